"""The kernel's status endpoint as the extension holds it: made and started at load, told the kernel's state as
cells start and end, closed at unload and at exit.

Every call is guarded: an endpoint that fails is said once (``warn``) and never reaches a cell. The endpoint itself
(the native server, its discovery file, its key) is :mod:`.status_endpoint`'s.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any, Callable, Optional

__all__ = ["EndpointLink", "MISSING"]

#: ``factory`` left out: the real endpoint (:class:`.status_endpoint.StatusEndpoint`), imported when first started
MISSING = object()


class EndpointLink:
    """The endpoint (``endpoint``: None while off) and what the extension tells it.

    ``factory``: makes the endpoint (:data:`MISSING`: the real one; None: never one); ``warn(kind, text)``: says a
    failure once; ``quiet()``: whether a state said now is left unsaid (a cell runs beside a drain from outside,
    :meth:`.outside_drain.OutsideDrain.quiet`)."""

    def __init__(self, factory: Any, warn: Callable[[str, str], None], quiet: Callable[[], bool]):
        self._factory = factory
        self._warn = warn
        self._quiet = quiet
        self.endpoint: Any = None

    def start(self, shell: Any, history_limit: int, max_peers: int) -> Optional[Any]:
        """Makes and starts the endpoint and says the kernel's state now (loaded by ``%load_ext``, the cell that
        loads it runs; loaded from the config at start-up, none does); the endpoint, or None when there is none."""
        factory = self._factory
        if factory is MISSING:
            try:
                from .status_endpoint import StatusEndpoint as factory
            except ModuleNotFoundError as exc:
                if exc.name and exc.name.endswith("status_endpoint"):
                    return None  # not built into this package: skip silently
                self._warn("status:import", f"status endpoint unavailable ({exc})")
                return None
            except Exception as exc:
                self._warn("status:import", f"status endpoint unavailable ({type(exc).__name__}: {exc})")
                return None
        if factory is None:
            return None
        try:
            try:
                endpoint = factory(history_limit=history_limit, max_peers=max_peers)
            except TypeError:
                endpoint = factory()  # a factory that takes no options
            endpoint.start(shell)
        except Exception as exc:
            self._warn("status:start", f"status endpoint did not start ({type(exc).__name__}: {exc})")
            return None
        self.endpoint = endpoint
        # Loaded from the config at start-up, no cell runs: "idle" now rather than leaving the endpoint without a
        # state (and refusing drains) until a first cell. IPython keeps displayhook.exec_result set only while a
        # cell executes.
        now = time.time_ns()
        running = getattr(getattr(shell, "displayhook", None), "exec_result", None)
        if running is not None:
            self.say("set_state", {"state": "running", "cell": getattr(running, "execution_count", None),
                                   "since_ns": now})
        else:
            self.say("set_state", {"state": "idle", "since_ns": now})
        return endpoint

    def close(self) -> None:
        endpoint, self.endpoint = self.endpoint, None
        if endpoint is not None:
            with contextlib.suppress(Exception):
                endpoint.close()  # the server's threads are joined: no drain of the library's runs after this

    def cell_state(self, state: str, cell: Optional[int] = None) -> Optional[int]:
        """A cell's "running" (with its number) or "idle", twice per cell: through the endpoint's ``cell_state``
        (no dict to check, no JSON, the time taken by the library), which answers the park state in the same call
        (None: not known, ask :meth:`gpucleanup.park.kernel_side.InKernel.parked`)."""
        endpoint = self.endpoint
        if endpoint is None:
            return None
        try:
            return endpoint.cell_state(state, cell)
        except Exception as exc:
            self._warn("status:set_state", f"status endpoint failed ({type(exc).__name__}: {exc})")
            return None

    def background(self, begin: bool) -> bool:
        """A release on a thread of the engine's own begins or ends (AfterCell.background): the endpoint refuses a
        park meanwhile; False while a park is under way."""
        endpoint = self.endpoint
        return True if endpoint is None else bool(endpoint.background(begin))

    def say(self, method: str, payload: dict) -> None:
        """``set_state`` or ``publish`` (a record), unless the endpoint is off or a state is to be left unsaid."""
        endpoint = self.endpoint
        if endpoint is None or (method == "set_state" and self._quiet()):  # a cell runs beside a drain
            return
        try:
            getattr(endpoint, method)(payload)
        except Exception as exc:
            self._warn(f"status:{method}", f"status endpoint failed ({type(exc).__name__}: {exc})")
