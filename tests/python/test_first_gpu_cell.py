"""The line tells the truth from the first GPU cell (issue 25), with the real library on the fake driver.

A device's baseline is its state before the cell, "no context yet" included: the cell that
makes the first context says what it took, what is outside every pool, and what holds it
(its ``Out[N]``); raw growth outside every pool is flagged with or without a framework in
use. The engine is built here without a shell (it imports nothing from IPython), and
through ``%load_ext`` where the shell's own objects (``Out[N]``) are part of the case.
"""

from __future__ import annotations

import re

import pytest

import gpucleanup
import gpucleanup._native  # noqa: F401  (the package attribute a stand-in replaces)
import gpucleanup.frameworks
import gpucleanup.in_kernel.status_endpoint
from gpucleanup.engine import after_cell
from gpucleanup.in_kernel import extension
from gpucleanup.records import report
from shell_stand_ins import StandInEndpoint  # noqa: E402
from support import GiB, MiB  # noqa: E402

TOTAL = 80 * GiB


def _lines(lines):
    return [re.sub(r" · [0-9.]+ (ms|s)$", " · <t>", line) for line in lines]


def _name():
    from gpucleanup import _native
    from gpucleanup.records import report

    return report.short_device_name(_native.snapshot()["devices"][0]["name"])


class Framework:
    """A framework adapter over scripted figures (the interface of gpucleanup.frameworks):
    ``live``/``cached`` per device; ``can_release`` False is a pool that never gives memory back."""

    def __init__(self, name="cupy", live=None, cached=None, can_release=True):
        self.name = name
        self.live = dict(live or {})
        self.cached = dict(cached or {})
        self.can_release = can_release
        self.drains = 0

    def stats(self, devices):
        return {"devices": {i: {"live_bytes": self.live.get(i, 0), "cached_bytes": self.cached.get(i, 0)}
                            for i in devices}, "pinned": None, "notes": []}

    def drain(self, devices):
        self.drains += 1
        freed = {i: self.cached.pop(i, 0) for i in devices}
        return {"freed_bytes": freed, "notes": []}

    def describe(self):
        return f"{self.name} holds its arrays"


def _engine(adapters=()):
    from gpucleanup import _native

    engine = after_cell.AfterCell(_native, adapters=lambda: list(adapters), voice=report.CellVoice())
    engine.baseline(_native.probe())  # what the extension does at load
    return engine


def _settings(**kw):
    return after_cell.Settings(pinned=False, **kw)


def _context_appears(fake_cuda, used):
    """A framework's first GPU call in the cell: the primary context exists and holds ``used``."""
    fake_cuda.update({"devices": [{"primary_active": True, "free_bytes": TOTAL - used}]})


def test_a_context_that_appears_during_the_cell_is_said_by_that_cell(fake_cuda):
    fake_cuda.reset({"devices": [{"total_bytes": TOTAL, "primary_active": False}]})
    engine = _engine()
    assert engine.run(_settings()) is None  # nothing in use: no record, no line
    _context_appears(fake_cuda, 600 * MiB)
    outcome = engine.run(_settings(), cell=2)
    [line] = _lines(outcome.lines)
    assert line == (f"gpucleanup · GPU0 {_name()} · freed 0 B · first use of GPU0: 600 MiB outside every pool (the "
                    "CUDA context, library code, raw allocations, or another process on GPU0) · device 0.6/80.0 GiB · <t>")
    dev = outcome.record.devices[0]
    assert outcome.record.touched and dev.first_use
    assert dev.outside_bytes == 600 * MiB and dev.outside_growth_bytes is None
    # the next cell that changes nothing is quiet: nothing changed, no record is built for it
    again = engine.run(_settings(), cell=3)
    assert again.lines == [] and not again.keep and again.record.devices == [] and engine.since.skipped == 1
    # a cell that changes the device's memory is no longer a first use
    _context_appears(fake_cuda, 700 * MiB)
    later = engine.run(_settings(), cell=4)
    assert later.keep and later.record.cell == 4 and not later.record.devices[0].first_use
    assert fake_cuda.counter("contexts_created") == 0 and fake_cuda.counter("cuInit") == 0


def test_the_first_gpu_cell_names_the_framework_that_holds_what_it_took(fake_cuda):
    fake_cuda.reset({"devices": [{"total_bytes": TOTAL, "primary_active": False}]})
    torch = Framework("torch")
    engine = _engine([torch])
    assert engine.run(_settings()) is None
    _context_appears(fake_cuda, GiB + 512 * MiB)
    torch.live = {0: GiB}
    outcome = engine.run(_settings(), cell=2)
    [line] = _lines(outcome.lines)
    assert line == (f"gpucleanup · GPU0 {_name()} · freed 0 B · first use of GPU0: 512 MiB outside every pool (the CUDA "
                    "context, library code, raw allocations, or another process on GPU0) · kept 1.0 GiB live (torch) "
                    "· device 1.5/80.0 GiB · <t>")


def test_a_device_in_use_before_the_extension_loaded_is_not_a_first_use(fake_cuda):
    fake_cuda.reset({"devices": [{"total_bytes": TOTAL, "primary_active": True,
                                  "free_bytes": TOTAL - GiB}]})
    engine = _engine()
    outcome = engine.run(_settings(show="always"), cell=1)
    assert not outcome.record.devices[0].first_use
    assert not any("first use" in line for line in outcome.lines)


def test_raw_growth_is_flagged_with_no_framework_in_use(fake_cuda):
    # cuda-python alone: threads keep cuMemAlloc'd memory, no framework, no pool accounts for it
    fake_cuda.reset({"devices": [{"total_bytes": TOTAL, "primary_active": False}]})
    engine = _engine()
    engine.run(_settings())
    _context_appears(fake_cuda, 500 * MiB + 5 * 64 * MiB)
    first = engine.run(_settings(), cell=2)
    assert first.record.devices[0].outside_bytes == 820 * MiB
    fake_cuda.update({"devices": [{"free_bytes": TOTAL - 820 * MiB - 256 * MiB}]})  # a cell keeps 256 MiB more
    outcome = engine.run(_settings(), cell=3)
    line, warning = _lines(outcome.lines)
    assert "+256 MiB outside every pool in this cell (library code and handles, raw allocations, or another process on GPU0)" in line
    assert outcome.record.devices[0].outside_growth_bytes == 256 * MiB
    # past outside_warning_mib (256) since the first cleanup: said once
    assert warning.startswith("gpucleanup · GPU0: 256 MiB outside every pool have appeared since gpucleanup loaded")


def test_a_framework_whose_figures_are_unknown_makes_outside_unknown(fake_cuda):
    # frameworks are in use, but their figures could not be read: nothing is called "outside"
    fake_cuda.reset({"devices": [{"total_bytes": TOTAL, "primary_active": True}]})

    class Broken(Framework):
        def stats(self, devices):
            raise RuntimeError("no figures")

    engine = _engine([Broken("cupy")])
    outcome = engine.run(_settings(show="always"), cell=1)
    assert outcome.record.devices[0].outside_bytes is None


# ------------------------------------------------------------------ through the shell: Out[N]


class ndarray:  # classified as a CuPy array by gpucleanup.frameworks.objects (module and name)
    __module__ = "cupy._core.core"

    def __init__(self, nbytes):
        self.nbytes = nbytes
        self.dtype = "float32"
        self.shape = (nbytes // 4,)
        self.device = type("Device", (), {"id": 0})()


class Endpoint(StandInEndpoint):
    """The status endpoint, recording what is published."""

    def __init__(self):
        super().__init__()
        self.published = []

    def start(self, shell):
        pass

    def set_state(self, state):
        pass

    def publish(self, record):
        self.published.append(record)

    def close(self):
        pass


@pytest.fixture
def shell():
    from IPython.core.interactiveshell import InteractiveShell

    ip = InteractiveShell.instance()
    ip.config.pop("GPUCleanup", None)
    yield ip
    ip.extension_manager.unload_extension("gpucleanup")
    ip.user_ns.pop("make", None)
    ip.run_line_magic("reset", "-f out")  # the shell is the process's: no array left in its output cache
    # %reset out sets _, __ and ___ to "" in user_ns but not in user_ns_hidden, where IPython 9's displayhook
    # then sees values the user assigned and stops updating them: every later test of this shell would find
    # _ empty (the fault matrix's cells check it)
    for name in ("_", "__", "___"):
        ip.user_ns_hidden.pop(name, None)
    ip.config.pop("GPUCleanup", None)


def test_out_n_is_named_on_the_first_gpu_cell(shell, fake_cuda, monkeypatch, capsys):
    from gpucleanup import _native

    fake_cuda.reset({"devices": [{"total_bytes": TOTAL, "primary_active": False}]})
    cupy = Framework("cupy")
    monkeypatch.setattr(gpucleanup, "_native", _native)
    monkeypatch.setattr(gpucleanup.frameworks, "active", lambda: [cupy])
    monkeypatch.setattr(gpucleanup.in_kernel.status_endpoint, "StatusEndpoint", lambda: Endpoint())
    shell.run_line_magic("load_ext", "gpucleanup")
    shell.run_cell("x = 1", store_history=True)
    capsys.readouterr()

    def make():
        _context_appears(fake_cuda, GiB + 500 * MiB)
        cupy.live = {0: GiB}
        return ndarray(GiB)

    shell.user_ns["make"] = make
    result = shell.run_cell("make()", store_history=True)
    n = result.execution_count
    lines = _lines([l for l in capsys.readouterr().out.splitlines() if l.startswith("gpucleanup")])
    assert lines == [f"gpucleanup · GPU0 {_name()} · freed 0 B · first use of GPU0: 500 MiB outside every pool (the "
                     "CUDA context, library code, raw allocations, or another process on GPU0) · kept 1.0 GiB live "
                     f"(cupy): Out[{n}] 1.0 GiB · device 1.5/80.0 GiB · <t>"]


# ------------------------------------------------------------------ a pool that never gives memory back


def _jax(monkeypatch, live, pool):
    """JAX's real adapter over the JAX stand-in: its BFC allocator holds ``pool`` bytes, ``live`` in arrays."""
    from stand_ins import World, install_jax

    from gpucleanup.frameworks.jax import JaxAdapter

    monkeypatch.delenv("XLA_PYTHON_CLIENT_ALLOCATOR", raising=False)
    install_jax(monkeypatch, World(n_devices=1, active=(0,)), stats={0: {"bytes_in_use": live, "pool_bytes": pool}})
    return JaxAdapter()


JAX_FIX = ("XLA_PYTHON_CLIENT_PREALLOCATE=false before import, or XLA_PYTHON_CLIENT_ALLOCATOR=platform to free as "
           "arrays die; XLA_PYTHON_CLIENT_MEM_FRACTION caps it")


def test_a_pool_that_cannot_be_freed_is_reserved_never_cached_and_its_fix_said_once(fake_cuda, monkeypatch):
    fake_cuda.reset({"devices": [{"total_bytes": TOTAL, "primary_active": False}]})
    jax = _jax(monkeypatch, live=4 * MiB, pool=60 * GiB)
    engine = _engine([jax])
    assert engine.run(_settings()) is None
    _context_appears(fake_cuda, 60 * GiB + 500 * MiB)  # jnp.ones((1024, 1024)): JAX preallocates 75%
    outcome = engine.run(_settings(), cell=2)
    [line] = _lines(outcome.lines)
    assert line == (f"gpucleanup · GPU0 {_name()} · freed 0 B · first use of GPU0: 500 MiB outside every pool (the "
                    "CUDA context, library code, raw allocations, or another process on GPU0) · kept 4.0 MiB live (jax) "
                    f"· reserved by jax 60.0 GiB (not freeable: {JAX_FIX}) · device 60.5/80.0 GiB · <t>")
    dev = outcome.record.devices[0]
    assert dev.reserved_bytes == {"jax": 60 * GiB - 4 * MiB} and dev.cached_bytes == {}
    assert outcome.record.reserved_fix == {"jax": JAX_FIX}
    # the next line that shows it says the amount only; "cached" is never said of it
    fake_cuda.update({"devices": [{"free_bytes": TOTAL - 60 * GiB - 500 * MiB - 64 * MiB}]})
    again = engine.run(_settings(), cell=3)
    assert any("· reserved by jax 60.0 GiB · device" in l for l in again.lines)
    assert not any("cached" in l or "not freeable" in l for l in again.lines)
    assert again.record.reserved_fix == {}


def test_gpumem_shows_a_pool_that_cannot_be_freed_in_its_own_column(fake_cuda, monkeypatch):
    from gpucleanup.records import report

    fake_cuda.reset({"devices": [{"total_bytes": TOTAL, "primary_active": True,
                                  "free_bytes": TOTAL - 60 * GiB - 500 * MiB}]})
    jax = _jax(monkeypatch, live=4 * MiB, pool=60 * GiB)
    status = _engine([jax]).memory_status(_settings())
    [dev] = status["devices"]
    assert dev["frameworks"]["jax"] == {"live_bytes": 4 * MiB, "cached_bytes": 0, "reserved_bytes": 60 * GiB - 4 * MiB}
    assert dev["outside_bytes"] == 500 * MiB  # the reserved pool is known, not outside
    text = report.memory_report(status).text()
    assert "not freeable" in text.splitlines()[1]  # the column's header
    [row] = [l for l in text.splitlines() if l.startswith("jax")]
    assert row.split() == ["jax", "4.0", "MiB", "0", "B", "60.0", "GiB"]
    assert f"not freeable: jax's pool never gives memory back ({JAX_FIX})." in text


def test_gpumem_names_a_context_no_array_uses(fake_cuda):
    from gpucleanup.records import report

    fake_cuda.reset({"devices": [{"total_bytes": TOTAL, "primary_active": True, "free_bytes": TOTAL - GiB},
                                 {"total_bytes": TOTAL, "primary_active": True,
                                  "free_bytes": TOTAL - 537 * MiB}]})
    torch = Framework("torch", live={0: GiB - 500 * MiB})
    status = _engine([torch]).memory_status(_settings())
    text = report.memory_report(status).text()
    assert ("no array of torch is on GPU1: what it uses is a CUDA context (and libraries') made without an array, "
            "or raw allocations.") in text
    assert "no array of torch is on GPU0" not in text


def test_the_first_use_of_a_gpu_no_array_uses_is_named(fake_cuda):
    fake_cuda.reset({"devices": [{"total_bytes": TOTAL, "primary_active": True, "free_bytes": TOTAL - GiB},
                                 {"total_bytes": TOTAL, "primary_active": False}]})
    torch = Framework("torch", live={0: GiB - 500 * MiB})
    engine = _engine([torch])
    engine.run(_settings(), cell=1)
    fake_cuda.update({"devices": [{}, {"primary_active": True, "free_bytes": TOTAL - 537 * MiB}]})
    outcome = engine.run(_settings(), cell=2)
    [gpu1] = [l for l in _lines(outcome.lines) if l.startswith("gpucleanup · GPU1")]
    assert " · freed 0 B · first use of GPU1: a context no array uses, 537 MiB outside every pool (" in gpu1
    assert outcome.record.devices[1].context_only and not outcome.record.devices[0].context_only


# ------------------------------------------------------------------ the line is gpucleanup's own output


def _loaded(shell, fake_cuda, monkeypatch):
    from gpucleanup import _native

    fake_cuda.reset({"devices": [{"total_bytes": TOTAL, "primary_active": True,
                                  "free_bytes": TOTAL - GiB}]})
    monkeypatch.setattr(gpucleanup, "_native", _native)
    monkeypatch.setattr(gpucleanup.frameworks, "active", lambda: [])
    monkeypatch.setattr(gpucleanup.in_kernel.status_endpoint, "StatusEndpoint", lambda: Endpoint())
    shell.run_line_magic("load_ext", "gpucleanup")
    shell.run_line_magic("config", "GPUCleanup.show = 'always'")


def test_the_line_is_a_display_output_of_its_own_named_gpucleanup(shell, fake_cuda, monkeypatch, capsys):
    _loaded(shell, fake_cuda, monkeypatch)
    published = []
    monkeypatch.setattr(shell.display_pub, "publish", lambda data, metadata=None, **kw: published.append((data, metadata)))
    result = shell.run_cell("print('hi')", store_history=True)
    assert capsys.readouterr().out == "hi\n"  # the cell's stdout holds what it printed, nothing more
    [(data, metadata)] = published
    assert _lines([data["text/plain"]]) == [f"gpucleanup · GPU0 {_name()} · freed 0 B · device 1.0/80.0 GiB · <t>"]
    assert data["text/html"].startswith('<div class="gpucleanup-line"') and "GPU0" in data["text/html"]
    assert metadata == {"gpucleanup": {"kind": "after_cell", "cell": result.execution_count}, "tags": ["gpucleanup"]}


def test_capture_and_a_redirected_stdout_hold_only_what_the_cell_printed(shell, fake_cuda, monkeypatch, capsys):
    _loaded(shell, fake_cuda, monkeypatch)
    capsys.readouterr()
    shell.run_cell("%%capture cap\nprint('inside')", store_history=True)
    out = capsys.readouterr().out
    cap = shell.user_ns.pop("cap")
    assert cap.stdout == "inside\n" and cap.outputs == []
    assert len([l for l in out.splitlines() if l.startswith("gpucleanup · GPU0")]) == 1  # one cleanup, after the cell
    shell.run_cell("import contextlib, io\nbuf = io.StringIO()\nwith contextlib.redirect_stdout(buf):\n    print('mine')",
                   store_history=True)
    assert shell.user_ns.pop("buf").getvalue() == "mine\n"
