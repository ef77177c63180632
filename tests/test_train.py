"""Training: determinism, exact resume, divergence handling, the LR schedule, and that it learns."""

from __future__ import annotations

import json
import math
import signal
import warnings

import pandas as pd
import pytest
import torch

from interp_norm.training import train as train_mod
from interp_norm import load_with_info
from interp_norm.training.checkpoints import load_train_state
from interp_norm.errors import ConfigError, OutputDirError, TrainingDivergedError
from interp_norm.core.scoring import evaluate
from interp_norm.core.model import HookedNormTransformer, ModelConfig
from interp_norm.core.task import AdditionTask
from interp_norm.training.train import PlateauHalving, batch_for_step, train
from interp_norm.training.config import TrainConfig

EASY = AdditionTask(train_terms=(2,), interp_terms=(2,), extrap_terms=(3,), n_digits=(1,))


def quick_cfg(**kw) -> TrainConfig:
    base = dict(lr=3e-3, batch_size=16, steps_per_epoch=4, max_steps=14, log_every=3, eval_every=5, eval_size=16,
                final_eval_size=16, checkpoint_every=5, grad_clip=1.0, seed=7)
    return TrainConfig(**{**base, **kw})


def assert_bit_identical(a: HookedNormTransformer, b: HookedNormTransformer) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert list(sa) == list(sb)
    for k in sa:
        assert torch.equal(sa[k].view(torch.int32), sb[k].view(torch.int32)), k


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """An uninterrupted 14-step run (3.5 epochs) that the other runs must reproduce."""
    out = tmp_path_factory.mktemp("ref")
    model, curve = train(ModelConfig.preset("tiny", attn_norm="qkv"), EASY, quick_cfg(), out, progress=False)
    return model, curve, out


def test_same_seed_gives_identical_weights_and_other_seed_differs(reference, tmp_path):
    ref, curve, _ = reference
    again, curve2 = train(ModelConfig.preset("tiny", attn_norm="qkv"), EASY, quick_cfg(), tmp_path / "a", progress=False)
    assert_bit_identical(ref, again)
    pd.testing.assert_frame_equal(curve, curve2)
    other, _ = train(ModelConfig.preset("tiny", attn_norm="qkv"), EASY, quick_cfg(seed=8), tmp_path / "b", progress=False)
    assert not torch.equal(ref.W_E, other.W_E)
    untrained = HookedNormTransformer(ModelConfig.preset("tiny", attn_norm="qkv"))
    assert not torch.equal(ref.W_E, untrained.W_E)


class Crash(BaseException):
    """A failure that saves nothing (as SIGKILL would): resuming starts from the last periodic checkpoint."""


def raise_at_call(monkeypatch, n: int, error):
    """Make the ``n``-th training-loss call raise ``error``; returns the real function, to put back."""
    real = train_mod.training_loss
    calls = {"n": 0}

    def failing(model, tokens, pos_offset):
        calls["n"] += 1
        if calls["n"] == n:
            raise error
        return real(model, tokens, pos_offset)

    monkeypatch.setattr(train_mod, "training_loss", failing)
    return real


@pytest.mark.parametrize("interrupt_at", [6, 13])  # just after a checkpoint; mid-epoch, mid-log-window
@pytest.mark.parametrize("error", [Crash, KeyboardInterrupt])
def test_resume_after_interrupt_equals_uninterrupted(reference, tmp_path, monkeypatch, interrupt_at, error):
    ref, ref_curve, ref_out = reference
    real = raise_at_call(monkeypatch, interrupt_at, error)
    cfg = ModelConfig.preset("tiny", attn_norm="qkv")
    with pytest.raises(error):
        train(cfg, EASY, quick_cfg(), tmp_path, progress=False)
    # Ctrl-C saves the last completed step; a crash leaves the last periodic checkpoint (every 5 steps)
    expected_step = interrupt_at - 1 if error is KeyboardInterrupt else 5 * ((interrupt_at - 1) // 5)
    assert load_train_state(tmp_path)["step"] == expected_step
    assert sorted(p.name for p in tmp_path.iterdir()) == ["LATEST", f"step-{expected_step:08d}"]
    monkeypatch.setattr(train_mod, "training_loss", real)
    model, curve = train(cfg, EASY, quick_cfg(), tmp_path, resume=True, progress=False)
    assert_bit_identical(ref, model)
    pd.testing.assert_frame_equal(curve, ref_curve, check_exact=True)
    final = "step-00000014/model.safetensors"
    assert (tmp_path / final).read_bytes() == (ref_out / final).read_bytes()
    _, info = load_with_info(tmp_path)
    assert info.step == 14 and info.metrics["final"]
    pd.testing.assert_frame_equal(info.curve, ref_curve, check_exact=True)


def test_ctrl_c_during_a_weight_update_is_held_until_the_step_is_complete(reference, tmp_path, monkeypatch):
    """A real SIGINT delivered inside the AdamW update: the step finishes, then it is saved and re-raised."""
    ref, ref_curve, _ = reference
    real = train_mod._update
    calls = {"n": 0}

    def sigint_mid_update(*args, **kw):
        calls["n"] += 1
        if calls["n"] == 8:  # the update of step index 7, i.e. the 8th step
            signal.raise_signal(signal.SIGINT)
        return real(*args, **kw)

    monkeypatch.setattr(train_mod, "_update", sigint_mid_update)
    cfg = ModelConfig.preset("tiny", attn_norm="qkv")
    with pytest.raises(KeyboardInterrupt) as e:
        train(cfg, EASY, quick_cfg(), tmp_path, progress=False)
    assert "saved a checkpoint at step 8" in "".join(getattr(e.value, "__notes__", []))
    assert load_train_state(tmp_path)["step"] == 8 and calls["n"] == 8
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # the handler is restored
    monkeypatch.setattr(train_mod, "_update", real)
    model, curve = train(cfg, EASY, quick_cfg(), tmp_path, resume=True, progress=False)
    assert_bit_identical(ref, model)
    pd.testing.assert_frame_equal(curve, ref_curve, check_exact=True)


def test_ctrl_c_that_cannot_be_held_back_saves_nothing_mid_update(reference, tmp_path, monkeypatch):
    """With a custom SIGINT handler installed the trainer leaves it alone; an interrupt landing inside
    an update then finds a half-updated state, so the last periodic checkpoint is kept instead."""
    ref, _, _ = reference
    real = train_mod._update
    calls = {"n": 0}

    def raise_now(signum, frame):
        raise KeyboardInterrupt

    def sigint_mid_update(*args, **kw):
        calls["n"] += 1
        if calls["n"] == 8:
            signal.raise_signal(signal.SIGINT)
        return real(*args, **kw)

    monkeypatch.setattr(train_mod, "_update", sigint_mid_update)
    previous = signal.signal(signal.SIGINT, raise_now)
    try:
        with pytest.raises(KeyboardInterrupt):
            train(ModelConfig.preset("tiny", attn_norm="qkv"), EASY, quick_cfg(), tmp_path, progress=False)
        assert signal.getsignal(signal.SIGINT) is raise_now
    finally:
        signal.signal(signal.SIGINT, previous)
    assert load_train_state(tmp_path)["step"] == 5
    monkeypatch.setattr(train_mod, "_update", real)
    model, _ = train(ModelConfig.preset("tiny", attn_norm="qkv"), EASY, quick_cfg(), tmp_path, resume=True, progress=False)
    assert_bit_identical(ref, model)


def test_ctrl_c_before_the_first_step_writes_nothing(tmp_path, monkeypatch):
    def interrupt(model, tokens, pos_offset):
        raise KeyboardInterrupt

    monkeypatch.setattr(train_mod, "training_loss", interrupt)
    with pytest.raises(KeyboardInterrupt):
        train(ModelConfig.preset("tiny"), EASY, quick_cfg(), tmp_path, progress=False)
    assert not any(tmp_path.iterdir())  # nothing to keep: a rerun needs no --resume


def test_extending_a_finished_run_equals_a_longer_run(reference, tmp_path):
    ref, _, _ = reference
    cfg = ModelConfig.preset("tiny", attn_norm="qkv")
    train(cfg, EASY, quick_cfg(max_steps=9), tmp_path, progress=False)
    assert load_train_state(tmp_path)["step"] == 9
    with pytest.warns(UserWarning, match=r"from 9 to 14 steps: the plateau schedule has no planned length"):
        model, _ = train(cfg, EASY, quick_cfg(), tmp_path, resume=True, progress=False)
    assert_bit_identical(ref, model)  # as it says: the same as the reference run, started with 14 steps


def test_resume_of_finished_run_is_a_no_op(reference):
    ref, _, out = reference
    before = (out / "LATEST").read_text()
    model, _ = train(ModelConfig.preset("tiny", attn_norm="qkv"), EASY, quick_cfg(), out, resume=True, progress=False)
    assert_bit_identical(ref, model)
    assert (out / "LATEST").read_text() == before


def test_resume_without_checkpoint_starts_fresh(reference, tmp_path):
    ref, _, _ = reference
    model, _ = train(ModelConfig.preset("tiny", attn_norm="qkv"), EASY, quick_cfg(), tmp_path / "new", resume=True, progress=False)
    assert_bit_identical(ref, model)


def test_existing_run_needs_resume_and_matching_options(reference):
    _, _, out = reference
    cfg = ModelConfig.preset("tiny", attn_norm="qkv")
    with pytest.raises(OutputDirError, match="--resume"):
        train(cfg, EASY, quick_cfg(), out, progress=False)
    with pytest.raises(ConfigError, match="lr"):
        train(cfg, EASY, quick_cfg(lr=1e-2), out, resume=True, progress=False)
    with pytest.raises(ConfigError, match="attn_norm"):
        train(cfg.replace(attn_norm="pre"), EASY, quick_cfg(), out, resume=True, progress=False)
    with pytest.raises(ConfigError, match="task"):
        train(cfg, AdditionTask.preset("cpu"), quick_cfg(), out, resume=True, progress=False)


# ----------------------------------------------------------------------------- threads


def test_training_runs_on_the_configured_threads_and_restores_the_setting(tmp_path, monkeypatch):
    seen = []
    real = train_mod.training_loss

    def spy(model, tokens, pos_offset):
        seen.append(torch.get_num_threads())
        return real(model, tokens, pos_offset)

    monkeypatch.setattr(train_mod, "training_loss", spy)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        train(ModelConfig.preset("tiny"), EASY, quick_cfg(max_steps=2), tmp_path / "a", progress=False)
        assert seen == [1, 1] and torch.get_num_threads() == 2  # default 1 during the run, then restored
        assert load_train_state(tmp_path / "a")["threads"] == 1
        seen.clear()
        train(ModelConfig.preset("tiny"), EASY, quick_cfg(max_steps=2, threads=None), tmp_path / "b", progress=False)
        assert seen == [2, 2] and load_train_state(tmp_path / "b")["threads"] == 2  # None: torch's setting, recorded
    finally:
        torch.set_num_threads(before)


def test_resume_with_another_thread_count_is_refused(reference):
    _, _, out = reference
    cfg = ModelConfig.preset("tiny", attn_norm="qkv")
    with pytest.raises(ConfigError, match=r"trained with 1 CPU thread.*resume with threads=1 "):
        train(cfg, EASY, quick_cfg(threads=2, max_steps=20), out, resume=True, progress=False)
    with pytest.raises(ConfigError, match="threads"):
        quick_cfg(threads=0)


def _make_old(ckpt, drop_train=("threads",), drop_state=("threads", "schedule_total_steps")):
    """Rewrite a checkpoint as the code before these fields wrote it (manifest re-recorded)."""
    from interp_norm.training.checkpoint_format import manifest_entry

    state = torch.load(ckpt / "train_state.pt", weights_only=True)
    for k in drop_state:
        del state[k]
    torch.save(state, ckpt / "train_state.pt")
    config = json.loads((ckpt / "config.json").read_text())
    for k in drop_train:
        del config["train"][k]
    config["files"]["train_state.pt"] = manifest_entry(ckpt / "train_state.pt")
    (ckpt / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("schedule", ["plateau", "cosine"])
def test_checkpoint_from_before_threads_and_schedule_length_still_resumes_exactly(tmp_path, monkeypatch, schedule):
    cfg = ModelConfig.preset("tiny", attn_norm="qkv")
    tcfg = quick_cfg(schedule=schedule, min_lr=1e-4)
    clean, clean_curve = train(cfg, EASY, tcfg, tmp_path / "clean", progress=False)
    real = raise_at_call(monkeypatch, 8, Crash)
    with pytest.raises(Crash):
        train(cfg, EASY, tcfg, tmp_path / "old", progress=False)
    monkeypatch.setattr(train_mod, "training_loss", real)
    _make_old(tmp_path / "old" / "step-00000005")
    with pytest.warns(UserWarning, match="does not record the CPU thread count"):
        model, curve = train(cfg, EASY, tcfg, tmp_path / "old", resume=True, progress=False)
    assert_bit_identical(clean, model)
    pd.testing.assert_frame_equal(curve, clean_curve, check_exact=True)


# ----------------------------------------------------------------------------- extending a run


def expected_cosine_lr(step, total, peak, warm, floor):
    """The documented schedule, written out: linear warm-up over `warm` steps, cosine to `floor` at `total`."""
    if step < warm:
        return peak * (step + 1) / warm
    return floor + (peak - floor) * (1 + math.cos(math.pi * min(1.0, (step - warm) / (total - warm)))) / 2


def test_extending_a_cosine_run_continues_its_decayed_schedule(tmp_path):
    cfg = ModelConfig.preset("tiny", attn_norm="qkv")
    tcfg = quick_cfg(schedule="cosine", warmup_frac=0.25, min_lr=1e-4, max_steps=8, log_every=1)
    at_8, first = train(cfg, EASY, tcfg, tmp_path, progress=False)
    assert load_train_state(tmp_path)["schedule_total_steps"] == 8
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model, curve = train(cfg, EASY, tcfg.replace(max_steps=12), tmp_path, resume=True, progress=False)
    said = [str(w.message) for w in caught if issubclass(w.category, UserWarning)]
    assert len(said) == 1 and "continue the decayed schedule at min_lr=0.0001 (no restart" in said[0], said
    assert "will not change the weights" not in said[0]  # min_lr > 0: the extension trains
    # row k holds the lr of step k-1 (log_every=1); warm-up of round(0.25 * 8) = 2 steps
    expected = [expected_cosine_lr(s, 8, 3e-3, 2, 1e-4) for s in range(12)]
    assert curve["lr"].tolist() == pytest.approx(expected, rel=1e-12, abs=0)
    assert curve["lr"].iloc[8:].tolist() == [1e-4] * 4  # the extra steps: at min_lr, no jump back up
    pd.testing.assert_frame_equal(curve.iloc[:8], first, check_exact=True)
    assert load_train_state(tmp_path)["schedule_total_steps"] == 8  # extending twice keeps the first length
    assert not torch.equal(at_8.W_E, model.W_E)  # the extra steps did train


def test_extending_a_cosine_run_with_min_lr_zero_warns_that_it_cannot_train(tmp_path):
    cfg = ModelConfig.preset("tiny")
    tcfg = quick_cfg(schedule="cosine", max_steps=6, log_every=1)
    before, _ = train(cfg, EASY, tcfg, tmp_path, progress=False)
    with pytest.warns(UserWarning, match="run at min_lr=0 and will not change the weights"):
        after, curve = train(cfg, EASY, tcfg.replace(max_steps=9), tmp_path, resume=True, progress=False)
    assert curve["lr"].iloc[6:].tolist() == [0.0] * 3
    assert_bit_identical(before, after)


def test_interrupted_cosine_run_resumes_bit_identically(tmp_path, monkeypatch):
    cfg = ModelConfig.preset("tiny", attn_norm="qkv")
    tcfg = quick_cfg(schedule="cosine", warmup_frac=0.25)
    clean, clean_curve = train(cfg, EASY, tcfg, tmp_path / "clean", progress=False)
    real = raise_at_call(monkeypatch, 9, KeyboardInterrupt)
    with pytest.raises(KeyboardInterrupt):
        train(cfg, EASY, tcfg, tmp_path / "run", progress=False)
    monkeypatch.setattr(train_mod, "training_loss", real)
    model, curve = train(cfg, EASY, tcfg, tmp_path / "run", resume=True, progress=False)
    assert_bit_identical(clean, model)
    pd.testing.assert_frame_equal(curve, clean_curve, check_exact=True)


def test_nan_loss_raises_and_keeps_last_good_checkpoint(tmp_path, monkeypatch):
    real = train_mod.training_loss
    calls = {"n": 0}

    def nan_at_step_8(model, tokens, pos_offset):
        logits, loss = real(model, tokens, pos_offset)
        calls["n"] += 1
        return (logits, loss * float("nan")) if calls["n"] == 8 else (logits, loss)

    monkeypatch.setattr(train_mod, "training_loss", nan_at_step_8)
    with pytest.raises(TrainingDivergedError, match=r"loss became nan at step 8.*step-00000005 is kept"):
        train(ModelConfig.preset("tiny"), EASY, quick_cfg(), tmp_path, progress=False)
    snapshot = {p.name: p.read_bytes() for p in (tmp_path / "step-00000005").iterdir()}
    assert (tmp_path / "LATEST").read_text().strip() == "step-00000005"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["LATEST", "step-00000005"]
    _, info = load_with_info(tmp_path)  # hashes verified: intact
    assert info.step == 5
    # resuming (after fixing the cause) continues from step 5 and matches an undisturbed run
    monkeypatch.setattr(train_mod, "training_loss", real)
    assert {p.name: p.read_bytes() for p in (tmp_path / "step-00000005").iterdir()} == snapshot
    model, _ = train(ModelConfig.preset("tiny"), EASY, quick_cfg(), tmp_path, resume=True, progress=False)
    clean, _ = train(ModelConfig.preset("tiny"), EASY, quick_cfg(), tmp_path / "clean", progress=False)
    assert_bit_identical(clean, model)


def test_huge_learning_rate_diverges_with_a_typed_error(tmp_path):
    """No injection: a 'none' model at lr 1e12 overflows; the error (not a crash or NaN weights) results."""
    cfg = quick_cfg(lr=1e12, grad_clip=None, max_steps=40, checkpoint_every=100, weight_decay=0.0)
    with pytest.raises(TrainingDivergedError, match="became (nan|inf)|non-finite"):
        train(ModelConfig.preset("tiny", attn_norm="none", head="unembed"), EASY, cfg, tmp_path, progress=False)
    assert not (tmp_path / "LATEST").exists()


def test_data_stream_is_a_pure_function_of_seed_and_step():
    a_tok, a_off = batch_for_step(EASY, 3, 10, 8, 50)
    b_tok, b_off = batch_for_step(EASY, 3, 10, 8, 50)
    assert torch.equal(a_tok, b_tok) and torch.equal(a_off, b_off)
    for other in (batch_for_step(EASY, 3, 11, 8, 50)[0], batch_for_step(EASY, 4, 10, 8, 50)[0]):
        assert not (other.shape == a_tok.shape and torch.equal(other, a_tok))
    offs = torch.cat([batch_for_step(EASY, 0, s, 64, 50)[1] for s in range(20)])
    assert offs.min() == 0 and offs.max() == 50  # inclusive range [0, max_pos_offset]
    assert batch_for_step(EASY, 0, 0, 8, 0)[1].eq(0).all()


def test_offsets_reach_the_model_only_in_training(tmp_path, monkeypatch):
    seen = []
    real = train_mod.training_loss

    def spy(model, tokens, pos_offset):
        seen.append(pos_offset)
        return real(model, tokens, pos_offset)

    monkeypatch.setattr(train_mod, "training_loss", spy)
    train(ModelConfig.preset("tiny"), EASY, quick_cfg(max_steps=2), tmp_path / "a", progress=False)
    assert all(o is not None and o.shape == (16,) for o in seen)
    expected = batch_for_step(EASY, 7, 1, 16, ModelConfig.preset("tiny").max_pos_offset)[1]
    assert torch.equal(seen[1], expected)
    seen.clear()
    train(ModelConfig.preset("tiny"), EASY, quick_cfg(max_steps=2, pos_offsets=False), tmp_path / "b", progress=False)
    assert seen == [None, None]


def test_plateau_halving_follows_keras_semantics():
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.AdamW([p], lr=1.0)
    sched = PlateauHalving(opt, factor=0.5, patience=3, min_delta=1e-4, min_lr=0.2)
    lrs = []
    # improve, improve, 3 flat epochs (halve on the 3rd), tiny improvement < min_delta counts as flat,
    # 2 more flat (halve again), then halving is floored at min_lr
    for loss in [5, 4, 4, 4, 4, 3.99995, 4.5, 4.2, 9, 9, 9]:
        sched.step(loss)
        lrs.append(opt.param_groups[0]["lr"])
    assert lrs == [1, 1, 1, 1, 0.5, 0.5, 0.5, 0.25, 0.25, 0.25, 0.2]


def test_lr_is_halved_during_training_when_loss_stalls(tmp_path):
    # lr so small that the loss cannot improve by min_delta: halves after every 3 epochs of 2 steps
    cfg = quick_cfg(lr=1e-9, steps_per_epoch=2, max_steps=14, lr_min_delta=10.0, log_every=2, eval_every=100)
    _, curve = train(ModelConfig.preset("tiny"), EASY, cfg, tmp_path, progress=False)
    lr_by_step = dict(zip(curve["step"], curve["lr"]))
    # epoch 1 sets best (no halving); epochs 2,3,4 stall -> halve at step 8; epochs 5,6,7 -> step 14
    assert lr_by_step[6] == 1e-9 and lr_by_step[8] == 0.5e-9 and lr_by_step[12] == 0.5e-9 and lr_by_step[14] == 0.25e-9


def test_config_validation_and_presets():
    paper = TrainConfig.preset("paper")
    assert (paper.lr, paper.weight_decay, paper.batch_size, paper.steps_per_epoch) == (3e-4, 0.01, 128, 2000)
    assert (paper.lr_factor, paper.lr_patience, paper.grad_clip, paper.device) == (0.5, 3, None, "cuda")
    assert TrainConfig.preset("cpu", lr=5e-3).lr == 5e-3
    assert TrainConfig.from_dict(paper.to_dict()) == paper
    assert quick_cfg(max_steps=None, n_epochs=3).total_steps == 12
    for bad in [dict(lr=-1), dict(batch_size=0), dict(grad_clip=0.0), dict(lr_factor=1.5), dict(eval_splits=("ood",)),
                dict(device="gpu"), dict(max_steps=0), dict(betas=(0.9,))]:
        with pytest.raises(ConfigError):
            TrainConfig(**bad)
    with pytest.raises(ConfigError, match="unknown training preset"):
        TrainConfig.preset("fast")
    with pytest.raises(ConfigError, match="unknown training config fields"):
        TrainConfig.from_dict({"lrr": 1})


def test_cuda_requested_but_absent_is_a_clear_error(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("CUDA present")
    with pytest.raises(ConfigError, match="CUDA is not available"):
        train(ModelConfig.preset("tiny"), EASY, quick_cfg(device="cuda"), tmp_path, progress=False)
    assert not any(tmp_path.iterdir())  # failed before writing anything


def test_task_longer_than_context_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="n_ctx"):
        train(ModelConfig.preset("tiny"), AdditionTask.preset("paper"), quick_cfg(), tmp_path, progress=False)


def test_unwritable_output_is_refused_early(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(OutputDirError, match="file"):
        train(ModelConfig.preset("tiny"), EASY, quick_cfg(), tmp_path / "file", progress=False)
    with pytest.raises(OutputDirError, match="cannot write"):
        train(ModelConfig.preset("tiny"), EASY, quick_cfg(), tmp_path / "file" / "sub", progress=False)


@pytest.mark.slow
@pytest.mark.parametrize("attn_norm", ["pre", "qkv"])
def test_a_tiny_model_learns_one_digit_addition(tmp_path, attn_norm):
    cfg = ModelConfig.preset("tiny", attn_norm=attn_norm, seed=0)
    before = evaluate(HookedNormTransformer(cfg), EASY, splits=("id",), size=256, seed=99)
    tcfg = TrainConfig(lr=6e-3, batch_size=64, steps_per_epoch=100, max_steps=400, grad_clip=1.0, log_every=50,
                       eval_every=1000, eval_size=64, eval_splits=("id",), final_eval_size=64, checkpoint_every=1000)
    model, curve = train(cfg, EASY, tcfg, tmp_path, progress=False)
    after = evaluate(model, EASY, splits=("id",), size=256, seed=99)
    b, a = before.iloc[0], after.iloc[0]
    assert a.per_token_acc > max(0.5, 2 * b.per_token_acc), (b.per_token_acc, a.per_token_acc)
    assert a.per_token_acc_no_eos > max(0.5, 2 * b.per_token_acc_no_eos)  # digits, not only ']'
    assert a.exact_match > 0.25 and b.exact_match < 0.05
    assert curve["loss"].iloc[-1] < 0.5 * curve["loss"].iloc[0]
    assert math.isfinite(curve["grad_norm"].mean())
