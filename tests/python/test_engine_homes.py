"""The engine's parts, each alone: the background releases (``Releases``), the idle proof (``QuietCheck``), the
figures since the last pass (``SinceLastPass``) and the face that renders what the engine decides
(``report.CellVoice``). The layering the split keeps is tests/python/test_structure.py's."""

from __future__ import annotations

import collections
import threading

from gpucleanup.engine import after_cell
from gpucleanup.records import report
from gpucleanup.engine.figures import FrameworkFigures, Held, outside_every_pool
from gpucleanup.engine.releases import Release, Releases
from gpucleanup.engine.settings import Settings
from test_cell_pass import TOTAL, Native, _device  # noqa: F401  (the real library, its calls counted)
from support import GiB, MiB  # noqa: E402



def _engine(*adapters):
    native = Native()
    engine = after_cell.AfterCell(native, adapters=lambda: list(adapters),
                                  voice=report.CellVoice(write=lambda text: None))
    engine.baseline(native.probe())
    native.calls.clear()
    return engine, native


class Framework:
    """A framework adapter over scripted figures, with a quiet token (its figures as a tuple)."""

    def __init__(self, name="cupy", live=None, cached=None, pinned=0):
        self.name = name
        self.live, self.cached, self.pinned = dict(live or {}), dict(cached or {}), pinned
        self.calls = collections.Counter()

    def stats(self, devices):
        self.calls["stats"] += 1
        return {"devices": {i: {"live_bytes": self.live.get(i, 0), "cached_bytes": self.cached.get(i, 0)}
                            for i in devices}, "pinned": {"live_bytes": 0, "cached_bytes": self.pinned}, "notes": []}

    def quiet_token(self, devices, in_use=False):
        return tuple(sorted(self.live.items())) + tuple(sorted(self.cached.items()))

    def drain(self, devices):
        self.calls["drain"] += 1
        return {"freed_bytes": {i: self.cached.pop(i, 0) for i in devices}, "notes": []}

    def drain_pinned(self):
        self.calls["drain_pinned"] += 1
        freed, self.pinned = self.pinned, 0
        return {"freed_bytes": freed, "notes": []}

    def describe(self):
        return f"{self.name} holds its arrays"


# ------------------------------------------------------------------ QuietCheck


def test_with_a_device_in_use_and_no_framework_the_driver_figures_alone_prove_idle_cells(fake_cuda):
    _device(fake_cuda)
    engine, native = _engine()
    settings = Settings()
    assert engine.run(settings, cell=1).keep  # the first cell: the whole pass, a record
    assert not engine.run(settings, cell=2).keep  # proven idle by the whole pass
    assert engine.quiet.ok and engine.quiet.proof is None
    native.calls.clear()
    for cell in range(3, 8):
        assert not engine.run(settings, cell=cell).keep
    proof = engine.quiet.proof
    # the proof rests on the driver's figures alone: no framework, no token
    assert proof is not None and proof.adapters == () and proof.tokens == ()
    assert dict(native.calls) == {"quiet": 5} and engine.since.skipped == 6
    # the device's memory moves: the quiet check says so, the whole pass runs and forgets the proof
    fake_cuda.update({"devices": [{"free_bytes": TOTAL - 3 * GiB}]})
    outcome = engine.run(settings, cell=8)
    assert outcome.keep and engine.quiet.proof is None and native.calls["after_cell"] == 1


def test_the_quiet_check_forgets_its_proof_as_a_cell_takes_it():
    quiet = after_cell.QuietCheck()
    quiet.ok, quiet.proof = True, "proof"
    assert quiet.take() == (True, "proof")
    assert (quiet.ok, quiet.proof) == (False, None)
    quiet.adapters_kept = (1, Settings(), [])
    quiet.forget_adapters()
    assert quiet.adapters_kept is None


# ------------------------------------------------------------------ Releases


def test_releases_alone_give_back_a_deferred_cache_once_idle_and_trim_after_it():
    trims = []
    releases = Releases(trim=lambda: trims.append(1) or {"devices": [{"index": 0, "released_bytes": MiB}]})
    told = []
    releases.background = lambda begin: told.append(begin) or True
    cupy = Framework(cached={0: 3 * GiB}, pinned=GiB)
    job = releases.defer(Release(device=True, pinned=True, trim=True), [cupy], [0], cell=4, delay_s=0.0,
                         rerun=False)
    assert releases.idle_job is job and releases.unreported == [job]
    assert job.done.wait(30)
    assert trims == [1] and told == [True, False]
    assert job.result()["devices"] == [{"index": 0, "freed_bytes": {"cupy": 3 * GiB, "driver": MiB}}]
    assert job.result()["pinned_freed_bytes"] == {"cupy": GiB}
    assert releases.finished_idle() == [job] and releases.unreported == [] and job.reported


def test_a_cell_holds_a_waiting_release_and_one_that_changed_nothing_rearms_it():
    releases = Releases(trim=lambda: {})
    cupy = Framework(cached={0: GiB})
    job = releases.defer(Release(device=True), [cupy], [0], cell=1, delay_s=3600.0, rerun=False)
    assert releases.cell_starts() is None and releases.held() is job
    releases.rearm_held()
    assert releases.held() is None and releases.idle_job is job and not job.cancelled
    releases.cell_starts()
    releases.cell_ends()  # held and not re-armed: not wanted any more
    assert job.cancelled and releases.idle_job is None and releases.unreported == []
    assert cupy.calls["drain"] == 0


def test_under_release_rerun_another_cell_runs_the_release_at_once():
    releases = Releases(trim=lambda: {})
    cupy = Framework(cached={0: GiB})
    releases.cell_starts("x = 1")
    job = releases.defer(Release(device=True), [cupy], [0], cell=1, delay_s=3600.0, rerun=True)
    assert job.source == "x = 1"
    assert releases.cell_starts("x = 1") is None and releases.held() is job  # the same cell again: held
    releases.rearm_held()
    assert releases.cell_starts("y = 2") is job  # another cell: it runs now
    assert job.done.wait(30) and job.when == "cell" and cupy.calls["drain"] == 1


def test_an_adapter_lock_is_one_per_framework():
    releases = Releases(trim=lambda: {})
    assert releases.adapter_lock("cupy") is releases.adapter_lock("cupy")
    assert releases.adapter_lock("cupy") is not releases.adapter_lock("torch")
    assert isinstance(releases.adapter_lock("cupy"), type(threading.Lock()))


# ------------------------------------------------------------------ SinceLastPass and the figures


def test_outside_every_pool_is_one_computation_for_the_cells_record_and_gpumem(fake_cuda):
    _device(fake_cuda, used=6 * GiB, pool=0)
    cupy = Framework(live={0: 2 * GiB}, cached={0: GiB})
    engine, _ = _engine(cupy)
    settings = Settings(release="idle")  # the cache stays until idle: the record and %gpumem see the same figures
    record = engine.run(settings, cell=1).record
    status = engine.memory_status(settings)
    dev = status["devices"][0]
    assert record.devices[0].outside_bytes == dev["outside_bytes"] == dev["used_bytes"] - 3 * GiB
    stats = {"cupy": FrameworkFigures(devices={0: Held(live=2 * GiB, cached=GiB)})}
    assert outside_every_pool(dev["used_bytes"], stats, 0, 0) == dev["outside_bytes"]
    assert outside_every_pool(GiB, stats, 0, 0) == 0  # never below zero


def test_since_last_pass_counts_the_first_use_of_a_device_after_the_baseline(fake_cuda):
    fake_cuda.reset({"devices": [{"total_bytes": TOTAL, "free_bytes": TOTAL, "primary_active": False}]})
    engine, _ = _engine()
    assert engine.since.seen_in_use == set()
    _device(fake_cuda)
    record = engine.run(Settings(), cell=1).record
    assert record.devices[0].first_use and engine.since.seen_in_use == {0}
    assert engine.last_driver_state == "ready"


# ------------------------------------------------------------------ the face speaks


def test_an_engine_without_a_voice_decides_but_says_nothing(fake_cuda):
    _device(fake_cuda)
    written = []
    engine = after_cell.AfterCell(Native(), adapters=lambda: [Framework(live={0: GiB}, cached={0: GiB})])
    outcome = engine.run(Settings(show="always"), cell=1)
    assert outcome.lines == [] and outcome.keep and not outcome.record.shown and written == []
    spoken = after_cell.AfterCell(Native(), adapters=lambda: [Framework(live={0: GiB}, cached={0: GiB})],
                                  voice=report.CellVoice(write=written.append))
    outcome = spoken.run(Settings(show="always"), cell=1)
    assert outcome.record.shown and outcome.lines == report.summary_lines(outcome.data)
    assert outcome.lines[0].startswith("gpucleanup · GPU0")


def test_the_voice_renders_a_sticky_error_alone_when_the_summary_is_not_shown():
    voice = report.CellVoice(write=lambda text: None)
    data = {"devices": [{"index": 0, "state": "unusable", "quiet": False, "message": None}]}
    assert voice.summary(data, shown=False) == ["gpucleanup · GPU0 is unusable: restart the kernel"]
    data["devices"][0]["quiet"] = True  # said before: nothing
    assert voice.summary(data, shown=False) == []
    assert voice.nothing_in_use({"state": "no_driver"}) == ["gpucleanup · no CUDA driver: nothing to clean"]
    assert voice.nothing_in_use({"state": "ready"}) == ["gpucleanup · no GPU in use by this kernel: nothing to clean"]


def test_the_progress_line_is_rewritten_in_place_and_closed():
    written = []
    voice = report.CellVoice(write=written.append)
    voice.progress(0, 2.4, again=False)
    voice.progress(0, 3.6, again=True)
    voice.progress_end()
    assert written == ["gpucleanup · waiting for GPU0 to finish queued work … 2 s",
                       "\rgpucleanup · waiting for GPU0 to finish queued work … 3 s", "\n"]


def test_the_facade_holds_its_parts_and_nothing_else():
    engine = after_cell.AfterCell(Native())
    assert set(vars(engine)) == {"native", "frameworks", "releases", "since", "quiet", "hooks"}
