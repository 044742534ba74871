"""The server's automatic park (``GPUCleanupServer.park_idle_after_s``): a kernel idle that long is parked.

Each round reads the kernels' status replies (:func:`gpucleanup.outside.kernels.gather`: one discovery scan, one
status request per kernel, no nvidia-smi) and parks the idle ones, one after the other, through the watch's park.
"""

from __future__ import annotations

from typing import Dict, List

from ..outside import kernels
from ..park import from_outside as remote_park, kernel_side as parking
from ..say import printable
from . import model


class AutoPark:
    """Rounds every ``min(60 s, after_s / 4)`` (at least 1 s) on the server's event loop; a round still running
    when the next is due is not doubled. A kernel whose park was refused or failed is tried once per idle period:
    not again, and not logged again, until its idle-since time changes (a cell ran) or what the kernel said keeps
    an automatic park away changes (``park_blocker``: a thread of the notebook runs, the trace is on), as when
    the thread ends with no cell to say it. A refused or failed park leaves the idle-since time as it was (the
    status server's ``failed`` step puts back the idle state ``begin`` found)."""

    def __init__(self, watch, after_s: float, log):
        self.watch = watch
        self.after_s = float(after_s)
        self.log = log
        #: kernel key -> (its idle-since time, the blocker it said) at its last refused or failed park
        self.refused: Dict[str, tuple] = {}
        self._running = False
        self._timer = None

    def start(self) -> None:
        from tornado.ioloop import PeriodicCallback

        self._timer = PeriodicCallback(self._tick, 1000 * max(1.0, min(60.0, self.after_s / 4)))
        self._timer.start()
        self.log.info("gpucleanup: kernels idle for %g s are parked (GPUCleanupServer.park_idle_after_s)",
                      self.after_s)

    def stop(self) -> None:
        if self._timer is not None:
            self._timer.stop()

    @property
    def started(self) -> bool:
        return self._timer is not None and self._timer.is_running()

    async def _tick(self) -> None:
        if self._running or self.watch.stopped:
            return
        self._running = True
        try:
            for line in await self.round():
                self.log.info("gpucleanup: %s", printable(line))  # a kernel's refusal, its id from a file
        except Exception as exc:
            if not self.watch.stopped:
                self.log.warning("gpucleanup: the automatic parking round failed: %s", printable(exc))
        finally:
            self._running = False

    async def round(self) -> List[str]:
        """One round: every kernel idle ``after_s`` or longer, parked one after the other; what each gave, as log
        lines."""
        said: List[str] = []
        gathered = await self.watch.run(kernels.gather, self.watch.runtime_dir, self.watch.settings.timeout, 0,
                                        clean=False)
        ours = {k["pid"]: k["kernel_id"] for k in await self.watch.server_kernels() if k.get("pid")}
        views = [v for v in gathered.kernels if v.elsewhere is None and v.status is not None and v.kernel.key_file]
        keys = {model.entry_id(ours.get(v.pid) or v.kernel_id, v.pid): v for v in views}
        for gone in set(self.refused) - set(keys):
            del self.refused[gone]  # a kernel that exited: its key is never seen again
        for key, view in keys.items():
            state = view.status.get("state")
            state = state if isinstance(state, dict) else {}
            age = state.get("age_s")
            if state.get("state") != "idle" or not isinstance(age, (int, float)) or age < self.after_s:
                continue
            memo = (state.get("since_ns"), state.get("park_blocker"))
            if self.refused.get(key) == memo:
                continue
            try:
                outcome = await self.watch.park(view.kernel, kernels.target_of(view.kernel), "park", automatic=True)
                said.append(f"kernel {key} idle {age:.0f} s: {remote_park.outcome_text(outcome)}")
                if not outcome.ok:
                    self.refused[key] = memo
            except Exception as exc:  # refused, no answer, a key file that cannot be read: next time, if it changes
                said.append(f"kernel {key} idle {age:.0f} s: not parked: {exc}")
                # a refusal that passes by itself (a drain, the kernel's own release) is asked again next round
                if getattr(exc, "error_id", None) not in parking.PASSING_REFUSALS:
                    self.refused[key] = memo
        return said
