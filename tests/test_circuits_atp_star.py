"""AtP*: the softmax fix against an independent hook computation, the saturation miss on a
hand-built model (plain attribution ~0, exact patching large, AtP* close to exact), and GradDrop
on a hand-built cancellation (first-order effect exactly 0, exact effect large)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from interp_norm import AdditionTask, HookedNormTransformer, ModelConfig
from interp_norm.circuits import (
    LogitDiff,
    PatchingPairs,
    activation_patch,
    attribution_patch,
    edge_attribution,
    exact_edge_patch,
    make_pairs,
)
from interp_norm.circuits.atp_star import atp_star, edge_atp_star
from interp_norm.errors import PatchingError
from interp_norm.core.hook_names import act_name
from tests._models import make_model

# ----------------------------------------------------------------------------- independent reference


def _pattern_grads(model, tokens, metric):
    """dM/dA per example at every layer's pattern, by a leaf at hook_pattern."""
    leaves = {}

    def leaf(x, hook, l):
        leaves[l] = torch.zeros_like(x, requires_grad=True)
        return x + leaves[l]

    L = model.cfg.n_layers
    with torch.enable_grad():
        logits = model.run_with_hooks(tokens, fwd_hooks=[(act_name("pattern", l), lambda x, hook, l=l: leaf(x, hook, l)) for l in range(L)])
        g = torch.autograd.grad(metric(logits).sum(), [leaves[l] for l in range(L)])
    return [x.double() for x in g]


@torch.no_grad()
def _patched_pattern(model, tokens, which, layer, pos, head, clean_act):
    """The pattern of ``layer`` when hook_{which} is patched at (pos, head) -- or every position
    when pos is None -- with the clean activation (a real forward pass)."""
    seen = {}

    def patch(x, hook):
        x = x.clone()
        if pos is None:
            x[:, :, head] = clean_act[:, :, head]
        else:
            x[:, pos, head] = clean_act[:, pos, head]
        return x

    def keep(x, hook):
        seen["A"] = x.double()
        return x

    model.run_with_hooks(tokens, fwd_hooks=[(act_name(which, layer), patch), (act_name("pattern", layer), keep)])
    return seen["A"]


@pytest.mark.parametrize("kw", [dict(attn_norm="pre"), dict(attn_norm="qkv", norm_kind="ln"), dict(attn_norm="qk")])
def test_softmax_fix_equals_the_pattern_change_of_a_real_patch(kw):
    model = make_model(seed=1, **kw)
    pairs = make_pairs(AdditionTask.preset("cpu"), 4, "id", seed=2, aligned=True)
    metric = LogitDiff(pairs)
    corr, clean = pairs.corrupted_tokens, pairs.clean_tokens
    L, H, n = model.cfg.n_layers, model.cfg.n_heads, corr.shape[1]
    G = _pattern_grads(model, corr, metric)
    with torch.no_grad():
        _, cc = model.run_with_cache(clean)
        _, xc = model.run_with_cache(corr)
    for which in ("q", "k"):
        got = atp_star(model, pairs, metric, which).per_example - atp_star(model, pairs, metric, which).baseline  # [cells, b]
        got_all = atp_star(model, pairs, metric, which, by="all").per_example
        k = 0
        for l in range(L):
            A = xc[act_name("pattern", l)].double()
            for p in range(n):
                for h in range(H):
                    A2 = _patched_pattern(model, corr, which, l, p, h, cc[act_name(which, l)])
                    want = ((A2 - A) * G[l]).sum((1, 2, 3))
                    assert got[k].double() == pytest.approx(want, abs=1e-5), (which, l, p, h)
                    k += 1
            for h in range(H):
                A2 = _patched_pattern(model, corr, which, l, None, h, cc[act_name(which, l)])
                want = ((A2 - A) * G[l]).sum((1, 2, 3))
                assert got_all[l * H + h].double() - atp_star(model, pairs, metric, which, by="all").baseline == pytest.approx(want, abs=1e-5)


@pytest.mark.parametrize("activation,by", [("z", "pos"), ("v", "all"), ("k", "pos"), ("q", "all"), ("resid_pre", "pos"), ("mlp_out", "all")])
def test_without_corrections_it_is_plain_attribution_patching(activation, by):
    model = make_model(seed=2, attn_norm="qk")
    pairs = make_pairs(AdditionTask.preset("cpu"), 5, "id", seed=3, aligned=True)
    plain = atp_star(model, pairs, None, activation, by=by, qk_fix=False)
    ref = attribution_patch(model, pairs, None, activation, by=by)
    assert plain.values.shape == ref.values.shape and plain.axis_names == ref.axis_names
    assert plain.effect() == pytest.approx(ref.effect(), abs=1e-5)
    assert plain.index_df.equals(ref.index_df)


# ----------------------------------------------------------------------------- saturation


V, N = 17, 12
TOK, POS, OUT, CONST = 0, V, V + N, 2 * V + N
MARKER = 16


def marker_model() -> HookedNormTransformer:
    """Head a0.h0 attends (score 30: saturated) to the position holding MARKER and writes that
    position's index into OUT; the unembedding reads it, so the model predicts where the marker is."""
    cfg = ModelConfig(d_model=2 * V + N + 1, d_head=N, n_heads=2, n_layers=1, n_ctx=N, d_mlp=4, attn_norm="none",
                      pos_embed="learned", head="unembed", seed=0)
    model = HookedNormTransformer(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
        model.W_E[:, TOK:TOK + V] = torch.eye(V)
        model.W_E[:, CONST] = 3.0  # a constant direction keeps the final LayerNorm nearly linear
        model.W_pos[:, POS:POS + N] = torch.eye(N)
        a = model.blocks[0].attn
        a.W_Q[0, POS:POS + N, 0] = 30 * cfg.attn_scale  # every query looks for the marker ...
        a.W_K[0, TOK + MARKER, 0] = 1.0  # ... which only the marker's key has
        for j in range(N):
            a.W_V[0, POS + j, j] = 1.0
            a.W_O[0, j, OUT + j] = 1.0
            model.head.W_U[OUT + j, j] = 10.0
        for blk in model.blocks:
            blk.ln2.w.fill_(1.0)
        model.ln_final.w.fill_(1.0)
    return model


def marker_pairs(n_pairs: int = 8, length: int = 9, clean_at: int = 3, corr_at: int = 5) -> PatchingPairs:
    g = torch.Generator().manual_seed(0)
    clean = torch.randint(0, MARKER, (n_pairs, length), generator=g)
    corr = clean.clone()
    clean[:, clean_at], corr[:, corr_at] = MARKER, MARKER
    clean[:, -1], corr[:, -1] = clean_at, corr_at  # the answer: where the marker is
    mask = torch.zeros(length, dtype=torch.bool)
    mask[length - 2] = True
    return PatchingPairs(clean, corr, score_mask=mask)


def test_the_marker_model_finds_the_marker():
    model = marker_model()
    g = torch.Generator().manual_seed(1)
    toks = torch.randint(0, MARKER, (300, N), generator=g)
    where = torch.randint(0, N - 1, (300,), generator=g)
    toks[torch.arange(300), where] = MARKER
    pred = model(toks).argmax(-1)[:, -1]
    assert torch.equal(pred, where)


def test_atp_star_recovers_the_key_that_plain_attribution_misses():
    model, pairs = marker_model(), marker_pairs()
    metric = LogitDiff(pairs)
    exact = activation_patch(model, pairs, None, metric, "k").effect()[0, :, 0]  # head a0.h0, per key position
    plain = attribution_patch(model, pairs, metric, "k").effect()[0, :, 0]
    star = atp_star(model, pairs, metric, "k").effect()[0, :, 0]
    with torch.no_grad():
        gap = float(metric(model(pairs.clean_tokens)).mean() - metric(model(pairs.corrupted_tokens)).mean())
    for p in (3, 5):  # the clean marker's key grabs half the attention; removing the corrupted one spreads it
        assert exact[p] > 0.3 * gap
        assert abs(plain[p]) < 1e-6 * exact[p]  # the softmax is saturated: gradient ~e^-30
        assert star[p] == pytest.approx(float(exact[p]), rel=0.1)
    others = [p for p in range(len(exact)) if p not in (3, 5)]
    assert exact[others].abs().max() < 1e-6 and star[others].abs().max() < 1e-6
    # the edge view: embed -> a0.h0.k carries the marker; EAP scores it ~0, AtP* close to exact
    edge = ("embed", "a0.h0.k")
    pick = lambda df: float(df.set_index(["sender", "receiver"]).loc[edge, "score"])  # noqa: E731
    ex, eap, st = pick(exact_edge_patch(model, pairs, metric)), pick(edge_attribution(model, pairs, metric)), pick(edge_atp_star(model, pairs, metric))
    assert ex > 0.3 * gap and abs(eap) < 1e-6 * ex and st == pytest.approx(ex, rel=0.25)


@torch.no_grad()
def test_edge_atp_star_equals_the_pattern_change_of_a_real_edge_patch():
    """Edge u -> a{l}.h{h}.k: add u_clean - u_corr to head h's key input only (a split-input twin)."""
    model = make_model(seed=4, attn_norm="qkv")
    pairs = make_pairs(AdditionTask.preset("cpu"), 4, "id", seed=5, aligned=True)
    metric = LogitDiff(pairs)
    twin = HookedNormTransformer(model.cfg.replace(use_split_qkv_input=True)).eval()
    twin.load_state_dict(model.state_dict())
    corr, clean = pairs.corrupted_tokens, pairs.clean_tokens
    G = _pattern_grads(model, corr, metric)
    _, cc = model.run_with_cache(clean)
    _, xc = model.run_with_cache(corr)
    star = edge_atp_star(model, pairs, metric).set_index(["sender", "receiver"])["score"]
    delta = {"embed": (cc["hook_embed"] + cc["hook_pos_embed"]) - (xc["hook_embed"] + xc["hook_pos_embed"]),
             "m0": cc[act_name("mlp_out", 0)] - xc[act_name("mlp_out", 0)]}
    W_O = model.blocks[0].attn.W_O
    delta["a0.h2"] = torch.einsum("bpd,dm->bpm", cc[act_name("z", 0)][:, :, 2] - xc[act_name("z", 0)][:, :, 2], W_O[2])
    for u, l, h, which in [("embed", 0, 1, "k"), ("embed", 0, 3, "q"), ("m0", 1, 0, "k"), ("a0.h2", 1, 2, "q")]:
        seen = {}

        def move(x, hook, h=h, u=u):
            x = x.clone()
            x[:, :, h] += delta[u]
            return x

        def keep(x, hook):
            seen["A"] = x.double()
            return x

        twin.run_with_hooks(corr, fwd_hooks=[(act_name(f"{which}_input", l), move), (act_name("pattern", l), keep)])
        want = float(((seen["A"] - xc[act_name("pattern", l)].double()) * G[l]).sum((1, 2, 3)).mean())
        assert star[(u, f"a{l}.h{h}.{which}")] == pytest.approx(want, abs=1e-5)
    eap = edge_attribution(model, pairs, metric).set_index(["sender", "receiver"])["score"]
    other = [e for e in eap.index if e[1].endswith((".v", "m0", "m1", "logits"))]
    assert star[other].to_numpy() == pytest.approx(eap[other].to_numpy(), abs=1e-7)  # only q/k edges change


# ----------------------------------------------------------------------------- cancellation


D = 6  # residual: [signal, mlp out, constant, tokA flag, pos0, spare]
SIG, MOUT, C0 = 0, 1, 2


def cancellation_model(s_clean: float = 1.0, s_corr: float = 3.0) -> tuple[HookedNormTransformer, Any]:
    """a0.h0 copies a scalar signal s(first token) into SIG. Logit 1 reads +alpha*SIG directly and
    -1 * MOUT, where the layer-1 MLP writes relu(k (LN(x)_SIG - theta)) into MOUT: active for the
    corrupted s, off for the clean s. alpha is solved so the first-order effect of patching
    a0.h0 is exactly zero on the corrupted input (direct and MLP paths cancel)."""
    cfg = ModelConfig(d_model=D, d_head=2, n_heads=1, n_layers=2, n_ctx=8, d_mlp=1, d_vocab=4, attn_norm="none",
                      pos_embed="learned", head="unembed", seed=0)
    model = HookedNormTransformer(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
        model.W_E[:, C0] = 4.0
        model.W_E[1, 3] = s_clean  # token 1 and token 2 carry the signal values in a side channel
        model.W_E[2, 3] = s_corr
        model.W_pos[0, 4] = 1.0
        model.W_pos[:, 5] = 1.0  # a constant query direction
        a = model.blocks[0].attn
        a.W_Q[0, 5, 0] = 30 * cfg.attn_scale  # every query attends to position 0 (saturated)
        a.W_K[0, 4, 0] = 1.0
        a.W_V[0, 3, 0] = 1.0
        a.W_O[0, 0, SIG] = 1.0  # SIG = s(token at position 0)
        for blk in model.blocks:
            blk.ln2.w.fill_(1.0)
        model.ln_final.w.fill_(1.0)
        # the MLP threshold halfway between the two signal values, measured on the real residual
        probe = torch.tensor([[1, 3, 3, 3]])
        _, cache = model.run_with_cache(probe)
        x = cache[act_name("resid_mid", 1)][0, -1].clone()
        ln = lambda v: torch.nn.functional.layer_norm(v, (D,), eps=cfg.eps)  # noqa: E731
        lo = ln(torch.cat([torch.tensor([s_clean]), x[1:]]))[SIG]
        hi = ln(torch.cat([torch.tensor([s_corr]), x[1:]]))[SIG]
        m = model.blocks[1].mlp
        m.W_in[SIG, 0], m.b_in[0] = 5.0, -5.0 * float(lo + hi) / 2
        m.W_out[0, MOUT] = 1.0
        model.head.W_U[MOUT, 1] = -1.0
    pairs = PatchingPairs(torch.tensor([[1, 3, 3, 3, 1]]), torch.tensor([[2, 3, 3, 3, 0]]), score_mask=torch.tensor([False, False, False, True, False]))
    metric = LogitDiff(pairs)

    def first_order(alpha: float) -> float:
        with torch.no_grad():
            model.head.W_U[SIG, 1] = alpha
        return float(attribution_patch(model, pairs, metric, "z", by="all").effect()[0, 0])

    e0, e1 = first_order(0.0), first_order(1.0)  # linear in alpha (W_U acts after the last norm)
    first_order(-e0 / (e1 - e0))
    return model, pairs


def test_grad_drop_recovers_a_cancelled_head():
    model, pairs = cancellation_model()
    metric = LogitDiff(pairs)
    assert model.head.W_U[SIG, 1] > 0
    exact = float(activation_patch(model, pairs, None, metric, "z", by="all").effect()[0, 0])
    plain = float(atp_star(model, pairs, metric, "z", by="all").effect()[0, 0])
    gd = atp_star(model, pairs, metric, "z", by="all", grad_drop=True).effect()
    assert abs(exact) > 0.5
    assert abs(plain) < 1e-5 * abs(exact)  # direct and indirect first-order effects cancel
    assert gd[0, 0] > 0.5 * abs(exact)  # GradDrop sees the paths separately
    assert gd[1].abs().max() < 1e-6 and (gd >= 0).all()  # layer 1's head does nothing


def test_atp_star_input_errors():
    model = make_model(seed=0, n_layers=1)
    pairs = make_pairs(AdditionTask.preset("cpu"), 2, "id", seed=0)
    with pytest.raises(PatchingError, match="at least 2 layers"):
        atp_star(model, pairs, None, "z", grad_drop=True)
    with pytest.raises(PatchingError, match="not 'pattern'"):
        atp_star(model, pairs, None, "pattern")
    with pytest.raises(PatchingError, match="PatchingPairs"):
        atp_star(model, pairs.clean_tokens, None, "k")
    with pytest.raises(PatchingError, match="by must be"):
        atp_star(model, pairs, None, "k", by="dest_src")
