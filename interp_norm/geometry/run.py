"""Every geometry analysis in one call, for the CLI, the dashboard, ``reproduce`` and the README table.

:func:`run_geometry` is the entry point for every kind of model; it picks the backend once
(:mod:`~interp_norm.geometry.run_ours` for ours, :mod:`~interp_norm.geometry.run_bridge` for a
TransformerBridge).
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

import pandas as pd

from interp_norm.anatomy import kind_of
from interp_norm.core.model import HookedNormTransformer
from interp_norm.core.specs import with_overrides
from interp_norm.errors import ConfigError
from interp_norm.geometry._common import TokensLike, check_model
from interp_norm.geometry.run_bridge import bridge_geometry
from interp_norm.geometry.run_ours import GeometrySpec, geometry_hook_names, ours_geometry, sample_tokens

__all__ = ["geometry_hook_names", "run_geometry", "bridge_geometry", "compare_geometry", "geometry_summary"]


def _uses_bridge_backend(model: Any) -> bool:
    """The one place this analysis tells kinds apart: a TransformerBridge runs :mod:`.run_bridge`."""
    return kind_of(model) == "bridge"


def run_geometry(
    model: HookedNormTransformer,
    task=None,
    *,
    tokens: Optional[TokensLike] = None,
    n: int = 256,
    split: str = "id",
    seed: int = 0,
    progress: bool = False,
    window_batch: Optional[int] = None,
    **options: Any,
) -> dict[str, pd.DataFrame]:
    """Every geometry analysis on one batch (``n`` problems of ``split``, or the given ``tokens``).

    Keys: ``norm_spread``, ``sparsity_hist``, ``sparsity_summary``, ``sphere_components``,
    ``sphere_pairs``, ``sphere_scores``, ``subspace_angles``, ``head_reads``, ``interference``,
    ``ellipsoids``, ``ellipsoid_axes``, ``ellipsoid_membership``. ``subspace_angles`` holds every
    component–component and component–read pair (head read spaces among themselves are skipped:
    ~65k large SVDs on the paper-size model; call :func:`subspace_angles` for them). ``options`` are
    :class:`~interp_norm.geometry.run_ours.GeometrySpec` fields (``coverage``, ``tolerance``, ``bins``, ``energy``,
    ``weighting``, ``interventions``; an unknown one: ConfigError); a bridge reads the first three.

    ``task`` defaults to the model's own (``model.task``); it is only read when ``tokens`` is not given.
    The one entry point for every kind of model: the backend is picked once (:func:`_backend`), our
    models' in :mod:`~interp_norm.geometry.run_ours`, a ``TransformerBridge``'s (a Hugging Face model)
    in :mod:`~interp_norm.geometry.run_bridge` (:func:`bridge_geometry`: the tables a bridge
    supports, on ``tokens`` or ``n`` text windows; ``task`` and ``split`` are not read; ``window_batch`` is
    its; our models run in one pass and refuse it).
    """
    spec = with_overrides(GeometrySpec, None, options, who="run_geometry")
    if _uses_bridge_backend(model):
        return bridge_geometry(model, tokens=tokens, n=n, seed=seed, spec=spec, progress=progress,
                               window_batch=window_batch)
    return ours_geometry(model, task, tokens=tokens, n=n, split=split, seed=seed, spec=spec, progress=progress,
                         window_batch=window_batch)


def compare_geometry(
    models: Mapping[str, HookedNormTransformer], task=None, *, tokens: Optional[TokensLike] = None, **kwargs
) -> dict[str, pd.DataFrame]:
    """:func:`run_geometry` on several models (e.g. ``{"pre": m1, "qkv": m2}``) on the same batch;
    the tables are concatenated with a leading ``variant`` column (Pre-Norm vs QKV-Norm side by side)."""
    if not models:
        raise ConfigError("compare_geometry needs at least one model, e.g. {'pre': model_a, 'qkv': model_b}")
    for m in models.values():
        if not _uses_bridge_backend(m):
            check_model(m)
    n, split, seed = kwargs.pop("n", 256), kwargs.pop("split", "id"), kwargs.pop("seed", 0)
    first = next(iter(models.values()))
    toks = sample_tokens(first, task, tokens, n, split, seed)
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
