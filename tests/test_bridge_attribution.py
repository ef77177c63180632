"""Node EAP / EAP-IG batched over pairs on TransformerBridges equals TransformerLens 4.3's own
attribution code per pair; edge EAP equals TransformerLens's edge ``attribution_patch`` where
TransformerLens allows it (it refuses grouped k/v heads and post-norms; ours scores those).

References: ``transformer_lens.tools.analysis.attribution_patching.attribution_patch`` run on one
pair at a time (EAP, node and edge granularity), and for EAP-IG -- which TransformerLens 4.3 does
not implement -- its ``cache_activation_and_gradient`` at each integration point with the token
embedding moved along the corrupted -> clean line by a hook, the gradients averaged by hand.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch
from transformer_lens.tools.analysis.attribution_patching import (
    EdgeAttributionConfig,
    Node,
    cache_activation_and_gradient,
)
from transformer_lens.tools.analysis.attribution_patching import attribution_patch as tl_attribution_patch

from _models import ReadAt, bridge_pairs
from interp_norm.anatomy import random_tokens, tiny_bridge
from interp_norm.circuits import PatchingPairs, edge_attribution, node_attribution
from interp_norm.core.hook_names import act_name

B, N = 3, 7


def read_at(at: int) -> ReadAt:
    """logit(5) - logit(6) at position ``at`` of this module's [B, N] batches."""
    return ReadAt(at, B, N)


def plain(logits: torch.Tensor) -> torch.Tensor:
    """A plain function (no read positions declared): every position is unembedded."""
    return logits[:, -1, 5] - logits[:, -1, 6]


@pytest.fixture(scope="module")
def bridges():
    return {"gpt2": tiny_bridge("gpt2", seed=5, n_layers=3), "llama": tiny_bridge("llama", seed=5, n_layers=3),
            "qwen3": tiny_bridge("qwen3", seed=5, n_layers=3), "llama-mha": tiny_bridge("llama", seed=5, n_layers=2, n_kv_heads=4),
            "olmo2": tiny_bridge("olmo2", seed=5, n_layers=2), "gemma4-mha": tiny_bridge("gemma4", seed=5, n_kv_heads=4)}


def _tl_metric(metric):
    at = metric.at if isinstance(metric, ReadAt) else -1
    return lambda lg: lg[0, at, 5] - lg[0, at, 6]


def _ours_per_pair(res: dict, L: int, H: int) -> tuple[torch.Tensor, torch.Tensor]:
    z = (res["z"].per_example - res["z"].baseline).view(L, N, H, B)
    mlp = (res["mlp_out"].per_example - res["mlp_out"].baseline).view(L, N, B)
    return z, mlp


@pytest.mark.parametrize("arch", ["gpt2", "llama", "qwen3"])
def test_node_eap_equals_transformer_lens_per_pair(bridges, arch):
    bridge = bridges[arch]
    pairs = bridge_pairs(bridge, B, N)
    L, H = bridge.cfg.n_layers, bridge.cfg.n_heads
    for metric in (read_at(N - 1), read_at(4), plain):
        res = node_attribution(bridge, pairs, metric, ("z", "mlp_out"), ig_steps=1)
        z, mlp = _ours_per_pair(res, L, H)
        for i in range(B):
            ref = tl_attribution_patch(bridge, pairs.clean_tokens[i : i + 1], pairs.corrupted_tokens[i : i + 1],
                                       _tl_metric(metric)).node_scores
            tz = torch.tensor([[[ref[Node("attn_head_out", p, l, h)] for h in range(H)] for p in range(N)] for l in range(L)])
            tm = torch.tensor([[ref[Node("mlp_out", p, l)] for p in range(N)] for l in range(L)])
            assert (z[..., i] - tz).abs().max() <= 1e-5
            assert (mlp[..., i] - tm).abs().max() <= 1e-5
            assert tz.abs().max() > 1e-3 and tm.abs().max() > 1e-3  # the check compares something
        if isinstance(metric, ReadAt) and metric.at < N - 1:  # positions after the read one score 0 on both sides
            assert z[:, metric.at + 1 :].abs().max() == 0


def _tl_eap_ig(bridge, clean: torch.Tensor, corr: torch.Tensor, metric_fn, steps: int) -> dict:
    """EAP-IG of one pair from TransformerLens's gradient cache, one pass per integration point."""
    names = [f"blocks.{l}.attn.hook_z" for l in range(bridge.cfg.n_layers)] + \
            [f"blocks.{l}.hook_mlp_out" for l in range(bridge.cfg.n_layers)]
    with torch.no_grad():
        _, cc = bridge.run_with_cache(clean, names_filter=lambda nm: nm in names + ["hook_embed"])
        _, xc = bridge.run_with_cache(corr, names_filter=lambda nm: nm == "hook_embed")
    total = {nm: torch.zeros_like(cc[nm], dtype=torch.float64) for nm in names}
    for k in range(steps):
        alpha = k / steps
        mix = xc["hook_embed"] + alpha * (cc["hook_embed"] - xc["hook_embed"])
        with bridge.hooks(fwd_hooks=[("hook_embed", lambda x, hook: x + (mix - x).detach())]):
            # hook_embed cached too, as attribution_patch does: the first z hook's gradient comes from below it
            gc = cache_activation_and_gradient(bridge, corr, metric_fn, names_filter=["hook_embed"] + names)
        for nm in names:
            total[nm] += gc.gradients[nm].double()
    with torch.no_grad():
        _, xa = bridge.run_with_cache(corr, names_filter=lambda nm: nm in names)
    return {nm: ((cc[nm].double() - xa[nm].double()) * total[nm] / steps).sum(-1)[0] for nm in names}


@pytest.mark.parametrize("arch", ["gpt2", "qwen3"])
def test_node_eap_ig_equals_transformer_lens_gradients_per_pair(bridges, arch):
    bridge = bridges[arch]
    pairs = bridge_pairs(bridge, B, N)
    L, H = bridge.cfg.n_layers, bridge.cfg.n_heads
    metric = read_at(N - 1)
    res = node_attribution(bridge, pairs, metric, ("z", "mlp_out"), ig_steps=3, batch_size=2 * B)  # two passes
    assert res["z"].method == "eap-ig3"
    z, mlp = _ours_per_pair(res, L, H)
    for i in range(B):
        ref = _tl_eap_ig(bridge, pairs.clean_tokens[i : i + 1], pairs.corrupted_tokens[i : i + 1], _tl_metric(metric), 3)
        tz = torch.stack([ref[f"blocks.{l}.attn.hook_z"] for l in range(L)])  # [L, pos, head]
        tm = torch.stack([ref[f"blocks.{l}.hook_mlp_out"] for l in range(L)])
        assert (z[..., i].double() - tz).abs().max() <= 1e-5 and (mlp[..., i].double() - tm).abs().max() <= 1e-5
        assert tz.abs().max() > 1e-3


@pytest.mark.parametrize("arch", ["gpt2", "llama-mha"])
def test_edge_eap_equals_transformer_lens_edges(bridges, arch):
    """TransformerLens scores each edge at each position; ours sums a (sender, receiver) pair over positions."""
    bridge = bridges[arch]
    pairs = bridge_pairs(bridge, B, N)
    ours = edge_attribution(bridge, pairs, plain).set_index(["sender", "receiver"])["score"]
    ref = tl_attribution_patch(bridge, pairs.clean_tokens, pairs.corrupted_tokens, _tl_metric(plain),
                               EdgeAttributionConfig(granularity="edge")).edge_scores

    def name(node: Node, reader: bool) -> str:
        if node.kind == "embed":
            return "embed"
        if node.kind == "logits":
            return "logits"
        if node.kind in ("mlp_out", "mlp_in"):
            return f"m{node.layer}"
        head = f"a{node.layer}.h{node.head}"
        return f"{head}.{node.kind[0]}" if reader else head

    summed: dict = {}
    for (w, r), v in ref.items():
        key = (name(w, False), name(r, True))
        summed[key] = summed.get(key, 0.0) + v
    assert set(summed) == set(ours.index)
    diff = max(abs(summed[k] - ours[k]) for k in summed)
    assert diff <= 1e-5 and max(abs(v) for v in summed.values()) > 1e-3


def test_transformer_lens_refuses_edges_where_ours_has_them(bridges):
    """TransformerLens's edge attribution refuses post-norm and grouped-k/v models (ValueError), Gemma 4
    even with ungrouped heads; ours scores them (checked in tests/test_bridge_edges_grouped.py,
    tests/test_bridge_edges_post_norm.py and tests/test_bridge_edges_gemma4.py)."""
    for arch in ("olmo2", "llama", "gemma4-mha"):
        bridge = bridges[arch]
        pairs = bridge_pairs(bridge, B, N)
        assert len(edge_attribution(bridge, pairs, plain)) > 0
        with pytest.raises(ValueError):
            tl_attribution_patch(bridge, pairs.clean_tokens, pairs.corrupted_tokens, _tl_metric(plain),
                                 EdgeAttributionConfig(granularity="edge"))


# --------------------------------------------------------------- the re-run from the shared prefix


class ReadAtMany:
    """logit(5) - logit(6), averaged over positions ``at`` (declared), per example."""

    supports_stacked = True

    def __init__(self, at: list, n: int = N):
        self.at = list(at)
        self.read_mask = torch.zeros(B, n, dtype=torch.bool)
        self.read_mask[:, self.at] = True

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        return (logits[:, self.at, 5] - logits[:, self.at, 6]).mean(-1)


def _pairs_from(bridge, at: list, n: int = N) -> PatchingPairs:
    """Pairs whose corrupted token ``i`` differs at position ``at[i]`` only (the shared prefix ends at min(at))."""
    clean = random_tokens(bridge, B, n, seed=8, low=3)
    corr = clean.clone()
    for i, p in enumerate(at):
        corr[i, p] = (corr[i, p] + 11) % 120 + 3
    mask = torch.zeros_like(clean, dtype=torch.bool)
    mask[:, -1] = True
    return PatchingPairs(clean, corr, score_mask=mask)


def _tl_scores(bridge, pairs: PatchingPairs, fn, i: int) -> tuple[torch.Tensor, torch.Tensor]:
    """TransformerLens 4.3's attribution_patch on pair ``i``: [L, pos, head] and [L, pos] node scores."""
    L, H, n = bridge.cfg.n_layers, bridge.cfg.n_heads, pairs.n_pos
    ref = tl_attribution_patch(bridge, pairs.clean_tokens[i : i + 1], pairs.corrupted_tokens[i : i + 1], fn).node_scores
    tz = torch.tensor([[[ref[Node("attn_head_out", p, l, h)] for h in range(H)] for p in range(n)] for l in range(L)])
    tm = torch.tensor([[ref[Node("mlp_out", p, l)] for p in range(n)] for l in range(L)])
    return tz, tm


def _assert_tl_per_pair(bridge, pairs: PatchingPairs, z: torch.Tensor, mlp: torch.Tensor) -> None:
    """Each pair's z and mlp_out scores (metric: the logit difference at the last position) equal
    TransformerLens's within 1e-5, and its head scores carry signal (the check compares something)."""
    for i in range(B):
        tz, tm = _tl_scores(bridge, pairs, _tl_metric(read_at(N - 1)), i)
        assert (z[..., i] - tz).abs().max() <= 1e-5 and (mlp[..., i] - tm).abs().max() <= 1e-5
        assert tz.abs().max() > 1e-3


@pytest.mark.parametrize("arch", ["gpt2", "llama", "qwen3", "olmo2"])
def test_rerun_from_the_shared_prefix_equals_transformer_lens_per_pair(bridges, arch, replays):
    """Pairs corrupted at positions 3, 5, 4 (shared prefix 0..2); metrics reading the last position,
    a middle one, one inside the shared prefix together with a later one, and every position (no
    read_mask): each pair's scores equal TransformerLens's, from the re-run path."""
    bridge = bridges[arch]
    pairs = _pairs_from(bridge, [3, 5, 4])
    L, H = bridge.cfg.n_layers, bridge.cfg.n_heads
    metrics = [(read_at(N - 1), _tl_metric(read_at(N - 1))), (read_at(5), _tl_metric(read_at(5))),
               (ReadAtMany([1, N - 1]), lambda lg: (lg[0, [1, N - 1], 5] - lg[0, [1, N - 1], 6]).mean()),
               (plain, _tl_metric(plain))]
    for metric, fn in metrics:
        res = node_attribution(bridge, pairs, metric, ("z", "mlp_out"))
        z, mlp = _ours_per_pair(res, L, H)
        for i in range(B):
            tz, tm = _tl_scores(bridge, pairs, fn, i)
            assert (z[..., i] - tz).abs().max() <= 1e-5 and (mlp[..., i] - tm).abs().max() <= 1e-5
            assert tz.abs().max() > 1e-3 and tm.abs().max() > 1e-3
        assert z[:, :3].abs().max() == 0 and mlp[:, :3].abs().max() == 0  # the shared prefix
        # the baseline and clean values are the metric on the corrupted and clean runs
        with torch.no_grad():
            assert torch.allclose(res["z"].baseline.float(), metric(bridge(pairs.corrupted_tokens)), atol=1e-4)
            assert torch.allclose(res["z"].clean.float(), metric(bridge(pairs.clean_tokens)), atol=1e-4)
    assert replays == [True] * len(metrics)


@pytest.mark.parametrize("arch", ["llama", "olmo2"])
def test_rerun_eap_ig_in_chunks_equals_transformer_lens_gradients(bridges, arch, replays):
    """EAP-IG through the re-run path, 3 integration points in passes of 2 and 1."""
    bridge = bridges[arch]
    pairs = _pairs_from(bridge, [2, 4, 3])
    L, H = bridge.cfg.n_layers, bridge.cfg.n_heads
    metric = read_at(N - 1)
    res = node_attribution(bridge, pairs, metric, ("z", "mlp_out"), ig_steps=3, batch_size=2 * B)
    z, mlp = _ours_per_pair(res, L, H)
    for i in range(B):
        ref = _tl_eap_ig(bridge, pairs.clean_tokens[i : i + 1], pairs.corrupted_tokens[i : i + 1], _tl_metric(metric), 3)
        tz = torch.stack([ref[f"blocks.{l}.attn.hook_z"] for l in range(L)])
        tm = torch.stack([ref[f"blocks.{l}.hook_mlp_out"] for l in range(L)])
        assert (z[..., i].double() - tz).abs().max() <= 1e-5 and (mlp[..., i].double() - tm).abs().max() <= 1e-5
        assert tz.abs().max() > 1e-3
    assert replays == [True]


def test_other_per_position_activations_and_by_all_through_the_rerun(bridges, replays):
    """resid_pre / attn_out / resid_post by position and z by head (summed over positions) equal the
    full passes (no hook on the model vs a no-op hook on it, which keeps the full passes)."""
    bridge = bridges["qwen3"]
    pairs = _pairs_from(bridge, [2, 4, 3])
    metric = read_at(4)
    acts = ("resid_pre", "attn_out", "resid_post")
    fast = node_attribution(bridge, pairs, metric, acts)
    fast_all = node_attribution(bridge, pairs, metric, ("z",), by="all")
    with bridge.hooks(fwd_hooks=[("blocks.0.hook_resid_pre", lambda act, hook: act)]):
        full = node_attribution(bridge, pairs, metric, acts)
        full_all = node_attribution(bridge, pairs, metric, ("z",), by="all")
    assert replays == [True, True]  # the hooked calls did not try the re-run
    for a in acts:
        assert (fast[a].per_example - full[a].per_example).abs().max() <= 1e-5
        assert (fast[a].per_example - fast[a].baseline).abs().max() > 1e-3
    assert (fast_all["z"].per_example - full_all["z"].per_example).abs().max() <= 1e-5


def _gemma4_without_per_layer_inputs(shared: bool):
    """Tiny Gemma 4 with no per-layer-input branch (as the 31B has none); ``shared``: with KV sharing."""
    import transformers as tf

    from interp_norm.anatomy import bridge_from_hf, tiny_config
    from interp_norm.anatomy.build import _reinit

    cfg = tiny_config("gemma4-shared" if shared else "gemma4", n_layers=4 if shared else 2)
    cfg.hidden_size_per_layer_input = 0
    cfg._attn_implementation = "eager"
    torch.manual_seed(5)
    hf = tf.Gemma4ForCausalLM(cfg)
    _reinit(hf, 5)
    return bridge_from_hf(hf.eval())


@pytest.mark.parametrize("shared", [False, True])
def test_gemma4_takes_the_re_run_and_equals_transformer_lens(shared, replays):
    """Gemma 4 without per-layer inputs (sliding windows; KV-sharing layers, k = v layers) takes the
    re-run, and its scores are TransformerLens's."""
    bridge = _gemma4_without_per_layer_inputs(shared)
    pairs = _pairs_from(bridge, [2, 4, 3])
    L, H = bridge.cfg.n_layers, bridge.cfg.n_heads
    res = node_attribution(bridge, pairs, read_at(N - 1), ("z", "mlp_out"))
    assert replays == [True]
    z, mlp = _ours_per_pair(res, L, H)
    _assert_tl_per_pair(bridge, pairs, z, mlp)


@pytest.mark.parametrize("arch", ["gemma4", "gemma4-shared"])
@pytest.mark.parametrize("ig_steps", [1, 3])
def test_gemma4_with_per_layer_inputs_takes_the_re_run(arch, ig_steps, replays):
    """Per-layer inputs are made from the tokens and the embedding the integration path moves: the
    re-run makes each row's own. EAP equals TransformerLens's; EAP-IG equals the full passes."""
    bridge = tiny_bridge(arch, seed=5, **({"n_layers": 2} if arch == "gemma4" else {}))
    pairs = _pairs_from(bridge, [2, 4, 3])
    L, H = bridge.cfg.n_layers, bridge.cfg.n_heads
    res = node_attribution(bridge, pairs, read_at(N - 1), ("z", "mlp_out"), ig_steps=ig_steps)
    assert replays == [True]
    z, mlp = _ours_per_pair(res, L, H)
    if ig_steps == 1:
        _assert_tl_per_pair(bridge, pairs, z, mlp)
        return
    with bridge.hooks(fwd_hooks=[(act_name("resid_pre", 0), lambda act, hook: act)]):  # a hook: full passes
        full = node_attribution(bridge, pairs, read_at(N - 1), ("z", "mlp_out"), ig_steps=ig_steps)
    assert replays == [True]
    fz, fm = _ours_per_pair(full, L, H)
    assert (z - fz).abs().max() <= 1e-5 and (mlp - fm).abs().max() <= 1e-5 and fz.abs().max() > 1e-3


def test_a_bridge_whose_blocks_ignore_the_cache_falls_back(replays, monkeypatch):
    """An attention that ignores the key/value cache it is given (Gemma 4's without per-layer inputs, made to drop it): the
    re-run is refused and the full passes give TransformerLens's scores."""
    bridge = _gemma4_without_per_layer_inputs(False)
    attn_cls = type(bridge.blocks[0].original_component.self_attn)
    forward = attn_cls.forward
    monkeypatch.setattr(attn_cls, "forward", lambda self, *a, **kw: forward(self, *a, **{**kw, "cache": None}))
    pairs = _pairs_from(bridge, [2, 4, 3])
    L, H = bridge.cfg.n_layers, bridge.cfg.n_heads
    res = node_attribution(bridge, pairs, read_at(N - 1), ("z", "mlp_out"))
    assert replays == [False]
    z, mlp = _ours_per_pair(res, L, H)
    _assert_tl_per_pair(bridge, pairs, z, mlp)


def test_the_wiring_check_runs_once_per_weights_and_a_failed_check_falls_back(monkeypatch, replays):
    from interp_norm.circuits import attribution_replay
    from interp_norm.errors import EngineRefusal

    bridge = tiny_bridge("llama", seed=9, n_layers=2)
    pairs = _pairs_from(bridge, [2, 4, 3])
    checks: list = []
    real = attribution_replay._check
    monkeypatch.setattr(attribution_replay, "_check", lambda *a, **kw: checks.append(1) or real(*a, **kw))
    first = node_attribution(bridge, pairs, read_at(N - 1), ("z",))
    node_attribution(bridge, pairs, read_at(N - 1), ("z",))
    assert len(checks) == 1  # the same weights: checked once
    with torch.no_grad():
        bridge.blocks[0].mlp.out.weight.mul_(1.0)  # an in-place write: checked again
    node_attribution(bridge, pairs, read_at(N - 1), ("z",))
    assert len(checks) == 2

    def refuse(*a, **kw):
        raise EngineRefusal("wired otherwise")

    monkeypatch.setattr(attribution_replay, "_check", refuse)
    with torch.no_grad():
        bridge.blocks[0].mlp.out.weight.mul_(1.0)
    again = node_attribution(bridge, pairs, read_at(N - 1), ("z",))
    assert replays == [True, True, True, False]
    assert (again["z"].per_example - first["z"].per_example).abs().max() <= 1e-6
