"""What each cell of the addition circuit reads: attention mass per token class, a role by a stated rule.

From the rows of one answer position, a head's attention over the keys is summed per *token class*
and averaged over the rows: ``grain="place"`` groups operand digits by place value over all terms
(``units digits``, ``tens digits``, ...), ``grain="term"`` keeps the term apart (``term 0 units``); the
other classes are ``[``, operand signs (``N``), operators, ``=`` and the earlier answer tokens (the
query's own token included, when it is an answer token). Classes partition the keys, so a row's
masses sum to 1.

The role rule (:class:`RoleRule`): a cell *reads X* when at least ``dominant`` of its mass is on class
X; *reads X and Y* when the two largest classes hold at least ``pair`` together and the second at
least ``minor``; *reads operand digits* when the digit classes together hold at least ``dominant``;
otherwise it is *spread*, most on its largest class. The plain-words account
(:func:`account`) is generated from these tables.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import pandas as pd
import torch

from interp_norm.circuits._types import device, require_eval
from interp_norm.circuits.cell_circuit import (
    GRAINS,
    CircuitData,
    CircuitSpec,
    LocatedCircuit,
    class_ids,
    is_digit_class,
    locate_circuit,
    token_class,
)
from interp_norm.core.hook_names import act_name
from interp_norm.errors import PatchingError

@torch.no_grad()
def attention_by_class(model, data: CircuitData, grain: str = "place") -> pd.DataFrame:
    """Mean attention mass per (layer, head, answer position, token class) over that position's rows."""
    require_eval(model)
    dev = device(model)
    ids, names = class_ids(data, grain)
    keys = torch.nn.functional.one_hot(ids.clamp(min=0), len(names)).float() * (ids >= 0).unsqueeze(-1)
    slot = data.slot
    rows = torch.nn.functional.one_hot(slot.clamp(min=0), len(data.slots)).float() * (slot >= 0).unsqueeze(-1)
    counts = rows.sum((0, 1))
    hooks = [act_name("pattern", l) for l in range(model.cfg.n_layers)]
    _, cache = model.run_with_cache(data.tokens.to(dev), names_filter=lambda n: n in hooks)
    out = []
    for l, n in enumerate(hooks):
        pat = cache[n].float().cpu()  # [b, h, q, k]
        mass = torch.einsum("bhqk,bkc,bqs->hsc", pat, keys, rows) / counts.clamp(min=1)[None, :, None]
        for h in range(mass.shape[0]):
            for s, pos in enumerate(data.slots):
                if counts[s] == 0:
                    continue
                out += [dict(layer=l, head=h, position=pos, token_class=c, mass=float(mass[h, s, i]),
                             n_rows=int(counts[s])) for i, c in enumerate(names)]
    return pd.DataFrame(out)


@dataclass(frozen=True)
class RoleRule:
    """Thresholds of the role rule (shares of a cell's attention mass)."""

    dominant: float = 0.6
    pair: float = 0.6
    minor: float = 0.2

    def check(self) -> "RoleRule":
        for k in ("dominant", "pair", "minor"):
            v = getattr(self, k)
            if not 0 < v <= 1:
                raise PatchingError(f"RoleRule.{k} must be a share in (0, 1], got {v!r}")
        return self

    def role(self, top: str, top_mass: float, second: str, second_mass: float, digit_mass: float = 0.0) -> str:
        if top_mass >= self.dominant:
            return f"reads {top}"
        if top_mass + second_mass >= self.pair and second_mass >= self.minor:
            return f"reads {top} and {second}"
        if digit_mass >= self.dominant:
            return "reads operand digits"
        return f"spread (most on {top})"


def assign_roles(masses: pd.DataFrame, rule: Optional[RoleRule] = None) -> pd.DataFrame:
    """One row per (layer, head, position): its two largest classes, their masses and its role."""
    rule = (rule or RoleRule()).check()
    out = []
    for (l, h, pos), g in masses.groupby(["layer", "head", "position"], sort=False):
        g = g.sort_values("mass", ascending=False, kind="stable")
        (c1, m1), (c2, m2) = zip(g["token_class"].iloc[:2], g["mass"].iloc[:2])
        digits = float(g.loc[g["token_class"].map(is_digit_class), "mass"].sum())
        out.append(dict(layer=l, head=h, position=pos, top_class=c1, top_mass=m1, second_class=c2,
                        second_mass=m2, digit_mass=digits, role=rule.role(c1, m1, c2, m2, digits)))
    return pd.DataFrame(out)


def circuit_roles(located: LocatedCircuit, roles: pd.DataFrame) -> pd.DataFrame:
    """The circuit's cells in the order they were added, with their roles."""
    return located.cells.merge(roles, on=["layer", "head", "position"], how="left")


def role_counts(circuit: pd.DataFrame) -> pd.DataFrame:
    """How many circuit cells hold each role, per answer position and layer (what can be compared across
    seeds and norms, where head indices mean nothing)."""
    cols = ["position", "layer", "role"]
    if circuit.empty:
        return pd.DataFrame(columns=cols + ["cells"])
    return circuit.groupby(cols, sort=False).size().rename("cells").reset_index()


def _pct(x: float) -> str:
    return f"{100 * x:.0f}%"


def account(located: LocatedCircuit, roles: pd.DataFrame, name: str = "the model") -> str:
    """A plain-words account of the circuit, generated from its tables."""
    ver = located.verification.set_index("ablation")
    ab = located.spec.ablation
    v = ver.loc[ab]
    others = ", ".join(f"{a}: {_pct(ver.loc[a, 'accuracy_kept'])}" for a in ver.index if a != ab)
    lines = [
        f"{name}: the circuit is {int(v['cells'])} of {int(v['n_cells'])} cells (layer, head, answer position), "
        f"{_pct(v['share_of_cells'])} of the model. With every other cell {ab}-ablated it keeps "
        f"{_pct(v['accuracy_kept'])} of per-token accuracy ({v['accuracy_circuit']:.3f} of {v['accuracy_full']:.3f}; "
        f"{v['accuracy_none']:.3f} with no cell kept) and its logit-difference faithfulness is {v['faithfulness']:.2f}"
        + (f" (accuracy kept under other ablations: {others})." if others else ".")
    ]
    cr = circuit_roles(located, roles)
    for pos in located.data.slots:
        here = cr[cr["position"] == pos]
        n = int(located.effects.loc[located.effects["position"] == pos, "n_rows"].max() or 0)
        if here.empty:
            lines.append(f"At the {pos} position ({n} rows) no cell is in the circuit.")
            continue
        parts = [f"L{r.layer}H{r.head} {r.role} ({r.top_class} {_pct(r.top_mass)}; necessity "
                 f"{100 * r.accuracy_drop:.1f} points)" for r in here.itertuples()]
        lines.append(f"At the {pos} position ({n} rows), {len(here)} head(s): " + "; ".join(parts) + ".")
    return "\n".join(lines)


def addition_circuit(model, task=None, *, spec: Optional[CircuitSpec] = None, rule: Optional[RoleRule] = None,
                     grain: str = "place", name: Optional[str] = None, test_roles: bool = False) -> dict:
    """One call: locate the circuit and explain it. Returns the tables ``circuit`` (cells with roles),
    ``effects``, ``curve``, ``verification``, ``attention`` (mass per token class), ``roles`` (every
    cell), ``role_counts`` (circuit cells per answer position, layer and role) and the ``account`` (a string);
    ``test_roles=True`` adds ``role_tests`` and ``role_agreement``
    (:mod:`~interp_norm.circuits.role_checks`: about as long again as locating the circuit)."""
    located = locate_circuit(model, task, spec=spec)
    masses = attention_by_class(model, located.data, grain)
    roles = assign_roles(masses, rule)
    label = name or getattr(model, "name", None) or "the model"
    circuit = circuit_roles(located, roles)
    out = dict(circuit=circuit, effects=located.effects, curve=located.curve, verification=located.verification,
               attention=masses, roles=roles, role_counts=role_counts(circuit), account=account(located, roles, label))
    if test_roles:
        from interp_norm.circuits.role_checks import role_agreement, role_tests

        out["role_tests"] = role_tests(model, located, circuit, grain)
        out["role_agreement"] = role_agreement(out["role_tests"])
    return out


__all__ = ["GRAINS", "RoleRule", "account", "addition_circuit", "assign_roles", "attention_by_class",
           "circuit_roles", "is_digit_class", "role_counts", "token_class"]
