// Live charts of the overview page: polls /api/overview every 5 s and draws
// the last hour as SVG polylines. No framework, no build step.
(function () {
  "use strict";
  const throughput = document.getElementById("chart-throughput");
  const latency = document.getElementById("chart-latency");
  if (!throughput || !latency) { return; }
  const NS = "http://www.w3.org/2000/svg";

  function draw(svg, points, keys) {
    while (svg.firstChild) { svg.removeChild(svg.firstChild); }
    const w = 600, h = 160, pad = 14;
    const values = [];
    points.forEach(function (p) { keys.forEach(function (k) { if (p[k] !== null && p[k] !== undefined) { values.push(p[k]); } }); });
    const max = Math.max(1e-9, Math.max.apply(null, values.concat([0])));
    const t0 = points.length ? points[0].t : 0, t1 = points.length ? points[points.length - 1].t : 1;
    const span = Math.max(1, t1 - t0);
    keys.forEach(function (k, i) {
      const coords = [];
      points.forEach(function (p) {
        if (p[k] === null || p[k] === undefined) { return; }
        const x = ((p.t - t0) / span) * (w - 2 * pad) + pad;
        const y = h - pad - (p[k] / max) * (h - 2 * pad);
        coords.push(x.toFixed(1) + "," + y.toFixed(1));
      });
      const line = document.createElementNS(NS, "polyline");
      line.setAttribute("points", coords.join(" "));
      line.setAttribute("class", "s" + i);
      svg.appendChild(line);
    });
    const label = document.createElementNS(NS, "text");
    label.setAttribute("x", "2"); label.setAttribute("y", "10");
    label.textContent = "max " + max.toFixed(max < 10 ? 2 : 0);
    svg.appendChild(label);
  }

  function last(points, key) {
    for (let i = points.length - 1; i >= 0; i--) { if (points[i][key] !== null) { return points[i][key]; } }
    return null;
  }

  function refresh() {
    fetch("/api/overview", { headers: { "Accept": "application/json" } })
      .then(function (r) { return r.json(); })
      .then(function (data) {
        const s = data.series || [];
        draw(throughput, s, ["completed_per_s"]);
        draw(latency, s, ["pickup_p50_ms", "pickup_p95_ms"]);
        const t = last(s, "completed_per_s"), p50 = last(s, "pickup_p50_ms"), p95 = last(s, "pickup_p95_ms");
        document.getElementById("last-throughput").textContent = t === null ? "no sample yet" : "now " + t.toFixed(1) + "/s";
        document.getElementById("last-latency").textContent = p50 === null ? "no local samples" : "now p50 " + p50.toFixed(2) + " ms, p95 " + p95.toFixed(2) + " ms";
        (data.queues || []).forEach(function (q) {
          const row = document.querySelector('#overview-queues tr[data-queue="' + CSS.escape(q.queue) + '"]');
          if (!row) { return; }
          ["available", "completed", "failed", "cancelled"].forEach(function (f) {
            const cell = row.querySelector('[data-field="' + f + '"]');
            if (cell) { cell.textContent = String(q[f] || 0); }
          });
        });
      })
      .catch(function () { /* the next poll tries again */ });
  }
  refresh();
  setInterval(refresh, 5000);
})();
