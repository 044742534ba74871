"""The admin's view of a shared GPU server: who holds each GPU, what is idle, what parking would give back.

What the page's header and table and the bulk "park the idle kernels" action read, added to the API's answer
(``model.assemble``) by :func:`annotate`; read once per refresh, never per kernel per request.
"""

from __future__ import annotations

import os
import time
from typing import Dict, Iterable, List, Optional, Tuple

from ..outside import kernels
from ..park import steps as park_steps, kernel_side as parking, from_outside as remote_park

__all__ = ["GpuView", "local_facts", "annotate", "park_preview", "owner_name", "SORTS"]

#: the table's sort orders (``?sort=`` of the list): the default first
SORTS = ("held", "idle", "name")


class GpuView:
    """What nvidia-smi says, read once per refresh: ``gpus`` (park.Gpu) and ``apps`` ((pid, uuid, bytes)),
    each None when it cannot say (no nvidia-smi, a container that hides it). nvidia-smi is asked twice per refresh
    (the GPUs, the processes on them, at once, each bounded)."""

    def __init__(self, gpus=None, apps=None):
        self.gpus: Optional[List[park_steps.Gpu]] = gpus
        self.apps: Optional[List[Tuple[int, str, int]]] = apps


def owner_name(pid: Optional[int]) -> Optional[str]:
    """The user name of process ``pid``'s real uid (its uid as text when the name is unknown); None when the
    process cannot be seen from here."""
    if not isinstance(pid, int):
        return None
    uid = remote_park.process_uid(pid)
    if uid is None:
        return None
    try:
        import pwd

        return pwd.getpwuid(uid).pw_name
    except (KeyError, ImportError):
        return str(uid)


def _state_refusal(pid: int, state: Optional[dict]) -> Optional[str]:
    # the same sentences as gpucleanup park --check (remote_park.check_kernel)
    name = (state or {}).get("state")
    if name in ("running", "draining"):
        cell = state.get("cell")
        return (f"the kernel is {name}" + (f" (cell {cell})" if cell else "")
                + ": a park starts only between cells; ask again when it is idle")
    if name in ("parking", "parked"):
        return f"the kernel is {name} already: gpucleanup resume {pid} brings it back"
    return None


def quick_check(kernel, state: Optional[dict], error: Optional[str], view: GpuView) -> dict:
    """The cheap part of ``gpucleanup park --check`` for one kernel (``kernel``: its discovery record):
    ``{"parkable", "reasons", "usage", "full": False}``. Reads files only; no helper, no request."""
    out = {"parkable": False, "reasons": [], "usage": None, "full": False}
    pid = kernel.pid
    if not kernel.key_file:
        out["reasons"].append("it has no key file: it cannot be parked from outside")
        return out
    lock = parking.lock_path(kernel.key_file, pid)
    refusal = remote_park.owner_refusal(pid, lock)
    if refusal:
        out["reasons"].append(refusal)
        return out
    refused = remote_park.refused_before(pid, lock) if (state or {}).get("state") not in ("parking", "parked") else None
    if refused:
        out["reasons"].append(refused)
    if error:
        out["reasons"].append(f"the kernel did not answer its status request ({error}): a park would be refused")
    said = _state_refusal(pid, state)
    if said:
        out["reasons"].append(said)
    usage = out["usage"] = (park_steps.process_gpu_usage(pid, apps=view.apps) if view.apps is not None else None)
    maps = park_steps.read_maps(pid)  # one read for the refusals and the hold's check
    out["reasons"].extend(park_steps.refusals(pid, None, usage, view.gpus if usage else None,
                                              unheld=park_steps.kernel_hold(), maps=maps))
    held = remote_park.hold_refused(pid, lock, maps) if not out["reasons"] and maps is not None else None
    if held:
        out["reasons"].append(held)
    out["parkable"] = not out["reasons"]
    return out


def local_facts(gathered: kernels.Gathered, view: GpuView) -> Dict[int, dict]:
    """Per pid of every kernel ``gathered`` found in this PID namespace: ``owner`` and ``park_check``
    (:func:`quick_check`). One pass over files under /proc and the kernels' directory; nothing is asked.

    ``owner`` is the user name from ``/proc/<pid>/status``; ``park_check`` is the cheap part of ``gpucleanup park
    --check``: who owns the process, its state, the GPUs it uses, host memory and its cgroup's limit
    (``park.refusals``). The driver's own state of the process needs a helper process per kernel, so it is read only
    by the full check (``GET .../park-check``, the row's "Can park?")."""
    facts: Dict[int, dict] = {}
    for kv in gathered.kernels:
        if kv.elsewhere is not None:
            continue
        state = (kv.status or {}).get("state") if isinstance((kv.status or {}).get("state"), dict) else None
        try:
            check = quick_check(kv.kernel, state, kv.error, view)
        except Exception as exc:  # one kernel's odd files never cost the list
            check = {"parkable": False, "reasons": [f"could not be checked: {exc}"], "usage": None, "full": False}
        facts[kv.pid] = {"owner": owner_name(kv.pid), "park_check": check}
    return facts


# ------------------------------------------------------------------ the answer


def _gpu_key(uuid: Optional[str], index) -> str:
    return uuid if uuid else f"GPU{index}"


def _idle_since(entry: dict) -> Optional[int]:
    """When the kernel's last cell ended, for a kernel idle, parking or parked: the state's
    ``last_cell_ended_ns`` (moved by a cell's end only, not by a drain from outside or a park), else the idle
    state's start, else (parked) its last cell's record; None while a cell runs."""
    state = entry.get("state") or {}
    ended = state.get("last_cell_ended_ns")
    if state.get("state") in ("idle", "parking", "parked") and type(ended) is int and ended > 0:
        return ended
    if state.get("state") == "idle" and isinstance(state.get("since_ns"), int):
        return state["since_ns"]
    if state.get("state") in ("parking", "parked"):
        for cell in entry.get("last_cells") or ():
            if isinstance(cell.get("time_ns"), int):
                return cell["time_ns"]
    return None


def _held(entry: dict, apps_by_pid: Dict[int, Dict[str, int]], parked: bool) -> List[dict]:
    """The kernel's memory per GPU (``held``).

    What nvidia-smi lists for its pid there (the whole process: context, pools, raw allocations), split into live
    and cached (the frameworks' pools and the driver's free pool memory, from its last cell's record) and the rest,
    outside every pool. Where nvidia-smi does not list the pid (no nvidia-smi, another PID namespace) it is the
    kernel's own pools only, live and cached, marked ``source: "kernel"``: its context and raw allocations then
    count in the GPU's ``rest``."""
    pid = entry.get("pid")
    listed = apps_by_pid.get(pid) if isinstance(pid, int) else None
    rows = []
    seen = set()
    for dev in entry.get("devices") or ():
        key = _gpu_key(dev.get("uuid"), dev.get("index"))
        seen.add(key)
        live = kernels.total(dev.get("live_bytes"))
        pool_used = dev.get("driver_pool_used_bytes") or 0
        pool_free = max(0, (dev.get("driver_pool_reserved_bytes") or 0) - pool_used)
        cached = kernels.total(dev.get("cached_bytes")) + pool_free
        if parked:
            held, source = 0, "parked"  # a parked process holds nothing on the GPU; its figures are from before
            live = cached = 0
        elif listed is not None:
            held, source = listed.get(dev.get("uuid"), 0), "nvidia-smi"
        else:
            # no nvidia-smi: what the kernel itself reports. The driver pool's used bytes are live memory of the
            # process even where no framework names them its own (cuMemAllocAsync from the kernel's code, a
            # framework on the stream-ordered pool): at least that much is live, never counted twice
            live = max(live, pool_used)
            held, source = live + cached, "kernel"
        if source == "nvidia-smi":
            # the record may be older than nvidia-smi's look: never more live and cached than held
            live = min(live, held)
            cached = min(cached, held - live)
            outside = held - live - cached
        else:
            outside = None if source == "kernel" else 0
        rows.append({"gpu": key, "index": dev.get("index"), "uuid": dev.get("uuid"), "name": dev.get("name"),
                     "bytes": held, "live_bytes": live, "cached_bytes": cached, "outside_bytes": outside,
                     "source": source})
    for uuid, used in sorted((listed or {}).items()):
        if uuid not in seen and not parked:  # a GPU nvidia-smi sees it on and its own snapshot did not list
            rows.append({"gpu": uuid, "index": None, "uuid": uuid, "name": None, "bytes": used, "live_bytes": 0,
                         "cached_bytes": 0, "outside_bytes": used, "source": "nvidia-smi"})
    return rows


def _parked(entry: dict) -> Optional[dict]:
    state = entry.get("state") or {}
    if state.get("state") not in ("parking", "parked"):
        return None
    size = state.get("bytes")
    devices = entry.get("devices") or []
    gpu = _gpu_key(devices[0].get("uuid"), devices[0].get("index")) if len(devices) == 1 else None
    return {"state": state.get("state"), "bytes": size if type(size) is int and size >= 0 else None,
            "since_ns": state.get("since_ns") if isinstance(state.get("since_ns"), int) else None, "gpu": gpu}


def annotate(data: dict, view: GpuView, facts: Dict[int, dict], root_dir: Optional[str] = None,
             now_ns: Optional[int] = None) -> dict:
    """Adds the admin's fields to ``data`` (``model.assemble``'s answer) and its ``gpus``; returns it.

    Per entry ``owner``, ``idle_since_ns``/``idle_s``, ``held`` (per GPU, :func:`_held`) and ``held_bytes``,
    ``parked``, ``park_check``; per GPU the header's figures, whose ``held_bytes`` is by construction the sum of the
    rows' ``held`` on that GPU."""
    now_ns = time.time_ns() if now_ns is None else now_ns
    apps_by_pid: Dict[int, Dict[str, int]] = {}
    for pid, uuid, used in view.apps or ():
        per = apps_by_pid.setdefault(pid, {})
        per[uuid] = per.get(uuid, 0) + used
    gpus: Dict[str, dict] = {}

    def gpu(key: str, index=None, uuid=None, name=None) -> dict:
        row = gpus.get(key)
        if row is None:
            row = gpus[key] = {"gpu": key, "index": index, "uuid": uuid, "name": name, "total_bytes": None,
                               "used_bytes": None, "used_source": None, "held_bytes": 0, "live_bytes": 0,
                               "cached_bytes": 0, "outside_bytes": 0, "unsplit_bytes": 0, "parked_bytes": 0,
                               "rest_bytes": None, "kernels": 0, "used_unknown": None}
        row["index"] = row["index"] if row["index"] is not None else index
        row["name"] = row["name"] or name
        return row

    for smi in view.gpus or ():
        row = gpu(smi.uuid, smi.index, smi.uuid)
        row["total_bytes"], row["used_bytes"], row["used_source"] = smi.total, smi.total - smi.free, "nvidia-smi"
    index_of = {smi.uuid: smi.index for smi in view.gpus or ()}
    parked_elsewhere = 0
    for entry in data["kernels"]:
        entry["notebook"] = relative_notebook(entry.get("notebook"), root_dir)
        fact = facts.get(entry.get("pid")) if entry.get("gpucleanup") else None
        entry["owner"] = (fact or {}).get("owner") or (owner_name(entry.get("pid")) if entry.get("server_kernel") else None)
        check = (fact or {}).get("park_check")
        entry["park_check"] = check
        since = _idle_since(entry)
        entry["idle_since_ns"] = since
        entry["idle_s"] = max(0.0, (now_ns - since) / 1e9) if since is not None else None
        parked = _parked(entry)
        entry["parked"] = parked
        entry["held"] = _held(entry, apps_by_pid, parked is not None) if entry.get("gpucleanup") else []
        for held in entry["held"]:
            if held["index"] is None:  # a GPU its own snapshot did not list: nvidia-smi's index
                held["index"] = index_of.get(held["uuid"])
        entry["held_bytes"] = sum(h["bytes"] for h in entry["held"])
        for held in entry["held"]:
            row = gpu(held["gpu"], held["index"], held["uuid"], held["name"])
            row["held_bytes"] += held["bytes"]
            row["live_bytes"] += held["live_bytes"]
            row["cached_bytes"] += held["cached_bytes"]
            if held["outside_bytes"] is None:
                row["unsplit_bytes"] += held["bytes"] - held["live_bytes"] - held["cached_bytes"]
            else:
                row["outside_bytes"] += held["outside_bytes"]
            row["kernels"] += 1 if held["bytes"] > 0 else 0
        for dev in entry.get("devices") or ():
            row = gpu(_gpu_key(dev.get("uuid"), dev.get("index")), dev.get("index"), dev.get("uuid"), dev.get("name"))
            if row["used_source"] != "nvidia-smi" and isinstance(dev.get("used_bytes"), int) and parked is None:
                # device-wide figures of the kernel's own snapshot: the largest of them (all are of one device)
                if row["used_bytes"] is None or dev["used_bytes"] > row["used_bytes"]:
                    row["used_bytes"], row["used_source"] = dev["used_bytes"], "kernel snapshot"
                row["total_bytes"] = row["total_bytes"] or dev.get("total_bytes")
        if parked is not None and parked["bytes"]:
            if parked["gpu"] is not None:
                gpu(parked["gpu"])["parked_bytes"] += parked["bytes"]
            else:
                parked_elsewhere += parked["bytes"]
    for row in gpus.values():
        row["used_unknown"] = None
        if isinstance(row["used_bytes"], int):
            row["rest_bytes"] = max(0, row["used_bytes"] - row["held_bytes"])
        elif row["parked_bytes"] > 0:
            # no nvidia-smi, and a parked kernel makes no driver call: nobody here can say the device's figure
            row["used_unknown"] = ("not known while parked: without nvidia-smi only a kernel's own snapshot says the "
                                   "device's use, and the kernels with gpucleanup on it are parked")
        else:
            row["used_unknown"] = "not known: no nvidia-smi here, and no running kernel with gpucleanup reported it"
    data["gpus"] = sorted(gpus.values(), key=lambda r: (r["index"] is None, r["index"] or 0, r["gpu"]))
    data["parked_gpu_unknown_bytes"] = parked_elsewhere
    data["gpu_source"] = "nvidia-smi" if view.gpus is not None else "kernels"
    return data


def relative_notebook(path: Optional[str], root_dir: Optional[str]) -> Optional[str]:
    """A notebook path as the server's sessions say it: relative to the server's root where it is under it,
    else as it is."""
    if not path or not root_dir or not os.path.isabs(path):
        return path
    root = os.path.normpath(root_dir)
    normal = os.path.normpath(path)
    if normal.startswith(root.rstrip(os.sep) + os.sep):
        return os.path.relpath(normal, root)
    return path


def sort_entries(entries: List[dict], order: str) -> List[dict]:
    """``held``: most GPU memory first (then the longest idle); ``idle``: longest idle first (kernels never
    idle, last); ``name``: by notebook, then id."""
    def name_key(e):
        return ((e.get("notebook") or "").lower(), e.get("id") or "")

    if order == "idle":
        return sorted(entries, key=lambda e: (e.get("idle_s") is None, -(e.get("idle_s") or 0), name_key(e)))
    if order == "name":
        return sorted(entries, key=lambda e: (e.get("notebook") is None, name_key(e)))
    return sorted(entries, key=lambda e: (-(e.get("held_bytes") or 0), -(e.get("idle_s") or 0), name_key(e)))


def park_preview(entries: Iterable[dict], min_idle_s: float) -> dict:
    """Which kernels "park the kernels idle for more than ``min_idle_s``" would park and what it would give
    back: every kernel with gpucleanup idle that long; those the cheap check refuses are listed apart, each
    with its reasons. ``bytes`` per kernel: what it holds on its GPUs now (a park moves all of it)."""
    chosen, refused = [], []
    for entry in entries:
        state = entry.get("state") or {}
        if not entry.get("gpucleanup") or state.get("state") != "idle":
            continue
        if entry.get("idle_s") is None or entry["idle_s"] < min_idle_s:
            continue
        item = {"id": entry["id"], "notebook": entry.get("notebook"), "pid": entry.get("pid"),
                "owner": entry.get("owner"), "idle_s": entry["idle_s"], "bytes": entry.get("held_bytes") or 0,
                "held": [{"gpu": h["gpu"], "index": h["index"], "bytes": h["bytes"]} for h in entry.get("held") or ()]}
        check = entry.get("park_check") or {}
        if isinstance(state.get("park_blocker"), str):  # a thread of the notebook's runs: a bulk park leaves it
            refused.append(dict(item, reasons=[state["park_blocker"]]))
        elif check.get("parkable"):
            chosen.append(item)
        else:
            refused.append(dict(item, reasons=list(check.get("reasons") or ["it cannot be asked from here"])))
    chosen.sort(key=lambda i: -i["bytes"])
    return {"min_idle_s": min_idle_s, "kernels": chosen, "bytes": sum(i["bytes"] for i in chosen),
            "refused": refused}
