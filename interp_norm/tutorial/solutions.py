"""Reference solutions of the tutorial exercises, one function per exercise.

The notebooks never execute these under the learner's names: ``scripts/tutorials/build_notebooks.py``
shows each function's source in a collapsed ``<details>`` block after its exercise, so Run All cannot
overwrite an attempt. ``tests/test_tutorials.py`` feeds every one of them to its check in
``checks.py`` (and a deliberately wrong variant, which must fail). They live in the package, not
beside the notebooks, so that they are not one click away in JupyterLab. Each function imports what it
needs itself, so the shown code can be copied into a notebook as is.
"""

from __future__ import annotations

# ============================================================================= 01 quickstart


def my_scores(model, cache, layer):
    import torch
    from interp_norm.core.hook_names import used_name

    # the q and k the scores use: hook_q / hook_k for Pre-Norm, hook_q_normed / ... for QK/QKV-Norm
    q = cache[used_name(model.cfg.attn_norm, "q", layer)]  # [batch, pos, head, d_head]
    k = cache[used_name(model.cfg.attn_norm, "k", layer)]
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / model.cfg.attn_scale
    if model.cfg.calibration == "paper":  # models with the paper's Checkpoint layers rescale scores
        scores = scores * model.blocks[layer].attn.calib_scores.factor
    n = scores.shape[-1]
    after_query = torch.triu(torch.ones(n, n, dtype=torch.bool), diagonal=1)
    return scores.masked_fill(after_query, float("-inf"))


def most_important_head(ablation):
    row = ablation.loc[ablation["loss_increase"].idxmax()]
    return int(row["layer"]), int(row["head"])


def prev_token_scores(model, tokens):
    import pandas as pd
    import torch
    from interp_norm.core.hook_names import act_name
    from interp_norm.core.task import PAD_ID

    names = [act_name("pattern", layer) for layer in range(model.cfg.n_layers)]
    with torch.no_grad():
        _, cache = model.run_with_cache(tokens, names_filter=lambda name: name in names)
    valid = tokens[:, 1:] != PAD_ID  # [batch, pos-1]: query positions 1.. that are not padding
    rows = []
    for layer, name in enumerate(names):
        prev = cache[name].diagonal(offset=-1, dim1=-2, dim2=-1)  # pattern[b, h, p, p-1]: [batch, head, pos-1]
        for head in range(model.cfg.n_heads):
            rows.append(dict(layer=layer, head=head, prev_token_score=float(prev[:, head][valid].mean())))
    return pd.DataFrame(rows)


# ============================================================================= 02 circuit


def patch_one(model, pairs, metric, layer, pos):
    import torch
    from interp_norm.core.hook_names import act_name

    name = act_name("resid_pre", layer)
    with torch.no_grad():
        _, clean_cache = model.run_with_cache(pairs.clean_tokens, names_filter=name)
        clean = metric(model(pairs.clean_tokens)).mean().item()
        corrupted = metric(model(pairs.corrupted_tokens)).mean().item()

        def restore(x, hook):
            x[:, pos] = clean_cache[hook.name][:, pos]
            return x

        patched = metric(model.run_with_hooks(pairs.corrupted_tokens, fwd_hooks=[(name, restore)])).mean().item()
    return (patched - corrupted) / (clean - corrupted)


def attribution_scores(model, pairs, metric):
    import pandas as pd
    import torch
    from interp_norm.core.hook_names import act_name

    names = [act_name("z", layer) for layer in range(model.cfg.n_layers)]
    with torch.no_grad():
        _, clean = model.run_with_cache(pairs.clean_tokens, names_filter=lambda name: name in names)
    saved = {}

    def keep(z, hook):  # keep the corrupted z and its gradient
        z.retain_grad()
        saved[hook.name] = z
        return z

    logits = model.run_with_hooks(pairs.corrupted_tokens, fwd_hooks=[(name, keep) for name in names])
    metric(logits).mean().backward()
    rows = []
    for layer, name in enumerate(names):
        z = saved[name]
        # the gradient of the batch *mean* already carries 1/batch: sum over batch, positions, d_head
        attr = ((clean[name] - z.detach()) * z.grad).sum(dim=(0, 1, 3))  # [head]
        rows += [dict(layer=layer, head=head, attribution=float(a)) for head, a in enumerate(attr)]
    model.zero_grad(set_to_none=True)
    return pd.DataFrame(rows)


def head_faithfulness(model, pairs, metric, heads_in_circuit):
    import torch
    from interp_norm.core.hook_names import act_name

    names = [act_name("z", layer) for layer in range(model.cfg.n_layers)]
    with torch.no_grad():
        _, corr = model.run_with_cache(pairs.corrupted_tokens, names_filter=lambda name: name in names)
        clean = metric(model(pairs.clean_tokens)).mean().item()
        corrupted = metric(model(pairs.corrupted_tokens)).mean().item()

        def knock_out(z, hook):  # heads outside the circuit get their corrupted output
            layer = names.index(hook.name)
            for head in range(model.cfg.n_heads):
                if (layer, head) not in heads_in_circuit:
                    z[:, :, head] = corr[hook.name][:, :, head]
            return z

        logits = model.run_with_hooks(pairs.clean_tokens, fwd_hooks=[(name, knock_out) for name in names])
    return (metric(logits).mean().item() - corrupted) / (clean - corrupted)


def most_necessary_reads(effects, attention, position):
    here = effects[effects["position"] == position]
    # most necessary: the largest accuracy drop when the cell alone is ablated (logit difference breaks ties)
    cell = here.sort_values(["accuracy_drop", "logit_diff_drop"], ascending=False).iloc[0]
    mine = attention[(attention["layer"] == cell["layer"]) & (attention["head"] == cell["head"])
                     & (attention["position"] == position)]
    return mine.loc[mine["mass"].idxmax(), "token_class"]


def eap_errors(model, pairs, metric):
    import pandas as pd
    from interp_norm import circuits

    exact = circuits.activation_patch(model, pairs, None, metric, "z", by="all")
    eap = circuits.attribution_patch(model, pairs, metric, "z", by="all", ig_steps=1)
    # per pair: the change of that pair's metric; cells in (layer, head) order, one column per pair
    exact_pp = exact.per_example.double() - exact.baseline.double()
    eap_pp = eap.per_example.double() - eap.baseline.double()
    error = (eap_pp - exact_pp).abs().mean(-1)  # mean over pairs of |estimate - exact|: no cancelling
    H = model.cfg.n_heads
    return pd.DataFrame([dict(layer=i // H, head=i % H, error=float(e)) for i, e in enumerate(error)])


# ============================================================================= 03 noise


def query_norm_ratio(model, tokens, level, seed):
    import torch
    from interp_norm.core.hook_names import act_name
    from interp_norm.noise import NormNoise

    name = act_name("q", 0)
    with torch.no_grad():
        _, clean = model.run_with_cache(tokens, names_filter=name)
        with NormNoise(model, level, targets="q", layers=[0], seed=seed):
            _, noisy = model.run_with_cache(tokens, names_filter=name)
    return noisy[name].norm(dim=-1) / clean[name].norm(dim=-1)  # [batch, pos, head]


def mc_collapse_probability(row, level, n_draws, seed):
    import torch
    from interp_norm import theory

    g = torch.Generator().manual_seed(seed)
    kappa = theory.NoiseLaw(level).sample((n_draws, row.shape[-1]), g).double()  # uniform, RMS = level
    collapsed = theory.collapse_condition_exact(row.double().expand_as(kappa), kappa)
    return collapsed.double().mean().item()


# ============================================================================= 04 geometry


def principal_angles_deg(A, B):
    import torch

    def orthonormal(M):  # an orthonormal basis of the column space (drops null directions)
        U, S, _ = torch.linalg.svd(M.double(), full_matrices=False)
        return U[:, S > S.max() * 1e-6]

    cosines = torch.linalg.svdvals(orthonormal(A).T @ orthonormal(B)).clamp(0, 1)
    return torch.rad2deg(torch.arccos(cosines)).sort().values


def ln_coordinates(model, cache, layer):
    from interp_norm.core.hook_names import act_name

    ln = model.blocks[layer].ln2
    y = cache[act_name("normalized", layer, "ln2")].double()  # g ⊙ (x − mean)/√(var + ε) + b
    return (y - ln.b.detach().double()) / ln.w.detach().double()


# ============================================================================= 05 train


def head_layernorm(q, w, eps):
    centred = q - q.mean(-1, keepdim=True)
    var = centred.pow(2).mean(-1, keepdim=True)  # population variance (divide by d_head, not d_head − 1)
    return centred / (var + eps).sqrt() * w


# ============================================================================= 06 production architectures


def noised_argmax(model, cache, layer, kappa_q, kappa_k):
    from interp_norm.anatomy import anatomy, attention_mask, attention_scores

    la = anatomy(model)[layer]
    scores = attention_scores(model, cache, layer, softcap=False)  # [batch, head, query, key], after norms and RoPE
    f_q = (1 + kappa_q).permute(0, 2, 1).unsqueeze(-1)  # [batch, head, query, 1]
    f_k = (1 + kappa_k)[:, :, list(la.kv_head_of)].permute(0, 2, 1).unsqueeze(-2)  # each query head reads its k/v head
    mask = attention_mask(la, scores.shape[-2], scores.shape[-1])  # causal (and sliding window)
    return (scores * f_q * f_k).masked_fill(~mask, float("-inf")).argmax(-1)


__all__ = [
    "my_scores", "most_important_head", "prev_token_scores",
    "patch_one", "attribution_scores", "head_faithfulness", "most_necessary_reads", "eap_errors",
    "query_norm_ratio", "mc_collapse_probability",
    "principal_angles_deg", "ln_coordinates",
    "head_layernorm",
    "noised_argmax",
]
