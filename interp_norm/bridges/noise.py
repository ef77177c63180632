"""Multiplicative norm noise on q, k, v of any described model, and collapse from clean scores.

The paper's noise model (digest §2.3): a vector x becomes (1+κ)·x, κ drawn per (example,
position, head). :class:`HeadNoise` puts it on either side of the attention norms that
:func:`~interp_norm.bridges.anatomy` found: ``"before_norm"`` on the projection's output (where
upstream interference arrives), ``"after_norm"`` on what the scores and values use. Grouped k/v
heads are noised once per *key/value* head, so every query head sharing it sees the same κ.

Why collapse needs no re-run: scaling q and k by per-vector factors f_q, f_k scales each score
q·k by f_q·f_k — RoPE rotates each vector by a position-dependent orthogonal map, which commutes
with a scalar factor — so the noised scores are the clean ones times f_q·f_k (:func:`argmax_changes`).
Before a norm, the factor that survives is :func:`effective_factors` (≈ 1 for a per-head norm,
*not* 1 for OLMo-2's all-heads norm, whose common divisor mixes the heads' factors).

:class:`interp_norm.noise.NormNoise` hands a bridge to :class:`HeadNoise`, so the README's
``with NormNoise(model, level=0.1): ...`` works on any described model.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Mapping, Optional, Sequence

import numpy as np
import torch
from torch import Tensor

from interp_norm.anatomy._common import canonical, from_canonical
from interp_norm.anatomy.describe import Anatomy, LayerAnatomy
from interp_norm.anatomy.model_anatomy import anatomy
from interp_norm import theory
from interp_norm.errors import ArchitectureError, NoiseSpecError
from interp_norm.theory import NoiseLaw

from interp_norm.defaults import PLACEMENTS  # noqa: E402
#: κ for (layer, target, shape [batch, pos, head], forward-pass count) -> Tensor of that shape.
Sampler = Callable[[int, str, tuple, int], Tensor]


def generator(*keys: int) -> torch.Generator:
    """A CPU generator seeded from non-negative ints (NumPy's SeedSequence mixing)."""
    state = np.random.SeedSequence([int(k) for k in keys]).generate_state(1, dtype=np.uint64)[0]
    return torch.Generator().manual_seed(int(state) & 0x7FFF_FFFF_FFFF_FFFF)


def seeded_sampler(level: float, seed: int = 0, distribution: str = "uniform") -> Sampler:
    """κ = level·z, z of unit RMS from :func:`interp_norm.theory.sample_kappa` (the one κ sampler),
    seeded per (layer, target, pass): the same seed gives proportional κ at every level."""
    law = NoiseLaw(level, distribution)  # validates level and distribution (NoiseSpecError)

    def draw(layer: int, target: str, shape: tuple, call: int) -> Tensor:
        g = generator(seed, layer, "qkv".index(target), call)
        return law.level * theory.sample_kappa(shape, g, law.distribution, 1.0, dtype=torch.float32)

    return draw


class HeadNoise:
    """Hooks multiplying q, k and/or v of chosen layers by (1+κ) per (example, position, head).

    ``kappa``: explicit κ per ``(layer, target)``, each [batch, pos, heads of that target] (k/v:
    key/value heads); or a ``sampler`` (default :func:`seeded_sampler` at ``level``, ``seed`` and
    ``distribution``, "uniform" or "normal").
    ``placement`` "before_norm" (the projection output) or "after_norm" (what attention uses;
    the same hook where the target has no norm). After a forward pass ``last_kappa`` holds the κ
    used. Use as ``model.run_with_hooks(tokens, fwd_hooks=noise.hooks())``.

    Gemma 4: a KV-sharing layer has no keys of its own, so with ``layers=None`` its k/v noise is
    the noise of its source layer (noised once); naming such a layer's k/v explicitly is an error.
    In a k = v layer, v before its norm *is* k's projection (k noise there reaches v too), so
    "before_norm" v noise is skipped with ``layers=None`` and refused when named. ``sites`` lists
    the (layer, target) pairs actually noised.
    """

    def __init__(
        self,
        model: Any,
        kappa: Optional[Mapping[tuple[int, str], Tensor]] = None,
        *,
        level: float = 0.0,
        targets: Sequence[str] = ("q", "k", "v"),
        placement: str = "before_norm",
        layers: Optional[Sequence[int]] = None,
        sampler: Optional[Sampler] = None,
        seed: int = 0,
        distribution: str = "uniform",
        anat: Optional[Anatomy] = None,
    ):
        self.model, self._ctx = model, None
        self.anat = anat or anatomy(model)
        if placement not in PLACEMENTS:
            raise NoiseSpecError(f"unknown placement {placement!r}; choose one of {PLACEMENTS}")
        bad = [t for t in targets if t not in ("q", "k", "v")]
        if bad or not targets:
            raise NoiseSpecError(f"targets must be among 'q', 'k', 'v', got {tuple(targets)!r}")
        n = self.anat.n_layers
        if kappa is not None:
            sites = sorted(kappa, key=lambda lt: (lt[0], "qkv".index(lt[1]) if lt[1] in ("q", "k", "v") else 3))
            explicit = True
        else:
            explicit = layers is not None
            layers = list(range(n)) if layers is None else list(layers)
            sites = [(l, t) for l in layers for t in ("q", "k", "v") if t in targets]
        self.sites: list[tuple[int, str]] = []
        for l, t in sites:
            if isinstance(l, bool) or not isinstance(l, int) or not 0 <= l < n or t not in ("q", "k", "v"):
                raise NoiseSpecError(f"noise site {(l, t)!r}: layer must lie in [0, {n}) and target be 'q', 'k' or 'v'")
            la = self.anat[l]
            if t != "q" and la.shares_kv:
                if explicit:
                    raise NoiseSpecError(
                        f"layer {l} reads the keys and values of layer {la.kv_layer} (KV sharing); noise {t} there, "
                        f"which changes both layers"
                    )
                continue  # all layers noised: the shared k/v is noised once, at its source layer
            if t == "v" and la.v_from_k and placement == "before_norm":
                if explicit:
                    raise NoiseSpecError(f"layer {l} has no v projection (v = v_norm(raw k)); noise before the norm on 'k' or after it on 'v'")
                continue  # before its norm, v is k's projection: k noise there already reaches v
            self.sites.append((l, t))
        self.placement = placement
        self.kappa = dict(kappa) if kappa is not None else None
        self.sampler = sampler or seeded_sampler(level, seed, distribution)
        self.last_kappa: dict[tuple[int, str], Tensor] = {}
        self._calls: dict[tuple[int, str], int] = {}

    def site(self, layer: int, target: str) -> tuple[str, str]:
        """(hook name, layout) where noise on ``target`` of ``layer`` lands."""
        la = self.anat[layer]
        key = target if self.placement == "before_norm" else la.used(target)
        return la.hooks[key], la.layouts.get(key, "bphd")

    def _kappa_for(self, layer: int, target: str, shape: tuple, like: Tensor) -> Tensor:
        if self.kappa is not None:
            k = self.kappa.get((layer, target))
            if k is None:
                return torch.zeros(shape, dtype=like.dtype, device=like.device)
            if tuple(k.shape) != shape:
                raise NoiseSpecError(f"kappa[{(layer, target)}] has shape {tuple(k.shape)}; this pass needs {shape} [batch, pos, heads]")
            return k.to(like.device, like.dtype)
        call = self._calls.get((layer, target), 0)
        self._calls[(layer, target)] = call + 1
        return self.sampler(layer, target, shape, call).to(like.device, like.dtype)

    def _hook(self, layer: int, target: str, layout: str) -> Callable:
        la = self.anat[layer]
        heads = la.n_heads_of(target)

        def hook(act: Tensor, hook: Any = None) -> Tensor:
            x = canonical(act, layout, heads, la.d_head)
            kappa = self._kappa_for(layer, target, tuple(x.shape[:3]), x)
            self.last_kappa[(layer, target)] = kappa
            return from_canonical(x * (1.0 + kappa)[..., None], layout).contiguous()

        return hook

    def hooks(self) -> list[tuple[str, Callable]]:
        out = []
        for l, t in self.sites:
            name, layout = self.site(l, t)
            out.append((name, self._hook(l, t, layout)))
        return out

    def __enter__(self) -> "HeadNoise":
        """``with HeadNoise(bridge, level=0.1): bridge(tokens)`` -- the hooks are removed on exit."""
        if self._ctx is not None:
            raise NoiseSpecError("this noise is already active; exit it before entering again")
        self._ctx = self.model.hooks(fwd_hooks=self.hooks())
        self._ctx.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        ctx, self._ctx = self._ctx, None
        ctx.__exit__(*exc)


def effective_factors(la: LayerAnatomy, target: str, kappa: Tensor, raw: Tensor) -> Tensor:
    """What (1+κ) applied *before* ``target``'s norm leaves on its output, per head (float64).

    ``raw`` is the clean projection output [b, p, h, d] (canonical), ``kappa`` [..., b, p, h]
    (leading draw dimensions allowed). With m the clean mean square (variance for LayerNorm):
    per-head norm f = (1+κ)·√(m+eps)/√((1+κ)²m+eps) (→ sign(1+κ) as eps → 0: removed);
    all-heads RMS norm f_h = (1+κ_h)·√(M+eps)/√(M'+eps), M = mean_h m_h, M' = mean_h (1+κ_h)² m_h.
    No norm: 1+κ.
    """
    one = 1.0 + kappa.to(torch.float64)
    norm = la.norms.get(target)
    if norm is None:
        return one
    x = raw.to(torch.float64)
    if norm.kind == "ln":
        if norm.axis == "all_heads":
            raise ArchitectureError("per-head noise before a LayerNorm over all heads is not a per-head factor (the mean mixes heads)")
        x = x - x.mean(-1, keepdim=True)
    m = x.pow(2).mean(-1)  # [b, p, h]
    if norm.axis == "per_head":
        f = one * (m + norm.eps).sqrt() / (one * one * m + norm.eps).sqrt()
    else:
        M = m.mean(-1, keepdim=True)
        M_noised = (one * one * m).mean(-1, keepdim=True)
        f = one * (M + norm.eps).sqrt() / (M_noised + norm.eps).sqrt()
    return f  # float64: f − 1 is often below float32 resolution


def collapse_factors(model: Any, cache: Any, layer: int, kappa_q: Tensor, kappa_k: Tensor,
                     placement: str = "before_norm", anat: Optional[Anatomy] = None) -> tuple[Tensor, Tensor]:
    """(f_q [..., b, p, n_heads], f_k [..., b, p, n_kv_heads]): the factors κ puts on the q and k
    the scores use, for noise at ``placement`` (raw projections read from ``cache``)."""
    la = (anat or anatomy(model))[layer]
    out = []
    for t, kappa in (("q", kappa_q), ("k", kappa_k)):
        if placement == "after_norm" or la.norms.get(t) is None:
            out.append(1.0 + kappa)
            continue
        raw = canonical(cache[la.hooks[t]], la.layouts.get(t, "bphd"), la.n_heads_of(t), la.d_head)
        out.append(effective_factors(la, t, kappa, raw))
    return out[0], out[1]


def argmax_changes(scores: Tensor, mask: Tensor, f_q: Tensor, f_k: Tensor, kv_head_of: Sequence[int],
                   max_elements: int = 1 << 24) -> Tensor:
    """Bool [draw, b, h, q]: whether each row's argmax moves when q and k are scaled per vector.

    ``scores`` [b, h, q, k] pre-mask and pre-softcap (a soft cap is monotone but does not
    commute with the factors); ``mask`` [q, k] allowed keys; ``f_q`` [draw, b, q, h];
    ``f_k`` [draw, b, k, h_kv], mapped to query heads by ``kv_head_of``. Noised scores are
    f_q·f_k·s (exact: RoPE commutes with scalar factors). Draws are processed in blocks of at most
    ``max_elements`` score entries, which bounds memory. First maximum wins, as ``torch.argmax``.
    """
    w = scores.to(torch.float64).masked_fill(~mask, 0.0)
    neg = torch.zeros_like(w).masked_fill(~mask, -math.inf)
    clean = scores.to(torch.float64).masked_fill(~mask, -math.inf).argmax(-1)  # [b, h, q]
    idx = torch.as_tensor(list(kv_head_of), dtype=torch.long)
    fq = f_q.to(torch.float64).permute(0, 1, 3, 2)  # [D, b, h, q]
    fk = f_k.to(torch.float64)[..., idx].permute(0, 1, 3, 2)  # [D, b, h, k]
    D = fq.shape[0]
    step = max(1, max_elements // max(1, w.numel()))
    out = torch.empty((D, *clean.shape), dtype=torch.bool)
    for d0 in range(0, D, step):
        noised = w * fq[d0 : d0 + step, ..., :, None] * fk[d0 : d0 + step, ..., None, :] + neg
        out[d0 : d0 + step] = noised.argmax(-1) != clean
    return out


__all__ = ["PLACEMENTS", "HeadNoise", "seeded_sampler", "effective_factors", "collapse_factors", "argmax_changes"]
