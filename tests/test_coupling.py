"""interp_norm.geometry.coupling against an explicit computation of the attention pattern, and the
identity it exists to show: a per-head norm makes a head blind to what it does not read."""

from __future__ import annotations

import pytest
import torch

from interp_norm.geometry.coupling import norm_coupling
from tests._models import make_model


def _tokens(model, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, model.cfg.d_vocab, (3, 10), generator=g)


def _manual_pattern(model, x, scale_source):
    """Layer 0's Pre-Norm attention written out: centre (LN), divide by the RMS of ``scale_source``,
    gains, W_Q/W_K, q·k / attn_scale, causal mask, softmax."""
    ln, attn = model.blocks[0].ln1, model.blocks[0].attn
    centre = (lambda t: t - t.mean(-1, keepdim=True)) if ln.kind == "ln" else (lambda t: t)
    s = (centre(scale_source).pow(2).mean(-1, keepdim=True) + ln.eps).sqrt()
    unit = centre(x) / s
    wq, wk = (ln.w[0], ln.w[1]) if ln.n_gains > 1 else (ln.w, ln.w)
    q = torch.einsum("bpd,hde->bphe", unit * wq, attn.W_Q)
    k = torch.einsum("bpd,hde->bphe", unit * wk, attn.W_K)
    scores = torch.einsum("bqhe,bkhe->bhqk", q, k) / model.cfg.attn_scale
    n = x.shape[1]
    scores = scores.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))
    return scores.softmax(-1)


def _tv(p, q):
    return (0.5 * (p - q).abs().sum(-1)[:, :, 1:].mean(dim=(0, 2)))


@pytest.mark.parametrize("norm_kind", ["rms", "ln"])
def test_paths_match_the_pattern_written_out(norm_kind):
    model = make_model(attn_norm="pre", norm_kind=norm_kind)
    tokens = _tokens(model)
    basis = torch.randn(model.cfg.d_model, 5, generator=torch.Generator().manual_seed(1))
    got = norm_coupling(model, tokens, 0, basis, factor=0.3, n_controls=0)
    with torch.no_grad():
        _, cache = model.run_with_cache(tokens)
        x = cache["blocks.0.hook_resid_pre"]
        u, _ = torch.linalg.qr(basis)
        x2 = x + (0.3 - 1.0) * (x @ u) @ u.T
        clean = _manual_pattern(model, x, x)
        want = {"total": _tv(_manual_pattern(model, x2, x2), clean),
                "direct": _tv(_manual_pattern(model, x2, x), clean),
                "norm": _tv(_manual_pattern(model, x, x2), clean)}
    for path, tv in want.items():
        g = got[got["path"] == path].sort_values("head")["tv"].to_numpy()
        # float32 patterns: each TV sums ~10 differences of O(1e-7) rounding
        assert g == pytest.approx(tv.numpy(), abs=2e-5), path
    assert float(want["norm"].max()) > 1e-3  # the test is not vacuous: the shared scale moves attention


def _unread_by_head0(model):
    """An orthonormal basis of the residual directions head 0 of layer 0 reads with neither W_Q nor W_K."""
    attn, ln = model.blocks[0].attn, getattr(model.blocks[0], "ln1", None)
    wq = wk = torch.ones(model.cfg.d_model)
    if ln is not None:  # Pre-Norm: the head reads the normalised residual times the norm's gains
        wq, wk = (ln.w[0], ln.w[1]) if ln.n_gains > 1 else (ln.w, ln.w)
    m = torch.cat([wq[:, None] * attn.W_Q[0], wk[:, None] * attn.W_K[0]], dim=1).T.detach()  # [2·d_head, d_model]
    _, _, vh = torch.linalg.svd(m)
    return vh[m.shape[0]:].T  # [d_model, d_model − 2·d_head]


def test_a_component_head_does_not_read_moves_pre_norm_only_through_the_norm_and_qkv_norm_not_at_all():
    pre, qkv = make_model(attn_norm="pre", norm_kind="rms"), make_model(attn_norm="qkv", norm_kind="rms")
    for model in (pre, qkv):
        got = norm_coupling(model, _tokens(model), 0, _unread_by_head0(model), factor=0.3, n_controls=2)
        h0 = got[(got["head"] == 0) & (got["subspace"] == "component")].set_index("path")["tv"]
        assert h0["direct"] < 2e-5  # the head does not read the component
        if model is qkv:
            assert h0["total"] < 2e-5 and h0["norm"] < 2e-5  # its own norms see only what it reads
        else:
            assert h0["norm"] > 1e-3 and h0["total"] > 1e-3  # the shared norm carries the change
        controls = got[got["subspace"].str.startswith("random")]
        assert set(controls["subspace"]) == {"random 0", "random 1"}
        # equal-norm controls: the same mean perturbation size as the component's
        comp = got[got["subspace"] == "component"]["delta_norm"].iloc[0]
        assert controls["delta_norm"].to_numpy() == pytest.approx(comp, rel=1e-4)
