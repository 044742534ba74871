"""The status server through the library (_native.server_*) and the kernel-side StatusEndpoint.

The client is gpucleanup.protocol.status_client, in this process; the fake CUDA driver
answers the snapshot and drain hooks.
"""

from __future__ import annotations

import json
import os
import re
import stat
import statistics
import time
import types
from pathlib import Path

import pytest
import zmq

from gpucleanup import _native
from gpucleanup.protocol import discovery, status_client
from gpucleanup.in_kernel.status_endpoint import StatusEndpoint

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def protocol(schema_registry):
    """Validators for the $defs of share/schema/protocol.schema.json (with the snapshot and drain schemas)."""
    import jsonschema

    registry, docs = schema_registry
    base = docs["protocol.schema.json"]["$id"]

    def validate(definition: str, value) -> None:
        schema = {"$schema": "https://json-schema.org/draft/2020-12/schema", "$ref": f"{base}#/$defs/{definition}"}
        jsonschema.Draft202012Validator(schema, registry=registry).validate(value)

    return validate


@pytest.fixture
def runtime(tmp_path, monkeypatch):
    directory = tmp_path / "runtime"
    monkeypatch.setenv("JUPYTER_RUNTIME_DIR", str(directory))
    monkeypatch.delenv("JPY_SESSION_NAME", raising=False)
    return directory


@pytest.fixture
def shell():
    """Stands in for an InteractiveShell: the endpoint only reads user_ns."""
    return types.SimpleNamespace(user_ns={})


@pytest.fixture
def endpoint(runtime, shell, fake_cuda):
    ep = StatusEndpoint()
    ep.start(shell)
    assert ep.error is None, ep.error
    assert ep.running
    yield ep
    ep.close()


def target(ep: StatusEndpoint, signed: bool = True) -> status_client.Target:
    key = Path(ep.info["key_file"]).read_bytes() if signed else None
    return status_client.Target(ep.info["endpoint"], key)


def test_server_start_answers_through_the_library(fake_cuda, protocol):
    key = "k" * 32
    bound = _native.server_start(
        {"endpoint": "tcp://127.0.0.1:0", "key": key, "kernel": {"pid": os.getpid(), "kernel_id": "fake"}}
    )
    try:
        assert bound["endpoint"].startswith("tcp://127.0.0.1:")
        assert not bound["endpoint"].endswith(":0")
        _native.server_set_state({"state": "running", "cell": 4, "since_ns": time.time_ns() - 1_500_000_000})
        reply = status_client.request(status_client.Target(bound["endpoint"], key.encode()), "status")
        protocol("status_reply", reply)
        assert reply["kernel"] == {"pid": os.getpid(), "kernel_id": "fake"}
        assert reply["state"]["state"] == "running"
        assert reply["state"]["cell"] == 4
        assert reply["state"]["age_s"] >= 1.5
        assert reply["snapshot"]["kind"] == "snapshot"
        assert reply["snapshot_status"] == "fresh"
        with pytest.raises(_native.NativeError) as excinfo:
            _native.server_start({"endpoint": "tcp://127.0.0.1:0", "key": key})
        assert "already running" in str(excinfo.value)
    finally:
        _native.server_stop()
    _native.server_stop()  # idempotent


def test_tcp_requests_must_be_signed(fake_cuda, protocol):
    bound = _native.server_start({"endpoint": "tcp://127.0.0.1:0", "key": "secret"})
    try:
        with pytest.raises(status_client.StatusRejected) as excinfo:
            status_client.request(status_client.Target(bound["endpoint"], None), "status")
        assert excinfo.value.error_id == "gpucleanup.server.401"
        assert str(excinfo.value).startswith("[gpucleanup.server.401] request is not signed")
        with pytest.raises(status_client.StatusRejected) as excinfo:
            status_client.request(status_client.Target(bound["endpoint"], b"wrong"), "status")
        assert excinfo.value.error_id == "gpucleanup.server.403"
        assert status_client.request(status_client.Target(bound["endpoint"], b"secret"), "ping")["kind"] == "ping"
    finally:
        _native.server_stop()


def test_tcp_without_key_does_not_start(fake_cuda):
    with pytest.raises(_native.NativeError) as excinfo:
        _native.server_start({"endpoint": "tcp://127.0.0.1:0"})
    assert str(excinfo.value) == (
        "[gpucleanup.server.503] tcp endpoint tcp://127.0.0.1:0 needs a key: every request over tcp is signed"
    )


def test_reply_with_a_signature_that_does_not_match_is_not_believed():
    body = json.dumps({"protocol": 1, "ok": True, "kind": "status", "id": None, "time_ns": 1}).encode()
    with pytest.raises(status_client.StatusBadReply, match="reply signature does not match the key file"):
        status_client.decode([b"", b"00" * 32, body], b"key")
    assert status_client.decode([b"", status_client.sign(b"key", body).encode(), body], b"key")["kind"] == "status"


def test_error_replies_match_the_schema_and_serving_goes_on(endpoint, protocol):
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint.info["endpoint"])
    try:
        for frames, error_id in [
            ([b"", b"", b"not json"], "gpucleanup.server.402"),
            ([b"", b"", b"x" * (65 * 1024)], "gpucleanup.server.406"),
            ([b"", b"00" * 32, b'{"protocol": 1, "kind": "status"}'], "gpucleanup.server.403"),
            ([b"", b"", b'{"protocol": 1, "kind": "reboot"}'], "gpucleanup.server.410"),
        ]:
            sock.send_multipart(frames)
            assert sock.poll(2000), "no reply"
            reply = json.loads(sock.recv_multipart()[2])
            protocol("error_reply", reply)
            protocol("reply", reply)
            assert reply["error"]["id"] == error_id
    finally:
        sock.close()
    assert status_client.request(target(endpoint), "ping")["ok"] is True


def test_discovery_file_and_socket_dir_are_private(endpoint, runtime, protocol):
    name = endpoint.instance  # <pid>-<8 random hex digits>: what every file of this endpoint is named from
    assert re.fullmatch(rf"{os.getpid()}-[0-9a-f]{{8}}", name)
    path = runtime / f"gpucleanup-{name}.json"
    assert endpoint.discovery_path == path
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    private = runtime / "gpucleanup"
    assert stat.S_IMODE(private.stat().st_mode) == 0o700
    info = json.loads(path.read_text())
    protocol("discovery", info)
    assert info["pid"] == os.getpid() and info["instance"] == name
    assert info["proc_start_ticks"] == discovery.process_start_ticks(os.getpid())
    assert (info["machine_id"], info["host"]) == (discovery.machine_id(), discovery.host_name())
    assert info["endpoint"] == f"ipc://{private}/{name}.sock"
    assert info["pub_endpoint"] == f"ipc://{private}/{name}.sock.pub"
    assert info["key_file"] == str(private / f"{name}.key")
    assert info["kernel_id"] is None and info["connection_file"] is None  # not in a kernel
    assert stat.S_IMODE(Path(info["key_file"]).stat().st_mode) == 0o600
    assert len(Path(info["key_file"]).read_text()) == 64
    assert stat.S_IMODE(Path(info["endpoint"][6:]).stat().st_mode) == 0o600


def test_open_socket_dir_is_narrowed_to_0700(runtime, shell, fake_cuda):
    (runtime / "gpucleanup").mkdir(parents=True, mode=0o755)
    os.chmod(runtime / "gpucleanup", 0o755)
    ep = StatusEndpoint()
    ep.start(shell)
    try:
        assert ep.error is None
        assert stat.S_IMODE((runtime / "gpucleanup").stat().st_mode) == 0o700
    finally:
        ep.close()


def test_notebook_path_comes_from_the_frontend(runtime, shell, fake_cuda, monkeypatch):
    ep = StatusEndpoint()
    ep.start(shell)
    try:
        assert ep.info["notebook"] is None
        shell.user_ns["__session__"] = "/home/me/analysis.ipynb"
        ep.set_state({"state": "idle"})  # as each cell ends: not looked for again
        assert json.loads(ep.discovery_path.read_text())["notebook"] is None
        ep.set_state({"state": "running", "cell": 1})  # the next cell: taken
        assert json.loads(ep.discovery_path.read_text())["notebook"] == "/home/me/analysis.ipynb"
    finally:
        ep.close()
    monkeypatch.setenv("JPY_SESSION_NAME", "/srv/other.ipynb")
    ep = StatusEndpoint()
    ep.start(types.SimpleNamespace(user_ns={}))
    try:
        assert ep.info["notebook"] == "/srv/other.ipynb"
    finally:
        ep.close()


def test_close_removes_files_and_is_idempotent(endpoint, runtime):
    info, path = dict(endpoint.info), endpoint.discovery_path
    assert path.exists()
    endpoint.close()
    endpoint.close()
    assert not endpoint.running
    assert not path.exists()
    assert not Path(info["key_file"]).exists()
    assert not Path(info["endpoint"][6:]).exists()
    endpoint.set_state({"state": "idle"})  # after close: ignored, never raises
    endpoint.publish({"cell": 1})


def test_endpoint_never_raises_when_it_cannot_start(tmp_path, monkeypatch, shell, fake_cuda):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    monkeypatch.setenv("JUPYTER_RUNTIME_DIR", str(blocker))
    ep = StatusEndpoint()
    ep.start(shell)
    assert not ep.running
    assert ep.error and ("FileExistsError" in ep.error or "NotADirectoryError" in ep.error), ep.error
    ep.set_state({"state": "idle"})
    ep.publish({"cell": 1})
    ep.close()


def test_unknown_transport_is_an_error_not_an_exception(runtime, shell, fake_cuda):
    ep = StatusEndpoint(transport="udp")
    ep.start(shell)
    assert not ep.running
    assert ep.error == "ValueError: transport 'udp' is not supported: use 'ipc' or 'tcp'"


def test_long_runtime_dir_falls_back_to_a_private_temp_socket(tmp_path, monkeypatch, shell, fake_cuda):
    deep = tmp_path / ("d" * 60) / ("e" * 60)
    monkeypatch.setenv("JUPYTER_RUNTIME_DIR", str(deep))
    ep = StatusEndpoint()
    ep.start(shell)
    try:
        assert ep.error is None, ep.error
        socket_dir = Path(ep.info["endpoint"][6:]).parent
        assert socket_dir.name.startswith("gpucleanup-")
        assert stat.S_IMODE(socket_dir.stat().st_mode) == 0o700
        assert status_client.request(target(ep), "ping")["ok"] is True
    finally:
        ep.close()
    assert not socket_dir.exists()


def test_tcp_transport_through_the_endpoint(runtime, shell, fake_cuda, protocol):
    ep = StatusEndpoint(transport="tcp")
    ep.start(shell)
    try:
        assert ep.info["endpoint"].startswith("tcp://127.0.0.1:")
        protocol("discovery", ep.info)
        assert status_client.request(target(ep), "status")["server"]["require_signature"] is True
        with pytest.raises(status_client.StatusRejected):
            status_client.request(target(ep, signed=False), "status")
    finally:
        ep.close()


def test_status_reports_state_age_and_history(endpoint, protocol):
    endpoint.set_state({"state": "running", "cell": 7, "since_ns": time.time_ns() - 3_000_000_000})
    for cell in range(1, 4):
        endpoint.publish({"cell": cell, "devices": [{"index": 0, "freed_bytes": {"cupy": cell << 20}}]})
    reply = status_client.request(target(endpoint), "status")
    protocol("status_reply", reply)
    assert reply["state"]["state"] == "running"
    assert 3.0 <= reply["state"]["age_s"] < 60
    assert reply["last_record"]["cell"] == 3
    assert reply["server"]["records"] == 3
    assert reply["kernel"]["pid"] == os.getpid()

    history = status_client.request(target(endpoint), "history", limit=2)
    protocol("history_reply", history)
    assert [r["cell"] for r in history["records"]] == [2, 3]
    ping = status_client.request(target(endpoint, signed=False), "ping")
    protocol("ping_reply", ping)


def test_records_unserialisable_values_are_published_as_text(endpoint):
    endpoint.publish({"cell": 1, "odd": {1, 2}})
    assert endpoint.error is None
    reply = status_client.request(target(endpoint), "status")
    assert reply["last_record"]["odd"] == repr({1, 2})


def test_published_records_reach_a_subscriber(endpoint, protocol):
    subscriber = status_client.Subscriber()
    subscriber.add("me", status_client.Target(endpoint.info["pub_endpoint"], Path(endpoint.info["key_file"]).read_bytes()))
    try:
        received = []
        deadline = time.monotonic() + 5
        cell = 0
        while not received and time.monotonic() < deadline:
            cell += 1
            endpoint.publish({"cell": cell})
            received = subscriber.poll(0.05)
        assert received, "no record arrived"
        _target, message = received[0]
        protocol("record_message", message)
        assert message["record"]["cell"] == message["seq"]
    finally:
        subscriber.close()


def test_drain_runs_only_between_cells(endpoint, fake_cuda, protocol):
    endpoint.set_state({"state": "running", "cell": 2})
    with pytest.raises(status_client.StatusRejected) as excinfo:
        status_client.request(target(endpoint), "drain", timeout_s=1)
    assert str(excinfo.value) == (
        "[gpucleanup.server.411] drain refused: the kernel is running; a drain runs only between cells (state idle)"
    )
    with pytest.raises(status_client.StatusRejected) as excinfo:
        status_client.request(target(endpoint, signed=False), "drain", timeout_s=1)
    assert excinfo.value.error_id == "gpucleanup.server.414"
    endpoint.set_state({"state": "idle"})
    reply = status_client.request(target(endpoint), "drain", timeout=5, timeout_s=1)
    protocol("drain_reply", reply)
    assert reply["result"]["kind"] == "drain"


def test_request_many_keeps_a_stuck_endpoint_from_stalling_others(endpoint):
    ctx = zmq.Context.instance()
    stuck = ctx.socket(zmq.ROUTER)  # accepts, never answers
    stuck.setsockopt(zmq.LINGER, 0)
    port = stuck.bind_to_random_port("tcp://127.0.0.1")
    try:
        # the stuck peer never answers: returning at all, with the other's answer, is the point
        results = status_client.request_many(
            [status_client.Target(f"tcp://127.0.0.1:{port}", b"k"), target(endpoint)], "status", timeout=5
        )
        assert isinstance(results[0], status_client.StatusTimeout)
        assert results[1]["kind"] == "status"
    finally:
        stuck.close()


def test_status_latency_idle_in_process(endpoint):
    endpoint.set_state({"state": "idle"})
    t = target(endpoint)
    times = []
    for _ in range(100):
        start = time.perf_counter()
        status_client.request(t, "status", timeout=2)
        times.append(time.perf_counter() - start)
    print(f"\nstatus latency in-process (ipc, signed, idle): median {statistics.median(times) * 1e3:.2f} ms, "
          f"max {max(times) * 1e3:.2f} ms over {len(times)}")


def _wait_for(condition, what: str, limit: float = 30.0):
    deadline = time.monotonic() + limit
    while True:
        value = condition()
        if value:
            return value
        assert time.monotonic() < deadline, f"gave up waiting for {what}"
        time.sleep(0.005)


def test_a_drain_from_outside_gives_way_to_the_kernels_own_calls(endpoint, fake_cuda):
    import threading

    # queued work that never finishes: the outside drain would wait its whole 60 s
    fake_cuda.reset({"devices": [{"primary_active": True, "sync_seconds": -1, "uuid": "GPU-0000000b-0000-0000-0000-000000000016"}]})
    endpoint.set_state({"state": "idle"})
    replies = []
    asker = threading.Thread(
        target=lambda: replies.append(status_client.request(target(endpoint), "drain", timeout=90, timeout_s=60))
    )
    asker.start()
    try:
        # the outside drain holds the library once its watchdog has called the synchronize
        _wait_for(lambda: fake_cuda.counter("calls.cuCtxSynchronize") >= 1, "the drain to wait on the device")
        # a cell starts: its snapshot does not queue behind the drain (the fake never finishes:
        # returning at all is the point), and the drain is told to stop waiting
        snapshot = _native.snapshot()
        assert snapshot["kind"] == "snapshot"
        asker.join(60)
        assert not asker.is_alive()
        (reply,) = replies
        device = reply["result"]["devices"][0]
        assert device["state"] == "busy" and device["settle"]["status"] == "interrupted"
    finally:
        fake_cuda.release_sync()
        asker.join(60)
        _wait_for(lambda: _native.drain(timeout=5)["devices"][0]["state"] == "drained", "the device to settle")


def test_closing_the_endpoint_ends_a_drain_from_outside_at_once(runtime, shell, fake_cuda):
    import threading

    fake_cuda.reset({"devices": [{"primary_active": True, "sync_seconds": -1, "uuid": "GPU-0000000c-0000-0000-0000-000000000016"}]})
    ep = StatusEndpoint()
    ep.start(shell)
    assert ep.error is None, ep.error
    ep.set_state({"state": "idle"})
    outcome = []

    def ask():
        try:
            outcome.append(status_client.request(target(ep), "drain", timeout=3, timeout_s=60))
        except Exception as exc:  # the server went away before it could answer
            outcome.append(exc)

    asker = threading.Thread(target=ask)
    asker.start()
    try:
        _wait_for(lambda: fake_cuda.counter("calls.cuCtxSynchronize") >= 1, "the drain to wait on the device")
        ep.close()  # %unload_ext and exit: the fake never finishes, so returning at all is the point
        assert not ep.running
        asker.join(60)
        assert len(outcome) == 1
    finally:
        fake_cuda.release_sync()
        asker.join(60)
        _wait_for(lambda: _native.drain(timeout=5)["devices"][0]["state"] == "drained", "the device to settle")
