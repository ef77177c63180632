"""``interp-norm collapse|noise|geometry|dashboard`` on Hugging Face models saved with save_pretrained.

The tiny models are built offline and saved into tmp_path; nothing is downloaded. The expected
numbers come from the saved model itself (reloaded with transformers, not through interp_norm).
"""

from __future__ import annotations

import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pandas as pd
import pytest
import torch

from interp_norm.anatomy import tiny_hf_model

from _models import run_cli


def one_line_error(code, err, *needles):
    """Exit 2, no traceback, the error on one line (transformers may print its weight-loading bar before it)."""
    assert code == 2, err
    lines = [ln for ln in err.strip().splitlines() if "Loading weights" not in ln]
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith("interp-norm"), lines[0]
    for n in needles:
        assert n in lines[0], (n, lines[0])


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("hf") / "tiny-qwen3"
    tiny_hf_model("qwen3", seed=6).save_pretrained(folder)
    return folder


def test_geometry_on_a_save_pretrained_folder(hf_folder, tmp_path, capsys):
    import transformers

    code, out, err = run_cli(capsys, "geometry", hf_folder, "--out", tmp_path / "g", "--windows", "2", "--n-ctx", "9",
                         "--no-progress")
    assert code == 0, err
    assert "Loading weights" not in err  # --no-progress hides transformers' bar too ...
    from transformers.utils import logging as hf_logging

    assert hf_logging.is_progress_bar_enabled()  # ... for that command only
    mem = pd.read_csv(tmp_path / "g" / "geometry_ellipsoid_membership.csv")
    assert {"q_norm", "k_norm", "residual"} <= set(mem["role"])
    assert mem["max_abs_err"].max() < 1e-5
    # the q-norm gains in the table's ellipsoids are the saved weights (reloaded independently)
    ref = transformers.AutoModelForCausalLM.from_pretrained(hf_folder, local_files_only=True)
    axes = pd.read_csv(tmp_path / "g" / "geometry_ellipsoid_axes.csv")
    q0 = axes[axes["module"] == mem[mem["role"] == "q_norm"]["module"].iloc[0]]["semi_axis"].sort_values().to_numpy()
    g = ref.model.layers[0].self_attn.q_norm.weight.detach().double()
    expect = torch.sort(g.abs() * g.numel() ** 0.5).values.numpy()
    assert q0 == pytest.approx(expect, rel=1e-4)
    assert (tmp_path / "g" / "geometry_anatomy.csv").is_file() and "wrote" in out


def test_a_folder_that_is_no_model_gets_a_typed_error(tmp_path, capsys):
    bad = tmp_path / "notamodel"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps({"hello": 1}))
    code, _, err = run_cli(capsys, "collapse", bad, "--out", tmp_path / "c")
    one_line_error(code, err, "not a supported model folder", "save_pretrained")
    assert "format_version None" not in err
    empty = tmp_path / "empty"
    empty.mkdir()
    code, _, err = run_cli(capsys, "geometry", empty, "--out", tmp_path / "g")
    one_line_error(code, err, "not a supported model folder")


def test_a_missing_name_says_nothing_is_downloaded(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "cache"))
    code, _, err = run_cli(capsys, "geometry", "someorg/not-cached-model", "--out", tmp_path / "g")
    one_line_error(code, err, "not in the Hugging Face cache", "never downloads")


def test_commands_on_the_addition_task_refuse_a_hf_model(hf_folder, tmp_path, capsys):
    code, _, err = run_cli(capsys, "evaluate", hf_folder)
    one_line_error(code, err, "Hugging Face model", "interp-norm evaluate")


@pytest.mark.parametrize("command", ["collapse", "noise"])  # -> bridges.bridge_collapse / bridges.text_agreement
def test_collapse_and_noise_route_a_hf_folder_to_the_bridge_engine(hf_folder, tmp_path, capsys, command):
    code, out, err = run_cli(capsys, command, hf_folder, "--out", tmp_path / "o", "--levels", "0", "0.3",
                         "--windows", "2", "--n-ctx", "9", "--no-progress")
    assert code == 0, err
    name = "collapse.csv" if command == "collapse" else "noise_accuracy.csv"
    df = pd.read_csv(tmp_path / "o" / name)
    assert len(df) and set(df["level"].round(6)) >= {0.3}


def test_dashboard_with_a_hf_model_has_the_real_model_section(hf_folder, tmp_path, capsys):
    code, out, err = run_cli(capsys, "dashboard", hf_folder, "--out", tmp_path / "d", "--windows", "2", "--n-ctx", "9",
                         "--no-progress")
    assert code == 0, err
    page = (tmp_path / "d" / "dashboard.html").read_text()
    assert "<h2>Hugging Face models</h2>" in page and "Attention anatomy" in page  # no models of ours: no "beside ours"
    # saved without a tokenizer: the page says what was measured, and the warning names no flag of another command
    assert "on random token ids (tiny-qwen3: no tokenizer" in page and "text windows instead" not in page
    warned = [ln for ln in err.splitlines() if "warning" in ln and "tokenizer" in ln]
    assert len(warned) == 1 and "--" not in warned[0].split("warning:", 1)[1], err
    assert "<h2>Models</h2>" not in page
    assert "figure skipped" not in page


def test_layer_comparison_puts_ours_beside_the_real_model():
    from interp_norm.report.dashboard.real_models import layer_comparison

    real = pd.DataFrame(dict(model="hf", layer=[0, 1, 2], spread=[0.1, 0.2, 0.3], frac_sparse=[0.0, 0.5, 1.0]))
    ns = pd.DataFrame(dict(variant="pre", layer=[0, 1, 0, 1], head=pd.array([pd.NA, pd.NA, 0, 0], dtype="Int64"),
                           spread=[0.4, 0.5, 9.0, 9.0]))
    ss = pd.DataFrame(dict(variant="pre", layer=pd.array([0, 1, pd.NA], dtype="Int64"), frac_sparse=[0.2, 0.3, 0.25]))
    df = layer_comparison({"real_layers": real, "geometry_norm_spread": ns, "geometry_sparsity_summary": ss})
    ours = df[df["source"] == "ours"].sort_values("layer")
    assert list(ours["spread"]) == [0.4, 0.5] and list(ours["frac_sparse"]) == [0.2, 0.3]
    assert list(ours["depth"]) == [0.0, 1.0]
    assert list(df[df["source"] == "hugging face"]["depth"]) == [0.0, 0.5, 1.0]


def test_placement_after_norm_needs_a_norm_on_q_k_or_v(hf_folder, tmp_path, capsys):
    """GPT-2 (Pre-LN, no q/k norm): noise after the norm is noise before it, so the flag is refused;
    Qwen3 has per-head q/k norms, so it runs and records the placement."""
    gpt2 = tmp_path / "tiny-gpt2"
    tiny_hf_model("gpt2", seed=2).save_pretrained(gpt2)
    capsys.readouterr()
    code, _, err = run_cli(capsys, "noise", gpt2, "--out", tmp_path / "g", "--placement", "after_norm",
                           "--windows", "2", "--n-ctx", "9", "--no-progress")
    one_line_error(code, err, "interp-norm noise: error: --placement after_norm means nothing", "no norm on q, k or v")
    assert not (tmp_path / "g").exists()
    code, out, err = run_cli(capsys, "collapse", hf_folder, "--out", tmp_path / "q", "--placement", "after_norm",
                             "--levels", "0.3", "--windows", "2", "--n-ctx", "9", "--no-progress")
    assert code == 0, err
    assert set(pd.read_csv(tmp_path / "q" / "collapse.csv")["placement"]) == {"after_norm"}
