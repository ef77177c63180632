"""Labels and colours shared by every figure: the variant names, their one colour each, HTML escaping.

One palette, keyed by variant: a variant has the same colour in every figure (the dashboard's
browser test checks it). Labels derived from a variant keep its colour -- a seed or checkpoint
suffix (``"QKV-Norm (qkv-s1)"``), a placement (``"QKV-Norm, noise after norm"``), an escaped name
-- so figures only vary dash, marker or facet to tell such series apart. Anything that is not one of
the four variants (a bridge model, a bare checkpoint name) gets a colour from a second palette,
chosen by a stable hash of its name, so it too is the same everywhere.

Labels that come from users (checkpoint names, problem strings) are HTML-escaped before they
reach plotly, which would otherwise interpret tags like ``<b>`` inside them.
"""

from __future__ import annotations

import html
import math
import zlib
from typing import Any, Optional

from interp_norm.card import SPLITS
from interp_norm.hooks import VARIANT_LABELS

#: The colour of each variant (by its display label), used by every figure.
VARIANT_COLOURS: dict[str, str] = {
    "Pre-Norm": "#1f77b4",  # blue
    "QKV-Norm": "#d62728",  # red
    "QK-Norm": "#2ca02c",  # green
    "No-Norm": "#9467bd",  # purple
}
# for anything else (bridges, unlabelled checkpoints): none of the variant colours
_OTHER_COLOURS = ("#ff7f0e", "#8c564b", "#e377c2", "#17becf", "#bcbd22", "#7f7f7f", "#393b79", "#637939")
#: The paper's reference values: black, dashed, always with a legend entry.
PAPER_LINE: dict[str, Any] = dict(color="black", dash="dash", width=1.5)

_BY_CODE = {code: VARIANT_LABELS[code] for code in VARIANT_LABELS}
# longest first: "QKV-Norm" must not be read as "QK-Norm" (it is not a prefix, but stay safe)
_BASES = sorted(VARIANT_COLOURS, key=len, reverse=True)


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


def base_variant(label: Any) -> Optional[str]:
    """The variant a label belongs to (``"QKV-Norm"`` for ``"QKV-Norm (qkv-s1), noise after norm"``
    or for the code ``"qkv"``), or None for anything else."""
    s = html.unescape(str(label)).strip()
    if s in _BY_CODE:
        return _BY_CODE[s]
    for base in _BASES:
        if s == base or s.startswith(base + " ") or s.startswith(base + ","):
            return base
    return None


def variant_colour(label: Any) -> str:
    """The one colour of ``label``'s variant (see the module docstring); stable for any other label."""
    base = base_variant(label)
    if base is not None:
        return VARIANT_COLOURS[base]
    key = html.unescape(str(label)).strip().encode("utf-8")
    return _OTHER_COLOURS[zlib.crc32(key) % len(_OTHER_COLOURS)]


_DASHES = ("solid", "dot", "dashdot", "longdash", "longdashdot")


def member_dashes(labels: Any) -> dict[str, str]:
    """Line dash per label so that labels sharing a variant colour (seeds) stay apart: the first of
    each variant is solid, the next dotted, and so on."""
    seen: dict[Optional[str], int] = {}
    out = {}
    for v in dict.fromkeys(map(str, labels)):
        b = base_variant(v) or v
        out[v] = _DASHES[seen.get(b, 0) % len(_DASHES)]
        seen[b] = seen.get(b, 0) + 1
    return out


def colour_map(labels: Any) -> dict[str, str]:
    """``{label: variant_colour(label)}`` for plotly express's ``color_discrete_map``."""
    return {str(v): variant_colour(v) for v in dict.fromkeys(labels)}


# trace types plotly leaves out of the legend unless showlegend=True (named heatmaps are not legend entries)
_NO_LEGEND = frozenset({"heatmap", "heatmapgl", "contour", "histogram2d", "histogram2dcontour", "surface", "image",
                        "table", "mesh3d", "cone", "streamtube", "volume", "isosurface"})


def row_gap(rows: int, height: float, gap_px: float, cap: float) -> float:
    """``make_subplots``' ``vertical_spacing`` for ``rows`` rows in a figure ``height`` px tall: a gap
    of ``gap_px`` pixels, at most ``cap`` (the fraction small figures use). Plotly refuses a spacing
    above 1/(rows - 1), which a fixed fraction reaches as soon as a model has many layers or a
    report many checkpoints; a gap in pixels shrinks as the figure grows, so the panels keep their size."""
    if rows <= 1:
        return cap
    return min(cap, gap_px / height, 0.5 / (rows - 1))


def fit_legend(fig: Any, max_side_entries: int = 8) -> Any:
    """A legend of more than ``max_side_entries`` entries moves below the plot, laid out
    horizontally, and the figure grows to hold it, so it never needs a scroll box."""
    entries = [t for t in fig.data if t.name and (t.showlegend or (t.showlegend is None and t.type not in _NO_LEGEND))]
    seen = {t.legendgroup or t.name for t in entries}
    if len(seen) <= max_side_entries or (fig.layout.legend and fig.layout.legend.orientation == "h"):
        return fig
    rows = math.ceil(len(seen) / 3)
    height = (fig.layout.height or 450) + 22 * rows
    fig.update_layout(height=height, legend=dict(orientation="h", yanchor="top", y=-0.18 - 0.02 * rows * 450 / height,
                                                 xanchor="left", x=0), margin=dict(b=60 + 22 * rows))
    return fig


__all__ = ["fit_legend", "row_gap", "SPLITS", "VARIANT_LABELS", "VARIANT_COLOURS", "PAPER_LINE", "escape", "variant_label",
           "base_variant", "variant_colour", "colour_map", "member_dashes"]
