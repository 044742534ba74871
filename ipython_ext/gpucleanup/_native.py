"""The only module that touches ctypes: loads libgpucleanup.so and declares its C ABI.

Every function returns plain Python objects decoded from the library's JSON
(shapes in ``share/schema``). Failures of the library itself raise
:class:`NativeError` whose message starts with the library's stable id; states
such as "no CUDA driver" are values in the returned dicts, never exceptions.
"""

from __future__ import annotations

import ctypes
import json
import math
import os
import re
import signal
import stat
import threading
import time
from importlib import resources
from typing import Any, Callable, Optional

try:  # the C module: signal.getsignal makes an enum of the handler it returns, which costs 15-20 µs a call
    import _signal as _raw_signal
except ImportError:  # pragma: no cover - CPython has it
    _raw_signal = signal

__all__ = [
    "NativeError",
    "library",
    "library_path",
    "version",
    "abi_version",
    "probe",
    "snapshot",
    "cuda_initialized",
    "drain",
    "after_cell",
    "quiet",
    "trim",
    "shutdown",
    "server_start",
    "server_stop",
    "server_set_state",
    "server_state",
    "server_park",
    "server_parked",
    "server_park_blocker",
    "server_publish",
    "server_connections",
    "set_drain_hook",
    "clear_drain_hook",
    "checkpoint_step",
    "allow_tracer",
    "hold_while_parked",
    "sigterm_cleanup",
]

ABI_VERSION = 2

# gpucleanup_status values (native/include/gpucleanup/gpucleanup.h)
OK = 0
ERR_INVALID_ARGUMENT = 1
ERR_DRIVER = 2
ERR_INTERNAL = 3
ERR_EXITING = 4
ERR_SERVER = 5
ERR_BUSY = 6  # a drain from outside (gpucleanup drain) held the library; nothing was done

_STATUS_NAMES = {
    ERR_INVALID_ARGUMENT: "invalid argument",
    ERR_DRIVER: "driver",
    ERR_INTERNAL: "internal",
    ERR_EXITING: "exiting",
    ERR_SERVER: "server",
    ERR_BUSY: "busy",
}

PROGRESS_FN = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_char_p, ctypes.c_void_p)
# gpucleanup_drain_hook_fn: (timeout_s, out, capacity, user) -> bytes written, -1 on failure
DRAIN_HOOK_FN = ctypes.CFUNCTYPE(ctypes.c_longlong, ctypes.c_double, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p)


class NativeError(RuntimeError):
    """A call into libgpucleanup failed; ``status`` is the gpucleanup_status code, ``error_id`` the message's
    ``[gpucleanup.<area>.<number>]`` id (None when it has none)."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status
        end = message.find("]")
        self.error_id = message[1:end] if message.startswith("[gpucleanup.") and end > 0 else None


_lock = threading.Lock()
_lib: Optional[ctypes.CDLL] = None
# The same library through ctypes.PyDLL: its calls keep the interpreter lock. The
# per-cell calls (probe, after_cell, trim, snapshot, the status server's state and
# records) go through it, so that IPython's history thread is not let in by a call
# of microseconds (a ctypes.CDLL call releases the lock; the thread then commits to
# SQLite before the kernel goes idle). Where such a call has to wait, the library
# gives the lock up for the wait (gpucleanup_set_gil_hooks, native/src/gil.hpp).
# GPUCLEANUP_NATIVE_GIL=release makes every call release it (for comparisons).
_held: Optional[ctypes.CDLL] = None

# gpucleanup_server_state's state codes (GPUCLEANUP_STATE_*)
STATES = {"idle": 0, "running": 1, "draining": 2, "waiting": 3}


def library_path() -> str:
    """Path of the shared library: ``$GPUCLEANUP_LIBRARY`` or the one in this package."""
    override = os.environ.get("GPUCLEANUP_LIBRARY")
    if override:
        return override
    return str(resources.files("gpucleanup").joinpath("libgpucleanup.so"))


def _refuse_special_file(path: str) -> None:
    """dlopen() of a FIFO blocks until someone writes to it, and a directory or device is no library:
    a path that is not a regular file (through links) is refused before it is opened, in one sentence
    that shows the path escaped and shortened. A name without a slash is dlopen's to look up."""
    if "/" not in path:
        return
    try:
        mode = os.stat(path).st_mode
        why = None if stat.S_ISREG(mode) else "is not a regular file"
    except OSError as exc:
        why = f"cannot be opened ({exc.strerror})"
    except ValueError as exc:
        why = f"cannot be opened ({exc})"
    if why is not None:
        where = "GPUCLEANUP_LIBRARY" if os.environ.get("GPUCLEANUP_LIBRARY") else "the package's library"
        shown = ascii(path) if len(path) <= 200 else ascii(path[:200]) + "..."
        raise NativeError(
            ERR_INTERNAL,
            f"[gpucleanup.python.103] {where} {shown} {why}: point GPUCLEANUP_LIBRARY at libgpucleanup.so, "
            "or unset it",
        )


# The C types of native/include/gpucleanup/entry_points.def as ctypes declares them.
_C_TYPES = {
    "void": None,
    "int": ctypes.c_int,
    "unsigned int": ctypes.c_uint,
    "long long": ctypes.c_longlong,
    "double": ctypes.c_double,
    "gpucleanup_status": ctypes.c_int,
    "const char*": ctypes.c_char_p,
    "char*": ctypes.c_void_p,  # a reply handed back to gpucleanup_free as the address it came as
    "char**": ctypes.POINTER(ctypes.c_void_p),
    "int*": ctypes.POINTER(ctypes.c_int),
    "void*": ctypes.c_void_p,
    "gpucleanup_progress_fn": PROGRESS_FN,
    "gpucleanup_drain_hook_fn": DRAIN_HOOK_FN,
    # addresses: the interpreter's own functions, and the caller's CFUNCTYPE cast to c_void_p
    "gpucleanup_gil_check_fn": ctypes.c_void_p,
    "gpucleanup_gil_save_fn": ctypes.c_void_p,
    "gpucleanup_gil_restore_fn": ctypes.c_void_p,
    "gpucleanup_trace_site_fn": ctypes.c_void_p,
}
_ENTRY = re.compile(r"\b(GPUCLEANUP_ENTRY(?:_ADDED)?)\(\s*([^,()]+?)\s*,\s*(\w+)\s*,\s*\(([^()]*)\)\s*\)")


def _entry_points_text(lib: Optional[ctypes.CDLL] = None) -> str:
    """The list of the library's C functions: as the loaded library itself gives it (``gpucleanup_entry_points``,
    made from entry_points.def when it was built, so it always belongs to that library); from a library without
    it, entry_points.def: the wheel's copy beside the library, else the one of the checkout the package is in."""
    own = getattr(lib, "gpucleanup_entry_points", None) if lib is not None else None
    if own is not None:
        own.argtypes, own.restype = [], ctypes.c_char_p
        text = own()
        if text:
            return text.decode("utf-8")
    shipped = resources.files("gpucleanup").joinpath("entry_points.def")
    checkout = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                            "native", "include", "gpucleanup", "entry_points.def")
    try:
        return shipped.read_text(encoding="utf-8") if shipped.is_file() else open(checkout, encoding="utf-8").read()
    except OSError as exc:
        raise NativeError(ERR_INTERNAL, f"[gpucleanup.python.104] the list of the library's C functions "
                          f"(gpucleanup/entry_points.def) cannot be read ({exc.strerror}): reinstall gpucleanup") from None


def _c_type(spelling: str) -> Any:
    spelling = re.sub(r"\s*(\*+)\s*", r"\1 ", " ".join(spelling.split())).strip()
    if spelling not in _C_TYPES:
        raise NativeError(ERR_INTERNAL, f"[gpucleanup.python.105] entry_points.def uses the C type {spelling!r}, "
                          "which gpucleanup._native cannot declare: add it to _C_TYPES")
    return _C_TYPES[spelling]


def _entry_points(lib: Optional[ctypes.CDLL] = None) -> tuple:
    """(name, restype, argtypes, added later) of every C function, read from the library's own list (or
    entry_points.def, :func:`_entry_points_text`)."""
    text = re.sub(r"/\*.*?\*/|//[^\n]*", " ", _entry_points_text(lib), flags=re.S)
    entries = []
    for macro, result, name, parameters in _ENTRY.findall(text):
        argtypes = []
        for parameter in parameters.split(","):
            parameter = re.sub(r"\s*(\*+)\s*", r"\1 ", " ".join(parameter.split())).strip()
            if parameter != "void":
                argtypes.append(_c_type(parameter.rpartition(" ")[0]))  # the type, less the parameter's name
        entries.append((name, _c_type(result), argtypes, macro == "GPUCLEANUP_ENTRY_ADDED"))
    if not entries or len(entries) != len(re.findall(r"\bGPUCLEANUP_ENTRY(?:_ADDED)?\s*\(", text)):
        raise NativeError(ERR_INTERNAL, "[gpucleanup.python.105] entry_points.def has an entry that is not "
                          "GPUCLEANUP_ENTRY(result, name, (parameters)): fix it")
    return tuple(entries)


def _declare(lib: ctypes.CDLL) -> None:
    # A function added to this ABI version later may be missing from an older build: its wrapper says so.
    for name, restype, argtypes, added in _entry_points(lib):
        fn = getattr(lib, name, None) if added else getattr(lib, name)
        if fn is not None:
            fn.argtypes = argtypes
            fn.restype = restype


def library() -> ctypes.CDLL:
    """The loaded library (loaded on first use, RTLD_LOCAL, ABI version checked)."""
    global _lib
    with _lock:
        if _lib is None:
            _refuse_special_file(library_path())
            lib = ctypes.CDLL(library_path(), mode=os.RTLD_LOCAL | os.RTLD_NOW)
            _declare(lib)
            found = lib.gpucleanup_abi_version()
            if found != ABI_VERSION:
                raise NativeError(
                    ERR_INTERNAL,
                    f"[gpucleanup.python.101] {library_path()} has ABI version {found}, "
                    f"this package needs {ABI_VERSION}: reinstall gpucleanup",
                )
            global _held
            _held = lib
            if os.environ.get("GPUCLEANUP_NATIVE_GIL", "hold") != "release":
                api = ctypes.pythonapi
                lib.gpucleanup_set_gil_hooks(*(ctypes.cast(getattr(api, name), ctypes.c_void_p).value for name in (
                    "PyGILState_Check", "PyEval_SaveThread", "PyEval_RestoreThread")))
                held = ctypes.PyDLL(library_path(), mode=os.RTLD_LOCAL | os.RTLD_NOW)
                _declare(held)
                _held = held
            _lib = lib
        return _lib


def held() -> ctypes.CDLL:
    """The library through ctypes.PyDLL (calls keep the interpreter lock), see ``_held``."""
    if _lib is None:
        library()
    return _held


def _raise(lib: ctypes.CDLL, status: int) -> None:
    message = (lib.gpucleanup_last_error() or b"").decode("utf-8", "replace")
    if not message:
        message = f"gpucleanup call failed ({_STATUS_NAMES.get(status, status)})"
    raise NativeError(status, message)


def _call_json(fn: Callable[..., int], *args: Any) -> Any:
    lib = held()  # freeing the reply takes microseconds: no reason to let another thread in
    out = ctypes.c_void_p()
    status = fn(*args, ctypes.byref(out))
    if status != OK:
        _raise(lib, status)
    try:
        text = ctypes.string_at(out.value).decode("utf-8")
    finally:
        lib.gpucleanup_free(out)
    return json.loads(text)


def version() -> str:
    return library().gpucleanup_version().decode()


def abi_version() -> int:
    return library().gpucleanup_abi_version()


def probe() -> dict:
    """Driver state and which devices are in use; no memory queries."""
    return _call_json(held().gpucleanup_probe)


def cuda_initialized() -> Optional[bool]:
    """Whether anything in this process initialised CUDA, in one driver call, no JSON.

    None when the probe would stop for another reason (no driver, unusable, exiting):
    :func:`probe` says which. Never initialises CUDA.
    """
    found = held().gpucleanup_cuda_initialized()
    return None if found < 0 else bool(found)


def file_size(path: bytes) -> int:
    """The size of the regular file at ``path`` (not following a link), in one library call that keeps the
    interpreter lock (gpucleanup_file_size): -1 when there is none or it is not a regular file. ``os.stat`` gives the
    lock up, and a waiting Python thread may then run in the middle of a cell's hooks. Without that call (an older
    build of the library) ``os.lstat`` answers. A path with a NUL byte names no file: -1."""
    if b"\0" in path:
        return -1  # C would read the path up to it
    fn = getattr(held(), "gpucleanup_file_size", None)
    if fn is not None:
        return fn(path)
    try:
        info = os.lstat(path)
    except OSError:
        return -1
    return info.st_size if stat.S_ISREG(info.st_mode) else -1


def snapshot() -> dict:
    """Full per-device snapshot (share/schema/snapshot.schema.json)."""
    return _call_json(held().gpucleanup_snapshot)


def _entry(name: str) -> Callable[..., int]:
    """A function of the library that may be missing from an older build of the same ABI version."""
    fn = getattr(held(), name, None)
    if fn is None:
        raise NativeError(
            ERR_INTERNAL,
            f"[gpucleanup.python.102] {library_path()} has no {name} (a build older than this package): "
            "reinstall gpucleanup",
        )
    return fn


def _check_timeout(timeout: Any) -> float:
    if not isinstance(timeout, (int, float)) or isinstance(timeout, bool):
        raise TypeError(f"timeout must be a number of seconds, not {type(timeout).__name__}")
    if not math.isfinite(timeout) or timeout < 0:
        raise ValueError(f"timeout must be a finite number of seconds >= 0, got {timeout!r}")
    return float(timeout)


def _waiting_call(call: Callable[[Any], dict], progress: Optional[Callable[[dict], bool]]) -> dict:
    """Runs ``call(callback)`` (a native call that may wait) with Ctrl-C turned into "stop waiting".

    Python runs a SIGINT handler at the first bytecode it executes, which in a
    ctypes callback is before any try: block could catch the KeyboardInterrupt
    (ctypes would print it and return 0). So while the native call waits, Ctrl-C
    only sets a flag that the callback turns into "stop waiting". A caller that
    installed its own handler (the extension does) keeps it. A KeyboardInterrupt
    raised inside ``progress`` also stops the wait. Either way the result gets
    ``"keyboard_interrupt": True`` and nothing is raised.
    """
    interrupted: list = []
    swap = (threading.current_thread() is threading.main_thread()
            and _raw_signal.getsignal(signal.SIGINT) is signal.default_int_handler)

    def _on_sigint(_signum: int, _frame: Any) -> None:
        interrupted.append(True)

    def _on_progress(payload: bytes, _user: Any) -> int:
        try:
            if interrupted:
                return 1
            if progress is None:
                return 0
            return 1 if progress(json.loads(payload.decode("utf-8"))) else 0
        except KeyboardInterrupt:
            interrupted.append(True)
            return 1
        except Exception:  # a faulty callback must not abort the wait
            return 0

    callback = PROGRESS_FN(_on_progress)
    if swap:
        _raw_signal.signal(signal.SIGINT, _on_sigint)
    try:
        result = call(callback)
    finally:
        if swap:
            _raw_signal.signal(signal.SIGINT, signal.default_int_handler)
    if interrupted:
        result["keyboard_interrupt"] = True
    return result


def drain(timeout: float = 30.0, progress: Optional[Callable[[dict], bool]] = None, trim: bool = True) -> dict:
    """Settle (bounded by ``timeout`` seconds) and trim the driver pools of every device in use.

    ``trim=False`` settles only (``gpucleanup_settle``): the pools are reported, not trimmed.

    ``progress``, if given, is called with ``{"device", "waited_s", "limit_s"}`` about once
    a second once a wait passes 2 s; returning True abandons the remaining waits. A
    ``KeyboardInterrupt`` raised while the callback runs also abandons them; it is not
    re-raised (a drain never stops the kernel) but recorded as
    ``result["keyboard_interrupt"] = True``.
    """
    seconds = _check_timeout(timeout)
    lib = library()
    fn = lib.gpucleanup_drain if trim else lib.gpucleanup_settle
    return _waiting_call(lambda callback: _call_json(fn, seconds, callback, None), progress)


def after_cell(timeout: float = 30.0, progress: Optional[Callable[[dict], bool]] = None, trim: bool = True) -> dict:
    """The whole after-cell pass in one native call (share/schema/after_cell.schema.json, kind after_cell).

    Probe; settle every device in use (bounded by ``timeout`` seconds in total, on the
    device's long-lived watchdog thread); trim the driver's pools (``trim=False``: report
    them only); and per device the memory afterwards (``total_bytes``, ``used_bytes``,
    ``free_bytes``) next to what a drain reports (``state``, ``settle``,
    ``free_before_bytes``, ``released_bytes``, ``pools``, ``error``, ``message``). CUDA not
    initialised or no device in use: ``devices`` is empty, nothing but the probe was done.

    ``progress`` and Ctrl-C behave as in :func:`drain`: the wait stops, nothing is raised,
    ``result["keyboard_interrupt"]`` is True.
    """
    seconds = _check_timeout(timeout)
    fn = _entry("gpucleanup_after_cell")
    return _waiting_call(lambda callback: _call_json(fn, seconds, 1 if trim else 0, callback, None), progress)


def quiet() -> bool:
    """Whether the after-cell pass would find nothing to do now (gpucleanup_quiet): the same devices in use as
    the last :func:`after_cell` left, each through its primary context with nothing queued, no driver pool
    reserving memory and the same free memory. False when anything differs or cannot be told. The probe, one
    event and one cuMemGetInfo per device; no wait, no JSON, never cuInit."""
    fn = _entry("gpucleanup_quiet")
    out = ctypes.c_int(0)
    status = fn(ctypes.byref(out))
    if status != OK:
        _raise(held(), status)
    return out.value == 1


def trim() -> dict:
    """Trim the driver's pools of every device in use now, without waiting (kind trim).

    For the second trim after the frameworks gave memory back to the driver's pools:
    per device ``released_bytes``, ``pools`` and the memory afterwards. A device still
    busy from an earlier wait is reported busy and not trimmed.
    """
    return _call_json(_entry("gpucleanup_trim"))


def checkpoint_step(pid: int, step: str, lock_timeout_ms: int = 0) -> dict:
    """One step of parking process ``pid`` ("state", "lock", "checkpoint", "restore", "unlock").

    For the park helper process only (``python -m gpucleanup.park.native_step``): it calls cuInit
    in *this* process, which a kernel must never do. A step the driver refuses is a value
    (``"ok": False``, ``"result"``, ``"state"``); a driver without checkpoint calls, a pid
    that is not another process or a failed cuInit raise :class:`NativeError`.
    """
    _entry("gpucleanup_checkpoint_step")
    fn = library().gpucleanup_checkpoint_step  # may wait for the driver: let other threads run
    return _call_json(fn, int(pid), step.encode(), int(lock_timeout_ms))


def hold_while_parked(pid: int, tids: list, limit_ms: int, report_fd: int) -> dict:
    """Holds threads ``tids`` of process ``pid`` (ptrace) until a release (SIGUSR1, SIGTERM, SIGINT, SIGHUP for this
    process) or their end; writes the hold's report as one JSON line on ``report_fd`` once they are stopped and
    returns the last one (``"ended"``: why the hold ended). Blocks all that time: for the park's hold helper only
    (:mod:`gpucleanup.park.parked_hold`). No driver call."""
    fn = _entry("gpucleanup_hold_while_parked")  # blocks for as long as the kernel stays parked: the GIL is let go
    return _call_json(fn, int(pid), json.dumps([int(t) for t in tids]).encode(), int(limit_ms), int(report_fd))


def allow_tracer(pid: int) -> Optional[int]:
    """Names process ``pid`` as the one allowed to hold this process's threads during a restore (prctl
    PR_SET_PTRACER, for Yama's ptrace_scope 1; 0 takes it back). No driver call. Returns 0 when done, else
    the errno (EINVAL where Yama is absent and none is needed); None where this build of the library lacks it."""
    lib = library()
    fn = getattr(lib, "gpucleanup_allow_tracer", None)
    if fn is None:
        return None
    out = ctypes.c_int(0)
    status = fn(int(pid), ctypes.byref(out))
    if status != OK:
        _raise(lib, status)
    return out.value


def shutdown() -> None:
    """Stop the status server and refuse every later driver call (process exit)."""
    if _lib is not None:
        _lib.gpucleanup_shutdown()


def server_start(config: dict) -> dict:
    return _call_json(library().gpucleanup_server_start, json.dumps(config).encode())


def _call_status(fn: Callable[..., int], *args: Any) -> None:
    status = fn(*args)
    if status != OK:
        _raise(library(), status)


def sigterm_cleanup(paths: Optional[dict]) -> bool:
    """Have a SIGTERM remove ``paths`` ({"files": [...], "dirs": [...]}) before the process ends; None forgets them.

    False where this build of the library lacks the call, or where SIGTERM already has a handler (someone
    else's, left as it is); raises GPUCleanupError for bad paths.
    """
    lib = library()
    fn = getattr(lib, "gpucleanup_sigterm_cleanup", None)
    if fn is None:
        return False
    status = fn(None if paths is None else json.dumps(paths).encode())
    if status == ERR_BUSY:
        return False
    if status != OK:
        _raise(lib, status)
    return True


def server_stop() -> None:
    _call_status(library().gpucleanup_server_stop)


def server_connections() -> dict:
    """The status server's connection counters (peers, refused, dropped when idle)."""
    return _call_json(library().gpucleanup_server_connections)


def server_set_state(state: dict) -> None:
    _call_status(held().gpucleanup_server_set_state, json.dumps(state).encode())


def server_state(state: str, cell: Optional[int] = None, since_ns: Optional[int] = None,
                 device: Optional[int] = None) -> None:
    """The kernel's state for the status server, without JSON (gpucleanup_server_state).

    ``state`` is one of STATES; ``since_ns`` defaults to now (``time.time_ns()``).
    """
    code = STATES.get(state)
    if code is None:
        raise ValueError(f"state must be one of {', '.join(STATES)}, got {state!r}")
    _call_status(held().gpucleanup_server_state, code, -1 if cell is None else int(cell),
                 time.time_ns() if since_ns is None else int(since_ns), -1 if device is None else int(device))


def server_park(step: str, parked_bytes: Optional[int] = None, then: Optional[dict] = None) -> dict:
    """One park step in the status server's state (gpucleanup_server_park): ``begin``, ``parked``,
    ``failed`` or ``resumed`` (``then``: the state it goes to instead of idle); returns the state after
    it. A step the state does not allow raises NativeError (gpucleanup.server.509) and changes nothing."""
    fn = getattr(held(), "gpucleanup_server_park", None)
    if fn is None:
        raise NativeError(ERR_INTERNAL, "[gpucleanup.api.134] this build of the native library cannot park: "
                              "reinstall gpucleanup")
    return _call_json(fn, step.encode(), -1 if parked_bytes is None else int(parked_bytes),
                      None if then is None else json.dumps(then).encode())


def server_cell(running: bool, cell: Optional[int] = None) -> int:
    """A cell's own state, said twice per cell, in one call (gpucleanup_server_cell): "running" with ``cell``
    as it starts (``running``), "idle" as its hooks end; since now. Returns the park state after it, as
    :func:`server_parked` does (0, 1 parking, 2 parked: a park in place keeps its state). Raises NativeError
    when the server is not running."""
    fn = getattr(held(), "gpucleanup_server_cell", None)
    if fn is None:  # a build older than the call: the two it stands for
        server_state("running" if running else "idle", cell if running else None)
        return server_parked()
    parked = fn(1 if running else 0, -1 if cell is None else int(cell))
    if parked < 0:
        _raise(held(), ERR_SERVER)
    return parked


def server_park_blocker(why: Optional[str]) -> bool:
    """Why no automatic park may begin now (None or "": it may), kept by the status server
    (gpucleanup_server_park_blocker); False with a library older than the call. Raises NativeError
    when the server is not running."""
    fn = getattr(held(), "gpucleanup_server_park_blocker", None)
    if fn is None:
        return False
    if fn(why.encode("utf-8", "replace") if why else None) < 0:
        _raise(held(), ERR_SERVER)
    return True


def server_background(begin: bool, activity: bool = False) -> int:
    """The kernel's own work on a thread of its own (a release once idle) begins or ends
    (gpucleanup_server_background): begin answers 0 when it may run (counted: a park asked for before it
    ends is refused), or the park state (1 parking, 2 parked) when it must wait for the resume; end
    answers 0; an end with ``activity`` (a request that ran the user's code) also starts an idle kernel's idle
    time again. A library older than the call coordinates nothing: begin answers :func:`server_parked`.
    Raises NativeError when the server is not running."""
    fn = getattr(held(), "gpucleanup_server_background", None)
    if fn is None:
        return server_parked() if begin else 0
    answer = fn(1 if begin else 2 if activity else 0)
    if answer < 0:
        _raise(held(), ERR_SERVER)
    return answer


def server_parked() -> int:
    """0: not parked (or no server), 1: parking, 2: parked (gpucleanup_server_parked); no driver call."""
    fn = getattr(held(), "gpucleanup_server_parked", None)
    return 0 if fn is None else int(fn())


# What the drain hook runs (set_drain_hook); the one C thunk below calls it, and stays alive with this
# module, so that a drain already under way when the hook is changed or removed never calls freed code.
_drain_target: Optional[Callable[[float], dict]] = None


def _on_drain(timeout_s: float, out: Optional[int], capacity: int, _user: Any) -> int:
    try:
        target = _drain_target
        if target is None:
            part: dict = {"ran": False, "skipped": "gpucleanup is not loaded in this kernel", "error": None}
        else:
            part = target(float(timeout_s))
        data = json.dumps(part, default=repr, separators=(",", ":")).encode("utf-8", "replace")
    except BaseException as exc:  # on the server's thread: nothing may escape into C
        data = json.dumps({"ran": False, "skipped": None, "error": f"{type(exc).__name__}: {exc}"},
                          default=repr).encode("utf-8", "replace")
    if len(data) > capacity:
        data = json.dumps({"ran": False, "skipped": None,
                           "error": f"the kernel's cleanup said more than {capacity} bytes"}).encode()
    ctypes.memmove(out, data, len(data))
    return len(data)


_DRAIN_THUNK = DRAIN_HOOK_FN(_on_drain)


def set_drain_hook(target: Optional[Callable[[float], dict]]) -> bool:
    """The kernel's part of a drain asked for through the status server (gpucleanup_set_drain_hook).

    ``target(wait_s)`` runs on the server's drain thread after the library's drain, ``wait_s`` being how long
    the reply may still wait for it, and returns a JSON-able dict, the drain result's ``kernel``
    (share/schema/drain.schema.json); None removes it.
    False where this build of the library has no such hook.
    """
    global _drain_target
    fn = getattr(library(), "gpucleanup_set_drain_hook", None)
    if fn is None:
        return False
    _drain_target = target
    fn(_DRAIN_THUNK if target is not None else DRAIN_HOOK_FN(), None)
    return True


def clear_drain_hook(target: Callable[[float], dict]) -> None:
    """Removes the drain hook if it is still ``target`` (another shell of the process may have set its own since)."""
    if _drain_target is target:
        set_drain_hook(None)


def server_publish(record: dict) -> None:
    _call_status(held().gpucleanup_server_publish, json.dumps(record, separators=(",", ":")).encode())


def trace_start(candidates: list, site: Any = None) -> dict:
    """Start tracing raw allocations through CUPTI (gpucleanup_trace_start).

    ``candidates``: the paths of libcupti to try, in order; ``site``: a
    ``ctypes.CFUNCTYPE(c_longlong)`` the library calls on an allocating thread that holds
    the interpreter lock (keep it alive while tracing). The reply says whether it is
    ``active`` and, when not, the ``error`` in words. Never initialises CUDA.
    """
    text = json.dumps([str(c) for c in candidates]).encode()
    pointer = None if site is None else ctypes.cast(site, ctypes.c_void_p)
    return _call_json(_entry("gpucleanup_trace_start"), text, pointer)


def trace_stop() -> dict:
    return _call_json(_entry("gpucleanup_trace_stop"))


def trace_set_cell(cell: int) -> None:
    _entry("gpucleanup_trace_set_cell")(int(cell))


def trace_report(cell: int = -1) -> dict:
    """The live traced allocations, grouped (cell >= 0: those made during that cell)."""
    return _call_json(_entry("gpucleanup_trace_report"), int(cell))

