"""Every analysis of one checkpoint, as tables: the unit of work ``reproduce`` runs per model.

One function, :func:`analyse_checkpoint`, so that ``reproduce`` can run checkpoints one after the
other or in worker processes (one torch thread each: these small models are fastest on one thread,
and two processes use both cores of a small machine). The analyses and what each one runs are
registered in :mod:`interp_norm.report.registry`; this module only runs the chosen ones in registry
order, labels the rows and times them.

Besides the paper's measurements the registry runs the controls that make them mean something
(the matched-count noise group, noise placed after a QK/QKV norm, forward-pass collapse,
the temperature sweep; collapse per head, the noise-drop decomposition, the
consequence of collapse); see each entry's ``help``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional

import pandas as pd

from interp_norm.report.registry import ANALYSES, CONTROLS, DEFAULT_ANALYSES, HEAVY, Job, default_problems, each, get

Stage = Callable[[str, bool], None]


def job_for(name: str, model: Any, info: Any, settings: Any, label: str = "", progress: bool = False) -> Job:
    """The :class:`~interp_norm.report.registry.Job` of a loaded checkpoint (``info`` from ``interp_norm.load_with_info``)."""
    return Job(name=name, model=model, task=info.task, attn_norm=info.model_cfg.attn_norm, label=label or name,
               settings=settings, progress=progress)


def _timed(analysis: str, run: Callable[[], Any], seconds: dict[str, float], on_stage: Optional[Stage]) -> Any:
    if on_stage is not None:
        on_stage(analysis, False)
    t0 = time.perf_counter()
    out = run()
    seconds[analysis] = time.perf_counter() - t0
    if on_stage is not None:
        on_stage(analysis, True)
    return out


def evaluate_checkpoint(job: Job) -> pd.DataFrame:
    """Accuracy per split on fresh seeded test sets (not the numbers recorded at training time)."""
    return pd.concat([df for _, df in get("evaluate").run(job)], ignore_index=True)


def analyse_checkpoint(job: Job, todo: Optional[set[str]] = None, *,
                       on_stage: Optional[Stage] = None) -> tuple[dict[str, list[pd.DataFrame]], dict[str, float]]:
    """The heavy analyses of one checkpoint: ``({table key: [frames]}, {analysis: seconds})``.

    ``todo``: analysis names (default: every heavy one). ``on_stage(analysis, finished)`` is called
    as each analysis starts and ends (``reproduce``'s progress bar ticks per analysis, not per
    checkpoint). Table keys are those each analysis yields (see its ``tables``); every frame carries
    ``checkpoint`` (and ``variant`` where the analysis does not set it).
    """
    todo = set(HEAVY) if todo is None else set(todo) & set(HEAVY)
    tables: dict[str, list[pd.DataFrame]] = {}
    seconds: dict[str, float] = {}
    for analysis in each(todo):
        for key, df in _timed(analysis.name, lambda: list(analysis.run(job)), seconds, on_stage):
            tables.setdefault(key, []).append(df)
    return tables, seconds


def stages(name: str, todo: set[str], heavy: set[str]) -> int:
    """Progress ticks of one checkpoint: evaluate (if run) plus each heavy analysis it gets."""
    return int("evaluate" in todo) + (sum(a in todo for a in HEAVY) if name in heavy else 0)


def run_checkpoint(job: Job, todo: set[str], analysed: bool, on_stage: Optional[Stage] = None,
                   ) -> tuple[Optional[pd.DataFrame], dict[str, list[pd.DataFrame]], dict[str, float]]:
    """Evaluate ``job`` (if ``"evaluate"`` is in ``todo``) and, if ``analysed``, run its heavy analyses:
    ``(evaluation or None, tables, seconds)``."""
    seconds: dict[str, float] = {}
    ev = _timed("evaluate", lambda: evaluate_checkpoint(job), seconds, on_stage) if "evaluate" in todo else None
    tables: dict[str, list[pd.DataFrame]] = {}
    if analysed:
        tables, more = analyse_checkpoint(job, todo, on_stage=on_stage)
        seconds.update(more)
    return ev, tables, seconds


@dataclass(frozen=True)
class WorkerPlan:
    """What a forked worker needs, handed to it explicitly (:func:`start_worker`, the pool's initializer):
    the loaded models, their labels, the run's settings and analyses, the checkpoints that get the
    heavy analyses, per-checkpoint ``overrides`` ``{name: (settings, todo)}`` (the seed tables' pass)
    and ``events``: a multiprocessing queue that receives ``(name, stage, finished)`` as each stage
    starts and ends."""

    models: Mapping[str, tuple[Any, Any]]
    labels: Mapping[str, str]
    settings: Any
    todo: frozenset
    heavy: frozenset
    events: Any = None
    overrides: Mapping[str, tuple[Any, Any]] = field(default_factory=dict)


#: The plan of THIS worker process, set once by :func:`start_worker` in the child (never in the parent).
_PLAN: Optional[WorkerPlan] = None


def start_worker(plan: WorkerPlan) -> None:
    """Pool initializer: a forked worker inherits ``plan`` through the fork (nothing is pickled, the
    models are not copied) and keeps it for :func:`analyse_in_worker`; one torch thread per worker."""
    import torch

    global _PLAN
    _PLAN = plan
    torch.set_num_threads(1)


def analyse_in_worker(name: str) -> tuple[str, Optional[pd.DataFrame], dict[str, list[pd.DataFrame]], dict[str, float]]:
    """One job in a forked worker process: evaluate and/or analyse ``name`` under the worker's plan.

    Workers are forked, not spawned, so they inherit the loaded models and nothing is re-imported
    (a user's script without an ``if __name__ == "__main__"`` guard keeps working).
    """
    plan = _PLAN
    if plan is None:
        raise RuntimeError("analyse_in_worker runs in a worker started with start_worker(plan)")
    model, info = plan.models[name]
    settings, todo = plan.overrides.get(name, (plan.settings, plan.todo))

    def on_stage(stage: str, finished: bool) -> None:
        if plan.events is not None:
            plan.events.put((name, stage, finished))

    job = job_for(name, model, info, settings, plan.labels[name])
    ev, tables, seconds = run_checkpoint(job, set(todo), name in plan.heavy, on_stage)
    return name, ev, tables, seconds


__all__ = ["ANALYSES", "HEAVY", "CONTROLS", "DEFAULT_ANALYSES", "Job", "job_for", "analyse_checkpoint", "stages",
           "evaluate_checkpoint", "run_checkpoint", "WorkerPlan", "start_worker", "analyse_in_worker",
           "default_problems"]
