"""Labels shared by every figure: the variant names and HTML escaping of user text.

Labels that come from users (checkpoint names, problem strings) are HTML-escaped before they
reach plotly, which would otherwise interpret tags like ``<b>`` inside them.
"""

from __future__ import annotations

import html
from typing import Any, Optional

from interp_norm.card import SPLITS
from interp_norm.hooks import VARIANT_LABELS


def escape(text: Any) -> str:
    """HTML-escape user text for plotly labels and the dashboard (plotly renders entities back)."""
    return html.escape(str(text), quote=True)


def variant_label(name: str, attn_norm: Optional[str] = None) -> str:
    """``"Pre-Norm (pre-s1)"`` for a checkpoint called ``pre-s1``; ``"Pre-Norm"`` when the name is the variant.

    Raw text (for tables and CSVs); figures escape it when they display it.
    """
    nice = VARIANT_LABELS.get(attn_norm or "", attn_norm or "")
    if not nice or name == attn_norm:
        return str(nice or name)
    return f"{nice} ({name})"


__all__ = ["SPLITS", "VARIANT_LABELS", "escape", "variant_label"]
