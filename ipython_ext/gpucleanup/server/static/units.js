// The units of gpucleanup/units.py (format_bytes, format_duration), for the page and the JupyterLab extension
// alike (labextension/ imports this file): 6.0 GiB, 512 MiB, 1.5 MiB, 8 B; 0.4 s, 31 s, 2 min 5 s.
export const UNITS = [["TiB", 2 ** 40], ["GiB", 2 ** 30], ["MiB", 2 ** 20], ["KiB", 2 ** 10]];

export function unitFor(n) {
  for (const [unit, size] of UNITS) if (n >= size) return [unit, size];
  return ["B", 1];
}

export function number(value, unit) {
  if (unit === "B") return String(Math.trunc(value));
  if (unit === "GiB" || unit === "TiB") return value.toFixed(1);
  return value >= 10 ? value.toFixed(0) : value.toFixed(1);
}

export function formatBytes(n) {
  if (n === null || n === undefined) return "?";
  const sign = n < 0 ? "-" : "";
  const [unit, size] = unitFor(Math.abs(n));
  return `${sign}${number(Math.abs(n) / size, unit)} ${unit}`;
}

// used/total in the unit of the total: 2.7/79.6 GiB
export function formatPair(used, total) {
  if (total === null || total === undefined) return formatBytes(used);
  if (used === null || used === undefined) return `?/${formatBytes(total)}`;
  const [unit, size] = unitFor(Math.abs(total));
  if (unit === "B") return `${used}/${total} B`;
  return `${number(used / size, unit)}/${formatBytes(total)}`;
}

export function formatDuration(seconds) {
  if (seconds === null || seconds === undefined) return "?";
  const s = Math.max(0, seconds);
  if (s < 1) return `${Math.round(s * 1000)} ms`;
  if (s < 10) return `${s.toFixed(1)} s`;
  if (s < 60) return `${s.toFixed(0)} s`;
  const whole = Math.round(s);
  const minutes = Math.floor(whole / 60), rest = whole % 60;
  return rest ? `${minutes} min ${rest} s` : `${minutes} min`;
}
