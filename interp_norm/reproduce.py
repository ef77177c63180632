"""The paper's whole analysis on the shipped checkpoints, as CSVs and one dashboard (``interp-norm reproduce``).

Orchestration only: every number comes from an analysis module's one-call function
(:func:`~interp_norm.evaluate.evaluate`, :func:`~interp_norm.noise.run_noise`,
:func:`~interp_norm.noise.run_collapse`, :func:`~interp_norm.geometry.run_geometry`, the circuits
package); this module picks sizes, labels the models, times the stages and writes the report
through :mod:`interp_norm.io`. Its command-line options live in :mod:`interp_norm.cli`.

Which models get which analysis: evaluation, the model card and training curves cover every
checkpoint; the heavier analyses (circuits, noise, collapse, geometry, attention) run on one
checkpoint per architecture (the one named like the architecture, ``pre``/``qkv``/..., else its
lowest seed) unless ``analyse`` names others. That keeps the whole run within the 3-minute budget
on 2 CPU cores while covering the paper's Pre-Norm vs QKV-Norm comparison; ``analyse="all"``
runs everything on every checkpoint.
"""

from __future__ import annotations

import dataclasses
import os
import platform
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence, Union

import pandas as pd

from interp_norm.errors import CheckpointNotFoundError, ConfigError, OutputDirError

__all__ = [
    "Settings",
    "Report",
    "load_models",
    "default_analysed",
    "run_analyses",
    "write_report",
    "reproduce",
    "make_dashboard",
]

ANALYSES = ("evaluate", "circuits", "noise", "collapse", "geometry", "attention")


def _noise_default(name: str) -> tuple[float, ...]:
    """The noise module's default levels (one source; loaded when a Settings is made, not on import)."""
    from interp_norm import noise

    return tuple(getattr(noise, name))


def _hooks_default(name: str) -> tuple[str, ...]:
    from interp_norm import hooks

    return tuple(getattr(hooks, name))


@dataclass(frozen=True)
class Settings:
    """Sizes of every analysis. :meth:`full` is the default run (< 3 min on 2 cores), :meth:`quick` is for tests."""

    eval_size: int = 2048
    exact_match: bool = True
    noise_levels: tuple[float, ...] = field(default_factory=lambda: _noise_default("DEFAULT_NOISE_LEVELS"))
    noise_examples: int = 512
    noise_datasets: int = 3
    noise_rows: tuple[str, ...] = field(default_factory=lambda: _hooks_default("NOISED_ROWS"))
    collapse_levels: tuple[float, ...] = field(default_factory=lambda: _noise_default("DEFAULT_COLLAPSE_LEVELS"))
    collapse_examples: int = 512
    collapse_draws: int = 64
    collapse_strict_samples: int = 128
    geometry_examples: int = 256
    circuit_pairs: int = 64
    circuit_attention_problems: int = 256
    problems: tuple[str, ...] = ()  # attention problems; default: one per split
    seed: int = 0
    analyses: tuple[str, ...] = ANALYSES

    def __post_init__(self) -> None:
        for name in ("eval_size", "noise_examples", "noise_datasets", "collapse_examples", "collapse_draws",
                     "collapse_strict_samples", "geometry_examples", "circuit_pairs", "circuit_attention_problems"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ConfigError(f"Settings.{name} must be a positive integer, got {v!r}")
        bad = [a for a in self.analyses if a not in ANALYSES]
        if bad:
            raise ConfigError(f"unknown analyses {bad}; choose from {ANALYSES}")

    @classmethod
    def full(cls, **overrides: Any) -> "Settings":
        return cls(**overrides)

    @classmethod
    def quick(cls, **overrides: Any) -> "Settings":
        """Tiny sizes: every code path, seconds instead of minutes (numbers are noisy)."""
        base = dict(
            eval_size=32, exact_match=True, noise_levels=(0.0, 0.01, 0.1), noise_examples=24, noise_datasets=2,
            collapse_levels=(0.05, 0.2, 0.5), collapse_examples=16, collapse_draws=8, collapse_strict_samples=16,
            geometry_examples=24, circuit_pairs=6, circuit_attention_problems=16,
        )
        return cls(**{**base, **overrides})

    def replace(self, **changes: Any) -> "Settings":
        return dataclasses.replace(self, **changes)


@dataclass
class Report:
    """Everything ``reproduce`` computed: the tables (each written as ``<key>.csv``) and run facts."""

    tables: dict[str, pd.DataFrame] = field(default_factory=dict)
    checkpoints: pd.DataFrame = field(default_factory=pd.DataFrame)
    timings: dict[str, float] = field(default_factory=dict)
    settings: Optional[Settings] = None
    notes: list[str] = field(default_factory=list)
    threads: Optional[int] = None  # torch threads the analyses ran with

    @property
    def total_seconds(self) -> float:
        return float(sum(self.timings.values()))


# ----------------------------------------------------------------------------- loading


def _load(spec: str) -> tuple[str, Any, Any]:
    """(display name, model, info) for a checkpoint folder or a pretrained name."""
    from interp_norm.checkpoints import load_any, looks_like_path

    model, info = load_any(spec)
    if not looks_like_path(spec):
        return spec, model, info
    name = Path(spec).resolve().name
    if name.startswith("step-"):  # a step folder inside a run folder: name it after the run
        name = Path(spec).resolve().parent.name
    return name, model, info


def load_models(checkpoints: Optional[Sequence[str]] = None) -> dict[str, tuple[Any, Any]]:
    """``{name: (model, info)}`` for checkpoint folders / pretrained names; all shipped ones if None."""
    from interp_norm.checkpoints import list_pretrained, pretrained_dir

    if checkpoints is None:
        checkpoints = [n for n in list_pretrained()["name"]]
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
        name, model, info = _load(str(spec))
        base, k = name, 2
        while name in out:  # two folders with the same name: keep both
            name, k = f"{base}-{k}", k + 1
        out[name] = (model, info)
    return out


_ARCH_ORDER = {"pre": 0, "qkv": 1, "qk": 2, "none": 3}


def _arch_key(name: str, info: Any) -> tuple:
    a = info.model_cfg.attn_norm
    return (_ARCH_ORDER.get(a, 9), a, name != a, info.model_cfg.seed, name)


def default_analysed(models: Mapping[str, tuple[Any, Any]]) -> list[str]:
    """One checkpoint per architecture: the one named like it (``pre``), else the lowest seed."""
    best: dict[str, tuple] = {}
    for name, (_, info) in models.items():
        a = info.model_cfg.attn_norm
        key = (name != a, info.model_cfg.seed, name)
        if a not in best or key < best[a][0]:
            best[a] = (key, name)
    return [best[a][1] for a in sorted(best, key=lambda a: (_ARCH_ORDER.get(a, 9), a))]


def _default_problems(task: Any, n_ctx: int, seed: int) -> list[str]:
    """One problem per split that fits the model: the attention figure's default choices."""
    out = []
    for i, split in enumerate(("id", "interp", "extrap")):
        for k in range(50):
            p = task.sample_problems(1, split, seed=seed * 1000 + 17 * i + k)[0]
            if len(p.text) <= n_ctx:
                out.append(p.text)
                break
    return out


# ----------------------------------------------------------------------------- running


class _Clock:
    def __init__(self, report: Report, bar: Any):
        self.report, self.bar = report, bar

    def stage(self, name: str) -> "_Stage":
        return _Stage(self, name)


class _Stage:
    def __init__(self, clock: _Clock, name: str):
        self.clock, self.name = clock, name

    def __enter__(self) -> None:
        self.t0 = time.perf_counter()
        self.clock.bar.set_postfix_str(self.name)

    def __exit__(self, *exc: Any) -> None:
        t = self.clock.report.timings
        t[self.name] = t.get(self.name, 0.0) + time.perf_counter() - self.t0
        if exc[0] is None:
            self.clock.bar.update(1)


def _concat(frames: Sequence[pd.DataFrame]) -> pd.DataFrame:
    frames = [f for f in frames if f is not None and len(f)]
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()


def _front(df: pd.DataFrame, **cols: Any) -> pd.DataFrame:
    for i, (k, v) in enumerate(cols.items()):
        if k in df.columns:
            df = df.drop(columns=k)
        df.insert(i, k, v)
    return df


def _circuits(model: Any, task: Any, settings: Settings, progress: bool) -> dict[str, pd.DataFrame]:
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
        patch = _concat(frames)
        pairs = res.get("pairs")
        patch["template"] = str(pairs["clean"].iloc[0]) if pairs is not None and "clean" in pairs and len(pairs) else ""
        out["patching"] = patch
    if "circuit" in out:
        out["circuit"] = out["circuit"].assign(n_layers=model.cfg.n_layers, n_heads=model.cfg.n_heads)
    return out


def run_analyses(
    checkpoints: Optional[Union[Sequence[str], Mapping[str, tuple[Any, Any]]]] = None,
    settings: Optional[Settings] = None,
    analyse: Optional[Union[str, Sequence[str]]] = None,
    progress: bool = True,
    threads: Optional[int] = None,
) -> Report:
    """Run every analysis and return the :class:`Report` (no files written).

    ``checkpoints``: names/folders, or already loaded ``{name: (model, info)}``; None = all shipped.
    ``analyse``: checkpoint names for the heavy analyses, ``"all"``, or None (one per architecture,
    see the module docstring; every checkpoint when they were given explicitly). ``threads``: torch
    threads for the run (restored afterwards); these small models run fastest on 1, and several
    threads on a busy machine can be ten times slower.
    """
    import torch

    if threads is not None:
        if not isinstance(threads, int) or threads < 1:
            raise ConfigError(f"threads must be a positive integer, got {threads!r}")
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            return run_analyses(checkpoints, settings, analyse, progress, None)
        finally:
            torch.set_num_threads(before)
    from tqdm.auto import tqdm

    from interp_norm.card import model_card
    from interp_norm.circuits.attention_maps import attention_patterns
    from interp_norm.evaluate import evaluate
    from interp_norm.geometry import geometry_summary, run_geometry
    from interp_norm.noise import collapse_thresholds, run_collapse, run_noise
    from interp_norm.plots import variant_label

    settings = settings or Settings.full()
    report = Report(settings=settings, threads=torch.get_num_threads())
    t0 = time.perf_counter()
    explicit = checkpoints is not None
    models = dict(checkpoints) if isinstance(checkpoints, Mapping) else load_models(checkpoints)
    if not explicit:  # the shipped set: Pre-Norm first, then QKV-Norm, QK-Norm, No-Norm (seeds in order)
        models = dict(sorted(models.items(), key=lambda kv: _arch_key(kv[0], kv[1][1])))
    report.timings["load"] = time.perf_counter() - t0
    if analyse is None:
        heavy = list(models) if explicit else default_analysed(models)
    elif isinstance(analyse, str) and analyse == "all":
        heavy = list(models)
    else:
        heavy = [analyse] if isinstance(analyse, str) else list(analyse)
        unknown = [h for h in heavy if h not in models]
        if unknown:
            raise ConfigError(f"cannot analyse {unknown}: not among the loaded checkpoints {list(models)}")
    labels = {n: variant_label(n, info.model_cfg.attn_norm) for n, (_, info) in models.items()}
    report.checkpoints = pd.DataFrame([
        dict(checkpoint=n, label=labels[n], attn_norm=info.model_cfg.attn_norm, seed=info.model_cfg.seed,
             step=info.step, analysed=n in heavy, path=str(info.path))
        for n, (_, info) in models.items()
    ])
    todo = set(settings.analyses)
    n_stages = ("evaluate" in todo) * len(models) + len(heavy) * len(todo - {"evaluate"})
    T = report.tables
    # no global torch.no_grad(): attribution patching needs gradients (each analysis manages its own)
    with tqdm(total=n_stages, desc="reproduce", disable=not progress, dynamic_ncols=True) as bar:
        clock = _Clock(report, bar)
        # model card, training curves, evaluation: every checkpoint
        evals, curves = [], []
        for name, (model, info) in models.items():
            if len(info.curve):
                curves.append(_front(info.curve.copy(), checkpoint=name, attn_norm=info.model_cfg.attn_norm))
            if "evaluate" in todo:
                with clock.stage("evaluate"):
                    ev = evaluate(model, info.task, size=settings.eval_size, exact_match=settings.exact_match,
                                  progress=progress)
                    evals.append(_front(ev, checkpoint=name, attn_norm=info.model_cfg.attn_norm))
        T["evaluation"] = _concat(evals)
        T["model_card"] = model_card(models, T["evaluation"] if len(T["evaluation"]) else None)
        T["training_curves"] = _concat(curves)

        noise, collapse, geo, attn, circ = [], [], {}, [], {}
        for name in heavy:
            model, info = models[name]
            task, label, a = info.task, labels[name], info.model_cfg.attn_norm
            if "circuits" in todo:
                with clock.stage("circuits"):
                    for key, df in _circuits(model, task, settings, progress).items():
                        circ.setdefault(key, []).append(_front(df.copy(), variant=label, checkpoint=name))
            if "noise" in todo:
                with clock.stage("noise"):
                    df = run_noise(model, task, settings.noise_levels, n_datasets=settings.noise_datasets,
                                   n_examples=settings.noise_examples, noised=settings.noise_rows,
                                   variant=label, seed=settings.seed, progress=progress)
                    noise.append(_front(df, checkpoint=name))
            if "collapse" in todo:
                with clock.stage("collapse"):
                    kw = dict(n_examples=settings.collapse_examples, n_draws=settings.collapse_draws,
                              strict_samples=settings.collapse_strict_samples, seed=settings.seed, progress=progress)
                    df = run_collapse(model, task, settings.collapse_levels, variant=label, **kw)
                    collapse.append(_front(df, checkpoint=name))
                    if a == "qkv":
                        # the norm removes noise placed before it; also ask how fragile QKV-Norm's
                        # attention itself would be if the noise survived the norm
                        df = run_collapse(model, task, settings.collapse_levels, variant=f"{label}, noise after norm",
                                          placement="after_norm", **kw)
                        collapse.append(_front(df, checkpoint=name))
            if "geometry" in todo:
                with clock.stage("geometry"):
                    g = run_geometry(model, task, n=settings.geometry_examples, seed=settings.seed, progress=progress)
                    for key, df in g.items():
                        geo.setdefault(key, []).append(_front(df.copy(), variant=label, checkpoint=name))
            if "attention" in todo:
                with clock.stage("attention"):
                    probs = list(settings.problems) or _default_problems(task, model.cfg.n_ctx, settings.seed)
                    attn.append(attention_patterns(model, probs, name=label).assign(checkpoint=name))
        T["noise_accuracy"] = _concat(noise)
        T["collapse"] = _concat(collapse)
        if len(T["collapse"]):
            T["collapse_thresholds"] = collapse_thresholds(T["collapse"])
        for key, frames in geo.items():
            T[f"geometry_{key}"] = _concat(frames)
        if geo:
            try:
                T["geometry_summary"] = geometry_summary({k: T[f"geometry_{k}"] for k in geo})
            except Exception as e:  # a summary is a convenience; never lose the run over it
                report.notes.append(f"geometry summary skipped: {type(e).__name__}: {e}")
        for key, frames in circ.items():
            T[f"circuits_{key}"] = _concat(frames)
        if attn:
            T["attention_patterns"] = _concat(attn)
    report.tables = {k: v for k, v in T.items() if v is not None and len(v)}
    report.timings["total"] = time.perf_counter() - t0
    return report


# ----------------------------------------------------------------------------- writing


def _timings_table(report: Report) -> pd.DataFrame:
    return pd.DataFrame([dict(stage=k, seconds=round(v, 3)) for k, v in report.timings.items()])


def write_report(report: Report, out: Union[str, os.PathLike], dashboard: bool = True) -> dict[str, Path]:
    """Write every table as ``<key>.csv``, ``timings.csv``, ``run.json`` and ``dashboard.html`` into ``out``."""
    from interp_norm.io import ensure_writable_dir, write_csv, write_json, write_text_atomic

    out = ensure_writable_dir(out)
    written: dict[str, Path] = {}
    for key, df in report.tables.items():
        written[key] = write_csv(out / f"{key}.csv", df)
    written["timings"] = write_csv(out / "timings.csv", _timings_table(report))
    if len(report.checkpoints):
        written["checkpoints"] = write_csv(out / "checkpoints.csv", report.checkpoints)
    written["run"] = write_json(out / "run.json", run_facts(report))
    if dashboard:
        from interp_norm.dashboard import dashboard_html

        written["dashboard"] = write_text_atomic(out / "dashboard.html", dashboard_html(report), durable=False)
    return written


def run_facts(report: Report) -> dict:
    """Where and how the run happened (for run.json and the dashboard's footer)."""
    import torch

    import interp_norm

    return dict(
        interp_norm=interp_norm.__version__, python=platform.python_version(), torch=torch.__version__,
        machine=platform.machine(), cpus=os.cpu_count(), torch_threads=report.threads,
        seconds=round(report.timings.get("total", report.total_seconds), 1),
        settings=dataclasses.asdict(report.settings) if report.settings else None,
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
) -> Report:
    """The main job: analyse the (shipped) checkpoints and write ``out/`` (CSVs + dashboard.html).

    Fails with :class:`OutputDirError` before any work if ``out`` cannot be written.
    """
    from interp_norm.io import ensure_writable_dir

    ensure_writable_dir(out)
    settings = settings or (Settings.quick() if quick else Settings.full())
    report = run_analyses(checkpoints, settings, analyse=analyse, progress=progress, threads=threads)
    t = time.perf_counter()
    write_report(report, out)
    report.timings["write"] = time.perf_counter() - t
    report.timings["total"] += report.timings["write"]
    # timings.csv and run.json again, now with the write time included
    write_report_meta(report, out)
    return report


def write_report_meta(report: Report, out: Union[str, os.PathLike]) -> None:
    """Rewrite ``timings.csv`` and ``run.json`` (after the write time is known)."""
    from interp_norm.io import write_csv, write_json

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
) -> Path:
    """Analyse any checkpoints and write their dashboard (one HTML file; no CSVs).

    Fails with :class:`OutputDirError` before any work if ``out`` is a folder or cannot be written.
    """
    from interp_norm.dashboard import write_dashboard
    from interp_norm.io import ensure_writable_dir

    if isinstance(checkpoints, (str, os.PathLike)):
        checkpoints = [str(checkpoints)]
    out = Path(out)
    if out.is_dir():
        raise OutputDirError(f"{str(out)!r} is a folder; give a file name such as dashboard.html")
    ensure_writable_dir(out.parent if str(out.parent) else Path("."))  # before any work
    settings = settings or (Settings.quick() if quick else Settings.full())
    report = run_analyses(list(checkpoints), settings, analyse=analyse, progress=progress, threads=threads)
    return write_dashboard(report, out, csv_links=False)
