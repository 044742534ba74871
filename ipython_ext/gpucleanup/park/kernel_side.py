"""Parking a kernel: :mod:`.steps`, kept in step with the kernel's status server and its next cell.

What every party that parks a kernel shares (the park and the resume under its lock file, their sentences), and the
kernel's own side (:class:`InKernel`, :class:`RequestGuard`); what only a party outside the kernel needs is
:mod:`.from_outside`'s.
"""

from __future__ import annotations

import inspect
import os
import sys
import threading
import time
import weakref
from pathlib import Path
from typing import Callable, Optional

from . import parked_hold, steps as park_steps, resume_news
from .parked_hold import ThreadList, threads_to_hold
from .lock import LockBusy, LockUnusable, ParkLock, lock_path, parked_need, refused_memo, wait_limit
from ..say import printable, say
from ..units import format_bytes, format_duration

__all__ = ["LockBusy", "LockUnusable", "ParkLock", "parked_need", "outliving_threads", "lock_path", "park_kernel",
           "resume_kernel", "parked_text", "resumed_text", "kernel_message", "wait_limit", "InKernel", "RequestGuard"]

#: Records one step in the kernel's state: ``(step, bytes) -> state after``; raises with a sentence when refused.
RecordStep = Callable[[str, Optional[int]], dict]


#: The refusals of a park's ``begin`` that pass by themselves (share/protocol.md): a drain, or the kernel's own
#: release on a thread, is under way; on the socket and in the kernel's own process.
PASSING_REFUSALS = ("gpucleanup.server.421", "gpucleanup.server.510")
RECHECK_S = 2.0  # how often a blocked automatic park, and the server's memo of the blocker, look again
BEGIN_WAIT_S = 10.0  # how long a park asks again while a refusal passes (a release takes milliseconds to seconds)


def _begin(record: RecordStep, wait_s: float) -> float:
    """The park's ``begin``, asked again every 50 ms for at most ``wait_s`` seconds while the kernel answers
    with a passing refusal; any other refusal, or a passing one past the wait, is raised as it came.
    Returns how long it waited (0.0: begun at the first ask)."""
    started = time.monotonic()
    deadline = started + wait_s
    asked = 0
    while True:
        try:
            record("begin", None)
            return time.monotonic() - started if asked else 0.0
        except Exception as exc:
            if getattr(exc, "error_id", None) not in PASSING_REFUSALS or time.monotonic() >= deadline:
                raise
        asked += 1
        time.sleep(0.05)


def park_kernel(pid: int, record: RecordStep, lock_file: os.PathLike,
                limits: park_steps.Limits = park_steps.Limits(), env: Optional[dict] = None,
                lock_timeout: float = 1.0, begin_wait_s: float = BEGIN_WAIT_S,
                tracing: bool = False, hold_threads=None, allow: park_steps.Allow = None) -> park_steps.Outcome:
    """Parks kernel ``pid``: its state to parking, the driver's steps, its state to parked (or back to idle).

    ``hold_threads`` and ``allow``: the kernel's own park, which can list its threads to hold while parked
    (:func:`gpucleanup.park.steps.park`); the hold's report is kept in the lock file's note for the resume.

    A ``begin`` refused only for a moment (a drain or the kernel's own release under way) is asked again
    for at most ``begin_wait_s`` seconds: the release ends by itself, and a park must not fail for it.

    Raises :class:`~gpucleanup.park.steps.ParkRefused` with the sentence when nothing was done (the kernel
    runs a cell, is parked already, cannot be parked, or the driver refused a park of it for what it holds: the
    lock file's memo, kept for the process's life), :class:`LockBusy` when another park or resume
    of it is under way. When the driver's steps fail and leave the process locked or checkpointed, its
    state is ``parked`` all the same: its next cell (or ``gpucleanup resume``) brings it back.

    Three parties may act on one kernel's park: ``gpucleanup park|resume KERNEL`` (another process), the kernel
    itself (``%gpumem --park``, and the resume before its next cell), and the Jupyter Server page. Two things keep
    them apart:

    - **The kernel's state**, held by its status server (share/protocol.md, request ``park``): ``begin`` takes it
      from idle to parking, and is refused while a cell or a drain runs; a cell that starts meanwhile keeps the
      park (the server never lets a cell's state replace it) and finds it at once. While parking or parked,
      neither the server nor the extension makes a driver call: one would wait until the process is restored
      (share/FACTS.md §10).
    - **A lock file** next to the kernel's key (:mod:`.lock`): whoever runs the driver's steps holds it. The
      kernel's resume waits for it at most as long as the park's own limits.

    Nothing here makes a driver call in the calling process: each step runs in a helper (:mod:`.steps`); what
    only a party outside the kernel needs (its state through signed requests to the status endpoint, the
    owner's check) is :mod:`.from_outside`'s.
    """
    with ParkLock(lock_file, lock_timeout) as lock:
        memo = refused_memo(lock.read_note())
        if memo is not None:
            raise park_steps.ParkRefused(park_steps.refused_again_refusal(pid, memo))
        waited_s = _begin(record, begin_wait_s)
        try:
            outcome = park_steps.park(pid, limits, env=env, tracing=tracing, hold_threads=hold_threads, allow=allow)
        except BaseException:
            record("failed", None)
            raise
        outcome.waited_s = round(waited_s, 3)
        if outcome.ok or outcome.state in (park_steps.LOCKED, park_steps.CHECKPOINTED):
            note = {"pid": pid, "usage": outcome.usage or {}, "parked_bytes": outcome.parked_bytes,
                    "since_ns": time.time_ns()}
            if outcome.parked_hold:
                note["held"] = outcome.parked_hold
            lock.write_note(note if outcome.ok or outcome.parked_hold else None)
            record("parked", outcome.parked_bytes if outcome.ok else None)
        else:
            result = park_steps.lasting_refusal(outcome)
            if result is not None:  # refused for what it holds: the driver fails every later one, none is tried
                lock.write_note(dict(lock.read_note(), refused={"result": result, "since_ns": time.time_ns()}))
            record("failed", None)
        return outcome


def resume_kernel(pid: int, record: Optional[RecordStep], lock_file: os.PathLike,
                  limits: park_steps.Limits = park_steps.Limits(), env: Optional[dict] = None,
                  lock_timeout: Optional[float] = None,
                  by: Optional[str] = None, allow: park_steps.Allow = None) -> park_steps.Outcome:
    """Brings kernel ``pid`` back from whatever a park left (the driver's own state decides) and, when it
    runs again, records ``resumed``. Waits for a park under way (at most :func:`wait_limit`). ``by``: how the
    kernel's next cell says a resume made here, for a resume no cell says at once (:mod:`.resume_news`: from
    outside, for a request that is no cell); None: said at once by the caller (before a cell), or never (at exit).
    ``allow``: names the restore's helper to the kernel, so that it may hold the kernel's threads meanwhile."""
    with ParkLock(lock_file, wait_limit(limits) if lock_timeout is None else lock_timeout) as lock:
        note = lock.read_note()
        held = note.get("held") if isinstance(note, dict) and isinstance(note.get("held"), dict) else None
        outcome = park_steps.resume(pid, limits, env=env, need=parked_need(note), allow=allow, held=held)
        if record is not None and park_steps.lost(outcome):
            try:
                record("lost", None)  # ps, the page and /metrics say it; no cell waits on it
            except Exception:
                pass
        if outcome.ok:
            lock.write_note(resume_news.after_resume(note, outcome.seconds, by)
                            if by is not None and outcome.changed else None)
            if record is not None:
                try:
                    record("resumed", None)
                except Exception as exc:
                    # Already running: another party resumed it and said so first; not news.
                    if outcome.changed or "not parked" not in str(exc):
                        raise
        return outcome


def kernel_message(outcome: park_steps.Outcome) -> str:
    """The outcome's sentence, its retry advice for a kernel: ``gpucleanup resume PID`` (which also tells the
    kernel's status endpoint) rather than the bare process command."""
    return outcome.message.replace(f"python -m gpucleanup.park resume {outcome.pid}", f"gpucleanup resume {outcome.pid}")


def parked_text(outcome: park_steps.Outcome) -> str:
    """``parked 8.2 GiB of GPU memory in host memory in 3.1 s``: an ``ok`` park's sentence."""
    what = f"{format_bytes(outcome.parked_bytes)} of GPU memory" if outcome.parked_bytes else "its GPU memory"
    waited = (f", after waiting {format_duration(outcome.waited_s)} for a release or a drain under way to end"
              if outcome.waited_s else "")
    return f"parked {what} (context included) in host memory in {outcome.seconds:.1f} s{waited}"


def resumed_text(outcome: park_steps.Outcome, parked: Optional[dict]) -> str:
    """``resumed 8.2 GiB from host memory in 1.5 s (parked 42 min)``: a resume's sentence; ``parked``: the
    kernel's state before it (``bytes``, ``since_ns``) when known."""
    parked = parked or {}
    size = parked.get("bytes")
    what = f"resumed {format_bytes(size)}" if isinstance(size, int) and size > 0 else "resumed its GPU memory"
    text = f"{what} from host memory in {outcome.seconds:.1f} s"
    since = parked.get("since_ns")
    if isinstance(since, int) and since > 0:
        text += f" (parked {format_duration(max(0.0, (time.time_ns() - since) / 1e9))})"
    hold = next((s.hold for s in outcome.steps if s.name == "restore" and isinstance(s.hold, dict)), None)
    if hold is not None and not hold.get("held"):
        text += f"; the kernel's other threads ran during the restore ({hold.get('why') or 'not held'})"
    return text


# ------------------------------------------------------------------ the kernel's own side


def allow_helper(helper_pid: int) -> None:
    """In the kernel: lets the resume's helper hold this process's threads during the restore (Yama's
    ptrace_scope 1 lets a process trace only its descendants, or one the tracee names)."""
    from .. import _native

    _native.allow_tracer(helper_pid)


#: Threads that outlive cells by design and make no GPU calls of the user's: tqdm's monitor, IPython's history
#: saver, gpucleanup's own.
_QUIET_THREADS = ("gpucleanup", "TMonitor", "IPythonHistorySavingThread")

#: Where the kernel's own machinery lives: a thread whose class or target comes from one of these modules is the
#: kernel's (ipykernel's parent poller, heartbeat, iopub, control and shell channel threads, ZeroMQ's and
#: tornado's, the debugger's), never the notebook's work, however and whenever gpucleanup was loaded.
_MACHINERY = ("ipykernel", "jupyter_client", "zmq", "tornado", "IPython", "debugpy", "_pydevd", "pydevd",
              "gpucleanup", "comm", "traitlets")

_WORKER_FILE = os.path.join("concurrent", "futures", "thread.py")
_EXECUTOR = "concurrent.futures"


def _origin(thread: threading.Thread) -> str:
    """The module a thread's code comes from: its class's when it is a subclass, else its target's."""
    cls = type(thread)
    if cls not in (threading.Thread, threading.Timer):
        return cls.__module__ or ""
    target = getattr(thread, "_target", None)
    return getattr(target, "__module__", None) or ""


def _idle_worker(frame) -> bool:
    """A ThreadPoolExecutor's worker (asyncio's default executor included) waiting in its queue for work: its
    innermost Python frame is the worker loop itself, not a task it runs."""
    code = getattr(frame, "f_code", None)
    return code is not None and code.co_name == "_worker" and code.co_filename.endswith(_WORKER_FILE)


def _thread_refs(threads: list) -> tuple:
    """What tells one look at Python's threads from the next: weak references to the thread objects (one that ended
    never equals one that started; a count would, and a kept thread object would keep what the notebook's thread
    held alive for a cell more)."""
    return tuple(map(weakref.ref, threads))


def outliving_threads() -> list:
    """The names of the live threads that may be doing the notebook's GPU work (a training loop, a prefetcher,
    a task on an executor), whenever they started (before gpucleanup loaded too): every thread but the kernel's
    machinery (:data:`_MACHINERY`), the main thread, the quiet ones and idle executor workers."""
    import sys

    frames = sys._current_frames()  # noqa: SLF001 (the one way to see where another thread waits)
    try:
        main = threading.main_thread()
        out = []
        for t in threading.enumerate():
            if t is main or not t.is_alive() or t.name.startswith(_QUIET_THREADS):
                continue
            if _origin(t).split(".")[0] in _MACHINERY or _idle_worker(frames.get(t.ident)):
                continue
            out.append(t.name)
        return sorted(out)
    finally:
        # The dict holds this very frame, which holds the dict: a cycle that would keep every thread's frames,
        # and what their locals hold (a training loop's tensors), until the garbage collector finds it.
        frames.clear()


def _threads_to_hold_here(restore_thread: Optional[int]):
    """The kernel's own park of a JAX kernel: its threads to hold while parked, or why not (threads of the notebook
    run: :func:`.steps.busy_threads`)."""
    running = [printable(n) for n in outliving_threads() if n != threading.current_thread().name]
    return park_steps.busy_threads(running) if running else threads_to_hold(restore_thread)


class InKernel:
    """The kernel's side of parking: ``%gpumem --park`` after the cell, the resume before the next cell,
    and the look the hooks take first (no driver call while parked).

    ``endpoint``: a callable giving the kernel's status endpoint (or None while it is off); ``say``: writes
    gpucleanup's own output lines. Each park or resume runs in a thread of its own that the cell's thread
    joins: a Ctrl-C then stops the wait, never a step half-way (the step goes on, and the next cell or
    ``gpucleanup resume`` finds the lock and the driver's state).
    """

    def __init__(self, endpoint: Callable[[], object], say: Callable[[list], None],
                 limits: park_steps.Limits = park_steps.Limits(), env: Optional[dict] = None,
                 tracing: Callable[[], bool] = lambda: False):
        self._endpoint = endpoint
        self._tracing = tracing  # whether %gpumem --trace holds CUPTI now (the driver cannot checkpoint then)
        self._say = say
        self.limits = limits
        self.env = env
        self.requested = False
        self._timer = None
        self._auto_note: Optional[str] = None
        self._watch: Optional[threading.Thread] = None  # follows a blocker until its threads end
        self._closed = threading.Event()
        self._workers = False  # executor workers were alive at the last look
        self._armed = 0  # which arming of the timer is current (a cell's start or a new arming ends the older)
        #: why the cell about to run must not run (the kernel stays parked), for the extension to say
        self.refusal: Optional[str] = None
        #: set when a resume lost the kernel's GPU state: every later cell and request is refused at once with it
        self.lost: Optional[str] = None
        self._threads = _thread_refs(threading.enumerate())
        self._listed = ThreadList()  # a JAX kernel's threads to hold, for a park from outside
        self._traced = False  # whether the trace was on at the last look
        self._say_lock = threading.Lock()
        self._blocker_said: Optional[str] = None
        self._lock_of: object = None  # the endpoint whose park lock _lock is
        self._lock = None
        self._news = resume_news.NewsLook()
        #: what the resume before this cell found: False, not parked (the cell's state is "running" since,
        #: so no park can begin before the cell's cleanup); None: not known, asked again
        self.parked_at_start: Optional[bool] = None

    # ---------------------------------------------------------- parking after a time idle

    def arm(self, after_s: float) -> None:
        """Parks the kernel once it has stayed idle ``after_s`` seconds (0: never); re-armed after every cell."""
        if self._timer is not None:
            self.disarm()
        if after_s and after_s > 0:
            self._closed.clear()
            self._start_timer(after_s, after_s)

    def _start_timer(self, delay_s: float, after_s: float) -> None:
        self._armed += 1
        self._timer = threading.Timer(delay_s, self._park_when_idle, args=(after_s, self._armed))
        self._timer.daemon = True
        self._timer.name = "gpucleanup-park-timer"
        self._timer.start()

    def disarm(self) -> None:
        self._armed += 1  # a timer already firing re-arms nothing
        timer, self._timer = self._timer, None
        if timer is not None:
            timer.cancel()

    def automatic_park_blocker(self) -> Optional[str]:
        """Why no automatic park may take this kernel now (None: it may): %gpumem --trace on, or a thread started
        in a cell that still runs (its driver calls would stop for as long as the kernel stays parked)."""
        if self._tracing():
            return ("[gpucleanup.park.647] %gpumem --trace is on: the driver's checkpoint does not support its "
                    "CUPTI subscriber (%gpumem --trace off makes the kernel parkable)")
        # a thread's name is the notebook's to choose: it reaches the server, a CLI's terminal and the log
        running = [printable(name) for name in outliving_threads() if name != threading.current_thread().name]
        if not running:
            return None
        return (f"[gpucleanup.park.642] {len(running)} thread{'s' if len(running) > 1 else ''} started in a cell "
                f"still run{'' if len(running) > 1 else 's'} ({', '.join(running[:3])}"
                f"{', ...' if len(running) > 3 else ''}): an automatic park would stop their GPU calls; "
                "it is left to %gpumem --park or gpucleanup park once they end")

    def _park_when_idle(self, after_s: float, armed: int = 0) -> None:
        # On the timer's thread, the kernel idle: the server's "begin" refuses if a cell started meanwhile.
        if not self.can_park():
            return
        endpoint = self._endpoint()
        blocker = self.automatic_park_blocker()
        if blocker:
            self._auto_note = f"not parked after {format_duration(after_s)} idle: {blocker}"
            if armed == self._armed and not self._closed.is_set():
                # looked at again until the threads end: the kernel has been idle long enough by then
                self._start_timer(RECHECK_S, after_s)
            return
        try:
            outcome = park_kernel(os.getpid(), endpoint.park_step, endpoint.park_lock, self.limits, self.env,
                                  tracing=self._tracing(), hold_threads=_threads_to_hold_here, allow=allow_helper)
        except (park_steps.ParkRefused, LockBusy, RuntimeError) as exc:
            if "the kernel is running" not in str(exc):  # a cell that started first is not news
                self._auto_note = f"not parked after {format_duration(after_s)} idle: {exc}"
            return
        except Exception as exc:
            self._auto_note = f"not parked after {format_duration(after_s)} idle ({type(exc).__name__}: {exc})"
            return
        if not outcome.ok:
            self._auto_note = f"not parked after {format_duration(after_s)} idle: {kernel_message(outcome)}"

    def take_note(self) -> Optional[str]:
        """What an automatic park had to say (a refusal, a failure), once."""
        note, self._auto_note = self._auto_note, None
        return note

    def can_park(self) -> bool:
        """Whether this kernel can be parked at all: its status endpoint serves (where the park is kept for the
        next cell) and has a park lock."""
        endpoint = self._endpoint()
        return endpoint is not None and endpoint.park_lock is not None

    def parked(self) -> bool:
        """Whether the kernel is parking or parked (its server's state); no driver call."""
        endpoint = self._endpoint()  # none (off): never parked
        try:
            return endpoint is not None and bool(endpoint.parked())
        except Exception:
            return False

    def after_cell(self, after_s: float) -> None:
        """A cell's hooks end, its state idle: the park ``%gpumem --park`` asked for runs now, and the timer
        that parks the kernel once idle ``after_s`` seconds (0: never) is armed; one call per cell, which
        does nothing more when neither is wanted."""
        if self.requested:
            self.park_after_cell()
        if self._timer is not None or (after_s and after_s > 0):
            self.arm(after_s)

    def threads_seen(self) -> None:
        """A cell ends, before its state says idle (from when a policy may park the kernel): what keeps an
        automatic park away is said again when a thread started or ended since the last look (the thread objects
        are compared, not their count, which one ending as another starts leaves as it was), the trace was turned
        on or off, executor workers live (one may take a task without any thread starting) or a blocker is said."""
        if "jaxlib" in sys.modules:  # a JAX kernel lists its threads for a park from outside (one dict lookup else)
            endpoint = self._endpoint()
            self._listed.seen(endpoint.park_lock if endpoint is not None else None)
            parked_hold.reap()
        threads = threading.enumerate()
        refs = _thread_refs(threads)
        tracing = bool(self._tracing())
        if (refs != self._threads or self._workers or tracing != self._traced
                or self._blocker_said is not None):
            self._threads = refs
            self._traced = tracing
            self._workers = any(_origin(t).startswith(_EXECUTOR) for t in threads)
            self.say_blocker()

    def say_blocker(self) -> None:
        """Tells the status server why no automatic park may begin (or that one may), when that changed: the
        server's own automatic park asks the kernel's server, which cannot see Python's threads."""
        with self._say_lock:  # the cell's thread and the watch thread: one says each change, once
            blocker = self.automatic_park_blocker()
            if blocker == self._blocker_said:
                return
            endpoint = self._endpoint()
            if endpoint is not None:
                endpoint.park_blocker(blocker)
                self._blocker_said = blocker
                if blocker is not None:
                    self._follow_blocker()

    def _follow_blocker(self) -> None:
        """While the server is told a blocker, a thread looks again every :data:`RECHECK_S` seconds and tells it
        when the threads have ended (with no cell to say it, the server's automatic park would wait for ever)."""
        self._closed.clear()  # loaded again after an unload
        if self._watch is not None and self._watch.is_alive():
            return

        def watch() -> None:
            while not self._closed.wait(RECHECK_S):
                try:
                    self.say_blocker()
                except Exception:
                    return
                if self._blocker_said is None:
                    return

        self._watch = threading.Thread(target=watch, name="gpucleanup-thread-watch", daemon=True)
        self._watch.start()

    def close(self) -> None:
        """The extension unloads: no timer, no watch."""
        self._closed.set()
        self.disarm()
        self._listed.close()

    def park_after_cell(self) -> None:
        """The park ``%gpumem --park`` asked for, now that the cell has ended (its state is idle)."""
        if not self.requested:
            return
        self.requested = False
        if not self.can_park():
            self._say([say("not parked: parking needs the status endpoint, which is off "
                           "(%config GPUCleanup.status_server = True, with a private Jupyter runtime directory)")])
            return
        endpoint = self._endpoint()
        pid = os.getpid()

        def run() -> str:
            outcome = park_kernel(pid, endpoint.park_step, endpoint.park_lock, self.limits, self.env,
                                  tracing=self._tracing(), hold_threads=_threads_to_hold_here, allow=allow_helper)
            if outcome.ok:
                return (parked_text(outcome) + "; the next cell brings it back (or: gpucleanup resume "
                        f"{pid})")
            return kernel_message(outcome)
        self._say([say(self._joined(run, "the park"))])

    def parked_for_cleanup(self) -> bool:
        """Whether the cell's cleanup must be left out (the kernel is parked: a driver call would wait for the
        restore): what the resume before the cell found, without asking the server again when it was not parked."""
        known, self.parked_at_start = self.parked_at_start, None
        return self.parked() if known is None else known

    def resume_before_cell(self, then: Optional[dict] = None, parked: Optional[int] = None) -> None:
        """Brings a parked kernel back before its cell runs, and says so in one line; ``then``: the
        cell's state, taken in the same step as the resume (no park can begin in between); ``parked``:
        the server's park state as the call that said ``then`` answered it (None: asked here); sets
        ``parked_at_start``, which the extension clears as each cell starts. When the kernel is still
        parked after it (no room on its GPU, a failed restore, Ctrl-C), ``refusal`` says why: the cell
        must not run, since its first GPU call would wait for a restore nobody makes."""
        self.refusal = None
        if self.lost is not None:
            self.refusal = self.lost
            return
        if self._timer is not None:
            self.disarm()
        note = self.take_note() if self._auto_note is not None else None  # set by the timer's thread
        if note:
            self._say([say(note)])
        if not (self.parked() if parked is None else parked):
            self.parked_at_start = False
            told = self._news.take(self._lock_file())  # resumed meanwhile for a request, or from outside
            if told:
                self._say([say(told)])
            return
        text = self._resume(then, None)
        if self.lost is not None:
            self.refusal = self.lost
            return
        if self.parked():
            self.refusal = (f"this cell was not run: the kernel is still parked ({text}); nothing is lost: run the "
                            f"cell again, or resume it with gpucleanup resume {os.getpid()}")
            return
        self._say([say(text)])

    def hold_off_parks(self, begin: bool) -> bool:
        """A request that is no cell begins (``begin``) or ends: the status server refuses a park's begin
        meanwhile, as during the kernel's own release (a passing refusal); False when the endpoint says parked.
        Its end is activity: an idle kernel's idle time, which automatic parks wait for, starts again."""
        endpoint = self._endpoint()
        if endpoint is None:
            return True  # off: nothing can park this kernel
        return bool(endpoint.background(True)) if begin else bool(endpoint.background(False, activity=True))

    def resume_for_request(self, msg_type: str = "request") -> bool:
        """A request that runs code and is no cell (a silent execute, a comm message, an inspection) brings a
        parked kernel back first; it has no cell to show a line under, so the next cell says it
        (:mod:`.resume_news`). Returns whether the kernel is still parked."""
        if self.lost is not None:
            return True
        if not self.parked():
            return False
        self._resume(None, resume_news.for_request(msg_type))
        return self.lost is not None or self.parked()

    def _lock_file(self) -> Optional[Path]:
        """The kernel's park lock (its endpoint's, fixed while the endpoint serves); None while it is off."""
        endpoint = self._endpoint()
        if endpoint is None:
            return None
        if self._lock_of is not endpoint or self._lock is None:
            self._lock_of, self._lock = endpoint, endpoint.park_lock
        return self._lock

    def _resume(self, then: Optional[dict], by: Optional[str]) -> str:
        endpoint = self._endpoint()
        pid = os.getpid()
        before: dict = {}

        def record(step: str, parked_bytes: Optional[int]) -> dict:
            # the cell's state goes with "resumed" only (the same step: no park can begin in between)
            after = (endpoint.park_step(step, parked_bytes, then) if then and step == "resumed" else
                     endpoint.park_step(step, parked_bytes))
            before.update(after.get("was") or {})
            return after

        def run() -> str:
            outcome = resume_kernel(pid, record, endpoint.park_lock, self.limits, self.env, by=by, allow=allow_helper)
            if park_steps.lost(outcome):
                self.lost = (f"this cell was not run: the kernel's GPU state is lost ({kernel_message(outcome)}); "
                             "restart the kernel (its variables cannot be brought back to the GPU)")
            if outcome.ok:
                return (resumed_text(outcome, before) if outcome.changed else
                        "resumed already (by gpucleanup resume or the page) before this cell")
            return kernel_message(outcome)
        return self._joined(run, "the resume")

    def resume_at_exit(self) -> None:
        """At exit, a parked kernel is brought back first: its frameworks' own frees at exit would wait
        for a restore that nobody makes. Bounded by the park's limits; never raises."""
        try:
            if not self.parked():
                return
            endpoint = self._endpoint()
            resume_kernel(os.getpid(), endpoint.park_step, endpoint.park_lock, self.limits, self.env,
                          allow=allow_helper)
        except Exception:
            pass

    @staticmethod
    def _joined(run: Callable[[], str], what: str) -> str:
        """``run()`` in a thread of its own; its sentence, or why there is none."""
        refused = "not parked" if what == "the park" else "not resumed"

        result: dict = {}

        def target() -> None:
            try:
                result["text"] = run()
            except (park_steps.ParkRefused, RuntimeError) as exc:  # RuntimeError: the server refused the step
                result["text"] = f"{refused}: {exc}"
            except LockBusy as exc:
                result["text"] = f"{what} did not start: {exc}; try again"
            except Exception as exc:
                result["text"] = f"{what} failed ({type(exc).__name__}: {exc})"

        worker = threading.Thread(target=target, name="gpucleanup-park", daemon=True)
        worker.start()
        try:
            worker.join()
        except KeyboardInterrupt:
            return (f"interrupted (Ctrl-C): {what} goes on in the background; the next cell finds where it "
                    "ended (gpucleanup ps shows it)")
        return result.get("text", f"{what} ended without a word")


class RequestGuard:
    """Brings a parked kernel back before any request that runs code and is no cell: a silent execute (a
    variable inspector's poll), an execute whose ``user_expressions`` ipykernel evaluates after it (a blank one
    runs no cell hook at all), a comm message (a widget), an inspection or a completion (which may call an
    object's ``__repr__``), and the debugger's variable requests on the control channel (JupyterLab's Variables
    panel). Each would otherwise block the kernel on its first GPU call, with the next cell queued behind it and
    nobody to resume it.

    It wraps the kernel's own handlers (ipykernel's ``Kernel.shell_handlers`` and ``control_handlers``: the
    handler of each message type, called as ``handler(stream, idents, msg)``) and puts them back on
    :meth:`remove` where they are still its own. A cell's execute request is passed on untouched: its
    ``pre_run_cell`` resumes it, and says so under the cell. When the resume fails, the request gets an error
    that says why, never silence: a silent execute is refused as a cell is (``refuse``), ``user_expressions``
    each answer the error, a completion, an inspection and a debug request get an error reply; a comm message,
    which has no reply, is dropped with a line in the kernel's log. After each request the kernel's threads are
    looked at again (a widget's button may start a training thread): an automatic park then knows them.

    Left out (they run no user code, or have a reply of their own): ``kernel_info_request``,
    ``history_request``, ``is_complete_request``, ``comm_info_request``, ``shutdown_request`` (exit resumes a
    parked kernel itself), ``interrupt_request``, ``usage_request``.
    """

    TYPES = ("execute_request", "comm_open", "comm_msg", "comm_close", "inspect_request", "complete_request")
    CONTROL_TYPES = ("debug_request",)
    #: the debugger's commands that evaluate the user's objects (their repr): the Variables panel's
    DEBUG_COMMANDS = ("inspectVariables", "richInspectVariables", "variables", "evaluate", "copyToGlobals",
                      "dumpCell", "modules")

    def __init__(self, parking: "InKernel", refuse: Callable[[str], None]):
        self._parking = parking
        self._refuse = refuse
        self._kernel = None
        self._installed: list = []  # (handler table, message type, our wrapper)

    def install(self, kernel) -> bool:
        handlers = getattr(kernel, "shell_handlers", None)
        if not isinstance(handlers, dict) or self._installed:
            return False
        control = getattr(kernel, "control_handlers", None)
        for table, types in ((handlers, self.TYPES), (control if isinstance(control, dict) else {}, self.CONTROL_TYPES)):
            for msg_type in types:
                original = table.get(msg_type)
                if original is not None:
                    table[msg_type] = self._wrap(msg_type, original)
                    self._installed.append((table, msg_type, table[msg_type]))
        self._kernel = kernel
        return True

    def remove(self) -> None:
        installed, self._installed, self._kernel = self._installed, [], None
        for table, msg_type, wrapper in installed:
            if table.get(msg_type) is wrapper:  # another extension wrapped it after us: leave theirs
                table[msg_type] = wrapper.__wrapped__

    def _wrap(self, msg_type: str, original: Callable) -> Callable:
        guard = self

        def handler(stream, idents, msg, *args, **kwargs):
            if guard.holds_back(msg_type, msg, stream, idents):
                return None
            # no park begins while the request runs (a first completion imports jedi: seconds, the kernel idle)
            held = guard.needs_resume(msg_type, _content(msg)) and guard.hold_off_parks(True)
            try:
                result = original(stream, idents, msg, *args, **kwargs)
            except BaseException:
                guard.after_request(held)
                raise
            if inspect.isawaitable(result):
                async def then():
                    try:
                        return await result
                    finally:
                        guard.after_request(held)
                return then()
            guard.after_request(held)
            return result

        handler.__wrapped__ = original  # type: ignore[attr-defined]
        return handler

    def hold_off_parks(self, begin: bool) -> bool:
        """Tells the status server that the kernel answers a request (no park may begin meanwhile: a passing
        refusal, asked again) or has answered it; True when the begin was taken."""
        try:
            return bool(self._parking.hold_off_parks(begin))
        except Exception:
            return False

    def after_request(self, held: bool = False) -> None:
        if held:
            self.hold_off_parks(False)
        try:
            self._parking.threads_seen()
        except Exception:
            pass

    def needs_resume(self, msg_type: str, content: dict) -> bool:
        """Whether the request runs the user's code outside a cell's hooks."""
        if msg_type == "execute_request":
            # a cell resumes in its own pre_run_cell; a silent one runs no hook, and user_expressions are
            # evaluated after the cell (for blank code, with no hook at all)
            return bool(content.get("silent")) or bool(content.get("user_expressions"))
        if msg_type == "debug_request":
            return content.get("command") in self.DEBUG_COMMANDS
        return True

    def holds_back(self, msg_type: str, msg, stream=None, idents=None) -> bool:
        """Resumes the kernel first where ``msg`` needs it; True when the request must not be run (answered
        here with an error, or dropped where it has no reply)."""
        content = _content(msg)
        if not self.needs_resume(msg_type, content):
            return False
        try:
            still = self._parking.resume_for_request(msg_type)
        except Exception:
            return False
        if not still:
            return False
        why = (getattr(self._parking, "lost", None) or
               f"the kernel is still parked after a resume was tried before this {msg_type}: its GPU calls would "
               f"wait for a restore nobody makes; resume it with gpucleanup resume {os.getpid()}")
        if msg_type == "execute_request":
            if content.get("user_expressions"):
                # each expression answers the refusal (the messaging spec's error for an expression)
                content["user_expressions"] = {
                    name: f"__import__('gpucleanup.park.kernel_side').park.kernel_side.still_parked({why!r})"
                    for name in content["user_expressions"]}
            if content.get("silent") or (content.get("code") or "").strip():
                self._refuse(why)
            return False  # it runs, and the refusal ends it before any of its code
        if self._reply_error(msg_type, msg, content, stream, idents, why):
            return True
        log = getattr(self._kernel, "log", None)
        if log is not None:
            log.warning("gpucleanup: %s dropped: %s", msg_type, why)
        return True

    def _reply_error(self, msg_type: str, msg: dict, content: dict, stream, idents, why: str) -> bool:
        """Answers a request that has a reply with an error that says ``why``; False where it has none."""
        session = getattr(self._kernel, "session", None)
        if session is None or stream is None:
            return False
        if msg_type == "debug_request":
            reply = {"type": "response", "request_seq": content.get("seq"), "success": False,
                     "command": content.get("command"), "message": why, "seq": 0}
        elif msg_type in ("complete_request", "inspect_request"):
            reply = {"status": "error", "ename": "KernelStillParked", "evalue": why, "traceback": []}
        else:
            return False
        try:
            session.send(stream, msg_type.replace("_request", "_reply"), reply, msg, idents)
        except Exception:
            return False
        return True


def _content(msg) -> dict:
    content = msg.get("content") if isinstance(msg, dict) else None
    return content if isinstance(content, dict) else {}


class StillParked(RuntimeError):
    """A request's expression refused: the kernel is still parked."""


def still_parked(why: str):
    """Raises :class:`StillParked` with ``why``: what each of a refused execute's ``user_expressions`` answers."""
    raise StillParked(why)
