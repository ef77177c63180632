"""Multiplicative norm noise on q, k, v of any described model: the per-head core of :class:`NormNoise`.

The paper's noise model (Menary et al. 2024, §2.3): a vector x becomes (1+κ)·x, κ drawn per
(example, position, head). :class:`HeadNoise` puts it on either side of the attention norms that
:func:`~interp_norm.anatomy.anatomy` found -- ours or a TransformerLens bridge's, asked the same
way: ``"before_norm"`` on the projection's output (where upstream interference arrives),
``"after_norm"`` on what the scores and values use. Grouped k/v heads are noised once per
*key/value* head, so every query head sharing it sees the same κ.

:class:`interp_norm.noise.NormNoise` is this class with the options only our models support
(``scale``, ``row_gate``, ``shared``, ``direction``, ``heads``); its κ streams are the same
(:func:`~interp_norm.noise.kernels.pass_noise`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional, Sequence

import torch
from torch import Tensor

from interp_norm.anatomy import Anatomy, anatomy, canonical, from_canonical
from interp_norm.core.specs import with_overrides
from interp_norm.errors import NoiseSpecError
from interp_norm.noise import _validate as V
from interp_norm.noise.kernels import pass_noise
from interp_norm.theory import NoiseLaw

#: κ for (layer, target, shape [batch, pos, head], forward-pass count) -> Tensor of that shape.
Sampler = Callable[[int, str, tuple, int], Tensor]
QKV = ("q", "k", "v")


def seeded_sampler(level: float, seed: int = 0, distribution: str = "uniform") -> Sampler:
    """κ = level·z, z of unit RMS from :func:`~interp_norm.noise.kernels.pass_noise` (the one κ stream),
    seeded per (layer, target, pass): the same seed gives proportional κ at every level."""
    law = NoiseLaw(level, distribution)  # validates level and distribution (NoiseSpecError)

    def draw(layer: int, target: str, shape: tuple, call: int) -> Tensor:
        return law.level * pass_noise(seed, layer, target, call, shape, distribution=law.distribution)

    return draw


@dataclass(frozen=True)
class DrawSpec:
    """How the default sampler draws κ (:func:`seeded_sampler`): RMS ``level``, ``seed``, ``distribution``
    ("uniform" or "normal"). Not read when κ is explicit or a sampler is given."""

    level: float = 0.0
    seed: int = 0
    distribution: str = "uniform"


class HeadNoise:
    """Hooks multiplying q, k and/or v of chosen layers by (1+κ) per (example, position, head).

    ``kappa``: explicit κ per ``(layer, target)``, each [batch, pos, heads of that target] (k/v:
    key/value heads); or a ``sampler`` (default :func:`seeded_sampler` at ``level``, ``seed`` and
    ``distribution``, "uniform" or "normal": the :class:`DrawSpec` fields, passed as keywords).
    ``placement`` "before_norm" (the projection output) or "after_norm" (what attention uses;
    the same hook where the target has no norm). After a forward pass ``last_kappa`` holds the κ
    used. Use as ``model.run_with_hooks(tokens, fwd_hooks=noise.hooks())`` or ``with noise: ...``.

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
        targets: Sequence[str] = QKV,
        placement: str = "before_norm",
        layers: Optional[Sequence[int]] = None,
        sampler: Optional[Sampler] = None,
        anat: Optional[Anatomy] = None,
        **draw: Any,
    ):
        drawn = with_overrides(DrawSpec, None, draw, who="HeadNoise", error=NoiseSpecError)
        self.model, self._ctx = model, None
        self.anat = anat or anatomy(model)
        self.placement = V.check_placement(placement)
        bad = [t for t in targets if t not in QKV]
        if bad or not targets:
            raise NoiseSpecError(f"targets must be among 'q', 'k', 'v', got {tuple(targets)!r}")
        self.sites = self._sites(kappa, targets, layers)
        self.kappa = dict(kappa) if kappa is not None else None
        self.sampler = sampler or seeded_sampler(drawn.level, drawn.seed, drawn.distribution)
        self.last_kappa: dict[tuple[int, str], Tensor] = {}
        self._calls: dict[tuple[int, str], int] = {}

    def _sites(self, kappa, targets: Sequence[str], layers: Optional[Sequence[int]]) -> list[tuple[int, str]]:
        n = self.anat.n_layers
        if kappa is not None:
            sites = sorted(kappa, key=lambda lt: (lt[0], QKV.index(lt[1]) if lt[1] in QKV else 3))
            explicit = True
        else:
            explicit = layers is not None
            layers = list(range(n)) if layers is None else list(layers)
            sites = [(l, t) for l in layers for t in QKV if t in targets]
        out = []
        for l, t in sites:
            if isinstance(l, bool) or not isinstance(l, int) or not 0 <= l < n or t not in QKV:
                raise NoiseSpecError(f"noise site {(l, t)!r}: layer must lie in [0, {n}) and target be 'q', 'k' or 'v'")
            la = self.anat[l]
            if t != "q" and la.shares_kv:
                if explicit:
                    raise NoiseSpecError(
                        f"layer {l} reads the keys and values of layer {la.kv_layer} (KV sharing); noise {t} there, "
                        f"which changes both layers"
                    )
                continue  # all layers noised: the shared k/v is noised once, at its source layer
            if t == "v" and la.v_from_k and self.placement == "before_norm":
                if explicit:
                    raise NoiseSpecError(f"layer {l} has no v projection (v = v_norm(raw k)); noise before the norm on 'k' or after it on 'v'")
                continue  # before its norm, v is k's projection: k noise there already reaches v
            out.append((l, t))
        return out

    def site(self, layer: int, target: str) -> tuple[str, str]:
        """(hook name, layout) where noise on ``target`` of ``layer`` lands (asked of the anatomy)."""
        la = self.anat[layer]
        key = target if self.placement == "before_norm" else la.used(target)
        return la.hooks[key], la.layouts.get(key, "bphd")

    def reset(self) -> None:
        """Restart the forward-pass counter: the next pass reuses the first pass's draws."""
        self._calls.clear()
        self.last_kappa.clear()

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
        """``[(hook_name, fn), ...]`` for ``run_with_hooks`` / ``model.hooks``."""
        out = []
        for l, t in self.sites:
            name, layout = self.site(l, t)
            out.append((name, self._hook(l, t, layout)))
        return out

    def __enter__(self):
        """``with NormNoise(model, 0.1): model(tokens)`` -- the hooks are removed on exit."""
        if self._ctx is not None:
            raise NoiseSpecError(f"this {type(self).__name__} is already active; exit it before entering again")
        self._ctx = self.model.hooks(fwd_hooks=self.hooks())
        self._ctx.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        ctx, self._ctx = self._ctx, None
        ctx.__exit__(*exc)


__all__ = ["Sampler", "seeded_sampler", "DrawSpec", "HeadNoise"]
