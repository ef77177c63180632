"""Accuracy under noise for text models: agreement with the clean model's next-token prediction.

A text model has no addition task to score, so the metric is how much norm noise changes what the
model would say: per noise level, the fraction of positions whose top-1 next token is unchanged
(``agreement``) and the mean KL(clean ‖ noised) of the next-token distributions. Noise is
:class:`~interp_norm.noise.HeadNoise` on every layer at once (one forward pass per draw), so
unlike collapse this measures the whole model, errors compounding through the layers.
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import pandas as pd
import torch
from torch import Tensor
from tqdm.auto import tqdm

from interp_norm.anatomy.describe import Anatomy
from interp_norm.anatomy.model_anatomy import anatomy
from interp_norm.anatomy.stream import cache_before_unembed, unembed_input
from interp_norm.core.defaults import PLACEMENTS
from interp_norm.core.specs import with_overrides
from interp_norm.noise.head_noise import HeadNoise, seeded_sampler
from interp_norm.errors import ConfigError, NoiseSpecError
from interp_norm.theory import NoiseLaw


def _removed(anat: Anatomy, targets: Sequence[str], placement: str) -> bool:
    """Whether every noised vector passes through a per-head norm after the noise."""
    if placement != "before_norm":
        return False
    return all(la.norms.get(t) is not None and la.norms[t].axis == "per_head" for la in anat.layers for t in targets)


def _tokens(model: Any, tokens: Optional[Tensor], n_ctx: int, max_windows: Optional[int]) -> Tensor:
    if tokens is None:
        from interp_norm.anatomy.text import text_tokens

        return text_tokens(model, n_ctx=n_ctx, max_windows=max_windows)
    if not isinstance(tokens, Tensor) or tokens.ndim != 2 or tokens.is_floating_point() or tokens.shape[1] < 1:
        raise ConfigError("tokens must be an integer tensor [batch, pos] (e.g. interp_norm.anatomy.text_tokens(model))")
    return tokens


def _kl(clean: Tensor, out: Tensor, max_elements: int = 1 << 18) -> Tensor:
    """KL(clean ‖ noised) [b, p] from two logits tensors [b, p, vocab], in float64 (a KL near 0 is not
    rounding noise), a block of positions at a time: each position's value is the one the whole
    tensor gives (softmax and sum run over the vocabulary alone), without [b, p, vocab] float64 copies.
    A block holds about ``max_elements`` numbers (2 MB of float64 each: five are alive at once), and at
    least two rows, so the sums are never split across threads (one row would be)."""
    b, p, v = clean.shape
    kl = torch.empty(b, p, dtype=torch.float64, device=clean.device)
    step = max(1, max_elements // max(1, b * v), 2 if b == 1 else 1)
    for p0 in range(0, p, step):
        logp = clean[:, p0:p0 + step].double().log_softmax(-1)
        kl[:, p0:p0 + step] = (logp.exp() * (logp - out[:, p0:p0 + step].double().log_softmax(-1))).sum(-1)
    return kl


@dataclass(frozen=True)
class TextAgreementSpec:
    """The options of :func:`text_agreement`: noise as :class:`~interp_norm.noise.HeadNoise` (``targets``,
    ``placement``, ``distribution``, ``layers``) with ``draws`` independent passes per level (the same unit
    draws at every level, from ``seed``), ``batch_size`` sequences per pass; ``n_ctx``/``max_windows`` cut the
    default text; ``logit_positions`` positions per block of logits (None: full logits; see
    :func:`text_agreement`)."""

    targets: Sequence[str] = ("q", "k", "v")
    placement: str = "before_norm"
    distribution: str = "uniform"
    layers: Optional[Sequence[int]] = None
    draws: int = 1
    batch_size: int = 8
    n_ctx: int = 64
    max_windows: Optional[int] = 16
    seed: int = 0
    logit_positions: Optional[int] = 16


@torch.no_grad()
def text_agreement(
    model: Any, tokens: Optional[Tensor] = None, levels: Sequence[float] = (0.0, 0.05, 0.1, 0.2),
    spec: Optional[TextAgreementSpec] = None, *, progress: bool = False, **overrides: Any,
) -> pd.DataFrame:
    """Top-1 agreement with the clean model and KL(clean ‖ noised), per noise level.

    ``tokens`` [batch, pos] (default: the shipped sample text through the model's tokenizer,
    :func:`~interp_norm.anatomy.text_tokens` with ``n_ctx``/``max_windows``); options:
    :class:`TextAgreementSpec` (``spec`` and/or its fields as keywords; an unknown one: NoiseSpecError).
    Level 0 multiplies by exactly 1, so it is bit-identical to the clean model (agreement 1, KL 0).

    Memory: the forwards end where the unembedding starts, and the clean and noised logits are made
    a block of ``logit_positions`` positions at a time from the two final residuals (the model's own
    ``unembed``), so the memory beyond the weights is two blocks of logits, not two [batch, pos, vocab]
    tensors (151 936 wide for Qwen3). This is used only where it gives the model's own logits for those
    positions bit for bit, checked once per batch shape: the model's own forward asked for the logits of
    the last ``logit_positions`` positions only (Hugging Face's ``logits_to_keep``: its code unembeds that
    slice of positions and applies whatever follows, such as Gemma's logit soft-cap) must equal the
    unembedded final residuals there (``torch.equal``); where it does not (a soft-cap) the full logits are
    used. What the check does not prove: that a block's logits equal a whole-window forward's to the last
    bit, as a matrix product's rounding can depend on its number of rows (on this CPU, Qwen3-0.6B's
    unembedding in bfloat16 gives other last bits for blocks below 64 positions than for 256; in float32
    blocks of 16 and the whole window agree). So the logits are those of the model's own code for blocks
    of positions, not necessarily those of one full forward; a forward without ``logits_to_keep`` is
    checked against its full logits instead (the smallest of ``logit_positions``, twice, four times as
    many ... positions per block that equals them on every block, else full logits). ``None``: always
    full logits.

    One row per level. Columns: ``level``, ``targets``, ``placement``, ``distribution``,
    ``n_tokens`` (positions scored per draw), ``draws``, ``agreement`` (fraction of (position, draw)
    whose noised argmax equals the clean one), ``agreement_se`` (binomial, over positions·draws),
    ``kl`` (mean KL(clean ‖ noised) in nats), ``kl_se`` (std / √count), ``removed_by_norm`` (every
    noised vector meets a per-head norm after the noise, where the theory says nothing changes).
    """
    sp = with_overrides(TextAgreementSpec, spec, overrides, who="text_agreement", error=NoiseSpecError)
    anat = anatomy(model)
    tokens = _tokens(model, tokens, sp.n_ctx, sp.max_windows)
    targets = _check_options(sp)
    levels = [NoiseLaw(lv, sp.distribution).level for lv in ((levels,) if isinstance(levels, (int, float)) else levels)]
    device = getattr(model.cfg, "device", None) or "cpu"
    batches = [tokens[i : i + sp.batch_size].to(device) for i in range(0, len(tokens), sp.batch_size)]
    removed = _removed(anat, targets, sp.placement)
    # one HeadNoise per level, all with the same seed: pass n draws the same unit κ at every level
    noises = [HeadNoise(model, targets=targets, placement=sp.placement, layers=sp.layers, anat=anat,
                        sampler=seeded_sampler(level, sp.seed, sp.distribution)) for level in levels]
    sums = torch.zeros(len(levels), 4, dtype=torch.float64)  # same, kl, kl², count
    stop = unembed_input(model) if sp.logit_positions is not None else None
    exact: dict[tuple, Optional[int]] = {}  # batch shape -> positions per block that give the model's logits
    for t in tqdm(batches, desc="agreement", disable=not progress):  # batches outer: one clean batch in memory
        x_clean = cache_before_unembed(model, t, {stop}).get(stop) if stop else None
        if x_clean is not None and tuple(t.shape) not in exact:
            exact[tuple(t.shape)] = _exact_block(model, t, x_clean, sp.logit_positions)
        block = exact.get(tuple(t.shape))
        if x_clean is None or block is None:
            del x_clean
            _full_logits(model, t, noises, sp.draws, sums)
            continue
        _blocked_logits(model, t, x_clean, stop, block, noises, draws=sp.draws, sums=sums)
    rows = []
    for level, (same, kl_sum, kl_sq, count) in zip(levels, sums.tolist()):
        agreement = same / count
        kl_mean = kl_sum / count
        kl_var = max(0.0, kl_sq / count - kl_mean**2)
        rows.append(dict(level=level, targets="".join(targets), placement=sp.placement, distribution=sp.distribution,
                         n_tokens=int(tokens.numel()), draws=sp.draws, agreement=agreement,
                         agreement_se=math.sqrt(agreement * (1 - agreement) / count), kl=kl_mean,
                         kl_se=math.sqrt(kl_var / count), removed_by_norm=removed))
    return pd.DataFrame(rows)


def _check_options(sp: TextAgreementSpec) -> tuple[str, ...]:
    """The targets as a tuple, every option checked (NoiseSpecError naming it)."""
    targets = (sp.targets,) if isinstance(sp.targets, str) else tuple(sp.targets)
    if not targets or any(t not in ("q", "k", "v") for t in targets):
        raise NoiseSpecError(f"targets must be among 'q', 'k', 'v', got {targets!r}")
    if sp.placement not in PLACEMENTS:
        raise NoiseSpecError(f"unknown placement {sp.placement!r}; choose one of {PLACEMENTS}")
    sizes: list[tuple[str, Any]] = [("draws", sp.draws), ("batch_size", sp.batch_size)]
    if sp.logit_positions is not None:
        sizes.append(("logit_positions", sp.logit_positions))
    for name, v in sizes:
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise NoiseSpecError(f"{name} must be a positive integer, got {v!r}")
    return targets


def _blocked_logits(model: Any, t: Tensor, x_clean: Tensor, stop: str, block: int, noises: list, *, draws: int,
                    sums: Tensor) -> None:
    """Agreement and KL of one batch, the logits made ``block`` positions at a time from the final residuals
    (clean ``x_clean``; noised: each noise's pass stopped at ``stop``), added to ``sums``."""
    blocks = [slice(p0, p0 + block) for p0 in range(0, t.shape[1], block)]
    for i, noise in enumerate(noises):
        for _ in range(draws):
            with model.hooks(fwd_hooks=noise.hooks()):
                x_out = cache_before_unembed(model, t, {stop})[stop]
            same = 0
            kl = torch.empty(t.shape, dtype=torch.float64, device=x_out.device)  # [b, p]
            for sl in blocks:  # the clean block is made again for every pass: memory over time
                clean, out = model.unembed(x_clean[:, sl]), model.unembed(x_out[:, sl])
                same += int((out.argmax(-1) == clean.argmax(-1)).sum())
                kl[:, sl] = _kl(clean, out)
                del clean, out
            sums[i] += torch.tensor([float(same), float(kl.sum()), float(kl.pow(2).sum()), kl.numel()],
                                    dtype=torch.float64)


def _exact_block(model: Any, t: Tensor, x_clean: Tensor, start: int) -> Optional[int]:
    """Positions per block whose unembedding of ``x_clean`` gives the model's own logits of ``t`` bit for bit,
    or None (use full logits).

    With ``logits_to_keep`` (every Hugging Face ``*ForCausalLM`` of transformers >= 4.50), the model's own
    forward makes the logits of the last ``start`` positions only, and ``start`` is returned if they equal
    ``model.unembed`` of ``x_clean`` there: no [batch, pos, vocab] tensor is made (77 MB for one window of
    256 tokens of Qwen3-0.6B in bfloat16). It proves that the residuals and the unembedding reproduce the
    model's own code for a block of positions, not that a block's rounding is a whole window's (see
    :func:`text_agreement`). Without it: the smallest of ``start``, 2·``start``, 4·``start`` ... (below the
    window length) whose blocks all equal one full forward's logits."""
    p = t.shape[1]
    if _keeps_logits(model):
        n = min(start, p)
        ref = model(t, use_cache=False, logits_to_keep=n)
        return start if ref.shape[1] == n and torch.equal(model.unembed(x_clean[:, p - n:]), ref) else None
    full = model(t, use_cache=False)
    block = start
    while block < p:
        if all(torch.equal(model.unembed(x_clean[:, p0:p0 + block]), full[:, p0:p0 + block])
               for p0 in range(0, p, block)):
            return block
        block *= 2
    return None


def _keeps_logits(model: Any) -> bool:
    """Whether the Hugging Face model under a bridge takes ``logits_to_keep`` (the logits of the last n positions only)."""
    hf = getattr(model, "original_model", None)
    try:
        return hf is not None and "logits_to_keep" in inspect.signature(hf.forward).parameters
    except (TypeError, ValueError):  # no signature to read
        return False


def _full_logits(model: Any, t: Tensor, noises: list, draws: int, sums: Tensor) -> None:
    """Agreement and KL of one batch from full logits tensors (``use_cache=False``: no key/value cache of
    every layer, same logits); clean kept in the model's dtype, float64 only a block of positions at a time."""
    clean = model(t, use_cache=False)
    top = clean.argmax(-1)
    for i, noise in enumerate(noises):
        for _ in range(draws):
            out = model.run_with_hooks(t, fwd_hooks=noise.hooks(), use_cache=False)
            kl = _kl(clean, out)  # [b, p]
            sums[i] += torch.tensor([float((out.argmax(-1) == top).sum()), float(kl.sum()),
                                     float(kl.pow(2).sum()), kl.numel()], dtype=torch.float64)
            del out


__all__ = ["TextAgreementSpec", "text_agreement"]
