"""Independent references for the circuit exercises of tutorial 02: plain loops over the tables and over
``hook_pattern``, sharing no code with :mod:`interp_norm.circuits.cell_roles`; per-pair patching and
attribution by hand, sharing no code with :mod:`interp_norm.circuits`."""

from __future__ import annotations

import numpy as np
import torch

from interp_norm.core.hook_names import act_name


def most_necessary(effects, position: str) -> list[tuple[int, int]]:
    """The cells (layer, head) at ``position`` whose (accuracy drop, logit-difference drop) is largest, by a loop (all tied ones)."""
    best, cells = None, []
    for r in effects.itertuples(index=False):
        if r.position != position:
            continue
        key = (float(r.accuracy_drop), float(r.logit_diff_drop))
        if best is None or key > best:
            best, cells = key, [(int(r.layer), int(r.head))]
        elif key == best:
            cells.append((int(r.layer), int(r.head)))
    return cells


def masses_by_loop(model, data, layer: int, head: int, slot: int) -> dict:
    """Mean attention mass per token class of one cell, from ``hook_pattern`` by a loop over rows and keys."""
    from interp_norm.circuits.cell_circuit import token_class

    with torch.no_grad():
        _, cache = model.run_with_cache(data.tokens, names_filter=act_name("pattern", layer))
    pattern = cache[act_name("pattern", layer)][:, head].double().tolist()  # [batch][query][key]
    total: dict = {}
    rows = 0
    for b, slots in enumerate(data.slot.tolist()):
        for q, s in enumerate(slots):
            if s != slot:
                continue
            rows += 1
            for k in range(q + 1):
                c = token_class(data.key_roles[b][k])
                total[c] = total.get(c, 0.0) + pattern[b][q][k]
    return {c: m / rows for c, m in total.items()}


def top_classes(masses: dict, tol: float) -> set:
    top = max(masses.values())
    return {c for c, m in masses.items() if m >= top - tol}


def shuffled_tables(effects, attention):
    """The same cells with shuffled necessities and attention masses: a hard-coded answer fails here."""
    rng = np.random.default_rng(0)
    fx = effects.assign(accuracy_drop=rng.permutation(np.linspace(0.0, 0.3, len(effects))),
                        logit_diff_drop=rng.permutation(np.linspace(-1.0, 5.0, len(effects))))
    att = attention.assign(mass=rng.permutation(np.linspace(0.01, 0.9, len(attention))))
    return fx.sample(frac=1.0, random_state=1).reset_index(drop=True), att.sample(frac=1.0, random_state=2).reset_index(drop=True)


def reads_from_tables(effects, attention, position: str) -> set:
    """The reference answer on tables alone: the top class(es) of the most necessary cell(s), by a loop."""
    out: set = set()
    for l, h in most_necessary(effects, position):
        masses = {r.token_class: float(r.mass) for r in attention.itertuples(index=False)
                  if (int(r.layer), int(r.head), r.position) == (l, h, position)}
        out |= top_classes(masses, 1e-12)
    return out



def eap_and_exact_by_hand(model, pairs, metric) -> tuple[torch.Tensor, torch.Tensor]:
    """``(eap, exact)`` per pair, each [layer, head, pair] (float64): exact patching one head at a time (its clean
    ``hook_z`` at every position into the corrupted run) and EAP from the per-pair gradient of the metric."""
    L, H = model.cfg.n_layers, model.cfg.n_heads
    names = [act_name("z", layer) for layer in range(L)]
    with torch.no_grad():
        _, clean = model.run_with_cache(pairs.clean_tokens, names_filter=lambda n: n in names)
        corrupted = metric(model(pairs.corrupted_tokens)).double()
    exact = torch.zeros(L, H, len(corrupted), dtype=torch.float64)
    for layer, name in enumerate(names):
        for head in range(H):
            def put(z, hook, head=head):
                z[:, :, head] = clean[hook.name][:, :, head]
                return z

            with torch.no_grad():
                exact[layer, head] = metric(model.run_with_hooks(pairs.corrupted_tokens, fwd_hooks=[(name, put)])).double() - corrupted
    saved = {}

    def keep(z, hook):
        z.retain_grad()
        saved[hook.name] = z
        return z

    # pairs do not interact in a forward pass, so the gradient of the sum holds each pair's own gradient
    metric(model.run_with_hooks(pairs.corrupted_tokens, fwd_hooks=[(n, keep) for n in names])).sum().backward()
    eap = torch.stack([((clean[n] - saved[n].detach()) * saved[n].grad).sum(dim=(1, 3)).T.double() for n in names])
    model.zero_grad(set_to_none=True)
    return eap, exact
