"""Prometheus metrics of every kernel's GPU memory: a collector, jupyter_server's ``/metrics``, the exporter's registry.

:class:`KernelCollector` asks every kernel with gpucleanup on this machine (``kernels.gather``, all at once, each
at most ``timeout`` seconds) when it is scraped; README "Prometheus and Grafana" lists every series and label.
``prometheus_client`` is optional (``pip install gpucleanup[server]``): this module imports without it, and using
it without it raises :class:`MetricsUnavailable`, which says how to install it.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math
import os
import pwd
import threading
import time
import weakref
from concurrent.futures import Future, TimeoutError as FutureTimeout
from pathlib import Path
from typing import Any, Dict, Iterable, List, Optional, Tuple

from ..protocol import discovery
from . import kernels
from ..protocol import status_client
from ..say import printable

__all__ = [
    "KernelCollector",
    "ServerCollector",
    "MetricsUnavailable",
    "STATES",
    "register_server_collector",
    "unregister_server_collector",
    "make_registry",
    "kernel_user",
    "idle_seconds",
]

log = logging.getLogger("gpucleanup")

#: the states ``gpucleanup_kernel_state`` has a series for; any other state counts as "unknown"
STATES = ("idle", "running", "draining", "waiting", "parking", "parked", "lost", "unknown")

KERNEL_LABELS = ("kernel_id", "notebook", "pid", "user")
#: the kernel labels that carry a value in a public exporter's metrics (``--public``): what ``ps`` shows every
#: local user (the pid and its owner); the others are empty
PUBLIC_KERNEL_LABELS = ("pid", "user")
DEVICE_LABELS = KERNEL_LABELS + ("device", "uuid")


class MetricsUnavailable(ImportError):
    """prometheus_client is not installed."""


def _prometheus():
    """prometheus_client, or :class:`MetricsUnavailable` with the command that installs it."""
    try:
        import prometheus_client
        import prometheus_client.core  # noqa: F401  (the metric families)
    except ImportError as exc:
        raise MetricsUnavailable(
            f"gpucleanup's Prometheus metrics need prometheus_client ({exc}): "
            "install it with pip install 'gpucleanup[server]' (or pip install prometheus_client)"
        ) from exc
    return prometheus_client


def _count(value) -> Optional[int]:
    """A byte count or counter from a reply, None when it is not a non-negative int."""
    return value if type(value) is int and value >= 0 else None


def _number(value) -> Optional[float]:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value)


class KernelCollector:
    """Every kernel's GPU memory, asked at scrape time: prometheus_client's Collector protocol
    (``collect``, and ``describe`` so that registering asks no kernel).

    ``runtime_dir``: where the kernels' discovery files are (default: Jupyter's runtime directory);
    ``timeout``: seconds each kernel has to answer (all are asked at once, so a scrape takes at most
    about that long).
    """

    def __init__(self, runtime_dir: Optional[Path] = None, timeout: float = status_client.DEFAULT_TIMEOUT,
                 public: bool = False):
        seconds = _number(timeout)
        if seconds is None or seconds <= 0:
            raise ValueError(f"timeout must be a number of seconds above 0, got {timeout!r}")
        self.runtime_dir = Path(runtime_dir) if runtime_dir is not None else None
        self.timeout = seconds
        #: served to whoever asks (``gpucleanup exporter --public``): only the labels of PUBLIC_KERNEL_LABELS
        #: carry a value, the others are empty
        self.public = bool(public)
        self._lock = threading.Lock()
        self._running: Optional[Future] = None  # the collection in progress, shared by every scrape
        self._latest: Optional[List[Any]] = None  # the families of the last collection that finished
        self._latest_started = 0.0  # when that collection started (time.monotonic())
        self.collections = 0  # how many collections ran (each asked every kernel once)

    # ------------------------------------------------------------------ the families

    @staticmethod
    def _families(prom) -> Dict[str, Any]:
        core = prom.core
        gauge, counter, histogram = core.GaugeMetricFamily, core.CounterMetricFamily, core.HistogramMetricFamily
        per_framework = DEVICE_LABELS + ("framework",)
        return {
            "live": gauge("gpucleanup_device_live_bytes",
                          "GPU memory held by live arrays and tensors, per framework, after the kernel's last cleanup.",
                          labels=per_framework, unit="bytes"),
            "cached": gauge("gpucleanup_device_cached_bytes",
                            "GPU memory a framework keeps cached and could not give back, after the kernel's last cleanup.",
                            labels=per_framework, unit="bytes"),
            "outside": gauge("gpucleanup_device_outside_bytes",
                             "Device memory no framework and no driver pool accounts for (CUDA context, raw allocations, "
                             "other processes on the GPU), after the kernel's last cleanup.",
                             labels=DEVICE_LABELS, unit="bytes"),
            "used": gauge("gpucleanup_device_used_bytes",
                          "Device memory in use as the CUDA driver sees it (device-wide, every process).",
                          labels=DEVICE_LABELS, unit="bytes"),
            "total": gauge("gpucleanup_device_total_bytes", "Device memory in all.", labels=DEVICE_LABELS, unit="bytes"),
            "pool_reserved": gauge("gpucleanup_driver_pool_reserved_bytes",
                                   "Device memory the kernel's CUDA memory pools reserve.", labels=DEVICE_LABELS,
                                   unit="bytes"),
            "pool_used": gauge("gpucleanup_driver_pool_used_bytes",
                               "Device memory in use within the kernel's CUDA memory pools.", labels=DEVICE_LABELS,
                               unit="bytes"),
            "freed": counter("gpucleanup_freed_bytes",
                             "GPU memory gpucleanup freed in the kernel since its extension loaded, per device and "
                             "framework ('driver': the CUDA driver's pools).",
                             labels=per_framework, unit="bytes"),
            "pinned_freed": counter("gpucleanup_pinned_freed_bytes",
                                    "Pinned (page-locked) host memory gpucleanup freed in the kernel since its extension "
                                    "loaded, per framework.",
                                    labels=KERNEL_LABELS + ("framework",), unit="bytes"),
            "cells": counter("gpucleanup_cells_cleaned",
                             "Cleanups gpucleanup recorded in the kernel since its extension loaded (cells that used "
                             "the GPU, %gpumem --drain).",
                             labels=KERNEL_LABELS),
            "outside_drains": counter("gpucleanup_drains_from_outside",
                                      "Drains asked for from outside the kernel (gpucleanup drain, the page's Drain) "
                                      "since its extension loaded; not counted as cells cleaned.",
                                      labels=KERNEL_LABELS),
            "wait": histogram("gpucleanup_wait_seconds",
                              "How long each cleanup waited for the kernel's queued GPU work to settle.",
                              labels=KERNEL_LABELS, unit="seconds"),
            "state": gauge("gpucleanup_kernel_state",
                           "1 for the kernel's current state (idle, running, draining, waiting, parking, parked, unknown), "
                           "0 for the others.",
                           labels=KERNEL_LABELS + ("state",)),
            "state_age": gauge("gpucleanup_kernel_state_age_seconds", "How long the kernel has been in its state.",
                               labels=KERNEL_LABELS),
            "idle": gauge("gpucleanup_kernel_idle_seconds",
                          "Seconds since the kernel's last cell ended (a park, a resume or a drain from outside "
                          "since then does not count), or since gpucleanup loaded if no cell ran; 0 while a cell "
                          "runs.",
                          labels=KERNEL_LABELS, unit="seconds"),
            "parked": gauge("gpucleanup_kernel_parked",
                            "1 while the kernel is parked (its GPU memory, context included, in host memory), else 0.",
                            labels=KERNEL_LABELS),
            "parked_bytes": gauge("gpucleanup_kernel_parked_bytes",
                                  "Device memory the parked kernel holds in host memory (while parked, when known).",
                                  labels=KERNEL_LABELS, unit="bytes"),
            "device_parked": gauge("gpucleanup_device_parked_bytes",
                                   "Device memory that kernels parked from this GPU hold in host memory (the sum "
                                   "over them; device empty when the GPU is not known).",
                                   labels=("device", "uuid"), unit="bytes"),
            "up": gauge("gpucleanup_kernel_up", "1 when the kernel's status endpoint answered this scrape, 0 when not.",
                        labels=KERNEL_LABELS),
            "error": gauge("gpucleanup_kernel_error",
                           "1 for a kernel that did not answer, with why (kind: no_answer, refused, bad_key).",
                           labels=KERNEL_LABELS + ("kind",)),
            "kernels": gauge("gpucleanup_kernels", "Kernels with gpucleanup found in this PID namespace."),
            "elsewhere": gauge("gpucleanup_kernels_elsewhere",
                               "Kernels with gpucleanup on other machines or in other PID or network namespaces: listed, never asked."),
            "scrape_ok": gauge("gpucleanup_scrape_ok",
                               "1 when the runtime directory was scanned, 0 when not (the gpucleanup logger says why)."),
            "duration": gauge("gpucleanup_scrape_duration_seconds", "How long asking the kernels took.", unit="seconds"),
            "collected": gauge("gpucleanup_collected_timestamp_seconds",
                               "When these figures were collected (Unix time): on jupyter_server's /metrics they "
                               "are those of the collection the previous scrape started.", unit="seconds"),
        }

    def describe(self) -> Iterable[Any]:
        """The families without samples: what a registry reads to check names, without asking a kernel."""
        return list(self._families(_prometheus()).values())

    def collect(self) -> Iterable[Any]:
        """Every kernel's figures; never raises for one kernel's sake.

        Scrapes that come while a collection runs share it: every kernel is asked once, however
        many scrapes wait. A collection runs on a thread of its own, never on the caller's. Called
        on a thread that runs an event loop (jupyter_server's ``/metrics`` handler is synchronous,
        on the server's loop), it returns the figures of the last collection that finished and starts
        the next, so the server's loop does not wait on a kernel; its figures are then one scrape old
        (``gpucleanup_collected_timestamp_seconds``). Only when there are no such figures (the first
        scrape) or they are older than :data:`STALE_AFTER_S` does it wait for the collection, at most
        ``timeout`` + 0.5 s (every kernel is asked at once), then shows what there is. Called
        elsewhere (the exporter's request threads, a test), it waits for the shared collection,
        which is bounded by ``timeout`` (every kernel is asked at once).
        """
        running = self._start()
        if _on_event_loop():
            latest = self._latest
            if latest is not None and time.monotonic() - self._latest_started < STALE_AFTER_S:
                return latest
            # the first scrape, or one after a long pause: the figures of a collection it started, not
            # those of the server's start; bounded (every kernel is asked at once, each for ``timeout``)
            try:
                return running.result(timeout=self.timeout + _LOOP_MARGIN_S)
            except FutureTimeout:
                return latest if latest is not None else list(self._families(_prometheus()).values())
        try:
            return running.result(timeout=self.timeout + _COLLECT_MARGIN_S)
        except FutureTimeout:  # a directory that takes ages to scan: the last figures
            latest = self._latest
            return latest if latest is not None else list(self._families(_prometheus()).values())

    def _start(self) -> "Future":
        """The collection in progress, or a new one started on a thread of its own."""
        with self._lock:
            if self._running is not None:
                return self._running
            running = self._running = Future()
        threading.Thread(target=self._run, args=(running,), name="gpucleanup-metrics", daemon=True).start()
        return running

    def _run(self, running: "Future") -> None:
        started = time.monotonic()
        try:
            families = self.collect_now()
            self._latest, self._latest_started = families, started
            running.set_result(families)
        except BaseException as exc:  # never lost: the waiting scrapes see it
            running.set_exception(exc)
        finally:
            with self._lock:
                if self._running is running:
                    self._running = None

    def collect_now(self) -> List[Any]:
        """Ask every kernel now, on the calling thread (:meth:`collect` shares it between scrapes)."""
        prom = _prometheus()
        self.collections += 1
        families = self._families(prom)
        start = time.perf_counter()
        ok, here, elsewhere = True, 0, 0
        parked: Dict[Tuple[str, str], int] = {}  # (device, uuid) -> parked bytes, over every kernel
        for directory in self.directories():
            try:
                # a scrape only reads: whoever can scrape must not be able to delete files
                gathered = kernels.gather(directory, timeout=self.timeout, clean=False)
            except Exception as exc:
                log.warning("gpucleanup metrics: cannot scan %s for kernels (%s: %s)",
                            directory or "Jupyter's runtime directory", type(exc).__name__, exc)
                ok = False
                continue
            for view in gathered.kernels:
                if view.elsewhere is not None:
                    elsewhere += 1
                    continue
                here += 1
                self._add_kernel(prom, families, view, parked)
        families["scrape_ok"].add_metric([], 1 if ok else 0)
        if ok:
            families["kernels"].add_metric([], here)
            families["elsewhere"].add_metric([], elsewhere)
        for (device, uuid), n in sorted(parked.items()):
            families["device_parked"].add_metric([device, uuid], n)
        families["duration"].add_metric([], time.perf_counter() - start)
        families["collected"].add_metric([], time.time())
        return list(families.values())

    def directories(self) -> List[Optional[Path]]:
        """The runtime directories asked at each collection (None: Jupyter's runtime directory)."""
        return [self.runtime_dir]

    # ------------------------------------------------------------------ one kernel

    def _kernel_labels(self, view: kernels.KernelView) -> List[str]:
        # Built from an allow-list: a public view names what every local user may see anyway (the pid and
        # its owner, as ps shows them), never the notebook or the kernel id.
        # escaped as a terminal would need (a scrape read with curl): the exposition format escapes only \\ " \n
        known = {"kernel_id": printable(view.kernel_id or ""), "notebook": printable(view.notebook or ""),
                 "pid": str(view.pid),
                 "user": kernel_user(view)}
        allowed = PUBLIC_KERNEL_LABELS if self.public else KERNEL_LABELS
        return [known[name] if name in allowed else "" for name in KERNEL_LABELS]

    def _add_kernel(self, prom, families: Dict[str, Any], view: kernels.KernelView,
                    parked: Dict[Tuple[str, str], int]) -> None:
        labels = self._kernel_labels(view)
        reply = view.status
        if not isinstance(reply, dict):
            families["up"].add_metric(labels, 0)
            families["error"].add_metric(labels + [view.error_kind or "no_answer"], 1)
            return
        families["up"].add_metric(labels, 1)
        state = reply.get("state") if isinstance(reply.get("state"), dict) else {}
        name = state.get("state")
        name = name if name in STATES else "unknown"
        for each in STATES:
            families["state"].add_metric(labels + [each], 1 if each == name else 0)
        families["parked"].add_metric(labels, 1 if name == "parked" else 0)
        parked_bytes = state.get("bytes")
        if name == "parked" and type(parked_bytes) is int and parked_bytes >= 0:
            families["parked_bytes"].add_metric(labels, parked_bytes)
            for key, n in _parked_per_device(view, reply, parked_bytes).items():
                parked[key] = parked.get(key, 0) + n
        age = _number(state.get("age_s"))
        if age is not None:
            families["state_age"].add_metric(labels, max(0.0, age))
        server = reply.get("server") if isinstance(reply.get("server"), dict) else {}
        idle = idle_seconds(state, server.get("started_ns"))
        if idle is not None:
            families["idle"].add_metric(labels, idle)

        uuids = _uuids(reply)
        # A parked kernel holds nothing on the GPU: its last record's live and cached figures, and the
        # snapshot from before the park, would count as held what is in host memory (parked_bytes).
        rows = [] if name == "parked" else kernels.device_rows(reply)
        for row in rows:
            index = row.get("index")
            if type(index) is not int:
                continue
            uuid = printable(row.get("uuid") or uuids.get(index) or "")
            device = labels + [str(index), uuid]
            for key, family in (("live_bytes", "live"), ("cached_bytes", "cached")):
                for framework, n in sorted((row.get(key) or {}).items()):
                    if _count(n) is not None:
                        families[family].add_metric(device + [printable(framework)], n)
            for key, family in (("outside_bytes", "outside"), ("used_bytes", "used"), ("total_bytes", "total"),
                                ("driver_pool_reserved_bytes", "pool_reserved"), ("driver_pool_used_bytes", "pool_used")):
                n = _count(row.get(key))
                if n is not None:
                    families[family].add_metric(device, n)

        record = reply.get("last_record")
        totals = record.get("totals") if isinstance(record, dict) else None
        if isinstance(totals, dict):
            self._add_totals(prom, families, labels, totals, uuids)

    @staticmethod
    def _add_totals(prom, families: Dict[str, Any], labels: List[str], totals: dict, uuids: Dict[int, str]) -> None:
        started = _count(totals.get("started_ns"))
        created = started / 1e9 if started else None
        cleanups = _count(totals.get("cleanups"))
        if cleanups is not None:
            families["cells"].add_metric(labels, cleanups, created=created)
        outside = _count(totals.get("drains_from_outside"))
        if outside is not None:
            families["outside_drains"].add_metric(labels, outside, created=created)
        for device in totals.get("devices") or []:
            index = device.get("index") if isinstance(device, dict) else None
            if type(index) is not int:
                continue
            for framework, n in sorted((device.get("freed_bytes") or {}).items()):
                if _count(n) is not None:
                    families["freed"].add_metric(labels + [str(index), printable(uuids.get(index, "")),
                                                  printable(framework)], n,
                                                 created=created)
        pinned = totals.get("pinned_freed_bytes")
        for framework, n in sorted((pinned if isinstance(pinned, dict) else {}).items()):
            if _count(n) is not None:
                families["pinned_freed"].add_metric(labels + [printable(framework)], n, created=created)
        buckets = _buckets(prom, totals.get("settle_wait_s"))
        if buckets is not None:
            families["wait"].add_metric(labels, buckets[0], buckets[1])


#: how much longer than the kernels' timeout a scrape off the event loop waits for the shared collection
#: (the scan of the runtime directory, reading the keys)
_COLLECT_MARGIN_S = 30.0
#: how much longer than the kernels' timeout a scrape on the server's event loop may wait for a collection,
#: when it must wait at all (the first scrape, or figures older than STALE_AFTER_S)
_LOOP_MARGIN_S = 0.5
#: figures older than this (from the start of their collection) are not shown by a scrape on the event
#: loop: it waits for fresh ones instead (Prometheus's default scrape interval is 1 min; a longer pause,
#: or none before, means the last figures say little about now)
STALE_AFTER_S = 300.0

def idle_seconds(state: dict, started_ns: Optional[int] = None) -> Optional[float]:
    """How long the kernel has been idle, from its status reply's ``state`` (and ``server.started_ns``), as of
    its answer; None when unknown (:func:`kernels.idle_for_s`).

    0 while a cell runs (``running``; ``waiting`` or ``draining`` of a cell); else the time since its last cell
    ended (the state's ``last_cell_ended_ns``), which a drain from outside, a park or a resume since then leave
    as it is: a kernel parked 30 min after its last cell and resumed from outside says 30 min and more, not the
    time since the resume. Since the status server started when no cell has ended since; the state's age from
    a library older than the field.
    """
    return kernels.idle_for_s(state, started_ns)


@functools.lru_cache(maxsize=4096)
def _user_name(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except (KeyError, OverflowError):
        return str(uid)


def _process_uid(pid: int) -> Optional[int]:
    """The real uid of process ``pid`` in this PID namespace (``/proc/<pid>/status``), None if unreadable."""
    try:
        with open(f"/proc/{int(pid)}/status", "r", encoding="ascii", errors="replace") as lines:
            for line in lines:
                if line.startswith("Uid:"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


def kernel_user(view: kernels.KernelView) -> str:
    """The ``user`` label: the name of the kernel process's owner (its uid when the name is not known),
    else the owner of its discovery file; empty when neither is known."""
    uid = _process_uid(view.pid) if view.elsewhere is None else None
    if uid is None:
        uid = getattr(view.kernel, "owner", None)
    return _user_name(uid) if type(uid) is int and uid >= 0 else ""


def _park_note(view: kernels.KernelView) -> dict:
    """What the kernel's last park wrote beside its key (``{"usage": {uuid: bytes}}``), {} when unreadable.
    Read without the park's lock: a note being written reads as malformed, and is ignored."""
    key_file = getattr(view.kernel, "key_file", None)
    if not key_file:
        return {}
    from ..park.lock import lock_path, peek_note

    return peek_note(lock_path(key_file, view.pid), owners={os.geteuid()})


def _parked_per_device(view: kernels.KernelView, reply: dict, parked_bytes: int) -> Dict[Tuple[str, str], int]:
    """A parked kernel's bytes per GPU, keyed (device index, UUID) as the device labels are.

    A park is refused for a process with memory on more than one GPU, so the bytes go to the one GPU the
    park's note names (what it moved, per GPU UUID), else to the one device the kernel's last snapshot or
    record shows in use; when neither tells, to device "" (not known)."""
    uuids = _uuids(reply)
    index_of = {uuid: index for index, uuid in uuids.items()}
    used = [row for row in kernels.device_rows(reply) if type(row.get("index")) is int]
    usage = _park_note(view).get("usage")
    if isinstance(usage, dict):
        moved = {u: n for u, n in usage.items() if isinstance(u, str) and _count(n) and n > 0}
        if len(moved) == 1:
            (uuid,) = moved
            index = index_of.get(uuid)
            if index is None and len(used) == 1:  # no snapshot while parked: the one device its record names
                index = used[0]["index"]
            return {("" if index is None else str(index), uuid): parked_bytes}
        if len(moved) > 1:
            return {("" if index_of.get(u) is None else str(index_of[u]), u): n for u, n in moved.items()}
    if len(used) == 1:
        index = used[0]["index"]
        return {(str(index), used[0].get("uuid") or uuids.get(index, "")): parked_bytes}
    return {("", ""): parked_bytes}


def _on_event_loop() -> bool:
    """Whether the calling thread is running an asyncio event loop (tornado's, for jupyter_server)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


def _uuids(reply: dict) -> Dict[int, str]:
    """Device index -> UUID, from the kernel's snapshot (every device it lists)."""
    snapshot = reply.get("snapshot")
    out: Dict[int, str] = {}
    for dev in (snapshot.get("devices") or []) if isinstance(snapshot, dict) else []:
        if isinstance(dev, dict) and type(dev.get("index")) is int and isinstance(dev.get("uuid"), str):
            out[dev["index"]] = dev["uuid"]
    return out


def _buckets(prom, wait) -> Optional[Tuple[List[Tuple[str, float]], float]]:
    """(buckets as HistogramMetricFamily takes them, sum) from ``totals.settle_wait_s``; None if malformed."""
    if not isinstance(wait, dict):
        return None
    bounds, counts = wait.get("le"), wait.get("counts")
    count, total = _count(wait.get("count")), _number(wait.get("sum"))
    if not isinstance(bounds, list) or not isinstance(counts, list) or len(bounds) != len(counts):
        return None
    if count is None or total is None:
        return None
    bounds = [_number(b) for b in bounds]
    if any(b is None for b in bounds) or bounds != sorted(set(bounds)):
        return None
    if any(_count(c) is None for c in counts) or counts != sorted(counts) or (counts and counts[-1] > count):
        return None
    go = prom.utils.floatToGoString
    return [(go(b), c) for b, c in zip(bounds, counts)] + [("+Inf", count)], total


# ---------------------------------------------------------------- jupyter_server's /metrics


class ServerCollector(KernelCollector):
    """The collector on jupyter_server's ``/metrics``: the kernels of every server registered with it,
    each from that server's own runtime directory, read at every collection.

    Every server in a process serves the same default registry, so one collector serves them all: it
    follows each server that registered (a server that stopped, or whose object is gone, is left out),
    and a directory two servers share is asked once.
    """

    def __init__(self, timeout: float = 0.5):
        super().__init__(None, timeout=timeout)
        self._servers_lock = threading.Lock()
        self._servers: Dict[int, Any] = {}  # id -> a callable giving the server app (None once it is gone)

    def add(self, serverapp: Any) -> bool:
        """Follow ``serverapp`` (None: Jupyter's runtime directory); False when it is followed already."""
        with self._servers_lock:
            known = self._servers.get(id(serverapp))
            if known is not None and known() is serverapp:
                return False
            try:
                ref = weakref.ref(serverapp) if serverapp is not None else (lambda: None)
            except TypeError:  # an object without weak references is kept as it is
                ref = (lambda app: (lambda: app))(serverapp)
            self._servers[id(serverapp)] = ref
            return True

    def remove(self, serverapp: Any) -> bool:
        with self._servers_lock:
            known = self._servers.get(id(serverapp))
            if known is None or known() is not serverapp:
                return False
            del self._servers[id(serverapp)]
            return True

    @property
    def servers(self) -> int:
        """Servers followed (a server whose object is gone no longer counts)."""
        with self._servers_lock:
            return sum(1 for key, ref in self._servers.items() if key == id(None) or ref() is not None)

    def directories(self) -> List[Optional[Path]]:
        with self._servers_lock:
            refs = list(self._servers.items())
        found: List[Optional[Path]] = []
        seen = set()
        for key, ref in refs:
            app = ref()
            if app is None and key != id(None):
                with self._servers_lock:
                    if self._servers.get(key) is ref:
                        del self._servers[key]
                continue
            if getattr(app, "_stopping", False) is True:  # ServerApp.stop() began: its kernels are going
                continue
            runtime = getattr(app, "runtime_dir", None) if app is not None else None
            directory = Path(runtime) if runtime else None
            where = os.path.realpath(directory if directory is not None else discovery.runtime_dir())
            if where not in seen:
                seen.add(where)
                found.append(directory)
        return found


_server_lock = threading.Lock()
_server_collectors: Dict[int, Tuple[Any, ServerCollector]] = {}  # id(registry) -> (registry, collector)


def register_server_collector(serverapp: Any = None, timeout: float = 0.5, registry: Any = None) -> ServerCollector:
    """Show gpucleanup's metrics on jupyter_server's own ``/metrics``; returns the collector registered.

    jupyter_server (2.x) serves ``<base_url>/metrics`` with ``PrometheusMetricsHandler``, which writes
    ``prometheus_client.generate_latest(prometheus_client.REGISTRY)``: the default registry, so the
    collector goes there (``registry`` overrides it). With ``ServerApp.authenticate_prometheus`` True
    (the default) a request that is not logged in gets 403: Prometheus must send the server's token
    (``Authorization: token <token>`` header, or ``?token=<token>``); ``c.ServerApp.authenticate_prometheus
    = False`` serves it to anyone who can reach the server.

    The kernels are those of ``serverapp.runtime_dir`` (Jupyter's runtime directory without a server app),
    read at each collection. One collector per registry: a second server registering (another
    ``ServerApp`` in the same process) adds its own runtime directory to it; the same server registering
    again adds nothing.

    The handler is synchronous, on the server's event loop, so the collector asks the kernels on a thread
    of its own: a scrape gets the figures of the last collection at once and starts the next one (scrapes
    that come meanwhile share it), so its figures are those of the previous scrape's time
    (``gpucleanup_collected_timestamp_seconds``). The first scrape, and one that comes more than
    ``STALE_AFTER_S`` after the last collection started, waits for the collection it started instead,
    for at most ``timeout`` + 0.5 s (every kernel is asked at once).

    jupyter_server calls no unload hook for a module's ``_load_jupyter_server_extension``: call
    :func:`unregister_server_collector` with the server when it stops, if any.
    """
    prom = _prometheus()
    registry = prom.REGISTRY if registry is None else registry
    with _server_lock:
        known = _server_collectors.get(id(registry))
        if known is not None and known[0] is registry:
            known[1].add(serverapp)
            return known[1]
        collector = ServerCollector(timeout=timeout)
        collector.add(serverapp)
        registry.register(collector)
        _server_collectors[id(registry)] = (registry, collector)
        return collector


_EVERY_SERVER = object()


def unregister_server_collector(registry: Any = None, serverapp: Any = _EVERY_SERVER) -> bool:
    """Stop following ``serverapp`` (default: every server) on ``registry`` (default: the default
    registry); the collector leaves the registry once it follows no server. False when nothing was
    registered there (or ``serverapp`` was not followed)."""
    prom = _prometheus()
    registry = prom.REGISTRY if registry is None else registry
    with _server_lock:
        known = _server_collectors.get(id(registry))
        if known is None or known[0] is not registry:
            return False
        collector = known[1]
        if serverapp is not _EVERY_SERVER:
            if not collector.remove(serverapp):
                return False
            if collector.servers:
                return True
        del _server_collectors[id(registry)]
        registry.unregister(collector)
        return True


# ---------------------------------------------------------------- the standalone exporter


def make_registry(runtime_dir: Optional[Path] = None, timeout: float = status_client.DEFAULT_TIMEOUT,
                  public: bool = False, with_collector: bool = False):
    """A registry of its own holding only gpucleanup's collector: no process or Python metrics of the
    exporter itself, which say nothing about the GPUs. ``with_collector``: (registry, collector)."""
    prom = _prometheus()
    registry = prom.CollectorRegistry()
    collector = KernelCollector(runtime_dir, timeout=timeout, public=public)
    registry.register(collector)
    return (registry, collector) if with_collector else registry
