// The Semantic dashboard: one SSE stream (GET /v1/events, read with fetch so the
// API key goes in a header), a snapshot first and events after; the page only
// formats the server's numbers. No polling: the stream reconnects at most once a second.
(() => {
  "use strict";
  const $ = (s) => document.querySelector(s);
  const KEY = "semantic-api-key";
  const ROUTES = { anthropic: "Anthropic", openai: "OpenAI", responses: "Responses", agent: "agent API",
                   "in-process": "in-process", api: "API" };
  const MAX_TURNS = 100, MAX_SEGMENTS = 40, SPARK_S = 300;
  const state = { agents: new Map(), memory: null, disk: null, batch: null, turns: [], throughput: [],
                  sort: { key: "last_use", asc: false }, filter: "", open: null, convOpen: false, model: "" };
  const stats = { renders: 0, renderMs: 0, agentsRenderMs: 0, events: 0, connected: false };
  window.dashboard = { state, stats };

  // -- helpers --------------------------------------------------------------------
  const esc = (s) => String(s ?? "").replace(/[&<>"']/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;",
                                                                    '"': "&quot;", "'": "&#39;" }[c]));
  const int = (n) => (n == null ? "–" : Number(n).toLocaleString("en-US"));
  function bytes(n) {
    if (n == null) return "–";
    const u = ["B", "KiB", "MiB", "GiB", "TiB"]; let i = 0;
    while (Math.abs(n) >= 1024 && i < u.length - 1) { n /= 1024; i++; }
    return (i ? n.toFixed(n < 10 ? 1 : 0) : n) + " " + u[i];
  }
  const pct = (x) => (x == null ? "–" : Math.round(x * 100) + "%");
  const ms = (s) => (s == null ? "–" : s < 1 ? Math.round(s * 1000) + " ms" : s.toFixed(2) + " s");
  const rate = (x) => (x == null ? "–" : x.toFixed(1));
  function ago(t) {
    if (t == null) return "–";
    const s = Math.max(0, Date.now() / 1000 - t);
    if (s < 60) return Math.round(s) + " s ago";
    if (s < 3600) return Math.round(s / 60) + " min ago";
    if (s < 86400) return Math.round(s / 3600) + " h ago";
    return new Date(t * 1000).toISOString().slice(0, 10);
  }
  const key = () => localStorage.getItem(KEY) || "";
  function headers(extra) {
    const h = Object.assign({}, extra || {});
    if (key()) h["x-api-key"] = key();
    return h;
  }
  async function api(method, path, body) {
    const init = { method, headers: headers(body ? { "content-type": "application/json" } : {}) };
    if (body) init.body = JSON.stringify(body);
    const r = await fetch(path, init);
    const data = await r.json().catch(() => ({}));
    if (r.status === 401) askKey("the server refused the key");
    if (!r.ok) throw new Error((data.error && data.error.message) || r.status + " " + r.statusText);
    return data;
  }
  // Server-sent events from a fetch response: {event, data} objects.
  async function* sse(response) {
    const reader = response.body.getReader(), decoder = new TextDecoder();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) return;
      buffer += decoder.decode(value, { stream: true }).replace(/\r\n?/g, "\n");
      let at;
      while ((at = buffer.indexOf("\n\n")) >= 0) {
        const block = buffer.slice(0, at); buffer = buffer.slice(at + 2);
        let event = "message"; const data = [];
        for (const line of block.split("\n")) {
          if (line.startsWith("event:")) event = line.slice(6).trim();
          else if (line.startsWith("data:")) data.push(line.slice(5).replace(/^ /, ""));
        }
        if (data.length) yield { event, data: data.join("\n") };
      }
    }
  }

  // -- the stream -------------------------------------------------------------------
  let stream = null;
  function setStatus(s, text) { const el = $("#status"); el.dataset.state = s; el.textContent = text || s; }
  function askKey(message) {
    if (stream) stream.abort();
    stream = null;
    state.agents.clear(); state.turns = []; state.memory = state.disk = state.batch = null;
    $("#main").hidden = true; $("#key-form").hidden = false;
    $("#key-error").textContent = message || "";
    setStatus("error", "API key needed");
    $("#key-input").focus();
  }
  async function connect() {
    if (stream) stream.abort();
    const ctl = (stream = new AbortController());
    const started = Date.now();
    try {
      const r = await fetch("/v1/events", { headers: headers({ accept: "text/event-stream" }), signal: ctl.signal });
      if (r.status === 401) { askKey(key() ? "the server refused that key" : ""); return; }
      if (!r.ok) throw new Error(r.status + " " + r.statusText);
      $("#key-form").hidden = true; $("#main").hidden = false;
      setStatus("live"); stats.connected = true;
      for await (const ev of sse(r)) handle(ev.event, JSON.parse(ev.data));
    } catch (e) {
      if (ctl.signal.aborted) return;
      setStatus("error", "disconnected");
    }
    stats.connected = false;
    if (ctl !== stream) return;
    setStatus("connecting", "reconnecting");
    setTimeout(() => { if (ctl === stream) connect(); }, Math.max(1000, 2000 - (Date.now() - started)));
  }

  function handle(type, d) {
    stats.events++;
    switch (type) {
      case "snapshot":
        state.agents = new Map(d.agents.map((a) => [a.id, a]));
        Object.assign(state, { memory: d.memory, disk: d.disk, batch: d.batch, turns: d.turns.slice(-MAX_TURNS),
                               throughput: d.throughput, model: d.model });
        $("#model").textContent = (d.model || "") + (d.context_length ? " · " + int(d.context_length) + "-token context" : "");
        schedule("agents", "memory", "batch", "turns");
        if (state.open) loadDetail();
        break;
      case "agent":
        state.agents.set(d.agent.id, d.agent);
        schedule("agents", "memory");
        if (state.open === d.agent.id) loadDetail();
        break;
      case "tier": {
        const row = state.agents.get(d.agent);
        if (row) { row.tier = d.tier; schedule("agents", "memory"); }
        break;
      }
      case "agent_deleted":
        state.agents.delete(d.agent);
        if (state.open === d.agent) closeDetail();
        schedule("agents", "memory");
        break;
      case "turn_ended":
        state.turns.push(d);
        if (state.turns.length > MAX_TURNS) state.turns.shift();
        schedule("turns");
        break;
      case "memory":
        state.memory = d.memory; state.disk = d.disk;
        schedule("memory");
        break;
      case "batch":
        state.batch = d;
        if (d.tokens_per_s != null) state.throughput.push([d.at, d.tokens_per_s]);
        schedule("batch");
        break;
      case "dropped":
        break; // the stream ends; connect() starts again from a snapshot
    }
  }

  // -- rendering (coalesced) ----------------------------------------------------------
  const pending = new Set();
  let timer = null;
  function schedule(...parts) {
    parts.forEach((p) => pending.add(p));
    if (!timer) timer = setTimeout(flush, 30);
  }
  function flush() {
    timer = null;
    const t0 = performance.now();
    const parts = [...pending]; pending.clear();
    for (const p of parts) RENDER[p]();
    stats.renders++; stats.renderMs = performance.now() - t0;
  }
  const RENDER = { agents: renderAgents, memory: renderMemory, batch: renderBatch, turns: renderTurns };

  const isConv = (id) => id.startsWith("conv-");
  function sorted(rows) {
    const { key: k, asc } = state.sort, sign = asc ? 1 : -1;
    return rows.sort((a, b) => {
      const x = a[k], y = b[k];
      if (x == null && y == null) return a.id < b.id ? -1 : 1;
      if (x == null) return 1;
      if (y == null) return -1;
      if (x < y) return -sign;
      if (x > y) return sign;
      return a.id < b.id ? -1 : 1;
    });
  }
  function agentRow(a) {
    const tier = a.tier || "none";
    return `<tr class="agent" data-id="${esc(a.id)}" data-tier="${tier}" data-tokens="${a.tokens_cached}">` +
      `<td>${esc(a.id)}</td><td>${esc(a.model)}</td><td><span class="tier tier-${tier}">${tier}</span></td>` +
      `<td class="num">${int(a.tokens_cached)}</td><td class="num">${bytes(a.bytes)}</td>` +
      `<td title="${a.last_use ? new Date(a.last_use * 1000).toISOString() : ""}">${ago(a.last_use)}</td>` +
      `<td class="num">${int(a.turns)}</td><td class="num">${pct(a.reuse)}</td><td class="num">${ms(a.ttft_s)}</td></tr>`;
  }
  function renderAgents() {
    const t0 = performance.now();
    const f = state.filter.trim().toLowerCase();
    const rows = sorted([...state.agents.values()].filter((a) => !f || a.id.toLowerCase().includes(f)));
    const named = rows.filter((a) => !isConv(a.id)), conv = rows.filter((a) => isConv(a.id));
    const html = named.map(agentRow);
    if (conv.length) {
      const open = state.convOpen || f.startsWith("conv-");
      const hot = conv.filter((a) => a.tier === "hot").length;
      const tokens = conv.reduce((n, a) => n + (a.tokens_cached || 0), 0);
      html.push(`<tr class="group" data-group="conv"><td colspan="9">${open ? "▾" : "▸"} conv-* · ` +
                `${conv.length} anonymous conversations · ${hot} hot · ${int(tokens)} tokens cached</td></tr>`);
      if (open) html.push(...conv.map(agentRow));
    }
    $("#agents tbody").innerHTML = html.join("");
    $("#agent-count").textContent = `${state.agents.size}` + (f ? ` (${rows.length} shown)` : "");
    document.querySelectorAll("#agents th").forEach((th) => {
      th.classList.toggle("sorted", th.dataset.sort === state.sort.key);
      th.classList.toggle("asc", th.dataset.sort === state.sort.key && state.sort.asc);
    });
    stats.agentsRenderMs = performance.now() - t0;
  }

  function renderMemory() {
    const m = state.memory, d = state.disk;
    if (!m) return;
    const budget = m.budget_bytes || 1, segs = [];
    const hot = [...state.agents.values()].filter((a) => a.tier === "hot" && a.bytes).sort((a, b) => b.bytes - a.bytes);
    let agentBytes = 0;
    hot.forEach((a, i) => {
      agentBytes += a.bytes;
      if (i < MAX_SEGMENTS) segs.push([a.bytes, "seg-hot", `${a.id}: ${bytes(a.bytes)}`]);
    });
    if (hot.length > MAX_SEGMENTS) {
      const rest = hot.slice(MAX_SEGMENTS).reduce((n, a) => n + a.bytes, 0);
      segs.push([rest, "seg-hot", `${hot.length - MAX_SEGMENTS} more agents: ${bytes(rest)}`]);
    }
    if (m.prefix_bytes) segs.push([m.prefix_bytes, "seg-prefix", `shared prefixes: ${bytes(m.prefix_bytes)}`]);
    const other = m.hot_bytes - agentBytes - m.prefix_bytes;
    if (other > 0) segs.push([other, "seg-other", `turns in flight and other: ${bytes(other)}`]);
    const bar = $("#kv-bar");
    bar.innerHTML = segs.map(([n, cls, title]) =>
      `<div class="${cls}" style="width:${(100 * n / budget).toFixed(3)}%" title="${esc(title)}"></div>`).join("");
    bar.dataset.used = m.hot_bytes; bar.dataset.segments = segs.length;
    const free = Math.max(0, m.budget_bytes - m.hot_bytes);
    $("#kv-text").textContent = `${bytes(m.hot_bytes)} of ${bytes(m.budget_bytes)} · ${bytes(free)} free`;
    $("#kv-legend").innerHTML =
      `<span><i class="seg-hot"></i>${hot.length} hot agents ${bytes(agentBytes)}</span>` +
      `<span><i class="seg-prefix"></i>shared prefixes ${bytes(m.prefix_bytes)}</span>` +
      `<span><i class="seg-other"></i>other ${bytes(Math.max(0, other))}</span>` +
      `<span><i style="background:var(--free)"></i>free ${bytes(free)}</span>` +
      `<span>${int(m.demotions)} demotions · ${int(m.preemptions)} preemptions</span>`;
    if (d) {
      const cap = d.budget_bytes != null ? d.budget_bytes : m.disk_bytes + d.free_bytes;
      $("#disk-bar").innerHTML = `<div class="seg-disk" style="width:${(100 * m.disk_bytes / (cap || 1)).toFixed(3)}%"></div>`;
      $("#disk-text").textContent = `${bytes(m.disk_bytes)} of ` +
        (d.budget_bytes != null ? `${bytes(d.budget_bytes)} budget` : `${bytes(cap)} (no budget; filesystem)`) +
        ` · ${bytes(d.free_bytes)} free on disk`;
    }
    $("#mlx-text").textContent = `active ${bytes(m.mlx_active_bytes)} · peak ${bytes(m.mlx_peak_bytes)}`;
  }

  function renderBatch() {
    const b = state.batch;
    if (!b) return;
    const rows = [...b.decoding.map((s) => ["decode", s]), ...b.prefilling.map((s) => ["prefill", s]),
                  ...b.queued.map((s) => ["queued", s])];
    $("#batch tbody").innerHTML = rows.length ? rows.map(([phase, s]) =>
      `<tr data-agent="${esc(s.agent)}"><td>${esc(s.agent)}</td><td>${phase}` +
      `${phase === "prefill" ? " (" + int(s.prompt_tokens) + " prompt)" : ""}</td>` +
      `<td class="num">${int(s.tokens)}</td><td class="num">${rate(s.tokens_per_s)}</td></tr>`).join("")
      : `<tr><td colspan="4" class="muted">idle</td></tr>`;
    $("#queue").textContent = `queue depth ${b.queue_depth} · ${b.decoding.length} decoding · ` +
      `${b.prefilling.length} prefilling · ${int(b.generated_tokens)} tokens generated`;
    $("#tps").textContent = b.tokens_per_s == null ? "" : `· ${rate(b.tokens_per_s)} tok/s`;
    const now = Date.now() / 1000;
    state.throughput = state.throughput.filter(([t]) => t > now - SPARK_S);
    const top = Math.max(1, ...state.throughput.map(([, v]) => v));
    const pts = state.throughput.map(([t, v]) =>
      `${(300 * (t - (now - SPARK_S)) / SPARK_S).toFixed(1)},${(38 - 36 * v / top).toFixed(1)}`);
    $("#spark").innerHTML = `<polyline points="${pts.join(" ")}"></polyline>`;
    $("#spark-caption").textContent = `tokens/s over the last ${SPARK_S / 60} min (peak ${rate(top)})`;
  }

  function renderTurns() {
    $("#turns tbody").innerHTML = state.turns.slice().reverse().slice(0, 50).map((t) =>
      `<tr data-agent="${esc(t.agent)}" data-route="${esc(t.route)}"><td>${esc(t.agent)}</td>` +
      `<td>${esc(ROUTES[t.route] || t.route)}</td><td class="num">${int(t.prefilled_tokens)}</td>` +
      `<td class="num">${int(t.reused_tokens)}</td><td class="num">${int(t.output_tokens)}</td>` +
      `<td class="num">${ms(t.ttft_s)}</td><td class="num">${rate(t.decode_tps)}</td>` +
      `<td class="num">${t.drafted_tokens ? pct(t.accepted_tokens / t.drafted_tokens) : "–"}</td></tr>`).join("");
  }

  // -- one agent: history, actions, chat ------------------------------------------------
  function openAgent(id) {
    state.open = id;
    $("#detail").hidden = false; $("#detail-id").textContent = id;
    $("#action-msg").textContent = ""; $("#chat-reply").textContent = ""; $("#chat-reply").dataset.state = "idle";
    disarm();
    loadDetail();
    $("#detail").scrollIntoView({ block: "nearest" });
  }
  function closeDetail() { state.open = null; $("#detail").hidden = true; }
  let loading = null;
  async function loadDetail() {
    const id = state.open;
    if (!id || loading === id) return;
    loading = id;
    try {
      const a = await api("GET", `/v1/agents/${encodeURIComponent(id)}`);
      if (state.open !== id) return;
      $("#history").innerHTML = a.history.map((m) =>
        `<li><b>${esc(m.role)}</b> ${esc(m.content)}</li>`).join("") || "<li class='muted'>no messages</li>";
    } catch (e) {
      $("#action-msg").textContent = e.message;
    } finally { loading = null; }
  }
  function disarm() { const b = $("#delete"); b.dataset.armed = ""; b.textContent = "Delete"; }
  async function act(fn, done) {
    const id = state.open;
    try { $("#action-msg").textContent = done(await fn(id)); } catch (e) { $("#action-msg").textContent = e.message; }
  }
  $("#fork").onclick = () => {
    const target = $("#fork-id").value.trim();
    if (!target) { $("#action-msg").textContent = "name the new agent first"; return; }
    act((id) => api("POST", `/v1/agents/${encodeURIComponent(id)}/fork`, { id: target }),
        (r) => `forked to ${r.id}`);
  };
  $("#demote").onclick = () => act((id) => api("POST", `/v1/agents/${encodeURIComponent(id)}/demote`),
                                   () => "demotion requested");
  $("#delete").onclick = () => {
    const b = $("#delete");
    if (!b.dataset.armed) { b.dataset.armed = "1"; b.textContent = "Really delete?"; return; }
    disarm();
    act(async (id) => { await api("DELETE", `/v1/agents/${encodeURIComponent(id)}`); closeDetail(); return id; },
        (id) => `deleted ${id}`);
  };
  $("#detail-close").onclick = closeDetail;
  $("#chat").onsubmit = async (ev) => {
    ev.preventDefault();
    const id = state.open, text = $("#chat-input").value.trim(), out = $("#chat-reply");
    if (!id || !text) return;
    out.textContent = ""; out.dataset.state = "streaming"; $("#chat-send").disabled = true;
    try {
      const r = await fetch(`/v1/agents/${encodeURIComponent(id)}/messages`, {
        method: "POST", headers: headers({ "content-type": "application/json", accept: "text/event-stream" }),
        body: JSON.stringify({ content: text, max_tokens: 128, stream: true }) });
      if (!r.ok) {
        const e = await r.json().catch(() => ({}));
        throw new Error((e.error && e.error.message) || r.status + " " + r.statusText);
      }
      for await (const ev of sse(r)) {
        const d = JSON.parse(ev.data);
        if (ev.event === "delta") out.textContent += d.text;
        else if (ev.event === "error") throw new Error(d.error.message);
        else if (ev.event === "done") out.dataset.state = "done";
      }
      if (out.dataset.state !== "done") throw new Error("the stream ended early");
      $("#chat-input").value = "";
      loadDetail();
    } catch (e) {
      out.dataset.state = "error"; out.textContent += `\n[${e.message}]`;
    } finally { $("#chat-send").disabled = false; }
  };

  // -- wiring -------------------------------------------------------------------------------
  $("#agents tbody").addEventListener("click", (ev) => {
    const tr = ev.target.closest("tr");
    if (!tr) return;
    if (tr.classList.contains("group")) { state.convOpen = !state.convOpen; schedule("agents"); }
    else if (tr.dataset.id && ev.target.closest("td") === tr.firstElementChild) openAgent(tr.dataset.id);
  });
  $("#agents thead").addEventListener("click", (ev) => {
    const k = ev.target.dataset && ev.target.dataset.sort;
    if (!k) return;
    state.sort = { key: k, asc: state.sort.key === k ? !state.sort.asc : k === "id" || k === "model" };
    renderAgents();
  });
  $("#filter").addEventListener("input", (ev) => { state.filter = ev.target.value; renderAgents(); });
  $("#key-form").onsubmit = (ev) => {
    ev.preventDefault();
    localStorage.setItem(KEY, $("#key-input").value.trim());
    $("#key-input").value = "";
    connect();
  };
  setInterval(() => { if (!$("#main").hidden) schedule("agents", "batch"); }, 10000); // "x s ago" and the sparkline age
  connect();
})();
