"""``%gpumem``'s work once its line is parsed: each option's answer, from the extension's parts.

The magic itself (its options, its help) is :class:`gpucleanup.in_kernel.extension.GPUCleanup`'s, as IPython
wants it on the ``Magics`` object; it parses the line (:mod:`.magics`) and hands the options here. What this
uses of the extension: ``parking``, ``enabled``, ``hooks_registered``, ``why_no_hooks()``, ``status()``,
``history``, ``trace``, ``cleanup()``, ``cells`` and ``shell``.
"""

from __future__ import annotations

import os
from typing import Any

from IPython.core.error import UsageError

from . import holders
from .cell_state import running_cell_number
from ..dask.workers import DaskWorkers
from ..records import report
from ..say import say

__all__ = ["GpumemCommand"]


class GpumemCommand:
    """What ``%gpumem`` does for one parsed line (:meth:`run`); ``ext``: the extension it answers for."""

    def __init__(self, ext: Any):
        self.ext = ext

    def run(self, args: Any):
        """The magic's answer for ``args`` (the parsed options): a JSON report to return, or None once shown."""
        from IPython.display import display

        if self.ext.parking.parked():  # its resume failed: any driver call would wait for the restore
            print(say("this kernel is parked (its GPU memory is in host memory): nothing is "
                      f"asked of the driver until it is resumed (gpucleanup resume {os.getpid()} from a terminal)"))
            return None
        if args.park:
            return self.request_park()

        if (args.off or args.on) and not self.ext.hooks_registered:
            # no driver, no GPU or no native library at load: there is no cleanup to pause or resume
            self.ext.enabled = not args.off
            print(say(f"no cleanup runs after cells in this kernel ({self.ext.why_no_hooks()}): nothing to "
                      + ("pause" if args.off else "resume")))
        elif args.off:
            self.ext.enabled = False
            print(say("automatic cleanup paused (%gpumem --on resumes it)"))
        elif args.on:
            self.ext.enabled = True
            print(say("automatic cleanup resumed"))
        if args.dask is not None:
            return DaskWorkers(self.ext.status).gpumem(args.dask, args.drain, args.json, display)
        if not self.ext.hooks_registered and not args.json and self.say_nothing_here(args):
            return None
        if args.plot is not None:
            from ..records import plot, timeline

            records = self.ext.history.last(args.plot if isinstance(args.plot, int) else None)  # no N: all kept
            if args.json:
                return report.JSONReport(timeline.series(records))
            display(plot.TimelinePlot(records))  # no point yet: its text says so (no empty axes)
            return None
        if args.trace in ("on", "off"):
            if args.trace == "on":
                self.ext.trace.start(automatic=False, cell=running_cell_number(self.ext.shell))
            else:
                stopped = self.ext.trace.stop()
                print(say("allocation trace stopped (what it found stays in %gpumem --trace)"
                          if stopped else "the allocation trace was not running"))
            return None
        if args.trace == "show":
            if args.json:
                return report.JSONReport(self.ext.trace.report())
            display(report.trace_report(self.ext.trace.report()))
            return None
        if args.release is not None:
            self.release(args.release)
        elif args.drain:
            outcome = self.ext.cleanup(forced=True)
            if outcome is not None:
                for text in outcome.lines:
                    print(text)
                self.ext.cells.forced = outcome.record
        wants_table = not (args.off or args.on or args.drain or args.release is not None) or args.json
        if args.json:
            data = self.ext.status() if (args.history is None and args.vars is None) or wants_table else {}
            if args.history is not None:
                data["history"] = self.ext.history.last(args.history)
            if args.vars is not None:
                kept = holders.kept_objects(self.ext.shell)
                data["vars"] = kept[: args.vars] if args.vars else kept
            return report.JSONReport(data)
        shown = False
        if args.history is not None:
            display(report.history_report(self.ext.history.last(args.history)))
            shown = True
        if args.vars is not None:
            display(report.vars_report(holders.kept_objects(self.ext.shell), args.vars))
            shown = True
        if wants_table and not shown:
            display(report.memory_report(self.ext.status()))
        return None


    def request_park(self) -> None:
        """``%gpumem --park``: said now, done by post_run_cell once the cell has ended."""
        if not self.ext.hooks_registered:
            print(say(f"nothing to park: {self.ext.why_no_hooks()}"))
        elif not self.ext.parking.can_park():
            print(say("not parked: parking needs the status endpoint, which is off "
                      "(%config GPUCleanup.status_server = True, with a private Jupyter runtime directory)"))
        else:
            self.ext.parking.requested = True
            print(say("this kernel is parked as soon as this cell has ended"))

    def say_nothing_here(self, args: Any) -> bool:
        """Without a usable driver, a GPU or the native library, say so for what can never come (True if said).

        "Run a cell that uses the GPU" would be advice nobody can follow on such a machine.
        """
        why = self.ext.why_no_hooks()
        if args.trace in ("on", "show"):
            what = "allocation trace not started" if args.trace == "on" else "the allocation trace is off"
            said = f"{what}: {why} in this kernel, so there are no GPU allocations to trace"
        elif args.plot is not None:
            said = f"nothing to plot: {why} in this kernel, so no cell is cleaned up or recorded"
        elif args.history is not None:
            said = f"no cell recorded: {why} in this kernel, so no cleanup runs after cells"
        else:
            return False
        print(say(said))
        return True

    def release(self, what: str) -> None:
        """``%gpumem --release out|traceback|NAME``: let go of GPU objects the kernel keeps, then clean up."""
        try:
            said = holders.release(self.ext.shell, what)
        except ValueError as exc:
            raise UsageError(f"%gpumem --release: {exc}: pass out, traceback or the name of a variable that "
                             "holds GPU memory (see %gpumem --vars)") from None
        print(say(said))
        outcome = self.ext.cleanup(forced=True)
        if outcome is not None:
            for text in outcome.lines:
                print(text)
            self.ext.cells.forced = outcome.record
