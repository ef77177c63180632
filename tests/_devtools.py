"""Headless Chromium driven over the DevTools protocol (``--remote-debugging-pipe``; test-only).

One browser serves many page loads: :class:`Browser` opens a tab, sets the viewport width
(``Emulation.setDeviceMetricsOverride``), loads a page and waits for the dashboard's
``#render-status`` to say it is complete, then reads what the browser itself recorded, not what
the page says about itself:

* every network request (``Network.requestWillBeSent``) other than the page's own document;
* every console error, uncaught exception and browser log error (``Runtime.consoleAPICalled``,
  ``Runtime.exceptionThrown``, ``Log.entryAdded``);
* per figure, the on-screen boxes of its SVG, title, legend, annotations and axis titles, and the
  style plotly resolved for each trace (``div._fullData``): see :data:`MEASURE_JS`.

No Python package beyond the standard library: the protocol runs over two pipes (file
descriptors 3 and 4 of the browser), one JSON message per NUL-terminated chunk.
"""

from __future__ import annotations

import base64
import fcntl
import json
import os
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Union

__all__ = ["Browser", "PageLoad", "MEASURE_JS", "GEOMETRY_JS", "boxes_overlap", "inside"]

#: Per figure, where its pieces landed on screen (page pixels): every tick label (box, font size), every
#: subplot's plot area, every colour bar, every annotation with an opaque background, every trace's points
#: (line traces sampled along their segments) with its name, mode, width and marker sizes, every visible
#: heatmap's share of blank cells.
GEOMETRY_JS = r"""
const GEOMETRY = (div) => {
  const R = (el) => { const r = el.getBoundingClientRect(); return [r.left, r.top, r.right, r.bottom]; };
  const fl = div._fullLayout || {}, svg = div.querySelector('svg.main-svg');
  const o = svg ? svg.getBoundingClientRect() : {left: 0, top: 0};
  const g = {ticks: [], plots: [], colorbars: [], boxes: [], subtitles: [], series: [], heatmaps: []};
  div.querySelectorAll('.xtick text, .ytick text').forEach((e) => {
    const r = R(e);
    if (r[2] - r[0] > 0.5) g.ticks.push({text: (e.textContent || '').slice(0, 20), box: r,
                                          size: parseFloat(getComputedStyle(e).fontSize)});
  });
  div.querySelectorAll('.draglayer .nsewdrag').forEach((e) => g.plots.push(R(e)));
  div.querySelectorAll('.infolayer g.colorbar').forEach((e) => { const bg = e.querySelector('rect.cbbg');
    g.colorbars.push(R(bg || e)); });
  div.querySelectorAll('.infolayer g.annotation').forEach((e) => {
    const bg = e.querySelector('rect.bg');
    const fill = bg ? getComputedStyle(bg).fill : 'none';
    const m = /rgba?\(([^)]*)\)/.exec(fill || '');
    const alpha = m ? (m[1].split(',').length > 3 ? parseFloat(m[1].split(',')[3]) : 1) : 0;
    // where a data-anchored annotation points (a label of a point may sit over the lines leaving that point)
    const a = (fl.annotations || [])[parseInt(e.getAttribute('data-index') || '-1', 10)] || {};
    const xa = fl[String(a.xref || '').replace('x', 'xaxis')], ya = fl[String(a.yref || '').replace('y', 'yaxis')];
    const anchor = xa && ya && xa.c2p && ya.c2p && xa.d2c && ya.d2c ? [o.left + xa._offset + xa.c2p(xa.d2c(a.x)), o.top + ya._offset + ya.c2p(ya.d2c(a.y))] : null;
    if (alpha > 0.3) g.boxes.push({text: (e.textContent || '').slice(0, 60), box: R(bg), anchor: anchor});
    // subplot titles: paper-anchored, sitting on top of their panel (make_subplots' annotations)
    if (a.xref === 'paper' && a.yref === 'paper' && a.yanchor === 'bottom' && !a.showarrow)
      g.subtitles.push({text: (e.textContent || '').slice(0, 60), box: R(e)});
  });
  (div._fullData || []).forEach((t) => {
    if (t.visible !== true) return;
    if (t.type === 'heatmap') {
      let n = 0, blank = 0;
      const z = t._z || t.z || [], same = JSON.stringify(t.x) === JSON.stringify(t.y);
      z.forEach((row, i) => (row || []).forEach((v, j) => { if (same && j > i) return; n += 1;
        if (v === null || v === undefined || Number.isNaN(v)) blank += 1; }));
      g.heatmaps.push({name: String(t.name || ''), cells: n, blank: blank});
      return;
    }
    if (t.type !== 'scatter' || !t.x || !t.y) return;
    const xa = fl[(t.xaxis || 'x').replace('x', 'xaxis')], ya = fl[(t.yaxis || 'y').replace('y', 'yaxis')];
    if (!xa || !ya || !xa.d2c || !ya.d2c || !xa.c2p || !ya.c2p) return;  // an axis plotly has not set up
    const pts = [];
    for (let i = 0; i < t.x.length; i++) {
      const xv = t.x[i], yv = t.y[i];
      if (xv === null || yv === null || xv === undefined || yv === undefined) { pts.push(null); continue; }
      const px = xa._offset + xa.c2p(xa.d2c(xv)), py = ya._offset + ya.c2p(ya.d2c(yv));
      pts.push(Number.isFinite(px) && Number.isFinite(py) ? [o.left + px, o.top + py] : null);
    }
    const mode = String(t.mode || ''), lines = mode.indexOf('lines') >= 0;
    const size = (t.marker && t.marker.size !== undefined) ? t.marker.size : 6;
    g.series.push({name: String(t.name || ''), group: String(t.legendgroup || ''), mode: mode, axes: (t.xaxis || 'x') + (t.yaxis || 'y'),
                   width: lines ? ((t.line && t.line.width) || 2) : 0, dash: lines ? String((t.line && t.line.dash) || 'solid') : '',
                   colour: String((lines ? t.line && t.line.color : t.marker && t.marker.color) || ''),
                   symbol: String((t.marker && t.marker.symbol) || ''),
                   x: Array.from(t.x, (v) => (typeof v === 'number' ? v : String(v))),
                   y: Array.from(t.y, (v) => (typeof v === 'number' ? v : String(v))), points: pts,
                   sizes: Array.isArray(size) ? size : pts.map(() => size)});
  });
  return g;
};
"""

#: Run in the page after every figure has rendered: returns one record per figure.
MEASURE_JS = r"""
(() => {
""" + GEOMETRY_JS + r"""
  const R = (el) => { const r = el.getBoundingClientRect(); return [r.left, r.top, r.right, r.bottom]; };
  const out = [];
  document.querySelectorAll('div.figure[data-fig]').forEach((div) => {
    const svg = div.querySelector('svg.main-svg');
    const rec = {id: div.id, panel: (div.closest('.panel') && div.closest('.panel').querySelector('h3') || {}).textContent || '',
                 box: R(div), svg: svg ? R(svg) : null, texts: [], traces: []};
    const add = (kind, el) => {
      const r = R(el);
      if (r[2] - r[0] > 0.5 && r[3] - r[1] > 0.5) rec.texts.push({kind: kind, text: (el.textContent || '').trim().slice(0, 80), box: r});
    };
    div.querySelectorAll('.g-gtitle .gtitle').forEach((e) => add('title', e));
    div.querySelectorAll('.infolayer g.annotation').forEach((e) => add('annotation', e));
    div.querySelectorAll('.infolayer g.legend').forEach((e) => add('legend', e));
    div.querySelectorAll('.infolayer text[class$="title"]').forEach((e) => {
      if (!e.closest('.g-gtitle') && !e.closest('.legend') && !e.closest('.colorbar')) add('axis title', e);
    });
    div.querySelectorAll('.infolayer g.colorbar').forEach((e) => add('colorbar', e));
    (div._fullData || []).forEach((t) => {
      if (t.visible !== true) return;
      const line = t.line || {}, marker = t.marker || {}, pattern = marker.pattern || {};
      rec.traces.push({name: String(t.name || ''), legendgroup: String(t.legendgroup || ''), type: t.type,
                       mode: String(t.mode || ''), showlegend: !!t.showlegend,
                       line_color: typeof line.color === 'string' ? line.color : null,
                       marker_color: typeof marker.color === 'string' ? marker.color : null,
                       dash: line.dash || null, symbol: typeof marker.symbol === 'string' || typeof marker.symbol === 'number' ? String(marker.symbol) : null,
                       pattern: typeof pattern.shape === 'string' ? pattern.shape : '',
                       fillmode: pattern.fillmode || ''});
    });
    Object.assign(rec, GEOMETRY(div));
    out.push(rec);
  });
  const st = document.getElementById('render-status');
  return {figures: out, title: document.title, status: st ? Object.assign({}, st.dataset) : {},
          width: window.innerWidth, scroll_width: document.documentElement.scrollWidth,
          height: document.documentElement.scrollHeight};
})()
"""

_WAIT_JS = """
new Promise((resolve) => {
  const t0 = Date.now();
  (function poll() {
    const st = document.getElementById('render-status');
    if ((st && st.dataset.complete === '1') || Date.now() - t0 > %d) resolve(st ? st.dataset.complete === '1' : false);
    else setTimeout(poll, 50);
  })();
})
"""


def inside(inner: list, outer: list, tol: float = 1.0) -> bool:
    """Whether box ``inner`` (left, top, right, bottom) lies within ``outer`` (``tol`` px of slack)."""
    return inner[0] >= outer[0] - tol and inner[1] >= outer[1] - tol and inner[2] <= outer[2] + tol and inner[3] <= outer[3] + tol


def boxes_overlap(a: list, b: list, tol: float = 1.0) -> bool:
    """Whether two boxes share more than ``tol`` px in both directions."""
    return min(a[2], b[2]) - max(a[0], b[0]) > tol and min(a[3], b[3]) - max(a[1], b[1]) > tol


@dataclass
class PageLoad:
    """What one page load at one width showed."""

    url: str
    width: int
    complete: bool
    measure: dict
    requests: list = field(default_factory=list)  # URLs other than the page's own document
    console_errors: list = field(default_factory=list)

    @property
    def figures(self) -> list:
        return self.measure["figures"]


class Browser:
    """One headless Chromium, driven over the DevTools pipe. Use as a context manager."""

    def __init__(self, chromium: str, timeout: float = 120.0):
        self.timeout = timeout
        self._tmp = tempfile.TemporaryDirectory(prefix="interp-norm-devtools-")
        to_chrome_r, self._to_chrome = os.pipe()
        self._from_chrome, from_chrome_w = os.pipe()
        # the browser reads commands on fd 3 and writes answers on fd 4
        hi_r, hi_w = fcntl.fcntl(to_chrome_r, fcntl.F_DUPFD, 10), fcntl.fcntl(from_chrome_w, fcntl.F_DUPFD, 10)

        def wire() -> None:
            os.dup2(hi_r, 3)
            os.dup2(hi_w, 4)

        cmd = [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
               "--disable-background-networking", "--disable-component-update", "--disable-sync",
               "--disable-dev-shm-usage", "--hide-scrollbars", "--mute-audio", "--host-resolver-rules=MAP * ~NOTFOUND",
               f"--user-data-dir={self._tmp.name}", "--remote-debugging-pipe", "about:blank"]
        self.proc = subprocess.Popen(cmd, pass_fds=(3, 4), preexec_fn=wire, stdin=subprocess.DEVNULL,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for fd in (to_chrome_r, from_chrome_w, hi_r, hi_w):
            os.close(fd)
        self._id = 0
        self._lock = threading.Lock()
        self._replies: dict[int, dict] = {}
        self._events: list[dict] = []
        self._cv = threading.Condition()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        target = self.send("Target.createTarget", url="about:blank")["targetId"]
        self.session = self.send("Target.attachToTarget", targetId=target, flatten=True)["sessionId"]
        for domain in ("Page", "Runtime", "Network", "Log"):
            self.send(f"{domain}.enable", session=self.session)

    # -- protocol
    def _read(self) -> None:
        buf = b""
        while True:
            try:
                chunk = os.read(self._from_chrome, 1 << 16)
            except OSError:
                chunk = b""
            if not chunk:
                with self._cv:
                    self._events.append({"method": "__closed__"})
                    self._cv.notify_all()
                return
            buf += chunk
            *msgs, buf = buf.split(b"\0")
            with self._cv:
                for m in msgs:
                    msg = json.loads(m)
                    if "id" in msg:
                        self._replies[msg["id"]] = msg
                    else:
                        self._events.append(msg)
                self._cv.notify_all()

    def send(self, method: str, session: Optional[str] = None, **params: Any) -> dict:
        with self._lock:
            self._id += 1
            mid = self._id
        msg: dict = {"id": mid, "method": method, "params": params}
        if session:
            msg["sessionId"] = session
        os.write(self._to_chrome, json.dumps(msg).encode() + b"\0")
        deadline = time.monotonic() + self.timeout
        with self._cv:
            while mid not in self._replies:
                if not self._cv.wait(timeout=max(0.0, deadline - time.monotonic())) and time.monotonic() > deadline:
                    raise TimeoutError(f"no answer to {method} within {self.timeout} s")
            reply = self._replies.pop(mid)
        if "error" in reply:
            raise RuntimeError(f"{method}: {reply['error']}")
        return reply.get("result", {})

    def evaluate(self, expression: str, await_promise: bool = False) -> Any:
        r = self.send("Runtime.evaluate", session=self.session, expression=expression, returnByValue=True,
                      awaitPromise=await_promise)
        if "exceptionDetails" in r:
            raise RuntimeError(f"page script failed: {r['exceptionDetails']}")
        return r["result"].get("value")

    def _take_events(self) -> list[dict]:
        with self._cv:
            ev, self._events = self._events, []
        return ev

    # -- pages
    def load(self, path: Union[str, os.PathLike], width: int, height: int = 900, wait_ms: int = 90000) -> PageLoad:
        """Load ``path`` in a viewport ``width`` px wide, wait for every figure, measure."""
        url = Path(path).resolve().as_uri()
        self.send("Emulation.setDeviceMetricsOverride", session=self.session, width=width, height=height,
                  deviceScaleFactor=1, mobile=False)
        self.send("Page.navigate", session=self.session, url="about:blank")
        self._take_events()
        self.send("Page.navigate", session=self.session, url=url)
        deadline = time.monotonic() + self.timeout
        loaded = False
        while not loaded and time.monotonic() < deadline:
            with self._cv:
                loaded = any(e.get("method") == "Page.loadEventFired" for e in self._events)
                if not loaded:
                    self._cv.wait(timeout=0.2)
        complete = bool(self.evaluate(_WAIT_JS % wait_ms, await_promise=True))
        measure = self.evaluate(MEASURE_JS)
        events = self._take_events()
        requests, errors = [], []
        for e in events:
            m, p = e.get("method"), e.get("params", {})
            if m == "Network.requestWillBeSent":
                u = p.get("request", {}).get("url", "")
                if u != url and not u.startswith(("data:", "blob:", "about:")):
                    requests.append(u)
            elif m == "Runtime.consoleAPICalled" and p.get("type") in ("error", "assert"):
                errors.append(" ".join(str(a.get("value", a.get("description", ""))) for a in p.get("args", [])))
            elif m == "Runtime.exceptionThrown":
                d = p.get("exceptionDetails", {})
                errors.append(str(d.get("exception", {}).get("description") or d.get("text")))
            elif m == "Log.entryAdded" and p.get("entry", {}).get("level") == "error":
                errors.append(p["entry"].get("text", ""))
        return PageLoad(url=url, width=width, complete=complete, measure=measure, requests=requests, console_errors=errors)

    def screenshot(self, out: Union[str, os.PathLike], top: int = 0, height: Optional[int] = None) -> Path:
        """A PNG of the loaded page (at the current width) from ``top``, ``height`` px tall (default: to the end)."""
        full = int(self.evaluate("document.documentElement.scrollHeight"))
        h = max(1, min(full - top, height or full))
        w = int(self.evaluate("window.innerWidth"))
        data = self.send("Page.captureScreenshot", session=self.session, format="png", captureBeyondViewport=True,
                         clip=dict(x=0, y=top, width=w, height=h, scale=1))["data"]
        out = Path(out)
        out.write_bytes(base64.b64decode(data))
        return out

    def figure_screenshot(self, out: Union[str, os.PathLike], figure_id: str) -> Path:
        """A PNG of one figure's panel."""
        box = self.evaluate(f"(() => {{ const r = document.getElementById('{figure_id}').closest('.panel')"
                            ".getBoundingClientRect(); return [r.left + window.scrollX, r.top + window.scrollY, r.width, r.height]; })()")
        data = self.send("Page.captureScreenshot", session=self.session, format="png", captureBeyondViewport=True,
                         clip=dict(x=box[0], y=box[1], width=box[2], height=box[3], scale=1))["data"]
        out = Path(out)
        out.write_bytes(base64.b64decode(data))
        return out

    def close(self) -> None:
        try:
            self.send("Browser.close")
        except Exception:
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        os.close(self._to_chrome)
        self._tmp.cleanup()

    def __enter__(self) -> "Browser":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
