/* fxstab pages: the diff page (fxstab diff BASE HEAD --html OUT.html). */
(() => {
  const {DATA, $, $$, esc, fmt, num, digitColour, inkFor} = FX;
  const ops = DATA.ops, cap = DATA.cap, metric = DATA.metric, STYLES = DATA.styles;
  const preds = ops.map(o => o.inputs), succs = ops.map(o => o.consumers);
  const STATS = [["avg", "avg digits (CESTAC bound)"], ["run", "expected in a real run (estimate)"],
                 ["normwise", "normwise digits"], ["p10", "p10 digits"],
                 ["p50", "p50 digits"], ["min", "min digits"], ["max", "max digits"]];

  function delta(a, b) {
    const x = num(a), y = num(b);
    if (Number.isNaN(x) || Number.isNaN(y)) return "";
    const d = y - x;
    const colour = d < -DATA.max_drop ? "#d62728" : d > DATA.max_drop ? "#2ca02c" : "#555";
    return `<span style="color:${colour}">${d >= 0 ? "+" : ""}${d.toFixed(2)}</span>`;
  }
  function tipHtml(i) {
    const o = ops[i], b = o.b || {}, h = o.h || {};
    const side = (s, k) => (o[s] ? fmt(o[s][k]) : "&mdash;");
    const rows = STATS.map(([k, label]) => `<tr class="${k === metric ? "cur" : ""}"><td>${label}</td>
      <td class="n">${side("b", k)}</td><td class="n">${side("h", k)}</td>
      <td class="n">${o.b && o.h ? delta(b[k], h[k]) : ""}</td></tr>`);
    const ints = [["nonfin", "NaN/inf elements"], ["under", "underflow elements"],
                  ["numel", "elements analysed"], ["calls", "calls"]];
    ints.forEach(([k, label]) => rows.push(`<tr><td>${label}</td><td class="n">${o.b ? b[k] : "&mdash;"}</td>
      <td class="n">${o.h ? h[k] : "&mdash;"}</td><td></td></tr>`));
    rows.push(`<tr><td>zero fraction</td><td class="n">${o.b ? (100 * num(b.zero)).toFixed(1) + "%" : "&mdash;"}</td>
      <td class="n">${o.h ? (100 * num(h.zero)).toFixed(1) + "%" : "&mdash;"}</td><td></td></tr>`);
    const [fill, , what] = STYLES[o.state];
    return `<h3>${esc(o.name)}</h3>
      <div><span class="badge" style="background:${fill === "#ffffff" ? "#777" : fill};color:#fff">${esc(o.state)}</span>
      ${esc(what)}${o.origin ? ' &middot; <b style="color:#6a00f4">NaN/inf first appear here (head)</b>' : ""}</div>
      <div>${esc(o.kind)} in <code>${esc(o.module || "(top level)")}</code></div>
      <table><tr><th></th><th class="n">${esc(DATA.base)}</th><th class="n">${esc(DATA.head)}</th><th class="n">change</th></tr>
      ${rows.join("")}</table>`;
  }

  // ------------------------------------------------------------------ graph
  const svg = $("#graph");
  let colourBy = "change";
  function colour() {
    graph.nodes.forEach((g, i) => {
      const o = ops[i];
      let fill, ink, text;
      if (colourBy === "change") {
        [fill, ink] = STYLES[o.state];
        text = o.delta !== null ? (num(o.delta) >= 0 ? "+" : "") + fmt(o.delta) : o.state === "new" ? "new" : "gone";
      } else {
        const s = o[colourBy === "head" ? "h" : "b"];
        fill = s ? digitColour(s[metric], cap) : "#ffffff";
        ink = inkFor(fill);
        text = s ? fmt(s[metric]) : "\u2014";
      }
      g.querySelector("rect.box").setAttribute("fill", fill);
      $$("text", g).forEach(t => t.setAttribute("fill", ink));
      g.querySelector("text.val").textContent = text;
    });
    legend();
  }
  function legend() {
    if (colourBy === "change") {
      $("#graph-legend").innerHTML = Object.entries(STYLES).map(([k, [fill, ink, what]]) =>
        `<span><span class="swatch" style="background:${fill};border-color:${k === "vanished" ? "#d62728" : "#555"};${k === "gone" || k === "vanished" ? "border-style:dashed" : ""}"></span>${esc(k)}: ${esc(what)}</span>`).join("") +
        '<span><span class="swatch" style="background:#fff;border:3px solid #6a00f4"></span>NaN/inf origin (head)</span>';
    } else {
      $("#graph-legend").innerHTML = `0<span class="scalebar" style="background:${FX.scaleGradient()}"></span>${cap.toFixed(2)} ${metric} digits (${colourBy})`;
    }
  }
  const graph = FX.initGraph(svg, preds, succs, tipHtml, i => table.mark(i, preds[i] || [], succs[i] || []));
  FX.initZoom($("#graphbox"), svg, {fit: $("#zoom-fit"), full: $("#zoom-full")});
  $("#colour-by").addEventListener("change", ev => { colourBy = ev.target.value; colour(); });

  // ------------------------------------------------------------------ table
  const rows = ops.map((o, i) => ({i, o}));
  const order = {lost: 0, vanished: 1, gone: 2, new: 3, gained: 4, same: 5};
  const cols = [
    {label: "operator", get: r => r.o.name, html: r => `<code>${esc(r.o.name)}</code>`},
    {label: "module", get: r => r.o.module},
    {label: "kind", get: r => r.o.kind},
    // sorted by what fails the gate first: lost (largest loss first), vanished, gone, new,
    // gained, the rest (a separate "rank" column of bare numbers said it to nobody)
    {label: "change", num: true,
     title: "sorted by what fails the gate first: lost (largest loss first), vanished, gone, " +
            "new, gained, same",
     get: r => 100 * order[r.o.state] + (num(r.o.delta) || 0), html: r => esc(r.o.state),
     style: r => {
      const [fill, ink] = STYLES[r.o.state];
      return `background:${fill};color:${ink}`;
    }},
    {label: `base ${metric}`, num: true, get: r => r.o.b ? r.o.b[metric] : null},
    {label: `head ${metric}`, num: true, get: r => r.o.h ? r.o.h[metric] : null},
    {label: "delta", num: true, get: r => r.o.delta},
    {label: "base NaN/inf", num: true, get: r => r.o.b ? r.o.b.nonfin : null, html: r => r.o.b ? String(r.o.b.nonfin) : ""},
    {label: "head NaN/inf", num: true, get: r => r.o.h ? r.o.h.nonfin : null, html: r => r.o.h ? String(r.o.h.nonfin) : ""},
  ];
  const table = FX.makeTable($("#table"), cols, rows, i => {
    graph.select(i === graph.selected ? -1 : i, true);
  });
  table.sort(3, false);  // the change column: what failed first

  const states = Object.keys(STYLES).filter(k => ops.some(o => o.state === k));
  $("#f-kind").innerHTML = '<option value="">all</option>' +
    states.map(k => `<option value="${k}">${k}</option>`).join("");
  function applyFilter() {
    const glob = $("#f-module").value.trim(), state = $("#f-kind").value;
    const re = glob ? FX.globRe(glob) : null;
    const keep = r => (!re || re.test(r.o.module) || re.test(r.o.name)) && (!state || r.o.state === state);
    const n = table.filter(keep);
    rows.forEach(r => graph.nodes[r.i].classList.toggle("dim", !keep(r)));
    $("#f-count").textContent = `${n} of ${ops.length} operators`;
  }
  ["input", "change"].forEach(ev => ["#f-module", "#f-kind"].forEach(
    s => $(s).addEventListener(ev, applyFilter)));
  legend();
  applyFilter();
  FX.ready();
})();
