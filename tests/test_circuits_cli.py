"""run_circuits writes the patching tables and the circuit graph; the CLI runner drives it."""

from __future__ import annotations

import argparse
import json

import pandas as pd
import pytest

from interp_norm import AdditionTask, HookedNormTransformer, ModelConfig
from interp_norm.circuits import cli_command, run_circuits
from interp_norm.errors import OutputDirError


def test_run_circuits_writes_tables_and_graph(tmp_path):
    model = HookedNormTransformer(ModelConfig.preset("tiny")).eval()
    tables = run_circuits(model, AdditionTask.preset("cpu"), tmp_path / "out", n_pairs=6, ig_steps=2, top_n=6,
                          attention_problems=16)
    expected = {"pairs", "answer_metrics", "patch_resid_pre", "patch_attn_out", "patch_mlp_out", "patch_z", "patch_z_all",
                "eap_vs_exact", "edges", "circuit", "faithfulness", "attention_map"}
    assert set(tables) == expected
    for name in expected:
        assert (tmp_path / "out" / f"{name}.csv").is_file()
    z = pd.read_csv(tmp_path / "out" / "patch_z.csv")
    assert {"layer", "pos", "head", "value", "effect", "normalized"} <= set(z.columns)
    graph = json.loads((tmp_path / "out" / "circuit.json").read_text())
    assert len(graph["edges"]) == len(tables["circuit"]) >= 6
    assert "plotly" in (tmp_path / "out" / "circuit.html").read_text()[:20000].lower()
    assert list(tables["faithfulness"].ablation) == ["resample", "mean", "zero"]


def test_run_circuits_refuses_a_file_as_folder(tmp_path):
    f = tmp_path / "x.csv"
    f.write_text("")
    with pytest.raises(OutputDirError, match="not a folder"):
        run_circuits(HookedNormTransformer(ModelConfig.preset("tiny")).eval(), None, f)


def test_cli_command_parses_its_arguments():
    p = argparse.ArgumentParser()
    run = cli_command(p)
    args = p.parse_args(["some/ckpt", "--pairs", "8", "--top-n", "5", "--metric", "kl_to_clean", "--unaligned"])
    assert callable(run) and args.pairs == 8 and args.top_n == 5 and args.unaligned and args.metric == "kl_to_clean"
