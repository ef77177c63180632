"""The anatomy of a TransformerLens 4 ``TransformerBridge``, read from its module tree and one probe.

Per layer, from the bridge attention component and the HF attention it wraps: head counts
(``head_dim``, ``num_key_value_groups``), the score factor (``scaling``), soft cap, sliding
window, the ``q_norm``/``k_norm``/``v_norm`` children (identified by what they compute, axis from
their gain's shape), the block's ``ln1``/``ln1_post`` norms, and the hooks on each step (their
``HookPoint.name``). Gemma 4 adds two wrinkles, both read from the module tree:

* KV sharing (E2B/E4B): the last layers have no k/v projections and read the keys and values of
  the last earlier layer of the same ``layer_type`` that has them (HF's "store" layer);
  ``kv_layer`` names it and the k/v hooks are that layer's.
* k = v (31B, 26B-A4B global layers): no v projection; v = v_norm(raw k) (``v_from_k``).

Then one probe forward (random ids, a length that is no head count) fixes each hook's layout,
drops hooks that exist but never fire, checks every "normed" hook against norm(raw hook), and
checks the rebuilt scores against the pattern (:func:`interp_norm.anatomy.rebuild.verify_anatomy`).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Mapping, Optional

import torch
from torch import nn

from interp_norm.anatomy._common import canonical, is_bridge, original
from interp_norm.anatomy.describe import (
    TARGETS,
    Anatomy,
    LayerAnatomy,
    NormSpec,
    _computes_a_norm,
    _module_path,
    identify_norm,
)
from interp_norm.anatomy.rebuild import verify_anatomy
from interp_norm.anatomy.stream import cache_before_unembed
from interp_norm.errors import ArchitectureError


def _hook(component: Any, attr: str) -> Optional[str]:
    """Name of the HookPoint ``component.<attr>`` (bridge aliases such as hook_q resolve), or None."""
    from transformer_lens.hook_points import HookPoint

    if component is None:
        return None
    try:
        hp = getattr(component, attr)
    except AttributeError:
        return None
    return hp.name if isinstance(hp, HookPoint) and isinstance(hp.name, str) else None


def _placement(norms: Mapping[str, Optional[NormSpec]], pre: Optional[NormSpec]) -> str:
    normed = tuple(t for t in TARGETS if norms[t] is not None)
    if normed == ("q", "k", "v"):
        return "qkv"
    if normed == ("q", "k"):
        return "qk"
    if normed:
        raise ArchitectureError(f"only {normed} are normalised; interp_norm knows q+k (QK-Norm) and q+k+v (QKV-Norm)")
    return "pre" if pre is not None else "none"


def _norm_child(attn: Any, hf: nn.Module, t: str) -> Any:
    comp = attn._modules.get(f"{t}_norm")
    return comp if comp is not None else getattr(hf, f"{t}_norm", None)


def _qkv_norms(model: Any, attn: Any, hf: nn.Module, l: int, hooks: dict[str, Optional[str]], *, n_heads: int,
               n_kv: int, d_head: int) -> tuple[dict[str, Optional[NormSpec]], dict[str, nn.Module]]:
    """Layer ``l``'s q/k/v norms (spec and HF module, by target); records each one's output hook in ``hooks``."""
    norm_mods: dict[str, nn.Module] = {}
    norms: dict[str, Optional[NormSpec]] = {t: None for t in TARGETS}
    known = set()
    for t in TARGETS:
        comp = _norm_child(attn, hf, t)
        hooks[f"{t}_normed"] = None
        if comp is None:
            continue
        mod = original(comp)
        known |= {id(comp), id(mod)}
        norm_mods[t] = mod
        weight = next((p for p in mod.parameters() if p.ndim == 1), None)
        n_t = n_heads if t == "q" else n_kv
        if weight is None or weight.numel() == d_head:
            axis, dim = "per_head", d_head  # a gainless norm's axis is confirmed by the probe's shapes
        elif weight.numel() == n_t * d_head:
            axis, dim = "all_heads", n_t * d_head
        else:
            raise ArchitectureError(f"layer {l}: {t}_norm has a gain of {weight.numel()} entries, neither d_head={d_head} nor {n_t}·d_head")
        norms[t] = identify_norm(mod, dim, f"{_module_path(model, attn)}.{t}_norm", axis)
        hooks[f"{t}_normed"] = _hook(attn, f"hook_{t}_normed") or _hook(comp, "hook_out")
        if hooks[f"{t}_normed"] is None:
            raise ArchitectureError(f"layer {l}: {t}_norm found in the module tree but no hook holds its output")
    for name, child in hf.named_children():  # a norm we cannot attribute to q, k or v
        if id(child) not in known and _computes_a_norm(original(child)):
            raise ArchitectureError(
                f"layer {l}: attention child {name!r} ({type(original(child)).__name__}) computes a norm but is "
                "none of q_norm/k_norm/v_norm; interp_norm cannot tell whether it normalises q, k or v"
            )
    return norms, norm_mods


def _static_layer(model: Any, l: int, block: Any) -> tuple[LayerAnatomy, dict[str, nn.Module]]:
    """A layer's anatomy before the probe, and its norm modules (HF originals) by target."""
    cfg = model.cfg
    attn = block._modules.get("attn")
    hf = original(attn)
    if attn is None or hf is None:
        raise ArchitectureError(f"block {l} has no attention component 'attn' wrapping an HF attention module")
    d_head = int(getattr(hf, "head_dim", 0) or getattr(cfg, "d_head", 0))
    n_heads = int(getattr(cfg, "n_heads", 0))
    groups = getattr(hf, "num_key_value_groups", None)
    n_kv = n_heads // int(groups) if groups else int(getattr(cfg, "n_key_value_heads", None) or n_heads)
    if d_head < 1 or n_heads < 1 or n_heads % n_kv:
        raise ArchitectureError(f"layer {l}: cannot read head counts (n_heads={n_heads}, n_kv_heads={n_kv}, d_head={d_head})")
    scale = getattr(hf, "scaling", None)
    if not isinstance(scale, (int, float)):
        raise ArchitectureError(
            f"layer {l}: the HF attention {type(hf).__name__} has no numeric 'scaling' attribute, so the factor "
            "q·k is multiplied by is unknown"
        )
    if getattr(hf, "sinks", None) is not None:
        raise ArchitectureError(f"layer {l}: attention sinks ({type(hf).__name__}.sinks) join the softmax; not supported")
    softcap = getattr(hf, "attn_logit_softcapping", None) or getattr(getattr(hf, "config", None), "attn_logit_softcapping", None)

    hooks: dict[str, Optional[str]] = {t: _hook(attn, f"hook_{t}") for t in TARGETS}
    shared = hooks["k"] is None and bool(getattr(hf, "is_kv_shared_layer", False))
    if hooks["q"] is None or (hooks["k"] is None and not shared):
        missing = [t for t in ("q", "k") if hooks[t] is None]
        raise ArchitectureError(f"layer {l}: the bridge attention has no hook on the {missing} projection (hook_q/hook_k)")
    v_from_k = False
    if hooks["v"] is None and not shared:
        if _norm_child(attn, hf, "v") is None:
            raise ArchitectureError(f"layer {l}: the bridge attention has no hook on the v projection (hook_v)")
        hooks["v"], v_from_k = hooks["k"], True  # checked on the probe: v_normed == v_norm(raw k)

    norms, norm_mods = _qkv_norms(model, attn, hf, l, hooks, n_heads=n_heads, n_kv=n_kv, d_head=d_head)
    pre = post = None
    for key in ("ln1", "ln1_post"):
        comp = block._modules.get(key)
        if comp is not None and original(comp) is not None:
            spec = identify_norm(original(comp), int(cfg.d_model), _module_path(model, comp), "residual")
            pre, post = (spec, post) if key == "ln1" else (pre, spec)
    rope = getattr(cfg, "positional_embedding_type", None) == "rotary"
    hooks.update(q_rot=_hook(attn, "hook_rot_q") if rope else None, k_rot=_hook(attn, "hook_rot_k") if rope else None,
                 attn_scores=_hook(attn, "hook_attn_scores"), pattern=_hook(attn, "hook_pattern"), z=_hook(attn, "hook_z"))
    if hooks["pattern"] is None:
        raise ArchitectureError(f"layer {l}: the bridge attention has no hook_pattern")
    window = getattr(hf, "sliding_window", None)
    la = LayerAnatomy(
        layer=l, n_heads=n_heads, n_kv_heads=n_kv, d_head=d_head, placement="none", norms=norms,
        pre_norm=pre, post_norm=post, hooks=hooks, layouts={}, score_scale=float(scale),
        softcap=float(softcap) if softcap else None, rope=rope,
        sliding_window=int(window) if isinstance(window, int) and window > 0 else None,
        kv_layer=None if shared else l, v_from_k=v_from_k,
    )
    return la, norm_mods


def _resolve_kv_sharing(model: Any, static: list[tuple[LayerAnatomy, dict]]) -> list[tuple[LayerAnatomy, dict]]:
    """Point each KV-consuming layer at the last earlier layer of the same type with own k/v."""
    out: list[tuple[LayerAnatomy, dict]] = []
    for la, mods in static:
        if la.kv_layer is None:
            kind = getattr(original(model.blocks[la.layer]._modules["attn"]), "layer_type", None)
            sources = [s for s, _ in out if s.kv_layer == s.layer
                       and getattr(original(model.blocks[s.layer]._modules["attn"]), "layer_type", None) == kind]
            if not sources:
                raise ArchitectureError(f"layer {la.layer} shares keys/values but no earlier {kind!r} layer has its own")
            src = sources[-1]
            if (src.n_kv_heads, src.d_head) != (la.n_kv_heads, la.d_head):
                raise ArchitectureError(f"layer {la.layer} reads layer {src.layer}'s keys but their head shapes differ")
            hooks = dict(la.hooks)
            hooks.update({k: src.hooks[k] for k in ("k", "v", "k_normed", "v_normed", "k_rot")})
            norms = {"q": la.norms["q"], "k": src.norms["k"], "v": src.norms["v"]}
            mods = {t: m for t, m in mods.items() if t == "q"}  # k/v norms are checked at the source
            la = replace(la, hooks=hooks, norms=norms, kv_layer=src.layer, v_from_k=src.v_from_k)
        out.append((replace(la, placement=_placement(la.norms, la.pre_norm)), mods))
    return out


def _probe_length(layers: list[LayerAnatomy]) -> int:
    taken = {x for la in layers for x in (la.n_heads, la.n_kv_heads, la.d_head)}
    n = 5
    while n in taken:
        n += 1
    return n


def _special_ids(config: Any) -> set[int]:
    """Every ``*_token_id(s)`` / ``*_token_index`` of an HF config and its sub-configs (BOS, image, audio ...)."""

    def walk(d: dict) -> set[int]:
        out: set[int] = set()
        for key, value in d.items():
            if isinstance(value, dict):
                out |= walk(value)
            elif isinstance(key, str) and ("_token_id" in key or key.endswith("_token_index")):
                values = value if isinstance(value, list) else [value]
                out |= {v for v in values if isinstance(v, int) and not isinstance(v, bool)}
        return out

    return walk(config.to_dict()) if hasattr(config, "to_dict") else set()


def probe_tokens(model: Any, batch: int, n: int, seed: int = 0) -> torch.Tensor:
    """Seeded ordinary token ids [batch, n]: below 1000 and none of the config's special or media
    tokens (an image token without pixels would send a multimodal Gemma 4 down its vision path)."""
    vocab = int(model.cfg.d_vocab)
    special = _special_ids(getattr(getattr(model, "original_model", None), "config", None))
    ordinary = torch.tensor([i for i in range(min(vocab, 1000)) if i not in special] or [0])
    pick = torch.randint(0, len(ordinary), (batch, n), generator=torch.Generator().manual_seed(seed))
    return ordinary[pick]


def _layout(shape: tuple[int, ...], n: int, heads: int, d_head: int) -> Optional[str]:
    if shape == (1, n, heads, d_head):
        return "bphd"
    if shape == (1, heads, n, d_head):
        return "bhpd"
    if shape == (1, n, heads * d_head):
        return "flat"
    return None


def _check_norm_hooks(la: LayerAnatomy, mods: dict[str, nn.Module], cache: Any) -> None:
    """Every normed hook must hold norm(raw hook): catches a hook that is not what its name says."""
    for t, mod in mods.items():
        heads = la.n_heads_of(t)
        raw = canonical(cache[la.hooks[t]], la.layouts[t], heads, la.d_head)
        normed = canonical(cache[la.hooks[f"{t}_normed"]], la.layouts[f"{t}_normed"], heads, la.d_head)
        with torch.no_grad():
            spec = la.norms[t]
            assert spec is not None  # mods holds the targets that have a norm
            ref = mod(raw) if spec.axis == "per_head" else mod(raw.flatten(-2)).view_as(raw)
        err = float((ref - normed).abs().max() / (normed.abs().max() + 1e-12))
        if err > 1e-4:
            raw_what = "k (k = v layer)" if t == "v" and la.v_from_k else t
            raise ArchitectureError(
                f"layer {la.layer}: {la.hooks[f'{t}_normed']!r} does not hold {t}_norm of the raw {raw_what} in "
                f"{la.hooks[t]!r} (relative error {err:.2g})"
            )


def bridge_anatomy(model: Any, strict: bool = True) -> Anatomy:
    """The :class:`Anatomy` of a TransformerBridge (module docstring)."""
    blocks = getattr(model, "blocks", None)
    if blocks is None or len(blocks) == 0:
        raise ArchitectureError(f"{type(model).__name__} has no 'blocks'; is it a decoder-only TransformerBridge?")
    static = _resolve_kv_sharing(model, [_static_layer(model, l, b) for l, b in enumerate(blocks)])
    n = _probe_length([s[0] for s in static])
    tokens = probe_tokens(model, 1, n)
    wanted = {h for la, _ in static for h in la.hooks.values() if h}
    # the probe ends before the unembedding: no logits, and the vocabulary matrix is never read
    cache = cache_before_unembed(model, tokens.to(model.cfg.device or "cpu"), wanted)
    out = []
    for la, mods in static:
        hooks, layouts = dict(la.hooks), {}
        for key in ("q", "k", "v", "q_normed", "k_normed", "v_normed", "q_rot", "k_rot"):
            name = hooks.get(key)
            if name is None:
                continue
            if name not in cache:
                if key in ("q_rot", "k_rot"):
                    hooks[key] = None  # exists but never fires (Gemma 4): rotate from the rotary module
                    continue
                raise ArchitectureError(f"layer {la.layer}: hook {name!r} ({key}) exists but did not fire on a forward pass")
            heads = la.n_heads_of(key[0])
            layout = _layout(tuple(cache[name].shape), n, heads, la.d_head)
            if layout is None:
                raise ArchitectureError(
                    f"layer {la.layer}: hook {name!r} ({key}) has shape {tuple(cache[name].shape)}; expected "
                    f"{heads} heads of {la.d_head} over {n} positions"
                )
            layouts[key] = layout
        for key in ("attn_scores", "pattern"):
            if hooks[key] is not None and hooks[key] not in cache:
                hooks[key] = None
        if hooks["pattern"] is None:
            raise ArchitectureError(f"layer {la.layer}: hook_pattern never fires (sdpa attention?); load the model with attn_implementation='eager'")
        la = replace(la, hooks=hooks, layouts=layouts, rope_from_hooks=bool(hooks["q_rot"] and hooks["k_rot"]))
        if la.rope and not la.rope_from_hooks and original(getattr(model, "rotary_emb", None)) is None:
            raise ArchitectureError(f"layer {la.layer}: rotary model whose rotated q/k hooks do not fire and no 'rotary_emb' module to recompute them")
        _check_norm_hooks(la, mods, cache)
        out.append(la)
    arch = str(getattr(model.cfg, "architecture", None) or type(original(model) or model).__name__)
    return verify_anatomy(model, Anatomy("bridge", arch, tuple(out)), cache, tokens, strict=strict)


__all__ = ["is_bridge", "original", "bridge_anatomy", "probe_tokens"]
