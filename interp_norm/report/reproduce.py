"""The paper's whole analysis on the shipped checkpoints, as CSVs and one dashboard (``interp-norm reproduce``).

Orchestration only: every number comes from an analysis module's one-call function
(:func:`~interp_norm.core.scoring.evaluate`, :func:`~interp_norm.noise.run_noise`,
:func:`~interp_norm.noise.run_collapse`, :func:`~interp_norm.geometry.run_geometry`, the circuits
package); this module picks sizes, labels the models, times the stages and writes the report
through :mod:`interp_norm.training.io`. Its command-line options live in :mod:`interp_norm.cli`.

Which models get which analysis: evaluation, the model card and training curves cover every
checkpoint; the heavier analyses (:mod:`interp_norm.report.worker`: circuits, noise with its
controls, collapse, forward-pass collapse, temperature sweep, geometry, attention) run on every
seed of every architecture at the reference scaling (:func:`default_analysed`), so each figure can
show its spread over seeds; ``analyse`` names others, ``analyse="all"`` takes every checkpoint.
The shipped set is read up to seed 1 (``seed_compare.DEFAULT_SEEDS``: seeds 0 and 1 of each
architecture and scaling), which keeps ``make reproduce`` within its budget however many seeds ship.

``all_seeds=True`` (``interp-norm reproduce --all-seeds``) reads every seed and runs the seed
tables' analyses on every checkpoint the heavy ones skip (:mod:`interp_norm.stats.seed_compare`, which
also builds the seed tables every run writes: ``seed_comparisons``, ``seed_matched_id``).
"""

from __future__ import annotations

import os
import platform
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Mapping, Optional, Sequence, Union

import pandas as pd

from interp_norm.errors import CheckpointNotFoundError, ConfigError, OutputDirError, check_positive_int

__all__ = [
    "Settings",
    "Report",
    "default_analysed",
    "run_analyses",
    "write_report",
    "reproduce",
    "make_dashboard",
]
from interp_norm.report.registry import ANALYSES, DEFAULT_ANALYSES  # noqa: E402  (standard library only)
from interp_norm.stats.seed_compare import DEFAULT_SEEDS, SEED_ANALYSES, seed_pass_settings, seed_tables  # noqa: E402,F401
from interp_norm.report.partial import PartialStore, fingerprint  # noqa: E402
from interp_norm.report.jobs import Plan, run_in_workers, run_serially  # noqa: E402

#: Settings of the run as a whole (the analyses' own sizes come from the registry).
RUN_FIELDS: dict[str, Any] = dict(workers=None, seed=0, analyses=DEFAULT_ANALYSES)


def _settings_from(values: dict[str, Any]) -> "Settings":
    return Settings(**values)


class Settings:
    """Sizes of every analysis: :meth:`full` is the default run (< 3 min on 2 cores), :meth:`quick` is for tests.

    The fields are :data:`RUN_FIELDS` (``workers``: processes, None = up to 2, see :func:`run_analyses`;
    ``seed``; ``analyses``: names from :data:`interp_norm.report.registry.ANALYSES`) and every registered
    analysis's ``sizes`` (``noise_levels``, ``collapse_examples``, ...), read as attributes
    (``settings.noise_levels``). Frozen: :meth:`replace` returns a changed copy. A field whose
    full-run value is an integer must be a positive integer (:class:`ConfigError` otherwise).
    """

    __slots__ = ("_values",)

    def __init__(self, _quick: bool = False, **values: Any) -> None:
        from interp_norm.report.registry import sizes

        full = sizes()
        known = {**RUN_FIELDS, **sizes(quick=_quick)}
        unknown = sorted(set(values) - set(known))
        if unknown:
            raise ConfigError(f"unknown Settings fields {unknown}; choose from {sorted(known)}")
        merged = {k: values.get(k, v) for k, v in known.items()}
        merged = {k: v() if callable(v) else v for k, v in merged.items()}  # registry.Lazy defaults
        for name, default in full.items():
            if isinstance(default, int) and not isinstance(default, bool):
                check_positive_int(merged[name], f"Settings.{name}")
        merged["analyses"] = tuple(merged["analyses"])
        bad = [a for a in merged["analyses"] if a not in ANALYSES]
        if bad:
            raise ConfigError(f"unknown analyses {bad}; choose from {ANALYSES}")
        object.__setattr__(self, "_values", merged)

    def __getattr__(self, name: str) -> Any:
        try:
            return object.__getattribute__(self, "_values")[name]
        except KeyError:
            raise AttributeError(f"Settings has no field {name!r}") from None

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("Settings is frozen; use settings.replace(...)")

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Settings) and self._values == other._values

    def __hash__(self) -> int:
        return hash(tuple(self._values.items()))

    def __reduce__(self) -> tuple:
        return (_settings_from, (self._values,))

    def __repr__(self) -> str:
        return "Settings(" + ", ".join(f"{k}={v!r}" for k, v in self._values.items()) + ")"

    def as_dict(self) -> dict[str, Any]:
        """Every field and its value (run.json's ``settings``)."""
        return dict(self._values)

    @classmethod
    def full(cls, **overrides: Any) -> "Settings":
        return cls(**overrides)

    @classmethod
    def quick(cls, **overrides: Any) -> "Settings":
        """Tiny sizes: every code path, seconds instead of minutes (numbers are noisy)."""
        return cls(_quick=True, **overrides)

    def replace(self, **changes: Any) -> "Settings":
        return Settings(**{**self._values, **changes})


@dataclass
class Report:
    """Everything ``reproduce`` computed: the tables (each written as ``<key>.csv``) and run facts."""

    tables: dict[str, pd.DataFrame] = field(default_factory=dict)
    checkpoints: pd.DataFrame = field(default_factory=pd.DataFrame)
    timings: dict[str, float] = field(default_factory=dict)
    settings: Optional[Settings] = None
    notes: list[str] = field(default_factory=list)
    threads: Optional[int] = None  # torch threads the analyses ran with (per worker process: 1)
    workers: int = 1  # processes that analysed checkpoints side by side

    @property
    def total_seconds(self) -> float:
        return float(sum(self.timings.values()))


# ----------------------------------------------------------------------------- loading


def _load(spec: str, device: str = "cpu") -> tuple[str, Any, Any]:
    """(display name, model, info) for a checkpoint folder or a pretrained name."""
    from interp_norm.anatomy.loading import load_with_info
    from interp_norm.training.checkpoints import looks_like_path

    model, info = load_with_info(spec, device=device, kind="interp_norm")
    if not looks_like_path(spec):
        return spec, model, info
    name = Path(spec).resolve().name
    if name.startswith("step-"):  # a step folder inside a run folder: name it after the run
        name = Path(spec).resolve().parent.name
    return name, model, info


def _load_models(checkpoints: Optional[Sequence[str]] = None, device: str = "cpu") -> dict[str, tuple[Any, Any]]:
    """``{name: (model, info)}`` for checkpoint folders / pretrained names; None: the shipped
    reference set (``list_pretrained()["set"] == "reference"``: every architecture trained alike,
    so its tables compare like with like; other sets are named explicitly)."""
    from interp_norm.training.checkpoints import list_pretrained, pretrained_dir

    if checkpoints is None:
        listed = list_pretrained()
        # a folder that cannot be read has no set: keep it, so loading it says what is wrong
        checkpoints = list(listed.loc[listed["set"].fillna("reference") == "reference", "name"])
        if not checkpoints:
            raise CheckpointNotFoundError(
                f"no shipped checkpoints in {pretrained_dir()}; pass checkpoint folders explicitly, set "
                "INTERP_NORM_DATA to a data folder holding checkpoints/, or train one with 'interp-norm train'"
            )
    if isinstance(checkpoints, (str, os.PathLike)):
        checkpoints = [str(checkpoints)]
    if not checkpoints:
        raise ConfigError("give at least one checkpoint (a folder or a pretrained name)")
    out: dict[str, tuple[Any, Any]] = {}
    for spec in checkpoints:
        name, model, info = _load(str(spec), device)
        base, k = name, 2
        while name in out:  # two folders with the same name: keep both
            name, k = f"{base}-{k}", k + 1
        out[name] = (model, info)
    return out



_ARCH_ORDER = {"pre": 0, "qkv": 1, "qk": 2, "none": 3}


def _arch_key(name: str, info: Any) -> tuple:
    a = info.model_cfg.attn_norm
    return (_ARCH_ORDER.get(a, 9), a, info.model_cfg.calibration != "none", name != a, info.model_cfg.seed, name)


def default_analysed(models: Mapping[str, tuple[Any, Any]]) -> list[str]:
    """Every seed of every architecture at the reference scaling (``calibration="none"``).

    Checkpoints trained with the paper's Checkpoint calibration are evaluated (their accuracy per
    split is the with/without-calibration comparison) but not put through the heavy analyses by
    default; if every checkpoint is calibrated, all are analysed.
    """
    names = [n for n, (_, info) in models.items() if info.model_cfg.calibration == "none"] or list(models)
    return sorted(names, key=lambda n: _arch_key(n, models[n][1]))


# ----------------------------------------------------------------------------- running


def _concat(frames: Sequence[pd.DataFrame]) -> pd.DataFrame:
    frames = [f for f in frames if f is not None and len(f)]
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()


def _choose_heavy(models: Mapping[str, tuple[Any, Any]], analyse: Any, explicit: bool) -> list[str]:
    if analyse is None:
        return list(models) if explicit else default_analysed(models)
    if isinstance(analyse, str) and analyse == "all":
        return list(models)
    heavy = [analyse] if isinstance(analyse, str) else list(analyse)
    unknown = [h for h in heavy if h not in models]
    if unknown:
        raise ConfigError(f"cannot analyse {unknown}: not among the loaded checkpoints {list(models)}")
    return heavy


def choose_scopes(models: Mapping[str, tuple[Any, Any]], analyse: Any = None, explicit: bool = False,
                  all_seeds: bool = False) -> tuple[list[str], list[str]]:
    """``(heavy, seed_pass)``: the checkpoints for every heavy analysis, and those for the seed tables'
    pass only (``all_seeds``: every other one). For the shipped set without ``analyse``, the heavy
    analyses keep to seeds below ``DEFAULT_SEEDS`` even when every seed is read."""
    heavy = [n for n in _choose_heavy(models, analyse, explicit) if analyse is not None or explicit or not all_seeds
             or models[n][1].model_cfg.seed < DEFAULT_SEEDS]
    return heavy, [n for n in models if n not in heavy] if all_seeds else []


def _workers(workers: Optional[int], n_jobs: int) -> int:
    """Worker processes: up to 2 (the 2 cores) by default; 1 where processes cannot be forked."""
    import multiprocessing as mp

    if n_jobs <= 1 or "fork" not in mp.get_all_start_methods():
        return 1
    if workers is None:
        return max(1, min(2, os.cpu_count() or 1, n_jobs))
    check_positive_int(workers, "workers")
    return min(workers, n_jobs)


@contextmanager
def _torch_threads(threads: Optional[int]) -> Iterator[None]:
    """Run with ``threads`` torch threads (None: as they are), restored afterwards."""
    import torch

    if threads is None:
        yield
        return
    check_positive_int(threads, "threads")
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _plan(report: Report, checkpoints: Any, analyse: Any, device: str, all_seeds: bool) -> Plan:
    """Load the models and decide the scopes; fills ``report.checkpoints`` (and a note on left-out seeds)."""
    from interp_norm.report.plots import variant_label

    settings = report.settings or Settings.full()
    explicit = checkpoints is not None
    models = dict(checkpoints) if isinstance(checkpoints, Mapping) else _load_models(checkpoints, device=device)
    if not explicit:  # the shipped set: Pre-Norm first, then QKV-Norm, QK-Norm, No-Norm (seeds in order)
        models = dict(sorted(models.items(), key=lambda kv: _arch_key(kv[0], kv[1][1])))
        later = [n for n, (_, info) in models.items() if info.model_cfg.seed >= DEFAULT_SEEDS and not all_seeds]
        if later:
            models = {n: m for n, m in models.items() if n not in later}
            report.notes.append(f"further seeds left out: {', '.join(later)} ('reproduce --all-seeds' analyses them)")
    todo = set(settings.analyses)
    seed_settings = seed_pass_settings(settings)
    seed_todo = set(seed_settings.analyses)
    heavy, seed_pass = choose_scopes(models, analyse, explicit, all_seeds and bool(seed_todo - {"evaluate"}))
    labels = {n: variant_label(n, info.model_cfg.attn_norm) for n, (_, info) in models.items()}
    report.checkpoints = pd.DataFrame([
        dict(checkpoint=n, label=labels[n], attn_norm=info.model_cfg.attn_norm, seed=info.model_cfg.seed,
             calibration=info.model_cfg.calibration, step=info.step, analysed=n in heavy or n in seed_pass,
             scope="all analyses" if n in heavy else "seed tables" if n in seed_pass else "evaluation",
             path=str(info.path))
        for n, (_, info) in models.items()
    ])
    jobs = [n for n in models if "evaluate" in todo or n in heavy or n in seed_pass]
    return Plan(models, labels, settings, todo, seed_settings, seed_todo, list(heavy), list(seed_pass), jobs)


def _assemble(report: Report, plan: Plan, evals: dict, tables: dict) -> None:
    """The report's tables from every checkpoint's, in checkpoint order, plus those over all of them."""
    from interp_norm.report.card import model_card
    from interp_norm.report.registry import each

    T = report.tables
    order = list(plan.models)  # tables in checkpoint order, whatever order the workers finished in
    T["evaluation"] = _concat([evals[n] for n in order if n in evals])
    T["model_card"] = model_card(plan.models, T["evaluation"] if len(T["evaluation"]) else None)
    T["training_curves"] = _concat([
        _front_curve(info.curve, n, info.model_cfg.attn_norm) for n, (_, info) in plan.models.items() if len(info.curve)
    ])
    keys = list(dict.fromkeys(k for n in order for k in tables.get(n, {})))
    for key in keys:
        T[key] = _concat([f for n in order for f in tables.get(n, {}).get(key, [])])
    for analysis in each(plan.todo | plan.seed_todo):  # tables over every checkpoint (thresholds, summaries)
        if analysis.combine is not None:
            T.update(analysis.combine(T, report.notes))
    if len(report.checkpoints):
        from interp_norm.stats.seed_summary import per_checkpoint, seed_spread

        T["seed_numbers"] = per_checkpoint(T, report.checkpoints[report.checkpoints["checkpoint"].isin(plan.jobs)])
        T["seed_spread"] = seed_spread(T["seed_numbers"])
        t = time.perf_counter()
        T.update(seed_tables(T, report.checkpoints, plan.settings.seed))
        report.timings["seed_tables"] = time.perf_counter() - t
    report.tables = {k: v for k, v in T.items() if v is not None and len(v)}


def run_analyses(
    checkpoints: Optional[Union[Sequence[str], Mapping[str, tuple[Any, Any]]]] = None,
    settings: Optional[Settings] = None,
    analyse: Optional[Union[str, Sequence[str]]] = None,
    *,
    progress: Union[bool, str] = True,
    threads: Optional[int] = None,
    workers: Optional[int] = None,
    device: str = "cpu",
    all_seeds: bool = False,
    store: Optional[PartialStore] = None,
) -> Report:
    """Run every analysis and return the :class:`Report` (no files written, unless ``store``).

    ``checkpoints``: names/folders, or already loaded ``{name: (model, info)}``; None = the shipped reference set (``_load_models``).
    ``analyse``: checkpoint names for the heavy analyses, ``"all"``, or None (see
    :func:`default_analysed`; every checkpoint when they were given explicitly). ``threads``: torch
    threads for the run (restored afterwards). ``workers``: forked processes that analyse
    checkpoints side by side, each on one torch thread (default: up to 2; 1 runs everything in this
    process; on a ``device`` other than cpu, models are loaded there and analysed in this process).
    Every analysis is seeded, so results do not depend on the number of workers. ``progress``: show
    the bar (a string: its label; default "reproduce"); it ticks once per analysis of each checkpoint.
    ``all_seeds``: read every seed of the shipped set (default: seeds below ``DEFAULT_SEEDS``) and
    run ``SEED_ANALYSES`` on every checkpoint the heavy analyses skip (see the module docstring).
    ``store``: a :class:`~interp_norm.report.partial.PartialStore`; each checkpoint's tables are written
    there as it finishes, and checkpoints already there with the same settings are not run again.
    """
    import torch
    from tqdm.auto import tqdm

    with _torch_threads(threads):
        settings = settings or Settings.full()
        report = Report(settings=settings, threads=torch.get_num_threads())
        t0 = time.perf_counter()
        plan = _plan(report, checkpoints, analyse, device, all_seeds)
        report.timings["load"] = time.perf_counter() - t0
        n_workers = _workers(workers if workers is not None else settings.workers, len(plan.jobs))
        if str(device) != "cpu":  # forked workers cannot share a CUDA context
            n_workers = 1
        evals: dict[str, pd.DataFrame] = {}
        tables: dict[str, dict[str, list[pd.DataFrame]]] = {}
        keys = {n: fingerprint(plan.models[n][1], *plan.of(n)) for n in plan.jobs}

        def collect(name: str, ev: Optional[pd.DataFrame], t: dict, seconds: dict, fresh: bool = True) -> None:
            if fresh and store is not None:
                store.save(name, keys[name], (ev, t, seconds))
            if ev is not None:
                evals[name] = ev
            tables[name] = t
            for k, v in seconds.items():
                report.timings[k] = report.timings.get(k, 0.0) + v

        stored = {n: r for n in plan.jobs if store is not None and (r := store.load(n, keys[n])) is not None}
        todo = [n for n in plan.jobs if n not in stored]
        # no global torch.no_grad(): attribution patching needs gradients (each analysis manages its own)
        with tqdm(total=sum(plan.stages(n) for n in plan.jobs), desc=progress if isinstance(progress, str) else "reproduce",
                  unit="stage", disable=not progress, dynamic_ncols=True) as bar:
            for name, result in stored.items():  # finished by an earlier, interrupted run
                collect(name, *result, fresh=False)
                bar.update(plan.stages(name))

            def on_stage(name: str, stage: str, finished: bool) -> None:
                if finished:
                    bar.update(1)
                else:
                    bar.set_postfix_str(f"{name}: {stage}")

            if n_workers == 1 or len(todo) <= 1:
                run_serially(plan, todo, collect, on_stage)
            else:
                run_in_workers(plan, todo, min(n_workers, len(todo)), collect, on_stage)
        _assemble(report, plan, evals, tables)
        if checkpoints is None:  # the shipped set: its addition circuit from the kept 24-checkpoint tables
            from interp_norm.report.shipped_circuit import shipped_circuit_tables

            report.tables.update(shipped_circuit_tables())
        report.workers = n_workers
        report.timings["total"] = time.perf_counter() - t0
        return report


def _front_curve(curve: pd.DataFrame, name: str, attn_norm: str) -> pd.DataFrame:
    df = curve.copy()
    df.insert(0, "checkpoint", name)
    df.insert(1, "attn_norm", attn_norm)
    return df


# ----------------------------------------------------------------------------- writing


def _timings_table(report: Report) -> pd.DataFrame:
    return pd.DataFrame([dict(stage=k, seconds=round(v, 3)) for k, v in report.timings.items()])


def write_report(report: Report, out: Union[str, os.PathLike], dashboard: bool = True) -> dict[str, Path]:
    """Write every table as ``<key>.csv``, ``timings.csv``, ``run.json`` and ``dashboard.html`` into ``out``."""
    from interp_norm.training.io import ensure_writable_dir, write_csv, write_json, write_text_atomic

    out = ensure_writable_dir(out)
    written: dict[str, Path] = {}
    for key, df in report.tables.items():
        written[key] = write_csv(out / f"{key}.csv", df)
    written["timings"] = write_csv(out / "timings.csv", _timings_table(report))
    if len(report.checkpoints):
        written["checkpoints"] = write_csv(out / "checkpoints.csv", report.checkpoints)
    written["run"] = write_json(out / "run.json", run_facts(report))
    if dashboard:
        from interp_norm.report.dashboard import dashboard_html

        written["dashboard"] = write_text_atomic(out / "dashboard.html", dashboard_html(report), durable=False)
    return written


def run_facts(report: Report) -> dict:
    """Where and how the run happened (for run.json and the dashboard's footer)."""
    import torch

    import interp_norm

    return dict(
        interp_norm=interp_norm.__version__, python=platform.python_version(), torch=torch.__version__,
        machine=platform.machine(), cpus=os.cpu_count(), torch_threads=report.threads, workers=report.workers,
        seconds=round(report.timings.get("total", report.total_seconds), 1),
        all_seeds=bool(len(report.checkpoints) and "scope" in report.checkpoints
                       and (report.checkpoints["scope"] == "seed tables").any()),
        settings=report.settings.as_dict() if report.settings else None,
        checkpoints=report.checkpoints.to_dict("records") if len(report.checkpoints) else [],
        notes=report.notes,
    )


def reproduce(
    out: Union[str, os.PathLike] = "report",
    checkpoints: Optional[Sequence[str]] = None,
    *,
    quick: bool = False,
    settings: Optional[Settings] = None,
    analyse: Optional[Union[str, Sequence[str]]] = None,
    progress: bool = True,
    threads: Optional[int] = 1,
    device: str = "cpu",
    all_seeds: bool = False,
) -> Report:
    """The main job: analyse the (shipped) checkpoints and write ``out/`` (CSVs + dashboard.html).

    ``all_seeds``: every seed of the shipped set, with the seed tables' analyses on the checkpoints
    the heavy analyses skip (:func:`run_analyses`); slower than the default run.

    Interruptible: each checkpoint's tables are written to ``out/partial/`` as it finishes
    (:mod:`interp_norm.report.partial`), and a run into the same ``out`` skips the checkpoints found
    there with the same checkpoint files and settings (every analysis is seeded, so their tables are
    what a new run would compute). The folder is removed once the report is written.

    Fails with :class:`OutputDirError` before any work if ``out`` cannot be written.
    """
    from interp_norm.training.io import ensure_writable_dir

    ensure_writable_dir(out)
    settings = settings or (Settings.quick() if quick else Settings.full())
    store = PartialStore(Path(out))
    report = run_analyses(checkpoints, settings, analyse=analyse, progress=progress, threads=threads, device=device,
                          all_seeds=all_seeds, store=store)
    t = time.perf_counter()
    write_report(report, out)
    store.clear()  # the report is whole: nothing left to resume
    report.timings["write"] = time.perf_counter() - t
    report.timings["total"] += report.timings["write"]
    # timings.csv and run.json again, now with the write time included
    write_report_meta(report, out)
    return report


def write_report_meta(report: Report, out: Union[str, os.PathLike]) -> None:
    """Rewrite ``timings.csv`` and ``run.json`` (after the write time is known)."""
    from interp_norm.training.io import write_csv, write_json

    out = Path(out)
    write_csv(out / "timings.csv", _timings_table(report))
    write_json(out / "run.json", run_facts(report))


def make_dashboard(
    checkpoints: Sequence[str],
    out: Union[str, os.PathLike] = "dashboard.html",
    *,
    quick: bool = False,
    settings: Optional[Settings] = None,
    analyse: Optional[Union[str, Sequence[str]]] = None,
    progress: bool = True,
    threads: Optional[int] = 1,
    device: str = "cpu",
) -> Path:
    """Analyse any checkpoints and write their dashboard (one HTML file; no CSVs).

    Interruptible like :func:`reproduce`: each checkpoint's tables go to ``partial/`` beside the page
    as they finish, a run with the same ``out`` skips those, and the folder is removed once the page is
    written.

    Fails with :class:`OutputDirError` before any work if ``out`` is a folder or cannot be written.
    """
    from interp_norm.report.dashboard import write_dashboard
    from interp_norm.training.io import ensure_writable_dir

    if isinstance(checkpoints, (str, os.PathLike)):
        checkpoints = [str(checkpoints)]
    out = Path(out)
    if out.is_dir():
        raise OutputDirError(f"{str(out)!r} is a folder; give a file name such as dashboard.html")
    ensure_writable_dir(out.parent if str(out.parent) else Path("."))  # before any work
    settings = settings or (Settings.quick() if quick else Settings.full())
    store = PartialStore(out.parent if str(out.parent) else Path("."))
    report = run_analyses(list(checkpoints), settings, analyse=analyse, progress="dashboard" if progress else False,
                          threads=threads, device=device, store=store)
    path = write_dashboard(report, out, csv_links=False)
    store.clear()  # the page is whole: nothing left to resume
    return path
