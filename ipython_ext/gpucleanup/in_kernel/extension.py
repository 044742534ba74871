"""The IPython extension: one ``GPUCleanup`` object that is the configurable, the ``%gpumem``
magic and the ``pre_run_cell`` / ``post_run_cell`` handler.

It owns the session's lifecycle (load, reload, unload, exit), the traits, the status
endpoint and the magic. The work after each cell is the engine's
(``after_cell.AfterCell``, which knows no shell): ``post_run_cell`` hands it the cell,
keeps the record it returns and prints its lines. ``pre_run_cell`` makes no driver
call. Nothing here raises into the user's cell.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import functools
import gc
import time
import weakref
from typing import Any, List, NamedTuple, Optional

from IPython.core.error import InputRejected
from IPython.core.magic import Magics, line_magic, magics_class
from traitlets import All, observe

from .. import frameworks
from . import holders
from ..records import report
from ..engine.after_cell import AfterCell, Settings
from .allocation_trace import AllocationTrace
from .cell_state import CellState, a_cell_runs_code, running_cell_number, unended_cells
from .config import GPUCleanupOptions
from .gpumem_command import GpumemCommand
from ..records.history import History
from .load_notes import LoadNotes, environment_notes, no_cleanup_here, no_hooks_reason, probe_failure
from .endpoint_link import MISSING as _MISSING, EndpointLink
from .magics import gpumem_arguments, parse_gpumem, unregister_magics, with_settings
from .outside_drain import OutsideDrain, gave_no_way as outside_drain_gave_no_way
from ..park.kernel_side import InKernel, RequestGuard
from .pending_clear import PendingClear
from ..records.record import CellRecord, Outcome
from ..say import PREFIX, say
from ..records.totals import Totals
from .tracing import Tracer

__all__ = ["GPUCleanup", "load_ipython_extension", "unload_ipython_extension"]


class _HookTraits(NamedTuple):
    """What :meth:`GPUCleanup._hook_traits` keeps."""

    enabled: bool
    trace_allocations: bool
    park_after_idle_s: float


class _InterruptTheCell:
    """An IPython AST transformer that hands a Ctrl-C caught in ``pre_run_cell`` to the cell.

    IPython runs ``pre_run_cell`` callbacks inside ``events.trigger``, which catches a
    KeyboardInterrupt, prints it and runs the cell anyway: a Ctrl-C that lands while the
    hook runs would be lost. The cell's AST is transformed after ``pre_run_cell``
    (``run_cell_async``: trigger, then ``transform_ast``, then run), so the interrupt is
    put back as the cell's first statement: the cell stops at once, with
    KeyboardInterrupt as its error, as if Ctrl-C had come a moment later.
    """

    def __init__(self):
        self.pending = False
        self.installed = False  # in the shell's ast_transformers until the cell's post_run_cell

    def visit(self, node):
        if not self.pending:
            return node
        self.pending = False
        import ast

        stop = ast.parse("raise KeyboardInterrupt").body[0]
        body = getattr(node, "body", None)
        if isinstance(body, list):
            node.body = [ast.copy_location(stop, body[0]) if body else stop] + body
            ast.fix_missing_locations(node)
        return node

    def arm(self, shell: Any) -> None:
        """A Ctrl-C landed in ``pre_run_cell``: the cell about to run stops at once. In the shell's
        transformers only for this cell (IPython makes cyclic garbage per cell while one is set)."""
        self.pending = True
        with contextlib.suppress(Exception):
            if self not in shell.ast_transformers:
                shell.ast_transformers.append(self)
            self.installed = True

    def disarm(self, shell: Any) -> None:
        """The cell has ended (its ``post_run_cell``)."""
        self.pending = False
        if self.installed:  # only by a Ctrl-C in this cell's pre_run_cell
            self.installed = False
            with contextlib.suppress(Exception):
                if self in shell.ast_transformers:
                    shell.ast_transformers.remove(self)


class KernelStillParked(InputRejected):
    """A cell (or a silent execute) that was not run because the kernel is still parked: its first GPU call
    would wait for a restore that nobody makes. Shown as gpucleanup's one sentence, not as a traceback."""

    def _render_traceback_(self) -> List[str]:
        return [say(str(self))]


class _RefuseTheCell:
    """An IPython AST transformer that refuses the cell about to run, once, with :class:`KernelStillParked`.

    ``run_cell`` triggers ``pre_run_cell``, then transforms the cell's AST, then runs it; an
    ``InputRejected`` raised by a transformer ends the cell before any of its code, with the exception as
    its error (``error_before_exec``). It is in the shell's ``ast_transformers`` only from the refusal to
    the cell it refuses, and takes itself out as it refuses (a silent execute has no ``post_run_cell``).
    """

    def __init__(self, shell):
        self.shell = shell
        self.why: Optional[str] = None

    def arm(self, why: str) -> None:
        self.why = why
        with contextlib.suppress(Exception):
            if self not in self.shell.ast_transformers:
                self.shell.ast_transformers.append(self)

    def disarm(self) -> None:
        if self.why is None and self not in self.shell.ast_transformers:
            return
        self.why = None
        with contextlib.suppress(Exception):
            while self in self.shell.ast_transformers:
                self.shell.ast_transformers.remove(self)

    def visit(self, node):
        why = self.why
        if why is None:
            return node
        self.disarm()
        raise KernelStillParked(why)


@magics_class
class GPUCleanup(Magics, GPUCleanupOptions):
    """Frees GPU memory after every cell and answers ``%gpumem``.

    Configure with ``c.GPUCleanup.<trait>`` or ``%config GPUCleanup``; the traits are
    documented in ``gpucleanup/in_kernel/config.py``.
    """

    def __init__(self, shell=None, native: Any = None, adapters: Any = _MISSING, status_endpoint: Any = _MISSING, **kwargs):
        """``native``, ``adapters`` and ``status_endpoint`` left out: the real ones (``gpucleanup._native``,
        ``gpucleanup.frameworks.active``, ``gpucleanup.in_kernel.status_endpoint.StatusEndpoint``), each looked up
        where it lives, the native library now, the others when first used."""
        super().__init__(shell=shell, **kwargs)
        if native is None:
            from .. import _native as native
        self.native = native
        # adapters: a callable returning the adapters in use, None for none; _MISSING: the real ones
        if adapters is _MISSING:
            adapters_fn = None
        elif adapters is None:
            adapters_fn = list
        else:
            adapters_fn = adapters
        self._link = EndpointLink(status_endpoint, self._warn_once_now, quiet=lambda: self.outside.quiet())
        tracer = Tracer(native, shell)
        self.trace = AllocationTrace(tracer, self._driver_ready, self._warn_once_now)
        self.engine = AfterCell(native, adapters=adapters_fn, status=self._link.say, voice=report.CellVoice(),
                                traced=tracer.cell_entries, tracing=lambda: bool(tracer.active),
                                background=self._link.background)
        self.history = History(self.history_size)
        self.totals = Totals()  # cumulative since load: published beside each record (gpucleanup.outside.metrics)
        self._hooks_registered = False
        self._magics_registered = False
        self._loaded = False
        self.cells = CellState()
        self.load_notes = LoadNotes(shell, self._say)  # what load says, heard in a kernel too
        self._interrupt_the_cell = _InterruptTheCell()
        self.parking = InKernel(lambda: self._endpoint, self._say, tracing=lambda: bool(tracer.active))
        self._refuse_the_cell = _RefuseTheCell(shell)
        self.clears = PendingClear(shell)  # a clear_output(wait=True) the cell left pending holds the line back
        self._holding = False  # set while the end of a cell says nothing (a pending clear would wipe its output)
        self._request_guard = RequestGuard(self.parking, self._refuse_the_cell.arm)
        self._gpumem = GpumemCommand(self)  # %gpumem's work, once its line is parsed
        # A drain from outside (gpucleanup drain, the page's Drain button) runs the kernel's cleanup on a thread
        # of its own only while no cell is under way; a cell that starts meanwhile waits for it (bounded).
        self.outside = OutsideDrain(native, self.cells, self._clean_for_outside, self._why_no_outside_drain,
                                    self._say, self._warn_once_now, idle=lambda: self._link.cell_state("idle"))

    @property
    def hooks_registered(self) -> bool:
        """Whether the cell hooks run (a driver, a GPU and the native library were there at load)."""
        return self._hooks_registered

    def settings(self) -> Settings:
        """The traits as the engine reads them for one cell: built once and kept until a trait
        changes (``%config``), or the ``frameworks`` dict is changed in place."""
        kept = self.__dict__.get("_settings_kept")
        if kept is not None and kept.frameworks == self.frameworks:
            return kept
        kept = self.__dict__["_settings_kept"] = Settings(
            gc=self.gc,
            pinned=bool(self.pinned),
            driver_pools=bool(self.driver_pools),
            settle_timeout=float(self.settle_timeout),
            show=self.show,
            frameworks=dict(self.frameworks),
            release=self.release,
            idle_release_s=float(self.idle_release_s),
            outside_warning_mib=int(self.outside_warning_mib),
        )
        return kept

    def _hook_traits(self) -> "_HookTraits":
        """The traits the hooks read on every cell, besides the engine's settings: kept as
        :meth:`settings` is, until a trait changes."""
        kept = self.__dict__.get("_hook_traits_kept")
        if kept is None:
            kept = self.__dict__["_hook_traits_kept"] = _HookTraits(
                bool(self.enabled), bool(self.trace_allocations), float(self.park_after_idle_s))
        return kept

    @observe(All)
    def _forget_settings(self, change) -> None:
        self.__dict__.pop("_settings_kept", None)
        self.__dict__.pop("_hook_traits_kept", None)

    # ------------------------------------------------------------ lifecycle

    def load(self) -> None:
        """Register the magic and, where CUDA can ever be in use, the cell hooks; print why not otherwise."""
        self.shell.register_magics(self)
        self._magics_registered = True
        self._loaded = True
        notes = self.load_notes
        for sentence in self.ignored_config:
            notes.say(sentence)
        for sentence in environment_notes():
            notes.say(sentence)
        try:
            probe = self.native.probe()
        except Exception as exc:
            # the library did not load, or the driver it found cannot be used (its message says why and what to do)
            self.engine.last_driver_state, why = probe_failure(exc)
            notes.say(why)
            return
        self.engine.last_driver_state = (probe.get("driver") or {}).get("state")
        with contextlib.suppress(Exception):  # the devices in use before the first cell: its baseline
            self.engine.baseline(probe)
        why = no_cleanup_here(probe)
        if why is not None:
            notes.say(why)
            return
        self.shell.events.register("pre_run_cell", self.pre_run_cell)
        self.shell.events.register("post_run_cell", self.post_run_cell)
        self._hooks_registered = True
        with contextlib.suppress(Exception):  # PyCUDA's pools are seen as they are made from now on
            frameworks.install()
        self._start_status_endpoint()
        with contextlib.suppress(Exception):  # ipykernel's: requests that run code and are no cell resume first
            self._request_guard.install(getattr(self.shell, "kernel", None))
        with contextlib.suppress(Exception):
            self.clears.install()
        atexit.register(self._at_exit)

    def unload(self) -> None:
        """Undo ``load``: the same bound methods are unregistered, the magic and %config entry removed."""
        self.parking.close()
        if self.parking.requested:  # %gpumem --park earlier in the cell that unloads: its park cannot come
            self.parking.requested = False
            print(say("not parked: gpucleanup was unloaded in the cell that asked for the "
                      "park (%gpumem --park); load it again and ask in a cell of its own"))
        with contextlib.suppress(Exception):
            self._request_guard.remove()
        with contextlib.suppress(Exception):
            self.clears.remove()
        self._refuse_the_cell.disarm()
        self.load_notes.remove()
        with contextlib.suppress(Exception):
            self.trace.stop()
        self.engine.stop()
        if self._hooks_registered:
            for event, fn in (("pre_run_cell", self.pre_run_cell), ("post_run_cell", self.post_run_cell)):
                with contextlib.suppress(ValueError):
                    self.shell.events.unregister(event, fn)
            with contextlib.suppress(ValueError):
                self.shell.ast_transformers.remove(self._interrupt_the_cell)
            with contextlib.suppress(Exception):
                frameworks.uninstall()
            self._hooks_registered = False
        if self._magics_registered:
            unregister_magics(self.shell.magics_manager, self)
            self._magics_registered = False
        # Magics.__init__ added us to shell.configurables (for %config): a reload must not leave two
        self.shell.configurables[:] = [c for c in self.shell.configurables if c is not self]
        atexit.unregister(self._at_exit)
        self._close_status_endpoint()
        self._loaded = False

    def _at_exit(self) -> None:
        # no driver call may happen while the process exits, and no callback into Python
        with contextlib.suppress(Exception):
            self.trace.stop()
        self.parking.disarm()
        self.parking.resume_at_exit()  # a parked process's frees at exit would wait for a restore
        self.engine.exiting = True
        self.engine.stop()
        self._close_status_endpoint()

    def _start_status_endpoint(self) -> None:
        if not self.status_server or self._link.start(self.shell, self.history_size, self.status_max_peers) is None:
            return
        try:
            self.outside.hook(self._link.endpoint)  # a drain from outside runs the kernel's cleanup too
        except Exception as exc:
            self._warn_once_now("status:start", f"status endpoint did not start ({type(exc).__name__}: {exc})")

    def _close_status_endpoint(self) -> None:
        self.outside.unhook()  # first: a drain's reply under way stops waiting for a finalizer
        self._link.close()

    @property
    def _endpoint(self) -> Any:
        """The status endpoint while it serves, else None."""
        link = self.__dict__.get("_link")
        return link.endpoint if link is not None else None

    @observe("history_size", "status_max_peers")
    def _resize_history(self, change) -> None:
        if change["name"] == "history_size" and hasattr(self, "history"):
            self.history.resize(change["new"])
        # The native server's history bound and peer cap are fixed when it starts: restart
        # it so that the status endpoint keeps as many records as %gpumem --history.
        if self._endpoint is not None:
            self._close_status_endpoint()
            self._start_status_endpoint()

    # ------------------------------------------------------------ notes

    def _warn_once_now(self, kind: str, text: str) -> None:
        if self._holding:  # said at a later cell's end: one said now would be held back, and never said
            return
        if self.engine.note_once(kind):
            self._say([say(text)])

    def _say(self, lines: List[str], cell: Optional[int] = None) -> None:
        """gpucleanup's own output after a cell, never the cell's stdout: a display output of its own
        (``text/plain``, a small ``text/html``, metadata that name gpucleanup) that Jupyter shows under
        the cell and frontends, nbconvert and tests can tell apart or drop; terminal IPython's display
        publisher prints its text after the cell's output. ``%%capture`` and a redirected stdout
        inside the cell hold only what the user printed."""
        if not lines or self._holding:
            return
        publish = getattr(getattr(self.shell, "display_pub", None), "publish", None)
        if publish is None:
            print("\n".join(lines))
            return
        publish(data=report.line_bundle(lines), metadata=report.line_metadata(cell))

    # ------------------------------------------------------------ event handlers

    def pre_run_cell(self, info: Any = None) -> None:
        """Before a cell: mark it running for the status endpoint. No driver call."""
        outside_drain = self.outside.cell_starts()  # from here no drain from outside runs the kernel's cleanup
        if self.cells.enter() > 1:  # run_cell inside a cell (%%capture, %run -i): left to the enclosing cell
            if a_cell_runs_code():
                return
            self._put_right_unended_cells()
        self.parking.parked_at_start = None  # set again below by the resume, once the cell says "running"
        self.clears.cell_starts()
        released = None
        try:
            if outside_drain:
                self.outside.wait()  # one that began before this cell: it ends first
            self.cells.forced = None
            if info is not None and getattr(info, "silent", False):
                return  # a frontend's silent request (no cleanup follows it) leaves a pending release alone
            # a release waiting for the kernel to be idle waits for this cell's end, or runs now if it is another
            # cell; the wait for it comes after the resume below: parked, it cannot begin
            released = self.engine.cell_starts(getattr(info, "raw_cell", None))
            if self.trace.active:
                self.trace.set_cell(running_cell_number(self.shell, info))
            if self.engine.exiting:
                if released is not None:
                    self._wait_for_release(released)
                return
            # Said with the cleanup paused too (%gpumem --off): no park or drain may begin during a cell,
            # and a parked kernel is resumed first whatever the settings.
            number = running_cell_number(self.shell, info)
            parked = self._link.cell_state("running", number)
            # the state the resume takes in the same step, built only when the kernel may be parked
            running = None if parked == 0 else {"state": "running", "cell": number, "since_ns": time.time_ns()}
            # a refusal armed for a silent execute that never ran (ipykernel aborts queued requests after an
            # error) is not this cell's: each cell's own resume decides
            self._refuse_the_cell.disarm()
            self.parking.resume_before_cell(running, parked=parked)
            if self.parking.refusal:
                self._refuse_the_cell.arm(self.parking.refusal)
            if released is not None:
                self._wait_for_release(released)
                released = None
        except KeyboardInterrupt:
            self._interrupt_the_cell.arm(self.shell)  # Ctrl-C is the user's: it stops the cell
        except Exception as exc:
            with contextlib.suppress(Exception):
                self._warn_once_now(f"pre:{type(exc).__name__}", f"before the cell: {type(exc).__name__}: {exc}")
        finally:
            if released is not None:  # not waited for: dropped unless it runs (a parked kernel's would sleep on)
                with contextlib.suppress(Exception):
                    released.cancel()

    def _put_right_unended_cells(self) -> None:
        """A cell starts while the count says another runs, but none runs code (``CellState.put_right``)."""
        unended = self.cells.put_right()
        with contextlib.suppress(Exception):
            self.engine.cell_ends()  # what the unended cell held is dropped, as its post_run_cell would have
        with contextlib.suppress(Exception):
            self._warn_once_now("unended-cell", unended_cells(unended))

    def _wait_for_release(self, job: Any) -> None:
        """Another cell starts under release "rerun": it finds the caches the last cell left given back, as after
        release "cell"; called after the resume before the cell (``IdleRelease.before_cell``)."""
        limit = float(self.settle_timeout)
        if not job.before_cell(limit, bool(self.parking.refusal)):
            self._warn_once_now("release:late", f"the release of what cell [{job.cell}] left still ran after "
                                f"{limit:g} s: this cell runs alongside it (a framework's free waits for the GPU)")

    def post_run_cell(self, result: Any = None) -> None:
        """After a cell: the cleanup; never raises and leaves the cell's result and error alone.

        A run_cell inside a cell (``%%capture`` runs the cell's body so) is left to the enclosing
        cell's cleanup: its line is not captured into the user's output, and a cell is cleaned once."""
        try:
            self._post_run_cell(result)
        finally:
            self.cells.counted_out()

    def _post_run_cell(self, result: Any = None) -> None:
        if self.cells.leave() > 0:
            return
        traits = None
        try:
            if result is not None and getattr(getattr(result, "info", None), "silent", False):
                return
            # a clear_output(wait=True) still pending: anything said now would wipe what the cell showed
            self._holding = self.clears.holds_the_line(result)
            traits = self._hook_traits()
            if not traits.enabled or self.engine.exiting or self.parking.parked_for_cleanup():
                return  # parked (its resume failed): a driver call would wait for the restore
            cell = getattr(result, "execution_count", None) if result is not None else None
            if result is not None and getattr(result, "error_in_exec", None) is not None:
                self._release_after_oom(result, cell)
            # asked for by the engine once this cell's pass found a device in use (the first GPU cell too)
            hidden = functools.partial(holders.held_after_cell, self.shell, result, cell)
            outcome = self.cleanup(cell=cell, after_forced=self.cells.forced, hidden=hidden)
            if outcome is not None and outcome.lines:  # an idle cell's has none
                self._say(outcome.lines, cell)
            if traits.trace_allocations and not self.trace.active and outcome is not None:
                self.trace.start(automatic=True)
        except KeyboardInterrupt:
            with contextlib.suppress(Exception):
                self._say([say("interrupted (Ctrl-C): cleanup stopped")])
        except Exception as exc:
            if outside_drain_gave_no_way(exc):
                with contextlib.suppress(Exception):
                    self._say([say(str(exc))])
                return
            with contextlib.suppress(Exception):
                self._warn_once_now(f"internal:{type(exc).__name__}", f"cleanup failed ({type(exc).__name__}: {exc}); the cell is not affected")
        finally:
            self.engine.cell_ends()  # a release the cell held and no cleanup re-armed (paused, parked) is dropped
            self.cells.forced = None
            self._interrupt_the_cell.disarm(self.shell)
            try:  # before "idle": from then a policy may park the kernel (no contextlib.suppress: every cell)
                self.parking.threads_seen()
            except Exception:
                pass
            self._say_idle()
            try:
                # %gpumem --park: the cell has ended, the kernel is idle; and parked if it stays idle that long
                self.parking.after_cell((traits or self._hook_traits()).park_after_idle_s)
            except Exception:
                pass
            self._holding = False

    def _say_idle(self) -> None:
        """The status endpoint's "idle" as a cell's hook ends. A Ctrl-C that lands here comes after
        the cleanup: it is dropped, as an idle kernel drops one, and "idle" is said again (a state
        left at "draining" would refuse gpucleanup drain until the next cell)."""
        for _ in range(3):
            try:
                # "draining" instead while a drain's cleanup that this cell outwaited still runs: no park may begin
                self.outside.say_after_cell(lambda: self._link.cell_state("idle"), lambda: self._link.say(
                    "set_state", {"state": "draining", "cell": None, "since_ns": time.time_ns()}))
                return
            except KeyboardInterrupt:
                continue
            except Exception:
                return

    def _release_after_oom(self, result: Any, cell: Optional[int]) -> None:
        """A cell that failed with a GPU out-of-memory error: its traceback's frames let go of their variables
        before the cleanup (``release_after_oom``), and the user is told."""
        error = getattr(result, "error_in_exec", None) if result is not None else None
        said = holders.release_after_oom(error, cell, getattr(self.shell, "user_ns", None)) \
            if error is not None and self.release_after_oom else None
        if said:
            self._say([say(said)], cell)

    def cleanup(self, cell: Optional[int] = None, forced: bool = False, after_forced: Optional[CellRecord] = None,
                hidden: Any = None, overrides: Optional[dict] = None, source: Optional[str] = None) -> Optional[Outcome]:
        """The after-cell cleanup now (the engine's); its record goes to the history and
        the status endpoint. None when nothing in the kernel uses CUDA. ``overrides``: settings
        that differ from the traits for this pass only (a drain from outside: its time limit); ``source``:
        "outside" for a drain asked for from outside the kernel, which its record says (not a cell)."""
        namespace = getattr(self.shell, "user_ns", None)
        settings = self.settings()
        if overrides:
            settings = dataclasses.replace(settings, **overrides)
        outcome = self.engine.run(settings, cell=cell, namespace=namespace, forced=forced, after_forced=after_forced,
                                  hidden=hidden)
        if outcome is not None and outcome.keep:
            data = outcome.as_dict()
            if source is not None:
                data["source"] = source
            self.history.append(data)
            self.totals.add(data)
            # only the published copy carries the totals: the history and %gpumem --json stay per cell
            self._link.say("publish", dict(data, totals=self.totals.as_dict()))
        return outcome

    # ------------------------------------------------------------ a drain from outside

    def _clean_for_outside(self, overrides: dict) -> Optional[Outcome]:
        """The cleanup for a drain from outside (OutsideDrain.run), said to the status endpoint as "draining"."""
        self._link.say("set_state", {"state": "draining", "cell": None, "since_ns": time.time_ns()})
        return self.cleanup(forced=True, overrides=overrides, source="outside")  # "idle" after: OutsideDrain's

    def _why_no_outside_drain(self) -> Optional[str]:
        """Why a drain from outside may not run the kernel's cleanup now, besides a cell under way."""
        if not self._loaded or not self._hooks_registered or self.engine.exiting:
            return "gpucleanup's cleanup is not active in this kernel"
        if self.parking.parked():
            return "the kernel is parked"
        return None

    # ------------------------------------------------------------ %gpumem (its work: gpumem_command)

    def status(self) -> dict:
        """What %gpumem shows, as data with exact bytes."""
        out = self.engine.memory_status(self.settings())
        out["enabled"] = bool(self.enabled)
        out["history"] = self.history.last(5)
        out["trace"] = self.trace.brief()
        return out

    @gpumem_arguments
    @line_magic
    @with_settings(GPUCleanupOptions)
    def gpumem(self, line: str = ""):
        """GPU memory of this kernel: per device in use, per framework, driver pools, pinned host pools.

        With no option, a table per device in use: total and used memory (device-wide,
        as the driver sees it), each framework's live and cached bytes, the driver's
        memory pools (used / reserved), the pinned host pools, and what is outside every
        pool (device used minus everything known: the CUDA context, other processes on
        the same GPU and raw allocations), then the last cells' records.

        Rich frontends get HTML tables, terminals aligned text. ``--json`` returns the
        same data with exact bytes (assign it: ``d = %gpumem --json``). ``--plot [N]`` draws
        device memory over the last N cells (an image in rich frontends, sparklines in terminals).

        After every cell, while the kernel uses CUDA, gpucleanup waits (at most
        ``settle_timeout`` s) for queued GPU work, collects garbage when it can release
        GPU memory, empties the frameworks' caches (pinned host pools in the
        background), trims the driver's pools and prints one line per device, e.g.
        ``gpucleanup · GPU0 H100 · freed 6.0 GiB (cupy 5.5, torch 0.5) · device 2.7/79.6 GiB · 12 ms``.

        """
        return self._gpumem.run(parse_gpumem(self.gpumem, line))

    def _driver_ready(self) -> bool:
        return self.engine.last_driver_state == "ready"

    def why_no_hooks(self) -> str:
        """Why no cleanup runs after cells in this kernel (no driver, no GPU, no native library)."""
        return no_hooks_reason(self.engine.last_driver_state)


# ---------------------------------------------------------------- entry points

try:
    _instances: "weakref.WeakKeyDictionary[Any, GPUCleanup]" = weakref.WeakKeyDictionary()
except Exception:  # pragma: no cover
    _instances = {}  # type: ignore[assignment]


def load_ipython_extension(ipython) -> None:
    """``%load_ext gpucleanup``: one GPUCleanup object per shell."""
    if ipython in _instances:
        print(f"{PREFIX} is already loaded (%reload_ext gpucleanup reloads it)")
        return
    ext = GPUCleanup(shell=ipython)  # the real parts, looked up where they live as it loads
    _instances[ipython] = ext
    try:
        ext.load()
    except Exception:
        _instances.pop(ipython, None)
        with contextlib.suppress(Exception):
            ext.unload()
        raise


def unload_ipython_extension(ipython) -> None:
    """``%unload_ext gpucleanup``: unregisters exactly what load registered."""
    ext = _instances.pop(ipython, None)
    if ext is not None:
        ext.unload()
        del ext
        # The object and what it held are reference cycles (traitlets, the magic's bound methods): freed
        # now, not at the interpreter's next full collection, which comes more rarely as a kernel's objects
        # grow; meanwhile a kernel that reloads the extension piled them up and its memory grew with every
        # reload (tests/soak/soak.py, reload part).
        gc.collect()


def get_extension(ipython) -> Optional[GPUCleanup]:
    """The loaded extension object of a shell, or None."""
    return _instances.get(ipython)
