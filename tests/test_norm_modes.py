"""Frozen norm scales and attention patterns in attribution: identities against exact patching and hand-written gradients."""

from __future__ import annotations

from functools import partial

import pytest
import torch

from interp_norm import AdditionTask
from interp_norm.circuits import LogitDiff, activation_patch, attribution_patch, make_pairs
from interp_norm.circuits.norm_modes import norm_scale_names
from interp_norm.core.hook_names import act_name
from interp_norm.errors import PatchingError
from tests._models import make_model

EPS64 = torch.finfo(torch.float64).eps


@pytest.fixture(scope="module")
def pairs():
    return make_pairs(AdditionTask.preset("cpu-small"), 6, "id", seed=7, aligned=True)


def linear_mlp_model(attn_norm: str):
    """A tiny float64 model with a plain unembedding and MLPs that act linearly: each hidden unit's
    bias is 4 and its input weights are shrunk 20x, so every pre-activation stays positive and
    the ReLU is the identity on every input the tests run (checked by ``relu_is_identity``)."""
    model = make_model(3, attn_norm=attn_norm, head="unembed").double()
    with torch.no_grad():
        for blk in model.blocks:
            blk.mlp.b_in.fill_(4.0)
            blk.mlp.W_in.mul_(0.05)
    return model


def effect64(r):
    """The estimated or exact effect per cell in float64 (``effect()`` reads the float32 ``values``)."""
    return (r.per_example.mean(-1) - r.baseline.mean()).view(r.values.shape)


def _min_pre(act, hook, seen):
    seen.append(float(act.detach().min()))


def _pin(act, hook, ref):
    """The corrupted run's tensor, once per stacked copy of the batch."""
    return ref.repeat(act.shape[0] // ref.shape[0], *([1] * (ref.ndim - 1)))


def pinned_exact(model, pairs, metric, act: str):
    """Exact patching (our engine's hooks method) of the model with every norm scale and attention
    pattern pinned to its value on the corrupted run. Pinned, every map from a patched activation to
    the logits is affine: norms divide by constants, attention mixes with constant weights, the
    MLPs are linear (``linear_mlp_model``), the head is a matrix; the logit difference is linear.
    So the exact effect equals the first-order estimate at the corrupted run, with nothing left over."""
    names = norm_scale_names(model) + [act_name("pattern", l) for l in range(model.cfg.n_layers)]
    with torch.no_grad():
        _, clean_cache = model.run_with_cache(pairs.clean_tokens)
        _, corr = model.run_with_cache(pairs.corrupted_tokens, names_filter=lambda nm: nm in names)
    with model.hooks(fwd_hooks=[(nm, partial(_pin, ref=corr[nm])) for nm in names]):
        return activation_patch(model, pairs.corrupted_tokens, clean_cache, metric, act, method="hooks")


@pytest.mark.parametrize("attn_norm", ["pre", "qkv", "qk"])
@pytest.mark.parametrize("act", ["resid_pre", "z", "v", "k", "attn_out", "mlp_out"])
def test_fully_frozen_attribution_equals_exact_patching_of_the_pinned_model(attn_norm, act, pairs):
    """With norms and patterns frozen, EAP is the derivative of the pinned model, which is affine in
    every patched activation: it equals exact patching of that model up to rounding (float64:
    ~1e3 rounding steps of relative size eps on the path to each logit, so 1e4 * eps of the
    largest effect). The live estimate, against the real model, must differ by far more."""
    model = linear_mlp_model(attn_norm)
    metric = LogitDiff(pairs)
    pre_min: list = []
    mlp_pre = [(act_name("pre", l), partial(_min_pre, seen=pre_min)) for l in range(model.cfg.n_layers)]
    with model.hooks(fwd_hooks=mlp_pre):
        exact = effect64(pinned_exact(model, pairs, metric, act))
        est = effect64(attribution_patch(model, pairs, metric, act, norm="frozen", pattern="frozen"))
        live = effect64(attribution_patch(model, pairs, metric, act))
        true = effect64(activation_patch(model, pairs, None, metric, act, method="hooks"))
    assert min(pre_min) > 0  # the ReLUs were the identity on every run
    scale = float(exact.abs().max())
    assert scale > 1e-4 or act == "k"  # keys reach nothing through frozen patterns: both are 0
    assert float((est - exact).abs().max()) <= 1e4 * EPS64 * max(scale, 1.0)
    if act != "k":
        assert float((live - true).abs().max()) > 1e-6 * scale  # the live linearisation is not exact here


def test_frozen_ln_final_gradient_is_the_hand_written_one(pairs):
    """Attribution at the last residual with ln_final's scale frozen: the gradient of
    ``u . (w * (x - mean x) / s + b)`` with ``s`` constant is ``(u*w - mean(u*w)) / s`` at the positions the
    metric reads, so EAP = (clean - corrupted) . that, summed per position."""
    model = linear_mlp_model("pre")
    metric = LogitDiff(pairs)
    L = model.cfg.n_layers
    rp, sc = act_name("resid_post", L - 1), act_name("scale")
    with torch.no_grad():
        _, cc = model.run_with_cache(pairs.clean_tokens, names_filter=lambda nm: nm == rp)
        _, xc = model.run_with_cache(pairs.corrupted_tokens, names_filter=lambda nm: nm in (rp, sc))
    W_U, w = model.head.W_U.detach(), model.ln_final.w.detach()
    # the metric: sum_j weights[b, j] * (logit of correct[b, j] - logit of wrong[b, j]) at position cols[j]
    u = torch.zeros_like(cc[rp])  # [b, pos, d]: d metric / d ln_final output
    u[:, metric.cols] = metric.weights.double().unsqueeze(-1) * (W_U.T[metric.correct] - W_U.T[metric.wrong])
    uw = u * w
    g = (uw - uw.mean(-1, keepdim=True)) / xc[sc]  # [b, pos, d]
    hand = ((cc[rp] - xc[rp]) * g).sum(-1).mean(0)  # [pos]
    est = effect64(attribution_patch(model, pairs, metric, "resid_post", norm="frozen"))[L - 1]
    live = effect64(attribution_patch(model, pairs, metric, "resid_post"))[L - 1]
    tol = 1e4 * EPS64 * max(float(hand.abs().max()), 1.0)
    assert float((est - hand).abs().max()) <= tol
    assert float((live - hand).abs().max()) > 1e3 * tol  # the live scale's gradient term is not negligible


def test_default_is_live_and_bad_modes_are_refused(pairs):
    model = make_model(1, attn_norm="qkv").double()
    a = attribution_patch(model, pairs, None, "z")
    b = attribution_patch(model, pairs, None, "z", norm="live", pattern="live")
    assert torch.equal(a.values, b.values) and a.method == "eap"
    assert attribution_patch(model, pairs, None, "z", norm="frozen").method == "eap+frozen-norm"
    with pytest.raises(PatchingError, match="norm must be 'live' or 'frozen'"):
        attribution_patch(model, pairs, None, "z", norm="detached")


@pytest.mark.parametrize("attn_norm", ["pre", "qkv"])
def test_frozen_atp_equals_exact_patching_of_the_pinned_model(attn_norm, pairs):
    """AtP (its own gradient code) with norms and patterns frozen is exact on the pinned linear-MLP
    model too; AtP*'s key fix with frozen patterns downstream keeps its own exact softmax, so on a
    one-layer-deep key it differs from the all-frozen estimate (which is 0)."""
    from interp_norm.circuits.atp_star import atp_star

    model = linear_mlp_model(attn_norm)
    metric = LogitDiff(pairs)
    for act in ("z", "resid_mid"):
        exact = effect64(pinned_exact(model, pairs, metric, act))
        est = effect64(atp_star(model, pairs, metric, act, qk_fix=False, norm="frozen", pattern="frozen"))
        assert float((est - exact).abs().max()) <= 1e4 * EPS64 * max(float(exact.abs().max()), 1.0)
    k_fix = atp_star(model, pairs, metric, "k", norm="frozen", pattern="frozen")
    assert k_fix.method == "atp*+frozen-norm+frozen-pattern"
    assert float(effect64(k_fix).abs().max()) > 1e-6
    k_lin = effect64(atp_star(model, pairs, metric, "k", qk_fix=False, norm="frozen", pattern="frozen"))
    assert float(k_lin.abs().max()) <= 1e4 * EPS64  # 0, up to adding and removing the baseline


@pytest.mark.parametrize("norm,pattern", [("frozen", "live"), ("frozen", "frozen"), ("live", "frozen")])
def test_frozen_edges_sum_to_frozen_nodes(norm, pattern, pairs):
    """A sender's out-edges add up to its node score (the residual is a sum of senders), in every
    mode: the edge pass (split twin) and the node pass (leaves on the model) freeze the same things.
    Edges into queries and keys score exactly 0 with frozen patterns."""
    from interp_norm.circuits import edge_attribution

    model = make_model(2, attn_norm="qkv").double()
    metric = LogitDiff(pairs)
    edges = edge_attribution(model, pairs, metric, norm=norm, pattern=pattern)
    live = edge_attribution(model, pairs, metric)
    out = edges.groupby("sender")["score"].sum()
    z = effect64(attribution_patch(model, pairs, metric, "z", by="all", norm=norm, pattern=pattern))
    mlp = effect64(attribution_patch(model, pairs, metric, "mlp_out", by="all", norm=norm, pattern=pattern))
    scale = float(z.abs().max())
    for l in range(model.cfg.n_layers):
        for h in range(model.cfg.n_heads):
            assert abs(out[f"a{l}.h{h}"] - float(z[l, h])) <= 1e6 * EPS64 * scale
        assert abs(out[f"m{l}"] - float(mlp[l])) <= 1e6 * EPS64 * scale
    qk = edges[edges["input"].isin(["q", "k"])]["score"]
    assert (qk.abs().max() == 0.0) == (pattern == "frozen")
    j = edges.merge(live, on=["sender", "receiver"])
    assert (j.score_x - j.score_y).abs().max() > 1e-4 * scale


def _pin_unless_clean(act, hook, ref, clean):
    """The corrupted run's tensor per stacked copy, except on the clean run itself (recognised by
    its own activation, bit for bit), whose senders exact edge patching reads, and on the runner's
    wiring probe (another batch shape)."""
    if (act.shape == clean.shape and torch.equal(act, clean)) or act.shape[1:] != ref.shape[1:] or act.shape[0] % ref.shape[0]:
        return act
    return _pin(act, hook, ref)


@pytest.mark.parametrize("attn_norm", ["pre", "qkv"])
def test_fully_frozen_edge_attribution_equals_exact_edge_patching_of_the_pinned_model(attn_norm, pairs):
    """Edges: with norms and patterns frozen, EAP of every edge (split twin and copies backends)
    equals exact edge patching of the pinned linear-MLP model (copies backend, which runs the model
    itself, so the pins reach it); the same affine argument as for nodes."""
    from interp_norm.circuits import edge_attribution, exact_edge_patch

    model = linear_mlp_model(attn_norm)
    metric = LogitDiff(pairs)
    names = norm_scale_names(model) + [act_name("pattern", l) for l in range(model.cfg.n_layers)]
    with torch.no_grad():
        _, cc = model.run_with_cache(pairs.clean_tokens, names_filter=lambda nm: nm in names)
        _, xc = model.run_with_cache(pairs.corrupted_tokens, names_filter=lambda nm: nm in names)
    pins = [(nm, partial(_pin_unless_clean, ref=xc[nm], clean=cc[nm])) for nm in names]
    with model.hooks(fwd_hooks=pins):
        exact = exact_edge_patch(model, pairs, metric, backend="copies")
    scale = float(exact.score.abs().max())
    assert scale > 1e-3
    live = exact_edge_patch(model, pairs, metric, backend="copies").merge(exact, on=["sender", "receiver"])
    assert float((live.score_x - live.score_y).abs().max()) > 1e-4 * scale  # the pins took effect
    for backend in ("split", "copies"):
        est = edge_attribution(model, pairs, metric, backend=backend, norm="frozen", pattern="frozen")
        j = est.merge(exact, on=["sender", "receiver"], suffixes=("", "_exact"))
        assert len(j) == len(exact)
        assert float((j.score - j.score_exact).abs().max()) <= 1e4 * EPS64 * max(scale, 1.0), backend


def test_a_bridge_needs_tokens_to_check_its_norm_hooks():
    from interp_norm.anatomy import tiny_bridge
    from interp_norm.circuits.norm_modes import freeze_hooks

    with pytest.raises(PatchingError, match="needs tokens"):
        freeze_hooks(tiny_bridge("gpt2"), "frozen", "live")


def test_edge_atp_star_takes_the_modes(pairs):
    """AtP*'s edges: the edges it does not rescore are the frozen-mode EAP edges; with frozen
    patterns, the query/key edges keep AtP*'s exact-softmax score (EAP gives them 0)."""
    from interp_norm.circuits import edge_attribution
    from interp_norm.circuits.atp_star import edge_atp_star

    model = make_model(2, attn_norm="qkv").double()
    star = edge_atp_star(model, pairs, None, norm="frozen", pattern="frozen")
    eap = edge_attribution(model, pairs, None, norm="frozen", pattern="frozen")
    assert set(star.method) == {"atp*+frozen-norm+frozen-pattern"}
    j = star.merge(eap, on=["sender", "receiver"])
    qk = j.input_x.isin(["q", "k"])
    assert (j[~qk].score_x - j[~qk].score_y).abs().max() == 0.0
    assert j[qk].score_y.abs().max() == 0.0 and j[qk].score_x.abs().max() > 1e-6
