"""How much of attribution's error against exact patching each nonlinearity carries: the norms' scales, the softmax, the rest.

Attribution (AtP, AtP*, EAP, EAP-IG) linearises activation patching. Against exact patching (the
ground truth, :func:`~interp_norm.circuits.exact.patching.activation_patch`) its error comes from
every nonlinearity between the patched node and the metric. Freezing a nonlinearity in the backward
pass (:mod:`~interp_norm.circuits.norm_modes`) removes that nonlinearity's curvature from the
estimate; so for each node the error in three modes -- (live norm, live pattern), (frozen norm,
live pattern), (frozen norm, frozen pattern) -- splits the live error exactly as

    err_live = (err_live - err_norm)  +  (err_norm - err_both)  +  err_both
               removed by freezing      removed by freezing       the rest: MLPs, the output
               the norms' scales        the patterns              head, interactions

A "removed" part is negative where freezing makes the estimate worse. Choices (the paper, Menary
et al. 2024 sec. 5, patches exactly and does not attribute): the error of a node is the mean over
pairs of ``|estimate - exact|`` per pair (``per="pair"``; errors of opposite sign in different
pairs do not cancel) or ``|mean estimate - mean exact|`` (``per="mean"``); the norm is frozen
before the patterns (the order of the split is a choice: the other order splits differently where
the two interact). AtP* is scored on queries and keys with its exact softmax (and equals AtP
elsewhere); GradDrop is left out (an unsigned magnitude, no signed error). AtP and EAP are the
same estimate computed by different code (an identity the table shows).

On a TransformerBridge the methods are EAP and EAP-IG (AtP / AtP* recompute attention with our
model's own steps) and the activations those with one node per head (``k``/``v`` of grouped-query
attention have one per k/v head and are refused); a bridge whose norms or patterns cannot be frozen is
refused by :func:`~interp_norm.circuits.norm_modes.freeze_hooks` (Gemma 4: its patterns, whose hook
fires after the attention ran; its norms freeze).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import pandas as pd
import torch
from torch import Tensor
from tqdm.auto import tqdm

from interp_norm.circuits import attribution as attr
from interp_norm.circuits.exact.patching import activation_patch
from interp_norm.circuits.metrics import LogitDiff
from interp_norm.circuits.pairs import PatchingPairs, as_pairs
from interp_norm.core import nodes
from interp_norm.errors import PatchingError, PatternNotEditable

#: (norm, pattern) modes, in the order of the split
MODES = {"live": ("live", "live"), "norm": ("frozen", "live"), "both": ("frozen", "frozen")}
METHODS = ("atp", "atp*", "eap", "eap-ig")
ACTIVATIONS = ("z", "q", "k", "v", "mlp_out")


@dataclass(frozen=True)
class BudgetSpec:
    """What :func:`attribution_error_budget` computes: ``methods`` (of :data:`METHODS`),
    ``activations`` (node kinds, patched over all positions: ``z`` a head's output, ``q``/``k``/``v``
    its inputs after the projection, ``mlp_out``), EAP-IG's ``ig_steps``, ``per`` = ``"pair"`` or
    ``"mean"`` (see the module docstring)."""

    methods: tuple = METHODS
    activations: tuple = ACTIVATIONS
    ig_steps: int = 8
    per: str = "pair"

    def check(self) -> None:
        bad = [m for m in self.methods if m not in METHODS]
        if bad:
            raise PatchingError(f"unknown attribution method {bad[0]!r}; choose from {list(METHODS)}")
        bad = [a for a in self.activations if a not in ACTIVATIONS]
        if bad:
            raise PatchingError(f"the error budget covers {list(ACTIVATIONS)}, not {bad[0]!r}")
        if self.per not in ("pair", "mean"):
            raise PatchingError(f"per must be 'pair' or 'mean', got {self.per!r}")
        if int(self.ig_steps) < 2:
            raise PatchingError(f"EAP-IG needs ig_steps >= 2 (1 is EAP), got {self.ig_steps}")


def _per_pair(result) -> Tensor:
    """[cells, pairs] effect of each cell on each pair (float64)."""
    return result.per_example.double() - result.baseline.double().unsqueeze(0)


def _estimate(model, pairs: PatchingPairs, metric, method: str, activation: str, *, spec: BudgetSpec, modes: tuple) -> Tensor:
    from interp_norm.circuits.atp_star import atp_star

    norm, pattern = modes
    if method in ("atp", "atp*"):
        qk_fix = method == "atp*" and activation in ("q", "k")
        r = atp_star(model, pairs, metric, activation, by="all", qk_fix=qk_fix, norm=norm, pattern=pattern)
    else:
        steps = 1 if method == "eap" else spec.ig_steps
        r = attr.attribution_patch(model, pairs, metric, activation, by="all", ig_steps=steps, norm=norm, pattern=pattern)
    return _per_pair(r)


def _estimate_or_nan(model, pairs: PatchingPairs, metric, method: str, activation: str, *, spec: BudgetSpec,
                     modes: tuple, like: Tensor) -> Tensor:
    """:func:`_estimate`; where the model's attention patterns cannot be frozen (its pattern hook is read
    after attention ran, e.g. Gemma 4: a typed refusal) the frozen-pattern estimate is NaN, so the error with
    the norms live and frozen is still reported and the patterns' part and the rest are "not available"."""
    try:
        return _estimate(model, pairs, metric, method, activation, spec=spec, modes=modes)
    except PatternNotEditable:
        if modes[1] != "frozen":
            raise
        return torch.full_like(like, float("nan"))


def _node_names(activation: str, L: int, H: int) -> list[str]:
    if activation == "mlp_out":
        return [nodes.mlp(l) for l in range(L)]
    if activation == "z":
        return [nodes.head(l, h) for l in range(L) for h in range(H)]
    return [nodes.head_input(l, h, activation) for l in range(L) for h in range(H)]


def _error(est: Tensor, exact: Tensor, per: str) -> Tensor:
    return (est - exact).abs().mean(-1) if per == "pair" else (est.mean(-1) - exact.mean(-1)).abs()


def attribution_error_budget(model, pairs: PatchingPairs, metric=None, spec: Optional[BudgetSpec] = None, *,
                             progress: bool = False) -> pd.DataFrame:
    """Per method and node: the exact effect, the estimate in each mode, the error in each mode and
    its split (``removed_by_norm + removed_by_pattern + rest = err_live``); see the module docstring.

    One row per (method, node) with columns ``method``, ``activation``, ``node``, ``layer``,
    ``exact`` and ``est_live`` / ``est_norm`` / ``est_both`` (batch means), ``exact_size`` (the error of
    an estimate of 0: mean |exact| over pairs, or |mean exact|, as ``per``), ``err_live`` /
    ``err_norm`` / ``err_both``, ``removed_by_norm``, ``removed_by_pattern``, ``rest``.
    Our models, or a bridge with EAP / EAP-IG (see the module docstring).
    """
    from interp_norm.anatomy import capabilities

    spec = spec if spec is not None else BudgetSpec()
    spec.check()
    if not capabilities(model).full_vocabulary:  # AtP / AtP* need the q/k/v and pattern hooks our models fire
        if spec.methods == METHODS:  # the default: what a bridge supports
            spec = BudgetSpec(methods=("eap", "eap-ig"), activations=spec.activations, ig_steps=spec.ig_steps, per=spec.per)
        bad = [m for m in spec.methods if m in ("atp", "atp*")]
        if bad:
            raise PatchingError(f"{bad[0]} recomputes attention with interp_norm's own model; on a bridge use methods=('eap', 'eap-ig')")
    pairs = as_pairs(pairs)
    metric = metric if metric is not None else LogitDiff(pairs)
    L, H = model.cfg.n_layers, model.cfg.n_heads
    rows = []
    work = [(a, m) for a in spec.activations for m in spec.methods]
    exact: dict[str, Tensor] = {}
    for activation, method in tqdm(work, disable=not progress, desc="error budget"):
        if activation not in exact:
            exact[activation] = _per_pair(activation_patch(model, pairs, None, metric, activation, by="all"))
        ex = exact[activation]
        est = {k: _estimate_or_nan(model, pairs, metric, method, activation, spec=spec, modes=modes, like=ex)
               for k, modes in MODES.items()}
        err = {k: _error(v, ex, spec.per) for k, v in est.items()}
        names = _node_names(activation, L, H)
        if len(names) != ex.shape[0]:
            raise PatchingError(f"{activation!r} has {ex.shape[0] // L} k/v heads per layer, not one per head "
                                "(grouped-query attention); leave it out of activations")
        for i, node in enumerate(names):
            e = {k: float(v[i]) for k, v in err.items()}
            rows.append(dict(
                method=method, activation=activation, node=node, layer=nodes.parse(node).layer,
                exact=float(ex[i].mean()), exact_size=float(_error(torch.zeros_like(ex[i]), ex[i], spec.per)), **{f"est_{k}": float(v[i].mean()) for k, v in est.items()},
                **{f"err_{k}": e[k] for k in MODES}, removed_by_norm=e["live"] - e["norm"],
                removed_by_pattern=e["norm"] - e["both"], rest=e["both"],
            ))
    return pd.DataFrame(rows)


def budget_summary(budget: pd.DataFrame, by: tuple = ("method", "activation")) -> pd.DataFrame:
    """Totals over nodes (``n_nodes`` of them): the error in each mode, the shares of the live error each
    part carries (they add to 1), and ``rel_err_<mode>`` = that error / the error of estimating every
    effect as 0 (``exact_size``): 1 is no better than attributing nothing."""
    cols = ["err_live", "err_norm", "err_both", "removed_by_norm", "removed_by_pattern", "rest", "exact_size"]
    grouped = budget.groupby(list(by), sort=False)
    g = grouped[cols].sum(min_count=1).assign(n_nodes=grouped.size())  # a part not available stays NaN, not 0
    out = g.assign(**{f"share_{c}": g[c] / g["err_live"] for c in ("removed_by_norm", "removed_by_pattern", "rest")})
    for mode in MODES:
        out[f"rel_err_{mode}"] = g[f"err_{mode}"] / g["exact_size"]
    return out.reset_index()


__all__ = ["BudgetSpec", "attribution_error_budget", "budget_summary", "METHODS", "ACTIVATIONS"]
