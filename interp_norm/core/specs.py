"""Settings objects with keyword overrides: ``f(model, spec=None, **overrides)``.

Functions with many options take one frozen dataclass (a spec) and accept its fields as keyword
arguments too, so callers may write either ``f(m, spec)`` or ``f(m, draws=8)``. One helper builds
the spec so every such function refuses an unknown option the same way.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Optional, TypeVar

from interp_norm.errors import ConfigError

S = TypeVar("S")


def field_names(cls: type) -> list[str]:
    """The fields of dataclass ``cls``, in declaration order."""
    return [f.name for f in dataclasses.fields(cls)]


def with_overrides(cls: type[S], spec: Optional[S], overrides: Mapping[str, Any], *, who: str,
                   error: type[Exception] = ConfigError) -> S:
    """``spec`` (None: ``cls()``'s defaults) with ``overrides`` replacing fields; an unknown name raises ``error``
    naming it and the valid ones, a spec of another type raises ``error`` too."""
    names = field_names(cls)
    unknown = sorted(set(overrides) - set(names))
    if unknown:
        raise error(f"{who} has no option {', '.join(map(repr, unknown))}; its options are {cls.__name__}'s "
                    f"fields: {names}")
    if spec is None:
        return cls(**overrides)
    if not isinstance(spec, cls):
        raise error(f"{who}: spec must be a {cls.__name__}, got {type(spec).__name__}")
    return dataclasses.replace(spec, **overrides) if overrides else spec  # type: ignore[type-var]


def split_overrides(overrides: Mapping[str, Any], cls: type) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the overrides that are fields of ``cls``, the rest), for a function whose options span two specs."""
    names = set(field_names(cls))
    return ({k: v for k, v in overrides.items() if k in names}, {k: v for k, v in overrides.items() if k not in names})


__all__ = ["field_names", "with_overrides", "split_overrides"]
