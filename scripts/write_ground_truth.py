"""Write the ground-truth suite's readable statement: data/ground_truth/<model>.json and README.md.

The JSON files are the construction's circuit (tests check they equal the code's); the README
has one table describing the models and one with the benchmark measured by
``interp_norm.circuits.benchmark.suite.run_benchmark()`` (so it is regenerated, never hand-edited).

    PYTHONPATH=. python scripts/write_ground_truth.py [--out data/ground_truth] [--no-benchmark]
"""

from __future__ import annotations

import argparse

import pandas as pd

from interp_norm.circuits.benchmark.ground_truth import SUITE
from interp_norm.training.io import ensure_writable_dir, write_json, write_text_atomic

HEADER = """# Ground-truth circuit suite

Hand-weighted 2-layer, 2-head models in our own architecture (`interp_norm.circuits.benchmark.ground_truth`);
the circuit of each comes from its construction, stated in `<model>.json` (`nodes`, and `edges`
with what the receiver reads: `token` = depends on the tokens, `fixed` = only positions or
constants). Clean/corrupted pairs change tokens and keep positions, so `fixed` edges carry the
same value in both runs: no resample-ablation method can see them, and the benchmark leaves them
out of the edge evaluation. Every other head and MLP is a distractor that does real work (copies
tokens, or maps the circuit's output through a random matrix into a block nothing reads) and can
reach the logits only through the final LayerNorm's scale. Regenerate with
`PYTHONPATH=. python scripts/write_ground_truth.py`; `tests/test_circuits_gt_suite.py` checks the
files equal the code, that each model computes its function on 300 random inputs, and that
exact patching ranks every circuit node first (AUROC 1).

The `tracr:` models are RASP programs compiled by tracr (`scripts/compile_tracr.py`, run once in a
separate environment with JAX) and loaded as TransformerLens 4 `TransformerBridge`s by
`interp_norm.circuits.benchmark.tracr_suite`; their circuit is the compiler's (which labelled residual
subspaces each head/MLP reads and writes, see `tracr/<name>.json`). Nodes marked `fixed` compute
something independent of the tokens at a fixed length (e.g. the input length in `reverse`) and are
left out like fixed edges. Their metric is the program-output difference; AtP* needs our own
attention steps and is not run on them (NaN). Node AUROC is NaN where every component of the
model is in the circuit (no negatives).

"""


def _md(df: pd.DataFrame) -> str:
    cols = list(df.columns)
    fmt = lambda v: f"{v:.2f}" if isinstance(v, float) else str(v)  # noqa: E731
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(fmt(v) for v in row) + " |" for row in df.itertuples(index=False)]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="data/ground_truth")
    ap.add_argument("--no-benchmark", action="store_true")
    args = ap.parse_args()
    out = ensure_writable_dir(args.out)
    models = []
    for name, g in SUITE.items():
        write_json(out / f"{name}.json", g.spec())
        models.append(dict(model=name, function=g.function, nodes=", ".join(g.nodes),
                           token_edges=", ".join(f"{u}->{r}" for u, r, k in g.edges if k == "token"),
                           fixed_edges=", ".join(f"{u}->{r}" for u, r, k in g.edges if k == "fixed") or "-",
                           pairs=g.pairs))
    from interp_norm.circuits.benchmark.tracr_suite import TRACR_SUITE

    for name, g in TRACR_SUITE.items():
        spec = g.spec
        models.append(dict(model=f"tracr:{name}", function=spec["program"],
                           nodes=", ".join(g.nodes) + ("; fixed: " + ", ".join(sorted(g.fixed_nodes)) if g.fixed_nodes else ""),
                           token_edges=", ".join(f"{u}->{r}" for u, r, k in g.edges if k == "token"),
                           fixed_edges=", ".join(f"{u}->{r}" for u, r, k in g.edges if k == "fixed") or "-",
                           pairs="one input token changes (tracr/<name>.npz)"))
    text = HEADER + "## Models\n\n" + _md(pd.DataFrame(models))
    if not args.no_benchmark:
        from interp_norm.circuits.benchmark.suite import run_benchmark

        df = run_benchmark()
        table = df.pivot_table(index=["model", "method"], columns="level", values=["precision", "recall", "auroc"], sort=False)
        table.columns = [f"{lvl} {m}" for m, lvl in table.columns]
        table = table[[f"{lvl} {m}" for lvl in ("node", "edge") for m in ("precision", "recall", "auroc")]].reset_index()
        text += ("\n## Benchmark (measured: `run_benchmark()`, 32 pairs per model, seed 0)\n\n"
                 "Selection threshold for precision/recall: |score| >= 5 % of the clean-corrupted metric gap. "
                 "AUROC over all heads and MLPs (nodes) or all non-fixed edges (edges).\n\n" + _md(table))
    write_text_atomic(out / "README.md", text, durable=False)
    print(f"wrote {len(SUITE)} model files and README.md to {out}")


if __name__ == "__main__":
    main()
