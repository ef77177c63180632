"""Training: determinism, exact resume, divergence handling, the LR schedule, and that it learns."""

from __future__ import annotations

import math

import pandas as pd
import pytest
import torch

from interp_norm import train as train_mod
from interp_norm.checkpoints import load_checkpoint, load_train_state
from interp_norm.errors import ConfigError, OutputDirError, TrainingDivergedError
from interp_norm.evaluate import evaluate
from interp_norm.model import HookedNormTransformer, ModelConfig
from interp_norm.task import AdditionTask
from interp_norm.train import PlateauHalving, TrainConfig, batch_for_step, train

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


@pytest.mark.parametrize("interrupt_at", [6, 13])  # just after a checkpoint; mid-epoch, mid-log-window
def test_resume_after_interrupt_equals_uninterrupted(reference, tmp_path, monkeypatch, interrupt_at):
    ref, ref_curve, ref_out = reference
    real = train_mod.training_loss
    calls = {"n": 0}

    def interrupt(model, tokens, pos_offset):
        calls["n"] += 1
        if calls["n"] == interrupt_at:
            raise KeyboardInterrupt
        return real(model, tokens, pos_offset)

    monkeypatch.setattr(train_mod, "training_loss", interrupt)
    cfg = ModelConfig.preset("tiny", attn_norm="qkv")
    with pytest.raises(KeyboardInterrupt):
        train(cfg, EASY, quick_cfg(), tmp_path, progress=False)
    assert load_train_state(tmp_path)["step"] == 5 * ((interrupt_at - 1) // 5)
    monkeypatch.setattr(train_mod, "training_loss", real)
    model, curve = train(cfg, EASY, quick_cfg(), tmp_path, resume=True, progress=False)
    assert_bit_identical(ref, model)
    pd.testing.assert_frame_equal(curve, ref_curve, check_exact=True)
    final = "step-00000014/model.safetensors"
    assert (tmp_path / final).read_bytes() == (ref_out / final).read_bytes()
    _, info = load_checkpoint(tmp_path)
    assert info.step == 14 and info.metrics["final"]
    pd.testing.assert_frame_equal(info.curve, ref_curve, check_exact=True)


def test_extending_a_finished_run_equals_a_longer_run(reference, tmp_path):
    ref, _, _ = reference
    cfg = ModelConfig.preset("tiny", attn_norm="qkv")
    train(cfg, EASY, quick_cfg(max_steps=9), tmp_path, progress=False)
    assert load_train_state(tmp_path)["step"] == 9
    model, _ = train(cfg, EASY, quick_cfg(), tmp_path, resume=True, progress=False)
    assert_bit_identical(ref, model)


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
    _, info = load_checkpoint(tmp_path)  # hashes verified: intact
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
