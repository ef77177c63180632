"""The tutorials: their exercise checks, their structure, and that every notebook runs top to bottom.

* Fast: every check in ``interp_norm.tutorial`` passes the reference solution (``interp_norm.tutorial.solutions``),
  fails a deliberately wrong function (two per exercise), reports an untouched stub as "not attempted",
  and reports a crashing or nonsense attempt as a failure instead of raising — on small random models.
* Fast: the checked-in .ipynb equal what ``scripts/tutorials/build_notebooks.py`` writes; every exercise has a
  difficulty/time badge, a check call and a collapsed solution; Run All cannot redefine the learner's
  function (every code cell is parsed); ``tutorials/`` holds no Python module (no solutions one click away),
  no set-up boilerplate and no emoji (they render as empty boxes without an emoji font).
* Slow: each notebook executes on the shipped checkpoints (stubs unattempted: every check reports [TODO]).
"""

from __future__ import annotations

import ast
import os
import re
import sys
import tempfile
import time
from pathlib import Path

import pandas as pd
import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
TUTORIALS = ROOT / "tutorials"
BUILDER = ROOT / "scripts" / "tutorials"  # the notebooks' sources and their HTML export
NOTEBOOKS = sorted(TUTORIALS.glob("[0-9][0-9]_*.ipynb"))
TIMEOUT = 240  # seconds per cell; all five notebooks together take a few minutes

sys.path.insert(0, str(BUILDER))
import _export  # noqa: E402

sys.path.remove(str(BUILDER))

from _models import make_model  # noqa: E402

from interp_norm import AdditionTask  # noqa: E402
from interp_norm.circuits import LogitDiff, make_pairs  # noqa: E402
from interp_norm.core.hook_names import act_name  # noqa: E402
from interp_norm.tutorial import _core  # noqa: E402
from interp_norm.tutorial import checks as C  # noqa: E402
from interp_norm.tutorial import solutions as S  # noqa: E402


# ============================================================================= fixtures: small random models


@pytest.fixture(scope="module")
def data():
    task = AdditionTask.preset("cpu")
    pre = make_model(attn_norm="pre")
    tokens = task.test_set("id", 16).tokens
    with torch.no_grad():
        _, cache = pre.run_with_cache(tokens)
    ln = make_model(seed=3, attn_norm="qkv", norm_kind="ln")
    with torch.no_grad():
        _, ln_cache = ln.run_with_cache(tokens)
    pairs = make_pairs(task, 8, "id", seed=0, aligned=True)
    g = torch.Generator().manual_seed(0)
    ablation = pd.DataFrame([dict(layer=l, head=h, loss_increase=float(torch.rand(1, generator=g)))
                             for l in range(pre.cfg.n_layers) for h in range(pre.cfg.n_heads)])
    row = cache[act_name("attn_scores", pre.cfg.n_layers - 1)][0, 0, 9]
    from interp_norm.anatomy import random_tokens, tiny_bridge

    gemma = tiny_bridge("gemma4", seed=0)
    gemma_tokens = random_tokens(gemma, 4, 12, seed=1, low=3)
    with torch.no_grad():
        _, gemma_cache = gemma.run_with_cache(gemma_tokens)
    return dict(pre=pre, tokens=tokens, cache=cache, ln=ln, ln_cache=ln_cache, pairs=pairs, metric=LogitDiff(pairs),
                ablation=ablation, row=row, gemma=gemma, gemma_cache=gemma_cache, gemma_tokens=gemma_tokens,
                **_located(pre, task))


def _located(model, task) -> dict:
    """A cell-grain circuit of a small model and its attention mass per token class (the circuit exercise's tables)."""
    from interp_norm.circuits import CircuitSpec, attention_by_class, locate_circuit

    located = locate_circuit(model, task, spec=CircuitSpec(n=24, seed=0))
    return dict(located=located, attention=attention_by_class(model, located.data))


def check_args(name: str, d: dict) -> tuple:
    """The arguments the notebooks pass to check_<name> after the learner's function."""
    return {
        "my_scores": (d["pre"], d["cache"]),
        "most_important_head": (d["ablation"],),
        "prev_token_scores": (d["pre"], d["tokens"]),
        "patch_one": (d["pre"], d["pairs"], d["metric"]),
        "attribution_scores": (d["pre"], d["pairs"], d["metric"]),
        "head_faithfulness": (d["pre"], d["pairs"], d["metric"]),
        "most_necessary_reads": (d["pre"], d["located"], d["attention"]),
        "eap_errors": (d["pre"], d["pairs"], d["metric"]),
        "query_norm_ratio": (d["pre"], d["tokens"]),
        "mc_collapse_probability": (d["row"],),
        "principal_angles_deg": (d["pre"],),
        "ln_coordinates": (d["pre"], d["cache"]),
        "head_layernorm": (d["ln"], d["ln_cache"]),
        "noised_argmax": (d["gemma"], d["gemma_cache"], d["gemma_tokens"]),
    }[name]


# ============================================================================= deliberately wrong answers


def _clean_corrupted(model, pairs, metric):
    with torch.no_grad():
        return metric(model(pairs.clean_tokens)).mean().item(), metric(model(pairs.corrupted_tokens)).mean().item()


def scores_unscaled(model, cache, layer):
    return S.my_scores(model, cache, layer) * model.cfg.attn_scale


def scores_unmasked(model, cache, layer):
    q, k = cache[act_name("q", layer)], cache[act_name("k", layer)]
    return torch.einsum("bqhd,bkhd->bhqk", q, k) / model.cfg.attn_scale


def head_argmin(ablation):
    row = ablation.loc[ablation["loss_increase"].idxmin()]
    return int(row["layer"]), int(row["head"])


def head_swapped(ablation):
    layer, head = S.most_important_head(ablation)
    return head, layer


def prev_token_with_padding(model, tokens):
    names = [act_name("pattern", l) for l in range(model.cfg.n_layers)]
    with torch.no_grad():
        _, cache = model.run_with_cache(tokens, names_filter=lambda n: n in names)
    return pd.DataFrame([dict(layer=l, head=h, prev_token_score=float(cache[n].diagonal(-1, -2, -1)[:, h].mean()))
                         for l, n in enumerate(names) for h in range(model.cfg.n_heads)])


def prev_token_next_token(model, tokens):
    df = S.prev_token_scores(model, tokens)
    return df.assign(prev_token_score=df["prev_token_score"].iloc[::-1].to_numpy())  # scores of the wrong heads


def patch_raw(model, pairs, metric, layer, pos):
    clean, corrupted = _clean_corrupted(model, pairs, metric)
    return S.patch_one(model, pairs, metric, layer, pos) * (clean - corrupted) + corrupted


def patch_wrong_position(model, pairs, metric, layer, pos):
    return S.patch_one(model, pairs, metric, layer, max(pos - 1, 0) if pos else 1)


def attribution_negated(model, pairs, metric):
    df = S.attribution_scores(model, pairs, metric)
    return df.assign(attribution=-df["attribution"])


def attribution_halved(model, pairs, metric):
    df = S.attribution_scores(model, pairs, metric)
    return df.assign(attribution=0.5 * df["attribution"])


def _eap_and_exact(model, pairs, metric):
    from interp_norm.circuits import activation_patch, attribution_patch

    res = [r.per_example.double() - r.baseline.double() for r in (
        attribution_patch(model, pairs, metric, "z", by="all", ig_steps=1), activation_patch(model, pairs, None, metric, "z", by="all"))]
    return res[0], res[1]


def _per_head_frame(model, values):
    H = model.cfg.n_heads
    return pd.DataFrame([dict(layer=i // H, head=i % H, error=float(v)) for i, v in enumerate(values)])


def errors_of_batch_means(model, pairs, metric):
    eap, exact = _eap_and_exact(model, pairs, metric)
    return _per_head_frame(model, (eap.mean(-1) - exact.mean(-1)).abs())  # opposite signs cancel


def errors_signed(model, pairs, metric):
    eap, exact = _eap_and_exact(model, pairs, metric)
    return _per_head_frame(model, (eap - exact).mean(-1))  # no absolute value


def faithfulness_inverted(model, pairs, metric, heads_in_circuit):
    every = {(l, h) for l in range(model.cfg.n_layers) for h in range(model.cfg.n_heads)}
    return S.head_faithfulness(model, pairs, metric, every - set(heads_in_circuit))


def faithfulness_unnormalised(model, pairs, metric, heads_in_circuit):
    clean, corrupted = _clean_corrupted(model, pairs, metric)
    return S.head_faithfulness(model, pairs, metric, heads_in_circuit) * (clean - corrupted) + corrupted


def reads_of_most_necessary_overall(effects, attention, position):
    top = effects.sort_values(["accuracy_drop", "logit_diff_drop"], ascending=False).iloc[0]  # ignores the position
    mine = attention[(attention["layer"] == top["layer"]) & (attention["head"] == top["head"])
                     & (attention["position"] == position)]
    return mine.loc[mine["mass"].idxmax(), "token_class"]


def reads_most_attended(effects, attention, position):
    here = attention[attention["position"] == position]  # the largest mass of any head, necessary or not
    return here.loc[here["mass"].idxmax(), "token_class"]


def ratio_inverted(model, tokens, level, seed):
    return 1 / S.query_norm_ratio(model, tokens, level, seed)


def ratio_ignores_seed(model, tokens, level, seed):
    return S.query_norm_ratio(model, tokens, level, 0)


def mc_half_width_level(row, level, n_draws, seed):
    from interp_norm import theory

    g = torch.Generator().manual_seed(seed)
    kappa = (2 * torch.rand(n_draws, row.shape[-1], generator=g, dtype=torch.float64) - 1) * level  # RMS level/√3
    return theory.collapse_condition_exact(row.double().expand_as(kappa), kappa).double().mean().item()


def mc_zero(row, level, n_draws, seed):
    return 0.0


def angles_radians(A, B):
    return torch.deg2rad(S.principal_angles_deg(A, B))


def angles_not_orthonormalised(A, B):
    k = min(torch.linalg.matrix_rank(A), torch.linalg.matrix_rank(B))
    cos = torch.linalg.svdvals(A.double().T @ B.double()).clamp(0, 1)[:k]
    return torch.rad2deg(torch.arccos(cos)).sort().values


def ln_without_gain(model, cache, layer):
    y = cache[act_name("normalized", layer, "ln2")].double()
    return y - model.blocks[layer].ln2.b.detach().double()


def ln_bias_after_gain(model, cache, layer):
    ln = model.blocks[layer].ln2
    return cache[act_name("normalized", layer, "ln2")].double() / ln.w.detach().double() - ln.b.detach().double()


def layernorm_unbiased(q, w, eps):
    c = q - q.mean(-1, keepdim=True)
    return c / (c.var(-1, keepdim=True) + eps).sqrt() * w


def layernorm_rms(q, w, eps):
    return q / (q.pow(2).mean(-1, keepdim=True) + eps).sqrt() * w


def argmax_unmasked(model, cache, layer, kappa_q, kappa_k):
    from interp_norm.anatomy import anatomy, attention_scores

    la = anatomy(model)[layer]
    f_k = (1 + kappa_k)[:, :, list(la.kv_head_of)].permute(0, 2, 1).unsqueeze(-2)
    return (attention_scores(model, cache, layer) * (1 + kappa_q).permute(0, 2, 1).unsqueeze(-1) * f_k).argmax(-1)


def argmax_wrong_kv_heads(model, cache, layer, kappa_q, kappa_k):
    return S.noised_argmax(model, cache, layer, kappa_q, kappa_k.flip(-1))  # each query head reads the other k/v head


WRONG = {
    "my_scores": [scores_unscaled, scores_unmasked],
    "most_important_head": [head_argmin, head_swapped],
    "prev_token_scores": [prev_token_with_padding, prev_token_next_token],
    "patch_one": [patch_raw, patch_wrong_position],
    "attribution_scores": [attribution_negated, attribution_halved],
    "head_faithfulness": [faithfulness_inverted, faithfulness_unnormalised],
    "most_necessary_reads": [reads_of_most_necessary_overall, reads_most_attended],
    "eap_errors": [errors_of_batch_means, errors_signed],
    "query_norm_ratio": [ratio_inverted, ratio_ignores_seed],
    "mc_collapse_probability": [mc_half_width_level, mc_zero],
    "principal_angles_deg": [angles_radians, angles_not_orthonormalised],
    "ln_coordinates": [ln_without_gain, ln_bias_after_gain],
    "head_layernorm": [layernorm_unbiased, layernorm_rms],
    "noised_argmax": [argmax_unmasked, argmax_wrong_kv_heads],
}
NAMES = sorted(C.CHECKS)


def test_there_are_fourteen_checks_each_with_a_solution_and_wrong_answers():
    assert len(NAMES) == 14
    assert set(NAMES) == set(S.__all__) == set(WRONG)


# ============================================================================= the checks


@pytest.mark.parametrize("name", NAMES)
def test_solution_passes(name, data, capsys):
    result = C.CHECKS[name](getattr(S, name), *check_args(name, data))
    out = capsys.readouterr().out
    assert result.status == C.PASS and result, out
    assert out.startswith(f"[PASS] {name} — correct: ") and out.count("\n") == 1


@pytest.fixture(scope="module")
def calibrated(data):
    """The same data on models with the paper's Checkpoint calibration (fixed factors on scores and updates)."""
    pre = make_model(attn_norm="pre", calibration="paper")
    pre.calibrate(data["tokens"])
    ln = make_model(seed=3, attn_norm="qk", norm_kind="ln", calibration="paper")
    ln.calibrate(data["tokens"])
    with torch.no_grad():
        _, cache = pre.run_with_cache(data["tokens"])
        _, ln_cache = ln.run_with_cache(data["tokens"])
    return dict(data, pre=pre, cache=cache, ln=ln, ln_cache=ln_cache, **_located(pre, AdditionTask.preset("cpu")))


@pytest.mark.parametrize("name", [n for n in NAMES if n not in ("most_important_head", "mc_collapse_probability",
                                                                  "noised_argmax")])
def test_solution_passes_on_calibrated_models(name, calibrated):
    assert C.CHECKS[name](getattr(S, name), *check_args(name, calibrated)).status == C.PASS


@pytest.mark.parametrize("name,wrong", [(n, w) for n in NAMES for w in WRONG[n]], ids=lambda x: getattr(x, "__name__", x))
def test_wrong_answer_fails(name, wrong, data, capsys):
    result = C.CHECKS[name](wrong, *check_args(name, data))
    out = capsys.readouterr().out
    assert result.status == C.FAIL and not result, out
    assert out.startswith(f"[FAIL] {name} — not right yet: ")


@pytest.mark.parametrize("name", NAMES)
def test_untouched_stub_is_not_attempted(name, data, capsys):
    def stub(*args, **kwargs):
        return None

    result = C.CHECKS[name](stub, *check_args(name, data))
    assert result.status == C.NOT_ATTEMPTED and not result
    assert capsys.readouterr().out.startswith(f"[TODO] {name} — not attempted yet: ")


@pytest.mark.parametrize("name", NAMES)
def test_crashing_or_nonsense_attempt_is_reported_not_raised(name, data, capsys):
    def boom(*args, **kwargs):
        raise ValueError("my bug")

    def nonsense(*args, **kwargs):
        return "nonsense"

    crashed = C.CHECKS[name](boom, *check_args(name, data))
    assert crashed.status == C.FAIL and "ValueError: my bug" in crashed.message
    assert "raise ValueError" in crashed.message  # the line of the learner's code that raised
    assert C.CHECKS[name](nonsense, *check_args(name, data)).status == C.FAIL
    assert C.CHECKS[name]("not a function", *check_args(name, data)).status == C.FAIL
    assert "Traceback" not in capsys.readouterr().out


def test_a_function_that_leaves_hooks_on_the_model_fails_and_the_hooks_are_removed(data):
    def leaves_a_hook(model, cache, layer):
        model.add_hook(act_name("z", 0), lambda z, hook: z)
        return S.my_scores(model, cache, layer)

    model = data["pre"]
    result = C.check_my_scores(leaves_a_hook, model, data["cache"])
    assert result.status == C.FAIL and "left hooks" in result.message
    assert not any(hp.fwd_hooks for hp in model.hook_dict.values())


def test_head_layernorm_check_refuses_a_model_without_per_head_layernorms(data):
    from interp_norm.errors import ConfigError

    with pytest.raises(ConfigError, match="norm_kind 'ln'"):
        C.check_head_layernorm(S.head_layernorm, data["pre"], data["cache"])


def test_a_check_result_displays_nothing_in_jupyter():
    """The check printed its line; the returned object must not print a second one as a cell's value."""
    result = C.CheckResult("x", C.PASS, "ok")
    assert result._ipython_display_() is None and bool(result)


# ============================================================================= the notebooks' structure


@pytest.fixture(scope="module")
def builder():
    pytest.importorskip("nbformat")
    sys.path.insert(0, str(BUILDER))
    try:
        import build_notebooks
    finally:
        sys.path.remove(str(BUILDER))
    return build_notebooks


def test_there_are_six_tutorials():
    assert [p.name[:2] for p in NOTEBOOKS] == ["01", "02", "03", "04", "05", "06"]


def test_notebooks_match_their_builder(builder, tmp_path):
    import nbformat

    built = builder.build(tmp_path)
    assert [p.name for p in built] == [p.name for p in NOTEBOOKS]
    for p in built:
        mine = nbformat.read(p, as_version=4)
        theirs = nbformat.read(TUTORIALS / p.name, as_version=4)
        assert [c.source for c in mine.cells] == [c.source for c in theirs.cells], (
            f"{p.name} differs from scripts/tutorials/build_notebooks.py; rerun the builder"
        )
        assert all(not c.get("outputs") for c in theirs.cells if c.cell_type == "code"), f"{p.name} has outputs"
        assert "What you will learn" in "\n".join(c.source for c in mine.cells)


def _exercises(cells) -> list[tuple[int, str]]:
    """(cell index, function name) of every exercise cell."""
    out = []
    for i, c in enumerate(cells):
        if c.cell_type == "code" and c.metadata.get("tags") == ["exercise"]:
            fn = next(n for n in ast.parse(c.source).body if isinstance(n, ast.FunctionDef))
            out.append((i, fn.name))
    return out


def test_every_exercise_has_a_badge_a_check_and_a_collapsed_solution(builder):
    import inspect

    seen = []
    for nb_name, cells in builder.NOTEBOOKS.items():
        exercises = _exercises(cells)
        assert exercises, f"{nb_name} has no exercise"
        for i, name in exercises:
            seen.append(name)
            task = cells[i - 1] if cells[i - 1].cell_type == "markdown" else cells[i - 2]
            assert re.search(r"\*\*Difficulty:\*\* [1-5]/5 · \*\*~\d+ min\*\*", task.source), (nb_name, name)
            assert f"check_{name}({name}," in cells[i].source
            assert f"check_{name}" in cells[1].source, "the setup cell imports the notebook's checks"
            sol = cells[i + 1]
            assert sol.cell_type == "markdown" and sol.metadata.get("tags") == ["solution"]
            assert sol.source.startswith("<details>") and inspect.getsource(getattr(S, name)).strip() in sol.source
    assert sorted(seen) == NAMES, "every check is used by exactly one exercise"


def _bound_names(source: str) -> set[str]:
    """Names a code cell binds at top level or anywhere (def, class, assignment, import, for, with)."""
    names = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
    return names


def test_run_all_cannot_overwrite_the_learners_functions(builder):
    for nb_name, cells in builder.NOTEBOOKS.items():
        exercise_cells = dict(_exercises(cells))
        for i, c in enumerate(cells):
            if c.cell_type != "code":
                continue
            bound = _bound_names(c.source)
            for j, name in exercise_cells.items():
                if i != j:
                    assert name not in bound, f"{nb_name}: cell {i} redefines the learner's {name!r}"
            imports = [n for n in ast.walk(ast.parse(c.source)) if isinstance(n, (ast.Import, ast.ImportFrom))]
            assert not any("solutions" in ast.unparse(n) for n in imports), f"{nb_name}: cell {i} imports the solutions"


def test_stubs_return_none_so_ci_sees_unattempted_exercises(builder):
    for cells in builder.NOTEBOOKS.values():
        for i, name in _exercises(cells):
            fn_node = next(n for n in ast.parse(cells[i].source).body if isinstance(n, ast.FunctionDef))
            ns: dict = {}
            exec(compile(ast.Module([fn_node], []), "<stub>", "exec"), ns)
            assert ns[name](*[None] * len(fn_node.args.args)) is None


def test_markdown_explains_nan_thresholds_resume_and_the_n_notation(builder):
    text = {name[:2]: "\n".join(c.source for c in cells if c.cell_type == "markdown") for name, cells in builder.NOTEBOOKS.items()}
    assert "NaN" in text["03"] and "largest tested noise level" in text["03"]
    assert "bit-identically" in text["05"]
    # the schedule on resume is stated where the learner meets it, not only in a docstring
    assert "keeps the length it started with" in text["05"] and "never jumps back up" in text["05"]
    assert "TODO" not in "\n".join(text.values()).replace("[TODO]", "")  # the checks' mark for "not attempted"
    first_n = text["01"].index("The `N` notation")
    assert first_n < text["01"].index("[7-N3=10]")


def test_readme_lists_every_notebook_and_exercise_with_its_badge(builder):
    readme = (TUTORIALS / "README.md").read_text(encoding="utf-8")
    for nb_name, cells in builder.NOTEBOOKS.items():
        assert f"`{Path(nb_name).stem}`" in readme
        for i, name in _exercises(cells):
            task = cells[i - 1] if cells[i - 1].cell_type == "markdown" else cells[i - 2]
            badge = task.source.split("**Difficulty:** ")[1].split("**")[0].strip(" ·")  # e.g. 2/5
            minutes = task.source.split("**~")[1].split("**")[0]  # e.g. 10 min
            assert f"`{name}` {badge} ~{minutes}" in readme, f"README: {name} should read `{name}` {badge} ~{minutes}"


# emoji and pictographs (Misc Symbols, Dingbats, the arrows-and-shapes block, the emoji planes, the emoji
# variation selector): they render as identical empty boxes where no emoji font is installed
EMOJI = re.compile("[\u2600-\u27bf\u2b00-\u2bff\ufe0f\U0001f000-\U0010ffff]")


def test_the_folder_jupyterlab_opens_holds_only_notebooks_their_readme_and_html():
    """No helper module, check or solution one click away from the notebooks (they are in interp_norm.tutorial)."""
    tracked = {p.name for p in TUTORIALS.iterdir() if p.name != "__pycache__"}
    assert tracked == {p.name for p in NOTEBOOKS} | {"README.md", "html"}, sorted(tracked)


def test_notebooks_open_with_plain_imports_without_set_up_boilerplate(builder):
    for nb_name, cells in builder.NOTEBOOKS.items():
        first = next(c for c in cells if c.cell_type == "code").source
        assert "from interp_norm.tutorial import check_" in first, nb_name
        for c in cells:
            if c.cell_type == "code":
                for bad in ("sys.path", "formatwarning", "os.environ", "filterwarnings", "__file__", "_checks"):
                    assert bad not in c.source, f"{nb_name}: {bad!r} in a code cell:\n{c.source}"


def test_no_emoji_in_what_a_learner_reads(data, capsys):
    texts = {p.name: p.read_text(encoding="utf-8") for p in [*NOTEBOOKS, TUTORIALS / "README.md", *(TUTORIALS / "html").glob("*.html")]}
    for name in ("my_scores", "most_important_head"):
        C.CHECKS[name](getattr(S, name), *check_args(name, data))
        C.CHECKS[name](WRONG[name][0], *check_args(name, data))
        C.CHECKS[name](lambda *a: None, *check_args(name, data))
    texts["check output"] = capsys.readouterr().out
    texts["check html"] = "".join(C.CheckResult("x", st, "m").html() for st in (C.PASS, C.FAIL, C.NOT_ATTEMPTED))
    for name, text in texts.items():
        found = sorted(set(EMOJI.findall(text)))
        assert not found, f"{name}: {found} render as boxes without an emoji font; use text (see _core.MARK)"
    assert [texts["check output"].count(m) for m in ("[PASS]", "[FAIL]", "[TODO]")] == [2, 2, 2]


def test_in_jupyter_a_check_displays_its_line_as_text_and_as_coloured_html(data, monkeypatch, capsys):
    pytest.importorskip("IPython")
    import IPython.display

    shown = []
    monkeypatch.setattr(_core, "_ipython", lambda: object())  # as if in a kernel
    monkeypatch.setattr(IPython.display, "display", lambda obj, raw=False: shown.append((obj, raw)))
    result = C.check_most_important_head(lambda df: (0, "<b>"), data["ablation"])
    assert capsys.readouterr().out == "" and len(shown) == 1 and shown[0][1] is True
    bundle = shown[0][0]
    assert bundle["text/plain"] == result.line() and result.line().startswith("[FAIL] most_important_head — ")
    assert bundle["text/html"].startswith('<div style="font-family:monospace;white-space:pre-wrap"><b style="color:#cf222e">[FAIL]</b>')
    assert "&lt;b&gt;" in bundle["text/html"] or "<b>" not in result.message  # the message is escaped


def test_notebook_warnings_are_short_in_ipython_and_untouched_elsewhere(monkeypatch):
    import warnings

    import interp_norm.tutorial as T

    monkeypatch.setattr(warnings, "formatwarning", warnings.formatwarning)  # restored after the test
    before = warnings.formatwarning
    with warnings.catch_warnings():
        T._notebook_warnings()  # plain Python (pytest): nothing changes
        assert warnings.formatwarning is before
        monkeypatch.setattr(T, "_ipython", lambda: object())
        T._notebook_warnings()
        T._notebook_warnings()  # idempotent
        line = warnings.formatwarning("the task differs", UserWarning, "/tmp/ipykernel_42/123.py", 3, "x = 1")
        assert line == "UserWarning: the task differs\n"
        assert sum("IProgress not found" in str(f[1].pattern) for f in warnings.filters if f[1] is not None) == 1


def test_offline_html_detector_flags_network_references():
    assert _export.external_references('<script src="https://cdn.plot.ly/plotly-3.0.1.min.js"></script>')
    assert _export.external_references("<link rel=stylesheet href='//fonts.example.org/x.css'>")
    assert _export.external_references("<style>@import url('https://x.org/a.css');</style>")
    assert not _export.external_references('<script>var topojsonURL = "https://cdn.plot.ly/";</script><a href="https://arxiv.org">x</a>')


# ============================================================================= executing the notebooks


def _execute(path: Path):
    import nbclient
    import nbformat

    nb = nbformat.read(path, as_version=4)
    env_before = os.environ.get("OMP_NUM_THREADS")
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # the kernel inherits it
    try:
        # started in tutorials/, as Jupyter does for a notebook there
        client = nbclient.NotebookClient(nb, timeout=TIMEOUT, kernel_name="python3",
                                         resources={"metadata": {"path": str(TUTORIALS)}})
        client.execute()  # raises CellExecutionError on the first failing cell
    finally:
        if env_before is None:
            os.environ.pop("OMP_NUM_THREADS", None)
    return nb


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_executes(path):
    pytest.importorskip("nbclient")
    t = time.perf_counter()
    temporary = lambda: set(Path(tempfile.gettempdir()).glob("interp-norm-tutorial-*"))  # noqa: E731
    before = temporary()
    nb = _execute(path)
    assert temporary() <= before, "the notebook left temporary folders behind"
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []) if o.get("output_type") == "error"]
    assert not errors
    for c in nb.cells:
        stderr = "".join(o.get("text", "") for o in c.get("outputs", []) if o.get("name") == "stderr")
        assert "ipykernel_" not in stderr and "site-packages" not in stderr, f"a warning shows a file path: {stderr}"
        assert "IProgress not found" not in stderr, stderr
        if c.cell_type == "code" and c.metadata.get("tags") == ["exercise"]:
            name = next(n for n in ast.parse(c.source).body if isinstance(n, ast.FunctionDef)).name
            # in Jupyter a check displays its line: text/plain (the plain line) beside text/html (coloured)
            text = "".join(o.get("text", "") or o.get("data", {}).get("text/plain", "") for o in c.outputs)
            assert f"[TODO] {name}" in text and "not attempted yet" in text and "[FAIL]" not in text, text
            html = "".join(o.get("data", {}).get("text/html", "") for o in c.outputs)
            assert f'<b style="color:{_core._COLOUR[C.NOT_ATTEMPTED]}">[TODO]</b>' in html, "Jupyter shows the coloured mark"
    print(f"{path.name}: {time.perf_counter() - t:.1f} s")


@pytest.mark.slow
def test_html_export_is_offline_and_loads_the_shared_local_plotly(tmp_path):
    pytest.importorskip("nbconvert")
    import nbformat
    from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

    nb = new_notebook(cells=[new_markdown_cell("# t"), *(new_code_cell(
        f"import plotly.express as px\npx.line(x=[1, 2], y=[{i}, 3])") for i in range(2))])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    path = tmp_path / "t.ipynb"
    nbformat.write(nb, path)
    html = _export.to_offline_html(_export.execute_notebook(path, timeout=120), "t")
    assert not _export.external_references(html)
    assert html.count("Plotly.newPlot") >= 2
    assert html.count("* plotly.js v") == 0, "plotly.js is not embedded in the page"
    assert html.count(f'<script src="{_export.PLOTLY_JS}"></script>') == 1, "the page loads the shared local copy"
    # nbconvert's CSS lives once in notebook.css: the page links it and embeds none of it in its head
    head = html.split("</head>")[0]
    assert head.count(f'<link rel="stylesheet" href="{_export.NOTEBOOK_CSS}">') == 1 and "<style" not in head
    css = _export.shared_css()
    assert len(css.splitlines()) > 5000 and ".jp-Notebook" in css and ".highlight" in css  # the lab theme + pygments


def test_shipped_html_pages_link_one_shared_stylesheet():
    pages = sorted((TUTORIALS / "html").glob("*.html"))
    assert pages, "tutorials/html/ holds the exported pages"
    css = (TUTORIALS / "html" / _export.NOTEBOOK_CSS).read_text(encoding="utf-8")
    assert ".jp-Notebook" in css and ".jp-Cell" in css
    for page in pages:
        head = page.read_text(encoding="utf-8").split("</head>")[0]
        assert f'href="{_export.NOTEBOOK_CSS}"' in head and "<style" not in head, page.name
        assert len(head.splitlines()) < 50, f"{page.name}: CSS is embedded again"
