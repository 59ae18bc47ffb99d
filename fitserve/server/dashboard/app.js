// fitserve dashboard: polls /dashboard/state and draws the KV pool, the queues and latencies.
"use strict";

const POLL_MS = 500;
const $ = (id) => document.getElementById(id);
let cells = [];      // one div per KV block
let painted = [];    // block ids coloured in the previous frame

function hue(id) {  // a stable colour per request: hue from the client request, shade per child
  const cut = id.lastIndexOf("-");
  const group = cut > 0 ? id.slice(0, cut) : id;
  const child = cut > 0 ? parseInt(id.slice(cut + 1), 10) || 0 : 0;
  let h = 2166136261;
  for (let i = 0; i < group.length; i++) h = Math.imul(h ^ group.charCodeAt(i), 16777619) >>> 0;
  return `hsl(${h % 360}, ${70 - (child % 3) * 15}%, ${62 - (child % 4) * 9}%)`;
}

function ensureGrid(n) {
  if (cells.length === n) return;
  const grid = $("grid");
  grid.replaceChildren();
  cells = [];
  for (let i = 0; i < n; i++) {
    const d = document.createElement("div");
    d.className = "blk";
    d.dataset.block = i;
    grid.appendChild(d);
    cells.push(d);
  }
  painted = [];
}

function drawGrid(state) {
  // the grid is group 0's pool (a windowed pool's null block 0 included, never painted)
  const g0 = (state.kv.groups || [])[0];
  ensureGrid(g0 ? g0.num_blocks + (g0.window === null ? 0 : 1) : state.kv.num_blocks);
  for (const b of painted) {
    const c = cells[b];
    if (c) { c.className = "blk"; c.style.background = ""; c.title = ""; }
  }
  painted = [];
  let shared = 0;
  for (const [block, owners] of state.owners) {
    const c = cells[block];
    if (!c) continue;
    c.className = owners.length > 1 ? "blk used shared" : "blk used";
    c.style.background = hue(owners[0]);
    c.title = `block ${block}: ${owners.join(", ")}`;
    if (owners.length > 1) shared++;
    painted.push(block);
  }
  const used = painted.length;
  for (const block of state.cached || []) {  // free, but still holding a reusable prefix
    const c = cells[block];
    if (!c) continue;
    c.className = "blk cached";
    c.title = `block ${block}: cached prefix, evictable`;
    painted.push(block);
  }
  const grid = $("grid");
  grid.dataset.used = String(used);
  grid.dataset.shared = String(shared);
  grid.dataset.cached = String(painted.length - used);
}

function drawGroups(state) {  // one line per KV layer group (hybrid / windowed models)
  const groups = state.kv.groups || [];
  const show = groups.length > 1 || groups.some((g) => g.window !== null);
  $("groups-box").style.display = show ? "" : "none";
  const rows = groups.map((g, i) => {
    const tr = document.createElement("tr");
    tr.dataset.group = String(i);
    tr.dataset.used = String(g.used_blocks);
    tr.dataset.freed = String(g.window_freed_blocks);
    const kind = g.window === null ? "full" : `sliding (window ${g.window})`;
    for (const v of [kind, g.num_layers || "", `${g.used_blocks} / ${g.num_blocks}`, g.free_blocks,
                     g.window === null ? "-" : g.window_freed_blocks]) {
      const td = document.createElement("td");
      td.textContent = v;
      tr.appendChild(td);
    }
    return tr;
  });
  $("groups").replaceChildren(...rows);
}

function drawRequests(state) {
  const body = $("requests");
  const rows = state.requests
    .slice()
    .sort((a, b) => (a.state === b.state ? b.age_s - a.age_s : a.state === "running" ? -1 : 1))
    .map((r) => {
      const tr = document.createElement("tr");
      tr.className = r.state;
      const cols = [r.id.replace(/^(chat)?cmpl-/, "").slice(-14), r.state, r.prompt_tokens,
                    r.output_tokens, r.blocks, r.age_s.toFixed(1)];
      const sw = document.createElement("td");
      const dot = document.createElement("span");  // request data goes in as text, never as HTML
      dot.className = "sw";
      dot.style.background = hue(r.id);
      sw.appendChild(dot);
      tr.appendChild(sw);
      for (const v of cols) {
        const td = document.createElement("td");
        td.textContent = v;
        tr.appendChild(td);
      }
      return tr;
    });
  body.replaceChildren(...rows);
  $("no-requests").style.display = rows.length ? "none" : "";
}

function drawSeries(canvas, series, color, unit) {
  const ctx = canvas.getContext("2d");
  const w = canvas.width, h = canvas.height, pad = 28;
  ctx.clearRect(0, 0, w, h);
  const pts = series.filter((p) => p.v !== null);
  const max = Math.max(1e-9, ...pts.map((p) => p.v));
  ctx.strokeStyle = "#2a313b";
  ctx.strokeRect(pad, 4, w - pad - 4, h - pad);
  ctx.fillStyle = "#7d8794";
  ctx.font = "11px system-ui";
  ctx.fillText(`${max.toFixed(max < 10 ? 1 : 0)} ${unit}`, 2, 12);
  ctx.fillText("-5 min", pad, h - 8);
  ctx.fillText("now", w - 28, h - 8);
  if (!pts.length) return;
  const x = (t) => pad + ((t + 300) / 300) * (w - pad - 4);
  const y = (v) => 4 + (h - pad) * (1 - v / max);
  ctx.strokeStyle = color;
  ctx.fillStyle = color;
  ctx.lineWidth = 2;
  ctx.beginPath();
  pts.forEach((p, i) => (i ? ctx.lineTo(x(p.t), y(p.v)) : ctx.moveTo(x(p.t), y(p.v))));
  ctx.stroke();
  for (const p of pts) ctx.fillRect(x(p.t) - 2, y(p.v) - 2, 4, 4);
}

function render(state) {
  $("model").textContent = state.model + (state.ready ? "" : " (loading)") + (state.draining ? " (draining)" : "");
  if (!state.kv) return;
  $("kv-used").textContent = state.kv.used_blocks;
  $("kv-total").textContent = state.kv.num_blocks;
  $("frag").textContent = (100 * state.kv.fragmentation).toFixed(1) + "%";
  $("running").textContent = state.num_running;
  $("waiting").textContent = state.num_waiting;
  $("preempt").textContent = state.total_preemptions;
  drawGrid(state);
  drawGroups(state);
  drawRequests(state);
  const hist = state.history || [];
  drawSeries($("ttft"), hist.map((p) => ({ t: p.t, v: p.ttft_ms })), "#4c9be8", "ms");
  drawSeries($("itl"), hist.map((p) => ({ t: p.t, v: p.itl_ms })), "#e8a84c", "ms");
}

async function poll() {
  try {
    const r = await fetch("/dashboard/state", { cache: "no-store" });
    render(await r.json());
    $("conn").textContent = "live";
    $("conn").className = "stat";
  } catch (e) {
    $("conn").textContent = "disconnected";
    $("conn").className = "stat bad";
  }
  setTimeout(poll, POLL_MS);
}

poll();
