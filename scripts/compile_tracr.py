"""Compile tracr programs once and ship their weights and ground-truth circuits, so nobody needs JAX.

Run in a separate virtual environment (tracr needs JAX; the project's does not have it)::

    python3 -m venv /work/tracr-venv && /work/tracr-venv/bin/pip install tracr-pypi jax jaxlib numpy
    /work/tracr-venv/bin/python scripts/compile_tracr.py [--out data/ground_truth/tracr]

For each program it writes ``<name>.npz`` (the raw tracr parameters, test inputs with the RASP
interpreter's outputs, and clean/corrupted pairs with their outputs) and ``<name>.json`` (the
model config, residual labels, encodings and the ground truth). ``interp_norm.circuits.benchmark.tracr_suite``
turns the parameters into a TransformerLens 4 ``TransformerBridge`` with TransformerLens's own
``transformer_lens.utilities.tracr`` converter.

Ground truth comes from the compiler, not from any discovery method: tracr gives every RASP
value (SOp) its own residual subspace, labelled ``<sop>:<value>``. A head or MLP is a circuit
node when its weights are not all zero; it *writes* the labels its output matrix touches and
*reads* the labels its query/key/value (or first MLP) matrix touches. An edge u -> r exists when
u writes a label r reads (the embedding writes ``tokens``, ``indices`` and ``one``; the logits
read the program's output labels) -- exactly the RASP graph's dependencies, routed through the
compiled layers. ``reads`` is ``"token"`` when a shared label belongs to an SOp whose value
depends on the input tokens at a fixed length (from the RASP expression: ``tokens`` does,
``indices`` and constants do not, a ``Select`` with TRUE/FALSE comparison does not, everything
else does when an input does) and, for a head's q/k/v, that input can change the head's output
(not the queries/keys of a TRUE/FALSE selector, not a selector-width head's value); else
``"fixed"``. Nodes are marked the same way by what they write.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

import numpy as np
from tracr.compiler import compiling, lib, nodes, rasp_to_graph
from tracr.rasp import rasp

BOS = "BOS"
SW_SUFFIX = "_selector_width_attn_output"


def double_hist() -> rasp.SOp:
    hist = lib.make_hist()
    return rasp.SelectorWidth(rasp.Select(hist, hist, rasp.Comparison.EQ)).named("double_hist")


PROGRAMS = {
    # name: (program, vocab, max_seq_len, unique tokens, description)
    "reverse": (lambda: lib.make_reverse(rasp.tokens), [0, 1, 2, 3, 4], 5, False, "reverses the input"),
    "sort": (lambda: lib.make_sort_unique(rasp.tokens, rasp.tokens), [0, 1, 2, 3, 4, 5], 5, True,
             "sorts distinct tokens ascending"),
    "histogram": (lib.make_hist, [0, 1, 2, 3], 5, False, "how often each position's token occurs"),
    "double_histogram": (double_hist, [0, 1, 2, 3], 5, False,
                         "how many positions have the same token count as this one"),
    "frac_prevs": (lambda: lib.make_frac_prevs(rasp.tokens == 1), [0, 1, 2], 5, False,
                   "fraction of tokens up to this position equal to 1 (numerical output)"),
}


def token_dependent(expr) -> bool:
    """Whether an SOp/selector's value can change with the token values at a fixed length."""
    if expr.label == "tokens":
        return True
    if expr.label in ("indices", "length"):
        return False
    if isinstance(expr, rasp.Select) and expr.predicate in (rasp.Comparison.TRUE, rasp.Comparison.FALSE):
        return False
    return any(token_dependent(c) for c in expr.children)


def label_dependent(label: str, graph) -> bool:
    sop, _, value = label.partition(":")
    if sop == "tokens":
        return value not in (BOS, "compiler_pad")
    if sop in ("indices", "one"):
        return False
    sop = sop[: -len(SW_SUFFIX)] if sop.endswith(SW_SUFFIX) else sop
    if sop not in graph.nodes:
        raise KeyError(f"residual label {label!r} matches no RASP expression")
    return token_dependent(graph.nodes[sop][nodes.EXPR])


def sop_of(label: str, graph):
    sop = label.partition(":")[0]
    sop = sop[: -len(SW_SUFFIX)] if sop.endswith(SW_SUFFIX) else sop
    return graph.nodes[sop][nodes.EXPR] if sop in graph.nodes else None


def input_matters(head_expr, which: str) -> bool:
    """Whether a head's q / k / v input can change its output at all: a Select with a TRUE/FALSE
    comparison ignores its queries and keys; a SelectorWidth's value reads only BOS."""
    sel = getattr(head_expr, "selector", None)
    if which == "v":
        return isinstance(head_expr, rasp.Aggregate) and token_dependent(head_expr.sop)
    if isinstance(sel, rasp.Select):
        if sel.predicate in (rasp.Comparison.TRUE, rasp.Comparison.FALSE):
            return False
        return token_dependent(sel.queries if which == "q" else sel.keys)
    return sel is None or token_dependent(sel)


def nonzero_rows(w: np.ndarray, tol: float = 1e-9) -> np.ndarray:
    return np.abs(w).max(axis=1) > tol


def ground_truth(model, program) -> dict:
    """Nodes and edges of the compiled model from its weights' read/write labels."""
    labels = list(model.residual_labels)
    graph = rasp_to_graph.extract_rasp_graph(program).graph
    cfg = model.model_config
    H, ks = cfg.num_heads, cfg.key_size
    P = {k: {kk: np.asarray(v) for kk, v in d.items()} for k, d in model.params.items()}
    lab = lambda mask: [labels[i] for i in np.nonzero(mask)[0]]  # noqa: E731
    writes = {"embed": lab(nonzero_rows(P["token_embed"]["embeddings"].T) | nonzero_rows(P["pos_embed"]["embeddings"].T))}
    reads: dict = {}
    order = ["embed"]
    for l in range(cfg.num_layers):
        a = f"transformer/layer_{l}/attn"
        for h in range(H):
            sl = slice(h * ks, (h + 1) * ks)
            out = lab(nonzero_rows(P[f"{a}/linear"]["w"][sl].T))
            if out:
                node = f"a{l}.h{h}"
                writes[node] = out
                order.append(node)
                for j, part in zip("qkv", ("query", "key", "value")):
                    reads[f"{node}.{j}"] = lab(nonzero_rows(P[f"{a}/{part}"]["w"][:, sl]))
        m = f"transformer/layer_{l}/mlp"
        out = lab(nonzero_rows(P[f"{m}/linear_2"]["w"].T))
        if out:
            writes[f"m{l}"] = out
            order.append(f"m{l}")
            reads[f"m{l}"] = lab(nonzero_rows(P[f"{m}/linear_1"]["w"]))
    out_label = [l for l in labels if l.split(":")[0] == program.label]
    reads["logits"] = out_label
    position = {n: i for i, n in enumerate(order)}
    edges = []
    for r, rd in reads.items():
        rnode = r.rsplit(".", 1)[0] if r.count(".") == 2 else r
        for u in order:
            if u == rnode or (rnode != "logits" and position[u] >= position[rnode]):
                continue
            if rnode != "logits" and u.startswith("a") and rnode.startswith("a") and u.split(".")[0] == rnode.split(".")[0]:
                continue  # heads of one layer run in parallel
            via = sorted(set(writes[u]) & set(rd))
            if via:
                dep = any(label_dependent(x, graph) for x in via)
                if r.count(".") == 2:  # into a head's q/k/v: does that input matter for what the head computes?
                    dep = dep and input_matters(sop_of(writes[rnode][0], graph), r[-1])
                edges.append(dict(sender=u, receiver=r, reads="token" if dep else "fixed", via=via))
    node_rows = [dict(node=n, reads="token" if any(label_dependent(x, graph) for x in writes[n]) else "fixed",
                      writes=writes[n]) for n in order[1:]]
    return dict(nodes=node_rows, edges=edges, output_labels=out_label)


def encode(model, seq: list) -> list[int]:
    return [model.input_encoder.encoding_map[t] for t in [BOS] + seq]


def sample_input(rng: random.Random, vocab: list, n: int, unique: bool) -> list:
    return rng.sample(vocab, n) if unique else [rng.choice(vocab) for _ in range(n)]


def compile_one(name: str, out: Path, n_inputs: int = 300, n_pairs: int = 64, seed: int = 0) -> dict:
    make, vocab, max_len, unique, desc = PROGRAMS[name]
    program = make()
    model = compiling.compile_rasp_to_model(program, vocab=set(vocab), max_seq_len=max_len, compiler_bos=BOS)
    numerical = not hasattr(model.output_encoder, "encoding_map") or model.output_encoder.encoding_map is None
    out_map = None if numerical else {str(k): int(v) for k, v in model.output_encoder.encoding_map.items()}

    def target(seq: list) -> list:
        ys = rasp.evaluate(program, seq)
        if numerical:
            return [float("nan")] + [float(y) for y in ys]
        return [-1] + [model.output_encoder.encoding_map[y] for y in ys]

    rng = random.Random(seed)
    inputs = [sample_input(rng, vocab, max_len, unique) for _ in range(n_inputs)]
    ref = [target(s) for s in inputs]
    compiled_ok = 0
    for s, _y in zip(inputs, ref):
        dec = model.apply([BOS] + s).decoded[1:]
        want = rasp.evaluate(program, s)
        compiled_ok += all(abs(a - b) < 1e-3 for a, b in zip(dec, want)) if numerical else dec == want
    clean, corr, cy, xy = [], [], [], []
    while len(clean) < n_pairs:
        s = sample_input(rng, vocab, max_len, unique)
        x = list(s)
        i = rng.randrange(max_len)
        choices = [v for v in vocab if v != s[i] and (not unique or v not in s)]
        x[i] = rng.choice(choices)
        ys, yx = target(s), target(x)
        if any(a != b for a, b in zip(ys[1:], yx[1:])):
            clean.append(encode(model, s))
            corr.append(encode(model, x))
            cy.append(ys)
            xy.append(yx)
    arrays = {f"param|{k}|{kk}": np.asarray(v, dtype=np.float32) for k, d in model.params.items() for kk, v in d.items()}
    arrays.update(inputs=np.array([encode(model, s) for s in inputs]), outputs=np.array(ref, dtype=np.float64),
                  pairs_clean=np.array(clean), pairs_corrupted=np.array(corr),
                  pairs_clean_out=np.array(cy, dtype=np.float64), pairs_corrupted_out=np.array(xy, dtype=np.float64))
    np.savez_compressed(out / f"{name}.npz", **arrays)
    cfg = model.model_config
    spec = dict(
        name=name, program=desc, vocab=vocab, max_seq_len=max_len, unique_tokens=unique, bos=BOS,
        output="numerical" if numerical else "categorical",
        model_config=dict(num_layers=cfg.num_layers, num_heads=cfg.num_heads, key_size=cfg.key_size,
                          mlp_hidden_size=cfg.mlp_hidden_size, layer_norm=bool(cfg.layer_norm), causal=bool(cfg.causal)),
        residual_labels=list(model.residual_labels),
        input_encoding={str(k): int(v) for k, v in model.input_encoder.encoding_map.items()},
        output_encoding=out_map, compiled_matches_rasp=f"{compiled_ok}/{n_inputs}",
        **ground_truth(model, program),
    )
    (out / f"{name}.json").write_text(json.dumps(spec, indent=1))
    return spec


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="data/ground_truth/tracr")
    ap.add_argument("--programs", nargs="+", default=list(PROGRAMS))
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for name in args.programs:
        spec = compile_one(name, out)
        print(f"{name}: {spec['model_config']['num_layers']} layers x {spec['model_config']['num_heads']} heads, "
              f"{len(spec['nodes'])} nodes, {len(spec['edges'])} edges, compiled = RASP on {spec['compiled_matches_rasp']}")


if __name__ == "__main__":
    main()
