/* fxstab pages: a precision plan (fxstab plan ... --html OUT.html). */
(() => {
  const {DATA, $, esc, fmt, num} = FX;
  const f = DATA.frontier;
  if (f.length) {
    // the plan: the cheapest point that keeps what it must (the search returns that one)
    const chosen = f.findIndex(p => num(p[1]) >= DATA.keep && Math.abs(num(p[0]) - num(DATA.cost)) < 1e-3);
    const ys = f.map(p => num(p[1])).filter(Number.isFinite);
    FX.linePlot($("#frontier"), f.map(p => fmt(p[0], 3)), [{
      name: "plans found (digits at the outputs)",
      points: f.map((p, i) => [i, p[1], !Number.isFinite(num(p[1])),
                               i === chosen ? `the plan: ${p[2]} operators, cost ${fmt(p[0], 3)}` : null]),
    }], {yTitle: "digits at the outputs", xTitle: `cost (all in ${DATA.format} = 1)`, ymin: 0,
         ymax: Math.max(DATA.keep, ...ys, 0.01) * 1.1,
         hlines: [{y: DATA.keep, label: `keep ${fmt(DATA.keep)}`, colour: "#d62728"}]});
  } else {
    $("#frontier").innerHTML = '<p class="muted">No frontier: the search evaluated no plan beyond the first.</p>';
  }
  const rows = DATA.ops.map((o, i) => ({i, o}));
  FX.makeTable($("#table"), [
    {label: "operator", get: r => r.o.name, html: r => `<code>${esc(r.o.name)}</code>`},
    {label: "module", get: r => r.o.module},
    {label: "kind", get: r => r.o.kind},
    {label: `before (${DATA.format})`, num: true, get: r => r.o.before},
    {label: "after", num: true, get: r => r.o.after},
  ], rows, () => {});
  if (!rows.length) $("#table").innerHTML = '<p class="muted">Nothing promoted.</p>';
  FX.ready();
})();
