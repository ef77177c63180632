"""One figure style for every plot: a colour per variant, a dash and marker per seed / recipe, legends and titles that fit.

**Colour = variant.** :func:`variant_colour` gives each of the four variants its one colour
(:data:`VARIANT_COLOURS`: Pre-Norm blue, QKV-Norm red, QK-Norm green, No-Norm purple) in every
figure; labels derived from a variant keep it -- a seed or checkpoint suffix (``"QKV-Norm
(qkv-s1)"``), a placement (``"QKV-Norm, noise after norm"``), an escaped name. Anything else (a
Hugging Face model, a bare checkpoint name) gets a colour from :data:`REAL_MODEL_COLOURS`, which
never reuses a variant's colour (:func:`real_model_colour`). The dashboard's browser test checks both.

**Dash and marker = seed and recipe.** :func:`member_style` reads a label's checkpoint name
(``pre``, ``pre-s1``, ``pre-cal``, ``pre-cal-s1``, ``qkv-30k-s3`` ...): the seed (``-sN``, default 0)
picks the line dash and the marker's shape (:data:`SEED_DASHES`, :data:`SEED_SYMBOLS`), the
recipe (``cal``: the paper's Checkpoint calibration, ``30k`` ...) picks the marker's fill
(:data:`RECIPE_FILL`: filled, open, open with a dot) and noise placed after the norm another set
of shapes (:data:`AFTER_NORM_SYMBOLS`). Seeds 0-5 and every recipe/placement
combination of the shipped checkpoints are told apart; bars use :func:`member_style`'s
``pattern`` (by seed) and, for a recipe other than the reference, the pattern in colour on white
with a dark outline (:func:`bar_style`).

**Layout.** :func:`fit_layout` (the dashboard applies it to every figure) puts legends
below the plot, horizontally, with room reserved for them, and wraps long titles, so nothing
is clipped at 1000 px.

Labels that come from users (checkpoint names, problem strings) are HTML-escaped before they
reach plotly, which would otherwise interpret tags like ``<b>`` inside them.
"""

from __future__ import annotations

import html
import math
import re
import zlib
from typing import Any, Iterable, Optional

from interp_norm.report.card import SPLITS
from interp_norm.core.defaults import VARIANT_LABELS

#: The colour of each variant (by its display label), used by every figure.
VARIANT_COLOURS: dict[str, str] = {
    "Pre-Norm": "#1f77b4",  # blue
    "QKV-Norm": "#d62728",  # red
    "QK-Norm": "#2ca02c",  # green
    "No-Norm": "#9467bd",  # purple
}
#: Colours for real (Hugging Face) models and other non-variant labels: none is a variant's colour
#: (nor close to one: no other blue, red, green or purple).
REAL_MODEL_COLOURS: tuple[str, ...] = ("#ff7f0e", "#17becf", "#8c564b", "#e377c2", "#bcbd22", "#7f7f7f", "#000000",
                                       "#f0a30a")
#: The paper's reference values: black, dashed, always with a legend entry.
PAPER_LINE: dict[str, Any] = dict(color="black", dash="dash", width=1.5)
#: Line dash by seed (seed 0 solid); seeds beyond 5 cycle.
SEED_DASHES: tuple[str, ...] = ("solid", "dot", "dash", "longdash", "dashdot", "longdashdot")
#: Marker shape by seed (seed 0 a circle); each has plotly's -open / -dot / -open-dot forms.
SEED_SYMBOLS: tuple[str, ...] = ("circle", "square", "diamond", "triangle-up", "pentagon", "star")
#: Bar pattern by seed (seed 0 plain).
SEED_PATTERNS: tuple[str, ...] = ("", "/", ".", "x", "\\", "+")
#: Marker shape by seed for noise placed after the norm (the "noise after norm" series).
AFTER_NORM_SYMBOLS: tuple[str, ...] = ("x", "cross", "triangle-down", "hexagram", "star-square", "diamond-tall")
#: Marker fill by recipe: the reference recipe filled, the paper's calibration open, other
#: recipes (``30k`` ...) open with a dot.
RECIPE_FILL: dict[str, str] = {"": "", "cal": "-open"}
_OTHER_RECIPE_FILL = "-open-dot"
AFTER_NORM = "noise after norm"

_BY_CODE = {code: VARIANT_LABELS[code] for code in VARIANT_LABELS}
# longest first: "QKV-Norm" must not be read as "QK-Norm" (it is not a prefix, but stay safe)
_BASES = sorted(VARIANT_COLOURS, key=len, reverse=True)


def escape(text: Any) -> str:
    """HTML-escape user text for plotly labels and the dashboard (plotly renders entities back).
    Idempotent: text escaped once already (the dashboard escapes its labels) is not escaped again."""
    return html.escape(html.unescape(str(text)), quote=True)


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


def real_model_colour(name: Any) -> str:
    """The colour of a label that is not a variant (a Hugging Face model such as ``gpt2``): from
    :data:`REAL_MODEL_COLOURS`, chosen by a stable hash of the name, so it is the same in every figure."""
    key = html.unescape(str(name)).strip().encode("utf-8")
    return REAL_MODEL_COLOURS[zlib.crc32(key) % len(REAL_MODEL_COLOURS)]


def variant_colour(label: Any) -> str:
    """The one colour of ``label``'s variant; a label of no variant gets :func:`real_model_colour`."""
    base = base_variant(label)
    return VARIANT_COLOURS[base] if base is not None else real_model_colour(label)


def colour_map(labels: Iterable[Any]) -> dict[str, str]:
    """``{label: colour}``: variants by :func:`variant_colour`; other labels by :func:`real_model_colour`,
    except that two of them never share a colour (later ones move to the next free colour, in
    sorted order, so the same set of models gets the same colours in every figure)."""
    labels = [str(v) for v in dict.fromkeys(map(str, labels))]
    out = {v: VARIANT_COLOURS[b] for v in labels if (b := base_variant(v)) is not None}
    used: set = set()
    for v in sorted(v for v in labels if v not in out):
        c = real_model_colour(v)
        i = REAL_MODEL_COLOURS.index(c)
        for k in range(len(REAL_MODEL_COLOURS)):
            if REAL_MODEL_COLOURS[(i + k) % len(REAL_MODEL_COLOURS)] not in used:
                c = REAL_MODEL_COLOURS[(i + k) % len(REAL_MODEL_COLOURS)]
                break
        used.add(c)
        out[v] = c
    return {v: out[v] for v in labels}


_SEED = re.compile(r"(?:^|[-_])s(?:eed)?(\d+)$")


def member_key(label: Any) -> tuple[int, str, bool]:
    """``(seed, recipe, after_norm)`` read from a label: ``"Pre-Norm (pre-cal-s1)"`` -> ``(1, "cal", False)``,
    ``"QKV-Norm, noise after norm"`` -> ``(0, "", True)``, ``"qkv-30k"`` -> ``(0, "30k", False)``.

    The checkpoint name is the text in parentheses (else the label up to a comma); its seed is a
    trailing ``-sN`` (none: 0) and its recipe whatever lies between the variant code and the seed.
    """
    s = html.unescape(str(label)).strip()
    after = AFTER_NORM in s
    m = re.match(r"^[^(]*\((.*)\)", s)
    name = (m.group(1) if m else s.split(",")[0]).strip()
    seed = 0
    ms = _SEED.search(name)
    if ms:
        seed, name = int(ms.group(1)), name[:ms.start()]
    parts = [p for p in re.split(r"[-_]", name) if p]
    if parts and (parts[0] in _BY_CODE or base_variant(parts[0]) is not None or name == base_variant(name)):
        parts = parts[1:]
    if base_variant(name) is not None and not m:
        parts = []  # the label is the variant itself ("Pre-Norm", "QKV-Norm, noise after norm")
    return seed, "-".join(parts), after


def member_style(label: Any) -> dict[str, Any]:
    """The dash, marker and bar pattern of one seed / recipe / placement (see the module docstring):
    ``{"dash", "symbol", "pattern", "outline"}``. The colour stays the variant's."""
    seed, recipe, after = member_key(label)
    fill = RECIPE_FILL.get(recipe, _OTHER_RECIPE_FILL)
    shapes = AFTER_NORM_SYMBOLS if after else SEED_SYMBOLS
    return dict(dash=SEED_DASHES[seed % len(SEED_DASHES)], symbol=shapes[seed % len(shapes)] + fill,
                pattern=SEED_PATTERNS[seed % len(SEED_PATTERNS)], outline=bool(recipe))


def line_style(label: Any, width: float = 2.0, size: float = 8, colour: Optional[str] = None) -> dict[str, Any]:
    """``go.Scatter``'s ``line`` and ``marker`` for one series: its variant's colour (or ``colour``),
    its seed's dash and marker (see :func:`member_style`)."""
    st = member_style(label)
    c = colour or variant_colour(label)
    return dict(line=dict(color=c, dash=st["dash"], width=width),
                marker=dict(color=c, symbol=st["symbol"], size=size, line=dict(color=c, width=1.5)))


def bar_style(label: Any) -> dict[str, Any]:
    """``go.Bar``'s marker for one series: its variant's colour, its seed's pattern (white on colour);
    a recipe other than the reference: the pattern in colour on white, with a dark outline."""
    st = member_style(label)
    c = variant_colour(label)
    if st["outline"]:  # another recipe: the pattern in the variant's colour on white, a dark outline
        return dict(color=c, pattern=dict(shape=st["pattern"] or "-", fgcolor=c, bgcolor="white", fillmode="replace", size=6),
                    line=dict(color="#222", width=1.5))
    return dict(color=c, pattern=dict(shape=st["pattern"], fgcolor="white", size=6, fillmode="overlay"),
                line=dict(color="white", width=0.5))


def dodge(i: int, n: int, width: float = 0.7) -> float:
    """Offset of series ``i`` of ``n`` around a category (so dots of several series sit side by side)."""
    return 0.0 if n <= 1 else (i / (n - 1) - 0.5) * width


# ----------------------------------------------------------------------------- layout

# trace types plotly leaves out of the legend unless showlegend=True (named heatmaps are not legend entries)
_NO_LEGEND = frozenset({"heatmap", "heatmapgl", "contour", "histogram2d", "histogram2dcontour", "surface", "image",
                        "table", "mesh3d", "cone", "streamtube", "volume", "isosurface"})
#: The narrowest width a figure is laid out for (a 1000 px window: the dashboard's panel is ~930 px).
NARROW_PX = 920
_CHAR_PX = 7.5  # mean width of a 12 px character (DejaVu Sans / system-ui), rounded up
_TAG = re.compile(r"<[^>]+>")
_SPACE_OUTSIDE_TAGS = re.compile(r" (?![^<]*>)")  # a line may break at a space, never inside <span style=...>


def row_gap(rows: int, height: float, gap_px: float, cap: float) -> float:
    """``make_subplots``' ``vertical_spacing`` for ``rows`` rows in a figure ``height`` px tall: a gap
    of ``gap_px`` pixels, at most ``cap`` (the fraction small figures use). Plotly refuses a spacing
    above 1/(rows - 1), which a fixed fraction reaches as soon as a model has many layers or a
    report many checkpoints; a gap in pixels shrinks as the figure grows, so the panels keep their size."""
    if rows <= 1:
        return cap
    return min(cap, gap_px / height, 0.5 / (rows - 1))


def text_px(text: str, size: float = 12) -> float:
    """Rough rendered width of plotly text (tags removed, entities decoded)."""
    return len(html.unescape(_TAG.sub("", str(text)))) * _CHAR_PX * size / 12


def wrap(text: str, max_px: float, size: float = 12) -> str:
    """``text`` with ``<br>`` between words so that no line is wider than ``max_px`` (a rough estimate)."""
    lines: list[str] = []
    per = max(4, int(max_px / (_CHAR_PX * size / 12)))  # characters per line, for words longer than a line

    def pieces(word: str) -> list[str]:
        if text_px(word, size) <= max_px or "&" in word or "<" in word:
            return [word]
        return [word[i:i + per] for i in range(0, len(word), per)]

    for para in str(text).split("<br>"):
        line = ""
        for word in (p for w in _SPACE_OUTSIDE_TAGS.split(para) for p in pieces(w)):
            if line and text_px(line + " " + word, size) > max_px:
                lines.append(line)
                line = word
            else:
                line = f"{line} {word}" if line else word
        lines.append(line)
    return "<br>".join(lines)


def _legend_entries(fig: Any) -> list[str]:
    names: dict[str, str] = {}
    for t in fig.data:
        if not t.name or t.showlegend is False or (t.showlegend is None and t.type in _NO_LEGEND):
            continue
        if t.type in _NO_LEGEND and not t.showlegend:
            continue
        names.setdefault(t.legendgroup or t.name, t.name)
    return list(names.values())


def legend_rows(names: Iterable[str], width: float, title: str = "", size: float = 12) -> int:
    """Rows a horizontal plotly legend needs at ``width`` px (entries packed left to right)."""
    rows, x = 1, text_px(title, size) + 10 if title else 0.0
    for n in names:
        w = 46 + text_px(n, size)
        if x and x + w > width:
            rows, x = rows + 1, 0.0
        x += w
    return rows


def fit_layout(fig: Any, width: float = NARROW_PX) -> Any:
    """Lay a figure out so that nothing clips or collides from ``width`` px up (the dashboard's
    smallest panel): the legend goes below the plot, horizontal, with the rows it needs at that
    width reserved in the bottom margin (the figure grows by as much); the title wraps, with room
    for it and the subplot titles; subplot titles wrap to their panel's width."""
    lay = fig.layout
    height = float(lay.height or 450)
    # subplot titles (make_subplots' annotations above each panel): smaller, wrapped to the panel width
    top_titles = 0
    for a in lay.annotations or ():
        if a.yanchor == "bottom" and a.showarrow is False and a.xref == "paper" and a.yref == "paper" and a.text:
            doms = [lay[k].domain for k in lay if k.startswith("xaxis") and lay[k].domain]
            span = min((d[1] - d[0] for d in doms if d[0] - 1e-6 <= (a.x or 0) <= d[1] + 1e-6), default=1.0)
            size = min(13, (a.font.size or 13))
            a.update(text=wrap(a.text, max(110.0, 0.9 * span * (width - 140)), size), font=dict(size=size))
            if (a.y or 0) >= 0.999:
                top_titles = max(top_titles, a.text.count("<br>") + 1)
    # the title: wrapped, at the top of the figure
    title = lay.title.text if lay.title and lay.title.text else ""
    t_lines = 0
    if title:
        text = wrap(title, width - 60, 16)
        t_lines = text.count("<br>") + 1
        fig.update_layout(title=dict(text=text, font=dict(size=16), x=0.01, xanchor="left", xref="container",
                                     y=1, yanchor="top", yref="container", pad=dict(t=10 + 18 * (t_lines - 1))))
    top = 16 + 21 * t_lines + (18 * top_titles + 6 if top_titles else 0) + 8
    # the legend: below, horizontal, its rows reserved
    names = _legend_entries(fig)
    bottom = max(float(lay.margin.b or 0), 60.0)
    if names and lay.showlegend is not False:
        ltitle = lay.legend.title.text if lay.legend and lay.legend.title and lay.legend.title.text else ""
        rows = legend_rows(names, width - 40) + (1 if ltitle else 0)
        extra = 22 * rows + 12
        bottom = max(bottom, 72.0) + extra
        height += extra
        legend = dict(orientation="h", yref="container", y=0, yanchor="bottom", xref="container", x=0.01, xanchor="left",
                      font=dict(size=12))
        if ltitle:
            legend["title"] = dict(text=ltitle, side="top")
        fig.update_layout(legend=legend)
    fig.update_layout(height=height, margin=dict(t=max(float(lay.margin.t or 0), top), b=bottom,
                                                 l=lay.margin.l if lay.margin.l is not None else 70,
                                                 r=lay.margin.r if lay.margin.r is not None else 30))
    return fig


def log_axis(fig: Any, axis: str, values: Any) -> None:
    """A log axis ticked at 1, 2, 5 x 10^k within the data's range (no minor labels such as "3 2 1 9 8 7")."""
    v = [float(x) for x in values if x is not None and x == x and float(x) > 0]
    if not v:
        return
    vmin, vmax = min(v), max(v)
    lo, hi = math.floor(math.log10(vmin)), math.ceil(math.log10(vmax))
    ticks = [m * 10.0 ** k for k in range(lo, hi + 1) for m in (1, 2, 5) if vmin / 1.5 <= m * 10.0 ** k <= vmax * 1.5]
    if len(ticks) < 3:  # less than a decade: four ticks spread over the range, three significant digits
        ticks = sorted({float(f"{vmin * (vmax / vmin) ** (i / 3):.3g}") for i in range(4)})
    upd = dict(type="log", tickmode="array", tickvals=ticks, ticktext=[f"{t:g}" for t in ticks], minor=dict(showgrid=False))
    (fig.update_yaxes if axis == "y" else fig.update_xaxes)(**upd)


#: Old name of :func:`fit_layout`.
fit_legend = fit_layout


__all__ = ["fit_layout", "fit_legend", "row_gap", "wrap", "text_px", "legend_rows", "SPLITS", "VARIANT_LABELS",
           "VARIANT_COLOURS", "REAL_MODEL_COLOURS", "PAPER_LINE", "SEED_DASHES", "SEED_SYMBOLS", "SEED_PATTERNS",
           "RECIPE_FILL", "AFTER_NORM_SYMBOLS", "escape", "variant_label", "base_variant", "variant_colour", "real_model_colour", "colour_map",
           "member_key", "member_style", "line_style", "bar_style", "dodge", "log_axis"]
