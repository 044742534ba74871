"""What the user reads: the summary line after a cell, the %gpumem tables (text and HTML), units.

Everything here is a pure function of the records the extension builds (plain
dicts with exact bytes, ``share/schema/cell_record.schema.json``), so it is tested without a GPU and
without a shell. Numbers shown to a user are rounded for reading and carry a
unit (``6.0 GiB``, ``512 MiB``, ``4 ms``); ``--json`` output keeps exact bytes.
"""

from __future__ import annotations

import html
import json
import os
import re
import sys
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence

from ..units import _number, _unit_for, count_of, format_bytes, format_duration, format_in_unit, format_pair  # noqa: F401

__all__ = [
    "PREFIX",
    "drained_text",
    "drain_kernel_notes",
    "format_bytes",
    "format_duration",
    "short_device_name",
    "summary_lines",
    "progress_line",
    "Table",
    "Report",
    "memory_report",
    "history_report",
    "vars_report",
    "JSONReport",
]

from ..say import PREFIX, SEP, printable, say  # noqa: F401  (the prefix is written once, in say.py)


_VENDOR = {"nvidia", "tesla", "geforce", "quadro"}
_DETAIL = re.compile(r"^(\d+\s*[GT]B|PCIe|SXM\d*|HBM\w*|NVL\d*|NVLink|MIG|with|Max-Q|\d+GB\w*)$", re.IGNORECASE)


def short_device_name(name: Optional[str]) -> str:
    """``NVIDIA H100 80GB HBM3`` → ``H100``; ``NVIDIA A100-SXM4-80GB`` → ``A100``;
    ``NVIDIA GeForce RTX 4090`` → ``RTX 4090``. Unknown shapes are kept as they are."""
    if not name:
        return ""
    words = []
    for word in name.split():
        if not words and word.lower() in _VENDOR:
            continue
        parts = word.split("-")
        if len(parts) > 1 and all(_DETAIL.match(p) for p in parts[1:]):
            word = parts[0]
            words.append(word)
            break
        if _DETAIL.match(word):
            break
        words.append(word)
    return " ".join(words) or name


def _device_label(dev: dict) -> str:
    label = f"GPU{dev.get('index', '?')}"
    short = short_device_name(dev.get("name"))
    return f"{label} {short}" if short else label


def _parts(amounts: dict, unit_of: int) -> str:
    """``cupy 5.5, torch 0.5`` in the unit of ``unit_of``; tiny parts with their own unit."""
    items = [(k, v) for k, v in amounts.items() if v]
    items.sort(key=lambda kv: -kv[1])
    out = []
    for name, value in items:
        shown = format_in_unit(value, unit_of)
        if unit_of >= (1 << 10) and float(shown) == 0.0:
            shown = format_bytes(value)
        out.append(f"{name} {shown}")
    return ", ".join(out)


def _sum(d: Optional[dict]) -> int:
    return sum(int(v or 0) for v in (d or {}).values())


def progress_line(device: int, waited_s: float) -> str:
    """``gpucleanup · waiting for GPU0 to finish queued work … 5 s``."""
    return f"{PREFIX}{SEP}waiting for GPU{device} to finish queued work … {int(waited_s)} s"


def _until(record: Optional[dict]) -> str:
    """Until when a deferred release keeps what a cell cached (release "idle" or "rerun")."""
    return "until idle or another cell" if (record or {}).get("release") == "rerun" else "until idle"


def _when(job: dict) -> str:
    """When a deferred release ran: the kernel stayed idle, or another cell began (release "rerun")."""
    cell = job.get("cell")
    if job.get("when") == "cell":
        return f"left by [{cell}]" if cell is not None else "left by the last cell"
    return "when idle"


def _released_later(record: dict, dev: dict) -> List[str]:
    """What releases deferred by earlier cells gave back on this device since the last line (the kernel
    stayed idle, or this cell started: release "idle" and "rerun")."""
    segs = []
    for job in record.get("idle") or []:
        for entry in job.get("devices") or []:
            total = _sum(entry.get("freed_bytes"))
            if entry.get("index") == dev.get("index") and total:
                segs.append(f"freed {format_bytes(total)} {_when(job)} ({_parts(entry['freed_bytes'], total)})")
    return segs


def _pinned_segment(pinned: dict, record: Optional[dict] = None) -> Optional[str]:
    segs = []
    now = _sum(pinned.get("freed_bytes"))
    if now:
        segs.append(f"pinned {format_bytes(now)}")
    for done in pinned.get("background", []):
        freed = _sum(done.get("freed_bytes"))
        if freed:
            segs.append(f"pinned {format_bytes(freed)} freed in background")
    if pinned.get("pending"):
        segs.append("pinned release running in background")
    for job in (record or {}).get("idle") or []:
        freed = _sum(job.get("pinned_freed_bytes"))
        if freed:
            segs.append(f"pinned {format_bytes(freed)} {_when(job)} freed" if job.get("when") == "cell"
                        else f"pinned {format_bytes(freed)} freed {_when(job)}")
    deferred = (record or {}).get("deferred") or {}
    if deferred.get("pinned"):
        held = sum(int((p or {}).get("cached_bytes") or 0) for p in (pinned.get("pools") or {}).values())
        segs.append(f"pinned {format_bytes(held)} cached {_until(record)}" if held
                    else "pinned pools given back once idle" + (
                        " or as another cell starts" if (record or {}).get("release") == "rerun" else ""))
    return SEP.join(segs) if segs else None


# A settle shorter than this is not worth a word in the summary line.
QUEUED_WORK_NOTICE_S = 0.1
# A cell's growth of memory outside every pool is said from this size on (record.py: the engine's show
# policy uses the same figure).
from .record import OUTSIDE_NOTICE_BYTES  # noqa: E402


def _device_line(dev: dict, record: dict, pinned: Optional[str]) -> str:
    segs = [PREFIX, _device_label(dev)]
    state = dev.get("state")
    settle = dev.get("settle") or {}
    if state == "busy":
        waited = settle.get("busy_for_s") or settle.get("waited_s")
        if settle.get("status") == "still_busy":
            segs.append(f"still busy with queued work ({format_duration(waited)}): skipped, nothing freed")
        else:
            segs.append(f"busy after {format_duration(waited)}: skipped freeing, queued work keeps running")
    elif state == "interrupted":
        segs.append("interrupted (Ctrl-C): cleanup stopped, nothing more freed")
    else:
        freed = dev.get("freed_bytes") or {}
        total = _sum(freed)
        if total:
            segs.append(f"freed {format_bytes(total)} ({_parts(freed, total)})")
        elif not _released_later(record, dev):
            segs.append("freed 0 B")
        # work the cell left queued, waited for before freeing: said when it is worth noticing
        waited = settle.get("waited_s") or 0.0
        if settle.get("status") == "done" and waited >= QUEUED_WORK_NOTICE_S:
            segs.append(f"waited {format_duration(waited)} for queued work")
    segs.extend(_released_later(record, dev))
    if pinned:
        segs.append(pinned)
    growth = dev.get("outside_growth_bytes")
    traced = traced_text(record.get("traced"), dev.get("index"))
    outside = dev.get("outside_bytes")
    if dev.get("first_use") and outside is not None:
        # no context before the cell: all of it came with this cell, the context included
        why = traced or f"the CUDA context, library code, raw allocations, or another process on GPU{dev.get('index')}"
        what = "a context no array uses, " if dev.get("context_only") else ""
        segs.append(f"first use of GPU{dev.get('index')}: {what}{format_bytes(outside)} outside every pool ({why})")
    elif growth is not None and growth >= OUTSIDE_NOTICE_BYTES:
        why = traced or (f"library code and handles, raw allocations, or another process on GPU{dev.get('index')}")
        segs.append(f"+{format_bytes(growth)} outside every pool in this cell ({why})")
    elif traced and sum(int(e.get("bytes") or 0) for e in record.get("traced") or []) >= OUTSIDE_NOTICE_BYTES:
        segs.append(f"traced {traced}")
    live = dev.get("live_bytes") or {}
    live_total = _sum(live)
    if live:
        names = ", ".join(k for k, v in sorted(live.items(), key=lambda kv: -kv[1]) if v)
        segs.append(f"kept {format_bytes(live_total)} live" + (f" ({names})" if names else "")
                    + _hidden_text(record.get("hidden"), dev.get("index")))
    cached = {k: v for k, v in (dev.get("cached_bytes") or {}).items() if v}
    if cached:
        cached_total = _sum(cached)
        if (record.get("deferred") or {}).get("device"):
            # release "idle" ("rerun"): the caches stay for a next cell (a re-run), and go once the kernel is idle
            segs.append(f"cached {format_bytes(cached_total)} {_until(record)} ({_parts(cached, cached_total)})")
        else:
            segs.append(f"held {format_bytes(cached_total)} cached ({_parts(cached, cached_total)})")
    segs.extend(_reserved_segments(dev, record))
    if dev.get("total_bytes") is not None or dev.get("used_after_bytes") is not None:
        segs.append(f"device {format_pair(dev.get('used_after_bytes'), dev.get('total_bytes'))}")
    segs.append(format_duration(record.get("elapsed_s")))
    return SEP.join(segs)


def _reserved_segments(dev: dict, record: dict) -> List[str]:
    """``reserved by jax 104.8 GiB (not freeable: XLA_PYTHON_CLIENT_PREALLOCATE=false before import)``:
    memory a framework's pool never gives back, never called cached; what to set, the first time."""
    fixes = record.get("reserved_fix") or {}
    out = []
    for name, n in sorted((dev.get("reserved_bytes") or {}).items(), key=lambda kv: -kv[1]):
        if n:
            fix = fixes.get(name)
            out.append(f"reserved by {name} {format_bytes(n)}" + (f" (not freeable: {fix})" if fix else ""))
    return out


def _hidden_text(hidden: Optional[Sequence[dict]], index: Any) -> str:
    """``: Out[5] 1.0 GiB, traceback of cell [7] 4.0 GiB (fit: batch)``: what holds live memory
    where no variable names it, largest first (at most three holders, two names each)."""
    groups: Dict[str, List[dict]] = {}
    for entry in hidden or []:
        if entry.get("device") not in (f"GPU{index}", None, "GPU?"):
            continue
        groups.setdefault(str(entry.get("held_by")), []).append(entry)
    if not groups:
        return ""
    parts = []
    for held_by, entries in sorted(groups.items(), key=lambda kv: -sum(int(e.get("bytes") or 0) for e in kv[1]))[:3]:
        text = f"{held_by} {format_bytes(sum(int(e.get('bytes') or 0) for e in entries))}"
        if held_by.startswith("traceback"):
            names = [str(e.get("name")) for e in sorted(entries, key=lambda e: -int(e.get("bytes") or 0))]
            text += f" ({', '.join(names[:2])}{', …' if len(names) > 2 else ''})"
        parts.append(text)
    return ": " + ", ".join(parts)


#: NVIDIA's libraries whose own allocations (workspaces, handles) a trace names by library
CUDA_LIBRARIES = ("libcublas", "libcudnn", "libcufft", "libcusolver", "libcusparse", "libcurand", "libnccl", "libnvrtc")


def traced_text(entries: List[dict], index: Any) -> Optional[str]:
    """``320 MiB in 5 allocations from <cell 3>:2 worker() on 5 threads, never freed``: the largest
    raw allocations of a cell on one device that are still alive (at most two sites)."""
    mine = [e for e in entries or [] if e.get("device") in (index, -1, None)]
    if not mine:
        return None
    mine.sort(key=lambda e: -int(e.get("bytes") or 0))
    parts = []
    for e in mine[:2]:
        count = int(e.get("count") or 0)
        threads = int(e.get("threads") or 0)
        where = (f"from {e['site']}" if e.get("site")
                 else f"by {e.get('caller') or 'unknown code'} (no Python line: the call released the interpreter lock)")
        if e.get("site") and str(e.get("caller") or "").startswith(CUDA_LIBRARIES):
            where += f" through {e['caller']} (the library's own workspace or handle)"
        text = f"{format_bytes(int(e.get('bytes') or 0))} in {count} allocation{'s' if count != 1 else ''} {where}"
        if threads > 1:
            text += f" on {threads} threads"
        parts.append(text)
    more = len(mine) - 2
    return ", ".join(parts) + (f" and {more} more site{'s' if more != 1 else ''}" if more > 0 else "") + ", never freed"


#: the metadata key that marks gpucleanup's own outputs (and the output tag nbconvert's
#: TagRemovePreprocessor.remove_single_output_tags can drop them by)
OUTPUT_TAG = "gpucleanup"


def line_bundle(lines: Sequence[str]) -> dict:
    """The summary lines as a display output's data: the text, and a small HTML form of it."""
    text = "\n".join(lines)
    body = "<br>".join(html.escape(line) for line in lines)
    return {"text/plain": text,
            "text/html": f'<div class="gpucleanup-line" style="font-family: monospace; font-size: smaller; '
                         f'opacity: 0.75">{body}</div>'}


def line_metadata(cell: Optional[int] = None) -> dict:
    """What names a display output as gpucleanup's: ``{"gpucleanup": {"kind": "after_cell", "cell": N},
    "tags": ["gpucleanup"]}``."""
    return {OUTPUT_TAG: {"kind": "after_cell", "cell": cell}, "tags": [OUTPUT_TAG]}


def unusable_sentence(dev: dict) -> str:
    return f"GPU{dev.get('index', '?')} is unusable: restart the kernel"


def summary_lines(record: dict) -> list[str]:
    """The lines printed after a cell: one per device touched, then new notes.

    The pinned host segment (host-wide, not per device) goes on the first line.
    """
    lines = []
    pinned = _pinned_segment(record.get("pinned") or {}, record)
    devices = [d for d in record.get("devices", []) if not d.get("quiet")]
    first = True
    for dev in devices:
        if dev.get("state") == "unusable":
            # said once, as the driver words it: "GPU0 is unusable after ...: restart the kernel"
            lines.append(f"{PREFIX}{SEP}{dev.get('message') or unusable_sentence(dev)}")
            continue
        lines.append(_device_line(dev, record, pinned if first else None))
        first = False
    if not devices and pinned:
        lines.append(SEP.join([PREFIX, pinned, format_duration(record.get("elapsed_s"))]))
    if record.get("interrupted") and not any(d.get("state") == "interrupted" for d in devices):
        lines.append(f"{PREFIX}{SEP}interrupted (Ctrl-C): cleanup stopped")
    for note in record.get("shown_notes", []):
        lines.append(f"{PREFIX}{SEP}{note}")
    return lines


# ---------------------------------------------------------------- tables


class Table:
    """A titled table that renders as aligned text and as HTML."""

    def __init__(
        self, title: str, headers: Sequence[str], rows: Iterable[Sequence[Any]], notes: Sequence[str] = (), align: str = "",
        rule: bool = True,
    ):
        """``align``: one letter per column, ``l`` or ``r``; default: a left label, then numbers on the right.
        ``rule``: a dashed line under the headers in the text form. An empty title prints no title line."""
        self.title = title
        self.headers = [str(h) for h in headers]
        # a cell may hold a worker's address, a kernel's reply or a device name: one line, nothing for a terminal
        self.rows = [[("" if c is None else printable(c)) for c in row] for row in rows]
        self.notes = list(notes)
        self.align = align or "l" + "r" * (len(self.headers) - 1)
        self.rule = rule

    def _left(self, i: int) -> bool:
        return i >= len(self.align) or self.align[i] == "l"

    def text(self, paint: Optional[Callable[[int, int, str, str], str]] = None) -> str:
        """Aligned text. ``paint(row, column, value, padded)`` may wrap a padded body cell in terminal colour
        codes (the widths are measured before, so colour never shifts a column)."""
        widths = [len(h) for h in self.headers]
        for row in self.rows:
            for i, cell in enumerate(row):
                widths[i] = max(widths[i], len(cell))

        def fmt(row: Sequence[str], r: int = -1) -> str:
            cells = []
            for i, cell in enumerate(row):
                # first column is a label (left), the others are numbers (right)
                padded = cell.ljust(widths[i]) if self._left(i) else cell.rjust(widths[i])
                if i == len(row) - 1:
                    padded = padded.rstrip()
                cells.append(paint(r, i, cell, padded) if paint is not None and r >= 0 and cell else padded)
            return "  ".join(cells).rstrip()

        lines = [self.title] if self.title else []
        if self.headers:
            lines.append(fmt(self.headers))
            if self.rule:
                lines.append("  ".join("-" * w for w in widths))
        lines.extend(fmt(row, r) for r, row in enumerate(self.rows))
        lines.extend(f"  {n}" for n in self.notes)
        return "\n".join(lines)

    def html(self) -> str:
        esc = html.escape
        out = [f"<table class='gpucleanup'><caption style='text-align:left'><b>{esc(self.title)}</b></caption>"]
        if self.headers:
            out.append("<thead><tr>" + "".join(f"<th>{esc(h)}</th>" for h in self.headers) + "</tr></thead>")
        out.append("<tbody>")
        for row in self.rows:
            cells = []
            for i, cell in enumerate(row):
                align = "left" if self._left(i) else "right"
                cells.append(f"<td style='text-align:{align}'>{esc(cell)}</td>")
            out.append("<tr>" + "".join(cells) + "</tr>")
        out.append("</tbody></table>")
        if self.notes:
            out.append("<ul>" + "".join(f"<li>{esc(n)}</li>" for n in self.notes) + "</ul>")
        return "".join(out)


class Report:
    """What %gpumem displays: rich frontends take ``_repr_html_``, terminals the text repr."""

    def __init__(self, tables: Sequence[Table], lines: Sequence[str] = ()):
        self.tables = list(tables)
        self.lines = list(lines)

    def text(self) -> str:
        parts = list(self.lines) + [t.text() for t in self.tables]
        return "\n\n".join(parts) if self.tables else "\n".join(parts)

    def __repr__(self) -> str:
        return self.text()

    def _repr_pretty_(self, p, cycle):
        p.text(self.text())

    def _repr_html_(self) -> str:
        head = "".join(f"<div>{html.escape(line)}</div>" for line in self.lines)
        return "<div class='gpucleanup-report'>" + head + "".join(t.html() for t in self.tables) + "</div>"


class JSONReport(dict):
    """The ``--json`` result: a dict (assign it: ``d = %gpumem --json``) shown as JSON text."""

    def text(self) -> str:
        return json.dumps(self, indent=1, sort_keys=True, default=str)

    def __repr__(self) -> str:
        return self.text()

    def _repr_pretty_(self, p, cycle):
        p.text(self.text())


def _fw_total(entry: dict) -> int:
    return (int(entry.get("live_bytes") or 0) + int(entry.get("cached_bytes") or 0)
            + int(entry.get("reserved_bytes") or 0))


def memory_report(status: dict, history_rows: int = 5) -> Report:
    """The %gpumem tables from the status dict the extension builds (exact bytes in, rounded out)."""
    lines = []
    driver = status.get("driver") or {}
    state = driver.get("state")
    if state != "ready":
        lines.append(f"{PREFIX}{SEP}{driver_sentence(driver)}")
    if not status.get("enabled", True):
        lines.append(f"{PREFIX}{SEP}automatic cleanup is off (%gpumem --on resumes it)")
    tables = []
    for dev in status.get("devices", []):
        total = dev.get("total_bytes")
        rows = [["total", format_bytes(total), ""], ["used (device, all processes)", format_bytes(dev.get("used_bytes")), ""]]
        frameworks = dev.get("frameworks") or {}
        # a framework whose pool never gives memory back: its own column, never "cached"
        reserved = {n: int(e.get("reserved_bytes") or 0) for n, e in frameworks.items() if e.get("reserved_bytes")}
        for name, entry in sorted(frameworks.items()):
            rows.append([f"{name}", format_bytes(entry.get("live_bytes")), format_bytes(entry.get("cached_bytes"))])
            if reserved:
                rows[-1].append(format_bytes(reserved[name]) if name in reserved else "")
            # a framework with pools of its users' own (PyCUDA): one row each, under it
            for pool in (status.get("framework_pools") or {}).get(name, []):
                if pool.get("device") != dev.get("index"):
                    continue
                where = "" if pool.get("drained_here") else f", thread {pool.get('thread')}: not drained here"
                rows.append([f"  {pool.get('pool')}{where}", format_bytes(pool.get("live_bytes")),
                             format_bytes(pool.get("cached_bytes"))] + ([""] if reserved else []))
        for pool in dev.get("pools") or []:
            rows.append(
                [f"driver pool ({pool.get('which')})", format_bytes(pool.get("used_bytes")), format_bytes(pool.get("reserved_bytes"))]
                + ([""] if reserved else [])
            )
        since = dev.get("outside_since_load_bytes")
        rows.append(["outside every pool", format_bytes(dev.get("outside_bytes"))
                     + (f" ({'+' if since >= 0 else '-'}{format_bytes(abs(since))} since load)" if since else ""), ""]
                    + ([""] if reserved else []))
        notes = ["frameworks: live (held by objects) / cached (freeable); driver pools: used / reserved."]
        fixes = status.get("reserved_fix") or {}
        for name in sorted(reserved):
            notes.append(f"not freeable: {name}'s pool never gives memory back"
                         + (f" ({fixes[name]})." if fixes.get(name) else "."))
        if frameworks and not any(_fw_total(e) for e in frameworks.values()):
            notes.append(f"no array of {', '.join(sorted(frameworks))} is on GPU{dev.get('index')}: what it uses is a "
                         "CUDA context (and libraries') made without an array, or raw allocations.")
        notes.append(
            "outside every pool = device used - everything known: the CUDA context (~500 MiB), "
            "other processes on this GPU and raw allocations are in it."
        )
        if dev.get("message"):
            notes.append(dev["message"])
        title = f"{_device_label(dev)} — {format_pair(dev.get('used_bytes'), total)} used"
        headers = ["", "live / used", "cached / reserved"] + (["not freeable"] if reserved else [])
        tables.append(Table(title, headers, rows, notes))
    pinned = status.get("pinned") or {}
    if pinned:
        rows = [[name, format_bytes(e.get("live_bytes")), format_bytes(e.get("cached_bytes"))] for name, e in sorted(pinned.items())]
        tables.append(Table("pinned host memory pools", ["", "live", "cached"], rows))
    if not status.get("devices") and state == "ready":
        lines.append(f"{PREFIX}{SEP}no GPU in use by this kernel")
    history = status.get("history") or []
    if history_rows and history:
        tables.append(history_table(history[-history_rows:], title="last cells"))
    notes = status.get("notes") or []
    lines.extend(f"{PREFIX}{SEP}{n}" for n in notes)
    return Report(tables, lines)


class CellVoice:
    """What the after-cell engine says, rendered here: the engine decides whether a cell's summary is shown (its
    show policy) and hands over the record's data; this turns it into lines, and writes the progress line of a
    wait and the one sentence about an unusable driver through ``write`` (stdout when None)."""

    def __init__(self, write: Optional[Callable[[str], None]] = None):
        self.write = write or _write_stdout

    def progress(self, device: int, waited_s: float, again: bool) -> None:
        """The progress line of a native wait, rewritten in place (``again``) as the wait goes on."""
        self.write(("\r" if again else "") + progress_line(device, waited_s))

    def progress_end(self) -> None:
        self.write("\n")

    def driver_unusable(self, driver: dict) -> None:
        self.write(f"{say('the CUDA driver is unusable: ' + str(driver.get('message')))}\n")

    def nothing_in_use(self, driver: dict) -> List[str]:
        """A ``%gpumem --drain`` with nothing to clean: why, in one line."""
        why = driver_sentence(driver) if driver.get("state") != "ready" else "no GPU in use by this kernel: nothing to clean"
        return [say(why)]

    def summary(self, data: dict, shown: bool) -> List[str]:
        """A cell's lines: the summary when ``shown``; else a sticky error, said once even when summaries are
        off, as the one sentence it is."""
        first_sticky = [d for d in data["devices"] if d["state"] == "unusable" and not d["quiet"]]
        if shown:
            return summary_lines(data)
        return [say(d["message"] or unusable_sentence(d)) for d in first_sticky]


def _write_stdout(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


def driver_sentence(driver: dict) -> str:
    state = driver.get("state")
    if state == "no_driver":
        return "no CUDA driver: nothing to clean"
    if state == "not_initialized":
        return "CUDA is not initialised in this kernel: nothing to clean"
    if state == "exiting":
        return "the kernel is exiting"
    message = driver.get("message")
    if isinstance(message, str) and message.startswith("[gpucleanup.python."):
        # gpucleanup's own library, not the driver, is what could not be used
        return f"gpucleanup's native library could not be loaded: {message}"
    return f"CUDA driver unusable: {message}" if message else f"CUDA driver state: {state}"


def history_table(records: Sequence[dict], title: str = "history") -> Table:
    rows = []
    for rec in records:
        devices = rec.get("devices") or []
        freed = sum(_sum(d.get("freed_bytes")) for d in devices)
        pinned = rec.get("pinned") or {}
        pinned_freed = _sum(pinned.get("freed_bytes")) + sum(_sum(b.get("freed_bytes")) for b in pinned.get("background", []))
        used = ", ".join(
            f"GPU{d.get('index')} {format_pair(d.get('used_after_bytes'), d.get('total_bytes'))}" for d in devices
        )
        states = sorted({d.get("state") for d in devices if d.get("state") not in (None, "drained")})
        growths = [d.get("outside_growth_bytes") for d in devices if d.get("outside_growth_bytes") is not None]
        outside = _signed_bytes(sum(growths)) if growths else "-"
        rows.append(
            [
                _history_label(rec),
                format_bytes(freed),
                format_bytes(pinned_freed),
                (rec.get("gc") or {}).get("ran") or "-",
                used or "-",
                outside,
                ", ".join(states) or "ok",
                format_duration(rec.get("elapsed_s")),
            ]
        )
    return Table(title, ["cell", "freed", "pinned", "gc", "device used", "outside pools", "state", "time"], rows,
                 align="lrrllrll")


def _history_label(rec: dict) -> str:
    """A record's first column: its cell (``[3]``), else what it was: a drain from outside (``gpucleanup drain``,
    the page's Drain) or ``%gpumem --drain`` run on its own."""
    if rec.get("cell") is not None:
        return f"[{rec.get('cell')}]"
    return "outside drain" if rec.get("source") == "outside" else "drain"


def _history_title(records: Sequence[dict]) -> str:
    """``last 3 cells``, ``last 3 cells and 1 drain``: drains (no cell) are counted apart, never as cells."""
    cells = sum(1 for rec in records if rec.get("cell") is not None)
    drains = len(records) - cells
    if not drains:
        return f"last {count_of(cells, 'cell')}"
    if not cells:
        return f"last {count_of(drains, 'drain')}"
    return f"last {count_of(cells, 'cell')} and {count_of(drains, 'drain')}"


def _signed_bytes(n: int) -> str:
    """A growth: ``+320 MiB``, ``-64 MiB``, ``0 B``."""
    if n > 0:
        return "+" + format_bytes(n)
    if n < 0:
        return "-" + format_bytes(-n)
    return format_bytes(0)


def trace_report(data: dict) -> Report:
    """``%gpumem --trace``: the live traced allocations, largest first, by site."""
    groups = data.get("groups") or []
    if not data.get("active") and not groups:
        why = data.get("refused")
        return Report([], [f"{PREFIX}{SEP}the allocation trace is off" + (f" ({why})" if why else "")
                           + ": %gpumem --trace on starts it"])
    rows = []
    for g in groups:
        threads = int(g.get("thread_count") or 0)
        rows.append([
            g.get("site") or "(no Python line)",
            os.path.basename(g.get("caller") or "") or "?",
            "raw" if g.get("raw") else f"{g.get('framework') or 'driver'} pool",
            f"GPU{g.get('device')}" if (g.get("device") or 0) >= 0 else "?",
            str(g.get("kind") or ""),
            f"[{g.get('cell')}]" if (g.get("cell") if g.get("cell") is not None else -1) >= 0 else "-",
            str(g.get("count") or 0),
            str(threads),
            format_bytes(int(g.get("bytes") or 0)),
        ])
    state = "on" if data.get("active") else "off (what it recorded before it stopped)"
    lines = [f"{PREFIX}{SEP}allocation trace {state}: {format_bytes(int(data.get('live_bytes') or 0))} live in "
             f"{data.get('live_allocations') or 0} traced allocations"]
    if data.get("dropped"):
        lines.append(f"{PREFIX}{SEP}{data['dropped']} allocations were not recorded (over a million live at once)")
    table = Table("traced allocations still alive",
                  ["site", "library", "memory of", "device", "call", "cell", "allocations", "threads", "bytes"],
                  rows, align="llllllrrr")
    return Report([table], lines)


def dask_report(workers: Dict[str, dict]) -> Report:
    """``%gpumem --dask``: one row per worker and GPU in use."""
    rows = []
    lines = []
    for address, w in sorted((workers or {}).items()):
        memory = w.get("memory") or {}
        state = ("busy" if w.get("busy") else "idle") if w.get("plugin") else "no plugin"
        devices = memory.get("devices") or []
        if not devices:
            driver = (memory.get("driver") or {}).get("state")
            rows.append([address, "-", "-", "-", "-", format_bytes(w.get("freed_since_last_look_bytes"))
                         if w.get("plugin") else "-", str(w.get("cleanups", "-")),
                         state + ("" if driver in (None, "ready", "not_initialized") else f", driver {driver}")])
            continue
        for dev in devices:
            live = sum(int(e.get("live_bytes") or 0) for e in (dev.get("frameworks") or {}).values())
            cached = sum(int(e.get("cached_bytes") or 0) for e in (dev.get("frameworks") or {}).values())
            cached += sum(max(0, int(p.get("reserved_bytes") or 0) - int(p.get("used_bytes") or 0))
                          for p in dev.get("pools") or [])
            rows.append([address, f"GPU{dev.get('index')} {short_device_name(dev.get('name'))}".rstrip(),
                         format_pair(dev.get("used_bytes"), dev.get("total_bytes")), format_bytes(live),
                         format_bytes(cached), format_bytes(w.get("freed_since_last_look_bytes"))
                         if w.get("plugin") else "-", str(w.get("cleanups", "-")), state])
        for note in memory.get("notes") or []:
            lines.append(f"{PREFIX}{SEP}{printable(address)}: {printable(note)}")
    if not rows:
        return Report([], [f"{PREFIX}{SEP}the Dask client has no workers"])
    table = Table("Dask workers", ["worker", "GPU", "device used", "live", "cached", "freed since last look",
                                   "cleanups", "state"], rows, align="llrrrrrl")
    if any(not w.get("plugin") for w in (workers or {}).values()):
        lines.append(f"{PREFIX}{SEP}workers without gpucleanup's plugin are only read: %gpumem --dask on registers it")
    return Report([table], lines)


def dask_drain_lines(drained: Dict[str, dict]) -> List[str]:
    """What ``%gpumem --dask --drain`` did on each worker."""
    out = []
    for address, d in sorted((drained or {}).items()):
        if d.get("skipped"):
            out.append(f"{PREFIX}{SEP}{printable(address)}: skipped ({printable(d['skipped'])})")
        elif d.get("error"):
            out.append(f"{PREFIX}{SEP}{printable(address)}: cleanup failed ({printable(d['error'])})")
        else:
            out.append(f"{PREFIX}{SEP}{printable(address)}: freed {format_bytes(int(d.get('freed_bytes') or 0))} "
                       f"({format_duration(d.get('elapsed_s'))})")
    return out


def history_report(records: Sequence[dict]) -> Report:
    if not records:
        return Report([], [f"{PREFIX}{SEP}no cell recorded yet"])
    return Report([history_table(records, title=_history_title(records))])


def vars_report(found: Sequence[dict], limit: int) -> Report:
    """The largest GPU arrays/tensors reachable from the user's namespace."""
    if not found:
        return Report([], [f"{PREFIX}{SEP}no GPU arrays or tensors in the namespace, the output cache or the last traceback"])
    top = sorted(found, key=lambda f: -int(f.get("bytes") or 0))[:limit]
    rows = [
        [f["name"], f.get("held_by", "variable"), f.get("kind", ""), "×".join(str(s) for s in f.get("shape") or ()) or "()",
         f.get("dtype", ""), f.get("device", ""), format_bytes(f.get("bytes"))]
        for f in top
    ]
    total = sum(int(f.get("bytes") or 0) for f in found)
    notes = [f"{count_of(len(found), 'object')}, {format_bytes(total)} in all; views of one buffer each count their own size."]
    hidden = sorted({f["held_by"] for f in found if f.get("held_by") not in (None, "variable")})
    if hidden:
        notes.append("held by " + ", ".join(hidden) + ": %gpumem --release out (the output cache) or --release "
                     "traceback (the last traceback's variables) lets them go")
    headers = ["name", "held by", "type", "shape", "dtype", "device", "bytes"]
    return Report([Table("GPU arrays and tensors the kernel keeps", headers, rows, notes, align="llllllr")])


# ---------------------------------------------------------------- a drain from outside (gpucleanup drain, the page)


def _kernel_part(result: dict) -> dict:
    part = result.get("kernel") if isinstance(result, dict) else None
    return part if isinstance(part, dict) else {}


def drained_text(result: dict, dev: dict) -> str:
    """``drained, released 1.5 GiB (cupy 1.0 GiB, torch 512 MiB)``: one drained device of a drain result, the
    library's trim of the driver's pools and what the kernel's own cleanup gave back there (its ``kernel``)."""
    freed: Dict[str, int] = {}
    for entry in _kernel_part(result).get("devices") or ():
        if isinstance(entry, dict) and entry.get("index") == dev.get("index"):
            for name, n in (entry.get("released_bytes") or {}).items():
                if isinstance(n, int) and not isinstance(n, bool) and n > 0:
                    freed[str(name)] = freed.get(str(name), 0) + n
    parts = dict(freed)
    trimmed = dev.get("released_bytes")
    if isinstance(trimmed, int) and trimmed > 0:
        parts["driver"] = parts.get("driver", 0) + trimmed
    text = f"drained, released {format_bytes(sum(parts.values()))}"
    if freed:
        named = sorted(parts.items(), key=lambda kv: (kv[0] == "driver", -kv[1]))
        text += " (" + ", ".join(f"{'driver pools' if name == 'driver' else name} {format_bytes(n)}"
                                 for name, n in named) + ")"
    if dev.get("message"):
        text += f" ({dev['message']})"
    return text


def drain_kernel_notes(result: dict) -> List[str]:
    """What a drain result says of the kernel's own cleanup beyond the devices: why it did not run, and the
    pinned host memory it gave back."""
    part = _kernel_part(result)
    notes = []
    if part.get("running"):
        notes.append(f"the kernel's own cleanup is still running ({part.get('doing') or 'no detail'}): it goes on by "
                     "itself, nothing to do; the kernel says draining until it ends, a cell or a park waits for it "
                     "(at most 10 s), and its last cell then shows what the drain freed")
    elif part.get("skipped"):
        notes.append(f"the kernel's own cleanup did not run ({part['skipped']}): the frameworks' caches were left "
                     "as they are")
    elif part.get("error"):
        notes.append(f"the kernel's own cleanup failed ({part['error']}): the frameworks' caches may be left as "
                     "they are")
    pinned = {str(k): n for k, n in (part.get("pinned_released_bytes") or {}).items()
              if isinstance(n, int) and not isinstance(n, bool) and n > 0}
    if pinned:
        notes.append(f"released {format_bytes(sum(pinned.values()))} of pinned host memory ("
                     + ", ".join(f"{k} {format_bytes(n)}" for k, n in sorted(pinned.items(), key=lambda kv: -kv[1]))
                     + ")")
    return notes
