"""Prometheus metrics of every kernel's GPU memory: a collector, jupyter_server's ``/metrics``, an exporter.

:class:`KernelCollector` asks every kernel with gpucleanup on this machine (``kernels.gather``, all at
once, each at most ``timeout`` seconds) when it is scraped, and exports per kernel and device. Labels:
``kernel_id``, ``notebook`` (empty when unknown), ``pid``; device series add ``device`` (the CUDA index)
and ``uuid`` (the device's UUID from the kernel's snapshot, empty when unknown); per-framework series add
``framework`` (``driver`` is the CUDA driver's own pools).

Gauges, as of the kernel's last cleanup (its ``last_record``) or its live snapshot:

- ``gpucleanup_device_live_bytes{framework}``, ``gpucleanup_device_cached_bytes{framework}``: held by live
  arrays and tensors / kept by the framework's cache (last cleanup);
- ``gpucleanup_device_outside_bytes``: device memory no framework and no driver pool accounts for (the CUDA
  context, raw allocations, other processes on the GPU; last cleanup);
- ``gpucleanup_device_used_bytes``, ``gpucleanup_device_total_bytes``: the device as the driver sees it
  (device-wide, every process: kernels on one GPU report the same figure; live snapshot);
- ``gpucleanup_driver_pool_reserved_bytes``, ``gpucleanup_driver_pool_used_bytes``: the kernel's CUDA
  memory pools (live snapshot);
- ``gpucleanup_kernel_state{state}``: 1 for the kernel's state, 0 for the others (idle, running, draining,
  waiting, parking, parked, unknown); ``gpucleanup_kernel_state_age_seconds``: how long it has been in it;
  ``gpucleanup_kernel_parked`` (1 while parked) and ``gpucleanup_kernel_parked_bytes`` (what it holds in host memory);
- ``gpucleanup_kernel_up``: 1 when the kernel answered, 0 when not; a kernel that did not answer has
  ``gpucleanup_kernel_error{kind}`` 1 (kind: no_answer, refused, bad_key) and no other series;
- ``gpucleanup_kernels``: kernels found in this PID namespace; ``gpucleanup_kernels_elsewhere``: kernels
  of other PID namespaces (containers), listed by their discovery files and never asked;
- ``gpucleanup_scrape_duration_seconds``, ``gpucleanup_scrape_ok`` (0: the runtime directory could not be
  scanned; the error is logged on the ``gpucleanup`` logger), ``gpucleanup_collected_timestamp_seconds``
  (when the kernels were asked: jupyter_server's ``/metrics`` shows the collection the previous scrape
  started, never asking a kernel on the server's event loop).

Counters, cumulative since the kernel's extension loaded (``last_record.totals``, ``gpucleanup.totals``;
a reload of the extension is a counter reset, with a new ``_created``):

- ``gpucleanup_freed_bytes_total{device, uuid, framework}``: bytes freed on each device;
- ``gpucleanup_pinned_freed_bytes_total{framework}``: pinned (page-locked) host memory freed;
- ``gpucleanup_cells_cleaned_total``: cleanups recorded (cells that used the GPU, ``%gpumem --drain``);
- ``gpucleanup_drains_from_outside_total``: drains asked for from outside the kernel (not cells);
- ``gpucleanup_wait_seconds`` (histogram): how long each cleanup waited for queued GPU work to settle.

Where they are served: :func:`register_server_collector` (jupyter_server's own ``/metrics``) and
:func:`run_exporter` / :func:`start_exporter` (``gpucleanup exporter``, hosts without a Jupyter server).

``prometheus_client`` is an optional dependency (``pip install gpucleanup[server]``): this module imports
without it; using it without it raises :class:`MetricsUnavailable` (the exporter: :class:`ExporterError`),
which says how to install it.
"""

from __future__ import annotations

import asyncio
import errno
import hmac
import logging
import math
import os
import re
import secrets
import socket
import stat
import sys
import threading
import time
from concurrent.futures import Future, TimeoutError as FutureTimeout
from pathlib import Path
from typing import Any, Dict, Iterable, List, Optional, Tuple

from . import discovery, kernels, status_client

__all__ = [
    "KernelCollector",
    "MetricsUnavailable",
    "ExporterError",
    "Exporter",
    "STATES",
    "register_server_collector",
    "unregister_server_collector",
    "make_registry",
    "start_exporter",
    "run_exporter",
]

log = logging.getLogger("gpucleanup")

#: the states ``gpucleanup_kernel_state`` has a series for; any other state counts as "unknown"
STATES = ("idle", "running", "draining", "waiting", "parking", "parked", "unknown")

KERNEL_LABELS = ("kernel_id", "notebook", "pid")
#: the kernel labels that carry a value in a public exporter's metrics (``--public``); the others are empty
PUBLIC_KERNEL_LABELS = ("pid",)
DEVICE_LABELS = KERNEL_LABELS + ("device", "uuid")


class MetricsUnavailable(ImportError):
    """prometheus_client is not installed."""


class ExporterError(ValueError):
    """The exporter cannot serve as asked; the message is one sentence that says what to do."""


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
            "parked": gauge("gpucleanup_kernel_parked",
                            "1 while the kernel is parked (its GPU memory, context included, in host memory), else 0.",
                            labels=KERNEL_LABELS),
            "parked_bytes": gauge("gpucleanup_kernel_parked_bytes",
                                  "Device memory the parked kernel holds in host memory (while parked, when known).",
                                  labels=KERNEL_LABELS, unit="bytes"),
            "up": gauge("gpucleanup_kernel_up", "1 when the kernel's status endpoint answered this scrape, 0 when not.",
                        labels=KERNEL_LABELS),
            "error": gauge("gpucleanup_kernel_error",
                           "1 for a kernel that did not answer, with why (kind: no_answer, refused, bad_key).",
                           labels=KERNEL_LABELS + ("kind",)),
            "kernels": gauge("gpucleanup_kernels", "Kernels with gpucleanup found in this PID namespace."),
            "elsewhere": gauge("gpucleanup_kernels_elsewhere",
                               "Kernels with gpucleanup of other PID namespaces (containers): listed, never asked."),
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
        on the server's loop), it never waits: it returns the figures of the last collection that
        finished (none before the first) and starts the next, so the server's loop never waits on
        a kernel; its figures are then one scrape old (``gpucleanup_scrape_age_seconds``). Called
        elsewhere (the exporter's request threads, a test), it waits for the shared collection,
        which is bounded by ``timeout`` (every kernel is asked at once).
        """
        running = self._start()
        if _on_event_loop():
            latest = self._latest
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
        try:
            families = self.collect_now()
            self._latest = families
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
        try:
            # a scrape only reads: whoever can scrape must not be able to delete files
            gathered = kernels.gather(self.runtime_dir, timeout=self.timeout, clean=False)
        except Exception as exc:
            log.warning("gpucleanup metrics: cannot scan %s for kernels (%s: %s)",
                        self.runtime_dir or "Jupyter's runtime directory", type(exc).__name__, exc)
            families["scrape_ok"].add_metric([], 0)
        else:
            families["scrape_ok"].add_metric([], 1)
            here = [v for v in gathered.kernels if v.elsewhere is None]
            families["kernels"].add_metric([], len(here))
            families["elsewhere"].add_metric([], len(gathered.kernels) - len(here))
            for view in here:
                self._add_kernel(prom, families, view)
        families["duration"].add_metric([], time.perf_counter() - start)
        families["collected"].add_metric([], time.time())
        return list(families.values())

    # ------------------------------------------------------------------ one kernel

    def _kernel_labels(self, view: kernels.KernelView) -> List[str]:
        # Built from an allow-list: a public view names what every local user may see anyway (the pid,
        # as ps shows it), never the notebook or the kernel id.
        known = {"kernel_id": view.kernel_id or "", "notebook": view.notebook or "", "pid": str(view.pid)}
        allowed = PUBLIC_KERNEL_LABELS if self.public else KERNEL_LABELS
        return [known[name] if name in allowed else "" for name in KERNEL_LABELS]

    def _add_kernel(self, prom, families: Dict[str, Any], view: kernels.KernelView) -> None:
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
        age = _number(state.get("age_s"))
        if age is not None:
            families["state_age"].add_metric(labels, max(0.0, age))

        uuids = _uuids(reply)
        for row in kernels.device_rows(reply):
            index = row.get("index")
            if type(index) is not int:
                continue
            uuid = row.get("uuid") or uuids.get(index) or ""
            device = labels + [str(index), uuid]
            for key, family in (("live_bytes", "live"), ("cached_bytes", "cached")):
                for framework, n in sorted((row.get(key) or {}).items()):
                    if _count(n) is not None:
                        families[family].add_metric(device + [str(framework)], n)
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
                    families["freed"].add_metric(labels + [str(index), uuids.get(index, ""), str(framework)], n,
                                                 created=created)
        pinned = totals.get("pinned_freed_bytes")
        for framework, n in sorted((pinned if isinstance(pinned, dict) else {}).items()):
            if _count(n) is not None:
                families["pinned_freed"].add_metric(labels + [str(framework)], n, created=created)
        buckets = _buckets(prom, totals.get("settle_wait_s"))
        if buckets is not None:
            families["wait"].add_metric(labels, buckets[0], buckets[1])


#: how much longer than the kernels' timeout a scrape off the event loop waits for the shared collection
#: (the scan of the runtime directory, reading the keys)
_COLLECT_MARGIN_S = 30.0


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

_server_lock = threading.Lock()
_server_collectors: Dict[int, Tuple[Any, KernelCollector]] = {}  # id(registry) -> (registry, collector)


def register_server_collector(serverapp: Any = None, timeout: float = 0.5, registry: Any = None) -> KernelCollector:
    """Show gpucleanup's metrics on jupyter_server's own ``/metrics``; returns the collector registered.

    jupyter_server (2.x) serves ``<base_url>/metrics`` with ``PrometheusMetricsHandler``, which writes
    ``prometheus_client.generate_latest(prometheus_client.REGISTRY)``: the default registry, so the
    collector goes there (``registry`` overrides it). With ``ServerApp.authenticate_prometheus`` True
    (the default) a request that is not logged in gets 403: Prometheus must send the server's token
    (``Authorization: token <token>`` header, or ``?token=<token>``); ``c.ServerApp.authenticate_prometheus
    = False`` serves it to anyone who can reach the server.

    The kernels are those of ``serverapp.runtime_dir`` (Jupyter's runtime directory without a server
    app). The handler is synchronous, on the server's event loop, so the collector never asks a kernel
    there: a scrape gets the figures of the last collection at once and starts the next one on a thread
    of its own (scrapes that come meanwhile share it); the figures a scrape shows are therefore those
    of the previous scrape's time (``gpucleanup_collected_timestamp_seconds``). A first collection
    starts when the collector is registered, so the first scrape already has figures.

    Registering is done once per registry: a second call returns the collector already there.
    jupyter_server calls no unload hook for a module's ``_load_jupyter_server_extension`` (only an
    ``ExtensionApp``'s ``stop_extension``): call :func:`unregister_server_collector` from there, if any.
    """
    prom = _prometheus()
    registry = prom.REGISTRY if registry is None else registry
    with _server_lock:
        known = _server_collectors.get(id(registry))
        if known is not None and known[0] is registry:
            return known[1]
        runtime_dir = getattr(serverapp, "runtime_dir", None) if serverapp is not None else None
        collector = KernelCollector(Path(runtime_dir) if runtime_dir else None, timeout=timeout)
        registry.register(collector)
        _server_collectors[id(registry)] = (registry, collector)
        collector._start()  # the first scrape finds figures
        return collector


def unregister_server_collector(registry: Any = None) -> bool:
    """Take the collector of :func:`register_server_collector` out of ``registry`` (default: the default
    registry); False when none was registered there."""
    prom = _prometheus()
    registry = prom.REGISTRY if registry is None else registry
    with _server_lock:
        known = _server_collectors.pop(id(registry), None)
        if known is None or known[0] is not registry:
            return False
        registry.unregister(known[1])
        return True


# ---------------------------------------------------------------- the standalone exporter


def make_registry(runtime_dir: Optional[Path] = None, timeout: float = status_client.DEFAULT_TIMEOUT,
                  public: bool = False):
    """A registry of its own holding only gpucleanup's collector: no process or Python metrics of the
    exporter itself, which say nothing about the GPUs."""
    prom = _prometheus()
    registry = prom.CollectorRegistry()
    registry.register(KernelCollector(runtime_dir, timeout=timeout, public=public))
    return registry


#: the token file's name in ``<runtime dir>/gpucleanup/`` (the directory of the kernels' keys, 0700)
TOKEN_FILE = "exporter.token"
_TOKEN = re.compile(r"[A-Za-z0-9._~+/=-]{16,512}", re.ASCII)


def token_path(runtime_dir: Optional[Path] = None) -> Path:
    """Where the exporter keeps its token by default: ``<runtime dir>/gpucleanup/exporter.token``."""
    return (Path(runtime_dir) if runtime_dir is not None else discovery.runtime_dir()) / discovery.KEY_DIR / TOKEN_FILE


def read_token(path: Path) -> str:
    """The bearer token in ``path``: a regular file of yours that no one else may read; ExporterError if not."""
    try:
        data, info = discovery.read_bounded(path, owners={os.geteuid()})
    except discovery.UnsafeFile as exc:
        raise ExporterError(f"token file {path} is {exc.strerror}: give a regular file of yours") from None
    except OSError as exc:
        raise ExporterError(f"cannot read the token file {path} ({exc.strerror or exc})") from None
    if stat.S_IMODE(info.st_mode) & 0o077:
        raise ExporterError(f"token file {path} may be read by others (mode {stat.S_IMODE(info.st_mode):o}): "
                            "chmod 600 it")
    token = data.decode("ascii", "replace").strip()
    if not _TOKEN.fullmatch(token):
        raise ExporterError(f"token file {path} does not hold a token (16 to 512 characters of A-Z a-z 0-9 ._~+/=-)")
    return token


def ensure_token(path: Path) -> str:
    """The token in ``path``, written there first (0600, a new random token) when the file does not exist."""
    path = Path(path)
    if not path.exists() and not path.is_symlink():
        try:
            discovery.ensure_private_dir(path.parent)
            discovery.write_private(path, (secrets.token_urlsafe(32) + "\n").encode("ascii"))
        except OSError as exc:
            raise ExporterError(f"cannot write the token file {path} ({exc.strerror or exc})") from None
    return read_token(path)


class Exporter:
    """A running exporter: ``url`` is where its metrics are; ``wait()`` blocks while it serves;
    ``shutdown()`` stops it (idempotent; from any thread)."""

    def __init__(self, server: Any, thread: threading.Thread, token_file: Optional[Path] = None):
        self.server = server
        self.thread = thread
        #: the file holding the bearer token scrapes must send; None for a public exporter
        self.token_file = token_file
        self._closed = False
        self._close_lock = threading.Lock()

    @property
    def host(self) -> str:
        return self.server.server_address[0]

    @property
    def port(self) -> int:
        return self.server.server_address[1]

    @property
    def url(self) -> str:
        host = self.host
        return f"http://{'[' + host + ']' if ':' in host else host}:{self.port}/metrics"

    def wait(self) -> None:
        """Block until the exporter is shut down (by another thread); Ctrl-C interrupts it
        (KeyboardInterrupt), the exporter still serving: call :meth:`shutdown` then."""
        self.thread.join()

    def shutdown(self) -> None:
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        self.server.shutdown()  # returns once serve_forever has stopped
        self.thread.join()
        self.server.server_close()

    def __enter__(self) -> "Exporter":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()


def _wsgi_app(registry, token: Optional[str]):
    metrics = _prometheus().make_wsgi_app(registry)
    expected = f"Bearer {token}".encode("ascii") if token is not None else None

    def app(environ, start_response):
        path = environ.get("PATH_INFO") or "/"
        if path == "/metrics":
            given = (environ.get("HTTP_AUTHORIZATION") or "").encode("latin-1", "replace")
            if expected is not None and not hmac.compare_digest(given, expected):
                start_response("401 Unauthorized", [("Content-Type", "text/plain; charset=utf-8"),
                                                    ("WWW-Authenticate", 'Bearer realm="gpucleanup"')])
                return [b"the metrics need the exporter's token: Authorization: Bearer <token>\n"]
            return metrics(environ, start_response)
        if path == "/":
            start_response("200 OK", [("Content-Type", "text/plain; charset=utf-8")])
            return [b"gpucleanup exporter: the metrics are at /metrics\n"]
        start_response("404 Not Found", [("Content-Type", "text/plain; charset=utf-8")])
        return [b"not found: the metrics are at /metrics\n"]

    return app


#: seconds a connection may take to send its request before it is closed
READ_TIMEOUT_S = 10.0
#: connections served at once (each a thread and a descriptor); more are closed at once, except the owner's
MAX_CONNECTIONS = 32


def tcp_peer_uid(sock: socket.socket) -> Optional[int]:
    """The user owning the other end of a loopback tcp connection (``/proc/net/tcp`` or ``tcp6`` of this
    network namespace, the socket whose local address is our peer's and remote address ours); None when
    it cannot be told, which is never the owner."""
    try:
        local, peer = sock.getsockname(), sock.getpeername()
    except OSError:
        return None

    def text(address, family) -> str:
        packed = socket.inet_pton(family, address[0])
        # the kernel prints each 32-bit word in host byte order, then the port
        words = [int.from_bytes(packed[i:i + 4], sys.byteorder) for i in range(0, len(packed), 4)]
        return "".join(f"{w:08X}" for w in words) + f":{address[1]:04X}"

    family = sock.family
    try:
        theirs, ours = text(peer, family), text(local, family)
        table = "/proc/net/tcp" if family == socket.AF_INET else "/proc/net/tcp6"
        with open(table, "r", encoding="ascii", errors="replace") as lines:
            for line in lines:
                fields = line.split()
                if len(fields) > 7 and fields[1] == theirs and fields[2] == ours and fields[7].isdigit():
                    return int(fields[7])
    except (OSError, ValueError):
        return None
    return None


class _Bounded:
    """A threading HTTP server with at most MAX_CONNECTIONS connections at once. At the cap a newcomer is
    closed at once, unless it comes from the exporter's own user: then the oldest connection of another
    user is closed to make room, so that other local users cannot lock the owner out of its metrics."""

    refused = 0

    def _tracked(self) -> dict:
        if not hasattr(self, "_open"):
            self._open: Dict[Any, list] = {}
            self._open_lock = threading.Lock()
        return self._open

    def process_request(self, request, client_address):
        open_ = self._tracked()
        with self._open_lock:
            full = len(open_) >= MAX_CONNECTIONS
        if full:
            if tcp_peer_uid(request) != os.geteuid() or not self._make_room():
                self.refused += 1
                self.shutdown_request(request)
                return
        with self._open_lock:
            open_[request] = [time.monotonic(), os.geteuid() if full else None, full]
        super().process_request(request, client_address)

    def _make_room(self) -> bool:
        with self._open_lock:
            candidates = sorted(self._open.items(), key=lambda item: item[1][0])
        for sock, entry in candidates:
            if not entry[2]:  # the peer's user, asked once and only when full
                entry[1], entry[2] = tcp_peer_uid(sock), True
            if entry[1] != os.geteuid():
                try:
                    sock.shutdown(socket.SHUT_RDWR)  # its thread reads end-of-file and ends
                except OSError:
                    pass
                with self._open_lock:
                    self._open.pop(sock, None)
                return True
        return False

    def process_request_thread(self, request, client_address):
        try:
            super().process_request_thread(request, client_address)
        finally:
            with self._open_lock:
                self._open.pop(request, None)


def _bind(port: int, host: str, registry, token: Optional[str] = None) -> Any:
    """The HTTP server bound to (host, port), not yet serving; :class:`ExporterError` when it cannot be."""
    import socketserver
    from wsgiref.simple_server import WSGIRequestHandler, WSGIServer

    if type(port) is not int or not 0 <= port <= 65535:
        raise ExporterError(f"port must be a number from 1 to 65535 (0: any free port), got {port!r}")
    if not isinstance(host, str) or not host:
        raise ExporterError(f"host must be an address or a name to listen on, got {host!r}")
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0][0]
    except socket.gaierror as exc:
        raise ExporterError(f"cannot listen on {host!r} ({exc.strerror}): give an address of this machine "
                            "(127.0.0.1, the default, or ::1)") from None

    class Silent(WSGIRequestHandler):
        timeout = READ_TIMEOUT_S  # a connection that sends nothing is closed, not kept for ever

        def log_message(self, format, *args):  # a scrape every few seconds is not news
            pass

    class Server(_Bounded, socketserver.ThreadingMixIn, WSGIServer):
        daemon_threads = True
        address_family = family

    try:
        server = Server((host, port), Silent)
    except OSError as exc:
        where = f"{host}:{port}" if ":" not in host else f"[{host}]:{port}"
        if exc.errno == errno.EADDRINUSE:
            raise ExporterError(f"cannot listen on {where}: the port is in use by another program; "
                                "choose another port with --port") from None
        if exc.errno == errno.EACCES:
            raise ExporterError(f"cannot listen on {where}: permission denied (ports below 1024 need "
                                "privileges); choose a port from 1024 up with --port") from None
        if exc.errno == errno.EADDRNOTAVAIL:
            raise ExporterError(f"cannot listen on {where}: {host} is not an address of this machine; "
                                "give one of its addresses with --host") from None
        raise ExporterError(f"cannot listen on {where}: {exc.strerror or exc}") from None
    server.set_app(_wsgi_app(registry, token))
    return server


def start_exporter(port: int, host: str = "127.0.0.1", runtime_dir: Optional[Path] = None,
                   timeout: float = status_client.DEFAULT_TIMEOUT, token_file: Optional[Path] = None,
                   public: bool = False) -> Exporter:
    """Serve gpucleanup's metrics at ``http://host:port/metrics`` on a thread of its own; returns the
    :class:`Exporter` (``.url``, ``.shutdown()``). ``port`` 0 takes any free port (``.port`` says which).

    Private to its owner by default: a scrape must send ``Authorization: Bearer <token>``, the token in
    ``token_file`` (default :func:`token_path`, created 0600 with a random token when missing; a file
    others may read is refused); other requests get 401 and no figure. ``public``: no token, and the
    metrics carry only what every local user may see (the labels of :data:`PUBLIC_KERNEL_LABELS`; the
    notebook and kernel id labels are empty).

    Raises :class:`ExporterError` (a sentence to print; exit status 2) when the port is in use, not
    allowed, or the host is not an address of this machine, and without prometheus_client.
    """
    try:
        registry = make_registry(runtime_dir, timeout, public=public)
    except MetricsUnavailable as exc:
        raise ExporterError(str(exc)) from exc
    except ValueError as exc:  # the timeout
        raise ExporterError(str(exc)) from None
    token = None
    if not public:
        token_file = Path(token_file) if token_file is not None else token_path(runtime_dir)
        token = ensure_token(token_file)
    server = _bind(port, host, registry, token)
    thread = threading.Thread(target=server.serve_forever, name="gpucleanup-exporter", daemon=True)
    thread.start()
    return Exporter(server, thread, None if public else token_file)


def run_exporter(port: int, host: str = "127.0.0.1", runtime_dir: Optional[Path] = None,
                 timeout: float = status_client.DEFAULT_TIMEOUT) -> int:
    """``gpucleanup exporter``: serve gpucleanup's metrics at ``http://host:port/metrics`` until Ctrl-C;
    returns 0.

    For hosts without a Jupyter server (with one, its own ``/metrics`` can show them:
    :func:`register_server_collector`). The registry is the exporter's own: only gpucleanup's metrics,
    no process metrics of the exporter. Each scrape asks every kernel of ``runtime_dir`` (default:
    Jupyter's runtime directory, as ``gpucleanup ps``), each at most ``timeout`` seconds.

    It listens on loopback (127.0.0.1) unless ``host`` says otherwise, and answers only scrapes that send
    its token (:func:`start_exporter`): every local user can reach a loopback port, and the metrics name
    notebooks and kernels.

    Raises :class:`ExporterError` (print it, exit status 2) when it cannot listen: port in use, not
    allowed, host not an address of this machine, no prometheus_client.
    """
    exporter = start_exporter(port, host, runtime_dir, timeout)
    try:
        print(f"gpucleanup exporter: serving {exporter.url} (Ctrl-C stops)", flush=True)
        print(f"gpucleanup exporter: scrapes send Authorization: Bearer <the token in {exporter.token_file}>",
              flush=True)
        exporter.wait()
    except KeyboardInterrupt:
        pass
    finally:
        exporter.shutdown()
    return 0
