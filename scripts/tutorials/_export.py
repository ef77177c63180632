"""Execute the tutorial notebooks and export each to one offline HTML page (``--execute`` of the builder).

Why a special renderer: in a kernel without a browser, plotly's default renderer emits only its
JSON mimetype, which nbconvert's HTML export drops, and plotly's "notebook" renderers add a
MathJax/plotly CDN script. So the export prepends one cell (removed again before export, never
saved in the .ipynb) that registers a renderer writing each figure as plain HTML without plotly.js.
The page template is nbconvert's ``lab`` template without its require.js, MathJax and mermaid
``<script src=...>`` tags, plus one ``<script src="plotly.min.js">``: every page in ``html/`` shares
one local copy of plotly.js (written beside them), so six pages cost 4.6 MB of plotly.js instead of
28 MB, and nothing is loaded from the network (:func:`external_references` checks that). The same for
the ~7300 lines of nbconvert's CSS (the lab theme and the code highlighting, identical on every page):
they are moved out of each page's ``<head>`` into one local ``notebook.css`` that every page links
(:func:`shared_css` is that CSS, taken from the export of an empty notebook; a page whose head CSS
differs from it is an error rather than a page that silently loses its styles).

The checked-in notebooks stay output-free; the HTML pages are what a reader opens without Jupyter.
"""

from __future__ import annotations

import functools
import os
import re
from pathlib import Path
from typing import Optional, Sequence

import nbformat
from nbformat.v4 import new_code_cell, new_notebook

REPO = Path(__file__).resolve().parents[2]
TUTORIALS = REPO / "tutorials"  # the notebooks and html/ (this builder lives in scripts/tutorials/)

OFFLINE_PLOTLY = '''\
# Export only (removed before the HTML is written): figures as HTML, plotly.js embedded once, no CDN.
import plotly.io as _pio
from plotly.io.base_renderers import MimetypeRenderer as _MimetypeRenderer


class _OfflineHTML(_MimetypeRenderer):
    def to_mimebundle(self, fig_dict):
        html = _pio.to_html(fig_dict, include_plotlyjs=False, include_mathjax=False, full_html=False,
                            default_width="100%", default_height=525, validate=False)
        return {"text/html": html}


_pio.renderers["offline_html"] = _OfflineHTML()
_pio.renderers.default = "offline_html"
'''

# nbconvert's lab page without the <script src="https://..."> tags it adds by default.
OFFLINE_TEMPLATE = """\
{%- extends 'index.html.j2' -%}
{%- block html_head_js_requirejs -%}{%- endblock html_head_js_requirejs -%}
{%- block html_head_js_mathjax -%}{%- endblock html_head_js_mathjax -%}
{%- block html_head_js_mermaidjs -%}{%- endblock html_head_js_mermaidjs -%}
{%- block extra_css -%}{{ super() }}<script src="plotly.min.js"></script>{%- endblock extra_css -%}
"""

#: The shared local copy of plotly.js that every exported page loads (written by :func:`execute_all`).
PLOTLY_JS = "plotly.min.js"
#: The shared stylesheet (nbconvert's lab CSS) that every exported page links (written by :func:`execute_all`).
NOTEBOOK_CSS = "notebook.css"
_HEAD_STYLE = re.compile(r"[ \t]*<style[^>]*>(.*?)</style>[ \t]*\n?", re.S | re.I)

_EXTERNAL = re.compile(r"<(?:script|link|img|iframe)\b[^>]*\b(?:src|href)\s*=\s*[\"']?(?:https?:)?//[^\"'\s>]+", re.I)
_CSS_IMPORT = re.compile(r"@import\s+(?:url\()?[\"']?(?:https?:)?//", re.I)


def external_references(html: str) -> list[str]:
    """Tags and CSS imports in ``html`` that would load something from the network."""
    return _EXTERNAL.findall(html) + _CSS_IMPORT.findall(html)


def has_nbconvert() -> bool:
    try:
        import nbconvert  # noqa: F401
    except ImportError:
        return False
    return True


def execute_notebook(path: Path, timeout: int = 600) -> nbformat.NotebookNode:
    """Run ``path`` top to bottom in a fresh kernel started in ``tutorials/`` (as Jupyter does) on this
    checkout's package; raise on the first failing cell."""
    import nbclient

    nb = nbformat.read(path, as_version=4)
    nb.cells.insert(0, new_code_cell(OFFLINE_PLOTLY))
    env = {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
           "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)  # the kernel inherits the environment
    try:
        nbclient.NotebookClient(nb, timeout=timeout, kernel_name="python3",
                                resources={"metadata": {"path": str(TUTORIALS)}}).execute()
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    del nb.cells[0]
    for cell in nb.cells:  # number the cells as if the renderer cell had never run
        if cell.cell_type == "code" and cell.get("execution_count"):
            cell.execution_count -= 1
            for out in cell.outputs:
                if out.get("execution_count"):
                    out.execution_count -= 1
    return nb


def _export_html(nb: nbformat.NotebookNode, title: str) -> str:
    from jinja2 import DictLoader
    from nbconvert import HTMLExporter

    exporter = HTMLExporter(template_name="lab", extra_loaders=[DictLoader({"offline.html.j2": OFFLINE_TEMPLATE})],
                            template_file="offline.html.j2")
    nb = nbformat.from_dict(nb)
    nb.metadata["title"] = title
    return exporter.from_notebook_node(nb)[0]


def _split_head_css(html: str) -> tuple[str, str, int]:
    """(the ``<style>`` blocks of the page's ``<head>`` joined, the page without them, where the first was)."""
    head, sep, body = html.partition("</head>")
    blocks = list(_HEAD_STYLE.finditer(head))
    if not blocks:
        return "", html, -1
    css = "\n".join(m.group(1).strip("\n") for m in blocks) + "\n"
    return css, _HEAD_STYLE.sub("", head) + sep + body, blocks[0].start()


@functools.cache
def shared_css() -> str:
    """nbconvert's lab CSS as this exporter puts it in every page's head (from an empty notebook)."""
    css, _, _ = _split_head_css(_export_html(new_notebook(), "empty"))
    return css


def to_offline_html(nb: nbformat.NotebookNode, title: str) -> str:
    """One page (nbconvert's lab look) that loads only ``plotly.min.js`` and ``notebook.css`` from its
    own folder, nothing from the network."""
    css, html, at = _split_head_css(_export_html(nb, title))
    if css != shared_css():
        raise RuntimeError(f"the exported page {title!r} has head CSS that differs from the shared {NOTEBOOK_CSS}")
    html = html[:at] + f'<link rel="stylesheet" href="{NOTEBOOK_CSS}">\n' + html[at:]
    found = external_references(html)
    if found:
        raise RuntimeError(f"the exported page {title!r} still references the network: {found[:3]}")
    return html


def execute_all(names: Sequence[str], html_dir: Optional[Path] = None, timeout: int = 600) -> list[Path]:
    """Execute each notebook and write ``html_dir/<name>.html`` (plus the shared ``plotly.min.js`` and
    ``notebook.css``); without nbconvert, execute only."""
    from interp_norm.training.io import ensure_writable_dir, write_text_atomic

    html = has_nbconvert()
    if not html:
        print("nbconvert is not installed: executing the notebooks without writing HTML "
              "(install it, e.g. with the project's notebooks extra, to get tutorials/html/)")
    out_dir = ensure_writable_dir(html_dir or TUTORIALS / "html") if html else None
    written = []
    if out_dir is not None:
        from plotly.offline import get_plotlyjs

        written.append(write_text_atomic(out_dir / PLOTLY_JS, get_plotlyjs(), durable=False))
        written.append(write_text_atomic(out_dir / NOTEBOOK_CSS, shared_css(), durable=False))
    for name in names:
        nb = execute_notebook(TUTORIALS / name, timeout=timeout)
        print(f"executed {name}")
        if out_dir is not None:
            path = write_text_atomic(out_dir / f"{Path(name).stem}.html", to_offline_html(nb, Path(name).stem), durable=False)
            print(f"wrote {path} ({path.stat().st_size / 1e6:.1f} MB)")
            written.append(path)
    return written
