/* fxstab pages, shared part: data, colours, tooltip, the operator graph's interactions, the
 * sortable and filterable table, the heatmap and the line plot. Vanilla JS, no network: the
 * page's data is the JSON of <script id="fxstab-data"> (written by fxstab/plots/html.py). */
"use strict";

const FX = (() => {
  const DATA = JSON.parse(document.getElementById("fxstab-data").textContent);
  const ORIGIN = "#6a00f4";
  // matplotlib's RdYlGn (ColorBrewer, 11 classes), interpolated linearly as matplotlib does:
  // the same colours as the PNG of `fxstab show --graph`
  const RDYLGN = ["#a50026", "#d73027", "#f46d43", "#fdae61", "#fee08b", "#ffffbf", "#d9ef8b",
                  "#a6d96a", "#66bd63", "#1a9850", "#006837"].map(hex);
  const NO_DIGITS = "#d1d1d1";

  function hex(h) {
    return [1, 3, 5].map(i => parseInt(h.slice(i, i + 2), 16));
  }
  function rgb(c) {
    return "#" + c.map(v => Math.round(v).toString(16).padStart(2, "0")).join("");
  }
  /** A number of the page's JSON: null is NaN, "inf"/"-inf" the infinities. */
  function num(v) {
    if (v === null || v === undefined) return NaN;
    if (v === "inf") return Infinity;
    if (v === "-inf") return -Infinity;
    return v;
  }
  function fmt(v, d = 2) {
    v = num(v);
    if (Number.isNaN(v)) return "n/a";
    if (!Number.isFinite(v)) return v > 0 ? "inf" : "-inf";
    return v.toFixed(d);
  }
  function fmtg(v) {
    v = num(v);
    if (Number.isNaN(v)) return "n/a";
    if (!Number.isFinite(v)) return v > 0 ? "inf" : "-inf";
    if (v !== 0 && (Math.abs(v) < 1e-3 || Math.abs(v) >= 1e4)) return v.toExponential(2);
    return String(Number(v.toPrecision(3)));
  }
  /** The fill of `v` digits on the red (0) to green (cap) scale; grey when unknown. */
  function digitColour(v, cap) {
    v = num(v);
    if (Number.isNaN(v)) return NO_DIGITS;
    const t = Math.min(1, Math.max(0, cap > 0 ? v / cap : 0)) * (RDYLGN.length - 1);
    const i = Math.min(RDYLGN.length - 2, Math.floor(t));
    const f = t - i;
    return rgb(RDYLGN[i].map((a, k) => a + f * (RDYLGN[i + 1][k] - a)));
  }
  function inkFor(fill) {
    const [r, g, b] = hex(fill);
    return (0.299 * r + 0.587 * g + 0.114 * b) / 255 < 0.45 ? "#fff" : "#000";
  }
  function scaleGradient() {
    return "linear-gradient(to right, " + RDYLGN.map(rgb).join(", ") + ")";
  }
  function esc(s) {
    return String(s).replace(/[&<>"']/g, c => ({"&": "&amp;", "<": "&lt;", ">": "&gt;",
                                                  '"': "&quot;", "'": "&#39;"}[c]));
  }
  function $(sel, root = document) { return root.querySelector(sel); }
  function $$(sel, root = document) { return Array.from(root.querySelectorAll(sel)); }
  /** A glob over module paths and names: `*` any run, `?` one character; "" matches all. */
  function globRe(glob) {
    const body = glob.split("").map(c => c === "*" ? ".*" : c === "?" ? "." :
      c.replace(/[.+^${}()|[\]\\]/g, "\\$&")).join("");
    return new RegExp("^" + body + (glob.includes("*") ? "" : ".*") + "$");
  }

  // ------------------------------------------------------------------ tooltip
  const tip = document.createElement("div");
  tip.className = "tip";
  tip.id = "tip";
  document.body.appendChild(tip);
  function showTip(html, ev) {
    tip.innerHTML = html;
    tip.style.display = "block";
    moveTip(ev);
  }
  function moveTip(ev) {
    const pad = 14, w = tip.offsetWidth, h = tip.offsetHeight;
    let x = ev.clientX + pad, y = ev.clientY + pad;
    if (x + w > window.innerWidth) x = Math.max(0, ev.clientX - w - pad);
    if (y + h > window.innerHeight) y = Math.max(0, ev.clientY - h - pad);
    tip.style.left = x + "px";
    tip.style.top = y + "px";
  }
  function hideTip() { tip.style.display = "none"; }

  // ------------------------------------------------------------------ the operator graph
  /**
   * Hover and click on the SVG graph. `preds[i]`/`succs[i]` are the operator's inputs and
   * consumers (indices); `tipHtml(i)` the hover text; `onSelect(i)` runs after a click (i is
   * -1 when the selection is cleared).
   */
  /** Fit each operator's label in its box: a label the browser's font draws wider than the
   * box loses characters from its start, ellipsised (the full name stays in data-full and in
   * the tip on hover). */
  function fitLabels(svg) {
    $$("g.op", svg).forEach(g => {
      const t = g.querySelector("text.lbl"), box = g.querySelector("rect.box");
      if (!t || !box) return;
      const full = t.dataset.full || t.textContent;
      t.dataset.full = full;
      const room = +box.getAttribute("width") - 6;
      t.textContent = full;
      if (t.getComputedTextLength() <= room) return;
      let lo = 0, hi = full.length;
      while (lo < hi) {
        const mid = (lo + hi) >> 1;
        t.textContent = "\u2026" + full.slice(mid);
        if (t.getComputedTextLength() <= room) hi = mid; else lo = mid + 1;
      }
      t.textContent = "\u2026" + full.slice(lo);
    });
  }

  function initGraph(svg, preds, succs, tipHtml, onSelect) {
    fitLabels(svg);
    const nodes = $$("g.op", svg);
    const byIndex = [];
    nodes.forEach(g => { byIndex[+g.dataset.i] = g; });
    const edges = $$("path.edge", svg);
    let selected = -1;
    function clear() {
      $$(".sel, .in, .out", svg).forEach(e => e.classList.remove("sel", "in", "out"));
      $$(".ein, .eout", svg).forEach(e => e.classList.remove("ein", "eout"));
    }
    function select(i, scroll) {
      clear();
      selected = i;
      if (i >= 0) {
        byIndex[i].classList.add("sel");
        preds[i].forEach(p => byIndex[p].classList.add("in"));
        succs[i].forEach(s => byIndex[s].classList.add("out"));
        edges.forEach(e => {
          if (+e.dataset.t === i) e.classList.add("ein");
          if (+e.dataset.s === i) e.classList.add("eout");
        });
        if (scroll) byIndex[i].scrollIntoView({block: "center", inline: "center"});
      }
      onSelect(i);
    }
    svg.addEventListener("mouseover", ev => {
      const g = ev.target.closest("g.op");
      if (g) showTip(tipHtml(+g.dataset.i), ev);
    });
    svg.addEventListener("mousemove", ev => {
      if (ev.target.closest("g.op")) moveTip(ev);
    });
    svg.addEventListener("mouseout", ev => {
      const g = ev.target.closest("g.op");
      if (g && !(ev.relatedTarget && g.contains(ev.relatedTarget))) hideTip();
    });
    svg.addEventListener("click", ev => {
      const g = ev.target.closest("g.op");
      const i = g ? +g.dataset.i : -1;
      select(i === selected ? -1 : i, false);
    });
    return {nodes: byIndex, select, get selected() { return selected; }};
  }

  /** Zoom buttons of a graph box: fit the width, or 100%. */
  function initZoom(box, svg, buttons) {
    const w = +svg.getAttribute("width"), h = +svg.getAttribute("height");
    function set(scale) {
      svg.setAttribute("width", (w * scale).toFixed(0));
      svg.setAttribute("height", (h * scale).toFixed(0));
    }
    buttons.fit.addEventListener("click", () => set(Math.min(1, (box.clientWidth - 4) / w)));
    buttons.full.addEventListener("click", () => set(1));
  }

  // ------------------------------------------------------------------ the table
  /**
   * A sortable table. `columns`: {key, label, num (bool), get(row) -> value,
   * html(row) -> cell html (default: the value), style(row) -> css}. `rows`: objects with
   * an index `i`. Clicking a header sorts (again: reverses); clicking a row calls onRow(i).
   */
  function makeTable(host, columns, rows, onRow) {
    const table = document.createElement("table");
    table.className = "ops";
    const head = table.createTHead().insertRow();
    columns.forEach((c, k) => {
      const th = document.createElement("th");
      th.textContent = c.label;
      th.dataset.k = k;
      if (c.title) th.title = c.title;
      head.appendChild(th);
    });
    const body = table.createTBody();
    const trs = [];
    function fill() {
      rows.forEach(r => {
        let tr = trs[r.i];
        if (!tr) {
          tr = document.createElement("tr");
          tr.dataset.i = r.i;
          tr.id = "row-" + r.i;
          trs[r.i] = tr;
        }
        tr.innerHTML = columns.map(c => {
          const v = c.html ? c.html(r) : esc(c.num ? fmt(c.get(r)) : c.get(r));
          const st = c.style ? ` style="${c.style(r)}"` : "";
          return `<td class="${c.num ? "n" : "txt"}"${st}>${v}</td>`;
        }).join("");
        body.appendChild(tr);
      });
    }
    fill();
    host.appendChild(table);
    let sortKey = -1, desc = false;
    function sort(k, keepDir, descending) {
      if (descending !== undefined) desc = descending;
      else if (!keepDir) desc = k === sortKey ? !desc : false;
      sortKey = k;
      const c = columns[k];
      const key = r => {
        const v = c.get(r);
        if (!c.num) return String(v);
        const x = num(v);
        return Number.isNaN(x) ? -Infinity : x;
      };
      rows.sort((a, b) => {
        const x = key(a), y = key(b);
        const o = x < y ? -1 : x > y ? 1 : a.i - b.i;
        return desc ? -o : o;
      });
      $$("th", head).forEach(th => th.classList.remove("sorted-asc", "sorted-desc"));
      head.children[k].classList.add(desc ? "sorted-desc" : "sorted-asc");
      rows.forEach(r => body.appendChild(trs[r.i]));
    }
    head.addEventListener("click", ev => {
      const th = ev.target.closest("th");
      if (th) sort(+th.dataset.k, false);
    });
    body.addEventListener("click", ev => {
      const tr = ev.target.closest("tr");
      if (tr) onRow(+tr.dataset.i);
    });
    function filter(keep) {
      let n = 0;
      rows.forEach(r => {
        const ok = keep(r);
        trs[r.i].hidden = !ok;
        n += ok;
      });
      return n;
    }
    function mark(i, preds, succs) {
      trs.forEach(tr => tr && tr.classList.remove("selected", "rel-in", "rel-out"));
      if (i < 0) return;
      preds.forEach(p => trs[p] && trs[p].classList.add("rel-in"));
      succs.forEach(s => trs[s] && trs[s].classList.add("rel-out"));
      trs[i].classList.add("selected");
      if (!trs[i].hidden) trs[i].scrollIntoView({block: "nearest"});
    }
    function refresh() {
      fill();
      if (sortKey >= 0) sort(sortKey, true);
    }
    return {table, sort, filter, mark, refresh, rows: trs};
  }

  // ------------------------------------------------------------------ heatmap (canvas)
  /**
   * A row x column heatmap on a canvas (25 000 cells draw in milliseconds, a DOM element per
   * cell would not). `cell(r, c)` -> {fill, mark} or null (no value: left white); `mark`
   * draws a violet cross (NaN/inf). `tipHtml(r, c)` on hover, `onRow(r)` on click.
   */
  /** `s`, or its end after an ellipsis, as wide as `width` at most in `ctx`'s font (a row
   * label is right-aligned at the heatmap's edge: its start is what may go). */
  function fitLeft(ctx, s, width) {
    if (ctx.measureText(s).width <= width) return s;
    let lo = 0, hi = s.length;  // the fewest leading characters to drop
    while (lo < hi) {
      const mid = (lo + hi) >> 1;
      if (ctx.measureText("\u2026" + s.slice(mid)).width <= width) hi = mid; else lo = mid + 1;
    }
    return "\u2026" + s.slice(lo);
  }

  function heatmap(canvas, rowLabels, colLabels, cell, tipHtml, onRow) {
    const ch = rowLabels.length > 120 ? 6 : rowLabels.length > 60 ? 9 : 14;
    const cw = Math.max(3, Math.min(26, Math.floor(900 / Math.max(1, colLabels.length))));
    const ctx0 = canvas.getContext("2d");
    ctx0.font = "11px system-ui, sans-serif";
    const lw = Math.min(320, 12 + Math.max(...rowLabels.map(s => ctx0.measureText(s).width)));
    const top = 34;
    const dpr = window.devicePixelRatio || 1;
    const W = lw + cw * colLabels.length + 10, H = top + ch * rowLabels.length + 4;
    canvas.width = W * dpr;
    canvas.height = H * dpr;
    canvas.style.width = W + "px";
    canvas.style.height = H + "px";
    const ctx = canvas.getContext("2d");
    ctx.scale(dpr, dpr);
    function draw(hiRow) {
      ctx.clearRect(0, 0, W, H);
      ctx.font = (ch >= 9 ? 11 : 8) + "px system-ui, sans-serif";
      ctx.textBaseline = "middle";
      ctx.fillStyle = "#333";
      const every = Math.max(1, Math.ceil(40 / cw));
      ctx.textAlign = "center";
      colLabels.forEach((l, c) => {
        if (c % every === 0) ctx.fillText(l, lw + cw * (c + 0.5), top - 10);
      });
      ctx.textAlign = "right";
      const skip = ch < 9 ? Math.ceil(9 / ch) : 1;
      for (let r = 0; r < rowLabels.length; r++) {
        const y = top + r * ch;
        if (r % skip === 0 || r === hiRow) {
          ctx.fillStyle = r === hiRow ? "#000" : "#333";
          ctx.fillText(fitLeft(ctx, rowLabels[r], lw - 8), lw - 6, y + ch / 2);
        }
        for (let c = 0; c < colLabels.length; c++) {
          const v = cell(r, c);
          if (!v) continue;
          ctx.fillStyle = v.fill;
          ctx.fillRect(lw + c * cw, y, cw - (cw > 4 ? 1 : 0), ch - (ch > 6 ? 1 : 0));
          if (v.mark) {
            ctx.strokeStyle = ORIGIN;
            ctx.lineWidth = Math.max(1, Math.min(cw, ch) / 5);
            const x0 = lw + c * cw + 1, x1 = lw + (c + 1) * cw - 2;
            ctx.beginPath();
            ctx.moveTo(x0, y + 1); ctx.lineTo(x1, y + ch - 2);
            ctx.moveTo(x1, y + 1); ctx.lineTo(x0, y + ch - 2);
            ctx.stroke();
          }
          if (v.box) {
            ctx.strokeStyle = "#000";
            ctx.lineWidth = 1.5;
            ctx.strokeRect(lw + c * cw + 0.75, y + 0.75, cw - 2.5, ch - 2.5);
          }
        }
        if (r === hiRow) {
          ctx.strokeStyle = "#000";
          ctx.lineWidth = 1;
          ctx.strokeRect(lw, y, cw * colLabels.length, ch);
        }
      }
    }
    draw(-1);
    function at(ev) {
      const b = canvas.getBoundingClientRect();
      const x = ev.clientX - b.left, y = ev.clientY - b.top;
      const c = Math.floor((x - lw) / cw), r = Math.floor((y - top) / ch);
      return (c >= 0 && c < colLabels.length && r >= 0 && r < rowLabels.length) ? [r, c] : null;
    }
    canvas.addEventListener("mousemove", ev => {
      const p = at(ev);
      if (p) showTip(tipHtml(p[0], p[1]), ev); else hideTip();
    });
    canvas.addEventListener("mouseleave", hideTip);
    canvas.addEventListener("click", ev => {
      const p = at(ev);
      if (p) onRow(p[0]);
    });
    return {redraw: draw};
  }

  // ------------------------------------------------------------------ line plot (SVG)
  const PALETTE = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b",
                   "#e377c2", "#7f7f7f", "#bcbd22", "#17becf"];
  /**
   * Lines over x = 0..n-1 (labels `xLabels`). `series`: {name, points: [[x, y, bad]]}; a bad
   * point (NaN/inf) is drawn as a violet cross at the bottom when y is not finite. `hlines`:
   * {y, label, colour}. `log`: log10 y axis.
   */
  function linePlot(host, xLabels, series, opts) {
    const W = opts.width || 860, H = opts.height || 300;
    const L = 52, R = 12, T = 12, B = 34;
    const ys = [];
    series.forEach(s => s.points.forEach(p => {
      const y = num(p[1]);
      if (Number.isFinite(y) && (!opts.log || y > 0)) ys.push(y);
    }));
    (opts.hlines || []).forEach(h => ys.push(h.y));
    let lo = opts.ymin !== undefined ? opts.ymin : Math.min(...ys, 0);
    let hi = opts.ymax !== undefined ? opts.ymax : Math.max(...ys, 1e-9);
    if (opts.log) {  // whole decades
      lo = Math.floor(Math.log10(Math.min(...ys.filter(v => v > 0), 1)));
      hi = Math.ceil(Math.log10(Math.max(...ys, 1)) + 1e-9);
    }
    if (!(hi > lo)) hi = lo + 1;
    const n = Math.max(1, xLabels.length - 1);
    const X = x => L + (W - L - R) * (xLabels.length > 1 ? x / n : 0.5);
    const Y = y => {
      const v = opts.log ? Math.log10(Math.max(y, 1e-300)) : y;
      return T + (H - T - B) * (1 - (v - lo) / (hi - lo));
    };
    const out = [`<svg class="lines" width="${W}" height="${H}" viewBox="0 0 ${W} ${H}">`];
    const ticks = opts.log && hi - lo <= 10 ? hi - lo : 4;
    for (let k = 0; k <= ticks; k++) {
      const v = lo + (hi - lo) * k / ticks;
      const y = T + (H - T - B) * (1 - k / ticks);
      const lab = opts.log ? fmtg(Math.pow(10, v)) : v.toFixed(2);
      out.push(`<line class="grid" x1="${L}" x2="${W - R}" y1="${y}" y2="${y}"/>`,
               `<text x="${L - 4}" y="${y + 4}" text-anchor="end">${lab}</text>`);
    }
    // every label up to 14, then every k-th and always the last; the last ends at its tick
    // (centred there it was cut by the plot's right edge: "step 2" for "step 20")
    const every = Math.max(1, Math.ceil(xLabels.length / 14));
    const last = xLabels.length - 1;
    xLabels.forEach((l, x) => {
      const shown = x === last || (x % every === 0 && last - x >= every);
      if (shown) {
        const anchor = x === last && last > 0 ? "end" : "middle";
        out.push(`<text class="xlabel" x="${X(x)}" y="${H - B + 16}" text-anchor="${anchor}">${esc(l)}</text>`);
      }
    });
    out.push(`<line class="axis" x1="${L}" x2="${L}" y1="${T}" y2="${H - B}"/>`,
             `<line class="axis" x1="${L}" x2="${W - R}" y1="${H - B}" y2="${H - B}"/>`,
             `<text x="${(L + W - R) / 2}" y="${H - 3}" text-anchor="middle">${esc(opts.xTitle || "")}</text>`,
             `<text x="12" y="${(T + H - B) / 2}" transform="rotate(-90 12 ${(T + H - B) / 2})" text-anchor="middle">${esc(opts.yTitle || "")}</text>`);
    (opts.hlines || []).forEach(h => {
      out.push(`<line class="thr" x1="${L}" x2="${W - R}" y1="${Y(h.y)}" y2="${Y(h.y)}" stroke="${h.colour || "#777"}"/>`,
               `<text x="${W - R - 2}" y="${Y(h.y) - 3}" text-anchor="end" fill="${h.colour || "#777"}">${esc(h.label)}</text>`);
    });
    series.forEach((s, k) => {
      const colour = s.colour || PALETTE[k % PALETTE.length];
      s.colour = colour;
      let d = "";
      let pen = false;
      s.points.forEach(p => {
        const y = num(p[1]);
        if (Number.isFinite(y) && (!opts.log || y > 0)) {
          d += (pen ? "L" : "M") + X(p[0]).toFixed(1) + " " + Y(y).toFixed(1);
          pen = true;
        } else {
          pen = false;
        }
      });
      out.push(`<path class="series" d="${d}" stroke="${colour}"><title>${esc(s.name)}</title></path>`);
      s.points.forEach(p => {
        const y = num(p[1]);
        const ok = Number.isFinite(y) && (!opts.log || y > 0);
        const cx = X(p[0]), cy = ok ? Y(y) : H - B - 6;
        if (p[2]) {
          out.push(`<path class="bad" d="M${cx - 4} ${cy - 4}L${cx + 4} ${cy + 4}M${cx + 4} ${cy - 4}L${cx - 4} ${cy + 4}"><title>${esc(s.name)}: NaN/inf at ${esc(xLabels[p[0]])}</title></path>`);
        } else if (ok) {
          out.push(`<circle cx="${cx}" cy="${cy}" r="2.2" fill="${colour}"><title>${esc(s.name)} at ${esc(xLabels[p[0]])}: ${fmtg(y)}</title></circle>`);
        }
        if (p[3]) {  // an event at this point (a promotion)
          out.push(`<path d="M${cx} ${cy - 11}l-5 -8h10z" fill="${colour}" stroke="#000" stroke-width="0.8"><title>${esc(p[3])}</title></path>`);
        }
      });
    });
    out.push("</svg>");
    host.innerHTML = out.join("") + '<div class="chips">' + series.map(s =>
      `<span style="border-color:${s.colour}">${esc(s.name)}</span>`).join("") + "</div>";
  }

  function ready() {
    document.body.dataset.ready = "1";
  }

  return {DATA, ORIGIN, num, fmt, fmtg, digitColour, inkFor, scaleGradient, esc, $, $$, globRe,
          showTip, moveTip, hideTip, initGraph, initZoom, makeTable, heatmap, linePlot, fitLeft,
          PALETTE, ready};
})();
