"""``interp-norm circuits``: run_circuits returns the tables and writes nothing; the CLI writes them,
the circuit graph (circuit.html) and the edge list (circuit.json)."""

from __future__ import annotations

import json
import math
import re

import pandas as pd
import pytest

from interp_norm import AdditionTask, HookedNormTransformer, ModelConfig, cli
from interp_norm.training.checkpoints import save_checkpoint
from interp_norm.circuits import run_circuits

TASK = AdditionTask.preset("cpu")
EXPECTED = {"pairs", "answer_metrics", "patch_resid_pre", "patch_attn_out", "patch_mlp_out", "patch_z", "patch_z_all",
            "eap_vs_exact", "eap_vs_exact_heads", "edges", "circuit", "faithfulness", "attention_map"}
ARGS = ["--pairs", "6", "--ig-steps", "2", "--top-n", "6", "--n-examples", "16"]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    model = HookedNormTransformer(ModelConfig.preset("tiny")).eval()
    return save_checkpoint(model, tmp_path_factory.mktemp("ck") / "tiny", task=TASK)


def test_run_circuits_returns_tables_and_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    model = HookedNormTransformer(ModelConfig.preset("tiny")).eval()
    tables = run_circuits(model, TASK, n_pairs=6, ig_steps=2, top_n=6, attention_problems=16)
    assert set(tables) == EXPECTED
    assert all(isinstance(df, pd.DataFrame) for df in tables.values())
    assert list(tmp_path.iterdir()) == []
    assert list(tables["faithfulness"].ablation) == ["resample", "mean", "zero"]
    _check_per_head_attribution_table(model, tables)


def _check_per_head_attribution_table(model, tables):
    """eap_vs_exact_heads: per head, the exact column is whole-head z patching (patch_z_all) and the
    attribution column what attribution_patch(by="all") computes on its own (not the per-position sum)."""
    from interp_norm.circuits import attribution_patch, make_metric, make_pairs

    heads = tables["eap_vs_exact_heads"]
    L, H = model.cfg.n_layers, model.cfg.n_heads
    assert sorted(heads["method"].unique()) == ["eap", "eap-ig2"] and len(heads) == 2 * L * H
    exact = tables["patch_z_all"].set_index(["layer", "head"])["effect"]
    pairs = make_pairs(TASK, 6, "id", 0, "digit", aligned=True)
    met = make_metric("logit_diff", pairs, model)
    for method, steps in (("eap", 1), ("eap-ig2", 2)):
        g = heads[heads["method"] == method]
        assert [(int(l), int(h)) for l, h in zip(g["layer"], g["head"])] == [(l, h) for l in range(L) for h in range(H)]
        ref = attribution_patch(model, pairs, met, "z", by="all", ig_steps=steps).effect().double()  # [layer, head]
        for row in g.itertuples():
            assert row.exact == pytest.approx(float(exact[(row.layer, row.head)]), abs=1e-9)
            assert row.attribution == pytest.approx(float(ref[row.layer, row.head]), rel=1e-4, abs=1e-6)


def test_cli_writes_every_table_the_graph_and_the_edge_list(ckpt, tmp_path, capsys):
    out = tmp_path / "out"
    assert cli.main(["circuits", str(ckpt), "--out", str(out), *ARGS]) == 0
    assert f"wrote {len(EXPECTED)} tables" in capsys.readouterr().out
    from interp_norm import load_with_info

    model, _ = load_with_info(ckpt)
    tables = run_circuits(model, TASK, n_pairs=6, ig_steps=2, top_n=6, attention_problems=16)
    for name in EXPECTED:  # the files hold exactly what the library returned
        back = pd.read_csv(out / f"{name}.csv")
        want = pd.read_csv(pd.io.common.StringIO(tables[name].to_csv(index=False)))
        pd.testing.assert_frame_equal(back, want, check_exact=False, rtol=1e-12)
    z = pd.read_csv(out / "patch_z.csv")
    assert {"layer", "pos", "head", "value", "effect", "normalized"} <= set(z.columns)
    graph = json.loads((out / "circuit.json").read_text())
    assert (graph["n_layers"], graph["n_heads"]) == (model.cfg.n_layers, model.cfg.n_heads)
    circuit = tables["circuit"]
    assert len(graph["edges"]) == len(circuit) >= 6
    assert [(e["sender"], e["receiver"]) for e in graph["edges"]] == list(zip(circuit["sender"], circuit["receiver"]))
    for e, s in zip(graph["edges"], circuit["score"]):
        assert (e["score"] is None and math.isnan(s)) or e["score"] == pytest.approx(s, rel=1e-12)
    from plotly.offline import get_plotlyjs

    html = (out / "circuit.html").read_text()
    assert get_plotlyjs() in html  # offline: plotly.js inside
    assert f"checkpoint {ckpt.name}: circuit of {len(circuit)} edges" in html  # the graph says whose circuit it is
    assert not re.search(r"<script[^>]*\bsrc\s*=", html.replace(get_plotlyjs(), ""), re.I)


def test_cli_refuses_a_file_as_folder_before_loading(tmp_path, capsys):
    f = tmp_path / "x.csv"
    f.write_text("")
    # the checkpoint does not exist either: the output error must come first
    assert cli.main(["circuits", "no/such/checkpoint", "--out", str(f)]) == 2
    err = capsys.readouterr().err
    assert "is a file" in err and "--out" in err


def test_circuits_options_parse():
    args = cli.build_parser().parse_args(["circuits", "some/ckpt", "--pairs", "8", "--top-n", "5", "--metric",
                                          "kl_to_clean", "--unaligned"])
    assert args.pairs == 8 and args.top_n == 5 and args.unaligned and args.metric == "kl_to_clean"
    assert args._run is cli.COMMANDS["circuits"].run


# ----------------------------------------------------------------------------- --benchmark

BENCH = ["--models", "prev_token", "induction", "--methods", "exact", "eap", "pruning", "--pairs", "8",
         "--ig-steps", "2", "--no-progress"]


def test_benchmark_writes_the_suite_tables_and_the_faithfulness_figure(tmp_path, capsys):
    from interp_norm.circuits.benchmark.suite import run_benchmark, run_benchmark_mib

    out = tmp_path / "bench"
    assert cli.main(["circuits", "--benchmark", "--out", str(out), *BENCH]) == 0
    assert "AUROC" in capsys.readouterr().out
    table = run_benchmark(["prev_token", "induction"], ["exact", "eap", "pruning"], n_pairs=8, ig_steps=2)
    mib = run_benchmark_mib(["prev_token", "induction"], ["exact", "eap"], n_pairs=8, ig_steps=2)
    for name, want in (("benchmark", table), ("mib_curve", mib["curve"]), ("mib_summary", mib["summary"])):
        back = pd.read_csv(out / f"{name}.csv")
        want = pd.read_csv(pd.io.common.StringIO(want.to_csv(index=False)))
        pd.testing.assert_frame_equal(back, want, check_exact=False, rtol=1e-9)
    back = pd.read_csv(out / "benchmark.csv")
    # exact patching recovers every hand-built circuit node (the ground truth comes from the construction)
    assert (back[(back.method == "exact") & (back.level == "node")]["auroc"] == 1.0).all()
    assert set(back.model) == {"prev_token", "induction"} and "pruning" in set(back.method)
    summary = pd.read_csv(out / "mib_summary.csv")
    assert set(summary.method) == {"exact", "eap"}  # pruning ranks no edges: no curve
    assert (summary["f_at_full"] - 1).abs().max() < 1e-6  # the full model is the clean run
    from plotly.offline import get_plotlyjs

    assert get_plotlyjs() in (out / "faithfulness.html").read_text()


def test_benchmark_shows_progress_by_default(tmp_path, monkeypatch):
    from interp_norm.errors import ConfigError

    seen = []

    def fake(*args, **kw):
        seen.append(kw["progress"])
        raise ConfigError("stop here")

    monkeypatch.setattr("interp_norm.circuits.benchmark.suite.run_benchmark", fake)
    base = ["circuits", "--benchmark", "--models", "prev_token", "--out", str(tmp_path / "b")]
    assert cli.main(base) == 2 and cli.main([*base, "--no-progress"]) == 2
    assert seen == [True, False]


@pytest.mark.parametrize("argv, message", [
    (["circuits"], "--benchmark"),
    (["circuits", "some/ckpt", "--benchmark"], "drop"),
])
def test_benchmark_and_checkpoint_are_exclusive(argv, message, tmp_path, capsys):
    assert cli.main([*argv, "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "error:" in err and message in err and "Traceback" not in err


def test_run_circuits_settings_come_from_a_spec_and_keywords_override_it():
    from interp_norm.circuits import CircuitsSpec
    from interp_norm.errors import ConfigError, PatchingError

    model = HookedNormTransformer(ModelConfig.preset("tiny")).eval()
    # an unknown metric stops the run before any patching: which one it names shows which setting won
    with pytest.raises(PatchingError, match="from-the-spec"):
        run_circuits(model, TASK, CircuitsSpec(n_pairs=2, metric="from-the-spec"))
    with pytest.raises(PatchingError, match="from-a-keyword"):
        run_circuits(model, TASK, CircuitsSpec(n_pairs=2, metric="from-the-spec"), metric="from-a-keyword")
    with pytest.raises(ConfigError, match="'n_pair'"):
        run_circuits(model, TASK, n_pair=2)
