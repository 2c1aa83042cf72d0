/* ncm dashboard: plain ES2020, no framework, no external URL. */
"use strict";
(() => {
const SVGNS = "http://www.w3.org/2000/svg";
const TOKEN_KEY = "ncm.token";
const $ = (id) => document.getElementById(id);
const S = {
  token: "", status: null, models: [], tps: [], conv: [], busy: new Set(),
  live: { events: false, models: false }, liveErr: {}, events: [], seen: new Set(),
  nodeCache: new Map(), modelCache: new Map(), mapKey: "", optKey: "", picked: false,
  chatBusy: false, chatAbort: null, chatStopped: null,
};

// -- small helpers
const num = (v) => typeof v === "number" && Number.isFinite(v);
const str = (v) => (v == null ? "" : typeof v === "string" ? v : typeof v === "object" ? JSON.stringify(v) : String(v));
const cls = (v) => str(v).toLowerCase().replace(/[^a-z0-9_-]/g, "");
const uniq = (a) => [...new Set(a.filter((x) => x != null && x !== "").map(str))];
const pad = (n) => String(n).padStart(2, "0");
const cap = (s) => s.charAt(0).toUpperCase() + s.slice(1);
function json(s) { try { return JSON.parse(s); } catch { return null; } }
function hms(t) { const d = new Date(t * 1000); return `${pad(d.getHours())}:${pad(d.getMinutes())}:${pad(d.getSeconds())}`; }
function fmtBytes(b) {
  if (!num(b)) return "—";
  const g = b / 2 ** 30;
  return g >= 1 ? g.toFixed(g >= 10 ? 1 : 2) + " GiB" : (b / 2 ** 20).toFixed(1) + " MiB";
}
function sumVals(o) {
  if (!o || typeof o !== "object") return 0;
  let t = 0;
  for (const v of Object.values(o)) if (num(v)) t += v;
  return t;
}
function span(r) {
  if (num(r)) return [r, r];
  if (Array.isArray(r) && num(r[0])) return [r[0], num(r[1]) ? r[1] : r[0]];
  return [0, -1];
}
const spanText = ([a, b]) => (a === b ? `${a}` : `${a}-${b}`);

function mk(e, props, kids) {
  if (props) for (const [k, v] of Object.entries(props)) {
    if (v == null || v === false) continue;
    if (k === "text") e.textContent = v;
    else if (k.startsWith("on")) e.addEventListener(k.slice(2), v);
    else e.setAttribute(k, v === true ? "" : String(v));
  }
  if (kids != null) for (const k of [].concat(kids)) if (k != null && k !== false) e.append(k);
  return e;
}
const h = (tag, props, kids) => mk(document.createElement(tag), props, kids);
const s = (tag, props, kids) => mk(document.createElementNS(SVGNS, tag), props, kids);
const badge = (text, c) => h("span", { class: "badge " + (c || ""), text });
function kv(list, key, val) {
  list.append(h("dt", { text: key }), h("dd", null, val));
}
function cached(cache, next, key, obj, build) {
  const sig = JSON.stringify(obj);
  const c = cache.get(key);
  const el = c && c.sig === sig ? c.el : build();
  next.set(key, { sig, el });
  return el;
}

// -- token, fetch
function loadToken() { try { return localStorage.getItem(TOKEN_KEY) || ""; } catch { return ""; } }
function saveToken(t) {
  try { if (t) localStorage.setItem(TOKEN_KEY, t); else localStorage.removeItem(TOKEN_KEY); } catch { /* storage off */ }
}
function headers(extra) {
  const hd = Object.assign({ Accept: "application/json" }, extra || {});
  if (S.token) hd.Authorization = "Bearer " + S.token;
  return hd;
}
function errMsg(data, status) {
  const e = data && data.error;
  const m = (e && typeof e === "object" ? e.message : typeof e === "string" ? e : "") || (data && typeof data.message === "string" ? data.message : "");
  return m || `HTTP ${status}`;
}
async function errorText(res) {
  let text = "";
  try { text = await res.text(); } catch { /* body gone */ }
  const data = json(text);
  return data ? errMsg(data, res.status) : (text.trim().slice(0, 200) || `HTTP ${res.status}`);
}
async function request(path, opts = {}) {
  try {
    const res = await fetch(path, { cache: "no-store", ...opts, headers: headers(opts.headers) });
    const data = json(await res.text());
    if (res.ok) return { ok: true, status: res.status, data };
    return { ok: false, status: res.status, data, error: errMsg(data, res.status) };
  } catch (e) {
    return { ok: false, status: 0, data: null, error: "cannot reach the agent (" + str(e && e.message ? e.message : e) + ")" };
  }
}
const authHint = (status) => (status === 401 || status === 403 ? " — set the admin token in the Token field at the top" : "");

// -- toast, live indicator
let toastTimer = 0;
function toast(msg, kind = "error") {
  const t = $("toast");
  t.textContent = msg;
  t.dataset.kind = kind;
  t.hidden = false;
  clearTimeout(toastTimer);
  toastTimer = setTimeout(() => { t.hidden = true; }, kind === "error" ? 8000 : 3000);
}
function setLive(name, on, err) {
  S.live[name] = on;
  S.liveErr[name] = err || "";
  const all = Object.values(S.live).every(Boolean);
  const e = $("live");
  e.dataset.state = all ? "live" : "reconnecting";
  e.textContent = all ? "live" : "reconnecting";
  e.title = Object.keys(S.live).map((k) => `${k}: ${S.live[k] ? "live" : "reconnecting"}${S.liveErr[k] ? " (" + S.liveErr[k] + ")" : ""}`).join("; ");
}

// -- Server-Sent Events over fetch
async function readSSE(res, onEvent) {
  const reader = res.body.getReader();
  const dec = new TextDecoder();
  let buf = "", ev = "", data = [];
  const fire = () => {
    const r = data.length ? onEvent(ev || "message", data.join("\n")) : undefined;
    ev = ""; data = [];
    return r;
  };
  const line = (l) => {
    if (l.endsWith("\r")) l = l.slice(0, -1);
    if (l === "") return fire();
    if (l[0] === ":") return undefined;
    const c = l.indexOf(":");
    const f = c < 0 ? l : l.slice(0, c);
    let v = c < 0 ? "" : l.slice(c + 1);
    if (v[0] === " ") v = v.slice(1);
    if (f === "event") ev = v;
    else if (f === "data") data.push(v);
    return undefined;
  };
  for (;;) {
    const { value, done } = await reader.read();
    if (done) {
      buf += dec.decode();
      if (buf) line(buf);
      fire();
      return;
    }
    buf += dec.decode(value, { stream: true });
    let i;
    while ((i = buf.indexOf("\n")) >= 0) {
      const l = buf.slice(0, i);
      buf = buf.slice(i + 1);
      if (line(l) === false) { reader.cancel().catch(() => {}); return; }
    }
  }
}
function stream(name, path, onEvent, onOpen) {
  const run = async () => {
    let err = "";
    try {
      const res = await fetch(path, { cache: "no-store", headers: headers({ Accept: "text/event-stream" }) });
      if (res.ok && res.body) {
        setLive(name, true);
        if (onOpen) onOpen();
        await readSSE(res, (ev, d) => {
          try { onEvent(ev, d); } catch (e) { toast("dashboard error: " + str(e && e.message)); }
        });
        err = "stream ended";
      } else {
        err = (await errorText(res)) + authHint(res.status);
      }
    } catch (e) {
      err = str(e && e.message ? e.message : e);
    }
    setLive(name, false, err);
    setTimeout(run, 2000);
  };
  run();
}
function loop(fn, ms) {
  const tick = async () => {
    try { await fn(); } catch (e) { toast("dashboard error: " + str(e && e.message)); }
    setTimeout(tick, ms);
  };
  tick();
}
function coalesce(fn) {
  let running = false, again = false;
  const go = async () => {
    if (running) { again = true; return; }
    running = true;
    try { await fn(); } catch (e) { toast("dashboard error: " + str(e && e.message)); }
    running = false;
    if (again) { again = false; go(); }
  };
  return go;
}

// -- devices
function showMsg(id, msg) {
  const e = $(id);
  e.textContent = msg || "";
  e.hidden = !msg;
}
const refreshNodes = coalesce(async () => {
  const r = await request("/cluster/nodes");
  if (!r.ok || !r.data) {
    showMsg("nodes-msg", "Devices unavailable: " + (r.error || "empty answer") + authHint(r.status));
    $("node-list").classList.add("stale");
    return;
  }
  $("node-list").classList.remove("stale");
  renderNodes(r.data);
});
function renderNodes(d) {
  $("cluster-name").textContent = str(d.cluster) || "cluster";
  $("orchestrator").textContent = str(d.orchestrator) || "—";
  $("epoch").textContent = d.epoch == null ? "—" : str(d.epoch);
  const nodes = Array.isArray(d.nodes) ? d.nodes.filter((n) => n && typeof n === "object") : [];
  const next = new Map();
  const cards = nodes.map((n, i) => cached(S.nodeCache, next, str(n.id) || "#" + i, n, () => nodeCard(n)));
  S.nodeCache = next;
  $("node-list").replaceChildren(...cards);
  if (!cards.length) $("node-list").append(h("p", { class: "muted", text: "No devices known yet." }));
  const rej = Array.isArray(d.rejected) ? d.rejected : [];
  showMsg("nodes-msg", rej.length ? "Rejected: " + rej.map(str).join(", ") : "");
}
function nodeCard(n) {
  const id = str(n.id) || "(unknown)";
  const alive = n.alive === true;
  const w = n.worker && typeof n.worker === "object" ? n.worker : {};
  const frags = Array.isArray(w.fragments) ? w.fragments.filter(Boolean) : [];
  const acc = n.accelerators && typeof n.accelerators === "object" ? n.accelerators : {};
  let backend = uniq(frags.map((f) => f.backend));
  const device = uniq(frags.map((f) => f.provider || f.kind));
  if (!backend.length && Array.isArray(acc.usable)) backend = uniq(acc.usable);
  let used = 0;
  if (w.models && typeof w.models === "object") for (const m of Object.values(w.models)) if (m && num(m.memory_bytes)) used += m.memory_bytes;
  const c = n.capacity && typeof n.capacity === "object" ? n.capacity : null;
  const total = c ? ((num(c.ram_gib) ? c.ram_gib : 0) + (num(c.vram_gib) ? c.vram_gib : 0)) * 2 ** 30 : 0;
  const meas = Array.isArray(acc.measured) && acc.measured[0] && typeof acc.measured[0] === "object" ? acc.measured[0] : null;
  const role = str(n.role) || "unknown";

  const head = h("div", { class: "node-head" }, [
    h("strong", { class: "node-id", text: id }),
    n.self ? badge("this device", "self") : null,
    badge(role, "role role-" + cls(role)),
    badge(alive ? "alive" : "dead", alive ? "alive" : "dead"),
  ]);
  const dl = h("dl", { class: "kv" });
  kv(dl, "Backend", backend.join(", ") || "—");
  kv(dl, "Device", device.join(", ") || "—");
  const pct = total > 0 ? Math.min(100, (used / total) * 100) : 0;
  const bar = h("div", { class: "bar", title: total ? pct.toFixed(1) + " %" : "total unknown" }, [h("span", { class: "fill" })]);
  bar.firstChild.style.width = (used > 0 ? Math.max(pct, 1) : 0) + "%";
  kv(dl, "Memory", [h("span", { text: `${fmtBytes(used)} of ${total ? fmtBytes(total) : "?"}` }), bar]);
  kv(dl, "Speed", meas && num(meas.decode_ms)
    ? `${meas.decode_ms.toFixed(2)} ms/step${num(meas.tops) ? " · " + meas.tops.toPrecision(3) + " TOPS" : ""}`
    : "—");
  kv(dl, "Latency", num(n.latency_ms) ? n.latency_ms.toFixed(1) + " ms" : "—");
  const ws = [w.state, w.model, num(w.sessions) ? w.sessions + " sessions" : null].filter((x) => x != null && x !== "").map(str);
  kv(dl, "Worker", ws.join(" · ") || "—");
  const fault = w.fault != null
    ? h("p", { class: "fault", text: `fault (${str(w.state) || "?"}): ${typeof w.fault === "object" ? str(w.fault.message || w.fault.cause || w.fault) : str(w.fault)}` })
    : null;
  return h("article", {
    class: "node" + (alive ? "" : " dead") + (n.self ? " self" : ""),
    "data-node": id, "data-alive": alive ? "true" : "false", "data-role": role, "data-self": n.self ? "true" : null,
  }, [head, dl, fault]);
}

// -- cluster status, layer map, throughput
const refreshStatus = coalesce(async () => {
  const r = await request("/cluster/status");
  let st;
  if (r.data && typeof r.data === "object" && typeof r.data.state === "string") st = r.data;
  else st = { state: r.status === 503 ? "starting" : "unknown", message: (r.error || "no status") + authHint(r.status) };
  S.status = st;
  renderStatus(st, r.ok);
});
function renderStatus(st, ok) {
  const state = cls(st.state) || "unknown";
  const b = $("status-banner");
  b.dataset.state = state;
  $("status-state").textContent = state;
  $("status-message").textContent = str(st.message) + (st.degraded && st.model && st.main_model && st.model !== st.main_model ? ` (serving ${st.model} instead of ${st.main_model})` : "");
  if (st.orchestrator && $("orchestrator").textContent === "—") $("orchestrator").textContent = str(st.orchestrator);

  const faults = st.faults && typeof st.faults === "object" ? Object.entries(st.faults) : [];
  const fl = $("faults");
  fl.replaceChildren(...faults.map(([node, f]) => h("li", { "data-fault-node": node }, [
    h("strong", { text: node }), ": ",
    f && typeof f === "object" ? `${str(f.cause) || "fault"}${f.message ? " — " + str(f.message) : ""}` : str(f),
  ])));
  fl.hidden = !faults.length;

  if (ok) {
    const tp = st.throughput && typeof st.throughput === "object" ? st.throughput : {};
    const v = num(tp.tokens_per_s) ? tp.tokens_per_s : 0;
    S.tps.push(v);
    if (S.tps.length > 60) S.tps.shift();
    $("tps").textContent = v.toFixed(1);
    $("tps-window").textContent = num(tp.window_s) ? `(${tp.window_s} s window)` : "";
    renderSpark();
  }

  const key = JSON.stringify([st.models, st.nodes_alive]);
  if (key !== S.mapKey) {
    S.mapKey = key;
    renderMaps(st);
  }
  renderChatOptions();
}
function renderSpark() {
  const v = S.tps, n = v.length;
  const max = Math.max(1, ...v);
  $("spark-line").setAttribute("points", v.map((x, i) => `${(((60 - n + i) * 120) / 59).toFixed(1)},${(29 - (x / max) * 27).toFixed(1)}`).join(" "));
  $("tps-max").textContent = Math.max(0, ...v).toFixed(1);
}
function renderMaps(st) {
  const list = $("layer-map-list");
  const models = st.models && typeof st.models === "object" ? Object.entries(st.models) : [];
  const alive = Array.isArray(st.nodes_alive) ? new Set(st.nodes_alive.map(str)) : null;
  if (!models.length) {
    list.replaceChildren(h("p", { class: "muted", text: st.state === "ok" || st.state === "degraded" ? "No model placed." : "No placement yet." }));
    return;
  }
  list.replaceChildren(...models.map(([name, m], i) => layerMap(name, m && typeof m === "object" ? m : {}, alive, i)));
}
function layerMap(name, m, alive, idx) {
  const layers = Array.isArray(m.layers) ? m.layers.filter((l) => l && num(l.layer)) : [];
  let L = num(m.total_layers) ? m.total_layers : 0;
  for (const l of layers) L = Math.max(L, l.layer + 1);
  L = Math.min(L, 4096);
  const rows = [];
  const addRow = (n) => { n = str(n); if (n && !rows.includes(n)) rows.push(n); };
  const onRoute = new Set(), held = new Set();
  const route = Array.isArray(m.route) ? m.route.filter((r) => r && r.node != null) : [];
  const mark = (set, node, r) => {
    const [a, b] = span(r);
    for (let l = Math.max(0, a); l <= Math.min(b, L - 1); l++) set.add(str(node) + "|" + l);
  };
  for (const r of route) { addRow(r.node); mark(onRoute, r.node, r.layers); mark(held, r.node, r.layers); }
  for (const l of layers) for (const n of Array.isArray(l.holders) ? l.holders : []) { addRow(n); held.add(str(n) + "|" + l.layer); }
  const replicas = Array.isArray(m.replicas) ? m.replicas.filter((r) => Array.isArray(r) && r[0] != null) : [];
  for (const [n, r] of replicas) { addRow(n); mark(held, n, r); }

  const W = 420, LW = 78, top = 16, RH = 20, gw = W - LW - 4, cw = L ? gw / L : gw;
  const H = top + Math.max(rows.length, 1) * RH + 2;
  const pid = "hatch-" + idx;
  const svg = s("svg", { class: "layer-map", "data-model": name, viewBox: `0 0 ${W} ${H}`, role: "img", "aria-label": "layer map of " + name }, [
    s("defs", null, s("pattern", { id: pid, patternUnits: "userSpaceOnUse", width: 5, height: 5, patternTransform: "rotate(45)" }, [
      s("rect", { class: "hatch-bg", width: 5, height: 5 }),
      s("line", { class: "hatch-line", x1: 1, y1: 0, x2: 1, y2: 5 }),
    ])),
  ]);
  const step = Math.max(1, Math.ceil(L / 8));
  for (let l = 0; l < L; l++) {
    if (l % step === 0 || (l === L - 1 && (L - 1) % step >= step / 2)) {
      svg.append(s("text", { class: "axis", x: (LW + (l + 0.5) * cw).toFixed(1), y: 11, "text-anchor": "middle", text: String(l) }));
    }
  }
  const gap = cw > 6 ? 1 : 0;
  rows.forEach((n, i) => {
    const y = top + i * RH;
    const dead = alive ? !alive.has(n) : false;
    const g = s("g", { class: "lrow" + (dead ? " dead" : ""), "data-row-node": n });
    g.append(s("text", { class: "label", x: LW - 6, y: y + RH / 2 + 4, "text-anchor": "end", text: n.length > 10 ? n.slice(0, 8) + "…" : n }, s("title", { text: n + (dead ? " (dead)" : "") })));
    g.append(s("rect", { class: "row-bg", x: LW, y: y + 2, width: (L * cw).toFixed(2), height: RH - 4 }));
    for (let l = 0; l < L; l++) {
      const k = n + "|" + l;
      if (!held.has(k)) continue;
      const r = onRoute.has(k);
      g.append(s("rect", {
        class: "cell " + (r ? "route" : "replica"), "data-layer": l, fill: r ? null : `url(#${pid})`,
        x: (LW + l * cw + gap).toFixed(2), y: y + 2, width: Math.max(0.5, cw - 2 * gap).toFixed(2), height: RH - 4,
      }, s("title", { text: `${n} · layer ${l}${r ? " · route in use" : " · replica / standby"}` })));
    }
    svg.append(g);
  });
  if (!rows.length) svg.append(s("text", { class: "axis", x: LW, y: top + 14, text: "no layers placed" }));

  const routeText = route.length ? route.map((r) => `${str(r.node)} [${spanText(span(r.layers))}]`).join(" → ") : "no route in use";
  const sw = (c, t) => h("span", { class: "key" }, [h("span", { class: "sw " + c }), t]);
  return h("figure", { class: "lm" }, [
    h("figcaption", null, [
      h("strong", { text: name }),
      m.degraded ? badge("degraded: serving " + (str(m.serving) || "?"), "warn") : null,
      h("span", { class: "muted", text: ` plan v${m.plan_version == null ? "?" : str(m.plan_version)} · ${L} layers` }),
    ]),
    svg,
    h("p", { class: "route", text: routeText }),
    replicas.length ? h("p", { class: "muted small", text: "Replicas: " + replicas.map(([n, r]) => `${str(n)} [${spanText(span(r))}]`).join(", ") }) : null,
    h("div", { class: "legend" }, [sw("route", "route in use"), sw("replica", "head replica / standby"), sw("dead", "dead node")]),
  ]);
}

// -- models
const refreshModels = coalesce(async () => {
  const r = await request("/models");
  if (!r.ok || !r.data) {
    showMsg("models-msg", "Models unavailable: " + (r.error || "empty answer") + authHint(r.status));
    return;
  }
  showMsg("models-msg", "");
  S.models = (Array.isArray(r.data.data) ? r.data.data : []).filter((m) => m && m.id != null).map((m) => ({ ...m, id: str(m.id) }));
  renderModels();
});
function renderModels() {
  const next = new Map();
  const cards = S.models.map((m) => {
    const busy = ["load", "sleep", "unload"].filter((a) => S.busy.has(m.id + ":" + a));
    return cached(S.modelCache, next, m.id, [m, busy], () => modelCard(m));
  });
  S.modelCache = next;
  $("model-list").replaceChildren(...cards);
  if (!cards.length) $("model-list").append(h("p", { class: "muted", text: "No models." }));
  renderChatOptions();
}
function modelCard(m) {
  const id = m.id, st = str(m.state) || "unknown";
  const mem = sumVals(m.memory && m.memory.effective_bytes) || sumVals(m.memory && m.memory.min_bytes);
  const aliases = Array.isArray(m.aliases) ? m.aliases.map(str) : [];
  let prog = null;
  if (st === "loading" || st === "measuring") {
    const p = num(m.progress) ? Math.max(0, Math.min(1, m.progress)) : 0;
    const bar = h("div", { class: "bar progress", role: "progressbar", "aria-valuemin": 0, "aria-valuemax": 100, "aria-valuenow": Math.round(p * 100) }, h("span", { class: "fill" }));
    bar.firstChild.style.width = (p * 100).toFixed(1) + "%";
    prog = h("div", { class: "prog" }, [bar, h("span", { class: "small", text: Math.round(p * 100) + " %" })]);
  }
  const dl = h("dl", { class: "kv" });
  kv(dl, "Memory", mem ? (mem / 2 ** 20).toFixed(1) + " MiB" : "—");
  kv(dl, "In flight", str(m.requests_in_flight ?? m.active_requests ?? 0));
  kv(dl, "Queued", str(m.queued_requests ?? 0));
  kv(dl, "Waiters", str(m.waiters ?? 0));
  const actions = h("div", { class: "actions" }, ["load", "sleep", "unload"].map((a) => h("button", {
    type: "button", class: "btn-" + a, "data-action": a, disabled: S.busy.has(id + ":" + a),
    text: cap(a), onclick: () => modelAction(id, a),
  })));
  return h("article", { class: "model", "data-model": id, "data-state": st }, [
    h("div", { class: "model-head" }, [
      h("strong", { class: "model-name", text: id }),
      badge(st, "st st-" + cls(st)),
      aliases.length ? h("span", { class: "muted small", text: "aka " + aliases.join(", ") }) : null,
    ]),
    prog,
    st === "failed" && m.reason ? h("p", { class: "fault", text: str(m.reason) }) : null,
    m.degraded ? h("p", { class: "warn-text small", text: "degraded: serving " + str(m.serving) }) : null,
    dl,
    actions,
  ]);
}
async function modelAction(id, action) {
  const key = id + ":" + action;
  if (S.busy.has(key)) return;
  S.busy.add(key);
  renderModels();
  const r = await request("/models/" + action, {
    method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify({ model: id }),
  });
  S.busy.delete(key);
  renderModels();
  if (r.ok) toast(`${action} ${id}: ok`, "ok");
  else toast(`${action} ${id} failed: ${r.error}${authHint(r.status)}`);
  refreshModels();
}
function onModelsEvent(ev, raw) {
  const d = json(raw);
  if (!d || typeof d !== "object") return;
  const name = str(d.model ?? d.id) || "?";
  if (ev === "status_change") {
    const i = S.models.findIndex((m) => m.id === name);
    const prev = i >= 0 ? S.models[i] : null;
    const entry = { ...(prev || {}), ...d, id: name };
    if (i >= 0) S.models[i] = entry; else S.models.push(entry);
    renderModels();
    if (!prev || prev.state !== d.state || d.detail) {
      addEvent({ time: Date.now() / 1000, kind: "model", message: `${name}: ${str(d.state)}${d.detail ? " — " + str(d.detail) : ""}`, model: name });
    }
  } else if (ev === "load_refused") {
    const msg = `load of ${name} refused (${str(d.state) || "?"})${d.detail ? ": " + str(d.detail) : ""}${num(d.retry_after_s) ? `; retry after ${d.retry_after_s} s` : ""}`;
    toast(msg);
    addEvent({ time: Date.now() / 1000, kind: "refused", message: msg, model: name });
  } else {
    return;
  }
  refreshModels();
}

// -- events
const ICONS = {
  join: "+", death: "✕", election: "★", failover: "⇄", replan: "↻", load: "▲", unload: "▼",
  sleep: "☾", degraded: "!", recovered: "✓", model: "●", refused: "⊘",
};
let evTimer = 0;
function addEvent(e) {
  const key = `${e.time}|${e.kind}|${e.message}|${str(e.node)}|${str(e.model)}`;
  if (S.seen.has(key)) return;
  S.seen.add(key);
  let i = 0;
  while (i < S.events.length && S.events[i].time >= e.time) i++;
  S.events.splice(i, 0, e);
  if (S.events.length > 200) S.events.length = 200;
  if (S.seen.size > 2000) S.seen = new Set(S.events.map((x) => `${x.time}|${x.kind}|${x.message}|${str(x.node)}|${str(x.model)}`));
  if (!evTimer) evTimer = setTimeout(renderEvents, 50);
}
function renderEvents() {
  evTimer = 0;
  $("event-log").replaceChildren(...S.events.map((e) => {
    const k = cls(e.kind) || "event";
    return h("li", { class: "event kind-" + k, "data-kind": k }, [
      h("span", { class: "ev-icon", "aria-hidden": "true", text: ICONS[k] || "•" }),
      h("time", { class: "ev-time", datetime: Math.abs(e.time) < 8e12 ? new Date(e.time * 1000).toISOString() : null, text: hms(e.time) }),
      h("span", { class: "ev-msg", text: e.message || k }),
      e.node || e.model ? h("span", { class: "ev-tags muted", text: [e.node, e.model].filter(Boolean).map(str).join(" · ") }) : null,
    ]);
  }));
}
function onClusterEvent(ev, raw) {
  if (ev !== "cluster") return;
  const d = json(raw);
  if (!d || typeof d !== "object") return;
  const kind = str(d.kind) || "event";
  addEvent({ time: num(d.time_s) ? d.time_s : Date.now() / 1000, kind, message: str(d.message), node: d.node, model: d.model });
  if (kind === "death" || kind === "join") refreshNodes();
}

// -- chat
function renderChatOptions() {
  const sel = $("chat-model");
  const ms = S.models.slice().sort((a, b) => (b.state === "ready") - (a.state === "ready"));
  const main = S.status && S.status.main_model ? str(S.status.main_model) : "";
  const opts = ms.map((m) => [m.id, m.state === "ready" ? m.id : `${m.id} (${str(m.state)})`]);
  if (!opts.length && main) opts.push([main, main]);
  const key = JSON.stringify(opts);
  if (key !== S.optKey) {
    S.optKey = key;
    const cur = sel.value;
    sel.replaceChildren(...opts.map(([v, t]) => h("option", { value: v, text: t })));
    if (cur && opts.some(([v]) => v === cur)) sel.value = cur;
  }
  if (!S.picked && main && opts.some(([v]) => v === main) && sel.value !== main) sel.value = main;
}
function addMsg(role, text) {
  const m = h("div", { class: "msg " + role, text });
  $("chat-log").append(m);
  scrollChat();
  return m;
}
function scrollChat() { const l = $("chat-log"); l.scrollTop = l.scrollHeight; }
function setChatBusy(b) { S.chatBusy = b; $("chat-send").disabled = b; $("chat-stop").hidden = !b; }
// The temperature field: empty means the API's default (1); 0 answers greedily.
function chatTemperature() {
  const raw = $("chat-temperature").value.trim();
  const t = Number(raw);
  return raw !== "" && Number.isFinite(t) && t >= 0 && t <= 2 ? { temperature: t } : {};
}
async function sendChat() {
  if (S.chatBusy) return;
  const input = $("chat-input");
  const text = input.value.trim();
  if (!text) return;
  const model = $("chat-model").value || (S.status && str(S.status.main_model)) || "";
  if (!model) { toast("No model to chat with yet."); return; }
  input.value = "";
  const conv = S.conv;
  conv.push({ role: "user", content: text });
  addMsg("user", text);
  const el = addMsg("assistant", "");
  el.classList.add("streaming");
  const tn = document.createTextNode("");
  el.append(tn);
  const meta = h("div", { class: "msg-meta" });
  el.after(meta);
  const ctrl = new AbortController();
  S.chatAbort = ctrl;
  setChatBusy(true);
  const t0 = performance.now();
  let n = 0, usage = null, err = null, thought = null;  // thought: a reasoning model's reasoning, shown apart
  try {
    const res = await fetch("/v1/chat/completions", {
      method: "POST", signal: ctrl.signal, cache: "no-store",
      headers: headers({ "Content-Type": "application/json", Accept: "text/event-stream" }),
      body: JSON.stringify({ model, messages: conv, stream: true, max_tokens: 128, ...chatTemperature() }),
    });
    if (!res.ok || !res.body) {
      err = (await errorText(res)) + authHint(res.status);
    } else {
      await readSSE(res, (ev, data) => {
        if (data.trim() === "[DONE]") return false;
        const j = json(data);
        if (!j || typeof j !== "object") return undefined;
        if (j.error) { err = (typeof j.error === "object" ? str(j.error.message) : str(j.error)) || "stream error"; return false; }
        const c = Array.isArray(j.choices) && j.choices[0];
        const reasoning = c && c.delta && c.delta.reasoning_content;
        if (typeof reasoning === "string" && reasoning) {
          if (!thought) { thought = document.createTextNode(""); el.prepend(h("details", { class: "msg-thinking", open: true }, [h("summary", { text: "Thinking" }), thought])); }
          n++; thought.data += reasoning; scrollChat();
        }
        const piece = c && c.delta && c.delta.content;
        if (typeof piece === "string" && piece) { n++; tn.data += piece; scrollChat(); }
        if (j.usage && num(j.usage.completion_tokens)) usage = j.usage.completion_tokens;
        return undefined;
      });
    }
  } catch (e) {
    if (!ctrl.signal.aborted) err = "network error: " + str(e && e.message ? e.message : e);
  }
  el.classList.remove("streaming");
  const stopped = S.chatStopped === ctrl;  // Stop: the answer so far stays, the agent stops generating
  if (stopped) S.chatStopped = null;
  if ((ctrl.signal.aborted && !stopped) || S.chatAbort !== ctrl) return;
  S.chatAbort = null;
  setChatBusy(false);
  const secs = Math.max(0.001, (performance.now() - t0) / 1000);
  if (tn.data) conv.push({ role: "assistant", content: tn.data });
  else if (err) conv.pop();
  if (err) {
    el.classList.add("error");
    if (!tn.data) tn.data = "⚠ " + err;
    else meta.textContent = "⚠ " + err + " · ";
    toast(err);
  }
  if (tn.data && (!err || n)) {
    const toks = usage ?? n;
    const line = `${stopped ? "stopped · " : ""}${toks} tokens in ${secs.toFixed(1)} s · ${(toks / secs).toFixed(1)} tokens/s`;
    meta.append(line);
    $("chat-stats").textContent = line;
  }
  input.focus();
}
function stopChat() {
  if (!S.chatAbort) return;
  S.chatStopped = S.chatAbort;
  S.chatAbort.abort();  // closing the stream stops the generation on the cluster
}
function clearChat() {
  if (S.chatAbort) S.chatAbort.abort();
  S.chatAbort = null;
  S.conv = [];
  $("chat-log").replaceChildren();
  $("chat-stats").textContent = "";
  setChatBusy(false);
}

// -- start
function start() {
  S.token = loadToken();
  const tok = $("token");
  tok.value = S.token;
  tok.addEventListener("input", () => { S.token = tok.value.trim(); saveToken(S.token); });
  $("token-form").addEventListener("submit", (e) => {
    e.preventDefault();
    S.token = tok.value.trim();
    saveToken(S.token);
    toast(S.token ? "Token saved." : "Token cleared.", "ok");
    refreshNodes(); refreshStatus(); refreshModels();
  });
  $("toast").addEventListener("click", () => { $("toast").hidden = true; });
  $("chat-form").addEventListener("submit", (e) => { e.preventDefault(); sendChat(); });
  $("chat-input").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey && !e.isComposing) { e.preventDefault(); sendChat(); }
  });
  $("chat-clear").addEventListener("click", clearChat);
  $("chat-stop").addEventListener("click", stopChat);
  $("chat-model").addEventListener("change", () => { S.picked = true; });

  loop(refreshNodes, 1000);
  loop(refreshStatus, 2000);
  loop(() => (S.live.models ? undefined : refreshModels()), 5000);
  stream("events", "/cluster/events", onClusterEvent);
  stream("models", "/models/sse", onModelsEvent, refreshModels);
}
if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", start);
else start();
})();
