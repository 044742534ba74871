"""The fault matrix's machinery: what the library calls, how one case runs, and the summary line.

``tests/python/test_fault_matrix.py`` injects every error of :data:`ERRORS` (and a hang) into every
driver entry point the native library calls, and makes every call the after-cell engine makes into
a framework adapter raise; each case runs cells through the extension in an ``InteractiveShell``.

- :func:`resolved_entry_points` / :func:`called_entry_points`: the entry points of
  ``native/src/detail/entry_points.inc``, and those with a call site in ``native/src`` (the matrix's
  rows, so that an entry point added to the library is in the matrix without anyone listing it).
- :func:`run_case`: one case in a shell: load the extension, inject, a cell that prints and returns a
  value, a cell that raises, clear the injection, a cell that must work; what each cell printed,
  returned and raised, the driver calls it made, and the threads, file descriptors and sockets of
  the process before the case and after it.
- Run as a script (``python fault_matrix.py '<case as JSON>'``), it runs one case in a fresh process
  (for what the library does once per process: reading the driver's version, remembering a device by
  its index) and prints what it observed as JSON on a line of its own.
- As a pytest plugin (``pytest_plugins = ["fault_matrix"]`` in the test module) it prints the
  matrix's size and result at the end of the run, whatever the verbosity. (PYTEST_DONT_REWRITE: the
  test module imports it before pytest registers it as a plugin; it asserts nothing itself.)
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import sys
import threading
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional
from support import GiB  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
NATIVE_SRC = ROOT / "native" / "src"
ENTRY_POINTS_INC = NATIVE_SRC / "detail" / "entry_points.inc"


#: The errors of the matrix, as cuda.h numbers them (test_fault_matrix checks them against cuda.h).
ERRORS = (
    ("CUDA_ERROR_NOT_INITIALIZED", 3),
    ("CUDA_ERROR_DEINITIALIZED", 4),
    ("CUDA_ERROR_INVALID_CONTEXT", 201),
    ("CUDA_ERROR_INVALID_VALUE", 1),
    ("CUDA_ERROR_ILLEGAL_ADDRESS", 700),
    ("CUDA_ERROR_LAUNCH_TIMEOUT", 702),
    ("CUDA_ERROR_OUT_OF_MEMORY", 2),
    ("CUDA_ERROR_UNKNOWN", 999),
)

#: The one device of every case. Its UUID is this module's own: the library keeps what it learnt of
#: a device (its name, its watchdog thread, a sticky error) per UUID for the process's life.
DEVICE_NAME = "Fake H100"
STABLE_UUID = "GPU-fa017000-0000-4000-8000-000000000000"
FREE_BYTES = 78 * GiB  # of 80 GiB: 2 GiB used, 1 GiB of it reserved by the driver's default pool

RESULT_MARK = "fault-matrix-observation: "


# ------------------------------------------------------------------ what the library calls


def resolved_entry_points() -> List[str]:
    """The entry points the library resolves, in the order of entry_points.inc."""
    text = ENTRY_POINTS_INC.read_text()
    return re.findall(r"^GPUCLEANUP_(?:REQUIRED|OPTIONAL)\((\w+),", text, re.M)


# A call through the table: api.cuX(, api().cuX(, d->api.cuX(, loaded_->api.cuX( ...
_CALL_SITE = re.compile(r"\bapi(?:\(\))?\.(cu\w+)\s*\(")


def call_sites() -> Dict[str, List[str]]:
    """Entry point -> the files of native/src that call it."""
    found: Dict[str, List[str]] = defaultdict(list)
    for path in sorted(NATIVE_SRC.rglob("*")):
        if path.suffix in (".cpp", ".hpp", ".h", ".inc") and path.is_file():
            for name in sorted(set(_CALL_SITE.findall(path.read_text()))):
                found[name].append(str(path.relative_to(ROOT)))
    return dict(found)


#: The park helper's step, run in a process of its own (never in a kernel, never in a cell).
PARK_HELPER_SOURCE = "native/src/checkpoint.cpp"


def called_entry_points() -> List[str]:
    """The resolved entry points the library calls somewhere in a kernel (the matrix's rows)."""
    sites = call_sites()
    return [name for name in resolved_entry_points() if name in sites and sites[name] != [PARK_HELPER_SOURCE]]


def park_helper_entry_points() -> List[str]:
    """The entry points only the park helper calls (the checkpoint calls): no cell can meet their faults."""
    sites = call_sites()
    return [name for name in resolved_entry_points() if sites.get(name) == [PARK_HELPER_SOURCE]]


def uuid_for(key: str) -> str:
    """A UUID of its own for one case (a device the library has not seen), the same on every run."""
    import zlib

    return f"GPU-fa017000-0000-4000-8001-{zlib.crc32(key.encode()):012x}"


def scenario(uuid: str = STABLE_UUID, errors: Optional[dict] = None, pool: int = GiB) -> dict:
    """One device in use (its primary context active and current to this thread), ``pool`` bytes (1 GiB)
    reserved by its driver pool, nothing queued."""
    out: Dict[str, Any] = {
        "devices": [{"name": DEVICE_NAME, "uuid": uuid, "primary_active": True, "free_bytes": FREE_BYTES,
                     "default_pool": {"reserved_bytes": pool, "used_bytes": 0}}],
        "current_context": {"device": 0, "primary": True},
    }
    if errors:
        out["errors"] = dict(errors)
    return out


#: Puts back what a cleanup trimmed, so that the next cell has 1 GiB to free again.
REFILL = {"devices": [{"free_bytes": FREE_BYTES, "default_pool": {"reserved_bytes": GiB}}]}


# ------------------------------------------------------------------ the process's resources


def resources(ignore: tuple = ()) -> dict:
    """The process's Python threads, native threads, open file descriptors and sockets.

    ``ignore``: path prefixes of descriptors that are not the extension's (IPython's history
    database, which its own thread opens and closes as it saves)."""
    fds = {}
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue  # the descriptor of the listing itself, closed since
        if not any(target.startswith(prefix) for prefix in ignore):
            fds[fd] = target
    return {
        "python_threads": sorted(f"{t.name}#{t.ident}" for t in threading.enumerate()),
        "native_threads": sorted(int(tid) for tid in os.listdir("/proc/self/task")),
        "fds": sorted(f"{fd}->{target}" for fd, target in fds.items()),
        "sockets": sum(1 for target in fds.values() if target.startswith("socket:")),
    }


def wait_until(condition: Callable[[], bool], timeout: float = 10.0) -> bool:
    """Polls ``condition`` until it holds or ``timeout`` seconds have passed; True if it held."""
    deadline = time.monotonic() + timeout
    while True:
        if condition():
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.005)


# ------------------------------------------------------------------ one case


def _jsonable(value: Any) -> Any:
    try:
        json.dumps(value)
        return value
    except (TypeError, ValueError):
        return repr(value)


_MISSING = "<missing>"


def _counters(fake) -> dict:
    return dict(fake.state()["counters"])


def run_cell(ip, fake, code: str) -> dict:
    """Runs one cell as a frontend does; what it printed, returned and raised, and the driver calls made."""
    from gpucleanup.in_kernel import extension

    before = _counters(fake)
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        result = ip.run_cell(code, store_history=True)
        ext = extension.get_extension(ip)
        job = ext.engine.releases.pinned_job if ext is not None else None
        if job is not None:
            job.done.wait(10)  # a background pinned release of this cell: done before the next cell
    after = _counters(fake)
    error = result.error_in_exec
    n = result.execution_count
    record = None
    if ext is not None and ext.history.last(1):
        last = ext.history.last(1)[-1]
        if last.get("cell") == n:
            record = {"devices": [{k: d.get(k) for k in ("index", "state", "quiet", "message")}
                                  for d in last.get("devices") or []],
                      "interrupted": last.get("interrupted"), "notes": list(last.get("notes") or [])}
    return {
        "code": code,
        "stdout": out.getvalue(),
        "stderr": err.getvalue(),
        "count": n,
        "result": _jsonable(result.result),
        "out_entry": _jsonable(ip.user_ns.get("Out", {}).get(n, _MISSING)),
        "underscore": _jsonable(ip.user_ns.get("_", _MISSING)),
        "error": None if error is None else [type(error).__name__, [str(a) for a in error.args]],
        "error_before_exec": None if result.error_before_exec is None else repr(result.error_before_exec),
        "last_value_is_the_error": error is not None and getattr(sys, "last_value", None) is error,
        "calls": {k[len("calls."):]: after[k] - before.get(k, 0)
                  for k in after if k.startswith("calls.") and after[k] != before.get(k, 0)},
        "record": record,
    }


def run_case(ip, fake, case: dict, clear: Optional[Callable[[], None]] = None,
             after_c: Optional[Callable[[Any], Any]] = None, settled: bool = True) -> dict:
    """One case of the matrix in the shell ``ip`` against the fake driver ``fake``.

    ``case``: ``errors`` ({entry point: CUresult}) injected ``at`` "start" (before the extension
    loads: the library may read it at load) or "cells" (after the load, before cell A);
    ``uuid``; ``pool`` (what the driver pool reserves before cells A and B, 1 GiB; before cell C always 1 GiB);
    ``settle`` (the settle_timeout trait); ``hang`` (cuCtxSynchronize hangs from cell A on,
    released before cell C); ``code_a`` (cell A, default: print and return 42).
    ``clear``: called with the driver's errors removed, before cell C (an adapter's fault goes away).
    ``after_c``: called with the extension after cell C; its result is kept as ``after_c``.
    ``settled``: wait (bounded) for the process's threads and descriptors to be as before the case;
    False for a warm-up, which leaves what is meant to last (the device's watchdog thread).
    """
    from gpucleanup.in_kernel import extension

    errors = dict(case.get("errors") or {})
    at = case.get("at", "cells")
    # IPython's history database (and its directory, which SQLite opens to sync a journal's removal)
    # is opened and closed by IPython's own thread as it saves the cells.
    history_file = str(getattr(getattr(ip, "history_manager", None), "hist_file", "") or "")
    ignore = (os.path.dirname(history_file),) if history_file and history_file != ":memory:" else ()

    fake.reset(scenario(case.get("uuid", STABLE_UUID), errors if at == "start" else None, case.get("pool", GiB)))
    before = resources(ignore)
    loaded = io.StringIO()
    with contextlib.redirect_stdout(loaded):
        ip.run_line_magic("load_ext", "gpucleanup")
    after_load = _counters(fake)
    ext = extension.get_extension(ip)
    observed: Dict[str, Any] = {"case": case, "load_stdout": loaded.getvalue(), "calls_at_load": {
        k[len("calls."):]: v for k, v in after_load.items() if k.startswith("calls.")}}
    try:
        ext.settle_timeout = float(case.get("settle", 0.2))
        if case.get("hang"):
            fake.update({"devices": [{"sync_seconds": -1}]})
        if at == "cells" and errors:
            fake.update({"errors": errors})
        observed["A"] = run_cell(ip, fake, case.get("code_a") or "print('hello')\n6 * 7")
        observed["B"] = run_cell(ip, fake, "raise ValueError('mine')")
        if case.get("hang"):
            fake.release_sync()
            # the watchdog's synchronize returns now; its pass gives the context back when it ends
            observed["hang_released"] = wait_until(
                lambda: fake.counter("syncs_in_flight") == 0 and fake.counter("retained") == 0)
            fake.update({"devices": [{"sync_seconds": 0}]})
        fake.update({"errors": {name: 0 for name in errors}, **REFILL})
        if clear is not None:
            clear()
        observed["C"] = run_cell(ip, fake, case.get("code_c") or "print('after')\n8")
        if after_c is not None:
            observed["after_c"] = after_c(ext)
        observed["driver"] = ext.native.snapshot()["driver"]
    finally:
        with contextlib.redirect_stdout(io.StringIO()):
            ip.run_line_magic("unload_ext", "gpucleanup")
        for name in ("_g",):
            ip.user_ns.pop(name, None)
    # Threads end and sockets close a moment after the unload (the status server's, a pinned release's):
    # a bounded wait for the process to be as it was, never a fixed sleep.
    if settled:
        wait_until(lambda: resources(ignore) == before)
    observed["resources"] = {"before": before, "after": resources(ignore)}
    observed["fake_after"] = {k: fake.counter(k) for k in ("retained", "pushed", "syncs_in_flight")}
    return observed


# ------------------------------------------------------------------ one case in a fresh process


def main(argv: List[str]) -> int:
    """``python fault_matrix.py '<case>'``: the case (with ``warm_up``: after a clean case) in this process."""
    case = json.loads(argv[1])
    import conftest  # the fake driver's front and the library's environment, as the tests have them
    from IPython.core.interactiveshell import InteractiveShell

    fake = conftest.FakeCuda(conftest.FAKE_CUDA)
    ip = InteractiveShell.instance()
    if case.get("warm_up"):
        run_case(ip, fake, {"uuid": STABLE_UUID}, settled=False)
    observed = run_case(ip, fake, case)
    sys.stdout.write(RESULT_MARK + json.dumps(observed) + "\n")
    sys.stdout.flush()
    return 0


# ------------------------------------------------------------------ the summary (pytest plugin)


class _Summary:
    """Each case's outcome, from the properties its test recorded: matrix, row and column."""

    def __init__(self):
        self.cases: Dict[str, dict] = {}

    def take(self, report) -> None:
        props = dict(report.user_properties or ())
        if "fault_matrix" not in props:
            return
        entry = self.cases.setdefault(report.nodeid, {**props, "outcome": "passed"})
        if report.failed:
            entry["outcome"] = "failed"
        elif report.skipped and entry["outcome"] != "failed":
            entry["outcome"] = "skipped"

    def lines(self) -> List[str]:
        out = []
        by_matrix: Dict[str, List[dict]] = defaultdict(list)
        for entry in self.cases.values():
            by_matrix[entry["fault_matrix"]].append(entry)
        for matrix in sorted(by_matrix):
            entries = by_matrix[matrix]
            rows = sorted({e["row"] for e in entries})
            cols = sorted({e["col"] for e in entries})
            outcomes = Counter(e["outcome"] for e in entries)
            said = ", ".join(f"{outcomes[o]} {o}" for o in ("passed", "failed", "skipped") if outcomes[o])
            out.append(f"fault matrix ({matrix}): {len(rows)} {entries[0]['rows']} x {len(cols)} "
                       f"{entries[0]['cols']} = {len(entries)} cases: {said}")
        return out


_SUMMARY = _Summary()


def pytest_runtest_logreport(report) -> None:
    _SUMMARY.take(report)


def pytest_terminal_summary(terminalreporter) -> None:
    lines = _SUMMARY.lines()
    if lines:
        terminalreporter.write_sep("-", "fault matrix")
        for line in lines:
            terminalreporter.write_line(line)


if __name__ == "__main__":
    sys.exit(main(sys.argv))
