"""The fault matrix: every driver entry point the library calls x every error it can return (and a
hang), and every call the after-cell engine makes into a framework adapter x an exception, each run
through the extension in an InteractiveShell against the fake CUDA driver.

Each case loads the extension, injects the fault, runs a cell that prints and returns a value and a
cell that raises, clears the fault and runs a cell that must work. It asserts:

- the cells' own output, result (``Out[n]``) and exception are what they are without gpucleanup;
- exactly one gpucleanup line names the failure (the entry point and the CUresult, or the adapter
  and its call), said once per session; or, where the library by design says nothing of a failing
  call, that nothing names it and what the user sees instead (each such row says why);
- after the fault is cleared the next cell works and the cleanup runs again (or, after an error
  that leaves the context unusable, the device is left alone: said once, never entered again);
- no thread, file descriptor or socket is left behind, and the driver holds no context reference
  or pushed context of the library's but those a failed release or pop could not give back.

The rows and columns come from the library: the entry points from ``entry_points.inc`` that
``native/src`` calls, the adapters from ``gpucleanup.frameworks.ADAPTERS``, their calls from
``after_cell.py``. ``fault_matrix.py`` holds the machinery and prints the matrix's size and result
at the end of the run.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Dict, Optional, Tuple

import pytest

import fault_matrix as fm
from conftest import BUILD, FAKE_CUDA, FakeCuda
from support import MiB

pytest_plugins = ["fault_matrix"]

import gpucleanup  # noqa: E402
from gpucleanup.engine import after_cell
from gpucleanup import frameworks  # noqa: E402

ENTRY_POINTS = fm.called_entry_points()
ERROR_NAMES = [name for name, _ in fm.ERRORS]
CODE = dict(fm.ERRORS)
FAULTS = ERROR_NAMES + ["hang"]

#: Errors after which the context cannot be used again (driver.cpp's is_sticky, checked below).
STICKY = {"CUDA_ERROR_ILLEGAL_ADDRESS", "CUDA_ERROR_LAUNCH_TIMEOUT"}

#: Resolved (entry_points.inc) but called nowhere in native/src: no fault of theirs can reach a user.
RESOLVED_NEVER_CALLED = {"cuGetErrorString", "cuDeviceGetAttribute"}

#: Called, but not after a cell: cuDriverGetVersion once when the library loads the driver,
#: cuGetErrorName only to name another call's failure.
NOT_CALLED_BY_A_CLEAN_CELL = {"cuDriverGetVersion", "cuGetErrorName"}

DEVICE = fm.DEVICE_NAME
NORMAL = f"gpucleanup · GPU0 {DEVICE} · freed 1.0 GiB (driver 1.0) · device 1.0/80.0 GiB · <t>"
INTERRUPTED = f"gpucleanup · GPU0 {DEVICE} · interrupted (Ctrl-C): cleanup stopped, nothing more freed · device 1.0/80.0 GiB · <t>"

#: The calls in which a failure stops that device's cleanup for the cell (and is said).
IN_THE_PASS = {"cuDevicePrimaryCtxRetain", "cuCtxPushCurrent", "cuMemGetInfo", "cuCtxSynchronize", "cuMemPoolTrimTo"}
#: Driver calls that enter a device: none of them after it was marked unusable.
ENTERING = IN_THE_PASS | {"cuMemPoolGetAttribute", "cuDeviceGetDefaultMemPool", "cuEventCreate", "cuCtxRecordEvent"}
#: The question "is anything queued?" asked before the settle without waiting (drain.cpp, nothing_queued).
EVENT_CALLS = ("cuEventCreate", "cuCtxRecordEvent", "cuEventQuery", "cuEventDestroy")

# ------------------------------------------------------------------ what each entry point's failure does

NOTE, UNUSABLE, DRIVER, QUIET = "note", "unusable", "driver", "quiet"

WHY = {
    "cuDeviceGetCount:CUDA_ERROR_NOT_INITIALIZED":
        "the driver says nothing in this process initialised CUDA: the state of a kernel that never used "
        "the GPU, with nothing to clean (a cell then costs this one call)",
    "cuDeviceGetCount:CUDA_ERROR_DEINITIALIZED":
        "the driver is shutting down, as it does while the process exits: nothing can be cleaned any more",
    "cuDeviceGet": "a device the library cannot look at is not known to be in use: the cleanup leaves it "
                   "alone, as any device whose context is not active",
    "cuDevicePrimaryCtxGetState": "a device whose context state cannot be read is not known to be in use: the "
                                  "cleanup leaves it alone, as any device whose context is not active",
    "cuDriverGetVersion": "read once, when the library loads the driver, for %gpumem --json and the status "
                          "reply: a failure leaves the version null and changes no cleanup",
    "cuDeviceGetName": "the name is for the line only: the line leaves it out; it is read again at the next cell",
    "cuDeviceTotalMem": "the total is for the line only: the line shows the memory used without it; it is "
                        "read again at the next cell",
    "cuDeviceGetUuid": "the UUID keys what the library remembers of a device: without it, its index does",
    "cuCtxGetCurrent": "asked only to find a context current to the cell's thread that is no primary context "
                       "(PyCUDA's): the device is found through its primary context as well",
    "cuCtxGetDevice": "asked only to find a context current to the cell's thread that is no primary context "
                      "(PyCUDA's): the device is found through its primary context as well",
    "cuDeviceGetMemPool": "asked only for a current pool other than the default one: the default pool is "
                          "trimmed as always",
    "cuDevicePrimaryCtxRelease": "gives back the reference the library took for the cleanup, which is done: "
                                 "nothing can be done about a release that fails",
    "cuCtxPopCurrent": "pops the context the library pushed for the cleanup, which is done: nothing can be "
                       "done about a pop that fails",
    "cuDeviceGetDefaultMemPool": "a device without a default pool (what a driver without memory pools "
                                 "answers) has no pool to trim: nothing is freed, nothing said",
    "cuMemPoolGetAttribute": "the pools' reserved bytes are figures only: the trim runs, but what it freed is "
                             "not known, so there is nothing to report",
    # Asked only of a device whose driver pools reserve nothing (a stream-ordered free needs the synchronize):
    # these rows' cells A and B run with an empty pool, so nothing is freed and nothing said; cell C as usual.
    "cuEventCreate": "asks whether anything is queued without waiting; a failure means the driver cannot tell, "
                     "and the watchdog's cuCtxSynchronize settles the device as it always did",
    "cuCtxRecordEvent": "asks whether anything is queued without waiting; a failure (a stream being captured, "
                        "an old driver) means the driver cannot tell, and the watchdog's synchronize settles it",
    "cuEventQuery": "a failure or 'not ready' sends the device to the watchdog's synchronize, as before",
    "cuEventDestroy": "frees the event of that question: a failure leaves a small driver object, none of the "
                      "device's memory, and changes no cleanup",
}


@dataclasses.dataclass(frozen=True)
class Expect:
    """What a failing entry point does, seen from the cells."""

    kind: str
    a: Tuple[str, ...] = ()  # QUIET: cell A's gpucleanup lines, exactly
    why: str = ""  # QUIET: why nothing is said
    fresh: bool = False  # on a device the library has not seen (a sticky error is kept per device)
    settle: float = 0.2  # the settle_timeout trait
    isolated: str = ""  # why the case runs in a process of its own
    at: str = "cells"
    also: Tuple[Tuple[str, str], ...] = ()  # other entry points failing with it (entry point, error)
    named: str = ""  # the call the line names, when not the injected one
    keeps: str = ""  # the driver counter a failed call leaves raised ("retained", "pushed")
    pool: int = fm.GiB  # what the driver pool reserves before cells A and B (0: the event is asked)


def expect(entry: str, error: str) -> Expect:
    """The library's documented behaviour for ``entry`` failing with ``error``."""
    sticky = error in STICKY
    if entry == "cuDeviceGetCount":
        if error in ("CUDA_ERROR_NOT_INITIALIZED", "CUDA_ERROR_DEINITIALIZED"):
            return Expect(QUIET, why=WHY[f"{entry}:{error}"])
        return Expect(DRIVER)
    if entry in IN_THE_PASS:
        return Expect(UNUSABLE, fresh=True) if sticky else Expect(NOTE)
    if entry == "cuGetErrorName":
        # It names other calls' failures: with a trim failing too, the line names that failure from
        # the library's own table of cuda.h's names.
        inner = expect("cuMemPoolTrimTo", error)
        return dataclasses.replace(inner, also=(("cuMemPoolTrimTo", error),), named="cuMemPoolTrimTo")
    if entry in ("cuDeviceGet", "cuDevicePrimaryCtxGetState"):
        if not sticky:
            return Expect(QUIET, why=WHY[entry])
        if entry == "cuDeviceGet":
            return Expect(UNUSABLE, isolated="without cuDeviceGet there is no UUID: the library keeps the device "
                                             "unusable under its index, for the process's life")
        return Expect(UNUSABLE, fresh=True)
    if entry == "cuDriverGetVersion":
        return Expect(QUIET, (NORMAL,), WHY[entry], settle=0.0, at="start",
                      isolated="the library reads the driver's version once per process, when it loads the driver")
    # The name and the total are read once per device: a device the library has not seen. No settle:
    # a new device's watchdog thread is meant to last (one per device), and would outlive the case.
    if entry == "cuDeviceGetName":
        return Expect(QUIET, (NORMAL.replace(f"GPU0 {DEVICE}", "GPU0"),), WHY[entry], fresh=True, settle=0.0)
    if entry == "cuDeviceTotalMem":
        return Expect(QUIET, (NORMAL.replace("1.0/80.0 GiB", "1.0 GiB"),), WHY[entry], fresh=True, settle=0.0)
    if entry == "cuDeviceGetUuid":  # keyed by its index meanwhile: no settle, no watchdog for that key
        return Expect(QUIET, (NORMAL,), WHY[entry], settle=0.0)
    if entry in ("cuCtxGetCurrent", "cuCtxGetDevice", "cuDeviceGetMemPool"):
        return Expect(QUIET, (NORMAL,), WHY[entry])
    if entry == "cuDevicePrimaryCtxRelease":
        return Expect(QUIET, (NORMAL,), WHY[entry], keeps="retained")
    if entry == "cuCtxPopCurrent":
        return Expect(QUIET, (NORMAL,), WHY[entry], keeps="pushed")
    if entry in ("cuDeviceGetDefaultMemPool", "cuMemPoolGetAttribute"):
        return Expect(QUIET, (), WHY[entry])
    if entry in EVENT_CALLS:
        return Expect(QUIET, (), WHY[entry], pool=0)
    raise LookupError(f"{entry} is called by the library but the fault matrix does not know what its failure "
                      "does: add it to expect() in tests/python/test_fault_matrix.py")


# ------------------------------------------------------------------ output


_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def lines(cell: dict) -> list:
    """The cell's gpucleanup lines, the varying timing at their end replaced by <t>."""
    return [re.sub(r" · [0-9.]+ (ms|s)$", " · <t>", line) for line in cell["stdout"].splitlines()
            if line.startswith("gpucleanup")]


def user_lines(cell: dict) -> list:
    """What the cell itself printed (its output, Out[n], its traceback), colours taken out."""
    return [_ANSI.sub("", line) for line in cell["stdout"].splitlines() if not line.startswith("gpucleanup")]


def naming(cell_lines: list, *words: str) -> list:
    return [line for line in cell_lines if any(w and w in line for w in words)]


def assert_the_cells_are_the_users(obs: dict, code_a_prints_more: bool = False, a_interrupted: bool = False) -> None:
    """Each cell's output, result and exception are what they are without gpucleanup.

    ``code_a_prints_more``: cell A prints more than "hello" between it and Out (%gpumem's tables);
    ``a_interrupted``: cell A ends with the KeyboardInterrupt of a Ctrl-C (after its own output)."""
    a, b, c = obs["A"], obs["B"], obs["C"]
    assert obs["load_stdout"] == ""
    for cell in (a, b, c):
        assert cell["stderr"] == "", cell["stderr"]
        assert cell["error_before_exec"] is None
        assert "Error in callback" not in cell["stdout"] and "Traceback" not in "".join(lines(cell))
        own = [i for i, line in enumerate(cell["stdout"].splitlines()) if not line.startswith("gpucleanup")]
        ours = [i for i, line in enumerate(cell["stdout"].splitlines()) if line.startswith("gpucleanup")]
        if not code_a_prints_more or cell is not a:
            assert not own or not ours or max(own) < min(ours), "a gpucleanup line inside the cell's own output"
    n = a["count"]
    if a_interrupted:
        assert user_lines(a)[0] == "hello" and user_lines(a)[-1].startswith("KeyboardInterrupt")
        assert (a["result"], a["out_entry"], a["error"]) == (None, "<missing>", ["KeyboardInterrupt", []])
        assert a["last_value_is_the_error"]
    elif code_a_prints_more:
        assert user_lines(a)[0] == "hello" and user_lines(a)[-1] == f"Out[{n}]: 42"
    else:
        assert user_lines(a) == ["hello", f"Out[{n}]: 42"]
    if not a_interrupted:
        assert (a["result"], a["out_entry"], a["underscore"], a["error"]) == (42, 42, 42, None)
    assert b["error"] == ["ValueError", ["mine"]] and b["last_value_is_the_error"]
    assert b["count"] == n + 1 and b["out_entry"] == "<missing>" and b["result"] is None
    assert [line.strip() for line in user_lines(b) if line.strip()][-1] == "ValueError: mine"
    m = c["count"]
    assert m == n + 2
    assert user_lines(c)[0] == "after" and user_lines(c)[-1] == f"Out[{m}]: 8"
    assert (c["result"], c["out_entry"], c["underscore"], c["error"]) == (8, 8, 8, None)


def assert_nothing_left_behind(obs: dict) -> None:
    before, after = obs["resources"]["before"], obs["resources"]["after"]
    for key in ("python_threads", "native_threads", "fds", "sockets"):
        assert after[key] == before[key], (
            f"{key} left behind: before {before[key]}, after {after[key]}")


def assert_driver_holds_nothing_of_ours(obs: dict, entry: str, keeps: str) -> None:
    """No context reference, pushed context or blocked synchronize of the library's remains, but one
    per failed release (or pop): what a call that failed could not give back."""
    left = dict(obs["fake_after"])
    if keeps:
        failed = obs["A"]["calls"].get(entry, 0) + obs["B"]["calls"].get(entry, 0)
        assert failed > 0 and left.pop(keeps) == failed
    assert all(v == 0 for v in left.values()), left


# ------------------------------------------------------------------ fixtures


@pytest.fixture(scope="module")
def matrix_shell():
    """The process's InteractiveShell with the real extension (native library, adapters, status
    endpoint), after one clean case: imports done, the matrix's device known to the library."""
    from IPython.core.interactiveshell import InteractiveShell

    import gpucleanup._native
    import gpucleanup.frameworks
    import gpucleanup.in_kernel.status_endpoint

    # the real parts, as the extension looks them up at load: no stand-in left behind by another test
    assert gpucleanup._native.__name__ == "gpucleanup._native"
    assert gpucleanup.frameworks.active.__module__ == "gpucleanup.frameworks"
    assert gpucleanup.in_kernel.status_endpoint.StatusEndpoint.__module__ == "gpucleanup.in_kernel.status_endpoint"
    ip = InteractiveShell.instance()
    ip.extension_manager.unload_extension("gpucleanup")
    saved = ip.config.pop("GPUCleanup", None)
    # Every adapter verb fails in turn inside a cell's own cleanup, so every cache is given back as each
    # cell ends (release "cell"): under the default, "rerun", the drains run later on the release's own
    # thread, whose faults test_cell_pass.py covers.
    ip.config.GPUCleanup.release = "cell"
    fake = FakeCuda(FAKE_CUDA)
    warm = fm.run_case(ip, fake, {}, settled=False)
    assert lines(warm["A"]) == [NORMAL], warm["A"]["stdout"]
    yield ip
    fake.reset({})
    ip.config.pop("GPUCleanup", None)
    if saved is not None:
        ip.config["GPUCleanup"] = saved


def _isolated_cases() -> Dict[str, dict]:
    cases = {}
    for entry in ENTRY_POINTS:
        for error in ERROR_NAMES:
            exp = _expect_or_none(entry, error)
            if exp is not None and exp.isolated:
                cases[f"{entry}:{error}"] = _case(entry, error, exp, warm_up=exp.at != "start")
    return cases


def _expect_or_none(entry: str, error: str) -> Optional[Expect]:
    try:
        return expect(entry, error)
    except LookupError:
        return None


def _case(entry: str, error: str, exp: Expect, warm_up: bool = False) -> dict:
    errors = {entry: CODE[error], **{e: CODE[err] for e, err in exp.also}}
    case = {"errors": errors, "at": exp.at, "settle": exp.settle, "pool": exp.pool,
            "uuid": fm.uuid_for(f"{entry}:{error}") if exp.fresh else fm.STABLE_UUID}
    if warm_up:
        case["warm_up"] = True
    return case


@pytest.fixture(scope="module")
def isolated(tmp_path_factory):
    """The cases that need a process of their own, all started at once on first use: {id: Popen}."""
    started: Dict[str, subprocess.Popen] = {}
    package = str(Path(gpucleanup.__file__).resolve().parents[1])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(__file__).parent), package]),
               IPYTHONDIR=str(tmp_path_factory.mktemp("ipython")))
    env.pop("GPUCLEANUP_FAKE_CUDA_SCENARIO", None)

    def get(case_id: str) -> dict:
        if not started:
            for cid, case in _isolated_cases().items():
                started[cid] = subprocess.Popen([sys.executable, fm.__file__, json.dumps(case)], env=env,
                                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        out, err = started[case_id].communicate(timeout=120)
        assert started[case_id].returncode == 0, err
        (line,) = [line for line in out.splitlines() if line.startswith(fm.RESULT_MARK)]
        return json.loads(line[len(fm.RESULT_MARK):])

    yield get
    for proc in started.values():
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# ------------------------------------------------------------------ the rows and columns


def test_the_rows_are_every_entry_point_the_library_calls():
    resolved = fm.resolved_entry_points()
    assert len(resolved) == len(set(resolved)) > 0
    helper_only = set(fm.park_helper_entry_points())
    assert helper_only == {"cuCheckpointProcessGetState", "cuCheckpointProcessLock", "cuCheckpointProcessCheckpoint",
                           "cuCheckpointProcessRestore", "cuCheckpointProcessUnlock",
                           "cuCheckpointProcessGetRestoreThreadId"}
    assert set(resolved) - set(ENTRY_POINTS) == RESOLVED_NEVER_CALLED | helper_only, fm.call_sites()
    assert set(fm.call_sites()) <= set(resolved)  # nothing called that is not resolved through the table
    for entry in ENTRY_POINTS:  # every row says what its failure does (a new entry point must)
        for error in ERROR_NAMES:
            expect(entry, error)


def test_a_clean_cell_calls_every_row_but_the_version_and_the_error_names(matrix_shell, fake_cuda):
    # A device's name and total are read at its first cell (a device the library has not seen, no
    # settle: no watchdog thread for it); the settle's synchronize, on a device with a settle limit.
    # And a device whose driver pool reserves nothing: the event says nothing is queued, no synchronize.
    first = fm.run_case(matrix_shell, fake_cuda, {"uuid": fm.uuid_for("a clean first cell"), "settle": 0.0})
    settled = fm.run_case(matrix_shell, fake_cuda, {})
    idle = fm.run_case(matrix_shell, fake_cuda, {"pool": 0})
    assert lines(first["A"]) == lines(settled["A"]) == [NORMAL]
    assert lines(idle["A"]) == []  # nothing to free, nothing said
    called = set(first["A"]["calls"]) | set(settled["A"]["calls"]) | set(idle["A"]["calls"])
    assert called == set(ENTRY_POINTS) - NOT_CALLED_BY_A_CLEAN_CELL
    assert set(first["A"]["calls"]) ^ set(settled["A"]["calls"]) == {"cuDeviceGetName", "cuDeviceTotalMem",
                                                                      "cuCtxSynchronize"}
    assert set(idle["A"]["calls"]) ^ set(settled["A"]["calls"]) == {"cuCtxSynchronize", *EVENT_CALLS}
    for obs in (first, settled, idle):
        assert_nothing_left_behind(obs)


def test_the_errors_are_cuda_h_s_and_the_sticky_ones_driver_cpp_s():
    cache = BUILD / "CMakeCache.txt"
    include = None
    if cache.exists():
        found = re.search(r"^GPUCLEANUP_CUDA_INCLUDE_DIR:\w+=(.*)$", cache.read_text(), re.M)
        include = Path(found.group(1)) if found else None
    if include is None or not (include / "cuda.h").exists():
        pytest.skip(f"no cuda.h known to the build in {BUILD}")
    header = (include / "cuda.h").read_text()
    for name, code in fm.ERRORS:
        assert re.search(rf"^\s*{name}\s*=\s*{code}\s*,?", header, re.M), name
    driver = (fm.NATIVE_SRC / "driver.cpp").read_text()
    body = re.search(r"bool is_sticky\(CUresult code\) noexcept \{(.*?)\n\}", driver, re.S).group(1)
    sticky = set(re.findall(r"case (CUDA_ERROR_\w+):", body))
    assert sticky & set(ERROR_NAMES) == STICKY


# ------------------------------------------------------------------ entry point x error, and a hang


@pytest.mark.parametrize("fault", FAULTS)
@pytest.mark.parametrize("entry", ENTRY_POINTS)
def test_driver_fault(entry, fault, matrix_shell, fake_cuda, isolated, record_property):
    for key, value in (("fault_matrix", "driver entry points"), ("row", entry), ("col", fault),
                       ("rows", "entry points"), ("cols", "faults (8 CUresult codes and a hang)")):
        record_property(key, value)
    if fault == "hang":
        return _hang(entry, matrix_shell, fake_cuda)
    exp = expect(entry, fault)
    code = CODE[fault]
    if exp.isolated:
        obs = isolated(f"{entry}:{fault}")
    else:
        obs = fm.run_case(matrix_shell, fake_cuda, _case(entry, fault, exp))
    a, b, c = obs["A"], obs["B"], obs["C"]

    assert_the_cells_are_the_users(obs)
    # the fault was met: the library made the failing call
    made = obs["calls_at_load"] if exp.at == "start" else a["calls"]
    assert made.get(entry, 0) > 0, made
    named = exp.named or entry

    if exp.kind == NOTE:
        note = f"gpucleanup · {named} failed with {fault} ({code}) on GPU0: gpucleanup left the device alone this time"
        assert lines(a).count(note) == 1, lines(a)
        others = [line for line in lines(a) if line != note]
        assert all(line.startswith(f"gpucleanup · GPU0 {DEVICE} · ") and fault not in line for line in others), others
        assert a["record"]["devices"][0]["state"] == "error"
        assert naming(lines(b), fault, named) == []  # said once
    elif exp.kind == UNUSABLE:
        assert lines(a) == [f"gpucleanup · GPU0 is unusable after {fault}: restart the kernel"]
        assert lines(b) == [] and lines(c) == []
        # left alone: only the probe looks at the device again; said once, quiet after
        for cell in (b, c) if entry != "cuDeviceGet" else (b,):
            assert not set(cell["calls"]) & ENTERING, cell["calls"]
            assert cell["record"]["devices"][0]["state"] == "unusable" and cell["record"]["devices"][0]["quiet"]
        if entry == "cuDeviceGet":
            # The library kept the device unusable under its index (no UUID without cuDeviceGet); once
            # cuDeviceGet works the device is known by its UUID again, without an error: the library
            # cleans it, the extension keeps GPU0 quiet. (A real driver's cuDeviceGet touches no
            # context and returns no sticky error.)
            assert c["calls"].get("cuMemPoolTrimTo", 0) > 0 and c["record"]["devices"][0]["quiet"]
    elif exp.kind == DRIVER:
        assert lines(a) == [f"gpucleanup · the CUDA driver is unusable: [gpucleanup.driver.104] cuDeviceGetCount "
                            f"failed with {fault} ({code}): the driver cannot be used; check the GPU with nvidia-smi"]
        assert lines(b) == []
    else:
        assert exp.kind == QUIET and exp.why
        assert lines(a) == list(exp.a), lines(a)
        for cell in (a, b, c):
            assert naming(lines(cell), fault, entry) == []

    if exp.kind != UNUSABLE:  # the fault is gone: the next cell works and the cleanup runs again
        assert lines(c) == [NORMAL], lines(c)
        assert c["calls"].get("cuMemPoolTrimTo", 0) > 0
    if entry == "cuGetErrorName":  # the name came from the library's own table
        assert a["calls"]["cuGetErrorName"] > 0
    assert obs["driver"]["version"] == (None if entry == "cuDriverGetVersion" else 13000)
    assert_nothing_left_behind(obs)
    assert_driver_holds_nothing_of_ours(obs, entry, exp.keeps)


def _hang(entry: str, ip, fake) -> None:
    if entry != "cuCtxSynchronize":
        pytest.skip(f"{entry} does not wait for the GPU's queued work: only cuCtxSynchronize does, which the "
                    "library runs on the device's watchdog thread under the settle limit; the fake driver "
                    "can hang cuCtxSynchronize only")
    obs = fm.run_case(ip, fake, {"hang": True, "settle": 0.2})
    a, b, c = obs["A"], obs["B"], obs["C"]
    assert_the_cells_are_the_users(obs)
    # the settle limit ended the wait: one line says the device is busy, nothing was trimmed
    (line,) = lines(a)
    waited = re.fullmatch(rf"gpucleanup · GPU0 {DEVICE} · busy after (\d+) ms: skipped freeing, queued work keeps "
                          r"running · device 2\.0/80\.0 GiB · <t>", line)
    assert waited is not None and int(waited.group(1)) >= 200, line
    assert a["calls"].get("cuMemPoolTrimTo", 0) == 0 and a["record"]["devices"][0]["state"] == "busy"
    # the next cell does not wait for it again
    (line,) = lines(b)
    assert re.fullmatch(rf"gpucleanup · GPU0 {DEVICE} · still busy with queued work \(\d+ ms\): skipped, nothing "
                        r"freed · device 2\.0/80\.0 GiB · <t>", line), line
    assert b["calls"].get("cuCtxSynchronize", 0) == 0
    # released: the watchdog's synchronize returned and its pass ended; the cleanup runs again
    assert obs["hang_released"]
    assert lines(c) == [NORMAL]
    assert_nothing_left_behind(obs)  # the same watchdog thread waits for the device's next settle
    assert_driver_holds_nothing_of_ours(obs, "cuCtxSynchronize", "")


# ------------------------------------------------------------------ framework adapter x call x exception


ADAPTERS = [a.name for a in frameworks.ADAPTERS]
#: What the engine calls of an adapter: in_use through frameworks.active, the rest through guarded().
ADAPTER_CALLS = ("in_use", "stats", "drain", "drain_pinned", "describe")
EXCEPTIONS = {
    "RuntimeError": (lambda: RuntimeError("injected by the fault matrix"), "RuntimeError: injected by the fault matrix"),
    "MemoryError": (MemoryError, "MemoryError"),
    "KeyboardInterrupt": (KeyboardInterrupt, "KeyboardInterrupt"),
}


def test_the_adapter_calls_are_those_the_engine_makes():
    engine = Path(after_cell.__file__).parent  # the engine's parts: the facade and its homes
    source = "".join((engine / f"{name}.py").read_text()
                     for name in ("after_cell", "cell_pass", "figures", "quiet_check", "releases", "since_last_pass"))
    guarded = set(re.findall(r"guarded\(\s*\w+,\s*\"(\w+)\"", source))
    assert guarded == set(ADAPTER_CALLS) - {"in_use"}
    assert "adapter.in_use()" in Path(frameworks.__file__).read_text()


class ScriptedFramework:
    """What an adapter reads of its framework, scripted: 1 GiB live and 256 MiB cached on GPU0, 64 MiB
    cached in its pinned pool; the adapter's own verbs (guards, locks, notes, wording) run as they are."""

    def __init__(self):
        self.cached, self.pinned = 256 * MiB, 64 * MiB

    def hooks(self) -> dict:
        def _stats(devices, result):
            for i in devices:
                result["devices"][i] = {"live_bytes": fm.GiB, "cached_bytes": self.cached}

        def _drain(devices, result):
            for i in devices:
                result["freed_bytes"][i] = self.cached
            self.cached = 0

        def _pinned_stats(notes):
            return {"live_bytes": 0, "cached_bytes": self.pinned}

        def _drain_pinned(result):
            result["freed_bytes"], self.pinned = self.pinned, 0

        # "modules": the scripted framework is no imported module: frameworks.active() asks the adapter anyway
        return {"_in_use": lambda: True, "_stats": _stats, "_drain": _drain, "_pinned_stats": _pinned_stats,
                "_drain_pinned": _drain_pinned, "modules": ()}

    def refill(self):
        self.cached, self.pinned = 128 * MiB, 32 * MiB


class Faulty:
    """One verb of an adapter, raising while ``failing``; every call counted."""

    def __init__(self, verb_fn, make_exc):
        self.verb_fn, self.make_exc = verb_fn, make_exc
        self.failing = True
        self.failed = self.worked = 0

    def __call__(self, *args, **kwargs):
        if self.failing:
            self.failed += 1
            raise self.make_exc()
        self.worked += 1
        return self.verb_fn(*args, **kwargs)

    def stop(self):
        self.failing = False


@pytest.mark.parametrize("exc_name", list(EXCEPTIONS))
@pytest.mark.parametrize("call", ADAPTER_CALLS)
@pytest.mark.parametrize("name", ADAPTERS)
def test_adapter_fault(name, call, exc_name, matrix_shell, fake_cuda, monkeypatch, record_property):
    for key, value in (("fault_matrix", "framework adapters"), ("row", name), ("col", f"{call}:{exc_name}"),
                       ("rows", "adapters"), ("cols", f"faults ({len(ADAPTER_CALLS)} calls x {len(EXCEPTIONS)} exceptions)")):
        record_property(key, value)
    adapter = next(a for a in frameworks.ADAPTERS if a.name == name)
    if call in ("drain", "drain_pinned") and not adapter.can_release:
        pytest.skip(f"{name} cannot release its memory: the engine never calls its {call}")
    framework = ScriptedFramework()
    for hook, fn in framework.hooks().items():
        monkeypatch.setitem(adapter.__dict__, hook, fn)
    make_exc, text = EXCEPTIONS[exc_name]
    faulty = Faulty(getattr(adapter, call), make_exc)
    monkeypatch.setitem(adapter.__dict__, call, faulty)

    def clear():
        faulty.stop()
        framework.refill()

    describe = call == "describe"
    case = {"code_a": "print('hello')\n%gpumem\n6 * 7", "code_c": "print('after')\n%gpumem\n8"} if describe else {}
    obs = fm.run_case(matrix_shell, fake_cuda, case, clear=clear,
                      after_c=lambda ext: ext.status()["frameworks"].get(name))
    a, b, c = obs["A"], obs["B"], obs["C"]
    failed_line = f"gpucleanup · {name}.{call} failed: {text}"
    interrupt = exc_name == "KeyboardInterrupt"

    # Ctrl-C during %gpumem stops the magic as it stops any code of the cell: the cell ends with
    # KeyboardInterrupt (after its own output); the cleanup after it runs as after any cell.
    assert_the_cells_are_the_users(obs, code_a_prints_more=describe, a_interrupted=describe and interrupt)
    assert faulty.failed > 0 and faulty.worked > 0  # met in cell A (and B), made again and working in cell C

    if interrupt and call in ("in_use", "stats", "drain"):
        # a KeyboardInterrupt in the cleanup is the user's Ctrl-C: the cleanup stops, the cell is not affected
        assert lines(a) == [INTERRUPTED] and lines(b) == [INTERRUPTED]
    elif call == "in_use" and not interrupt:
        # frameworks.active counts a failing check as "not in use": the framework is left alone this cell
        assert lines(a) == [NORMAL]
        assert naming(lines(b), name) == []
    elif describe and interrupt:
        assert naming(lines(a), failed_line) == [] and a["record"]["interrupted"] is False
    else:
        # one line names the adapter and its call, once per session: in cell A, or for the pinned
        # release (on its own thread) in cell A or, when it ended after cell A's line, in cell B
        said = lines(a) + (lines(b) if call == "drain_pinned" else [])
        assert said.count(failed_line) == 1, said
        assert all(line == failed_line or (line.startswith(f"gpucleanup · GPU0 {DEVICE} · ") and "failed" not in line)
                   for line in lines(a) + lines(b)), lines(a) + lines(b)
    # the fault is gone: the next cell's cleanup reads (and, if it can, frees) the framework again
    (line,) = lines(c)
    assert line.startswith(f"gpucleanup · GPU0 {DEVICE} · freed ") and "failed" not in line and "interrupted" not in line
    if adapter.can_release:
        assert f"{name} 0.1" in line, line  # its 128 MiB of cache
    assert isinstance(obs["after_c"], str) and obs["after_c"]  # describe works again
    assert_nothing_left_behind(obs)
    assert_driver_holds_nothing_of_ours(obs, "", "")
