"""The shipped reference checkpoints (issue: reference checkpoints) load by name and keep their accuracy."""

from __future__ import annotations

import json

import pytest

from interp_norm import list_pretrained, load_pretrained
from interp_norm.checkpoints import pretrained_dir
from interp_norm.evaluate import per_token_accuracy

# name -> attention normalisation; "-cal" checkpoints use the paper's Checkpoint calibration
EXPECTED = {
    "pre": "pre", "pre-s1": "pre", "qkv": "qkv", "qkv-s1": "qkv", "qk": "qk", "none": "none",
    "pre-cal": "pre", "pre-cal-s1": "pre", "qkv-cal": "qkv", "qkv-cal-s1": "qkv",
    "pre-30k": "pre", "pre-30k-s1": "pre", "qkv-30k": "qkv", "qkv-30k-s1": "qkv",
}
# Seeds 2-5 of the four arms the findings compare (scripts/train_reference.py), as they ship.
EXTRA_SEEDS = ["pre-s2", "qkv-s2", "pre-s3", "qkv-s3", "pre-s4", "qkv-s4"]
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
    model, _ = load_pretrained(name)
    assert model.cfg.calibration == ("paper" if name in CALIBRATED else "none")
    assert model.is_calibrated  # calibrated models ship their fitted factors


def test_data_dir_stays_small():
    total = sum(p.stat().st_size for p in pretrained_dir().rglob("*") if p.is_file())
    assert total < 30 * 2**20, f"data/ holds {total / 2**20:.1f} MiB; the limit is 30 MiB"


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_fresh_sample_reproduces_recorded_accuracy(name):
    """Recompute ID per-token accuracy on a fresh seeded sample (not the recorded test set)."""
    model, info = load_pretrained(name)
    recorded = {r["split"]: r for r in info.metrics["evaluation"]}["id"]["per_token_acc"]
    fresh = info.task.sample_batch(2048, "id", seed=987_654)
    acc = per_token_accuracy(model, fresh)
    assert acc >= LEARNED, f"{name}: fresh ID per-token accuracy {acc:.4f} < {LEARNED}"
    assert abs(acc - recorded) <= 0.01, f"{name}: fresh {acc:.4f} vs recorded {recorded:.4f}"
    files = {p.name for p in info.path.iterdir()}
    assert {"model.safetensors", "config.json", "training_curve.csv", "metrics.json"} <= files
    assert json.loads((info.path / "metrics.json").read_text())["final"] is True
