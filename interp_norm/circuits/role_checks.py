"""A causal test of the roles: resample only what a circuit cell reads from one token class.

For a cell (layer, head, answer position) and a token class C, the cell's output at its rows becomes
``z + sum over keys k in C of A[q, k] (v_source[k] - v[k])``: the head attends as in the clean run,
but the values it reads from the keys of class C come from the resample source run (the problem of
the same layout the circuit was located with); everything else stays clean. ``v`` is the value the
scores' softmax weights (after the value norm under QKV-Norm), so ``z = A v`` exactly.

A role predicts which classes matter: *reads X* -> X, *reads X and Y* -> X and Y, *reads operand
digits* -> the digit classes, *spread* -> nothing. The test asks whether the class whose resampling
lowers the logit difference most is among the predicted ones.
"""

from __future__ import annotations

import pandas as pd
import torch
from torch import Tensor

from interp_norm.circuits._types import device, require_eval
from interp_norm.circuits.cell_circuit import CircuitData, LocatedCircuit, class_ids, is_digit_class, score_logits
from interp_norm.core.hook_names import act_name, used_name


TEST_COLUMNS = ["cell", "layer", "head", "position", "role", "token_class", "predicted", "value_shift",
                "accuracy_drop", "logit_diff_drop"]


@torch.no_grad()
def class_patched_logits(model, data: CircuitData, layer: int, head: int, slot: int,
                         classes: Tensor) -> tuple[Tensor, Tensor]:
    """Logits [C, batch, pos, vocab]: run c resamples the values the cell (layer, head, slot) reads from
    the keys where ``classes[c]`` [batch, pos] is True; and per class the mean norm of the change it
    makes to the cell's output (0 exactly when those values are the same in both runs)."""
    require_eval(model)
    dev = device(model)
    vname, pname = used_name(model.cfg.attn_norm, "v", layer), act_name("pattern", layer)
    _, clean = model.run_with_cache(data.tokens.to(dev), names_filter=lambda n: n in (vname, pname))
    _, src = model.run_with_cache(data.source.to(dev), names_filter=lambda n: n == vname)
    A = clean[pname][:, head]  # [b, q, k]
    dv = src[vname][:, :, head] - clean[vname][:, :, head]  # [b, k, d]
    rows = (data.slot.to(dev) == slot).to(A.dtype)  # [b, q]
    delta = torch.einsum("bqk,cbk,bkd->cbqd", A, classes.to(dev, A.dtype), dv) * rows[None, :, :, None]
    C, B = classes.shape[0], data.tokens.shape[0]
    shift = delta.norm(dim=-1).sum((1, 2)) / rows.sum().clamp(min=1)

    def hook(z: Tensor, hook) -> Tensor:
        z = z.clone().view(C, B, *z.shape[1:])
        z[:, :, :, head] += delta
        return z.view(C * B, *z.shape[2:])

    logits = model.run_with_hooks(data.tokens.to(dev).repeat(C, 1), fwd_hooks=[(act_name("z", layer), hook)])
    return logits.view(C, B, *logits.shape[1:]), shift


def _predicted(role: str, classes: list[str]) -> list[str]:
    if role.startswith("spread"):
        return []
    if role == "reads operand digits":
        return [c for c in classes if is_digit_class(c)]
    named = role[len("reads "):]
    return [c for c in classes if c == named or named.startswith(c + " and ") or named.endswith(" and " + c)]


@torch.no_grad()
def role_tests(model, located: LocatedCircuit, circuit: pd.DataFrame, grain: str = "place") -> pd.DataFrame:
    """One row per (circuit cell, token class): accuracy and logit difference lost when only that class's
    values are resampled at the cell, and whether the role predicted the class. ``circuit``: the cells with
    their roles (:func:`~interp_norm.circuits.cell_roles.circuit_roles`, same ``grain``)."""
    data = located.data
    ids, names = class_ids(data, grain)
    classes = torch.stack([ids == i for i in range(len(names))])  # [C, b, k]
    dev = device(model)
    base_acc, base_ld = score_logits(data, model(data.tokens.to(dev))[None])
    out = []
    for r in circuit.itertuples():
        logits, shift = class_patched_logits(model, data, r.layer, r.head, r.slot, classes)
        acc, ld = score_logits(data, logits)
        predicted = _predicted(r.role, names)
        for i, c in enumerate(names):
            out.append(dict(cell=r.cell, layer=r.layer, head=r.head, position=r.position, role=r.role,
                            token_class=c, predicted=c in predicted, value_shift=float(shift[i]),
                            accuracy_drop=float(base_acc[0] - acc[i]),
                            logit_diff_drop=float(base_ld[0] - ld[i])))
    return pd.DataFrame(out, columns=TEST_COLUMNS)


def role_agreement(tests: pd.DataFrame) -> pd.DataFrame:
    """Per cell: the class whose resampling costs the most logit difference, its share of the positive
    costs (``causal_share``), and whether the role predicted it (``agrees``; None for a *spread* role, or
    where the predicted classes' values are the same in both runs -- ``=`` and ``[`` in layer 0, a role
    read from a constant -- so resampling cannot move them: ``testable`` False)."""
    cols = ["cell", "role", "most_causal_class", "logit_diff_drop", "causal_share", "testable", "agrees"]
    out = []
    for cell, g in tests.groupby("cell", sort=False):
        top = g.loc[g["logit_diff_drop"].idxmax()]
        positive = g["logit_diff_drop"].clip(lower=0).sum()
        testable = bool((g.loc[g["predicted"], "value_shift"] > 0).any())
        out.append(dict(cell=cell, role=top["role"], most_causal_class=top["token_class"],
                        logit_diff_drop=top["logit_diff_drop"],
                        causal_share=float(max(top["logit_diff_drop"], 0) / positive) if positive > 0 else float("nan"),
                        testable=testable, agrees=bool(top["predicted"]) if testable else None))
    return pd.DataFrame(out, columns=cols)


__all__ = ["class_patched_logits", "role_agreement", "role_tests"]
