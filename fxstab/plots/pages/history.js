/* fxstab pages: digits across commits (fxstab history MAPS --html OUT.html). */
(() => {
  const {DATA, $, $$, esc, fmt, num, digitColour, inkFor} = FX;
  let metric = DATA.metric;
  const labels = DATA.labels;

  function drawTarget(t, k) {
    const vals = t.values[metric];
    const shown = Array.from(new Set([...t.outputs, ...t.worst[metric]]));
    const caps = t.caps.filter(c => c !== null);
    const cap = caps.length ? Math.max(...caps) : 1;
    FX.linePlot($(`#lines-${k}`), labels, shown.map(n => ({
      name: (t.outputs.includes(n) ? "output " : "") + n,
      points: labels.map((_, c) => [c, vals[n][c], t.bad[n].includes(c)])
        .filter(p => p[1] !== null || p[2]),
    })), {yTitle: `${metric} digits`, xTitle: "commit", ymin: 0,
         ymax: Math.max(cap, 0.01) * 1.05, hlines: [{y: cap, label: `cap ${cap.toFixed(2)}`}]});
    const host = $(`#table-${k}`);
    host.innerHTML = "";
    const rows = shown.map((n, i) => ({i, n}));
    const last = labels.length - 1;
    const first = n => vals[n].find(v => v !== null);
    const now = n => vals[n][last];
    const cols = [
      {label: "operator", get: r => r.n, html: r => `<code>${esc(r.n)}</code>`},
      {label: "role", get: r => t.outputs.includes(r.n) ? "output" : "worst"},
    ];
    labels.forEach((l, c) => cols.push({label: l, num: true, get: r => vals[r.n][c],
      style: r => vals[r.n][c] === null ? "" :
        `background:${digitColour(vals[r.n][c], cap)};color:${inkFor(digitColour(vals[r.n][c], cap))}`,
      html: r => vals[r.n][c] === null ? "" : fmt(vals[r.n][c]) + (t.bad[r.n].includes(c) ? " NaN/inf" : "")}));
    cols.push({label: "change", num: true,
               title: "the last commit's digits - the first commit's that has the operator",
               get: r => now(r.n) === null || first(r.n) === undefined ? null : num(now(r.n)) - num(first(r.n)),
               html: r => {
                 if (now(r.n) === null || first(r.n) === undefined) return "";
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
