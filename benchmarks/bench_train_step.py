"""Hook overhead: one training step of HookedNormTransformer vs a plain-PyTorch twin without hooks.

The twin below is written independently (plain tensors, no HookPoint) and loads the same weights;
the script first checks both give the same loss, then times interleaved steps so both see the same
machine load, and prints the median time per step and the ratio per variant (target <= 1.10x).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_train_step.py
"""

from __future__ import annotations

import argparse
import math
import statistics
import time

import torch
import torch.nn.functional as F

from interp_norm import AdditionTask, HookedNormTransformer, ModelConfig
from interp_norm.core.task import next_token_targets


def _norm(x, kind, eps):
    if kind == "ln":
        x = x - x.mean(-1, keepdim=True)
    return x / (x.pow(2).mean(-1, keepdim=True) + eps).sqrt()


def _ln(x, w, b, eps):
    return F.layer_norm(x, x.shape[-1:], w, b, eps)


def plain_forward(P: dict[str, torch.Tensor], cfg: ModelConfig, tokens: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
    """The same architecture as plain tensor code, reading parameters from a state-dict-like mapping."""
    b, n = tokens.shape
    x = P["W_E"][tokens]
    pos = (torch.arange(n).expand(b, n) + offset.view(b, 1)).unsqueeze(-1).float() * P["pos_embed.freqs"]
    x = x + F.pad(torch.cat([pos.sin(), pos.cos()], -1), (0, cfg.d_model - 2 * cfg.n_freq))
    mask = torch.tril(torch.ones(n, n, dtype=torch.bool))
    for l in range(cfg.n_layers):
        pre = f"blocks.{l}."
        if cfg.attn_norm == "pre":
            xn = _norm(x, cfg.norm_kind, cfg.eps)
            w = P[pre + "ln1.w"]
            xq, xk, xv = (xn * w[0], xn * w[1], xn * w[2]) if w.ndim == 2 else (xn * w,) * 3
        else:
            xq = xk = xv = x
        q = torch.einsum("bpd,hde->bphe", xq, P[pre + "attn.W_Q"])
        k = torch.einsum("bpd,hde->bphe", xk, P[pre + "attn.W_K"])
        v = torch.einsum("bpd,hde->bphe", xv, P[pre + "attn.W_V"])
        if cfg.attn_norm in ("qk", "qkv"):
            q = _norm(q, cfg.norm_kind, cfg.eps) * P[pre + "attn.q_norm.w"]
            k = _norm(k, cfg.norm_kind, cfg.eps) * P[pre + "attn.k_norm.w"]
        if cfg.attn_norm == "qkv":
            v = _norm(v, cfg.norm_kind, cfg.eps) * P[pre + "attn.v_norm.w"]
        s = torch.einsum("bqhd,bkhd->bhqk", q, k) / cfg.attn_scale
        a = s.masked_fill(~mask, float("-inf")).softmax(-1)
        z = torch.einsum("bhqk,bkhd->bqhd", a, v)
        x = x + torch.einsum("bqhd,hdm->bqm", z, P[pre + "attn.W_O"]) + P[pre + "attn.b_O"]
        h = _ln(x, P[pre + "ln2.w"], P[pre + "ln2.b"], cfg.eps)
        h = F.relu(h @ P[pre + "mlp.W_in"] + P[pre + "mlp.b_in"]) @ P[pre + "mlp.W_out"] + P[pre + "mlp.b_out"]
        x = x + h
    x = _ln(x, P["ln_final.w"], P["ln_final.b"], cfg.eps)
    n_lin = len(cfg.head_hidden) + 1
    for i in range(n_lin):
        x = x @ P[f"head.layers.{i}.weight"].T + P[f"head.layers.{i}.bias"]
        if i < n_lin - 1:
            x = F.relu(x)
    return x


class PlainTwin(torch.nn.Module):
    def __init__(self, model: HookedNormTransformer):
        super().__init__()
        self.cfg = model.cfg
        self.params = torch.nn.ParameterDict(
            {k.replace(".", "__"): torch.nn.Parameter(v.detach().clone()) for k, v in model.named_parameters()}
        )

    def forward(self, tokens, offset):
        P = {k.replace("__", "."): v for k, v in self.params.items()}
        return plain_forward(P, self.cfg, tokens, offset)


def loss_of(logits, tokens):
    return F.cross_entropy(logits.flatten(0, 1), next_token_targets(tokens).flatten(), ignore_index=-100)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--preset", default="cpu")
    args = ap.parse_args()
    torch.set_num_threads(1)
    task = AdditionTask.preset("cpu")
    print(f"one AdamW training step, preset={args.preset}, batch={args.batch}, {args.steps} interleaved steps, 1 thread")
    print(f"{'variant':8s} {'hooked ms':>10s} {'plain ms':>10s} {'ratio':>7s}")
    for attn_norm in ("pre", "qkv", "qk", "none"):
        model = HookedNormTransformer(ModelConfig.preset(args.preset, attn_norm=attn_norm)).train()
        twin = PlainTwin(model).train()
        batch = task.sample_batch(args.batch, "id", seed=0)
        offset = torch.randint(0, 51, (args.batch,), generator=torch.Generator().manual_seed(0))
        l1 = loss_of(model(batch.tokens, pos_offset=offset), batch.tokens)
        l2 = loss_of(twin(batch.tokens, offset), batch.tokens)
        assert math.isclose(float(l1), float(l2), rel_tol=1e-5), (float(l1), float(l2))
        opt_h = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.01)
        opt_p = torch.optim.AdamW(twin.parameters(), lr=3e-4, weight_decay=0.01)

        def step_hooked():
            opt_h.zero_grad(set_to_none=True)
            model(batch.tokens, return_type="loss", pos_offset=offset).backward()
            opt_h.step()

        def step_plain():
            opt_p.zero_grad(set_to_none=True)
            loss_of(twin(batch.tokens, offset), batch.tokens).backward()
            opt_p.step()

        for _ in range(3):
            step_hooked(), step_plain()
        th, tp = [], []
        for i in range(args.steps):
            for fn, store in ((step_hooked, th), (step_plain, tp)) if i % 2 == 0 else ((step_plain, tp), (step_hooked, th)):
                t0 = time.perf_counter()
                fn()
                store.append(time.perf_counter() - t0)
        mh, mp = statistics.median(th) * 1e3, statistics.median(tp) * 1e3
        print(f"{attn_norm:8s} {mh:10.2f} {mp:10.2f} {mh / mp:7.3f}x")


if __name__ == "__main__":
    main()
