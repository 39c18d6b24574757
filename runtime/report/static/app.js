// rewardbox report. Everything that comes from the record (completions, prompts, what rewards printed) is put
// into the page with textContent only: it is shown as text and never runs.
"use strict";

const PAGE = 50;
const state = { meta: null, view: "graphs", prompts: { q: "", sort: "last_step", order: "desc", offset: 0 },
  prompt: null, leftIndex: 0, logs: { offset: 0 }, search: { offset: 0, ids: "" }, seen: -1 };

function $(id) { return document.getElementById(id); }

function el(tag, props, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(props || {})) {
    if (key === "class") node.className = value;
    else if (key === "onclick") node.addEventListener("click", value);
    else node.setAttribute(key, value);
  }
  for (const child of children) {
    if (child === null || child === undefined) continue;
    node.appendChild(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return node;
}

function fmt(value, digits = 3) {
  if (value === null || value === undefined) return "None";
  if (typeof value === "number") return Number.isInteger(value) ? String(value) : value.toFixed(digits);
  return String(value);
}

async function api(name, params = {}) {
  const query = new URLSearchParams(Object.entries(params).filter(([, v]) => v !== "" && v !== undefined && v !== null));
  const response = await fetch(`/api/${name}?${query}`, { credentials: "same-origin" });
  const body = await response.json();
  if (!response.ok || body.error) throw new Error(body.error || response.statusText);
  return body;
}

function showError(error) {
  const box = $("error");
  box.hidden = !error;
  box.textContent = error ? String(error.message || error) : "";
}

function statusCell(score) {
  if (!score) return el("td", {}, "-");
  const cell = el("td", { class: `status-${score.status}` }, `${fmt(score.value)} (${score.status})`);
  const took = score.latency_s === null || score.latency_s === undefined ? "" : `, ${fmt(score.latency_s * 1000, 1)} ms`;
  cell.title = `version ${score.version || "?"}${took}`;
  return cell;
}

// A completion's tool calls (TRL's tools and environment methods): how many, how many failed; each on hover.
function toolsCell(calls) {
  if (!calls || !calls.length) return el("td", {}, "-");
  const failed = calls.filter((t) => t.status !== "ok").length;
  const cell = el("td", { class: failed ? "status-error" : "status-ok" }, `${calls.length}${failed ? ` (${failed} failed)` : ""}`);
  cell.title = calls.map((t) => `${t.name}(${t.arguments}): ${t.status}`).join("\n");
  return cell;
}

function toolTable(calls) {
  if (!calls || !calls.length) return null;
  return el("table", { class: "data tool-calls" },
    el("thead", {}, el("tr", {}, ...["tool call", "arguments", "status", "ms", "shown to the model"].map((h) => el("th", {}, h)))),
    el("tbody", {}, ...calls.map((t) => el("tr", {}, el("td", {}, t.name), el("td", {}, el("pre", {}, t.arguments)),
      el("td", { class: `status-${t.status}` }, t.status),
      el("td", {}, t.latency_s === null || t.latency_s === undefined ? "-" : fmt(t.latency_s * 1000, 1)),
      el("td", {}, el("pre", {}, t.shown === null || t.shown === undefined ? "(no result)" : t.shown),
        t.error ? el("pre", { class: "status-error" }, t.error) : null)))));
}

function rewardNames() { return state.meta ? state.meta.rewards.map((r) => r.name) : []; }

// ---- tabs ----------------------------------------------------------------------------------------------------
function showView(view) {
  state.view = ["graphs", "completions", "logs", "search"].includes(view) ? view : "graphs";
  for (const link of document.querySelectorAll("#tabs a")) link.classList.toggle("active", link.dataset.view === state.view);
  for (const section of document.querySelectorAll(".view")) section.classList.toggle("active", section.id === `view-${state.view}`);
  refresh().catch(showError);
}

async function refresh() {
  showError(null);
  if (state.view === "graphs") await renderGraphs();
  else if (state.view === "completions") await renderPrompts();
  else if (state.view === "logs") await renderLogs();
  else await renderSearch();
}

// ---- graphs --------------------------------------------------------------------------------------------------
function versionMarkers() {
  const shapes = [], annotations = [];
  for (const v of (state.meta ? state.meta.versions : [])) {
    if (!v.first_step) continue;
    shapes.push({ type: "line", x0: v.first_step, x1: v.first_step, yref: "paper", y0: 0, y1: 1,
      line: { dash: "dot", color: "#8e24aa" } });
    annotations.push({ x: v.first_step, yref: "paper", y: 1, text: `${v.reward} ${v.version}`, showarrow: false,
      font: { color: "#8e24aa", size: 11 }, yanchor: "bottom" });
  }
  return { shapes, annotations };
}

function plot(id, title, traces, yTitle) {
  const layout = { title: { text: title }, margin: { t: 40, r: 20, b: 40, l: 50 }, xaxis: { title: { text: "step" } },
    yaxis: { title: { text: yTitle } }, legend: { orientation: "h" }, ...versionMarkers() };
  Plotly.react($(id), traces, layout, { displaylogo: false, responsive: true });
}

async function renderGraphs() {
  const g = await api("graphs");
  const steps = g.steps.map((s) => s.step);
  const means = g.steps.map((s) => s.total);
  const std = g.steps.map((s) => s.total_std);
  plot("chart-total", "Total reward (weighted) by step, with its std", [
    { x: steps, y: means, name: "mean total", mode: "lines+markers", error_y: { type: "data", array: std, visible: true } },
    { x: steps, y: std, name: "std of total", mode: "lines", line: { dash: "dash" } },
  ], "reward");
  const byReward = {};
  for (const row of g.rewards) (byReward[row.reward] ||= []).push(row);
  plot("chart-rewards", "Mean of each reward by step", Object.entries(byReward).map(([name, rows]) => (
    { x: rows.map((r) => r.step), y: rows.map((r) => r.mean), name, mode: "lines+markers" })), "mean score");
  plot("chart-fallbacks", "Fallback rate by step (every status but ok)", Object.entries(byReward).map(([name, rows]) => (
    { x: rows.map((r) => r.step), y: rows.map((r) => (r.n - r.ok) / r.n), name, mode: "lines+markers" })), "rate");
  const latency = {};
  for (const row of g.latency) (latency[row.reward] ||= []).push(row);
  plot("chart-latency", "Latency of each reward call by step", Object.entries(latency).map(([name, rows]) => (
    { x: rows.map((r) => r.step), y: rows.map((r) => r.latency_s), name, mode: "lines+markers" })), "seconds");
}

// ---- completions ---------------------------------------------------------------------------------------------
async function renderPrompts() {
  const p = state.prompts;
  const data = await api("prompts", { q: p.q, sort: p.sort, order: p.order, offset: p.offset, limit: PAGE });
  $("prompt-count").textContent = `${data.total} prompts (${p.offset + 1}-${Math.min(p.offset + PAGE, data.total)})`;
  const body = $("prompt-table").tBodies[0];
  body.replaceChildren(...data.rows.map((row) => {
    const tr = el("tr", { class: "clickable" + (state.prompt && state.prompt.prompt.id === row.id ? " selected" : ""),
      "data-id": row.id, onclick: () => openPrompt(row.id).catch(showError) },
      el("td", {}, row.id), el("td", {}, el("pre", {}, row.text)), el("td", {}, fmt(row.tokens)),
      el("td", {}, el("pre", {}, row.columns)), el("td", {}, row.first_step), el("td", {}, row.last_step),
      el("td", {}, row.steps), el("td", {}, row.epochs), el("td", {}, row.completions), el("td", {}, fmt(row.mean_total)));
    return tr;
  }));
  if (state.prompt) await openPrompt(state.prompt.prompt.id, true);
}

function bestOfLatest(completions) {
  const last = Math.max(...completions.map((c) => c.step));
  let best = null;
  for (const c of completions) if (c.step === last && (best === null || (c.total ?? -Infinity) > (best.total ?? -Infinity))) best = c;
  return best;
}

async function openPrompt(id, keepLeft = false) {
  const data = await api("prompt", { id });
  const previous = state.prompt && state.prompt.prompt.id === id;
  state.prompt = data;
  $("prompt-detail").hidden = false;
  $("detail-id").textContent = id;
  $("detail-prompt").textContent = data.prompt.text;
  const slider = $("left-slider");
  slider.max = String(Math.max(0, data.completions.length - 1));
  if (!(keepLeft && previous)) state.leftIndex = 0;
  slider.value = String(state.leftIndex);
  renderCompare();
  const names = rewardNames();
  $("detail-table").tHead.replaceChildren(el("tr", {}, ...["id", "step", "epoch", "completion", ...names, "total",
    "advantage", "tokens", "tool calls"].map((h) => el("th", {}, h))));
  $("detail-table").tBodies[0].replaceChildren(...data.completions.map((c, index) => el("tr", {
    class: "clickable", onclick: () => { state.leftIndex = index; slider.value = String(index); renderCompare(); } },
  el("td", {}, c.id), el("td", {}, c.step), el("td", {}, fmt(c.epoch, 2)), el("td", {}, el("pre", {}, c.text)),
  ...names.map((n) => statusCell(c.scores[n])), el("td", {}, fmt(c.total)), el("td", {}, fmt(c.advantage)),
  el("td", {}, fmt(c.tokens)), toolsCell(c.tool_calls))));
  for (const tr of $("prompt-table").tBodies[0].rows) tr.classList.toggle("selected", tr.dataset.id === id);
}

// Word-level differences (longest common subsequence); past a size where that gets slow, none are marked.
function diff(a, b) {
  const x = a.split(/(\s+)/), y = b.split(/(\s+)/);
  if (a.length > 100000 || b.length > 100000 || (x.length + 1) * (y.length + 1) > 2.5e6)
    return { left: x.map((t) => [t, false]), right: y.map((t) => [t, false]) };
  const n = x.length, m = y.length, w = m + 1, cells = new Uint32Array((n + 1) * w);
  const table = { get: (i, j) => cells[i * w + j] };
  for (let i = n - 1; i >= 0; i--) for (let j = m - 1; j >= 0; j--)
    cells[i * w + j] = x[i] === y[j] ? cells[(i + 1) * w + j + 1] + 1 : Math.max(cells[(i + 1) * w + j], cells[i * w + j + 1]);
  const left = [], right = [];
  let i = 0, j = 0;
  while (i < n && j < m) {
    if (x[i] === y[j]) { left.push([x[i], false]); right.push([y[j], false]); i++; j++; }
    else if (table.get(i + 1, j) >= table.get(i, j + 1)) left.push([x[i++], true]);
    else right.push([y[j++], true]);
  }
  while (i < n) left.push([x[i++], true]);
  while (j < m) right.push([y[j++], true]);
  return { left, right };
}

function panel(node, title, c, pieces, side) {
  const names = rewardNames();
  const text = el("pre", { class: "text" });
  for (const [piece, changed] of pieces) text.appendChild(changed && piece.trim() ? el("mark", { class: `diff-${side}` }, piece) : document.createTextNode(piece));
  node.replaceChildren(
    el("h4", {}, `${title}: completion ${c.id}, step ${c.step}, epoch ${fmt(c.epoch, 2)}`),
    el("table", { class: "data" }, el("tbody", {},
      ...names.map((n) => el("tr", {}, el("th", {}, n), statusCell(c.scores[n]))),
      el("tr", {}, el("th", {}, "total"), el("td", {}, fmt(c.total))),
      el("tr", {}, el("th", {}, "advantage"), el("td", {}, fmt(c.advantage))),
      el("tr", {}, el("th", {}, "tokens"), el("td", {}, fmt(c.tokens))))),
    toolTable(c.tool_calls), text);
}

function renderCompare() {
  const completions = state.prompt.completions;
  if (!completions.length) return;
  const left = completions[state.leftIndex], right = bestOfLatest(completions);
  const pieces = diff(left.text, right.text);
  panel($("panel-left"), "Chosen", left, pieces.left, "left");
  panel($("panel-right"), "Best of the latest step", right, pieces.right, "right");
  $("left-position").textContent = `${state.leftIndex + 1} of ${completions.length}`;
}

// ---- reward logs ---------------------------------------------------------------------------------------------
function fillSelect(id, values) {
  const select = $(id);
  if (select.options.length > 1) return;
  for (const value of values) select.appendChild(el("option", { value }, value));
}

const STATUSES = ["ok", "error", "timeout", "crash", "invalid", "unavailable"];

async function renderLogs() {
  fillSelect("log-reward", rewardNames());
  fillSelect("log-status", STATUSES);
  const filters = { reward: $("log-reward").value, step: $("log-step").value, status: $("log-status").value,
    q: $("log-search").value, offset: state.logs.offset, limit: PAGE };
  const data = await api("logs", filters);
  $("log-count").textContent = `${data.total} scores (${state.logs.offset + 1}-${Math.min(state.logs.offset + PAGE, data.total)})`;
  $("log-table").tBodies[0].replaceChildren(...data.rows.map((r) => el("tr", {},
    el("td", {}, r.id), el("td", {}, r.step), el("td", {}, r.reward), el("td", {}, r.version),
    el("td", { class: `status-${r.status}` }, r.status), el("td", {}, fmt(r.value)),
    el("td", {}, r.latency_s === null ? "-" : fmt(r.latency_s * 1000, 1)),
    el("td", {}, el("pre", {}, r.text)), el("td", {}, el("pre", {}, r.own_logs)),
    el("td", {}, r.error ? el("details", {}, el("summary", {}, r.error.trim().split("\n").pop()), el("pre", {}, r.error)) : ""),
    el("td", {}, r.call_logs ? el("details", {}, el("summary", {}, "the call's output"), el("pre", {}, r.call_logs)) : ""))));
}

// ---- search and signals --------------------------------------------------------------------------------------
function searchFilters() {
  return { q: $("search-q").value, reward: $("search-reward").value, status: $("search-status").value,
    step: $("search-step").value, min_total: $("search-min").value, max_total: $("search-max").value,
    ids: state.search.ids };
}

async function renderSearch() {
  fillSelect("search-reward", rewardNames());
  fillSelect("search-status", STATUSES);
  const signals = await api("signals");
  $("signals").replaceChildren(...(signals.length ? signals.map((s) => el("li", {}, s.title, " ",
    el("button", { onclick: () => { state.search.ids = s.ids.join(","); state.search.offset = 0; renderSearchTable().catch(showError); } },
      `show ${s.ids.length}`))) : [el("li", {}, "none found")]));
  await renderSearchTable();
}

async function renderSearchTable() {
  const filters = searchFilters();
  const data = await api("completions", { ...filters, offset: state.search.offset, limit: PAGE });
  const names = rewardNames();
  $("search-count").textContent = `${data.total} completions${state.search.ids ? " (a signal's)" : ""}`;
  $("search-export").href = `/api/export?${new URLSearchParams(Object.entries(filters).filter(([, v]) => v))}`;
  $("search-table").tHead.replaceChildren(el("tr", {}, ...["id", "step", "prompt", "completion", ...names, "total",
    "advantage", "tool calls"].map((h) => el("th", {}, h))));
  $("search-table").tBodies[0].replaceChildren(...data.rows.map((r) => el("tr", {},
    el("td", {}, r.id), el("td", {}, r.step), el("td", {}, el("pre", {}, r.prompt)), el("td", {}, el("pre", {}, r.text)),
    ...names.map((n) => statusCell(r.scores[n])), el("td", {}, fmt(r.total)), el("td", {}, fmt(r.advantage)),
    toolsCell(r.tool_calls))));
}

// ---- live updates --------------------------------------------------------------------------------------------
async function poll() {
  try {
    const meta = await api("meta");
    state.meta = meta;
    $("status").textContent = `${meta.completions} completions, ${meta.prompts} prompts, last step ${meta.last_step}`;
    if (meta.completions !== state.seen) {
      const first = state.seen < 0;
      state.seen = meta.completions;
      if (!first && (state.view === "graphs" || state.view === "completions")) await refresh();
    }
  } catch (error) {
    showError(error);
  }
}

function wire() {
  window.addEventListener("hashchange", () => showView(location.hash.slice(1)));
  let timer = null;
  $("prompt-search").addEventListener("input", () => {
    clearTimeout(timer);
    timer = setTimeout(() => { state.prompts.q = $("prompt-search").value; state.prompts.offset = 0; renderPrompts().catch(showError); }, 250);
  });
  for (const th of document.querySelectorAll("#prompt-table th[data-sort]")) {
    th.addEventListener("click", () => {
      const p = state.prompts;
      p.order = p.sort === th.dataset.sort && p.order === "desc" ? "asc" : "desc";
      p.sort = th.dataset.sort;
      renderPrompts().catch(showError);
    });
  }
  $("prompt-prev").addEventListener("click", () => { state.prompts.offset = Math.max(0, state.prompts.offset - PAGE); renderPrompts().catch(showError); });
  $("prompt-next").addEventListener("click", () => { state.prompts.offset += PAGE; renderPrompts().catch(showError); });
  const slider = $("left-slider");
  slider.addEventListener("input", () => { state.leftIndex = Number(slider.value); renderCompare(); });
  $("left-prev").addEventListener("click", () => { state.leftIndex = Math.max(0, state.leftIndex - 1); slider.value = String(state.leftIndex); renderCompare(); });
  $("left-next").addEventListener("click", () => { state.leftIndex = Math.min(state.prompt.completions.length - 1, state.leftIndex + 1); slider.value = String(state.leftIndex); renderCompare(); });
  for (const id of ["log-reward", "log-step", "log-status", "log-search"]) {
    $(id).addEventListener("change", () => { state.logs.offset = 0; renderLogs().catch(showError); });
  }
  $("log-prev").addEventListener("click", () => { state.logs.offset = Math.max(0, state.logs.offset - PAGE); renderLogs().catch(showError); });
  $("log-next").addEventListener("click", () => { state.logs.offset += PAGE; renderLogs().catch(showError); });
  $("search-go").addEventListener("click", () => { state.search.ids = ""; state.search.offset = 0; renderSearchTable().catch(showError); });
  $("search-prev").addEventListener("click", () => { state.search.offset = Math.max(0, state.search.offset - PAGE); renderSearchTable().catch(showError); });
  $("search-next").addEventListener("click", () => { state.search.offset += PAGE; renderSearchTable().catch(showError); });
}

wire();
poll().then(() => showView(location.hash.slice(1) || "graphs"));
setInterval(poll, 2000);
