"""The stand-ins for driving the extension in an in-process IPython shell, shared by the test files that do: a
scripted native module, framework adapters and a recording status endpoint, and the fixtures over them (``shell``,
``gpu``: the real library over the fake CUDA driver, ``stand_in``: a stand-in native module, ``real``)."""

from __future__ import annotations

import collections
import json
import re
import time
import types

import pytest

from gpucleanup.in_kernel import extension
from support import GiB


# ------------------------------------------------------------------ stand-ins


class StandInDevice:
    def __init__(self, index, name="NVIDIA H100 80GB HBM3", total=80 * GiB, used=GiB, pool_reserved=0, in_use=True):
        self.index = index
        self.name = name
        self.total = total
        self.used = used  # everything but the driver pool's reserved bytes
        self.pool_reserved = pool_reserved
        self.in_use = in_use

    @property
    def used_bytes(self):
        return self.used + self.pool_reserved


class StandInNative:
    """Stand-in for gpucleanup._native with the protocol the engine runs: ``probe`` (at load),
    ``cuda_initialized``, ``after_cell(timeout=, progress=, trim=)`` and ``trim()`` returning the
    shapes of share/schema (after_cell.schema.json), ``snapshot`` (%gpumem); scripted."""

    def __init__(self, state="ready", devices=None):
        self.state = state
        self.devices = devices if devices is not None else [StandInDevice(0, pool_reserved=GiB)]
        self.calls = collections.Counter()
        self.trims = []  # the trim argument of each after_cell pass
        self.progress = []  # payloads sent to the progress callback by passes with a timeout > 0
        self.interrupt_at_progress = False  # Ctrl-C arrives while the callback runs (as _native sees it)
        self.busy = set()
        self.sticky = set()
        self.fail = {}  # call name -> exception to raise

    def _maybe_fail(self, name):
        self.calls[name] += 1
        if name in self.fail:
            raise self.fail[name]

    def _driver(self):
        return {"state": self.state, "path": "/stand-in/libcuda.so.1", "version": 13000, "resolver": None, "missing_optional": [], "message": ""}

    def device(self, index):
        return next(d for d in self.devices if d.index == index)

    def _in_use(self):
        return [d for d in self.devices if d.in_use] if self.state == "ready" else []

    def probe(self):
        self._maybe_fail("probe")
        devices = []
        if self.state == "ready":
            devices = [{"index": d.index, "in_use": d.in_use, "context": "primary" if d.in_use else None, "state": "in_use" if d.in_use else "idle"} for d in self.devices]
        return {"kind": "probe", "driver": self._driver(), "devices": devices}

    def cuda_initialized(self):
        """As the library: False when nothing initialised CUDA, None when the driver is missing or unusable."""
        self._maybe_fail("cuda_initialized")
        if self.state in ("ready", "not_initialized"):
            return self.state == "ready"
        return None

    def snapshot(self):
        self._maybe_fail("snapshot")
        out = self.probe()
        self.calls["probe"] -= 1
        out["kind"] = "snapshot"
        for entry, d in zip(out["devices"], self.devices):
            entry.update(name=d.name, total_bytes=d.total)
            if d.in_use and d.index not in self.sticky:
                entry.update(
                    used_bytes=d.used_bytes,
                    free_bytes=d.total - d.used_bytes,
                    pools=[{"which": "default", "handle": "0x1", "reserved_bytes": d.pool_reserved, "used_bytes": 0, "reserved_high_bytes": d.pool_reserved, "used_high_bytes": 0}],
                )
        return out

    def _figures(self, d, entry, reserved_before):
        """A device's memory after the pass and its pool, as the library's after_cell and trim report them."""
        if d.index in self.sticky:
            entry.update(total_bytes=d.total, pools=[])
            return entry
        entry.update(total_bytes=d.total, used_bytes=d.used_bytes, free_bytes=d.total - d.used_bytes,
                     pools=[{"which": "default", "handle": "0x1", "reserved_before_bytes": reserved_before,
                             "reserved_after_bytes": d.pool_reserved, "trimmed": reserved_before != d.pool_reserved}])
        return entry

    def _waited(self, timeout, progress):
        """The progress payloads of a wait: (interrupted, keyboard_interrupt)."""
        if not (timeout > 0 and progress is not None):
            return False, False
        for payload in self.progress:
            try:
                if progress(payload):
                    return True, False
                if self.interrupt_at_progress:
                    raise KeyboardInterrupt
            except KeyboardInterrupt:
                return True, True
        return False, False

    def after_cell(self, timeout=30.0, progress=None, trim=True):
        self._maybe_fail("after_cell")
        self.trims.append(trim)
        interrupted, keyboard = self._waited(timeout, progress) if self._in_use() else (False, False)
        devices = []
        for d in self._in_use():
            reserved_before = d.pool_reserved
            entry = {"index": d.index, "name": d.name, "context": "primary", "error": None, "message": None,
                     "free_before_bytes": d.total - d.used_bytes, "released_bytes": 0}
            if d.index in self.sticky:
                entry.update(state="unusable", settle={"status": "skipped", "waited_s": 0.0},
                             message=f"GPU{d.index} is unusable after CUDA_ERROR_ILLEGAL_ADDRESS: restart the kernel",
                             free_before_bytes=None)
            elif interrupted:
                entry.update(state="busy", settle={"status": "interrupted", "waited_s": 2.0, "busy_for_s": 2.0})
            elif d.index in self.busy:
                entry.update(state="busy", settle={"status": "timeout", "waited_s": timeout, "busy_for_s": timeout})
            else:
                if trim:
                    entry["released_bytes"], d.pool_reserved = d.pool_reserved, 0
                entry.update(state="drained", settle={"status": "done" if timeout else "skipped", "waited_s": 0.0})
            devices.append(self._figures(d, entry, reserved_before))
        result = {"kind": "after_cell", "driver": self._driver(), "timeout_s": timeout, "trim": bool(trim),
                  "elapsed_s": 0.0, "interrupted": interrupted, "devices": devices}
        if keyboard:
            result["keyboard_interrupt"] = True
        return result

    def trim(self):
        self._maybe_fail("trim")
        devices = []
        for d in self._in_use():
            reserved_before = d.pool_reserved
            entry = {"index": d.index, "name": d.name, "context": "primary", "error": None, "message": None,
                     "released_bytes": 0, "state": "trimmed"}
            if d.index in self.sticky:
                entry.update(state="unusable")
            elif d.index in self.busy:
                entry.update(state="busy")
            else:
                entry["released_bytes"], d.pool_reserved = d.pool_reserved, 0
            devices.append(self._figures(d, entry, reserved_before))
        return {"kind": "trim", "driver": self._driver(), "elapsed_s": 0.0, "devices": devices}


class StandInAdapter:
    """Stand-in framework adapter with the interface of gpucleanup.frameworks."""

    def __init__(self, name, native, live=None, cached=None, pinned_cached=0, can_release=True):
        self.name = name
        self.native = native
        self.live = dict(live or {})
        self.cached = dict(cached or {})
        self.pinned_cached = pinned_cached
        self.can_release = can_release
        self.calls = collections.Counter()
        self.fail = {}
        self.pinned_gate = None  # threading.Event the background pinned release waits for
        self.in_pinned = False
        self.overlaps = 0
        self.on_drain = None

    def _call(self, verb):
        self.calls[verb] += 1
        if verb in self.fail:
            raise self.fail[verb]

    def in_use(self):
        return True

    def stats(self, devices):
        self._call("stats")
        return {
            "devices": {i: {"live_bytes": self.live.get(i, 0), "cached_bytes": self.cached.get(i, 0)} for i in devices},
            "pinned": {"live_bytes": 0, "cached_bytes": self.pinned_cached},
            "notes": [],
        }

    def drain(self, devices):
        if self.in_pinned:
            self.overlaps += 1
        self._call("drain")
        if self.on_drain:
            self.on_drain()
        freed = {}
        for i in devices:
            n = self.cached.pop(i, 0)
            if n:
                freed[i] = n
                self.native.device(i).used -= n
        return {"freed_bytes": freed, "notes": []}

    def drain_pinned(self):
        self.in_pinned = True
        try:
            self._call("drain_pinned")
            if self.pinned_gate is not None:
                self.pinned_gate.wait(10)
            freed, self.pinned_cached = self.pinned_cached, 0
            return {"freed_bytes": freed, "notes": []}
        finally:
            self.in_pinned = False

    def describe(self):
        return f"{self.name} stand-in"


class StandInEndpoint:
    """The status endpoint (gpucleanup.in_kernel.status_endpoint.StatusEndpoint) with every method the extension
    and the park's kernel side call, recording what it is told in ``events``; no server, so nothing can park the
    kernel. A test overrides what it needs (a park lock, a parked state, a refusal)."""

    running = True
    park_lock = None  # parking needs a served endpoint: "not parked: ... the status endpoint ..."

    def __init__(self):
        self.events = []

    def start(self, shell):
        self.events.append(("start", shell))

    def set_state(self, state):
        self.events.append(("set_state", dict(state)))

    def cell_state(self, state, cell=None, since_ns=None):
        # the endpoint's per-cell form of set_state; None: the park state is not known here (parked() says it)
        now = time.time_ns() if since_ns is None else since_ns
        self.set_state({"state": state, "since_ns": now} if state == "idle"
                       else {"state": state, "cell": cell, "since_ns": now})
        return None

    def publish(self, record):
        json.dumps(record)  # what is published must be JSON
        self.events.append(("publish", record))

    def background(self, begin, activity=False):
        return True  # nothing can park this kernel: its own work on a thread may always run

    def parked(self):
        return 0

    def park_blocker(self, why):
        pass  # no automatic park to keep away

    def park_step(self, step, parked_bytes=None, then=None):
        raise RuntimeError("parking needs the status endpoint, which is off")

    def close(self):
        self.events.append(("close",))


# ------------------------------------------------------------------ the fake driver's side


def fake_device(used=0, pool_reserved=0, active=True, **more):
    """One device of a fake driver scenario: ``used`` bytes outside the driver's default pool (a framework's own
    pool, the context), ``pool_reserved`` bytes reserved by that pool, 80 GiB in all."""
    return {"name": "NVIDIA H100 80GB HBM3", "primary_active": active, "total_bytes": 80 * GiB,
            "free_bytes": 80 * GiB - used - pool_reserved, "default_pool": {"reserved_bytes": pool_reserved}, **more}


class FakeDevice:
    """A device of the fake driver as a stand-in framework moves memory on it: ``used`` is everything but the
    default pool's reserved bytes, ``pool_reserved`` that pool's; setting one keeps the other."""

    def __init__(self, fake, index):
        self.fake = fake
        self.index = index

    def _state(self):
        return self.fake.state()["devices"][self.index]

    def _patch(self, **patch):
        self.fake.update({"devices": [{}] * self.index + [patch]})

    @property
    def used(self):
        s = self._state()
        return s["total_bytes"] - s["free_bytes"] - s["default_pool"]["reserved_bytes"]

    @used.setter
    def used(self, value):
        s = self._state()
        self._patch(free_bytes=s["total_bytes"] - value - s["default_pool"]["reserved_bytes"])

    @property
    def pool_reserved(self):
        return self._state()["default_pool"]["reserved_bytes"]

    @pool_reserved.setter
    def pool_reserved(self, value):
        used = self.used
        self._patch(default_pool={"reserved_bytes": value}, free_bytes=self._state()["total_bytes"] - used - value)


class FakeGpus:
    """The fake driver's devices, for the stand-in adapters (``StandInAdapter(name, gpus)``)."""

    def __init__(self, fake):
        self.fake = fake

    def device(self, index):
        return FakeDevice(self.fake, index)


class NativeCalls:
    """The real ``gpucleanup._native``, its calls counted: ``calls`` per function, ``trims`` the trim argument of
    each after-cell pass, ``fail`` (function name -> exception) what a call raises instead of calling the library,
    ``seen`` callables told each call's name before it runs."""

    NAMES = ("probe", "snapshot", "drain", "after_cell", "trim", "cuda_initialized", "quiet")

    def __init__(self, monkeypatch):
        from gpucleanup import _native

        self.calls = collections.Counter()
        self.trims = []
        self.fail = {}
        self.seen = []
        for name in self.NAMES:
            monkeypatch.setattr(_native, name, self._counted(name, getattr(_native, name)))

    def _counted(self, name, fn):
        def counted(*args, **kwargs):
            self.calls[name] += 1
            for see in self.seen:
                see(name)
            if name == "after_cell":
                self.trims.append(kwargs.get("trim", True))
            if name in self.fail:
                raise self.fail[name]
            return fn(*args, **kwargs)

        return counted


def _inject(monkeypatch, adapters=(), endpoint=None):
    """What the extension finds when it loads: these framework adapters (gpucleanup.frameworks.active) and this
    status endpoint (gpucleanup.in_kernel.status_endpoint.StatusEndpoint, a factory); the native module is the real one."""
    import gpucleanup.frameworks
    import gpucleanup.in_kernel.status_endpoint

    monkeypatch.setattr(gpucleanup.frameworks, "active", lambda: list(adapters))
    if endpoint is not None:
        monkeypatch.setattr(gpucleanup.in_kernel.status_endpoint, "StatusEndpoint", endpoint)


# ------------------------------------------------------------------ fixtures


@pytest.fixture
def shell():
    """The process's InteractiveShell, with gpucleanup unloaded and config reset afterwards."""
    from IPython.core.interactiveshell import InteractiveShell

    ip = InteractiveShell.instance()
    ip.config.pop("GPUCleanup", None)
    yield ip
    ip.extension_manager.unload_extension("gpucleanup")
    for name in ("x", "y", "z", "err"):
        ip.user_ns.pop(name, None)
    ip.config.pop("GPUCleanup", None)


class StandIn(types.SimpleNamespace):
    pass


@pytest.fixture
def gpu(fake_cuda, monkeypatch):
    """The real library over the fake driver's GPU0 (7 GiB used: 1 GiB reserved by the driver's pool, 1 GiB outside
    every pool, and a cupy-like stand-in adapter's 2 GiB live and 3 GiB cached, 1 GiB pinned), with a recording
    status endpoint. Its tests check what a cell's own cleanup does, so every cache is given back as the cell ends
    (release "cell"); the default, "rerun", and the other policies have tests of their own that set them.
    ``name``: GPU0's short name as the library reports it (it keeps the first it read, see _fake_name)."""
    from IPython.core.interactiveshell import InteractiveShell

    monkeypatch.setitem(InteractiveShell.instance().config.GPUCleanup, "release", "cell")
    fake_cuda.reset({"devices": [fake_device(used=6 * GiB, pool_reserved=GiB)]})
    name = _fake_name()
    gpus = FakeGpus(fake_cuda)
    native = NativeCalls(monkeypatch)
    cupy = StandInAdapter("cupy", gpus, live={0: 2 * GiB}, cached={0: 3 * GiB}, pinned_cached=GiB)
    adapters = [cupy]
    endpoint = StandInEndpoint()
    _inject(monkeypatch, adapters, lambda: endpoint)
    yield StandIn(native=native, fake=fake_cuda, gpus=gpus, device=gpus.device, name=name, cupy=cupy,
                  adapters=adapters, endpoint=endpoint)
    _settled(fake_cuda)  # a wait this test left running ends before the next test's first call


@pytest.fixture
def stand_in(monkeypatch):
    """A stand-in native module (StandInNative), for what the fake driver cannot produce in this process: no
    driver at all (the library loads its driver once per process), and waits of several seconds (the library's
    first progress report comes after 2 s of real waiting). Otherwise as ``gpu``."""
    import gpucleanup
    from IPython.core.interactiveshell import InteractiveShell

    monkeypatch.setitem(InteractiveShell.instance().config.GPUCleanup, "release", "cell")
    native = StandInNative()
    cupy = StandInAdapter("cupy", native, live={0: 2 * GiB}, cached={0: 3 * GiB}, pinned_cached=GiB)
    native.device(0).used += 5 * GiB
    adapters = [cupy]
    endpoint = StandInEndpoint()
    monkeypatch.setattr(gpucleanup, "_native", native)
    _inject(monkeypatch, adapters, lambda: endpoint)
    return StandIn(native=native, cupy=cupy, adapters=adapters, endpoint=endpoint)


def _ext(ip):
    return extension.get_extension(ip)


def _wait_pinned(ip):
    job = _ext(ip).engine.releases.pinned_job
    if job is not None:
        assert job.done.wait(10)


def _lines(text):
    """Output lines of gpucleanup with the (varying) timing replaced."""
    return [re.sub(r" · [0-9.]+ (ms|s)$", " · <t>", line) for line in text.splitlines() if line.startswith("gpucleanup")]


def _run(ip, code, capsys):
    result = ip.run_cell(code, store_history=True)
    out = capsys.readouterr()
    assert "Error in callback" not in out.out
    return result, out


@pytest.fixture
def real(monkeypatch):
    """The real library over the fake driver, its calls counted, with no framework adapter and a recording
    status endpoint; the test scripts the fake driver itself."""
    native = NativeCalls(monkeypatch)
    _inject(monkeypatch, (), StandInEndpoint)
    return native


def _fake_name(index=0):
    """The device name as the native library reports it: it keeps the first name it read for the
    process's life (a real GPU does not change its name), so an earlier test's scenario may have set it."""
    from gpucleanup import _native
    from gpucleanup.records import report

    return report.short_device_name(_native.snapshot()["devices"][index]["name"])


def _settled(fake_cuda):
    fake_cuda.release_sync()
    from gpucleanup import _native

    deadline = time.monotonic() + 10
    while any(d["state"] == "busy" for d in _native.probe()["devices"]):
        assert time.monotonic() < deadline
        time.sleep(0.01)
