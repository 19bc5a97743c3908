// OOM Planner API documentation: /openapi.json rendered as plain HTML, with nothing loaded from
// elsewhere (the page runs under "default-src 'self'"). Everything from the server is written with
// textContent, never as HTML. The token (when reads are protected) is the web page's, kept in
// sessionStorage.
"use strict";

const METHODS = ["get", "post", "put", "patch", "delete", "head"];

function refName(ref) {
  return ref.split("/").pop();
}

// a schema as one short line: "integer", "string | null", "PlanBody", "array of PlanStatus"
function typeOf(schema) {
  if (!schema) return "any";
  if (schema.$ref) return refName(schema.$ref);
  if (schema.anyOf) return schema.anyOf.map(typeOf).join(" | ");
  if (schema.enum) return schema.enum.map(v => JSON.stringify(v)).join(" | ");
  if (schema.type === "array") return "array of " + typeOf(schema.items);
  if (schema.type === "object" && schema.additionalProperties) return "object";
  return schema.type || "any";
}

function limits(schema) {
  const parts = [];
  for (const s of [schema, ...(schema.anyOf || [])]) {
    if (s.minimum !== undefined) parts.push(">= " + s.minimum);
    if (s.maximum !== undefined) parts.push("<= " + s.maximum);
    if (s.minLength !== undefined) parts.push("length >= " + s.minLength);
    if (s.maxLength !== undefined) parts.push("length <= " + s.maxLength);
    if (s.pattern !== undefined) parts.push("matches " + s.pattern);
  }
  return parts.join(", ");
}

function table(headings, rows) {
  const t = el("table");
  const head = el("tr");
  for (const h of headings) head.appendChild(el("th", h));
  t.appendChild(el("thead")).appendChild(head);
  const body = t.appendChild(el("tbody"));
  for (const row of rows) {
    const tr = el("tr");
    for (const cell of row) tr.appendChild(el("td", cell));
    body.appendChild(tr);
  }
  return t;
}

function fieldsTable(schema) {
  const required = new Set(schema.required || []);
  const rows = Object.entries(schema.properties || {}).map(([name, s]) => [
    name, typeOf(s), required.has(name) ? "yes" : "no",
    s.default === undefined ? "" : JSON.stringify(s.default), limits(s), s.description || ""]);
  return table(["field", "type", "required", "default", "limits", "what"], rows);
}

function example(schema) {
  const body = {};
  for (const [name, s] of Object.entries(schema.properties || {})) {
    if ((schema.required || []).includes(name) || s.examples) {
      body[name] = s.examples ? s.examples[0] : s.type === "integer" ? 1 : "";
    }
  }
  return body;
}

function curl(method, path, op, schemas) {
  const lines = ["curl -s -X " + method.toUpperCase() + " \"$PLANNER_URL" + path + "\""];
  if (op.security) lines.push("  -H \"Authorization: Bearer $PLANNER_API_TOKEN\"");
  const ref = op.requestBody && op.requestBody.content["application/json"].schema.$ref;
  if (ref) {
    lines.push("  -H 'Content-Type: application/json'");
    lines.push("  -d '" + JSON.stringify(example(schemas[refName(ref)])) + "'");
  }
  return lines.join(" \\\n");
}

function operation(path, method, op, schemas) {
  const id = (method + path).replace(/[^a-z0-9]+/gi, "-");
  const section = el("section", null, {id, class: "operation"});
  section.appendChild(el("h2", method.toUpperCase() + " " + path));
  if (op.summary) section.appendChild(el("p", op.summary, {class: "summary"}));
  if (op.description) section.appendChild(el("p", op.description, {class: "description"}));
  if (op.security) section.appendChild(el("p", "Needs 'Authorization: Bearer <token>' when the server has tokens.", {class: "auth"}));
  const params = op.parameters || [];
  if (params.length) {
    section.appendChild(el("h3", "Parameters"));
    section.appendChild(table(["name", "in", "type", "required", "default", "limits", "what"], params.map(p => [
      p.name, p.in, typeOf(p.schema), p.required ? "yes" : "no",
      p.schema && p.schema.default !== undefined ? JSON.stringify(p.schema.default) : "",
      p.schema ? limits(p.schema) : "", p.description || ""])));
  }
  if (op.requestBody) {
    const schema = op.requestBody.content["application/json"].schema;
    section.appendChild(el("h3", "Body: " + typeOf(schema) + " (JSON)"));
    if (schema.$ref) section.appendChild(fieldsTable(schemas[refName(schema.$ref)]));
  }
  section.appendChild(el("h3", "Answers"));
  section.appendChild(table(["status", "what", "body"], Object.entries(op.responses || {}).sort().map(([code, r]) => [
    code, r.description || "", r.content && r.content["application/json"] ? typeOf(r.content["application/json"].schema) : ""])));
  section.appendChild(el("pre", curl(method, path, op, schemas), {class: "curl"}));
  return section;
}

function render(spec) {
  const info = document.getElementById("info");
  info.replaceChildren(el("p", spec.info.description || ""), el("p", "Version " + spec.info.version + ", OpenAPI " + spec.openapi));
  const schemas = (spec.components && spec.components.schemas) || {};
  const toc = el("ul"), ops = [];
  for (const [path, item] of Object.entries(spec.paths)) {
    for (const method of METHODS) {
      if (!item[method]) continue;
      const section = operation(path, method, item[method], schemas);
      ops.push(section);
      const li = el("li");
      li.appendChild(el("a", method.toUpperCase() + " " + path, {href: "#" + section.id}));
      li.append(" " + (item[method].summary || ""));
      toc.appendChild(li);
    }
  }
  document.getElementById("toc").replaceChildren(el("h2", "Routes"), toc);
  document.getElementById("operations").replaceChildren(...ops);
  const list = document.getElementById("schemas");
  list.replaceChildren(el("h2", "Schemas"));
  for (const [name, schema] of Object.entries(schemas)) {
    const part = el("section", null, {id: "schema-" + name});
    part.appendChild(el("h3", name));
    if (schema.description) part.appendChild(el("p", schema.description, {class: "description"}));
    if (schema.properties) part.appendChild(fieldsTable(schema));
    else if (schema.enum) part.appendChild(el("p", "One of " + typeOf(schema)));
    list.appendChild(part);
  }
}

function showError(text) {
  const box = document.getElementById("error");
  box.textContent = text || "";
  box.hidden = !text;
}

async function load() {
  showError("");
  const token = document.getElementById("token").value.trim();
  const headers = {"Accept": "application/json"};
  if (token) headers["Authorization"] = "Bearer " + token;
  const response = await fetch("/openapi.json", {headers});
  if (response.status === 401) return showError("this server protects reads: enter a token and press Load");
  if (response.status !== 200) return showError("the server answered " + response.status);
  render(await response.json());
}

document.addEventListener("DOMContentLoaded", () => {
  const token = document.getElementById("token");
  token.value = sessionStorage.getItem("planner-token") || "";
  document.getElementById("token-form").addEventListener("submit", event => {
    event.preventDefault();
    sessionStorage.setItem("planner-token", token.value);
    load().catch(e => showError("cannot reach the server: " + e));
  });
  load().catch(e => showError("cannot reach the server: " + e));
});
