"""Model builders, and checks run on them, shared by several test files."""

from __future__ import annotations

import copy
import math
from typing import Callable, Optional, Sequence

import pandas as pd
import pytest
import torch

from interp_norm import HookedNormTransformer, ModelConfig
from interp_norm.core.task import BOS_ID, PAD_ID


def make_model(seed: int = 0, **kw) -> HookedNormTransformer:
    """A tiny model with every gain and bias moved away from its init, so gains are tested too."""
    model = HookedNormTransformer(ModelConfig.preset("tiny", seed=seed, **kw)).eval()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".w") or name.endswith(".b") or name.endswith("b_O"):
                p.add_(0.3 * torch.randn(p.shape, generator=g))
    return model


def sharpened_model(attn_norm: str = "pre", calibration: str = "none") -> HookedNormTransformer:
    """A tiny random model (seed 3) with sharpened attention (W_Q × 3, and the q norm's gain × 3 where
    there is one) so that many rows are sparse, for the noise and collapse tests; with
    ``calibration="paper"`` also a score factor ≠ 1, so code that re-derived scores from q·k/√d
    would fail. A new model each call: each test file keeps its own."""
    model = HookedNormTransformer(ModelConfig.preset("tiny", attn_norm=attn_norm, seed=3, calibration=calibration)).eval()
    with torch.no_grad():
        for block in model.blocks:
            block.attn.W_Q.mul_(3.0)
            if attn_norm in ("qk", "qkv"):
                block.attn.q_norm.w.mul_(3.0)
            if calibration == "paper":
                block.attn.calib_scores.factor.fill_(1.7)
    return model


def bridges_with_hf_copies(archs: Sequence[str], seed: int) -> dict:
    """arch -> (a tiny random TransformerBridge, an untouched deep copy of its Hugging Face model):
    the copy is the independent reference the bridge tests compare against."""
    from interp_norm.anatomy import bridge_from_hf, tiny_hf_model

    out = {}
    for arch in archs:
        hf = tiny_hf_model(arch, seed=seed)
        ref = copy.deepcopy(hf)
        out[arch] = (bridge_from_hf(hf, name=f"tiny-{arch}"), ref)
    return out


def differing_tokens(bridge, b: int = 3, n: int = 6) -> tuple[torch.Tensor, torch.Tensor]:
    """(clean, corrupted) token ids for ``bridge`` whose examples first differ at positions 1, 3, 2."""
    from interp_norm.anatomy import random_tokens

    clean = random_tokens(bridge, b, n, seed=4, low=3)
    corr = clean.clone()
    for i, at in enumerate([1, 3, 2][:b]):  # a different first difference per example
        corr[i, at] = (corr[i, at] + 7) % 120 + 3
    return clean, corr



def bridge_pairs(bridge, b: int, n: int, *, score_all: bool = False):
    """Clean/corrupted pairs for ``bridge`` (seed 6) whose examples first differ at positions 1, 3, 2; the
    score mask holds the last position (the metrics are the caller's; the mask only satisfies
    PatchingPairs), or every position with ``score_all``."""
    from interp_norm.anatomy import random_tokens
    from interp_norm.circuits import PatchingPairs

    clean = random_tokens(bridge, b, n, seed=6, low=3)
    corr = clean.clone()
    for i, at in enumerate([1, 3, 2][:b]):
        corr[i, at] = (corr[i, at] + 9) % 120 + 3
    mask = torch.ones_like(clean, dtype=torch.bool) if score_all else torch.zeros_like(clean, dtype=torch.bool)
    mask[:, -1] = True
    return PatchingPairs(clean, corr, score_mask=mask)

class ReadAt:
    """logit(5) - logit(6) at position ``at`` of a [b, n] batch, per example, declaring what it reads
    (``read_mask``: attribution re-runs and unembeds only there)."""

    supports_stacked = True

    def __init__(self, at: int, b: int, n: int):
        self.at = at
        self.read_mask = torch.zeros(b, n, dtype=torch.bool)
        self.read_mask[:, at] = True

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        return logits[:, self.at, 5] - logits[:, self.at, 6]


def _gpt2_attention(attn, x: torch.Tensor) -> torch.Tensor:
    b, n, d = x.shape
    H = attn.num_heads
    q, k, v = (t.view(b, n, H, d // H).transpose(1, 2) for t in attn.c_attn(x).split(d, dim=-1))
    s = (q @ k.transpose(-1, -2) / math.sqrt(d // H)).masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), -math.inf)
    return attn.c_proj((s.softmax(-1) @ v).transpose(1, 2).reshape(b, n, d))


def hand_forward(hf, arch: str, tokens: torch.Tensor, at: Optional[Callable] = None) -> torch.Tensor:
    """Logits of the Hugging Face model ``hf`` (GPT-2, Llama, Qwen3, OLMo-2) written out block by block:
    the independent reference for what a bridge's residual hooks hold. ``at(kind, layer, x)`` sees, and
    may replace, every ``resid_pre``, ``attn_out``, ``resid_mid``, ``mlp_out`` and ``resid_post``; the
    MLP reads, and the block carries on, the ``resid_mid`` it returns."""
    at = at or (lambda kind, l, x: x)
    b, n = tokens.shape
    if arch == "gpt2":
        t = hf.transformer
        h = t.wte(tokens) + t.wpe(torch.arange(n))
        for l, blk in enumerate(t.h):
            h = at("resid_pre", l, h)
            mid = at("resid_mid", l, h + at("attn_out", l, _gpt2_attention(blk.attn, blk.ln_1(h))))
            h = at("resid_post", l, mid + at("mlp_out", l, blk.mlp(blk.ln_2(mid))))
        return hf.lm_head(t.ln_f(h))
    m = hf.model
    h = m.embed_tokens(tokens)
    rope = m.rotary_emb(h, torch.arange(n).expand(b, n))
    mask = torch.zeros(n, n).masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), -math.inf).expand(b, 1, n, n)
    for l, blk in enumerate(m.layers):
        h = at("resid_pre", l, h)
        if arch == "olmo2":  # post-norm: the norms act on the updates
            a, _ = blk.self_attn(hidden_states=h, position_embeddings=rope, attention_mask=mask)
            mid = at("resid_mid", l, h + at("attn_out", l, blk.post_attention_layernorm(a)))
            h = at("resid_post", l, mid + at("mlp_out", l, blk.post_feedforward_layernorm(blk.mlp(mid))))
        else:
            a, _ = blk.self_attn(hidden_states=blk.input_layernorm(h), position_embeddings=rope, attention_mask=mask)
            mid = at("resid_mid", l, h + at("attn_out", l, a))
            h = at("resid_post", l, mid + at("mlp_out", l, blk.mlp(blk.post_attention_layernorm(mid))))
    return hf.lm_head(m.norm(h))


def check_read_matrices_reproduce_qkv(model: HookedNormTransformer, tokens: torch.Tensor) -> None:
    """hook_q/k/v = (resid_pre / scale) @ M for Pre-Norm, resid_pre @ M otherwise, per head."""
    from interp_norm import geometry as G

    _, cache = model.run_with_cache(tokens)
    for l in range(model.cfg.n_layers):
        x = cache[f"blocks.{l}.hook_resid_pre"].double()
        s = cache[f"blocks.{l}.ln1.hook_scale"].double() if model.cfg.attn_norm == "pre" else 1.0
        for (h, n), M in G.effective_read_matrices(model, l).items():
            got = (x / s) @ M
            assert torch.allclose(got, cache[f"blocks.{l}.attn.hook_{n}"][:, :, h].double(), atol=1e-4), (l, h, n)


def check_spheres_match_direct(model: HookedNormTransformer, tokens: torch.Tensor, pairs: bool = True) -> None:
    """The streamed all-layer orthogonal_spheres equals sphere_structure on each layer's decomposition
    (``pairs``: the pair table too), and its resid_norm_cv is the CV of |resid_pre| from the cache."""
    from interp_norm import geometry as G

    sph = G.orthogonal_spheres(model, tokens, center=False)
    _, cache = model.run_with_cache(tokens)
    mask = (tokens != PAD_ID) & (tokens != BOS_ID)
    for layer in range(model.cfg.n_layers + 1):
        direct = G.sphere_structure(G.residual_components(model, tokens, layer), mask)
        got = {k: v[v["layer"] == layer].drop(columns="layer").reset_index(drop=True) for k, v in sph.items()}
        pd.testing.assert_frame_equal(got["components"], direct["components"], rtol=1e-6)
        if pairs:
            pd.testing.assert_frame_equal(got["pairs"], direct["pairs"], rtol=1e-5, atol=1e-6)
        pd.testing.assert_frame_equal(got["scores"], direct["scores"], rtol=1e-5)
        if layer < model.cfg.n_layers:
            r = cache[f"blocks.{layer}.hook_resid_pre"][mask].double().norm(dim=-1)
            assert got["scores"]["resid_norm_cv"].iloc[0] == pytest.approx(float(r.std(unbiased=False) / r.mean()), rel=1e-5)


def layer1_change_from_doubled_embed(model: HookedNormTransformer, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The direct effect of ``ScaleComponent("hook_embed", 2.0)`` on layer 1, by a plain hooked run:
    |Δ hook_pattern| [b, h, q, k] of layer 1 when hook_embed is added once more to layer 1's input
    (layer 0 left clean), and the rows that count [b, q] (no padding, no BOS)."""
    _, cache = model.run_with_cache(tokens)
    emb = cache["hook_embed"]
    with model.hooks(fwd_hooks=[("blocks.1.hook_resid_pre", lambda x, hook: x + emb)]):
        _, patched = model.run_with_cache(tokens)
    d = (patched["blocks.1.attn.hook_pattern"] - cache["blocks.1.attn.hook_pattern"]).abs()
    return d, (tokens != PAD_ID) & (tokens != BOS_ID)


def run_cli(capsys, *argv):
    """``interp-norm ARGV`` in-process: (exit code, stdout, stderr); argparse's SystemExit is a code."""
    from interp_norm import cli

    try:
        code = cli.main([str(a) for a in argv])
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


def word_tokenizer(vocab_size: int):
    """A word-level fast tokenizer built offline from the shipped sample text's commonest words."""
    import collections
    import re

    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from interp_norm.anatomy import sample_text

    words = collections.Counter(re.findall(r"\w+|[^\w\s]", sample_text()))
    vocab = {"[UNK]": 0}
    for w, _ in words.most_common(vocab_size - 1):
        vocab[w] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]")


# ----------------------------------------------------------------------------- rounding tolerances
EPS32 = torch.finfo(torch.float32).eps


def forward_rtol(cfg) -> float:
    """Relative rounding bound between two float32 forwards of one model that differ only in the order
    of their sums (a batched and a whole forward, another CPU kernel: ``ATEN_CPU_CAPABILITY``).

    A sum of n products is exact up to n * eps relative to the sum of the |products| (Higham, *Accuracy
    and Stability of Numerical Algorithms*, 2002, eq. 3.5); each layer sums over d_model (q, k, v, MLP in,
    unembed), d_mlp (MLP out) and the n_ctx positions a pattern mixes; the layers' errors add up.
    A worst-case bound (observed differences are 10-100x smaller), yet far below any real disagreement.
    """
    return cfg.n_layers * (2 * cfg.d_model + (cfg.d_mlp or 0) + cfg.n_ctx) * EPS32


def assert_equal_up_to_rounding(actual: torch.Tensor, expected: torch.Tensor, rtol: float, msg=None) -> None:
    """``actual`` equals ``expected`` up to ``rtol`` relative to the tensor's scale (its largest |entry|):
    the bound of `forward_rtol` is on errors relative to the sizes summed, not to each entry."""
    scale = float(expected.abs().max()) if expected.numel() else 0.0
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=rtol * max(scale, 1e-30), msg=msg)
