"""Circuit collapse observed in the model's real noisy forward pass: a test of the theory.

:func:`interp_norm.noise.measure_collapse` judges each layer on its own clean inputs with the
noised scores computed as f_q·f_k·w, and compares with the theory's exact integral *of that same
event*: agreement there is a check of the code (Monte Carlo vs exact integral), not of the theory.

Here the noise goes where it would in use: :class:`NormNoise` on q and k of every chosen layer at
once, the model runs, and each clean-sparse (layer, head, query) row is judged in the actual noisy
run — its argmax key changed ("loose"), and the new top key also got ≥ the strict threshold
("strict"). Layer l's inputs then carry the noise of layers < l (downstream effects: a shifted
residual stream, earlier collapses), which the per-layer theory does not model. Beside each
measured rate stands the same per-layer prediction as in ``measure_collapse`` (exact for loose,
Monte Carlo for strict), from the clean scores; a disagreement is a finding about the theory's
reach, not a bug. Layer 0 sees clean inputs, so there the two must agree within sampling error.
"""

from __future__ import annotations

from typing import Optional, Sequence

import pandas as pd
import torch
from jaxtyping import Int
from torch import Tensor
from tqdm.auto import tqdm

from interp_norm.core.hook_names import act_name
from interp_norm.core.model import HookedNormTransformer
from interp_norm.noise import _validate as V
from interp_norm.noise.collapse import CollapseSpec, LayerCollapse, check_inputs, clean_attention, measure_collapse
from interp_norm.core.defaults import DEFAULT_COLLAPSE_LEVELS
from interp_norm.noise.norm_noise import NormNoise
from interp_norm.core.task import AdditionTask, Batch


@torch.no_grad()
def forward_collapse_decisions(
    model: HookedNormTransformer,
    tokens: Int[Tensor, "batch pos"] | Batch,
    levels: Sequence[float] = DEFAULT_COLLAPSE_LEVELS,
    spec: Optional[CollapseSpec] = None,
    *,
    progress: bool = False,
    **options,
) -> list[LayerCollapse]:
    """Per-draw collapse decisions of every clean-sparse row, read from real noisy forward passes.

    For each level, one :class:`NormNoise` (``spec.targets`` on q/k, ``spec.layers`` all at once,
    ``spec.heads``, ``spec.placement``, ``spec.distribution``, seed ``spec.seed``) is kept active
    for ``spec.n_draws`` passes; pass d uses its draw number d, so the κ are exactly what
    ``NormNoise(...).draw(layer, target, shape, call=d)`` returns (the same z at every level).
    Rows are those of :func:`interp_norm.noise.collapse_decisions` (clean max ≥
    ``spec.sparse_threshold``, query ≥ 1, no padding, chosen heads); loose: the noisy run's score
    argmax differs from the clean one; strict: also its attention weight ≥ ``spec.strict_threshold``.
    ``scores`` holds the clean rows, for the prediction. ``options`` are :class:`CollapseSpec` fields.
    """
    spec, _, levels = check_inputs(model, levels, spec, options)
    clean = clean_attention(model, tokens, spec)
    tokens = clean.tokens
    rows, tstar = {}, {}
    for l in clean.layers:
        rows[l] = clean.sparse_rows(clean.pattern[l], spec.sparse_threshold)
        rb, rh, rq = rows[l].unbind(-1)
        tstar[l] = clean.scores[l][rb, rh, rq].argmax(-1)
    D = spec.n_draws
    loose = {l: torch.zeros(len(levels), D, len(rows[l]), dtype=torch.bool) for l in clean.layers}
    strict = {l: torch.zeros_like(loose[l]) for l in clean.layers}
    wanted = {act_name(k, l) for l in clean.layers for k in ("attn_scores", "pattern")}
    bar = tqdm(total=len(levels) * D, desc="forward collapse", disable=not progress)
    for i, level in enumerate(levels):
        noise = NormNoise(model, level, spec.targets, distribution=spec.distribution, layers=clean.layers,
                          heads=spec.heads, placement=spec.placement, seed=spec.seed)
        with noise:
            for d in range(D):
                _, cache = model.run_with_cache(tokens, names_filter=lambda name: name in wanted)
                for l in clean.layers:
                    rb, rh, rq = rows[l].unbind(-1)
                    scores = cache[act_name("attn_scores", l)][rb, rh, rq].cpu()
                    top = scores.argmax(-1)
                    moved = top != tstar[l]
                    p_top = cache[act_name("pattern", l)][rb, rh, rq].cpu().gather(-1, top[:, None])[:, 0]
                    loose[l][i, d] = moved
                    strict[l][i, d] = moved & (p_top >= spec.strict_threshold)
                bar.update()
    bar.close()
    return [
        LayerCollapse(l, levels, rows[l], clean.scores[l][tuple(rows[l].unbind(-1))].to(torch.float64),
                      loose[l], strict[l])
        for l in clean.layers
    ]


def measure_forward_collapse(
    model: HookedNormTransformer,
    tokens: Int[Tensor, "batch pos"] | Batch,
    levels: Sequence[float] = DEFAULT_COLLAPSE_LEVELS,
    spec: Optional[CollapseSpec] = None,
    *,
    predict: bool = True,
    strict_samples: int = 256,
    variant: Optional[str] = None,
    progress: bool = False,
    **options,
) -> pd.DataFrame:
    """Collapse rate in the real noisy forward pass (all chosen layers noised at once) beside the
    theory's per-layer prediction: a test of the theory, downstream effects included.

    Same columns as :func:`interp_norm.noise.measure_collapse` (one row per layer, level and
    definition, plus ``layer == "all"``): ``measured`` (fraction of (clean-sparse row, draw) pairs
    whose argmax moved in the actual run), ``se`` (clustered by row), ``predicted`` (the theory on
    the clean scores: exact integral for loose, ``strict_samples`` Monte Carlo for strict),
    ``mc_se`` and ``z`` (the deviation expected if each layer behaved as on its clean inputs), and
    ``protocol = "forward"``. It is :func:`interp_norm.noise.measure_collapse` with these decisions,
    so the keyword arguments are the same (``predict``, ``strict_samples``, ``variant``,
    ``progress`` and :class:`CollapseSpec` fields).
    """
    df = measure_collapse(model, tokens, levels, spec, predict=predict, strict_samples=strict_samples, variant=variant,
                          progress=progress, decisions=forward_collapse_decisions, **options)
    df["protocol"] = "forward"
    return df


def run_forward_collapse(
    model: HookedNormTransformer,
    task: Optional[AdditionTask] = None,
    levels: Sequence[float] = DEFAULT_COLLAPSE_LEVELS,
    spec: Optional[CollapseSpec] = None,
    *,
    split: str = V.TEST_SPLIT,
    n_examples: int = V.TEST_EXAMPLES,
    data_seed: int = V.TEST_SEED,
    **kwargs,
) -> pd.DataFrame:
    """:func:`measure_forward_collapse` on ``task.test_set(split, n_examples, seed=data_seed)`` (the
    same keywords and defaults, so the same problems, as :func:`interp_norm.noise.run_collapse`),
    with a ``split`` column. ``task`` defaults to the model's own (``model.task``)."""
    return V.on_test_set(measure_forward_collapse, model, task, levels, spec, split=split, n_examples=n_examples,
                         data_seed=data_seed, who="run_forward_collapse", **kwargs)


__all__ = ["forward_collapse_decisions", "measure_forward_collapse", "run_forward_collapse"]
