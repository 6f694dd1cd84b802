// hier_localsgd dashboard: polls api/state and renders the hierarchy, loss charts
// (inline SVG) and the timeline. Vanilla JS, no build step, no external resources.
"use strict";

const COLORS = ["#2457c5", "#d4462f", "#13875d", "#c47d00", "#7c3aed", "#d0367f", "#0e8aa6", "#5f8f12"];
const DEAD = new Set(["killed", "exited", "failed", "restarting", "finished", "absent"]);

const ui = {
  refreshMs: 1000,
  state: null,
  openLinks: new Set(),
  hidden: new Set(loadHidden()),
  lastOk: 0,
};

// ---------------------------------------------------------------------------- helpers
function loadHidden() {
  try { return JSON.parse(localStorage.getItem("hl.hidden") || "[]"); } catch (e) { return []; }
}
function esc(v) {
  return String(v === null || v === undefined ? "" : v)
    .replace(/&/g, "&amp;").replace(/</g, "&lt;").replace(/>/g, "&gt;").replace(/"/g, "&quot;");
}
function isNum(x) { return typeof x === "number" && isFinite(x); }
function fmtAge(s) {
  if (!isNum(s)) return "–";
  if (s < 10) return s.toFixed(1) + " s";
  if (s < 60) return Math.round(s) + " s";
  if (s < 3600) return Math.floor(s / 60) + " m " + Math.floor(s % 60) + " s";
  return Math.floor(s / 3600) + " h " + Math.floor((s % 3600) / 60) + " m";
}
function fmtLoss(x, d = 4) { return isNum(x) ? x.toFixed(d) : "–"; }
function fmtBytes(b) {
  if (!isNum(b)) return "–";
  if (b < 1e3) return b.toFixed(0) + " B";
  if (b < 1e6) return (b / 1e3).toFixed(1) + " kB";
  if (b < 1e9) return (b / 1e6).toFixed(2) + " MB";
  return (b / 1e9).toFixed(2) + " GB";
}
function fmtVal(v) {
  if (isNum(v)) {
    if (Number.isInteger(v)) return String(v);
    return Math.abs(v) >= 1000 ? v.toFixed(0) : Math.abs(v) >= 1 ? v.toFixed(3) : v.toPrecision(3);
  }
  if (v === null || v === undefined) return "–";
  if (typeof v === "object") return JSON.stringify(v);
  return String(v);
}
function fmtKey(k, v) {
  if (isNum(v) && /bytes/.test(k)) return fmtBytes(v);
  if (isNum(v) && /rate$/.test(k)) return (100 * v).toFixed(2) + "%";
  if (isNum(v) && /_s$/.test(k)) return fmtAge(v);
  return fmtVal(v);
}
function clock(t) {
  const d = new Date(t * 1000);
  return d.toTimeString().slice(0, 8);
}
function slug(s) { return String(s).replace(/[^a-z0-9]+/gi, "-"); }
function toast(msg, err) {
  const el = document.getElementById("toast");
  el.textContent = msg;
  el.className = "toast" + (err ? " err" : "");
  el.hidden = false;
  clearTimeout(toast.timer);
  toast.timer = setTimeout(() => { el.hidden = true; }, 7000);
}

// ---------------------------------------------------------------------------- polling
async function poll() {
  try {
    const resp = await fetch("api/state", { cache: "no-store" });
    if (!resp.ok) throw new Error("HTTP " + resp.status);
    const s = await resp.json();
    ui.state = s;
    ui.refreshMs = (s.config && s.config.refresh_ms) || 1000;
    ui.lastOk = Date.now();
    setConn(true, s);
    render(s);
  } catch (e) {
    setConn(false, null, e);
  } finally {
    setTimeout(poll, ui.refreshMs);
  }
}

function setConn(ok, s, err) {
  const el = document.getElementById("conn");
  el.dataset.ok = ok ? "true" : "false";
  if (ok) {
    el.textContent = "live · " + clock(s.now) + (s.config.allow_kill ? " · kills enabled" : "");
  } else {
    const since = ui.lastOk ? " (last update " + fmtAge((Date.now() - ui.lastOk) / 1000) + " ago)" : "";
    el.textContent = "disconnected" + since;
    el.title = String(err);
  }
}

// sync.outer.auto: what it measured and what it picked (experiments/auto.py), re-choices (auto_watch.py)
function autoLine(a) {
  if (!a) return "";
  const f = (v, d) => (v === null || v === undefined) ? "?" : Number(v).toFixed(d);
  return '<br><span id="outer-auto">outer auto: WAN ' + f(a.wan_mbit, 1) + " Mbit/s " + f(a.wan_latency_ms, 1) +
    " ms, step " + f(a.step_ms, 0) + " ms → " + esc(a.overrides.join(" ")) +
    (a.hides === true ? " (hides" : a.hides === false ? " (does not hide" : " (") +
    (a.time_factor === null || a.time_factor === undefined ? ")" : ", modelled time " + f(a.time_factor, 3) + "×)") +
    (a.rechosen ? "; re-chosen for the link " + a.rechosen + "× (last at step " + f(a.rechosen_at_step, 0) + ")" : "") + "</span>";
}

// ---------------------------------------------------------------------------- render
function render(s) {
  const r = s.run;
  document.getElementById("run-title").innerHTML =
    "<b>" + esc(s.run_dir) + "</b>" +
    (r.mode ? " · mode " + esc(r.mode) : "") +
    " · " + r.clusters + " cluster" + (r.clusters === 1 ? "" : "s") + " × " + r.replicas_per_cluster + " replica groups" +
    (r.model_params ? " · " + (r.model_params / 1e6).toFixed(r.model_params < 1e6 ? 3 : 2) + " M params" : "") +
    autoLine(r.outer_auto);
  renderSummary(s);
  renderTree(s);
  renderCharts(s);
  renderTimeline(s);
}

function stat(label, value, sub, bar) {
  return '<div class="stat"><div class="label">' + esc(label) + '</div><div class="value">' + value + "</div>" +
    (sub !== undefined ? '<div class="sub">' + sub + "</div>" : "") +
    (bar !== undefined ? '<div class="bar"><span style="width:' + Math.max(0, Math.min(100, bar)).toFixed(1) + '%"></span></div>' : "") +
    "</div>";
}

function renderSummary(s) {
  const r = s.run, c = s.counts || {};
  const total = r.steps_total;
  const prog = isNum(r.step_min) && total ? (100 * r.step_min) / total : undefined;
  const losses = s.clusters.map((x) => x.loss).filter(isNum);
  const mean = losses.length ? losses.reduce((a, b) => a + b, 0) / losses.length : null;
  const floor = r.entropy_floor;
  const failures = (c.kill || 0) + (c.exit_nonzero || 0);
  document.getElementById("summary").innerHTML = [
    stat("Replica groups live", r.live + " / " + r.replica_groups, r.clusters + " clusters × " + r.replicas_per_cluster + " replica groups"),
    stat("Step", isNum(r.step_min) ? (r.step_min === r.step_max ? r.step_min : r.step_min + "–" + r.step_max) + (total ? '<span class="of"> / ' + total + "</span>" : "") : "–",
      "slowest – fastest replica group", prog),
    stat("Rounds inner / outer", isNum(r.inner_round) ? r.inner_round + " / " + r.outer_round : "–", "furthest replica group"),
    stat("Train loss", fmtLoss(mean), isNum(floor) ? "floor " + fmtLoss(floor) + (isNum(mean) ? " · excess " + fmtLoss(mean - floor) : "") : "mean of the clusters"),
    stat("Commits", (c.commit || 0) + "", plural(c.rollback || 0, "rollback") + " · " + plural(c.heal || 0, "heal") + " · " + plural(c.resync || 0, "resync")),
    stat("Failures", failures + "", plural(c.kill || 0, "kill") + " · " + plural(c.exit_nonzero || 0, "failed exit") + " · " + plural(c.restart || 0, "restart") + " · " + plural(c.timeout || 0, "timeout")),
  ].join("");
}

function participants(q, leader) {
  if (!q || !q.participants || !q.participants.length) return '<span class="muted">none reported</span>';
  return q.participants.map((p) => '<span class="chip' + (p === leader ? " lead" : "") + '">' + esc(p) + "</span>").join("");
}

function lighthouseLink(addr) {
  if (!addr) return '<span class="muted">unknown address</span>';
  return '<a class="mono" href="' + esc(addr) + '/" target="_blank" rel="noopener" title="this lighthouse\'s own torchft page">' + esc(addr) + " ↗</a>";
}

function quorumText(q) {
  if (!q || q.quorum_id === null || q.quorum_id === undefined) return '<span class="k">quorum</span> –';
  return '<span class="k">quorum</span> <b>#' + esc(q.quorum_id) + "</b> · " + q.participants.length + (isNum(q.quorum_size) ? " / " + q.quorum_size : "") + " participants";
}

function renderTree(s) {
  const tree = document.getElementById("tree");
  if (!s.run.found && !s.clusters.length) {
    tree.innerHTML = '<p class="empty">Waiting for replica groups to publish their status under <span class="mono">' + esc(s.run_dir) + "/replicas/</span> …</p>";
    return;
  }
  const allowKill = s.config.allow_kill;
  const g = s.global;
  let html = '<div class="lh lh-global" data-lighthouse="global"><span class="lh-name">Global lighthouse</span>' + lighthouseLink(g.address) +
    "<span>" + quorumText(g) + "</span><span>" + participants(g) + '</span><span class="muted">cluster leaders sync across clusters here</span></div>';
  html += '<div class="tree-children">';
  for (const c of s.clusters) {
    const lh = c.lighthouse;
    html += '<div class="cluster" data-cluster="' + c.cluster + '"><div class="cluster-head lh"><span class="lh-name">Cluster ' + c.cluster + "</span>" +
      '<span class="k">lighthouse</span>' + lighthouseLink(lh.address) + "<span>" + quorumText(lh) + "</span><span>" + participants(lh, c.leader) + "</span>" +
      '<span><span class="k">leader</span> <b class="mono">' + esc(c.leader || "–") + "</b></span>" +
      '<span><span class="k">live</span> ' + c.live + " / " + c.replicas.length + "</span>" +
      (isNum(c.loss) ? '<span><span class="k">loss</span> ' + fmtLoss(c.loss) + "</span>" : "") +
      (isNum(c.step_rate) ? '<span class="pace"><span class="k">steps/s</span> ' + c.step_rate.toFixed(2) +
        (isNum(c.sync_share) ? ' <span class="k">in sync</span> ' + Math.round(100 * c.sync_share) + "%" : "") +
        (isNum(c.wait_share) ? ' <span class="k">waiting</span> ' + Math.round(100 * c.wait_share) + "%" : "") + "</span>" : "") +
      (c.asynchronous && isNum(c.version) ? '<span class="version"><span class="k">version</span> ' + c.version +
        (isNum(c.version_lag) ? ' <span class="k">lag</span> ' + c.version_lag : "") + "</span>" : "") + "</div>";
    html += '<div class="table-wrap"><table class="rg"><thead><tr><th>Replica group</th><th>Role</th><th>Process</th><th>Phase</th><th>Step</th><th>Inner</th><th>Outer</th>' +
      "<th>Last commit</th><th>Train loss</th><th>Last seen</th><th>Link (sent)</th>" + (allowKill ? "<th></th>" : "") + "</tr></thead><tbody>";
    for (const rg of c.replicas) html += replicaRow(rg, allowKill);
    html += "</tbody></table></div></div>";
  }
  html += "</div>";
  tree.innerHTML = html;
}

function replicaRow(rg, allowKill) {
  const cols = allowKill ? 12 : 11;
  const dead = DEAD.has(rg.health);
  const healthCls = "h-" + slug(rg.health);
  const title = esc(rg.health_detail || "") + (rg.pid ? " · pid " + rg.pid : "") + (rg.restarts ? " · " + rg.restarts + " restart(s)" : "");
  if (!rg.published) {
    return '<tr class="rg-row dead" data-replica="' + rg.name + '" data-health="' + esc(rg.health) + '"><td class="c-name">' + rg.name +
      '</td><td class="c-role">–</td><td class="c-health"><span class="badge ' + healthCls + '" title="' + title + '">' + esc(rg.health) +
      '</span></td><td class="c-phase" colspan="' + (cols - 3) + '"><span class="muted">' + esc(rg.health_detail) + "</span></td></tr>";
  }
  const phase = rg.phase || "–";
  const phaseTitle = "in " + phase + " for " + fmtAge(rg.phase_age_s) + (isNum(rg.phase_deadline_in_s) ? " · deadline in " + fmtAge(Math.max(0, rg.phase_deadline_in_s)) : "");
  const stepPct = isNum(rg.step) && rg.steps_total ? (100 * rg.step) / rg.steps_total : 0;
  const commit = isNum(rg.last_commit_age_s)
    ? esc(rg.last_commit_level || "") + " #" + esc(rg.last_commit_round) + ' <span class="small">' + fmtAge(rg.last_commit_age_s) + " ago</span>"
    : '<span class="muted">none yet</span>';
  const outage = Object.entries(rg.outage || {}).map(([lvl, o]) =>
    ' <span class="badge warn" title="' + esc(lvl) + " lighthouse " + esc(o.lighthouse) + " not answering for " + fmtAge(o.for_s) + ", " + esc(o.retries) + ' retries; training on">' +
    esc(lvl) + " lighthouse out " + fmtAge(o.for_s) + "</span>").join("");
  const excessTxt = isNum(rg.excess) ? '<span class="small" title="excess over the entropy floor"> ' + (rg.excess >= 0 ? "+" : "−") + Math.abs(rg.excess).toFixed(3) + "</span>" : "";
  let html = '<tr class="rg-row' + (dead ? " dead" : "") + '" data-replica="' + rg.name + '" data-health="' + esc(rg.health) + '" data-phase="' + esc(phase) + '">' +
    '<td class="c-name" title="' + esc(rg.replica_id || "") + '">' + rg.name + "</td>" +
    '<td class="c-role"><span class="badge role-' + rg.role + '">' + (rg.leader ? "★ leader" : "member") + "</span></td>" +
    '<td class="c-health"><span class="badge ' + healthCls + '" title="' + title + '">' + esc(rg.health) + "</span>" +
    (rg.restarts ? ' <span class="small" title="restarts">↻' + rg.restarts + "</span>" : "") +
    (rg.excluded ? ' <span class="badge bad" title="contributions excluded by the poison screen (non-finite or outsized)">excluded ' + esc(rg.excluded) + "</span>" : "") + "</td>" +
    '<td class="c-phase"><span class="phase ph-' + esc(phase) + '" title="' + esc(phaseTitle) + '">' + esc(phase) + '</span> <span class="small">' + fmtAge(rg.phase_age_s) + "</span>" + outage + "</td>" +
    '<td class="c-step num">' + esc(rg.step) + (rg.steps_total ? '<span class="small"> / ' + rg.steps_total + '</span><div class="bar stepbar"><span style="width:' + stepPct.toFixed(1) + '%"></span></div>' : "") + "</td>" +
    '<td class="c-inner num">' + esc(rg.inner_round) + "</td>" +
    '<td class="c-outer num">' + esc(rg.outer_round) + "</td>" +
    '<td class="c-commit">' + commit + "</td>" +
    '<td class="c-loss num" title="step ' + esc(rg.loss_step) + (isNum(rg.eval_loss) ? " · eval " + fmtLoss(rg.eval_loss) + " at step " + esc(rg.eval_step) : "") + '">' + fmtLoss(rg.loss) + excessTxt + "</td>" +
    '<td class="c-seen num" title="age of its status.json (rewritten every step and phase change)">' + fmtAge(rg.last_seen_s) + "</td>" +
    '<td class="c-link">' + linkCell(rg) + "</td>";
  if (allowKill) {
    html += '<td class="c-kill">' + (rg.kill
      ? '<button class="kill" data-cluster="' + rg.cluster + '" data-replica="' + rg.replica + '" data-name="' + rg.name + '" data-rid="' + esc(rg.replica_id) + '" title="POST ' + esc(rg.lighthouse) + '/replica/…/kill">kill</button>'
      : '<button class="kill" disabled title="not running">kill</button>') + "</td>";
  }
  html += "</tr>";
  if (ui.openLinks.has(rg.name)) html += '<tr class="details" data-details="' + rg.name + '"><td colspan="' + cols + '">' + linkDetails(rg) + "</td></tr>";
  return html;
}

function linkCell(rg) {
  const levels = Object.entries(rg.link || {});
  if (!levels.length) return '<span class="muted">–</span>';
  const parts = levels.map(([lvl, st]) => {
    let p = '<span class="lvl">' + esc(lvl) + "</span> " + fmtBytes(st.sent_bytes_total);
    if (isNum(st.loss_rate)) p += ' <span class="warnv" title="observed packet loss">loss ' + (100 * st.loss_rate).toFixed(2) + "%</span>";
    if (isNum(st.injected_failures) && st.injected_failures > 0) p += ' <span class="warnv" title="injected failures">✗' + st.injected_failures + "</span>";
    return p;
  });
  const open = ui.openLinks.has(rg.name);
  const toggle = '<button class="toggle" data-toggle="' + rg.name + '" title="all link and process statistics">' + (open ? "▾ less" : "▸ more") + "</button>";
  return '<div class="link-levels">' + parts.map((p, i) => "<div>" + p + (i === parts.length - 1 ? toggle : "") + "</div>").join("") + "</div>";
}

function linkDetails(rg) {
  let html = "";
  for (const [lvl, st] of Object.entries(rg.link || {})) {
    html += '<div class="kv-level">' + esc(lvl) + " link · " + esc(st.calls) + " collectives · " + fmtBytes(st.sent_bytes_total) + " sent</div><div class=\"kv\">";
    for (const [k, v] of st.details || []) html += '<div title="' + esc(k) + " = " + esc(v) + '"><span class="k">' + esc(k) + "</span> " + esc(fmtKey(k, v)) + "</div>";
    html += "</div>";
  }
  const extra = [["steps run", rg.steps_run], ["steps discarded", rg.steps_discarded], ["contributions excluded", rg.excluded || 0], ["steps since commit", rg.steps_since_commit], ["uptime", fmtAge(rg.uptime_s)], ["pid", rg.pid], ["torchft replica id", rg.replica_id]];
  html += '<div class="kv-level">process</div><div class="kv">' + extra.map(([k, v]) => '<div><span class="k">' + esc(k) + "</span> " + esc(fmtVal(v)) + "</div>").join("") + "</div>";
  return html;
}

// ---------------------------------------------------------------------------- charts
function niceStep(span, n) {
  const raw = span / Math.max(1, n);
  const mag = Math.pow(10, Math.floor(Math.log10(raw)));
  const e = raw / mag;
  return (e >= 7.5 ? 10 : e >= 3.5 ? 5 : e >= 1.5 ? 2 : 1) * mag;
}
function linTicks(lo, hi, n) {
  const step = niceStep(hi - lo || 1, n);
  const out = [];
  for (let v = Math.ceil(lo / step) * step; v <= hi + step * 1e-9; v += step) out.push(+v.toPrecision(12));
  return out;
}
function logTicks(lo, hi) {
  const out = [];
  const a = Math.floor(Math.log10(lo)), b = Math.ceil(Math.log10(hi));
  const mults = b - a <= 2 ? [1, 2, 5] : [1];
  for (let d = a; d <= b; d++) for (const m of mults) { const v = m * Math.pow(10, d); if (v >= lo * 0.999 && v <= hi * 1.001) out.push(v); }
  return out;
}
function logFloor(v) {
  const b = Math.pow(10, Math.floor(Math.log10(v)));
  for (const m of [5, 2, 1]) if (m * b <= v * 1.0001) return m * b;
  return b;
}
function logCeil(v) {
  const b = Math.pow(10, Math.floor(Math.log10(v)));
  for (const m of [1, 2, 5, 10]) if (m * b >= v * 0.9999) return m * b;
  return 10 * b;
}
function plural(n, word) { return n + " " + word + (n === 1 ? "" : "s"); }
function fmtTick(v) {
  if (v === 0) return "0";
  const a = Math.abs(v);
  if (a >= 1000) return (v / 1000).toFixed(a >= 10000 ? 0 : 1) + "k";
  if (a >= 1) return String(+v.toFixed(2));
  return String(+v.toPrecision(2));
}

function lineChart(el, opts) {
  const W = Math.max(320, el.clientWidth || 600), H = opts.height || 220;
  const m = { l: 48, r: 14, t: 10, b: 28 };
  const pts = opts.series.flatMap((s) => s.points).concat(opts.marks ? opts.marks.flatMap((s) => s.points) : []);
  if (!pts.length) { el.innerHTML = '<p class="empty">No loss reported yet.</p>'; return; }
  let x0 = Math.min(...pts.map((p) => p[0])), x1 = Math.max(...pts.map((p) => p[0]));
  if (x1 === x0) x1 = x0 + 1;
  const ys = pts.map((p) => p[1]).concat(isNum(opts.hline) ? [opts.hline] : []);
  let y0 = Math.min(...ys), y1 = Math.max(...ys);
  if (opts.log) {
    const pos = ys.filter((v) => v > 0);
    y0 = logFloor(Math.max(opts.logMin, pos.length ? Math.min(...pos) : opts.logMin));
    y1 = logCeil(Math.max(y0 * 2, y1));
  } else {
    const step = niceStep(y1 - y0 || 1, 5);
    y0 = Math.max(Math.min(0, y0), Math.floor(y0 / step) * step);
    y1 = Math.ceil(y1 / step) * step;
    if (y1 === y0) y1 = y0 + step;
  }
  const X = (x) => m.l + ((x - x0) / (x1 - x0)) * (W - m.l - m.r);
  const Y = opts.log
    ? (y) => m.t + (1 - (Math.log10(Math.max(y, y0)) - Math.log10(y0)) / (Math.log10(y1) - Math.log10(y0))) * (H - m.t - m.b)
    : (y) => m.t + (1 - (y - y0) / (y1 - y0)) * (H - m.t - m.b);
  let svg = '<svg viewBox="0 0 ' + W + " " + H + '" width="' + W + '" height="' + H + '" role="img" aria-label="' + esc(opts.label) + '">';
  for (const v of opts.log ? logTicks(y0, y1) : linTicks(y0, y1, 5)) {
    svg += '<line class="grid" x1="' + m.l + '" x2="' + (W - m.r) + '" y1="' + Y(v) + '" y2="' + Y(v) + '"/>' +
      '<text x="' + (m.l - 6) + '" y="' + (Y(v) + 4) + '" text-anchor="end">' + fmtTick(v) + "</text>";
  }
  for (const v of linTicks(x0, x1, Math.max(3, Math.floor(W / 110)))) {
    svg += '<text x="' + X(v) + '" y="' + (H - m.b + 16) + '" text-anchor="middle">' + fmtTick(v) + "</text>";
  }
  svg += '<line class="axis" x1="' + m.l + '" x2="' + (W - m.r) + '" y1="' + (H - m.b) + '" y2="' + (H - m.b) + '"/>';
  svg += '<text x="' + (W - m.r) + '" y="' + (H - 2) + '" text-anchor="end">step</text>';
  if (isNum(opts.hline)) {
    svg += '<line class="floor" x1="' + m.l + '" x2="' + (W - m.r) + '" y1="' + Y(opts.hline) + '" y2="' + Y(opts.hline) + '"/>' +
      '<text class="floor-label" x="' + (W - m.r - 4) + '" y="' + (Y(opts.hline) - 5) + '" text-anchor="end">entropy floor ' + fmtLoss(opts.hline, 3) + "</text>";
  }
  for (const s of opts.series) {
    if (!s.points.length) continue;
    const d = s.points.map((p, i) => (i ? "L" : "M") + X(p[0]).toFixed(1) + " " + Y(p[1]).toFixed(1)).join("");
    svg += '<path d="' + d + '" fill="none" stroke="' + s.color + '" stroke-width="1.8" stroke-linejoin="round"/>';
  }
  for (const s of opts.marks || []) {
    for (const p of s.points) {
      svg += '<circle cx="' + X(p[0]).toFixed(1) + '" cy="' + Y(p[1]).toFixed(1) + '" r="4" fill="#fff" stroke="' + s.color + '" stroke-width="2"><title>' +
        esc(s.name) + " eval at step " + p[0] + ": " + fmtLoss(p[1]) + "</title></circle>";
    }
  }
  svg += "</svg>";
  el.innerHTML = svg;
}

function renderCharts(s) {
  const L = s.losses || { train: {}, eval: {} };
  const floor = L.floor;
  const ids = s.clusters.map((c) => String(c.cluster));
  const color = (i) => COLORS[i % COLORS.length];
  document.getElementById("legend").innerHTML = ids.map((c, i) =>
    '<span><span class="sw" style="background:' + color(i) + '"></span>cluster ' + esc(c) + (isNum(s.clusters[i].loss) ? " · " + fmtLoss(s.clusters[i].loss) : "") + "</span>").join("");
  const series = ids.map((c, i) => ({ name: "cluster " + c, color: color(i), points: (L.train[c] || []) }));
  const marks = ids.map((c, i) => ({ name: "cluster " + c, color: color(i), points: (L.eval[c] || []) }));
  lineChart(document.getElementById("chart-loss"), { label: "train loss per cluster", series, marks, hline: floor, height: 230 });
  if (isNum(floor)) {
    const ex = (pts) => pts.map((p) => [p[0], p[1] - floor]);
    lineChart(document.getElementById("chart-excess"), {
      label: "excess over the entropy floor", log: true, logMin: 1e-3, height: 190,
      series: series.map((x) => ({ ...x, points: ex(x.points) })), marks: marks.map((x) => ({ ...x, points: ex(x.points) })),
    });
  } else {
    document.getElementById("chart-excess").innerHTML = '<p class="empty">No entropy floor reported (data without a known floor).</p>';
  }
}

// ---------------------------------------------------------------------------- timeline
function renderTimeline(s) {
  const tl = s.timeline || [];
  const kinds = {};
  for (const e of tl) kinds[e.kind] = (kinds[e.kind] || 0) + 1;
  document.getElementById("filters").innerHTML = Object.keys(kinds).sort().map((k) =>
    '<button data-kind="' + esc(k) + '" class="' + (ui.hidden.has(k) ? "off" : "") + '">' + esc(k) + " " + kinds[k] + "</button>").join("");
  const items = tl.filter((e) => !ui.hidden.has(e.kind)).slice().reverse();
  const list = document.getElementById("timeline");
  if (!items.length) { list.innerHTML = '<li class="empty">No events yet.</li>'; return; }
  list.innerHTML = items.map((e) =>
    '<li class="sev-' + esc(e.severity || "info") + '" data-kind="' + esc(e.kind) + '" data-who="' + esc(e.who) + '">' +
    '<span class="t">' + clock(e.t) + '</span><span class="kind">' + esc(e.kind) + "</span>" +
    '<span class="text">' + esc(e.text) + '</span><span class="ago">' + fmtAge(s.now - e.t) + " ago</span></li>").join("");
}

// ---------------------------------------------------------------------------- actions
async function kill(btn) {
  const name = btn.dataset.name;
  if (!window.confirm("Kill " + name + " (torchft replica " + btn.dataset.rid + ")?\n\nIts lighthouse asks the Manager to exit the process (code 1); a launcher with restarts brings it back and it heals from a peer.")) return;
  btn.disabled = true;
  try {
    const resp = await fetch("api/replicas/" + btn.dataset.cluster + "/" + btn.dataset.replica + "/kill", {
      method: "POST", headers: { "Content-Type": "application/json" }, body: "{}",
    });
    const body = await resp.json().catch(() => ({}));
    if (resp.ok && body.ok) toast("Kill sent to " + name + " via " + body.lighthouse);
    else toast("Kill of " + name + " failed: " + (body.error || body.detail || "HTTP " + resp.status), true);
  } catch (e) {
    toast("Kill of " + name + " failed: " + e, true);
  }
}

document.addEventListener("click", (ev) => {
  const t = ev.target;
  if (!(t instanceof HTMLElement)) return;
  if (t.matches("button.kill:not([disabled])")) { kill(t); return; }
  if (t.matches("button.toggle")) {
    const n = t.dataset.toggle;
    if (ui.openLinks.has(n)) ui.openLinks.delete(n); else ui.openLinks.add(n);
    if (ui.state) renderTree(ui.state);
    return;
  }
  if (t.matches("#filters button")) {
    const k = t.dataset.kind;
    if (ui.hidden.has(k)) ui.hidden.delete(k); else ui.hidden.add(k);
    localStorage.setItem("hl.hidden", JSON.stringify([...ui.hidden]));
    if (ui.state) renderTimeline(ui.state);
  }
});
window.addEventListener("resize", () => { if (ui.state) renderCharts(ui.state); });

poll();
