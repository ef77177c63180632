"""The interp-norm command line: subcommands, one-line errors with exit code 2, early output checks."""

from __future__ import annotations

import json
import subprocess
import sys

import pandas as pd
import pytest
import torch

from interp_norm import cli
from interp_norm.checkpoints import load_checkpoint, save_checkpoint
from interp_norm.errors import ConfigError
from interp_norm.evaluate import evaluate
from interp_norm.model import HookedNormTransformer, ModelConfig
from interp_norm.task import AdditionTask

TASK = AdditionTask.preset("cpu")


def run(capsys, *argv):
    try:
        code = cli.main(list(argv))
    except SystemExit as e:  # argparse errors
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


def assert_one_line_error(code, err, *needles):
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith("interp-norm"), lines[0]
    for n in needles:
        assert n in lines[0], (n, lines[0])


@pytest.fixture
def ckpt(tmp_path):
    model = HookedNormTransformer(ModelConfig.preset("tiny", attn_norm="qk", seed=4)).eval()
    return save_checkpoint(model, tmp_path / "ck", task=TASK)


def test_bad_arguments_exit_2_with_one_line(capsys):
    assert_one_line_error(*run(capsys, "train", "--out", "x", "--attn-norm", "post")[::2], "invalid choice: 'post'")
    assert_one_line_error(*run(capsys, "train", "--out", "x", "--steps", "many")[::2], "invalid int value")
    assert_one_line_error(*run(capsys, "frobnicate")[::2], "invalid choice")
    assert_one_line_error(*run(capsys)[::2], "required")


def test_errors_from_the_library_become_one_line_in_a_real_process(tmp_path):
    p = subprocess.run([sys.executable, "-m", "interp_norm.cli", "evaluate", str(tmp_path / "missing")],
                       capture_output=True, text=True, timeout=120)
    assert_one_line_error(p.returncode, p.stderr, "interp-norm: error:", "does not exist")
    assert p.stdout == ""


def test_unwritable_output_fails_before_any_work(tmp_path, capsys, monkeypatch):
    (tmp_path / "file").write_text("x")
    monkeypatch.setattr("interp_norm.train.train", lambda *a, **k: pytest.fail("training started"))
    code, _, err = run(capsys, "train", "--out", str(tmp_path / "file" / "run"), "--model-preset", "tiny")
    assert_one_line_error(code, err, "cannot write to output folder")
    code, _, err = run(capsys, "evaluate", "nothing-here", "--out", str(tmp_path / "file" / "r.csv"))
    assert_one_line_error(code, err, "is a file")  # checked before the checkpoint is even looked up
    code, _, err = run(capsys, "evaluate", "x", "--out", str(tmp_path))
    assert_one_line_error(code, err, "is a folder")


def test_cuda_requested_on_a_machine_without_it(capsys, tmp_path):
    if torch.cuda.is_available():
        pytest.skip("CUDA present")
    code, _, err = run(capsys, "train", "--out", str(tmp_path / "r"), "--preset", "paper")
    assert_one_line_error(code, err, "CUDA is not available", "--device cpu")
    assert not (tmp_path / "r").exists()
    code, _, err = run(capsys, "evaluate", "x", "--device", "cuda")
    assert_one_line_error(code, err, "CUDA is not available")


def test_evaluate_a_folder_writes_the_table(ckpt, tmp_path, capsys):
    out = tmp_path / "res" / "acc.csv"
    code, stdout, err = run(capsys, "evaluate", str(ckpt), "--size", "16", "--seed", "5", "--out", str(out))
    assert code == 0, err
    df = pd.read_csv(out)
    model, _ = load_checkpoint(ckpt)
    expected = evaluate(model, TASK, size=16, seed=5)
    assert df["split"].tolist() == ["id", "interp", "extrap"]
    pd.testing.assert_frame_equal(df.drop(columns="checkpoint"), expected, check_exact=False, rtol=1e-12)
    assert "per_token_acc" in stdout and "extrap" in stdout


def test_evaluate_a_pretrained_name_and_list(ckpt, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("INTERP_NORM_DATA", str(tmp_path / "data"))
    code, out, _ = run(capsys, "list")
    assert code == 0 and "no pretrained checkpoints" in out
    code, _, err = run(capsys, "evaluate", "qk")
    assert_one_line_error(code, err, "neither a checkpoint folder nor a pretrained name", "available: none")
    (tmp_path / "data" / "checkpoints").mkdir(parents=True)
    ckpt.rename(tmp_path / "data" / "checkpoints" / "qk")
    code, out, _ = run(capsys, "list")
    assert code == 0 and "qk" in out and "attn_norm" in out
    code, out, err = run(capsys, "evaluate", "qk", "--size", "8", "--splits", "id", "--no-exact-match")
    assert code == 0, err
    assert out.count("\n") == 2 and " id " in out


def test_train_maps_options_and_resumes(tmp_path, capsys):
    out = tmp_path / "run"
    argv = ["train", "--out", str(out), "--model-preset", "tiny", "--attn-norm", "qk", "--norm-kind", "ln",
            "--seed", "11", "--steps", "6", "--lr", "0.002", "--batch-size", "8", "--checkpoint-every", "4",
            "--eval-size", "8", "--final-eval-size", "8", "--grad-clip", "0", "--no-progress"]
    code, stdout, err = run(capsys, *argv)
    assert code == 0, err
    assert "step-00000006" in stdout and "per_token_acc" in stdout
    model, info = load_checkpoint(out)
    assert (model.cfg.attn_norm, model.cfg.norm_kind, model.cfg.seed) == ("qk", "ln", 11)
    t = info.train_cfg
    assert (t.max_steps, t.lr, t.batch_size, t.seed, t.grad_clip, t.checkpoint_every) == (6, 0.002, 8, 11, None, 4)
    assert info.task.to_dict() == TASK.to_dict()
    code, _, err = run(capsys, *argv)  # same folder without --resume
    assert_one_line_error(code, err, "--resume")
    code, _, err = run(capsys, *argv, "--resume", "--steps", "8")  # extend the run
    assert code == 0, err
    assert (out / "LATEST").read_text().strip() == "step-00000008"
    assert json.loads((out / "step-00000008" / "config.json").read_text())["step"] == 8
    code, _, err = run(capsys, *argv[:-1], "--lr", "0.1", "--resume")
    assert_one_line_error(code, err, "cannot resume", "lr")
    code, _, err = run(capsys, "train", "--out", str(out), "--resume", "--steps", "10", "--no-progress")
    assert code == 0, err  # the saved options are reused
    model, info = load_checkpoint(out)
    assert (info.step, info.train_cfg.lr, info.train_cfg.batch_size, model.cfg.norm_kind) == (10, 0.002, 8, "ln")
    code, _, err = run(capsys, "train", "--out", str(out), "--resume", "--steps", "12", "--attn-norm", "pre")
    assert_one_line_error(code, err, "cannot resume", "attn_norm")


def test_commands_can_be_registered_and_library_errors_are_caught(capsys):
    def hello_args(p):
        p.add_argument("--name", default="world")
        p.add_argument("--fail", action="store_true")

    @cli.command("hello", help="say hello", add_arguments=hello_args)
    def _hello(args):
        if args.fail:
            raise ConfigError("bad name\nsecond line")
        print(f"hello {args.name}")
        return 0

    try:
        code, out, _ = run(capsys, "hello", "--name", "QKV")
        assert code == 0 and out == "hello QKV\n"
        assert_one_line_error(*run(capsys, "hello", "--fail")[::2], "interp-norm: error: bad name second line")
        assert "hello" in cli.build_parser().format_help()
    finally:
        cli.COMMANDS.pop("hello")


def test_every_subcommand_is_registered_in_cli_and_library_modules_hold_no_argparse():
    from pathlib import Path

    import interp_norm

    assert list(cli.COMMANDS) == ["train", "evaluate", "list", "circuits", "noise", "collapse", "geometry",
                                  "reproduce", "dashboard"]
    root = Path(interp_norm.__file__).parent
    for path in root.rglob("*.py"):
        if path.name == "cli.py":
            continue
        text = path.read_text(encoding="utf-8")
        assert "argparse" not in text and "register_cli" not in text, path
    parser = cli.build_parser()  # every subcommand's options build without error
    for name in cli.COMMANDS:
        assert name in parser.format_help()


HEAVY = ("torch", "transformer_lens", "plotly", "pandas")


def _modules_after(code: str) -> set:
    p = subprocess.run([sys.executable, "-c", code + "\nimport sys, json; print(json.dumps(sorted(sys.modules)))"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    return set(json.loads(p.stdout.strip().splitlines()[-1]))


def test_help_imports_no_heavy_module():
    """``interp-norm --help`` (and ``import interp_norm``) load neither torch nor TransformerLens, plotly, pandas."""
    code = ("import contextlib, io\nfrom interp_norm import cli\n"
            "with contextlib.redirect_stdout(io.StringIO()):\n"
            "    try:\n        cli.main(['--help'])\n    except SystemExit as e:\n        assert e.code == 0\n")
    loaded = _modules_after(code)
    assert "interp_norm.cli" in loaded
    assert not {m for m in loaded if m.split(".")[0] in HEAVY}, sorted(m for m in loaded if m.split(".")[0] in HEAVY)[:5]
    loaded = _modules_after("import interp_norm; interp_norm.__version__")
    assert not {m for m in loaded if m.split(".")[0] in HEAVY}
    p = subprocess.run([sys.executable, "-m", "interp_norm.cli", "--help"], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and all(name in p.stdout for name in cli.COMMANDS)


def test_lazy_package_names_resolve():
    import interp_norm

    for name in interp_norm.__all__:
        assert getattr(interp_norm, name) is not None
        assert name in dir(interp_norm)
    from interp_norm import AdditionTask as A
    from interp_norm.task import AdditionTask as B

    assert A is B
    with pytest.raises(AttributeError):
        interp_norm.no_such_name
