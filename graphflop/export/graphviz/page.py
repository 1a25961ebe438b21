"""An HTML page around a rendered SVG: the picture inline, a search box, zoom buttons.

The page is self-contained (no network): the SVG is embedded as markup, so its tooltips work,
and a small script searches every box's id, text and tooltip. Typing in the box highlights the
matching boxes (the others fade, and so do the clusters that hold no match) and Enter scrolls
to the next one; ``#q=attn`` in the address runs a search on load (highlighting only, the page
stays at its top). A query naming a member of a fold of identical blocks drawn once (``h.5``,
``h.5.attn``) finds the fold and the same path in the block drawn (``h.0``, ``h.0.attn``; inside
nested folds, through each fold in turn), and
says so beside the count. The number of matches is shown and kept in the body's
``data-matches`` attribute, the fold notes in ``data-folds`` (what a headless browser test
reads back).
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
svg g.cluster.hit a > path:first-of-type { stroke: #EE3377; stroke-width: 5px; }
svg g.cluster.current a > path:first-of-type { stroke: #117733; stroke-width: 7px; }
"""

_SCRIPT = """
(function () {
  const svg = document.querySelector('#picture svg');
  const box = document.getElementById('q');
  const count = document.getElementById('count');
  const nodes = Array.from(svg.querySelectorAll('g.node'));
  const clusters = Array.from(svg.querySelectorAll('g.cluster'));
  const tipOf = g => Array.from(g.querySelectorAll('a')).map(
    a => a.getAttribute('xlink:title') || a.getAttribute('title') || '');
  const text = new Map(nodes.map(g => {
    const title = g.querySelector('title');
    return [g, [g.id, title ? title.textContent : '', g.textContent, ...tipOf(g)]
      .join(' ').toLowerCase()];
  }));
  // a fold (repeated identical blocks drawn once): its tooltip ends in ": member, member, ..."
  const folds = clusters.filter(g => g.id.startsWith('fold_')).map(g => {
    const tip = tipOf(g)[0] || '';
    const members = tip.slice(tip.lastIndexOf(': ') + 2).split(', ');
    return {g: g, members: members, mark: tip.slice(0, tip.indexOf(':'))};
  });
  let boxes = null;  // cluster → its frame's box, measured on the first search
  function inside(c, g) {
    const a = boxes.get(c), b = g.getBBox();
    return b.x >= a.x && b.y >= a.y && b.x + b.width <= a.x + a.width &&
      b.y + b.height <= a.y + a.height;
  }
  let hits = [], at = -1, scale = 1;
  function search(q) {
    q = q.trim().toLowerCase();
    // a query naming a fold's member (h.5, h.5.attn) also finds the same path in the block
    // drawn (h.0, h.0.attn), and the fold itself
    // (folds inside folds: outer first, each on the path the outer one led to)
    const queries = q ? [q] : [], found = [], notes = [];
    let cur = q;
    for (const f of folds) {
      for (const m of f.members.slice(1)) {
        const p = m.toLowerCase();
        if (cur === p || cur.startsWith(p + '.')) {
          cur = f.members[0].toLowerCase() + cur.slice(p.length);
          queries.push(cur);
          found.push(f.g);
          notes.push(m + ' is one of the ' + f.mark + ' blocks ' + f.members[0] + ' … ' +
            f.members[f.members.length - 1] + ', drawn once as ' + f.members[0]);
        }
      }
    }
    hits = nodes.filter(g => queries.some(x => text.get(g).includes(x))).concat(found);
    at = -1;
    if (q && boxes === null) boxes = new Map(clusters.map(c => [c, c.getBBox()]));
    for (const g of nodes) {
      g.classList.toggle('hit', hits.includes(g));
      g.classList.toggle('dim', q !== '' && !hits.includes(g));
      g.classList.remove('current');
    }
    for (const c of clusters) {  // a cluster stays clear when it holds a match
      const keep = found.includes(c) || hits.some(g => g !== c && inside(c, g));
      c.classList.toggle('hit', found.includes(c));
      c.classList.toggle('dim', q !== '' && !keep);
      c.classList.remove('current');
    }
    count.textContent = q ? hits.length + ' match' + (hits.length === 1 ? '' : 'es') +
      (notes.length ? ' · ' + notes.join('; ') : '') : '';
    document.body.dataset.matches = String(hits.length);
    document.body.dataset.folds = notes.join('; ');
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
