"""Root (or any reader) over another user's runtime directory asks only what that user's own kernel serves
(issue 53, case 2).

A discovery record is the writer's word: before ``gpucleanup ps`` or ``drain`` connects to what a record of
another user names, the record's process must belong to the file's owner, and each endpoint it names must be a
listening socket that process holds. The first tests read a /proc tree written here; the last ones run as root
with a process of another user (``setpriv``, uid 4242) and a listener of root's own that the record points at.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gpucleanup.protocol import discovery

ROOT = Path(__file__).resolve().parents[2]
USER = 4242
GUARD = 60  # seconds: only there to turn a hang into a failure


def _hex(host: str) -> str:
    if ":" in host:
        return "".join(f"{w:08X}" for w in struct.unpack("=4I", socket.inet_pton(socket.AF_INET6, host)))
    return f"{struct.unpack('=I', socket.inet_aton(host))[0]:08X}"


def _fake_proc(tmp_path: Path, pid: int, uid: int, sockets: list, tcp: list = (), tcp6: list = (),
               unix: list = ()) -> Path:
    """A /proc with process ``pid`` of ``uid`` holding ``sockets`` (inodes), and the listening sockets given
    as (host, port, inode) for tcp and tcp6, (path, inode) for unix."""
    proc = tmp_path / "proc"
    (proc / str(pid) / "fd").mkdir(parents=True)
    (proc / str(pid) / "net").mkdir()
    (proc / str(pid) / "status").write_text(f"Name:\tpython\nUid:\t{uid}\t{uid}\t{uid}\t{uid}\n")
    for n, inode in enumerate(sockets):
        os.symlink(f"socket:[{inode}]", proc / str(pid) / "fd" / str(n + 3))
    os.symlink("/dev/null", proc / str(pid) / "fd" / "0")
    header = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n"
    for name, rows in (("tcp", tcp), ("tcp6", tcp6)):
        lines = [f"   {i}: {_hex(h)}:{p:04X} {_hex(h if ':' not in h else '::')}:0000 0A 00000000:00000000 00:00000000 "
                 f"00000000  {uid}        0 {inode} 1 0000000000000000 100 0 0 10 0\n"
                 for i, (h, p, inode) in enumerate(rows)]
        (proc / str(pid) / "net" / name).write_text(header + "".join(lines))
    unix_lines = [f"0000000000000000: 00000002 00000000 00010000 0001 01 {inode} {path}\n" for path, inode in unix]
    (proc / str(pid) / "net" / "unix").write_text("Num       RefCount Protocol Flags    Type St Inode Path\n"
                                                  + "".join(unix_lines))
    return proc


def _record(pid: int, endpoint: str, pub_endpoint: str, transport: str = "tcp") -> dict:
    return {"pid": pid, "endpoint": endpoint, "pub_endpoint": pub_endpoint, "transport": transport}


def test_a_record_whose_process_and_sockets_are_its_owners_may_be_asked(tmp_path):
    proc = _fake_proc(tmp_path, 700, USER, [5001, 5002], tcp=[("127.0.0.1", 40001, 5001)],
                      tcp6=[("::1", 40002, 5002)])
    info = _record(700, "tcp://127.0.0.1:40001", "tcp://[::1]:40002")
    assert discovery.foreign_record_refusal(info, USER, str(proc)) is None


def test_a_record_naming_another_users_process_is_not_asked(tmp_path):
    proc = _fake_proc(tmp_path, 700, 0, [5001], tcp=[("127.0.0.1", 40001, 5001)])
    info = _record(700, "tcp://127.0.0.1:40001", "tcp://127.0.0.1:40001")
    assert discovery.foreign_record_refusal(info, USER, str(proc)) == (
        f"process 700 belongs to uid 0, not to uid {USER}, who owns this file: not asked (a record names only its "
        "own writer's kernel)")


def test_a_record_naming_a_port_its_process_does_not_hold_is_not_asked(tmp_path):
    # the user's own sleep, and a port root's service listens on (inode 9001, not among the sleep's sockets)
    proc = _fake_proc(tmp_path, 700, USER, [5001], tcp=[("127.0.0.1", 40001, 5001), ("127.0.0.1", 8888, 9001)])
    info = _record(700, "tcp://127.0.0.1:8888", "tcp://127.0.0.1:40001")
    assert discovery.foreign_record_refusal(info, USER, str(proc)) == (
        "its endpoint 'tcp://127.0.0.1:8888' is not a socket of process 700: not asked")
    nothing = _record(700, "tcp://127.0.0.1:40001", "tcp://127.0.0.1:40009")
    assert discovery.foreign_record_refusal(nothing, USER, str(proc)) == (
        "nothing listens on its pub_endpoint 'tcp://127.0.0.1:40009': not asked")


def test_an_ipc_record_must_name_a_listening_unix_socket_of_its_process(tmp_path):
    proc = _fake_proc(tmp_path, 700, USER, [6001, 6002], unix=[("/run/user/4242/k.sock", 6001),
                                                              ("/run/user/4242/k.pub", 6002),
                                                              ("/run/docker.sock", 7777)])
    ours = _record(700, "ipc:///run/user/4242/k.sock", "ipc:///run/user/4242/k.pub", "ipc")
    assert discovery.foreign_record_refusal(ours, USER, str(proc)) is None
    docker = _record(700, "ipc:///run/docker.sock", "ipc:///run/user/4242/k.pub", "ipc")
    assert discovery.foreign_record_refusal(docker, USER, str(proc)) == (
        "its endpoint 'ipc:///run/docker.sock' is not a socket of process 700: not asked")


def test_unreadable_process_files_refuse_rather_than_guess(tmp_path):
    proc = tmp_path / "proc"
    proc.mkdir()
    info = _record(700, "tcp://127.0.0.1:40001", "tcp://127.0.0.1:40001")
    assert discovery.foreign_record_refusal(info, USER, str(proc)) == (
        "the owner of process 700 cannot be read: not asked")


# ------------------------------------------------------------------ as root, with another user's processes

needs_root = pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None,
                                reason="processes of another user need root and setpriv")


def _as_user(*argv: str) -> subprocess.Popen:
    return subprocess.Popen(["setpriv", f"--reuid={USER}", f"--regid={USER}", "--clear-groups", *argv],
                            stdout=subprocess.PIPE, text=True)


def _write_record(runtime: Path, pid: int, endpoint: str, pub_endpoint: str) -> Path:
    instance = f"{pid}-feedface"
    info = discovery.describe(endpoint=endpoint, pub_endpoint=pub_endpoint, key_file=None, transport="tcp",
                              instance=instance)
    info.update(pid=pid, proc_start_ticks=discovery.process_start_ticks(pid))
    path = discovery.discovery_path(instance, runtime)
    path.write_text(json.dumps(info))
    os.chown(path, USER, USER)
    os.chmod(path, 0o600)
    return path


def _user_runtime(tmp_path: Path) -> Path:
    runtime = tmp_path / "runtime"
    runtime.mkdir(mode=0o700)
    os.chown(runtime, USER, USER)
    tmp_path.chmod(0o755)
    return runtime


@needs_root
def test_roots_ps_never_connects_to_a_port_a_users_record_names_for_its_sleep(tmp_path):
    runtime = _user_runtime(tmp_path)
    sleeper = _as_user("sleep", "120")
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    listener.setblocking(False)
    port = listener.getsockname()[1]
    try:
        deadline = time.monotonic() + GUARD  # setpriv runs as root until it has become the user and exec'd sleep
        while Path(f"/proc/{sleeper.pid}/comm").read_text().strip() != "sleep" and time.monotonic() < deadline:
            time.sleep(0.01)
        path = _write_record(runtime, sleeper.pid, f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{port}")
        found = discovery.scan(runtime, clean=False)
        assert found.live == []
        assert [(s.path, s.why) for s in found.skipped] == [
            (path, f"its endpoint 'tcp://127.0.0.1:{port}' is not a socket of process {sleeper.pid}: not asked")]
        env = dict(os.environ, JUPYTER_RUNTIME_DIR=str(runtime),
                   PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT / "ipython_ext"), os.environ.get("PYTHONPATH")])))
        for argv in (("ps", "--json"), ("drain", str(sleeper.pid), "--timeout", "2")):
            run = subprocess.run([sys.executable, "-m", "gpucleanup.outside.cli", *argv], capture_output=True, text=True,
                                 env=env, timeout=GUARD)
            assert f"skipped {path}: its endpoint 'tcp://127.0.0.1:{port}' is not a socket of process" in run.stderr
        with pytest.raises(BlockingIOError):
            listener.accept()  # no connection ever came: nothing was sent to root's port
    finally:
        listener.close()
        sleeper.kill()
        sleeper.wait()


@needs_root
def test_a_users_own_listening_process_passes_the_check(tmp_path):
    server = _as_user(sys.executable, "-I", "-c",
                      "import socket, sys, time\n"
                      "s = socket.socket(); s.bind(('127.0.0.1', 0)); s.listen(1)\n"
                      "print(s.getsockname()[1], flush=True); time.sleep(120)")
    try:
        port = int(server.stdout.readline())
        info = _record(server.pid, f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{port}")
        assert discovery.foreign_record_refusal(info, USER) is None
        assert discovery.foreign_record_refusal(info, USER + 1).startswith(
            f"process {server.pid} belongs to uid {USER}, not to uid {USER + 1}")
    finally:
        server.kill()
        server.wait()


def test_an_address_is_written_as_proc_net_tcp_writes_it_for_both_families_and_both_spellings():
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        port = listener.getsockname()[1]
        with open("/proc/self/net/tcp", encoding="ascii") as fh:
            listening = {line.split()[1] for line in list(fh)[1:] if line.split()[3] == "0A"}
        assert discovery.proc_net_address("127.0.0.1", port) in listening
    finally:
        listener.close()
    little = sys.byteorder == "little"
    assert discovery.proc_net_address("[::1]", 8888) == discovery.proc_net_address("::1", 8888) == (
        "000000000000000000000000" + ("01000000" if little else "00000001") + ":22B8")
    assert discovery.proc_net_address("localhost", 1) is None  # a name is never resolved
