"""Inputs for text models: the shipped sample text, tokenised windows, or random token ids.

A text model has no addition task, so accuracy under noise becomes agreement with the clean
model's next-token prediction on text the user passes. ``data/text/sample.txt`` is a short story
written for this project (free to use) so the examples run without downloads; tests use
:func:`random_tokens` (no tokenizer needed, and tiny random models have none).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import torch
from torch import Tensor

from interp_norm.errors import ConfigError

SAMPLE_FILE = Path("text") / "sample.txt"


def sample_text() -> str:
    """The shipped sample text (``<data folder>/text/sample.txt``)."""
    from interp_norm.training.checkpoints import data_dir

    path = data_dir() / SAMPLE_FILE
    if not path.is_file():
        raise ConfigError(f"the sample text {str(path)!r} is missing; set INTERP_NORM_DATA to the repository's data folder")
    return path.read_text(encoding="utf-8")


def _vocab(model_or_vocab: Any) -> int:
    if isinstance(model_or_vocab, int) and not isinstance(model_or_vocab, bool):
        return model_or_vocab
    cfg = getattr(model_or_vocab, "cfg", None)
    vocab = getattr(cfg, "d_vocab", None)
    if not isinstance(vocab, int) or vocab < 1:
        raise ConfigError(f"cannot read a vocabulary size from {type(model_or_vocab).__name__}; pass it as an int")
    return vocab


def random_tokens(model_or_vocab: Any, batch: int, pos: int, seed: int = 0, low: int = 0) -> Tensor:
    """Seeded uniform token ids [batch, pos] in [low, vocab): the tokenizer-free input for tests."""
    vocab = _vocab(model_or_vocab)
    for name, v in (("batch", batch), ("pos", pos)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ConfigError(f"{name} must be a positive integer, got {v!r}")
    if not 0 <= low < vocab:
        raise ConfigError(f"low must lie in [0, {vocab}), got {low!r}")
    return torch.randint(low, vocab, (batch, pos), generator=torch.Generator().manual_seed(seed))


def text_tokens(model: Any, text: Optional[str] = None, n_ctx: int = 64, max_windows: Optional[int] = None) -> Tensor:
    """``text`` (default :func:`sample_text`) tokenised by the model's tokenizer and cut into
    non-overlapping windows [n_windows, n_ctx] (the tail shorter than a window is dropped)."""
    tokenizer = getattr(model, "tokenizer", None)
    if tokenizer is None:
        raise ConfigError(
            "this model has no tokenizer (a tiny model built from a config, or a folder saved without one), so "
            "text cannot be tokenised; load a folder that includes the tokenizer files, or pass token ids "
            "(interp_norm.anatomy.random_tokens(model, batch, pos))"
        )
    if not isinstance(n_ctx, int) or n_ctx < 2:
        raise ConfigError(f"n_ctx must be an integer >= 2, got {n_ctx!r}")
    ids = tokenizer(text if text is not None else sample_text(), return_tensors="pt")["input_ids"][0]
    n = len(ids) // n_ctx
    if n == 0:
        raise ConfigError(f"the text has {len(ids)} tokens, fewer than one window of n_ctx={n_ctx}; pass more text or a smaller n_ctx")
    windows = ids[: n * n_ctx].view(n, n_ctx)
    return windows if max_windows is None else windows[:max_windows]


#: TransformerBridge's methods between text and token ids: each asserts it has a tokenizer.
_TEXT_METHODS = ("to_tokens", "to_string", "to_str_tokens", "to_single_token")


def _needs_tokenizer(method: str, bridge: Any, *args: Any, **kwargs: Any) -> Any:
    if getattr(bridge, "tokenizer", None) is None:
        name = getattr(bridge.cfg, "model_name", None) or "this model"
        raise ConfigError(
            f"{name!r} has no tokenizer (none was saved beside the weights), so {method} cannot convert between "
            "text and token ids; copy tokenizer.json / tokenizer_config.json into the model folder and load it "
            "again, or give the model token ids (interp_norm.anatomy.random_tokens(model, batch, pos))")
    return getattr(type(bridge), method)(bridge, *args, **kwargs)


def refuse_text_without_tokenizer(bridge: Any) -> Any:
    """Give ``bridge`` instance methods ``to_tokens``, ``to_string``, ... that raise a ConfigError naming
    the fix while it has no tokenizer, instead of TransformerLens's bare ``AssertionError``; with a
    tokenizer (``bridge.tokenizer = ...`` later) they are TransformerLens's own. Bound methods, so a
    deep copy of the bridge checks its own tokenizer. Returns ``bridge``."""
    import functools
    import types

    for method in _TEXT_METHODS:
        if hasattr(type(bridge), method):
            object.__setattr__(bridge, method, types.MethodType(functools.partial(_needs_tokenizer, method), bridge))
    return bridge


__all__ = ["sample_text", "random_tokens", "text_tokens", "refuse_text_without_tokenizer", "SAMPLE_FILE"]
