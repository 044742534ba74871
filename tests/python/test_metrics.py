"""Prometheus metrics (gpucleanup.outside.metrics) and the cumulative totals behind its counters (gpucleanup.records.totals).

The kernels are status endpoints in this process (the native server over the fake CUDA driver): one
described with a notebook and published records, or the extension itself loaded in an InteractiveShell.
A kernel that does not answer is a discovery file naming a socket nobody listens on. Scrapes are parsed
back with prometheus_client's own parser.
"""

from __future__ import annotations

import json
import math
import os
import stat
import selectors
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
import types
import urllib.error
import urllib.request
from pathlib import Path
from typing import Optional

import pytest

prometheus_client = pytest.importorskip("prometheus_client")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

import gpucleanup
import gpucleanup.frameworks
import gpucleanup.in_kernel.status_endpoint
from gpucleanup.protocol import discovery
from gpucleanup.in_kernel import extension
from gpucleanup.outside import exporter as exporter_mod, kernels, metrics  # noqa: E402
from gpucleanup.in_kernel.status_endpoint import StatusEndpoint  # noqa: E402
from gpucleanup.records.totals import BUCKETS_S, Totals, settle_wait_s  # noqa: E402
from support import GiB, MiB  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


# ------------------------------------------------------------------ helpers


def scrape_text(text: str) -> list:
    """Every sample of an exposition: (name, labels, value)."""
    return [(s.name, dict(s.labels), s.value) for family in text_string_to_metric_families(text) for s in family.samples]


def scrape(registry) -> list:
    return scrape_text(prometheus_client.generate_latest(registry).decode())


def values(samples: list, name: str, **labels) -> list:
    """Values of the samples called ``name`` whose labels include ``labels``."""
    return [v for n, l, v in samples if n == name and all(l.get(k) == str(x) for k, x in labels.items())]


def value(samples: list, name: str, **labels) -> float:
    found = values(samples, name, **labels)
    assert len(found) == 1, (name, labels, found)
    return found[0]


def registry_for(runtime: Path, timeout: float = 5.0):
    registry = prometheus_client.CollectorRegistry()
    registry.register(metrics.KernelCollector(runtime, timeout=timeout))
    return registry


def settled(device: int = 0, waited: float = 0.0, status: str = "done") -> dict:
    return {"status": status, "waited_s": waited}


def record(cell, devices, pinned_freed=None, background=(), idle=()) -> dict:
    """A record's plain form, as much of it as the totals and the metrics read."""
    return {"cell": cell, "devices": devices,
            "pinned": {"freed_bytes": dict(pinned_freed or {}), "background": list(background), "pending": False,
                       "pools": {}},
            "idle": list(idle)}


def write_discovery(runtime: Path, pid: int, **fields) -> Path:
    info = {
        "discovery": 1, "pid": pid, "proc_start_ticks": None, "kernel_id": f"k{pid}", "connection_file": None,
        "notebook": None, "endpoint": f"ipc://{runtime}/gpucleanup/{pid}.sock",
        "pub_endpoint": f"ipc://{runtime}/gpucleanup/{pid}.sock.pub", "transport": "ipc", "key_file": None,
        "signature_scheme": "hmac-sha256", "protocol": 1, "started_ns": 1, "version": "0.1.0",
    }
    info.update(fields)
    path = runtime / f"gpucleanup-{pid}.json"
    discovery.write(path, info)
    return path


# Two cleanups on two devices, with pinned, background and idle releases.
FIRST = record(
    11,
    [{"index": 0, "settle": settled(waited=0.004), "freed_bytes": {"cupy": 6 * GiB, "driver": 1 * GiB},
      "live_bytes": {"cupy": 2 * GiB}, "cached_bytes": {}, "outside_bytes": 300 * MiB},
     {"index": 1, "settle": settled(waited=0.25), "freed_bytes": {"torch": 3 * GiB},
      "live_bytes": {}, "cached_bytes": {}, "outside_bytes": 0}],
    pinned_freed={"cupy": 64 * MiB},
)
SECOND = record(
    12,
    [{"index": 0, "settle": settled(waited=0.001), "freed_bytes": {"cupy": 1 * GiB},
      "live_bytes": {"cupy": 1 * GiB, "torch": 2 * MiB}, "cached_bytes": {"torch": 300 * MiB},
      "outside_bytes": 512 * MiB}],
    background=[{"cell": 11, "freed_bytes": {"cupy": 32 * MiB}, "elapsed_s": 0.01}],
    idle=[{"cell": 11, "devices": [{"index": 1, "freed_bytes": {"torch": 5 * MiB}}],
           "pinned_freed_bytes": {"torch": 8 * MiB}, "elapsed_s": 0.02}],
)


@pytest.fixture
def kernel(runtime, fake_cuda):
    """This process, described as a kernel of /home/me/fit.ipynb that cleaned two cells on GPU0 and GPU1."""
    fake_cuda.reset({"devices": [
        {"name": "Fake H100", "primary_active": True, "total_bytes": 80 * GiB, "free_bytes": 70 * GiB,
         "default_pool": {"reserved_bytes": 256 * MiB, "used_bytes": 64 * MiB}},
        {"name": "Fake H100", "primary_active": True, "total_bytes": 80 * GiB, "free_bytes": 79 * GiB},
    ]})
    ep = StatusEndpoint()
    ep.start(types.SimpleNamespace(user_ns={"__session__": "/home/me/fit.ipynb"}))
    assert ep.error is None, ep.error
    totals = Totals(started_ns=1_763_780_000_000_000_000)
    for each in (FIRST, SECOND):
        totals.add(each)
        ep.publish(dict(each, totals=totals.as_dict()))
    ep.set_state({"state": "idle", "since_ns": time.time_ns()})
    yield types.SimpleNamespace(endpoint=ep, totals=totals, pid=str(os.getpid()))
    ep.close()


# ------------------------------------------------------------------ Totals


def test_totals_count_cleanups_and_bytes_freed_per_device_framework_and_pinned():
    totals = Totals(started_ns=5)
    totals.add(FIRST)
    totals.add(SECOND)
    data = totals.as_dict()
    assert data["started_ns"] == 5
    assert data["cleanups"] == 2
    assert data["devices"] == [
        {"index": 0, "freed_bytes": {"cupy": 7 * GiB, "driver": 1 * GiB}},
        # the idle release's bytes are counted with the record that reports them
        {"index": 1, "freed_bytes": {"torch": 3 * GiB + 5 * MiB}},
    ]
    # the cleanup's own pinned release, the background one it left and the idle one, once each
    assert data["pinned_freed_bytes"] == {"cupy": 96 * MiB, "torch": 8 * MiB}


def test_totals_wait_histogram_buckets_are_inclusive_upper_bounds():
    totals = Totals(buckets=(0.001, 0.01, 1.0))
    for seconds in (0.0, 0.001, 0.0011, 0.01, 1.0, 1.5):
        totals.observe_wait(seconds)
    wait = totals.as_dict()["settle_wait_s"]
    assert wait["le"] == [0.001, 0.01, 1.0]
    # le=0.001 holds 0 and 0.001 (equal to the bound: inside it); cumulative from there
    assert wait["counts"] == [2, 4, 5]
    assert wait["count"] == 6  # the +Inf bucket: 1.5 s too
    assert wait["sum"] == pytest.approx(0.0 + 0.001 + 0.0011 + 0.01 + 1.0 + 1.5)


def test_totals_default_buckets_are_the_documented_ones():
    wait = Totals().as_dict()["settle_wait_s"]
    assert wait == {"le": [0.001, 0.01, 0.1, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0], "counts": [0] * 9, "count": 0, "sum": 0.0}
    assert list(BUCKETS_S) == wait["le"]


def test_a_cleanups_wait_is_its_longest_settle_and_skipped_settles_are_not_waits():
    assert settle_wait_s(FIRST) == 0.25
    two = record(1, [{"index": 0, "settle": settled(waited=0.0, status="skipped")},
                     {"index": 1, "settle": settled(waited=2.0, status="timeout")}])
    assert settle_wait_s(two) == 2.0
    none = record(2, [{"index": 0, "settle": settled(waited=0.0, status="skipped")}, {"index": 1, "settle": None}])
    assert settle_wait_s(none) is None
    totals = Totals()
    totals.add(none)
    totals.add(record(3, []))
    data = totals.as_dict()
    assert data["cleanups"] == 2 and data["settle_wait_s"]["count"] == 0


def test_totals_take_what_can_be_read_of_a_malformed_record():
    totals = Totals()
    totals.add({"devices": [{"index": "0", "freed_bytes": {"cupy": 5}}, {"index": 0, "freed_bytes": {"cupy": -3, "torch": 7}},
                            "not a device"], "pinned": None, "idle": "x"})
    totals.add("not a record")
    data = totals.as_dict()
    assert data["cleanups"] == 1
    assert data["devices"] == [{"index": 0, "freed_bytes": {"torch": 7}}]
    assert data["pinned_freed_bytes"] == {}


@pytest.mark.parametrize("buckets", [(), (1.0, 0.5), (0.1, 0.1), (0.1, math.inf)])
def test_totals_refuse_buckets_that_are_not_increasing_finite_bounds(buckets):
    with pytest.raises(ValueError, match="increasing"):
        Totals(buckets=buckets)


def test_the_totals_json_matches_the_record_schema(schemas):
    totals = Totals()
    totals.add(FIRST)
    schemas["cell_record.schema.json"].validate(
        {"cell": 1, "time_ns": 1, "elapsed_s": 0.0, "driver_state": "ready", "interrupted": False, "devices": [],
         "pinned": {"freed_bytes": {}, "background": [], "pending": False, "pools": {}},
         "gc": {"policy": "auto", "ran": None, "elapsed_s": 0.0, "collected": 0}, "notes": [], "shown_notes": [],
         "unraisable": [], "touched": False, "shown": False, "release": "cell", "deferred": None, "idle": [],
         "totals": totals.as_dict()})


# ------------------------------------------------------------------ the collector


def test_device_gauges_carry_the_last_records_figures_per_framework(kernel):
    samples = scrape(registry_for(kernel.endpoint.discovery_path.parent))
    gpu0 = dict(pid=kernel.pid, notebook="/home/me/fit.ipynb", device=0)
    assert value(samples, "gpucleanup_device_live_bytes", framework="cupy", **gpu0) == 1 * GiB
    assert value(samples, "gpucleanup_device_live_bytes", framework="torch", **gpu0) == 2 * MiB
    assert value(samples, "gpucleanup_device_cached_bytes", framework="torch", **gpu0) == 300 * MiB
    assert values(samples, "gpucleanup_device_cached_bytes", framework="cupy", **gpu0) == []
    assert value(samples, "gpucleanup_device_outside_bytes", **gpu0) == 512 * MiB


def test_device_gauges_carry_the_live_snapshot_and_the_devices_uuid(kernel):
    from gpucleanup import _native

    snapshot = {d["index"]: d for d in _native.snapshot()["devices"]}
    samples = scrape(registry_for(kernel.endpoint.discovery_path.parent))
    for index in (0, 1):
        uuid = snapshot[index]["uuid"]
        assert uuid.startswith("GPU-")
        labels = dict(kernel_id="", notebook="/home/me/fit.ipynb", pid=kernel.pid, device=index, uuid=uuid)
        assert value(samples, "gpucleanup_device_total_bytes", **labels) == 80 * GiB
        assert value(samples, "gpucleanup_device_used_bytes", **labels) == snapshot[index]["used_bytes"]
    assert value(samples, "gpucleanup_device_used_bytes", device=0) == 10 * GiB
    assert value(samples, "gpucleanup_driver_pool_reserved_bytes", device=0) == 256 * MiB
    assert value(samples, "gpucleanup_driver_pool_used_bytes", device=0) == 64 * MiB
    # every device series of the kernel has the same label names
    names = {tuple(sorted(l)) for n, l, _ in samples if n.startswith("gpucleanup_device_") and "framework" not in l}
    assert names == {("device", "kernel_id", "notebook", "pid", "user", "uuid")}


def test_counters_are_the_published_totals(kernel):
    samples = scrape(registry_for(kernel.endpoint.discovery_path.parent))
    me = dict(pid=kernel.pid, notebook="/home/me/fit.ipynb")
    assert value(samples, "gpucleanup_cells_cleaned_total", **me) == 2
    # freed after two cells: the sum of both records (and of the idle release on GPU1)
    assert value(samples, "gpucleanup_freed_bytes_total", device=0, framework="cupy", **me) == 6 * GiB + 1 * GiB
    assert value(samples, "gpucleanup_freed_bytes_total", device=0, framework="driver", **me) == 1 * GiB
    assert value(samples, "gpucleanup_freed_bytes_total", device=1, framework="torch", **me) == 3 * GiB + 5 * MiB
    assert value(samples, "gpucleanup_pinned_freed_bytes_total", framework="cupy", **me) == 96 * MiB
    assert value(samples, "gpucleanup_pinned_freed_bytes_total", framework="torch", **me) == 8 * MiB
    # _created: when the kernel's totals started
    assert value(samples, "gpucleanup_cells_cleaned_created", **me) == 1_763_780_000.0


def test_the_wait_histogram_is_the_published_buckets(kernel):
    samples = scrape(registry_for(kernel.endpoint.discovery_path.parent))
    buckets = {l["le"]: v for n, l, v in samples if n == "gpucleanup_wait_seconds_bucket"}
    # FIRST waited 0.25 s (its longest device), SECOND 0.001 s (on the bound: in le=0.001)
    assert buckets == {"0.001": 1, "0.01": 1, "0.1": 1, "0.5": 2, "1.0": 2, "2.0": 2, "5.0": 2, "10.0": 2, "30.0": 2,
                       "+Inf": 2}
    assert value(samples, "gpucleanup_wait_seconds_count") == 2
    assert value(samples, "gpucleanup_wait_seconds_sum") == pytest.approx(0.251)


def test_the_kernels_state_is_one_series_per_state(kernel):
    samples = scrape(registry_for(kernel.endpoint.discovery_path.parent))
    states = {l["state"]: v for n, l, v in samples if n == "gpucleanup_kernel_state"}
    assert states == {"idle": 1, "running": 0, "draining": 0, "waiting": 0, "parking": 0, "parked": 0, "lost": 0,
                      "unknown": 0}
    assert value(samples, "gpucleanup_kernel_state_age_seconds") >= 0
    kernel.endpoint.set_state({"state": "running", "cell": 13, "since_ns": time.time_ns()})
    samples = scrape(registry_for(kernel.endpoint.discovery_path.parent))
    assert {l["state"]: v for n, l, v in samples if n == "gpucleanup_kernel_state"}["running"] == 1
    assert value(samples, "gpucleanup_kernel_up", pid=kernel.pid) == 1
    assert value(samples, "gpucleanup_kernels") == 1
    assert value(samples, "gpucleanup_scrape_ok") == 1
    assert value(samples, "gpucleanup_scrape_duration_seconds") >= 0


def test_a_parked_kernel_says_so_with_the_bytes_it_holds_in_host_memory(kernel):
    assert value(scrape(registry_for(kernel.endpoint.discovery_path.parent)), "gpucleanup_kernel_parked") == 0
    kernel.endpoint.set_state({"state": "idle", "since_ns": time.time_ns()})
    kernel.endpoint.park_step("begin")
    kernel.endpoint.park_step("parked", 3 << 30)
    try:
        samples = scrape(registry_for(kernel.endpoint.discovery_path.parent))
        states = {l["state"]: v for n, l, v in samples if n == "gpucleanup_kernel_state"}
        assert (states["parked"], states["idle"]) == (1, 0)
        assert value(samples, "gpucleanup_kernel_parked", pid=kernel.pid) == 1
        assert value(samples, "gpucleanup_kernel_parked_bytes", pid=kernel.pid) == 3 << 30
    finally:
        kernel.endpoint.park_step("resumed")
    samples = scrape(registry_for(kernel.endpoint.discovery_path.parent))
    assert value(samples, "gpucleanup_kernel_parked", pid=kernel.pid) == 0
    assert values(samples, "gpucleanup_kernel_parked_bytes", pid=kernel.pid) == []


def test_a_kernel_that_does_not_answer_is_down_with_no_device_series(kernel, runtime):
    # a live process (ours' parent) whose discovery file names a socket nobody listens on
    parent = os.getppid()
    write_discovery(runtime, parent, kernel_id="5f1c-gone", notebook="lost.ipynb")
    samples = scrape(registry_for(runtime))
    gone = dict(kernel_id="5f1c-gone", notebook="lost.ipynb", pid=parent)
    assert value(samples, "gpucleanup_kernel_up", **gone) == 0
    assert value(samples, "gpucleanup_kernel_error", kind="no_answer", **gone) == 1
    assert [n for n, l, _ in samples if l.get("pid") == str(parent)] == ["gpucleanup_kernel_up", "gpucleanup_kernel_error"]
    # the kernel that answers is unaffected
    assert value(samples, "gpucleanup_kernel_up", pid=kernel.pid) == 1
    assert values(samples, "gpucleanup_kernel_error", pid=kernel.pid) == []
    assert value(samples, "gpucleanup_kernels") == 2


def test_no_kernel_gives_counts_of_zero_and_no_kernel_series(runtime):
    samples = scrape(registry_for(runtime))
    assert value(samples, "gpucleanup_kernels") == 0
    assert value(samples, "gpucleanup_kernels_elsewhere") == 0
    assert [n for n, l, _ in samples if "pid" in l] == []


def test_a_kernel_of_an_older_gpucleanup_has_gauges_and_no_counters(runtime, fake_cuda):
    fake_cuda.reset({"devices": [{"primary_active": True}]})
    ep = StatusEndpoint()
    ep.start(types.SimpleNamespace(user_ns={}))
    try:
        ep.publish({"cell": 3, "devices": [{"index": 0, "live_bytes": {"cupy": 5}, "cached_bytes": {}}]})
        samples = scrape(registry_for(runtime))
    finally:
        ep.close()
    assert value(samples, "gpucleanup_device_live_bytes", framework="cupy", notebook="") == 5
    assert [n for n, _, _ in samples if n.startswith(("gpucleanup_freed", "gpucleanup_cells", "gpucleanup_wait"))] == []


def test_registering_asks_no_kernel(runtime, monkeypatch):
    monkeypatch.setattr(kernels, "gather", lambda *a, **k: pytest.fail("registering gathered the kernels"))
    registry = prometheus_client.CollectorRegistry(auto_describe=True)
    registry.register(metrics.KernelCollector(runtime))
    monkeypatch.undo()


def test_without_prometheus_client_the_error_says_how_to_install_it(runtime, monkeypatch):
    monkeypatch.setitem(sys.modules, "prometheus_client", None)
    monkeypatch.setitem(sys.modules, "prometheus_client.core", None)
    collector = metrics.KernelCollector(runtime)  # the module and the object need nothing
    with pytest.raises(metrics.MetricsUnavailable, match=r"pip install 'gpucleanup\[server\]'"):
        list(collector.collect())
    # the exporter's own error, which the command prints (exit status 2)
    with pytest.raises(exporter_mod.ExporterError, match=r"pip install 'gpucleanup\[server\]'"):
        exporter_mod.start_exporter(0, runtime_dir=runtime)


def test_a_timeout_that_is_not_a_positive_number_is_refused(runtime):
    for bad in (0, -1, "1", float("nan")):
        with pytest.raises(ValueError, match="timeout must be a number of seconds above 0"):
            metrics.KernelCollector(runtime, timeout=bad)


# ------------------------------------------------------------------ the extension publishes its totals


@pytest.fixture
def shell(runtime, monkeypatch):
    """The process's InteractiveShell with the extension over the real library (fake driver), the real
    status endpoint, and no framework adapters; unloaded afterwards."""
    from IPython.core.interactiveshell import InteractiveShell

    monkeypatch.setattr(gpucleanup.frameworks, "active", lambda: [])
    monkeypatch.setenv("JPY_SESSION_NAME", "/home/me/train.ipynb")
    ip = InteractiveShell.instance()
    ip.config.pop("GPUCleanup", None)
    yield ip
    ip.extension_manager.unload_extension("gpucleanup")
    ip.user_ns.pop("x", None)


def test_the_extension_publishes_its_totals_and_keeps_its_history_per_cell(shell, runtime, fake_cuda, schemas, capsys):
    from gpucleanup.protocol import status_client

    fake_cuda.reset({"devices": [{"name": "Fake H100", "primary_active": True,
                                  "default_pool": {"reserved_bytes": 1 * GiB, "used_bytes": 0}}]})
    shell.run_line_magic("load_ext", "gpucleanup")
    ext = extension.get_extension(shell)
    assert ext._endpoint is not None and ext._endpoint.running
    shell.run_cell("x = 1", store_history=True)
    fake_cuda.update({"devices": [{"default_pool": {"reserved_bytes": 512 * MiB}}]})
    shell.run_cell("x = 2", store_history=True)
    capsys.readouterr()

    history = ext.history.last()
    assert [r["devices"][0]["freed_bytes"] for r in history] == [{"driver": 1 * GiB}, {"driver": 512 * MiB}]
    assert all("totals" not in r for r in history)  # the kernel's own history stays per cell
    assert all("totals" not in r for r in ext.status()["history"])

    target = kernels.target_of(kernels.gather(runtime).kernels[0].kernel)
    reply = status_client.request(target, "status")
    published = reply["last_record"]
    schemas["cell_record.schema.json"].validate(published)
    assert {k: v for k, v in published.items() if k != "totals"} == history[-1]
    totals = published["totals"]
    assert totals["cleanups"] == 2
    assert totals["devices"] == [{"index": 0, "freed_bytes": {"driver": 1 * GiB + 512 * MiB}}]
    expected = Totals()
    for each in history:
        expected.add(each)
    assert totals["settle_wait_s"] == expected.as_dict()["settle_wait_s"]
    assert totals["settle_wait_s"]["count"] == 2  # both cleanups settled GPU0
    # the endpoint's history keeps the published copies: each record with the totals as of it
    served = status_client.request(target, "history")["records"]
    assert [r["totals"]["cleanups"] for r in served] == [1, 2]
    assert served[-1] == published

    samples = scrape(registry_for(runtime))
    me = dict(pid=os.getpid(), notebook="/home/me/train.ipynb", device=0, framework="driver")
    assert value(samples, "gpucleanup_freed_bytes_total", **me) == 1 * GiB + 512 * MiB
    assert value(samples, "gpucleanup_cells_cleaned_total", pid=os.getpid()) == 2
    cumulative = expected.as_dict()["settle_wait_s"]["counts"]
    buckets = [v for n, l, v in samples if n == "gpucleanup_wait_seconds_bucket"]
    assert buckets == cumulative + [2]
    assert value(samples, "gpucleanup_kernel_state", state="idle") == 1


# ------------------------------------------------------------------ jupyter_server's /metrics


def test_register_server_collector_registers_once_and_unregisters(runtime):
    registry = prometheus_client.CollectorRegistry()
    app = types.SimpleNamespace(runtime_dir=str(runtime))
    first = metrics.register_server_collector(app, registry=registry)
    assert metrics.register_server_collector(app, registry=registry) is first
    assert first.directories() == [runtime]
    assert value(scrape(registry), "gpucleanup_kernels") == 0
    assert metrics.unregister_server_collector(registry) is True
    assert metrics.unregister_server_collector(registry) is False
    assert values(scrape(registry), "gpucleanup_kernels") == []


class _App:
    """A server app as the collector sees one: its runtime directory (and weak references, as ServerApp)."""

    def __init__(self, runtime_dir):
        self.runtime_dir = str(runtime_dir)


def test_the_server_collector_follows_each_servers_own_runtime_directory(kernel, runtime, tmp_path):
    other = tmp_path / "other-runtime"
    other.mkdir(mode=0o700)
    write_discovery(other, os.getppid(), kernel_id="k-other", notebook="other.ipynb")  # asked, no answer
    registry = prometheus_client.CollectorRegistry()
    first, second = _App(runtime), _App(other)
    collector = metrics.register_server_collector(first, registry=registry)
    # a second server in the process: the same collector (one /metrics), now asking its directory too
    assert metrics.register_server_collector(second, registry=registry) is collector
    assert metrics.register_server_collector(second, registry=registry) is collector
    third = _App(runtime)  # a third server on the first one's directory
    assert metrics.register_server_collector(third, registry=registry) is collector
    assert collector.directories() == [runtime, other]  # the shared directory once
    samples = scrape(registry)
    assert value(samples, "gpucleanup_kernels") == 2
    assert value(samples, "gpucleanup_kernel_up", pid=kernel.pid) == 1
    assert value(samples, "gpucleanup_kernel_up", kernel_id="k-other") == 0
    # the first server goes: the second's kernels stay
    first._stopping = True  # ServerApp.stop() sets it
    assert collector.directories() == [other, runtime]  # the third server still follows runtime
    assert metrics.unregister_server_collector(registry, serverapp=second) is True
    assert metrics.unregister_server_collector(registry, serverapp=second) is False
    assert collector.directories() == [runtime]
    del first
    import gc

    gc.collect()
    assert collector.servers == 1  # the third
    assert metrics.unregister_server_collector(registry) is True
    assert values(scrape(registry), "gpucleanup_kernels") == []


def test_a_stopped_or_collected_server_is_no_longer_asked(runtime, tmp_path):
    registry = prometheus_client.CollectorRegistry()
    gone, stopping = _App(tmp_path / "gone"), _App(runtime)
    collector = metrics.register_server_collector(gone, registry=registry)
    metrics.register_server_collector(stopping, registry=registry)
    del gone
    import gc

    gc.collect()
    assert collector.directories() == [runtime]
    stopping._stopping = True
    assert collector.directories() == []
    samples = scrape(registry)
    assert (value(samples, "gpucleanup_kernels"), value(samples, "gpucleanup_scrape_ok")) == (0, 1)
    assert metrics.unregister_server_collector(registry) is True


def _on_a_loop(call):
    """``call()`` on a thread that runs an asyncio event loop, as jupyter_server's /metrics handler runs."""
    import asyncio

    async def run():
        return call()

    return asyncio.run(run())


def test_the_first_scrape_on_the_servers_loop_shows_a_collection_it_waited_for(kernel, runtime):
    registry = prometheus_client.CollectorRegistry()
    app = _App(runtime)
    collector = metrics.register_server_collector(app, timeout=5.0, registry=registry)
    assert collector.collections == 0  # registering asks no kernel: the first scrape's collection is its own
    samples = _on_a_loop(lambda: scrape(registry))
    assert value(samples, "gpucleanup_kernels") == 1
    assert value(samples, "gpucleanup_kernel_up", pid=kernel.pid, notebook="/home/me/fit.ipynb") == 1
    assert collector.collections == 1


def test_later_scrapes_on_the_loop_never_wait_and_the_first_waits_boundedly(runtime, monkeypatch):
    registry = prometheus_client.CollectorRegistry()
    app = _App(runtime)
    collector = metrics.register_server_collector(app, timeout=0.5, registry=registry)
    release = threading.Event()
    real = kernels.gather

    def held(*args, **kwargs):
        assert release.wait(60)
        return real(*args, **kwargs)

    try:
        monkeypatch.setattr(kernels, "gather", held)
        started = time.monotonic()
        first = _on_a_loop(lambda: scrape(registry))
        waited = time.monotonic() - started
        # a collection that does not end: the first scrape gives up at timeout + 0.5 s, showing nothing
        assert 0.9 <= waited < 30, waited
        assert values(first, "gpucleanup_kernels") == []
        release.set()
        deadline = time.monotonic() + 60
        while collector.collections < 1 or collector._running is not None:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        release.clear()
        # figures exist now: a scrape on the loop shows them at once, the next collection held meanwhile
        second = _on_a_loop(lambda: scrape(registry))
        assert value(second, "gpucleanup_kernels") == 0
        assert collector._running is not None  # it started the next one and did not wait for it
    finally:
        release.set()
    assert metrics.unregister_server_collector(registry) is True


def test_kernels_of_several_users_carry_each_owners_name_or_uid(kernel, runtime):
    import pwd

    me = pwd.getpwuid(os.getuid()).pw_name
    named = next(u for u in (2, 1, 3) if _has_name(u))
    nameless = next(u for u in range(54321, 54400) if not _has_name(u))
    if os.geteuid() != 0:
        pytest.skip("processes of other users need root to start (setpriv)")
    others = [subprocess.Popen(["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "sleep", "300"])
              for uid in (named, nameless)]
    try:
        for proc in others:
            write_discovery(runtime, proc.pid, kernel_id=f"k{proc.pid}")
        deadline = time.monotonic() + 60
        while any(_process_uid(p.pid) != uid for p, uid in zip(others, (named, nameless))):
            assert time.monotonic() < deadline
            time.sleep(0.01)
        samples = scrape(registry_for(runtime))
    finally:
        for proc in others:
            proc.kill()
            proc.wait()
    assert value(samples, "gpucleanup_kernel_up", pid=kernel.pid, user=me) == 1
    assert value(samples, "gpucleanup_kernel_up", pid=others[0].pid, user=pwd.getpwuid(named).pw_name) == 0
    assert value(samples, "gpucleanup_kernel_up", pid=others[1].pid, user=nameless) == 0
    # every per-kernel series carries the label (so sum by (user) works on any of them)
    assert all("user" in l for n, l, _ in samples if "pid" in l)


def _has_name(uid: int) -> bool:
    import pwd

    try:
        pwd.getpwuid(uid)
        return True
    except KeyError:
        return False


def _process_uid(pid: int):
    try:
        with open(f"/proc/{pid}/status") as lines:
            return next(int(l.split()[1]) for l in lines if l.startswith("Uid:"))
    except (OSError, StopIteration):
        return None


def test_idle_seconds_count_from_the_end_of_the_last_cell_and_are_0_while_one_runs(kernel):
    registry = registry_for(kernel.endpoint.discovery_path.parent)
    kernel.endpoint.set_state({"state": "running", "cell": 13, "since_ns": time.time_ns() - 700 * 10**9})
    kernel.endpoint.set_state({"state": "idle", "since_ns": time.time_ns() - 600 * 10**9})  # cell 13 ended then
    idle = value(scrape(registry), "gpucleanup_kernel_idle_seconds", pid=kernel.pid)
    assert 600 <= idle < 660, idle
    kernel.endpoint.set_state({"state": "running", "cell": 14, "since_ns": time.time_ns() - 60 * 10**9})
    samples = scrape(registry)
    assert value(samples, "gpucleanup_kernel_idle_seconds", pid=kernel.pid) == 0
    assert value(samples, "gpucleanup_kernel_state_age_seconds", pid=kernel.pid) >= 60  # the state's age is not idleness


def test_idle_seconds_of_a_reply_state():
    # a library older than last_cell_ended_ns: the state's age
    assert metrics.idle_seconds({"state": "idle", "age_s": 12.5}) == 12.5
    assert metrics.idle_seconds({"state": "waiting", "device": 0, "cell": 3, "age_s": 40.0}) == 0
    assert metrics.idle_seconds({"state": "draining", "cell": 3, "age_s": 4.0}) == 0
    assert metrics.idle_seconds({"state": "running", "cell": None, "age_s": 4.0}) == 0
    assert metrics.idle_seconds({"state": "draining", "cell": None, "age_s": 4.0}) == 4.0  # a drain from outside
    assert metrics.idle_seconds({"state": "waiting", "device": 0, "cell": None, "age_s": 2.0}) == 2.0  # its settle
    assert metrics.idle_seconds({"state": "parked", "bytes": 5, "age_s": 90.0}) == 90.0
    assert metrics.idle_seconds({"state": "idle"}) is None
    assert metrics.idle_seconds(None) is None
    # the reply's time is since_ns + age_s: idle since the last cell's end, whatever state came after it
    s = 10**9
    parked = {"state": "parked", "bytes": 5, "since_ns": 1000 * s, "age_s": 90.0, "last_cell_ended_ns": 400 * s}
    assert metrics.idle_seconds(parked) == 690.0
    drained = {"state": "idle", "since_ns": 1000 * s, "age_s": 3.0, "last_cell_ended_ns": 940 * s}
    assert metrics.idle_seconds(drained) == 63.0
    assert metrics.idle_seconds(dict(drained, state="running", cell=7)) == 0  # the previous cell's end stands
    # no cell has ended since the status server started: idle since that start, when given
    fresh = {"state": "idle", "since_ns": 1000 * s, "age_s": 5.0, "last_cell_ended_ns": None}
    assert metrics.idle_seconds(fresh, 900 * s) == 105.0
    assert metrics.idle_seconds(fresh) == 5.0


def _park(endpoint, size: int) -> None:
    endpoint.set_state({"state": "idle", "since_ns": time.time_ns()})
    endpoint.park_step("begin")
    endpoint.park_step("parked", size)


def test_parked_bytes_per_gpu_sum_the_kernels_parked_from_it(runtime, fake_cuda):
    from gpucleanup import _native

    fake_cuda.reset({"devices": [{"name": "Fake H100", "primary_active": True, "total_bytes": 80 * GiB,
                                  "free_bytes": 70 * GiB},
                                 {"name": "Fake H100", "primary_active": False, "total_bytes": 80 * GiB}]})
    uuid0 = _native.snapshot()["devices"][0]["uuid"]
    ep = StatusEndpoint()
    ep.start(types.SimpleNamespace(user_ns={"__session__": "/home/me/parked.ipynb"}))
    assert ep.error is None, ep.error
    try:
        ep.publish({"cell": 1, "devices": [{"index": 0, "live_bytes": {"cupy": 3 * GiB}, "cached_bytes": {}}]})
        registry = registry_for(runtime)
        samples = scrape(registry)
        assert values(samples, "gpucleanup_device_parked_bytes") == []  # nothing parked: no series
        _park(ep, 3 * GiB)
        try:
            samples = scrape(registry)
            # one GPU in use before the park: its bytes are that GPU's
            assert value(samples, "gpucleanup_device_parked_bytes", device=0, uuid=uuid0) == 3 * GiB
            assert len(values(samples, "gpucleanup_device_parked_bytes")) == 1
            # nothing of it is counted as held on the GPU any more (the last record's 3 GiB live)
            assert values(samples, "gpucleanup_device_live_bytes", pid=os.getpid()) == []
            assert values(samples, "gpucleanup_device_used_bytes", pid=os.getpid()) == []
            # what the park itself wrote per GPU (its note beside the key) names the GPU when it is there
            uuid1 = _native.snapshot()["devices"][1]["uuid"]
            ep.park_lock.write_text(json.dumps({"usage": {uuid1: 3 * GiB}}))
            samples = scrape(registry)
            assert value(samples, "gpucleanup_device_parked_bytes", uuid=uuid1) == 3 * GiB
        finally:
            ep.park_step("resumed")
        samples = scrape(registry)
        assert values(samples, "gpucleanup_device_parked_bytes") == []
        assert value(samples, "gpucleanup_device_live_bytes", pid=os.getpid(), framework="cupy") == 3 * GiB
    finally:
        ep.close()


def test_the_default_registry_is_the_one_jupyter_server_serves(runtime):
    collector = metrics.register_server_collector(types.SimpleNamespace(runtime_dir=str(runtime)))
    try:
        assert value(scrape(prometheus_client.REGISTRY), "gpucleanup_kernels") == 0
        assert metrics.register_server_collector(None) is collector
    finally:
        assert metrics.unregister_server_collector() is True


_SERVER = textwrap.dedent("""
    import os, sys
    from jupyter_server.serverapp import ServerApp
    from gpucleanup.outside.metrics import register_server_collector

    app = ServerApp()
    app.initialize(argv=sys.argv[1:])
    register_server_collector(app, timeout=float(os.environ.get("COLLECT_TIMEOUT_S", "0.5")))
    # after the server's own bind callback: the port is listening when this prints
    app.io_loop.add_callback(lambda: print("ready", app.port, flush=True))
    app.start()
""")


def _read_line(proc: subprocess.Popen, limit_s: float = 120) -> str:
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        if not sel.select(limit_s):
            pytest.fail(f"no line from the process within {limit_s} s")
    return proc.stdout.readline()


def test_jupyter_servers_metrics_show_the_kernels_behind_its_token(kernel, runtime, tmp_path):
    env = _server_env(tmp_path)
    root = tmp_path / "root"
    root.mkdir()
    proc = subprocess.Popen(
        [sys.executable, "-c", _SERVER, "--ServerApp.port=0", "--ServerApp.ip=127.0.0.1", "--ServerApp.open_browser=False",
         "--IdentityProvider.token=s3cret", f"--ServerApp.root_dir={root}", "--allow-root"],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env,
    )
    try:
        line = _read_line(proc)
        assert line.startswith("ready "), line
        url = f"http://127.0.0.1:{int(line.split()[1])}/metrics"
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(url, timeout=60)
        assert refused.value.code == 403  # authenticate_prometheus: the token is needed
        request = urllib.request.Request(url, headers={"Authorization": "token s3cret"})
        # a scrape shows the collection the one before it started (the first: the one registering started)
        deadline = time.monotonic() + 60
        while True:
            with urllib.request.urlopen(request, timeout=60) as response:
                samples = scrape_text(response.read().decode())
            if values(samples, "gpucleanup_kernel_up", pid=kernel.pid) or time.monotonic() > deadline:
                break
            time.sleep(0.1)
    finally:
        proc.terminate()
        proc.wait(60)
    assert value(samples, "gpucleanup_kernel_up", pid=kernel.pid, notebook="/home/me/fit.ipynb") == 1
    assert value(samples, "gpucleanup_cells_cleaned_total", pid=kernel.pid) == 2


def test_the_first_scrape_after_the_server_starts_shows_a_kernel_started_after_it(runtime, tmp_path, fake_cuda):
    env = dict(_server_env(tmp_path), COLLECT_TIMEOUT_S="10")  # the kernel has time to answer on a loaded machine
    root = tmp_path / "root"
    root.mkdir()
    proc = subprocess.Popen(
        [sys.executable, "-c", _SERVER, "--ServerApp.port=0", "--ServerApp.ip=127.0.0.1", "--ServerApp.open_browser=False",
         "--IdentityProvider.token=s3cret", f"--ServerApp.root_dir={root}", "--allow-root"],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env,
    )
    ep = StatusEndpoint()
    try:
        line = _read_line(proc)
        assert line.startswith("ready "), line
        fake_cuda.reset({"devices": [{"primary_active": True}]})
        ep.start(types.SimpleNamespace(user_ns={"__session__": "/home/me/late.ipynb"}))
        assert ep.error is None, ep.error
        started = time.time()
        request = urllib.request.Request(f"http://127.0.0.1:{int(line.split()[1])}/metrics",
                                         headers={"Authorization": "token s3cret"})
        with urllib.request.urlopen(request, timeout=60) as response:
            samples = scrape_text(response.read().decode())  # the first scrape: no retry
    finally:
        ep.close()
        proc.terminate()
        proc.wait(60)
    assert value(samples, "gpucleanup_kernels") == 1
    assert value(samples, "gpucleanup_kernel_up", pid=os.getpid(), notebook="/home/me/late.ipynb") == 1
    assert value(samples, "gpucleanup_collected_timestamp_seconds") >= started


#: a kernel in a process of its own (its status endpoint on the fake driver), stopped by the test with SIGSTOP
_STOPPABLE_KERNEL = textwrap.dedent("""
    import sys, types
    from gpucleanup.in_kernel.status_endpoint import StatusEndpoint
    ep = StatusEndpoint()
    ep.start(types.SimpleNamespace(user_ns={"__session__": "/home/me/stopped.ipynb"}))
    assert ep.error is None, ep.error
    print("ready", flush=True)
    sys.stdin.read()
""")


def _server_env(tmp_path: Path) -> dict:
    return dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT / "ipython_ext"), os.environ.get("PYTHONPATH")])),
                JUPYTER_CONFIG_DIR=str(tmp_path / "config"), JUPYTER_DATA_DIR=str(tmp_path / "data"))


COLLECT_TIMEOUT_S = 5.0


def test_scrapes_never_hold_the_servers_event_loop_while_a_kernel_is_stopped(runtime, tmp_path, fake_cuda):
    # Each collection waits COLLECT_TIMEOUT_S for the stopped kernel: an event loop held by a collection would hold
    # the status answers behind it for that long, far beyond a round trip on a loaded machine.
    env = dict(_server_env(tmp_path), COLLECT_TIMEOUT_S=str(COLLECT_TIMEOUT_S))
    stopped = subprocess.Popen([sys.executable, "-c", _STOPPABLE_KERNEL], stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, text=True, env=env)
    root = tmp_path / "root"
    root.mkdir()
    server = None
    try:
        assert _read_line(stopped).startswith("ready")
        os.kill(stopped.pid, signal.SIGSTOP)
        # authenticate_prometheus off, as the docs say for Prometheus: anyone can scrape
        server = subprocess.Popen(
            [sys.executable, "-c", _SERVER, "--ServerApp.port=0", "--ServerApp.ip=127.0.0.1",
             "--ServerApp.open_browser=False", "--IdentityProvider.token=s3cret", f"--ServerApp.root_dir={root}",
             "--ServerApp.authenticate_prometheus=False", "--allow-root"],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env,
        )
        line = _read_line(server)
        assert line.startswith("ready "), line
        base = f"http://127.0.0.1:{int(line.split()[1])}"

        def scrape_once() -> list:
            with urllib.request.urlopen(f"{base}/metrics", timeout=60) as response:
                return scrape_text(response.read().decode())

        # the stopped kernel is found and shown down (from a collection the scrapes started)
        deadline = time.monotonic() + 60
        while not values(scrape_once(), "gpucleanup_kernel_up", pid=stopped.pid):
            assert time.monotonic() < deadline, "the stopped kernel never showed in /metrics"
            time.sleep(0.1)

        scraped = []
        errors = []
        go = threading.Barrier(11)

        def scraper():
            try:
                go.wait(60)
                for _ in range(3):
                    scraped.append(scrape_once())
            except Exception as exc:  # reported below
                errors.append(exc)

        threads = [threading.Thread(target=scraper) for _ in range(10)]
        for t in threads:
            t.start()
        go.wait(60)
        answers = []
        status = urllib.request.Request(f"{base}/api/status", headers={"Authorization": "token s3cret"})
        while any(t.is_alive() for t in threads):
            started = time.monotonic()
            with urllib.request.urlopen(status, timeout=60) as response:
                assert response.status == 200
            answers.append(time.monotonic() - started)
        for t in threads:
            t.join(60)
    finally:
        if server is not None:
            server.terminate()
            server.wait(60)
        os.kill(stopped.pid, signal.SIGCONT)
        stopped.stdin.close()
        stopped.wait(60)
    assert errors == []
    assert len(scraped) == 30
    assert answers and max(answers) < COLLECT_TIMEOUT_S, answers  # no answer waited for a collection
    for samples in scraped:
        assert value(samples, "gpucleanup_kernel_up", pid=stopped.pid) == 0
        assert value(samples, "gpucleanup_kernel_error", pid=stopped.pid, kind="no_answer") == 1


def test_concurrent_scrapes_share_one_collection(runtime, monkeypatch):
    collector = metrics.KernelCollector(runtime, timeout=5.0)
    registry = prometheus_client.CollectorRegistry()
    registry.register(collector)
    release = threading.Event()
    gathered = []
    real = kernels.gather

    def slow_gather(*args, **kwargs):
        gathered.append(threading.current_thread().name)
        assert release.wait(60)
        return real(*args, **kwargs)

    monkeypatch.setattr(kernels, "gather", slow_gather)
    results = []
    threads = [threading.Thread(target=lambda: results.append(scrape(registry))) for _ in range(8)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 60
    while not gathered:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    release.set()
    for t in threads:
        t.join(60)
    assert len(results) == 8
    assert gathered == ["gpucleanup-metrics"]  # one collection, on a thread of its own
    assert collector.collections == 1
    assert all(value(r, "gpucleanup_kernels") == 0 for r in results)


# ------------------------------------------------------------------ the exporter


def _get(url: str, token: Optional[str] = None):
    headers = {"Authorization": f"Bearer {token}"} if token is not None else {}
    with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=60) as response:
        return response.status, response.read().decode()


def _token(exporter) -> str:
    return exporter.token_file.read_text().strip()


def test_the_exporter_serves_the_metrics_over_http_until_shut_down(kernel, runtime):
    exporter = exporter_mod.start_exporter(0, runtime_dir=runtime, timeout=5.0)
    try:
        assert exporter.host == "127.0.0.1" and exporter.port > 0
        assert exporter.url == f"http://127.0.0.1:{exporter.port}/metrics"
        status, text = _get(exporter.url, _token(exporter))
        assert status == 200
        samples = scrape_text(text)
        assert value(samples, "gpucleanup_cells_cleaned_total", pid=kernel.pid) == 2
        assert value(samples, "gpucleanup_device_live_bytes", framework="cupy", device=0) == 1 * GiB
        # its own registry: nothing about the exporter's process
        assert [n for n, _, _ in samples if not n.startswith("gpucleanup_")] == []
        assert _get(exporter.url.replace("/metrics", "/"))[1] == "gpucleanup exporter: the metrics are at /metrics\n"
        with pytest.raises(urllib.error.HTTPError) as missing:
            _get(exporter.url.replace("/metrics", "/other"))
        assert missing.value.code == 404
        # wait() blocks while it serves and returns once another thread shuts it down
        waiter = threading.Thread(target=exporter.wait)
        waiter.start()
        assert waiter.is_alive()
    finally:
        exporter.shutdown()
    waiter.join(60)
    assert not waiter.is_alive()
    exporter.wait()  # shut down: returns at once
    exporter.shutdown()  # twice: nothing more to do
    with pytest.raises(urllib.error.URLError):
        _get(exporter.url)


def test_the_exporter_is_private_to_its_owner_by_default(kernel, runtime):
    exporter = exporter_mod.start_exporter(0, runtime_dir=runtime, timeout=5.0)
    try:
        assert exporter.token_file == runtime / "gpucleanup" / "exporter.token"
        assert stat.S_IMODE(exporter.token_file.stat().st_mode) == 0o600
        for token in (None, "wrong-token-of-20-chars"):
            with pytest.raises(urllib.error.HTTPError) as refused:
                _get(exporter.url, token)
            assert refused.value.code == 401
            assert refused.value.headers["WWW-Authenticate"] == 'Bearer realm="gpucleanup"'
            assert b"notebook" not in refused.value.read()
        samples = scrape_text(_get(exporter.url, _token(exporter))[1])
        assert value(samples, "gpucleanup_kernel_up", pid=kernel.pid, notebook="/home/me/fit.ipynb") == 1
        token = _token(exporter)
    finally:
        exporter.shutdown()
    # the same token the next time: a Prometheus configured once keeps working
    again = exporter_mod.start_exporter(0, runtime_dir=runtime, timeout=5.0)
    try:
        assert _token(again) == token
    finally:
        again.shutdown()


def test_a_public_exporter_names_no_notebook_nor_kernel_id(kernel, runtime):
    exporter = exporter_mod.start_exporter(0, runtime_dir=runtime, timeout=5.0, public=True)
    try:
        assert exporter.token_file is None
        samples = scrape_text(_get(exporter.url)[1])
    finally:
        exporter.shutdown()
    assert value(samples, "gpucleanup_kernel_up", pid=kernel.pid) == 1
    assert {(l.get("notebook"), l.get("kernel_id")) for _, l, _ in samples if "pid" in l} == {("", "")}


def test_a_token_file_others_may_read_is_refused(runtime, tmp_path):
    loose = tmp_path / "token"
    loose.write_text("a" * 32)
    loose.chmod(0o644)
    with pytest.raises(exporter_mod.ExporterError, match=r"may be read by others \(mode 644\): chmod 600 it"):
        exporter_mod.start_exporter(0, runtime_dir=runtime, token_file=loose)
    loose.chmod(0o600)
    loose.write_text("short")
    with pytest.raises(exporter_mod.ExporterError, match="does not hold a token"):
        exporter_mod.start_exporter(0, runtime_dir=runtime, token_file=loose)


def test_a_port_in_use_is_a_clear_error(runtime):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        for start in (exporter_mod.start_exporter, exporter_mod.run_exporter):
            with pytest.raises(exporter_mod.ExporterError) as error:
                start(port, runtime_dir=runtime)
            assert str(error.value) == (f"cannot listen on 127.0.0.1:{port}: the port is in use by another program; "
                                        "choose another port with --port")
    assert isinstance(error.value, ValueError)


@pytest.mark.parametrize("port, host, says", [
    (70000, "127.0.0.1", "port must be a number from 1 to 65535"),
    ("9400", "127.0.0.1", "port must be a number from 1 to 65535"),
    (0, "", "host must be an address"),
    (0, "no-such-host.invalid", "cannot listen on 'no-such-host.invalid'"),
    (0, "192.0.2.1", "192.0.2.1 is not an address of this machine"),
])
def test_bad_ports_and_hosts_are_clear_errors(runtime, port, host, says):
    with pytest.raises(exporter_mod.ExporterError, match=says.replace(".", r"\.")):
        exporter_mod.start_exporter(port, host=host, runtime_dir=runtime)


def test_run_exporter_serves_until_ctrl_c_and_returns_0(kernel, runtime):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT / "ipython_ext"), os.environ.get("PYTHONPATH")])))
    code = "import sys; from gpucleanup.outside.exporter import run_exporter; sys.exit(run_exporter(0, timeout=5.0))"
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        line = _read_line(proc)
        assert line.startswith("gpucleanup exporter: serving http://127.0.0.1:"), line
        assert line.rstrip().endswith("/metrics (Ctrl-C stops)")
        url = line.split()[3]
        status, text = _get(url, exporter_mod.token_path().read_text().strip())
        assert status == 200
        assert value(scrape_text(text), "gpucleanup_kernel_up", pid=kernel.pid) == 1
        proc.send_signal(signal.SIGINT)
        assert proc.wait(60) == 0
        assert proc.stderr.read() == ""
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
