"""Text from outside gpucleanup (a kernel's reply, a discovery file, a thread's name, a Dask worker) never reaches a
terminal, the server's log or a metrics label with a control character: no escape sequence, and no newline that
starts a line looking like gpucleanup's own."""

from __future__ import annotations

import logging
import threading
import types
from pathlib import Path

import pytest

from gpucleanup.outside import cli as gpucleanup_cli, kernels, metrics
from gpucleanup.park import kernel_side as parking
from gpucleanup.records import report
from tornado import web

#: what a hostile value carries: a colour change, a bell, a window title, a forged line, a right-to-left override
HOSTILE = "x\x1b[31m\x07\x1b]0;pwn\x07\ngpucleanup: kernel 1 parked\u202e"
FORGED = "gpucleanup: kernel 1 parked"


def _clean(text: str) -> None:
    assert "\x1b" not in text and "\x07" not in text and "\u202e" not in text
    assert not any(line.startswith(FORGED) for line in text.splitlines()), text


def _kernel(pid: int = 4242) -> types.SimpleNamespace:
    return types.SimpleNamespace(pid=pid, kernel_id=HOSTILE, notebook=HOSTILE, notebook_root=None,
                                 endpoint=f"ipc:///run/{pid}.sock", key_file=f"/run/{pid}.key", path=Path("/run/x"))


def _reply() -> dict:
    device = {"index": HOSTILE, "name": HOSTILE, "uuid": HOSTILE, "used_bytes": 1 << 30, "total_bytes": 80 << 30,
              "frameworks": {HOSTILE: {"live_bytes": 1, "cached_bytes": 2}}, "message": HOSTILE, "state": HOSTILE}
    return {"state": {"state": HOSTILE, "cell": HOSTILE, "since_ns": 1}, "kernel": {"notebook": HOSTILE},
            "snapshot": {"driver": {"state": HOSTILE}, "devices": [device]}, "snapshot_status": HOSTILE,
            "last_record": {"cell": HOSTILE, "devices": [device]},
            "result": {"driver": {"state": HOSTILE, "message": HOSTILE}, "devices": [device], "doing": HOSTILE,
                       "skipped": HOSTILE, "error": HOSTILE}}


@pytest.fixture
def hostile_kernel(monkeypatch):
    monkeypatch.setattr(gpucleanup_cli, "_resolve", lambda args, which: _kernel())
    monkeypatch.setattr(gpucleanup_cli, "_ask", lambda args, kernel, kind, timeout, **fields: _reply())


@pytest.mark.parametrize("command", [["status", "4242"], ["drain", "4242"]])
def test_a_kernels_reply_reaches_the_terminal_escaped(hostile_kernel, command, capsys):
    gpucleanup_cli.main(command)
    said = capsys.readouterr()
    _clean(said.out)
    _clean(said.err)
    assert "\\x1b[31m" in said.out + said.err  # shown, escaped: the user sees what the reply held


def test_ps_rows_from_a_kernels_reply_are_escaped(monkeypatch, capsys):
    view = kernels.KernelView(kernel=_kernel(), status=_reply())
    monkeypatch.setattr(kernels, "gather", lambda directory, timeout: types.SimpleNamespace(kernels=[view],
                                                                                            skipped=[]))
    assert gpucleanup_cli.main(["ps"]) == 0
    said = capsys.readouterr()
    _clean(said.out)
    assert said.out.count("\n") == 2  # the header and one row: no line of the reply's own


def test_park_check_reasons_and_the_blocker_are_escaped(monkeypatch, capsys):
    monkeypatch.setattr(gpucleanup_cli, "_resolve", lambda args, which: _kernel())
    monkeypatch.setattr(gpucleanup_cli, "_target", lambda kernel: None)
    monkeypatch.setattr(gpucleanup_cli.remote_park, "check_kernel", lambda *args: {
        "parkable": False, "reasons": [HOSTILE], "blocker": HOSTILE})
    assert gpucleanup_cli.main(["park", "--check", "4242"]) == gpucleanup_cli.EXIT_REFUSED
    said = capsys.readouterr()
    _clean(said.out)
    assert said.out.splitlines()[0] == "kernel 4242 cannot be parked now:"


def test_an_error_that_carries_a_files_words_is_escaped(monkeypatch, capsys):
    def refuse(args, which):
        raise gpucleanup_cli.CliError(f"kernel 4242: its key file {HOSTILE} is gone", gpucleanup_cli.EXIT_REFUSED)

    monkeypatch.setattr(gpucleanup_cli, "_resolve", refuse)
    assert gpucleanup_cli.main(["status", "4242"]) == gpucleanup_cli.EXIT_REFUSED
    said = capsys.readouterr()
    _clean(said.err)
    assert said.err.count("\n") == 1 and said.err.startswith("gpucleanup: kernel 4242: its key file x\\x1b[31m")


def test_a_thread_name_reaches_the_automatic_parks_blocker_escaped():
    stop = threading.Event()
    worker = threading.Thread(target=stop.wait, name=HOSTILE, daemon=True)
    worker.start()
    try:
        blocker = parking.InKernel(lambda: None, lambda lines: None).automatic_park_blocker()
    finally:
        stop.set()
        worker.join()
    _clean(blocker)
    assert "\n" not in blocker and "(x\\x1b[31m\\x07" in blocker


def test_table_cells_are_one_line_with_no_control_character():
    table = report.Table("Dask workers", ["worker", "state"], [[HOSTILE, "idle"]], align="ll")
    _clean(table.text())
    assert len(table.text().splitlines()) == 4  # title, header, rule, the row


def test_dask_lines_escape_a_workers_address_and_error():
    lines = report.dask_drain_lines({HOSTILE: {"error": HOSTILE}, "tcp://127.0.0.1:1": {"skipped": HOSTILE}})
    assert len(lines) == 2
    for line in lines:
        _clean(line)
        assert "\n" not in line


def test_the_servers_log_gets_a_refusal_as_one_escaped_line(caplog):
    from gpucleanup.server.handlers import _API

    handler = types.SimpleNamespace(log=logging.getLogger("gpucleanup-test-server"),
                                    _request_summary=lambda: "POST /api/gpucleanup/kernels/k/park (127.0.0.1)")
    error = web.HTTPError(409, "%s", f"kernel k not parked: {HOSTILE}")
    with caplog.at_level(logging.WARNING, logger="gpucleanup-test-server"):
        _API.log_exception(handler, web.HTTPError, error, None)
    assert len(caplog.records) == 1
    logged = caplog.records[0].getMessage()
    _clean(logged)
    assert "\n" not in logged and logged.startswith("409 POST /api/gpucleanup/kernels/k/park (127.0.0.1): kernel k")


def test_metrics_labels_from_a_kernel_are_escaped():
    view = kernels.KernelView(kernel=_kernel(), status=_reply())
    labels = metrics.KernelCollector.__new__(metrics.KernelCollector)
    labels.public = False
    for value in labels._kernel_labels(view):  # noqa: SLF001
        _clean(value)
        assert "\n" not in value
