"""Every heavy analysis of one checkpoint, as tables: the unit of work ``reproduce`` runs per model.

One function, :func:`analyse_checkpoint`, so that ``reproduce`` can run checkpoints one after the
other or in worker processes (one torch thread each: these small models are fastest on one thread,
and two processes use both cores of a small machine). Each analysis comes from its module's
one-call function; this module only chooses which ones, labels the rows and times them.

Besides the paper's measurements it runs the controls that make them mean something (issue 13):

* ``noise``: the paper's sparse-only / non-sparse-only contrast plus the *matched-count* group
  (as many non-sparse rows as sparse ones), and for QK-/QKV-Norm the noise placed *after* the norm
  (before it the norm removes the noise by construction);
* ``forward_collapse``: collapse seen in the real noisy forward pass beside the per-layer theory;
* ``temperature``: collapse level and sparse fraction vs a score multiplier c, split into the rows
  sparse at c = 1 and the rows newly counted as sparse.

and those of issue 23: ``collapse`` also gives ``collapse_heads`` (the 1% level and share of sparse
rows per head, from the same decisions); ``noise_decomposition`` (q-only, k-only, v-only, all,
random-direction and one-κ-per-token noise at 1%); ``collapse_consequence`` (accuracy of problems
with ≥ 1 collapsed sparse row vs none, noise on sparse rows only, with bootstrap intervals).
"""

from __future__ import annotations

import time
from typing import Any, Callable, Optional

import pandas as pd

#: Analyses in the order they run (``evaluate`` is cheap and runs for every checkpoint).
ANALYSES = ("evaluate", "circuits", "noise", "collapse", "forward_collapse", "temperature", "geometry", "attention",
            "noise_decomposition", "collapse_consequence")
#: The heavy ones (``analyse`` chooses the checkpoints they run on).
HEAVY = tuple(a for a in ANALYSES if a != "evaluate")
#: Opt-in (``interp-norm reproduce --controls``): about +5 s of CPU per analysed checkpoint, which
#: would take ``make reproduce`` past its 3-minute budget.
CONTROLS = ("noise_decomposition", "collapse_consequence")
#: What a run does unless told otherwise.
DEFAULT_ANALYSES = tuple(a for a in ANALYSES if a not in CONTROLS)


def _front(df: pd.DataFrame, **cols: Any) -> pd.DataFrame:
    for i, (k, v) in enumerate(cols.items()):
        if k in df.columns:
            df = df.drop(columns=k)
        df.insert(i, k, v)
    return df


def _circuits(model: Any, task: Any, settings: Any, progress: bool) -> dict[str, pd.DataFrame]:
    """The circuits package's one-call analysis, reshaped for the dashboard.

    The ``patch_<activation>`` tables become one ``patching`` table (with ``by`` = pos/all and the
    pairs' first clean problem as ``template``, for position labels); the circuit's edge table
    gets ``n_layers``/``n_heads`` so a :class:`~interp_norm.circuits.Circuit` can be rebuilt from it.
    """
    from interp_norm.circuits import run_circuits

    res = run_circuits(model, task, n_pairs=settings.circuit_pairs, seed=settings.seed,
                       attention_problems=settings.circuit_attention_problems, progress=progress)
    out: dict[str, pd.DataFrame] = {}
    frames = []
    for key, df in res.items():
        if key.startswith("patch_"):
            df = df.copy()
            df.insert(1, "by", "all" if key.endswith("_all") else "pos")
            frames.append(df)
        else:
            out[key] = df
    if frames:
        patch = pd.concat(frames, ignore_index=True)
        pairs = res.get("pairs")
        patch["template"] = str(pairs["clean"].iloc[0]) if pairs is not None and "clean" in pairs and len(pairs) else ""
        out["patching"] = patch
    if "circuit" in out:
        out["circuit"] = out["circuit"].assign(n_layers=model.cfg.n_layers, n_heads=model.cfg.n_heads)
    return out


def default_problems(task: Any, n_ctx: int, seed: int) -> list[str]:
    """One problem per split that fits the model: the attention figure's default choices."""
    out = []
    for i, split in enumerate(("id", "interp", "extrap")):
        for k in range(50):
            p = task.sample_problems(1, split, seed=seed * 1000 + 17 * i + k)[0]
            if len(p.text) <= n_ctx:
                out.append(p.text)
                break
    return out


def evaluate_checkpoint(name: str, model: Any, info: Any, settings: Any, progress: bool = False) -> pd.DataFrame:
    """Accuracy per split on fresh seeded test sets (not the numbers recorded at training time)."""
    from interp_norm.evaluate import evaluate

    ev = evaluate(model, info.task, size=settings.eval_size, exact_match=settings.exact_match, progress=progress)
    return _front(ev, checkpoint=name, attn_norm=info.model_cfg.attn_norm)


def analyse_checkpoint(
    name: str,
    model: Any,
    info: Any,
    settings: Any,
    label: str,
    todo: Optional[set[str]] = None,
    progress: bool = False,
    on_stage: Optional[Callable[[str, bool], None]] = None,
) -> tuple[dict[str, list[pd.DataFrame]], dict[str, float]]:
    """The heavy analyses of one checkpoint: ``({table key: [frames]}, {analysis: seconds})``.

    ``on_stage(analysis, finished)`` is called as each analysis starts and ends (``reproduce``'s
    progress bar ticks per analysis, not per checkpoint).

    Table keys are those of the report (``noise_accuracy``, ``collapse``, ``forward_collapse``,
    ``temperature``, ``geometry_<k>``, ``circuits_<k>``, ``attention_patterns``); every frame carries
    ``checkpoint`` (and ``variant`` where the analysis does not set it).
    """
    from interp_norm.hooks import is_normalised
    from interp_norm.noise import (
        MATCHED,
        run_collapse_consequence,
        run_collapse_with_heads,
        run_forward_collapse,
        run_noise,
        run_noise_decomposition,
        run_temperature_sweep,
    )

    todo = set(HEAVY) if todo is None else set(todo) & set(HEAVY)
    task, a = info.task, info.model_cfg.attn_norm
    after_norm = is_normalised(a, "q")  # QK/QKV-Norm: noise before the norm is removed by construction
    # the single-placement analyses ask QK/QKV-Norm about noise that survives its norm
    placement = "after_norm" if after_norm else "before_norm"
    v = f"{label}, noise after norm" if after_norm else label
    tables: dict[str, list[pd.DataFrame]] = {}
    seconds: dict[str, float] = {}

    def put(key: str, df: pd.DataFrame) -> None:
        tables.setdefault(key, []).append(df)

    for analysis in HEAVY:
        if analysis not in todo:
            continue
        if on_stage is not None:
            on_stage(analysis, False)
        t0 = time.perf_counter()
        if analysis == "circuits":
            for key, df in _circuits(model, task, settings, progress).items():
                put(f"circuits_{key}", _front(df.copy(), variant=label, checkpoint=name))
        elif analysis == "noise":
            kw = dict(n_datasets=settings.noise_datasets, n_examples=settings.noise_examples, seed=settings.seed,
                      progress=progress)
            rows = tuple(settings.noise_rows) + ((MATCHED,) if settings.noise_matched else ())
            put("noise_accuracy", _front(run_noise(model, task, settings.noise_levels, noised=rows, variant=label, **kw),
                                         checkpoint=name))
            if after_norm:
                put("noise_accuracy", _front(run_noise(model, task, settings.noise_levels, noised="all",
                                                       variant=f"{label}, noise after norm", placement="after_norm",
                                                       **kw), checkpoint=name))
        elif analysis == "collapse":
            kw = dict(n_examples=settings.collapse_examples, n_draws=settings.collapse_draws,
                      strict_samples=settings.collapse_strict_samples, seed=settings.seed, progress=progress)
            # the norm removes noise placed before it; for QK/QKV-Norm also ask how fragile the
            # attention itself would be if the noise survived the norm
            for v, more in [(label, {})] + ([(f"{label}, noise after norm", dict(placement="after_norm"))]
                                            if after_norm else []):
                curves, heads = run_collapse_with_heads(model, task, settings.collapse_levels, variant=v, **kw, **more)
                put("collapse", _front(curves, checkpoint=name))
                put("collapse_heads", _front(heads, checkpoint=name))
        elif analysis == "forward_collapse":
            put("forward_collapse", _front(run_forward_collapse(
                model, task, settings.collapse_levels, n_examples=settings.forward_examples,
                n_draws=settings.forward_draws, strict_samples=settings.collapse_strict_samples, seed=settings.seed,
                variant=v, placement=placement, progress=progress), checkpoint=name))
        elif analysis == "temperature":
            put("temperature", _front(run_temperature_sweep(
                model, task, settings.temperature_multipliers, settings.collapse_levels,
                n_examples=settings.temperature_examples, n_draws=settings.temperature_draws, seed=settings.seed,
                variant=v, placement=placement, progress=progress), checkpoint=name))
        elif analysis == "noise_decomposition":
            put("noise_decomposition", _front(run_noise_decomposition(
                model, task, settings.decomposition_levels, n_datasets=settings.noise_datasets,
                n_examples=settings.noise_examples, seed=settings.seed, variant=label, progress=progress),
                checkpoint=name))
        elif analysis == "collapse_consequence":
            put("collapse_consequence", _front(run_collapse_consequence(
                model, task, settings.consequence_levels, n_examples=settings.consequence_examples,
                n_draws=settings.consequence_draws, n_boot=settings.consequence_boot, seed=settings.seed,
                variant=v, placement=placement, progress=progress), checkpoint=name))
        elif analysis == "geometry":
            from interp_norm.geometry import run_geometry

            g = run_geometry(model, task, n=settings.geometry_examples, seed=settings.seed, progress=progress)
            for key, df in g.items():
                put(f"geometry_{key}", _front(df.copy(), variant=label, checkpoint=name))
        elif analysis == "attention":
            from interp_norm.circuits.attention_maps import attention_patterns

            probs = list(settings.problems) or default_problems(task, model.cfg.n_ctx, settings.seed)
            put("attention_patterns", attention_patterns(model, probs, name=label).assign(checkpoint=name))
        seconds[analysis] = time.perf_counter() - t0
        if on_stage is not None:
            on_stage(analysis, True)
    return tables, seconds


def stages(name: str, todo: set[str], heavy: set[str]) -> int:
    """Progress ticks of one checkpoint: evaluate (if run) plus each heavy analysis it gets."""
    return int("evaluate" in todo) + (sum(a in todo for a in HEAVY) if name in heavy else 0)


#: What forked workers inherit from the parent: the loaded models and the run's choices.
_SHARED: dict[str, Any] = {}


def share_with_workers(models: dict, settings: Any, labels: dict, todo: set[str], heavy: set[str],
                       events: Any = None, overrides: Optional[dict] = None) -> None:
    """Set what :func:`analyse_in_worker` reads; call before forking the workers. ``events``: a
    multiprocessing queue that receives ``(name, stage, finished)`` as each stage starts and ends.
    ``overrides``: ``{name: (settings, todo)}`` for checkpoints analysed with other settings (the
    seed tables' pass)."""
    _SHARED.update(models=models, settings=settings, labels=labels, todo=todo, heavy=heavy, events=events,
                   overrides=overrides or {})


def analyse_in_worker(name: str) -> tuple[str, Optional[pd.DataFrame], dict[str, list[pd.DataFrame]], dict[str, float]]:
    """One job in a forked worker process (on one torch thread): evaluate and/or analyse ``name``.

    Workers are forked, not spawned, so they inherit the loaded models and nothing is re-imported
    (a user's script without an ``if __name__ == "__main__"`` guard keeps working).
    """
    import torch

    torch.set_num_threads(1)
    model, info = _SHARED["models"][name]
    settings, todo = _SHARED.get("overrides", {}).get(name, (_SHARED["settings"], _SHARED["todo"]))
    events = _SHARED.get("events")

    def on_stage(stage: str, finished: bool) -> None:
        if events is not None:
            events.put((name, stage, finished))

    seconds: dict[str, float] = {}
    ev = None
    if "evaluate" in todo:
        on_stage("evaluate", False)
        t0 = time.perf_counter()
        ev = evaluate_checkpoint(name, model, info, settings)
        seconds["evaluate"] = time.perf_counter() - t0
        on_stage("evaluate", True)
    tables: dict[str, list[pd.DataFrame]] = {}
    if name in _SHARED["heavy"]:
        tables, more = analyse_checkpoint(name, model, info, settings, _SHARED["labels"][name], todo,
                                          on_stage=on_stage)
        seconds.update(more)
    return name, ev, tables, seconds


__all__ = ["ANALYSES", "HEAVY", "CONTROLS", "DEFAULT_ANALYSES", "analyse_checkpoint", "stages", "evaluate_checkpoint", "analyse_in_worker", "share_with_workers",
           "default_problems"]
