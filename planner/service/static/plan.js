// One stored plan (#plan=ID, opened from the history): its candidates with the runs measured of
// them, the picture of a candidate's predicted step (GET /v1/plans/ID/timeline), where its memory
// goes, its assumptions, and a download of its files (GET /v1/plans/ID/files, a zip). Everything
// the server sends is written with textContent or as SVG attributes, never as HTML.
"use strict";

const SVG = "http://www.w3.org/2000/svg";
const STEP_COLORS = {"weights": "#4c72b0", "gradients": "#dd8452", "optimizer states": "#55a868",
                     "activations": "#c44e52", "logits/loss": "#8172b3", "temporaries": "#937860"};
let shown = {plan: null, rank: 1};

function svg(tag, attrs) {
  const node = document.createElementNS(SVG, tag);
  for (const [key, value] of Object.entries(attrs || {})) node.setAttribute(key, value);
  return node;
}

function latestRun(candidate) {
  const runs = candidate.measurements || [];
  return runs.length ? runs[runs.length - 1] : null;
}

function measuredCells(candidate) {
  const run = latestRun(candidate);
  if (!run) return ["-", "-", "not run"];
  const m = run.measurement || run;
  const peak = m.process_total_bytes || m.peak_reserved_bytes || m.peak_allocated_bytes;
  return [peak ? gib(peak) : "-", m.tokens_per_s ? Math.round(m.tokens_per_s).toLocaleString() : "-", m.outcome || "-"];
}

function renderPlanView(plan) {
  shown = {plan, rank: 1};
  const r = plan.request;
  document.getElementById("plan-title").textContent = "Plan " + plan.id.slice(0, 8);
  document.getElementById("plan-summary").textContent =
    r.model_id + " on " + r.gpu_count + " x " + r.gpu + ", target batch " + r.target_batch + " x " + r.seq_len +
    " tokens; " + plan.status + (plan.status_reason ? " (" + plan.status_reason + ")" : "") + "; made " +
    plan.created_at.slice(0, 16).replace("T", " ") + " UTC";
  const body = document.querySelector("#plan-candidates tbody");
  body.replaceChildren(...plan.candidates.map(c => {
    const rank = c.rank || c.position + 1;
    const row = el("tr", null, {class: "candidate", "data-rank": rank, title: "show this plan's step"});
    row.append(el("td", rank, {class: "num"}), el("td", c.label), el("td", gib(c.memory.process_total_bytes), {class: "num"}),
               el("td", risk(c.memory.oom_probability), {class: "num"}),
               el("td", Math.round(c.throughput.tokens_per_s).toLocaleString(), {class: "num"}),
               ...measuredCells(c).map((text, i) => el("td", text, {class: i < 2 ? "num" : ""})));
    row.addEventListener("click", () => showCandidate(rank));
    return row;
  }));
  document.getElementById("plan-view").hidden = false;
  if (plan.candidates.length) showCandidate(plan.candidates[0].rank || 1);
  document.getElementById("plan-view").scrollIntoView();
}

function showCandidate(rank) {
  const plan = shown.plan, candidate = plan.candidates.find(c => (c.rank || c.position + 1) === rank);
  shown.rank = rank;
  for (const row of document.querySelectorAll("#plan-candidates tbody tr"))
    row.classList.toggle("selected", Number(row.getAttribute("data-rank")) === rank);
  const parts = Object.entries(candidate.memory.breakdown).sort((a, b) => b[1] - a[1]);
  document.querySelector("#breakdown tbody").replaceChildren(...parts.map(([key, bytes]) => {
    const row = el("tr");
    row.append(el("td", key), el("td", gib(bytes), {class: "num"}));
    return row;
  }));
  document.getElementById("assumptions").replaceChildren(
    ...[...candidate.memory.assumptions, ...(candidate.throughput.assumptions || [])].map(a => el("li", a)));
  document.getElementById("timeline-title").textContent = "The step of plan #" + rank + ", predicted: " + candidate.label;
  loadTimeline(plan.id, rank).catch(e => showError("cannot reach the server: " + e));
}

async function loadTimeline(planId, rank) {
  const box = document.getElementById("timeline"), note = document.getElementById("timeline-note");
  box.replaceChildren();
  note.textContent = "drawing...";
  const {status, data} = await call("GET", "/v1/plans/" + planId + "/timeline?rank=" + rank);
  if (status !== 200) {
    note.textContent = data.error || "the server answered " + status;
    return;
  }
  box.appendChild(drawTimeline(data));
  note.textContent = "peak " + gib(data.peak_bytes) + " at " + data.peak_phase + "; the line above the areas is " +
    (data.reserved ? "the caching allocator's reserve" : "the allocated total") + "; dashed: usable after the safety margin";
}

// stacked areas of live bytes by category over the step, the reserve as a line, capacity and usable
function drawTimeline(data) {
  const width = 800, height = 300, left = 60, right = 10, top = 10, bottom = 30;
  const top_bytes = Math.max(data.capacity_bytes, ...(data.reserved || data.allocated));
  const xOf = x => left + x * (width - left - right), yOf = b => height - bottom - b / top_bytes * (height - top - bottom);
  const root = svg("svg", {viewBox: "0 0 " + width + " " + height, role: "img", "aria-label": "predicted memory over one step"});
  const below = data.x.map(() => 0), legend = document.getElementById("timeline-legend");
  legend.replaceChildren();
  for (const [name, values] of Object.entries(data.stacks)) {
    if (!values.some(v => v > 0)) continue;
    const upper = values.map((v, i) => below[i] + v);
    const points = data.x.map((x, i) => xOf(x) + "," + yOf(upper[i]))
      .concat(data.x.map((x, i) => xOf(x) + "," + yOf(below[i])).reverse());
    root.appendChild(svg("polygon", {points: points.join(" "), fill: STEP_COLORS[name] || "#999", "data-part": name}));
    upper.forEach((v, i) => { below[i] = v; });
    const item = el("span", name), swatch = el("i");
    swatch.style.background = STEP_COLORS[name] || "#999";
    item.prepend(swatch);
    legend.appendChild(item);
  }
  if (data.reserved)
    root.appendChild(svg("polyline", {class: "reserved", points: data.x.map((x, i) => xOf(x) + "," + yOf(data.reserved[i])).join(" ")}));
  for (const [cls, bytes] of [["capacity", data.capacity_bytes], ["usable", data.usable_bytes]]) {
    if (!bytes) continue;
    root.appendChild(svg("line", {class: cls, x1: left, x2: width - right, y1: yOf(bytes), y2: yOf(bytes)}));
  }
  root.appendChild(svg("circle", {class: "peak", cx: xOf(data.peak_x), cy: yOf(data.peak_bytes), r: 4, fill: "#000"}));
  for (const [text, x, y, anchor] of [[gib(top_bytes), 2, top + 10, "start"], ["0", left - 4, height - bottom, "end"],
                                        ["forward", xOf(0.02), height - 10, "start"],
                                        ["optimizer step", xOf(data.marks.optimizer_start || 0.97), height - 10, "end"]]) {
    const label = svg("text", {x, y, "text-anchor": anchor});
    label.textContent = text;
    root.appendChild(label);
  }
  return root;
}

async function download() {
  const plan = shown.plan, status = document.getElementById("download-status");
  status.textContent = "";
  const response = await fetch("/v1/plans/" + plan.id + "/files?rank=" + shown.rank, {headers: authHeaders({})});
  if (response.status !== 200) {
    let text = "the server answered " + response.status;
    try { text = (await response.json()).error || text; } catch (e) { /* not JSON */ }
    status.textContent = text;
    return;
  }
  const link = el("a", null, {href: URL.createObjectURL(await response.blob()),
                              download: "plan-" + plan.id.slice(0, 8) + "-rank" + shown.rank + ".zip"});
  document.body.appendChild(link);
  link.click();
  link.remove();
  status.textContent = "downloaded " + link.getAttribute("download");
}

async function openPlan(planId) {
  const {status, data} = await call("GET", "/v1/plans/" + planId);
  if (status !== 200) return showError(data.error || "the server answered " + status);
  showError("");
  renderPlanView(data);
}

function openFromHash() {
  const match = /^#plan=([0-9a-fA-F]{1,32})$/.exec(location.hash);
  if (match) openPlan(match[1]).catch(e => showError("cannot reach the server: " + e));
}

document.addEventListener("DOMContentLoaded", () => {
  document.getElementById("download").addEventListener("click", () => download().catch(e => showError(String(e))));
  window.addEventListener("hashchange", openFromHash);
  openFromHash();
});
