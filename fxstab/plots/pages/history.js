/* fxstab pages: digits across commits (fxstab history MAPS --html OUT.html), or across the
   steps of a training run (DATA.unit "step": the trainer callbacks' steps.html). */
(() => {
  const {DATA, $, $$, esc, fmt, num, digitColour, inkFor} = FX;
  let metric = DATA.metric;
  const labels = DATA.labels;
  const unit = DATA.unit || "commit";

  function drawTarget(t, k) {
    const vals = t.values[metric];
    const shown = Array.from(new Set([...t.outputs, ...t.worst[metric]]));
    const caps = t.caps.filter(c => c !== null);
    const cap = caps.length ? Math.max(...caps) : 1;
    FX.linePlot($(`#lines-${k}`), labels, shown.map(n => ({
      name: (t.outputs.includes(n) ? "output " : "") + n,
      points: labels.map((_, c) => [c, vals[n][c], t.bad[n].includes(c)])
        .filter(p => p[1] !== null || p[2]),
    })), {yTitle: `${metric} digits`, xTitle: unit, ymin: 0,
         ymax: Math.max(cap, 0.01) * 1.05, hlines: [{y: cap, label: `cap ${cap.toFixed(2)}`}]});
    const host = $(`#table-${k}`);
    host.innerHTML = "";
    const rows = shown.map((n, i) => ({i, n}));
    const last = labels.length - 1;
    const first = n => vals[n].find(v => v !== null);
    const now = n => vals[n][last];
    // an operator only the last point has: no change to show (it read "+0.00")
    const isNew = n => last > 0 && vals[n].findIndex(v => v !== null) === last;
    const cols = [
      {label: "operator", get: r => r.n, html: r => `<code>${esc(r.n)}</code>`},
      {label: "role", get: r => t.outputs.includes(r.n) ? "output" : "worst"},
    ];
    labels.forEach((l, c) => cols.push({label: l, num: true, get: r => vals[r.n][c],
      style: r => vals[r.n][c] === null ? "" :
        `background:${digitColour(vals[r.n][c], cap)};color:${inkFor(digitColour(vals[r.n][c], cap))}`,
      html: r => vals[r.n][c] === null ? "" : fmt(vals[r.n][c]) + (t.bad[r.n].includes(c) ? " NaN/inf" : "")}));
    cols.push({label: "change", num: true,
               title: `the last ${unit}'s digits - the first ${unit}'s that has the operator ` +
                      `("new": only the last ${unit} has it)`,
               get: r => now(r.n) === null || first(r.n) === undefined || isNew(r.n) ? null :
                         num(now(r.n)) - num(first(r.n)),
               html: r => {
                 if (now(r.n) === null || first(r.n) === undefined) return "";
                 if (isNew(r.n)) return "new";
                 const d = num(now(r.n)) - num(first(r.n));
                 return (d >= 0 ? "+" : "") + d.toFixed(2);
               }});
    FX.makeTable(host, cols, rows, () => {});
  }
  function draw() { DATA.targets.forEach(drawTarget); }
  $("#metric").addEventListener("change", ev => { metric = ev.target.value; draw(); });
  draw();
  FX.ready();
})();
