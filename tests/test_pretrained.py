"""The shipped reference checkpoints (issue: reference checkpoints) load by name and keep their accuracy."""

from __future__ import annotations

import json

import pytest

from interp_norm import list_pretrained, load_with_info
from interp_norm.training.checkpoints import pretrained_dir
from interp_norm.core.scoring import per_token_accuracy

# name -> attention normalisation; "-cal" checkpoints use the paper's Checkpoint calibration
EXPECTED = {
    "pre": "pre", "pre-s1": "pre", "qkv": "qkv", "qkv-s1": "qkv", "qk": "qk", "none": "none",
    "pre-cal": "pre", "pre-cal-s1": "pre", "qkv-cal": "qkv", "qkv-cal-s1": "qkv",
    "pre-30k": "pre", "pre-30k-s1": "pre", "qkv-30k": "qkv", "qkv-30k-s1": "qkv",
}
# Seeds 2-5 of the four arms the findings compare (scripts/train_reference.py), as they ship.
EXTRA_SEEDS = ["pre-s2", "qkv-s2", "pre-s3", "qkv-s3", "pre-s4", "qkv-s4", "pre-s5", "qkv-s5", "pre-cal-s2", "qkv-cal-s2", "pre-cal-s3", "pre-cal-s4", "qkv-cal-s3", "pre-cal-s5", "qkv-cal-s4", "qkv-cal-s5"]
EXPECTED.update({name: name.split("-")[0] for name in EXTRA_SEEDS})
LONGER = {"pre-30k", "pre-30k-s1", "qkv-30k", "qkv-30k-s1"}  # the "30k steps" set: three times the reference training
CALIBRATED = {name for name in EXPECTED if "-cal" in name}
# The 2-digit cpu task is learned but not solved in 10k CPU steps (README: 78-95 % ID per token);
# far above chance (~1/14 per token), and below the 0.95 the 1-digit models of the past reached.
LEARNED = 0.75


def test_every_reference_checkpoint_is_listed():
    listed = list_pretrained()
    assert set(EXPECTED) <= set(listed["name"]), f"missing: {set(EXPECTED) - set(listed['name'])}"
    for name, attn_norm in EXPECTED.items():
        row = listed.set_index("name").loc[name]
        assert row["attn_norm"] == attn_norm
        assert row["set"] == ("30k steps" if name in LONGER else "reference")
        assert row["step"] == (30_000 if name in LONGER else 10_000)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_calibration_is_what_the_name_says(name):
    model, _ = load_with_info(name)
    assert model.cfg.calibration == ("paper" if name in CALIBRATED else "none")
    assert model.is_calibrated  # calibrated models ship their fitted factors


def test_data_dir_stays_small():
    total = sum(p.stat().st_size for p in pretrained_dir().rglob("*") if p.is_file())
    assert total < 30 * 2**20, f"data/ holds {total / 2**20:.1f} MiB; the limit is 30 MiB"


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_fresh_sample_reproduces_recorded_accuracy(name):
    """Recompute ID per-token accuracy on a fresh seeded sample (not the recorded test set)."""
    model, info = load_with_info(name)
    recorded = {r["split"]: r for r in info.metrics["evaluation"]}["id"]["per_token_acc"]
    fresh = info.task.sample_batch(2048, "id", seed=987_654)
    acc = per_token_accuracy(model, fresh)
    assert acc >= LEARNED, f"{name}: fresh ID per-token accuracy {acc:.4f} < {LEARNED}"
    assert abs(acc - recorded) <= 0.01, f"{name}: fresh {acc:.4f} vs recorded {recorded:.4f}"
    files = {p.name for p in info.path.iterdir()}
    assert {"model.safetensors", "config.json", "training_curve.csv", "metrics.json"} <= files
    assert json.loads((info.path / "metrics.json").read_text())["final"] is True


def test_pre_knows_its_task_and_analyses_default_to_it():
    """A model loaded by name carries the task its config.json records; run_noise without a
    task scores the same problems as with that task passed explicitly, and its clean accuracy is a
    per-problem count's; the paper's task instead warns, naming both tasks."""
    import warnings

    import torch

    import interp_norm
    from interp_norm import AdditionTask, HookedNormTransformer
    from interp_norm.errors import TaskMismatchWarning
    from interp_norm.noise import run_noise
    from interp_norm.core.task import encode

    recorded = json.loads((pretrained_dir() / "pre" / "config.json").read_text())["task"]
    cpu = AdditionTask(**{k: tuple(v) for k, v in recorded.items()})
    assert cpu == AdditionTask.preset("cpu")
    model = interp_norm.load("pre")
    assert model.task == cpu and model.name == "pre"
    assert HookedNormTransformer.from_pretrained("pre").task == cpu
    kw = dict(levels=[0.0], noised="all", n_datasets=1, n_examples=128)
    with warnings.catch_warnings():
        warnings.simplefilter("error", TaskMismatchWarning)
        default, explicit = run_noise(model, **kw), run_noise(model, cpu, **kw)
    assert default["accuracy"].tolist() == explicit["accuracy"].tolist()
    problems = cpu.test_set("id", 128, seed=1234).problems  # run_noise's dataset 0
    texts = [p.text for p in problems]
    width = max(map(len, texts))
    tokens = torch.stack([encode(t + "*" * (width - len(t))) for t in texts])
    with torch.no_grad():
        pred = model(tokens).argmax(-1)
    right = total = 0
    for row, t in enumerate(texts):  # scored: each answer character and the closing ']' (after '=')
        for i in range(t.index("=") + 1, len(t)):
            right += int(pred[row, i - 1]) == int(tokens[row, i])
            total += 1
    assert default["accuracy"].iloc[0] == pytest.approx(right / total, abs=1.5 / total)  # a near-tie may flip
    assert right / total >= LEARNED
    with pytest.warns(TaskMismatchWarning) as caught:
        paper = run_noise(model, AdditionTask(), **kw)
    said = str(caught[0].message)
    assert said.startswith("model 'pre' was trained on AdditionTask.preset('cpu') (2-digit terms")
    assert "you passed AdditionTask() (the paper's task" in said
    assert paper["accuracy"].iloc[0] < right / total - 0.2  # problems it never learnt
