/* fxstab pages: a stability monitor's history (StabilityMonitor.save_html). */
(() => {
  const {DATA, $, esc, fmtg, num} = FX;
  const ops = DATA.ops, nSteps = Math.max(1, DATA.steps);
  const stepLabels = Array.from({length: nSteps}, (_, s) => String(s));
  // per operator and step: the last check of that step
  const at = ops.map(o => {
    const m = new Map();
    o.checks.forEach(c => m.set(c[0], c));
    return m;
  });
  const promoAt = new Map();
  DATA.promotions.forEach(p => promoAt.set(p[1] + ":" + p[0], p));

  function scoreColour(score, warn, safe) {
    const s = num(score);
    if (!Number.isFinite(s)) return "#6a00f4";
    if (s >= safe) return "#d62728";
    if (s >= warn) return "#ff7f0e";
    // below tau_warn: pale to full green as the score nears it
    const t = Math.max(0, Math.min(1, Math.log10(Math.max(s, warn * 1e-3) / (warn * 1e-3)) / 3));
    const c0 = [232, 245, 233], c1 = [44, 160, 44];
    return "#" + c0.map((a, k) => Math.round(a + t * (c1[k] - a)).toString(16).padStart(2, "0")).join("");
  }

  // ------------------------------------------------------------------ promotions
  $("#promotions").innerHTML = DATA.promotions.length ?
    '<table class="ops"><thead><tr><th>step</th><th>operator</th><th>from</th><th>to</th><th>score</th><th>reason</th></tr></thead><tbody>' +
    DATA.promotions.map(p => `<tr><td class="n">${p[0]}</td><td><code>${esc(ops[p[1]].name)}</code></td>
      <td>${esc(p[2])}</td><td>${esc(p[3])}</td><td class="n">${fmtg(p[4])}</td><td>${esc(p[5])}</td></tr>`).join("") +
    "</tbody></table>" : "<p>No operator was promoted.</p>";

  // ------------------------------------------------------------------ heatmap and lines
  const promoted = new Set(DATA.promotions.map(p => p[1]));
  const sel = ops.map((o, i) => i).filter(i => promoted.has(i));
  if (!sel.length) {
    const peak = i => Math.max(0, ...ops[i].checks.map(c => Number.isFinite(num(c[2])) ? num(c[2]) : 0));
    ops.map((o, i) => i).sort((a, b) => peak(b) - peak(a)).slice(0, 4).forEach(i => sel.push(i));
  }
  function draw() {
    // an operator never checked has no score yet: its row says so (a blank row would read as 0)
    FX.heatmap($("#heat"), ops.map(o => o.checks.length ? o.name : o.name + " (not checked yet)"), stepLabels, (r, c) => {
      const ch = at[r].get(c);
      const p = promoAt.get(r + ":" + c);
      if (!ch && !p) return null;
      const o = ops[r];
      return {fill: ch ? scoreColour(ch[2], num(o.warn), num(o.safe)) : "#ffffff",
              mark: ch ? !Number.isFinite(num(ch[1])) : false, box: !!p};
    }, (r, c) => {
      const ch = at[r].get(c), p = promoAt.get(r + ":" + c), o = ops[r];
      let t = `<b>${esc(o.name)}</b><br>step ${c}`;
      if (ch) t += `: S ${fmtg(ch[1])}, score ${fmtg(ch[2])} (probed ${esc(ch[3])})`;
      else t += ": not checked";
      t += `<br>tau_warn ${fmtg(o.warn)}, tau_safe ${fmtg(o.safe)}`;
      if (p) t += `<br><b>promoted ${esc(p[2])} &rarr; ${esc(p[3])}</b> (${esc(p[5])})`;
      return t;
    }, r => {
      const k = sel.indexOf(r);
      if (k >= 0) sel.splice(k, 1); else sel.push(r);
      draw();
    });
    const pairs = new Map();
    sel.forEach(r => pairs.set(ops[r].warn + "/" + ops[r].safe, ops[r]));
    const hlines = [];
    pairs.forEach(o => {
      if (Number.isFinite(num(o.warn))) hlines.push({y: num(o.warn), label: `tau_warn ${fmtg(o.warn)}`, colour: "#ff7f0e"});
      if (Number.isFinite(num(o.safe))) hlines.push({y: num(o.safe), label: `tau_safe ${fmtg(o.safe)}`, colour: "#d62728"});
    });
    FX.linePlot($("#lines"), stepLabels, sel.map(r => ({
      name: ops[r].name,
      points: ops[r].checks.map(c => {
        const p = promoAt.get(r + ":" + c[0]);
        return [c[0], c[2], !Number.isFinite(num(c[1])), p ? `promoted ${p[2]} -> ${p[3]}` : ""];
      }),
    })), {log: true, yTitle: "score (EMA of S)", xTitle: "step", hlines});
  }
  draw();

  // ------------------------------------------------------------------ table
  const rows = ops.map((o, i) => ({i, o}));
  const last = o => o.checks.length ? o.checks[o.checks.length - 1] : null;
  FX.makeTable($("#table"), [
    {label: "operator", get: r => r.o.name, html: r => `<code>${esc(r.o.name)}</code>`},
    {label: "mode", get: r => r.o.mode},
    {label: "checks", num: true, get: r => r.o.checks.length, html: r => String(r.o.checks.length)},
    {label: "last score", num: true, get: r => last(r.o) ? last(r.o)[2] : null,
     html: r => last(r.o) ? fmtg(last(r.o)[2]) : '<span class="muted unchecked">not checked yet</span>'},
    {label: "peak score", num: true, get: r => Math.max(-Infinity, ...r.o.checks.map(c => num(c[2])).filter(Number.isFinite)),
     html: r => r.o.checks.length ? fmtg(Math.max(-Infinity, ...r.o.checks.map(c => num(c[2])).filter(Number.isFinite))) : '<span class="muted">-</span>'},
    {label: "tau_warn", num: true, get: r => r.o.warn, html: r => fmtg(r.o.warn)},
    {label: "tau_safe", num: true, get: r => r.o.safe, html: r => fmtg(r.o.safe)},
  ], rows, i => {
    if (!sel.includes(i)) { sel.push(i); draw(); }
  });
  FX.ready();
})();
