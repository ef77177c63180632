"""Every geometry analysis in one call, for the CLI, the dashboard, ``reproduce`` and the README table.

One forward pass caches :func:`geometry_hook_names`; each analysis then reads that cache.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

import pandas as pd
from torch import Tensor
from tqdm.auto import tqdm

from interp_norm.errors import ConfigError
from interp_norm.geometry._common import TokensLike, as_tokens, check_model, run_cached
from interp_norm.geometry.bridge import (
    bridge_ellipsoid_axes,
    bridge_ellipsoid_table,
    bridge_norms,
    bridge_tokens,
)
from interp_norm.anatomy import kind_of
from interp_norm.geometry.ellipsoid import ellipsoid_axes, ellipsoid_membership, ellipsoid_table, norm_hook_names
from interp_norm.geometry.interference import Intervention, direct_interference
from interp_norm.geometry.sparsity import max_attention, sparsity_histogram, sparsity_summary
from interp_norm.geometry.spheres import orthogonal_spheres
from interp_norm.geometry.spread import norm_spread
from interp_norm.geometry.subspaces import head_read_fractions, subspace_angles, subspaces
from interp_norm.core.hook_names import act_name
from interp_norm.core.model import HookedNormTransformer
from interp_norm.core.task import task_for

__all__ = ["geometry_hook_names", "run_geometry", "bridge_geometry", "compare_geometry", "geometry_summary"]


def geometry_hook_names(model: HookedNormTransformer) -> list[str]:
    """Every hook the analyses here read (cache them once and pass ``cache=`` to each analysis)."""
    per_layer = ("resid_pre", "pattern", "z", "attn_out", "mlp_out")
    names = [act_name("embed"), act_name("pos_embed")]
    names += [act_name(k, l) for l in range(model.cfg.n_layers) for k in per_layer]
    return names + norm_hook_names(model)


def _sample_tokens(model: HookedNormTransformer, task, tokens, n: int, split: str, seed: int) -> Tensor:
    if tokens is not None:
        return as_tokens(model, tokens)
    task = task_for(model, task, who="run_geometry (without tokens=)", stacklevel=4)
    return as_tokens(model, task.sample_batch(n, split, seed=seed).tokens)


def _spread_and_sparsity(model: Any, tokens: Tensor, cache, *, coverage: float, tolerance: float, bins: int,
                         steps: tqdm) -> dict[str, pd.DataFrame]:
    """``norm_spread``, ``sparsity_hist`` and ``sparsity_summary`` from the cache (two progress
    steps): the analyses our models and bridges share, written once for both runners."""
    out = {"norm_spread": norm_spread(model, tokens, coverage=coverage, tolerance=tolerance, cache=cache)}
    steps.update()
    mx = max_attention(model, tokens, cache=cache)
    out["sparsity_hist"] = sparsity_histogram(mx, bins=bins)
    out["sparsity_summary"] = sparsity_summary(mx)
    steps.update()
    return out


def run_geometry(
    model: HookedNormTransformer,
    task=None,
    *,
    tokens: Optional[TokensLike] = None,
    n: int = 256,
    split: str = "id",
    seed: int = 0,
    coverage: float = 0.9,
    tolerance: float = 0.2,
    bins: int = 20,
    energy: float = 0.9,
    weighting: str = "energy",
    interventions: Optional[Mapping[str, Intervention]] = None,
    progress: bool = False,
    window_batch: Optional[int] = None,
) -> dict[str, pd.DataFrame]:
    """Every geometry analysis on one batch (``n`` problems of ``split``, or the given ``tokens``).

    Keys: ``norm_spread``, ``sparsity_hist``, ``sparsity_summary``, ``sphere_components``,
    ``sphere_pairs``, ``sphere_scores``, ``subspace_angles``, ``head_reads``, ``interference``,
    ``ellipsoids``, ``ellipsoid_axes``, ``ellipsoid_membership``. ``subspace_angles`` holds every
    component–component and component–read pair (head read spaces among themselves are skipped:
    ~65k large SVDs on the paper-size model; call :func:`subspace_angles` for them).

    ``task`` defaults to the model's own (``model.task``); it is only read when ``tokens`` is not given.
    A ``TransformerBridge`` (a Hugging Face model) gets :func:`bridge_geometry` instead (``window_batch``
    is its; our models run in one pass and refuse it).
    """
    if kind_of(model) == "bridge":
        return bridge_geometry(model, tokens=tokens, n=n, seed=seed, coverage=coverage, tolerance=tolerance,
                               bins=bins, progress=progress, window_batch=window_batch)
    if window_batch is not None:
        raise ConfigError(f"window_batch={window_batch!r} applies to Hugging Face models (TransformerBridges); "
                          "our models run the batch in one pass: drop window_batch")
    check_model(model)
    tokens = _sample_tokens(model, task, tokens, n, split, seed)
    steps = tqdm(total=8, desc="geometry", disable=not progress)
    cache = run_cached(model, tokens, geometry_hook_names(model))  # one forward pass for every analysis
    steps.update()
    out: dict[str, pd.DataFrame] = _spread_and_sparsity(model, tokens, cache, coverage=coverage, tolerance=tolerance,
                                                        bins=bins, steps=steps)
    sph = orthogonal_spheres(model, tokens, weighting=weighting, cache=cache)
    out["sphere_components"], out["sphere_pairs"], out["sphere_scores"] = sph["components"], sph["pairs"], sph["scores"]
    steps.update()
    bases = subspaces(model, tokens, energy=energy, cache=cache)
    is_read = {k: k.endswith((".q", ".k", ".v")) for k in bases}
    names = list(bases)
    pairs = [(a, b) for i, a in enumerate(names) for b in names[i + 1 :] if not (is_read[a] and is_read[b])]
    out["subspace_angles"] = subspace_angles(bases, pairs=pairs)
    comp_bases = {k: v for k, v in bases.items() if not is_read[k]}
    out["head_reads"] = head_read_fractions(model, comp_bases)
    steps.update()
    out["interference"] = direct_interference(model, tokens, interventions, cache=cache)
    steps.update()
    out["ellipsoids"] = ellipsoid_table(model)
    out["ellipsoid_axes"] = ellipsoid_axes(model)
    steps.update()
    out["ellipsoid_membership"] = ellipsoid_membership(model, tokens, cache=cache)
    steps.update()
    steps.close()
    return out


def bridge_geometry(
    model: Any,
    *,
    tokens: Optional[TokensLike] = None,
    n: int = 8,
    n_ctx: int = 32,
    seed: int = 0,
    coverage: float = 0.9,
    tolerance: float = 0.2,
    bins: int = 20,
    progress: bool = False,
    window_batch: Optional[int] = None,
) -> dict[str, pd.DataFrame]:
    """The geometry of a ``TransformerBridge``: ``norm_spread``, ``sparsity_hist``,
    ``sparsity_summary``, ``ellipsoids``, ``ellipsoid_axes``, ``ellipsoid_membership`` (every norm,
    attention q/k/v norms included) and ``anatomy`` (:meth:`~interp_norm.anatomy.Anatomy.table`).

    ``tokens`` default: ``n`` windows of ``n_ctx`` tokens of the shipped sample text, or random
    ordinary ids for a model without a tokenizer (:func:`~interp_norm.geometry.bridge.bridge_tokens`).
    The orthogonal-spheres, subspace and interference analyses read our model's weight steps and
    residual decomposition, which a bridge does not expose; they are not run here.

    Memory: one early-stopped forward (no logits) per block of ``window_batch`` windows (None:
    :data:`~interp_norm.core.defaults.WINDOW_BATCH`, 8; ≥ the windows: one pass), the blocks in lockstep
    layer by layer; each block's hooks of a layer are reduced to per-row values before the next block
    runs (:func:`~interp_norm.geometry.bridge_sweep.bridge_sweep`), so the peak is the weights plus one
    block's hooks of one layer plus those per-row values, while every table is the one a single pass gives.
    """
    from interp_norm.anatomy import anatomy
    from interp_norm.core.defaults import WINDOW_BATCH
    from interp_norm.errors import GeometryError, check_positive_int
    from interp_norm.geometry.bridge_sweep import bridge_sweep

    window_batch = WINDOW_BATCH if window_batch is None else window_batch
    check_positive_int(window_batch, "window_batch", GeometryError, "windows per forward pass")

    toks = as_tokens(model, tokens if tokens is not None else bridge_tokens(model, n, n_ctx, seed))
    norms = bridge_norms(model)
    steps = tqdm(total=4, desc="geometry", disable=not progress)
    out: dict[str, pd.DataFrame] = {"anatomy": anatomy(model).table()}
    steps.update()
    swept = bridge_sweep(model, toks, norms, coverage=coverage, tolerance=tolerance, bins=bins,
                         window_batch=window_batch, steps=steps)
    out.update({k: swept[k] for k in ("norm_spread", "sparsity_hist", "sparsity_summary")})
    out["ellipsoids"] = bridge_ellipsoid_table(model, norms)
    out["ellipsoid_axes"] = bridge_ellipsoid_axes(model, norms)
    out["ellipsoid_membership"] = swept["ellipsoid_membership"]
    steps.update()
    steps.close()
    return out


def compare_geometry(
    models: Mapping[str, HookedNormTransformer], task=None, *, tokens: Optional[TokensLike] = None, **kwargs
) -> dict[str, pd.DataFrame]:
    """:func:`run_geometry` on several models (e.g. ``{"pre": m1, "qkv": m2}``) on the same batch;
    the tables are concatenated with a leading ``variant`` column (Pre-Norm vs QKV-Norm side by side)."""
    if not models:
        raise ConfigError("compare_geometry needs at least one model, e.g. {'pre': model_a, 'qkv': model_b}")
    for m in models.values():
        if kind_of(m) != "bridge":
            check_model(m)
    n, split, seed = kwargs.pop("n", 256), kwargs.pop("split", "id"), kwargs.pop("seed", 0)
    first = next(iter(models.values()))
    toks = _sample_tokens(first, task, tokens, n, split, seed)
    per = {name: run_geometry(m, tokens=toks, **kwargs) for name, m in models.items()}
    keys = next(iter(per.values())).keys()
    return {k: pd.concat([df[k].assign(variant=v) for v, df in per.items()], ignore_index=True)
            .pipe(lambda d: d[["variant", *[c for c in d.columns if c != "variant"]]]) for k in keys}


def geometry_summary(
    results: Mapping[str, pd.DataFrame], *, per_layer: bool = True, top_bin: Optional[float] = None
) -> pd.DataFrame:
    """The README table. Works on :func:`run_geometry` or :func:`compare_geometry` output.

    ``per_layer=True``: one row per (variant, layer) with the pooled norm ``spread`` and
    ``within_tol`` share, sparsity shares (``frac_top_bin`` = share of max attention in the
    histogram's top bin: the paper's "peak at 1"), the orthogonal-spheres ``score`` and its terms,
    and the mean attention change per intervention (``tv[<name>]``) and its shared-norm part
    (``tv_norm[<name>]``, see :func:`~interp_norm.geometry.direct_interference`). Layer n_layers (the
    ln_final input) only has sphere columns. ``per_layer=False``: one row per variant: spread and sphere
    columns averaged over the attention layers 0..n_layers−1 (``max_spread`` the worst layer),
    sparsity shares of all distributions pooled, tv columns averaged over heads and layers.
    """
    if not per_layer:
        return _overall_summary(results, top_bin)
    has_v = "variant" in results["norm_spread"].columns
    keys = ["variant", "layer"] if has_v else ["layer"]
    ns = results["norm_spread"]
    ns = ns[ns["head"].isna()][keys + ["spread", "within_tol"]]
    ss = results["sparsity_summary"]
    ss = ss[ss["layer"].notna()][keys + ["frac_sparse", "frac_nonsparse", "median"]].rename(columns={"median": "median_max_attn"})
    h = results["sparsity_hist"]
    h = h[h["layer"].notna()]
    top = h[h["bin"] == h["bin"].max()] if top_bin is None else h[h["lo"] >= top_bin]
    top = top.groupby(keys, as_index=False)["fraction"].sum().rename(columns={"fraction": "frac_top_bin"})
    frames = [ns, ss, top]
    if "sphere_scores" in results:  # our models only (a bridge has no residual decomposition)
        frames.insert(0, results["sphere_scores"][keys + ["score", "constancy", "orthogonality", "resid_norm_cv"]])
    if "interference" in results:
        it = results["interference"].pivot_table(index=keys, columns="intervention",
                                                 values=["mean_tv", "mean_tv_norm"], aggfunc="mean")
        it.columns = [f"{'tv' if v == 'mean_tv' else 'tv_norm'}[{c}]" for v, c in it.columns]
        frames.append(it.reset_index())
    out = None
    for df in frames:
        df = df.copy()
        df["layer"] = df["layer"].astype(int)
        out = df if out is None else out.merge(df, on=keys, how="outer")
    return out.sort_values(keys).reset_index(drop=True)


def _overall_summary(results: Mapping[str, pd.DataFrame], top_bin: Optional[float]) -> pd.DataFrame:
    per = geometry_summary(results, per_layer=True, top_bin=top_bin)
    has_v = "variant" in per.columns
    if not has_v:
        per = per.assign(variant="model")
    attn = per[per["spread"].notna()]  # attention layers only
    spheres = dict(sphere_score=("score", "mean"), constancy=("constancy", "mean"),
                   orthogonality=("orthogonality", "mean"), resid_norm_cv=("resid_norm_cv", "mean"))
    agg = attn.groupby("variant", sort=False).agg(
        mean_spread=("spread", "mean"), max_spread=("spread", "max"), within_tol=("within_tol", "mean"),
        **{k: v for k, v in spheres.items() if v[0] in per.columns},
        **{c: (c, "mean") for c in per.columns if c.startswith(("tv[", "tv_norm["))},
    )
    ss = results["sparsity_summary"]
    ss = ss[ss["layer"].isna()]
    h = results["sparsity_hist"]
    h = h[h["layer"].isna()]
    h = h[h["bin"] == h["bin"].max()] if top_bin is None else h[h["lo"] >= top_bin]
    if not has_v:
        ss, h = ss.assign(variant="model"), h.assign(variant="model")
    agg = agg.join(ss.set_index("variant")[["frac_sparse", "frac_nonsparse", "median"]]
                   .rename(columns={"median": "median_max_attn"}))
    agg = agg.join(h.groupby("variant")["fraction"].sum().rename("frac_top_bin"))
    out = agg.reset_index()
    return out if has_v else out.drop(columns="variant")
