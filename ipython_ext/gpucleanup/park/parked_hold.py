"""The hold while parked: a JAX kernel's own native threads kept stopped from just after its lock until after its unlock.

XLA's threads poll their streams on their own; one that calls the driver while the process is checkpointed makes the
driver fault in it and the kernel dies (share/FACTS.md §11). CRIU keeps every thread of a process stopped through its
checkpoint; a kernel must still take the cell that resumes it, so the kernel lists the threads to stop
(:func:`threads_to_hold`: every thread but its Python threads, ZeroMQ's and gpucleanup's own, and the driver's restore
thread), and a helper process (:func:`start`) holds them with ptrace until :func:`release` after the unlock.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import Dict, Iterable, List, Optional, Union

#: Native threads a kernel needs to take its next cell and answer requests while parked: ZeroMQ's I/O threads
#: (libzmq names them ``ZMQbg/...``) and gpucleanup's own (its status server and jobs, named in the library).
KERNEL_NATIVE_THREADS = ("ZMQbg/", "gpucleanup")

#: The helpers still running that this process started: kept so that each is reaped once it ends.
_started: List[subprocess.Popen] = []
_started_lock = threading.Lock()


def _comm(tid: int, proc: str, pid: int) -> str:
    try:
        with open(f"{proc}/{pid}/task/{tid}/comm", encoding="utf-8", errors="replace") as fh:
            return fh.read().strip()
    except OSError:
        return ""


def threads_to_hold(restore_thread: Optional[int], python_threads: Optional[Iterable[int]] = None,
                    proc: str = "/proc", pid: Optional[int] = None) -> List[int]:
    """In the kernel: the ids of its threads to hold while parked, sorted: every thread of this process but its
    Python threads (``python_threads``; default: :func:`threading.enumerate`'s), those named in
    :data:`KERNEL_NATIVE_THREADS` and the driver's ``restore_thread``."""
    pid = os.getpid() if pid is None else pid
    if python_threads is None:
        python_threads = [t.native_id for t in threading.enumerate()]
    spare = {int(t) for t in python_threads if t}
    if restore_thread:
        spare.add(int(restore_thread))
    try:
        tids = sorted(int(name) for name in os.listdir(f"{proc}/{pid}/task") if name.isdigit())
    except OSError:
        return []
    return [t for t in tids if t not in spare and not _comm(t, proc, pid).startswith(KERNEL_NATIVE_THREADS)]


def listed_path(lock_file: os.PathLike) -> str:
    """Where a kernel lists its threads to hold for a park from outside: beside its park lock, private as it is."""
    return os.fspath(lock_file) + "-threads"


def thread_start(pid: int, tid: int, proc: str = "/proc") -> Optional[int]:
    """When thread ``tid`` of ``pid`` started (field 22 of its ``stat``, clock ticks): with the id, names one thread."""
    try:
        with open(f"{proc}/{int(pid)}/task/{int(tid)}/stat", "rb") as fh:
            return int(fh.read().rpartition(b")")[2].split()[19])
    except (OSError, ValueError, IndexError):
        return None


class ThreadList:
    """In a kernel running JAX: keeps :func:`listed_path` up to date, so that a park from outside (the CLI, the page,
    the server's automatic park) holds the same threads as the kernel's own. Looked at as each cell ends: a dict
    lookup where JAX is not imported, one listing of the process's thread ids and one ``stat`` where it is; written
    when those ids changed (JAX starts its threads in cells) or the file is gone."""

    def __init__(self) -> None:
        self._tids: Optional[List[str]] = None
        self._path: Optional[str] = None

    def seen(self, lock_file: Optional[os.PathLike]) -> None:
        if "jaxlib" not in sys.modules or lock_file is None:
            return
        try:
            tids = os.listdir("/proc/self/task")  # the ids, not their count: one ending as another starts
        except OSError:
            return
        path = listed_path(lock_file)
        if tids == self._tids and path == self._path and os.path.exists(path):
            return
        pid = os.getpid()
        held = threads_to_hold(None)
        # every other thread is listed too, as spared: a thread in neither list started since (park.654 then)
        holding = set(held)
        spared = sorted(int(t) for t in tids if t.isdigit() and int(t) not in holding)
        text = json.dumps({"pid": pid, "threads": _with_starts(pid, held), "spared": _with_starts(pid, spared)})
        part = None
        try:
            fd, part = tempfile.mkstemp(prefix=os.path.basename(path) + ".", suffix=".part",
                                        dir=os.path.dirname(path) or ".")  # O_EXCL, 0600, a name of its own
            with os.fdopen(fd, "w") as fh:
                fh.write(text)
            os.replace(part, path)
        except OSError:
            if part is not None:
                with contextlib.suppress(OSError):
                    os.unlink(part)
            return  # looked at again at the next cell; a park from outside refuses meanwhile (park.654)
        if self._path is not None and self._path != path:  # the park lock moved (a restarted endpoint)
            with contextlib.suppress(OSError):
                os.unlink(self._path)
        self._tids, self._path = tids, path

    def close(self) -> None:
        if self._path is not None:
            try:
                os.unlink(self._path)
            except OSError:
                pass
            self._path = self._tids = None


def _with_starts(pid: int, tids: Iterable[int]) -> List[List[int]]:
    """``[[tid, start], ...]`` of the threads still there: with its start time an id names one thread."""
    out = []
    for tid in tids:
        start = thread_start(pid, tid)
        if start is not None:
            out.append([int(tid), start])
    return out


def listed_threads(lock_file: os.PathLike, pid: int, restore_thread: Optional[int], owner: Optional[int],
                   proc: str = "/proc") -> Union[List[int], str, None]:
    """Outside the kernel: the threads kernel ``pid`` listed to hold (:class:`ThreadList`), each still the same
    thread (its start time), the driver's ``restore_thread`` left out; None when the kernel listed none (a file of
    ``owner``'s only, read as the lock's note is); a sentence when a thread of the process is in neither of its lists
    (it started since the last cell ended: nothing says whether it calls the driver)."""
    from ..protocol import discovery

    try:
        data, _ = discovery.read_bounded(listed_path(lock_file), owners={owner} if owner is not None else None)
        note = json.loads(data.decode("utf-8")) if data else {}
    except (OSError, ValueError):
        return None
    threads = note.get("threads") if isinstance(note, dict) else None
    spared = note.get("spared") if isinstance(note, dict) else None
    if not isinstance(threads, list) or not isinstance(spared, list) or note.get("pid") != pid:
        return None
    out: List[int] = []
    known = {restore_thread} if restore_thread else set()
    for entries, into in ((threads, out), (spared, None)):
        for entry in entries:
            if (isinstance(entry, list) and len(entry) == 2 and all(type(v) is int for v in entry)
                    and thread_start(pid, entry[0], proc) == entry[1]):
                known.add(entry[0])
                if into is not None and entry[0] != restore_thread:
                    into.append(entry[0])
    try:
        now = {int(name) for name in os.listdir(f"{proc}/{int(pid)}/task") if name.isdigit()}
    except OSError:
        return None
    new = sorted(now - known)
    if new:
        return (f"{len(new)} thread{'s' if len(new) > 1 else ''} started since its last cell ended "
                f"({', '.join(map(str, new[:4]))}{', ...' if len(new) > 4 else ''}), which the kernel has not listed: "
                "run a cell")
    return out


def start(pid: int, command: List[str], limit_ms: int, env: Dict[str, str], cwd: str, allow=None) -> dict:
    """Starts the helper that holds threads of process ``pid`` (``command``: the park's helper command for step
    ``hold``, made by :func:`gpucleanup.park.steps.helper_command`) and waits at most ``limit_ms`` (plus 5 s for its start)
    for its report: ``{"held": bool, "threads": n, "holder": its pid, ...}``, or ``{"held": False, "why": ...}``
    when it gave none (it is then stopped). ``allow`` is called with the helper's pid as it starts (the kernel names
    it as its tracer). The helper outlives this call, and this process; anything that goes wrong here (Ctrl-C
    included) stops it before this raises, which lets every thread it held go."""
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL,
                            env=env, cwd=cwd, start_new_session=True)
    kept = False
    try:
        if allow is not None:
            try:
                allow(proc.pid)
            except Exception:
                pass  # the hold then says why it could not
        line = _first_line(proc, time.monotonic() + limit_ms / 1000 + 5.0)  # the helper's start included
        try:
            report = json.loads(line.decode("utf-8", "replace").strip().splitlines()[0])
            if not isinstance(report, dict):
                raise ValueError("not an object")
        except (ValueError, IndexError):
            return {"held": False, "threads": 0, "why": "the hold's helper gave no answer in time"}
        if report.get("threads") and report.get("held"):
            report["start"] = _start_time(proc.pid)
            reap()
            with _started_lock:
                _started.append(proc)
            kept = True
        return report
    finally:
        with contextlib.suppress(Exception):
            proc.stdout.close()
        if not kept:  # what it holds, if anything, goes with it (the kernel detaches the tracees of a dead tracer)
            with contextlib.suppress(Exception):
                proc.kill()
            with contextlib.suppress(Exception):
                proc.wait(timeout=5)


def reap() -> None:
    """Reaps the hold helpers this process started that have ended (a resume from outside ends them): looked at as
    each cell of a JAX kernel ends, so that none stays a zombie of the kernel."""
    if _started:
        with _started_lock:
            _started[:] = [p for p in _started if p.poll() is None]


def _first_line(proc: subprocess.Popen, deadline: float) -> bytes:
    """What the helper wrote on its stdout up to its first newline, or up to ``deadline`` (poll: any fd number)."""
    poller = select.poll()
    poller.register(proc.stdout.fileno(), select.POLLIN | select.POLLHUP)
    line = b""
    while not line.endswith(b"\n"):
        left = deadline - time.monotonic()
        if left <= 0 or not poller.poll(max(1, int(left * 1000))):
            break
        chunk = os.read(proc.stdout.fileno(), 65536)
        if not chunk:
            break
        line += chunk
    return line


def _start_time(pid: int) -> Optional[int]:
    """Field 22 of ``/proc/PID/stat`` (when the process started, in clock ticks): with the pid, names one process;
    None when it is gone or has ended (a zombie its parent has not reaped yet: the server that parked the kernel)."""
    try:
        with open(f"/proc/{int(pid)}/stat", "rb") as fh:
            fields = fh.read().rpartition(b")")[2].split()
        return None if fields[0] == b"Z" else int(fields[19])
    except (OSError, ValueError, IndexError):
        return None


def _is_holder(holder: dict, pid: int) -> bool:
    """Whether ``holder`` (a report kept by the park) still names the helper holding process ``pid``: the same pid
    and start time, this user's, its command the hold of ``pid``; never signal a process that took its pid."""
    hid = holder.get("holder")
    if not isinstance(hid, int) or hid <= 0 or _start_time(hid) != holder.get("start"):
        return False
    try:
        if os.stat(f"/proc/{hid}").st_uid != os.getuid():
            return False
        with open(f"/proc/{hid}/cmdline", "rb") as fh:
            args = fh.read().split(b"\0")
    except OSError:
        return False
    return b"hold" in args and str(int(pid)).encode() in args


def find(pid: int, proc: str = "/proc") -> Optional[dict]:
    """The hold of process ``pid`` whatever made it and wherever its report went: the tracer of its threads
    (``TracerPid``) that is a hold helper of ``pid`` (:func:`_is_holder`), as a report :func:`release` takes; None
    when no thread of it is so held. For a resume that was not given the park's report (the bare
    ``python -m gpucleanup.park resume PID``): the threads it holds must still go after the unlock."""
    tracers: Dict[int, int] = {}
    try:
        tids = [name for name in os.listdir(f"{proc}/{int(pid)}/task") if name.isdigit()]
    except OSError:
        return None
    for tid in tids:
        try:
            with open(f"{proc}/{int(pid)}/task/{tid}/status", encoding="ascii", errors="replace") as fh:
                tracer = next((int(line.split()[1]) for line in fh if line.startswith("TracerPid:")), 0)
        except (OSError, ValueError, IndexError):
            continue
        if tracer > 0:
            tracers[tracer] = tracers.get(tracer, 0) + 1
    for tracer, count in tracers.items():
        report = {"held": True, "threads": count, "holder": tracer, "start": _start_time(tracer)}
        if report["start"] is not None and _is_holder(report, pid):
            return report
    return None


def release(holder: Optional[dict], pid: int, wait_s: float = 2.0) -> Optional[str]:
    """Ends the hold after the unlock: SIGUSR1 to its helper, then waits at most ``wait_s`` for it to end (it lets
    the threads go first), then SIGKILL. The signals go through a pidfd taken before the helper is recognised, so
    they reach that very process or none. Returns None when it ended (or there was none), else a sentence."""
    if not holder or not holder.get("threads"):
        return None
    hid = holder.get("holder")
    if not isinstance(hid, int) or hid <= 0:
        return None
    try:
        pidfd: Optional[int] = os.pidfd_open(hid)
    except AttributeError:
        pidfd = None  # no pidfd here: the checks below, then the pid
    except OSError:
        return None  # gone already: its threads went with it
    try:
        if not _is_holder(holder, pid):
            return None  # it ended already, or its pid is another process's now
        try:
            _signal(hid, pidfd, signal.SIGUSR1)
        except OSError as exc:
            return f"the hold's helper {hid} could not be told to end ({exc.strerror})"
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            with _started_lock:
                for proc in _started:
                    if proc.pid == hid:
                        proc.poll()
            if _start_time(hid) != holder.get("start"):
                return None
            time.sleep(0.01)
        # still there: it is ended, which lets its threads go all the same (the kernel detaches a dead tracer's)
        if pidfd is None and not _is_holder(holder, pid):
            return None
        with contextlib.suppress(OSError):
            _signal(hid, pidfd, signal.SIGKILL)
        return f"the hold's helper {hid} did not end within {wait_s:g} s and was killed"
    finally:
        if pidfd is not None:
            os.close(pidfd)


def _signal(pid: int, pidfd: Optional[int], signum: int) -> None:
    if pidfd is not None:
        signal.pidfd_send_signal(pidfd, signum)
    else:
        os.kill(pid, signum)


def serve(pid: int, limit_ms: int, tids: List[int]) -> int:
    """The helper's side (``python -m gpucleanup.park.native_step hold PID LIMIT_MS TIDS``): holds, reports, waits
    for the release. Prints its last report on stderr for a person who runs it by hand."""
    from .. import _native

    try:
        result = _native.hold_while_parked(pid, tids, limit_ms, sys.stdout.fileno())
    except _native.NativeError as exc:
        print(json.dumps({"held": False, "threads": 0, "why": str(exc)}), flush=True)
        return 1
    print(json.dumps(result), file=sys.stderr, flush=True)
    return 0
