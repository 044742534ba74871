// The page /gpucleanup: every kernel's GPU memory, from GET api/gpucleanup/kernels, refreshed every
// refresh_s seconds while the page is visible. Plain DOM, no framework, no network beyond this server.
// Every text from the server goes through textContent or createTextNode: notebook names are user data.
"use strict";

(function () {
  const body = document.body;
  const BASE = body.dataset.baseUrl || "/";
  const REFRESH_MS = Math.max(0.5, parseFloat(body.dataset.refreshS) || 2) * 1000;
  const API = BASE + "api/gpucleanup/kernels";
  const SVG_NS = "http://www.w3.org/2000/svg";
  const SERIES = [
    ["used", "used_bytes"],
    ["live", "live_bytes"],
    ["cached", "cached_bytes"],
    ["outside", "outside_bytes"],
  ];

  const list = document.getElementById("kernels");
  const updated = document.getElementById("updated");
  const problem = document.getElementById("problem");
  const empty = document.getElementById("empty");
  // kernel id -> {root, content, button, result}: the Drain button and its result survive refreshes
  const shown = new Map();
  let timer = null;
  let inFlight = false;

  // ------------------------------------------------------------------ building blocks

  function el(tag, className, ...children) {
    const node = document.createElement(tag);
    if (className) node.className = className;
    for (const child of children) {
      if (child === null || child === undefined) continue;
      node.appendChild(typeof child === "string" ? document.createTextNode(child) : child);
    }
    return node;
  }

  function svg(tag, attributes) {
    const node = document.createElementNS(SVG_NS, tag);
    for (const [name, value] of Object.entries(attributes || {})) node.setAttribute(name, String(value));
    return node;
  }

  // The units of gpucleanup.report.format_bytes: 6.0 GiB, 512 MiB, 1.5 MiB, 8 B.
  const UNITS = [["TiB", 2 ** 40], ["GiB", 2 ** 30], ["MiB", 2 ** 20], ["KiB", 2 ** 10]];

  function unitFor(n) {
    for (const [unit, size] of UNITS) if (n >= size) return [unit, size];
    return ["B", 1];
  }

  function number(value, unit) {
    if (unit === "B") return String(Math.trunc(value));
    if (unit === "GiB" || unit === "TiB") return value.toFixed(1);
    return value >= 10 ? value.toFixed(0) : value.toFixed(1);
  }

  function formatBytes(n) {
    if (n === null || n === undefined) return "?";
    const sign = n < 0 ? "-" : "";
    const [unit, size] = unitFor(Math.abs(n));
    return `${sign}${number(Math.abs(n) / size, unit)} ${unit}`;
  }

  // used/total in the unit of the total: 2.7/79.6 GiB
  function formatPair(used, total) {
    if (total === null || total === undefined) return formatBytes(used);
    if (used === null || used === undefined) return `?/${formatBytes(total)}`;
    const [unit, size] = unitFor(Math.abs(total));
    if (unit === "B") return `${used}/${total} B`;
    return `${number(used / size, unit)}/${formatBytes(total)}`;
  }

  function formatDuration(seconds) {
    if (seconds === null || seconds === undefined) return "?";
    const s = Math.max(0, seconds);
    if (s < 1) return `${Math.round(s * 1000)} ms`;
    if (s < 10) return `${s.toFixed(1)} s`;
    if (s < 60) return `${s.toFixed(0)} s`;
    const whole = Math.round(s);
    const minutes = Math.floor(whole / 60), rest = whole % 60;
    return rest ? `${minutes} min ${rest} s` : `${minutes} min`;
  }

  function sum(perFramework) {
    if (!perFramework || typeof perFramework !== "object") return 0;
    return Object.values(perFramework).reduce((a, b) => a + (typeof b === "number" && b > 0 ? b : 0), 0);
  }

  function breakdown(perFramework) {
    if (!perFramework || typeof perFramework !== "object") return "";
    return Object.entries(perFramework).map(([name, bytes]) => `${name} ${formatBytes(bytes)}`).join(", ");
  }

  function clock(timeNs) {
    return new Date(timeNs / 1e6).toLocaleTimeString([], { hour12: false });
  }

  function xsrfToken() {
    for (const part of document.cookie.split(";")) {
      const [name, ...value] = part.trim().split("=");
      if (name === "_xsrf") return decodeURIComponent(value.join("="));
    }
    return "";
  }

  // ------------------------------------------------------------------ one kernel

  function stateClass(entry) {
    if (entry.error) return "problem";
    if (!entry.gpucleanup) return "off";
    return (entry.state && entry.state.state) || "unknown";
  }

  function stateWords(entry) {
    if (!entry.gpucleanup) return entry.execution_state ? `${entry.execution_state} · gpucleanup not loaded` : "gpucleanup not loaded";
    if (entry.state_text) return entry.state_text;
    if (entry.error_kind === "no_answer") return "no answer";
    if (entry.error_kind === "elsewhere") return "elsewhere";
    return entry.error_kind || "unknown";
  }

  function head(entry) {
    const title = entry.notebook
      ? el("h2", "notebook", entry.notebook)
      : el("h2", "notebook unnamed", entry.kernel_id ? `kernel ${entry.kernel_id}` : `process ${entry.pid}`);
    const meta = [];
    if (entry.pid !== null && entry.pid !== undefined) meta.push(`pid ${entry.pid}`);
    if (entry.kernel_id && entry.notebook) meta.push(`kernel ${entry.kernel_id.slice(0, 8)}`);
    if (entry.execution_state && entry.gpucleanup) meta.push(`Jupyter: ${entry.execution_state}`);
    if (!entry.server_kernel) meta.push("not a kernel of this server");
    if (entry.snapshot_status === "stale") meta.push(`figures ${formatDuration(entry.snapshot_age_s)} old`);
    const state = el("span", `state state-${stateClass(entry)}`, stateWords(entry));
    return el("div", "head", title, state, el("span", "meta", meta.join(" · ")));
  }

  function bar(dev) {
    // used of total, split into live, cached, outside and the rest of used
    const total = dev.total_bytes;
    const box = svg("svg", { class: "bar", viewBox: "0 0 100 6", preserveAspectRatio: "none", "aria-hidden": "true" });
    box.appendChild(svg("rect", { class: "bar-total", x: 0, y: 0, width: 100, height: 6 }));
    if (!total) return box;
    const used = Math.max(0, dev.used_bytes || 0);
    box.appendChild(svg("rect", { class: "bar-used", x: 0, y: 0, width: (100 * used) / total, height: 6 }));
    let x = 0;
    for (const [name, bytes] of [["live", sum(dev.live_bytes)], ["cached", sum(dev.cached_bytes)], ["outside", dev.outside_bytes || 0]]) {
      const width = (100 * Math.max(0, bytes)) / total;
      if (width > 0) box.appendChild(svg("rect", { class: `bar-${name}`, x, y: 0, width, height: 6 }));
      x += width;
    }
    return box;
  }

  function figure(className, bytes, detail) {
    const cell = el("td", className, formatBytes(bytes));
    if (detail) cell.title = detail;
    return cell;
  }

  function devices(entry) {
    if (!entry.devices.length) {
      const driver = entry.driver_state;
      const words = !driver || driver === "ready" || driver === "not_initialized" ? "no GPU in use" : `no GPU (driver ${driver})`;
      return el("p", "no-devices muted", words);
    }
    const table = el("table", "devices");
    table.appendChild(el("thead", null, el("tr", null, ...["GPU", "used / total", "live", "cached", "outside", "driver pool"].map((h) => el("th", null, h)))));
    const rows = el("tbody");
    for (const dev of entry.devices) {
      const row = el("tr", "device");
      row.dataset.index = String(dev.index);
      row.appendChild(el("td", "gpu", `GPU${dev.index}`, dev.name ? el("span", "muted", ` ${dev.name}`) : null));
      row.appendChild(el("td", "used", el("span", null, formatPair(dev.used_bytes, dev.total_bytes)), bar(dev)));
      row.appendChild(figure("live", sum(dev.live_bytes), breakdown(dev.live_bytes)));
      row.appendChild(figure("cached", sum(dev.cached_bytes), breakdown(dev.cached_bytes)));
      row.appendChild(figure("outside", dev.outside_bytes, "memory in no framework's and no driver pool: the CUDA context, raw allocations"));
      row.appendChild(figure("pool", dev.driver_pool_reserved_bytes, `in use ${formatBytes(dev.driver_pool_used_bytes)}`));
      rows.appendChild(row);
    }
    table.appendChild(rows);
    return table;
  }

  function cells(entry) {
    if (!entry.last_cells.length) return null;
    const table = el("table", "cells");
    table.appendChild(el("thead", null, el("tr", null, ...["cell", "freed", "used after", "cleanup"].map((h) => el("th", null, h)))));
    const rows = el("tbody");
    for (const record of entry.last_cells) {
      const usedAfter = record.devices.map((d) => `GPU${d.index} ${formatBytes(d.used_after_bytes)}`).join(", ");
      const row = el("tr", "cell",
        el("td", "cell-number", record.cell === null || record.cell === undefined ? "drain" : `[${record.cell}]`),
        el("td", "freed", formatBytes(record.freed_bytes + (record.pinned_freed_bytes || 0))),
        el("td", "used-after", usedAfter || "-"),
        el("td", "took", (record.interrupted ? "interrupted · " : "") + formatDuration(record.elapsed_s)));
      rows.appendChild(row);
    }
    table.appendChild(rows);
    return el("div", "cells-box", el("h3", null, "last cells"), table);
  }

  const W = 420, H = 150, PAD_L = 8, PAD_R = 8, PAD_T = 18, PAD_B = 18;

  function timelineOf(device) {
    const points = device.points;
    const box = svg("svg", { class: "timeline", viewBox: `0 0 ${W} ${H}`, role: "img" });
    box.dataset.index = String(device.index);
    const label = svg("title");
    label.textContent = `GPU${device.index}: device memory over the last ${points.length} cell(s)`;
    box.appendChild(label);
    let top = 0;
    for (const p of points) for (const [, key] of SERIES) if (typeof p[key] === "number") top = Math.max(top, p[key]);
    top = top > 0 ? top * 1.1 : 1;
    const n = points.length;
    const x = (i) => (n === 1 ? W / 2 : PAD_L + (i * (W - PAD_L - PAD_R)) / (n - 1));
    const y = (v) => PAD_T + (H - PAD_T - PAD_B) * (1 - v / top);
    box.appendChild(svg("line", { class: "axis", x1: PAD_L, x2: W - PAD_R, y1: y(0), y2: y(0) }));
    const scale = svg("text", { class: "scale", x: PAD_L, y: PAD_T - 5 });
    scale.textContent = `GPU${device.index} · top ${formatBytes(top)}`;
    box.appendChild(scale);
    for (const [name, key] of SERIES) {
      // a gap where a figure is unknown; a single cell is drawn as a flat line across
      let run = [];
      const flush = () => {
        if (run.length === 1) run = [[PAD_L, run[0][1]], [W - PAD_R, run[0][1]]];
        if (run.length > 1) box.appendChild(svg("polyline", { class: `line line-${name}`, points: run.map((p) => p.join(",")).join(" ") }));
        run = [];
      };
      points.forEach((p, i) => (typeof p[key] === "number" ? run.push([x(i).toFixed(1), y(p[key]).toFixed(1)]) : flush()));
      flush();
    }
    points.forEach((p, i) => {
      if (!(p.freed_bytes > 0)) return;
      const at = typeof p.used_bytes === "number" ? y(p.used_bytes) : y(0);
      const marker = svg("path", { class: "freed", d: `M ${x(i).toFixed(1)} ${(at + 2).toFixed(1)} l -4 -7 h 8 z` });
      const tip = svg("title");
      tip.textContent = `${p.cell === null ? "drain" : `cell ${p.cell}`} freed ${formatBytes(p.freed_bytes)}`;
      marker.appendChild(tip);
      box.appendChild(marker);
    });
    const first = points[0], last = points[n - 1];
    const cellName = (p) => (p.cell === null || p.cell === undefined ? "drain" : `[${p.cell}]`);
    const from = svg("text", { class: "cells-axis", x: PAD_L, y: H - 4 });
    from.textContent = cellName(first);
    box.appendChild(from);
    if (n > 1) {
      const to = svg("text", { class: "cells-axis", x: W - PAD_R, y: H - 4, "text-anchor": "end" });
      to.textContent = cellName(last);
      box.appendChild(to);
    }
    return box;
  }

  function timelines(entry) {
    const series = (entry.timeline && entry.timeline.devices) || [];
    const drawn = series.filter((d) => d.points && d.points.length);
    if (!drawn.length) return null;
    return el("div", "timelines", ...drawn.map(timelineOf));
  }

  function content(entry) {
    const part = el("div", "content");
    part.appendChild(head(entry));
    if (entry.error) part.appendChild(el("p", "error", entry.error));
    if (entry.hint) part.appendChild(el("p", "hint", entry.hint));
    if (entry.gpucleanup && !entry.error) {
      part.appendChild(el("div", "figures", el("div", "devices-box", devices(entry)), timelines(entry), cells(entry)));
    }
    return part;
  }

  // One POST of an action button (drain, park, resume); its result stays next to the buttons.
  async function act(entry, view, action, pending, wordsOf) {
    view.button.disabled = true;
    view.park.disabled = true;
    view.result.className = "drain-result pending";
    view.result.textContent = pending;
    let words, kind;
    try {
      const response = await fetch(`${API}/${encodeURIComponent(entry.id)}/${action}`, {
        method: "POST",
        credentials: "same-origin",
        headers: { "Content-Type": "application/json", Accept: "application/json", "X-XSRFToken": xsrfToken() },
        body: "{}",
      });
      let data = null;
      try {
        data = await response.json();
      } catch (_) {
        data = null;
      }
      const message = (data && data.message) || `HTTP ${response.status}`;
      if (response.ok && data) {
        [kind, words] = wordsOf(data);
      } else if (response.status === 409) {
        kind = "refused";
        words = `Refused: ${message}`;
      } else if (response.status === 504) {
        kind = "refused";
        words = `No answer: ${message}`;
      } else {
        kind = "refused";
        words = `Failed (HTTP ${response.status}): ${message}`;
      }
    } catch (error) {
      kind = "refused";
      words = `The server did not answer: ${error.message}`;
    }
    view.result.className = `drain-result ${kind}`;
    view.result.textContent = words;
    view.button.disabled = !entry.gpucleanup;
    view.park.disabled = !entry.gpucleanup;
    refreshSoon(0);
  }

  function drain(entry, view) {
    return act(entry, view, "drain", "draining…", (data) => [
      data.drained ? "ok" : "warn",
      `${data.drained ? "Drained" : "Not all drained"} at ${clock(Date.now() * 1e6)}: ${data.lines.join("; ")}`,
    ]);
  }

  function isParked(entry) {
    const name = entry.state && entry.state.state;
    return name === "parked" || name === "parking";
  }

  function parkOrResume(entry, view) {
    const action = isParked(entry) ? "resume" : "park";
    return act(entry, view, action, action === "park" ? "parking…" : "resuming…", (data) => [
      data.ok ? "ok" : "warn",
      `${data.ok ? "Done" : "Not done"} at ${clock(Date.now() * 1e6)}: ${data.message}`,
    ]);
  }

  // "Can park?": what gpucleanup park --check says, on one line next to the buttons; it touches nothing.
  async function checkPark(entry, view) {
    view.result.className = "drain-result pending";
    view.result.textContent = "checking…";
    let kind = "refused";
    let words;
    try {
      const response = await fetch(`${API}/${encodeURIComponent(entry.id)}/park-check`, {
        credentials: "same-origin",
        headers: { Accept: "application/json" },
      });
      let data = null;
      try {
        data = await response.json();
      } catch (_) {
        data = null;
      }
      if (response.ok && data) {
        kind = data.parkable ? "ok" : "warn";
        words = `${data.parkable ? "Can be parked now" : "Cannot be parked now"} (${clock(Date.now() * 1e6)})` +
          (data.parkable ? "" : `: ${data.reasons.join("; ")}`);
      } else {
        words = `Failed (HTTP ${response.status}): ${(data && data.message) || ""}`;
      }
    } catch (error) {
      words = `The server did not answer: ${error.message}`;
    }
    view.result.className = `drain-result ${kind}`;
    view.result.textContent = words;
  }

  function viewOf(entry) {
    let view = shown.get(entry.id);
    if (view) return view;
    const root = el("section", "kernel");
    root.dataset.id = entry.id;
    const button = el("button", "drain", "Drain");
    button.type = "button";
    button.title = "Wait for the kernel's queued GPU work and trim its memory pools (only between cells)";
    const park = el("button", "park", "Park");
    park.type = "button";
    const check = el("button", "park-check", "Can park?");
    check.type = "button";
    check.title = "Whether the kernel can be parked now, and every reason why not (touches nothing)";
    const result = el("output", "drain-result");
    view = { root, content: el("div", "content"), button, park, check, result, entry };
    button.addEventListener("click", () => drain(view.entry, view));
    park.addEventListener("click", () => parkOrResume(view.entry, view));
    check.addEventListener("click", () => checkPark(view.entry, view));
    root.appendChild(view.content);
    root.appendChild(el("div", "actions", button, park, check, result));
    shown.set(entry.id, view);
    return view;
  }

  // ------------------------------------------------------------------ the whole page

  function render(data) {
    const seen = new Set();
    for (const entry of data.kernels) {
      const view = viewOf(entry);
      seen.add(entry.id);
      view.entry = entry;
      const fresh = content(entry);
      view.root.replaceChild(fresh, view.content);
      view.content = fresh;
      view.root.dataset.state = stateClass(entry);
      view.button.disabled = !entry.gpucleanup || !!entry.error;
      view.park.disabled = !entry.gpucleanup || !!entry.error;
      view.check.disabled = !entry.gpucleanup || !!entry.error;
      view.park.textContent = isParked(entry) ? "Resume" : "Park";
      view.park.title = isParked(entry)
        ? "Bring the kernel's GPU memory back from host memory now (its next cell also does)"
        : "Move all of the kernel's GPU memory, its CUDA context included, to host memory (only between cells)";
      list.appendChild(view.root); // keeps the server's order
    }
    for (const [id, view] of shown) {
      if (!seen.has(id)) {
        view.root.remove();
        shown.delete(id);
      }
    }
    empty.hidden = data.kernels.length !== 0;
    const count = data.kernels.length === 1 ? "1 kernel" : `${data.kernels.length} kernels`;
    let words = `${count} · updated ${clock(data.time_ns)} · every ${formatDuration(REFRESH_MS / 1000)}`;
    if (data.skipped.length) {
      words += ` · ${data.skipped.length} discovery file(s) skipped: ` + data.skipped.map((s) => `${s.path} (${s.why})`).join("; ");
    }
    updated.textContent = words;
  }

  function say(words) {
    problem.hidden = !words;
    problem.textContent = words || "";
  }

  async function refresh() {
    if (inFlight) return;
    inFlight = true;
    try {
      const response = await fetch(API, { credentials: "same-origin", headers: { Accept: "application/json" } });
      if (response.status === 403) {
        say("Not logged in to this Jupyter server any more: open it again with its token, then reload this page.");
      } else if (!response.ok) {
        say(`Could not refresh at ${clock(Date.now() * 1e6)}: HTTP ${response.status}.`);
      } else {
        render(await response.json());
        say("");
      }
    } catch (error) {
      say(`Could not reach the Jupyter server at ${clock(Date.now() * 1e6)} (${error.message}); the figures below are older.`);
    } finally {
      inFlight = false;
      refreshSoon(REFRESH_MS);
    }
  }

  function refreshSoon(delay) {
    if (timer !== null) clearTimeout(timer);
    timer = null;
    if (document.hidden) return; // resumed by visibilitychange
    timer = setTimeout(refresh, delay);
  }

  document.addEventListener("visibilitychange", () => {
    if (!document.hidden) refreshSoon(0);
  });
  refresh();
})();
