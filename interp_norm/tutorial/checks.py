"""Checks for the tutorial exercises: the learner's function against an independent computation.

``check_<name>(your_function, ...)`` calls your function on the notebook's data (and, where a
lucky answer is possible, on a second synthetic case), compares the result with a computation
that does not share your code path — a formula, a brute-force loop, TransformerLens's own
``transformer_lens.patching``, or the library's result for exercises that re-derive it by hand —
reports one line (printed; in Jupyter shown with a coloured mark) and returns a :class:`CheckResult`:

* ``[PASS] name — correct: ...`` (``status == "pass"``);
* ``[FAIL] name — not right yet: ...`` with the first mismatch and, where the mistake is a common
  one, a hint (``status == "fail"``); an exception inside your function is reported here with the
  line that raised it, never re-raised, so Run All continues;
* ``[TODO] name — not attempted yet`` when your function still returns ``None`` (the stub) or raises
  ``NotImplementedError`` (``status == "not attempted"``).

The notebooks import the checks with ``from interp_norm.tutorial import check_<name>``;
``tests/test_tutorials.py`` feeds every check the reference solution (``solutions.py``) and a
deliberately wrong function. The shared machinery (result type, decorator, comparison helpers) is
in ``_core.py``.
"""

from __future__ import annotations

import contextlib
import io
import math

import numpy as np
import torch

from interp_norm.tutorial._core import (  # noqa: F401  (CheckResult and the statuses are part of this module's API)
    FAIL,
    NOT_ATTEMPTED,
    PASS,
    CheckResult,
    _as_tensor,
    _close,
    _exercise,
    _Fail,
    _head_label,
    _is_close,
    _per_head,
)
from interp_norm.errors import ConfigError
from interp_norm.core.hook_names import act_name, normalised_targets
from interp_norm.tutorial._circuit_ref import eap_and_exact_by_hand, masses_by_loop, most_necessary, reads_from_tables, shuffled_tables, top_classes


# ============================================================================= 01 quickstart


@_exercise("my_scores")
def check_my_scores(learner, model, cache) -> str:
    """``my_scores(model, cache, layer)`` against the cache's own ``hook_attn_scores`` and ``hook_pattern``."""
    L = model.cfg.n_layers
    for layer in range(L):
        ref = cache[act_name("attn_scores", layer)]
        got = _as_tensor(learner(model, cache, layer), f"my_scores(model, cache, {layer})", ref.shape, "[batch, head, query, key]")
        masked = torch.isneginf(ref)
        if not torch.equal(torch.isneginf(got), masked):
            raise _Fail(f"layer {layer}: the causal mask is wrong; exactly the keys after each query must be -inf")
        g, r = got.double().masked_fill(masked, 0.0), ref.double().masked_fill(masked, 0.0)  # [b, h, q, k], 0 where masked
        hint = ""
        ratio = float((g[~masked] / r[~masked]).median())
        if _is_close(g, r * ratio, 1e-4 * (1 + float(r.abs().max()))) and abs(ratio - 1) > 1e-3:
            hint = f"Yours are {ratio:.4g}× the model's scores: check the scale (model.cfg.attn_scale = {model.cfg.attn_scale:.4g})"
        _close(g, r, f"layer {layer} scores [batch, head, query, key]", atol=1e-4, rtol=1e-4, hint=hint)
        _close(got.softmax(-1), cache[act_name("pattern", layer)], f"layer {layer}: softmax of your scores vs hook_pattern", atol=1e-5)
    return f"your scores equal hook_attn_scores in all {L} layers, and their softmax over keys equals hook_pattern"


@_exercise("most_important_head", uses_model=False)
def check_most_important_head(learner, ablation) -> str:
    """``most_important_head(ablation)`` against a plain loop over the rows, on the table and a shuffled synthetic one."""

    def brute_force(df):
        best = None
        for row in df.itertuples(index=False):
            if best is None or row.loss_increase > best[0]:
                best = (row.loss_increase, int(row.layer), int(row.head))
        return best

    def as_pair(x, what):
        try:
            l, h = x
            return int(l), int(h)
        except (TypeError, ValueError):
            raise _Fail(f"{what} should return a (layer, head) tuple of two ints, e.g. (1, 2); got {x!r}") from None

    synthetic = ablation[["layer", "head"]].copy()
    rng = np.random.default_rng(0)
    synthetic["loss_increase"] = rng.permutation(np.linspace(-0.5, 2.0, len(synthetic)))
    synthetic = synthetic.sample(frac=1.0, random_state=1).reset_index(drop=True)
    for df, what in ((ablation, "on the notebook's table"), (synthetic, "on a shuffled synthetic table")):
        got = as_pair(learner(df.copy()), "most_important_head(ablation)")
        value, l, h = brute_force(df)
        if got != (l, h):
            hint = " (you returned (head, layer): swap them)" if got == (h, l) else ""
            raise _Fail(f"{what}: the largest loss increase ({value:.4g}) is at layer {l}, head {h}; you returned {got}{hint}")
    value, l, h = brute_force(ablation)
    return f"{_head_label(l, h)} raises the loss most (+{value:.4g}); also right on a shuffled synthetic table"


@_exercise("prev_token_scores")
def check_prev_token_scores(learner, model, tokens) -> str:
    """``prev_token_scores(model, tokens)`` against a loop over examples and query positions."""
    from interp_norm.core.task import PAD_ID

    cfg = model.cfg
    got = _per_head(learner(model, tokens), "prev_token_scores(model, tokens)", "prev_token_score", cfg.n_layers, cfg.n_heads)
    names = [act_name("pattern", l) for l in range(cfg.n_layers)]
    with torch.no_grad():
        _, cache = model.run_with_cache(tokens, names_filter=lambda n: n in names)
    ref = torch.zeros(cfg.n_layers, cfg.n_heads, dtype=torch.float64)
    for l, name in enumerate(names):
        pattern, total, count = cache[name].double(), torch.zeros(cfg.n_heads, dtype=torch.float64), 0
        for b in range(tokens.shape[0]):
            for p in range(1, tokens.shape[1]):
                if int(tokens[b, p]) != PAD_ID:  # a real query token: its attention to the token before it
                    total += pattern[b, :, p, p - 1]
                    count += 1
        ref[l] = total / count
    _close(got, ref, "prev-token score per [layer, head]", atol=1e-5,
           hint="Average pattern[b, h, p, p-1] over every query position p ≥ 1 whose token is not padding")
    l, h = divmod(int(ref.argmax()), cfg.n_heads)
    return f"matches a loop over every example and position; the strongest previous-token head is {_head_label(l, h)} ({float(ref[l, h]):.3f})"


# ============================================================================= 02 circuit


def _clean_corrupted(model, pairs, metric) -> tuple[float, float]:
    with torch.no_grad():
        return metric(model(pairs.clean_tokens)).mean().item(), metric(model(pairs.corrupted_tokens)).mean().item()


@_exercise("patch_one")
def check_patch_one(learner, model, pairs, metric) -> str:
    """``patch_one(model, pairs, metric, layer, pos)`` against ``transformer_lens.patching.get_act_patch_resid_pre``."""
    from transformer_lens import patching

    first = learner(model, pairs, metric, 0, 0)  # cheap "not attempted" detection first
    clean, corrupted = _clean_corrupted(model, pairs, metric)
    with torch.no_grad(), contextlib.redirect_stderr(io.StringIO()):  # TransformerLens's progress bar
        _, clean_cache = model.run_with_cache(pairs.clean_tokens)
        ref = patching.get_act_patch_resid_pre(
            model, pairs.corrupted_tokens, clean_cache,
            lambda logits: (metric(logits).mean() - corrupted) / (clean - corrupted),
        ).double()  # [layer, pos]
    flat = ref.reshape(-1)
    partial = torch.where(((flat - 1).abs() > 0.02) & (flat.abs() > 0.02), flat.abs(), torch.zeros_like(flat))
    cells = [(0, 0), divmod(int(partial.argmax() if partial.max() > 0 else flat.abs().argmax()), ref.shape[1])]
    full = ((flat - 1).abs() < 1e-3).nonzero().flatten()
    if len(full):
        cells.append(divmod(int(full[-1]), ref.shape[1]))
    for i, (l, p) in enumerate(dict.fromkeys(cells)):
        got = first if i == 0 else learner(model, pairs, metric, l, p)
        try:
            got = float(got)
        except (TypeError, ValueError):
            raise _Fail(f"patch_one should return a float (the normalised logit difference), got {type(got).__name__}") from None
        want = float(ref[l, p])
        if not abs(got - want) <= 1e-4:
            raw = want * (clean - corrupted) + corrupted
            hint = (". That is the raw logit difference: normalise it, (patched − corrupted) / (clean − corrupted)"
                    if abs(got - raw) <= 1e-4 else "")
            raise _Fail(f"layer {l}, position {p}: yours {got:.6g}, transformer_lens.patching gives {want:.6g}{hint}")
    l, p = cells[1]
    return (f"equals transformer_lens.patching.get_act_patch_resid_pre at {len(dict.fromkeys(cells))} cells, "
            f"e.g. layer {l}, position {p}: {float(ref[l, p]):.4f}")


@_exercise("attribution_scores")
def check_attribution_scores(learner, model, pairs, metric) -> str:
    """``attribution_scores(model, pairs, metric)`` against the library's EAP (``attribution_patch``, ``ig_steps=1``)."""
    from interp_norm.circuits import attribution_patch

    cfg = model.cfg
    got = _per_head(learner(model, pairs, metric), "attribution_scores(model, pairs, metric)", "attribution", cfg.n_layers, cfg.n_heads)
    ref = attribution_patch(model, pairs, metric, "z", by="all", ig_steps=1).effect().double().reshape(cfg.n_layers, cfg.n_heads)
    model.zero_grad(set_to_none=True)
    tol = 1e-4 * (1 + float(ref.abs().max()))
    hint = ("Your scores have the opposite sign: the estimate is (z_clean − z_corrupted) · ∂metric/∂z"
            if _is_close(got, -ref, tol) else "Sum (z_clean − z_corrupted) · grad over batch, positions and d_head, with the gradient of the batch-mean metric")
    _close(got, ref, "attribution per [layer, head]", atol=tol, hint=hint)
    l, h = divmod(int(ref.abs().argmax()), cfg.n_heads)
    return f"equals circuits.attribution_patch(..., ig_steps=1) for all {ref.numel()} heads; the largest is {_head_label(l, h)} ({float(ref[l, h]):+.4f})"


def _faithfulness_via_attn_out(model, pairs, metric, heads: set, clean: float, corrupted: float) -> float:
    """Reference faithfulness that never writes ``hook_z``: it reads each layer's z and adds to
    ``hook_attn_out`` what replacing the outside heads' z by their corrupted values changes there,
    ``attn.out(z_new) − attn.out(z)`` (times the block's calibration factor on calibrated models)."""
    cfg = model.cfg
    with torch.no_grad():
        _, corr = model.run_with_cache(pairs.corrupted_tokens, names_filter=lambda n: n.endswith("hook_z"))
        current = {}

        def read_z(z, hook):
            current[hook.name] = z.clone()
            return z

        def add_change(out, hook):
            layer = next(l for l in range(cfg.n_layers) if hook.name == act_name("attn_out", l))
            name = act_name("z", layer)
            z, z_new = current[name], current[name].clone()
            for h in range(cfg.n_heads):
                if (layer, h) not in heads:
                    z_new[:, :, h] = corr[name][:, :, h]
            block = model.blocks[layer]
            change = block.attn.out(z_new) - block.attn.out(z)
            if cfg.calibration == "paper":
                change = change * block.calib_attn_out.factor
            return out + change

        hooks = [h for l in range(cfg.n_layers) for h in ((act_name("z", l), read_z), (act_name("attn_out", l), add_change))]
        value = metric(model.run_with_hooks(pairs.clean_tokens, fwd_hooks=hooks)).mean().item()
    return (value - corrupted) / (clean - corrupted)


@_exercise("head_faithfulness")
def check_head_faithfulness(learner, model, pairs, metric) -> str:
    """``head_faithfulness(model, pairs, metric, heads)`` against a computation that patches the
    attention *output* instead of ``hook_z`` (:func:`_faithfulness_via_attn_out`)."""
    cfg = model.cfg
    heads = [(l, h) for l in range(cfg.n_layers) for h in range(cfg.n_heads)]
    rng = np.random.default_rng(0)
    sets = [set(heads), set(), {heads[-1]}, {heads[i] for i in sorted(rng.choice(len(heads), len(heads) // 2, replace=False))}]
    got = []
    for s in sets:
        v = learner(model, pairs, metric, set(s))
        try:
            got.append(float(v))
        except (TypeError, ValueError):
            raise _Fail(f"head_faithfulness should return a float, got {type(v).__name__}") from None
    clean, corrupted = _clean_corrupted(model, pairs, metric)
    ref = [_faithfulness_via_attn_out(model, pairs, metric, s, clean, corrupted) for s in sets]
    names = ["every head", "no head", f"{{{_head_label(*heads[-1])}}}", "a random half of the heads"]
    for name, g, r in zip(names, got, ref):
        if not abs(g - r) <= 1e-4:
            hint = ""
            if abs(got[0] - ref[1]) <= 1e-4 and abs(got[1] - ref[0]) <= 1e-4:
                hint = ". You replaced the circuit's heads; replace the heads *outside* the circuit by their corrupted values"
            elif abs(got[0] - 1) > 1e-4:
                hint = ". With every head kept nothing is replaced, so the result must be 1: check the normalisation"
            raise _Fail(f"circuit of {name}: yours {g:.6g}, expected {r:.6g}{hint}")
    return (f"equals an independent computation (the replaced heads' change added to hook_attn_out through W_O) "
            f"for 4 head sets; no head keeps {ref[1]:.3f}, a random half {ref[3]:.3f}")


@_exercise("most_necessary_reads")
def check_most_necessary_reads(learner, model, located, attention) -> str:
    """``most_necessary_reads(effects, attention, position)`` at every answer position, against the attention
    mass recomputed from ``hook_pattern`` by a loop, and on shuffled tables."""
    from interp_norm.circuits.cell_roles import assign_roles

    effects, data = located.effects, located.data
    answers = {}
    for slot, pos in enumerate(data.slots):
        got = learner(effects.copy(), attention.copy(), pos)
        if not isinstance(got, str):
            raise _Fail(f"most_necessary_reads should return a token class name (a str, e.g. 'units digits'), got {type(got).__name__}")
        cells = most_necessary(effects, pos)
        masses = [masses_by_loop(model, data, l, h, slot) for l, h in cells]
        want = set().union(*(top_classes(m, 1e-6) for m in masses))  # float32 sums of at most ~20 keys
        if got not in want:
            mean_top = attention[attention["position"] == pos].sort_values("mass").iloc[-1]
            hint = ""
            if got == mean_top["token_class"]:
                hint = ". That is the class most attended by any head there: take the most *necessary* cell (largest accuracy_drop)"
            raise _Fail(f"at the {pos} position the most necessary cell is {_head_label(*cells[0])}, which reads most from "
                        f"{sorted(want)[0]!r} ({100 * max(masses[0].values()):.0f}% of its attention); you returned {got!r}{hint}")
        answers[pos] = (cells[0], got, masses[0][got])
    fx, att = shuffled_tables(effects, attention)
    for pos in data.slots:
        got, want = learner(fx.copy(), att.copy(), pos), reads_from_tables(fx, att, pos)
        if got not in want:
            raise _Fail(f"on shuffled tables (same cells, other necessities and masses), at the {pos} position: "
                        f"expected {sorted(want)[0]!r}, you returned {got!r}")
    roles = assign_roles(attention).set_index(["layer", "head", "position"])["role"]
    pos = "units" if "units" in answers else data.slots[-1]
    (l, h), cls, mass = answers[pos]
    return (f"right at all {len(answers)} answer positions (masses recomputed from hook_pattern) and on shuffled tables; "
            f"at the {pos} position {_head_label(l, h)} reads most from {cls} ({100 * mass:.0f}%): "
            f"its role is '{roles.get((l, h, pos), '?')}'")


@_exercise("eap_errors")
def check_eap_errors(learner, model, pairs, metric) -> str:
    """``eap_errors(model, pairs, metric)`` against per-pair exact patching and EAP computed here by hand."""
    cfg = model.cfg
    got = _per_head(learner(model, pairs, metric), "eap_errors(model, pairs, metric)", "error", cfg.n_layers, cfg.n_heads)
    eap, exact = eap_and_exact_by_hand(model, pairs, metric)  # [layer, head, pair]
    ref = (eap - exact).abs().mean(-1)
    tol = 1e-4 * (1 + float(exact.abs().max()))
    hint = ("That is |mean estimate − mean exact|: errors of opposite sign in different pairs cancel there; take "
            "|estimate − exact| per pair, then the mean" if _is_close(got, (eap.mean(-1) - exact.mean(-1)).abs(), tol)
            else "Per pair: the estimate's change of that pair's metric minus exact patching's, in absolute value")
    _close(got, ref, "error per [layer, head]", atol=tol, hint=hint)
    l, h = divmod(int(ref.argmax()), cfg.n_heads)
    return (f"equals exact patching and EAP recomputed pair by pair for all {ref.numel()} heads; the largest error is "
            f"{_head_label(l, h)} ({float(ref[l, h]):.3f}, exact effect {float(exact[l, h].mean()):+.3f} on average)")


# ============================================================================= 03 noise


@_exercise("query_norm_ratio")
def check_query_norm_ratio(learner, model, tokens) -> str:
    """``query_norm_ratio(model, tokens, level, seed)`` against 1+κ from ``NormNoise.last_kappa``."""
    from interp_norm.noise import NormNoise

    rms = []
    for level, seed in ((0.05, 1), (0.2, 7)):
        got = learner(model, tokens, level, seed)
        with torch.no_grad(), NormNoise(model, level, targets="q", layers=[0], seed=seed) as noise:
            model(tokens)
        kappa = noise.last_kappa[(0, "q")][..., 0].double()  # [batch, pos, head]
        got = _as_tensor(got, f"query_norm_ratio(model, tokens, {level}, {seed})", kappa.shape, "[batch, pos, head]")
        hint = ("That is clean/noisy: divide the noisy norm by the clean one" if _is_close(got, 1 / (1 + kappa), 1e-4)
                else "Use NormNoise(model, level, targets='q', layers=[0], seed=seed) around one forward pass")
        _close(got, 1 + kappa, f"level {level}, seed {seed}: |q_noisy| / |q_clean| vs 1 + κ", atol=1e-4, rtol=1e-4, hint=hint)
        rms.append(f"{float((got.double() - 1).pow(2).mean().sqrt()):.4f} at level {level}")
    return f"|q_noisy| / |q_clean| = 1 + κ at every position and head; RMS of the ratio − 1: {', '.join(rms)}"


# A fragile synthetic row (t* = 0, a close competitor, a masked key) for a second Monte Carlo case.
_SYNTHETIC_ROW = torch.tensor([3.0, 2.7, 1.5, -1.0, float("-inf")], dtype=torch.float64)


@_exercise("mc_collapse_probability", uses_model=False)
def check_mc_collapse_probability(learner, row, level: float = 0.2, n_draws: int = 20_000) -> str:
    """``mc_collapse_probability(row, level, n_draws, seed)`` against the exact integral
    ``theory.predicted_collapse_probability``, within 5 standard errors of the Monte Carlo."""
    from interp_norm import theory

    lines = []
    for r, lv, what in ((row, level, "the notebook's row"), (_SYNTHETIC_ROW, 0.1, "a synthetic row [3, 2.7, 1.5, −1, −inf]")):
        v = learner(r.detach().clone(), lv, n_draws, 0)
        try:
            got = float(v)
        except (TypeError, ValueError):
            raise _Fail(f"mc_collapse_probability should return a float (the fraction of draws that collapse), got {type(v).__name__}") from None
        p = float(theory.predicted_collapse_probability(r.detach().double()[None], theory.NoiseLaw(lv))[0])
        se = math.sqrt(max(p * (1 - p), 1.0 / n_draws) / n_draws)
        if not abs(got - p) <= 5 * se + 1e-3:
            raise _Fail(
                f"{what} at noise {lv}: yours {got:.4f}, the exact probability is {p:.4f} (Monte Carlo standard error "
                f"{se:.4f}). κ is uniform with RMS = level, i.e. on ±√3·level, one per key, and a row collapses when some "
                "t ≠ t* has (1+κ_t)·w_t > (1+κ_t*)·w_t*"
            )
        lines.append(f"{got:.4f} vs exact {p:.4f}")
    return f"your estimates agree with the exact integral within their sampling error ({'; '.join(lines)})"


# ============================================================================= 04 geometry


def _column_space(M: torch.Tensor) -> torch.Tensor:
    """Orthonormal basis of span(columns of M) from the eigenvectors of M Mᵀ (not an SVD of M)."""
    M = M.detach().double()
    evals, evecs = torch.linalg.eigh(M @ M.T)
    return evecs[:, evals > evals.max() * 1e-10]


def _reference_angles_deg(A: torch.Tensor, B: torch.Tensor) -> torch.Tensor:
    """Principal angles through the projector: cos²θ are the top eigenvalues of Q_Aᵀ P_B Q_A."""
    QA, QB = _column_space(A), _column_space(B)
    k = min(QA.shape[1], QB.shape[1])
    cos2 = torch.linalg.eigvalsh(QA.T @ QB @ QB.T @ QA).flip(0)[:k].clamp(0, 1)
    return torch.rad2deg(torch.arccos(cos2.sqrt())).sort().values


@_exercise("principal_angles_deg", uses_model=False)
def check_principal_angles_deg(learner, model=None) -> str:
    """``principal_angles_deg(A, B)`` against angles computed from projectors (eigenvalues, not an SVD)."""
    g = torch.Generator().manual_seed(0)
    theta = math.radians(30.0)
    e = torch.eye(4, dtype=torch.float64)
    B2 = torch.randn(8, 4, generator=g, dtype=torch.float64)
    cases = [
        ("a line and a line at 30°", e[:, :1], math.cos(theta) * e[:, :1] + math.sin(theta) * e[:, 1:2]),
        ("random 3- and 4-dimensional subspaces of R⁸ (non-orthonormal columns, one repeated)",
         3.0 * torch.randn(8, 3, generator=g, dtype=torch.float64), torch.cat([B2, B2[:, :1]], dim=1)),
    ]
    if model is not None:
        from interp_norm.geometry import positional_subspace

        cases.append(("the token (W_E) and positional subspaces of this model",
                      model.W_E.detach().double().T, positional_subspace(model)))
    for what, A, B in cases:
        ref = _reference_angles_deg(A, B)
        got = _as_tensor(learner(A.clone(), B.clone()), "principal_angles_deg(A, B)")
        if got.ndim != 1 or got.numel() != ref.numel():
            raise _Fail(f"{what}: expected {ref.numel()} angles (min of the two ranks), got shape {tuple(got.shape)}; "
                        "drop the directions with (near-)zero singular value before comparing the bases")
        hint = ""
        if _is_close(torch.rad2deg(got.double()), ref, 0.05):
            hint = "Your angles are in radians: convert with torch.rad2deg"
        elif _is_close(got.double().sort().values, ref, 0.05):
            hint = "Sort them ascending"
        _close(got, ref, f"{what} (degrees)", atol=0.05, hint=hint)
    summary = ""
    if model is not None:
        ref = _reference_angles_deg(*cases[-1][1:])
        summary = f"; for this model's tok/pos subspaces the smallest is {float(ref[0]):.2f}°, the largest {float(ref[-1]):.2f}°"
    return f"right on {len(cases)} cases (a known 30° angle, rank-deficient random subspaces{', this model' if model is not None else ''}){summary}"


@_exercise("ln_coordinates")
def check_ln_coordinates(learner, model, cache) -> str:
    """``ln_coordinates(model, cache, layer)`` against (x − mean)/scale from ln2's *input* (resid_mid)."""
    lo, hi = math.inf, -math.inf
    for layer in range(model.cfg.n_layers):
        x = cache[act_name("resid_mid", layer)].double()  # what ln2 normalises
        scale = cache[act_name("scale", layer, "ln2")].double()
        ref = (x - x.mean(-1, keepdim=True)) / scale
        got = _as_tensor(learner(model, cache, layer), f"ln_coordinates(model, cache, {layer})", ref.shape, "[batch, pos, d_model]")
        w = model.blocks[layer].ln2.w.detach().double()
        # compared after multiplying by the gain g, so dimensions with tiny gains do not amplify rounding
        _close((got.double() - ref) * w, torch.zeros_like(ref), f"layer {layer}: g ⊙ (your u − (x − mean)/scale)", atol=1e-4,
               hint="Undo the affine map: u = (y − b) / g with b = ln2.b and g = ln2.w")
        m = got.double().pow(2).mean(-1)
        _close(m, 1 - model.cfg.eps / scale[..., 0] ** 2, f"layer {layer}: |u|²/N vs 1 − ε/scale²", atol=1e-4)
        lo, hi = min(lo, float(m.min())), max(hi, float(m.max()))
    return (f"u = (y − b)/g has mean 0 and |u|²/N = σ²/(σ²+ε) in all {model.cfg.n_layers} layers; |u|²/N lies in "
            f"[{lo:.6f}, {hi:.6f}]: inside the ellipsoid, near its surface")


# ============================================================================= 05 train


@_exercise("head_layernorm", uses_model=False)
def check_head_layernorm(learner, model, cache) -> str:
    """``head_layernorm(q, w, eps)`` against ``torch.nn.functional.layer_norm`` head by head, and the
    model's own ``hook_{q,k,v}_normed``."""
    cfg = model.cfg
    targets = normalised_targets(cfg.attn_norm)
    if not targets or cfg.norm_kind != "ln":
        raise ConfigError(
            f"check_head_layernorm needs a model with per-head LayerNorms (attn_norm 'qkv' or 'qk', norm_kind 'ln'); "
            f"this one has attn_norm={cfg.attn_norm!r}, norm_kind={cfg.norm_kind!r}"
        )
    n = 0
    for layer in range(cfg.n_layers):
        attn = model.blocks[layer].attn
        for t in targets:
            raw = cache[act_name(t, layer)]
            w = getattr(attn, f"{t}_norm").w.detach()
            got = _as_tensor(learner(raw.clone(), w.clone(), cfg.eps), "head_layernorm(q, w, eps)", raw.shape, "[batch, pos, head, d_head]")
            wh = w if w.ndim == 2 else w.expand(cfg.n_heads, -1)
            ref = torch.stack([torch.nn.functional.layer_norm(raw[:, :, h].double(), (cfg.d_head,), wh[h].double(), None, cfg.eps)
                               for h in range(cfg.n_heads)], dim=2)
            centred = raw.double() - raw.double().mean(-1, keepdim=True)
            unbiased = centred / (centred.var(-1, keepdim=True, unbiased=True) + cfg.eps).sqrt() * w.double()
            rms = raw.double() / (raw.double().pow(2).mean(-1, keepdim=True) + cfg.eps).sqrt() * w.double()
            hint = ("You used the unbiased variance (÷ (d_head − 1)); LayerNorm divides by d_head (unbiased=False)"
                    if _is_close(got, unbiased, 1e-5) else
                    "That is an RMSNorm: a LayerNorm subtracts the mean over d_head first" if _is_close(got, rms, 1e-5) else
                    "Normalise over d_head: (q − mean) / √(var + eps), then multiply by the gain w")
            _close(got, ref, f"layer {layer}, {t}: your LayerNorm vs torch.nn.functional.layer_norm", atol=1e-5, rtol=1e-5, hint=hint)
            _close(got, cache[act_name(f"{t}_normed", layer)], f"layer {layer}: yours vs hook_{t}_normed", atol=1e-5, rtol=1e-5)
            n += 1
    return f"equals torch.nn.functional.layer_norm per head and the model's hook_*_normed ({n} layer × target pairs)"


# ============================================================================= 06 production architectures


@_exercise("noised_argmax")
def check_noised_argmax(learner, model, cache, tokens) -> str:
    """``noised_argmax(model, cache, layer, kappa_q, kappa_k)`` against re-running the bridge with the
    noise hooked in after the q/k norms (``HeadNoise``) and reading the argmax of its own pattern."""
    from interp_norm.anatomy import anatomy
    from interp_norm.noise import HeadNoise

    anat = anatomy(model)
    g = torch.Generator().manual_seed(5)
    b, n = tokens.shape
    checked = 0
    for layer in range(anat.n_layers):
        la = anat[layer]
        kq = (torch.rand(b, n, la.n_heads, generator=g) - 0.5) * 0.8
        kk = (torch.rand(b, n, la.n_kv_heads, generator=g) - 0.5) * 0.8
        noise = HeadNoise(model, {(layer, "q"): kq, (layer, "k"): kk}, placement="after_norm", anat=anat)
        with torch.no_grad(), model.hooks(fwd_hooks=noise.hooks()):  # run_with_cache ignores fwd_hooks= on a bridge
            _, noisy = model.run_with_cache(tokens, names_filter=lambda nm: nm == la.hooks["pattern"])
        pattern = noisy[la.hooks["pattern"]]
        ref = pattern.argmax(-1)
        got = _as_tensor(learner(model, cache, layer, kq.clone(), kk.clone()), f"noised_argmax(model, cache, {layer}, ...)",
                         ref.shape, "[batch, head, query]")
        top2 = pattern.topk(2, -1).values
        clear = (top2[..., 0] - top2[..., 1]) > 1e-5  # rows whose winner is not a float tie
        bad = (got.long() != ref) & clear
        if bad.any():
            i = bad.nonzero()[0].tolist()
            hint = ""
            if int(got[tuple(i)]) > i[2]:
                hint = " (that key comes after the query: mask the keys a query may not read, attention_mask)"
            elif la.n_kv_heads != la.n_heads:
                hint = " (did each query head use the κ of *its* key/value head? see kv_head_of)"
            raise _Fail(f"layer {layer}, (batch, head, query) = {tuple(i)}: argmax {int(got[tuple(i)])}, "
                        f"re-running the model gives {int(ref[tuple(i)])}{hint}")
        checked += int(clear.sum())
    return f"{checked} noisy attention rows match re-running the model with the noise hooked in"


#: Every check, by exercise name (the learner's function name and the solution's name in solutions.py).
CHECKS = {
    f.exercise: f
    for f in (
        check_my_scores, check_most_important_head, check_prev_token_scores,
        check_patch_one, check_attribution_scores, check_head_faithfulness, check_most_necessary_reads, check_eap_errors,
        check_query_norm_ratio, check_mc_collapse_probability,
        check_principal_angles_deg, check_ln_coordinates,
        check_head_layernorm, check_noised_argmax,
    )
}

__all__ = ["CheckResult", "CHECKS", "PASS", "FAIL", "NOT_ATTEMPTED", *[f"check_{n}" for n in CHECKS]]
