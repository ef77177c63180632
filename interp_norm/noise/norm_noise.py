"""The norm-noise hooks: :class:`NormNoise` and the seeded κ draws behind every noise experiment.

Menary et al. (2024) model Pre-Norm interference as multiplicative noise on the L2 norms of
queries, keys and values (§2.3): v → (1+κ) v with κ drawn independently per (example,
position, layer, head, vector). :class:`NormNoise` is that model as hooks: a plain hook list
(``model.run_with_hooks(..., fwd_hooks=noise.hooks())``) or a context manager (``with
NormNoise(model, 0.01): model(tokens)``). Targets ``q``, ``k``, ``v`` (= the message, since
m = W_O v is linear) and ``scale`` (the Pre-Norm divisor ``ln1.hook_scale`` itself). Uniform (the
paper's) or normal κ; the noise *level* is the RMS of κ. Optional ``row_gate`` restricts q/k noise
to chosen attention rows.

Placement in QK-/QKV-Norm models (``placement``; the hook is :func:`interp_norm.core.hook_names.noise_site`).
``"before_norm"`` (default) puts the noise on ``hook_q/hook_k/hook_v``, the outputs of
W_Q/W_K/W_V — the same physical place as in the Pre-Norm model, where interference arrives from
upstream — and the per-head norm then removes it up to eps. This is the reading under which the
paper can call QKV-Norm "stable by construction" and see "only jitter due to finite sampling".
``"after_norm"`` puts it on ``hook_q_normed`` etc., asking how fragile QKV-Norm's attention
*would* be if noise survived the norm. Pre-Norm and No-Norm models have no norm between W_Q and
the scores, so both placements are ``hook_q/hook_k/hook_v``; QK-Norm has no value norm, so ``v``
noise always lands on ``hook_v``.

Controls (Menary et al. §2.3 ask what noise *on the norm* does; these ask what else could):
``shared=True`` draws one κ per (example, position, layer), the same for every head and every
noised target (q, k and v all scaled by that one (1+κ)) — the paper's picture of interference
arriving through the one shared Pre-Norm divisor, as opposed to an independent κ per head and
vector. ``direction="random"`` replaces x → (1+κ)x by x → x + κ·‖x‖·u, u a uniformly random unit
vector per (example, position, head, target): the perturbation has exactly the norm |κ|·‖x‖ of the
norm noise with the same κ (so the same RMS size, level·‖x‖), only its direction is random rather
than along x. Per-head norms do not remove it (they remove only the radial part).

Seeding: the κ of forward pass n (counted per :class:`NormNoise` object) at (layer, target) comes
from a generator seeded by ``(seed, layer, target, n)``, so draws do not depend on which other
targets, layers or heads are noised. κ = level · z with z of unit RMS from
:func:`interp_norm.theory.sample_kappa` (the one κ sampler): the same seed gives proportional κ at
every level (common random numbers make noise curves smooth).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional, Sequence

import torch
from torch import Tensor

from interp_norm.anatomy import capabilities
from interp_norm.errors import NoiseSpecError
from interp_norm.core.hook_names import act_name, is_normalised, noise_site
from interp_norm.core.model import HookedNormTransformer
from interp_norm.core.specs import with_overrides
from interp_norm.noise import _validate as V
from interp_norm.noise.head_noise import HeadNoise
from interp_norm.noise.kernels import effective_factor, pass_noise, seeded_generator, unit_noise
from interp_norm.theory import NoiseLaw


@dataclass(frozen=True)
class NoiseControls:
    """The controls of the module docstring, our models only (keywords of :class:`NormNoise`): ``row_gate``
    ``{layer: Bool[batch, head, query]}``, ``shared`` one κ per position for every head and target,
    ``direction`` "norm" or "random"."""

    row_gate: Optional[Mapping[int, Tensor]] = None
    shared: bool = False
    direction: str = "norm"


class NormNoise(HeadNoise):
    """Multiply the L2 norm of chosen vectors by (1+κ), κ = level · z, z of unit RMS.

    Parameters: ``level`` (RMS of κ); ``targets`` any of ``"q"``, ``"k"``, ``"v"`` (alias ``"m"``),
    ``"scale"`` (Pre-Norm only: the divisor ``ln1.hook_scale`` [b, p, 1] times (1+κ), so q, k and
    v of that position shrink by 1/(1+κ); one κ per (example, position, layer), shared by all
    heads and by q, k and v — which is how Pre-Norm interference actually arrives);
    ``distribution`` ``"uniform"`` (the paper's) or ``"normal"``; ``layers`` and ``heads`` (None =
    all; unselected heads get κ = 0 exactly); ``placement`` (module docstring); ``seed``.

    ``shared`` and ``direction`` (``"norm"`` or ``"random"``): the controls of the module
    docstring. ``shared`` draws κ from its own stream (seeded by ``(seed, layer, "shared", n)``),
    so every target of a pass gets the same κ; ``direction="random"`` keeps the κ of the plain norm
    noise (common random numbers) and draws u from a separate stream (:meth:`draw_direction`).

    ``row_gate``: ``{layer: Bool[batch, head, query]}`` restricts q/k noise to those attention
    rows (the paper's "noise only on sparse / non-sparse distributions"). A key is read by many
    rows, so gating cannot be done on the vectors; instead the layer's scores of gated rows become
    f_q·f_k·w — exactly what scaling q and k by f gives — and other rows keep their scores. f is
    1+κ, or :func:`effective_factor` for ``placement="before_norm"`` on a normalised q/k, so gating
    all rows reproduces ungated noise up to rounding. Gating applies to q and k only.

    After each forward pass, ``last_kappa[(layer, target)]`` holds the κ used ([b, p, h, 1], or
    [b, p, 1] for ``scale``).

    On a TransformerLens bridge of a Hugging Face model the same class places the noise through the
    model's attention anatomy (:class:`~interp_norm.noise.head_noise.HeadNoise`, its base: same
    ``level``, ``targets`` among q/k/v, ``placement``, ``layers``, ``distribution``, ``seed`` and the
    same κ streams; ``last_kappa`` [b, p, heads of the target]). The options only our models have
    (``heads``, ``row_gate``, ``shared``, ``direction``, target ``scale``) are refused there with a
    :class:`~interp_norm.errors.NoiseSpecError`.
    """

    def __init__(
        self,
        model: HookedNormTransformer,
        level: float,
        targets: str | Sequence[str] = ("q", "k", "v"),
        *,
        distribution: str = "uniform",
        layers: Optional[int | Sequence[int]] = None,
        heads: Optional[int | Sequence[int]] = None,
        placement: str = "before_norm",
        seed: int = 0,
        **controls: Any,
    ):
        ctl = with_overrides(NoiseControls, None, controls, who="NormNoise", error=NoiseSpecError)
        self.law = NoiseLaw(level, V.check_distribution(distribution))
        self.row_gate, self.shared, self.direction = None, False, "norm"
        self._scales: dict[tuple[int, str], Tensor] = {}
        self.native = not capabilities(model).hf_original  # our model: its config and every hook of the vocabulary
        if not self.native:
            self._init_bridge(model, targets, layers=layers, heads=heads, placement=placement, seed=seed, ctl=ctl)
            return
        cfg = V.check_model(model)
        self.model, self.cfg, self._ctx = model, cfg, None
        self.targets = V.check_targets(targets, cfg)
        self.placement = V.check_placement(placement)
        self.seed = V.check_seed(seed)
        self.shared, self.direction = V.check_control(ctl.shared, ctl.direction, self.targets, ctl.row_gate is not None)
        if ctl.row_gate is not None:
            if not isinstance(ctl.row_gate, Mapping) or not ctl.row_gate:
                raise NoiseSpecError("row_gate must be a non-empty dict {layer: Bool[batch, head, query] tensor}")
            if layers is None:
                layers = sorted(ctl.row_gate)
            bad = [t for t in self.targets if t not in ("q", "k")]
            if bad:
                raise NoiseSpecError(
                    f"row_gate restricts noise on attention rows, which only q and k noise can do; "
                    f"drop targets {bad} or drop row_gate"
                )
        self.layers = V.check_index_list(layers, cfg.n_layers, "layer")
        self.heads = V.check_index_list(heads, cfg.n_heads, "head")
        if "scale" in self.targets and heads is not None and len(self.heads) < cfg.n_heads:
            raise NoiseSpecError(
                "the Pre-Norm scale factor is shared by all heads of a layer, so it cannot be noised "
                "per head; pass heads=None with target 'scale'"
            )
        if ctl.row_gate is not None:
            self.row_gate = self._checked_gates(ctl.row_gate)
        self.last_kappa: dict[tuple[int, str], Tensor] = {}
        self._calls: dict[tuple[int, str], int] = {}

    def _init_bridge(self, model: Any, targets: str | Sequence[str], *, layers: Any, heads: Any, placement: str,
                     seed: int, ctl: "NoiseControls") -> None:
        """A TransformerBridge: :class:`HeadNoise` with the same draws; the options only our models have are refused."""
        unsupported = [name for name, v in (("heads", heads), ("row_gate", ctl.row_gate)) if v is not None]
        unsupported += [name for name, v, default in (("shared", ctl.shared, False), ("direction", ctl.direction, "norm"))
                        if v != default]
        if unsupported:
            raise NoiseSpecError(
                f"{' and '.join(unsupported)} are not available on a TransformerBridge; noise whole layers "
                "(layers=...) or use interp_norm.noise.HeadNoise with explicit kappa per head"
            )
        self.cfg = None  # type: ignore[assignment]  # a bridge has no ModelConfig: its anatomy describes it
        self.targets = V.check_targets(targets, None, allowed=("q", "k", "v"))
        layers = None if layers is None else list(V.check_index_form(layers, "layer"))
        super().__init__(model, level=self.law.level, targets=self.targets, placement=V.check_placement(placement),
                         layers=layers, seed=V.check_seed(seed), distribution=self.law.distribution)
        self.seed, self.layers = seed, tuple(sorted({l for l, _ in self.sites}))

    def _checked_gates(self, row_gate: Mapping[int, Tensor]) -> dict[int, Tensor]:
        """One bool gate [batch, n_heads, query] per noised layer, or a NoiseSpecError naming what is wrong."""
        cfg = self.cfg
        missing = [l for l in self.layers if l not in row_gate]
        if missing:
            raise NoiseSpecError(f"row_gate has no gate for layers {missing}; give one per noised layer")
        gates = {}
        for l in self.layers:
            g = row_gate[l]
            if not isinstance(g, Tensor) or g.dtype != torch.bool or g.ndim != 3 or g.shape[1] != cfg.n_heads:
                raise NoiseSpecError(
                    f"row_gate[{l}] must be a bool tensor [batch, n_heads={cfg.n_heads}, query], "
                    f"got {getattr(g, 'shape', type(g).__name__)}"
                )
            gates[l] = g
        return gates

    @property
    def level(self) -> float:
        return self.law.level

    def hook_names(self) -> dict[tuple[int, str], str]:
        """(layer, target) → hook point where the vector noise lands (without ``row_gate``)."""
        if not self.native:
            return {(l, t): self.site(l, t)[0] for l, t in self.sites}
        return {(l, t): noise_site(self.cfg.attn_norm, t, l, self.placement) for l in self.layers for t in self.targets}

    def draw(self, layer: int, target: str, shape: Sequence[int], call: int = 0, dtype: torch.dtype = torch.float32) -> Tensor:
        """κ for (layer, target) in forward pass ``call``; unselected heads (dim 2 of q/k/v) get 0.
        With ``shared``, one κ per (example, position) for every head and target (``shape`` [b, p, h, 1])."""
        if self.shared and target != "scale":
            g = seeded_generator(self.seed, layer, V.SHARED_CODE, call)
            z = unit_noise((*shape[:2], *(1,) * (len(shape) - 2)), g, self.law.distribution, dtype).expand(*shape)
        else:
            z = pass_noise(self.seed, layer, target, call, shape, distribution=self.law.distribution, dtype=dtype)
        kappa = z * self.law.level
        if target != "scale" and len(self.heads) < self.cfg.n_heads:
            keep = torch.zeros(self.cfg.n_heads, dtype=torch.bool)
            keep[list(self.heads)] = True
            kappa = kappa * keep.view(1, 1, -1, 1).to(dtype)
        return kappa

    def draw_direction(self, layer: int, target: str, shape: Sequence[int], call: int = 0,
                       dtype: torch.dtype = torch.float32) -> Tensor:
        """The random unit vectors u [..., d] of ``direction="random"`` for (layer, target) in pass
        ``call``: standard normal draws divided by their norm (uniform on the sphere)."""
        g = seeded_generator(self.seed, layer, V.DIRECTION_CODE + V.TARGET_CODE[target], call)
        u = torch.randn(tuple(shape), generator=g, dtype=torch.float64)
        return (u / u.norm(dim=-1, keepdim=True)).to(dtype)

    def _next(self, layer: int, target: str, shape: Sequence[int], like: Tensor) -> Tensor:
        call = self._calls.get((layer, target), 0)
        self._calls[(layer, target)] = call + 1
        kappa = self.draw(layer, target, shape, call, like.dtype).to(like.device)
        self.last_kappa[(layer, target)] = kappa
        return kappa

    def _vector_hook(self, layer: int, target: str) -> Callable:
        def hook(act: Tensor, hook=None) -> Tensor:
            shape = (*act.shape[:-1], 1)  # [b, p, h, 1] or [b, p, 1] for the scale
            kappa = self._next(layer, target, shape, act)
            if not kappa.any():  # level 0 (or no selected head): the activation as it is, bit for bit
                return act
            if self.direction == "random":
                u = self.draw_direction(layer, target, act.shape, self._calls[(layer, target)] - 1, act.dtype)
                return act + kappa * act.norm(dim=-1, keepdim=True) * u.to(act.device)
            return act * (1.0 + kappa)

        return hook

    def _store_hook(self, layer: int, target: str) -> Callable:
        def hook(act: Tensor, hook=None) -> None:
            self._scales[(layer, target)] = act

        return hook

    def _factor(self, layer: int, target: str, b: int, n: int, like: Tensor) -> Tensor:
        """Per-vector factor [b, h, p] on the scores for q or k of this layer."""
        kappa = self._next(layer, target, (b, n, self.cfg.n_heads, 1), like)
        if self.placement == "before_norm" and is_normalised(self.cfg.attn_norm, target):
            f = effective_factor(kappa, self._scales[(layer, target)], self.cfg.eps)
        else:
            f = 1.0 + kappa
        return f[..., 0].permute(0, 2, 1)

    def _gate_hook(self, layer: int) -> Callable:
        def hook(scores: Tensor, hook=None) -> Tensor:
            b, h, n, _ = scores.shape
            gate = self.row_gate[layer]
            if gate.shape[0] != b or gate.shape[2] < n:
                raise NoiseSpecError(
                    f"row_gate[{layer}] has shape {tuple(gate.shape)} but the scores are [b={b}, h={h}, q={n}]; "
                    "build the gate from a clean run on the same tokens (see clean_row_gates)"
                )
            ones = torch.ones(b, h, n, dtype=scores.dtype, device=scores.device)
            fq = self._factor(layer, "q", b, n, scores) if "q" in self.targets else ones
            fk = self._factor(layer, "k", b, n, scores) if "k" in self.targets else ones
            factor = fq[..., :, None] * fk[..., None, :]
            factor = torch.where(gate[:, :, :n, None].to(scores.device), factor, torch.ones_like(factor))
            return (scores * factor).masked_fill(torch.isneginf(scores), -math.inf)

        return hook

    def hooks(self) -> list[tuple[str, Callable]]:
        """``[(hook_name, fn), ...]`` for ``run_with_hooks`` / ``model.hooks``."""
        if not self.native:
            return super().hooks()
        out = []
        for l in self.layers:
            if self.row_gate is None:
                out += [(noise_site(self.cfg.attn_norm, t, l, self.placement), self._vector_hook(l, t)) for t in self.targets]
                continue
            if self.placement == "before_norm":
                for t in self.targets:
                    if is_normalised(self.cfg.attn_norm, t):
                        out.append((act_name(f"{t}_scale", l), self._store_hook(l, t)))
            out.append((act_name("attn_scores", l), self._gate_hook(l)))
        for name, _ in out:
            if name not in self.model.hook_dict:
                raise NoiseSpecError(f"hook {name!r} does not exist on this model (attn_norm={self.cfg.attn_norm!r})")
        return out

    def __exit__(self, *exc) -> None:
        self._scales.clear()
        super().__exit__(*exc)


def norm_noise_hooks(model: HookedNormTransformer, level: float, targets: str | Sequence[str] = ("q", "k", "v"), **kwargs) -> list[tuple[str, Callable]]:
    """Shorthand: ``NormNoise(model, level, targets, **kwargs).hooks()``."""
    return NormNoise(model, level, targets, **kwargs).hooks()


__all__ = ["NormNoise", "NoiseControls", "HeadNoise", "norm_noise_hooks", "unit_noise", "effective_factor", "seeded_generator"]
