"""The addition circuit at (layer, head, answer position): ablations and attention masses against
explicit per-example hooks and loops written here, and the role rule against its statement."""

from __future__ import annotations

import pandas as pd
import pytest
import torch

from interp_norm.circuits.cell_circuit import CircuitSpec, cell_table, circuit_data, locate_circuit, verify
from interp_norm.circuits.cell_roles import RoleRule, addition_circuit, assign_roles, attention_by_class
from interp_norm.circuits.pairs import problem_format
from interp_norm.core.task import AdditionTask
from interp_norm.errors import PatchingError
from tests._models import make_model

TASK = AdditionTask.preset("cpu")
PLACES = ("units", "tens", "hundreds", "thousands")
# logits are a few hundred float32 operations deep and of size ~10: rounding stays far below this
ATOL = 1e-4


@pytest.fixture(scope="module")
def model():
    return make_model(seed=0)


@pytest.fixture(scope="module")
def problems():
    return TASK.sample_problems(10, "id", seed=3)


def answer_rows(text: str) -> list[tuple[int, str]]:
    """(position, answer position name) of each row that predicts an answer character, from the text."""
    eq, last = text.index("="), len(text) - 1
    out = []
    for p in range(eq, last):
        c = text[p + 1]
        out.append((p, "sign" if c == "N" else "end" if c == "]" else PLACES[(last - 1) - (p + 1)]))
    return out


@torch.no_grad()
def z_of(model, text: str) -> list[torch.Tensor]:
    from interp_norm.core.task import encode

    _, cache = model.run_with_cache(encode(text)[None])
    return [cache[f"blocks.{l}.attn.hook_z"][0] for l in range(model.cfg.n_layers)]


@torch.no_grad()
def brute_logits(model, problems, sources, kept: set, ablation: str) -> list[torch.Tensor]:
    """Each problem run alone; every (layer, head, answer position) not in ``kept`` gets its ablated z,
    written row by row and head by head."""
    from interp_norm.core.task import encode

    L, H = model.cfg.n_layers, model.cfg.n_heads
    means = {}
    if ablation == "mean":
        sums, counts = {}, {}
        for p in problems:
            zs = z_of(model, p.text)
            for pos, name in answer_rows(p.text):
                counts[name] = counts.get(name, 0) + 1
                for l in range(L):
                    sums[l, name] = sums.get((l, name), 0) + zs[l][pos]
        means = {k: v / counts[k[1]] for k, v in sums.items()}
    out = []
    for p, q in zip(problems, sources):
        zsrc = z_of(model, q.text) if ablation == "resample" else None
        rows = answer_rows(p.text)

        def write(z, l, rows=rows, zsrc=zsrc):
            for pos, name in rows:
                for h in range(H):
                    if (l, h, name) in kept:
                        continue
                    if ablation == "resample":
                        z[0, pos, h] = zsrc[l][pos, h]
                    elif ablation == "mean":
                        z[0, pos, h] = means[l, name][h]
                    else:
                        z[0, pos, h] = 0.0
            return z

        hooks = [(f"blocks.{l}.attn.hook_z", lambda z, hook, l=l: write(z, l)) for l in range(L)]
        out.append(model.run_with_hooks(encode(p.text)[None], fwd_hooks=hooks)[0])
    return out


def brute_scores(problems, sources, logits) -> tuple[float, float, int]:
    """Per-token accuracy, mean logit difference, and how many rows are within ATOL of a tie."""
    from interp_norm.core.task import encode

    right = total = ties = 0
    ld, n_ld = 0.0, 0
    for p, q, lg in zip(problems, sources, logits):
        t, s = encode(p.text), encode(q.text)
        for pos, _ in answer_rows(p.text):
            top2 = lg[pos].topk(2).values
            ties += int(top2[0] - top2[1] < 10 * ATOL)
            right += int(lg[pos].argmax() == t[pos + 1])
            total += 1
            if t[pos + 1] != s[pos + 1]:
                ld += float(lg[pos, t[pos + 1]] - lg[pos, s[pos + 1]])
                n_ld += 1
    return right / total, ld / n_ld, ties


def test_answer_positions_and_sources_follow_the_text(problems):
    data = circuit_data(problems, seed=1)
    for b, (p, q) in enumerate(zip(problems, data.source_problems)):
        assert problem_format(p) == problem_format(q) and p != q
        got = [(i, data.slots[int(data.slot[b, i])]) for i in range(data.slot.shape[1]) if data.slot[b, i] >= 0]
        assert got == answer_rows(p.text)


@pytest.mark.parametrize("ablation", ["resample", "mean", "zero"])
def test_circuit_accuracy_equals_explicit_hooks(model, problems, ablation):
    data = circuit_data(problems, seed=1)
    cells = cell_table(model, data)
    circuit = cells.iloc[::3]  # an arbitrary third of the cells
    kept = {(r.layer, r.head, r.position) for r in circuit.itertuples()}
    got = verify(model, data, circuit, cells, ablations=(ablation,)).iloc[0]
    full = brute_scores(problems, data.source_problems, brute_logits(model, problems, data.source_problems,
                                                                     set((r.layer, r.head, r.position) for r in cells.itertuples()), ablation))
    circ = brute_scores(problems, data.source_problems, brute_logits(model, problems, data.source_problems, kept, ablation))
    none = brute_scores(problems, data.source_problems, brute_logits(model, problems, data.source_problems, set(), ablation))
    n_rows = int(data.answer_rows.sum())
    for (acc, ld, ties), key in ((full, "full"), (circ, "circuit"), (none, "none")):
        assert abs(got[f"accuracy_{key}"] - acc) <= ties / n_rows + 1e-12
        assert got[f"logit_diff_{key}"] == pytest.approx(ld, abs=ATOL)
    assert got["share_of_cells"] == pytest.approx(len(circuit) / len(cells))


def test_located_circuit_is_the_smallest_prefix_that_keeps_the_target(model):
    spec = CircuitSpec(n=10, seed=3, keep=0.9)
    located = locate_circuit(model, TASK, spec=spec)
    data = located.data
    P, S = data.problems, data.source_problems
    everything = {(r.layer, r.head, r.position) for r in located.effects.itertuples()}
    full, _, _ = brute_scores(P, S, brute_logits(model, P, S, everything, "resample"))
    order = [(r.layer, r.head, r.position) for r in located.cells.itertuples()]
    acc, _, ties = brute_scores(P, S, brute_logits(model, P, S, set(order), "resample"))
    n_rows = int(data.answer_rows.sum())
    slack = ties / n_rows + 1e-12
    assert acc >= 0.9 * full - slack
    if order:
        acc_less, _, ties_less = brute_scores(P, S, brute_logits(model, P, S, set(order[:-1]), "resample"))
        assert acc_less < 0.9 * full + ties_less / n_rows + 1e-12


def test_greedy_growth_reaches_the_target_too(model):
    located = locate_circuit(model, TASK, spec=CircuitSpec(n=6, seed=2, grow="greedy"))
    v = located.verification.set_index("ablation").loc["resample"]
    assert v["accuracy_circuit"] >= 0.9 * v["accuracy_full"] - 1e-12
    assert len(located.curve) == len(located.cells) + 1


def test_attention_by_class_equals_run_with_cache(model, problems):
    from interp_norm.core.task import encode

    data = circuit_data(problems, seed=1)
    got = attention_by_class(model, data).set_index(["layer", "head", "position", "token_class"])["mass"]
    sums: dict = {}
    counts: dict = {}
    for p in problems:
        text = p.text
        eq = text.index("=")
        cls = []
        for k, c in enumerate(text):
            if c == "[":
                cls.append("[")
            elif k > eq:
                cls.append("earlier answer" if c != "]" else "]")
            elif c == "=":
                cls.append("=")
            elif c == "N":
                cls.append("operand signs")
            elif c in "+-":
                cls.append("operators")
            else:  # a digit: its place is how many digits follow it in its term
                j = k
                while text[j + 1].isdigit():
                    j += 1
                cls.append(f"{PLACES[j - k]} digits")
        _, cache = model.run_with_cache(encode(text)[None])
        for pos, name in answer_rows(text):
            counts[name] = counts.get(name, 0) + 1
            for l in range(model.cfg.n_layers):
                pat = cache[f"blocks.{l}.attn.hook_pattern"][0]
                for h in range(model.cfg.n_heads):
                    for k in range(pos + 1):
                        key = (l, h, name, cls[k])
                        sums[key] = sums.get(key, 0.0) + float(pat[h, pos, k])
    for key, total in sums.items():
        assert got[key] == pytest.approx(total / counts[key[2]], abs=1e-6)
    seen = {k for k in got.index if got[k] > 0}
    assert seen <= set(sums)
    rows = got.groupby(level=[0, 1, 2]).sum()
    assert rows.to_numpy() == pytest.approx(1.0, abs=1e-5)


def test_roles_follow_the_stated_rule(model, problems):
    data = circuit_data(problems, seed=1)
    masses = attention_by_class(model, data)
    rule = RoleRule(dominant=0.5, pair=0.7, minor=0.15)
    roles = assign_roles(masses, rule)
    for r in roles.itertuples():
        m = masses[(masses["layer"] == r.layer) & (masses["head"] == r.head) & (masses["position"] == r.position)]
        m = dict(zip(m.token_class, m.mass))
        ranked = sorted(m, key=m.get, reverse=True)
        a, b = ranked[0], ranked[1]
        digits = sum(v for c, v in m.items() if c.endswith(" digits"))
        if m[a] >= 0.5:
            want = f"reads {a}"
        elif m[a] + m[b] >= 0.7 and m[b] >= 0.15:
            want = f"reads {a} and {b}"
        elif digits >= 0.5:
            want = "reads operand digits"
        else:
            want = f"spread (most on {a})"
        assert r.role == want


def test_role_rule_on_stated_numbers():
    rule = RoleRule()
    assert rule.role("units digits", 0.61, "=", 0.2) == "reads units digits"
    assert rule.role("units digits", 0.45, "=", 0.2) == "reads units digits and ="
    assert rule.role("units digits", 0.45, "=", 0.1, digit_mass=0.62) == "reads operand digits"
    assert rule.role("units digits", 0.45, "=", 0.1, digit_mass=0.5) == "spread (most on units digits)"


def test_one_call_tables_and_account(model):
    out = addition_circuit(model, TASK, spec=CircuitSpec(n=6, seed=1), name="tiny")
    assert {"circuit", "effects", "curve", "verification", "attention", "roles", "account"} <= set(out)
    assert out["account"].startswith("tiny: the circuit is")
    assert all(isinstance(out[k], pd.DataFrame) for k in out if k != "account")
    assert out["circuit"]["role"].notna().all()
    counts = out["role_counts"]
    assert counts["cells"].sum() == len(out["circuit"])
    for r in counts.itertuples():
        c = out["circuit"]
        assert ((c["position"] == r.position) & (c["layer"] == r.layer) & (c["role"] == r.role)).sum() == r.cells


@pytest.mark.parametrize("bad", [dict(keep=1.5), dict(ablation="noise"), dict(grow="random"), dict(n=0)])
def test_bad_spec_is_a_typed_error(model, bad):
    with pytest.raises(PatchingError):
        locate_circuit(model, TASK, spec=CircuitSpec(**bad))


def test_bad_grain_and_rule_are_typed_errors(model, problems):
    data = circuit_data(problems[:2])
    with pytest.raises(PatchingError, match="grain"):
        attention_by_class(model, data, grain="letters")
    with pytest.raises(PatchingError, match="dominant"):
        assign_roles(attention_by_class(model, data), RoleRule(dominant=0.0))
    with pytest.raises(PatchingError, match="position_key"):
        circuit_data(problems[:2], position_key="row")


def test_cli_cells_writes_the_tables_and_the_account(tmp_path, capsys):
    from interp_norm.training.checkpoints import save_checkpoint
    from tests._models import run_cli

    ckpt = save_checkpoint(make_model(seed=0), tmp_path / "tiny", task=TASK)
    out = tmp_path / "out"
    code, stdout, err = run_cli(capsys, "circuits", ckpt, "--cells", "--out", out, "--n-examples", "6", "--no-progress")
    assert code == 0, err
    for k in ("effects", "curve", "verification", "roles", "attention"):  # the others may be empty
        assert not pd.read_csv(out / f"addition_{k}.csv").empty
    assert {"cell", "role", "accuracy_drop"} <= set(pd.read_csv(out / "addition_circuit.csv").columns)
    assert (out / "addition_role_tests.csv").exists() and (out / "addition_role_agreement.csv").exists()
    assert (out / "addition_account.txt").read_text().startswith("tiny: the circuit is")
    ver = pd.read_csv(out / "addition_verification.csv")
    assert list(ver["ablation"]) == ["resample", "mean", "zero"]
    code, _, err = run_cli(capsys, "circuits", ckpt, "--cells", "--out", out, "--n-examples", "6")
    assert code != 0 and "--force" in err


@pytest.mark.parametrize("attn_norm", ["pre", "qkv"])
def test_class_patch_equals_explicit_value_swap(problems, attn_norm):
    """The cell's output recomputed key by key with the class's values taken from the source run."""
    from interp_norm.circuits.cell_circuit import class_ids
    from interp_norm.circuits.role_checks import class_patched_logits
    from interp_norm.core.task import encode

    model = make_model(seed=1, attn_norm=attn_norm)
    data = circuit_data(problems[:4], seed=1)
    ids, names = class_ids(data, "place")
    layer, head, slot = 1, 2, data.slots.index("units")
    pick = [names.index("units digits"), names.index("earlier answer")]
    got, shift = class_patched_logits(model, data, layer, head, slot, torch.stack([ids == i for i in pick]))
    vname = "blocks.1.attn.hook_v" + ("_normed" if attn_norm == "qkv" else "")
    for c, cls in enumerate(pick):
        for b, (p, q) in enumerate(zip(data.problems, data.source_problems)):
            with torch.no_grad():
                _, clean = model.run_with_cache(encode(p.text)[None])
                _, src = model.run_with_cache(encode(q.text)[None])
            rows = [pos for pos, name in answer_rows(p.text) if name == "units"]

            def write(z, hook):
                for qpos in rows:
                    new = torch.zeros_like(z[0, qpos, head])
                    for k in range(qpos + 1):
                        v = src[vname][0, k, head] if ids[b, k] == cls else clean[vname][0, k, head]
                        new += clean["blocks.1.attn.hook_pattern"][0, head, qpos, k] * v
                    z[0, qpos, head] = new
                return z

            with torch.no_grad():
                want = model.run_with_hooks(encode(p.text)[None], fwd_hooks=[("blocks.1.attn.hook_z", write)])[0]
            n = len(p.text)
            assert torch.allclose(got[c, b, :n], want, atol=ATOL), (attn_norm, names[cls], b)
    assert (shift > 0).all()


def test_role_predictions_name_the_classes():
    from interp_norm.circuits.role_checks import _predicted

    names = ["[", "tens digits", "units digits", "operators", "operand signs", "=", "earlier answer", "]"]
    assert _predicted("reads = and earlier answer", names) == ["=", "earlier answer"]
    assert _predicted("reads tens digits", names) == ["tens digits"]
    assert _predicted("reads operand digits", names) == ["tens digits", "units digits"]
    assert _predicted("spread (most on =)", names) == []


def test_role_agreement_reads_the_test_table():
    from interp_norm.circuits.role_checks import TEST_COLUMNS, role_agreement

    rows = [  # cell a: role right; b: role wrong; c: spread; d: reads a constant
        ("a", "reads =", "=", True, 1.0, 0.5), ("a", "reads =", "]", False, 1.0, 0.1),
        ("b", "reads ]", "=", False, 1.0, 0.3), ("b", "reads ]", "]", True, 1.0, 0.1),
        ("c", "spread (most on =)", "=", False, 1.0, 0.2), ("c", "spread (most on =)", "]", False, 1.0, -0.2),
        ("d", "reads =", "=", True, 0.0, 0.0), ("d", "reads =", "]", False, 1.0, 0.4),
    ]
    t = pd.DataFrame([dict(zip(TEST_COLUMNS, (c, 0, 0, "units", r, k, p, s, 0.0, d))) for c, r, k, p, s, d in rows])
    got = role_agreement(t).set_index("cell")
    assert got.loc["a", "agrees"] is True and got.loc["a", "causal_share"] == pytest.approx(0.5 / 0.6)
    assert got.loc["b", "agrees"] is False and got.loc["b", "most_causal_class"] == "="
    assert got.loc["c", "agrees"] is None and got.loc["c", "causal_share"] == pytest.approx(1.0)
    assert got.loc["d", "agrees"] is None and not got.loc["d", "testable"]
