"""The after-cell engine built with no IPython shell, on the real library over the fake CUDA driver:
its stages over one :class:`~gpucleanup.engine.after_cell.DeviceWork` per device, and the idle cell whose
cleanup is skipped because nothing changed since the last one (no record, no publish, no hand-off).
"""

from __future__ import annotations

import collections
import dataclasses
import gc
import math
import signal
import sys
import time
import types

import pytest

import gpucleanup
import gpucleanup._native
import gpucleanup.frameworks
import gpucleanup.in_kernel.status_endpoint
from gpucleanup.engine import after_cell
from gpucleanup.in_kernel import extension
from gpucleanup.records import report
from shell_stand_ins import StandInEndpoint  # noqa: E402
from support import GiB, MiB  # noqa: E402

TOTAL = 80 * GiB


class Native:
    """The real _native module, its calls counted."""

    COUNTED = ("probe", "snapshot", "drain", "after_cell", "trim", "cuda_initialized", "quiet")

    def __init__(self):
        from gpucleanup import _native

        self._native = _native
        self.calls = collections.Counter()

    def __getattr__(self, name):
        fn = getattr(self._native, name)
        if name not in self.COUNTED:
            return fn

        def counted(*args, **kwargs):
            self.calls[name] += 1
            return fn(*args, **kwargs)

        return counted


class Framework:
    """A framework adapter over scripted figures (the interface of gpucleanup.frameworks), its calls counted."""

    def __init__(self, name="cupy", live=None, cached=None):
        self.name = name
        self.live = dict(live or {})
        self.cached = dict(cached or {})
        self.calls = collections.Counter()

    def stats(self, devices):
        self.calls["stats"] += 1
        return {"devices": {i: {"live_bytes": self.live.get(i, 0), "cached_bytes": self.cached.get(i, 0)}
                            for i in devices}, "pinned": {"live_bytes": 0, "cached_bytes": 0}, "notes": []}

    def drain(self, devices):
        self.calls["drain"] += 1
        return {"freed_bytes": {i: self.cached.pop(i, 0) for i in devices}, "notes": []}

    def drain_pinned(self):
        self.calls["drain_pinned"] += 1
        return {"freed_bytes": 0, "notes": []}

    def describe(self):
        return f"{self.name} holds its arrays"


def _device(fake_cuda, used=2 * GiB, pool=0):
    fake_cuda.reset({"devices": [{"total_bytes": TOTAL, "free_bytes": TOTAL - used, "primary_active": True,
                                  "default_pool": {"reserved_bytes": pool, "used_bytes": 0}}]})


def _engine(*adapters):
    native = Native()
    engine = after_cell.AfterCell(native, adapters=lambda: list(adapters), voice=report.CellVoice(write=lambda text: None))
    engine.baseline(native.probe())  # what the extension does at load
    native.calls.clear()
    return engine, native


def _settings(**kw):
    return after_cell.Settings(**kw)


# ------------------------------------------------------------------ the stages, one DeviceWork per device


def test_device_work_is_built_once_from_the_native_pass_entry(fake_cuda):
    _device(fake_cuda, used=2 * GiB, pool=GiB)
    from gpucleanup import _native

    entry = _native.after_cell(timeout=1.0)["devices"][0]
    work = after_cell.DeviceWork(entry["index"])
    work.take_pass(entry, interrupted=False)
    assert (work.state, work.settled, work.settle["status"]) == ("drained", True, "done")
    assert work.freed == {"driver": GiB}  # the pass's own trim
    assert work.free_before == entry["free_before_bytes"] and work.used_before == TOTAL - entry["free_before_bytes"]
    assert work.after == {k: entry[k] for k in ("name", "total_bytes", "used_bytes", "free_bytes")}
    assert work.pools == 0


def test_framework_figures_are_read_once_into_typed_values():
    fw = Framework(live={0: GiB}, cached={0: 2 * GiB})
    figures = after_cell.FrameworkFigures.read(fw, fw.stats([0, 1]))
    assert figures.on(0) == after_cell.Held(live=GiB, cached=2 * GiB)
    assert figures.on(1) == after_cell.Held() and figures.on(7) == after_cell.Held()
    assert figures.pinned == after_cell.Held() and figures.releases is True and figures.fix is None


def test_a_cell_frees_each_frameworks_cache_and_takes_the_figures_after_from_the_trim(fake_cuda):
    _device(fake_cuda, used=5 * GiB, pool=GiB)
    cupy = Framework(live={0: 2 * GiB}, cached={0: 3 * GiB})
    engine, native = _engine(cupy)
    outcome = engine.run(_settings(pinned=False), cell=1)
    dev = outcome.record.devices[0]
    assert dev.freed_bytes == {"driver": GiB, "cupy": 3 * GiB}
    assert dev.live_bytes == {"cupy": 2 * GiB} and dev.cached_bytes == {}
    assert cupy.calls["drain"] == 1
    # one pass, one trim after cupy gave memory back; the trim's figures make a snapshot needless
    assert (native.calls["after_cell"], native.calls["trim"], native.calls["snapshot"]) == (1, 1, 0)


# ------------------------------------------------------------------ the idle cell


def test_idle_cells_build_no_record_and_read_each_framework_once(fake_cuda, schemas):
    _device(fake_cuda)
    cupy = Framework(live={0: GiB})
    engine, native = _engine(cupy)
    first = engine.run(_settings(), cell=1)
    assert first.keep and first.record.cell == 1
    native.calls.clear()
    cupy.calls.clear()
    for cell in range(2, 12):
        outcome = engine.run(_settings(), cell=cell)
        assert outcome.lines == [] and not outcome.keep
        # its record: no device, nothing freed (what a Dask worker's summary adds up)
        assert (outcome.record.cell, outcome.record.devices, outcome.record.driver_state) == (cell, [], "ready")
        schemas["cell_record.schema.json"].validate(outcome.as_dict())
    assert engine.since.skipped == 10
    # the first idle cell: the native pass proves it idle; every one after it: the library's quiet check
    # (no pass, no JSON, and no asking whether CUDA is initialised: it was, and stays so); each reads each
    # framework once, nothing else
    assert dict(native.calls) == {"cuda_initialized": 1, "after_cell": 1, "quiet": 9}
    assert dict(cupy.calls) == {"stats": 10}


def test_an_adapter_answering_as_before_gets_the_same_figures_and_one_with_no_single_truth_is_read_afresh():
    class Ambiguous:
        """A value like an array's: == gives no single truth."""

        def __eq__(self, other):
            raise ValueError("the truth value of an array with more than one element is ambiguous")

        __hash__ = None

    engine = after_cell.AfterCell(Native(), adapters=list, voice=report.CellVoice(write=lambda text: None))
    cupy = Framework(live={0: GiB})
    first = engine.frameworks.stats([cupy], [0], [])["cupy"]
    again = engine.frameworks.stats([cupy], [0], [])["cupy"]
    assert again is first and again == after_cell.FrameworkFigures.read(cupy, cupy.stats([0]))
    cupy.live = {0: 2 * GiB}
    changed = engine.frameworks.stats([cupy], [0], [])["cupy"]
    assert changed is not first and changed.on(0) == after_cell.Held(live=2 * GiB)

    class Odd(Framework):
        def stats(self, devices):
            answer = super().stats(devices)
            answer["notes"] = [Ambiguous()]
            return answer

    odd, notes = Odd(name="odd", live={0: GiB}), []
    one = engine.frameworks.stats([odd], [0], notes)["odd"]
    two = engine.frameworks.stats([odd], [0], notes)["odd"]
    assert one is not two and two.on(0) == after_cell.Held(live=GiB) and notes == []


def test_once_an_idle_cell_is_proven_the_library_quiet_check_stands_for_the_pass_until_anything_changes(fake_cuda):
    _device(fake_cuda)
    cupy = Framework(live={0: GiB})
    engine, native = _engine(cupy)
    engine.run(_settings(), cell=1)  # a first cleanup: a record
    assert not engine.run(_settings(), cell=2).keep  # proven idle by the whole pass
    native.calls.clear()
    for cell in range(3, 6):
        assert not engine.run(_settings(), cell=cell).keep
    assert native.calls["after_cell"] == 0 and native.calls["quiet"] == 3
    # a framework figure the driver does not see: the quiet check says nothing changed, the figures do
    cupy.live[0] += 256 * MiB
    outcome = engine.run(_settings(), cell=6)
    assert outcome.keep and outcome.record.devices[0].live_bytes == {"cupy": GiB + 256 * MiB}
    assert native.calls["after_cell"] == 1
    # memory taken outside every pool: the quiet check sees it, the whole pass says it
    assert not engine.run(_settings(), cell=7).keep and native.calls["after_cell"] == 2  # proven idle again
    fake_cuda.update({"devices": [{"free_bytes": TOTAL - 2 * GiB - 128 * MiB}]})
    outcome = engine.run(_settings(), cell=8)
    assert outcome.keep and outcome.record.devices[0].outside_growth_bytes == 128 * MiB
    assert native.calls["after_cell"] == 3 and native.calls["quiet"] == 5
    assert engine.since.skipped == 5


def test_an_initialised_driver_with_no_context_is_found_unused_by_the_quiet_check_alone_until_a_first_context(
        fake_cuda):
    # a notebook that asked torch.cuda.is_available() and made no tensor: CUDA initialised, no context of its own
    fake_cuda.reset({"initialized": True, "devices": [{"total_bytes": TOTAL, "free_bytes": TOTAL - 2 * GiB,
                                                        "primary_active": False}]})
    engine, native = _engine()
    assert engine.run(_settings(), cell=1) is None  # the whole pass: nothing in use, nothing said
    assert native.calls["after_cell"] == 1 and engine.since.unused
    native.calls.clear()
    for cell in range(2, 6):
        assert engine.run(_settings(), cell=cell) is None
    assert (native.calls["after_cell"], native.calls["quiet"]) == (0, 4)  # no pass, no JSON: the probe's calls
    assert engine.since.driver_state == "ready"
    # the first context: the quiet check no longer holds, the whole pass runs and finds the device in use
    fake_cuda.update({"devices": [{"primary_active": True}]})
    outcome = engine.run(_settings(), cell=6)
    assert native.calls["after_cell"] == 1 and not engine.since.unused
    assert outcome is not None and [d.index for d in outcome.record.devices] == [0]
    # a forced cell (%gpumem --drain) always runs the whole pass
    native.calls.clear()
    fake_cuda.update({"devices": [{"primary_active": False}]})
    assert engine.run(_settings(), cell=7) is None and engine.since.unused
    engine.run(_settings(), cell=8, forced=True)
    assert native.calls["after_cell"] == 2


def test_idle_cells_ask_which_frameworks_are_in_use_once_until_an_import_or_a_full_pass(fake_cuda, monkeypatch):
    _device(fake_cuda)
    cupy, torch = Framework(live={0: GiB}), Framework("torch")
    in_use, asked = [cupy], []
    engine, native = _engine()
    engine.frameworks.find = lambda: asked.append(1) or list(in_use)
    engine.run(_settings(), cell=1)
    assert not engine.run(_settings(), cell=2).keep  # proven idle by the whole pass
    asked.clear()
    for cell in range(3, 6):
        assert not engine.run(_settings(), cell=cell).keep
    assert len(asked) == 1 and native.calls["quiet"] == 3  # the first idle cell asked; the next two kept its answer
    monkeypatch.setitem(sys.modules, "gpucleanup_test_imported_meanwhile", types.ModuleType("imported"))
    assert not engine.run(_settings(), cell=6).keep
    assert len(asked) == 2  # a module imported since: asked again
    # a full pass whose cell skipped the quiet check (%gpumem --drain here) forgets the answer kept
    engine.run(_settings(), cell=6, forced=True)
    assert engine.quiet.adapters_kept is None
    # PyTorch starts using the GPU: an allocation the quiet check sees, so the whole pass runs and reads it
    in_use.append(torch)
    torch.live[0] = GiB
    fake_cuda.update({"devices": [{"free_bytes": TOTAL - 3 * GiB}]})
    outcome = engine.run(_settings(), cell=7)
    assert outcome.keep and outcome.record.devices[0].live_bytes == {"cupy": GiB, "torch": GiB}
    assert not engine.run(_settings(), cell=8).keep  # proven idle by the whole pass again
    # its tensor deleted: the memory stays in its cache, unseen by the driver; the idle cell asks afresh
    # (the full passes forgot what was kept) and gives it back
    torch.live[0], torch.cached[0] = 0, GiB
    outcome = engine.run(_settings(), cell=9)
    assert outcome.keep and torch.calls["drain"] == 1 and torch.cached == {}
    assert outcome.record.devices[0].freed_bytes.get("torch") == GiB


class Tokened(Framework):
    """A framework with a quiet token: its figures' counters, read without building them."""

    def quiet_token(self, devices, in_use=False):
        self.calls["quiet_token"] += 1
        self.calls["quiet_token_in_use"] += bool(in_use)
        return tuple((self.live.get(i, 0), self.cached.get(i, 0)) for i in devices)


def test_idle_cells_read_no_figures_of_a_framework_whose_quiet_token_is_the_one_read_before_them(fake_cuda):
    _device(fake_cuda)
    cupy, torch = Tokened(live={0: GiB}), Framework("torch", live={0: GiB})
    engine, native = _engine(cupy, torch)
    engine.run(_settings(), cell=1)
    assert not engine.run(_settings(), cell=2).keep  # proven idle by the whole pass
    assert cupy.calls["quiet_token"] == cupy.calls["stats"] == 2  # a token before each read of the figures
    read = dict(cupy.calls), torch.calls["stats"]
    for cell in range(3, 6):
        assert not engine.run(_settings(), cell=cell).keep
    assert native.calls["quiet"] == 3 and engine.since.skipped == 4
    assert cupy.calls["stats"] == read[0]["stats"] and cupy.calls["quiet_token"] == read[0]["quiet_token"] + 3
    # found in use by the full pass, nothing imported since: the idle cells' tokens do not ask again
    assert cupy.calls["quiet_token_in_use"] == read[0]["quiet_token_in_use"] + 3
    assert torch.calls["stats"] == read[1] + 3  # no token: its figures are read on every idle cell
    # an array deleted: its memory stays in the pool, unseen by the driver; the token differs, so the
    # figures are read, and the whole pass gives the cache back
    cupy.live[0], cupy.cached[0] = 0, GiB
    outcome = engine.run(_settings(), cell=6)
    assert outcome.keep and cupy.calls["drain"] == 1 and cupy.cached == {}
    assert outcome.record.devices[0].freed_bytes.get("cupy") == GiB
    # a token that fails is no token: the figures are read, the cell is still proven idle
    assert not engine.run(_settings(), cell=7).keep
    stats = cupy.calls["stats"]
    cupy.quiet_token = lambda devices: 1 / 0
    assert not engine.run(_settings(), cell=8).keep and cupy.calls["stats"] == stats + 1


def test_idle_cells_with_pytorch_read_its_token_alone_and_a_tensor_deleted_is_given_back(fake_cuda, monkeypatch):
    # the real adapter over stand-in torch: its token is the two C functions' counters, no figures built
    from gpucleanup.frameworks import ADAPTERS
    from stand_ins import World
    from stand_ins.torch import install_torch

    _device(fake_cuda)
    torch = install_torch(monkeypatch, World(n_devices=1, active=(0,), current=0), allocated={0: GiB},
                          reserved={0: GiB}, host_keys="2.5")
    adapter = next(a for a in ADAPTERS if a.name == "torch")
    figures_read = collections.Counter()
    read_figures = type(adapter)._stats
    monkeypatch.setattr(type(adapter), "_stats", lambda self, *a: figures_read.update(["stats"]) or read_figures(
        self, *a))
    engine, native = _engine(adapter)
    engine.run(_settings(), cell=1)
    assert not engine.run(_settings(), cell=2).keep  # proven idle by the whole pass
    read = figures_read["stats"]
    for cell in range(3, 6):
        assert not engine.run(_settings(), cell=cell).keep
    assert native.calls["quiet"] == 3 and engine.since.skipped == 4 and figures_read["stats"] == read
    # a tensor deleted: its GiB stays in torch's cache, unseen by the driver; the token differs, the figures are
    # read and the whole pass empties the cache
    torch.allocated[0] = 0
    outcome = engine.run(_settings(), cell=6)
    assert outcome.keep and figures_read["stats"] > read and torch.reserved[0] == 0
    assert outcome.record.devices[0].freed_bytes.get("torch") == GiB


def _count_nothing_new(monkeypatch) -> collections.Counter:
    """CellPass.nothing_new, its calls counted: the comparisons an idle cell's proof spares the next ones."""
    calls = collections.Counter()
    real = after_cell.CellPass.nothing_new

    def counted(self):
        calls["nothing_new"] += 1
        return real(self)

    monkeypatch.setattr(after_cell.CellPass, "nothing_new", counted)
    return calls


def test_idle_cells_after_one_proven_idle_the_long_way_stand_on_its_proof_and_read_only_the_tokens(
        fake_cuda, monkeypatch):
    _device(fake_cuda)
    checked = _count_nothing_new(monkeypatch)
    cupy, torch = Tokened(live={0: GiB}), Tokened("torch", live={0: 2 * GiB})
    engine, native = _engine(cupy, torch)
    settings = _settings()
    engine.run(settings, cell=1)
    assert not engine.run(settings, cell=2).keep  # proven idle by the whole pass: no proof of the quiet check
    assert engine.quiet.proof is None
    assert not engine.run(settings, cell=3).keep  # the quiet check, the long way: it leaves its proof
    proof = engine.quiet.proof
    assert proof is not None and proof.settings is settings and proof.adapters == (cupy, torch)
    assert proof.tokens == (((GiB, 0),), ((2 * GiB, 0),)) and proof.held is None and proof.jobs == []
    asked, figures = checked["nothing_new"], (cupy.calls["stats"], torch.calls["stats"])
    tokens = (cupy.calls["quiet_token"], torch.calls["quiet_token"])
    for cell in range(4, 8):
        assert not engine.run(settings, cell=cell).keep
    assert engine.quiet.proof is proof and engine.since.skipped == 6 and native.calls["quiet"] == 5
    assert checked["nothing_new"] == asked  # not asked again
    assert (cupy.calls["stats"], torch.calls["stats"]) == figures  # no figures read
    assert (cupy.calls["quiet_token"], torch.calls["quiet_token"]) == (tokens[0] + 4, tokens[1] + 4)
    # a tensor deleted: its memory stays in torch's cache, unseen by the driver; its token differs, the proof
    # falls and the whole pass gives the cache back
    torch.live[0], torch.cached[0] = GiB, GiB
    outcome = engine.run(settings, cell=8)
    assert outcome.keep and torch.calls["drain"] == 1 and torch.cached == {}
    assert outcome.record.devices[0].freed_bytes.get("torch") == GiB and engine.quiet.proof is None


@pytest.mark.parametrize("change, still_idle", [
    ("other settings", True),  # equal, but another object: compared the long way, and a new proof made
    ("a module imported", True),  # which frameworks are in use is asked again
    ("the allocation trace started", False),  # every cell gets its record of what it traced
    ("a drain earlier in the cell", False),  # %gpumem --drain in the cell: its cleanup says what it adds
    ("a framework's token", False),  # an array deleted into the pool
    ("a driver change", False),  # the library's quiet check, asked on every cell
])
def test_the_proof_falls_when_anything_it_rested_on_changes(fake_cuda, monkeypatch, change, still_idle):
    _device(fake_cuda)
    checked = _count_nothing_new(monkeypatch)
    cupy = Tokened(live={0: GiB})
    engine, native = _engine(cupy)
    settings = _settings()
    first = engine.run(settings, cell=1)
    for cell in range(2, 5):
        assert not engine.run(settings, cell=cell).keep
    assert engine.quiet.proof is not None and engine.since.skipped == 3
    asked, after_forced = checked["nothing_new"], None
    if change == "other settings":
        settings = _settings()
    elif change == "a module imported":
        monkeypatch.setitem(sys.modules, "gpucleanup_test_imported_meanwhile", types.ModuleType("imported"))
    elif change == "the allocation trace started":
        engine.hooks.traced, engine.hooks.tracing = (lambda cell: []), (lambda: True)
    elif change == "a drain earlier in the cell":
        after_forced = first.record
    elif change == "a framework's token":
        cupy.live[0], cupy.cached[0] = 0, GiB
    else:
        fake_cuda.update({"devices": [{"free_bytes": TOTAL - 3 * GiB}]})
    outcome = engine.run(settings, cell=5, after_forced=after_forced)
    assert engine.since.skipped == (4 if still_idle else 3)
    assert outcome.keep is not still_idle or after_forced is not None
    if still_idle:  # the long way, which leaves a proof of its own
        assert checked["nothing_new"] == asked + 1
        assert engine.quiet.proof is not None and engine.quiet.proof.settings is settings
        assert engine.quiet.proof.modules == len(sys.modules)
    else:
        assert engine.quiet.proof is None
    if change == "a framework's token":
        assert cupy.calls["drain"] == 1 and outcome.record.devices[0].freed_bytes.get("cupy") == GiB


def test_no_proof_is_kept_while_a_framework_in_use_has_no_quiet_token(fake_cuda, monkeypatch):
    _device(fake_cuda)
    checked = _count_nothing_new(monkeypatch)
    cupy, torch = Tokened(live={0: GiB}), Framework("torch", live={0: GiB})
    engine, _ = _engine(cupy, torch)
    engine.run(_settings(), cell=1)
    asked = checked["nothing_new"]
    for cell in range(2, 6):
        assert not engine.run(_settings(), cell=cell).keep
    assert engine.quiet.proof is None and checked["nothing_new"] == asked + 4  # the long way on every cell


def test_a_token_that_raises_under_the_proof_sends_the_cell_the_long_way_which_keeps_no_proof(fake_cuda, monkeypatch):
    _device(fake_cuda)
    checked = _count_nothing_new(monkeypatch)
    cupy = Tokened(live={0: GiB})
    engine, _ = _engine(cupy)
    settings = _settings()
    for cell in range(1, 5):
        engine.run(settings, cell=cell)
    assert engine.quiet.proof is not None and engine.since.skipped == 3
    asked, figures = checked["nothing_new"], cupy.calls["stats"]

    def broken(devices, in_use=False):
        raise RuntimeError("the framework's counters are gone")

    monkeypatch.setattr(cupy, "quiet_token", broken)
    outcome = engine.run(settings, cell=5)
    # no exception into the cell; its figures are read the long way, still equal, so the cell is idle
    assert not outcome.keep and engine.since.skipped == 4
    assert cupy.calls["stats"] == figures + 1 and checked["nothing_new"] == asked + 1
    assert engine.quiet.proof is None  # no token to rest a proof on
    monkeypatch.undo()  # the token answers again: the next idle cell leaves a proof once more
    _count_nothing_new(monkeypatch)
    assert not engine.run(settings, cell=6).keep and engine.quiet.proof is not None


def test_a_release_held_by_idle_cells_on_their_proof_is_re_armed_by_each_and_once_it_ran_the_next_cell_says_so(
        fake_cuda, monkeypatch):
    _device(fake_cuda)
    checked = _count_nothing_new(monkeypatch)
    cupy = Tokened(live={0: GiB}, cached={0: GiB})
    # its release gives nothing back (a pool it cannot empty): its token stays as it was, and only the proof's
    # held release tells the next cell that the release ran and is still to be reported
    cupy.drain = lambda devices: cupy.calls.update(["drain"]) or {"freed_bytes": {i: 0 for i in devices}, "notes": []}
    engine, _ = _engine(cupy)
    settings = _settings(release="idle", idle_release_s=3600.0)
    engine.run(settings, cell=1)
    job = engine.releases.idle_job
    for cell in range(2, 4):
        engine.cell_starts()
        assert not engine.run(settings, cell=cell).keep
    proof = engine.quiet.proof
    assert proof is not None and proof.held is job and proof.jobs == [job]
    asked = checked["nothing_new"]
    for cell in range(4, 7):
        engine.cell_starts()
        assert not engine.run(settings, cell=cell).keep
    assert checked["nothing_new"] == asked and engine.quiet.proof is proof
    assert engine.releases.idle_job is job and not job.cancelled and cupy.calls["drain"] == 0  # re-armed by each
    assert job.run_now() and job.done.wait(30) and cupy.calls["drain"] == 1  # it runs while the kernel is idle
    assert cupy.quiet_token([0]) == proof.tokens[0]
    engine.cell_starts()  # nothing to hold now: the proof falls
    outcome = engine.run(settings, cell=7)
    assert outcome.keep and outcome.record.idle == [job.result()] and engine.quiet.proof is None
    engine.stop()


@pytest.mark.parametrize("gc_policy, frameworks, quiet_cells", [
    ("auto", 1, 3),
    ("never", 1, 3),  # nothing to collect anyway: as quiet as "auto"
    ("auto", 0, 3),  # raw CUDA (cuda-python, ctypes) with no framework in use: the check alone proves it
    ("always", 1, 0),  # a full collection after every cell: the whole pass runs it
])
def test_the_quiet_check_under_each_garbage_policy_and_with_no_framework(fake_cuda, gc_policy, frameworks, quiet_cells):
    _device(fake_cuda)
    adapters = [Framework(live={0: GiB})][:frameworks]
    engine, native = _engine(*adapters)
    engine.run(_settings(gc=gc_policy), cell=1)
    assert not engine.run(_settings(gc=gc_policy), cell=2).keep
    native.calls.clear()
    for cell in range(3, 6):
        assert not engine.run(_settings(gc=gc_policy), cell=cell).keep
    assert (native.calls["quiet"], native.calls["after_cell"]) == (quiet_cells, 3 - quiet_cells)
    assert engine.since.skipped == 4


def test_ctrl_c_during_the_quiet_check_is_pythons_own_and_the_next_cell_runs_the_whole_pass(fake_cuda):
    """The quiet check waits for nothing, so it is not armed for Ctrl-C (no two sigaction calls per idle cell): a
    Ctrl-C there is the KeyboardInterrupt Python raises, which the extension reports; nothing was proven, so the
    next cell runs the whole pass."""
    _device(fake_cuda)
    handlers = []

    class PressesCtrlC(Framework):
        pressing = False

        def stats(self, devices):
            if self.pressing:
                handlers.append(signal.getsignal(signal.SIGINT))
                raise KeyboardInterrupt  # what Python's own SIGINT handler does
            return super().stats(devices)

    cupy = PressesCtrlC(live={0: GiB})
    engine, native = _engine(cupy)
    engine.run(_settings(), cell=1)
    engine.run(_settings(), cell=2)
    native.calls.clear()
    cupy.pressing = True
    with pytest.raises(KeyboardInterrupt):
        engine.run(_settings(), cell=3)
    assert (native.calls["quiet"], native.calls["after_cell"]) == (1, 0)
    assert handlers == [signal.default_int_handler]  # the cleanup's handler was not installed
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    cupy.pressing = False
    engine.run(_settings(), cell=4)  # the cell after it: a whole pass again (nothing was proven)
    assert (native.calls["quiet"], native.calls["after_cell"]) == (1, 1)


def test_ctrl_c_during_the_driver_pass_is_a_flag_and_the_cleanup_stops_interrupted(fake_cuda):
    _device(fake_cuda)
    engine = None

    class PressesCtrlC(Framework):
        pressing = False

        def stats(self, devices):
            if self.pressing:
                engine.hooks.ctrl_c.pressed = True  # what the SIGINT handler armed for the pass does
            return super().stats(devices)

    cupy = PressesCtrlC(live={0: GiB})
    engine, native = _engine(cupy)
    cupy.pressing = True
    outcome = engine.run(_settings(), cell=1)
    assert native.calls["after_cell"] == 1
    assert outcome.record.interrupted is True
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # restored


class CountedGc:
    """gc.collect as the engine calls it, counted by generation; ``found`` objects "collected" each call, and
    ``on_collect`` run (a collection that frees GPU memory)."""

    def __init__(self, monkeypatch, found=0, on_collect=None):
        self.calls = []
        self.found, self.on_collect = found, on_collect
        monkeypatch.setattr(gc, "collect", self)

    def __call__(self, generation=2):
        self.calls.append(generation)
        if self.on_collect is not None:
            self.on_collect()
        return self.found


def test_an_idle_cell_with_live_gpu_memory_runs_no_collection(fake_cuda, monkeypatch):
    _device(fake_cuda)
    cupy = Framework(live={0: GiB})
    engine, _ = _engine(cupy)
    collections_ = CountedGc(monkeypatch)
    engine.run(_settings(), cell=1)
    assert collections_.calls == [1]  # the first cleanup has nothing to compare with: a young collection
    for cell in range(2, 6):
        assert not engine.run(_settings(), cell=cell, namespace={}).keep
    # the driver saw no change and the figures are the last cleanup's: nothing a collection could give back
    assert collections_.calls == [1] and cupy.calls["stats"] == 5 and engine.since.skipped == 4


def test_an_idle_cell_whose_framework_keeps_what_it_cannot_give_back_runs_no_collection(fake_cuda, monkeypatch):
    # PyTorch keeps the rest of a 20 MiB segment that a live tensor is in: cached, never given back
    class Segmented(Framework):
        def drain(self, devices):
            self.calls["drain"] += 1
            return {"freed_bytes": {i: 0 for i in devices}, "notes": []}

    _device(fake_cuda)
    torch = Segmented(name="torch", live={0: 4 * MiB}, cached={0: 16 * MiB})
    engine, _ = _engine(torch)
    collections_ = CountedGc(monkeypatch)
    engine.run(_settings(), cell=1)
    for cell in range(2, 6):
        assert not engine.run(_settings(), cell=cell, namespace={}).keep
    assert collections_.calls == [1] and engine.since.skipped == 4
    torch.live[0] += 2 * MiB  # handed out of that cache: the driver sees nothing, the figures do
    assert engine.run(_settings(), cell=6).keep
    assert collections_.calls == [1, 1]


def test_a_cell_that_unbinds_a_name_holding_gpu_memory_still_collects(fake_cuda, monkeypatch):
    _device(fake_cuda)
    cupy = Framework(live={0: GiB})
    engine, _ = _engine(cupy)
    model = object()
    namespace = {"model": model, "In": []}
    engine.run(_settings(), cell=1, namespace=namespace)
    engine.since.holders.names = {"model": id(model)}  # what the walk of the namespace found holding GPU memory
    collections_ = CountedGc(monkeypatch)
    del namespace["model"]  # `del model`, its memory still live behind a reference cycle
    engine.run(_settings(), cell=2, namespace=namespace)
    assert collections_.calls == [1, 2]  # young, then full: GPU memory is still live after the young one


def test_a_collection_that_finds_garbage_has_the_frameworks_read_again(fake_cuda, monkeypatch):
    _device(fake_cuda)
    cupy = Framework(live={0: GiB})
    engine, _ = _engine(cupy)
    engine.run(_settings(), cell=1)
    cupy.live[0] = GiB + 256 * MiB  # handed out of the pool during the cell: the driver sees no change

    def frees_the_cycle():
        cupy.live[0] = GiB  # the cycle held those 256 MiB: the collection gave them back to the pool
        cupy.cached[0] = 256 * MiB

    collections_ = CountedGc(monkeypatch, found=4, on_collect=frees_the_cycle)
    stats_before = cupy.calls["stats"]
    outcome = engine.run(_settings(), cell=2)
    assert collections_.calls == [1]
    # read before the collection, again after it found garbage, and after the drain gave the 256 MiB back
    assert cupy.calls["stats"] - stats_before == 3
    dev = outcome.record.devices[0]
    assert dev.live_bytes == {"cupy": GiB} and dev.freed_bytes == {"cupy": 256 * MiB}


def test_a_new_allocation_in_the_driver_is_not_skipped(fake_cuda):
    _device(fake_cuda)
    cupy = Framework(live={0: GiB})
    engine, _ = _engine(cupy)
    engine.run(_settings(), cell=1)
    assert not engine.run(_settings(), cell=2).keep
    fake_cuda.update({"devices": [{"free_bytes": TOTAL - 2 * GiB - 256 * MiB}]})  # a raw allocation the cell kept
    outcome = engine.run(_settings(), cell=3)
    assert outcome.keep and outcome.record.cell == 3 and outcome.record.touched
    assert outcome.record.devices[0].outside_growth_bytes == 256 * MiB
    assert outcome.lines  # show "auto": the cell touched GPU memory
    assert engine.since.skipped == 1
    assert not engine.run(_settings(), cell=4).keep  # and idle again after it


def test_a_framework_figure_that_changes_is_not_skipped(fake_cuda):
    _device(fake_cuda)
    cupy = Framework(live={0: GiB})
    engine, _ = _engine(cupy)
    engine.run(_settings(), cell=1)
    cupy.live[0] += 512 * MiB  # handed out of cupy's pool: the driver sees no change
    outcome = engine.run(_settings(), cell=2)
    assert outcome.keep and outcome.record.devices[0].live_bytes == {"cupy": GiB + 512 * MiB}
    cupy.cached[0] = 256 * MiB  # cached since: given back, not skipped
    outcome = engine.run(_settings(), cell=3)
    assert outcome.keep and outcome.record.devices[0].freed_bytes == {"cupy": 256 * MiB}
    assert cupy.calls["drain"] == 1 and engine.since.skipped == 0


def test_memory_in_the_driver_pools_is_trimmed_not_skipped(fake_cuda):
    _device(fake_cuda)
    engine, _ = _engine(Framework(live={0: GiB}))
    engine.run(_settings(), cell=1)
    fake_cuda.update({"devices": [{"default_pool": {"reserved_bytes": GiB, "used_bytes": 0}}]})
    outcome = engine.run(_settings(), cell=2)
    assert outcome.keep and outcome.record.devices[0].freed_bytes == {"driver": GiB}
    assert engine.since.skipped == 0


@pytest.mark.parametrize("settings, forced", [(dict(show="always"), False), ({}, True)])
def test_show_always_and_gpumem_drain_never_skip(fake_cuda, settings, forced):
    _device(fake_cuda)
    engine, _ = _engine(Framework(live={0: GiB}))
    engine.run(_settings(**settings), cell=1, forced=forced)
    outcome = engine.run(_settings(**settings), cell=2, forced=forced)
    assert outcome.keep and outcome.record.cell == 2 and len(outcome.lines) == 1
    assert engine.since.skipped == 0


def test_release_idle_a_re_run_that_leaves_the_same_cache_is_skipped_and_its_release_re_armed(fake_cuda):
    # release "idle" leaves the cache to a release once the kernel is idle: a cell re-run back to back
    # that leaves the very same cache changes nothing, so the release deferred by the first is re-armed
    _device(fake_cuda)
    cupy = Framework(live={0: GiB}, cached={0: GiB})
    engine, native = _engine(cupy)
    settings = _settings(release="idle", idle_release_s=60.0)
    first = engine.run(settings, cell=1)
    assert first.keep and first.record.deferred == {"device": True, "pinned": False, "after_s": 60.0}
    job = engine.releases.idle_job
    for cell in range(2, 6):
        outcome = engine.run(settings, cell=cell)
        assert outcome.lines == [] and not outcome.keep and outcome.record.deferred is None
    assert engine.since.skipped == 4 and engine.releases.idle_job is job and engine.releases.unreported == [job] and not job.cancelled
    assert cupy.calls["drain"] == 0 and cupy.cached == {0: GiB}
    cupy.cached[0] = 2 * GiB  # the next cell caches more: a full cleanup defers it all anew
    outcome = engine.run(settings, cell=6)
    assert outcome.keep and outcome.record.devices[0].cached_bytes == {"cupy": 2 * GiB}
    assert job.cancelled and engine.releases.idle_job is not job and engine.releases.unreported == [engine.releases.idle_job]
    engine.stop()
    assert engine.releases.idle_job is None and engine.releases.unreported == []


def _asleep(job, until):
    """Waits (bounded) until the release's thread sleeps in its wait, ``until`` as given (None: until woken)."""
    for _ in range(3000):
        with job._lock:
            asleep = job._asleep_until
        if asleep != -math.inf and (asleep is None) == (until is None):
            return asleep
        time.sleep(0.01)
    raise AssertionError(f"the release's thread never slept as expected (it sleeps until {job._asleep_until})")


def test_release_idle_re_arming_wakes_no_thread_while_its_wait_ends_before_the_new_deadline(fake_cuda):
    # a cell re-run back to back re-arms the release on every cell: waking its thread each time would take
    # the GIL from the cell's thread while the kernel replies; the thread sees the later deadline on its own
    _device(fake_cuda)
    cupy = Framework(live={0: GiB}, cached={0: GiB})
    engine, _ = _engine(cupy)
    settings = _settings(release="idle", idle_release_s=3600.0)
    engine.run(settings, cell=1)
    job = engine.releases.idle_job
    first = _asleep(job, until=3600.0)
    woken = []
    notify = job._wake.notify
    job._wake.notify = lambda *a: (woken.append(a), notify(*a))[1]
    for cell in (2, 3, 4):
        engine.cell_starts()
        assert not engine.run(settings, cell=cell).keep  # nothing changed: re-armed
    assert woken == [] and job._deadline > first and job._asleep_until == first and engine.releases.idle_job is job
    assert job.run_now()  # moved sooner (another cell under release "rerun"): this one wakes it
    assert woken == [()] and job.done.wait(30) and cupy.calls["drain"] == 1
    engine.stop()


def test_release_idle_a_re_armed_release_still_runs_once_the_kernel_is_idle(fake_cuda):
    _device(fake_cuda)
    cupy = Framework(live={0: GiB}, cached={0: GiB})
    engine, _ = _engine(cupy)
    settings = _settings(release="idle", idle_release_s=2.0)  # not due before the next cell starts, under load too
    engine.run(settings, cell=1)
    job = engine.releases.idle_job
    engine.cell_starts()  # the next cell holds it: it does not run while the cell runs
    assert not job.done.wait(0.3) and cupy.calls["drain"] == 0
    assert not engine.run(settings, cell=2).keep  # nothing changed: re-armed
    assert job.done.wait(30) and not job.cancelled
    assert cupy.calls["drain"] == 1 and cupy.cached == {}
    outcome = engine.run(settings, cell=3)  # the next cell says what was given back while idle
    assert outcome.keep and outcome.record.idle[0]["devices"] == [{"index": 0, "freed_bytes": {"cupy": GiB}}]
    engine.stop()


def test_release_rerun_keeps_the_cache_for_the_same_cell_and_gives_it_back_as_another_starts(fake_cuda):
    # release "rerun": what a cell caches stays while that very cell is re-run, and goes (on the
    # release's own thread) as soon as any other cell starts
    _device(fake_cuda)
    cupy = Framework(live={0: GiB}, cached={0: GiB})
    engine, _ = _engine(cupy)
    settings = _settings(release="rerun", idle_release_s=3600.0)
    shown = dataclasses.replace(settings, show="always")  # the line even where the driver saw no change
    engine.cell_starts("train()")  # what the extension says as a cell starts
    first = engine.run(shown, cell=1)
    assert first.record.deferred == {"device": True, "pinned": False, "after_s": 3600.0}
    assert "cached 1.0 GiB until idle or another cell (cupy 1.0)" in first.lines[0]
    job = engine.releases.idle_job
    assert job.source == "train()"
    for cell in (2, 3):  # re-run back to back: nothing changed, the release is re-armed
        engine.cell_starts("train()")
        assert not engine.run(settings, cell=cell).keep
    assert engine.since.skipped == 2 and engine.releases.idle_job is job and cupy.calls["drain"] == 0
    engine.cell_starts("evaluate()")  # another cell: the caches go now, not after an hour
    assert engine.releases.idle_job is None and job.done.wait(30) and not job.cancelled
    assert cupy.calls["drain"] == 1 and cupy.cached == {}
    outcome = engine.run(shown, cell=4)
    assert outcome.keep and outcome.record.idle == [job.result()]
    assert job.result()["when"] == "cell" and job.result()["devices"] == [{"index": 0, "freed_bytes": {"cupy": GiB}}]
    assert "freed 1.0 GiB left by [1] (cupy 1.0)" in outcome.lines[0]
    engine.stop()


def test_release_rerun_a_cell_whose_source_is_not_known_keeps_the_cache_until_idle(fake_cuda):
    _device(fake_cuda)
    cupy = Framework(live={0: GiB}, cached={0: GiB})
    engine, _ = _engine(cupy)
    settings = _settings(release="rerun", idle_release_s=3600.0)
    engine.run(settings, cell=1)  # no source said (the engine used without the extension): as "idle"
    job = engine.releases.idle_job
    assert job.source is None
    engine.cell_starts("other()")
    assert engine.releases.held() is job and not job.done.is_set() and cupy.calls["drain"] == 0
    engine.stop()
    assert job.cancelled


@pytest.mark.parametrize("exc_type", [RuntimeError, MemoryError, KeyboardInterrupt])
def test_release_rerun_a_framework_that_fails_on_the_release_thread_is_said_by_the_next_cell(fake_cuda, exc_type):
    _device(fake_cuda)
    class Broken(Framework):
        def drain(self, devices):
            self.calls["drain"] += 1
            raise exc_type("the pool is corrupt")

    broken = Broken(live={0: GiB}, cached={0: GiB})
    engine, _ = _engine(broken)
    settings = _settings(release="rerun", idle_release_s=3600.0)
    engine.cell_starts("a()")
    engine.run(settings, cell=1)
    job = engine.releases.idle_job
    engine.cell_starts("b()")  # another cell: the release runs on its thread, and its adapter raises there
    assert job.done.wait(30) and broken.calls["drain"] == 1
    outcome = engine.run(settings, cell=2)
    assert outcome.keep and any("the pool is corrupt" in note for note in outcome.record.notes)
    assert any(exc_type.__name__ in note for note in outcome.record.notes)
    engine.stop()


# ------------------------------------------------------------------ the idle cell in a shell


class Endpoint(StandInEndpoint):
    def __init__(self):
        super().__init__()
        self.published = []
        self.states = []

    def start(self, shell):
        pass

    def set_state(self, state):
        self.states.append(state["state"])

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
    ip.config.pop("GPUCleanup", None)


def test_an_idle_cell_publishes_nothing_and_prints_nothing(shell, fake_cuda, monkeypatch, capsys):
    _device(fake_cuda)
    cupy = Framework(live={0: GiB})
    endpoint = Endpoint()
    monkeypatch.setattr(gpucleanup, "_native", Native())
    monkeypatch.setattr(gpucleanup.frameworks, "active", lambda: [cupy])
    monkeypatch.setattr(gpucleanup.in_kernel.status_endpoint, "StatusEndpoint", lambda: endpoint)
    shell.run_line_magic("load_ext", "gpucleanup")
    ext = extension.get_extension(shell)
    shell.run_cell("a = 1", store_history=True)
    published, kept = len(endpoint.published), len(ext.history.last())
    capsys.readouterr()
    endpoint.states.clear()
    for i in range(5):
        shell.run_cell(f"a = {i}", store_history=True)
    assert capsys.readouterr().out == ""
    assert len(endpoint.published) == published and len(ext.history.last()) == kept
    assert ext.engine.since.skipped == 5
    # the status endpoint hears "running" and "idle", never of a drain that did not happen
    assert endpoint.states == ["running", "idle"] * 5
    endpoint.states.clear()
    fake_cuda.update({"devices": [{"free_bytes": TOTAL - 3 * GiB}]})  # the next cell keeps 1 GiB more
    shell.run_cell("a = 6", store_history=True)
    assert len(endpoint.published) == published + 1 and ext.history.last()[-1]["touched"] is True
    assert endpoint.states == ["running", "draining", "idle"]
    assert "gpucleanup · GPU0" in capsys.readouterr().out


def test_no_cell_is_skipped_while_the_allocation_trace_runs(fake_cuda):
    _device(fake_cuda)
    engine, _ = _engine(Framework(live={0: GiB}))
    engine.run(_settings(), cell=1)
    kept = {2: [{"device": 0, "bytes": 64 * MiB, "count": 1, "threads": 1, "site": "cuMemAlloc_v2",
                 "caller": "cell.py", "kind": "raw"}]}
    engine.hooks.traced = lambda cell: kept.get(cell, [])
    engine.hooks.tracing = lambda: True
    outcome = engine.run(_settings(), cell=2)
    assert outcome.keep and outcome.record.traced == kept[2]
    outcome = engine.run(_settings(), cell=3)  # what it traced may have been freed with no driver change
    assert outcome.keep and outcome.record.traced == []
    engine.hooks.tracing = lambda: False  # the trace stopped
    assert not engine.run(_settings(), cell=4).keep and engine.since.skipped == 1


# ------------------------------------------------------------------ stand-in cases, on the fake driver


def test_driver_pools_off_settles_and_leaves_the_pools(fake_cuda):
    _device(fake_cuda, pool=GiB)
    engine, native = _engine()
    trims = fake_cuda.counter("calls.cuMemPoolTrimTo")
    outcome = engine.run(_settings(driver_pools=False), cell=1)
    dev = outcome.record.devices[0]
    assert dev.state == "drained" and dev.freed_bytes == {}
    assert fake_cuda.counter("calls.cuMemPoolTrimTo") == trims and native.calls["trim"] == 0
    # 2 GiB in use, the pool's gigabyte among them: the driver's, not outside every pool
    assert (dev.used_after_bytes, dev.outside_bytes) == (2 * GiB, GiB)
    outcome = engine.run(_settings(), cell=2)
    assert outcome.record.devices[0].freed_bytes == {"driver": GiB}


def test_several_devices_one_record_and_line_each_and_an_idle_one_untouched(fake_cuda):
    fake_cuda.reset({"devices": [
        {"total_bytes": TOTAL, "free_bytes": TOTAL - GiB, "primary_active": True,
         "default_pool": {"reserved_bytes": GiB, "used_bytes": 0}},
        {"total_bytes": TOTAL, "free_bytes": TOTAL - GiB, "primary_active": True,
         "default_pool": {"reserved_bytes": 2 * GiB, "used_bytes": 0}},
        {"total_bytes": TOTAL, "primary_active": False}]})
    cupy = Framework(live={0: GiB, 1: 0}, cached={0: GiB})
    engine, _ = _engine(cupy)
    outcome = engine.run(_settings(pinned=False), cell=1)
    assert [d.index for d in outcome.record.devices] == [0, 1]
    assert [d.freed_bytes for d in outcome.record.devices] == [{"driver": GiB, "cupy": GiB}, {"driver": 2 * GiB}]
    assert len(outcome.lines) == 2 and outcome.lines[0].startswith("gpucleanup · GPU0")
    assert outcome.lines[1].startswith("gpucleanup · GPU1")
    assert fake_cuda.counter("contexts_created") == 0


def test_a_busy_device_is_skipped_and_its_frameworks_are_left_alone(fake_cuda):
    from shell_stand_ins import _settled

    fake_cuda.reset({"devices": [{"total_bytes": TOTAL, "free_bytes": TOTAL - GiB, "primary_active": True,
                                  "sync_seconds": -1}]})
    cupy = Framework(live={0: GiB}, cached={0: GiB})
    engine, _ = _engine(cupy)
    try:
        outcome = engine.run(_settings(settle_timeout=0.2), cell=1)
        dev = outcome.record.devices[0]
        assert dev.state == "busy" and dev.freed_bytes == {}
        assert cupy.calls == {}  # neither read nor drained on a device with queued work
        assert "busy after" in outcome.lines[0]
        second = engine.run(_settings(settle_timeout=0.2), cell=2)
        assert second.keep and second.record.devices[0].state == "busy" and engine.since.skipped == 0
    finally:
        _settled(fake_cuda)


# ------------------------------------------------------------------ a release on its own thread, and parking


def test_a_pinned_release_whose_thread_finds_a_park_under_way_ends_freeing_nothing():
    # The pinned release (release "cell") starts on its thread after the cell's last driver call; should a park
    # have begun before that thread did, no cell will hold it and re-arm it: it ends at once, and the next cell's
    # cleanup finds what is still pinned.
    told = []
    engine = types.SimpleNamespace(background=lambda begin: told.append(begin) or False, exiting=False)
    cupy = Framework(live={0: GiB}, cached={0: GiB})
    job = after_cell.PinnedRelease(engine, [cupy], cell=4)
    job.start()
    assert job.done.wait(30)
    assert job.cancelled and told == [True]  # asked once, and no end said for a begin that was refused
    assert cupy.calls["drain_pinned"] == 0
    assert job.result() == {"cell": 4, "freed_bytes": {}, "elapsed_s": 0.0}


def test_no_park_begins_while_a_release_runs_on_its_thread_and_none_runs_while_a_park_is_under_way(
        fake_cuda, tmp_path, monkeypatch):
    # A release's driver calls made after a park's lock wait for the restore; the thread that waits holds the
    # interpreter lock (the library is called through ctypes.PyDLL), so the kernel could never run the cell
    # that resumes it. The status server therefore refuses a park while a release runs, and a release whose
    # deadline comes while a park is under way waits for the next cell.
    import threading

    from gpucleanup.in_kernel.status_endpoint import StatusEndpoint

    runtime = tmp_path / "runtime"
    runtime.mkdir(mode=0o700)
    monkeypatch.setenv("JUPYTER_RUNTIME_DIR", str(runtime))
    endpoint = StatusEndpoint()
    endpoint.start(types.SimpleNamespace(user_ns={}))
    assert endpoint.error is None, endpoint.error
    draining, let_go = threading.Event(), threading.Event()

    class Slow(Framework):
        def drain(self, devices):
            draining.set()
            let_go.wait(30)
            return super().drain(devices)

    _device(fake_cuda)
    cupy = Slow(live={0: GiB}, cached={0: GiB})
    engine, _ = _engine(cupy)
    engine.releases.background = endpoint.background
    settings = _settings(release="idle", idle_release_s=0.05)
    try:
        engine.run(settings, cell=1)
        job = engine.releases.idle_job
        endpoint.cell_state("idle", None, 0)
        assert draining.wait(30)  # the release runs on its thread, in the framework's drain
        with pytest.raises(RuntimeError, match="park refused: gpucleanup is giving the frameworks' caches back"):
            endpoint.park_step("begin")
        let_go.set()
        assert job.done.wait(30) and cupy.calls["drain"] == 1
        assert endpoint.park_step("begin")["state"] == "parking"  # it has ended: a park may begin
        cupy.cached[0] = GiB  # the next cell caches again; its release comes due while the park is under way
        draining.clear()
        engine.cell_starts()
        engine.run(settings, cell=2)
        job = engine.releases.idle_job
        _asleep(job, until=None)  # its deadline came: refused, it now waits for the next cell
        assert not draining.is_set() and cupy.calls["drain"] == 1 and not job.done.is_set()
        endpoint.park_step("failed")  # the park ended: the next cell re-arms it, and it runs
        engine.cell_starts()
        assert not engine.run(settings, cell=3).keep
        assert job.done.wait(30) and cupy.calls["drain"] == 2
        assert endpoint.park_step("begin")["state"] == "parking"  # every release that began has ended
    finally:
        let_go.set()
        engine.stop()
        endpoint.close()


def test_under_a_release_that_waits_a_cache_only_the_kernels_thread_can_empty_is_emptied_as_the_cell_ends(fake_cuda):
    # PyCUDA's pools can be emptied only on the thread that made them: a release on a thread of its own could
    # never give them back, so they are emptied as the cell ends; the other frameworks' caches wait for it
    _device(fake_cuda)
    cupy, pycuda = Framework(live={0: GiB}), Framework("pycuda", live={0: GiB})
    pycuda.drains_on_cell_thread = True
    engine, native = _engine(cupy, pycuda)
    settings = _settings(release="rerun", idle_release_s=3600)
    engine.run(settings, cell=1)
    cupy.cached[0] = pycuda.cached[0] = GiB  # a cell leaves a GiB in each cache
    outcome = engine.run(settings, cell=2)
    assert (pycuda.calls["drain"], cupy.calls["drain"]) == (1, 0)
    assert outcome.record.devices[0].freed_bytes == {"pycuda": GiB}
    job = engine.releases.idle_job
    assert job is not None and job.adapters == [cupy]
    assert job.run_now() and job.done.wait(10)
    assert (pycuda.calls["drain"], cupy.calls["drain"]) == (1, 1) and cupy.cached == {}
    # only PyCUDA cached something: emptied at once, nothing left for a release
    engine.run(settings, cell=3)
    pycuda.cached[0] = GiB
    outcome = engine.run(settings, cell=4)
    assert pycuda.calls["drain"] == 2 and outcome.record.devices[0].freed_bytes == {"pycuda": GiB}
    assert engine.releases.idle_job is None or engine.releases.idle_job.cell != 4
    engine.stop()


def test_idle_cells_keep_the_names_that_hold_gpu_memory_without_rebuilding_them_and_a_rebound_one_is_seen(fake_cuda):
    """The quiet check found each name that holds GPU memory bound to its object, and the live bytes are those of
    the last update: an idle cell leaves the names as they are (no map rebuilt). A name bound to another object is
    seen by the next cell, which runs the whole pass and forgets it (nothing grew: no walk)."""
    _device(fake_cuda)
    cupy = Framework(live={0: GiB})
    engine, native = _engine(cupy)
    model = object()
    namespace = {"model": model, "In": []}
    engine.since.holders._walk = lambda ns: {"model": id(ns["model"])}  # what the walk finds holding GPU memory
    engine.run(_settings(), cell=1, namespace=namespace)
    engine.run(_settings(), cell=2, namespace=namespace)
    assert engine.since.holders.names == {"model": id(model)}
    names = engine.since.holders.names
    updates = []
    real_update = engine.since.holders.update
    engine.since.holders.update = lambda ns, live: (updates.append(live), real_update(ns, live))
    native.calls.clear()
    for cell in range(3, 8):
        assert not engine.run(_settings(), cell=cell, namespace=namespace).keep
    assert (native.calls["quiet"], native.calls["after_cell"]) == (5, 0)
    assert updates == [] and engine.since.holders.names is names
    other = object()
    namespace["model"] = other  # `model = ...`: the name now holds another object
    engine.run(_settings(), cell=8, namespace=namespace)
    assert (native.calls["quiet"], native.calls["after_cell"]) == (5, 1)  # not proven idle: the whole pass
    assert updates == [GiB] and engine.since.holders.names == {}


def test_a_release_held_as_its_cell_starts_is_not_held_again_by_the_cleanup(fake_cuda):
    _device(fake_cuda)
    cupy = Framework(live={0: GiB}, cached={0: GiB})
    engine, _ = _engine(cupy)
    engine.run(_settings(release="idle", idle_release_s=60.0), cell=1)  # caches left for a release once idle
    job = engine.releases.idle_job
    assert job is not None
    holds = []
    real_hold = job.hold
    job.hold = lambda: (holds.append(1), real_hold())[1]
    assert engine.cell_starts("x = 1") is None  # the next cell starts: held until it ends
    assert engine.releases.held() is job and holds == [1]
    engine.run(_settings(release="idle", idle_release_s=60.0), cell=2)
    assert holds == [1]  # the cleanup found it held already
    engine.stop()
