"""Parking a kernel: :mod:`gpucleanup.park`'s steps, kept in step with the kernel's status server and its next cell.

Three parties may act on one kernel's park: ``gpucleanup park|resume KERNEL`` (another process), the
kernel itself (``%gpumem --park``, and the resume before its next cell), and the Jupyter Server page.
Two things keep them apart:

- **The kernel's state**, held by its status server (share/protocol.md, request ``park``): ``begin``
  takes it from idle to parking, and is refused while a cell or a drain runs; a cell that starts
  meanwhile keeps the park (the server never lets a cell's state replace it) and finds it at once.
  While parking or parked, neither the server nor the extension makes a driver call: one would wait
  until the process is restored (share/FACTS.md §10).
- **A lock file** next to the kernel's key (``<runtime>/gpucleanup/<pid>.park``, 0600, ``flock``):
  whoever runs the driver's steps holds it, so a resume waits for a park under way to end rather than
  racing it, and a park of a killed ``gpucleanup park`` is left to the next holder, which reads the
  driver's own state. The kernel's resume waits for it at most as long as the park's own limits.

Nothing here makes a driver call in the calling process: each step runs in a helper (:mod:`.park`).
"""

from __future__ import annotations

import errno
import fcntl
import os
import stat
import time
from pathlib import Path
from typing import Callable, Optional

from . import park as park_steps, report
from .units import format_bytes, format_duration

__all__ = ["LockBusy", "ParkLock", "lock_path", "remote_record", "park_kernel", "park_from_outside",
           "resume_from_outside", "outcome_text", "resume_kernel", "parked_text", "resumed_text", "kernel_message",
           "wait_limit"]

#: Records one step in the kernel's state: ``(step, bytes) -> state after``; raises with a sentence when refused.
RecordStep = Callable[[str, Optional[int]], dict]


class LockBusy(Exception):
    """Another party holds the kernel's park lock past the wait allowed."""


def lock_path(key_file: os.PathLike, pid: int) -> Path:
    """The park lock of kernel ``pid``: beside its key, in the user's private ``gpucleanup`` directory."""
    return Path(key_file).parent / f"{int(pid)}.park"


def wait_limit(limits: park_steps.Limits = park_steps.Limits()) -> float:
    """How long a resume waits for a park under way: the longest a park may take (state, lock, checkpoint,
    and an unlock with a second look at the state after a failure)."""
    return limits.state_s * 2 + limits.lock_s + limits.checkpoint_s + limits.unlock_s


class ParkLock:
    """``flock`` on the kernel's park lock file, waited for at most ``timeout`` seconds.

    The file is opened with ``O_NOFOLLOW`` and must be a regular file of this user: a link or another
    user's file planted at the name is refused, never followed.
    """

    def __init__(self, path: os.PathLike, timeout: float):
        self.path = Path(path)
        self.timeout = float(timeout)
        self._fd: Optional[int] = None

    def __enter__(self) -> "ParkLock":
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode) or info.st_uid != os.geteuid():
                raise PermissionError(errno.EPERM, f"{self.path} is not a regular file of this user")
            deadline = time.monotonic() + self.timeout
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() >= deadline:
                        raise LockBusy(f"another park or resume of this kernel has held {self.path} for over "
                                       f"{self.timeout:.0f} s") from None
                    time.sleep(0.05)
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd
        return self

    def __exit__(self, *exc) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)  # closing the descriptor lets the lock go


def remote_record(target, timeout: float) -> RecordStep:
    """The park steps of a kernel's state as signed ``park`` requests to its status endpoint (``target``:
    a :class:`~gpucleanup.status_client.Target`); a refusal raises status_client's error, its sentence."""
    from . import status_client

    def record(step: str, parked_bytes: Optional[int]) -> dict:
        fields: dict = {"step": step}
        if parked_bytes is not None:
            fields["bytes"] = int(parked_bytes)
        return status_client.request(target, "park", timeout, **fields).get("state") or {}

    return record


#: The refusals of a park's ``begin`` that pass by themselves (share/protocol.md): a drain, or the kernel's own
#: release on a thread, is under way; on the socket and in the kernel's own process.
PASSING_REFUSALS = ("gpucleanup.server.421", "gpucleanup.server.510")
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
                lock_timeout: float = 1.0, begin_wait_s: float = BEGIN_WAIT_S) -> park_steps.Outcome:
    """Parks kernel ``pid``: its state to parking, the driver's steps, its state to parked (or back to idle).

    A ``begin`` refused only for a moment (a drain or the kernel's own release under way) is asked again
    for at most ``begin_wait_s`` seconds: the release ends by itself, and a park must not fail for it.

    Raises :class:`~gpucleanup.park.ParkRefused` with the sentence when nothing was done (the kernel
    runs a cell, is parked already, cannot be parked), :class:`LockBusy` when another park or resume
    of it is under way. When the driver's steps fail and leave the process locked or checkpointed, its
    state is ``parked`` all the same: its next cell (or ``gpucleanup resume``) brings it back.
    """
    with ParkLock(lock_file, lock_timeout):
        waited_s = _begin(record, begin_wait_s)
        try:
            outcome = park_steps.park(pid, limits, env=env)
        except BaseException:
            record("failed", None)
            raise
        outcome.waited_s = round(waited_s, 3)
        if outcome.ok or outcome.state in (park_steps.LOCKED, park_steps.CHECKPOINTED):
            record("parked", outcome.parked_bytes if outcome.ok else None)
        else:
            record("failed", None)
        return outcome


def resume_kernel(pid: int, record: Optional[RecordStep], lock_file: os.PathLike,
                  limits: park_steps.Limits = park_steps.Limits(), env: Optional[dict] = None,
                  lock_timeout: Optional[float] = None) -> park_steps.Outcome:
    """Brings kernel ``pid`` back from whatever a park left (the driver's own state decides) and, when it
    runs again, records ``resumed``. Waits for a park under way (at most :func:`wait_limit`)."""
    with ParkLock(lock_file, wait_limit(limits) if lock_timeout is None else lock_timeout):
        outcome = park_steps.resume(pid, limits, env=env)
        if outcome.ok and record is not None:
            record("resumed", None)
        return outcome


def kernel_message(outcome: park_steps.Outcome) -> str:
    """The outcome's sentence, its retry advice for a kernel: ``gpucleanup resume PID`` (which also tells the
    kernel's status endpoint) rather than the bare process command."""
    return outcome.message.replace(f"python -m gpucleanup.park resume {outcome.pid}", f"gpucleanup resume {outcome.pid}")


def park_from_outside(pid: int, target, timeout: float, lock_file: os.PathLike) -> park_steps.Outcome:
    """``gpucleanup park`` and the page's Park: :func:`park_kernel` with the kernel's state kept through
    signed requests to its status endpoint (``target``)."""
    return park_kernel(pid, remote_record(target, timeout), lock_file)


def resume_from_outside(pid: int, target, timeout: float, lock_file: os.PathLike,
                        wait: Optional[float] = None) -> tuple:
    """``gpucleanup resume`` and the page's Resume: ``(outcome, state before)``. The driver's state decides
    what is done; the kernel's state is told ``resumed`` only when it said parking or parked (a kernel
    parked by ``python -m gpucleanup.park`` alone never knew)."""
    from . import status_client

    before = status_client.request(target, "status", timeout).get("state") or {}
    record = remote_record(target, timeout) if before.get("state") in ("parking", "parked") else None
    return resume_kernel(pid, record, lock_file, lock_timeout=wait), before


def outcome_text(outcome: park_steps.Outcome, before: Optional[dict] = None) -> str:
    """A park's or a resume's one sentence for a kernel."""
    if outcome.ok and outcome.changed:
        return parked_text(outcome) if outcome.action == "park" else resumed_text(outcome, before)
    return kernel_message(outcome)


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
    return text


# ------------------------------------------------------------------ the kernel's own side


class InKernel:
    """The kernel's side of parking: ``%gpumem --park`` after the cell, the resume before the next cell,
    and the look the hooks take first (no driver call while parked).

    ``endpoint``: a callable giving the kernel's status endpoint (or None while it is off); ``say``: writes
    gpucleanup's own output lines. Each park or resume runs in a thread of its own that the cell's thread
    joins: a Ctrl-C then stops the wait, never a step half-way (the step goes on, and the next cell or
    ``gpucleanup resume`` finds the lock and the driver's state).
    """

    PREFIX = report.PREFIX + report.SEP  # gpucleanup's own lines start as every other line of it

    def __init__(self, endpoint: Callable[[], object], say: Callable[[list], None],
                 limits: park_steps.Limits = park_steps.Limits(), env: Optional[dict] = None):
        self._endpoint = endpoint
        self._say = say
        self.limits = limits
        self.env = env
        self.requested = False
        self._timer = None
        self._auto_note: Optional[str] = None
        #: what the resume before this cell found: False, not parked (the cell's state is "running" since,
        #: so no park can begin before the cell's cleanup); None: not known, asked again
        self.parked_at_start: Optional[bool] = None

    # ---------------------------------------------------------- parking after a time idle

    def arm(self, after_s: float) -> None:
        """Parks the kernel once it has stayed idle ``after_s`` seconds (0: never); re-armed after every cell."""
        if self._timer is not None:
            self.disarm()
        if after_s and after_s > 0:
            import threading

            self._timer = threading.Timer(after_s, self._park_when_idle, args=(after_s,))
            self._timer.daemon = True
            self._timer.name = "gpucleanup-park-timer"
            self._timer.start()

    def disarm(self) -> None:
        timer, self._timer = self._timer, None
        if timer is not None:
            timer.cancel()

    def _park_when_idle(self, after_s: float) -> None:
        # On the timer's thread, the kernel idle: the server's "begin" refuses if a cell started meanwhile.
        endpoint = self._endpoint()
        if getattr(endpoint, "park_lock", None) is None:
            return
        try:
            outcome = park_kernel(os.getpid(), endpoint.park_step, endpoint.park_lock, self.limits, self.env)
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

    def parked(self) -> bool:
        """Whether the kernel is parking or parked (its server's state); no driver call."""
        asked = getattr(self._endpoint(), "parked", None)  # an endpoint without parking is never parked
        try:
            return bool(asked is not None and asked())
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

    def park_after_cell(self) -> None:
        """The park ``%gpumem --park`` asked for, now that the cell has ended (its state is idle)."""
        if not self.requested:
            return
        self.requested = False
        endpoint = self._endpoint()
        if getattr(endpoint, "park_lock", None) is None:
            self._say([self.PREFIX + "not parked: parking needs the status endpoint, which is off "
                       "(%config GPUCleanup.status_server = True, with a private Jupyter runtime directory)"])
            return
        pid = os.getpid()

        def run() -> str:
            outcome = park_kernel(pid, endpoint.park_step, endpoint.park_lock, self.limits, self.env)
            if outcome.ok:
                return (parked_text(outcome) + "; the next cell brings it back (or: gpucleanup resume "
                        f"{pid})")
            return kernel_message(outcome)
        self._say([self.PREFIX + self._joined(run, "the park")])

    def parked_for_cleanup(self) -> bool:
        """Whether the cell's cleanup must be left out (the kernel is parked: a driver call would wait for the
        restore): what the resume before the cell found, without asking the server again when it was not parked."""
        known, self.parked_at_start = self.parked_at_start, None
        return self.parked() if known is None else known

    def resume_before_cell(self, then: Optional[dict] = None, parked: Optional[int] = None) -> None:
        """Brings a parked kernel back before its cell runs, and says so in one line; ``then``: the
        cell's state, taken in the same step as the resume (no park can begin in between); ``parked``:
        the server's park state as the call that said ``then`` answered it (None: asked here); sets
        ``parked_at_start``, which the extension clears as each cell starts."""
        if self._timer is not None:
            self.disarm()
        note = self.take_note() if self._auto_note is not None else None  # set by the timer's thread
        if note:
            self._say([self.PREFIX + note])
        if not (self.parked() if parked is None else parked):
            self.parked_at_start = False
            return
        endpoint = self._endpoint()
        pid = os.getpid()
        before: dict = {}

        def record(step: str, parked_bytes: Optional[int]) -> dict:
            after = endpoint.park_step(step, parked_bytes, then) if then else endpoint.park_step(step, parked_bytes)
            before.update(after.get("was") or {})
            return after

        def run() -> str:
            outcome = resume_kernel(pid, record, endpoint.park_lock, self.limits, self.env)
            if outcome.ok:
                return resumed_text(outcome, before) if outcome.changed else "resumed: " + outcome.message
            return f"{kernel_message(outcome)}; until then this cell's GPU calls wait"
        self._say([self.PREFIX + self._joined(run, "the resume")])

    def resume_at_exit(self) -> None:
        """At exit, a parked kernel is brought back first: its frameworks' own frees at exit would wait
        for a restore that nobody makes. Bounded by the park's limits; never raises."""
        try:
            if not self.parked():
                return
            endpoint = self._endpoint()
            resume_kernel(os.getpid(), endpoint.park_step, endpoint.park_lock, self.limits, self.env)
        except Exception:
            pass

    @staticmethod
    def _joined(run: Callable[[], str], what: str) -> str:
        """``run()`` in a thread of its own; its sentence, or why there is none."""
        import threading

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
