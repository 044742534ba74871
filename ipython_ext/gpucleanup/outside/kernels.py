"""Every kernel with gpucleanup on this machine, asked at once: what ``gpucleanup ps``, the Jupyter
Server page (``gpucleanup.server``) and the Prometheus metrics (``gpucleanup.outside.metrics``) all read.

:func:`gather` asks the kernels; :func:`device_rows` turns one status reply into per-device figures.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import List, Optional, Sequence

from ..protocol import discovery, status_client
from ..units import format_bytes, format_duration

__all__ = ["KernelView", "Gathered", "gather", "device_rows", "total", "target_of", "short_error", "state_text",
           "where_to_ask", "cell_runs", "idle_for_s"]


def _int(value) -> Optional[int]:
    return value if type(value) is int else None


def cell_runs(state: Optional[dict]) -> bool:
    """Whether a reply's ``state`` says a cell runs: ``running``, or ``waiting``/``draining`` of a cell (a drain
    from outside says them with no cell)."""
    if not isinstance(state, dict):
        return False
    name = state.get("state")
    return name == "running" or (name in ("waiting", "draining") and _int(state.get("cell")) is not None)


def idle_for_s(state: Optional[dict], started_ns: Optional[int] = None) -> Optional[float]:
    """How long the kernel had been idle when it answered, from a status reply's ``state`` (and its
    ``server.started_ns``); 0 while a cell runs, None when not known.

    Idle since its last cell's end (``last_cell_ended_ns``), whatever a park, a resume or a drain from outside
    did since (each restarts the state's own age); since the status server started when no cell has ended since
    (null); from a library older than the field, the state's age. The reply's time is ``since_ns + age_s``."""
    if not isinstance(state, dict):
        return None
    if cell_runs(state):
        return 0.0
    age = state.get("age_s")
    if not isinstance(age, (int, float)) or isinstance(age, bool):
        return None
    since = _int(state.get("since_ns"))
    if "last_cell_ended_ns" not in state or since is None:
        return max(0.0, float(age))
    began = _int(state.get("last_cell_ended_ns"))
    if began is None:
        began = _int(started_ns)
    if began is None:
        return max(0.0, float(age))
    return max(0.0, float(age) + (since - began) / 1e9)


def state_text(state: Optional[dict], started_ns: Optional[int] = None) -> Optional[str]:
    """A kernel's state as ``gpucleanup ps`` and the page say it: ``idle for 3.0 s`` (since its last cell ended:
    :func:`idle_for_s`, with ``started_ns`` the reply's ``server.started_ns``), ``running cell 12 for 1 min 3 s``,
    ``waiting for GPU0 for 8.0 s``, ``parked 8.2 GiB in host memory for 42 min`` (None: unknown)."""
    if not isinstance(state, dict):
        return None
    name = str(state.get("state") or "unknown")
    words = name
    size = state.get("bytes")
    if name in ("running", "draining") and isinstance(state.get("cell"), int):
        words = f"{name} cell {state['cell']}"
    elif name == "waiting" and isinstance(state.get("device"), int):
        words = f"waiting for GPU{state['device']}"
    elif name == "parked":
        words = f"parked {format_bytes(size)} in host memory" if type(size) is int and size > 0 else "parked in host memory"
    elif name == "lost":
        words = "lost: a resume could not bring its GPU state back; restart it"
    age = idle_for_s(state, started_ns) if name == "idle" else None if name == "lost" else state.get("age_s")
    if isinstance(age, (int, float)) and not isinstance(age, bool):
        words += f" for {format_duration(age)}"
    return words


@dataclass
class KernelView:
    """One kernel as seen from outside it."""

    kernel: discovery.Kernel
    #: the kernel's status reply (``share/protocol.md``), None when it could not be had
    status: Optional[dict] = None
    #: the records of its last cells, oldest first (only when asked for)
    history: Optional[List[dict]] = None
    #: why there is no status: a sentence that says what to do
    error: Optional[str] = None
    #: what kind of failure: "no_answer" | "refused" | "bad_key" | "elsewhere"
    error_kind: Optional[str] = None
    #: the kernel runs in another PID namespace: listed, never asked
    elsewhere: Optional[str] = None
    #: the StatusError (or, for a key file, the OSError) behind ``error``, for callers that map it to exit codes
    exception: Optional[Exception] = field(default=None, repr=False)

    @property
    def pid(self) -> int:
        return self.kernel.pid

    @property
    def kernel_id(self) -> Optional[str]:
        return self.kernel.kernel_id

    @property
    def notebook(self) -> Optional[str]:
        status = self.status or {}
        described = (status.get("kernel") or {}).get("notebook") if isinstance(status.get("kernel"), dict) else None
        return described or self.kernel.notebook


@dataclass
class Gathered:
    kernels: List[KernelView]
    #: discovery files that could not be used: (path, why)
    skipped: List[discovery.Skipped]
    #: the runtime directory scanned
    directory: Path


def where_to_ask(kernel: discovery.Kernel) -> str:
    """What to do about a kernel that is not asked from here (``discovery.Kernel.place``)."""
    if kernel.place == discovery.ON_ANOTHER_MACHINE:
        return f"run gpucleanup on {'host ' + kernel.host if kernel.host else 'that machine'}"
    if kernel.place == discovery.IN_ANOTHER_NAMESPACE:
        return "run gpucleanup where the kernel runs (the same container)"
    return "run gpucleanup where the kernel runs (the same machine and container)"


def target_of(kernel: discovery.Kernel) -> status_client.Target:
    """The kernel's endpoint and key; raises :class:`discovery.UnsafeFile` for a key file that is not a
    regular file of at most 64 KiB, ``OSError`` for one that cannot be read."""
    return status_client.Target(kernel.endpoint, kernel.read_key(), kernel.label)


def short_error(error: status_client.StatusError, timeout: float) -> tuple:
    """(kind, sentence) for a failed request."""
    if isinstance(error, status_client.StatusTimeout):
        return "no_answer", (f"did not answer within {timeout:g} s: the process may be stopped or overloaded")
    if isinstance(error, status_client.StatusUnreachable):
        return "no_answer", str(error)
    if error.error_id == "gpucleanup.server.403":
        return "refused", f"refused the request: its key file does not hold the kernel's key ({error})"
    return "refused", str(error)


def gather(
    directory: Optional[Path] = None,
    timeout: float = status_client.DEFAULT_TIMEOUT,
    history: int = 0,
    clean: bool = True,
) -> Gathered:
    """Every kernel of ``directory`` (default: Jupyter's runtime directory) with its status, and with
    the records of its last ``history`` cells when ``history`` > 0. Kernels elsewhere come last.

    Scans the discovery files (``discovery.scan``: stale files of exited kernels are removed on the way, kernels on
    another machine or in another PID namespace are listed and never asked: their pid, socket and loopback port
    mean something else here), reads each kernel's key, and sends every kernel the same request at once
    (``status_client.request_many``), each with at most ``timeout`` seconds. Nothing here raises for one kernel's
    sake: a kernel that cannot be asked or does not answer carries its reason in :attr:`KernelView.error`.
    """
    found = discovery.scan(directory, clean=clean)
    views: List[KernelView] = []
    targets: List[status_client.Target] = []
    asked: List[KernelView] = []
    for kernel in found.live:
        view = KernelView(kernel)
        views.append(view)
        try:
            targets.append(target_of(kernel))
        except discovery.UnsafeFile as exc:
            view.error_kind, view.exception = "bad_key", exc
            view.error = f"its key file {kernel.key_file} is {exc.strerror}: restart the kernel"
            continue
        except OSError as exc:
            view.error_kind, view.exception = "bad_key", exc
            view.error = (f"cannot read its key file {kernel.key_file} ({exc.strerror}): "
                          "run as the user who started the kernel")
            continue
        asked.append(view)
    if asked:
        for view, result in zip(asked, status_client.request_many(targets, "status", timeout)):
            _take(view, result, timeout, "status")
        if history > 0:
            wanted = [(v, t) for v, t in zip(asked, targets) if v.status is not None]
            if wanted:
                results = status_client.request_many([t for _, t in wanted], "history", timeout, limit=int(history))
                for (view, _), result in zip(wanted, results):
                    if isinstance(result, dict) and isinstance(result.get("records"), list):
                        view.history = result["records"]
    for kernel in found.elsewhere:
        views.append(KernelView(kernel, elsewhere=kernel.elsewhere, error_kind="elsewhere",
                                error=f"elsewhere ({kernel.elsewhere}): {where_to_ask(kernel)}"))
    return Gathered(views, list(found.skipped), Path(directory) if directory else discovery.runtime_dir())


def _take(view: KernelView, result, timeout: float, kind: str) -> None:
    if isinstance(result, status_client.StatusError):
        view.error_kind, view.error = short_error(result, timeout)
        view.exception = result
    else:
        view.status = result


# ------------------------------------------------------------------ reading replies


def total(value) -> int:
    """The sum of a per-framework dict of bytes (or the int itself)."""
    if isinstance(value, dict):
        return sum(v for v in value.values() if isinstance(v, int) and not isinstance(v, bool))
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def device_rows(reply: dict) -> List[dict]:
    """Per device the kernel uses: ``index``, ``name``, ``uuid``, ``used_bytes``, ``total_bytes`` and the
    driver pools (``driver_pool_reserved_bytes``, ``driver_pool_used_bytes``) from the live snapshot;
    ``live_bytes`` and ``cached_bytes`` per framework, ``outside_bytes`` and ``freed_bytes`` (the last
    cleanup's, per framework) from the last cell's record. Devices by index."""
    devices = {}
    snapshot = reply.get("snapshot") or {}
    for dev in snapshot.get("devices") or []:
        if not isinstance(dev, dict) or not dev.get("in_use"):
            continue
        pools = [p for p in dev.get("pools") or [] if isinstance(p, dict)]
        devices[dev.get("index")] = {
            "index": dev.get("index"),
            "name": dev.get("name"),
            "uuid": dev.get("uuid"),
            "used_bytes": dev.get("used_bytes"),
            "total_bytes": dev.get("total_bytes"),
            "driver_pool_reserved_bytes": sum(p.get("reserved_bytes") or 0 for p in pools),
            "driver_pool_used_bytes": sum(p.get("used_bytes") or 0 for p in pools),
            "live_bytes": {},
            "cached_bytes": {},
            "outside_bytes": None,
            "freed_bytes": {},
        }
    record = reply.get("last_record") or {}
    for dev in record.get("devices") or []:
        if not isinstance(dev, dict):
            continue
        entry = devices.setdefault(
            dev.get("index"),
            {"index": dev.get("index"), "name": dev.get("name"), "uuid": None,
             "used_bytes": dev.get("used_after_bytes"), "total_bytes": dev.get("total_bytes"),
             "driver_pool_reserved_bytes": None, "driver_pool_used_bytes": None},
        )
        entry["live_bytes"] = dev.get("live_bytes") or {}
        entry["cached_bytes"] = dev.get("cached_bytes") or {}
        entry["outside_bytes"] = dev.get("outside_bytes")
        entry["freed_bytes"] = dev.get("freed_bytes") or {}
    return [devices[k] for k in sorted(devices, key=lambda i: (i is None, i if isinstance(i, int) else 0))]
