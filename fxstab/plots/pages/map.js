/* fxstab pages: the digit map page (fxstab show MAP --html OUT.html). */
(() => {
  const {DATA, $, $$, esc, fmt, num, digitColour, inkFor} = FX;
  const ops = DATA.ops, cap = DATA.cap;
  const origins = new Set(DATA.origins);
  const fixed = DATA.fixed || {};  // operator index -> the verified fixes covering it (fxstab fix)
  let metric = DATA.metric;
  const preds = ops.map(o => o.inputs), succs = ops.map(o => o.consumers);
  const STAT_ROWS = [["avg", "avg digits (CESTAC bound)"],
                     ["run", "expected in a real run (estimate)"], ["normwise", "normwise digits"],
                     ["p10", "p10 digits"], ["p50", "p50 digits"], ["min", "min digits"],
                     ["max", "max digits"]];

  function tipHtml(i) {
    const o = ops[i], s = o.s, [loss, worst] = DATA.loss[metric][i] || [null, -1];
    const rows = STAT_ROWS.map(([k, label]) =>
      `<tr class="${k === metric ? "cur" : ""}"><td>${label}</td><td class="n">${fmt(s[k])}</td></tr>`);
    rows.push(`<tr><td>zero fraction</td><td class="n">${(100 * num(s.zero)).toFixed(1)}%</td></tr>`,
              `<tr><td>NaN/inf elements</td><td class="n">${s.nonfin}</td></tr>`,
              `<tr><td>underflow elements</td><td class="n">${s.under}</td></tr>`,
              `<tr><td>elements analysed</td><td class="n">${s.numel}</td></tr>`,
              `<tr><td>calls</td><td class="n">${s.calls}</td></tr>`);
    const counters = Object.entries(o.counters);
    const cnt = counters.length ? counters.map(([k, v]) =>
      `<span${v ? ' class="cur"' : ""}>${esc(k)} ${v}</span>`).join(", ") : "none";
    const where = origins.has(i) ? '<div style="color:#6a00f4;font-weight:700">NaN/inf first appear here</div>'
      : s.nonfin ? '<div style="color:#6a00f4">passes NaN/inf on</div>' : "";
    const lossText = origins.has(i) ? "NaN/inf origin (ranked first)"
      : worst >= 0 ? `${fmt(loss)} against ${esc(ops[worst].name)}`
      : `${fmt(loss)} against the format's cap`;
    return `<h3>${esc(o.name)}</h3>${where}
      <div>${esc(o.kind)} in <code>${esc(o.module || "(top level)")}</code>, format
      ${esc(o.fmt || DATA.format || "?")}, ${esc(o.dir)}, status ${esc(o.status)}${o.sur ? ", surrogate" : ""}</div>
      <div>shape [${o.shape.join(", ")}]</div>
      <table>${rows.join("")}</table>
      <div>local loss (${metric}): ${lossText}</div>
      <div>counters: ${cnt}</div>
      <div>coverage: ${o.cov ? esc(o.cov[0] + ": " + o.cov[1]) : "n/a"}</div>
      ${o.src ? `<div class="muted">${esc(o.src)}</div>` : ""}
      ${fixed[i] ? `<div class="fixed">verified fix: ${fixed[i].map(esc).join("; ")}</div>` : ""}
      <div class="muted">${o.inputs.length} input(s), ${o.consumers.length} consumer(s)</div>`;
  }

  // ------------------------------------------------------------------ graph
  const svg = $("#graph");
  function colour() {
    graph.nodes.forEach((g, i) => {
      const v = ops[i].s[metric];
      const fill = digitColour(v, cap), ink = inkFor(fill);
      g.querySelector("rect.box").setAttribute("fill", fill);
      $$("text", g).forEach(t => t.setAttribute("fill", ink));
      g.querySelector("text.val").textContent =
        (num(v) === num(v) ? fmt(v) : "n/a") + (ops[i].s.nonfin ? " NaN/inf" : "");
    });
  }
  function legend() {
    $("#graph-legend").innerHTML =
      `0<span class="scalebar" style="background:${FX.scaleGradient()}"></span>${cap.toFixed(2)} ${metric} digits
       <span><span class="swatch" style="background:#fff;border:3px solid #6a00f4"></span>NaN/inf origin</span>
       <span><span class="swatch" style="background:#fff;border:2px dashed #6a00f4"></span>passes NaN/inf on</span>
       <span><span class="swatch" style="background:#d1d1d1"></span>no ${metric} digits</span>`;
  }
  const graph = FX.initGraph(svg, preds, succs, tipHtml, i => table.mark(i, preds[i] || [], succs[i] || []));
  FX.initZoom($("#graphbox"), svg, {fit: $("#zoom-fit"), full: $("#zoom-full")});

  // ------------------------------------------------------------------ table
  const rows = ops.map((o, i) => ({i, o}));
  const cols = [
    {label: "operator", get: r => r.o.name, html: r => `<code>${esc(r.o.name)}</code>`},
    {label: "module", get: r => r.o.module},
    {label: "kind", get: r => r.o.kind},
  ];
  DATA.metrics.forEach(m => cols.push({label: m, num: true, metric: m, get: r => r.o.s[m],
    style: r => m === metric ? `background:${digitColour(r.o.s[m], cap)};color:${inkFor(digitColour(r.o.s[m], cap))}` : ""}));
  cols.push(
    {label: "max", num: true, get: r => r.o.s.max},
    {label: "local loss", num: true, title: "the least accurate input's digits - own digits",
     get: r => (DATA.loss[metric][r.i] || [null])[0],
     html: r => origins.has(r.i) ? '<b style="color:#6a00f4">NaN/inf origin</b>' : fmt((DATA.loss[metric][r.i] || [null])[0])},
  );
  // a map with impacts (fxstab record --impact): a column, and the table's first order
  const impactCol = DATA.impact === null ? -1 : cols.length;
  if (impactCol >= 0) cols.push({label: "impact", num: true,
    title: `the digits the outputs lose to the operator's own rounding (below ${DATA.impact}: harmless)`,
    get: r => r.o.s.imp});
  cols.push(
    {label: "zero%", num: true, get: r => 100 * num(r.o.s.zero), html: r => (100 * num(r.o.s.zero)).toFixed(1)},
    {label: "NaN/inf", num: true, get: r => r.o.s.nonfin, html: r => String(r.o.s.nonfin)},
    {label: "underflow", num: true, get: r => r.o.s.under, html: r => String(r.o.s.under)},
    {label: "calls", num: true, get: r => r.o.s.calls, html: r => String(r.o.s.calls)},
    {label: "status", get: r => r.o.status},
    {label: "coverage", get: r => r.o.cov ? r.o.cov[1] : ""},
  );
  const table = FX.makeTable($("#table"), cols, rows, i => {
    graph.select(i === graph.selected ? -1 : i, true);
  });
  if (impactCol >= 0) table.sort(impactCol, false, true);
  // the Fixes section's operator names (fxstab fix --html): a click selects the operator
  $$("a.op-link").forEach(a => a.addEventListener("click", ev => {
    ev.preventDefault();
    graph.select(+a.dataset.op, true);
  }));

  // ------------------------------------------------------------------ filters
  const kinds = Array.from(new Set(ops.map(o => o.kind))).sort();
  $("#f-kind").innerHTML = '<option value="">all</option>' +
    kinds.map(k => `<option value="${esc(k)}">${esc(k)}</option>`).join("");
  function applyFilter() {
    const glob = $("#f-module").value.trim(), kind = $("#f-kind").value;
    const below = parseFloat($("#f-below").value);
    const re = glob ? FX.globRe(glob) : null;
    const keep = r => (!re || re.test(r.o.module) || re.test(r.o.name)) &&
      (!kind || r.o.kind === kind) &&
      (Number.isNaN(below) || !(num(r.o.s[metric]) >= below));
    const n = table.filter(keep);
    rows.forEach(r => graph.nodes[r.i].classList.toggle("dim", !keep(r)));
    $("#f-count").textContent = `${n} of ${ops.length} operators`;
  }
  ["input", "change"].forEach(ev => ["#f-module", "#f-kind", "#f-below"].forEach(
    s => $(s).addEventListener(ev, applyFilter)));

  // ------------------------------------------------------------------ digits over steps
  let steps = null;
  function drawSteps() {
    const st = DATA.steps;
    if (!st) return;
    const host = $("#steps");
    if (!steps) {
      const worst = ops.map((o, i) => i).sort((a, b) => (num(ops[a].s[metric]) || 0) - (num(ops[b].s[metric]) || 0));
      steps = {sel: worst.slice(0, 5), bad: new Set(st.bad.map(([r, c]) => r + ":" + c))};
      host.innerHTML = '<p class="muted">Rows: operators in graph order; columns: (phase, step). ' +
        'Violet cross: the output had NaN/inf at that step. Click a row to add or remove its line.</p>' +
        '<div class="heatbox"><canvas class="heat" id="heat"></canvas></div><div id="lines"></div>';
    }
    const vals = st.values[metric];
    FX.heatmap($("#heat"), ops.map(o => o.name), st.labels, (r, c) => {
      const v = vals[r][c];
      const bad = steps.bad.has(r + ":" + c);
      if (v === null && !bad) return null;
      return {fill: digitColour(v, cap), mark: bad, box: steps.sel.includes(r)};
    }, (r, c) => `<b>${esc(ops[r].name)}</b><br>${esc(st.labels[c])}: ${fmt(vals[r][c])} ${metric} digits` +
      (steps.bad.has(r + ":" + c) ? '<br><b style="color:#6a00f4">NaN/inf in the output</b>' : ""),
    r => {
      const k = steps.sel.indexOf(r);
      if (k >= 0) steps.sel.splice(k, 1); else steps.sel.push(r);
      drawSteps();
    });
    FX.linePlot($("#lines"), st.labels, steps.sel.map(r => ({
      name: ops[r].name,
      points: st.labels.map((_, c) => [c, vals[r][c], steps.bad.has(r + ":" + c)])
        .filter(p => p[1] !== null || p[2]),
    })), {yTitle: `${metric} digits`, xTitle: "step", ymin: 0, ymax: Math.max(cap, 0.01) * 1.05,
         hlines: [{y: cap, label: `cap ${cap.toFixed(2)}`}]});
  }

  // ------------------------------------------------------------------ metric selector
  function setMetric(m) {
    metric = m;
    $$("ul.findings").forEach(u => { u.hidden = u.dataset.metric !== m; });
    $("#f-metric-name").textContent = m;
    colour();
    legend();
    table.refresh();
    applyFilter();
    drawSteps();
    if (graph.selected >= 0) table.mark(graph.selected, preds[graph.selected], succs[graph.selected]);
  }
  $("#metric").addEventListener("change", ev => setMetric(ev.target.value));
  legend();
  applyFilter();
  drawSteps();
  FX.ready();
})();
