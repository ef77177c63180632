"""The attribution error budget against exact patching: its bookkeeping recomputed, and a model whose patterns cannot move."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from interp_norm import AdditionTask
from interp_norm.circuits import LogitDiff, activation_patch, attribution_patch, make_pairs
from interp_norm.circuits.attribution_error import BudgetSpec, attribution_error_budget, budget_summary
from interp_norm.errors import PatchingError
from tests._models import make_model

EPS64 = torch.finfo(torch.float64).eps


@pytest.fixture(scope="module")
def pairs():
    return make_pairs(AdditionTask.preset("cpu-small"), 6, "id", seed=7, aligned=True)


def _per_pair(r):
    return r.per_example.double() - r.baseline.double().unsqueeze(0)


def test_budget_errors_are_the_mean_absolute_errors_against_exact_patching(pairs):
    """err_* recomputed from attribution_patch and activation_patch called here; the three parts add
    to the live error; AtP and EAP (two implementations of one estimate) agree."""
    model = make_model(4, attn_norm="qkv").double()
    metric = LogitDiff(pairs)
    spec = BudgetSpec(methods=("atp", "eap", "eap-ig"), activations=("z", "mlp_out"), ig_steps=3)
    df = attribution_error_budget(model, pairs, metric, spec)
    assert len(df) == 3 * (2 * 4 + 2)
    exact = _per_pair(activation_patch(model, pairs, None, metric, "z", by="all"))
    for mode, (norm, pattern) in {"live": ("live", "live"), "norm": ("frozen", "live"), "both": ("frozen", "frozen")}.items():
        est = _per_pair(attribution_patch(model, pairs, metric, "z", by="all", ig_steps=3, norm=norm, pattern=pattern))
        want = (est - exact).abs().mean(-1).numpy()
        got = df[(df.method == "eap-ig") & (df.activation == "z")][f"err_{mode}"].to_numpy()
        assert abs(got - want).max() <= 1e3 * EPS64 * max(abs(want).max(), 1.0)
        row = budget_summary(df).set_index(["method", "activation"]).loc[("eap-ig", "z")]
        rel = want.sum() / exact.abs().mean(-1).sum().item()  # error / the error of attributing nothing
        assert row["n_nodes"] == model.cfg.n_layers * model.cfg.n_heads and abs(row[f"rel_err_{mode}"] - rel) <= 1e3 * EPS64 * max(rel, 1.0)
    parts = df.removed_by_norm + df.removed_by_pattern + df.rest
    assert (parts - df.err_live).abs().max() <= 1e3 * EPS64 * max(df.err_live.abs().max(), 1.0)
    atp, eap = (df[df.method == m].reset_index() for m in ("atp", "eap"))
    assert (atp.est_live - eap.est_live).abs().max() <= 1e6 * EPS64 * max(atp.est_live.abs().max(), 1.0)
    s = budget_summary(df)
    shares = s.share_removed_by_norm + s.share_removed_by_pattern + s.share_rest
    assert (shares - 1).abs().max() < 1e-9


def test_constant_patterns_leave_nothing_for_freezing_patterns_to_remove(pairs):
    """W_Q = W_K = 0: every score is 0 whatever the input, so no gradient reaches the patterns and
    freezing them changes no estimate (removed_by_pattern = 0), while freezing the norms does."""
    model = make_model(5, attn_norm="pre").double()
    with torch.no_grad():
        for blk in model.blocks:
            blk.attn.W_Q.zero_()
            blk.attn.W_K.zero_()
    df = attribution_error_budget(model, pairs, None, BudgetSpec(activations=("z", "k", "mlp_out"), ig_steps=2))
    scale = max(df.err_live.abs().max(), 1.0)
    assert df.removed_by_pattern.abs().max() <= 1e3 * EPS64 * scale
    assert df[df.activation != "k"].removed_by_norm.abs().max() > 1e-4 * scale


def test_bad_specs_are_refused(pairs):
    model = make_model(1)
    for spec, msg in [(BudgetSpec(methods=("gd",)), "unknown attribution method"),
                      (BudgetSpec(activations=("pattern",)), "the error budget covers"),
                      (BudgetSpec(per="median"), "per must be"), (BudgetSpec(ig_steps=1), "ig_steps >= 2")]:
        with pytest.raises(PatchingError, match=msg):
            attribution_error_budget(model, pairs, None, spec)


def test_exact_size_is_the_error_of_a_zero_estimate(pairs):
    model = make_model(4, attn_norm="pre").double()
    df = attribution_error_budget(model, pairs, None, BudgetSpec(methods=("eap",), activations=("mlp_out",), ig_steps=2))
    exact = _per_pair(activation_patch(model, pairs, None, LogitDiff(pairs), "mlp_out", by="all"))
    assert abs(df.exact_size.to_numpy() - exact.abs().mean(-1).numpy()).max() <= 1e3 * EPS64 * float(exact.abs().max())
    s = budget_summary(df)
    assert abs(float(s.rel_err_live[0]) - df.err_live.sum() / df.exact_size.sum()) < 1e-12


def test_bridges_get_eap_and_eap_ig_and_grouped_kv_is_refused():
    """On a tiny GPT-2 bridge the default budget has EAP and EAP-IG rows whose parts add to the live
    error; AtP on a bridge, and k on grouped-query Llama, are refused with typed errors."""
    from interp_norm.anatomy import random_tokens, tiny_bridge
    from interp_norm.circuits import PatchingPairs

    def metric(logits):
        return logits[:, -1, 5] - logits[:, -1, 6]

    out = {}
    for arch in ("gpt2", "llama"):
        bridge = tiny_bridge(arch)
        clean = random_tokens(bridge, 3, 6, seed=6, low=3)
        corr = clean.clone()
        corr[:, 2] = (corr[:, 2] + 9) % 120 + 3
        out[arch] = (bridge, PatchingPairs(clean, corr, score_mask=torch.ones_like(clean, dtype=torch.bool)))
    bridge, pp = out["gpt2"]
    df = attribution_error_budget(bridge, pp, metric, BudgetSpec(activations=("z", "mlp_out"), ig_steps=2))
    assert set(df.method) == {"eap", "eap-ig"} and len(df) == 2 * (2 * bridge.cfg.n_heads + 2)
    parts = df.removed_by_norm + df.removed_by_pattern + df.rest
    assert (parts - df.err_live).abs().max() <= 1e3 * torch.finfo(torch.float32).eps * max(df.err_live.abs().max(), 1.0)
    with pytest.raises(PatchingError, match="on a bridge use methods"):
        attribution_error_budget(bridge, pp, metric, BudgetSpec(methods=("atp",)))
    bridge, pp = out["llama"]
    assert bridge.cfg.n_key_value_heads < bridge.cfg.n_heads  # the tiny Llama groups its k/v heads
    with pytest.raises(PatchingError, match="grouped-query attention"):
        attribution_error_budget(bridge, pp, metric, BudgetSpec(activations=("k",), ig_steps=2))


def test_a_model_whose_patterns_cannot_be_frozen_gets_the_norm_part_and_no_pattern_part():
    """Gemma 4's pattern hook fires after attention ran: freezing patterns is refused there, so the budget
    reports the error with the norms live and frozen and leaves the patterns' part and the rest NaN (not 0)."""
    from interp_norm.anatomy import random_tokens, tiny_bridge
    from interp_norm.circuits.pairs import PatchingPairs

    bridge = tiny_bridge("gemma4")
    clean = random_tokens(bridge, 4, 8, seed=0, low=3)
    corr = clean.clone()
    corr[:, 3] = (corr[:, 3] + 9) % 120 + 3
    pairs = PatchingPairs(clean, corr, score_mask=torch.ones_like(clean, dtype=torch.bool))
    df = attribution_error_budget(bridge, pairs, lambda lg: lg[:, -1, 5] - lg[:, -1, 6],
                                  BudgetSpec(methods=("eap",), activations=("z",), ig_steps=2))
    assert df[["err_live", "err_norm", "removed_by_norm"]].notna().all().all()
    assert df[["err_both", "removed_by_pattern", "rest"]].isna().all().all()
    total = budget_summary(df, by=("method",)).iloc[0]
    assert total["err_live"] == pytest.approx(df["err_live"].sum()) and np.isnan(total["removed_by_pattern"])
