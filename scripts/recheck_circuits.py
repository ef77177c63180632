"""An independent recomputation of the addition circuit's printed accuracy and roles, per checkpoint.

    .venv/bin/python scripts/recheck_circuits.py [CHECKPOINT ...] [--problems 256] [--tolerance 2]
        # per checkpoint: accuracy with every cell outside the printed circuit resample-ablated
        # (printed vs recomputed) and the printed roles vs roles recomputed from attention masses;
        # writes data/seed_tables/circuit_recheck.csv, exits 1 if any accuracy differs by more than the tolerance

It shares no code with ``interp_norm.circuits`` (whose ``cell_circuit`` / ``cell_roles`` printed the tables in
data/seed_tables/circuit_*): only the loader ``interp_norm.load``, the task (problems, tokens) of
``interp_norm.core.task`` and the hook names of ``interp_norm.core.hook_names``. The problems are
``scripts/circuit_seeds.py``'s: ``--problems`` ID problems drawn with seed 0, each resample source drawn
with ``random.Random(1)`` as another problem of the same token layout (same terms, digits per term and
signs; operators and digits afresh, redrawn until the layout, answer length included, matches). The draw
is redone here (a layout with no such problem in 500 draws falls back to a one-digit corruption there, which
is not redone here: the script stops with a message if that happens).

Cells are (layer, head, answer position); an answer position names the token a row predicts: ``sign``
(the answer's ``N``), ``units``, ``tens``, ... (an answer digit by place value) or ``end`` (the closing ``]``).
Role rule (as printed in cell_roles's module docstring, thresholds are parameters): a cell reads X when at
least ``dominant`` of its mean attention mass is on class X; reads X and Y when the two largest classes hold
at least ``pair`` and the second at least ``minor``; reads operand digits when the digit classes hold at least
``dominant``; otherwise spread (most on its largest class).
"""

from __future__ import annotations

import argparse
import random
import sys
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
import torch

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "data" / "seed_tables"
ARMS = ("pre", "qkv", "pre-cal", "qkv-cal")
CHECKPOINTS = tuple(n for a in ARMS for n in (a, *(f"{a}-s{s}" for s in range(1, 6))))
PLACES = ("units", "tens", "hundreds", "thousands")
MAX_TRIES = 500


@dataclass(frozen=True)
class Rule:
    dominant: float = 0.6
    pair: float = 0.6
    minor: float = 0.2


def place(k: int) -> str:
    return PLACES[k] if k < len(PLACES) else f"10^{k}"


def layout(text: str) -> str:
    return "".join("d" if c.isdigit() else "o" if c in "+-" else c for c in text)


def draw_sources(problems, seed: int):
    """Per problem another of the same layout, by rejection from ``random.Random(seed)``; None where none turned up."""
    from interp_norm.core import task as T

    rng, out = random.Random(seed), []
    for p in problems:
        got = None
        for _ in range(MAX_TRIES):
            terms = []
            for t in p.terms:
                n = len(str(abs(t)))
                mag = rng.randint(10 ** (n - 1), 10**n - 1) if n > 1 else rng.randint(1, 9)
                terms.append(-mag if t < 0 else mag)
            q = T.Problem(tuple(terms), tuple(rng.choice("+-") for _ in p.ops))
            if q != p and layout(q.text) == layout(p.text):
                got = q
                break
        out.append(got)
        if got is None:  # the printed run's fallback draws from the same rng: later draws would not match
            out += [None] * (len(problems) - len(out))
            break
    return out


def answer_rows(text: str) -> list[tuple[int, str]]:
    """(row, answer position) of every row from ``=`` on: the row predicts the next token."""
    eq = text.index("=")
    ans = text[eq + 1 :]
    digits = ans[:-1].lstrip("N")
    out = []
    for i in range(eq, len(text) - 1):
        nxt = text[i + 1]
        if i + 1 == len(text) - 1:
            out.append((i, "end"))
        elif nxt == "N":
            out.append((i, "sign"))
        else:
            k = i + 1 - (eq + 1) - (len(ans) - 1 - len(digits))
            out.append((i, place(len(digits) - 1 - k)))
    return out


def key_classes(text: str) -> list[str]:
    """The class of every key of ``text`` (character = token)."""
    eq = text.index("=")
    out = []
    i = 0
    while i < len(text):
        c = text[i]
        if i > eq:
            out.append("]" if c == "]" else "earlier answer")
        elif c == "[" or c == "=":
            out.append(c)
        elif c == "N":
            out.append("operand signs")
        elif c in "+-":
            out.append("operators")
        else:
            j = i
            while j < len(text) and text[j].isdigit():
                j += 1
            out += [f"{place(j - 1 - m)} digits" for m in range(i, j)]
            i = j
            continue
        i += 1
    return out


def role_of(masses: dict, rule: Rule) -> str:
    ranked = sorted(masses.items(), key=lambda kv: -kv[1])
    (c1, m1), (c2, m2) = ranked[0], ranked[1] if len(ranked) > 1 else ("", 0.0)
    digits = sum(m for c, m in masses.items() if c.endswith(" digits"))
    if m1 >= rule.dominant:
        return f"reads {c1}"
    if m1 + m2 >= rule.pair and m2 >= rule.minor:
        return f"reads {c1} and {c2}"
    if digits >= rule.dominant:
        return "reads operand digits"
    return f"spread (most on {c1})"


@torch.no_grad()
def kept_accuracy(model, tokens, source, rows, circuit: set) -> tuple[float, float]:
    """Per-token accuracy over answer rows, full and with every cell outside ``circuit`` resample-ablated."""
    from interp_norm.core.hook_names import act_name

    L, H = model.cfg.n_layers, model.cfg.n_heads
    names = [act_name("z", l) for l in range(L)]
    _, cache = model.run_with_cache(source, names_filter=lambda n: n in names)
    swap = torch.zeros(L, *tokens.shape, H, dtype=torch.bool)
    for b, rs in enumerate(rows):
        for i, pos in rs:
            for l in range(L):
                for h in range(H):
                    swap[l, b, i, h] = (l, h, pos) not in circuit

    def hook(z, hook):
        l = names.index(hook.name)
        return torch.where(swap[l].unsqueeze(-1).to(z.device), cache[hook.name], z)

    full = model(tokens)
    ablated = model.run_with_hooks(tokens, fwd_hooks=[(n, hook) for n in names])
    accs = []
    for logits in (full, ablated):
        pred = logits.argmax(-1)
        right = [int(pred[b, i] == tokens[b, i + 1]) for b, rs in enumerate(rows) for i, _ in rs]
        accs.append(sum(right) / len(right))
    return accs[0], accs[1]


@torch.no_grad()
def recomputed_roles(model, tokens, texts, rows, cells, rule: Rule) -> dict:
    """Role of each cell from its mean attention mass per key class over its rows (a plain loop)."""
    from interp_norm.core.hook_names import act_name

    names = [act_name("pattern", l) for l in range(model.cfg.n_layers)]
    _, cache = model.run_with_cache(tokens, names_filter=lambda n: n in names)
    classes = [key_classes(t) for t in texts]
    out = {}
    for l, h, pos in cells:
        pat = cache[names[l]][:, h].float().cpu()  # [b, q, k]
        sums, n = {}, 0
        for b, rs in enumerate(rows):
            for i, p in rs:
                if p != pos:
                    continue
                n += 1
                for k in range(i + 1):
                    sums[classes[b][k]] = sums.get(classes[b][k], 0.0) + float(pat[b, i, k])
        out[(l, h, pos)] = role_of({c: m / max(n, 1) for c, m in sums.items()}, rule)
    return out


def recheck(name: str, n: int, rule: Rule, circuit: pd.DataFrame, printed: pd.Series) -> dict:
    from interp_norm import load
    from interp_norm.core import task as T

    model = load(name, kind="interp_norm")
    model.eval()
    task = T.task_for(model, None, who="recheck_circuits")
    problems = task.sample_problems(n, "id", seed=0)
    sources = draw_sources(problems, seed=1)
    width = max(len(p.text) for p in problems)
    tokens = T.pad_batch([T.encode(p.text) for p in problems], width)
    if any(s is None for s in sources):
        raise SystemExit(f"{name}: a resample source was not found in {MAX_TRIES} draws; not redone here")
    source = T.pad_batch([T.encode(s.text) for s in sources], width)
    rows = [answer_rows(p.text) for p in problems]
    cells = {(int(r.layer), int(r.head), str(r.position)) for r in circuit.itertuples()}
    full, kept = kept_accuracy(model, tokens, source, rows, cells)
    roles = recomputed_roles(model, tokens, [p.text for p in problems], rows, sorted(cells), rule)
    agree = sum(roles[(int(r.layer), int(r.head), str(r.position))] == r.role for r in circuit.itertuples())
    diff = 100 * (kept - float(printed["accuracy_circuit"]))
    return dict(
        checkpoint=name,
        cells=len(cells),
        accuracy_full_printed=float(printed["accuracy_full"]),
        accuracy_full_recomputed=full,
        accuracy_printed=float(printed["accuracy_circuit"]),
        accuracy_recomputed=kept,
        difference_points=diff,
        roles_agreeing=agree,
        roles_total=len(cells),
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("checkpoints", nargs="*", default=list(CHECKPOINTS))
    ap.add_argument("--problems", type=int, default=256)
    ap.add_argument("--tolerance", type=float, default=2.0, help="largest accepted difference, accuracy points")
    ap.add_argument("--dominant", type=float, default=Rule.dominant)
    ap.add_argument("--pair", type=float, default=Rule.pair)
    ap.add_argument("--minor", type=float, default=Rule.minor)
    ap.add_argument("--out", type=Path, default=DATA / "circuit_recheck.csv")
    a = ap.parse_args(argv)
    torch.set_grad_enabled(False)
    rule = Rule(a.dominant, a.pair, a.minor)
    circ = pd.read_csv(DATA / "circuit_circuit_per_checkpoint.csv")
    ver = pd.read_csv(DATA / "circuit_verification.csv")
    ver = ver[ver["ablation"] == "resample"].set_index("checkpoint")
    out = []
    for name in a.checkpoints:
        out.append(recheck(name, a.problems, rule, circ[circ["checkpoint"] == name], ver.loc[name]))
        r = out[-1]
        print(
            f"{name:12s} printed {100 * r['accuracy_printed']:6.2f}  recomputed {100 * r['accuracy_recomputed']:6.2f}"
            f"  diff {r['difference_points']:+6.2f} pts  roles {r['roles_agreeing']}/{r['roles_total']}",
            flush=True,
        )
    df = pd.DataFrame(out)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    df.to_csv(a.out, index=False)
    worst = float(df["difference_points"].abs().max())
    print(
        f"largest difference {worst:.2f} points; roles agreeing {df['roles_agreeing'].sum()}/{df['roles_total'].sum()}"
    )
    return 1 if worst > a.tolerance else 0


if __name__ == "__main__":
    sys.exit(main())
