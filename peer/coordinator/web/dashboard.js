// The Swarmtrain dashboard: fetch the whole state once, then apply the updates the coordinator pushes.
// Everything shown comes from peers' DHT records, so it is only ever set as text (never as HTML).
"use strict";

const MAX_POINTS = 5000; // curve points kept in the page
const MAX_EVENTS = 500;
let history = [];
let events = [];
let updates = 0;

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (k === "class") node.className = v;
    else node.setAttribute(k, v);
  }
  for (const child of children) {
    if (child !== null && child !== undefined) node.append(child instanceof Node ? child : String(child));
  }
  return node;
}

function num(x, digits) {
  if (x === null || x === undefined) return "–";
  return Number(x).toFixed(digits);
}

function bytes(n) {
  if (!n) return "0 B";
  const units = ["B", "kB", "MB", "GB", "TB"];
  const i = Math.min(Math.floor(Math.log10(n) / 3), units.length - 1);
  return `${(n / 10 ** (3 * i)).toFixed(i ? 1 : 0)} ${units[i]}`;
}

function clock(t) {
  return new Date(t * 1000).toLocaleTimeString();
}

function total(label, value) {
  return el("div", { class: "total" }, el("b", {}, value), el("span", {}, label));
}

// ---- header ------------------------------------------------------------------------------------
function renderHeader(state) {
  const run = state.run;
  document.getElementById("run-name").textContent = run.name;
  document.title = `Swarmtrain · ${run.name}`;
  const t = state.totals || {};
  const step = t.step || 0;
  document.getElementById("progress-bar").style.width = `${Math.min(100, (100 * step) / run.total_steps)}%`;
  const servers = state.stages.reduce((n, s) => n + s.servers.filter((x) => x.state === "serving").length, 0);
  document.getElementById("totals").replaceChildren(
    total("step", `${step} / ${run.total_steps}`),
    total("samples trained", t.samples ?? 0),
    total("samples/s", num(t.samples_per_second, 1)),
    total("train loss", num(t.train_loss, 3)),
    total("validation loss", num(t.val_loss, 3)),
    total("servers serving", servers),
    total("trainers", state.trainers.length),
    total("slowest stage", `${num(t.bottleneck, 1)} samples/s`),
    total("mode", run.mode === "local" ? "local updates (DiLoCo)" : "gradient averaging"),
  );
  document.getElementById("updated").textContent = `updated ${clock(state.updated)}`;
}

// ---- swarm map ---------------------------------------------------------------------------------
function serverCard(s) {
  const tp = s.tp > 1 ? el("span", { class: "tp", title: "tensor-parallel ranks" }, `TP ${s.tp}`) : null;
  const round = s.last_round > 1 ? `averaged ×${s.last_round} in ${num(s.last_round_seconds, 2)} s` : s.last_round === 1 ? "stepped alone" : "no step yet";
  return el(
    "div",
    { class: `card health-${s.health}`, "data-endpoint": s.endpoint, "data-health": s.health, "data-tp": s.tp },
    el("div", {}, el("span", { class: "endpoint" }, s.endpoint), tp),
    el("div", { class: "line" }, `${s.peer} · ${s.health === "ok" ? s.state : s.health} · ${s.devices}`),
    el("div", { class: "line" }, `${num(s.throughput, 1)} samples/s · load ${num(s.load, 0)} · step ${s.step}`),
    el("div", { class: "line" }, `${s.requests} requests, ${s.errors} errors · ${round}`),
  );
}

function renderStages(state) {
  const rows = state.stages.map((stage) => {
    const label = el(
      "div",
      { class: "stage-label" },
      el("b", {}, `Stage ${stage.stage}`),
      el("div", { class: "muted" }, `blocks ${stage.blocks} · step ${stage.step}`),
      el("div", { class: "muted" }, `${num(stage.throughput, 1)} samples/s`),
    );
    const cards = stage.servers.length ? stage.servers.map(serverCard) : [el("div", { class: "none" }, "no server")];
    return el("div", { class: "stage", "data-stage": stage.stage }, label, el("div", { class: "cards" }, ...cards));
  });
  document.getElementById("stages").replaceChildren(...rows);
  const experts = document.getElementById("experts");
  if (!state.experts.length) {
    experts.replaceChildren();
    return;
  }
  const n = state.run.moe.num_experts;
  const head = el("tr", {}, el("th", {}, "layer"), ...Array.from({ length: n }, (_, i) => el("th", {}, `expert ${i}`)));
  const rows2 = state.experts.map((layer) =>
    el(
      "tr",
      {},
      el("td", {}, `${layer.layer} (${layer.hosted}/${n} hosted)`),
      ...layer.experts.map((e) => {
        const serving = e.hosts.filter((h) => h.state === "serving");
        const cell = el("td", { class: serving.length ? "" : "zero", title: serving.map((h) => h.endpoint).join(", ") });
        cell.textContent = serving.length ? `${serving.length} host${serving.length > 1 ? "s" : ""}` : "none";
        return cell;
      }),
    ),
  );
  experts.replaceChildren(
    el("h2", {}, `Experts (${n} per layer, top-${state.run.moe.top_k}): hosts per expert`),
    el("table", { class: "experts" }, head, ...rows2),
  );
}

// ---- curves ------------------------------------------------------------------------------------
const SVG = "http://www.w3.org/2000/svg";
function svg(tag, attrs) {
  const node = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, v);
  return node;
}

function chart(id, series) {
  // series: [{cls, points: [[x, y], ...]}]; x is unix time
  const root = document.getElementById(id);
  const W = 480, H = 220, L = 44, R = 8, T = 8, B = 22;
  const all = series.flatMap((s) => s.points).filter((p) => p[1] !== null && Number.isFinite(p[1]));
  const nodes = [svg("line", { class: "axis", x1: L, y1: H - B, x2: W - R, y2: H - B }), svg("line", { class: "axis", x1: L, y1: T, x2: L, y2: H - B })];
  if (all.length === 0) {
    const t = svg("text", { x: W / 2, y: H / 2, "text-anchor": "middle" });
    t.textContent = "no data yet";
    root.replaceChildren(...nodes, t);
    return;
  }
  let [x0, x1] = [Math.min(...all.map((p) => p[0])), Math.max(...all.map((p) => p[0]))];
  let [y0, y1] = [Math.min(...all.map((p) => p[1])), Math.max(...all.map((p) => p[1]))];
  if (x1 === x0) x1 = x0 + 1;
  if (y1 === y0) { y1 += Math.abs(y1) * 0.05 + 1e-6; y0 -= Math.abs(y0) * 0.05 + 1e-6; }
  const X = (x) => L + ((x - x0) / (x1 - x0)) * (W - L - R);
  const Y = (y) => H - B - ((y - y0) / (y1 - y0)) * (H - T - B);
  for (const [v, anchor] of [[y0, H - B], [y1, T + 8]]) {
    const t = svg("text", { x: L - 4, y: anchor, "text-anchor": "end" });
    t.textContent = Math.abs(v) >= 100 ? v.toFixed(0) : v.toPrecision(3);
    nodes.push(t);
  }
  for (const [v, anchor, align] of [[x0, L, "start"], [x1, W - R, "end"]]) {
    const t = svg("text", { x: anchor, y: H - 6, "text-anchor": align });
    t.textContent = clock(v);
    nodes.push(t);
  }
  for (const s of series) {
    const pts = s.points.filter((p) => p[1] !== null && Number.isFinite(p[1]));
    if (!pts.length) continue;
    const d = pts.map((p, i) => `${i ? "L" : "M"}${X(p[0]).toFixed(1)},${Y(p[1]).toFixed(1)}`).join(" ");
    nodes.push(svg("path", { class: s.cls, d, "data-points": pts.length }));
  }
  root.replaceChildren(...nodes);
}

function renderCharts() {
  chart("chart-loss", [
    { cls: "train", points: history.map((p) => [p.time, p.train_loss]) },
    { cls: "val", points: history.map((p) => [p.time, p.val_loss]) },
  ]);
  chart("chart-speed", [{ cls: "train", points: history.map((p) => [p.time, p.samples_per_second]) }]);
  chart("chart-step", [{ cls: "train", points: history.map((p) => [p.time, p.step]) }]);
}

// ---- trainers and events -----------------------------------------------------------------------
function renderTrainers(state) {
  const head = el("tr", {}, ...["trainer", "samples", "samples/s", "train loss", "val loss", "val bits/byte", "rerouted", "bans", "sent", "received", "health"].map((h) => el("th", {}, h)));
  const rows = state.trainers.map((t) =>
    el(
      "tr",
      { "data-trainer": t.peer },
      el("td", {}, t.peer),
      el("td", {}, t.samples),
      el("td", {}, num(t.samples_per_second, 1)),
      el("td", {}, num(t.train_loss, 3)),
      el("td", {}, num(t.val_loss, 3)),
      el("td", {}, num(t.val_bits_per_byte, 3)),
      el("td", {}, t.failed_calls),
      el("td", { title: t.banned.join(", ") }, t.bans),
      el("td", {}, bytes(t.bytes_sent)),
      el("td", {}, bytes(t.bytes_received)),
      el("td", {}, t.health),
    ),
  );
  if (!rows.length) rows.push(el("tr", {}, el("td", { colspan: 10, class: "muted" }, "no trainer yet")));
  document.getElementById("trainers").replaceChildren(head, ...rows);
}

function renderEvents() {
  const steps = document.getElementById("show-steps").checked;
  const shown = steps ? events : events.filter((e) => e.kind !== "step");
  const items = shown.slice().reverse().map((e) =>
    el("li", { "data-kind": e.kind }, el("span", { class: "when" }, clock(e.time)), el("span", { class: `kind kind-${e.kind}` }, e.kind), e.text),
  );
  document.getElementById("events").replaceChildren(...items);
}

function renderAbout(state) {
  const c = state.coordinator || {};
  const parts = [`coordinator ${c.peer_id || "?"}`, `join: ${c.join || "?"}`];
  if (c.metrics) parts.push(`metrics: http://${c.metrics}/metrics`);
  if (c.checkpoints) {
    const last = c.last_checkpoint ? `, last at step ${c.last_checkpoint.step} (${clock(c.last_checkpoint.time)})` : ", none yet";
    parts.push(`checkpoints: ${c.checkpoints}${last}`);
  }
  document.getElementById("about").textContent = parts.join(" · ");
}

// ---- state and updates -------------------------------------------------------------------------
function mergeEvents(incoming) {
  const last = events.length ? events[events.length - 1].id : 0;
  for (const e of incoming || []) if (e.id > last) events.push(e);
  if (events.length > MAX_EVENTS) events = events.slice(-MAX_EVENTS);
}

function render(state) {
  if (!state || !state.run) return;
  renderHeader(state);
  renderStages(state);
  renderCharts();
  renderTrainers(state);
  renderEvents();
  renderAbout(state);
  updates += 1;
  document.body.dataset.updates = String(updates);
}

let coordinatorStarted = null; // a restarted coordinator numbers its events anew from what it kept

function apply(update) {
  const started = update.coordinator && update.coordinator.started;
  const last = events.length ? events[events.length - 1].id : 0;
  const incoming = (update.events || []).filter((e) => e.id > last);
  if ((coordinatorStarted !== null && started !== coordinatorStarted) || (incoming.length && incoming[0].id > last + 1)) {
    load().catch(() => {}); // another coordinator, or updates were missed: take the whole state again
    return;
  }
  if (update.totals && (!history.length || update.totals.time > history[history.length - 1].time)) {
    history.push(update.totals);
    if (history.length > MAX_POINTS) history = history.slice(-MAX_POINTS);
  }
  mergeEvents(update.events);
  render(update);
}

async function load() {
  const response = await fetch("/api/state", { cache: "no-store" });
  const state = await response.json();
  if (!state.run) return;
  history = state.history || [];
  events = [];
  mergeEvents(state.events);
  coordinatorStarted = state.coordinator ? state.coordinator.started : null;
  render(state);
}

function connect() {
  const badge = document.getElementById("connection");
  const stream = new EventSource("/api/stream");
  stream.onopen = () => {
    badge.textContent = "live";
    badge.className = "badge on";
    load().catch(() => {}); // whatever happened while we were away
  };
  stream.onmessage = (message) => apply(JSON.parse(message.data));
  stream.onerror = () => {
    badge.textContent = "reconnecting";
    badge.className = "badge off";
    if (stream.readyState === EventSource.CLOSED) setTimeout(connect, 3000); // refused (503): the browser gives up, we do not
  };
}

document.getElementById("show-steps").addEventListener("change", renderEvents);
load().catch(() => {});
connect();
