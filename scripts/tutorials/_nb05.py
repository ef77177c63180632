"""Tutorial 05 (train): its cells, in order (built into the .ipynb by ``build_notebooks.py``)."""

from __future__ import annotations

from _cells import code, difficulty, exercise, hints, md, setup, solution  # noqa: F401

# ============================================================================= 05 train

NB05 = [
    md("""
    # 05 · Train your own variant

    **What you will learn**
    1. the configuration objects: model, task and training recipe;
    2. a short CPU training run with checkpoints, resuming it, and what extending a run means;
    3. evaluating it and comparing it with a shipped model;
    4. a LayerNorm variant of QKV-Norm, and its per-head LayerNorm by hand.

    The shipped checkpoints were trained with `interp-norm train --preset cpu` for much longer; here we run a
    couple of hundred steps, enough to see learning start (about a minute on a laptop CPU).

    **Exercise:** 1 · a per-head LayerNorm by hand.
    """),
    code(setup("head_layernorm")),
    code("""
    import tempfile
    from pathlib import Path

    from interp_norm import AdditionTask, ModelConfig, TrainConfig
    from interp_norm.core.scoring import evaluate
    from interp_norm.core.hook_names import act_name
    from interp_norm.training.train import train
    """),
    md("""
    ## 1. Configurations
    **What you will learn:** what you can change. `ModelConfig.preset("cpu", attn_norm=...)` picks the
    architecture; `attn_norm` is one of `pre`, `qkv`, `qk` (QK-Norm, as in Qwen3 / Gemma 3 / OLMo 2) or
    `none`, and `norm_kind` is `rms` or `ln`. The task preset `cpu` is a smaller version of the paper's task.
    """),
    code("""
    task = AdditionTask.preset("cpu")
    model_cfg = ModelConfig.preset("cpu", attn_norm="qk", seed=0)
    train_cfg = TrainConfig.preset("cpu", max_steps=120, log_every=20, eval_every=60, eval_size=64,
                                   final_eval_size=128, checkpoint_every=60, seed=0, min_lr=2e-4)
    print(task)
    print({k: getattr(model_cfg, k) for k in ("attn_norm", "norm_kind", "n_layers", "n_heads", "d_model", "d_head")})
    print({k: getattr(train_cfg, k) for k in ("lr", "batch_size", "max_steps", "grad_clip")})
    """),
    md("""
    ## 2. Train, checkpoint, resume
    **What you will learn:** how runs are stored, and what resuming does. A run folder holds step checkpoints
    (safetensors weights, JSON config with checksums, the training curve) and a `LATEST` pointer;
    `resume=True` continues from the newest one.
    """),
    code("""
    run_dir = Path(tempfile.mkdtemp(prefix="interp-norm-tutorial-")) / "qk-run"
    model, curve = train(model_cfg, task, train_cfg, run_dir, progress=False)
    print(sorted(p.name for p in run_dir.iterdir()))
    curve.tail()
    """),
    md("""
    **Resuming vs extending.** Resuming with the *same* `max_steps` (`--steps` on the command line), e.g. after
    an interruption, continues bit-identically: the weights equal those of an uninterrupted run. Below we
    resume with a *larger* `max_steps`, which extends the run. What that does to the learning rate is a
    choice, and this is the one made here: **the cosine schedule keeps the length it started with** (recorded
    in the checkpoint), so the extension continues the already decayed schedule and the extra steps run at
    `min_lr`; the learning rate never jumps back up to its peak (there is no restart or second warm-up).
    Training says so with a warning when the extension starts. That is why `train_cfg` above sets
    `min_lr=2e-4` (`--min-lr`): with the preset's `min_lr=0` the extra steps would run at learning rate 0 and
    leave the weights unchanged (training warns about that too). To train longer *on a full schedule*, start a
    new run with the larger total. (The paper's `"plateau"` schedule has no planned length: extending it is
    the same as having started with the larger total.) The table shows the learning rate around the step
    where the extension starts: it decays to `min_lr` at step 120 and stays there.
    """),
    code("""
    first_steps = train_cfg.max_steps
    model, curve = train(model_cfg, task, train_cfg.replace(max_steps=first_steps + 60), run_dir, resume=True, progress=False)
    display(curve[curve["step"].between(first_steps - 40, first_steps + 40)][["step", "lr", "loss", "acc"]])
    import plotly.express as px
    px.line(curve, x="examples", y=["loss", "acc"], title="Training curve (loss and per-token accuracy)")
    """),
    md("""
    ## 3. Evaluate and compare
    **What you will learn:** per-split accuracy. `evaluate` reports teacher-forced per-token accuracy and
    exact match (greedy generation) on fixed, seeded test sets.
    """),
    code("""
    mine, info = load_with_info(run_dir)
    shipped_name = "qk" if "qk" in set(list_pretrained()["name"]) else "pre"
    shipped, shipped_info = load_with_info(shipped_name)
    table = pd.concat([
        evaluate(mine, info.task, size=128).assign(model=f"mine ({info.step} steps)"),
        evaluate(shipped, shipped_info.task, size=128).assign(model=f"shipped {shipped_name} ({shipped_info.step} steps)"),
    ])
    table[["model", "split", "per_token_acc", "exact_match"]]
    """),
    md("""
    ## 4. A LayerNorm variant
    **What you will learn:** the per-head norms of QKV-Norm. With `norm_kind="ln"` each head's query, key and
    value are LayerNorm-ed over `d_head` after the projection (with a learned per-head gain and no bias). We
    train a `tiny` model for 60 steps on the same task so the gains move away from 1.
    """),
    code("""
    ln_cfg = ModelConfig.preset("tiny", attn_norm="qkv", norm_kind="ln", seed=1)
    ln_model, _ = train(ln_cfg, task, TrainConfig.preset("cpu", max_steps=60, log_every=20, eval_every=60,
                        eval_size=32, final_eval_size=32, checkpoint_every=60), run_dir.parent / "ln-run", progress=False)
    with torch.no_grad():
        _, ln_cache = ln_model.run_with_cache(task.test_set("id", 32).tokens)
    print("q gains of layer 0, head 0:", ln_model.blocks[0].attn.q_norm.w[0].detach().numpy().round(3))
    """),
    md(f"""
    ### Exercise 1 — a per-head LayerNorm by hand
    {difficulty(2, 10)}

    Write `head_layernorm(q, w, eps)`: `q` is `[batch, pos, head, d_head]` (the raw `hook_q`, `hook_k` or
    `hook_v`), `w` the gain (`[head, d_head]`), `eps` the model's `cfg.eps`. Return the LayerNorm over `d_head`
    times the gain. The check feeds your function the raw q, k and v of every layer and compares with
    `torch.nn.functional.layer_norm` (head by head) and with the model's own `hook_q_normed` / `hook_k_normed` /
    `hook_v_normed`.

    {hints("Subtract the mean over the last dimension, divide by √(var + eps), multiply by `w` (it broadcasts over batch and pos).",
           "LayerNorm uses the *population* variance: `mean((x - mean)²)`, not `torch.var`'s default, which divides by d_head − 1.")}
    """),
    exercise("head_layernorm", """
    def head_layernorm(q, w, eps):
        # YOUR CODE HERE: return the per-head LayerNorm of q (over d_head) times the gain w
        return None

    check_head_layernorm(head_layernorm, ln_model, ln_cache)
    """),
    solution("head_layernorm"),
    md("""
    From the command line the same run is `interp-norm train --out runs/qk --attn-norm qk --steps 300`, and
    `interp-norm dashboard runs/qk` builds the full dashboard for it, next to any other checkpoints you pass.
    """),
]
