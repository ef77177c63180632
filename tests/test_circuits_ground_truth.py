"""A model whose circuit is known by construction: one head copies the previous token into the logits.

Weights are set by hand (no norms in attention, learned one-hot positions, plain unembedding):
head a0.h0 attends from position i to i-1 and writes that token into a subspace W_U reads; every
other head has W_O = 0 and no preference, the MLPs are zero. Discovery must return exactly a0.h0
(and the edges embed -> a0.h0.v -> logits) and nothing else above threshold.
"""

from __future__ import annotations

import math

import pytest
import torch

from interp_norm import HookedNormTransformer, ModelConfig
from interp_norm.circuits import (
    Circuit,
    LogitDiff,
    PatchingPairs,
    activation_patch,
    attention_map,
    attribution_patch,
    edge_attribution,
    faithfulness,
)

V, N = 17, 24  # vocabulary, context
TOK, POS, OUT = 0, V, V + N  # offsets of the three subspaces of the residual stream


def copy_previous_token_model(n_layers: int = 2) -> HookedNormTransformer:
    cfg = ModelConfig(
        d_model=2 * V + N, d_head=N, n_heads=2, n_layers=n_layers, n_ctx=N, d_mlp=4, attn_norm="none",
        pos_embed="learned", head="unembed", seed=0,
    )
    model = HookedNormTransformer(cfg).eval()
    c = 30 * math.sqrt(cfg.d_head)  # score 30 on the previous position: attention ~ 1 - 1e-11
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
        model.W_E[:, TOK:TOK + V] = torch.eye(V)
        model.W_pos[:, POS:POS + N] = torch.eye(N)
        a = model.blocks[0].attn
        for i in range(1, N):
            a.W_Q[0, POS + i, i - 1] = c  # query at i looks for key i-1
        for j in range(N):
            a.W_K[0, POS + j, j] = 1.0
        for t in range(V):
            a.W_V[0, TOK + t, t] = 1.0
            a.W_O[0, t, OUT + t] = 1.0
            model.head.W_U[OUT + t, t] = 10.0
        for blk in model.blocks:  # LayerNorm gains back to 1 (zeroed above)
            blk.ln2.w.fill_(1.0)
        model.ln_final.w.fill_(1.0)
    return model


@pytest.fixture(scope="module")
def setup():
    model = copy_previous_token_model()
    g = torch.Generator().manual_seed(0)
    clean = torch.randint(0, V, (6, 12), generator=g)
    corr = clean.clone()
    clean[:, 6] = clean[:, 4]
    corr[:, 4] = (clean[:, 4] + 1 + torch.randint(0, V - 1, (6,), generator=g)) % V
    corr[:, 6] = corr[:, 4]
    mask = torch.zeros(12, dtype=torch.bool)
    mask[5] = True  # logits at 5 predict token 6 = the token at 4, which a0.h0 copies
    pairs = PatchingPairs(clean, corr, score_mask=mask)
    return model, pairs


def test_the_model_copies_the_previous_token(setup):
    model, pairs = setup
    pred = model(pairs.clean_tokens).argmax(-1)
    assert torch.equal(pred[:, 1:], pairs.clean_tokens[:, :-1])


def test_exact_patching_finds_exactly_the_copy_head(setup):
    model, pairs = setup
    metric = LogitDiff(pairs)
    z = activation_patch(model, pairs, None, metric, "z")
    eff = z.effect().abs()
    assert eff[0, 5, 0] > 5  # patching a0.h0 at the query restores the clean answer
    eff[0, 5, 0] = 0
    assert eff.max() < 1e-5  # and nothing else does anything
    v = activation_patch(model, pairs, None, metric, "v").effect().abs()
    assert v[0, 4, 0] > 5 and (v.sum() - v[0, 4, 0]) < 1e-4  # its value input at the copied position
    heads = Circuit.from_node_scores(activation_patch(model, pairs, None, metric, "z", by="all"), 2, 2, threshold=0.5)
    assert heads.components == {"a0.h0"}


def test_attribution_finds_exactly_the_copy_head_and_its_edges(setup):
    model, pairs = setup
    metric = LogitDiff(pairs)
    for steps in (1, 5):
        z = attribution_patch(model, pairs, metric, "z", ig_steps=steps).effect().abs()
        assert z[0, 5, 0] > 1
        z[0, 5, 0] = 0
        assert z.max() < 1e-5
        edges = edge_attribution(model, pairs, metric, ig_steps=steps)
        big = edges[edges.abs_score > 1e-3 * edges.abs_score.max()]
        assert set(zip(big.sender, big.receiver)) == {("embed", "a0.h0.v"), ("a0.h0", "logits")}
        circuit = Circuit.from_edge_scores(edges, 2, 2, threshold=1e-3 * edges.abs_score.max())
        assert circuit.components == {"a0.h0"} and len(circuit) == 2


def test_the_known_circuit_is_faithful_under_resampling(setup):
    model, pairs = setup
    circuit = Circuit(2, 2, frozenset({("embed", "a0.h0.v"), ("a0.h0", "logits")}))
    f = faithfulness(model, pairs, circuit).set_index("ablation")
    assert f.loc["resample", "faithfulness"] == pytest.approx(1.0, abs=1e-4)
    # zero ablation also removes the head's query/key inputs (positions), so its attention breaks
    assert f.loc["zero", "faithfulness"] < 0.9


def test_attention_map_sees_the_previous_token_head():
    """Each answer query attends to the token before it; worked out by hand for three problems."""
    model = copy_previous_token_model()
    df = attention_map(model, ["[12+7=", "[3-45=", "[N8+6="])  # answers 19], N42], N2]
    assert set(zip(df["layer"], df["head"])) == {(0, 0)}  # the only sparse head
    assert (df.mean_strength > 0.99).all()
    got = {(q, k): (c, nq) for q, k, c, nq in zip(df["query"], df["key"], df["count"], df["n_queries"])}
    assert got == {
        ("ans.p1", "t1.p0"): (1, 2), ("ans.p1", "="): (1, 2),          # '=' -> '1' of 19; 'N' -> '4' of N42
        ("ans.sign", "t1.p0"): (2, 2),                                 # '=' predicts the N of N42 and N2
        ("ans.p0", "="): (2, 3), ("ans.p0", "ans.sign"): (1, 3),
        ("eos", "ans.p1"): (2, 3), ("eos", "ans.sign"): (1, 3),          # before ']': the 1 of 19, the 4 of N42, the N of N2
    }
