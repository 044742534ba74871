#!/usr/bin/env python3
"""Soak and churn: gpucleanup in real Jupyter kernels for a long time, against the fake CUDA driver.

Three parts, each in real kernels started through jupyter_client (the extension loaded with
``%load_ext gpucleanup``, libgpucleanup pointed at the fake driver of the build tree):

cells
    N cells in one kernel. A seeded schedule changes the fake driver's state from inside the cells
    (the kernel loads the same libcuda.so.1 as libgpucleanup and calls its ``fake_cuda_update``):
    a second device comes into use and goes out of it, the default pools fill (reserved bytes grow,
    the cleanup trims them), live pool bytes come and go, a synchronize hangs (``settle_timeout`` is
    0.05 s: the cell's cleanup must say GPU0 is busy; the next cell that changes the driver's state
    lets the synchronize go, the last cell at the latest), an entry point fails for one cell, and near
    the end GPU0 takes a sticky error (said once, in its cell; the cells go on). Every ``--every``
    cells: ``%gpumem --json`` in the kernel (its JSON parsed) and a status request from outside,
    sent while that cell runs.
reload
    R cycles of ``%load_ext``, ``%reload_ext`` (then a cell) and ``%unload_ext gpucleanup`` in one
    kernel: the discovery file and key exist while loaded (and the kernel answers a status request
    after each load and reload), and are gone after each unload.
kernels
    K kernels started and stopped a few at a time (every other one killed, as a crashed kernel is;
    the others shut down as Jupyter does) while a thread runs ``python -m gpucleanup ps --json`` in a
    loop: every run exits 0 with a JSON list; at the end nothing of any kernel is left in the
    runtime directory (a last ``ps`` removes what the killed kernels left, as it does for users).

The kernels' resident memory (VmRSS), threads, descriptors and sockets are read from /proc at the
start, after a warm-up (the first 10 % of each part) and at the end. Limits: resident memory grows by
at most ``--rss-limit-mib`` (5 MiB) from the warm-up to the end; descriptors and sockets end where
the warm-up left them, threads at most there (a device that becomes unusable gives its watchdog thread
back) -- a kernel's, and for ``kernels`` this process's own; the runtime directory ends as it started;
every request gets its reply. Under AddressSanitizer (its runtime in LD_PRELOAD, as
scripts/sanitizers.sh runs the suite) the resident-memory limit is not applied and the summary says
why: ASan's quarantine keeps freed memory resident. The exit status is 1 when one is broken, 2 for bad arguments or a
missing build. ``--baseline`` also runs the cells part's cells in a kernel without gpucleanup, to
read the cells part's memory growth against what IPython and ipykernel grow by themselves.

The kernels (and ``gpucleanup ps``, and this process) use copies of the package and of the build's
libgpucleanup.so and fake libcuda.so.1, taken at the start: edits and rebuilds of the tree during the
run change nothing under them. A reply that does not come says whether the kernel still ran, with its
threads' native stacks (gdb, where installed) in the JSON.

Usage::

    python tests/soak/soak.py [--cells N] [--reloads N] [--kernels N] [--baseline] [--json PATH]

(``scripts/soak.sh`` runs the full size; ``tests/python/test_soak.py`` a short one.)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import queue
import random
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Dict, List, Optional

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))
import kernel_harness  # noqa: E402  (tests/kernel_harness.py)

MiB = 1 << 20
#: seconds one reply (a cell's, a status request's) may take before it counts as missing
REPLY_TIMEOUT = 60.0
#: how long resource figures may take to come back to where they should be (threads and peers
#: of a status request that has just been answered end a moment later)
SETTLE_S = 10.0
#: settle_timeout in the soaked kernels: a stalled synchronize is given up on after 50 ms
SETTLE_TIMEOUT = 0.05
WARM_UP = 0.1

SCENARIO = {"devices": [{"name": "Fake H100", "primary_active": True},
                        {"name": "Fake H100 (1)", "primary_active": False}]}

#: the first cell of the cells part: settle_timeout low, and the helper the schedule's cells call
SETUP = f"""\
%load_ext gpucleanup
%config GPUCleanup.settle_timeout = {SETTLE_TIMEOUT}
import ctypes as _soak_ctypes, json as _soak_json, os as _soak_os
_soak_fake = _soak_ctypes.CDLL(_soak_os.environ["GPUCLEANUP_LIBCUDA"])
_soak_fake.fake_cuda_state_json.restype = _soak_ctypes.c_char_p

def _soak(device, fill=0, live=None, in_use=None, sync=0, fault=None, sticky=None):
    \"\"\"Change the fake driver's state of one device, as a framework using it would.\"\"\"
    dev = _soak_json.loads(_soak_fake.fake_cuda_state_json())["devices"][device]
    pool = dev["default_pool"]
    patch = {{"sync_seconds": sync, "errors": {{"cuMemPoolTrimTo": fault or 0}}}}
    if fill:
        patch["default_pool"] = {{"reserved_bytes": pool["reserved_bytes"] + fill}}
        patch["free_bytes"] = dev["free_bytes"] - fill
    if live is not None:
        grow = max(0, live - pool["reserved_bytes"])
        patch["default_pool"] = {{"used_bytes": live, "reserved_bytes": pool["reserved_bytes"] + grow}}
        patch["free_bytes"] = dev["free_bytes"] - grow
    if in_use is not None:
        patch["primary_active"] = in_use
    if sticky:
        patch["sticky_error"] = sticky
    patch = {{"devices": [{{}}] * device + [patch]}}
    assert _soak_fake.fake_cuda_update(_soak_json.dumps(patch).encode()) == 0
"""

GPUMEM = "_soak_d = %gpumem --json\nprint(_soak_json.dumps(_soak_d, default=str))\ndel _soak_d"


#: where the kernels' processes write their own output (set by main)
KERNEL_LOG = None


class Missing(Exception):
    """A reply that did not come within REPLY_TIMEOUT; ``stacks``: the kernel's threads then, if it still ran."""

    def __init__(self, message: str, stacks: Optional[str] = None):
        super().__init__(message)
        self.stacks = stacks


# ---------------------------------------------------------------- measuring


def resources(pid: int) -> Dict[str, int]:
    """Resident memory, threads, descriptors and sockets of a process, from /proc."""
    rss = 0
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                rss = int(line.split()[1]) * 1024
    threads = len(os.listdir(f"/proc/{pid}/task"))
    fds = sockets = 0
    for name in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{name}")
        except OSError:
            continue  # closed meanwhile
        fds += 1
        sockets += target.startswith("socket:")
    return {"rss_bytes": rss, "threads": threads, "fds": fds, "sockets": sockets}


COUNTS = ("threads", "fds", "sockets")


def back(warm: Dict[str, int], end: Dict[str, int]) -> List[str]:
    """The counts that did not come back: descriptors and sockets must end where the warm-up left them,
    threads at most there (a device that becomes unusable gives its watchdog thread back)."""
    return [key for key in COUNTS if (end[key] > warm[key] if key == "threads" else end[key] != warm[key])]


def settled(pid: int, want: Optional[Dict[str, int]] = None) -> Dict[str, int]:
    """The process's figures once its threads, descriptors and sockets stop moving: equal to ``want``'s,
    or (without ``want``) the same twice in a row 50 ms apart; after SETTLE_S, whatever they are."""
    deadline = time.monotonic() + SETTLE_S
    last = resources(pid)
    while time.monotonic() < deadline:
        if want is not None and not back(want, last):
            return last
        time.sleep(0.05)
        now = resources(pid)
        if want is None and all(now[k] == last[k] for k in COUNTS):
            return now
        last = now
    return last


def asan_preloaded(environ: dict) -> bool:
    """Whether the kernels run with AddressSanitizer's runtime preloaded (scripts/sanitizers.sh does it).

    ASan holds freed memory back in its quarantine, up to 256 MiB by default, before any of it is used
    again (https://github.com/google/sanitizers/wiki/AddressSanitizerFlags, ``quarantine_size_mb``), so
    a kernel's resident memory grows with every allocation until the quarantine is full. That growth
    says nothing about a leak, and the resident-memory limit is not applied.
    """
    return any(Path(lib).name.startswith("libasan") for lib in environ.get("LD_PRELOAD", "").replace(":", " ").split())


def growth(part: dict, problems: List[str], rss_limit: Optional[int], name: str) -> None:
    """Compares the end with the warm-up; a broken limit goes to ``problems`` (no resident-memory
    limit when ``rss_limit`` is None)."""
    warm, end = part["resources"]["warm_up"], part["resources"]["end"]
    part["growth_after_warm_up"] = {k: end[k] - warm[k] for k in ("rss_bytes",) + COUNTS}
    rss = part["growth_after_warm_up"]["rss_bytes"]
    if rss_limit is not None and rss > rss_limit:
        problems.append(f"{name}: resident memory grew by {rss / MiB:.1f} MiB after the warm-up "
                        f"(limit {rss_limit / MiB:g} MiB)")
    for key in back(warm, end):
        problems.append(f"{name}: {key} {warm[key]} after the warm-up, {end[key]} at the end")


def missing(part: dict, problems: List[str], name: str, exc: Missing) -> None:
    """A reply that did not come is a problem of the part, kept with the kernel's threads' stacks
    where they were read."""
    problems.append(f"{name}: {exc}")
    if exc.stacks:
        part["stacks"] = exc.stacks


def unanswered(part: dict, problems: List[str], name: str) -> None:
    """Each kind of request of the part with fewer replies than requests is a problem."""
    for key, sent in part["sent"].items():
        if part["received"][key] != sent:
            problems.append(f"{name}: {sent} {key} requests, {part['received'][key]} replies")


def runtime_listing(runtime: Path) -> List[str]:
    """What the runtime directory holds: files, and the files of its gpucleanup/ directory."""
    out = []
    for path in sorted(runtime.rglob("*")):
        if not path.is_dir():
            out.append(str(path.relative_to(runtime)))
    return out


# ---------------------------------------------------------------- kernels


#: kernel ports are taken below the system's ephemeral range, which outgoing connections draw from
_PORTS_BELOW = 32768
_ports_given: set = set()


def _fixed_ports(n: int) -> List[int]:
    """``n`` free TCP ports on 127.0.0.1 below the ephemeral range (read from /proc where it can be), none given
    before in this process: a port there is taken only by a process that binds it on purpose."""
    import socket

    low = _PORTS_BELOW
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        pass
    ports: List[int] = []
    candidates = list(range(max(1024, low - 12000), low))
    random.shuffle(candidates)
    for port in candidates:
        if port in _ports_given:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue
        _ports_given.add(port)
        ports.append(port)
        if len(ports) == n:
            return ports
    raise RuntimeError(f"no {n} free ports below {low}")


class Kernel(kernel_harness.Kernel):
    """A kernel started through jupyter_client with the extension's environment (tests/kernel_harness.py); a reply
    that does not come raises :class:`Missing`."""

    def __init__(self, env: dict):
        # jupyter_client would pick the five ports by binding port 0 and letting it go: an ephemeral port, which
        # an outgoing connection of this busy process (its clients, gpucleanup ps) can take before the kernel
        # binds it; the loser's heartbeat thread then dies on "Address already in use" (seen once in CI).
        # The kernel process's own output (ipykernel's and libraries' logging) goes to the soak's log.
        super().__init__(env, python=sys.executable, ports=_fixed_ports(5), stdout=KERNEL_LOG, stderr=KERNEL_LOG,
                         ready=None, timeout=REPLY_TIMEOUT)

    def ready(self) -> "Kernel":
        try:
            self.wait_ready(REPLY_TIMEOUT)
        except RuntimeError as exc:
            raise Missing(f"kernel {self.pid} did not become ready: {exc}") from None
        return self

    def collect(self, msg_id: str, *args, **kwargs) -> kernel_harness.Cell:
        """One cell's outputs, error and reply, gathered until the kernel is idle."""
        try:
            return super().collect(msg_id, *args, **kwargs)
        except queue.Empty:
            why = self.why()
            raise Missing(f"kernel {self.pid}: no reply within {REPLY_TIMEOUT:g} s{why}",
                          self.stacks() if "still running" in why else None) from None

    def why(self) -> str:
        """How the kernel ended, when it did (a reply never comes from a dead kernel)."""
        code = self.exit_status()
        if code is None:
            return " (the kernel is still running)"
        return f" (the kernel exited: {'signal ' + str(-code) if code < 0 else 'status ' + str(code)})"

    def stacks(self) -> Optional[str]:
        """The native stacks of a kernel that does not answer (gdb, where installed), for the report."""
        if shutil.which("gdb") is None:
            return None
        try:
            done = subprocess.run(["gdb", "-p", str(self.pid), "-batch", "-ex", "thread apply all bt 40"],
                                  capture_output=True, text=True, timeout=120)
        except (OSError, subprocess.TimeoutExpired) as exc:
            return f"gdb failed: {exc}"
        return done.stdout[-60000:]


def cell_failed(cell: kernel_harness.Cell) -> Optional[str]:
    if cell.reply.get("status") != "ok" or cell.error:
        return cell.error_line or f"reply status {cell.reply.get('status')}"
    if cell.stderr:
        return f"stderr: {cell.stderr.strip()}"
    return None


def ask_status(runtime: Path, pid: int) -> Optional[dict]:
    """The kernel's status reply, from outside (as ``gpucleanup status`` asks), or None."""
    from gpucleanup.outside import kernels

    for view in kernels.gather(runtime, timeout=REPLY_TIMEOUT).kernels:
        if view.pid == pid:
            return view.status
    return None


def status_ok(reply: Optional[dict]) -> bool:
    return (isinstance(reply, dict) and reply.get("ok") is True and reply.get("kind") == "status"
            and isinstance(reply.get("state"), dict) and isinstance(reply.get("snapshot"), dict))


# ---------------------------------------------------------------- cells


def schedule(n: int, seed: int) -> List[dict]:
    """What each cell does to the fake driver: ``_soak`` keyword arguments (device first), or None."""
    rng = random.Random(seed)
    sticky_at = max(1, int(n * 0.9))
    gpu1 = False
    out = []
    for i in range(n):
        if i == sticky_at:
            out.append({"device": 0, "sticky": 700, "why": "sticky"})
            continue
        roll = rng.random()
        if roll < 0.3:
            out.append(None)
        elif roll < 0.65:
            device = rng.choice([0, 1]) if gpu1 else 0
            out.append({"device": device, "fill": rng.randrange(1, 9) * 256 * MiB, "why": "fill"})
        elif roll < 0.75:
            gpu1 = not gpu1
            out.append({"device": 1, "in_use": gpu1, "why": "in_use" if gpu1 else "not_in_use"})
        elif roll < 0.87:
            out.append({"device": 0, "live": rng.randrange(0, 5) * 256 * MiB, "why": "live"})
        elif roll < 0.94:
            # a synchronize that hangs until the next cell that changes the driver's state (its patch
            # sets sync_seconds back to 0, which lets a waiting synchronize go)
            out.append({"device": 0, "sync": -1, "fill": 512 * MiB, "why": "stall"})
        else:
            out.append({"device": 0, "fault": 999, "fill": 512 * MiB, "why": "fault"})
    if n > sticky_at + 1:
        out[-1] = {"device": 0, "why": "release"}  # the last cell lets a stalled synchronize go
    return out


def cell_code(i: int, step: Optional[dict]) -> str:
    user = f"x = [{i}] * 100"
    if step is None:
        return user
    args = ", ".join(f"{k}={v!r}" for k, v in step.items() if k not in ("device", "why"))
    return f"{user}\n_soak({step['device']}{', ' + args if args else ''})"


def line_kinds(stdout: str) -> Dict[str, List[str]]:
    """gpucleanup's lines in a cell's output, by what they say."""
    kinds: Dict[str, List[str]] = {}
    for line in stdout.splitlines():
        if not line.startswith("gpucleanup"):
            continue
        if "unusable" in line:
            kind = "unusable"
        elif "busy" in line:
            kind = "busy"
        elif " failed with " in line:
            kind = "entry_point_failed"
        elif "freed 0 B" in line:
            kind = "nothing_freed"
        elif "freed" in line:
            kind = "freed"
        else:
            kind = "other"
        kinds.setdefault(kind, []).append(line)
    return kinds


def part_cells(n: int, every: int, seed: int, env: dict, runtime: Path, rss_limit: Optional[int], log) -> dict:
    started = time.monotonic()
    problems: List[str] = []
    steps = schedule(n, seed)
    part = {"cells": n, "every": every, "seed": seed, "sent": {"cells": 0, "gpumem": 0, "status": 0},
            "received": {"cells": 0, "gpumem": 0, "status": 0}, "schedule": {}, "lines": {},
            "stalls": 0, "stalls_said_busy": 0, "examples": {}, "examples_by_step": {}, "resources": {},
            "rss_samples": [], "problems": problems}
    for step in steps:
        why = step["why"] if step else "idle"
        part["schedule"][why] = part["schedule"].get(why, 0) + 1
    kernel = Kernel(env).ready()
    pid = kernel.pid
    try:
        setup = kernel.execute(SETUP)
        if cell_failed(setup):
            problems.append(f"cells: the set-up cell failed: {cell_failed(setup)}")
            return part
        part["resources"]["start"] = settled(pid)
        warm_at = min(max(1, int(n * WARM_UP)), n - 1)
        sticky_at = next((i for i, s in enumerate(steps) if s and s["why"] == "sticky"), n)
        unusable_at: List[int] = []
        for i, step in enumerate(steps):
            if i == warm_at:
                part["resources"]["warm_up"] = settled(pid)
            asks = every > 0 and i % every == every - 1
            msg_id = kernel.send(cell_code(i, step))
            part["sent"]["cells"] += 1
            if asks:  # asked while the cell runs (or just after: either way the reply must come)
                part["sent"]["status"] += 1
                part["received"]["status"] += status_ok(ask_status(runtime, pid))
            cell = kernel.collect(msg_id)
            part["received"]["cells"] += 1
            failed = cell_failed(cell)
            if failed:
                problems.append(f"cells: cell {i} ({step}) failed: {failed}")
            for kind, lines in line_kinds(cell.printed).items():
                part["lines"][kind] = part["lines"].get(kind, 0) + len(lines)
                part["examples"].setdefault(kind, lines[0])
                if kind == "unusable":
                    unusable_at.append(i)
            if cell.printed.strip():
                part["examples_by_step"].setdefault(step["why"] if step else "idle", cell.printed.strip())
            if step and step["why"] == "stall" and i < sticky_at:
                part["stalls"] += 1
                part["stalls_said_busy"] += any(
                    line.startswith("gpucleanup · GPU0 ") and "busy" in line for line in cell.printed.splitlines())
            if asks:
                part["sent"]["gpumem"] += 1
                shown = kernel.execute(GPUMEM)
                # its JSON on one line; the cleanup after this cell may add its own line
                printed = [line for line in shown.printed.splitlines() if line.startswith("{")]
                try:
                    data = json.loads(printed[0]) if len(printed) == 1 else None
                except ValueError:
                    data = None
                if isinstance(data, dict) and data.get("kind") == "gpumem" and isinstance(data.get("devices"), list):
                    part["received"]["gpumem"] += 1
                else:
                    problems.append(f"cells: %gpumem --json after cell {i} printed no JSON: {shown.printed[:200]!r}")
            if (i + 1) % max(1, n // 10) == 0:
                part["rss_samples"].append([i + 1, resources(pid)["rss_bytes"]])
                log(f"cells: {i + 1}/{n}")
        part["resources"]["end"] = settled(pid, part["resources"]["warm_up"])
        if unusable_at != ([sticky_at] if sticky_at < n else []):
            problems.append(f"cells: the sticky error of cell {sticky_at} should be said once, in its cell; "
                            f"said after cells {unusable_at}")
        if part["stalls_said_busy"] != part["stalls"]:
            problems.append(f"cells: {part['stalls']} cells left a synchronize stalled, "
                            f"{part['stalls_said_busy']} of them said GPU0 was busy")
        growth(part, problems, rss_limit, "cells")
    except Missing as exc:
        missing(part, problems, "cells", exc)
    finally:
        kernel.stop()
        part["duration_s"] = round(time.monotonic() - started, 1)
    unanswered(part, problems, "cells")
    return part


# ---------------------------------------------------------------- reload


#: the baseline's set-up: the cells part's helpers without the extension; ``_soak`` only reads the fake
#: driver's state (nothing would trim the pools the schedule fills)
BASELINE_SETUP = "\n".join(line for line in SETUP.splitlines() if not line.startswith("%")) + """
def _soak(device, **change):
    _soak_json.loads(_soak_fake.fake_cuda_state_json())["devices"][device]
"""


def part_baseline(n: int, seed: int, env: dict, log) -> dict:
    """The cells part's cells in a kernel without gpucleanup: how much IPython and ipykernel grow by
    themselves over the same cells (no limit: a figure to read the cells part's growth against)."""
    started = time.monotonic()
    problems: List[str] = []
    part = {"cells": n, "sent": {"cells": 0}, "received": {"cells": 0}, "resources": {}, "rss_samples": [],
            "problems": problems}
    kernel = Kernel(env).ready()
    pid = kernel.pid
    try:
        setup = kernel.execute(BASELINE_SETUP)
        if cell_failed(setup):
            problems.append(f"baseline: the set-up cell failed: {cell_failed(setup)}")
            return part
        part["resources"]["start"] = settled(pid)
        warm_at = min(max(1, int(n * WARM_UP)), n - 1)
        for i, step in enumerate(schedule(n, seed)):
            if i == warm_at:
                part["resources"]["warm_up"] = settled(pid)
            part["sent"]["cells"] += 1
            cell = kernel.execute(cell_code(i, step))
            part["received"]["cells"] += 1
            if cell_failed(cell):
                problems.append(f"baseline: cell {i} failed: {cell_failed(cell)}")
            if (i + 1) % max(1, n // 10) == 0:
                part["rss_samples"].append([i + 1, resources(pid)["rss_bytes"]])
                log(f"baseline: {i + 1}/{n}")
        part["resources"]["end"] = settled(pid, part["resources"]["warm_up"])
        warm, end = part["resources"]["warm_up"], part["resources"]["end"]
        part["growth_after_warm_up"] = {k: end[k] - warm[k] for k in ("rss_bytes",) + COUNTS}
    except Missing as exc:
        missing(part, problems, "baseline", exc)
    finally:
        kernel.stop()
        part["duration_s"] = round(time.monotonic() - started, 1)
    return part


def part_reload(n: int, env: dict, runtime: Path, rss_limit: Optional[int], log) -> dict:
    started = time.monotonic()
    problems: List[str] = []
    part = {"cycles": n, "sent": {"cells": 0, "status": 0}, "received": {"cells": 0, "status": 0},
            "discovery": {"present_when_loaded": 0, "absent_after_unload": 0}, "resources": {}, "rss_samples": [],
            "problems": problems}
    kernel = Kernel(env).ready()
    pid = kernel.pid
    from gpucleanup.protocol import discovery

    def present_now() -> bool:
        # each load writes files named from a new instance (<pid>-<random>): found by the pid, then by that name
        found = discovery.path_for_pid(pid, runtime)
        return found.exists() and (runtime / "gpucleanup" / f"{discovery.instance_of(found)}.key").exists()

    def run(code: str) -> None:
        part["sent"]["cells"] += 1
        cell = kernel.execute(code)
        part["received"]["cells"] += 1
        failed = cell_failed(cell)
        if failed:
            problems.append(f"reload: {code!r} failed: {failed}")

    def loaded(what: str, cycle: int) -> None:
        present = present_now()
        part["discovery"]["present_when_loaded"] += present
        if not present:
            problems.append(f"reload: cycle {cycle}: no discovery file or key after {what}")
        part["sent"]["status"] += 1
        part["received"]["status"] += status_ok(ask_status(runtime, pid))

    try:
        run("x = 1")
        part["resources"]["start"] = settled(pid)
        warm_at = max(1, int(n * WARM_UP))
        for cycle in range(n):
            if cycle == warm_at:
                part["resources"]["warm_up"] = settled(pid)
            run("%load_ext gpucleanup")
            loaded("%load_ext", cycle)
            run("%reload_ext gpucleanup")
            loaded("%reload_ext", cycle)
            run(f"x = {cycle}")
            run("%unload_ext gpucleanup")
            mine = [p for p in runtime_listing(runtime) if str(pid) in p]
            part["discovery"]["absent_after_unload"] += not mine
            if mine:
                problems.append(f"reload: cycle {cycle}: left after %unload_ext: {mine}")
            if cycle == 0:
                part["resources"]["after_first_cycle"] = settled(pid)
            if (cycle + 1) % max(1, n // 10) == 0:
                part["rss_samples"].append([cycle + 1, resources(pid)["rss_bytes"]])
                log(f"reload: {cycle + 1}/{n}")
        part["resources"].setdefault("warm_up", part["resources"]["after_first_cycle"])  # fewer than 2 cycles
        part["resources"]["end"] = settled(pid, part["resources"]["warm_up"])
        growth(part, problems, rss_limit, "reload")
    except Missing as exc:
        missing(part, problems, "reload", exc)
    finally:
        kernel.stop()
        part["duration_s"] = round(time.monotonic() - started, 1)
    unanswered(part, problems, "reload")
    return part


# ---------------------------------------------------------------- kernels


class PsLoop(threading.Thread):
    """``python -m gpucleanup ps --json`` in a loop until stopped; every run's exit status and JSON checked."""

    def __init__(self, env: dict):
        super().__init__(name="soak-ps", daemon=True)
        self.env = env
        self.stopping = threading.Event()
        self.runs = self.ok = 0
        self.kernels_seen = 0
        self.errors: Dict[str, int] = {}
        self.failures: List[str] = []
        self.stderr_lines: List[str] = []

    def once(self) -> list:
        done = subprocess.run([sys.executable, "-m", "gpucleanup", "ps", "--json", "--timeout", "2"],
                              env=self.env, capture_output=True, text=True, timeout=REPLY_TIMEOUT)
        self.runs += 1
        if done.stderr.strip():
            self.stderr_lines += done.stderr.strip().splitlines()[:5]
        try:
            listed = json.loads(done.stdout)
        except ValueError:
            listed = None
        if done.returncode != 0 or not isinstance(listed, list):
            self.failures.append(f"exit {done.returncode}, stdout {done.stdout[:200]!r}, stderr {done.stderr[:200]!r}")
            return []
        self.ok += 1
        self.kernels_seen += len(listed)
        for entry in listed:
            if "error" in entry:
                # a kernel stopping or killed between the scan and the request: said in its entry
                kind = re.sub(r"\d+", "N", str(entry["error"]))[:80]
                self.errors[kind] = self.errors.get(kind, 0) + 1
        return listed

    def run(self) -> None:
        while not self.stopping.is_set():
            try:
                self.once()
            except subprocess.TimeoutExpired:
                self.failures.append(f"ps did not end within {REPLY_TIMEOUT:g} s")


def part_kernels(n: int, batch: int, env: dict, runtime: Path, log) -> dict:
    started = time.monotonic()
    problems: List[str] = []
    me = os.getpid()
    part = {"kernels": n, "batch": batch, "sent": {"cells": 0, "status": 0}, "received": {"cells": 0, "status": 0},
            "stopped": {"shutdown": 0, "killed": 0}, "runtime_dir": {}, "resources": {}, "problems": problems}
    part["runtime_dir"]["start"] = runtime_listing(runtime)
    part["resources"]["start"] = resources(me)
    ps = PsLoop(env)
    done = 0

    def churn(count: int) -> None:
        """``count`` kernels, ``batch`` at a time: started, the extension loaded, a cell, a status request;
        then every other one killed (its files stay for gpucleanup ps to remove), the others shut down."""
        nonlocal done
        goal = done + count
        while done < goal:
            group = [Kernel(env) for _ in range(min(batch, goal - done))]
            try:
                for kernel in group:
                    kernel.ready()
                    for code in ("%load_ext gpucleanup", "x = 1"):
                        part["sent"]["cells"] += 1
                        cell = kernel.execute(code)
                        part["received"]["cells"] += 1
                        if cell_failed(cell):
                            problems.append(f"kernels: {code!r} failed in kernel {kernel.pid}: {cell_failed(cell)}")
                    part["sent"]["status"] += 1
                    part["received"]["status"] += status_ok(ask_status(runtime, kernel.pid))
            finally:
                for kernel in group:
                    killed = done % 2 == 1
                    kernel.stop(now=killed)
                    part["stopped"]["killed" if killed else "shutdown"] += 1
                    done += 1
            if done % max(1, n // 10) < len(group):
                log(f"kernels: {done}/{n}")

    try:
        # The warm-up, before gpucleanup ps runs: this process's jupyter_client and ZeroMQ machinery
        # (ZeroMQ's own threads) start with its first kernel and stay.
        churn(max(1, int(n * WARM_UP)))
        ps.once()  # removes what a killed warm-up kernel left
        part["resources"]["warm_up"] = settled(me)
        ps.start()
        churn(n - done)
    except Missing as exc:
        missing(part, problems, "kernels", exc)
    finally:
        if ps.is_alive():
            ps.stopping.set()
            ps.join()
    # after the last kernel: one more ps, which removes what the killed kernels left
    last = ps.once()
    if last:
        problems.append(f"kernels: gpucleanup ps still lists {len(last)} kernel(s) after every kernel stopped")
    part["runtime_dir"]["end"] = runtime_listing(runtime)
    if part["runtime_dir"]["end"] != part["runtime_dir"]["start"]:
        problems.append(f"kernels: left in the runtime directory: "
                        f"{sorted(set(part['runtime_dir']['end']) - set(part['runtime_dir']['start']))}")
    part["resources"].setdefault("warm_up", resources(me))
    part["resources"]["end"] = settled(me, part["resources"]["warm_up"])
    for key in back(part["resources"]["warm_up"], part["resources"]["end"]):
        problems.append(f"kernels: this process's {key}: {part['resources']['warm_up'][key]} after the warm-up, "
                        f"{part['resources']['end'][key]} at the end")
    part["ps"] = {"runs": ps.runs, "ok": ps.ok, "kernels_listed": ps.kernels_seen, "entry_errors": ps.errors,
                  "failures": ps.failures[:10], "stderr": ps.stderr_lines[:10]}
    if ps.failures:
        problems.append(f"kernels: {len(ps.failures)} of {ps.runs} gpucleanup ps runs failed: {ps.failures[0]}")
    if ps.stderr_lines:
        problems.append(f"kernels: gpucleanup ps said on stderr: {ps.stderr_lines[0]}")
    unanswered(part, problems, "kernels")
    part["duration_s"] = round(time.monotonic() - started, 1)
    return part


# ---------------------------------------------------------------- report

#: what ipykernel itself says at every start on a TCP transport (not the soak's business)
_KERNEL_NOISE = re.compile(r"Kernel is running over TCP without encryption")


def kernel_output(text: str) -> dict:
    """The kernels' own output (stderr and stdout of their processes): lines beyond ipykernel's start-up notice."""
    lines = [line for line in text.splitlines() if line.strip() and not _KERNEL_NOISE.search(line)]
    return {"lines": len(lines), "first": lines[:20]}



def _mib(n: Optional[int]) -> str:
    return "" if n is None else f"{n / MiB:.1f}"


def summary(result: dict) -> str:
    from gpucleanup.records.report import Table

    rows = []
    for name in ("cells", "baseline", "reload", "kernels"):
        part = result["parts"].get(name)
        if not part:
            continue
        res = part["resources"]
        for point in ("start", "after_first_cycle", "warm_up", "end"):
            if point in res:
                r = res[point]
                who = {"kernels": "this process", "baseline": "kernel without gpucleanup"}.get(name, "kernel")
                rows.append([f"{name} ({who})", point.replace("_", " "),
                             _mib(r["rss_bytes"]), r["threads"], r["fds"], r["sockets"]])
        grown = part.get("growth_after_warm_up")
        if grown:
            rows.append([name, "growth after warm-up", f"{grown['rss_bytes'] / MiB:+.2f}", f"{grown['threads']:+d}",
                         f"{grown['fds']:+d}", f"{grown['sockets']:+d}"])
    table = Table("resources", ["part", "when", "RSS MiB", "threads", "fds", "sockets"], rows, align="llrrrr")
    lines = [table.text(), ""]
    replies = []
    for name in ("cells", "baseline", "reload", "kernels"):
        part = result["parts"].get(name)
        if part:
            for key, sent in part["sent"].items():
                replies.append([name, key, sent, part["received"][key]])
    if "kernels" in result["parts"]:
        ps = result["parts"]["kernels"]["ps"]
        replies.append(["kernels", "gpucleanup ps --json", ps["runs"], ps["ok"]])
    lines += [Table("requests and replies", ["part", "what", "sent", "answered"], replies, align="llrr").text(), ""]
    for name in ("cells", "baseline", "reload", "kernels"):
        part = result["parts"].get(name)
        if part:
            extra = ""
            if name == "cells":
                extra = f"; schedule {part['schedule']}; lines {part['lines']}"
            elif name == "reload":
                extra = f"; discovery {part['discovery']}"
            elif name == "baseline":
                extra = "; the cells part's cells without gpucleanup (no limit)"
            else:
                extra = (f"; stopped {part['stopped']}; runtime dir at the end {part['runtime_dir']['end'] or 'as at the start'}"
                         f"; ps entries without status {part['ps']['entry_errors'] or 0}")
            lines.append(f"{name}: {part['duration_s']} s{extra}")
    out = result.get("kernel_output") or {}
    lines.append(f"kernels' own output: {out.get('lines', 0)} line(s)" + "".join(f"\n  {l}" for l in out.get("first", [])[:5]))
    if result["parameters"].get("rss_limit_off"):
        lines.append(f"resident memory: no limit applied ({result['parameters']['rss_limit_off']})")
    lines.append("")
    lines.append("verdict: " + ("pass" if not result["problems"] else "FAIL"))
    lines += [f"  - {p}" for p in result["problems"]]
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cells", type=int, default=2000, help="cells in the cells part (0 skips it; default 2000)")
    parser.add_argument("--reloads", type=int, default=200, help="load/reload/unload cycles (0 skips; default 200)")
    parser.add_argument("--kernels", type=int, default=50, help="kernels started and stopped (0 skips; default 50)")
    parser.add_argument("--every", type=int, default=10, help="%%gpumem --json and a status request every N cells (default 10)")
    parser.add_argument("--batch", type=int, default=2, help="kernels started together in the kernels part (default 2)")
    parser.add_argument("--seed", type=int, default=1, help="seed of the cells' schedule (default 1)")
    parser.add_argument("--rss-limit-mib", type=float, default=5.0,
                        help="largest growth of resident memory after the warm-up (default 5 MiB)")
    parser.add_argument("--baseline", action="store_true",
                        help="also run the cells part's cells in a kernel without gpucleanup, for comparison")
    parser.add_argument("--json", metavar="PATH", help="write the figures there as JSON")
    parser.add_argument("--build-dir", default=os.environ.get("GPUCLEANUP_BUILD_DIR", str(ROOT / "build")),
                        help="the CMake build directory with the fake driver ($GPUCLEANUP_BUILD_DIR, default build/)")
    parser.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    args = parser.parse_args(argv)
    for name in ("cells", "reloads", "kernels", "every"):
        if getattr(args, name) < 0:
            parser.error(f"--{name} needs a number >= 0, got {getattr(args, name)}")
    if args.batch < 1:
        parser.error(f"--batch needs a number >= 1, got {args.batch}")

    build = Path(args.build_dir).resolve()
    library, fake = build / "native" / "libgpucleanup.so", build / "tests" / "fake_cuda" / "libcuda.so.1"
    for path in (library, fake):
        if not path.exists():
            print(f"soak: {path} is missing: build first (cmake -S . -B build -G Ninja -DGPUCLEANUP_BUILD_TESTS=ON "
                  "&& cmake --build build), or point --build-dir at the build", file=sys.stderr)
            return 2
    try:
        import ipykernel  # noqa: F401
        import jupyter_client  # noqa: F401
    except ImportError as exc:
        print(f"soak: {exc.name} is not installed: run scripts/setup.sh and use .venv/bin/python", file=sys.stderr)
        return 2

    def log(text: str) -> None:
        if not args.quiet:
            print(f"soak: {text}", file=sys.stderr, flush=True)

    base = Path(tempfile.mkdtemp(prefix="gpucleanup-soak-"))
    runtime = base / "runtime"
    runtime.mkdir(mode=0o700)
    # This process's own connection files (jupyter_client) go there too, so the runtime directory is
    # all the soak's: its listing at the end is compared with the start.
    os.environ["JUPYTER_RUNTIME_DIR"] = str(runtime)
    # The kernels load copies: a rebuild of the build tree while the soak runs must not change (or
    # truncate) the libraries under them.
    libs = base / "lib"
    libs.mkdir()
    library = Path(shutil.copy2(library, libs / library.name))
    fake = Path(shutil.copy2(fake, libs / fake.name))
    # and a copy of the package, which this process imports too: edits of the tree meanwhile change nothing
    package = base / "ipython_ext"
    shutil.copytree(ROOT / "ipython_ext", package, ignore=shutil.ignore_patterns("__pycache__"))
    sys.path.insert(0, str(package))
    for name in [m for m in sys.modules if m == "gpucleanup" or m.startswith("gpucleanup.")]:
        del sys.modules[name]
    from gpucleanup.outside import kernels
    from gpucleanup.records import report  # noqa: F401  (from the copy, before anything runs)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GPUCLEANUP_FAKE_CUDA", "JPY_"))}
    env.update(PYTHONPATH=os.pathsep.join(filter(None, [str(package), os.environ.get("PYTHONPATH")])),
               GPUCLEANUP_LIBRARY=str(library), GPUCLEANUP_LIBCUDA=str(fake),
               GPUCLEANUP_FAKE_CUDA_SCENARIO=json.dumps(SCENARIO), JUPYTER_RUNTIME_DIR=str(runtime),
               IPYTHONDIR=str(base / "ipython"), NO_COLOR="1")
    env.pop("GPUCLEANUP_STATUS_TRANSPORT", None)
    rss_limit: Optional[int] = int(args.rss_limit_mib * MiB)
    rss_limit_off = None
    if asan_preloaded(env):
        rss_limit, rss_limit_off = None, ("the kernels run under AddressSanitizer, whose quarantine keeps freed "
                                          "memory resident")
    result = {
        "parameters": {"cells": args.cells, "reloads": args.reloads, "kernels": args.kernels, "every": args.every,
                       "batch": args.batch, "seed": args.seed,
                       "rss_limit_mib": None if rss_limit is None else args.rss_limit_mib,
                       "rss_limit_off": rss_limit_off,
                       "settle_timeout_s": SETTLE_TIMEOUT, "warm_up": WARM_UP},
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform(),
                    "driver": "fake CUDA driver (tests/fake_cuda)"},
        "parts": {},
    }
    global KERNEL_LOG
    log_path = base / "kernels.log"
    KERNEL_LOG = open(log_path, "ab")
    started = time.monotonic()
    try:
        if args.cells:
            result["parts"]["cells"] = part_cells(args.cells, args.every, args.seed, env, runtime, rss_limit, log)
        if args.cells and args.baseline:
            result["parts"]["baseline"] = part_baseline(args.cells, args.seed, env, log)
        if args.reloads:
            result["parts"]["reload"] = part_reload(args.reloads, env, runtime, rss_limit, log)
        if args.kernels:
            result["parts"]["kernels"] = part_kernels(args.kernels, args.batch, env, runtime, log)
        KERNEL_LOG.close()
        result["kernel_output"] = kernel_output(log_path.read_text(errors="replace"))
    finally:
        KERNEL_LOG.close()
        shutil.rmtree(base, ignore_errors=True)
    result["duration_s"] = round(time.monotonic() - started, 1)
    result["problems"] = [p for part in result["parts"].values() for p in part["problems"]]
    result["verdict"] = "pass" if not result["problems"] else "fail"
    print(summary(result))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
        print(f"figures: {args.json}")
    return 0 if not result["problems"] else 1


if __name__ == "__main__":
    sys.exit(main())
