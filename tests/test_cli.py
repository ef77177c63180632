"""The interp-norm command line: subcommands, one-line errors with exit code 2, early output checks."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import numpy as np
import pandas as pd
import pytest
import torch

from interp_norm.cli import _support as S
from interp_norm import cli
from interp_norm import load_with_info
from interp_norm.training.checkpoints import save_checkpoint
from interp_norm.errors import ConfigError
from interp_norm.core.scoring import evaluate
from interp_norm.core.model import HookedNormTransformer, ModelConfig
from interp_norm.core.task import AdditionTask

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


@pytest.fixture(autouse=True)
def _in_tmp(tmp_path, monkeypatch):
    """Default --out folders (report/...) land in the test's own folder, not the repository."""
    monkeypatch.chdir(tmp_path)


@pytest.fixture
def ckpt(tmp_path):
    model = HookedNormTransformer(ModelConfig.preset("tiny", attn_norm="qk", seed=4)).eval()
    return save_checkpoint(model, tmp_path / "ck", task=TASK)


def test_bad_arguments_exit_2_with_one_line(capsys):
    assert_one_line_error(*run(capsys, "train", "--out", "x", "--attn-norm", "post")[::2], "invalid choice: 'post'")
    assert_one_line_error(*run(capsys, "train", "--out", "x", "--steps", "many")[::2], "argument --steps: expected a positive integer, got 'many'")
    assert_one_line_error(*run(capsys, "frobnicate")[::2], "invalid choice")
    assert_one_line_error(*run(capsys)[::2], "required")


def test_errors_from_the_library_become_one_line_in_a_real_process(tmp_path):
    p = subprocess.run([sys.executable, "-m", "interp_norm.cli", "evaluate", str(tmp_path / "missing")],
                       capture_output=True, text=True, timeout=120)
    assert_one_line_error(p.returncode, p.stderr, "interp-norm evaluate: error:", "does not exist")
    assert p.stdout == ""


def test_unwritable_output_fails_before_any_work(tmp_path, capsys, monkeypatch):
    (tmp_path / "file").write_text("x")
    monkeypatch.setattr("interp_norm.training.train.train", lambda *a, **k: pytest.fail("training started"))
    code, _, err = run(capsys, "train", "--out", str(tmp_path / "file" / "run"), "--model-preset", "tiny")
    assert_one_line_error(code, err, "cannot write to output folder")
    code, _, err = run(capsys, "evaluate", "nothing-here", "--out", str(tmp_path / "file"))
    assert_one_line_error(code, err, "is a file")  # checked before the checkpoint is even looked up
    code, _, err = run(capsys, "evaluate", "nothing-here", "--out", str(tmp_path / "file" / "sub"))
    assert_one_line_error(code, err, "cannot write to output folder")


def test_cuda_requested_on_a_machine_without_it(capsys, tmp_path):
    if torch.cuda.is_available():
        pytest.skip("CUDA present")
    code, _, err = run(capsys, "train", "--out", str(tmp_path / "r"), "--preset", "paper")
    assert_one_line_error(code, err, "CUDA is not available", "--device cpu")
    assert not (tmp_path / "r").exists()
    code, _, err = run(capsys, "evaluate", "x", "--device", "cuda")
    assert_one_line_error(code, err, "CUDA is not available")


def test_evaluate_a_folder_writes_the_table(ckpt, tmp_path, capsys):
    out = tmp_path / "res"
    code, stdout, err = run(capsys, "evaluate", str(ckpt), "--n-examples", "16", "--seed", "5", "--out", str(out))
    assert code == 0, err
    df = pd.read_csv(out / "evaluation.csv")
    model, _ = load_with_info(ckpt)
    expected = evaluate(model, TASK, size=16, seed=5)
    assert df["split"].tolist() == ["id", "interp", "extrap"]
    pd.testing.assert_frame_equal(df.drop(columns="checkpoint"), expected, check_exact=False, rtol=1e-12)
    assert "per_token_acc" in stdout and "extrap" in stdout
    for v in expected["per_token_acc"]:  # printed as percentages; the CSV keeps fractions
        assert f"{100 * v:.2f}%" in stdout


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
    code, out, err = run(capsys, "evaluate", "qk", "--n-examples", "8", "--splits", "id", "--no-exact-match")
    assert code == 0, err
    assert out.count("\n") == 3 and " id " in out and "%" in out
    assert (tmp_path / "report" / "evaluate" / "qk" / "evaluation.csv").is_file()  # the default --out


def test_train_maps_options_and_resumes(tmp_path, capsys):
    out = tmp_path / "run"
    argv = ["train", "--out", str(out), "--model-preset", "tiny", "--attn-norm", "qk", "--norm-kind", "ln",
            "--seed", "11", "--steps", "6", "--lr", "0.002", "--batch-size", "8", "--checkpoint-every", "4",
            "--eval-size", "8", "--final-eval-size", "8", "--grad-clip", "0", "--no-progress"]
    code, stdout, err = run(capsys, *argv)
    assert code == 0, err
    assert "step-00000006" in stdout and "per_token_acc" in stdout
    model, info = load_with_info(out)
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
    model, info = load_with_info(out)
    assert (info.step, info.train_cfg.lr, info.train_cfg.batch_size, model.cfg.norm_kind) == (10, 0.002, 8, "ln")
    code, _, err = run(capsys, "train", "--out", str(out), "--resume", "--steps", "12", "--attn-norm", "pre")
    assert_one_line_error(code, err, "interp-norm train: error:", "cannot resume", "--attn-norm")


def test_resume_without_a_run_is_an_error_that_creates_nothing(tmp_path, capsys):
    """A mistyped --out with --resume must not start a fresh default run."""
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "notes.txt").write_text("not a run")
    for out in (tmp_path / "missing", empty):
        before = sorted(tmp_path.rglob("*"))
        code, _, err = run(capsys, "train", "--out", str(out), "--resume", "--model-preset", "tiny", "--no-progress")
        assert_one_line_error(code, err, "interp-norm train: error:", str(out), "LATEST", "drop --resume")
        assert sorted(tmp_path.rglob("*")) == before  # nothing created


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
        assert_one_line_error(*run(capsys, "hello", "--fail")[::2], "interp-norm hello: error: bad name second line")
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
        if path.parent.name == "cli":  # the command line and its machinery
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
    from interp_norm.core.task import AdditionTask as B

    assert A is B
    with pytest.raises(AttributeError):
        interp_norm.no_such_name  # noqa: B018 (the attribute access is what is tested)


# ----------------------------------------------------------------------------- daily use

LONG = ("train", "evaluate", "circuits", "noise", "collapse", "geometry", "reproduce", "dashboard")


def subparser(name):
    parser = cli.build_parser()
    return next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[name]


def test_library_errors_name_the_command_and_its_flags(capsys, tmp_path):
    code, _, err = run(capsys, "train", "--out", str(tmp_path / "r"), "--model-preset", "tiny", "--lr", "-1")
    assert_one_line_error(code, err, "interp-norm train: error: --lr must be a positive number")
    assert not (tmp_path / "r").exists()
    flags = cli.COMMANDS["train"].flags
    assert S.with_flag_names("max_steps must be a positive integer, got 0", flags) == "--steps must be a positive integer, got 0"
    circuits = S.flag_map(subparser("circuits"), cli.COMMANDS["circuits"].flags)
    assert S.with_flag_names("n must be a positive integer; top_n too", circuits) == "--pairs must be a positive integer; --top-n too"
    noise = S.flag_map(subparser("noise"), cli.COMMANDS["noise"].flags)
    # whole identifiers only: a flag already spelled, a longer name and plain words stay
    msg = "n_examples=0 (--n-examples); lr_factor; in sum, the levels"
    assert S.with_flag_names(msg, {**noise, "lr": "--lr"}) == "--n-examples=0 (--n-examples); lr_factor; in sum, the --levels"


def test_a_noise_level_too_large_for_uniform_noise_names_the_flags(ckpt, capsys, tmp_path):
    for name in ("noise", "collapse"):
        code, _, err = run(capsys, name, str(ckpt), "--out", str(tmp_path / name), "--levels", "0.7", "--no-progress")
        assert_one_line_error(code, err, f"interp-norm {name}: error: uniform noise level 0.7", "--distribution")
        assert "distribution=" not in err.replace("--distribution=", "")


def test_counts_are_checked_where_they_are_typed(capsys):
    assert_one_line_error(*run(capsys, "circuits", "x", "--pairs", "0")[::2],
                          "interp-norm circuits: error: argument --pairs: must be a positive integer, got 0")
    assert_one_line_error(*run(capsys, "noise", "x", "--out", "o", "--n-examples", "-3")[::2], "argument --n-examples")
    assert_one_line_error(*run(capsys, "evaluate", "x", "--n-examples", "0")[::2], "argument --n-examples")
    assert_one_line_error(*run(capsys, "evaluate", "x", "--size", "0")[::2], "argument --size")  # deprecated spelling
    assert_one_line_error(*run(capsys, "circuits", "x", "--split", "train")[::2], "argument --split: invalid choice")


def test_a_problem_with_spaces_gets_a_message_about_spaces(capsys, tmp_path):
    code, _, err = run(capsys, "reproduce", "--out", str(tmp_path / "r"), "--problems", "[7 + 3 =")
    assert_one_line_error(code, err, "interp-norm reproduce: error:", "space")
    assert "negative" not in err


def test_every_option_has_help_and_shows_its_default():
    for name in cli.COMMANDS:
        p = subparser(name)
        text = " ".join(p.format_help().split())
        for a in p._actions:
            if isinstance(a, argparse._HelpAction) or a.help == argparse.SUPPRESS:  # deprecated spellings are hidden
                continue
            assert a.help, f"{name} {a.option_strings or a.dest}: no help text"
            if not a.option_strings:
                continue
            if a.default is None and not a.required:
                assert "default" in a.help, f"{name} {a.option_strings}: say what happens without it"
            elif a.default is not None and a.default is not False:
                assert f"(default: {S.show_default(a.default)})" in text, (name, a.option_strings)
    from interp_norm.noise import DEFAULT_COLLAPSE_LEVELS, DEFAULT_NOISE_LEVELS

    assert subparser("noise").get_default("levels") == list(DEFAULT_NOISE_LEVELS)
    assert subparser("collapse").get_default("levels") == list(DEFAULT_COLLAPSE_LEVELS)


def test_progress_is_on_by_default_for_every_long_command(ckpt, tmp_path, monkeypatch):
    for name in LONG:
        p = subparser(name)
        flags = {s for a in p._actions for s in a.option_strings}
        assert "--no-progress" in flags and "--progress" not in flags, name
        assert p.get_default("no_progress") is False
    seen = {}

    def fake_run_circuits(model, task, **kw):
        seen.update(kw)
        raise ConfigError("stop here")

    monkeypatch.setattr("interp_norm.circuits.run_circuits", fake_run_circuits)
    assert cli.main(["circuits", str(ckpt), "--out", str(tmp_path / "c")]) == 2
    assert seen["progress"] is True
    assert cli.main(["circuits", str(ckpt), "--out", str(tmp_path / "c"), "--no-progress"]) == 2
    assert seen["progress"] is False


def test_out_is_a_folder_and_results_are_not_overwritten_without_force(ckpt, tmp_path, capsys):
    for name, argv, files in [
        ("evaluate", ["evaluate", "no/such/ckpt"], ["evaluation.csv"]),
        ("noise", ["noise", "no/such/ckpt"], ["noise_accuracy.csv"]),
        ("collapse", ["collapse", "no/such/ckpt"], ["collapse_thresholds.csv"]),
        ("geometry", ["geometry", "no/such/ckpt"], ["geometry_norm_spread.csv"]),
        ("circuits", ["circuits", "no/such/ckpt"], ["circuit.json"]),
        ("reproduce", ["reproduce", "no/such/ckpt"], ["run.json"]),
        ("dashboard", ["dashboard", "no/such/ckpt"], ["dashboard.html"]),
    ]:
        out = tmp_path / name
        out.mkdir()
        (out / files[0]).write_text("precious")
        code, _, err = run(capsys, *argv, "--out", str(out))  # refused before the checkpoint is looked up
        assert_one_line_error(code, err, f"interp-norm {name}: error:", "already holds", files[0], "--force")
        assert (out / files[0]).read_text() == "precious"
        code, _, err = run(capsys, *argv, "--out", str(out), "--force")
        assert_one_line_error(code, err, "no/such/ckpt")  # --force gets past the check to the checkpoint
    # a real run: --force replaces the table
    out = tmp_path / "noise"
    code, stdout, err = run(capsys, "noise", str(ckpt), "--out", str(out), "--levels", "0", "0.1", "--n-examples", "8",
                            "--n-datasets", "2", "--no-progress", "--force")
    assert code == 0, err
    df = pd.read_csv(out / "noise_accuracy.csv")
    assert sorted(set(df["level"])) == [0.0, 0.1]
    header, *rows = stdout.splitlines()[:-1]
    at = header.split().index("level")
    assert header.split()[0] == "model" and rows[0].split()[0] == ckpt.name  # whose numbers, as percentages
    assert {r.split()[at] for r in rows} == {"0.00%", "10.00%"}


def test_collapse_writes_the_reports_table_names_and_explains_missing_levels(ckpt, tmp_path, capsys):
    out = tmp_path / "c"
    code, stdout, err = run(capsys, "collapse", str(ckpt), "--out", str(out), "--levels", "0.01", "0.5",
                            "--n-examples", "8", "--no-progress")
    assert code == 0, err
    assert sorted(p.name for p in out.iterdir()) == ["collapse.csv", "collapse_thresholds.csv"]  # as in reproduce
    th = pd.read_csv(out / "collapse_thresholds.csv")
    assert {"level_measured", "level_predicted"} <= set(th.columns)
    assert "1% of sparse attention rows collapse" in stdout
    if th[["level_measured", "level_predicted"]].isna().any().any():
        assert "'> L'" in stdout or "'< L'" in stdout or "'no rows'" in stdout


def test_threshold_display_says_why_a_level_is_missing():
    rows = []
    nan = [np.nan] * 3
    for layer, measured in ((0, [0.0, 0.001, 0.002]), (1, [0.05, 0.2, 0.5]), (2, [0.0, 0.02, 0.4]), (3, nan)):
        for level, m in zip((0.05, 0.1, 0.5), measured):
            rows.append(dict(variant="Pre-Norm", layer=layer, definition="loose", level=level, measured=m, predicted=m))
    curves = pd.DataFrame(rows)
    th = pd.DataFrame([dict(variant="Pre-Norm", layer=l, definition="loose", target=0.01, level_measured=v,
                            level_predicted=v) for l, v in ((0, np.nan), (1, np.nan), (2, 0.075), (3, np.nan))])
    shown, notes = S.threshold_display(th, curves)
    assert list(shown["level_measured"]) == ["> 50.00%", "< 5.00%", "7.50%", "no rows"]  # levels as percentages
    assert list(shown["level_predicted"]) == ["> 50.00%", "< 5.00%", "7.50%", "no rows"]
    assert len(notes) == 3 and "no attention row" in notes[0] and "never reached" in notes[1]
    assert "already above" in notes[2]
    assert th["level_measured"].isna().sum() == 3  # the table itself is unchanged


def test_train_threads_and_min_lr_reach_the_training_config(tmp_path, monkeypatch):
    seen = []

    def fake_train(model_cfg, task, train_cfg, out, **kw):
        seen.append(train_cfg)
        raise ConfigError("stop here")

    monkeypatch.setattr("interp_norm.training.train.train", fake_train)
    base = ["train", "--out", str(tmp_path / "r"), "--model-preset", "tiny", "--no-progress"]
    assert cli.main(base) == 2 and seen[-1].threads == 1 and seen[-1].min_lr == 0  # the default path: 1 thread
    assert cli.main([*base, "--threads", "2", "--min-lr", "1e-4"]) == 2
    assert seen[-1].threads == 2 and seen[-1].min_lr == 1e-4
    assert_one_line_error(*run_quiet(["train", "--out", "x", "--threads", "0"]), "argument --threads")


def test_train_extension_is_explained_in_flags_on_one_line(tmp_path, capsys):
    run = ["train", "--out", str(tmp_path / "r"), "--model-preset", "tiny", "--batch-size", "8", "--log-every", "2",
           "--eval-every", "4", "--eval-size", "8", "--final-eval-size", "8", "--checkpoint-every", "4", "--no-progress"]
    assert cli.main([*run, "--steps", "4"]) == 0
    capsys.readouterr()
    assert cli.main([*run, "--steps", "6", "--resume"]) == 0
    err = capsys.readouterr().err
    warning = [line for line in err.splitlines() if line.startswith("interp-norm train: warning: ")]
    assert len(warning) == 1, err
    assert "from 4 to 6 steps" in warning[0] and "run at --min-lr=0 and will not change the weights" in warning[0]
    assert "min_lr" not in err and "UserWarning" not in err  # the flag, not the Python parameter


def run_quiet(argv):
    import contextlib
    import io

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            code = cli.main(argv)
        except SystemExit as e:
            code = e.code
    return code, err.getvalue()
