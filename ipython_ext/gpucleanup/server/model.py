"""What the REST API answers: one entry per kernel, from the server's kernels and the kernels' status replies.

Pure functions of plain data (no tornado, no jupyter_server), so the shape is tested on its own. The
handlers (``handlers.py``) collect the inputs: the kernels the Jupyter server runs (id, notebook path,
execution state, pid) and :func:`gpucleanup.outside.kernels.gather`'s views.

An entry (``GET /api/gpucleanup/kernels`` lists them)::

    {"id": "5f1c...",              # what the URLs take: the kernel id, or "pid-<pid>" when it has none
     "kernel_id": "5f1c..." | None, "notebook": "fit.ipynb" | None, "pid": 4242 | None,
     "server_kernel": True,        # one of this Jupyter server's kernels
     "execution_state": "idle",    # the server's view (None for kernels of another server)
     "gpucleanup": True,           # it has a discovery file: %load_ext gpucleanup ran in it
     "state": {"state": "running", "cell": 12, "age_s": 63.2, ...} | None,   # the status reply's
     "state_text": "running cell 12 for 1 min 3 s" | None,
     "driver_state": "ready" | ..., "devices": [kernels.device_rows(...)],
     "last_cells": [{"cell", "time_ns", "elapsed_s", "interrupted", "freed_bytes", "devices": [...]}],
     "timeline": timeline.series(...),
     "snapshot_status": "fresh" | "stale" | "unavailable" | None, "snapshot_age_s": ...,
     "error": "a sentence" | None, "error_kind": "no_answer" | "refused" | "bad_key" | "elsewhere" | None,
     "hint": "gpucleanup is not loaded in this kernel: run %load_ext gpucleanup in a cell" | None}
"""

from __future__ import annotations

import time
from typing import Dict, Iterable, List, Optional

from ..outside import kernels
from ..records import report, timeline

__all__ = ["LAST_CELLS", "NOT_LOADED", "entry_id", "state_text", "compact_cell", "assemble", "drain_lines"]

#: how many of the last cells an entry lists (the timeline has all of ``history``)
LAST_CELLS = 6

NOT_LOADED = "gpucleanup is not loaded in this kernel: run %load_ext gpucleanup in a cell"


def entry_id(kernel_id: Optional[str], pid: Optional[int]) -> str:
    """The key an entry goes by in URLs: the kernel id, else ``pid-<pid>``."""
    return kernel_id if kernel_id else f"pid-{pid}"


#: the kernel's state as ``gpucleanup ps`` says it
state_text = kernels.state_text


def compact_cell(record: dict) -> dict:
    """One cell's record, as much as a list of recent cells shows."""
    devices = []
    freed = 0
    for dev in record.get("devices") or ():
        if not isinstance(dev, dict):
            continue
        # with what releases deferred by earlier cells gave back since (release "rerun"): as the timeline counts it
        dev_freed = kernels.total(dev.get("freed_bytes")) + timeline.released_later(record, dev.get("index"))
        freed += dev_freed
        devices.append({
            "index": dev.get("index"),
            "state": dev.get("state"),
            "freed_bytes": dev_freed,
            "used_after_bytes": dev.get("used_after_bytes"),
            "live_bytes": kernels.total(dev.get("live_bytes")),
            "cached_bytes": kernels.total(dev.get("cached_bytes")),
            "outside_bytes": dev.get("outside_bytes"),
        })
    pinned = kernels.total((record.get("pinned") or {}).get("freed_bytes")) if isinstance(record.get("pinned"), dict) else 0
    pinned += sum(kernels.total(job.get("pinned_freed_bytes")) for job in record.get("idle") or () if isinstance(job, dict))
    return {
        "cell": record.get("cell"),
        "time_ns": record.get("time_ns"),
        "elapsed_s": record.get("elapsed_s"),
        "interrupted": bool(record.get("interrupted")),
        "freed_bytes": freed,
        "pinned_freed_bytes": pinned,
        "devices": devices,
    }


def _records(view: kernels.KernelView) -> List[dict]:
    if view.history:
        return [r for r in view.history if isinstance(r, dict)]
    last = (view.status or {}).get("last_record")
    return [last] if isinstance(last, dict) else []


def _blank(kernel_id: Optional[str], pid: Optional[int]) -> dict:
    return {
        "id": entry_id(kernel_id, pid),
        "kernel_id": kernel_id,
        "notebook": None,
        "pid": pid,
        "server_kernel": False,
        "execution_state": None,
        "gpucleanup": False,
        "state": None,
        "state_text": None,
        "driver_state": None,
        "devices": [],
        "last_cells": [],
        "timeline": timeline.series([]),
        "snapshot_status": None,
        "snapshot_age_s": None,
        "error": None,
        "error_kind": None,
        "hint": None,
    }


def _fill(entry: dict, view: kernels.KernelView) -> None:
    entry["gpucleanup"] = True
    entry["pid"] = view.pid
    entry["kernel_id"] = entry["kernel_id"] or view.kernel_id
    entry["id"] = entry_id(entry["kernel_id"], entry["pid"])
    entry["notebook"] = entry["notebook"] or view.notebook
    entry["error"], entry["error_kind"] = view.error, view.error_kind
    status = view.status
    if not isinstance(status, dict):
        return
    entry["state"] = status.get("state") if isinstance(status.get("state"), dict) else None
    entry["state_text"] = state_text(entry["state"])
    snapshot = status.get("snapshot") if isinstance(status.get("snapshot"), dict) else {}
    entry["driver_state"] = (snapshot.get("driver") or {}).get("state") if isinstance(snapshot.get("driver"), dict) else None
    entry["devices"] = kernels.device_rows(status)
    records = _records(view)
    entry["last_cells"] = [compact_cell(r) for r in records[-LAST_CELLS:]][::-1]  # newest first
    entry["timeline"] = timeline.series(records)
    entry["snapshot_status"] = status.get("snapshot_status")
    entry["snapshot_age_s"] = status.get("snapshot_age_s")


def assemble(server_kernels: Iterable[dict], gathered: kernels.Gathered) -> dict:
    """The API's answer: this server's kernels (each ``{"kernel_id", "notebook", "pid", "execution_state"}``)
    joined with every kernel ``gathered`` found, by kernel id, else by pid. This server's kernels come first,
    by notebook; the others after them, by pid."""
    ours: List[dict] = []
    by_id: Dict[str, dict] = {}
    by_pid: Dict[int, dict] = {}
    for known in server_kernels:
        entry = _blank(known.get("kernel_id"), known.get("pid"))
        entry["server_kernel"] = True
        entry["notebook"] = known.get("notebook")
        entry["execution_state"] = known.get("execution_state")
        ours.append(entry)
        if entry["kernel_id"]:
            by_id[entry["kernel_id"]] = entry
        if isinstance(entry["pid"], int):
            by_pid[entry["pid"]] = entry
    others: List[dict] = []
    for view in gathered.kernels:
        entry = by_id.get(view.kernel_id or "")
        if entry is None and view.elsewhere is None:
            entry = by_pid.get(view.pid)
        if entry is None or entry["gpucleanup"]:
            entry = _blank(view.kernel_id, view.pid)
            others.append(entry)
        _fill(entry, view)
    for entry in ours:
        if not entry["gpucleanup"]:
            entry["hint"] = NOT_LOADED
    ours.sort(key=lambda e: (e["notebook"] is None, e["notebook"] or "", e["id"]))
    others.sort(key=lambda e: (e["pid"] is None, e["pid"] or 0))
    return {
        "time_ns": time.time_ns(),
        "runtime_dir": str(gathered.directory),
        "kernels": ours + others,
        "skipped": [{"path": str(s.path), "why": s.why} for s in gathered.skipped],
    }


def drain_lines(result: dict, drain_timeout: float) -> List[str]:
    """One line per device of a drain result: what was released, or why it was not drained."""
    devices = [d for d in result.get("devices") or () if isinstance(d, dict)]
    driver = result.get("driver") if isinstance(result.get("driver"), dict) else {}
    if not devices:
        if driver.get("state") in ("unusable", "exiting"):
            return [f"nothing drained: the CUDA driver is {driver['state']} ({driver.get('message') or 'no reason given'})"]
        return ["drained; no GPU in use"]
    lines = []
    for dev in devices:
        gpu = f"GPU{dev.get('index')}"
        state = dev.get("state")
        settle = dev.get("settle") if isinstance(dev.get("settle"), dict) else {}
        if state == "drained":
            line = f"{gpu}: {report.drained_text(result, dev)}"
        elif state == "busy" and settle.get("status") == "still_busy":
            line = (f"{gpu} busy: its queued work is still running and a wait for it is under way already (the "
                    "kernel's own cleanup, or an earlier drain), so its memory pools were not trimmed; try again when "
                    "that work has finished")
        elif state == "busy" and settle.get("status") == "interrupted":
            line = f"{gpu} busy: the wait for its queued work was interrupted, so its memory pools were not trimmed; try again"
        elif state == "busy":
            line = (f"{gpu} busy: the work the kernel queued on it did not finish within {drain_timeout:g} s, "
                    "so its memory pools were not trimmed; try again later")
        elif state == "unusable":
            line = f"{gpu} unusable: {dev.get('message') or 'restart the kernel'}"
        else:
            line = f"{gpu} {state or 'not drained'}: {dev.get('message') or 'no reason given'}; try again"
        lines.append(line)
    return lines + report.drain_kernel_notes(result)
