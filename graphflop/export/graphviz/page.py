"""An HTML page around a rendered SVG: the picture inline, a search box, zoom buttons.

The page is self-contained (no network): the SVG is embedded as markup, so its tooltips work,
and a small script searches every box's id, text and tooltip. Typing in the box highlights the
matching boxes (the others fade) and Enter scrolls to the next one; ``#q=attn`` in the address
runs a search on load (highlighting only, the page stays at its top). The number of matches is shown and kept in the body's ``data-matches``
attribute (what a headless browser test reads back).
"""

from __future__ import annotations

import html
import re

_STYLE = """
body { margin: 0; font: 14px Helvetica, Arial, sans-serif; }
header { position: fixed; top: 0; left: 0; right: 0; background: #fff; padding: 8px 12px;
         border-bottom: 1px solid #ccc; display: flex; gap: 8px; align-items: center; z-index: 1; }
header input { width: 22em; font-size: 14px; padding: 3px 6px; }
#picture { padding: 52px 8px 8px 8px; }
#picture svg { transform-origin: 0 0; }
svg g.node.dim, svg g.cluster.dim { opacity: 0.25; }
svg g.node.hit > polygon, svg g.node.hit > path, svg g.node.hit > ellipse
  { stroke: #EE3377; stroke-width: 5px; }
svg g.node.current > polygon, svg g.node.current > path { stroke: #117733; stroke-width: 7px; }
"""

_SCRIPT = """
(function () {
  const svg = document.querySelector('#picture svg');
  const box = document.getElementById('q');
  const count = document.getElementById('count');
  const nodes = Array.from(svg.querySelectorAll('g.node'));
  const text = new Map(nodes.map(g => {
    const tips = Array.from(g.querySelectorAll('a')).map(
      a => a.getAttribute('xlink:title') || a.getAttribute('title') || '');
    const title = g.querySelector('title');
    return [g, [g.id, title ? title.textContent : '', g.textContent, ...tips]
      .join(' ').toLowerCase()];
  }));
  let hits = [], at = -1, scale = 1;
  function search(q) {
    q = q.trim().toLowerCase();
    hits = q ? nodes.filter(g => text.get(g).includes(q)) : [];
    at = -1;
    for (const g of nodes) {
      g.classList.toggle('hit', hits.includes(g));
      g.classList.toggle('dim', q !== '' && !hits.includes(g));
      g.classList.remove('current');
    }
    count.textContent = q ? hits.length + ' match' + (hits.length === 1 ? '' : 'es') : '';
    document.body.dataset.matches = String(hits.length);
  }
  function next() {
    if (!hits.length) return;
    if (at >= 0) hits[at].classList.remove('current');
    at = (at + 1) % hits.length;
    hits[at].classList.add('current');
    hits[at].scrollIntoView({block: 'center', inline: 'center'});
  }
  function zoom(f) {
    scale = f === 0 ? 1 : scale * f;
    svg.style.transform = 'scale(' + scale + ')';
  }
  box.addEventListener('input', () => search(box.value));
  box.addEventListener('keydown', e => { if (e.key === 'Enter') next(); });
  document.getElementById('zin').onclick = () => zoom(1.25);
  document.getElementById('zout').onclick = () => zoom(0.8);
  document.getElementById('z1').onclick = () => zoom(0);
  const m = /[#&]q=([^&]*)/.exec(location.hash);
  if (m) { box.value = decodeURIComponent(m[1]); search(box.value); }
  else { document.body.dataset.matches = '0'; }
})();
"""


def page(svg: bytes, title: str) -> bytes:
    """The HTML page showing ``svg`` (Graphviz's output: its XML prologue is dropped) under a
    search box; ``title`` is the page's title (escaped here)."""
    text = svg.decode("utf-8")
    start = text.find("<svg")
    if start < 0:
        raise ValueError("not an SVG document")
    body = re.sub(r"<!--.*?-->\s*", "", text[start:], flags=re.S)
    return (
        '<!DOCTYPE html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n'
        f"<title>{html.escape(title)}</title>\n<style>{_STYLE}</style>\n</head>\n<body>\n"
        '<header><input id="q" type="search" placeholder="search: module, op, node name" '
        'autofocus> <span id="count"></span> <button id="zout">−</button>'
        '<button id="z1">1:1</button><button id="zin">+</button>'
        f" <span>{html.escape(title)}</span></header>\n"
        f'<div id="picture">{body}</div>\n<script>{_SCRIPT}</script>\n</body>\n</html>\n'
    ).encode()
