// OOM Planner web page: one form -> POST /v1/plans, the ranked plans with a stacked memory bar per
// plan (against the device's capacity), which GPU to rent (POST /v1/compare), and the history from
// GET /v1/plans. Everything the server
// sends is written with textContent, never as HTML.
"use strict";

const COLORS = ["#4e79a7", "#f28e2b", "#e15759", "#76b7b2", "#59a14f", "#edc948", "#b07aa1", "#ff9da7", "#9c755f", "#bab0ac"];
const OVERHEAD = "allocator + CUDA context";

function gib(bytes) {
  const units = [["TiB", 2 ** 40], ["GiB", 2 ** 30], ["MiB", 2 ** 20], ["KiB", 2 ** 10]];
  for (const [unit, size] of units) if (Math.abs(bytes) >= size) return (bytes / size).toFixed(2) + " " + unit;
  return bytes + " B";
}

function label(config) {
  const parts = [config.method];
  if (config.method !== "full") parts.push("r" + config.lora_r);
  parts.push(config.precision, config.optimizer, "mb" + config.micro_batch + "x" + config.grad_accum);
  if (config.grad_ckpt) parts.push("ckpt");
  // the sharding as suggest's table shows it: payloads name a ZeRO stage, or (version 3) the scheme
  const sharding = config.sharding || (config.zero ? "zero" + config.zero : "");
  if (sharding) parts.push(sharding + (config.offload !== "none" ? "+" + config.offload : ""));
  return parts.join(", ");
}

// breakdown keys like "activations/checkpoints" are grouped by their first part
function groups(memory) {
  const sums = new Map();
  for (const [key, value] of Object.entries(memory.breakdown)) {
    const name = key.split("/")[0];
    sums.set(name, (sums.get(name) || 0) + value);
  }
  const allocated = [...sums.values()].reduce((a, b) => a + b, 0);
  if (memory.process_total_bytes > allocated) sums.set(OVERHEAD, memory.process_total_bytes - allocated);
  return sums;
}

function colorOf(palette, name) {
  if (!palette.has(name)) palette.set(name, COLORS[palette.size % COLORS.length]);
  return palette.get(name);
}

function bar(memory, capacity, usable, palette) {
  const box = el("div", null, {class: "bar", title: "device capacity " + gib(capacity)});
  const total = Math.max(capacity, memory.process_total_bytes);
  for (const [name, bytes] of groups(memory)) {
    const seg = el("div", null, {class: "seg", "data-part": name, title: name + ": " + gib(bytes)});
    seg.style.width = (100 * bytes / total) + "%";
    seg.style.background = colorOf(palette, name);
    box.appendChild(seg);
  }
  const mark = el("div", null, {class: "usable", title: "usable after the safety margin: " + gib(usable)});
  mark.style.left = (100 * usable / total) + "%";
  box.appendChild(mark);
  return box;
}

// a plan's probability of running out of memory as the CLI's table shows it
function risk(p) {
  if (p === null || p === undefined) return "-";
  if (p < 0.001) return "<0.1%";
  return p > 0.999 ? ">99.9%" : (100 * p).toFixed(1) + "%";
}

function interval(range) {
  return range ? "90% interval " + gib(range[0]) + " - " + gib(range[1]) : "";
}

function renderPlans(data) {
  const body = document.querySelector("#plans tbody");
  body.replaceChildren();
  const capacity = data.request.gpu_memory_bytes, palette = new Map();
  for (const plan of data.plans) {
    const row = el("tr", null, {class: "plan"});
    row.append(el("td", plan.rank, {class: "num"}), el("td", label(plan.config)));
    const cell = el("td");
    cell.appendChild(bar(plan.memory, capacity, data.usable_bytes, palette));
    row.append(cell, el("td", gib(plan.memory.process_total_bytes), {class: "num"}),
               el("td", risk(plan.oom_probability), {class: "num" + (plan.near_edge ? " edge" : ""),
                  title: interval(plan.memory.peak_interval_bytes)}),
               el("td", Math.round(plan.throughput.tokens_per_s).toLocaleString(), {class: "num"}),
               el("td", plan.throughput.step_s.toPrecision(3) + " s", {class: "num"}),
               el("td", (plan.trade_offs || []).join("; ") || "-", {class: "tradeoffs"}));
    body.appendChild(row);
  }
  const legend = document.getElementById("legend");
  legend.replaceChildren();
  for (const [name, color] of palette) {
    const item = el("span", name), swatch = el("i");
    swatch.style.background = color;
    item.prepend(swatch);
    legend.appendChild(item);
  }
  const rejected = document.getElementById("rejected");
  rejected.replaceChildren(...(data.rejected || []).map(r => el("li", r.family + ": " + r.reason)));
  document.getElementById("rejected-title").hidden = !rejected.children.length;
  const r = data.request;
  document.getElementById("summary").textContent =
    r.model_id + " on " + r.gpu_count + " x " + r.gpu + " (" + gib(capacity) + ", usable " + gib(data.usable_bytes) +
    "), target batch " + r.target_batch + " x " + r.seq_len + " tokens; " + data.searched.toLocaleString() +
    " configurations searched" + (data.plan_id ? "; plan " + data.plan_id.slice(0, 8) : "") +
    (data.from_store ? " (" + data.verification.status + ", answered from the store)" : "");
  const other = data.other_policy_best;
  document.getElementById("other-policy").textContent = other ?
    "Ranked by " + (data.prefer === "speed" ? "fidelity" : "speed") + " instead, the first plan would be " +
    label(other.config) + " (" + Math.round(other.throughput.tokens_per_s).toLocaleString() + " tokens/s)." : "";
  document.getElementById("advice").replaceChildren(...(data.advice || []).map(a => el("li", a)));
  document.getElementById("result").hidden = false;
}

function authHeaders(headers) {
  const token = document.getElementById("token").value.trim();
  if (token) headers["Authorization"] = "Bearer " + token;
  return headers;
}

async function call(method, path, body) {
  const headers = authHeaders({"Accept": "application/json"});
  if (body !== undefined) headers["Content-Type"] = "application/json";
  const response = await fetch(path, {method, headers, body: body === undefined ? undefined : JSON.stringify(body)});
  let data = null;
  try { data = await response.json(); } catch (e) { data = {error: "the server answered " + response.status}; }
  return {status: response.status, data};
}

function showError(text) {
  const box = document.getElementById("error");
  box.textContent = text || "";
  box.hidden = !text;
}

async function loadHistory() {
  const {status, data} = await call("GET", "/v1/plans?limit=20");
  if (status !== 200) return showError(data.error);
  const body = document.querySelector("#history tbody");
  body.replaceChildren(...data.plans.map(p => {
    const row = el("tr", null, {"data-id": p.id, title: "open plan " + p.id.slice(0, 8)});
    row.addEventListener("click", () => { location.hash = "plan=" + p.id; });
    row.append(el("td", p.id.slice(0, 8)), el("td", p.created_at.slice(0, 16).replace("T", " ")), el("td", p.model_id),
               el("td", (p.gpu_count > 1 ? p.gpu_count + "x " : "") + p.gpu), el("td", p.target_batch + " x " + p.seq_len),
               el("td", p.top_plan || "nothing fits"), el("td", p.status));
    return row;
  }));
}

async function loadChoices() {
  const [gpus, models] = await Promise.all([call("GET", "/v1/gpus"), call("GET", "/v1/models")]);
  if (gpus.status === 200) {
    const select = document.getElementById("gpu"), keep = select.value;
    select.replaceChildren(...gpus.data.map(g => el("option", g.name + " (" + g.display_name + ", " + gib(g.memory_bytes) + ")", {value: g.name})));
    select.value = keep;
  }
  if (models.status === 200) {
    document.getElementById("models").replaceChildren(...models.data.map(m => el("option", null, {value: m.id})));
  }
}

async function submit(event) {
  event.preventDefault();
  showError("");
  const form = event.target, status = document.getElementById("status");
  const body = {model: form.model.value.trim(), gpu: form.gpu.value, target_batch: Number(form.target_batch.value),
                gpus: Number(form.gpus.value || 1), method: form.method.value, precision: form.precision.value,
                prefer: form.prefer.value};
  if (form.seq_len.value) body.seq_len = Number(form.seq_len.value);
  if (form.cpu_mem.value.trim()) body.cpu_mem = form.cpu_mem.value.trim();
  const file = form.config_file.files[0];
  if (!file && !body.model) return showError("give a model: a catalog id, or upload its config.json");
  if (file) {
    try {
      body.config = JSON.parse(await file.text());
    } catch (e) {
      return showError(file.name + " is not a JSON config.json: " + e.message);
    }
    // the plan's name: the model field, else the config's own, else the file's
    if (!form.model.value.trim() || form.model.value.trim() === form.model.defaultValue)
      body.model = body.config._name_or_path || file.name.replace(/\.json$/i, "");
  }
  status.textContent = "planning...";
  document.getElementById("submit").disabled = true;
  try {
    const {status: code, data} = await call("POST", "/v1/plans", body);
    status.textContent = "";
    if (code === 200 || code === 201) renderPlans(data);
    else {
      document.getElementById("result").hidden = true;
      showError(data.error || "the server answered " + code);
      if (data.rejected && data.rejected.length) renderPlans(data);
    }
    await loadHistory();
  } catch (e) {
    status.textContent = "";
    showError("cannot reach the server: " + e);
  } finally {
    document.getElementById("submit").disabled = false;
  }
}

function priceText(price) {
  return "$" + price.usd_per_gpu_hour.toFixed(2) + "/GPU-h at " + price.provider + (price.date ? " (" + price.date + ")" : "");
}

function optionText(o) {
  return o.gpus + " x " + o.gpu + ": " + o.hours.toFixed(2) + " h" +
    (o.dollars === null ? ", no price" : ", $" + o.dollars.toFixed(2)) + " (" + o.plan.label + ")";
}

// POST /v1/compare's answer: the cheapest options, then the fastest, what has no price and what fits nowhere
function renderComparison(data) {
  const body = document.querySelector("#rent tbody");
  body.replaceChildren(...data.by_cost.slice(0, 10).map((o, i) => {
    const row = el("tr", null, {class: "option"});
    row.append(el("td", i + 1, {class: "num"}), el("td", o.gpu), el("td", o.gpus, {class: "num"}), el("td", o.plan.label),
               el("td", risk(o.plan.oom_probability), {class: "num"}),
               el("td", Math.round(o.plan.tokens_per_s).toLocaleString(), {class: "num"}),
               el("td", o.hours.toFixed(2), {class: "num"}), el("td", "$" + o.dollars.toFixed(2), {class: "num"}),
               el("td", priceText(o.price)));
    return row;
  }));
  document.getElementById("rent").hidden = false;
  const notes = [data.model + ": " + data.tokens.toLocaleString() + " tokens (" + data.tokens_source + "), cheapest first"];
  if (data.by_time.length) notes.push("fastest: " + data.by_time.slice(0, 3).map(optionText).join("; "));
  const unpriced = [...new Set(data.by_time.filter(o => o.price === null).map(o => o.gpu))];
  if (unpriced.length) notes.push("planned but not priced: " + unpriced.join(", "));
  if (data.unfit.length) notes.push("nothing fits at any count on: " + data.unfit.join(", "));
  notes.push("prices: " + data.prices + " (on-demand, per GPU-hour; check the provider rents that many on one node); " +
             "time counts training steps only");
  document.getElementById("rent-notes").replaceChildren(...notes.map(n => el("li", n)));
}

async function compare(event) {
  event.preventDefault();
  showError("");
  const plan = document.getElementById("plan-form"), form = event.target, status = document.getElementById("rent-status");
  const body = {model: plan.model.value.trim(), target_batch: Number(plan.target_batch.value), method: plan.method.value,
                tokens: form.tokens.value.trim(), gpus_max: Number(form.gpus_max.value)};
  if (plan.seq_len.value) body.seq_len = Number(plan.seq_len.value);
  status.textContent = "planning on every GPU...";
  document.getElementById("compare").disabled = true;
  try {
    const {status: code, data} = await call("POST", "/v1/compare", body);
    status.textContent = "";
    if (code === 200) renderComparison(data);
    else showError(data.error || "the server answered " + code);
  } catch (e) {
    status.textContent = "";
    showError("cannot reach the server: " + e);
  } finally {
    document.getElementById("compare").disabled = false;
  }
}

document.addEventListener("DOMContentLoaded", () => {
  const token = document.getElementById("token");
  token.value = sessionStorage.getItem("planner-token") || "";
  token.addEventListener("change", () => {
    sessionStorage.setItem("planner-token", token.value);
    showError("");
    // a server that protects reads answered 401 without the token: read again with it
    loadChoices().catch(e => showError("cannot reach the server: " + e));
    loadHistory().catch(e => showError("cannot reach the server: " + e));
  });
  document.getElementById("plan-form").addEventListener("submit", submit);
  document.getElementById("rent-form").addEventListener("submit", compare);
  loadChoices().catch(e => showError("cannot reach the server: " + e));
  loadHistory().catch(e => showError("cannot reach the server: " + e));
});
