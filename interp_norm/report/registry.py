"""Every analysis ``reproduce`` runs, registered once: one :class:`Analysis` entry per analysis.

``reproduce`` (its :class:`~interp_norm.report.reproduce.Settings`, its derived tables), the per-checkpoint
runner :mod:`interp_norm.report.worker`, the command line (``reproduce --only`` / ``--controls``)
and the dashboard (its sections) all read :data:`REGISTRY`; none of them names an analysis.
``tests/test_registry.py`` checks that each entry appears in all four.

Adding an analysis: write its one-call function in its own module (models and data in, a DataFrame
out), then append one :class:`Analysis` here: ``run`` adapts the function to a :class:`Job` and
yields ``(table key, frame)``; ``tables`` lists the keys it writes; ``figure`` names the function
that turns those tables into dashboard panels; ``sizes`` / ``quick`` are the settings it reads, with
the values of the full run and of ``--quick``.

This module imports only the standard library (``interp-norm --help`` reads it): every analysis
module is imported when its analysis runs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from importlib import import_module
from typing import Any, Callable, Iterable, Iterator, Mapping, Optional

__all__ = ["Analysis", "Job", "REGISTRY", "ANALYSES", "HEAVY", "CONTROLS", "DEFAULT_ANALYSES", "get", "sizes",
           "resolve", "produces"]

#: What a run function yields: ``(table key, frame)`` pairs (a key may come more than once).
Tables = Iterable[tuple[str, Any]]


def resolve(ref: str) -> Any:
    """``"package.module:attribute"`` -> the attribute (imported now, not when the registry is read)."""
    module, _, attr = ref.partition(":")
    return getattr(import_module(module), attr)


@dataclass(frozen=True)
class Lazy:
    """A default read from another module when a :class:`~interp_norm.report.reproduce.Settings` is made
    (``Lazy("interp_norm.noise:DEFAULT_MULTIPLIERS")``), so reading the registry imports no torch."""

    ref: str

    def __call__(self) -> Any:
        v = resolve(self.ref)
        return tuple(v) if isinstance(v, (list, tuple)) else v


@dataclass(frozen=True)
class Job:
    """One checkpoint as every run function sees it: its name, model, task, label and the run's settings."""

    name: str
    model: Any
    task: Any
    attn_norm: str
    label: str
    settings: Any
    progress: bool = False

    @property
    def after_norm(self) -> bool:
        """QK/QKV-Norm: noise placed before the norm is removed by construction, so the single-placement
        analyses ask about noise placed after it."""
        from interp_norm.core.hook_names import is_normalised

        return is_normalised(self.attn_norm, "q")

    @property
    def placement(self) -> str:
        return "after_norm" if self.after_norm else "before_norm"

    @property
    def noise_label(self) -> str:
        """The variant label of the single-placement analyses (``", noise after norm"`` where it applies)."""
        return f"{self.label}, noise after norm" if self.after_norm else self.label

    def front(self, df: Any, **cols: Any) -> Any:
        """``df`` with ``cols`` (default: ``checkpoint``) as its first columns."""
        cols = cols or dict(checkpoint=self.name)
        for i, (k, v) in enumerate(cols.items()):
            if k in df.columns:
                df = df.drop(columns=k)
            df.insert(i, k, v)
        return df


@dataclass(frozen=True)
class Analysis:
    """One analysis of ``reproduce``.

    ``run(job)`` yields ``(table key, frame)`` for one checkpoint; ``tables``: the report tables it
    produces (``"geometry_*"`` for a family), ``combine`` included; ``figure``: ``"module:function"``
    of ``build(tables, panel, csv) -> {dashboard section anchor: [Panel, ...]}``; ``sizes``: the
    :class:`~interp_norm.report.reproduce.Settings` fields it owns with the full run's values (an ``int``
    must be a positive integer; a :class:`Lazy` is read from its module), ``quick``: their
    ``--quick`` values; ``default=False``: opt-in (``reproduce --controls``); ``every_checkpoint``:
    runs on every loaded checkpoint, not only the analysed ones; ``combine(tables, notes)``: tables
    derived from the concatenated ones (over every checkpoint).
    """

    name: str
    run: Callable[[Job], Tables]
    tables: tuple[str, ...]
    figure: str
    help: str = ""
    sizes: Mapping[str, Any] = field(default_factory=dict)
    quick: Mapping[str, Any] = field(default_factory=dict)
    default: bool = True
    every_checkpoint: bool = False
    combine: Optional[Callable[[dict, list], dict]] = None


def produces(analysis: Analysis, key: str) -> bool:
    """Whether report table ``key`` is one of ``analysis.tables`` (``prefix_*`` matches a family)."""
    return any(key == t or (t.endswith("*") and key.startswith(t[:-1])) for t in analysis.tables)


# ----------------------------------------------------------------------------- the run functions


def _evaluate(job: Job) -> Tables:
    from interp_norm.core.scoring import evaluate

    s = job.settings
    ev = evaluate(job.model, job.task, size=s.eval_size, exact_match=s.exact_match, progress=job.progress)
    yield "evaluation", job.front(ev, checkpoint=job.name, attn_norm=job.attn_norm)


def _circuits(job: Job) -> Tables:
    """The circuits package's one-call analysis, reshaped for the dashboard: the ``patch_<activation>``
    tables become one ``patching`` table (``by`` = pos/all, the pairs' first clean problem as
    ``template`` for position labels); the circuit's edges get ``n_layers``/``n_heads`` so a
    :class:`~interp_norm.circuits.Circuit` can be rebuilt from them."""
    import pandas as pd

    from interp_norm.circuits import run_circuits

    s, cfg = job.settings, job.model.cfg
    res = run_circuits(job.model, job.task, n_pairs=s.circuit_pairs, seed=s.seed,
                       attention_problems=s.circuit_attention_problems, progress=job.progress)
    out: dict[str, Any] = {}
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
        out["circuit"] = out["circuit"].assign(n_layers=cfg.n_layers, n_heads=cfg.n_heads)
    for key, df in out.items():
        yield f"circuits_{key}", job.front(df.copy(), variant=job.label, checkpoint=job.name)


def _noise(job: Job) -> Tables:
    from interp_norm.noise import MATCHED, run_noise

    s = job.settings
    kw = dict(n_datasets=s.noise_datasets, n_examples=s.noise_examples, seed=s.seed, progress=job.progress)
    rows = tuple(s.noise_rows) + ((MATCHED,) if s.noise_matched else ())
    yield "noise_accuracy", job.front(run_noise(job.model, job.task, s.noise_levels, noised=rows, variant=job.label,
                                                **kw))
    if job.after_norm:
        yield "noise_accuracy", job.front(run_noise(job.model, job.task, s.noise_levels, noised="all",
                                                    variant=job.noise_label, placement="after_norm", **kw))


def _collapse(job: Job) -> Tables:
    """The norm removes noise placed before it; for QK/QKV-Norm also ask how fragile the attention
    itself would be if the noise survived the norm."""
    from interp_norm.noise import run_collapse_with_heads

    s = job.settings
    kw = dict(n_examples=s.collapse_examples, n_draws=s.collapse_draws, strict_samples=s.collapse_strict_samples,
              seed=s.seed, progress=job.progress)
    runs: list[tuple[str, dict]] = [(job.label, {})] + ([(job.noise_label, dict(placement="after_norm"))] if job.after_norm else [])
    for variant, more in runs:
        curves, heads = run_collapse_with_heads(job.model, job.task, s.collapse_levels, variant=variant, **kw, **more)
        yield "collapse", job.front(curves)
        yield "collapse_heads", job.front(heads)


def _collapse_combine(T: dict, notes: list) -> dict:
    from interp_norm.noise import beside_thresholds, collapse_thresholds

    if not len(T.get("collapse", ())):
        return {}
    th = collapse_thresholds(T["collapse"])
    if len(T.get("collapse_heads", ())):  # the effective number of heads beside every level
        th = beside_thresholds(th, T["collapse_heads"])
    return {"collapse_thresholds": th}


def _forward_collapse(job: Job) -> Tables:
    from interp_norm.noise import run_forward_collapse

    s = job.settings
    yield "forward_collapse", job.front(run_forward_collapse(
        job.model, job.task, s.collapse_levels, n_examples=s.forward_examples, n_draws=s.forward_draws,
        strict_samples=s.collapse_strict_samples, seed=s.seed, variant=job.noise_label, placement=job.placement,
        progress=job.progress))


def _forward_combine(T: dict, notes: list) -> dict:
    from interp_norm.noise import collapse_thresholds

    return {"forward_collapse_thresholds": collapse_thresholds(T["forward_collapse"])} \
        if len(T.get("forward_collapse", ())) else {}


def _temperature(job: Job) -> Tables:
    from interp_norm.noise import run_temperature_sweep

    s = job.settings
    yield "temperature", job.front(run_temperature_sweep(
        job.model, job.task, s.temperature_multipliers, s.collapse_levels, n_examples=s.temperature_examples,
        n_draws=s.temperature_draws, seed=s.seed, variant=job.noise_label, placement=job.placement,
        progress=job.progress))


def _geometry(job: Job) -> Tables:
    from interp_norm.geometry import run_geometry

    g = run_geometry(job.model, job.task, n=job.settings.geometry_examples, seed=job.settings.seed,
                     progress=job.progress)
    for key, df in g.items():
        yield f"geometry_{key}", job.front(df.copy(), variant=job.label, checkpoint=job.name)


def _geometry_combine(T: dict, notes: list) -> dict:
    from interp_norm.geometry import geometry_summary

    geo = [k[len("geometry_"):] for k in T if k.startswith("geometry_")]
    if not geo:
        return {}
    try:
        return {"geometry_summary": geometry_summary({k: T[f"geometry_{k}"] for k in geo})}
    except Exception as e:  # a summary is a convenience; never lose the run over it
        notes.append(f"geometry summary skipped: {type(e).__name__}: {e}")
        return {}


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


def _attention(job: Job) -> Tables:
    from interp_norm.circuits.attention_maps import attention_patterns

    s = job.settings
    probs = list(s.problems) or default_problems(job.task, job.model.cfg.n_ctx, s.seed)
    yield "attention_patterns", attention_patterns(job.model, probs, name=job.label).assign(checkpoint=job.name)


def _noise_decomposition(job: Job) -> Tables:
    from interp_norm.noise import run_noise_decomposition

    s = job.settings
    yield "noise_decomposition", job.front(run_noise_decomposition(
        job.model, job.task, s.decomposition_levels, n_datasets=s.noise_datasets, n_examples=s.noise_examples,
        seed=s.seed, variant=job.label, progress=job.progress))


def _collapse_consequence(job: Job) -> Tables:
    from interp_norm.noise import run_collapse_consequence

    s = job.settings
    yield "collapse_consequence", job.front(run_collapse_consequence(
        job.model, job.task, s.consequence_levels, n_examples=s.consequence_examples, n_draws=s.consequence_draws,
        n_boot=s.consequence_boot, seed=s.seed, variant=job.noise_label, placement=job.placement,
        progress=job.progress))


def _addition_circuit(job: Job) -> Tables:
    """The circuit at (layer, head, answer position), its roles and the generated account."""
    import pandas as pd

    from interp_norm.circuits.cell_circuit import CircuitSpec
    from interp_norm.circuits.cell_roles import addition_circuit

    s = job.settings
    res = addition_circuit(job.model, job.task, spec=CircuitSpec(n=s.addition_circuit_problems, seed=s.seed,
                                                                  progress=job.progress), name=job.name)
    res["account"] = pd.DataFrame([dict(account=res["account"])])
    for key in ("circuit", "curve", "verification", "roles", "role_counts", "account"):
        yield f"addition_{key}", job.front(res[key].copy(), variant=job.label, checkpoint=job.name)


# ----------------------------------------------------------------------------- the registry

_PANELS = "interp_norm.report.dashboard.panels"

#: Every analysis, in the order they run (and their panels appear within a dashboard section).
REGISTRY: tuple[Analysis, ...] = (
    Analysis("evaluate", _evaluate, ("evaluation",), f"{_PANELS}:models", every_checkpoint=True,
             help="accuracy per split on fresh seeded test sets (every checkpoint)",
             sizes=dict(eval_size=1024, exact_match=True), quick=dict(eval_size=32)),
    Analysis("circuits", _circuits, ("circuits_*",), f"{_PANELS}:circuits",
             help="activation patching, EAP-IG edges, the pruned circuit and its faithfulness",
             sizes=dict(circuit_pairs=64, circuit_attention_problems=256),
             quick=dict(circuit_pairs=6, circuit_attention_problems=16)),
    Analysis("noise", _noise, ("noise_accuracy",), f"{_PANELS}:noise",
             help="accuracy under norm noise on all / sparse / non-sparse / matched-count rows",
             sizes=dict(noise_levels=Lazy("interp_norm.noise:DEFAULT_NOISE_LEVELS"), noise_examples=512,
                        noise_datasets=3, noise_rows=Lazy("interp_norm.noise:NOISED_ROWS"), noise_matched=True),
             quick=dict(noise_levels=(0.0, 0.01, 0.1), noise_examples=24, noise_datasets=2)),
    Analysis("collapse", _collapse, ("collapse", "collapse_heads", "collapse_thresholds"), f"{_PANELS}:collapse",
             help="per-layer circuit collapse vs noise level, per head, and the 1% levels",
             sizes=dict(collapse_levels=Lazy("interp_norm.noise:DEFAULT_COLLAPSE_LEVELS"), collapse_examples=256,
                        collapse_draws=64, collapse_strict_samples=128),
             quick=dict(collapse_levels=(0.05, 0.2, 0.5), collapse_examples=16, collapse_draws=8,
                        collapse_strict_samples=16),
             combine=_collapse_combine),
    Analysis("forward_collapse", _forward_collapse, ("forward_collapse", "forward_collapse_thresholds"),
             f"{_PANELS}:forward_collapse", help="collapse seen in the real noisy forward pass",
             sizes=dict(forward_examples=128, forward_draws=16), quick=dict(forward_examples=16, forward_draws=4),
             combine=_forward_combine),
    Analysis("temperature", _temperature, ("temperature",), f"{_PANELS}:temperature",
             help="collapse level and sparse fraction vs a score multiplier",
             sizes=dict(temperature_multipliers=Lazy("interp_norm.noise:DEFAULT_MULTIPLIERS"), temperature_examples=256,
                        temperature_draws=32),
             quick=dict(temperature_multipliers=(1.0, 2.0), temperature_examples=16, temperature_draws=4)),
    Analysis("geometry", _geometry, ("geometry_*",), f"{_PANELS}:geometry",
             help="residual-stream geometry: norm spread, spheres, subspaces, ellipsoids",
             sizes=dict(geometry_examples=256), quick=dict(geometry_examples=24), combine=_geometry_combine),
    Analysis("attention", _attention, ("attention_patterns",), f"{_PANELS}:attention",
             help="attention patterns of a few problems (the dashboard's explorer)", sizes=dict(problems=())),
    Analysis("noise_decomposition", _noise_decomposition, ("noise_decomposition",),
             f"{_PANELS}:noise_decomposition", default=False,
             help="the noise-drop decomposition (q, k, v, random direction, one κ per token)",
             sizes=dict(decomposition_levels=(0.01,))),
    Analysis("collapse_consequence", _collapse_consequence, ("collapse_consequence",),
             f"{_PANELS}:collapse_consequence", default=False,
             help="accuracy of problems with a collapsed sparse row vs none",
             sizes=dict(consequence_levels=Lazy("interp_norm.noise:CONSEQUENCE_LEVELS"), consequence_examples=512,
                        consequence_draws=4, consequence_boot=2000),
             quick=dict(consequence_examples=24, consequence_draws=2, consequence_boot=200)),
    Analysis("addition_circuit", _addition_circuit, ("addition_*",),
             "interp_norm.report.dashboard.addition_circuit:addition_circuit", default=False,
             help="the addition circuit by (layer, head, answer position): size at 90% accuracy, roles, account",
             sizes=dict(addition_circuit_problems=256), quick=dict(addition_circuit_problems=8)),
)

#: Names, in the order they run.
ANALYSES: tuple[str, ...] = tuple(a.name for a in REGISTRY)
#: Those that run only on the analysed checkpoints (``reproduce --analyse`` chooses them).
HEAVY: tuple[str, ...] = tuple(a.name for a in REGISTRY if not a.every_checkpoint)
#: Opt-in (``interp-norm reproduce --controls``): about +5 s of CPU per analysed checkpoint, which
#: would take ``make reproduce`` past its 3-minute budget.
CONTROLS: tuple[str, ...] = tuple(a.name for a in REGISTRY if not a.default)
#: What a run does unless told otherwise.
DEFAULT_ANALYSES: tuple[str, ...] = tuple(a.name for a in REGISTRY if a.default)


def get(name: str) -> Analysis:
    """The registered analysis ``name`` (KeyError naming the choices otherwise)."""
    for a in REGISTRY:
        if a.name == name:
            return a
    raise KeyError(f"no analysis {name!r}; registered: {', '.join(ANALYSES)}")


def sizes(quick: bool = False) -> dict[str, Any]:
    """Every analysis's settings with their full-run (or ``--quick``) values, :class:`Lazy` ones unread.
    A name two analyses declare is an error (each setting has one owner; others may read it)."""
    out: dict[str, Any] = {}
    owner: dict[str, str] = {}
    for a in REGISTRY:
        for k, v in a.sizes.items():
            if k in owner:
                raise ValueError(f"setting {k!r} is declared by both {owner[k]!r} and {a.name!r}")
            owner[k] = a.name
            out[k] = a.quick.get(k, v) if quick else v
        stray = set(a.quick) - set(a.sizes)
        if stray:
            raise ValueError(f"{a.name!r} has --quick values for settings it does not declare: {sorted(stray)}")
    return out


def each(names: Iterable[str]) -> Iterator[Analysis]:
    """The registered analyses among ``names``, in registry order."""
    wanted = set(names)
    return (a for a in REGISTRY if a.name in wanted)
