"""One CLI grammar: every subcommand's parser and --help, shared flags with one name and one
meaning, the --out default rule, deprecated spellings, "did you mean", Ctrl-C lines, no empty output
folder after a failure, percentages, --placement after_norm where it means nothing, per-stage progress.

The expectations are spelled out here (flag names, folder names, messages), not read back from
``interp_norm.cli._grammar``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from interp_norm import cli
from interp_norm.training.checkpoints import save_checkpoint
from interp_norm.core.model import HookedNormTransformer, ModelConfig
from interp_norm.core.task import AdditionTask

from _models import run_cli

TASK = AdditionTask.preset("cpu")
ALL = ["train", "evaluate", "list", "circuits", "noise", "collapse", "geometry", "reproduce", "dashboard"]
HEAVY = ["train", "evaluate", "circuits", "noise", "collapse", "geometry", "reproduce", "dashboard"]
#: Flags whose meaning is shared but whose default depends on the analysis: type and dest are shared, and
#: the help starts with the one sentence that says what the flag means (it may add a unit: "per split").
PER_COMMAND_DEFAULT = {
    "--out": "output folder; ",
    "--seed": "seed of every random draw: problems, noise, model init (default: ",
    "--device": "cpu, cuda, cuda:1 ... (default: ",
    "--threads": "torch CPU threads (default: ",
    "--n-examples": "problems drawn from the addition task",
    "--levels": "noise levels: the RMS of κ in the factor (1+κ) on the q/k/v norms",
    "--batch-size": "problems per forward pass",
}


@pytest.fixture(autouse=True)
def _in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # default --out folders land here


def subparsers():
    parser = cli.build_parser()
    return next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices


def visible(p):
    return [a for a in p._actions if a.option_strings and a.help != argparse.SUPPRESS
            and not isinstance(a, argparse._HelpAction)]


def test_every_subcommand_parser_builds_and_its_help_runs(capsys):
    subs = subparsers()
    assert list(subs) == ALL
    for name in ALL:
        with pytest.raises(SystemExit) as e:
            cli.main([name, "--help"])
        assert e.value.code == 0
        out = capsys.readouterr().out
        assert out.startswith(f"usage: interp-norm {name}"), name


def test_every_help_in_one_process_imports_no_heavy_module():
    code = ("import contextlib, io, json, sys\nfrom interp_norm import cli\n"
            f"for argv in [['--help']] + [[c, '--help'] for c in {ALL!r}]:\n"
            "    with contextlib.redirect_stdout(io.StringIO()):\n"
            "        try:\n            cli.main(argv)\n        except SystemExit as e:\n            assert e.code == 0\n"
            "print(json.dumps(sorted({m.split('.')[0] for m in sys.modules})))\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    loaded = set(json.loads(p.stdout.strip().splitlines()[-1]))
    assert not loaded & {"torch", "transformer_lens", "plotly", "pandas"}


def test_shared_flags_have_one_name_and_one_meaning():
    subs = subparsers()
    by_flag: dict[str, list] = {}
    for name, p in subs.items():
        for a in visible(p):
            for s in a.option_strings:
                by_flag.setdefault(s, []).append((name, a))
    for flag, uses in by_flag.items():
        if len(uses) < 2:
            continue
        first = uses[0][1]
        for name, a in uses[1:]:
            assert (a.dest, a.type, a.nargs, a.choices) == (first.dest, first.type, first.nargs, first.choices), \
                (flag, uses[0][0], name)
            if flag in PER_COMMAND_DEFAULT:
                assert a.help.startswith(PER_COMMAND_DEFAULT[flag]) and first.help.startswith(PER_COMMAND_DEFAULT[flag])
            else:
                assert (a.help, a.default) == (first.help, first.default), (flag, uses[0][0], name)
    for flag in ("--out", "--seed", "--device", "--threads"):  # train's notes stay in train's help
        assert all(("train" in a.help or "resume" in a.help) == (name == "train") for name, a in by_flag[flag]), flag
    # one name per meaning: no dest is reached by two different visible flags anywhere
    names_of: dict[str, set] = {}
    for uses in by_flag.values():
        for _, a in uses:
            names_of.setdefault(a.dest, set()).add(max(a.option_strings, key=len))
    assert {d: n for d, n in names_of.items() if len(n) > 1} == {}
    # the heavy subcommands all have the shared flags; the count of problems is --n-examples everywhere
    for name in HEAVY:
        flags = {s for a in visible(subs[name]) for s in a.option_strings}
        assert {"--out", "--seed", "--device", "--threads", "--no-progress"} <= flags, name
    for name in ("evaluate", "circuits", "noise", "collapse", "geometry"):
        flags = {s for a in visible(subs[name]) for s in a.option_strings}
        assert "--n-examples" in flags and not flags & {"--size", "--n", "--attention-problems"}, name
    assert "--checkpoints" not in {s for a in visible(subs["reproduce"]) for s in a.option_strings}
    for name in ("reproduce", "dashboard"):  # both take checkpoints as positional CKPT arguments
        pos = [a for a in subs[name]._actions if not a.option_strings]
        assert [a.dest for a in pos] == ["ckpt"], name


def record_runs(monkeypatch):
    """Replace every subcommand's run by one that records the parsed, defaulted arguments."""
    seen = {}
    for name, cmd in list(cli.COMMANDS.items()):
        def run(args, name=name):
            seen[name] = args
            return 0
        monkeypatch.setitem(cli.COMMANDS, name, dataclasses.replace(cmd, run=run))
    return seen


def test_one_default_rule_for_out_seed_device_threads(monkeypatch):
    seen = record_runs(monkeypatch)
    calls = {
        "evaluate": ["evaluate", "pre"],
        "circuits": ["circuits", "runs/qk/step-00000300"],
        "noise": ["noise", "data/checkpoints/pre/"],
        "collapse": ["collapse", "qkv"],
        "geometry": ["geometry", "Qwen/Qwen3-0.6B"],
        "reproduce": ["reproduce"],
        "dashboard": ["dashboard", "pre", "qkv"],
        "train": ["train"],
    }
    expected_out = {"evaluate": "report/evaluate/pre", "circuits": "report/circuits/qk", "noise": "report/noise/pre",
                    "collapse": "report/collapse/qkv", "geometry": "report/geometry/Qwen3-0.6B",
                    "reproduce": "report/reproduce", "dashboard": "report/dashboard", "train": "report/train"}
    for name, argv in calls.items():
        assert cli.main(argv) == 0
        args = seen[name]
        assert Path(args.out) == Path(expected_out[name]), name
        if name == "train":  # not given: the preset's (or the saved run's on --resume)
            assert (args.seed, args.device, args.threads) == (None, None, None)
        else:
            assert (args.seed, args.device, args.threads) == (0, "cpu", 1), name
    assert cli.main(["circuits", "--benchmark"]) == 0
    assert Path(seen["circuits"].out) == Path("report/circuits/benchmark")
    assert cli.main(["evaluate", "pre", "--out", "mine", "--seed", "7", "--threads", "2"]) == 0
    assert (seen["evaluate"].out, seen["evaluate"].seed, seen["evaluate"].threads) == ("mine", 7, 2)
    assert not Path("report").exists()  # choosing a folder is not creating it


def test_old_spellings_still_work_and_warn(monkeypatch, capsys):
    seen = record_runs(monkeypatch)
    for argv, name, dest, value in [
        (["evaluate", "pre", "--size", "64"], "evaluate", "n_examples", 64),
        (["geometry", "pre", "--n", "32"], "geometry", "n_examples", 32),
        (["circuits", "pre", "--attention-problems", "16"], "circuits", "n_examples", 16),
        (["reproduce", "--checkpoints", "pre", "qkv"], "reproduce", "checkpoints_old", ["pre", "qkv"]),
    ]:
        old = next(a for a in argv if a.startswith("--"))
        code, _, err = run_cli(capsys, *argv)
        assert code == 0 and getattr(seen[name], dest) == value
        assert f"interp-norm {name}: warning: {old} is deprecated" in err, err
        assert not re.search(rf"{old}(?![\w-])", subparsers()[name].format_help())  # hidden from --help


def test_unknown_options_and_choices_say_what_was_meant(capsys):
    code, _, err = run_cli(capsys, "reproduce", "--quik")
    assert code == 2 and err.strip() == ("interp-norm reproduce: error: unrecognized arguments: --quik "
                                         "(did you mean --quick?) (see 'interp-norm reproduce --help')")
    code, _, err = run_cli(capsys, "noise", "pre", "--placment", "after_norm")
    assert code == 2 and err.startswith("interp-norm noise: error:") and "did you mean --placement?" in err
    code, _, err = run_cli(capsys, "train", "--attn-norm", "QKV")
    assert code == 2 and "invalid choice: 'QKV'" in err and "did you mean 'qkv'?" in err
    code, _, err = run_cli(capsys, "evalute", "pre")
    assert code == 2 and "did you mean 'evaluate'?" in err
    code, _, err = run_cli(capsys, "geometry", "pre", "--zzz")
    assert code == 2 and "did you mean" not in err and "unrecognized arguments: --zzz" in err


def test_a_model_name_in_the_wrong_case_gets_did_you_mean(tmp_path, monkeypatch, capsys):
    data = tmp_path / "data"
    model = HookedNormTransformer(ModelConfig.preset("tiny", attn_norm="qkv", seed=1)).eval()
    save_checkpoint(model, data / "checkpoints" / "qkv", task=TASK)
    monkeypatch.setenv("INTERP_NORM_DATA", str(data))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf-cache"))
    code, _, err = run_cli(capsys, "evaluate", "QKV")
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert err.startswith("interp-norm evaluate: error: 'QKV'") and "did you mean 'qkv'?" in err
    code, _, err = run_cli(capsys, "evaluate", "zebra")  # nothing close: the full message, no suggestion
    assert code == 2 and "did you mean" not in err and "available: qkv" in err
    assert not (tmp_path / "report").exists()  # the failed runs left no empty folders


def test_ctrl_c_says_what_the_subcommand_leaves(tmp_path, monkeypatch, capsys):
    def interrupt(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr("interp_norm.report.reproduce.reproduce", interrupt)
    monkeypatch.setattr("interp_norm.training.train.train", interrupt)
    code, _, err = run_cli(capsys, "reproduce", "pre", "--out", tmp_path / "a" / "b")
    assert code == 130 and err.startswith("interp-norm reproduce: interrupted") and "--resume" not in err
    assert "run the same command again, without --force" in err  # finished checkpoints are kept
    assert not (tmp_path / "a").exists()  # the folders made for --out are gone again
    code, _, err = run_cli(capsys, "train", "--out", tmp_path / "run", "--model-preset", "tiny", "--no-progress")
    assert code == 130 and err.startswith("interp-norm train: interrupted") and "--resume" in err


def test_a_failed_run_leaves_no_empty_output_folder_and_keeps_existing_ones(tmp_path, capsys):
    code, _, _ = run_cli(capsys, "noise", "no/such/ckpt", "--out", tmp_path / "x" / "y" / "z")
    assert code == 2 and not (tmp_path / "x").exists()
    (tmp_path / "mine").mkdir()
    code, _, _ = run_cli(capsys, "geometry", "no/such/ckpt", "--out", tmp_path / "mine" / "sub")
    assert code == 2 and (tmp_path / "mine").is_dir() and not (tmp_path / "mine" / "sub").exists()
    code, _, _ = run_cli(capsys, "evaluate", "no/such/ckpt")  # the default folder too
    assert code == 2 and not (tmp_path / "report").exists()


@pytest.fixture(scope="module")
def tiny_ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("ck")
    out = {}
    for a in ("pre", "qk", "none"):
        model = HookedNormTransformer(ModelConfig.preset("tiny", attn_norm=a, seed=3)).eval()
        out[a] = save_checkpoint(model, root / a, task=TASK)
    return out


@pytest.mark.parametrize("command", ["noise", "collapse"])
def test_placement_after_norm_is_refused_where_no_norm_sits_on_q_k_v(tiny_ckpts, tmp_path, capsys, command):
    for a, label in (("pre", "Pre-Norm"), ("none", "No-Norm")):
        code, _, err = run_cli(capsys, command, tiny_ckpts[a], "--out", tmp_path / a, "--placement", "after_norm")
        assert code == 2 and f"--placement after_norm means nothing for a {label} model" in err, err
        assert not (tmp_path / a).exists()
    code, _, err = run_cli(capsys, command, tiny_ckpts["qk"], "--out", tmp_path / "qk", "--placement", "after_norm",
                           "--levels", "0.1", "--n-examples", "8", "--no-progress",
                           *(["--n-datasets", "1"] if command == "noise" else []))
    assert code == 0, err
    import pandas as pd

    table = "noise_accuracy.csv" if command == "noise" else "collapse.csv"
    assert set(pd.read_csv(tmp_path / "qk" / table)["placement"]) == {"after_norm"}


def test_list_prints_percentages(tiny_ckpts, tmp_path, monkeypatch, capsys):
    import shutil

    data = tmp_path / "data"
    shutil.copytree(tiny_ckpts["pre"], data / "checkpoints" / "pre")
    monkeypatch.setenv("INTERP_NORM_DATA", str(data))
    code, out, _ = run_cli(capsys, "list", "--no-progress")  # accepted like on every other command
    assert code == 0 and "pre" in out
    header = out.splitlines()[0].split()
    assert {"calibration", "seed"} <= set(header)  # pre and pre-cal tell apart
    from interp_norm.training.checkpoints import list_pretrained

    row = list_pretrained().iloc[0]
    for col in ("id_acc", "interp_acc", "extrap_acc"):
        if row[col] == row[col]:  # a fresh checkpoint may have no recorded accuracy
            assert f"{100 * row[col]:.2f}%" in out


class _Bar:
    """Stands in for tqdm: records the label, the total and every tick."""
    made: list = []

    def __init__(self, *a, total=None, desc=None, disable=False, **k):
        self.total, self.desc, self.n, self.postfix = total, desc, 0, []
        _Bar.made.append(self)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def update(self, n=1):
        self.n += n

    def set_postfix_str(self, s):
        self.postfix.append(s)


@pytest.mark.parametrize("workers", [1, 2])
def test_reproduce_progress_ticks_per_stage(tiny_ckpts, monkeypatch, workers):
    from interp_norm.report.reproduce import Settings, run_analyses

    monkeypatch.setattr("tqdm.auto.tqdm", _Bar)
    _Bar.made = []
    settings = Settings.quick(analyses=("evaluate", "attention", "geometry"), workers=workers)
    run_analyses([str(tiny_ckpts["pre"]), str(tiny_ckpts["qk"])], settings, progress=True)
    bar = next(b for b in _Bar.made if b.desc == "reproduce")
    # 2 checkpoints x (evaluate, attention, geometry)
    assert (bar.total, bar.n) == (6, 6)
    assert {"pre: geometry", "qk: attention"} <= set(bar.postfix)


def test_the_dashboard_bar_is_labelled_dashboard(tiny_ckpts, tmp_path, monkeypatch):
    monkeypatch.setattr("tqdm.auto.tqdm", _Bar)
    _Bar.made = []
    assert cli.main(["dashboard", str(tiny_ckpts["pre"]), "--out", str(tmp_path / "d"), "--quick",
                     "--only", "evaluate"]) == 0
    assert [b.desc for b in _Bar.made if b.total is not None and b.desc in ("reproduce", "dashboard")] == ["dashboard"]


def test_top_level_help_names_hugging_face_models_and_the_out_rule():
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf), pytest.raises(SystemExit):
        cli.main(["--help"])
    text = " ".join(buf.getvalue().split())
    assert "Hugging Face" in text and "save_pretrained folder" in text and "Hugging Face cache" in text
    assert "report/SUBCOMMAND/MODEL" in text
