"""TransformerLens habits made exact for :class:`~interp_norm.core.model.HookedNormTransformer`.

Two things TL gets subtly wrong on these models, fixed here so ``model.py`` stays the architecture:

* Hook names. TL raises a bare ``KeyError`` for a wrong name in ``run_with_hooks`` and silently
  caches nothing for a wrong name in ``run_with_cache(names_filter=[...])``; a hook on a point that
  exists but never fires (``hook_result`` without ``cfg.use_attn_result``, ``hook_q_input`` without
  ``cfg.use_split_qkv_input``) silently does nothing. :func:`check_hooks` and
  :func:`check_names_filter` refuse all three with a :class:`HookNameError` naming the closest valid
  names, or the config flag that makes the point fire. Refuse rather than warn: a sweep whose hooks
  never fired loses the work silently.
* The activation cache. TL's ``ActivationCache`` reads ``cfg.normalization_type`` as the norm of
  every residual read-out; here it describes only the attention's norm, while ``ln2`` and
  ``ln_final`` are LayerNorms in every variant. :class:`NormActivationCache` applies the right
  norm, and refuses direct logit attribution on the paper's MLP output head with a typed error.

Imports nothing from ``model.py`` (which imports this module): ``model`` is duck-typed.
"""

from __future__ import annotations

import difflib
import re
from typing import Any, Callable, Iterable, Optional, Union

import torch
from transformer_lens import ActivationCache
from transformer_lens.utilities import Slice, get_act_name

from interp_norm.errors import ConfigError, HookNameError
from interp_norm.core.hook_names import act_name, is_normalised, used_name

# ----------------------------------------------------------------------------- hook names


def dormant_hooks(model: Any) -> dict[str, str]:
    """Hook points that exist but never fire under the model's current config: name -> enabling flag."""
    cfg = model.cfg
    out: dict[str, str] = {}
    for layer in range(cfg.n_layers):
        if not cfg.use_attn_result:
            out[act_name("result", layer)] = "use_attn_result"
        if not cfg.use_split_qkv_input:
            for t in "qkv":
                out[act_name(f"{t}_input", layer)] = "use_split_qkv_input"
    return out


_INSTEAD = {"use_attn_result": "hook_z (per head, before W_O)", "use_split_qkv_input": "hook_resid_pre (shared by all heads)"}


def _dormant_message(name: str, flag: str) -> str:
    return (
        f"hook point {name!r} never fires on this model because cfg.{flag} is False, so a hook there "
        f"would silently do nothing; call model.set_{flag}(True) first (same weights, same function up "
        f"to float rounding), or hook the block's {_INSTEAD[flag]} instead"
    )


def _hint(model: Any, name: str) -> str:
    """Why a plausible-looking name is absent on this variant, and what to use instead."""
    cfg = model.cfg
    m = re.match(r"blocks\.(\d+)\.", name)
    layer = int(m.group(1)) if m else None
    if layer is not None and layer >= cfg.n_layers:
        return f" The model has {cfg.n_layers} layers (blocks.0 ... blocks.{cfg.n_layers - 1})."
    tail = name.rsplit(".", 1)[-1]
    m = re.fullmatch(r"hook_([qkv])_(normed|scale)", tail)
    if m and layer is not None:
        t = m.group(1)
        if not is_normalised(cfg.attn_norm, t):
            where = "attn_norm='qkv'" if t == "v" else "attn_norm='qk' or 'qkv'"
            extra = f"; its Pre-Norm scale is {act_name('scale', layer, 'ln1')}" if cfg.attn_norm == "pre" else ""
            return (
                f" {tail} exists only where a per-head norm acts on {t} ({where}); this model has "
                f"attn_norm={cfg.attn_norm!r}, so the {t} the attention uses is {used_name(cfg.attn_norm, t, layer)}{extra}."
            )
    if layer is not None and ".ln1." in name and cfg.attn_norm != "pre":
        return (
            f" ln1 exists only on Pre-Norm models (attn_norm='pre'); this model has attn_norm={cfg.attn_norm!r}"
            + (f", whose per-head norms hook as {act_name('q_scale', layer)} etc." if cfg.attn_norm in ("qk", "qkv") else ".")
        )
    return ""


def unknown_hook_message(model: Any, name: str) -> str:
    """``name`` is not a hook point: say why if we can, and list the closest valid names."""
    dormant = dormant_hooks(model)
    live = [n for n in model.hook_dict if n not in dormant]
    close = difflib.get_close_matches(name, live, n=5, cutoff=0.6)
    where = f" Closest valid names: {close}." if close else " See model.hook_names() for every valid name."
    return f"no hook point named {name!r} on this model.{_hint(model, name)}{where}"


def check_hook_name(model: Any, name: str, dormant: Optional[dict[str, str]] = None) -> None:
    """Raise :class:`HookNameError` unless ``name`` is a hook point that fires on this model."""
    if name not in model.hook_dict:
        raise HookNameError(unknown_hook_message(model, name))
    flag = (dormant_hooks(model) if dormant is None else dormant).get(name)
    if flag:
        raise HookNameError(_dormant_message(name, flag))


HookTarget = Union[str, Callable[[str], bool]]


def check_hooks(model: Any, hooks: Iterable[tuple[HookTarget, Any]]) -> None:
    """Check every ``(name_or_filter, fn)`` before any is added, so a bad one leaves no hooks behind.

    A filter function that matches only points that never fire is refused like a dormant name; one
    that matches nothing at all is allowed (generic filters run across variants, as in TL).
    """
    dormant = dormant_hooks(model)
    for target, _ in hooks:
        if isinstance(target, str):
            check_hook_name(model, target, dormant)
        elif callable(target):
            matched = [n for n in model.hook_dict if target(n)]
            if matched and all(n in dormant for n in matched):
                raise HookNameError(_dormant_message(matched[0], dormant[matched[0]]) + f" (the filter matched only {matched})")
        else:
            raise HookNameError(f"a hook target must be a hook name or a function of the name, got {type(target).__name__}")


def check_names_filter(model: Any, names_filter: Any) -> None:
    """``run_with_cache``'s ``names_filter`` given as names: each must exist and fire."""
    if isinstance(names_filter, str):
        names_filter = [names_filter]
    if isinstance(names_filter, (list, tuple)):
        dormant = dormant_hooks(model)
        for name in names_filter:
            if not isinstance(name, str):
                raise HookNameError(f"names_filter lists hook names (strings), got {name!r}")
            check_hook_name(model, name, dormant)


# ----------------------------------------------------------------------------- activation cache


def missing_from_cache(model: Any, name: Any, cached: Iterable[str]) -> str:
    """Why ``cache[name]`` holds nothing: no such hook point (closest names), a point that never
    fires on this model, or one the run's ``names_filter`` left out."""
    if not isinstance(name, str):
        return f"cache keys are hook names such as 'blocks.0.attn.hook_q' (or ('q', 0)), got {name!r}"
    full = name
    if name not in model.hook_dict:
        try:
            full = get_act_name(name)  # TL's shorthands: "q" -> ... only for names it can parse
        except Exception:  # noqa: BLE001 - an unparseable shorthand is simply an unknown name
            full = name
    if full not in model.hook_dict:
        return unknown_hook_message(model, name)
    flag = dormant_hooks(model).get(full)
    if flag:
        return _dormant_message(full, flag)
    return (f"hook point {full!r} exists but is not in this cache: the run's names_filter left it out "
            f"(the cache holds {len(list(cached))} names); add it to run_with_cache(names_filter=...)")

DLA_REFUSAL = (
    "direct logit attribution needs a linear read-out W_U, but this model has the paper's MLP output "
    "head (LayerNorm -> MLP with ReLU hidden layers): the head mixes the residual components "
    "non-linearly, so their logit contributions do not add up to the logits. Measure a component's "
    "effect with activation patching instead (interp_norm.circuits.activation_patch, or "
    "transformer_lens.patching), or use a model built with head='unembed', where cache.logit_attrs works"
)


class NormActivationCache(ActivationCache):
    """TL's ``ActivationCache``, reading the residual norms as these models apply them.

    ``apply_ln_to_stack`` (and so ``accumulated_resid(apply_ln=True)``, ``decompose_resid(apply_ln=True)``,
    ``logit_attrs``) centres and scales by ``ln_final`` / ``ln2`` -- LayerNorms in every variant --
    and by ``ln1`` only on Pre-Norm models (the only ones with a norm between the residual and W_Q).
    Like TL it excludes the norms' gains and biases (TL folds them into the next weights).
    """

    def __getitem__(self, key: Any) -> torch.Tensor:
        """TL's lookup (full names, ``"q"``-style shorthands, ``("q", 0)`` tuples, negative layers),
        plus this package's head-norm kinds (``("q_normed", 0)``); a name the cache lacks is a
        :class:`HookNameError` (still a ``KeyError``) naming the closest valid names, as
        ``run_with_hooks`` does, or saying that ``names_filter`` left an existing point out."""
        if not isinstance(key, (str, tuple)):
            raise HookNameError(missing_from_cache(self.model, key, self.cache_dict))
        try:
            return super().__getitem__(key)
        except KeyError:
            pass
        name = key
        if isinstance(key, tuple) and key and isinstance(key[0], str):
            layer = key[1] if len(key) > 1 else None
            if isinstance(layer, int) and layer < 0:
                layer += self.model.cfg.n_layers
            try:
                name = act_name(key[0], layer, *key[2:3])
            except HookNameError as e:
                raise HookNameError(f"cache[{key!r}]: {e}") from None
            if name in self.cache_dict:
                return self.cache_dict[name]
        raise HookNameError(missing_from_cache(self.model, name, self.cache_dict)) from None

    def logit_attrs(self, residual_stack: torch.Tensor, tokens: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        """TL's, for ``head='unembed'`` models; a :class:`ConfigError` for the MLP head (see ``DLA_REFUSAL``)."""
        cfg: Any = self.model.cfg  # our ModelConfig (TransformerLens types it as its own config)
        if cfg.head != "unembed":
            raise ConfigError(DLA_REFUSAL)
        return super().logit_attrs(residual_stack, tokens, *args, **kwargs)

    def apply_ln_to_stack(  # type: ignore[override]
        self,
        residual_stack: torch.Tensor,
        layer: Optional[int] = None,
        mlp_input: bool = False,
        pos_slice: Any = None,
        batch_slice: Any = None,
        has_batch_dim: bool = True,
        *,
        recompute_ln: bool = False,
    ) -> torch.Tensor:
        cfg: Any = self.model.cfg  # our ModelConfig (TransformerLens types it as its own config)
        pos_slice = pos_slice if isinstance(pos_slice, Slice) else Slice(pos_slice)
        batch_slice = batch_slice if isinstance(batch_slice, Slice) else Slice(batch_slice)
        if layer is None or layer == -1:
            layer = cfg.n_layers
        final = layer == cfg.n_layers
        if has_batch_dim:
            residual_stack = batch_slice.apply(residual_stack, dim=1)
        if final and recompute_ln:  # the logit lens: the real ln_final on each component, gain and bias included
            return self.model.ln_final(residual_stack)
        if not (final or mlp_input) and cfg.attn_norm != "pre":
            return residual_stack  # no norm between this residual and W_Q/W_K/W_V (per-head norms act after them)
        if final or mlp_input or cfg.norm_kind == "ln":
            residual_stack = residual_stack - residual_stack.mean(dim=-1, keepdim=True)
        return residual_stack / self._get_cached_ln_scale(layer, mlp_input, pos_slice, batch_slice)


__all__ = [
    "dormant_hooks", "check_hook_name", "check_hooks", "check_names_filter", "unknown_hook_message",
    "NormActivationCache", "DLA_REFUSAL", "missing_from_cache",
]
