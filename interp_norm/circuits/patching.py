"""Exact activation patching, batched: many patch cells per forward pass, same numbers as TransformerLens.

TransformerLens's ``patching.get_act_patch_*`` run one full forward pass per cell. Here a chunk of
``K`` cells runs as ``K`` stacked copies of the corrupted batch, each copy patched in its own
cell, and the metric is read per copy. Two engines compute those copies:

* ``method="incremental"`` (our :class:`~interp_norm.model.HookedNormTransformer`): a patch at
  layer ``l``, positions ``>= p`` cannot change anything before layer ``l`` or at positions
  ``< p`` (causal attention), so each chunk starts from the corrupted run's cached activations at
  the patched layer and stage, recomputes only positions ``>= p`` (earlier keys/values come from
  the cache), and in the last layer only the positions the metric reads. It reimplements the
  block arithmetic on the model's own weights (attention; LayerNorm + MLP with fused kernels),
  calls the model's own attention norms and output head, and checks itself against
  ``model(tokens)`` once per model before use (on failure ``method="auto"`` falls back to hooks).
* ``method="hooks"`` (any TransformerLens-protocol model, e.g. a ``TransformerBridge``): full
  forward passes of the stacked batch with one hook per activation name that writes each copy's
  clean slice (for our model the pass starts at the patched layer, :func:`forward_from`).

Cells that cannot change the metric -- the clean and corrupted activations agree in the cell
for every example (e.g. positions before the corrupted token), or (incremental engine) the position
comes after the last one the metric reads -- are the corrupted baseline without a forward pass.

Both equal ``transformer_lens.patching`` on the same model, inputs and metric (tests check
every cell to 1e-5). ``benchmarks/bench_patching.py`` measures the speed-up.
"""

from __future__ import annotations

import itertools
import warnings
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional, Sequence, Union

import numpy as np
import pandas as pd
import torch
import torch.nn.functional as F
from jaxtyping import Float, Int
from torch import Tensor
from tqdm.auto import tqdm

from interp_norm.circuits.pairs import LogitDiff, PatchingPairs
from interp_norm.errors import HookNameError, PatchingError

# activation -> (kind, hook name template)
ACTIVATIONS: dict[str, tuple[str, str]] = {
    "resid_pre": ("resid", "blocks.{l}.hook_resid_pre"),
    "resid_mid": ("resid", "blocks.{l}.hook_resid_mid"),
    "resid_post": ("resid", "blocks.{l}.hook_resid_post"),
    "attn_out": ("resid", "blocks.{l}.hook_attn_out"),
    "mlp_out": ("resid", "blocks.{l}.hook_mlp_out"),
    "z": ("head", "blocks.{l}.attn.hook_z"),
    "q": ("head", "blocks.{l}.attn.hook_q"),
    "k": ("head", "blocks.{l}.attn.hook_k"),
    "v": ("head", "blocks.{l}.attn.hook_v"),
    "pattern": ("pattern", "blocks.{l}.attn.hook_pattern"),
}
# (kind, by) -> axis names, in TransformerLens's order
AXES: dict[tuple[str, str], tuple[str, ...]] = {
    ("resid", "pos"): ("layer", "pos"),
    ("resid", "all"): ("layer",),
    ("head", "pos"): ("layer", "pos", "head"),
    ("head", "all"): ("layer", "head"),
    ("pattern", "pos"): ("layer", "head", "dest_pos"),
    ("pattern", "all"): ("layer", "head"),
    ("pattern", "dest_src"): ("layer", "head", "dest_pos", "src_pos"),
}
# stages of one block, in computation order (incremental engine)
_ORDER = ("resid_pre", "q", "k", "v", "pattern", "z", "attn_out", "resid_mid", "mlp_out", "resid_post")
_KEYISH = ("resid_pre", "k", "v")  # a patch at row p changes every query row >= p in its own layer

MetricFn = Callable[[Tensor], Tensor]


def hook_name(activation: str, layer: int) -> str:
    """TransformerLens hook name of ``activation`` in ``layer`` (``z`` -> ``blocks.{l}.attn.hook_z``)."""
    if activation not in ACTIVATIONS:
        raise PatchingError(f"unknown activation {activation!r}; choose one of {list(ACTIVATIONS)}")
    return ACTIVATIONS[activation][1].format(l=layer)


# ----------------------------------------------------------------------------- result


@dataclass
class PatchResult:
    """Patching (or attribution) results over a grid of cells, with per-example values.

    ``values`` has TransformerLens's shape for the sweep (e.g. ``[n_layers, pos, n_heads]`` for
    ``z`` by position) or one entry per row of ``index_df`` when explicit cells were given; it is
    the batch mean of the patched metric. ``baseline``/``clean`` are the unpatched corrupted and
    clean metric per example. For attribution results ``values`` is ``baseline.mean()`` plus the
    estimated effect, so :meth:`effect` compares directly with exact patching.
    """

    activation: str
    by: str
    axis_names: list[str]
    values: Tensor
    index_df: pd.DataFrame
    per_example: Optional[Tensor] = None  # [n_cells, batch]
    baseline: Optional[Tensor] = None
    clean: Optional[Tensor] = None
    metric_name: str = "metric"
    method: str = "exact"
    flat: bool = False

    def effect(self) -> Tensor:
        """Patched minus unpatched corrupted metric: what the patch changes."""
        if self.baseline is None:
            raise PatchingError("this result has no corrupted baseline")
        return self.values - self.baseline.mean()

    def normalized(self) -> Tensor:
        """(patched - corrupted) / (clean - corrupted) on batch means: 0 = no effect, 1 = fully restored."""
        if self.baseline is None or self.clean is None:
            raise PatchingError("normalized() needs clean and corrupted baselines; patch with pairs or clean_tokens")
        return (self.values - self.baseline.mean()) / (self.clean.mean() - self.baseline.mean())

    def to_dataframe(self) -> pd.DataFrame:
        """One row per cell: the axis indices, ``value``, ``effect`` and ``normalized`` where known."""
        df = self.index_df.copy()
        df.insert(0, "activation", self.activation)
        df["value"] = self.values.detach().reshape(-1).cpu().numpy()
        if self.baseline is not None:
            df["effect"] = self.effect().detach().reshape(-1).cpu().numpy()
        if self.baseline is not None and self.clean is not None:
            df["normalized"] = self.normalized().detach().reshape(-1).cpu().numpy()
        df["metric"] = self.metric_name
        df["method"] = self.method
        return df


# ----------------------------------------------------------------------------- helpers


def _device(model) -> torch.device:
    try:
        return next(model.parameters()).device
    except (StopIteration, AttributeError):
        return torch.device(getattr(model.cfg, "device", None) or "cpu")


def _require_eval(model) -> None:
    if any(m.training for m in model.modules()):
        raise PatchingError("the model is in training mode; call model.eval() before patching (dropout etc. would vary per copy)")


def _is_ours(model) -> bool:
    from interp_norm.model import HookedNormTransformer

    return isinstance(model, HookedNormTransformer)


def forward_from(model, layer: int, resid: Float[Tensor, "batch pos d_model"]) -> Float[Tensor, "batch pos vocab"]:
    """Run a :class:`HookedNormTransformer` from ``blocks[layer]``'s input to the logits (hooks fire)."""
    if not _is_ours(model):
        raise PatchingError("forward_from needs a HookedNormTransformer; run other models from the tokens")
    for blk in model.blocks[layer:]:
        resid = blk(resid)
    return model.head(model.ln_final(resid))


def _grid_cells(axes: Sequence[str], sizes: dict[str, int]) -> Tensor:
    ranges = [range(sizes[a]) for a in axes]
    return torch.tensor(list(itertools.product(*ranges)), dtype=torch.long).reshape(-1, len(axes))


def _row_axis(kind: str, by: str) -> Optional[int]:
    """Which cell column is the (destination) position, or None for all-position cells."""
    if by == "all":
        return None
    return 2 if kind == "pattern" else 1


def _cell_mask(kind: str, by: str, cells: Tensor, rows: Tensor, n_pos: int, n_heads: int, n_keys: int) -> Tensor:
    """Bool mask, broadcastable to the stacked activation [K, b, ...], True where copy k is patched.

    Layouts: resid [K, b, R, d]; head [K, b, R, h, dh]; pattern [K, b, h, R, keys]; R = ``rows``
    (absolute positions present in the tensor).
    """
    K, R = cells.shape[0], rows.numel()
    loc = torch.full((n_pos,), -1, dtype=torch.long)
    loc[rows.cpu()] = torch.arange(R)
    k = torch.arange(K)
    if kind == "resid":
        m = torch.zeros(K, 1, R, 1, dtype=torch.bool)
        if by == "all":
            m[:] = True
        else:
            r = loc[cells[:, 1]]
            ok = r >= 0
            m[k[ok], 0, r[ok], 0] = True
    elif kind == "head":
        m = torch.zeros(K, 1, R, n_heads, 1, dtype=torch.bool)
        if by == "all":
            m[k, 0, :, cells[:, 1], 0] = True
        else:
            r = loc[cells[:, 1]]
            ok = r >= 0
            m[k[ok], 0, r[ok], cells[ok, 2], 0] = True
    else:  # pattern
        m = torch.zeros(K, 1, n_heads, R, n_keys, dtype=torch.bool)
        h = cells[:, 1]
        if by == "all":
            m[k, 0, h] = True
        else:
            r = loc[cells[:, 2]]
            ok = r >= 0
            if by == "pos":
                m[k[ok], 0, h[ok], r[ok], :] = True
            else:
                src = cells[:, 3]
                ok &= src < n_keys
                m[k[ok], 0, h[ok], r[ok], src[ok]] = True
    return m


def _select_rows(kind: str, clean: Tensor, rows: Tensor, n_keys: int) -> Tensor:
    if kind == "pattern":
        return clean[:, :, rows][..., :n_keys]
    return clean[:, rows]


def _causal_softmax(scores: Tensor, causal: Tensor, dim: int = -1) -> Tensor:
    """Softmax over ``dim`` with ``~causal`` entries masked out.

    Written out because ``Tensor.softmax`` is several times slower on CPU for the short key
    axes of these models; equal to ``scores.masked_fill(~causal, -inf).softmax(dim)`` up to rounding.
    """
    m = scores.masked_fill(~causal, float("-inf")).amax(dim, keepdim=True)
    e = (scores - m).exp() * causal
    return e / e.sum(dim, keepdim=True)


def _cell_differs(kind: str, by: str, cells: Tensor, clean_acts: list, corr_acts: list) -> Tensor:
    """[n_cells, batch] bool: does the clean value differ from the corrupted one in the cell's slice?"""
    per_layer = []
    for a, c in zip(clean_acts, corr_acts):
        ne = a.to(c.device, c.dtype) != c
        per_layer.append(ne if kind == "pattern" else ne.any(-1))
    M = torch.stack(per_layer).cpu()  # [L, b, ...]
    l = cells[:, 0]
    if kind == "resid":
        return M[l, :, cells[:, 1]] if by == "pos" else M.any(-1)[l]
    if kind == "head":
        return M[l, :, cells[:, 1], cells[:, 2]] if by == "pos" else M.any(2)[l, :, cells[:, 1]]
    if by == "pos":
        return M.any(-1)[l, :, cells[:, 1], cells[:, 2]]
    if by == "all":
        return M.any(-1).any(-1)[l, :, cells[:, 1]]
    return M[l, :, cells[:, 1], cells[:, 2], cells[:, 3]]


def _eval_metric(metric: MetricFn, logits: Tensor, K: int, b: int) -> Tensor:
    """Metric per copy: [K, b] (per-example) or [K] (a metric that only returns a scalar)."""
    if getattr(metric, "supports_stacked", False):
        out = metric(logits)
        if out.shape != (K * b,):
            raise PatchingError(f"metric returned shape {tuple(out.shape)} for {K} stacked copies of {b} examples")
        return out.view(K, b)
    outs = [torch.as_tensor(metric(logits[i * b : (i + 1) * b])) for i in range(K)]
    if all(o.ndim == 0 for o in outs):
        return torch.stack(outs)
    if any(o.shape != (b,) for o in outs):
        raise PatchingError(
            f"a metric must map logits [batch, pos, vocab] to per-example values [batch] (or a scalar); got shape "
            f"{tuple(outs[0].shape)} for batch {b}"
        )
    return torch.stack(outs)


def _clean_act(clean_cache: Mapping[str, Tensor], name: str) -> Tensor:
    try:
        return clean_cache[name]
    except KeyError:
        raise HookNameError(
            f"the clean cache has no {name!r}; run model.run_with_cache(clean_tokens) without a names_filter that drops it"
        ) from None


# ----------------------------------------------------------------------------- incremental engine


_ENGINE_CHECKED: "weakref.WeakSet" = weakref.WeakSet()


class _Incremental:
    """Recompute only what a patch can change and the metric can see.

    Holds the corrupted run's cache. A patch in layer ``l`` leaves layers ``< l`` untouched; in
    each later layer a row (position) of one copy and one example is recomputed only if its
    input or one of the keys/values it attends to changed (causal attention: everything at or
    after the first changed row), and only if it can still reach a position the metric reads
    for that example (in the last layer: exactly the read positions). Row-wise work (norms,
    projections, MLP, output head) runs on those rows only, and so does attention: per (copy,
    example) with the cached keys/values, changed rows replaced. Only changed residual rows are
    kept between layers.
    """

    def __init__(self, model, tokens: Tensor, read_mask: Optional[Tensor]):
        self.model = model
        cfg = model.cfg
        self.cfg = cfg
        self.L, self.H, self.dh = cfg.n_layers, cfg.n_heads, cfg.d_head
        want = ("hook_resid_pre", "hook_q", "hook_k", "hook_v", "hook_q_normed", "hook_k_normed", "hook_v_normed",
                "hook_pattern", "hook_z", "hook_attn_out", "hook_resid_mid", "hook_mlp_out", "hook_resid_post")
        with torch.no_grad():
            logits, cache = model.run_with_cache(tokens, names_filter=lambda n: n.rsplit(".", 1)[-1] in want)
        self.logits = logits
        self.b, self.n = tokens.shape
        dev = tokens.device
        if read_mask is None:
            read_mask = torch.ones(self.b, self.n, dtype=torch.bool, device=dev)
        read_mask = read_mask.to(dev).expand(self.b, self.n)
        # positions after an example's last read position cannot influence the metric
        any_read = read_mask.any(0).nonzero().flatten()
        self.n_eff = int(any_read.max()) + 1 if any_read.numel() else self.n
        rm = read_mask[:, : self.n_eff]
        self.need_last = rm  # [b, n_eff]: rows whose logits the metric reads
        self.need = rm.flip(-1).long().cumsum(-1).flip(-1) > 0  # rows at or before an example's last read row
        self.c: list[dict[str, Tensor]] = []
        self.w: list[dict[str, Tensor]] = []
        ne = self.n_eff
        self.full = [{a: cache[ACTIVATIONS[a][1].format(l=l)] for a in _ORDER} for l in range(self.L)]
        for l in range(self.L):
            d = dict(self.full[l])
            d["q_used"] = cache[f"blocks.{l}.attn.hook_q_normed"] if cfg.attn_norm in ("qk", "qkv") else d["q"]
            d["k_used"] = cache[f"blocks.{l}.attn.hook_k_normed"] if cfg.attn_norm in ("qk", "qkv") else d["k"]
            d["v_used"] = cache[f"blocks.{l}.attn.hook_v_normed"] if cfg.attn_norm == "qkv" else d["v"]
            d = {k: (v[:, :, :ne, :ne] if k == "pattern" else v[:, :ne]) for k, v in d.items()}
            d["k_t"] = d["k_used"].permute(0, 2, 1, 3).contiguous()  # [b, h, keys, dh]
            d["v_t"] = d["v_used"].permute(0, 2, 1, 3).contiguous()
            self.c.append(d)
            a = model.blocks[l].attn
            flat = lambda W: W.permute(1, 0, 2).reshape(W.shape[1], -1)  # noqa: E731
            self.w.append(dict(Q=flat(a.W_Q), K=flat(a.W_K), V=flat(a.W_V), O=a.W_O.reshape(-1, a.W_O.shape[-1]), bO=a.b_O))
        self.causal = torch.tril(torch.ones(ne, ne, dtype=torch.bool, device=dev))
        # self-check (once per model object): recomputing every row must reproduce the logits
        if model in _ENGINE_CHECKED:
            return
        with torch.no_grad():
            full = self.run(0, "resid_pre", None, torch.ones(1, 1, ne, dtype=torch.bool, device=dev), force_all=True)
        err = float((full[0, :, :ne] - logits[:, :ne]).abs().max())
        scale = float(logits.abs().max()) + 1.0
        if not err <= 1e-4 * scale:
            raise PatchingError(
                f"the incremental patching engine disagrees with model(tokens) by {err:.3g}; the model's forward "
                "has changed -- use method='hooks'"
            )
        _ENGINE_CHECKED.add(model)

    # -- pieces of one block ------------------------------------------------------------------
    def _attn_in(self, blk, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        if self.cfg.attn_norm != "pre":
            return x, x, x
        out = blk.ln1(x)
        return out if isinstance(out, tuple) else (out, out, out)

    def _proj(self, x: Tensor, W: Tensor) -> Tensor:
        return (x @ W).unflatten(-1, (self.H, self.dh))

    def _norm(self, attn, which: str, x: Tensor) -> Tensor:
        an = self.cfg.attn_norm
        if which in ("q", "k") and an in ("qk", "qkv") or which == "v" and an == "qkv":
            return getattr(attn, f"{which}_norm")(x, getattr(attn, f"hook_{which}_scale"), getattr(attn, f"hook_{which}_normed"))
        return x

    def _mlp(self, blk, x: Tensor) -> Tensor:
        """``blk.mlp(blk.ln2(x))`` with fused kernels (LayerNorm with bias, ReLU MLP); the
        self-check against the model's forward guards the equivalence."""
        ln, mlp = blk.ln2, blk.mlp
        h = F.layer_norm(x, x.shape[-1:], ln.w, ln.b, ln.eps)
        return F.linear(F.relu(F.linear(h, mlp.W_in.T, mlp.b_in), inplace=True), mlp.W_out.T, mlp.b_out)

    def _groups(self, idx: tuple) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """Rows ``idx`` = (copy, example, position), sorted, grouped by (copy, example): the
        group's copy and example, and each row's group and slot within its group."""
        kidx, bidx, _ = idx
        keys, g_of, counts = torch.unique_consecutive(kidx * self.b + bidx, return_inverse=True, return_counts=True)
        slot = torch.arange(len(kidx), device=kidx.device) - (counts.cumsum(0) - counts)[g_of]
        return keys // self.b, keys % self.b, g_of, slot

    def _attend(self, q_rows: Tensor, ridx: Tensor, g_of: Tensor, slot: Tensor, k_g: Tensor, v_g: Tensor) -> Tensor:
        """z [M, h, dh] of query rows at positions ``ridx`` against their own (copy, example)'s keys.

        The rows are packed per group (``g_of``, ``slot``) into a zero-padded [g, h, w, dh] block
        against the groups' keys/values ``k_g``/``v_g`` [g, h, keys, dh]. Why: with mixed-length
        examples the recomputed rows are a small ragged subset of copies x examples x positions,
        and a dense block over all of them was most of the engine's time.
        """
        g, nk = k_g.shape[0], k_g.shape[2]
        w = int(slot.max()) + 1
        q = q_rows.new_zeros(g, self.H, w, self.dh)
        q[g_of, :, slot] = q_rows
        pos = ridx.new_zeros(g, w)  # padding rows: position 0 (a valid, discarded softmax)
        pos[g_of, slot] = ridx
        causal = self.causal[pos, :nk].unsqueeze(1)  # [g, 1, w, keys]
        scores = (q @ k_g.transpose(-1, -2)) / self.cfg.attn_scale
        z = _causal_softmax(scores, causal) @ v_g  # [g, h, w, dh]
        return z[g_of, :, slot]

    def _dense(self, l: int, name: str, K: int) -> Tensor:
        t = self.c[l][name]
        return t.unsqueeze(0).expand(K, *t.shape)

    def _rows(self, l: int, X: Optional[Tensor], D: Tensor, mask: Tensor) -> Tensor:
        """resid_pre rows ``mask`` [K, b, n] of layer ``l``: the cache, with the changed rows ``X``
        ([count(D), d], in ``D``'s order) in place. Why: only changed rows are kept, not a dense
        [K, b, n, d] copy per layer."""
        if X is not None and torch.equal(mask, D):
            return X
        _, bidx, ridx = mask.nonzero(as_tuple=True)
        out = self.c[l]["resid_pre"][bidx, ridx]
        if X is not None:
            slot = torch.full(D.shape, -1, dtype=torch.long, device=D.device)
            slot[D] = torch.arange(len(X), device=D.device)
            s = slot[mask]
            hit = s >= 0
            out[hit] = X[s[hit]]
        return out

    def _layer(
        self, l: int, X: Optional[Tensor], D: Tensor, K: int, last: bool,
        S: Optional[str] = None, patch: Optional[Callable] = None, P: Optional[Tensor] = None, force_all: bool = False,
    ) -> tuple[Tensor, Tensor]:
        """One block for K copies. ``D`` [K, b, n] marks the resid_pre rows that differ from the
        cache and ``X`` [count(D), d] holds them (None = none differ); ``S``/``patch``/``P`` are
        the patch of this layer (stage, function on the dense stage tensor or its rows, [K, b, n]
        rows it touches). Returns (resid_post rows ``A`` as [M, d], ``A`` [K, b, n])."""
        blk, c, w = self.model.blocks[l], self.c[l], self.w[l]
        attn = blk.attn
        need = torch.ones_like(self.need) if force_all else (self.need_last if last else self.need)
        if S == "resid_pre":
            dense = self._dense(l, "resid_pre", K).clone()
            if X is not None:
                dense[D] = X
            D = D | P
            X = patch(dense, None)[D]
        # rows whose attention output may change
        if S in (None, "resid_pre"):
            A = (D.long().cumsum(-1) > 0) & need
        elif S in ("k", "v"):
            A = (P.long().cumsum(-1) > 0) & need
        else:
            A = P & need
        if not A.any():
            return None, A
        kidx, bidx, ridx = idx = A.nonzero(as_tuple=True)
        si = _ORDER.index(S) if S is not None else 0
        x_in = None  # attention inputs of rows A, when they coincide with the key rows
        xA = self._rows(l, X, D, A) if si <= _ORDER.index("attn_out") else None  # resid_pre rows A
        if si <= _ORDER.index("v"):
            gk, ge, g_of, slot = self._groups(idx)
            # a key row matters only to query rows at or after it in its own copy and example
            seen = A.flip(-1).long().cumsum(-1).flip(-1) > 0
            nk = int(ridx.max()) + 1
            # keys/values [g, h, keys, dh] of each (copy, example) group: the cache, changed rows replaced
            k_g = c["k_t"][:, :, :nk].index_select(0, ge)
            v_g = c["v_t"][:, :, :nk].index_select(0, ge)
            kv_rows = (D if force_all else D & self.need) & seen
            if kv_rows.any():
                same = torch.equal(kv_rows, A)
                xs = self._attn_in(blk, xA if same else self._rows(l, X, D, kv_rows))
                if same:
                    x_in = xs[0]
                sel = kv_rows[gk, ge, :nk]  # same row order as kv_rows: groups are sorted (copy, example)
                k_g.transpose(1, 2)[sel] = self._norm(attn, "k", self._proj(xs[1], w["K"]))
                v_g.transpose(1, 2)[sel] = self._norm(attn, "v", self._proj(xs[2], w["V"]))
            if S in ("k", "v"):
                Pk = P & seen
                pidx = Pk.nonzero(as_tuple=True)
                new = self._norm(attn, S, patch(c[S][pidx[1], pidx[2]], pidx))
                (k_g if S == "k" else v_g).transpose(1, 2)[Pk[gk, ge, :nk]] = new
            if S == "q":
                q_rows = self._norm(attn, "q", patch(c["q"][bidx, ridx], idx))
            elif S in ("k", "v"):
                q_rows = c["q_used"][bidx, ridx]
            else:
                xq_ = x_in if x_in is not None else self._attn_in(blk, xA)[0]
                q_rows = self._norm(attn, "q", self._proj(xq_, w["Q"]))
            z = self._attend(q_rows, ridx, g_of, slot, k_g, v_g)
        elif S == "pattern":
            pattern = patch(c["pattern"][bidx, :, ridx], idx)  # [M, h, keys]
            z = (pattern.unsqueeze(2) @ c["v_t"][bidx]).squeeze(2)  # [M, h, dh]
        elif S == "z":
            z = patch(c["z"][bidx, ridx], idx)
        if si <= _ORDER.index("z"):
            attn_out = z.flatten(-2) @ w["O"] + w["bO"]
        elif S == "attn_out":
            attn_out = patch(c["attn_out"][bidx, ridx], idx)
        if si <= _ORDER.index("attn_out"):
            resid_mid = xA + attn_out
        elif S == "resid_mid":
            resid_mid = patch(c["resid_mid"][bidx, ridx], idx)
        elif S == "mlp_out":
            resid_mid = c["resid_mid"][bidx, ridx]
        if si <= _ORDER.index("resid_mid"):
            mlp_out = self._mlp(blk, resid_mid)
        elif S == "mlp_out":
            mlp_out = patch(c["mlp_out"][bidx, ridx], idx)
        if si <= _ORDER.index("mlp_out"):
            return resid_mid + mlp_out, A
        return patch(c["resid_post"][bidx, ridx], idx), A

    def run(self, l0: int, S: str, patch: Optional[Callable], P: Tensor, force_all: bool = False) -> Optional[Tensor]:
        """Logits [K, b, n, vocab] of the K copies, or None if no read position can change.

        ``patch(X, idx)`` patches a dense stage tensor ([K, b, n_eff, ...] or the pattern
        [K, b, h, n_eff, n_eff]) or its rows ``idx``; ``P`` [K, b, n_eff] marks the rows each
        copy's patch changes, per example (an example whose clean and corrupted values agree
        there is left out: the patch cannot change it).
        """
        K = P.shape[0]
        X: Optional[Tensor] = None
        D = torch.zeros(K, self.b, self.n_eff, dtype=torch.bool, device=P.device)
        if force_all:
            D = D | P
            X = self._dense(l0, "resid_pre", K)[D]
        for l in range(l0, self.L):
            last = l == self.L - 1
            here = l == l0 and not force_all
            rows, A = self._layer(l, X, D, K, last, S if here else None, patch if here else None, P, force_all)
            if rows is None:
                return None
            if not last:
                X, D = rows, A
        out = self.logits.unsqueeze(0).expand(K, *self.logits.shape).clone()
        view = out[:, :, : self.n_eff]
        view[A] = self.model.head(self.model.ln_final(rows))
        return out


# ----------------------------------------------------------------------------- main entry


def _validate_by(kind: str, by: str, activation: str) -> None:
    if (kind, by) not in AXES:
        ok = sorted(b for (k, b) in AXES if k == kind)
        raise PatchingError(f"by={by!r} is not available for {activation!r}; choose one of {ok}")


def _cells_from_df(cells: pd.DataFrame, axes: Sequence[str], sizes: dict[str, int]) -> Tensor:
    rename = {"head_index": "head"}
    df = cells.rename(columns=rename)
    missing = [a for a in axes if a not in df.columns]
    if missing:
        raise PatchingError(f"cells need columns {list(axes)}; missing {missing}")
    if len(df) == 0:
        raise PatchingError(
            f"the set of cells to patch is empty; pass at least one row with columns {list(axes)}, or cells=None for every cell"
        )
    try:
        values = df[list(axes)].to_numpy(dtype="int64")
    except (TypeError, ValueError):
        raise PatchingError(f"cells columns {list(axes)} must hold integer indices") from None
    t = torch.tensor(values, dtype=torch.long).reshape(-1, len(axes))
    for j, a in enumerate(axes):
        if len(t) and (t[:, j].min() < 0 or t[:, j].max() >= sizes[a]):
            raise PatchingError(f"cell column {a!r} must lie in [0, {sizes[a]}), got {t[:, j].min()}..{t[:, j].max()}")
    return t


@torch.no_grad()
def activation_patch(
    model,
    corrupted_tokens: Union[Int[Tensor, "batch pos"], PatchingPairs],
    clean_cache: Optional[Mapping[str, Tensor]] = None,
    metric: Optional[MetricFn] = None,
    activation: str = "z",
    *,
    by: str = "pos",
    cells: Optional[pd.DataFrame] = None,
    method: str = "auto",
    batch_size: int = 1024,
    clean_tokens: Optional[Tensor] = None,
    progress: bool = False,
) -> PatchResult:
    """Exact activation patching of ``activation`` (clean into corrupted), many cells per pass.

    ``corrupted_tokens`` may be a :class:`PatchingPairs` (then the clean cache, and by default
    the logit-difference metric, come from it). ``metric`` maps logits ``[batch, pos, vocab]``
    to ``[batch]`` (per-example; a scalar-valued metric also works but gives no per-example
    values). ``by``: ``"pos"`` (per position; per destination position for ``pattern``),
    ``"all"`` (all positions at once) or ``"dest_src"`` (``pattern`` only). ``cells``: a
    DataFrame of explicit cells (columns = the axis names); the result is then flat, one
    value per row, as in TransformerLens. ``batch_size`` bounds the rows per forward pass
    (copies x examples) and with it the memory.
    """
    pairs = corrupted_tokens if isinstance(corrupted_tokens, PatchingPairs) else None
    dev = _device(model)
    if pairs is not None:
        corrupted = pairs.corrupted_tokens.to(dev)
        clean_tokens = pairs.clean_tokens if clean_tokens is None else clean_tokens
        if metric is None:
            metric = LogitDiff(pairs)
    else:
        corrupted = torch.as_tensor(corrupted_tokens).to(dev)
    if metric is None:
        raise PatchingError("give a metric (logits -> [batch]) or pass PatchingPairs to use the logit difference")
    if corrupted.ndim != 2:
        raise PatchingError(f"corrupted tokens must be [batch, pos], got shape {tuple(corrupted.shape)}")
    if activation not in ACTIVATIONS:
        raise PatchingError(f"unknown activation {activation!r}; choose one of {list(ACTIVATIONS)}")
    if method not in ("auto", "incremental", "hooks"):
        raise PatchingError(f"method must be 'auto', 'incremental' or 'hooks', got {method!r}")
    if not isinstance(batch_size, int) or batch_size < 1:
        raise PatchingError(f"batch_size must be a positive integer, got {batch_size!r}")
    _require_eval(model)
    kind = ACTIVATIONS[activation][0]
    _validate_by(kind, by, activation)
    cfg = model.cfg
    b, n = corrupted.shape
    L, H = cfg.n_layers, cfg.n_heads
    axes = AXES[(kind, by)]
    sizes = dict(layer=L, pos=n, head=H, dest_pos=n, src_pos=n)
    if clean_cache is None:
        if clean_tokens is None:
            raise PatchingError("give clean_cache (model.run_with_cache(clean_tokens)[1]) or clean_tokens")
        names = {hook_name(activation, l) for l in range(L)}
        _, clean_cache = model.run_with_cache(clean_tokens.to(dev), names_filter=lambda nm: nm in names)
    clean_acts = [_clean_act(clean_cache, hook_name(activation, l)) for l in range(L)]
    for l, a in enumerate(clean_acts):
        if a.shape[0] != b:
            raise PatchingError(f"clean activations have batch {a.shape[0]} but corrupted tokens have batch {b}")

    flat = cells is not None
    cell_t = _cells_from_df(cells, axes, sizes) if flat else _grid_cells(axes, sizes)
    index_df = pd.DataFrame(cell_t.numpy(), columns=list(axes))
    n_cells = len(cell_t)

    read = getattr(metric, "read_mask", None)
    if read is None and getattr(metric, "read_positions", None) is not None:
        read = torch.as_tensor(metric.read_positions).expand(b, -1)
    engine = None
    if method in ("auto", "incremental"):
        if _is_ours(model):
            try:
                engine = _Incremental(model, corrupted, None if read is None else torch.as_tensor(read).to(dev))
            except (PatchingError, AttributeError, KeyError, TypeError, RuntimeError) as e:
                if method == "incremental":
                    raise e if isinstance(e, PatchingError) else PatchingError(
                        f"the incremental engine cannot run this model ({type(e).__name__}: {e}); use method='hooks'"
                    ) from e
                warnings.warn(f"incremental patching engine unavailable ({e}); falling back to hooks", RuntimeWarning)
        elif method == "incremental":
            raise PatchingError("method='incremental' needs a HookedNormTransformer; use method='hooks' for other models")
    act_names = {hook_name(activation, l) for l in range(L)}
    resid_cache = None
    if engine is not None:
        corrupted_logits = engine.logits
        corr_acts = [engine.full[l][activation] for l in range(L)]
    else:
        if _is_ours(model):  # hooks, but each pass starts at the patched layer (forward_from)
            act_names |= {f"blocks.{l}.hook_resid_pre" for l in range(L)}
        corrupted_logits, resid_cache = model.run_with_cache(corrupted, names_filter=lambda nm: nm in act_names)
        corr_acts = [resid_cache[hook_name(activation, l)] for l in range(L)]
        if not _is_ours(model):
            resid_cache = None
    for a, c in zip(clean_acts, corr_acts):
        if a.shape != c.shape:
            raise PatchingError(
                f"clean activations {tuple(a.shape)} and corrupted ones {tuple(c.shape)} differ in shape; "
                "clean and corrupted tokens must have the same [batch, pos]"
            )
    baseline = _eval_metric(metric, corrupted_logits, 1, b)[0]
    clean_val = None
    if clean_tokens is not None:
        clean_val = _eval_metric(metric, model(clean_tokens.to(dev)), 1, b)[0]
    scalar_metric = baseline.ndim == 0
    store = torch.zeros((n_cells,) if scalar_metric else (n_cells, b), dtype=torch.float64)


    # order cells by (layer, first affected row) so chunks share a start layer and a tight row range
    rowcol = _row_axis(kind, by)
    cells_np = cell_t.numpy()
    rowkey = cells_np[:, rowcol] if rowcol is not None else np.zeros(n_cells, dtype=np.int64)
    order = np.lexsort((rowkey, cells_np[:, 0]))
    # cells that cannot change the metric are the corrupted baseline, without a forward pass:
    # clean == corrupted there for every example (e.g. positions before the corrupted token),
    # or (incremental engine) the position comes after the last one the metric reads
    differs = _cell_differs(kind, by, cell_t, clean_acts, corr_acts)  # [cells, b]
    live = differs.any(-1).numpy()
    if engine is not None and rowcol is not None:
        live &= rowkey < engine.n_eff
    dead = order[~live[order]]
    if len(dead):
        store[torch.from_numpy(dead)] = baseline.to(torch.float64).cpu()
        order = order[live[order]]
    K_max = max(1, batch_size // b)
    layers = cells_np[order, 0]
    chunks = []
    for layer in np.unique(layers):
        sel = order[layers == layer]
        chunks += [sel[i : i + K_max] for i in range(0, len(sel), K_max)]

    for chunk in tqdm(chunks, disable=not progress, desc=f"patching {activation}"):
        idx = torch.from_numpy(chunk)
        cc = cell_t[idx]
        K = len(chunk)
        layer = int(cc[0, 0])
        clean = clean_acts[layer]
        if engine is not None:
            ne = engine.n_eff
            rows_all = torch.arange(ne)
            m = _cell_mask(kind, by, cc, rows_all, n, H, ne).to(dev)
            src = _select_rows(kind, clean, rows_all.to(clean.device), ne).unsqueeze(0).to(dev)

            def patch(X: Tensor, idx: Optional[tuple] = None, m=m, src=src) -> Tensor:
                """Dense stage tensor (idx None) or its rows ``idx`` = (copy, example, position)."""
                if idx is None:
                    return torch.where(m, src.to(X.dtype), X)
                k_, b_, r_ = idx
                if kind == "pattern":  # rows [M, h, keys]
                    return torch.where(m[:, 0][k_, :, r_], src[0][b_, :, r_].to(X.dtype), X)
                return torch.where(m[k_, 0, r_], src[0][b_, r_].to(X.dtype), X)

            P = differs[idx].unsqueeze(-1).expand(K, b, ne).clone()  # [K, b, n]: rows each copy changes
            if rowcol is not None:
                P &= torch.arange(ne).view(1, 1, ne) == cc[:, rowcol].view(K, 1, 1)
            logits = engine.run(layer, activation, patch, P.to(dev))
            if logits is None:
                vals = baseline.unsqueeze(0).expand(K, *baseline.shape)
            else:
                vals = _eval_metric(metric, logits.reshape(K * b, n, -1), K, b)
        else:
            all_rows = torch.arange(n)

            def hook_fn(act: Tensor, hook: Any, cc=cc, clean=clean) -> Tensor:
                X = act.view(K, b, *act.shape[1:])
                m = _cell_mask(kind, by, cc, all_rows, n, H, n).to(act.device)
                return torch.where(m, clean.unsqueeze(0).to(act.dtype), X).reshape(act.shape)

            hooks = [(hook_name(activation, layer), hook_fn)]
            if resid_cache is not None:
                start = resid_cache[f"blocks.{layer}.hook_resid_pre"]
                with model.hooks(fwd_hooks=hooks):
                    logits = forward_from(model, layer, start.repeat(K, 1, 1))
            else:
                logits = model.run_with_hooks(corrupted.repeat(K, 1), fwd_hooks=hooks)
            vals = _eval_metric(metric, logits, K, b)
        store[idx] = vals.to(torch.float64).cpu()

    per_example = None if scalar_metric else store
    mean = store if scalar_metric else store.mean(-1)
    values = mean if flat else mean.view(*[sizes[a] for a in axes])
    return PatchResult(
        activation=activation, by=by, axis_names=list(axes), values=values.to(torch.float32), index_df=index_df,
        per_example=per_example, baseline=baseline.detach().double().cpu(),
        clean=None if clean_val is None else clean_val.detach().double().cpu(),
        metric_name=getattr(metric, "name", getattr(metric, "__name__", "metric")),
        method=f"exact-{'incremental' if engine is not None else 'hooks'}", flat=flat,
    )


@torch.no_grad()
def patch_sweep(
    model,
    pairs: PatchingPairs,
    metric: Optional[MetricFn] = None,
    activations: Sequence[Union[str, tuple[str, str]]] = ("resid_pre", "attn_out", "mlp_out", ("z", "pos"), ("z", "all")),
    *,
    method: str = "auto",
    batch_size: int = 1024,
    progress: bool = False,
) -> dict[str, PatchResult]:
    """Several patching sweeps sharing one clean cache; keys like ``"z"`` or ``"z_all"``.

    Entries of ``activations`` are names (by position) or ``(name, by)`` tuples.
    """
    dev = _device(model)
    specs = [(a, "pos") if isinstance(a, str) else tuple(a) for a in activations]
    names = {hook_name(a, l) for a, _ in specs for l in range(model.cfg.n_layers)}
    _, cache = model.run_with_cache(pairs.clean_tokens.to(dev), names_filter=lambda nm: nm in names)
    metric = metric if metric is not None else LogitDiff(pairs)
    out = {}
    for a, by in specs:
        key = a if by == "pos" else f"{a}_{by}"
        out[key] = activation_patch(
            model, pairs, cache, metric, a, by=by, method=method, batch_size=batch_size, progress=progress
        )
    return out


__all__ = ["ACTIVATIONS", "AXES", "PatchResult", "activation_patch", "patch_sweep", "forward_from", "hook_name"]
