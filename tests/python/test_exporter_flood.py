"""A Prometheus that runs as a user of its own, with a copy of the exporter's token, is answered while a
third user floods the exporter with connections (gpucleanup.outside.exporter's gate).

Three users as on a shared machine: the exporter's owner (this process, root), the scraper (uid 2) and
the neighbour (uid 3), each process started with ``setpriv --reuid --regid --clear-groups`` (numeric
uids: no user is created).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import types
from pathlib import Path

import pytest

pytest.importorskip("prometheus_client")

from gpucleanup.outside import exporter as exporters  # noqa: E402
from gpucleanup.in_kernel.status_endpoint import StatusEndpoint  # noqa: E402

pytestmark = pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None,
                                reason="processes of other users need root and setpriv")

SCRAPER_UID, NEIGHBOUR_UID = 2, 3
PYTHON = shutil.which("python3", path="/usr/bin") or sys.executable

#: the neighbour: ``n`` connections to the port, held open and opened again as soon as one is closed
#: (the gate closes them for sending nothing), until its stdin closes
_FLOOD = textwrap.dedent("""
    import selectors, socket, sys, threading
    n, port = int(sys.argv[1]), int(sys.argv[2])
    sel = selectors.DefaultSelector()
    opened = [0]

    def open_one():
        s = socket.socket()
        s.connect(("127.0.0.1", port))
        s.setblocking(False)
        sel.register(s, selectors.EVENT_READ)
        opened[0] += 1

    for _ in range(n):
        open_one()
    print("ready", flush=True)
    done = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.read(), done.set()), daemon=True).start()
    while not done.is_set():
        for key, _ in sel.select(0.2):
            try:
                data = key.fileobj.recv(4096)
            except OSError:
                data = b""
            if not data:
                sel.unregister(key.fileobj)
                key.fileobj.close()
                open_one()
    print(opened[0], flush=True)
""")

#: Prometheus: ``count`` scrapes with the token from its own copy of the token file
_SCRAPER = textwrap.dedent("""
    import json, os, sys, urllib.request
    url, token_file, count = sys.argv[1], sys.argv[2], int(sys.argv[3])
    token = open(token_file).read().strip()
    results = []
    for _ in range(count):
        request = urllib.request.Request(url, headers={"Authorization": "Bearer " + token})
        try:
            with urllib.request.urlopen(request, timeout=30) as response:
                body = response.read().decode()
                results.append([response.status, "gpucleanup_kernels 1.0" in body])
        except Exception as exc:
            results.append([type(exc).__name__, str(exc)])
    print(json.dumps({"uid": os.getuid(), "results": results}))
""")


def _as(uid: int, *args: str, **kwargs) -> list:
    return ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", PYTHON, "-I", "-c", *args]


@pytest.fixture
def a_kernel(runtime, fake_cuda):
    fake_cuda.reset({"devices": [{"primary_active": True}]})
    ep = StatusEndpoint()
    ep.start(types.SimpleNamespace(user_ns={"__session__": "/home/me/fit.ipynb"}))
    assert ep.error is None, ep.error
    yield ep
    ep.close()


@pytest.fixture
def prometheus_token_copy():
    """A directory Prometheus's user may enter, to hold its copy of the token (0600, its own)."""
    place = Path(tempfile.mkdtemp(prefix="gpucleanup-prometheus-"))
    place.chmod(0o755)
    yield place
    shutil.rmtree(place)


@pytest.mark.parametrize("flood, cap", [(100, None), (300, 40)], ids=["100-idle", "300-over-a-cap-of-40"])
def test_a_scraper_of_another_user_with_the_token_is_answered_under_a_third_users_flood(
        a_kernel, runtime, prometheus_token_copy, monkeypatch, flood, cap):
    if cap is not None:
        monkeypatch.setattr(exporters, "MAX_PENDING", cap)
    exporter = exporters.start_exporter(0, runtime_dir=runtime, timeout=5.0)
    copy = prometheus_token_copy / "token"
    copy.write_text(exporter.token_file.read_text())
    copy.chmod(0o600)
    os.chown(copy, SCRAPER_UID, SCRAPER_UID)
    neighbour = subprocess.Popen(_as(NEIGHBOUR_UID, _FLOOD, str(flood), str(exporter.port)), cwd="/",
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert neighbour.stdout.readline().strip() == "ready", neighbour.stderr.read()
        scraper = subprocess.run(_as(SCRAPER_UID, _SCRAPER, exporter.url, str(copy), "10"), cwd="/",
                                 capture_output=True, text=True, timeout=600)
        assert scraper.returncode == 0, scraper.stderr
        stats = dict(exporter.server.stats)
        waiting = exporter.server.waiting
    finally:
        neighbour.stdin.close()
        neighbour.wait(60)
        exporter.shutdown()
    found = json.loads(scraper.stdout)
    assert found["uid"] == SCRAPER_UID
    assert found["results"] == [[200, True]] * 10  # every scrape answered, with the kernel's figures
    assert stats["served"] == 10
    assert waiting <= exporter.server.max_pending
    if cap is not None:
        assert exporter.server.max_pending == cap
        assert stats["evicted"] > 0  # the flood went over the cap and lost its own connections


def test_the_user_at_the_other_end_is_asked_of_the_kernel_without_reading_proc_net_tcp(monkeypatch):
    # issue 53, case 3: each eviction parsed /proc/net/tcp (every socket of the machine): 300 churning
    # connections cost the exporter most of a core. sock_diag answers one exact lookup per connection.
    import builtins
    import socket

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(4)
    client = subprocess.Popen(_as(NEIGHBOUR_UID, "import socket, sys\n"
                                  f"s = socket.create_connection(('127.0.0.1', {listener.getsockname()[1]}))\n"
                                  "print('connected', flush=True); sys.stdin.read()"),
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert client.stdout.readline() == "connected\n"
        accepted, _ = listener.accept()
        read = []
        real_open = builtins.open

        def counting_open(file, *args, **kwargs):
            if str(file).startswith("/proc/net/tcp"):
                read.append(str(file))
            return real_open(file, *args, **kwargs)

        monkeypatch.setattr(builtins, "open", counting_open)
        assert exporters.tcp_peer_uids([accepted]) == {accepted: NEIGHBOUR_UID}
        assert read == []
        assert exporters._proc_peer_uids([accepted]) == {accepted: NEIGHBOUR_UID}  # the same answer, the old way
        assert read == ["/proc/net/tcp", "/proc/net/tcp6"]
        accepted.close()
    finally:
        listener.close()
        client.stdin.close()
        client.wait(timeout=30)
