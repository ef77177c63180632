"""How ``reproduce`` runs its checkpoints: one after the other in this process, or side by side in
forked worker processes (:mod:`interp_norm.report.worker` holds the unit of work)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence


@dataclass
class Plan:
    """Who gets what: the loaded models in report order, their labels, the analyses (``todo``; the seed
    tables' pass: ``seed_settings``/``seed_todo`` on ``seed_pass``), the checkpoints with the heavy
    analyses and the jobs (checkpoints with any work)."""

    models: dict
    labels: dict
    settings: Any
    todo: set
    seed_settings: Any
    seed_todo: set
    heavy: list
    seed_pass: list
    jobs: list

    def of(self, name: str) -> tuple[Any, set, bool]:
        """(settings, analyses, heavy?) of one job."""
        if name in self.seed_pass:
            return self.seed_settings, self.seed_todo, True
        return self.settings, self.todo, name in self.heavy

    def stages(self, name: str) -> int:
        from interp_norm.report.worker import stages

        return stages(name, self.seed_todo, {name}) if name in self.seed_pass else stages(name, self.todo, set(self.heavy))


def run_serially(plan: Plan, names: Sequence[str], collect: Callable, on_stage: Callable) -> None:
    from interp_norm.report.worker import job_for, run_checkpoint

    for name in names:
        model, info = plan.models[name]
        settings, todo, analysed = plan.of(name)
        job = job_for(name, model, info, settings, plan.labels[name])

        def stage(step: str, finished: bool, name: str = name) -> None:
            on_stage(name, step, finished)

        collect(name, *run_checkpoint(job, todo, analysed, stage))


def run_in_workers(plan: Plan, names: Sequence[str], n_workers: int, collect: Callable, on_stage: Callable) -> None:
    """``names`` in forked worker processes. On any exception in the parent (Ctrl-C included) the
    workers are terminated at once instead of finishing their checkpoints."""
    import multiprocessing as mp
    from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait

    from interp_norm.report.worker import WorkerPlan, analyse_in_worker, start_worker

    ctx = mp.get_context("fork")
    events = ctx.SimpleQueue()  # (name, stage, finished) from the workers, as each stage starts and ends

    def drain() -> None:
        while not events.empty():
            on_stage(*events.get())

    wplan = WorkerPlan(plan.models, plan.labels, plan.settings, frozenset(plan.todo),
                       frozenset(plan.heavy) | frozenset(plan.seed_pass), events,
                       overrides={n: (plan.seed_settings, plan.seed_todo) for n in plan.seed_pass})
    pool = ProcessPoolExecutor(n_workers, mp_context=ctx, initializer=start_worker, initargs=(wplan,))
    try:
        pending = {pool.submit(analyse_in_worker, name) for name in names}
        while pending:
            done, pending = wait(pending, timeout=0.25, return_when=FIRST_COMPLETED)
            drain()
            for f in done:
                collect(*f.result())
        drain()
    except BaseException:
        procs = list((getattr(pool, "_processes", None) or {}).values())
        for proc in procs:
            proc.terminate()
        for proc in procs:  # SIGTERM, then SIGKILL for a worker that does not stop within a second
            proc.join(timeout=1)
            if proc.is_alive():
                proc.kill()
        pool.shutdown(wait=False, cancel_futures=True)
        raise
    pool.shutdown(wait=True)


__all__ = ["Plan", "run_serially", "run_in_workers"]
