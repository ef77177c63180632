"""Models with known circuits, weighted by hand in our own architecture, for scoring discovery methods.

Every model is a 2-layer, 2-head :class:`~interp_norm.core.model.HookedNormTransformer` (no attention
norm, learned positions, plain unembedding) whose weights are written below, so its circuit is
known from the construction -- never from running a discovery method. The residual stream is a
direct sum of named blocks: ``TOK`` (token one-hot), ``POS`` (position one-hot), ``OUT`` (what the
unembedding reads, ×10), ``AUX`` (an intermediate a later component reads), ``JUNK`` (where
distractors write) and ``CONST`` (3 in every position, so the final LayerNorm is nearly linear).
Circuit heads attend with score 30 (saturated softmax, as trained heads often are).

Components outside the circuit are *distractors* that do real work: heads that copy tokens into
``JUNK`` and a "reader" head that maps ``OUT``/``AUX`` through a random matrix into ``JUNK``, and
random ReLU MLPs reading ``TOK`` and ``JUNK``. They cannot reach the logits except through the
final LayerNorm's scale, so their effect is zero or second order.

Ground truth per model (also in ``data/ground_truth/<name>.json``): ``nodes`` (heads/MLPs of the
circuit) and ``edges`` with what the receiver *reads* from the sender: ``"token"`` (depends on
the tokens) or ``"fixed"`` (only positions or constants, e.g. a previous-token head's query and
key). Clean/corrupted pairs change tokens and keep positions, so fixed edges carry identical
values in both runs and no resample-ablation method can see them; the benchmark leaves them out
of the edge evaluation (neither positive nor negative).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import Tensor

from interp_norm.circuits import Circuit, LogitDiff, PatchingPairs
from interp_norm.core.hook_names import act_name
from interp_norm.core.nodes import EMBED, QKV, head_input
from interp_norm.core.model import HookedNormTransformer, ModelConfig

V, N, BOS = 17, 16, 16  # vocabulary, context, the start token every sequence begins with
TOK, POS, OUT, AUX, JUNK, CONST = 0, V, V + N, 2 * V + N, 3 * V + N, 4 * V + N
D_MODEL, D_HEAD, D_MLP = 4 * V + N + 1, V + 1 + N, 16
LENGTH = 12  # tokens per sample (the last one is the answer being predicted)
SCORE = 30.0  # attention score of a circuit head on its target: weight ~ 1 - 1e-12


def _blank(seed: int) -> HookedNormTransformer:
    cfg = ModelConfig(d_model=D_MODEL, d_head=D_HEAD, n_heads=2, n_layers=2, n_ctx=N, d_mlp=D_MLP, d_vocab=V,
                      attn_norm="none", pos_embed="learned", head="unembed", seed=seed)
    model = HookedNormTransformer(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
        model.W_E[:, TOK:TOK + V] = torch.eye(V)
        model.W_E[:, CONST] = 3.0
        model.W_pos[:, POS:POS + N] = torch.eye(N)
        for blk in model.blocks:
            blk.ln2.w.fill_(1.0)
        model.ln_final.w.fill_(1.0)
        model.head.W_U[OUT:OUT + V, :] = 10 * torch.eye(V)
    return model


def _c(model) -> float:
    return SCORE * model.cfg.attn_scale


def _attend(model, layer: int, head: int, rule: str) -> None:
    """Positional attention: ``prev`` (i -> i-1), ``self`` (i -> i) or ``first`` (i -> 0)."""
    a, c = model.blocks[layer].attn, _c(model)
    for i in range(N):
        j = {"prev": i - 1, "self": i, "first": 0}[rule]
        if j >= 0:
            a.W_Q[head, POS + i, j] = c
        a.W_K[head, POS + i, i] = 1.0


def _copy(model, layer: int, head: int, src: int, dst: int, mix: Tensor | None = None) -> None:
    """Value reads block ``src`` (V dims), output writes it to block ``dst`` (through ``mix``)."""
    a = model.blocks[layer].attn
    a.W_V[head, src:src + V, :V] = torch.eye(V)
    a.W_O[head, :V, dst:dst + V] = torch.eye(V) if mix is None else mix


def _distract(model, seed: int, heads: dict, mlps: tuple[int, ...]) -> None:
    """Distractor heads ``{(layer, head): (rule, src)}``; ``src="reader:OUT"`` maps that block
    through a random matrix into JUNK. Distractor MLPs read TOK and JUNK, write JUNK."""
    g = torch.Generator().manual_seed(seed)
    for (l, h), (rule, src) in heads.items():
        _attend(model, l, h, rule)
        if src.startswith("reader:"):
            _copy(model, l, h, {"OUT": OUT, "AUX": AUX}[src[7:]], JUNK, 0.25 * torch.randn(V, V, generator=g))
        else:
            _copy(model, l, h, TOK, JUNK)
    for l in mlps:
        m = model.blocks[l].mlp
        m.W_in[TOK:TOK + V] = 0.5 * torch.randn(V, D_MLP, generator=g)
        m.W_in[JUNK:JUNK + V] = 0.5 * torch.randn(V, D_MLP, generator=g)
        m.b_in.copy_(0.2 * torch.randn(D_MLP, generator=g))
        m.W_out[:, JUNK:JUNK + V] = 0.15 * torch.randn(D_MLP, V, generator=g)


# ----------------------------------------------------------------------------- the six constructions


def build_prev_token() -> HookedNormTransformer:
    model = _blank(1)
    with torch.no_grad():
        _attend(model, 0, 0, "prev")
        _copy(model, 0, 0, TOK, OUT)
        _distract(model, 1, {(0, 1): ("self", "TOK"), (1, 0): ("first", "TOK"), (1, 1): ("self", "reader:OUT")}, (0, 1))
    return model


def build_copy_first() -> HookedNormTransformer:
    """Predicts the first token after BOS: a0.h0 attends from every position to position 1."""
    model = _blank(2)
    with torch.no_grad():
        a, c = model.blocks[0].attn, _c(model)
        a.W_Q[0, CONST, 0] = c / 3.0  # every query (CONST = 3) looks for position 1
        a.W_K[0, POS + 1, 0] = 1.0
        _copy(model, 0, 0, TOK, OUT)
        _distract(model, 2, {(0, 1): ("prev", "TOK"), (1, 0): ("self", "TOK"), (1, 1): ("self", "reader:OUT")}, (0, 1))
    return model


def build_duplicate_token() -> HookedNormTransformer:
    """Predicts 1 if the current token occurred before (after BOS), else 0: a0.h0 attends to an
    earlier copy of the current token (score 30), else to BOS (score 15), never to itself."""
    model = _blank(3)
    with torch.no_grad():
        a, c = model.blocks[0].attn, _c(model)
        a.W_Q[0, TOK:TOK + V, :V] = c * torch.eye(V)  # same token: +30
        a.W_K[0, TOK:TOK + V, :V] = torch.eye(V)
        a.W_Q[0, CONST, V] = c / 2 / 3.0  # BOS position: +15
        a.W_K[0, POS + 0, V] = 1.0
        for i in range(N):  # own position: -60
            a.W_Q[0, POS + i, V + 1 + i] = -2 * c
            a.W_K[0, POS + i, V + 1 + i] = 1.0
        a.W_V[0, POS + 1:POS + N, 0] = 1.0  # an earlier token (not BOS) -> "1"
        a.W_V[0, POS + 0, 1] = 1.0  # BOS -> "0"
        a.W_O[0, 0, OUT + 1] = 1.0
        a.W_O[0, 1, OUT + 0] = 1.0
        _distract(model, 3, {(0, 1): ("prev", "TOK"), (1, 0): ("self", "TOK"), (1, 1): ("self", "reader:OUT")}, (0, 1))
    return model


def build_induction() -> HookedNormTransformer:
    """a0.h0 writes the previous token into AUX; a1.h0 attends from token t to the position whose
    previous token is t and copies the token there: [... A B ... A] -> B."""
    model = _blank(4)
    with torch.no_grad():
        _attend(model, 0, 0, "prev")
        _copy(model, 0, 0, TOK, AUX)
        a, c = model.blocks[1].attn, _c(model)
        a.W_Q[0, TOK:TOK + BOS, :BOS] = c * torch.eye(BOS)  # content tokens only (BOS never matches)
        a.W_K[0, AUX:AUX + BOS, :BOS] = torch.eye(BOS)
        _copy(model, 1, 0, TOK, OUT)
        _distract(model, 4, {(0, 1): ("self", "TOK"), (1, 1): ("self", "reader:AUX")}, (0, 1))
    return model


def lookup(t: int) -> int:
    """The table the lookup MLP applies to content tokens 0..15."""
    return (t + 3) % 16


def build_prev_token_lookup() -> HookedNormTransformer:
    """a0.h0 writes the previous token into AUX; MLP m0 maps it through :func:`lookup` into OUT
    (one ReLU unit per token, thresholded halfway between the normalised on/off values)."""
    model = _blank(5)
    with torch.no_grad():
        _attend(model, 0, 0, "prev")
        _copy(model, 0, 0, TOK, AUX)
        _distract(model, 5, {(0, 1): ("self", "TOK"), (1, 0): ("first", "TOK"), (1, 1): ("self", "reader:OUT")}, (1,))
        probe = torch.tensor([[BOS, 0, 1]])
        _, cache = model.run_with_cache(probe, names_filter=act_name("normalized", 0, "ln2"))
        x = cache[act_name("normalized", 0, "ln2")][0, 2]  # position 2: previous token 0 in AUX
        on, off = float(x[AUX + 0]), float(x[AUX + 1])
        m, k = model.blocks[0].mlp, 10.0
        for t in range(16):
            m.W_in[AUX + t, t] = k
            m.b_in[t] = -k * (on + off) / 2
            m.W_out[t, OUT + lookup(t)] = 1.0 / (k * (on - off) / 2)
    return model


def build_marker() -> HookedNormTransformer:
    """Predicts the position of the marker token 15: every query of a0.h0 looks for the marker's
    key (score 30) and copies its position index into OUT."""
    model = _blank(6)
    with torch.no_grad():
        a, c = model.blocks[0].attn, _c(model)
        a.W_Q[0, CONST, 0] = c / 3.0
        a.W_K[0, TOK + 15, 0] = 1.0
        a.W_V[0, POS:POS + N, :N] = torch.eye(N)
        a.W_O[0, :N, OUT:OUT + N] = torch.eye(N)
        _distract(model, 6, {(0, 1): ("prev", "TOK"), (1, 0): ("self", "TOK"), (1, 1): ("self", "reader:OUT")}, (0, 1))
    return model


# ----------------------------------------------------------------------------- what each computes


def ref_prev_token(seq: list[int]) -> list:
    return [None] + seq[:-1]


def ref_copy_first(seq: list[int]) -> list:
    return [None] + [seq[1]] * (len(seq) - 1)


def ref_duplicate_token(seq: list[int]) -> list:
    return [None] + [int(seq[i] in seq[1:i]) for i in range(1, len(seq))]


def ref_induction(seq: list[int]) -> list:
    out = []
    for i, t in enumerate(seq):
        nxt = {seq[j] for j in range(1, i + 1) if seq[j - 1] == t}
        out.append(nxt.pop() if len(nxt) == 1 and t != BOS else None)
    return out


def ref_prev_token_lookup(seq: list[int]) -> list:
    return [None, None] + [lookup(t) for t in seq[1:-1]]


def ref_marker(seq: list[int]) -> list:
    return [seq.index(15) if 15 in seq[: i + 1] and seq.count(15) == 1 else None for i in range(len(seq))]


# ----------------------------------------------------------------------------- inputs and pairs


def _seq(rng: random.Random, avoid: set, lo: int = 0) -> list[int]:
    pool = [t for t in range(lo, 16) if t not in avoid]
    return [BOS] + [rng.choice(pool) for _ in range(LENGTH - 1)]


def sample_inputs(name: str, n: int, seed: int = 0) -> Tensor:
    """``n`` random sequences on which the model's function is defined at many positions."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        if name == "duplicate_token":
            s = _seq(rng, set(), lo=2)
        elif name == "marker":
            s = _seq(rng, {15})
            s[rng.randrange(1, LENGTH)] = 15
        elif name == "induction":
            s = [BOS] + [rng.randrange(6) for _ in range(LENGTH - 1)]  # few types: many repeats
        else:
            s = _seq(rng, set())
        out.append(s)
    return torch.tensor(out)


def _pair_rows(name: str, rng: random.Random) -> tuple[list[int], list[int]]:
    """One clean and one corrupted sequence; position LENGTH-2 is scored (its next token is the answer)."""
    p = LENGTH - 2
    if name in ("prev_token", "prev_token_lookup", "copy_first"):
        src = p - 1 if name != "copy_first" else 1
        s = _seq(rng, set())
        t, u = rng.sample(range(16), 2)
        c, x = list(s), list(s)
        c[src], x[src] = t, u
        f = lookup if name == "prev_token_lookup" else (lambda v: v)
        c[p + 1], x[p + 1] = f(t), f(u)
        return c, x
    if name == "duplicate_token":
        d = rng.randrange(1, p)
        toks = rng.sample(range(2, 16), 3)
        s = _seq(rng, set(toks), lo=2)
        c, x = list(s), list(s)
        c[d] = c[p] = x[p] = toks[0]
        x[d] = toks[1]
        if rng.random() < 0.5:  # corrupt the query instead of the key
            x[d], x[p] = toks[0], toks[2]
        c[p + 1], x[p + 1] = 1, 0
        return c, x
    if name == "induction":
        A, B, C, D, B2 = rng.sample(range(16), 5)
        s = _seq(rng, {A, B, C, D, B2})
        a, cc = sorted(rng.sample(range(1, p - 1, 2), 2))
        c = list(s)
        c[a], c[a + 1], c[cc], c[cc + 1], c[p] = A, B, C, D, A
        x = list(c)
        kind = rng.randrange(3)
        if kind == 0:  # move the key: the earlier A and C swap
            x[a], x[cc] = C, A
            ans = D
        elif kind == 1:  # change the value after A
            x[a + 1] = ans = B2
        else:  # change the query
            x[p] = C
            ans = D
        c[p + 1], x[p + 1] = B, ans
        return c, x
    if name == "marker":
        s = _seq(rng, {15})
        i, j = rng.sample(range(1, p + 1), 2)
        c, x = list(s), list(s)
        c[i], x[j] = 15, 15
        c[p + 1], x[p + 1] = i, j
        return c, x
    raise KeyError(name)


def make_gt_pairs(name: str, n: int = 32, seed: int = 0) -> PatchingPairs:
    """Clean/corrupted pairs for model ``name``; position LENGTH-2 (predicting the answer) is scored."""
    rng = random.Random(seed)
    rows = [_pair_rows(name, rng) for _ in range(n)]
    mask = torch.zeros(LENGTH, dtype=torch.bool)
    mask[LENGTH - 2] = True
    return PatchingPairs(torch.tensor([c for c, _ in rows]), torch.tensor([x for _, x in rows]), score_mask=mask)


# ----------------------------------------------------------------------------- the suite


@dataclass(frozen=True)
class GroundTruth:
    """One suite model: how to build it, what it computes, and its circuit."""

    name: str
    build: Callable[[], HookedNormTransformer]
    reference: Callable[[list[int]], list]
    function: str
    pairs: str
    nodes: tuple[str, ...]
    edges: tuple[tuple[str, str, str], ...]  # (sender, receiver, reads: "token" | "fixed")
    distractors: dict = field(default_factory=dict)

    @property
    def token_edges(self) -> set[tuple[str, str]]:
        return {(u, r) for u, r, reads in self.edges if reads == "token"}

    @property
    def fixed_edges(self) -> set[tuple[str, str]]:
        return {(u, r) for u, r, reads in self.edges if reads == "fixed"}

    shape: tuple[int, int] = (2, 2)  # (n_layers, n_heads)
    fixed_nodes: frozenset = frozenset()  # every circuit node of these models writes token information

    def circuit(self) -> Circuit:
        return Circuit(*self.shape, frozenset((u, r) for u, r, _ in self.edges))

    def make_pairs(self, n: int = 32, seed: int = 0) -> PatchingPairs:
        return make_gt_pairs(self.name, n, seed)

    def metric(self, pairs: PatchingPairs) -> LogitDiff:
        return LogitDiff(pairs)

    def spec(self) -> dict:
        """The readable statement written to ``data/ground_truth/<name>.json``."""
        cfg = self.build().cfg.to_dict()
        return dict(name=self.name, function=self.function, pairs=self.pairs, nodes=list(self.nodes),
                    edges=[dict(sender=u, receiver=r, reads=k) for u, r, k in self.edges],
                    distractors=self.distractors, config=cfg,
                    layout=dict(TOK=TOK, POS=POS, OUT=OUT, AUX=AUX, JUNK=JUNK, CONST=CONST, d_model=D_MODEL))


def _prev_edges(layer: int = 0, h: int = 0) -> tuple:
    return tuple((EMBED, head_input(layer, h, j), "token" if j == "v" else "fixed") for j in QKV)


_D = dict(tok="copies the token into JUNK", reader="maps a block through a random matrix into JUNK",
          mlp="random ReLU MLP reading TOK and JUNK, writing JUNK")
SUITE: dict[str, GroundTruth] = {g.name: g for g in (
    GroundTruth("prev_token", build_prev_token, ref_prev_token, "predicts the previous token",
                "the token before the scored position changes", ("a0.h0",),
                _prev_edges() + (("a0.h0", "logits", "token"),),
                {"a0.h1": "self, " + _D["tok"], "a1.h0": "first, " + _D["tok"], "a1.h1": "self, OUT " + _D["reader"], "m0": _D["mlp"], "m1": _D["mlp"]}),
    GroundTruth("copy_first", build_copy_first, ref_copy_first, "predicts the first token after BOS",
                "the first token after BOS changes", ("a0.h0",),
                (("embed", "a0.h0.q", "fixed"), ("embed", "a0.h0.k", "fixed"), ("embed", "a0.h0.v", "token"), ("a0.h0", "logits", "token")),
                {"a0.h1": "prev, " + _D["tok"], "a1.h0": "self, " + _D["tok"], "a1.h1": "self, OUT " + _D["reader"], "m0": _D["mlp"], "m1": _D["mlp"]}),
    GroundTruth("duplicate_token", build_duplicate_token, ref_duplicate_token,
                "predicts 1 if the current token occurred earlier (after BOS), else 0",
                "the earlier copy (key) or the current token (query) changes; answer 1 -> 0", ("a0.h0",),
                (("embed", "a0.h0.q", "token"), ("embed", "a0.h0.k", "token"), ("embed", "a0.h0.v", "fixed"), ("a0.h0", "logits", "token")),
                {"a0.h1": "prev, " + _D["tok"], "a1.h0": "self, " + _D["tok"], "a1.h1": "self, OUT " + _D["reader"], "m0": _D["mlp"], "m1": _D["mlp"]}),
    GroundTruth("induction", build_induction, ref_induction, "[... A B ... A] predicts B (unique continuation)",
                "a third each: the earlier A moves (key), the B after it changes (value), the final A changes (query)",
                ("a0.h0", "a1.h0"),
                _prev_edges() + (("a0.h0", "a1.h0.k", "token"), ("embed", "a1.h0.q", "token"), ("embed", "a1.h0.v", "token"), ("a1.h0", "logits", "token")),
                {"a0.h1": "self, " + _D["tok"], "a1.h1": "self, AUX " + _D["reader"], "m0": _D["mlp"], "m1": _D["mlp"]}),
    GroundTruth("prev_token_lookup", build_prev_token_lookup, ref_prev_token_lookup,
                "predicts lookup(previous token) = (t + 3) mod 16, the table applied by MLP m0",
                "the token before the scored position changes", ("a0.h0", "m0"),
                _prev_edges() + (("a0.h0", "m0", "token"), ("m0", "logits", "token")),
                {"a0.h1": "self, " + _D["tok"], "a1.h0": "first, " + _D["tok"], "a1.h1": "self, OUT " + _D["reader"], "m1": _D["mlp"]}),
    GroundTruth("marker", build_marker, ref_marker, "predicts the position of the marker token 15",
                "the marker moves to another position", ("a0.h0",),
                (("embed", "a0.h0.q", "fixed"), ("embed", "a0.h0.k", "token"), ("embed", "a0.h0.v", "fixed"), ("a0.h0", "logits", "token")),
                {"a0.h1": "prev, " + _D["tok"], "a1.h0": "self, " + _D["tok"], "a1.h1": "self, OUT " + _D["reader"], "m0": _D["mlp"], "m1": _D["mlp"]}),
)}


__all__ = ["SUITE", "GroundTruth", "make_gt_pairs", "sample_inputs", "lookup", "V", "N", "BOS", "LENGTH"]
