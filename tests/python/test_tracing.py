"""The allocation trace (%gpumem --trace, trace_allocations) with the fake driver and the
fake libcupti (tests/fake_cupti): the fake plays allocation calls to the library's
subscriber from threads that hold the interpreter lock (ctypes.PyDLL), as PyCUDA's
mem_alloc does, so each allocation is traced to the cell's line."""

from __future__ import annotations

import ctypes
import os

import pytest
from IPython.core.error import UsageError
from IPython.utils.capture import capture_output

from conftest import BUILD
import gpucleanup
import gpucleanup.frameworks
import gpucleanup.in_kernel.status_endpoint
from gpucleanup.in_kernel import extension
from gpucleanup.records import report
from gpucleanup.in_kernel import tracing
from shell_stand_ins import StandInEndpoint, _lines, shell  # noqa: F401  (fixture)
from support import MiB

FAKE_CUPTI = BUILD / "tests" / "fake_cupti" / "libcupti.so"
MULTIPLE_SUBSCRIBERS = 39  # CUPTI_ERROR_MULTIPLE_SUBSCRIBERS_NOT_SUPPORTED


@pytest.fixture
def cupti(monkeypatch, fake_cuda):
    """The fake libcupti, named first to the trace, and the fake driver with GPU0 in use."""
    if not FAKE_CUPTI.exists():
        pytest.fail(f"fake libcupti not built at {FAKE_CUPTI}: run CMake with -DGPUCLEANUP_BUILD_TESTS=ON")
    lib = ctypes.PyDLL(str(FAKE_CUPTI), mode=os.RTLD_LOCAL)  # calls keep the interpreter lock
    for name in ("fake_cupti_mem_alloc", "fake_cupti_mem_free"):
        getattr(lib, name).restype = ctypes.c_int
    lib.fake_cupti_mem_alloc.argtypes = [ctypes.c_ulonglong, ctypes.c_ulonglong, ctypes.c_int]
    lib.fake_cupti_mem_free.argtypes = [ctypes.c_ulonglong]
    lib.fake_cupti_reset.argtypes = [ctypes.c_int]
    lib.fake_cupti_reset(0)
    monkeypatch.setenv("GPUCLEANUP_CUPTI", str(FAKE_CUPTI))
    monkeypatch.setattr(gpucleanup.frameworks, "active", lambda: [])
    monkeypatch.setattr(gpucleanup.in_kernel.status_endpoint, "StatusEndpoint", lambda: StandInEndpoint())
    fake_cuda.reset({"devices": [{"primary_active": True}], "current_context": {"device": 0}})
    yield lib
    from gpucleanup import _native

    _native.trace_stop()
    lib.fake_cupti_reset(0)


@pytest.fixture
def traced_shell(shell, cupti):  # noqa: F811
    shell.user_ns["fake_cupti"] = cupti
    shell.run_line_magic("load_ext", "gpucleanup")
    yield shell
    for name in ("fake_cupti", "worker", "threads", "t", "MiB"):
        shell.user_ns.pop(name, None)


def _cell(shell, code):  # noqa: F811
    with capture_output() as cap:
        result = shell.run_cell(code, store_history=True)
    assert result.error_in_exec is None, result.error_in_exec
    return result.execution_count, _said(cap)


def _said(cap) -> str:
    """What the cell printed, then gpucleanup's own output (a display output of its own, never the stdout)."""
    return cap.stdout + "".join(o.data["text/plain"] + "\n" for o in cap.outputs if "gpucleanup" in (o.metadata or {}))


def _magic(shell, line):  # noqa: F811
    with capture_output() as cap:
        value = shell.run_line_magic("gpumem", line)
    return value, _lines(cap.stdout)


WORKERS = """\
import threading
def worker(i):
    fake_cupti.fake_cupti_mem_alloc(0x10000000 * (i + 1), 64 << 20, 0)
threads = [threading.Thread(target=worker, args=(i,)) for i in range(5)]
for t in threads: t.start()
for t in threads: t.join()
"""


def test_five_threads_raw_allocations_are_traced_to_the_cells_line(traced_shell, cupti):
    shell = traced_shell
    _, said = _magic(shell, "--trace on")
    assert said == [f"gpucleanup · tracing raw GPU allocations to their line (CUPTI: {FAKE_CUPTI}); each cell's line "
                    "names what it allocated and kept; %gpumem --trace shows all, --trace off stops"]
    cell, out = _cell(shell, WORKERS)
    line = _lines(out)[0]
    assert f"traced 320 MiB in 5 allocations from <cell {cell}>:3 worker() on 5 threads, never freed" in line
    record = extension.get_extension(shell).history.last(1)[0]
    assert [(e["bytes"], e["count"], e["threads"], e["site"], e["kind"]) for e in record["traced"]] == [
        (320 * MiB, 5, 5, f"<cell {cell}>:3 worker()", "cuMemAlloc")]


def test_freed_allocations_leave_the_trace_and_the_next_cell_says_nothing_of_them(traced_shell, cupti):
    shell = traced_shell
    _magic(shell, "--trace on")
    _cell(shell, WORKERS)
    cell, out = _cell(shell, "for i in range(5): fake_cupti.fake_cupti_mem_free(0x10000000 * (i + 1))")
    assert "traced" not in out
    data, _ = _magic(shell, "--trace --json")
    assert data["live_bytes"] == 0 and data["groups"] == []
    assert extension.get_extension(shell).history.last(1)[0]["traced"] == []


def test_the_trace_table_lists_live_allocations_by_site(traced_shell, cupti):
    shell = traced_shell
    _magic(shell, "--trace on")
    cell, _ = _cell(shell, WORKERS)
    data, _ = _magic(shell, "--trace --json")
    [group] = data["groups"]
    assert (group["site"], group["count"], group["thread_count"], group["bytes"], group["raw"], group["cell"]) == (
        f"<cell {cell}>:3 worker()", 5, 5, 320 * MiB, True, cell)
    text = report.trace_report(data).text()
    assert text.splitlines()[0] == "gpucleanup · allocation trace on: 320 MiB live in 5 traced allocations"
    assert f"<cell {cell}>:3 worker()" in text and "raw" in text


def test_another_profiler_holding_cupti_is_named_and_nothing_breaks(traced_shell, cupti):
    shell = traced_shell
    cupti.fake_cupti_reset(MULTIPLE_SUBSCRIBERS)
    _, said = _magic(shell, "--trace on")
    assert said[0].startswith("gpucleanup · allocation trace not started: another tool holds CUPTI's only "
                              "subscription in this process (torch.profiler keeps it once it ran")
    assert extension.get_extension(shell).trace.tracer.active is False
    _, out = _cell(shell, "x = 1")
    assert "traced" not in out
    data, _ = _magic(shell, "--trace --json")
    assert data["active"] is False and "CUPTI" in data["refused"]


def test_a_gpucleanup_cupti_that_names_no_file_is_refused_with_what_to_set(traced_shell, cupti, monkeypatch,
                                                                            tmp_path):
    # before: a wrong path was passed over for another libcupti, silently
    shell = traced_shell
    monkeypatch.setenv("GPUCLEANUP_CUPTI", str(tmp_path / "libcupti.so.13"))
    _, said = _magic(shell, "--trace on")
    assert said[0] == (f"gpucleanup · allocation trace not started: GPUCLEANUP_CUPTI names {tmp_path / 'libcupti.so.13'}, "
                       "which is not a file: set it to the path of a libcupti.so (e.g. "
                       "/usr/local/cuda/lib64/libcupti.so.13, or the nvidia-cuda-cupti wheel's), or unset it to let "
                       "gpucleanup find one")
    assert extension.get_extension(shell).trace.tracer.active is False
    assert tracing.named_cupti_missing({"GPUCLEANUP_CUPTI": str(FAKE_CUPTI)}) is None
    assert tracing.named_cupti_missing({}) is None and tracing.named_cupti_missing({"GPUCLEANUP_CUPTI": " "}) is None
    monkeypatch.setenv("GPUCLEANUP_CUPTI", str(FAKE_CUPTI))
    _, said = _magic(shell, "--trace on")
    assert extension.get_extension(shell).trace.tracer.active is True


def test_trace_off_unsubscribes_and_unload_does_too(traced_shell, cupti):
    shell = traced_shell
    _magic(shell, "--trace on")
    assert cupti.fake_cupti_subscribed() == 1
    _, said = _magic(shell, "--trace off")
    assert said == ["gpucleanup · allocation trace stopped (what it found stays in %gpumem --trace)"]
    assert cupti.fake_cupti_subscribed() == 0
    _magic(shell, "--trace on")
    shell.run_line_magic("unload_ext", "gpucleanup")
    assert cupti.fake_cupti_subscribed() == 0


def test_trace_allocations_trait_starts_after_the_first_cell_with_cuda_in_use(shell, cupti, fake_cuda):  # noqa: F811
    from traitlets.config import Config

    fake_cuda.reset({"initialized": False})
    cfg = Config()
    cfg.GPUCleanup.trace_allocations = True
    shell.config.merge(cfg)
    shell.user_ns["fake_cupti"] = cupti
    shell.run_line_magic("load_ext", "gpucleanup")
    _, out = _cell(shell, "x = 1")
    assert out == "" and cupti.fake_cupti_subscribed() == 0  # CUDA not in use: nothing said, nothing started
    fake_cuda.reset({"devices": [{"primary_active": True}], "current_context": {"device": 0}})
    _, out = _cell(shell, "x = 2")
    assert "tracing raw GPU allocations to their line" in out
    assert cupti.fake_cupti_subscribed() == 1
    cell, out = _cell(shell, WORKERS)
    assert f"from <cell {cell}>:3 worker() on 5 threads" in out
    shell.user_ns.pop("fake_cupti", None)


@pytest.mark.parametrize("line", ["--trace maybe", "--trace on --drain", "--trace off --release out"])
def test_bad_trace_arguments_are_usage_errors_that_change_nothing(traced_shell, cupti, line):
    shell = traced_shell
    with pytest.raises(UsageError) as err:
        shell.run_line_magic("gpumem", line)
    assert "--trace" in str(err.value) and "Usage: %gpumem" in str(err.value)
    assert cupti.fake_cupti_subscribed() == 0


def test_cupti_candidates_put_the_users_path_first_and_end_with_the_loaders_search(tmp_path):
    found = tracing.cupti_candidates({"GPUCLEANUP_CUPTI": "/opt/mine/libcupti.so", "CUDA_HOME": str(tmp_path)})
    assert found[0] == "/opt/mine/libcupti.so"
    assert found[-3:] == ["libcupti.so.13", "libcupti.so.12", "libcupti.so"]
    (tmp_path / "lib64").mkdir()
    (tmp_path / "lib64" / "libcupti.so.13").write_bytes(b"")
    found = tracing.cupti_candidates({"CUDA_HOME": str(tmp_path)})
    assert str(tmp_path / "lib64" / "libcupti.so.13") in found


@pytest.mark.parametrize("caller, framework", [
    ("/site-packages/torch/lib/libc10_cuda.so", "torch"),
    ("/site-packages/cupy_backends/cuda/api/runtime.cpython-312-x86_64-linux-gnu.so", "cupy"),
    ("/site-packages/jaxlib/xla_extension.so", "jax"),
    ("/site-packages/pycuda/_driver.cpython-312-x86_64-linux-gnu.so", None),
    ("/site-packages/cuda/bindings/cydriver.cpython-312-x86_64-linux-gnu.so", None),
    ("/opt/torch/.venv/lib/python3.12/site-packages/cuda/bindings/cydriver.cpython-312-x86_64-linux-gnu.so", None),
    ("/opt/torch/.venv/lib/python3.12/site-packages/nvidia/cu13/lib/libcublas.so.13", None),
    ("/usr/lib/x86_64-linux-gnu/librmm.so", "rmm"),
    ("/site-packages/jax_cuda13_plugin/xla_cuda_plugin.so", "jax"),
    (None, None),
])
def test_allocations_of_a_frameworks_pool_are_not_raw(caller, framework):
    assert tracing.framework_of(caller) == framework


def test_traced_text_names_the_two_largest_sites_and_counts_the_rest():
    entries = [
        {"device": 0, "bytes": 320 * MiB, "count": 5, "threads": 5, "site": "<cell 3>:2 worker()", "caller": "x.so"},
        {"device": 0, "bytes": 64 * MiB, "count": 1, "threads": 1, "site": None, "caller": "cydriver.so"},
        {"device": 0, "bytes": 1 * MiB, "count": 1, "threads": 1, "site": "<cell 3>:9", "caller": "x.so"},
        {"device": 1, "bytes": 8 * MiB, "count": 1, "threads": 1, "site": "<cell 3>:4", "caller": "x.so"},
    ]
    assert report.traced_text(entries, 0) == (
        "320 MiB in 5 allocations from <cell 3>:2 worker() on 5 threads, 64 MiB in 1 allocation by cydriver.so "
        "(no Python line: the call released the interpreter lock) and 1 more site, never freed")
    assert report.traced_text(entries, 2) is None


def test_traced_text_names_a_cuda_librarys_own_allocations_by_library():
    entries = [{"device": 0, "bytes": 32 * MiB, "count": 1, "threads": 1, "site": "<cell 2>:1",
                "caller": "libcublasLt.so.13"}]
    assert report.traced_text(entries, 0) == (
        "32 MiB in 1 allocation from <cell 2>:1 through libcublasLt.so.13 (the library's own workspace or handle), "
        "never freed")


def test_the_site_hook_runs_with_garbage_collection_off_and_puts_it_back_as_it_was():
    import gc

    seen = []
    tracer = tracing.Tracer(native=None, shell=None)
    tracer._site_id = lambda: seen.append(gc.isenabled()) or 7  # what the hook runs, inside the driver call
    assert gc.isenabled()
    assert tracer._site() == 7 and gc.isenabled()
    gc.disable()
    try:
        assert tracer._site() == 7 and not gc.isenabled()  # the user's own choice stays
    finally:
        gc.enable()
    assert seen == [False, False]
