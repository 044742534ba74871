"""The allocation trace as the user turns it on and off: ``%gpumem --trace [on|off]``, ``%gpumem --trace``
and the ``trace_allocations`` trait (started after the first cell that uses the GPU).

The trace itself (CUPTI, the callbacks, the groups by line) is ``tracing.Tracer``'s; this part says that it
runs or why not, and what ``%gpumem`` shows of it.
"""

from __future__ import annotations

from typing import Callable, Optional

from ..say import say
from .tracing import Tracer

__all__ = ["AllocationTrace"]


class AllocationTrace:
    """Starts, stops and shows one :class:`~gpucleanup.in_kernel.tracing.Tracer`.

    ``driver_ready()``: whether the CUDA driver is ready (an automatic start waits for it);
    ``warn_once(kind, text)``: the kernel's note, said once per kind.
    """

    def __init__(self, tracer: Tracer, driver_ready: Callable[[], bool], warn_once: Callable[[str, str], None]):
        self.tracer = tracer
        self._driver_ready = driver_ready
        self._warn_once = warn_once

    @property
    def active(self) -> bool:
        return bool(self.tracer.active)

    def start(self, automatic: bool, cell: Optional[int] = None) -> None:
        """Start tracing raw allocations, ``cell`` being the running cell's number; say that it runs, or why
        not (automatic: once per reason)."""
        tracer = self.tracer
        if tracer.active:
            if not automatic:
                print(say(f"the allocation trace is already running ({tracer.library})"))
            return
        if automatic and not self._driver_ready():
            return
        try:
            reply = tracer.start()
        except Exception as exc:
            reply = {"active": False, "error": f"{type(exc).__name__}: {exc}"}
            tracer.refused = reply["error"]
        if reply.get("active"):
            tracer.set_cell(cell)
            print(say(f"tracing raw GPU allocations to their line (CUPTI: {reply.get('library')}); "
                      "each cell's line names what it allocated and kept; %gpumem --trace shows all, --trace off stops"))
            return
        error = reply.get("error") or "the trace could not start"
        if automatic:
            if "not initialised" in error:
                return  # tried again after the next cell that uses the GPU
            self._warn_once(f"trace:{error}", f"allocation trace (trace_allocations) is off: {error}")
        else:
            print(say(f"allocation trace not started: {error}"))

    def set_cell(self, cell: Optional[int]) -> None:
        """The running cell's number, which the allocations traced from now on are put down to."""
        self.tracer.set_cell(cell)

    def stop(self) -> bool:
        return self.tracer.stop()

    def report(self) -> dict:
        """What ``%gpumem --trace`` shows: every group the trace found, and why it does not run."""
        tracer = self.tracer
        if not tracer.active and tracer.library is None:
            return {"active": False, "library": None, "refused": tracer.refused, "groups": [], "pools": [],
                    "live_bytes": 0, "live_allocations": 0, "dropped": 0}
        data = tracer.report()
        data["refused"] = tracer.refused
        return data

    def brief(self) -> dict:
        """The trace's part of ``%gpumem``'s status."""
        return {"active": self.tracer.active, "library": self.tracer.library, "refused": self.tracer.refused}
