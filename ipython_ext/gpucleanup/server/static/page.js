// The page /gpucleanup, the admin's view of the GPUs: a header per GPU (used of total; held by kernels with
// gpucleanup, split into live, cached and outside every pool; parked in host memory; the rest), the kernels as
// rows of a table (sorted by memory held, idle time or name; a row opens the kernel's card: its devices, last
// cells and timeline), Drain, Park/Resume and "Can park?" per row, and "park the kernels idle for more than
// N min" (a preview first, then one park after the other, each result said). From GET api/gpucleanup/kernels
// (?sort=, ?cards= the open cards, whose last cells alone are asked for), refreshed every refresh_s seconds
// while the page is visible. Plain DOM, no framework, no network beyond this server. Every text from the
// server goes through textContent or createTextNode: notebook names are user data.
import { formatBytes, formatDuration, formatPair } from "./units.js";

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

  const tbody = document.getElementById("rows");
  const gpusBox = document.getElementById("gpus");
  const updated = document.getElementById("updated");
  const problem = document.getElementById("problem");
  const empty = document.getElementById("empty");
  // kernel id -> the row's view: its buttons, their last result and whether its card is open survive refreshes
  const shown = new Map();
  let timer = null;
  let inFlight = false;
  let sortOrder = "held";
  let shownSort = "held"; // the order the rows on the page were asked in: what the headers mark
  let lastData = null;

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


  // ------------------------------------------------------------------ the header: one block per GPU

  function gpuTitle(gpu) {
    const index = gpu.index === null || gpu.index === undefined ? gpu.gpu.slice(0, 12) : `GPU${gpu.index}`;
    return gpu.name ? `${index} ${gpu.name}` : index;
  }

  function stack(gpu) {
    // used of total: held by kernels with gpucleanup (live, cached, outside every pool, their pools only), the rest
    const total = gpu.total_bytes;
    const box = svg("svg", { class: "bar gpu-bar", viewBox: "0 0 100 8", preserveAspectRatio: "none", "aria-hidden": "true" });
    box.appendChild(svg("rect", { class: "bar-total", x: 0, y: 0, width: 100, height: 8 }));
    if (!total) return box;
    let x = 0;
    for (const [name, bytes] of [["live", gpu.live_bytes], ["cached", gpu.cached_bytes], ["outside", gpu.outside_bytes],
      ["unsplit", gpu.unsplit_bytes], ["rest", gpu.rest_bytes || 0]]) {
      const width = (100 * Math.max(0, bytes)) / total;
      if (width > 0) box.appendChild(svg("rect", { class: `bar-${name}`, x, y: 0, width, height: 8 }));
      x += width;
    }
    return box;
  }

  function figureLine(className, label, bytes, title) {
    const line = el("div", `gpu-figure ${className}`, el("span", "label", label), el("span", "value", formatBytes(bytes)));
    if (title) line.title = title;
    return line;
  }

  function gpuBlock(gpu) {
    const known = gpu.used_bytes !== null && gpu.used_bytes !== undefined;
    const used = known ? `${formatPair(gpu.used_bytes, gpu.total_bytes)} used` : "used: unknown";
    const why = known ? (gpu.used_source ? ` (${gpu.used_source})` : null) : (gpu.used_unknown ? ` (${gpu.used_unknown})` : null);
    const block = el("section", "gpu",
      el("h2", "gpu-name", gpuTitle(gpu)),
      el("div", "gpu-used", used, why ? el("span", "muted", why) : null),
      stack(gpu));
    block.dataset.gpu = gpu.gpu;
    const kernelsWord = gpu.kernels === 1 ? "1 kernel" : `${gpu.kernels} kernels`;
    block.appendChild(figureLine("held", `held by ${kernelsWord} with gpucleanup`, gpu.held_bytes));
    block.appendChild(figureLine("live sub", "live", gpu.live_bytes, "arrays and tensors the frameworks hold for the kernels"));
    block.appendChild(figureLine("cached sub", "cached", gpu.cached_bytes, "the frameworks' and the driver's pools, free for reuse"));
    block.appendChild(figureLine("outside sub", "outside every pool", gpu.outside_bytes, "CUDA contexts, raw allocations (nvidia-smi's figure less the pools)"));
    if (gpu.unsplit_bytes > 0) {
      block.appendChild(figureLine("unsplit sub", "not split", gpu.unsplit_bytes));
    }
    block.appendChild(figureLine("parked", "parked in host memory", gpu.parked_bytes));
    block.appendChild(figureLine("rest", "the rest (other processes, kernels without gpucleanup)",
      gpu.rest_bytes, "used less what the kernels with gpucleanup hold"));
    return block;
  }

  function renderGpus(data) {
    const gpus = data.gpus || [];
    gpusBox.replaceChildren(...gpus.map(gpuBlock));
    gpusBox.hidden = !data.gpus; // an answer recorded before the header existed has none to say
    if (data.gpus && !gpus.length) gpusBox.appendChild(el("p", "muted", "No GPU in use by a kernel with gpucleanup."));
  }

  // ------------------------------------------------------------------ one row, and its card on demand

  function held(entry) {
    if (!entry.held || !entry.held.length) return el("td", "held muted", entry.gpucleanup ? "-" : "?");
    const cell = el("td", "held");
    for (const h of entry.held) {
      const name = h.index === null || h.index === undefined ? h.gpu.slice(0, 12) : `GPU${h.index}`;
      const line = el("div", "held-gpu", el("span", "muted", `${name} `), formatBytes(h.bytes));
      line.title = h.source === "kernel"
        ? "its own pools only (nvidia-smi does not list this process): live " + formatBytes(h.live_bytes) + ", cached " + formatBytes(h.cached_bytes)
        : `live ${formatBytes(h.live_bytes)}, cached ${formatBytes(h.cached_bytes)}, outside every pool ${formatBytes(h.outside_bytes)} (${h.source})`;
      cell.appendChild(line);
    }
    return cell;
  }

  function parkedCell(entry) {
    const p = entry.parked;
    if (!p) return el("td", "parked muted", "-");
    const since = p.since_ns ? `since ${clock(p.since_ns)}` : "";
    return el("td", "parked", p.bytes === null ? p.state : formatBytes(p.bytes), el("div", "muted small", since));
  }

  function idleCell(entry, now) {
    if (entry.idle_since_ns === null || entry.idle_since_ns === undefined) return el("td", "idle muted", "-");
    return el("td", "idle", formatDuration(entry.idle_s), el("div", "muted small", `since ${clock(entry.idle_since_ns)}`));
  }

  function checkCell(entry) {
    const c = entry.park_check;
    if (!entry.gpucleanup) return el("td", "check muted", "-");
    if (!c) return el("td", "check muted", "?");
    const cell = el("td", `check ${c.parkable ? "can" : "cannot"}`, c.parkable ? "can park" : "cannot park");
    if (!c.parkable) cell.appendChild(el("div", "reasons small", c.reasons.join("; ")));
    cell.title = (c.parkable ? "" : c.reasons.join("\n") + "\n\n") +
      "What gpucleanup park --check says, but for the driver's own state of the process: Can park? reads it too";
    return cell;
  }

  function nameCell(entry, view) {
    const name = entry.notebook || (entry.kernel_id ? `kernel ${entry.kernel_id}` : `process ${entry.pid}`);
    const toggle = el("button", "open", view.open ? "▾" : "▸");
    toggle.type = "button";
    toggle.title = "The kernel's card: its devices, last cells and timeline";
    toggle.addEventListener("click", () => {
      view.open = !view.open;
      renderRows(lastData);
      if (view.open) refreshSoon(0);
    });
    const meta = [];
    if (entry.pid !== null && entry.pid !== undefined) meta.push(`pid ${entry.pid}`);
    if (!entry.server_kernel) meta.push("not this server's");
    return el("td", "name", toggle, el("span", entry.notebook ? "notebook" : "notebook unnamed", name),
      el("div", "muted small", meta.join(" · ")));
  }

  // One POST of an action button (drain, park, resume); its result stays in the row.
  async function post(entry, action) {
    let data = null;
    let response;
    try {
      response = await fetch(`${API}/${encodeURIComponent(entry.id)}/${action}`, {
        method: "POST",
        credentials: "same-origin",
        headers: { "Content-Type": "application/json", Accept: "application/json", "X-XSRFToken": xsrfToken() },
        body: "{}",
      });
    } catch (error) {
      return { kind: "refused", words: `The server did not answer: ${error.message}`, data: null };
    }
    try {
      data = await response.json();
    } catch (_) {
      data = null;
    }
    const message = (data && data.message) || `HTTP ${response.status}`;
    if (response.ok && data) return { kind: "ok", words: message, data };
    if (response.status === 409) return { kind: "refused", words: `Refused: ${message}`, data };
    if (response.status === 504) return { kind: "refused", words: `No answer: ${message}`, data };
    return { kind: "refused", words: `Failed (HTTP ${response.status}): ${message}`, data };
  }

  function setButtons(view, disabled) {
    for (const b of [view.drain, view.park, view.check]) b.disabled = disabled || !view.entry.gpucleanup || !!view.entry.error;
  }

  async function act(view, action, pending, wordsOf) {
    setButtons(view, true);
    view.result.className = "drain-result pending";
    view.result.textContent = pending;
    const got = await post(view.entry, action);
    let [kind, words] = [got.kind, got.words];
    if (got.kind === "ok") [kind, words] = wordsOf(got.data);
    view.result.className = `drain-result ${kind}`;
    view.result.textContent = words;
    setButtons(view, false);
    refreshSoon(0);
  }

  function drain(view) {
    return act(view, "drain", "draining…", (data) => [
      data.drained ? "ok" : "warn",
      `${data.drained ? "Drained" : "Not all drained"} at ${clock(Date.now() * 1e6)}: ${data.lines.join("; ")}`,
    ]);
  }

  function isParked(entry) {
    const name = entry.state && entry.state.state;
    return name === "parked" || name === "parking";
  }

  function parkOrResume(view) {
    const action = isParked(view.entry) ? "resume" : "park";
    return act(view, action, action === "park" ? "parking…" : "resuming…", (data) => [
      data.ok ? "ok" : "warn",
      `${data.ok ? "Done" : "Not done"} at ${clock(Date.now() * 1e6)}: ${data.message}`,
    ]);
  }

  // "Can park?": what gpucleanup park --check says (the driver's state of the process included); touches nothing.
  async function checkPark(view) {
    view.result.className = "drain-result pending";
    view.result.textContent = "checking…";
    let kind = "refused";
    let words;
    try {
      const response = await fetch(`${API}/${encodeURIComponent(view.entry.id)}/park-check`, {
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
    const drainButton = el("button", "drain", "Drain");
    drainButton.type = "button";
    drainButton.title = "Wait for the kernel's queued GPU work and trim its memory pools (only between cells)";
    const park = el("button", "park", "Park");
    park.type = "button";
    const check = el("button", "park-check", "Can park?");
    check.type = "button";
    check.title = "Whether the kernel can be parked now, and every reason why not (touches nothing)";
    const result = el("output", "drain-result");
    view = { row: el("tr", "kernel-row"), cardRow: el("tr", "card-row"), drain: drainButton, park, check, result,
      actions: el("td", "actions", el("div", "buttons", drainButton, park, check), result), entry, open: false };
    view.row.dataset.id = entry.id;
    view.cardRow.dataset.id = entry.id;
    drainButton.addEventListener("click", () => drain(view));
    park.addEventListener("click", () => parkOrResume(view));
    check.addEventListener("click", () => checkPark(view));
    shown.set(entry.id, view);
    return view;
  }

  function fillRow(view, now) {
    const entry = view.entry;
    // the row's state in a word where the Idle and Parked columns say the rest; the card says it all
    const name = entry.state && entry.state.state;
    const words = entry.gpucleanup && !entry.error && (name === "idle" || name === "parked" || name === "parking") ? name : stateWords(entry);
    const pill = el("span", `state state-${stateClass(entry)}`, words);
    if (entry.state_text) pill.title = entry.state_text;
    const state = el("td", "state-cell", pill);
    if (entry.error) state.appendChild(el("div", "error small", entry.error));
    if (entry.hint) state.appendChild(el("div", "hint small", entry.hint));
    view.row.replaceChildren(nameCell(entry, view), el("td", "owner", entry.owner || "?"), state,
      idleCell(entry, now), held(entry), parkedCell(entry), checkCell(entry), view.actions);
    view.row.dataset.state = stateClass(entry);
    setButtons(view, view.result.classList.contains("pending"));
    view.park.textContent = isParked(entry) ? "Resume" : "Park";
    view.park.title = isParked(entry)
      ? "Bring the kernel's GPU memory back from host memory now (its next cell also does)"
      : "Move all of the kernel's GPU memory, its CUDA context included, to host memory (only between cells)";
    if (view.open) {
      const card = el("section", "kernel", content(entry));
      card.dataset.id = entry.id;
      card.dataset.state = stateClass(entry);
      const cell = el("td", null, card);
      cell.colSpan = 8;
      view.cardRow.replaceChildren(cell);
    }
  }

  function renderRows(data) {
    if (!data) return;
    const seen = new Set();
    const now = data.time_ns;
    for (const entry of data.kernels) {
      const view = viewOf(entry);
      seen.add(entry.id);
      view.entry = entry;
      fillRow(view, now);
      tbody.appendChild(view.row); // the server's order
      if (view.open) tbody.appendChild(view.cardRow);
      else view.cardRow.remove();
    }
    for (const [id, view] of shown) {
      if (!seen.has(id)) {
        view.row.remove();
        view.cardRow.remove();
        shown.delete(id);
      }
    }
    for (const th of document.querySelectorAll("th[data-sort]")) {
      th.classList.toggle("sorted", th.dataset.sort === shownSort);
      th.setAttribute("aria-sort", th.dataset.sort === shownSort ? (shownSort === "name" ? "ascending" : "descending") : "none");
    }
  }

  // ------------------------------------------------------------------ park the kernels idle for more than N min

  const bulk = {
    minutes: document.getElementById("idle-minutes"),
    preview: document.getElementById("preview"),
    go: document.getElementById("park-them"),
    cancel: document.getElementById("cancel"),
    box: document.getElementById("bulk-result"),
    list: null,
    running: false,
  };

  function bulkSay(className, ...children) {
    bulk.box.hidden = false;
    bulk.box.className = className;
    bulk.box.replaceChildren(...children);
  }

  async function preview() {
    const minutes = parseFloat(bulk.minutes.value);
    if (!(minutes >= 0)) {
      bulkSay("bulk-result refused", "Give a number of minutes, 0 or more.");
      return;
    }
    bulk.go.hidden = true;
    bulkSay("bulk-result pending", "looking…");
    let data = null;
    let response;
    try {
      response = await fetch(`${BASE}api/gpucleanup/park-idle?min_idle_s=${minutes * 60}`,
        { credentials: "same-origin", headers: { Accept: "application/json" } });
      data = await response.json();
    } catch (error) {
      bulkSay("bulk-result refused", `The server did not answer: ${error.message}`);
      return;
    }
    if (!response.ok) {
      bulkSay("bulk-result refused", `Failed (HTTP ${response.status}): ${(data && data.message) || ""}`);
      return;
    }
    bulk.list = data.kernels;
    const names = (k) => k.notebook || `process ${k.pid}`;
    const items = el("ol", "bulk-list");
    for (const k of data.kernels) {
      const item = el("li", "bulk-item", `${names(k)} `, el("span", "muted", `(${k.owner || "?"}, idle ${formatDuration(k.idle_s)}) `),
        formatBytes(k.bytes), el("output", "bulk-outcome"));
      item.dataset.id = k.id;
      items.appendChild(item);
    }
    const left = el("ul", "bulk-left");
    for (const k of data.refused) {
      left.appendChild(el("li", null, `${names(k)} (idle ${formatDuration(k.idle_s)}, ${formatBytes(k.bytes)}): not parked: `,
        el("span", "reasons", k.reasons.join("; "))));
    }
    const count = data.kernels.length === 1 ? "1 kernel" : `${data.kernels.length} kernels`;
    const summary = el("p", "bulk-summary", data.kernels.length
      ? `Parking ${count} idle for more than ${formatDuration(minutes * 60)} would give back ${formatBytes(data.bytes)} of GPU memory:`
      : `No kernel that can be parked has been idle for more than ${formatDuration(minutes * 60)}.`);
    bulkSay("bulk-result", summary, data.kernels.length ? items : null,
      data.refused.length ? el("p", "muted", "Idle that long, and left as they are:") : null, data.refused.length ? left : null);
    bulk.go.hidden = !data.kernels.length;
    bulk.cancel.hidden = false;
  }

  async function parkThem() {
    if (!bulk.list || bulk.running) return;
    bulk.running = true;
    bulk.go.hidden = true;
    bulk.preview.disabled = true;
    const progress = el("p", "bulk-progress pending");
    bulk.box.appendChild(progress);
    let given = 0, done = 0, refused = 0;
    for (const [n, k] of bulk.list.entries()) {
      progress.textContent = `parking ${n + 1} of ${bulk.list.length}…`;
      const got = await post(k, "park");
      const item = bulk.box.querySelector(`li.bulk-item[data-id="${CSS.escape(k.id)}"] output`);
      const ok = got.kind === "ok" && got.data && got.data.ok;
      if (ok) {
        done += 1;
        const moved = got.data.outcome && got.data.outcome.parked_bytes;
        given += typeof moved === "number" ? moved : 0;
      } else {
        refused += 1;
      }
      if (item) {
        item.className = `bulk-outcome ${ok ? "ok" : "refused"}`;
        item.textContent = ` · ${ok ? got.data.message : got.words}`;
      }
    }
    progress.className = `bulk-progress ${refused ? "warn" : "ok"}`;
    progress.textContent = `Done at ${clock(Date.now() * 1e6)}: ${done} parked, ${formatBytes(given)} given back` +
      (refused ? `; ${refused} not parked (said above)` : "");
    bulk.running = false;
    bulk.preview.disabled = false;
    bulk.list = null;
    refreshSoon(0);
  }

  bulk.preview.addEventListener("click", preview);
  bulk.go.addEventListener("click", parkThem);
  bulk.cancel.addEventListener("click", () => {
    if (bulk.running) return;
    bulk.list = null;
    bulk.box.hidden = true;
    bulk.go.hidden = true;
    bulk.cancel.hidden = true;
  });

  // ------------------------------------------------------------------ the whole page

  function render(data) {
    lastData = data;
    renderGpus(data);
    renderRows(data);
    empty.hidden = data.kernels.length !== 0;
    const count = data.kernels.length === 1 ? "1 kernel" : `${data.kernels.length} kernels`;
    let words = `${count} · updated ${clock(data.time_ns)} · every ${formatDuration(REFRESH_MS / 1000)}`;
    if (data.skipped.length) {
      words += ` · ${data.skipped.length} discovery file(s) skipped: ` + data.skipped.map((s) => `${s.path} (${s.why})`).join("; ");
    }
    updated.textContent = words;
  }

  for (const th of document.querySelectorAll("th[data-sort]")) {
    th.addEventListener("click", () => {
      sortOrder = th.dataset.sort;
      refreshSoon(0);
    });
  }

  function say(words) {
    problem.hidden = !words;
    problem.textContent = words || "";
  }

  async function refresh() {
    if (inFlight) return;
    inFlight = true;
    const open = [...shown.values()].filter((v) => v.open).map((v) => v.entry.id);
    const asked = sortOrder; // a click while this request runs sorts the next one
    const url = `${API}?sort=${asked}&cards=${open.map(encodeURIComponent).join(",")}`;
    try {
      const response = await fetch(url, { credentials: "same-origin", headers: { Accept: "application/json" } });
      if (response.status === 403) {
        say("Not logged in to this Jupyter server any more: open it again with its token, then reload this page.");
      } else if (!response.ok) {
        say(`Could not refresh at ${clock(Date.now() * 1e6)}: HTTP ${response.status}.`);
      } else {
        const data = await response.json();
        shownSort = asked;
        render(data);
        say("");
      }
    } catch (error) {
      say(`Could not reach the Jupyter server at ${clock(Date.now() * 1e6)} (${error.message}); the figures below are older.`);
    } finally {
      inFlight = false;
      refreshSoon(sortOrder === asked ? REFRESH_MS : 0); // a sort asked for meanwhile: at once
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
