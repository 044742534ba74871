"""The extension in an in-process IPython shell: lifecycle, the after-cell flow, failure paths.

The native module is the real libgpucleanup over the fake CUDA driver (conftest.fake_cuda), whose devices the
tests script (fixture ``gpu``); the framework adapters are small scripted stand-ins (``StandInAdapter``) that move
memory on the fake driver as they free it, and the status endpoint a recording one. Both are what the extension
finds when it loads (``gpucleanup.frameworks.active``, ``gpucleanup.in_kernel.status_endpoint.StatusEndpoint``).
A few tests keep a stand-in native module (fixture ``stand_in``): no driver at all, and progress reports that
the library sends only after seconds of real waiting.
"""

from __future__ import annotations

import gc
import json
import os
import re
import subprocess
import sys
import textwrap
import threading
import time
import types
import uuid

import pytest

from gpucleanup.engine import after_cell
from gpucleanup.in_kernel import extension
from shell_stand_ins import (  # noqa: F401  (fixtures among them)
    StandInAdapter, StandInEndpoint, fake_device, _inject, shell, gpu, stand_in, _ext, _wait_pinned, _lines,
    _run, real, _fake_name, _settled)
from support import GiB, MiB

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# ------------------------------------------------------------------ lifecycle


def test_load_registers_one_handler_pair_and_the_magic(shell, gpu, capsys):
    shell.run_line_magic("load_ext", "gpucleanup")
    ext = _ext(shell)
    assert shell.events.callbacks["pre_run_cell"].count(ext.pre_run_cell) == 1
    assert shell.events.callbacks["post_run_cell"].count(ext.post_run_cell) == 1
    assert shell.magics_manager.magics["line"]["gpumem"].__self__ is ext
    assert [c for c in shell.configurables if type(c).__name__ == "GPUCleanup"] == [ext]
    assert capsys.readouterr().out == ""


def test_load_again_says_it_is_loaded(shell, gpu, capsys):
    shell.run_line_magic("load_ext", "gpucleanup")
    shell.run_line_magic("load_ext", "gpucleanup")
    assert "already loaded" in capsys.readouterr().out
    extension.load_ipython_extension(shell)  # called directly, past IPython's own check
    assert capsys.readouterr().out == "gpucleanup is already loaded (%reload_ext gpucleanup reloads it)\n"
    assert len([f for f in shell.events.callbacks["post_run_cell"] if getattr(f, "__self__", None).__class__.__name__ == "GPUCleanup"]) == 1


def test_reload_does_not_register_twice(shell, gpu):
    shell.run_line_magic("load_ext", "gpucleanup")
    first = _ext(shell)
    for _ in range(3):
        shell.run_line_magic("reload_ext", "gpucleanup")
    ext = _ext(shell)
    assert ext is not first
    ours = [f for f in shell.events.callbacks["post_run_cell"] if isinstance(getattr(f, "__self__", None), extension.GPUCleanup)]
    assert ours == [ext.post_run_cell]
    ours = [f for f in shell.events.callbacks["pre_run_cell"] if isinstance(getattr(f, "__self__", None), extension.GPUCleanup)]
    assert ours == [ext.pre_run_cell]
    assert [c for c in shell.configurables if isinstance(c, extension.GPUCleanup)] == [ext]
    assert shell.magics_manager.magics["line"]["gpumem"].__self__ is ext
    closes = [e for e in gpu.endpoint.events if e[0] == "close"]
    assert len(closes) == 3  # each unload closed the endpoint it started


def test_unload_unregisters_the_same_bound_methods(shell, gpu):
    shell.run_line_magic("load_ext", "gpucleanup")
    ext = _ext(shell)
    shell.run_line_magic("unload_ext", "gpucleanup")
    assert ext.post_run_cell not in shell.events.callbacks["post_run_cell"]
    assert ext.pre_run_cell not in shell.events.callbacks["pre_run_cell"]
    assert "gpumem" not in shell.magics_manager.magics["line"]
    assert ext not in shell.configurables
    assert extension.get_extension(shell) is None
    assert gpu.endpoint.events[-1] == ("close",)
    shell.run_line_magic("load_ext", "gpucleanup")  # and it loads again
    assert _ext(shell) is not None


def test_autoload_through_config_reads_the_traits(shell, gpu):
    from traitlets.config import Config

    cfg = Config()
    cfg.GPUCleanup.gc = "never"
    cfg.GPUCleanup.settle_timeout = 5.0
    shell.config.merge(cfg)
    shell.extension_manager.load_extension("gpucleanup")  # what InteractiveShellApp.extensions does
    ext = _ext(shell)
    assert (ext.gc, ext.settle_timeout) == ("never", 5.0)


@pytest.mark.parametrize(
    "state, line",
    [
        ("no_driver", "gpucleanup · no CUDA driver found (/stand-in/libcuda.so.1): nothing to clean, no cleanup after cells\n"),
    ],
)
def test_no_driver_prints_one_line_and_costs_nothing_per_cell_stand_in(shell, stand_in, capsys, state, line):
    stand_in.native.state = state
    shell.run_line_magic("load_ext", "gpucleanup")
    assert capsys.readouterr().out == line
    calls = dict(stand_in.native.calls)
    for _ in range(3):
        _run(shell, "x = 1", capsys)
    assert dict(stand_in.native.calls) == calls  # no hook: nothing per cell
    assert capsys.readouterr().out == ""
    assert _ext(shell).post_run_cell not in shell.events.callbacks["post_run_cell"]


def test_no_gpu_prints_one_line(shell, gpu, capsys):
    gpu.fake.reset({"devices": []})
    shell.run_line_magic("load_ext", "gpucleanup")
    assert capsys.readouterr().out == "gpucleanup · no GPU on this machine: nothing to clean, no cleanup after cells\n"


def test_native_library_missing_prints_one_line(shell, gpu, monkeypatch, capsys):
    from gpucleanup import _native

    # as a fresh process that cannot find its library: the first call loads it, and dlopen fails
    with monkeypatch.context() as absent:
        absent.setenv("GPUCLEANUP_LIBRARY", "libgpucleanup-absent.so")
        absent.setattr(_native, "_lib", None)
        absent.setattr(_native, "_held", None)
        shell.run_line_magic("load_ext", "gpucleanup")
        assert capsys.readouterr().out == (
            "gpucleanup · gpucleanup's native library could not be loaded (OSError: libgpucleanup-absent.so: cannot open "
            "shared object file: No such file or directory): nothing is cleaned after cells; reinstall gpucleanup\n"
        )
        _run(shell, "x = 1", capsys)
        assert capsys.readouterr().out == ""


def test_cuda_not_initialised_costs_one_quick_call_per_cell(shell, gpu, capsys):
    gpu.fake.update({"initialized": False})
    shell.run_line_magic("load_ext", "gpucleanup")
    gpu.native.calls.clear()
    for _ in range(5):
        _, out = _run(shell, "x = 1", capsys)
        assert out.out == ""
    assert dict(gpu.native.calls) == {"cuda_initialized": 5}  # no pass, no JSON
    assert gpu.cupy.calls == {}


# ------------------------------------------------------------------ after a cell


def test_summary_line_after_a_cell(shell, gpu, capsys):
    shell.run_line_magic("load_ext", "gpucleanup")
    result, out = _run(shell, "x = 1", capsys)
    assert _lines(out.out) == [
        f"gpucleanup · GPU0 {gpu.name} · freed 4.0 GiB (cupy 3.0, driver 1.0) · pinned 1.0 GiB · kept 2.0 GiB live (cupy) · device 3.0/80.0 GiB · <t>"
    ]
    record = _ext(shell).history.last()[-1]
    assert record["cell"] == result.execution_count
    dev = record["devices"][0]
    assert dev["freed_bytes"] == {"cupy": 3 * GiB, "driver": GiB}
    assert (dev["used_before_bytes"], dev["used_after_bytes"]) == (7 * GiB, 3 * GiB)
    assert record["pinned"]["freed_bytes"] == {"cupy": GiB}
    json.dumps(record)


def test_show_auto_stays_quiet_when_nothing_changed(shell, gpu, capsys):
    shell.run_line_magic("load_ext", "gpucleanup")
    _run(shell, "x = 1", capsys)
    _, out = _run(shell, "x = 2", capsys)
    assert out.out == ""
    assert _ext(shell).history.last()[-1]["shown"] is False


def test_show_auto_prints_when_the_cell_touched_gpu_memory(shell, gpu, capsys):
    shell.run_line_magic("load_ext", "gpucleanup")
    _run(shell, "x = 1", capsys)
    gpu.device(0).used += 256 * MiB  # the cell allocated and keeps it
    shell.user_ns["grow"] = lambda: None
    gpu.cupy.live[0] += 512 * MiB  # both allocations are cupy's: nothing outside the pools
    ext = _ext(shell)
    ext.pre_run_cell(None)
    gpu.device(0).used += 256 * MiB
    ext.post_run_cell(None)
    out = capsys.readouterr().out
    assert _lines(out) == [f"gpucleanup · GPU0 {gpu.name} · freed 0 B · kept 2.5 GiB live (cupy) · device 3.5/80.0 GiB · <t>"]


def test_show_always_and_never(shell, gpu, capsys):
    shell.run_line_magic("load_ext", "gpucleanup")
    _run(shell, "x = 1", capsys)
    shell.run_line_magic("config", "GPUCleanup.show = 'always'")
    _, out = _run(shell, "x = 2", capsys)
    assert _lines(out.out) == [f"gpucleanup · GPU0 {gpu.name} · freed 0 B · kept 2.0 GiB live (cupy) · device 3.0/80.0 GiB · <t>"]
    shell.run_line_magic("config", "GPUCleanup.show = 'never'")
    gpu.cupy.cached[0] = GiB
    _, out = _run(shell, "x = 3", capsys)
    assert out.out == ""
    assert _ext(shell).history.last()[-1]["devices"][0]["freed_bytes"] == {"cupy": GiB}


def test_several_devices_one_line_each(shell, gpu, capsys):
    gpu.fake.reset({"devices": [fake_device(used=6 * GiB, pool_reserved=GiB), fake_device(used=GiB, pool_reserved=2 * GiB),
                                fake_device(active=False)]})
    shell.run_line_magic("load_ext", "gpucleanup")
    _, out = _run(shell, "x = 1", capsys)
    assert _lines(out.out) == [
        f"gpucleanup · GPU0 {gpu.name} · freed 4.0 GiB (cupy 3.0, driver 1.0) · pinned 1.0 GiB · kept 2.0 GiB live (cupy) · device 3.0/80.0 GiB · <t>",
        f"gpucleanup · GPU1 {_fake_name(1)} · freed 2.0 GiB (driver 2.0) · device 1.0/80.0 GiB · <t>",
    ]
    assert gpu.cupy.calls["drain"] == 1


def test_adapters_get_only_devices_in_use_and_only_when_ready(shell, gpu, capsys):
    seen = []
    gpu.cupy.on_drain = lambda: seen.append("drain")
    original = gpu.cupy.stats
    gpu.cupy.stats = lambda devices: (seen.append(list(devices)), original(devices))[1]
    gpu.fake.reset({"devices": [fake_device(used=6 * GiB, pool_reserved=GiB), fake_device(active=False)]})
    shell.run_line_magic("load_ext", "gpucleanup")
    _run(shell, "x = 1", capsys)
    assert [s for s in seen if isinstance(s, list)] and all(s == [0] for s in seen if isinstance(s, list))
    gpu.fake.update({"initialized": False})
    seen.clear()
    _run(shell, "x = 2", capsys)
    assert seen == []


def test_disabled_framework_is_not_called(shell, gpu, capsys):
    shell.run_line_magic("load_ext", "gpucleanup")
    _ext(shell).frameworks = {"cupy": False}
    _, out = _run(shell, "x = 1", capsys)
    assert gpu.cupy.calls == {}
    assert _lines(out.out) == [f"gpucleanup · GPU0 {gpu.name} · freed 1.0 GiB (driver 1.0) · device 6.0/80.0 GiB · <t>"]


def test_framework_that_cannot_release_is_reported_not_drained(shell, gpu, capsys):
    jax = StandInAdapter("jax", gpu.gpus, live={0: GiB}, cached={0: 4 * GiB}, can_release=False)
    gpu.adapters.append(jax)
    shell.run_line_magic("load_ext", "gpucleanup")
    _, out = _run(shell, "x = 1", capsys)
    assert jax.calls["drain"] == 0 and jax.calls["drain_pinned"] == 0
    # a pool that never gives memory back is reserved, never called cached
    assert "· reserved by jax 4.0 GiB ·" in out.out and "cached" not in out.out


def test_driver_pools_off_settles_without_any_trim(shell, gpu, capsys):
    shell.run_line_magic("load_ext", "gpucleanup")
    _ext(shell).driver_pools = False
    del gpu.native.trims[:]
    _run(shell, "x = 1", capsys)
    assert (gpu.native.calls["after_cell"], gpu.native.calls["trim"]) == (1, 0)
    assert gpu.native.trims == [False]  # the pass settles and reports the pools, trims nothing
    assert gpu.device(0).pool_reserved == GiB
    _ext(shell).driver_pools = True
    gpu.cupy.cached[0] = GiB
    _run(shell, "x = 1", capsys)
    # the pass's own trim, then the second trim after cupy gave 1 GiB back
    assert (gpu.native.calls["after_cell"], gpu.native.calls["trim"]) == (2, 1)
    assert gpu.native.trims[-1] is True
    _run(shell, "x = 1", capsys)
    # nothing given back since the pass: no second trim
    assert (gpu.native.calls["after_cell"], gpu.native.calls["trim"]) == (3, 1)


def test_pinned_release_starts_after_the_cells_last_driver_call(shell, gpu, capsys, monkeypatch):
    # A pinned free makes driver calls made meanwhile wait for it: none of this cell's
    # own calls may overlap the background release.
    shell.run_line_magic("load_ext", "gpucleanup")
    seen = []
    gpu.native.seen.append(lambda name: seen.append((name, gpu.cupy.calls["drain_pinned"]))
                           if name in ("after_cell", "trim", "snapshot", "probe") else None)
    _run(shell, "x = 1", capsys)
    _wait_pinned(shell)
    assert gpu.cupy.calls["drain_pinned"] == 1
    assert {name for name, _ in seen} >= {"after_cell", "trim"}
    assert [name for name, started in seen if started] == []


def test_pinned_off_does_not_touch_pinned_pools(shell, gpu, capsys):
    shell.run_line_magic("load_ext", "gpucleanup")
    _ext(shell).pinned = False
    _, out = _run(shell, "x = 1", capsys)
    assert gpu.cupy.calls["drain_pinned"] == 0
    assert "pinned" not in out.out


def test_pinned_release_runs_in_background_and_is_reported_next_cell(shell, gpu, capsys):
    gate = threading.Event()
    gpu.cupy.pinned_gate = gate
    shell.run_line_magic("load_ext", "gpucleanup")
    _, out = _run(shell, "x = 1", capsys)
    assert _lines(out.out) == [
        f"gpucleanup · GPU0 {gpu.name} · freed 4.0 GiB (cupy 3.0, driver 1.0) · pinned release running in background · kept 2.0 GiB live (cupy) · device 3.0/80.0 GiB · <t>"
    ]
    assert gpu.cupy.in_pinned  # the cell returned while the release runs
    gate.set()
    _wait_pinned(shell)
    _, out = _run(shell, "x = 2", capsys)
    assert _lines(out.out) == [
        f"gpucleanup · GPU0 {gpu.name} · freed 0 B · pinned 1.0 GiB freed in background · kept 2.0 GiB live (cupy) · device 3.0/80.0 GiB · <t>"
    ]
    record = _ext(shell).history.last()[-1]
    assert record["pinned"]["background"][0]["freed_bytes"] == {"cupy": GiB}
    assert record["pinned"]["background"][0]["cell"] == record["cell"] - 1


def test_pinned_release_never_overlaps_the_next_drain_of_the_same_adapter(shell, gpu, capsys):
    gate = threading.Event()
    gpu.cupy.pinned_gate = gate
    shell.run_line_magic("load_ext", "gpucleanup")
    _run(shell, "x = 1", capsys)
    gpu.cupy.cached[0] = GiB
    _, out = _run(shell, "x = 2", capsys)
    assert gpu.cupy.overlaps == 0
    assert gpu.cupy.calls["drain"] == 1  # skipped this time, not run beside the pinned release
    assert gpu.cupy.calls["drain_pinned"] == 1  # and no second pinned job started
    assert "cupy: pinned release of an earlier cell still running" in out.out
    gate.set()
    _wait_pinned(shell)
    _run(shell, "x = 3", capsys)
    assert gpu.cupy.calls["drain"] == 2 and gpu.cupy.overlaps == 0


def _busy_line(gpu, limit_ms, used="7.0"):
    """The line of a device that stayed busy for the whole settle: the wait is measured (at least the limit)."""
    return re.compile(rf"gpucleanup · GPU0 {re.escape(gpu.name)} · busy after (\d+) ms: skipped freeing, queued work "
                      rf"keeps running · device {used}/80.0 GiB · <t>"), limit_ms


def _is_busy_line(line, expected):
    pattern, limit_ms = expected
    waited = pattern.fullmatch(line)
    return waited is not None and int(waited.group(1)) >= limit_ms


def test_busy_device_is_skipped_and_the_line_says_so(shell, gpu, capsys):
    gpu.fake.update({"devices": [{"sync_seconds": -1}]})  # its queued work never finishes
    shell.run_line_magic("load_ext", "gpucleanup")
    _ext(shell).settle_timeout = 0.1
    _, out = _run(shell, "x = 1", capsys)
    (line,) = _lines(out.out)
    assert _is_busy_line(line, _busy_line(gpu, 100)), line
    assert gpu.cupy.calls["drain"] == 0 and gpu.cupy.calls["drain_pinned"] == 0


def test_progress_line_while_the_settle_waits_stand_in(shell, stand_in, capsys):
    stand_in.native.progress = [{"device": 0, "waited_s": 2.0, "limit_s": 30}, {"device": 0, "waited_s": 3.0, "limit_s": 30}]
    shell.run_line_magic("load_ext", "gpucleanup")
    _, out = _run(shell, "x = 1", capsys)
    assert out.out.startswith(
        "gpucleanup · waiting for GPU0 to finish queued work … 2 s\rgpucleanup · waiting for GPU0 to finish queued work … 3 s\n"
    )


def test_keyboard_interrupt_during_the_settle_stops_the_drain_and_says_so_stand_in(shell, stand_in, capsys):
    stand_in.native.progress = [{"device": 0, "waited_s": 2.0, "limit_s": 30}]
    stand_in.native.interrupt_at_progress = True
    shell.run_line_magic("load_ext", "gpucleanup")
    result, out = _run(shell, "x = 41 + 1", capsys)
    assert result.success and shell.user_ns["x"] == 42
    assert _lines(out.out)[-1] == "gpucleanup · GPU0 H100 · interrupted (Ctrl-C): cleanup stopped, nothing more freed · device 7.0/80.0 GiB · <t>"
    assert stand_in.cupy.calls["drain"] == 0
    assert _ext(shell).history.last()[-1]["interrupted"] is True


def test_keyboard_interrupt_in_a_framework_drain_stops_the_rest(shell, gpu, capsys):
    torch = StandInAdapter("torch", gpu.gpus, cached={0: GiB})
    gpu.adapters.append(torch)
    gpu.cupy.fail["drain"] = KeyboardInterrupt()
    shell.run_line_magic("load_ext", "gpucleanup")
    result, out = _run(shell, "x = 1", capsys)
    assert result.success
    assert torch.calls["drain"] == 0
    assert "interrupted (Ctrl-C): cleanup stopped" in out.out
    assert "Traceback" not in out.out + out.err


def test_hook_never_raises_and_leaves_the_users_error_and_result_alone(shell, gpu, capsys):
    shell.run_line_magic("load_ext", "gpucleanup")
    gpu.native.fail["drain"] = RuntimeError("[gpucleanup.api.999] boom")
    gpu.native.fail["snapshot"] = RuntimeError("[gpucleanup.api.998] boom")
    gpu.cupy.fail["stats"] = ValueError("stats broke")
    result, out = _run(shell, "1 / 0", capsys)
    assert isinstance(result.error_in_exec, ZeroDivisionError)
    assert isinstance(sys.last_value, ZeroDivisionError)
    assert sys.last_value is result.error_in_exec
    assert "ZeroDivisionError" in out.out + out.err
    result, out = _run(shell, "6 * 7", capsys)
    assert result.result == 42 and shell.user_ns["_"] == 42 and shell.user_ns["Out"][result.execution_count] == 42
    assert isinstance(sys.last_value, ZeroDivisionError)  # still the user's, not ours


def test_one_warning_per_kind_of_failure_not_per_cell(shell, gpu, capsys):
    gpu.cupy.fail["drain"] = RuntimeError("cudaErrorMemoryAllocation")
    shell.run_line_magic("load_ext", "gpucleanup")
    outputs = []
    for i in range(4):
        gpu.device(0).pool_reserved = GiB
        outputs.append(_run(shell, f"x = {i}", capsys)[1].out)
    text = "".join(outputs)
    assert text.count("gpucleanup · cupy.drain failed: RuntimeError: cudaErrorMemoryAllocation") == 1
    assert all("cupy.drain failed" in r["notes"][0] for r in _ext(shell).history.last()[-4:])


def test_post_run_cell_none_and_pre_run_cell_none_are_handled(shell, gpu, capsys):
    shell.run_line_magic("load_ext", "gpucleanup")
    ext = _ext(shell)
    ext.pre_run_cell(None)
    ext.post_run_cell(None)
    out = capsys.readouterr().out
    assert _lines(out)[0].startswith(f"gpucleanup · GPU0 {gpu.name} · freed 4.0 GiB")
    assert ext.history.last()[-1]["cell"] is None
    ext.post_run_cell()  # no argument at all, as old IPython versions call it
    assert "Error" not in capsys.readouterr().out


def test_silent_executions_are_not_cleaned(shell, gpu, capsys):
    shell.run_line_magic("load_ext", "gpucleanup")
    gpu.native.calls.clear()
    shell.run_cell("x = 1", silent=True)
    assert gpu.native.calls == {}
    result = types.SimpleNamespace(info=types.SimpleNamespace(silent=True), execution_count=None)
    _ext(shell).post_run_cell(result)
    assert gpu.native.calls == {}
    assert capsys.readouterr().out == ""


def _a_device_of_its_own(gpu):
    """GPU0 under a UUID no other test uses. The library remembers a sticky error for the device's life, by UUID:
    the next tests' GPU0 is not the one this test leaves unusable. Its quiet check keeps the first enumeration it
    saw (UUIDs included): one pass first, so that it is not this device's."""
    from gpucleanup import _native

    _native.trim()
    gpu.fake.reset({"devices": [fake_device(used=6 * GiB, pool_reserved=GiB, uuid=f"GPU-{uuid.uuid4()}")]})


def test_sticky_error_is_said_once_then_the_device_is_left_alone(shell, gpu, capsys):
    _a_device_of_its_own(gpu)
    shell.run_line_magic("load_ext", "gpucleanup")
    gpu.fake.update({"devices": [{"sticky_error": 700}]})  # CUDA_ERROR_ILLEGAL_ADDRESS
    _, out = _run(shell, "x = 1", capsys)
    assert out.out == "gpucleanup · GPU0 is unusable after CUDA_ERROR_ILLEGAL_ADDRESS: restart the kernel\n"
    assert gpu.cupy.calls["drain"] == 0
    for i in range(3):
        _, out = _run(shell, f"x = {i}", capsys)
        assert out.out == ""
    assert gpu.cupy.calls["drain"] == 0 and gpu.cupy.calls["stats"] == 0


def test_sticky_error_is_said_even_with_show_never(shell, gpu, capsys):
    _a_device_of_its_own(gpu)
    shell.run_line_magic("load_ext", "gpucleanup")
    shell.run_line_magic("config", "GPUCleanup.show = 'never'")
    gpu.fake.update({"devices": [{"sticky_error": 700}]})  # CUDA_ERROR_ILLEGAL_ADDRESS
    _, out = _run(shell, "x = 1", capsys)
    assert out.out == "gpucleanup · GPU0 is unusable after CUDA_ERROR_ILLEGAL_ADDRESS: restart the kernel\n"


def test_unraisable_tracebacks_during_a_drain_are_captured_in_one_line(shell, gpu, capsys):
    class Memory:
        def __del__(self):
            raise RuntimeError("cudaErrorIllegalAddress: an illegal memory access was encountered")

    def free_blocks():
        for _ in range(3):
            Memory()  # each __del__ raises: CPython reports it through sys.unraisablehook

    gpu.cupy.on_drain = free_blocks
    shell.run_line_magic("load_ext", "gpucleanup")
    hook = sys.unraisablehook
    _, out = _run(shell, "x = 1", capsys)
    assert sys.unraisablehook is hook
    assert "Exception ignored" not in out.err
    assert "gpucleanup · 3 tracebacks from cupy while freeing captured (first: RuntimeError: cudaErrorIllegalAddress: an illegal memory access was encountered)" in out.out
    assert len(_ext(shell).history.last()[-1]["unraisable"]) == 3


def test_unraisable_from_other_threads_still_reach_the_previous_hook(shell, gpu, capsys):
    seen = []
    ext = extension.GPUCleanup(shell=shell, adapters=None, status_endpoint=None)
    saved = sys.unraisablehook
    sys.unraisablehook = seen.append
    try:
        with ext.engine.releases.unraisables.capture() as captured:
            worker = threading.Thread(target=lambda: sys.unraisablehook(types.SimpleNamespace(exc_type=ValueError)))
            worker.start()
            worker.join()
        assert captured == [] and len(seen) == 1
        assert sys.unraisablehook == seen.append
    finally:
        sys.unraisablehook = saved
        shell.configurables.remove(ext)


# ------------------------------------------------------------------ garbage policy


@pytest.fixture
def collects(monkeypatch):
    calls = []
    monkeypatch.setattr(gc, "collect", lambda generation=2: calls.append(generation) or 0)
    return calls


def test_gc_auto_skips_collection_when_no_gpu_object_is_live(shell, gpu, collects, capsys):
    gpu.cupy.live = {}
    shell.run_line_magic("load_ext", "gpucleanup")
    _run(shell, "x = 1", capsys)  # not known yet: a young collection (cheaper than reading to decide)
    assert collects == [1]
    collects.clear()
    _run(shell, "y = 1", capsys)
    _run(shell, "del y", capsys)
    assert collects == []  # nothing live, no cache kept, nothing changed since


def test_gc_auto_young_collection_only_when_nothing_was_unbound(shell, gpu, collects, capsys):
    shell.run_line_magic("load_ext", "gpucleanup")
    _run(shell, "x = 1", capsys)
    collects.clear()
    _run(shell, "y = 2", capsys)
    assert collects == [1]
    assert _ext(shell).history.last()[-1]["gc"]["ran"] == "young"


def _stand_in_holders(shell, names=("x",)):
    """The stand-in adapters' memory is held by these names, as the namespace walk would find."""
    walks = []

    def walk(namespace):
        walks.append(len(namespace))
        return {n: id(namespace[n]) for n in names if n in namespace}

    _ext(shell).engine.since.holders = after_cell.GpuHolders(walk=walk)
    return walks


def test_gc_auto_full_collection_when_the_cell_deleted_a_name_that_held_gpu_memory(shell, gpu, collects, capsys):
    shell.run_line_magic("load_ext", "gpucleanup")
    _stand_in_holders(shell)
    _run(shell, "x = 1", capsys)
    collects.clear()
    _run(shell, "del x", capsys)
    assert collects == [1, 2]
    assert _ext(shell).history.last()[-1]["gc"]["ran"] == "full"


def test_gc_auto_deleting_a_name_that_held_no_gpu_memory_is_a_young_collection(shell, gpu, collects, capsys):
    shell.run_line_magic("load_ext", "gpucleanup")
    _stand_in_holders(shell)
    _run(shell, "x = 1; y = 2", capsys)
    collects.clear()
    _run(shell, "del y", capsys)
    assert collects == [1]


def test_namespace_is_walked_only_when_live_gpu_memory_grows(shell, gpu, capsys):
    shell.run_line_magic("load_ext", "gpucleanup")
    walks = _stand_in_holders(shell)
    for i in range(50):
        shell.user_ns[f"name{i}"] = i  # the namespace grows, GPU memory does not
        _run(shell, f"x = 1", capsys)
    assert len(walks) == 1  # the first cell: nothing known yet
    gpu.cupy.live[0] += GiB  # a cell made new GPU objects: the last walk cannot explain them
    _run(shell, "x = 1", capsys)
    assert len(walks) == 2
    gpu.cupy.live[0] -= GiB  # memory given back: nothing new to find
    _run(shell, "x = 1", capsys)
    assert len(walks) == 2
    for i in range(50):
        shell.user_ns.pop(f"name{i}", None)


def test_gc_auto_no_full_collection_when_the_young_one_released_everything(shell, gpu, monkeypatch, capsys):
    calls = []

    def collect(generation=2):
        calls.append(generation)
        gpu.cupy.live = {}  # the young collection freed the cycle that held the memory
        return 1

    monkeypatch.setattr(gc, "collect", collect)
    shell.run_line_magic("load_ext", "gpucleanup")
    _stand_in_holders(shell)
    _run(shell, "x = 1", capsys)
    calls.clear()
    gpu.cupy.live = {0: GiB}
    gpu.device(0).used += GiB  # allocated from the driver: the pass sees the change
    _run(shell, "del x", capsys)
    assert calls == [1]


def test_gc_always_and_never(shell, gpu, collects, capsys):
    gpu.cupy.live = {}
    shell.run_line_magic("load_ext", "gpucleanup")
    shell.run_line_magic("config", "GPUCleanup.gc = 'always'")
    _run(shell, "x = 1", capsys)
    assert collects == [2]
    shell.run_line_magic("config", "GPUCleanup.gc = 'never'")
    gpu.cupy.live = {0: GiB}
    _run(shell, "del x", capsys)
    assert collects == [2]


def test_gc_really_releases_a_gpu_object_held_in_a_cycle(shell, gpu, capsys):
    """End to end with the real gc: a cycle holding a (stand-in) GPU buffer is collected after `del`."""
    shell.run_line_magic("load_ext", "gpucleanup")
    _stand_in_holders(shell)
    live = gpu.cupy.live
    shell.run_cell(textwrap.dedent("""
        class Node:
            pass
        x = Node(); x.self = x
    """), store_history=True)
    import weakref

    ref = weakref.ref(shell.user_ns["x"])
    ref().__class__.__del__ = lambda self: live.pop(0, None)  # "frees the GPU buffer"
    gc.collect()  # promote it to the oldest generation, as a long cell would
    capsys.readouterr()
    _run(shell, "del x", capsys)
    assert ref() is None and 0 not in live


# ------------------------------------------------------------------ history and status endpoint


def test_history_is_bounded_by_history_size(shell, gpu, capsys):
    shell.run_line_magic("load_ext", "gpucleanup")
    shell.run_line_magic("config", "GPUCleanup.history_size = 3")
    for i in range(5):
        gpu.cupy.live[0] += 64 * MiB  # each cell allocates: none is an idle cell (those add no record)
        gpu.device(0).used += 64 * MiB
        _run(shell, f"x = {i}", capsys)
    records = _ext(shell).history.last()
    assert len(records) == 3
    assert [r["cell"] for r in records] == sorted(r["cell"] for r in records)
    _run(shell, "x = 5", capsys)  # an idle cell: no record
    assert _ext(shell).history.last() == records and _ext(shell).engine.since.skipped == 1


def test_status_endpoint_sees_running_draining_idle_and_each_record(shell, gpu, capsys):
    shell.run_line_magic("load_ext", "gpucleanup")
    ext = _ext(shell)
    assert gpu.endpoint.events[0] == ("start", shell)
    del gpu.endpoint.events[:]
    result, _ = _run(shell, "x = 1", capsys)
    kinds = [(e[0], e[1].get("state")) if e[0] == "set_state" else (e[0],) for e in gpu.endpoint.events]
    assert kinds == [("set_state", "running"), ("set_state", "draining"), ("publish",), ("set_state", "idle")]
    assert gpu.endpoint.events[0][1]["cell"] == result.execution_count
    published = dict(gpu.endpoint.events[2][1])
    assert published.pop("totals") == ext.totals.as_dict()  # the published copy adds the cumulative totals
    assert published == ext.history.last()[-1]
    shell.run_line_magic("unload_ext", "gpucleanup")
    assert gpu.endpoint.events[-1] == ("close",)


def test_status_endpoint_state_at_load_is_idle_outside_a_cell_and_running_inside_one(shell, gpu, capsys):
    # as from c.InteractiveShellApp.extensions at start-up: no cell runs
    shell.extension_manager.load_extension("gpucleanup")
    assert gpu.endpoint.events[0] == ("start", shell)
    assert gpu.endpoint.events[1][0] == "set_state" and gpu.endpoint.events[1][1]["state"] == "idle"
    shell.extension_manager.unload_extension("gpucleanup")
    del gpu.endpoint.events[:]
    # %load_ext in a cell: that cell is running until its end says idle
    result, _ = _run(shell, "%load_ext gpucleanup", capsys)
    states = [e[1] for e in gpu.endpoint.events if e[0] == "set_state"]
    assert states[0]["state"] == "running" and states[0]["cell"] == result.execution_count
    assert states[-1]["state"] == "idle"


def test_status_endpoint_is_closed_at_exit_and_no_driver_call_after(shell, gpu, capsys):
    shell.run_line_magic("load_ext", "gpucleanup")
    ext = _ext(shell)
    ext._at_exit()
    assert gpu.endpoint.events[-1] == ("close",)
    gpu.native.calls.clear()
    _run(shell, "x = 1", capsys)
    assert gpu.native.calls == {}


def test_status_endpoint_failures_never_reach_the_cell(shell, gpu, capsys):
    gpu.endpoint.set_state = lambda state: 1 / 0
    shell.run_line_magic("load_ext", "gpucleanup")
    result, out = _run(shell, "x = 1", capsys)
    assert result.success
    assert out.out.count("status endpoint failed (ZeroDivisionError") == 1


def test_status_endpoint_module_absent_is_skipped_silently(shell, gpu, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "gpucleanup.in_kernel.status_endpoint", None)  # import raises ModuleNotFoundError
    shell.run_line_magic("load_ext", "gpucleanup")
    assert _ext(shell)._endpoint is None
    assert capsys.readouterr().out == ""


def test_status_server_off_starts_no_endpoint(shell, gpu):
    from traitlets.config import Config

    cfg = Config()
    cfg.GPUCleanup.status_server = False
    shell.config.merge(cfg)
    shell.run_line_magic("load_ext", "gpucleanup")
    assert gpu.endpoint.events == []


def test_enabled_false_does_nothing_per_cell(shell, gpu, capsys):
    shell.run_line_magic("load_ext", "gpucleanup")
    _ext(shell).enabled = False
    gpu.native.calls.clear()
    _run(shell, "x = 1", capsys)
    assert gpu.native.calls == {}


# ------------------------------------------------------------------ with the fake CUDA driver


def test_fake_driver_summary_line(shell, real, fake_cuda, capsys):
    fake_cuda.reset({"devices": [{"name": "Fake H100", "primary_active": True, "default_pool": {"reserved_bytes": GiB, "used_bytes": 0}}]})
    shell.run_line_magic("load_ext", "gpucleanup")
    _, out = _run(shell, "x = 1", capsys)
    assert _lines(out.out) == [f"gpucleanup · GPU0 {_fake_name()} · freed 1.0 GiB (driver 1.0) · device 0.5/80.0 GiB · <t>"]
    assert fake_cuda.counter("cuInit") == 0 and fake_cuda.counter("contexts_created") == 0
    assert fake_cuda.counter("calls.cuMemPoolTrimTo") >= 1
    _, out = _run(shell, "x = 2", capsys)
    assert out.out == ""


def test_fake_driver_not_initialised_one_probe_per_cell_and_no_cuinit(shell, real, fake_cuda, capsys):
    fake_cuda.reset({"initialized": False})
    shell.run_line_magic("load_ext", "gpucleanup")
    assert capsys.readouterr().out == ""
    real.calls.clear()
    counted = fake_cuda.counter("calls.cuDeviceGetCount")
    for i in range(10):
        _, out = _run(shell, f"x = {i}", capsys)
        assert out.out == ""
    assert dict(real.calls) == {"cuda_initialized": 10}  # one native call per cell, no JSON
    assert fake_cuda.counter("calls.cuDeviceGetCount") - counted == 10  # and one driver call in it
    assert fake_cuda.counter("cuInit") == 0 and fake_cuda.counter("contexts_created") == 0


def test_fake_driver_inactive_device_is_not_touched(shell, real, fake_cuda, capsys):
    fake_cuda.reset({"devices": [{"primary_active": False}]})
    shell.run_line_magic("load_ext", "gpucleanup")
    _, out = _run(shell, "x = 1", capsys)
    assert out.out == ""
    assert fake_cuda.counter("contexts_created") == 0 and fake_cuda.counter("calls.cuMemPoolTrimTo") == 0


def test_fake_driver_hanging_device_returns_at_the_limit(shell, real, fake_cuda, capsys):
    fake_cuda.reset({"devices": [{"name": "Fake H100", "primary_active": True, "sync_seconds": -1}]})
    shell.run_line_magic("load_ext", "gpucleanup")
    shell.run_line_magic("config", "GPUCleanup.settle_timeout = 0.3")
    try:
        # the fake's synchronize never returns: the cell returning at all is the bound
        _, out = _run(shell, "x = 1", capsys)
        (line,) = _lines(out.out)
        waited = re.fullmatch(
            rf"gpucleanup · GPU0 {re.escape(_fake_name())} · busy after (\d+) ms: skipped freeing, queued work keeps running · device 0.5/80.0 GiB · <t>",
            line,
        )
        assert waited is not None, line
        assert int(waited.group(1)) >= 300  # the wait is measured: at least the limit, never an exact figure
        _, out = _run(shell, "x = 2", capsys)
        assert re.fullmatch(rf"gpucleanup · GPU0 {re.escape(_fake_name())} · still busy with queued work \(\d+ ms\): skipped, nothing freed · device 0.5/80.0 GiB · <t>", _lines(out.out)[0])
    finally:
        _settled(fake_cuda)


def test_fake_driver_progress_line_after_two_seconds(shell, real, fake_cuda, capsys):
    fake_cuda.reset({"devices": [{"name": "Fake H100", "primary_active": True, "sync_seconds": -1}]})
    shell.run_line_magic("load_ext", "gpucleanup")
    shell.run_line_magic("config", "GPUCleanup.settle_timeout = 2.5")
    try:
        _, out = _run(shell, "x = 1", capsys)
        assert out.out.startswith("gpucleanup · waiting for GPU0 to finish queued work … 2 s\n")
        waited = re.fullmatch(
            rf"gpucleanup · GPU0 {re.escape(_fake_name())} · busy after ([0-9.]+) s: skipped freeing, queued work keeps running · device 0.5/80.0 GiB · <t>",
            _lines(out.out)[-1],
        )
        assert waited is not None and float(waited.group(1)) >= 2.5, out.out
    finally:
        _settled(fake_cuda)


def test_fake_driver_status_endpoint_says_which_gpu_the_cell_waits_for(shell, real, fake_cuda, monkeypatch, capsys):
    endpoint = StandInEndpoint()
    _inject(monkeypatch, (), lambda: endpoint)
    fake_cuda.reset({"devices": [{"name": "Fake H100", "primary_active": True, "sync_seconds": -1}]})
    shell.run_line_magic("load_ext", "gpucleanup")
    shell.run_line_magic("config", "GPUCleanup.settle_timeout = 2.5")
    del endpoint.events[:]
    try:
        result, _ = _run(shell, "x = 1", capsys)
        states = [e[1] for e in endpoint.events if e[0] == "set_state"]
        waiting = [s for s in states if s["state"] == "waiting"]
        # the wait is inside the one native pass; "draining" is the frameworks' turn after it
        assert [s["state"] for s in states] == ["running"] + ["waiting"] * len(waiting) + ["draining", "idle"]
        assert len(waiting) >= 1
        assert all(s["device"] == 0 and s["cell"] == result.execution_count for s in waiting)
        # since_ns is when the wait began (after the cell started), not when the progress report came
        running = states[0]
        assert all(s["since_ns"] >= running["since_ns"] for s in waiting)
    finally:
        _settled(fake_cuda)


def test_fake_driver_ctrl_c_during_the_settle_stops_it(shell, real, fake_cuda, capsys):
    import _thread

    fake_cuda.reset({"devices": [{"name": "Fake H100", "primary_active": True, "sync_seconds": -1}]})
    shell.run_line_magic("load_ext", "gpucleanup")
    shell.run_line_magic("config", "GPUCleanup.settle_timeout = 20")
    ext = _ext(shell)
    try:
        ext.pre_run_cell(None)
        done = threading.Event()

        def ctrl_c_once_waiting():  # Ctrl-C while the native wait runs (not before it: that is another line)
            while fake_cuda.counter("syncs_in_flight") < 1 and not done.is_set():
                time.sleep(0.01)
            if not done.is_set():
                _thread.interrupt_main()

        sender = threading.Thread(target=ctrl_c_once_waiting)
        sender.start()
        try:
            ext.post_run_cell(None)  # the fake never finishes: returning at all means the Ctrl-C stopped the wait
        finally:
            done.set()
            sender.join()
        out = capsys.readouterr().out
        assert f"gpucleanup · GPU0 {_fake_name()} · interrupted (Ctrl-C): cleanup stopped, nothing more freed" in out
        assert ext.history.last()[-1]["interrupted"] is True
    finally:
        _settled(fake_cuda)


def test_fake_driver_sticky_error_said_once_in_a_fresh_process(fake_cuda, tmp_path):
    """The native library remembers a sticky error for the process's life, so this runs in its own."""
    scenario = {"devices": [{"name": "Fake H100", "primary_active": True, "sticky_error": 700}]}
    script = textwrap.dedent(
        """
        from IPython.core.interactiveshell import InteractiveShell
        ip = InteractiveShell.instance()
        ip.run_line_magic("load_ext", "gpucleanup")
        ip.run_line_magic("config", "GPUCleanup.status_server = False")
        for i in range(3):
            ip.run_cell(f"x = {i}", store_history=True)
        print("done")
        """
    )
    env = dict(os.environ, GPUCLEANUP_FAKE_CUDA_SCENARIO=json.dumps(scenario), PYTHONPATH=os.path.join(ROOT, "ipython_ext"))
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout == "gpucleanup · GPU0 is unusable after CUDA_ERROR_ILLEGAL_ADDRESS: restart the kernel\ndone\n"


def test_adapter_notes_are_named_after_their_adapter_once():
    assert after_cell.adapter_note("cupy", "[gpucleanup.cupy.204] GPU0: cleared cupy's FFT plan cache") == \
        "[gpucleanup.cupy.204] GPU0: cleared cupy's FFT plan cache"
    assert after_cell.adapter_note("cupy", "pool busy") == "cupy: pool busy"
    assert after_cell.adapter_note("torch", "[gpucleanup.cupy.204] x") == "torch: [gpucleanup.cupy.204] x"


def test_a_library_that_is_not_a_cuda_driver_is_named_not_the_native_library(tmp_path):
    # GPUCLEANUP_LIBCUDA=libc.so.6: gpucleanup's own library is fine, the "driver" is not one
    script = textwrap.dedent(
        """
        from IPython.core.interactiveshell import InteractiveShell
        ip = InteractiveShell.instance()
        ip.run_line_magic("load_ext", "gpucleanup")
        ip.run_line_magic("gpumem", "--off")
        """
    )
    env = dict(os.environ, GPUCLEANUP_LIBCUDA="libc.so.6", IPYTHONDIR=str(tmp_path))
    env.pop("GPUCLEANUP_FAKE_CUDA_SCENARIO", None)
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [
        "gpucleanup · [gpucleanup.driver.107] libc.so.6 is not a CUDA driver: it exports none of the driver's entry "
        "points (cuDeviceGetCount, cuMemGetInfo, ...): point GPUCLEANUP_LIBCUDA at the NVIDIA driver's libcuda.so.1, "
        "or unset it: no cleanup after cells",
        "gpucleanup · no cleanup runs after cells in this kernel (the CUDA driver is unusable): nothing to pause",
    ]


# ------------------------------------------------------------------ a newcomer's first hour


def test_progress_line_is_closed_even_when_nothing_was_freed_stand_in(shell, stand_in, capsys):
    # show = "auto" would stay quiet after a cell that freed nothing: not after a progress line
    stand_in.native.device(0).pool_reserved = 0
    stand_in.cupy.cached[0] = 0
    stand_in.cupy.pinned_cached = 0
    shell.run_line_magic("load_ext", "gpucleanup")
    _run(shell, "x = 1", capsys)
    stand_in.native.progress = [{"device": 0, "waited_s": 2.0, "limit_s": 30}, {"device": 0, "waited_s": 5.0, "limit_s": 30}]
    _, out = _run(shell, "x = 2", capsys)
    lines = out.out.split("\n")
    assert lines[0].endswith("gpucleanup · waiting for GPU0 to finish queued work … 5 s")
    assert _lines(lines[1]) == ["gpucleanup · GPU0 H100 · freed 0 B · kept 2.0 GiB live (cupy) · device 6.0/80.0 GiB · <t>"]
    assert lines[2:] == [""]


def test_running_cell_number_follows_the_ipython_version(monkeypatch):
    import IPython

    from gpucleanup.in_kernel import cell_state

    shell = types.SimpleNamespace(execution_count=8)
    stored = types.SimpleNamespace(store_history=True)
    unstored = types.SimpleNamespace(store_history=False)

    def on(version):  # the answer is kept for the process: forget it for each version tried
        monkeypatch.setattr(IPython, "version_info", version)
        cell_state._counts_before_pre_run_cell.cache_clear()

    try:
        on((8, 12, 3, ""))
        assert cell_state.running_cell_number(shell, stored) == 8  # counted after the cell
        on((9, 7, 0, ""))
        assert cell_state.running_cell_number(shell, stored) == 8
        on((9, 8, 0, ""))
        assert cell_state.running_cell_number(shell, stored) == 7  # counted before pre_run_cell
        assert cell_state.running_cell_number(shell, unstored) == 8  # a cell kept out of the history is not counted
        assert cell_state.running_cell_number(types.SimpleNamespace(execution_count=None), stored) is None
    finally:
        cell_state._counts_before_pre_run_cell.cache_clear()  # the real IPython's answer for the tests after


def test_status_endpoint_keeps_as_many_records_as_the_history(shell, gpu, monkeypatch):
    made = []

    def factory(**options):
        made.append(options)
        return StandInEndpoint()

    _inject(monkeypatch, gpu.adapters, factory)
    shell.run_line_magic("load_ext", "gpucleanup")
    assert made == [{"history_limit": 100, "max_peers": 64}]
    first = _ext(shell)._endpoint
    shell.run_line_magic("config", "GPUCleanup.history_size = 7")
    assert made == [{"history_limit": 100, "max_peers": 64}, {"history_limit": 7, "max_peers": 64}]
    assert first.events[-1] == ("close",) and _ext(shell)._endpoint is not first


def test_gpumem_drain_in_a_cell_says_one_line_and_keeps_one_record(shell, gpu, capsys):
    shell.run_line_magic("load_ext", "gpucleanup")
    shell.run_line_magic("config", "GPUCleanup.show = 'always'")
    _run(shell, "x = 1", capsys)
    before = len(_ext(shell).history.last())
    _, out = _run(shell, "%gpumem --drain", capsys)
    assert len(_lines(out.out)) == 1
    assert len(_ext(shell).history.last()) == before + 1


def test_gpumem_drain_of_a_busy_device_says_it_once_and_waits_once(shell, gpu, capsys):
    shell.run_line_magic("load_ext", "gpucleanup")
    shell.run_line_magic("config", "GPUCleanup.settle_timeout = 0.1")
    _run(shell, "x = 1", capsys)  # 3 GiB left on the device
    gpu.fake.update({"devices": [{"sync_seconds": -1}]})  # then work is queued that never finishes
    before = len(_ext(shell).history.last())
    gpu.native.trims.clear()
    _, out = _run(shell, "%gpumem --drain", capsys)
    (line,) = _lines(out.out)
    assert _is_busy_line(line, _busy_line(gpu, 100, used="3.0")), line
    assert len(_ext(shell).history.last()) == before + 1
    # the after-cell pass did not wait a second time for the device the magic waited for
    assert len(gpu.native.trims) == 2


def test_gpumem_drain_then_more_work_in_the_same_cell_is_still_cleaned(shell, gpu, capsys):
    shell.run_line_magic("load_ext", "gpucleanup")
    _run(shell, "x = 1", capsys)
    cell = "%gpumem --drain\nget_ipython().user_ns['_gpus'].device(0).pool_reserved = 1 << 30"
    shell.user_ns["_gpus"] = gpu.gpus
    try:
        _, out = _run(shell, cell, capsys)
    finally:
        shell.user_ns.pop("_gpus", None)
    lines = _lines(out.out)
    assert len(lines) == 2 and "freed 1.0 GiB (driver 1.0)" in lines[1]


def test_a_drain_from_outside_never_makes_the_cell_wait(shell, gpu, capsys):
    from gpucleanup._native import NativeError

    shell.run_line_magic("load_ext", "gpucleanup")
    _run(shell, "x = 1", capsys)
    busy = NativeError(6, "[gpucleanup.api.111] a drain asked for with gpucleanup drain is still finishing: this call "
                          "was skipped so that the kernel does not wait for it; the next one runs as usual")
    for name in ("after_cell", "trim", "snapshot", "probe"):
        gpu.native.fail[name] = busy
    result, out = _run(shell, "x = 2", capsys)
    assert result.success
    assert out.out == f"gpucleanup · {busy}\n"  # no "snapshot before the cell failed", no "cleanup failed"
    gpu.native.fail.clear()
    _, out = _run(shell, "x = 3", capsys)
    assert out.out == ""  # the next cell runs as usual


class _InterruptedOnce(StandInEndpoint):
    """Ctrl-C arrives while the pre-cell hook tells the endpoint that a cell runs."""

    def __init__(self):
        super().__init__()
        self.armed = False

    def set_state(self, state):
        if self.armed and state.get("state") == "running":
            self.armed = False
            raise KeyboardInterrupt
        super().set_state(state)


def test_ctrl_c_during_the_pre_cell_hook_stops_the_cell(shell, gpu, monkeypatch, capsys):
    endpoint = _InterruptedOnce()
    _inject(monkeypatch, gpu.adapters, lambda: endpoint)
    shell.run_line_magic("load_ext", "gpucleanup")
    _run(shell, "x = 1", capsys)
    endpoint.armed = True
    result, out = _run(shell, "x = 2", capsys)
    # the interrupt reached the cell: it stopped before its first statement, as after any Ctrl-C
    assert isinstance(result.error_in_exec, KeyboardInterrupt)
    assert shell.user_ns["x"] == 1
    assert "Error in callback" not in out.out
    result, _ = _run(shell, "x = 3", capsys)
    assert result.success and shell.user_ns["x"] == 3


def test_the_interrupt_transformer_is_set_only_for_an_interrupted_cell(shell, gpu, monkeypatch, capsys):
    endpoint = _InterruptedOnce()
    _inject(monkeypatch, gpu.adapters, lambda: endpoint)
    before = list(shell.ast_transformers)
    shell.run_line_magic("load_ext", "gpucleanup")
    _run(shell, "x = 1", capsys)
    assert shell.ast_transformers == before
    endpoint.armed = True
    _run(shell, "x = 2", capsys)
    assert shell.ast_transformers == before  # gone again after that cell
    shell.run_line_magic("unload_ext", "gpucleanup")
    assert shell.ast_transformers == before


def test_every_kept_record_matches_its_schema(shell, gpu, schemas, capsys):
    shell.run_line_magic("load_ext", "gpucleanup")
    _run(shell, "x = 1", capsys)
    shell.run_line_magic("config", "GPUCleanup.settle_timeout = 0.1")
    gpu.fake.update({"devices": [{"sync_seconds": -1}]})  # busy
    _run(shell, "x = 2", capsys)
    gpu.fake.update({"devices": [{"sync_seconds": 0}]})
    _settled(gpu.fake)
    _run(shell, "%gpumem --drain", capsys)
    records = _ext(shell).history.last()
    assert len(records) >= 3
    for record in records:
        schemas["cell_record.schema.json"].validate(record)
    published = [e[1] for e in gpu.endpoint.events if e[0] == "publish"]
    for record in published:
        schemas["cell_record.schema.json"].validate(record)
    # the published copy is the kept record plus the cumulative totals (gpucleanup.records.totals)
    assert [{k: v for k, v in p.items() if k != "totals"} for p in published] == records[-len(published):]


def test_the_engine_imports_nothing_from_ipython():
    import subprocess as sp

    code = ("import sys, gpucleanup.engine.after_cell, gpucleanup.records.record, gpucleanup.frameworks; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('IPython', 'traitlets', 'ipykernel')))")
    done = sp.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                  env=dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.join(ROOT, "ipython_ext"), os.environ.get("PYTHONPATH", "")])))
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


# ------------------------------------------------------------------ release policy


def _idle_job_done(shell):
    job = _ext(shell).engine.releases.idle_job
    assert job is not None
    assert job.done.wait(30)
    return job


def test_release_idle_keeps_the_caches_for_the_next_cell_and_gives_them_back_when_idle(shell, gpu, capsys):
    shell.run_line_magic("load_ext", "gpucleanup")
    _run(shell, "x = 1", capsys)
    gpu.cupy.cached[0] = GiB
    shell.run_line_magic("config", "GPUCleanup.release = 'idle'")
    # long enough that the release cannot come before the line is read, even on a loaded machine
    shell.run_line_magic("config", "GPUCleanup.idle_release_s = 2")
    shell.run_line_magic("config", "GPUCleanup.show = 'always'")
    drains = gpu.cupy.calls["drain"]
    _, out = _run(shell, "x = 2", capsys)
    assert gpu.cupy.calls["drain"] == drains  # nothing torn down after the cell
    (line,) = _lines(out.out)
    assert "cached 1.0 GiB until idle (cupy 1.0)" in line
    assert _ext(shell).history.last()[-1]["deferred"] == {"device": True, "pinned": False, "after_s": 2.0}  # pinned: emptied by cell 1
    job = _idle_job_done(shell)  # the kernel stayed idle: the release ran on its own thread
    assert gpu.cupy.calls["drain"] == drains + 1 and gpu.cupy.cached.get(0, 0) == 0
    assert job.result()["devices"] == [{"index": 0, "freed_bytes": {"cupy": GiB}}]
    _, out = _run(shell, "y = 3", capsys)
    assert "freed 1.0 GiB when idle (cupy 1.0)" in _lines(out.out)[0]
    assert _ext(shell).history.last()[-1]["idle"][0]["devices"] == [{"index": 0, "freed_bytes": {"cupy": GiB}}]


def _a_release_deferred_for_an_hour(shell, gpu, capsys):
    """release "idle" with 1 GiB cached by CuPy after cell "x = 0": the engine and the release it deferred."""
    shell.run_line_magic("load_ext", "gpucleanup")
    shell.run_line_magic("config", "GPUCleanup.release = 'idle'")
    shell.run_line_magic("config", "GPUCleanup.idle_release_s = 3600")  # never reached in these tests
    gpu.cupy.cached[0] = GiB
    _run(shell, "x = 0", capsys)
    engine = _ext(shell).engine
    return engine, engine.releases.idle_job


def test_release_idle_a_cell_re_run_back_to_back_keeps_one_pending_release_re_armed(shell, gpu, capsys):
    engine, first = _a_release_deferred_for_an_hour(shell, gpu, capsys)
    assert _ext(shell).history.last()[-1]["deferred"] == {"device": True, "pinned": True, "after_s": 3600.0}
    skipped, records = engine.since.skipped, len(_ext(shell).history.last())
    for i in range(1, 5):  # the same caches after every cell: nothing changed since the release was deferred
        _, out = _run(shell, f"x = {i}", capsys)
        assert _lines(out.out) == []
    assert engine.since.skipped == skipped + 4 and len(_ext(shell).history.last()) == records
    assert engine.releases.idle_job is first and not first.cancelled and not first.done.is_set()
    assert engine.releases.unreported == [first]
    assert first._deadline is not None and first._deadline > time.monotonic() + 3000  # re-armed for its whole delay
    assert [t.name for t in threading.enumerate()].count("gpucleanup-idle-release") == 1
    assert gpu.cupy.calls["drain"] == 0 and gpu.cupy.cached[0] == GiB
    shell.run_line_magic("unload_ext", "gpucleanup")
    assert first.cancelled and engine.releases.idle_job is None
    first._thread.join(5)
    assert not first._thread.is_alive()  # its thread ended with it


def test_release_idle_a_cell_that_caches_more_replaces_the_pending_release(shell, gpu, capsys):
    engine, first = _a_release_deferred_for_an_hour(shell, gpu, capsys)
    gpu.cupy.cached[0] = 2 * GiB
    _run(shell, "x = 2", capsys)
    record = _ext(shell).history.last()[-1]
    assert record["devices"][0]["cached_bytes"] == {"cupy": 2 * GiB} and record["deferred"]["device"] is True
    first._thread.join(5)
    assert first.cancelled and first.done.is_set() and not first._thread.is_alive()
    assert engine.releases.idle_job is not first and engine.releases.unreported == [engine.releases.idle_job]
    assert gpu.cupy.calls["drain"] == 0


def test_release_idle_a_cell_with_the_cleanup_paused_drops_the_pending_release(shell, gpu, capsys):
    engine, first = _a_release_deferred_for_an_hour(shell, gpu, capsys)
    _run(shell, "%gpumem --off", capsys)  # paused during this cell: no cleanup after it, nothing re-arms
    assert first.cancelled and engine.releases.idle_job is None and engine.releases.held() is None
    assert gpu.cupy.calls["drain"] == 0


def test_release_rerun_is_the_default_and_another_cell_starts_with_the_caches_given_back(shell, gpu, capsys):
    del shell.config.GPUCleanup["release"]  # the default, not the stand-in's "cell"
    shell.run_line_magic("load_ext", "gpucleanup")
    assert _ext(shell).release == "rerun"
    shell.run_line_magic("config", "GPUCleanup.idle_release_s = 3600")  # never reached in this test
    gpu.cupy.cached[0] = GiB
    _run(shell, "x = 0", capsys)
    job = _ext(shell).engine.releases.idle_job
    assert job is not None and gpu.cupy.calls["drain"] == 0
    _run(shell, "x = 0", capsys)  # the same cell again: it finds the cache
    assert _ext(shell).engine.releases.idle_job is job and gpu.cupy.calls["drain"] == 0
    shell.user_ns["drains"] = lambda: gpu.cupy.calls["drain"]
    _run(shell, "seen = drains()", capsys)  # another cell: the release ran before its body
    assert shell.user_ns["seen"] == 1 and gpu.cupy.cached.get(0, 0) == 0
    assert job.result()["when"] == "cell" and _ext(shell).history.last()[-1]["idle"] == [job.result()]


def _a_rerun_release_waiting(shell, gpu, capsys):
    """Under the default release, "rerun", a cell that left 1 GiB cached: its release waits (for an hour, or for
    another cell), as it does when a park comes right after the cell."""
    del shell.config.GPUCleanup["release"]
    shell.run_line_magic("load_ext", "gpucleanup")
    shell.run_line_magic("config", "GPUCleanup.idle_release_s = 3600")
    gpu.cupy.cached[0] = GiB
    _run(shell, "x = 0", capsys)
    job = _ext(shell).engine.releases.idle_job
    assert job is not None and gpu.cupy.calls["drain"] == 0
    return job


def test_release_rerun_a_parked_kernels_next_cell_is_resumed_before_it_waits_for_the_release(
        shell, gpu, capsys, monkeypatch):
    # parked right after a cell (gpucleanup park, the page's Park), with the release "rerun" still waiting: the next
    # cell, another one, waited settle_timeout (30 s) for that release before its resume, and the release could not
    # begin while the kernel was parked (an H100, CuPy and PyTorch, tests/bench/results/h100-park-hold-*-179687d-*)
    job = _a_rerun_release_waiting(shell, gpu, capsys)
    parked, began = [1], []  # the kernel's server says parked until the resume

    def background(begin, activity=False):
        if begin:
            began.append(bool(parked[0]))
        return not (begin and parked[0])  # the endpoint refuses the kernel's own work while a park stands

    def resume(then, by):
        parked[0] = 0
        return "resumed its GPU memory from host memory in 1.0 s (parked 2.0 s)"

    monkeypatch.setattr(gpu.endpoint, "cell_state", lambda state, cell=None, since_ns=None: parked[0])
    monkeypatch.setattr(gpu.endpoint, "parked", lambda: parked[0])
    monkeypatch.setattr(gpu.endpoint, "background", background)
    monkeypatch.setattr(_ext(shell).parking, "_resume", resume)
    shell.user_ns["drains"] = lambda: gpu.cupy.calls["drain"]
    _, out = _run(shell, "seen = drains()", capsys)
    assert "gpucleanup · resumed its GPU memory from host memory in 1.0 s (parked 2.0 s)" in out.out
    assert "still ran after" not in out.out  # never waited out its bound
    # the release began only once the kernel was back, and ran before the cell's body
    assert began and began[-1] is False and shell.user_ns["seen"] == 1 and gpu.cupy.cached.get(0, 0) == 0
    assert job.done.is_set() and not job.cancelled and job.result()["when"] == "cell"


def test_release_rerun_a_kernel_still_parked_after_its_resume_drops_the_release_and_does_not_wait(
        shell, gpu, capsys, monkeypatch):
    job = _a_rerun_release_waiting(shell, gpu, capsys)
    monkeypatch.setattr(gpu.endpoint, "cell_state", lambda state, cell=None, since_ns=None: 1)
    monkeypatch.setattr(gpu.endpoint, "parked", lambda: 1)
    monkeypatch.setattr(gpu.endpoint, "background", lambda begin, activity=False: not begin)
    monkeypatch.setattr(_ext(shell).parking, "_resume", lambda then, by: "the restore failed (CUDA_ERROR_UNKNOWN)")
    _, out = _run(shell, "y = 1", capsys)
    assert "this cell was not run: the kernel is still parked (the restore failed (CUDA_ERROR_UNKNOWN))" in out.out
    assert "y" not in shell.user_ns and "still ran after" not in out.out
    # dropped, not left asleep: the caches stay for the cleanup after the resume
    assert job.cancelled and job.done.is_set() and gpu.cupy.calls["drain"] == 0 and gpu.cupy.cached[0] == GiB


def test_release_rerun_a_release_woken_while_parked_is_dropped_when_ctrl_c_stops_the_cell_before_its_resume(
        shell, gpu, capsys, monkeypatch):
    job = _a_rerun_release_waiting(shell, gpu, capsys)
    monkeypatch.setattr(gpu.endpoint, "parked", lambda: 1)
    monkeypatch.setattr(gpu.endpoint, "background", lambda begin, activity=False: not begin)

    def ctrl_c(state, cell=None, since_ns=None):
        raise KeyboardInterrupt  # Ctrl-C as the cell starts, before its resume

    monkeypatch.setattr(gpu.endpoint, "cell_state", ctrl_c)
    _run(shell, "y = 1", capsys)
    assert "y" not in shell.user_ns  # the cell was stopped, as Ctrl-C asks
    # not left asleep for good (it would keep every later idle cell from its proof): dropped, the caches kept
    assert job.done.wait(30) and job.cancelled and gpu.cupy.calls["drain"] == 0


def test_release_rerun_another_cell_waits_for_the_release_at_most_settle_timeout(shell, gpu, capsys):
    shell.config.GPUCleanup.release = "rerun"
    shell.run_line_magic("load_ext", "gpucleanup")
    shell.run_line_magic("config", "GPUCleanup.idle_release_s = 3600")
    shell.run_line_magic("config", "GPUCleanup.settle_timeout = 0.2")
    gpu.cupy.cached[0] = GiB
    _run(shell, "x = 0", capsys)
    job = _ext(shell).engine.releases.idle_job
    stuck = threading.Event()
    gpu.cupy.on_drain = lambda: stuck.wait(60)  # a framework's free that waits for a busy GPU
    try:
        _, out = _run(shell, "y = 1", capsys)  # runs after the bound, alongside the release
        assert shell.user_ns["y"] == 1 and not job.done.is_set()
        assert "the release of what cell [" in out.out and "still ran after 0.2 s: this cell runs alongside it" in out.out
    finally:
        stuck.set()
    assert job.done.wait(30)
    _, out = _run(shell, "y = 2", capsys)
    assert "still ran after" not in out.out  # said once


def test_release_auto_frees_device_caches_now_and_pinned_pools_when_idle(shell, gpu, capsys):
    shell.run_line_magic("load_ext", "gpucleanup")
    shell.run_line_magic("config", "GPUCleanup.release = 'auto'")
    shell.run_line_magic("config", "GPUCleanup.idle_release_s = 2")  # not before the counts below are read
    _, out = _run(shell, "x = 1", capsys)
    assert gpu.cupy.calls["drain"] == 1 and gpu.cupy.calls["drain_pinned"] == 0
    (line,) = _lines(out.out)
    assert "freed 4.0 GiB (cupy 3.0, driver 1.0)" in line and "pinned 1.0 GiB cached until idle" in line
    _idle_job_done(shell)
    assert gpu.cupy.calls["drain_pinned"] == 1
    _, out = _run(shell, "x = 2", capsys)
    assert "pinned 1.0 GiB freed when idle" in _lines(out.out)[0]


def test_gpumem_drain_gives_everything_back_now_whatever_the_release_policy(shell, gpu, capsys):
    shell.run_line_magic("load_ext", "gpucleanup")
    shell.run_line_magic("config", "GPUCleanup.release = 'idle'")
    shell.run_line_magic("config", "GPUCleanup.idle_release_s = 3600")
    _run(shell, "x = 1", capsys)
    assert gpu.cupy.calls["drain"] == 0
    _run(shell, "%gpumem --drain", capsys)
    _wait_pinned(shell)
    assert gpu.cupy.calls["drain"] == 1 and gpu.cupy.calls["drain_pinned"] == 1
    assert _ext(shell).history.last()[-1]["release"] == "cell"


def test_release_idle_a_silent_request_does_not_cancel_the_pending_release(shell, gpu, capsys):
    shell.run_line_magic("load_ext", "gpucleanup")
    shell.run_line_magic("config", "GPUCleanup.release = 'idle'")
    shell.run_line_magic("config", "GPUCleanup.idle_release_s = 3600")
    _run(shell, "x = 1", capsys)
    job = _ext(shell).engine.releases.idle_job
    shell.run_cell("y = 2", silent=True)  # e.g. a variable inspector's request: no cleanup follows it
    assert _ext(shell).engine.releases.idle_job is job and not job.cancelled


# ---------------------------------------------------------------- what an idle cell costs

def test_an_idle_cell_reads_each_framework_once_and_empties_nothing(shell, gpu, capsys):
    # after a cell that emptied the caches, a cell that touches no GPU memory: one read of
    # the framework's figures, no drain of an empty cache, no second trim of the driver's pools
    shell.run_line_magic("load_ext", "gpucleanup")
    _run(shell, "x = 1", capsys)
    _wait_pinned(shell)
    assert gpu.cupy.cached == {} and gpu.cupy.live == {0: 2 * GiB}
    gpu.cupy.calls.clear()
    gpu.native.calls.clear()
    for _ in range(5):
        _run(shell, "x += 1", capsys)
    assert gpu.cupy.calls == {"stats": 5}
    assert gpu.native.calls["trim"] == 0


def test_a_framework_caching_nothing_is_not_drained_one_caching_something_is(shell, gpu, capsys):
    empty = StandInAdapter("torch", gpu.gpus, live={0: GiB})
    gpu.adapters.append(empty)
    shell.run_line_magic("load_ext", "gpucleanup")
    _run(shell, "x = 1", capsys)
    assert gpu.cupy.calls["drain"] == 1 and gpu.cupy.cached == {}
    assert empty.calls["drain"] == 0
    empty.cached = {0: GiB}  # torch frees a tensor into its cache
    empty.live = {}
    _run(shell, "x = 2", capsys)
    assert empty.calls["drain"] == 1 and empty.cached == {}
    assert gpu.cupy.calls["drain"] == 1  # still nothing cached there


def test_gc_auto_collects_when_a_kept_cache_hands_out_memory_the_driver_cannot_see(shell, gpu, collects,
                                                                                              capsys):
    # a framework that cannot release keeps its cache: it can hand out memory again
    # without the driver's figures moving, so "nothing live last time" proves nothing
    keeper = StandInAdapter("jax", gpu.gpus, cached={0: 4 * GiB}, can_release=False)
    gpu.adapters[:] = [keeper]
    shell.run_line_magic("load_ext", "gpucleanup")
    _run(shell, "x = 1", capsys)
    collects.clear()
    keeper.live, keeper.cached = {0: GiB}, {0: 3 * GiB}  # handed out from its cache
    _run(shell, "y = 1", capsys)
    assert collects == [1]
    # the same world without the kept cache: after a cleanup that left nothing live,
    # a cell that changed nothing the driver sees is not collected after
    keeper.live, keeper.cached = {}, {}
    _run(shell, "z = 1", capsys)
    collects.clear()
    _run(shell, "z = 2", capsys)
    assert collects == []


def test_a_kernel_that_never_used_cuda_costs_one_quick_call_per_cell(shell, gpu, capsys, monkeypatch):
    # the library answers "nothing initialised CUDA" in one driver call: no JSON pass at all, and once a pass has
    # found it so (the probe at load is one), no pass is even built (AfterCell.never_initialised)
    from gpucleanup.engine import after_cell

    build, built = after_cell.CellPass, []

    def counted(*args):
        built.append(args)
        return build(*args)

    monkeypatch.setattr(after_cell, "CellPass", counted)
    gpu.fake.update({"initialized": False})
    shell.run_line_magic("load_ext", "gpucleanup")
    gpu.native.calls.clear()
    for _ in range(3):
        _, out = _run(shell, "x = 1", capsys)
        assert _lines(out.out) == []
    assert gpu.native.calls == {"cuda_initialized": 3}
    assert built == []  # the probe at load found CUDA not initialised, as each cell does
    assert _ext(shell).engine.last_driver_state == "not_initialized"
    # %gpumem --drain still asks the full probe, which says why there is nothing to clean
    _, out = _run(shell, "%gpumem --drain", capsys)
    assert gpu.native.calls["cuda_initialized"] == 4  # the cell's own cleanup after the magic
    assert sum(gpu.native.calls.values()) > 4
    assert len(_lines(out.out)) == 1
    assert len(built) == 1  # the drain's
    # CUDA initialised at last (by a cell, or a thread between cells): that cell's own pass sees the device, and
    # says it is the first use of it
    gpu.fake.update({"initialized": True})
    _, out = _run(shell, "x = 2", capsys)
    assert len(built) == 2
    assert _lines(out.out) == [
        f"gpucleanup · GPU0 {gpu.name} · freed 4.0 GiB (cupy 3.0, driver 1.0) · pinned 1.0 GiB · first use of GPU0: "
        "1.0 GiB outside every pool (the CUDA context, library code, raw allocations, or another process on GPU0) · "
        "kept 2.0 GiB live (cupy) · device 3.0/80.0 GiB · <t>"]


def test_a_cache_its_drain_cannot_empty_is_not_drained_again_until_it_changes(shell, gpu, capsys):
    # torch keeps a segment that still holds a live block: empty_cache leaves its free part
    stuck = StandInAdapter("torch", gpu.gpus, live={0: GiB}, cached={0: MiB})
    original = stuck.drain

    def drain_leaving_the_segment(devices):
        result = original(devices)
        stuck.cached = {0: MiB}
        result["freed_bytes"] = {}
        return result

    stuck.drain = drain_leaving_the_segment
    gpu.adapters[:] = [stuck]
    shell.run_line_magic("load_ext", "gpucleanup")
    _run(shell, "x = 1", capsys)
    assert stuck.calls["drain"] == 1
    for _ in range(3):
        _run(shell, "x += 1", capsys)
    assert stuck.calls["drain"] == 1  # the same bytes as its last drain left: nothing to give back
    stuck.cached = {0: MiB + GiB}  # a tensor freed into the cache
    _run(shell, "x += 1", capsys)
    assert stuck.calls["drain"] == 2


def test_memory_outside_every_pool_that_grows_in_a_cell_is_said_with_the_cell(shell, gpu, capsys):
    # a raw allocation (cuMemAlloc through ctypes, say): no framework, no pool accounts for it
    shell.run_line_magic("load_ext", "gpucleanup")
    shell.run_line_magic("config", "GPUCleanup.outside_warning_mib = 512")
    _run(shell, "x = 1", capsys)
    _wait_pinned(shell)
    gpu.device(0).used += 320 * MiB
    _, out = _run(shell, "x = 2", capsys)
    [line] = _lines(out.out)
    assert "+320 MiB outside every pool in this cell (library code and handles, raw allocations, or another process on GPU0)" in line
    record = _ext(shell).history.last(1)[0]["devices"][0]
    assert record["outside_growth_bytes"] == 320 * MiB
    first_outside = record["outside_bytes"]
    gpu.device(0).used += 320 * MiB  # 640 MiB since load: past the 512 MiB warning, said once
    _, out = _run(shell, "x = 3", capsys)
    lines = _lines(out.out)
    assert lines[1:] == ["gpucleanup · GPU0: 640 MiB outside every pool have appeared since gpucleanup loaded: CUDA "
                         "libraries' code and handles, raw allocations (cuMemAlloc through ctypes or cuda-python) that "
                         "nothing frees, or another process on this GPU; %gpumem shows the total"]
    assert _ext(shell).history.last(1)[0]["devices"][0]["outside_bytes"] == first_outside + 320 * MiB
    gpu.device(0).used += 320 * MiB
    _, out = _run(shell, "x = 4", capsys)
    assert not any("appeared since gpucleanup loaded" in l for l in _lines(out.out))
    assert _ext(shell).status()["devices"][0]["outside_since_load_bytes"] == 960 * MiB
    # a cell that changes nothing outside the pools says nothing of it
    _, out = _run(shell, "x = 5", capsys)
    assert not any("outside every pool" in l for l in _lines(out.out))


def test_a_pending_clear_is_followed_on_a_publisher_whose_clear_output_sends_without_its_hooks():
    # ipykernel before 6.29 sends clear_output straight to the socket; its display messages still pass the hooks
    from gpucleanup.in_kernel.pending_clear import PendingClear

    class OldPublisher:
        def __init__(self):
            self.hooks, self.sent = [], []

        def register_hook(self, hook):
            self.hooks.append(hook)

        def unregister_hook(self, hook):
            self.hooks.remove(hook)

        def clear_output(self, wait=False):
            self.sent.append(("clear_output", wait))

        def publish(self, data, metadata=None):
            msg = {"header": {"msg_type": "display_data"}, "content": {"data": data}, "metadata": metadata or {}}
            for hook in self.hooks:
                msg = hook(msg)
            self.sent.append(("display_data", data))

    publisher = OldPublisher()
    clears = PendingClear(types.SimpleNamespace(display_pub=publisher))
    assert clears.install() is True
    publisher.clear_output(True)
    assert publisher.sent == [("clear_output", True)] and clears.pending
    assert clears.holds_the_line(types.SimpleNamespace(result=None)) is True
    assert clears.holds_the_line(types.SimpleNamespace(result=42)) is False  # Out[N] takes the clear first
    publisher.publish({"text/plain": "gpucleanup · ..."}, {"gpucleanup": {"kind": "after_cell"}})
    assert clears.pending  # gpucleanup's own line never counts as the cell's output
    publisher.publish({"text/plain": "'frame'"})
    assert not clears.pending
    publisher.clear_output(False)
    assert not clears.pending
    # text written after a pending clear takes it; the streams get their own write back at once
    import io

    stream = io.StringIO()
    teed = []
    tee = stream.write
    stream.write = lambda text: teed.append(text) or tee(text)  # a write of the stream's own, as IPython's tee
    old_stdout, sys.stdout = sys.stdout, stream
    try:
        publisher.clear_output(True)
        assert clears.pending and vars(stream)["write"] is not tee
        print("step 1")
        assert not clears.pending and stream.getvalue() == "step 1\n" and teed == ["step 1", "\n"]
        own = vars(stream)["write"]
        publisher.clear_output(True)
        assert clears.holds_the_line(types.SimpleNamespace(result=None)) is True
        assert vars(stream)["write"] is own  # the cell has ended: the stream has its own write back
    finally:
        sys.stdout = old_stdout
    clears.cell_starts()
    clears.remove()
    assert "clear_output" not in vars(publisher) and publisher.hooks == []
    publisher.clear_output(True)
    assert not clears.pending  # removed: the publisher is as it was
    assert PendingClear(types.SimpleNamespace(display_pub=None)).install() is False  # terminal IPython


def test_underscore_is_the_last_result_after_a_cell_whose_line_was_shown(shell, gpu, capsys, monkeypatch):
    # gpucleanup's own proof for what IPython's test_underscore_* check (those are left out of the suite's
    # show = "always" run: they fail without gpucleanup too once a doctest has left builtins._ set)
    import builtins

    monkeypatch.setitem(shell.config.GPUCleanup, "show", "always")
    shell.run_line_magic("load_ext", "gpucleanup")
    result, out = _run(shell, "x = 12\nx", capsys)
    assert result.result == 12 and "gpucleanup ·" in out.out  # the line after the result
    result, out = _run(shell, "_", capsys)
    assert result.result == 12 and shell.user_ns["_"] == 12
    assert "gpucleanup ·" in out.out
    result, out = _run(shell, "_ * 2", capsys)
    assert result.result == 24 and shell.user_ns["__"] == 12
    assert not hasattr(builtins, "_") or builtins._ != 12  # the output cache's, never written into builtins


def test_idle_cells_make_no_call_that_gives_the_interpreter_lock_up(shell, real, fake_cuda, tmp_path, monkeypatch):
    # Every call an idle cell's hooks make keeps the interpreter lock: the library's through ctypes.PyDLL, never the
    # ctypes.CDLL handle, and the look at the park lock's size through gpucleanup_file_size. The operating system's
    # calls in Python (os.stat, os.lstat, os.fstat, files, sockets, time.sleep) give it up, and a waiting thread
    # (IPython's history thread, a notebook's own) may then run in the middle of the hooks. Every builtin C function
    # the hooks call is seen here (sys.setprofile; ctypes calls are not builtins, hence the watched handle).
    from IPython.core.interactiveshell import ExecutionInfo, ExecutionResult

    from gpucleanup import _native

    fake_cuda.reset({"devices": [{"primary_active": True}]})
    shell.run_line_magic("load_ext", "gpucleanup")
    ext = _ext(shell)
    lock = tmp_path / "4242-0123456789abcdef.park"
    lock.write_bytes(b"")  # the endpoint's empty park lock: nothing to say
    ext._endpoint.park_lock = lock
    looks = []
    monkeypatch.setattr(_native, "file_size", lambda path, size=_native.file_size: looks.append(path) or size(path))
    info = ExecutionInfo("x = 1", True, False, True, None)
    result = ExecutionResult(info)
    for _ in range(5):  # the first pass, then cells proven idle
        ext.pre_run_cell(info)
        ext.post_run_cell(result)
    looks.clear()
    called, releasing = set(), []

    class Releasing:  # the ctypes.CDLL handle (its calls give the lock up), watched: no idle cell may use it
        def __init__(self, lib):
            self._lib = lib

        def __getattr__(self, name):
            releasing.append(name)
            return getattr(self._lib, name)

    def seen(frame, event, arg):
        if event == "c_call":
            called.add((getattr(arg, "__module__", None) or type(getattr(arg, "__self__", None)).__name__,
                        getattr(arg, "__name__", repr(arg))))

    monkeypatch.setattr(_native, "_lib", Releasing(_native._lib))
    gc.collect()  # no finalizer of an earlier test's garbage runs among the hooks' calls
    profiler = sys.getprofile()
    sys.setprofile(seen)
    try:
        for _ in range(20):
            ext.pre_run_cell(info)
            ext.post_run_cell(result)
    finally:
        sys.setprofile(profiler)
    assert len(looks) == 20  # each cell looked at the park lock for a resume to say
    assert ext.engine.since.skipped >= 20  # proven idle
    assert releasing == []
    # the operating system's calls (os, time, select, sockets, files, fcntl) and blocking lock waits
    system = {(module, name) for module, name in called
              if module in ("posix", "nt", "time", "select", "socket", "_socket", "io", "_io", "fcntl", "_thread",
                            "FileIO", "BufferedReader", "BufferedWriter", "TextIOWrapper", "lock")}
    assert system <= {("posix", "getpid"), ("posix", "fspath"), ("time", "time_ns"), ("time", "monotonic"),
                      ("time", "perf_counter"), ("time", "time")}, system
