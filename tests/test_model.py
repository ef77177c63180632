"""The model against independent computations from its weights (issue: foundation)."""

from __future__ import annotations

import math

import pytest
import torch
from transformer_lens import ActivationCache, patching

from interp_norm import AdditionTask, HookedNormTransformer, ModelConfig
from interp_norm.errors import ConfigError, ProblemStringError
from interp_norm.core.task import PAD_ID
from _models import make_model

VARIANTS = [
    dict(attn_norm="pre", norm_kind="rms", pre_norm_gains="separate"),
    dict(attn_norm="pre", norm_kind="ln", pre_norm_gains="shared"),
    dict(attn_norm="qkv", norm_kind="rms"),
    dict(attn_norm="qkv", norm_kind="ln", qkv_gain="shared"),
    dict(attn_norm="qk", norm_kind="rms"),
    dict(attn_norm="none"),
]


def _ids(v):
    return "-".join(str(x) for x in v.values())


@pytest.fixture(scope="module")
def tokens() -> torch.Tensor:
    return AdditionTask.preset("cpu").sample_batch(6, "id", seed=3).tokens


def _norm(x: torch.Tensor, kind: str, eps: float) -> torch.Tensor:
    """Textbook RMSNorm / LayerNorm without gain, written independently of the model's code."""
    if kind == "ln":
        mu = x.mean(-1, keepdim=True)
        var = ((x - mu) ** 2).mean(-1, keepdim=True)
        return (x - mu) / torch.sqrt(var + eps)
    return x / torch.sqrt((x**2).mean(-1, keepdim=True) + eps)


@pytest.mark.parametrize("variant", VARIANTS, ids=_ids)
def test_attention_matches_formula_from_weights(variant, tokens):
    model = make_model(**variant)
    cfg = model.cfg
    _, cache = model.run_with_cache(tokens)
    n = tokens.shape[1]
    causal = torch.tril(torch.ones(n, n, dtype=torch.bool))
    for layer, block in enumerate(model.blocks):
        a = block.attn
        x = cache[f"blocks.{layer}.hook_resid_pre"]
        if cfg.attn_norm == "pre":
            xn = _norm(x, cfg.norm_kind, cfg.eps)
            w = block.ln1.w
            gq, gk, gv = (w[0], w[1], w[2]) if w.ndim == 2 else (w, w, w)
            xq, xk, xv = xn * gq, xn * gk, xn * gv
        else:
            xq = xk = xv = x
        out = torch.zeros_like(x)
        for h in range(cfg.n_heads):
            q, k, v = xq @ a.W_Q[h], xk @ a.W_K[h], xv @ a.W_V[h]
            if cfg.attn_norm in ("qk", "qkv"):
                gq = a.q_norm.w[h] if a.q_norm.w.ndim == 2 else a.q_norm.w
                gk = a.k_norm.w[h] if a.k_norm.w.ndim == 2 else a.k_norm.w
                q, k = _norm(q, cfg.norm_kind, cfg.eps) * gq, _norm(k, cfg.norm_kind, cfg.eps) * gk
            if cfg.attn_norm == "qkv":
                gv = a.v_norm.w[h] if a.v_norm.w.ndim == 2 else a.v_norm.w
                v = _norm(v, cfg.norm_kind, cfg.eps) * gv
            scores = q @ k.transpose(-1, -2) / math.sqrt(cfg.d_head)
            pattern = torch.softmax(scores.masked_fill(~causal, -math.inf), dim=-1)
            torch.testing.assert_close(cache[f"blocks.{layer}.attn.hook_pattern"][:, h], pattern, atol=1e-5, rtol=1e-4)
            out += pattern @ v @ a.W_O[h]
        torch.testing.assert_close(cache[f"blocks.{layer}.hook_attn_out"], out + a.b_O, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("variant", [v for v in VARIANTS if v["attn_norm"] in ("qk", "qkv")], ids=_ids)
def test_qkv_normed_vectors_have_the_gain_norm(variant, tokens):
    """For RMS QKV/QK-Norm with unit gain the normalised head vectors have L2 norm sqrt(d_head)."""
    model = HookedNormTransformer(ModelConfig.preset("tiny", **variant)).eval()
    _, cache = model.run_with_cache(tokens)
    names = ["q", "k", "v"] if variant["attn_norm"] == "qkv" else ["q", "k"]
    for nm in names:
        normed = cache[f"blocks.0.attn.hook_{nm}_normed"]
        raw = cache[f"blocks.0.attn.hook_{nm}"]
        assert cache[f"blocks.0.attn.hook_{nm}_scale"].shape == raw.shape[:-1] + (1,)
        if variant["norm_kind"] == "rms":
            expected = math.sqrt(model.cfg.d_head) * raw.norm(dim=-1) / torch.sqrt(raw.pow(2).sum(-1) + model.cfg.d_head * model.cfg.eps)
            torch.testing.assert_close(normed.norm(dim=-1), expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("variant", VARIANTS, ids=_ids)
def test_causal_and_rows_sum_to_one(variant, tokens):
    model = make_model(**variant)
    logits, cache = model.run_with_cache(tokens)
    for layer in range(model.cfg.n_layers):
        p = cache[f"blocks.{layer}.attn.hook_pattern"]
        torch.testing.assert_close(p.sum(-1), torch.ones_like(p.sum(-1)))
        assert (p.triu(1) == 0).all()
    changed = tokens.clone()
    j = 7
    changed[:, j] = (changed[:, j] + 1) % 10
    logits2 = model(changed)
    torch.testing.assert_close(logits2[:, :j], logits[:, :j])
    assert not torch.allclose(logits2[:, j:], logits[:, j:])


@pytest.mark.parametrize("variant", VARIANTS, ids=_ids)
def test_every_hook_is_live(variant, tokens):
    """Editing any hook must change the logits (TransformerLens once shipped hook_scale edits that did nothing)."""
    model = make_model(use_attn_result=True, use_split_qkv_input=True, **variant)
    clean, cache = model.run_with_cache(tokens)
    names = list(cache.keys())
    expected = {"hook_embed", "hook_pos_embed", "blocks.0.attn.hook_q", "blocks.0.attn.hook_z", "blocks.1.hook_resid_post",
                "blocks.0.hook_q_input", "blocks.0.attn.hook_result", "ln_final.hook_scale", "blocks.0.mlp.hook_post"}
    if variant["attn_norm"] == "pre":
        expected |= {"blocks.0.ln1.hook_scale", "blocks.0.ln1.hook_normalized"}
    if variant["attn_norm"] in ("qk", "qkv"):
        expected |= {"blocks.0.attn.hook_q_scale", "blocks.0.attn.hook_k_normed"}
    if variant["attn_norm"] == "qkv":
        expected |= {"blocks.0.attn.hook_v_scale", "blocks.0.attn.hook_v_normed"}
    assert expected <= set(names), expected - set(names)
    g = torch.Generator().manual_seed(0)
    for name in names:
        def edit(act, hook):
            return act * 1.7 + 0.1 * torch.randn(act.shape, generator=g)
        out = model.run_with_hooks(tokens, fwd_hooks=[(name, edit)])
        assert not torch.allclose(out, clean, atol=1e-6), f"editing {name} did not change the logits"
    # and hooks were removed afterwards
    torch.testing.assert_close(model(tokens), clean)


def test_split_qkv_and_attn_result_do_not_change_the_function(tokens):
    for variant in VARIANTS:
        base = make_model(**variant)
        split = HookedNormTransformer(base.cfg.replace(use_split_qkv_input=True, use_attn_result=True)).eval()
        split.load_state_dict(base.state_dict())
        torch.testing.assert_close(split(tokens), base(tokens), atol=1e-5, rtol=1e-5)


def test_run_with_cache_returns_activation_cache_and_tl_tools_work(tokens):
    model = make_model(attn_norm="qkv", use_attn_result=True)
    _, cache = model.run_with_cache(tokens)
    assert isinstance(cache, ActivationCache)
    stacked = cache.stack_head_results(layer=-1)
    assert stacked.shape[0] == model.cfg.n_layers * model.cfg.n_heads
    resid = cache.accumulated_resid()
    assert resid.shape[0] == model.cfg.n_layers + 1


@pytest.mark.parametrize("attn_norm", ["pre", "qkv"])
def test_transformer_lens_patching_runs_unchanged(attn_norm):
    """TL 4.3's own patching functions run on our model; one cell is checked by hand."""
    task = AdditionTask.preset("cpu")
    clean = task.make_batch(["[12+34=46]"]).tokens
    corrupt = task.make_batch(["[12+35=47]"]).tokens
    model = make_model(attn_norm=attn_norm)
    pos = int((clean[0] == 12).nonzero()[0]) + 1  # predicts the second answer digit: 6 (clean) vs 7

    def metric(logits):
        return logits[0, pos, 6] - logits[0, pos, 7]

    _, clean_cache = model.run_with_cache(clean)
    out = patching.get_act_patch_attn_head_out_by_pos(model, corrupt, clean_cache, metric)
    assert out.shape == (model.cfg.n_layers, clean.shape[1], model.cfg.n_heads)
    resid = patching.get_act_patch_resid_pre(model, corrupt, clean_cache, metric)

    def z_hook(z, hook):  # independent check of one cell: head 1's z at layer 1, position pos
        z = z.clone()
        z[:, pos, 1] = clean_cache["blocks.1.attn.hook_z"][:, pos, 1]
        return z

    manual = metric(model.run_with_hooks(corrupt, fwd_hooks=[("blocks.1.attn.hook_z", z_hook)]))
    assert abs(float(out[1, pos, 1]) - float(manual.detach())) < 1e-5
    # patching resid_pre at layer 0 on the corrupted digit's position restores the clean metric exactly
    diff_pos = int((clean[0] != corrupt[0]).nonzero()[0])
    clean_metric = float(metric(model(clean)).detach())
    assert diff_pos < pos and abs(float(resid[0, diff_pos]) - clean_metric) < 1e-4


def test_generate_matches_stepwise_argmax():
    model = make_model(attn_norm="pre")
    questions = ["[12+N7=", "[3-45+6="]
    got = model.generate(questions, max_new_tokens=4)
    for q, g in zip(questions, got):
        toks = model.to_tokens(q)[0].tolist()
        expect = []
        for _ in range(4):
            nxt = int(model(torch.tensor([toks]))[0, -1].argmax())
            toks.append(nxt)
            expect.append(nxt)
            if nxt == 15:  # ']'
                break
        assert g == "".join(model.to_str_tokens(torch.tensor(expect)))


def test_positional_offset_changes_only_positions():
    model = make_model(attn_norm="pre")
    toks = model.to_tokens(["[12+34="])
    _, c0 = model.run_with_cache(toks)
    _, c1 = model.run_with_cache(toks, pos_offset=torch.tensor([5]))
    torch.testing.assert_close(c0["hook_embed"], c1["hook_embed"])
    # offset 5 at position p equals position p+5 at offset 0
    long = model.to_tokens(["[12+34+56+7="])
    _, c2 = model.run_with_cache(long)
    torch.testing.assert_close(c1["hook_pos_embed"][0, :3], c2["hook_pos_embed"][0, 5:8])
    # and the sinusoidal encoding has constant norm sqrt(n_freq)
    norms = c2["hook_pos_embed"][0].norm(dim=-1)
    torch.testing.assert_close(norms, torch.full_like(norms, math.sqrt(model.cfg.n_freq)))


def test_weight_shapes_follow_hookedtransformer():
    model = make_model(attn_norm="qkv", head="unembed")
    c = model.cfg
    assert model.blocks[0].attn.W_Q.shape == (c.n_heads, c.d_model, c.d_head)
    assert model.blocks[0].attn.W_O.shape == (c.n_heads, c.d_head, c.d_model)
    assert model.W_K.shape == (c.n_layers, c.n_heads, c.d_model, c.d_head)
    assert model.W_U.shape == (c.d_model, c.d_vocab)
    assert model.W_E.shape == (c.d_vocab, c.d_model)
    with pytest.raises(ConfigError, match="unembedding"):
        _ = make_model(attn_norm="pre").W_U


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(attn_norm="post"), "attn_norm"),
        (dict(norm_kind="batch"), "norm_kind"),
        (dict(d_model=0), "d_model"),
        (dict(n_freq=40), "n_freq"),
        (dict(pos_embed="rotary"), "pos_embed"),
        (dict(head="linear"), "head"),
        (dict(attn_scale=-1.0), "attn_scale"),
    ],
)
def test_bad_config_raises_config_error(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        ModelConfig.preset("tiny", **kwargs)


def test_too_long_input_raises_typed_error():
    model = make_model()
    long = "[" + "+".join(["99"] * 14) + "="
    with pytest.raises(ProblemStringError, match="n_ctx"):
        model.to_tokens(long)
    with pytest.raises(ProblemStringError, match="n_ctx"):
        model(torch.full((1, model.cfg.n_ctx + 1), PAD_ID))


# ----------------------------------------------------------------------------- TransformerLens habits


def test_generate_refuses_prompts_that_do_not_fit_like_to_tokens():
    model = make_model()
    long = "[" + "+".join(["99"] * 14) + "="  # 43 tokens > n_ctx 40
    with pytest.raises(ProblemStringError, match="n_ctx") as from_tokens:
        model.to_tokens(long)
    with pytest.raises(ProblemStringError, match="n_ctx") as from_generate:
        model.generate(long)
    assert str(from_generate.value) == str(from_tokens.value)
    with pytest.raises(ProblemStringError, match="n_ctx"):
        model.generate(["[1+2=", long])  # one bad problem in a batch is enough
    full = "[" + "+".join(["9"] * 18) + "+99="  # exactly n_ctx tokens: no room for an answer
    assert len(full) == model.cfg.n_ctx
    with pytest.raises(ProblemStringError, match="no room for an answer"):
        model.generate(full)
    with pytest.raises(ProblemStringError, match="no room for an answer"):
        model.generate(model.to_tokens(full))
    with pytest.raises(ProblemStringError, match="no problems"):
        model.generate([])
    assert len(model.generate(full[:-4] + "=", max_new_tokens=3)) == 1  # n_ctx - 3 tokens still fits


def test_from_pretrained_reads_the_shipped_checkpoint_and_takes_folders(tmp_path):
    from interp_norm.training.checkpoints import _load_checkpoint, pretrained_dir
    from interp_norm.errors import CheckpointNotFoundError

    ours = HookedNormTransformer.from_pretrained("pre")
    ref = _load_checkpoint(pretrained_dir() / "pre")[0]
    assert ours.cfg.to_dict() == ref.cfg.to_dict() and not ours.training
    assert ours.state_dict().keys() == ref.state_dict().keys()
    assert all(torch.equal(v, ref.state_dict()[k]) for k, v in ours.state_dict().items())
    folder = HookedNormTransformer.from_pretrained(str(pretrained_dir() / "pre"))
    assert all(torch.equal(v, ref.state_dict()[k]) for k, v in folder.state_dict().items())
    with pytest.raises(CheckpointNotFoundError, match="available"):
        HookedNormTransformer.from_pretrained("no-such-model")
    with pytest.raises(ConfigError, match="fold_ln"):
        HookedNormTransformer.from_pretrained("pre", fold_ln=True)


def test_model_module_does_not_import_checkpoints_at_module_level():
    """Layering: model.py is core; checkpoints (one layer up) is imported only inside from_pretrained."""
    import ast
    import inspect

    import interp_norm.core.model

    tree = ast.parse(inspect.getsource(interp_norm.core.model))
    top = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
    names = [a.name for n in top if isinstance(n, ast.Import) for a in n.names]
    names += [f"{n.module}.{a.name}" for n in top if isinstance(n, ast.ImportFrom) for a in n.names]
    assert names and not [m for m in names if "checkpoints" in m], names


@pytest.mark.parametrize("variant", VARIANTS, ids=_ids)
def test_qk_and_ov_are_factored_weight_products(variant):
    from transformer_lens.FactoredMatrix import FactoredMatrix

    model = make_model(**variant)
    c = model.cfg
    QK, OV = model.QK, model.OV
    assert isinstance(QK, FactoredMatrix) and isinstance(OV, FactoredMatrix)
    assert QK.shape == OV.shape == (c.n_layers, c.n_heads, c.d_model, c.d_model)
    for layer, block in enumerate(model.blocks):
        a = block.attn
        for h in range(c.n_heads):
            torch.testing.assert_close(QK.AB[layer, h], a.W_Q[h] @ a.W_K[h].T)
            torch.testing.assert_close(OV.AB[layer, h], a.W_V[h] @ a.W_O[h])


@pytest.mark.parametrize("variant", VARIANTS, ids=_ids)
def test_qk_and_ov_act_where_their_docstrings_say(variant, tokens):
    """No-Norm: QK gives the scores and OV the per-head outputs exactly. Pre-Norm: the same on ln1's
    output with its gains. QK/QKV-Norm: QK is the form before the per-head norms (hook_q · hook_k)."""
    model = make_model(use_attn_result=True, **variant)
    cfg = model.cfg
    _, cache = model.run_with_cache(tokens)
    n = tokens.shape[1]
    causal = torch.tril(torch.ones(n, n, dtype=torch.bool))
    for layer, block in enumerate(model.blocks):
        x = cache[f"blocks.{layer}.hook_resid_pre"]
        if cfg.attn_norm == "pre":
            w = block.ln1.w
            gq, gk, gv = (w[0], w[1], w[2]) if w.ndim == 2 else (w, w, w)
            xn = _norm(x, cfg.norm_kind, cfg.eps)
            xq, xk, xv = xn * gq, xn * gk, xn * gv
        else:
            xq = xk = xv = x
        for h in range(cfg.n_heads):
            form = xq @ model.QK.AB[layer, h] @ xk.transpose(-1, -2)
            if cfg.attn_norm in ("qk", "qkv"):
                q, k = cache[f"blocks.{layer}.attn.hook_q"][:, :, h], cache[f"blocks.{layer}.attn.hook_k"][:, :, h]
                torch.testing.assert_close(form, q @ k.transpose(-1, -2), atol=1e-4, rtol=1e-4)
                continue
            scores = cache[f"blocks.{layer}.attn.hook_attn_scores"][:, h]
            torch.testing.assert_close(scores[:, causal], (form / cfg.attn_scale)[:, causal], atol=1e-4, rtol=1e-4)
            result = cache[f"blocks.{layer}.attn.hook_pattern"][:, h] @ xv @ model.OV.AB[layer, h]
            torch.testing.assert_close(cache[f"blocks.{layer}.attn.hook_result"][:, :, h], result, atol=1e-5, rtol=1e-4)


def test_to_single_token():
    model = make_model()
    for i, ch in enumerate("0123456789+-=N[]*"):
        assert model.to_single_token(ch) == i
    assert model.to_tokens("[12+N7=")[0].tolist() == [model.to_single_token(ch) for ch in "[12+N7="]
    assert model.to_str_tokens(torch.tensor([model.to_single_token("N")])) == ["N"]
    for bad in ["12", "", "x", " ", 3, None]:
        with pytest.raises(ProblemStringError, match="not a single token"):
            model.to_single_token(bad)


def _manual_answer_ce(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Cross-entropy at each position that predicts an answer token (after '=', next token not '*'), 0 elsewhere."""
    out = torch.zeros(tokens.shape, dtype=torch.float64)
    logp = logits.double().log_softmax(-1)
    for b, row in enumerate(tokens.tolist()):
        text = "".join("0123456789+-=N[]*"[i] for i in row)
        eq = text.index("=")
        for p in range(eq, len(row) - 1):
            if text[p + 1] != "*":
                out[b, p] = -logp[b, p, row[p + 1]]
    return out


@pytest.mark.parametrize("attn_norm", ["pre", "qkv"])
def test_loss_and_loss_per_token_match_manual_cross_entropy(attn_norm, tokens):
    model = make_model(attn_norm=attn_norm)
    logits = model(tokens)
    manual = _manual_answer_ce(logits.detach(), tokens)
    per_token = model(tokens, return_type="loss", loss_per_token=True)
    assert per_token.shape == tokens.shape
    torch.testing.assert_close(per_token.detach().double(), manual, atol=1e-5, rtol=1e-5)
    assert (per_token[manual == 0] == 0).all()  # zeros exactly where nothing is scored
    loss = model(tokens, return_type="loss")
    torch.testing.assert_close(float(loss.detach()), float(manual.sum() / (manual != 0).sum()), atol=1e-5, rtol=1e-5)
    both_logits, both_loss = model(tokens, return_type="both")
    torch.testing.assert_close(both_logits, logits)
    torch.testing.assert_close(both_loss, loss)


def test_direct_logit_attribution_on_the_mlp_head_is_a_typed_refusal(tokens):
    model = make_model(attn_norm="pre")
    _, cache = model.run_with_cache(tokens)
    stack = cache.decompose_resid(layer=-1)
    with pytest.raises(ConfigError, match="activation patching") as e:
        cache.logit_attrs(stack, tokens=3)
    assert not isinstance(e.value, AttributeError)
    with pytest.raises(ConfigError, match="head='unembed'"):
        model.tokens_to_residual_directions(3)
    with pytest.raises(ConfigError, match="unembedding"):
        hasattr(model, "W_U")  # a ValueError, so hasattr does not hide it


@pytest.mark.parametrize("attn_norm", ["pre", "qkv"])
def test_logit_attrs_on_the_unembed_head_add_up_to_the_logits(attn_norm, tokens):
    """Sum over the full decomposition = logit - b_U - b_ln·W_U (TL's convention, biases folded out)."""
    model = make_model(attn_norm=attn_norm, head="unembed")
    logits, cache = model.run_with_cache(tokens)
    stack, labels = cache.decompose_resid(layer=-1, return_labels=True)
    assert len(labels) == 2 + 2 * model.cfg.n_layers
    torch.testing.assert_close(stack.sum(0), cache[f"blocks.{model.cfg.n_layers - 1}.hook_resid_post"], atol=1e-5, rtol=1e-5)
    W_U, b_U, b_ln = model.head.W_U, model.head.b_U, model.ln_final.b
    for tok, wrong in [(3, 7), ("N", "]")]:
        t, w = (model.to_single_token(x) if isinstance(x, str) else x for x in (tok, wrong))
        attrs = cache.logit_attrs(stack, tokens=tok)
        assert attrs.shape == stack.shape[:-1]
        expected = logits[..., t] - b_U[t] - b_ln @ W_U[:, t]
        torch.testing.assert_close(attrs.sum(0), expected.detach(), atol=1e-4, rtol=1e-4)
        diff = cache.logit_attrs(stack, tokens=tok, incorrect_tokens=wrong).sum(0)
        expected_diff = (logits[..., t] - logits[..., w]) - (b_U[t] - b_U[w]) - b_ln @ (W_U[:, t] - W_U[:, w])
        torch.testing.assert_close(diff, expected_diff.detach(), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("variant", VARIANTS, ids=_ids)
def test_apply_ln_to_stack_uses_each_norm_as_the_model_does(variant, tokens):
    model = make_model(**variant)
    cfg = model.cfg
    _, cache = model.run_with_cache(tokens)
    last = f"blocks.{cfg.n_layers - 1}.hook_resid_post"
    x = cache[last][None]
    # ln_final and ln2 are LayerNorms in every variant (gain and bias excluded, as in TL)
    torch.testing.assert_close(cache.apply_ln_to_stack(x, layer=-1)[0], _norm(cache[last], "ln", cfg.eps), atol=1e-5, rtol=1e-4)
    mid = cache["blocks.1.hook_resid_mid"]
    torch.testing.assert_close(cache.apply_ln_to_stack(mid[None], layer=1, mlp_input=True)[0], _norm(mid, "ln", cfg.eps), atol=1e-5, rtol=1e-4)
    # the logit lens reproduces the real ln_final output
    accum = cache.accumulated_resid(layer=-1, apply_ln=True)
    torch.testing.assert_close(accum[-1], cache["ln_final.hook_normalized"], atol=1e-5, rtol=1e-4)
    # ln1 exists only on Pre-Norm models; elsewhere the attention reads the raw residual
    pre = cache["blocks.1.hook_resid_pre"]
    want = _norm(pre, cfg.norm_kind, cfg.eps) if cfg.attn_norm == "pre" else pre
    torch.testing.assert_close(cache.apply_ln_to_stack(pre[None], layer=1)[0], want, atol=1e-5, rtol=1e-4)


# ----------------------------------------------------------------------------- the norms' scale hooks


def _norm_reference(x: torch.Tensor, kind: str, eps: float, w: torch.Tensor, b, scale_factor: float = 1.0):
    """The norm by its formula in float64: (x - mean) / (sqrt(var + eps) * factor) * w + b (RMS: no mean)."""
    x = x.double()
    if kind == "ln":
        x = x - x.mean(-1, keepdim=True)
    s = (x.pow(2).mean(-1, keepdim=True) + eps).sqrt()
    y = x / (s * scale_factor) * w.double()
    return (y if b is None else y + b.double()), s


@pytest.mark.parametrize("kind", ["ln", "rms"])
@pytest.mark.parametrize("bias", [False, True])
def test_norm_fused_unless_a_hook_changes_the_scale(kind, bias):
    """Unhooked, a Norm is one fused kernel; a hook that only reads ``hook_scale`` leaves the output
    bit-identical; one that changes it (a new tensor or in place) takes effect; a backward hook on it
    gets the gradient of the formula with respect to the divisor."""
    from interp_norm.core.components import Norm

    g = torch.Generator().manual_seed(1)
    norm = Norm(16, kind, 1e-5, bias=bias)
    with torch.no_grad():
        norm.w.copy_(torch.randn(16, generator=g))
        if bias:
            norm.b.copy_(torch.randn(16, generator=g))
    x = torch.randn(3, 5, 16, generator=g) * 3 + 1
    ref, s = _norm_reference(x, kind, 1e-5, norm.w.detach(), None if norm.b is None else norm.b.detach())
    plain = norm(x)
    torch.testing.assert_close(plain.double(), ref, atol=1e-5, rtol=1e-5)

    seen = {}

    def read(module, inputs, out) -> None:
        seen["s"] = out.detach().clone()

    h = norm.hook_scale.register_forward_hook(read)
    assert torch.equal(norm(x), plain)  # read only: the same arithmetic
    h.remove()
    torch.testing.assert_close(seen["s"].double(), s, atol=1e-6, rtol=1e-6)

    doubled, _ = _norm_reference(x, kind, 1e-5, norm.w.detach(), None if norm.b is None else norm.b.detach(), 2.0)
    for edit in (lambda m, i, out: out * 2, lambda m, i, out: out.mul_(2)):
        h = norm.hook_scale.register_forward_hook(edit)
        torch.testing.assert_close(norm(x).double(), doubled, atol=1e-5, rtol=1e-5)
        h.remove()

    grads = {}

    def read_grad(grad, hook) -> None:
        grads["g"] = grad.detach().clone()

    norm.hook_scale.add_hook(read_grad, dir="bwd")
    r = torch.randn(3, 5, 16, generator=g)
    (norm(x.clone().requires_grad_()) * r).sum().backward()  # in a model the residual carries a gradient
    norm.hook_scale.remove_hooks(dir="bwd")
    s64 = s.clone().requires_grad_()
    xc = x.double() - x.double().mean(-1, keepdim=True) if kind == "ln" else x.double()
    (gs,) = torch.autograd.grad((xc / s64 * norm.w.detach().double() * r.double()).sum(), s64)
    torch.testing.assert_close(grads["g"].double(), gs, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("attn_norm", ["qk", "qkv"])
def test_head_norm_scale_hooks_read_or_change(attn_norm, tokens):
    """The per-head norms: caching ``hook_q_scale`` leaves the logits bit-identical; patching it with
    the doubled scale gives the logits of q halved before the gain (the norm's formula)."""
    model = make_model(attn_norm=attn_norm, norm_kind="ln")
    clean = model(tokens)
    _, cache = model.run_with_cache(tokens, names_filter=lambda n: n.endswith("hook_q_scale"))
    assert torch.equal(model.run_with_hooks(tokens, fwd_hooks=[("blocks.0.attn.hook_q_scale", lambda a, hook: None)]), clean)
    doubled = model.run_with_hooks(tokens, fwd_hooks=[("blocks.0.attn.hook_q_scale", lambda a, hook: a * 2)])
    attn = model.blocks[0].attn

    def halve_normed_q(act, hook):  # q_normed = (q - mean) / scale * w: doubling the scale halves it
        return act / 2

    ref = model.run_with_hooks(tokens, fwd_hooks=[("blocks.0.attn.hook_q_normed", halve_normed_q)])
    torch.testing.assert_close(doubled, ref, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(doubled, clean, atol=1e-4)
    assert attn.q_norm.w.shape[-1] == model.cfg.d_head
