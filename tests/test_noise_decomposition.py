"""The collapse controls, each against an independent computation on a tiny model: per-head collapse
and the effective number of heads, the noise-drop decomposition (and NormNoise's shared / random
direction noise), the consequence of collapse with its bootstrap, and the temperature identity."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from interp_norm import AdditionTask, HookedNormTransformer
from interp_norm import noise as N
from interp_norm import theory
from interp_norm.errors import NoiseSpecError
from interp_norm.core.scoring import per_token_accuracy
from interp_norm.core.hook_names import act_name
from interp_norm.noise.collapse import clean_attention, layer_decisions
from interp_norm.noise.decomposition import chunk_seed
from interp_norm.core.task import EQ_ID, PAD_ID
from _models import sharpened_model

TASK = AdditionTask.preset("cpu")
_MODELS: dict = {}


def make_model(attn_norm: str = "pre") -> HookedNormTransformer:
    if attn_norm not in _MODELS:
        _MODELS[attn_norm] = sharpened_model(attn_norm)
    return _MODELS[attn_norm]


@pytest.fixture(scope="module")
def tokens() -> torch.Tensor:
    t = TASK.sample_batch(16, "id", seed=5).tokens
    return t[:, : int((t != PAD_ID).sum(-1).max())]


def _sparse_rows_by_hand(model, tokens, layer, multiplier=1.0):
    """(b, h, q) with q >= 1 inside the example whose softmax(c·scores) has max >= 0.95, and the scores."""
    _, cache = model.run_with_cache(tokens)
    scores = cache[act_name("attn_scores", layer)]
    lengths = (tokens != PAD_ID).sum(-1)
    rows = []
    for b in range(len(tokens)):
        for h in range(model.cfg.n_heads):
            for q in range(1, int(lengths[b])):
                if float(torch.softmax(multiplier * scores[b, h, q, : q + 1], -1).max()) >= 0.95:
                    rows.append((b, h, q))
    return rows, scores


def _loose_by_hand(scores, rows, z_q, z_k, level, multiplier=1.0):
    """[draw, row]: argmax of (1+κ_q)(1+κ_k)·c·w over the row's keys differs from argmax of w."""
    D = z_q.shape[0]
    out = torch.zeros(D, len(rows), dtype=torch.bool)
    for j, (b, h, q) in enumerate(rows):
        w = scores[b, h, q, : q + 1].double()
        for d in range(D):
            noised = (1 + level * z_q[d, b, q, h]).double() * (1 + level * z_k[d, b, : q + 1, h]).double() * multiplier * w
            out[d, j] = int(noised.argmax()) != int(w.argmax())
    return out


# ----------------------------------------------------------------------------- 1. per-head collapse


def test_effective_heads_on_constructed_shares():
    assert N.effective_heads([0.5, 0.5]) == pytest.approx(2.0)
    assert N.effective_heads([1.0]) == pytest.approx(1.0)
    assert N.effective_heads([7, 0, 0]) == pytest.approx(1.0)  # counts are normalised; empty heads count for nothing
    assert N.effective_heads([3, 3, 3, 3]) == pytest.approx(4.0)
    assert N.effective_heads([3, 1]) == pytest.approx(1 / (0.75**2 + 0.25**2))
    assert math.isnan(N.effective_heads([0, 0]))
    with pytest.raises(NoiseSpecError, match="shares"):
        N.effective_heads([0.5, -0.1])


def test_head_table_against_a_per_row_loop(tokens):
    model = make_model("pre")
    levels, D, seed = (0.05, 0.1, 0.2, 0.3, 0.45), 6, 3
    heads = N.measure_head_collapse(model, tokens, levels, n_draws=D, seed=seed)
    assert heads["share"].sum() == pytest.approx(1.0)
    for _, g in heads.groupby("layer"):
        assert g["share_in_layer"].sum() == pytest.approx(1.0)
    b, n, h = len(tokens), tokens.shape[1], model.cfg.n_heads
    counts, pooled_curve, n_all = {}, np.zeros(len(levels)), 0
    for l in range(model.cfg.n_layers):
        rows, scores = _sparse_rows_by_hand(model, tokens, l)
        z_q, z_k = N.collapse_noise_draws((b, n, h), D, l, seed)
        per_level = [_loose_by_hand(scores, rows, z_q, z_k, lv) for lv in levels]  # [draw, row] each
        for hh in range(h):
            mine = [j for j, r in enumerate(rows) if r[1] == hh]
            counts[(l, hh)] = len(mine)
            got = heads[(heads["layer"] == l) & (heads["head"] == hh)].iloc[0]
            assert got["n_sparse"] == len(mine)
            if not mine:
                assert math.isnan(got["collapse_level_loose"])
                continue
            curve = [float(dec[:, mine].double().mean()) for dec in per_level]
            expect = theory.noise_level_at_rate(levels, curve, 0.01)
            assert (math.isnan(expect) and math.isnan(got["collapse_level_loose"])) or got["collapse_level_loose"] == pytest.approx(expect)
        pooled_curve += np.array([float(dec.double().sum()) / D for dec in per_level])
        n_all += len(rows)
    total = sum(counts.values())
    assert total == n_all > 20
    for (l, hh), c in counts.items():
        assert heads[(heads["layer"] == l) & (heads["head"] == hh)]["share"].iloc[0] == pytest.approx(c / total)
    # beside the pooled level: the inverse Simpson index of these counts, and the pooled level itself
    th = N.collapse_thresholds(N.measure_collapse(model, tokens, levels, predict=False, n_draws=D, seed=seed))
    joined = N.beside_thresholds(th, heads)
    assert len(joined) == len(th)
    row = joined[(joined["layer"] == "all") & (joined["definition"] == "loose")].iloc[0]
    shares = np.array(list(counts.values())) / total
    assert row["effective_heads"] == pytest.approx(1 / np.sum(shares**2))
    assert row["n_sparse"] == total and row["top_share"] == pytest.approx(shares.max())
    assert row["level_measured"] == pytest.approx(theory.noise_level_at_rate(levels, pooled_curve / total, 0.01))
    for l in range(model.cfg.n_layers):
        per = np.array([counts[(l, hh)] for hh in range(h)], dtype=float)
        got = joined[(joined["layer"] == l) & (joined["definition"] == "loose")].iloc[0]["effective_heads"]
        assert got == pytest.approx(1 / np.sum((per / per.sum()) ** 2))


def test_collapse_with_heads_uses_the_same_decisions_as_run_collapse():
    model = make_model("pre")
    kw = dict(n_examples=12, n_draws=4, seed=1, strict_samples=16, variant="x")
    curves, heads = N.run_collapse_with_heads(model, TASK, (0.1, 0.3), **kw)
    alone = N.run_collapse(model, TASK, (0.1, 0.3), **kw)
    assert curves.equals(alone)
    again = N.run_head_collapse(model, TASK, (0.1, 0.3), n_examples=12, n_draws=4, seed=1, variant="x")
    assert heads.equals(again)
    assert int(heads["n_sparse"].sum()) == int(curves[(curves["layer"] == "all")]["n_rows"].iloc[0])


# ----------------------------------------------------------------------------- 2. decomposition


def test_shared_noise_scales_q_k_v_of_a_token_by_one_factor(tokens):
    model = make_model("pre")
    _, clean = model.run_with_cache(tokens)
    noise = N.NormNoise(model, 0.2, "qkv", layers=[0], shared=True, seed=4)
    with noise:
        _, noisy = model.run_with_cache(tokens)
    ratios = [noisy[act_name(t, 0)].norm(dim=-1) / clean[act_name(t, 0)].norm(dim=-1) for t in "qkv"]  # [b, p, h]
    for r, t in zip(ratios, "qkv"):
        cos = torch.nn.functional.cosine_similarity(noisy[act_name(t, 0)], clean[act_name(t, 0)], dim=-1)
        torch.testing.assert_close(cos, torch.ones_like(cos), rtol=0, atol=1e-5)  # along x: norm noise
        torch.testing.assert_close(r, ratios[0], rtol=2e-5, atol=2e-5)  # the same κ for q, k and v
        torch.testing.assert_close(r, r[:, :, :1].expand_as(r), rtol=2e-5, atol=2e-5)  # and for every head
    kappa = ratios[0][:, :, 0] - 1  # [b, p]
    assert kappa.std() > 0.05 and kappa.abs().max() <= 0.2 * math.sqrt(3) + 1e-5
    # independent across tokens, and not the per-head draw of the plain noise
    per_head = N.NormNoise(model, 0.2, "qkv", layers=[0], seed=4).draw(0, "q", (*tokens.shape, 4, 1))[..., 0]
    assert not torch.allclose(per_head[:, :, 0], kappa, atol=1e-3)


def test_random_direction_noise_has_the_norm_noise_size(tokens):
    model = make_model("qkv")
    _, clean = model.run_with_cache(tokens)
    kw = dict(layers=[1], heads=[0, 2], seed=6, placement="before_norm")
    noise = N.NormNoise(model, 0.2, "qkv", direction="random", **kw)
    with noise:
        _, noisy = model.run_with_cache(tokens)
    plain = N.NormNoise(model, 0.2, "qkv", **kw)
    for t in "qkv":
        x, y = clean[act_name(t, 1)], noisy[act_name(t, 1)]
        kappa = plain.draw(1, t, (*x.shape[:-1], 1))  # the κ of plain norm noise (common random numbers)
        u = noise.draw_direction(1, t, x.shape)
        torch.testing.assert_close(y, x + kappa * x.norm(dim=-1, keepdim=True) * u, rtol=1e-5, atol=1e-6)
        delta = y - x
        torch.testing.assert_close(delta.norm(dim=-1), kappa[..., 0].abs() * x.norm(dim=-1), rtol=1e-4, atol=1e-6)
        assert torch.equal(y[:, :, [1, 3]], x[:, :, [1, 3]])  # unselected heads untouched
        cos = torch.nn.functional.cosine_similarity(delta[:, :, [0, 2]], x[:, :, [0, 2]], dim=-1)
        assert float(cos.pow(2).mean()) < 3.0 / x.shape[-1]  # a random direction: E cos² = 1/d_head
        # the per-head norm does NOT remove it (it would remove norm noise up to eps)
        if t in "qk":
            moved = (noisy[act_name(f"{t}_normed", 1)] - clean[act_name(f"{t}_normed", 1)])[:, :, [0, 2]].abs().max()
            assert moved > 1e-2


def _by_hand_accuracy(model, tokens, level, targets, seed, shared=False, direction="norm"):
    """Accuracy with each (layer, target) vector set to the explicit formula, counted token by token."""
    b, n, h = len(tokens), tokens.shape[1], model.cfg.n_heads
    draws = N.NormNoise(model, level, targets, seed=seed, shared=shared, direction=direction)

    def formula(act, hook, t):
        l = int(hook.name.split(".")[1])
        kappa = draws.draw(l, t, (b, n, h, 1))
        if direction == "random":
            u = draws.draw_direction(l, t, act.shape)
            return act + kappa * act.norm(dim=-1, keepdim=True) * u
        if shared:  # one κ per (example, position): every head and target the same
            kappa = kappa[:, :, :1].expand(b, n, h, 1)
        return act * (1 + kappa)

    hooks = [(act_name(t, l), lambda a, hook, t=t: formula(a, hook, t)) for l in range(2) for t in targets]
    logits = model.run_with_hooks(tokens, fwd_hooks=hooks)
    correct = total = 0
    for bb in range(b):
        toks = tokens[bb].tolist()
        for p in range(toks.index(EQ_ID), n - 1):
            if toks[p + 1] != PAD_ID:
                total += 1
                correct += int(logits[bb, p].argmax()) == toks[p + 1]
    return correct / total


def test_decomposition_equals_each_mode_by_hand(tokens):
    model = make_model("pre")
    level = 0.3
    df = N.noise_decomposition(model, [tokens], (level,), seed=2)
    assert list(df["mode"]) == list(N.DECOMPOSITION_MODES)
    clean = per_token_accuracy(model, tokens)
    seed = chunk_seed(2, 0, 0)
    for mode, (targets, opts) in N.DECOMPOSITION_MODES.items():
        row = df[df["mode"] == mode].iloc[0]
        expect = _by_hand_accuracy(model, tokens, level, targets, seed, **opts)
        assert row["accuracy"] == pytest.approx(expect), mode
        assert row["clean_accuracy"] == pytest.approx(clean)
        assert row["drop"] == pytest.approx((clean - expect) * 100)
    assert (df["drop"] > 0).any()
    zero = N.noise_decomposition(model, [tokens, tokens], (0.0,), seed=2)
    assert (zero["drop"] == 0).all() and (zero["drop_se"] == 0).all()


def test_control_options_are_validated(tokens):
    model = make_model("pre")
    with pytest.raises(NoiseSpecError, match="scale"):
        N.NormNoise(model, 0.1, "scale", shared=True)
    with pytest.raises(NoiseSpecError, match="direction"):
        N.NormNoise(model, 0.1, "qk", direction="sideways")
    gates = {l: torch.ones(len(tokens), 4, tokens.shape[1], dtype=torch.bool) for l in range(2)}
    with pytest.raises(NoiseSpecError, match="row_gate"):
        N.NormNoise(model, 0.1, "qk", direction="random", row_gate=gates)
    with pytest.raises(NoiseSpecError, match="modes"):
        N.noise_decomposition(model, [tokens], (0.01,), modes=("qk",))


# ----------------------------------------------------------------------------- 3. consequence of collapse


def test_consequence_groups_equal_a_per_problem_loop(tokens):
    model = make_model("pre")
    level, D, seed = 0.4, 3, 5
    df = N.collapse_consequence(model, tokens, (level,), n_draws=D, seed=seed, n_boot=300)
    b, n, h = len(tokens), tokens.shape[1], model.cfg.n_heads
    _, clean = model.run_with_cache(tokens)
    sparse = {l: clean[act_name("pattern", l)].max(-1).values >= 0.95 for l in range(2)}  # [b, h, q]
    draws = N.NormNoise(model, level, "qk", seed=seed)

    def correct_per_problem(logits):
        out = []
        for bb in range(b):
            toks = tokens[bb].tolist()
            ps = [p for p in range(toks.index(EQ_ID), n - 1) if toks[p + 1] != PAD_ID]
            out.append((sum(int(logits[bb, p].argmax()) == toks[p + 1] for p in ps), len(ps), max(ps)))
        return out

    base = correct_per_problem(model(tokens))
    groups = {"collapsed": [0, 0, 0, 0, set()], "none": [0, 0, 0, 0, set()]}  # noisy, clean, total, pairs, problems
    for d in range(D):
        kappa = {(l, t): draws.draw(l, t, (b, n, h, 1), call=d)[..., 0] for l in range(2) for t in "qk"}

        def noised(scores, hook):
            l = int(hook.name.split(".")[1])
            scores = scores.clone()
            for bb, hh, q in sparse[l].nonzero().tolist():
                keys = torch.isfinite(scores[bb, hh, q])
                f = (1 + kappa[(l, "q")][bb, q, hh]) * (1 + kappa[(l, "k")][bb, :, hh])
                scores[bb, hh, q, keys] = scores[bb, hh, q, keys] * f[keys]
            return scores

        with model.hooks(fwd_hooks=[(act_name("attn_scores", l), noised) for l in range(2)]):
            logits, cache = model.run_with_cache(tokens)
        now = correct_per_problem(logits)
        for bb in range(b):
            last = base[bb][2]  # rows after the last scored position reach no scored logit
            hit = any(int(cache[act_name("attn_scores", l)][bb, hh, q].argmax()) !=
                      int(clean[act_name("attn_scores", l)][bb, hh, q].argmax())
                      for l in range(2) for hh, q in sparse[l][bb].nonzero().tolist() if 1 <= q <= last)
            g = groups["collapsed" if hit else "none"]
            g[0] += now[bb][0]
            g[1] += base[bb][0]
            g[2] += base[bb][1]
            g[3] += 1
            g[4].add(bb)
    for name, (noisy, cl, total, pairs, problems) in groups.items():
        row = df[df["group"] == name].iloc[0]
        assert pairs > 0, name  # both groups occur at this noise
        assert (row["n_pairs"], row["n_problems"]) == (pairs, len(problems))
        assert row["accuracy"] == pytest.approx(noisy / total)
        assert row["clean_accuracy"] == pytest.approx(cl / total)
        assert row["drop"] == pytest.approx((cl - noisy) / total * 100)
        assert row["accuracy_lo"] <= row["accuracy"] <= row["accuracy_hi"]
    diff = df[df["group"] == "difference"].iloc[0]
    c, o = df[df["group"] == "collapsed"].iloc[0], df[df["group"] == "none"].iloc[0]
    assert diff["accuracy"] == pytest.approx(c["accuracy"] - o["accuracy"])
    assert diff["drop"] == pytest.approx(c["drop"] - o["drop"])
    assert diff["drop_lo"] <= diff["drop"] <= diff["drop_hi"] and diff["n_pairs"] == D * b


def test_cluster_bootstrap_against_the_normal_approximation():
    rng = np.random.default_rng(0)
    n, p = 4000, 0.3
    x = (rng.random(n) < p).astype(float)
    est, lo, hi = N.cluster_bootstrap(x[None], np.ones((1, n)), n_boot=4000, seed=1)
    se = math.sqrt(est[0] * (1 - est[0]) / n)
    assert est[0] == pytest.approx(x.mean())
    assert hi[0] - lo[0] == pytest.approx(2 * 1.96 * se, rel=0.1)
    assert lo[0] < est[0] < hi[0]
    # a constant ratio in every cluster: every resample gives it, so the interval is a point
    est, lo, hi = N.cluster_bootstrap(np.array([[2.0, 4.0, 6.0]]), np.array([[4.0, 8.0, 12.0]]), n_boot=200)
    assert est[0] == lo[0] == hi[0] == pytest.approx(0.5)
    # the same resamples for every statistic: identical statistics, identical intervals
    y = np.vstack([x, x])
    _, lo, hi = N.cluster_bootstrap(y, np.ones_like(y), n_boot=300)
    assert lo[0] == lo[1] and hi[0] == hi[1]
    with pytest.raises(NoiseSpecError):
        N.cluster_bootstrap(np.ones((1, 3)), np.ones((1, 4)))


# ----------------------------------------------------------------------------- 4. temperature


def test_temperature_decisions_for_fixed_rows_are_identical_at_every_c(tokens):
    """The identity: argmax of f_q·f_k·c·w is argmax of f_q·f_k·w for c > 0, so with the same draws
    a fixed set of rows collapses identically at every c (loose)."""
    model = make_model("pre")
    levels, D = (0.1, 0.3, 0.5), 5
    spec = N.CollapseSpec(n_draws=D, seed=8)
    clean = clean_attention(model, tokens, spec)
    b, n, h = len(tokens), tokens.shape[1], model.cfg.n_heads
    for l in clean.layers:
        rows = clean.sparse_rows(clean.pattern[l], spec.sparse_threshold)
        at1 = layer_decisions(clean, l, levels, spec, model.cfg.eps, rows=rows)
        hand_rows, scores = _sparse_rows_by_hand(model, tokens, l)
        assert [tuple(r) for r in rows.tolist()] == hand_rows
        z_q, z_k = N.collapse_noise_draws((b, n, h), D, l, spec.seed)
        for c in (0.25, 0.5, 2.0, 4.0, 10.0):
            atc = layer_decisions(clean, l, levels, spec, model.cfg.eps, multiplier=c, rows=rows)
            assert torch.equal(atc.loose, at1.loose), (l, c)
            for i, lv in enumerate(levels):  # and both are the explicit computation at that c
                assert torch.equal(atc.loose[i], _loose_by_hand(scores, hand_rows, z_q, z_k, lv, multiplier=c))
        assert at1.loose.any()


def test_temperature_table_splits_same_and_new_rows(tokens):
    model = make_model("pre")
    levels, D, seed = (0.05, 0.1, 0.2, 0.3, 0.45), 4, 3
    cs = (0.5, 1.0, 3.0)
    sweep = N.temperature_sweep(model, tokens, cs, levels, n_draws=D, seed=seed)
    b, n, h = len(tokens), tokens.shape[1], model.cfg.n_heads
    at1 = sweep[sweep["c"] == 1.0]
    pooled_same = {c: np.zeros(len(levels)) for c in cs}
    pooled_new = {c: np.zeros(len(levels)) for c in cs}
    counts = {c: [0, 0] for c in cs}
    for l in range(2):
        base, scores = _sparse_rows_by_hand(model, tokens, l)
        z_q, z_k = N.collapse_noise_draws((b, n, h), D, l, seed)
        for c in cs:
            rows, _ = _sparse_rows_by_hand(model, tokens, l, multiplier=c)
            same = [r for r in rows if r in base]
            new = [r for r in rows if r not in base]
            if c < 1:
                assert not new  # the max softmax weight never falls as c grows
            got = sweep[(sweep["c"] == c) & (sweep["layer"] == l)].iloc[0]
            assert (got["n_same"], got["n_new"]) == (len(same), len(new))
            for part, pooled in ((new, pooled_new), (same, pooled_same)):
                if part:
                    pooled[c] += [float(_loose_by_hand(scores, part, z_q, z_k, lv, c).double().sum()) / D for lv in levels]
            counts[c][0] += len(same)
            counts[c][1] += len(new)
    for c in cs:
        got = sweep[(sweep["c"] == c) & (sweep["layer"] == "all")].iloc[0]
        assert (got["n_same"], got["n_new"]) == tuple(counts[c])
        for kind, pooled, k in (("same", pooled_same, 0), ("new", pooled_new, 1)):
            expect = theory.noise_level_at_rate(levels, pooled[c] / counts[c][k], 0.01) if counts[c][k] else math.nan
            value = got[f"collapse_level_{kind}_loose"]
            assert (math.isnan(expect) and math.isnan(value)) or value == pytest.approx(expect), (c, kind)
        if c >= 1:  # the same rows as at c = 1, so (the identity) the same loose level
            ref = at1[at1["layer"] == "all"]["collapse_level_loose"].iloc[0]
            assert got["collapse_level_same_loose"] == pytest.approx(ref)
    assert counts[3.0][1] > 0
