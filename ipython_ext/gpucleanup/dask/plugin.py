"""gpucleanup in Dask workers: the after-cell engine run in each worker when it goes idle.

A Dask worker has the same caching pools as a kernel and no cell boundaries; :class:`GPUCleanupPlugin` cleans it up
after its tasks, and :func:`register`, :func:`cluster_memory` and :func:`drain_cluster` drive it from the notebook.
"""

from __future__ import annotations

import asyncio
import collections
import os
import threading
import time
from typing import Any, Dict, Optional

try:
    from distributed import WorkerPlugin
except ImportError:  # the module still imports; register() says what to install
    WorkerPlugin = object  # type: ignore[assignment,misc]

__all__ = ["GPUCleanupPlugin", "register", "unregister", "cluster_memory", "drain_cluster", "PLUGIN_NAME"]

PLUGIN_NAME = "gpucleanup"

# One cleanup at a time in the worker process, across plugin instances: teardown does not wait for
# the cleanup thread, so a plugin registered again may start while the old one's last cleanup runs.
_CLEANING = threading.Lock()


def _require_distributed() -> None:
    if WorkerPlugin is object:
        raise RuntimeError("gpucleanup.dask needs Dask's distributed scheduler: pip install 'distributed'")


def _check_frameworks(frameworks: Any) -> Dict[str, bool]:
    """``frameworks`` as the plugin keeps it: known framework names to True or False; ValueError otherwise."""
    from ..frameworks import known_frameworks

    if frameworks is None:
        return {}
    if not isinstance(frameworks, dict):
        raise ValueError(f"frameworks must be a dict of framework names to True or False, such as "
                         f"{{'jax': False}}, got {frameworks!r}")
    known = known_frameworks() or []
    unknown = sorted(repr(name) for name in frameworks if name not in known)
    if unknown:
        raise ValueError(f"frameworks names unknown framework(s) {', '.join(unknown)}; known: {', '.join(known)}")
    wrong = [f"{name}={value!r}" for name, value in frameworks.items() if not isinstance(value, bool)]
    if wrong:
        raise ValueError(f"frameworks takes True or False per framework, got {', '.join(wrong)}")
    return dict(frameworks)


class GPUCleanupPlugin(WorkerPlugin):  # type: ignore[misc,valid-type]
    """Cleans a worker's GPU memory once it is idle, and reports it.

    ``idle_s``: seconds a worker must stay idle after its last task before the cleanup (0 to
    3,600). ``settle_timeout``, ``pinned``, ``driver_pools``, ``frameworks``: as the
    extension's traits of the same names. ``history``: cleanup records kept per worker.

    A Dask worker is a long-lived process with the same caching pools as a kernel, and no cell boundaries: this
    plugin (a ``distributed.WorkerPlugin``) gives it one. When a task leaves the worker with nothing else running
    or ready, and the worker then stays idle for ``idle_s`` seconds, the engine cleans up exactly as after a
    notebook cell (bounded settle, framework pools, driver pools, pinned pools released in the background). A
    graph of many small tasks pays nothing per task: the worker is busy from its first task to its last, and one
    cleanup follows the batch. Everything the plugin does in the worker's event loop is bookkeeping; the cleanup
    runs on a thread of its own, so a stalled GPU never blocks the worker.

    From the notebook::

        from dask.distributed import Client
        import gpucleanup.dask
        client = Client(cluster)
        gpucleanup.dask.plugin.register(client)              # or: %gpumem --dask on
        gpucleanup.dask.plugin.cluster_memory(client)        # or: %gpumem --dask  (--json: data)
        gpucleanup.dask.plugin.drain_cluster(client)         # or: %gpumem --dask --drain (idle workers only)

    The same rules as in a kernel: the plugin never initialises CUDA nor creates a context (a worker that has not
    used the GPU is left alone), never imports a framework, never changes a task's result or exception. An RMM
    pool set up by dask-cuda (``rmm_pool_size``, ``--rmm-async``) is reported as RMM's and not released (RMM has
    no call for it); with dask-cuda's spilling, only device memory is counted.
    """

    idempotent = True
    name = PLUGIN_NAME

    def __init__(self, idle_s: float = 0.5, settle_timeout: float = 30.0, pinned: bool = True,
                 driver_pools: bool = True, frameworks: Optional[Dict[str, bool]] = None, history: int = 20):
        for label, value, high in (("idle_s", idle_s, 3600.0), ("settle_timeout", settle_timeout, 86400.0)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= high:
                raise ValueError(f"{label} must be a number of seconds from 0 to {high:,.0f}, got {value!r}")
        if not isinstance(history, int) or isinstance(history, bool) or not 1 <= history <= 10_000:
            raise ValueError(f"history must be a whole number from 1 to 10,000, got {history!r}")
        for label, value in (("pinned", pinned), ("driver_pools", driver_pools)):
            if not isinstance(value, bool):
                raise ValueError(f"{label} must be True or False, got {value!r}")
        self.idle_s = float(idle_s)
        self.settle_timeout = float(settle_timeout)
        self.pinned = pinned
        self.driver_pools = driver_pools
        self.frameworks = _check_frameworks(frameworks)
        self.history = history
        self._worker: Any = None
        self._engine: Any = None

    # -- what the worker calls (setup and teardown: once; transition: in its event loop) --------

    def setup(self, worker: Any) -> None:
        from .. import _native
        from ..engine.after_cell import AfterCell, Settings
        from ..records.report import CellVoice

        self._worker = worker
        self._settings = Settings(gc="auto", pinned=self.pinned, driver_pools=self.driver_pools,
                                  settle_timeout=self.settle_timeout, show="never", frameworks=dict(self.frameworks))
        self._engine = AfterCell(_native, voice=CellVoice(write=lambda text: None))  # records as a kernel's: no lines
        self._records: collections.deque = collections.deque(maxlen=self.history)
        self._cond = threading.Condition()
        self._due: Optional[float] = None
        self._stopping = False
        self._clean_lock = _CLEANING
        self._counts_lock = threading.Lock()  # the counters change and are read together
        self.cleanups = 0
        self.skipped_busy = 0
        self.freed_total = 0
        self._freed_unseen = 0
        self._thread = threading.Thread(target=self._loop, name="gpucleanup-dask", daemon=True)
        self._thread.start()

    def teardown(self, worker: Any) -> None:
        # On the worker's event loop (unregister, Worker.close, a plugin registered again under the
        # same name): returns at once. The cleanup thread may be waiting for a stalled GPU for up to
        # settle_timeout (a day at most); it stops the engine itself once that wait ends, so nothing
        # here waits on the GPU.
        if self._engine is None:
            return
        with self._cond:
            self._stopping = True
            self._cond.notify_all()

    def transition(self, key: Any, start: str, finish: str, **kwargs: Any) -> None:
        # In the worker's event loop: bookkeeping only. A task that leaves the worker busy
        # with nothing else schedules a cleanup idle_s from now (a later one moves it).
        if start in ("executing", "long-running") and not self.busy():
            with self._cond:
                self._due = time.monotonic() + self.idle_s
                self._cond.notify_all()

    # -- the cleanup thread -------------------------------------------------------------

    def busy(self) -> int:
        """Tasks running or ready to run on this worker (0: idle)."""
        state = getattr(self._worker, "state", None)
        if state is None:
            return 0
        try:
            return int(state.executing_count) + len(state.ready) + len(getattr(state, "constrained", ()))
        except Exception:
            return 0

    def _loop(self) -> None:
        try:
            while True:
                with self._cond:
                    while not self._stopping and (self._due is None or time.monotonic() < self._due):
                        self._cond.wait(None if self._due is None else max(0.0, self._due - time.monotonic()))
                    if self._stopping:
                        return
                    self._due = None
                if self.busy():
                    self.skipped_busy += 1  # a task started meanwhile: its end schedules the next one
                    continue
                self.clean("idle")
        finally:
            self._engine.stop()  # after the last cleanup, on this thread: teardown never waits for it

    def clean(self, reason: str) -> dict:
        """One cleanup now (on the calling thread, never the event loop's): a summary of it."""
        with self._clean_lock:
            started = time.time_ns()
            try:
                outcome = self._engine.run(self._settings, cell=None)
            except Exception as exc:  # never into the worker: the next cleanup tries again
                summary = {"reason": reason, "time_ns": started, "error": f"{type(exc).__name__}: {exc}",
                           "freed_bytes": 0}
                self._records.append(summary)
                return summary
            record = outcome.as_dict() if outcome is not None else None
            freed = 0
            if record is not None:
                freed = sum(sum((d.get("freed_bytes") or {}).values()) for d in record.get("devices") or [])
                freed += sum((record.get("pinned") or {}).get("freed_bytes", {}).values())
            summary = {"reason": reason, "time_ns": started, "freed_bytes": int(freed),
                       "elapsed_s": record.get("elapsed_s") if record else 0.0,
                       "cuda_in_use": record is not None,
                       "notes": list(record.get("notes") or []) if record else []}
            with self._counts_lock:
                self.cleanups += 1
                self.freed_total += int(freed)
                self._freed_unseen += int(freed)
                self._records.append(summary)
            return summary

    def status(self, look: bool = True) -> dict:
        """This worker's figures (``AfterCell.memory_status``) and the plugin's counters;
        ``look`` resets "freed since the last look"."""
        memory = self._engine.memory_status(self._settings)
        with self._counts_lock:
            freed_unseen = self._freed_unseen
            if look:
                self._freed_unseen = 0
            return {"plugin": True, "busy": self.busy(), "cleanups": self.cleanups, "skipped_busy": self.skipped_busy,
                    "freed_total_bytes": self.freed_total, "freed_since_last_look_bytes": freed_unseen,
                    "last": dict(self._records[-1]) if self._records else None, "memory": memory}


# ---------------------------------------------------------------- on the workers (client.run)

def _plugin_of(worker: Any) -> Optional[GPUCleanupPlugin]:
    plugin = getattr(worker, "plugins", {}).get(PLUGIN_NAME)
    return plugin if isinstance(plugin, GPUCleanupPlugin) and plugin._engine is not None else None


def _identity(worker: Any) -> dict:
    return {"address": worker.address, "name": str(worker.name), "pid": os.getpid()}


async def _status_on_worker(dask_worker: Any) -> dict:
    """Runs on each worker: its figures, read off the event loop's thread."""
    plugin = _plugin_of(dask_worker)
    loop = asyncio.get_running_loop()
    if plugin is not None:
        data = await loop.run_in_executor(None, plugin.status)
    else:
        def read() -> dict:
            from .. import _native
            from ..engine.after_cell import AfterCell, Settings

            engine = AfterCell(_native)
            return {"plugin": False, "memory": engine.memory_status(Settings(show="never"))}

        data = await loop.run_in_executor(None, read)
    data.update(_identity(dask_worker))
    return data


async def _drain_on_worker(dask_worker: Any) -> dict:
    """Runs on each worker: a cleanup now if the worker is idle, off the event loop's thread."""
    plugin = _plugin_of(dask_worker)
    out = _identity(dask_worker)
    if plugin is None:
        out["skipped"] = "gpucleanup's plugin is not registered here: gpucleanup.dask.plugin.register(client) first"
        return out
    busy = plugin.busy()
    if busy:
        out["skipped"] = f"busy with {busy} task{'s' if busy != 1 else ''}: drained only between tasks"
        return out
    if plugin._clean_lock.locked():
        # a cleanup is waiting for the GPU (up to settle_timeout, a day at most): the caller's
        # client.run would wait as long, for a drain that would only do it again
        out["skipped"] = "a cleanup is already running (waiting for the GPU to finish queued work): try again later"
        return out
    out.update(await asyncio.get_running_loop().run_in_executor(None, plugin.clean, "request"))
    return out


# ---------------------------------------------------------------- from the notebook

def register(client: Any, **options: Any) -> None:
    """Register the plugin on every worker of ``client`` (and on workers that join later)."""
    _require_distributed()
    client.register_plugin(GPUCleanupPlugin(**options), name=PLUGIN_NAME)


def unregister(client: Any) -> None:
    """Remove the plugin from every worker (its thread stops, nothing else changes)."""
    _require_distributed()
    client.unregister_worker_plugin(PLUGIN_NAME)


def cluster_memory(client: Any) -> Dict[str, dict]:
    """Per worker address: its GPU memory as ``%gpumem --json`` gives the kernel's, and the
    plugin's counters (cleanups, bytes freed in all and since the last look)."""
    _require_distributed()
    return client.run(_status_on_worker)


def drain_cluster(client: Any) -> Dict[str, dict]:
    """A cleanup now on every idle worker; busy ones are skipped and say so."""
    _require_distributed()
    return client.run(_drain_on_worker)
