"""The package's architecture holds: a folder per layer, imports only go down, one hook vocabulary.

The layers are the package's folders, lowest first (CONTRIBUTING.md explains them):

    core          core/          the task, the model and its components, the hook and node vocabularies
    training      training/      training runs, configs, checkpoints, files, devices
    adapter       anatomy/       what every analysis asks about a model, ours or a bridge; loading any model
    analyses      stats/, theory/, noise/, geometry/, circuits/
    faces         report/, cli/, tutorial/

The package root holds only ``__init__`` (the public entry points) and ``errors`` (the typed errors
every layer raises). A module may import its own layer and the layers below it, never a layer
above; the module graph has no cycles; no analysis or face spells a hook name by hand (they ask
``interp_norm.core.hook_names``); a model's kind is asked only in ``anatomy/`` and the per-analysis
dispatch points listed here (everything else asks ``anatomy.capabilities``). The imports and calls are
read from the source (``ast``), function-local imports included.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parent.parent / "interp_norm"
LAYERS = {
    "core": ("core",),
    "training": ("training",),
    "adapter": ("anatomy",),
    "analyses": ("stats", "theory", "noise", "geometry", "circuits"),
    "faces": ("report", "cli", "tutorial"),
}
ROOT_MODULES = {"__init__", "errors"}  # below every layer: the public entry points and the typed errors
RANK = {top: i for i, tops in enumerate(LAYERS.values()) for top in tops}
MAX_LINES = 550  # "no module over ~500 lines"


def folders() -> list[str]:
    return sorted(p.name for p in PKG.iterdir() if p.is_dir() and (p / "__init__.py").exists())


def test_the_root_holds_only_the_entry_points():
    root = {p.stem for p in PKG.glob("*.py")}
    assert root <= ROOT_MODULES, f"modules at the package root: {sorted(root - ROOT_MODULES)}; put each in its layer's folder"
    assert len(root) <= 3


def test_every_folder_is_one_layer():
    unplaced = [f for f in folders() if f not in RANK]
    assert not unplaced, f"folders in no layer: {unplaced}; add them to LAYERS here and to CONTRIBUTING.md"
    missing = sorted(set(RANK) - set(folders()))
    assert not missing, f"layers name folders that do not exist: {missing}"


def modules() -> dict[str, Path]:
    out = {}
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(PKG.parent).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def imported(path: Path, name: str) -> set[str]:
    """Every interp_norm module ``path`` imports (absolute and relative, anywhere in the file)."""
    tree = ast.parse(path.read_text())
    pkg = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("interp_norm")}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(pkg.split(".")[: len(pkg.split(".")) - node.level + 1] + ([base] if base else []))
            if not base.startswith("interp_norm"):
                continue
            found.add(base)
            found |= {f"{base}.{a.name}" for a in node.names}  # `from interp_norm import task` imports a module
    mods = modules()
    return {m for m in found if m in mods and m != name}


def top(name: str) -> str:
    parts = name.split(".")
    return parts[1] if len(parts) > 1 else ""


def test_imports_only_go_down():
    mods = modules()
    upward = []
    for name, path in mods.items():
        if not top(name) or top(name) in ROOT_MODULES:  # the root: public entry points (lazy) and the errors
            continue
        for dep in imported(path, name):
            if top(dep) in RANK and RANK[top(dep)] > RANK[top(name)]:
                upward.append(f"{name} -> {dep}")
    assert not upward, "imports from a lower layer to a higher one:\n" + "\n".join(upward)


def test_no_import_cycles():
    mods = modules()
    graph = {n: imported(p, n) for n, p in mods.items()}
    # a package __init__ that re-exports its submodules is not a cycle with them
    graph = {n: {d for d in deps if not (d.startswith(n + ".") or n.startswith(d + ".") and d == n.rsplit(".", 1)[0])}
             for n, deps in graph.items()}
    index, low, stack, on, cycles, counter = {}, {}, [], set(), [], [0]

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    assert not cycles, f"import cycles: {cycles}"


def test_no_hook_name_spelled_by_hand_outside_the_vocabulary():
    """Only core/hook_names.py and the model's own files may write ``blocks.{l}...``."""
    allowed = {"interp_norm.core.hook_names", "interp_norm.core.model", "interp_norm.core.components", "interp_norm.core.tl_api"}
    pattern = re.compile(r"""blocks\.\{|["']blocks\.\d""")
    offenders = [f"{n}:{i + 1}" for n, p in modules().items() if n not in allowed
                 for i, line in enumerate(p.read_text().splitlines()) if pattern.search(line)]
    assert not offenders, "hook names built by hand (use interp_norm.core.hook_names.act_name):\n" + "\n".join(offenders)


def test_model_kinds_are_told_apart_only_by_the_adapter():
    """Analyses ask ``interp_norm.anatomy`` (``anatomy(model)``, ``kind_of(model)``), never test
    a model's kind with their own helper."""
    pattern = re.compile(r"\bis_bridge\b|\bis_ours\b|\bis_hf\b")
    offenders = [f"{n}:{i + 1}" for n, p in modules().items() if top(n) != "anatomy"
                 for i, line in enumerate(p.read_text().splitlines()) if pattern.search(line)]
    assert not offenders, "model-kind checks outside interp_norm/anatomy (use anatomy.kind_of):\n" + "\n".join(offenders)


#: The per-analysis dispatch points: the one function of each analysis that runs on both kinds where
#: the kind picks the backend (our models' or a TransformerBridge's), once. Everything else asks the
#: anatomy (``anatomy(model)``, ``capabilities(model)``) what the model can do.
DISPATCH_POINTS = {
    "interp_norm.noise.accuracy:run_noise",  # accuracy on the task / text agreement
    "interp_norm.noise.collapse:run_collapse",  # measure_collapse / bridge_collapse
    "interp_norm.geometry.run:_uses_bridge_backend",  # run_geometry, compare_geometry: run_ours / run_bridge
    "interp_norm.geometry.spread:attended_norms",  # the residual and pattern hooks, the positions kept
    "interp_norm.geometry.sparsity:max_attention",  # the pattern hooks, the rows kept
    "interp_norm.geometry.ellipsoid:ellipsoid_table",  # our norm modules / geometry.bridge's
    "interp_norm.geometry.ellipsoid:ellipsoid_axes",
    "interp_norm.geometry.ellipsoid:ellipsoid_membership",
}
KIND_QUESTIONS = {"kind_of", "is_hf", "is_bridge", "is_ours"}


def kind_questions(path: Path) -> list[tuple[str, int]]:
    """(enclosing function, line) of every call of a kind question in the file (``ast``, so a
    mention in a docstring or comment does not count)."""
    found: list[tuple[str, int]] = []

    def walk(node: ast.AST, where: str) -> None:
        for child in ast.iter_child_nodes(node):
            inner = where
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                inner = f"{where}.{child.name}" if where else child.name
            if isinstance(child, ast.Call):
                f = child.func
                name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None
                if name in KIND_QUESTIONS:
                    found.append((inner or "<module>", child.lineno))
            walk(child, inner)

    walk(ast.parse(path.read_text()), "")
    return found


def test_the_kind_is_asked_only_by_the_adapter_and_the_dispatch_points():
    offenders, seen = [], {}
    for n, p in modules().items():
        if top(n) == "anatomy":
            continue
        for fn, line in kind_questions(p):
            key = f"{n}:{fn}"
            seen.setdefault(key, []).append(line)
            if key not in DISPATCH_POINTS:
                offenders.append(f"{key} (line {line})")
    assert not offenders, ("the model's kind asked outside interp_norm/anatomy and the dispatch points (ask "
                           "anatomy.capabilities(model) what it can do, or pick a backend in the analysis' entry "
                           "point and list it in DISPATCH_POINTS):\n" + "\n".join(offenders))
    twice = {k: v for k, v in seen.items() if len(v) > 1}
    assert not twice, f"a dispatch point asks the kind more than once (pick the backend once): {twice}"
    stale = sorted(DISPATCH_POINTS - set(seen))
    assert not stale, f"DISPATCH_POINTS lists functions that no longer ask the kind: {stale}"


def test_the_kind_question_finder_sees_calls_and_ignores_mentions(tmp_path):
    src = tmp_path / "m.py"
    src.write_text('"""kind_of(model) in a docstring"""\n'
                   "def f(model):\n    # kind_of(model) in a comment\n    return A.kind_of(model)\n"
                   "class C:\n    def g(self, m):\n        return is_hf(m) or is_bridge(m)\n")
    assert kind_questions(src) == [("f", 4), ("C.g", 7), ("C.g", 7)]


@pytest.mark.parametrize("name", sorted(modules()))
def test_modules_stay_small(name):
    n = len(modules()[name].read_text().splitlines())
    assert n <= MAX_LINES, f"{name} has {n} lines; split it by concern (limit ~500)"
