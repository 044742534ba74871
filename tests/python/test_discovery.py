"""Discovery files on a shared machine: liveness that cannot be fooled, files read as untrusted input, safe writes.

A. ``gpucleanup ps`` removes only files it can prove stale, and only the paths
   the naming scheme derives from the pid in the file's name; a kernel in
   another PID namespace is shown as "elsewhere" and left alone.
B. A malformed discovery or key file is skipped with one line on stderr; the
   other kernels are listed as before, and nothing hangs.
C. Writes never follow a link, never leave a temporary file, never go into a
   directory every user may write to, and never chmod through a link.

The ``gpucleanup`` command runs as a subprocess; its timeout is only a guard
against a hang (nothing here asserts on elapsed time).
"""

from __future__ import annotations

import errno
import json
import logging
import os
import socket
import stat
import shutil
import subprocess
import sys
import time
import types
import uuid
from pathlib import Path

import pytest

from gpucleanup.outside import cli as cli_module
from gpucleanup.protocol import discovery
from gpucleanup.in_kernel.status_endpoint import StatusEndpoint
import support  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
GUARD = 120  # seconds: far more than any run needs; only there to turn a hang into a failure


@pytest.fixture
def runtime(tmp_path, monkeypatch):
    directory = tmp_path / "runtime"
    directory.mkdir(mode=0o700)
    os.chmod(directory, 0o700)
    monkeypatch.setenv("JUPYTER_RUNTIME_DIR", str(directory))
    monkeypatch.delenv("JPY_SESSION_NAME", raising=False)
    return directory


def _env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "ipython_ext"), env.get("PYTHONPATH")]))
    return env


def cli(*args: str) -> subprocess.CompletedProcess:
    return support.cli(*args, env=_env(), timeout=GUARD)


@pytest.fixture
def kernel(runtime, fake_cuda):
    """This process, described as a kernel with a notebook and a running cell."""
    ep = StatusEndpoint()
    ep.start(types.SimpleNamespace(user_ns={"__session__": "/home/me/fit.ipynb"}))
    assert ep.error is None, ep.error
    ep.set_state({"state": "running", "cell": 12})
    yield ep
    ep.close()


@pytest.fixture
def sleepers():
    """Live processes of this namespace, for discovery files that name a live pid."""
    started = []

    def start() -> int:
        proc = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
        started.append(proc)
        return proc.pid

    yield start
    for proc in started:
        proc.stdin.close()
        proc.wait(timeout=GUARD)


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def record(runtime: Path, name_pid: int, **fields) -> dict:
    """A discovery record as this process's gpucleanup would write it for ``name_pid``; ``fields`` replace any."""
    private = runtime / "gpucleanup"
    pid = name_pid
    info = {
        "discovery": 1, "pid": pid, "proc_start_ticks": discovery.process_start_ticks(pid),
        "pid_ns": discovery.pid_namespace(), "boot_id": discovery.boot_id(), "machine_id": discovery.machine_id(),
        "host": discovery.host_name(), "kernel_id": f"k{pid}",
        "connection_file": None, "notebook": None, "endpoint": f"ipc://{private}/{pid}.sock",
        "pub_endpoint": f"ipc://{private}/{pid}.sock.pub", "transport": "ipc", "key_file": str(private / f"{pid}.key"),
        "signature_scheme": "hmac-sha256", "protocol": 1, "started_ns": 1, "version": "0.1.0",
    }
    info.update(fields)
    return info


def plant(runtime: Path, pid: int, content) -> Path:
    """Writes ``content`` (a dict as JSON, or bytes as they are) as ``gpucleanup-<pid>.json``, mode 0600."""
    path = runtime / f"gpucleanup-{pid}.json"
    path.write_bytes(content if isinstance(content, bytes) else json.dumps(content).encode())
    os.chmod(path, 0o600)
    return path


def scheme_leftovers(runtime: Path, pid: int) -> list:
    """The key and the two ipc sockets a kernel with ``pid`` leaves, named as the status endpoint names them."""
    private = discovery.ensure_private_dir(runtime / "gpucleanup")
    key = private / f"{pid}.key"
    key.write_text("0" * 64)
    paths = [key]
    for name in (f"{pid}.sock", f"{pid}.sock.pub"):
        sock = socket.socket(socket.AF_UNIX)
        sock.bind(str(private / name))  # the socket file stays after close, as after a SIGKILL
        sock.close()
        paths.append(private / name)
    return paths


def rows(stdout: str) -> dict:
    return {line.split()[0]: line for line in stdout.splitlines()[1:]}


UNSHARE_WAYS = (
    ["unshare", "--pid", "--fork", "--mount-proc"],  # root, as in CI
    ["unshare", "--user", "--map-root-user", "--pid", "--fork", "--mount-proc"],  # unprivileged user namespaces
)


def unshare() -> list:
    """The first command prefix that runs a program in a new PID namespace here; skips the test without one."""
    reasons = []
    for way in UNSHARE_WAYS:
        try:
            probe = subprocess.run([*way, "true"], capture_output=True, text=True, timeout=GUARD)
        except FileNotFoundError:
            pytest.skip("unshare (util-linux) is not installed")
        if probe.returncode == 0:
            return way
        reasons.append(f"{' '.join(way)}: {probe.stderr.strip()}")
    pytest.skip("this machine allows no new PID namespace: " + "; ".join(reasons))


# ---------------------------------------------------------------- A. liveness


def test_classify_same_namespace(runtime):
    parent = os.getppid()
    assert discovery.classify(record(runtime, parent)) == (discovery.LIVE, "running")
    gone = dead_pid()
    assert discovery.classify(record(runtime, gone, proc_start_ticks=5)) == (discovery.STALE, "its process is gone")
    ticks = discovery.process_start_ticks(parent)
    assert discovery.classify(record(runtime, parent, proc_start_ticks=ticks + 1)) == (
        discovery.STALE, f"pid {parent} now belongs to another process (started at tick {ticks}, not {ticks + 1})")
    # Written before pid_ns was recorded, or where /proc could not be read: the pid cannot be judged.
    legacy = record(runtime, gone)
    del legacy["pid_ns"], legacy["boot_id"]
    assert discovery.classify(legacy) == (discovery.ELSEWHERE, discovery.UNKNOWN_THEIR_NS)


def test_unknown_namespace_on_either_side_is_elsewhere_never_stale(runtime):
    gone = dead_pid()
    for pid in (gone, os.getpid()):
        assert discovery.classify(record(runtime, pid, pid_ns=None)) == (discovery.ELSEWHERE, discovery.UNKNOWN_THEIR_NS)
        assert discovery.classify(record(runtime, pid), own_pid_ns="") == (discovery.ELSEWHERE, discovery.UNKNOWN_OWN_NS)
    # an earlier boot of this machine (its machine id and host recorded) is still proof, whatever the namespaces
    other = str(uuid.uuid4())
    assert discovery.classify(record(runtime, gone, pid_ns=None, boot_id=other))[0] == discovery.STALE


def test_a_reader_without_its_namespace_removes_nothing(runtime, monkeypatch):
    gone = dead_pid()
    leftovers = scheme_leftovers(runtime, gone)
    path = plant(runtime, gone, record(runtime, gone, proc_start_ticks=1))
    monkeypatch.setattr(discovery, "pid_namespace", lambda: None)  # as where /proc cannot be read
    found = discovery.scan(runtime)
    assert (found.live, found.stale) == ([], [])
    assert [(k.pid, k.elsewhere) for k in found.elsewhere] == [(gone, discovery.UNKNOWN_OWN_NS)]
    assert path.exists() and all(p.exists() for p in leftovers)


def test_classify_another_namespace_is_elsewhere_even_for_a_pid_alive_here(runtime):
    for pid in (os.getpid(), dead_pid()):
        info = record(runtime, pid, pid_ns="pid:[1]")
        assert discovery.classify(info) == (discovery.ELSEWHERE, "another PID namespace, pid:[1]")
        assert not discovery.is_alive(info)


def test_classify_an_earlier_boot_of_this_machine_is_stale_even_for_a_pid_alive_here(runtime):
    other = str(uuid.uuid4())
    for ns in (discovery.pid_namespace(), "pid:[1]"):
        info = record(runtime, os.getpid(), boot_id=other, pid_ns=ns)
        assert discovery.classify(info) == (
            discovery.STALE, f"written during an earlier boot of this machine (boot id {other})")


def test_classify_another_boot_alone_proves_nothing(runtime):
    other, here = str(uuid.uuid4()), (discovery.machine_id(), discovery.host_name())
    gone = dead_pid()
    # another machine: another machine id, or the same (an image cloned with its id) on another host
    for machine, host in (("0" * 32, here[1]), (here[0], "gpu07"), ("f" * 32, "gpu07")):
        info = record(runtime, gone, boot_id=other, machine_id=machine, host=host)
        assert discovery.judge(info, own_machine=("a" * 32, here[1]) if machine == here[0] and host == here[1]
                               else here) == (discovery.ELSEWHERE, f"on another machine, host {host}",
                                              discovery.ON_ANOTHER_MACHINE)
    # an older gpucleanup recorded no machine, or this machine's id is unknown: never stale
    legacy = record(runtime, gone, boot_id=other)
    del legacy["machine_id"], legacy["host"]
    state, why, place = discovery.judge(legacy)
    assert (state, place) == (discovery.ELSEWHERE, discovery.PLACE_UNKNOWN)
    assert why == (f"written during another boot (boot id {other}) on a machine it does not name (an older "
                   "gpucleanup): it may be another machine's")
    state, why, place = discovery.judge(record(runtime, gone, boot_id=other), own_machine=(None, here[1]))
    assert (state, place) == (discovery.ELSEWHERE, discovery.PLACE_UNKNOWN)
    assert "this machine's id is unknown" in why
    # the same boot id is the same machine whatever the files say: a container without /etc/machine-id
    # still has its dead kernels' files judged by pid
    assert discovery.judge(record(runtime, gone, machine_id=None, host="elsewhere"), own_machine=(None, None)) == (
        discovery.STALE, "its process is gone", None)


def test_is_alive_never_raises_on_a_huge_pid():
    assert discovery.is_alive({"pid": 2**31}) is False
    assert discovery.is_alive({"pid": 2**64}) is False
    assert discovery.is_alive({"pid": "1"}) is False


def test_stale_file_naming_a_live_kernels_paths_takes_nothing_of_the_live_kernel(kernel, runtime):
    gone = dead_pid()
    own = scheme_leftovers(runtime, gone)  # what the stale kernel itself left: created before its discovery file
    stranger = runtime / "gpucleanup" / f"{gone}.key.bak"
    stranger.write_text("not a name the scheme makes")
    outside = runtime / "notes.txt"
    outside.write_text("mine")
    stale = plant(runtime, gone, record(
        runtime, gone, proc_start_ticks=1, key_file=kernel.info["key_file"], endpoint=kernel.info["endpoint"],
        pub_endpoint=kernel.info["pub_endpoint"], connection_file=str(outside), notebook=str(outside)))

    result = cli("ps")
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    assert list(rows(result.stdout)) == [str(os.getpid())]
    assert "running cell 12" in rows(result.stdout)[str(os.getpid())]
    assert not stale.exists()
    assert [p.exists() for p in own] == [False, False, False]
    # Paths named inside the stale file are never touched: the live kernel keeps its key and sockets.
    assert Path(kernel.info["key_file"]).is_file()
    assert stat.S_ISSOCK(os.lstat(kernel.info["endpoint"][len("ipc://"):]).st_mode)
    assert stat.S_ISSOCK(os.lstat(kernel.info["pub_endpoint"][len("ipc://"):]).st_mode)
    assert stranger.exists() and outside.exists()
    assert kernel.discovery_path.exists()
    assert cli("status", str(os.getpid())).returncode == 0


def test_another_boots_file_is_removed_with_its_scheme_files(runtime):
    parent = os.getppid()  # alive here, with the recorded start time: only the boot id tells
    leftovers = scheme_leftovers(runtime, parent)
    path = plant(runtime, parent, record(runtime, parent, boot_id=str(uuid.uuid4())))
    result = cli("ps", "--json")
    assert (result.returncode, result.stdout, result.stderr) == (0, "[]\n", "")
    assert not path.exists()
    assert [p.exists() for p in leftovers] == [False, False, False]


def test_a_dead_kernels_park_lock_goes_with_its_stale_file(runtime):
    gone = dead_pid()
    leftovers = scheme_leftovers(runtime, gone)
    path = plant(runtime, gone, record(runtime, gone, proc_start_ticks=1))
    lock = runtime / "gpucleanup" / f"{gone}.park"
    lock.write_text('{"usage": {}}')  # written when it was parked: after its discovery file
    later = path.stat().st_mtime_ns + 10_000_000_000
    os.utime(lock, ns=(later, later))
    other = runtime / "gpucleanup" / f"{gone + 1}.park"
    other.write_text("")
    assert cli("ps").returncode == 1  # no kernel
    assert not path.exists() and not lock.exists()
    assert [p.exists() for p in leftovers] == [False, False, False]
    assert other.exists()  # another pid's lock is not the dead kernel's


def test_a_key_newer_than_the_stale_file_is_kept(runtime):
    # A kernel that took the pid writes its key before its discovery file: a newer key is not the stale one's.
    gone = dead_pid()
    key, sock, pub = scheme_leftovers(runtime, gone)
    path = plant(runtime, gone, record(runtime, gone, proc_start_ticks=1))
    later = path.stat().st_mtime_ns + 10_000_000_000
    os.utime(key, ns=(later, later))
    assert cli("ps").returncode == 1  # no kernel
    assert not path.exists()
    assert key.exists()
    assert not sock.exists() and not pub.exists()


def test_a_linked_key_directory_is_not_cleaned_through(runtime, tmp_path):
    gone = dead_pid()
    other = tmp_path / "other"
    other.mkdir(mode=0o755)
    os.chmod(other, 0o755)
    (other / f"{gone}.key").write_text("someone else's")
    os.symlink(other, runtime / "gpucleanup")
    path = plant(runtime, gone, record(runtime, gone, proc_start_ticks=1))
    assert cli("ps").returncode == 1
    assert not path.exists()
    assert (other / f"{gone}.key").read_text() == "someone else's"
    assert stat.S_IMODE(other.stat().st_mode) == 0o755


def test_recorded_other_namespace_is_shown_elsewhere_and_kept(kernel, runtime):
    gone = dead_pid()  # gone here; in its own namespace it may well run
    leftovers = scheme_leftovers(runtime, gone)
    path = plant(runtime, gone, record(runtime, gone, pid_ns="pid:[1]", notebook="/srv/other.ipynb", kernel_id="abcdef123456"))

    result = cli("ps")
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    table = rows(result.stdout)
    assert "running cell 12" in table[str(os.getpid())]
    assert " ".join(table[str(gone)].split()[1:]) == "abcdef12 (/srv/other.ipynb) elsewhere (another PID namespace, pid:[1])"

    result = cli("ps", "--json")
    assert result.returncode == 0, result.stderr
    entries = {e["pid"]: e for e in json.loads(result.stdout)}
    assert entries[os.getpid()]["elsewhere"] is False
    assert entries[gone] == {
        "pid": gone, "kernel_id": "abcdef123456", "notebook": "/srv/other.ipynb", "discovery_file": str(path),
        "elsewhere": True, "elsewhere_reason": "another PID namespace, pid:[1]", "place": "namespace",
        "host": discovery.host_name(),
    }

    result = cli("status", str(gone))
    assert result.returncode == 1
    assert result.stderr == (
        f"gpucleanup: kernel {gone} is elsewhere (another PID namespace, pid:[1]): its pid means nothing here; "
        "run gpucleanup where the kernel runs (the same container)\n"
    )
    assert path.exists()
    assert all(p.exists() for p in leftovers)


INNER_KERNEL = r"""
import os, socket, sys
from pathlib import Path
from gpucleanup.protocol import discovery

runtime = Path(os.environ["JUPYTER_RUNTIME_DIR"])
pid = os.getpid()
private = discovery.ensure_private_dir(runtime / "gpucleanup")
discovery.write_private(private / f"{pid}.key", b"k" * 64)
socks = []
for name in (f"{pid}.sock", f"{pid}.sock.pub"):
    s = socket.socket(socket.AF_UNIX)
    s.bind(str(private / name))
    socks.append(s)
info = discovery.describe(endpoint=f"ipc://{private}/{pid}.sock", pub_endpoint=f"ipc://{private}/{pid}.sock.pub",
                          key_file=str(private / f"{pid}.key"), transport="ipc", notebook="/ns/inner.ipynb")
discovery.write(discovery.discovery_path(pid, runtime), info)
print(pid, info["pid_ns"], flush=True)
sys.stdin.read()
"""


def test_kernel_in_a_real_other_pid_namespace_is_left_alone(kernel, runtime):
    inner = subprocess.Popen(
        [*unshare(), sys.executable, "-c", INNER_KERNEL],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=_env(),
    )
    try:
        line = inner.stdout.readline()  # written once its files exist
        assert line, "the kernel in the new PID namespace did not start"
        pid_text, ns = line.split()
        assert ns != discovery.pid_namespace()
        files = [runtime / f"gpucleanup-{pid_text}.json"] + [
            runtime / "gpucleanup" / name for name in (f"{pid_text}.key", f"{pid_text}.sock", f"{pid_text}.sock.pub")]
        assert all(p.exists() for p in files)

        result = cli("ps")
        assert result.returncode == 0, result.stderr
        table = rows(result.stdout)
        assert "running cell 12" in table[str(os.getpid())]
        assert table[pid_text].split()[1:] == ["/ns/inner.ipynb", "elsewhere", "(another", "PID", "namespace,", f"{ns})"]
        entry = next(e for e in json.loads(cli("ps", "--json").stdout) if str(e["pid"]) == pid_text)
        assert entry["elsewhere"] is True
        assert all(p.exists() for p in files)
    finally:
        inner.stdin.close()
        inner.wait(timeout=GUARD)
    # Its process is gone now, but nothing here can prove it: the files stay for its own namespace to judge.
    result = cli("ps")
    assert result.returncode == 0, result.stderr
    assert "elsewhere" in rows(result.stdout)[pid_text]
    assert all(p.exists() for p in files)


NO_PROC_WAYS = (
    ["unshare", "--pid", "--fork", "--mount"],  # root
    ["unshare", "--user", "--map-root-user", "--pid", "--fork", "--mount"],  # unprivileged user namespaces
)
#: run "$@" with an empty tmpfs over /proc: no namespace link, no /proc/<pid>/stat
_EMPTY_PROC = ["sh", "-c", 'mount -t tmpfs none /proc && exec "$@"', "sh"]


def unshare_without_proc() -> list:
    """A command prefix that runs a program in a new PID namespace with /proc unreadable; skips without one."""
    if "libasan" in os.environ.get("LD_PRELOAD", ""):
        # the sanitizer run (scripts/sanitizers.sh) preloads ASan into every Python it starts, and ASan's runtime
        # reads /proc itself (/proc/self/exe, /proc/<pid>/task): without /proc it ends the process with its own
        # fatal error, which says nothing about gpucleanup; the plain run covers these tests
        pytest.skip("AddressSanitizer's runtime needs /proc: a process without /proc cannot run under it")
    reasons = []
    for way in NO_PROC_WAYS:
        try:
            probe = subprocess.run([*way, *_EMPTY_PROC, "sh", "-c", "! test -e /proc/self/ns/pid"],
                                   capture_output=True, text=True, timeout=GUARD)
        except FileNotFoundError:
            pytest.skip("unshare (util-linux) is not installed")
        if probe.returncode == 0:
            return [*way, *_EMPTY_PROC]
        reasons.append(f"{' '.join(way)}: {probe.stderr.strip()}")
    pytest.skip("this machine allows no PID namespace without /proc: " + "; ".join(reasons))


def test_a_kernel_started_without_proc_is_elsewhere_and_its_files_stay(kernel, runtime):
    inner = subprocess.Popen([*unshare_without_proc(), sys.executable, "-c", INNER_KERNEL],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=_env())
    try:
        line = inner.stdout.readline()
        assert line, "the kernel without /proc did not start"
        pid_text, ns = line.split()
        assert ns == "None"
        files = [runtime / f"gpucleanup-{pid_text}.json"] + [
            runtime / "gpucleanup" / name for name in (f"{pid_text}.key", f"{pid_text}.sock", f"{pid_text}.sock.pub")]
        assert json.loads(files[0].read_text())["pid_ns"] is None
        result = cli("ps", "--json")
        assert result.returncode == 0, result.stderr
        entries = {str(e["pid"]): e for e in json.loads(result.stdout)}
        assert entries[pid_text]["elsewhere"] is True
        assert entries[pid_text]["elsewhere_reason"] == discovery.UNKNOWN_THEIR_NS
        assert entries[str(os.getpid())]["status"]["state"]["state"] == "running"
    finally:
        inner.stdin.close()
        inner.wait(timeout=GUARD)
    # gone now, and still nothing here can prove it: its pid was another namespace's
    assert cli("ps").returncode == 0
    assert all(p.exists() for p in files)


def test_ps_without_proc_leaves_this_kernel_alone(kernel, runtime):
    result = subprocess.run([*unshare_without_proc(), sys.executable, "-m", "gpucleanup.outside.cli", "ps", "--json"],
                            capture_output=True, text=True, env=_env(), timeout=GUARD)
    assert result.returncode == 0, result.stderr
    (entry,) = json.loads(result.stdout)
    assert (entry["pid"], entry["elsewhere"], entry["elsewhere_reason"]) == (
        os.getpid(), True, discovery.UNKNOWN_OWN_NS)
    assert kernel.discovery_path.exists()
    assert Path(kernel.info["key_file"]).exists()
    assert stat.S_ISSOCK(os.lstat(kernel.info["endpoint"][len("ipc://"):]).st_mode)
    assert stat.S_ISSOCK(os.lstat(kernel.info["pub_endpoint"][len("ipc://"):]).st_mode)
    assert "running cell 12" in rows(cli("ps").stdout)[str(os.getpid())]


def test_ps_in_another_pid_namespace_leaves_this_kernel_alone(kernel, runtime):
    result = subprocess.run(
        [*unshare(), sys.executable, "-m", "gpucleanup.outside.cli", "ps", "--json"],
        capture_output=True, text=True, env=_env(), timeout=GUARD,
    )
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    (entry,) = json.loads(result.stdout)
    assert entry == {
        "pid": os.getpid(), "kernel_id": None, "notebook": "/home/me/fit.ipynb",
        "discovery_file": str(kernel.discovery_path), "elsewhere": True,
        "elsewhere_reason": f"another PID namespace, {discovery.pid_namespace()}", "place": "namespace",
        "host": discovery.host_name(),
    }
    assert kernel.discovery_path.exists()
    assert Path(kernel.info["key_file"]).exists()
    assert stat.S_ISSOCK(os.lstat(kernel.info["endpoint"][len("ipc://"):]).st_mode)
    assert stat.S_ISSOCK(os.lstat(kernel.info["pub_endpoint"][len("ipc://"):]).st_mode)
    result = cli("ps")
    assert result.returncode == 0, result.stderr
    assert "running cell 12" in rows(result.stdout)[str(os.getpid())]


# ---------------------------------------------------------------- B. untrusted input


def test_every_bad_file_is_one_line_and_the_good_kernel_is_still_listed(kernel, runtime, sleepers, tmp_path):
    bad = {}
    huge = 2**31
    bad[runtime / f"gpucleanup-{huge}.json"] = f"pid {huge} in the file name is out of range (1 to 4194303)"
    (runtime / f"gpucleanup-{huge}.json").write_text(json.dumps(record(runtime, 7, pid=huge)))
    p = dead_pid()
    bad[plant(runtime, p, record(runtime, p, pid=huge))] = f"pid {huge} is out of range (1 to 4194303)"
    p = dead_pid()
    bad[plant(runtime, p, record(runtime, p, endpoint=5))] = "endpoint must be a string, got int 5"
    p = dead_pid()
    bad[plant(runtime, p, record(runtime, p, kernel_id=[1, 2]))] = "kernel_id must be a string or null, got list [1, 2]"
    p = dead_pid()
    bad[plant(runtime, p, record(runtime, p, key_file=3))] = "key_file must be a string or null, got int 3"
    p = dead_pid()
    bad[plant(runtime, p, b"not json")] = "not JSON (Expecting value: line 1 column 1 (char 0))"
    p = dead_pid()
    bad[plant(runtime, p, b"{" + b" " * 70000 + b"}")] = "larger than 65536 bytes (70002)"
    p = dead_pid()
    fifo = runtime / f"gpucleanup-{p}.json"
    os.mkfifo(fifo, 0o600)
    bad[fifo] = "not a regular file (a FIFO)"
    p = dead_pid()
    zero = runtime / f"gpucleanup-{p}.json"
    os.symlink("/dev/zero", zero)
    bad[zero] = "a symbolic link"

    # Live processes of this namespace whose key file is a FIFO, a link to /dev/zero, /dev/zero itself.
    # At the key path of the naming scheme: a FIFO, a link to /dev/zero; elsewhere: /dev/zero itself.
    private = discovery.ensure_private_dir(runtime / "gpucleanup")
    pid = sleepers()
    os.mkfifo(private / f"{pid}.key", 0o600)
    bad[plant(runtime, pid, record(runtime, pid))] = f"key file {private / f'{pid}.key'} is not a regular file (a FIFO)"
    pid = sleepers()
    os.symlink("/dev/zero", private / f"{pid}.key")
    bad[plant(runtime, pid, record(runtime, pid))] = f"key file {private / f'{pid}.key'} is a symbolic link"
    pid = sleepers()
    bad[plant(runtime, pid, record(runtime, pid, key_file="/dev/zero"))] = (
        f"key file /dev/zero is not {private / f'{pid}.key'}, the only key file the naming scheme gives")

    for args in (("ps", "--timeout", "1"), ("ps", "--json", "--timeout", "1")):
        result = cli(*args)
        assert result.returncode == 0, result.stderr
        lines = result.stderr.splitlines()
        # the first few one line each, then one line for the rest
        said = set(f"gpucleanup: skipped {path}: {why}" for path, why in bad.items())
        cap = cli_module.MAX_SKIPPED_LINES
        assert len(bad) > cap
        assert len(lines) == cap + 1 and set(lines[:cap]) <= said
        assert lines[cap] == (f"gpucleanup: skipped {len(bad) - cap} more unusable files in {runtime} "
                              f"(the first {cap} are said above)")
        if "--json" in args:
            assert [e["pid"] for e in json.loads(result.stdout)] == [os.getpid()]
        else:
            assert list(rows(result.stdout)) == [str(os.getpid())]
            assert "running cell 12" in result.stdout
    # Nothing proves these stale: they are all still there, for a person to look at.
    assert all(os.path.lexists(path) for path in bad)
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)


def test_a_flood_of_bad_files_is_one_summary_line_on_stderr(kernel, runtime):
    for _ in range(100):
        plant(runtime, dead_pid(), b"not json")
    result = cli("ps")
    assert result.returncode == 0, result.stderr
    lines = result.stderr.splitlines()
    cap = cli_module.MAX_SKIPPED_LINES
    assert len(lines) == cap + 1
    assert all(line.startswith("gpucleanup: skipped ") and line.endswith(": not JSON (Expecting value: line 1 column 1 "
                                                                       "(char 0))") for line in lines[:cap])
    assert lines[cap] == f"gpucleanup: skipped {100 - cap} more unusable files in {runtime} (the first {cap} are said above)"
    assert "running cell 12" in rows(result.stdout)[str(os.getpid())]


def test_status_and_drain_report_a_bad_key_file_instead_of_hanging(runtime, sleepers, tmp_path):
    pid = sleepers()
    key = discovery.ensure_private_dir(runtime / "gpucleanup") / f"{pid}.key"
    os.mkfifo(key, 0o600)
    plant(runtime, pid, record(runtime, pid))
    for command in ("status", "drain"):
        result = cli(command, str(pid), "--timeout", "1")
        assert result.returncode == 4
        assert result.stderr == (
            f"gpucleanup: kernel {pid}: its key file {key} is not a regular file (a FIFO): gpucleanup writes a "
            "regular file there; restart the kernel\n"
        )


def test_a_key_file_is_only_ever_the_schemes_owned_by_the_discovery_files_owner(runtime, tmp_path):
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("only root can give a file away (and start the user's processes, with setpriv)")
    # root reading a user's runtime directory (--runtime-dir, JUPYTER_RUNTIME_DIR): everything there is the user's
    os.chown(runtime, 12345, 12345)
    secret = tmp_path / "root-only"
    secret.write_text("r" * 64)
    os.chmod(secret, 0o600)
    private = discovery.ensure_private_dir(runtime / "gpucleanup")
    # the user's own processes, holding the sockets their records name (a record of a user names only the
    # user's own process and sockets: tests/python/test_foreign_records.py); the sockets are made here and handed
    # down, as the user cannot reach pytest's root-only directory
    users, sockets = [], []
    for n in range(2):
        held = []
        for suffix in ("sock", "pub"):
            listening = socket.socket(socket.AF_UNIX)
            listening.bind(str(private / f"user{n}.{suffix}"))
            listening.listen(1)
            held.append(listening)
        sockets += held
        users.append(subprocess.Popen(
            ["setpriv", "--reuid=12345", "--regid=12345", "--clear-groups", sys.executable, "-I", "-c",
             "import sys; print('ready', flush=True); sys.stdin.read()"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, pass_fds=[s.fileno() for s in held]))
    try:
        for user in users:
            assert user.stdout.readline() == "ready\n"
        _key_files_of_the_users_records(runtime, private, secret, users[0].pid, users[1].pid)
    finally:
        for user in users:
            user.stdin.close()
            user.wait(timeout=GUARD)
        for listening in sockets:
            listening.close()


def _key_files_of_the_users_records(runtime: Path, private: Path, secret: Path, named: int, planted: int) -> None:
    for n, pid, fields in ((0, named, {"key_file": str(secret)}), (1, planted, {})):
        fields.update(endpoint=f"ipc://{private}/user{n}.sock", pub_endpoint=f"ipc://{private}/user{n}.pub")
        path = plant(runtime, pid, record(runtime, pid, **fields))
        os.chown(path, 12345, 12345)
    # at the scheme's path, a root-owned key (the user cannot have written it): not the user's either
    (private / f"{planted}.key").write_text("k" * 64)
    os.chmod(private / f"{planted}.key", 0o600)
    os.chown(private, 12345, 12345)
    found = {k.pid: k for k in discovery.scan(runtime, clean=False).live}
    assert found[named].owner == found[planted].owner == 12345
    with pytest.raises(discovery.UnsafeFile) as named_error:
        found[named].read_key()
    assert named_error.value.strerror == f"not {private / f'{named}.key'}, the only key file the naming scheme gives"
    with pytest.raises(discovery.UnsafeFile) as planted_error:
        found[planted].read_key()
    assert planted_error.value.strerror == "owned by uid 0, not by uid 12345, who owns the discovery file"
    result = cli("ps", "--json")
    assert result.returncode == 0
    assert f"key file {secret} is not {private / f'{named}.key'}" in result.stderr
    assert f"key file {private / f'{planted}.key'} is owned by uid 0, not by uid 12345" in result.stderr
    # a key of the user's own at the scheme's path is read
    os.chown(private / f"{planted}.key", 12345, 12345)
    assert found[planted].read_key() == b"k" * 64


def test_a_file_owned_by_someone_else_is_skipped(kernel, runtime):
    if os.geteuid() != 0:
        pytest.skip("only root can give a file away")
    p = dead_pid()
    path = plant(runtime, p, record(runtime, p))
    os.chown(path, 12345, 12345)
    result = cli("ps")
    assert result.returncode == 0
    assert result.stderr == f"gpucleanup: skipped {path}: owned by uid 12345, not by you\n"
    assert list(rows(result.stdout)) == [str(os.getpid())]
    assert path.exists()


@pytest.mark.parametrize(
    "fields, why",
    [
        ({"pid": True}, "pid must be an integer, got bool True"),
        ({"pid": 0}, "pid 0 is out of range (1 to 4194303)"),
        ({"pid": "77"}, "pid must be an integer, got str '77'"),
        ({"pid": 78}, "pid 78 does not match the file name's pid 77"),
        ({"discovery": 2}, "discovery version 2 is not 1"),
        ({"endpoint": "tcp://10.0.0.1:5555"},
         "endpoint 'tcp://10.0.0.1:5555' is not ipc://<absolute path>, tcp://127.0.0.1:<port> or tcp://[::1]:<port>"),
        ({"pub_endpoint": "tcp://127.0.0.1:0"},
         "pub_endpoint 'tcp://127.0.0.1:0' is not ipc://<absolute path>, tcp://127.0.0.1:<port> or tcp://[::1]:<port>"),
        ({"endpoint": "ipc://relative.sock"},
         "endpoint 'ipc://relative.sock' is not ipc://<absolute path>, tcp://127.0.0.1:<port> or tcp://[::1]:<port>"),
        ({"key_file": "relative.key"}, "key_file 'relative.key' is not an absolute path"),
        ({"key_file": "/a\x00b"}, "key_file is not a plausible value: '/a\\x00b'"),
        # the park lock is named from it, and a park's sentences name the lock: nothing for a terminal in it
        ({"key_file": "/r/\x1b[31m\ngpucleanup: forged.key"},
         "key_file '/r/\\x1b[31m\\ngpucleanup: forged.key' holds control characters"),
        ({"key_file": "/r/\u202eyek.key"}, "key_file '/r/\\u202eyek.key' holds control characters"),
        ({"transport": "udp"}, "transport 'udp' is not 'ipc' or 'tcp'"),
        ({"pid_ns": "net:[1]"}, "pid_ns 'net:[1]' is not pid:[<inode>]"),
        ({"boot_id": 5}, "boot_id must be a string or null, got int 5"),
        ({"proc_start_ticks": -1}, f"proc_start_ticks -1 is out of range (0 to {2**63 - 1})"),
        ({"notebook": {"a": 1}}, "notebook must be a string or null, got dict {'a': 1}"),
    ],
)
def test_validate_names_what_is_wrong(runtime, fields, why):
    with pytest.raises(discovery.BadDiscoveryFile) as raised:
        discovery.validate(record(runtime, 77, **{"proc_start_ticks": None, **fields}), 77)
    assert str(raised.value) == why


def test_validate_accepts_what_describe_writes_and_tcp_loopback(runtime):
    for endpoint in ("tcp://127.0.0.1:5555", "tcp://[::1]:65535"):
        info = record(runtime, 77, proc_start_ticks=None, endpoint=endpoint, pub_endpoint=endpoint, transport="tcp")
        assert discovery.validate(info, 77) is info
    info = discovery.describe(endpoint="ipc:///x/1.sock", pub_endpoint="ipc:///x/1.sock.pub", key_file=None,
                              transport="ipc")
    assert discovery.validate(info, os.getpid()) is info


# ---------------------------------------------------------------- C. writing


def test_write_on_a_full_disk_leaves_no_temporary_file(runtime, monkeypatch):
    path = runtime / "gpucleanup-77.json"
    discovery.write(path, record(runtime, 77, notebook="old"))

    def full(fd, data):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "write", full)
    with pytest.raises(OSError) as raised:
        discovery.write(path, record(runtime, 77, notebook="new"))
    assert raised.value.errno == errno.ENOSPC
    assert os.listdir(runtime) == [path.name]
    assert json.loads(path.read_text())["notebook"] == "old"


def test_endpoint_on_a_full_disk_leaves_nothing_behind(runtime, monkeypatch, fake_cuda):
    def full(fd, data):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    # At start: the key cannot be written, so nothing starts and nothing stays.
    with monkeypatch.context() as patch:
        patch.setattr(os, "write", full)
        ep = StatusEndpoint()
        ep.start(types.SimpleNamespace(user_ns={}))
    assert not ep.running
    assert ep.error == "OSError: [Errno 28] No space left on device"
    assert sorted(os.listdir(runtime)) == ["gpucleanup"]
    assert os.listdir(runtime / "gpucleanup") == []

    # Later, when the notebook name arrives: the old file stays whole, no temporary file is left.
    shell = types.SimpleNamespace(user_ns={})
    ep = StatusEndpoint()
    ep.start(shell)
    try:
        assert ep.error is None, ep.error
        before = ep.discovery_path.read_bytes()
        shell.user_ns["__session__"] = "/home/me/late.ipynb"
        with monkeypatch.context() as patch:
            patch.setattr(os, "write", full)
            ep.set_state({"state": "running", "cell": 2})  # a cell starts: the name is taken then
        assert ep.error == "OSError: [Errno 28] No space left on device"
        assert ep.discovery_path.read_bytes() == before
        assert sorted(os.listdir(runtime)) == ["gpucleanup", ep.discovery_path.name]
    finally:
        ep.close()


def test_write_replaces_a_planted_link_and_never_follows_it(runtime, tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("precious")
    path = runtime / "gpucleanup-77.json"
    os.symlink(victim, path)
    discovery.write(path, record(runtime, 77))
    assert not path.is_symlink()
    assert json.loads(path.read_text())["pid"] == 77
    assert victim.read_text() == "precious"


@pytest.mark.parametrize("planted", ["symlink", "fifo"])
def test_write_refuses_whatever_sits_at_its_temporary_name(runtime, tmp_path, monkeypatch, planted):
    victim = tmp_path / "victim"
    victim.write_text("precious")
    trap = runtime / "gpucleanup-77.json.trap.tmp"
    if planted == "symlink":
        os.symlink(victim, trap)
    else:
        os.mkfifo(trap)
    monkeypatch.setattr(discovery, "_temp_name", lambda name: trap.name)
    with pytest.raises(FileExistsError):
        discovery.write(runtime / "gpucleanup-77.json", record(runtime, 77))
    assert victim.read_text() == "precious"
    assert os.listdir(runtime) == [trap.name]  # not written through it, and not ours to remove


@pytest.mark.parametrize("umask", [0o000, 0o022, 0o277])
def test_written_files_are_0600_whatever_the_umask(runtime, umask):
    old = os.umask(umask)
    try:
        discovery.write(runtime / "gpucleanup-77.json", record(runtime, 77))
        discovery.write_private(runtime / "77.key", b"k" * 64)
    finally:
        os.umask(old)
    assert stat.S_IMODE((runtime / "gpucleanup-77.json").stat().st_mode) == 0o600
    assert stat.S_IMODE((runtime / "77.key").stat().st_mode) == 0o600


@pytest.mark.parametrize("mode", [0o777, 0o1777, 0o773])
def test_world_writable_runtime_dir_is_refused_with_what_to_set(tmp_path, monkeypatch, fake_cuda, caplog, mode):
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, mode)
    monkeypatch.setenv("JUPYTER_RUNTIME_DIR", str(shared))
    message = (
        f"runtime directory {shared} is writable by every user (mode {mode:o}): gpucleanup writes no discovery "
        "file, key or socket there; set JUPYTER_RUNTIME_DIR to a private directory (yours, mode 0700)"
    )
    with caplog.at_level(logging.WARNING, logger="gpucleanup"):
        ep = StatusEndpoint()
        ep.start(types.SimpleNamespace(user_ns={}))
    assert not ep.running
    assert ep.error == f"InsecureRuntimeDir: {message}"
    assert [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING] == [
        f"gpucleanup status endpoint did not start: InsecureRuntimeDir: {message}"]
    assert os.listdir(shared) == []
    with pytest.raises(discovery.InsecureRuntimeDir):
        discovery.write(shared / "gpucleanup-77.json", record(shared, 77))
    assert os.listdir(shared) == []
    ep.close()


def test_a_linked_private_dir_is_refused_and_its_target_keeps_its_mode(runtime, tmp_path, fake_cuda):
    other = tmp_path / "somebody-elses"
    other.mkdir()
    os.chmod(other, 0o755)
    os.symlink(other, runtime / "gpucleanup")
    ep = StatusEndpoint()
    ep.start(types.SimpleNamespace(user_ns={}))
    assert not ep.running
    assert ep.error == (
        f"PermissionError: {runtime / 'gpucleanup'} is a symbolic link: gpucleanup keeps its keys and sockets only "
        "in a directory of its own; remove the link"
    )
    assert stat.S_IMODE(other.stat().st_mode) == 0o755
    assert os.listdir(other) == []
    assert sorted(os.listdir(runtime)) == ["gpucleanup"]
    ep.close()


def test_ensure_private_dir_narrows_a_real_directory_and_refuses_a_file(runtime):
    private = runtime / "gpucleanup"
    private.mkdir()
    os.chmod(private, 0o755)
    assert discovery.ensure_private_dir(private) == private
    assert stat.S_IMODE(private.stat().st_mode) == 0o700
    (runtime / "afile").write_text("")
    with pytest.raises(PermissionError, match="is not a directory"):
        discovery.ensure_private_dir(runtime / "afile")


def test_a_cells_running_and_idle_go_in_one_call_that_answers_the_park_state(kernel):
    from gpucleanup.protocol import status_client

    info = json.loads(kernel.discovery_path.read_text())
    target = status_client.Target(info["endpoint"], Path(info["key_file"]).read_bytes())

    def state() -> dict:
        return status_client.request(target, "status", timeout=10)["state"]

    before = time.time_ns()
    assert kernel.cell_state("running", 12, 0) == 0  # not parked
    told = state()
    assert (told["state"], told["cell"]) == ("running", 12)
    assert before <= told["since_ns"] <= time.time_ns()  # "since" is the library's now, not the argument
    assert kernel.cell_state("idle", None, 0) == 0
    assert state()["state"] == "idle" and "cell" not in state()
    assert kernel.park_step("begin")["state"] == "parking"
    assert kernel.cell_state("running", 13, 0) == 1  # a park under way keeps its state, and says so
    assert state()["state"] == "parking"
    kernel.park_step("failed")
    assert kernel.cell_state("running", None, 0) == 0
    told = state()
    assert (told["state"], told["cell"]) == ("running", None)


def test_a_library_older_than_the_one_call_gets_the_two_calls_it_stands_for(kernel, monkeypatch):
    from gpucleanup import _native
    from gpucleanup.protocol import status_client

    info = json.loads(kernel.discovery_path.read_text())
    target = status_client.Target(info["endpoint"], Path(info["key_file"]).read_bytes())
    real = _native.held()

    class Older:  # the library of a build from before gpucleanup_server_cell
        def __getattr__(self, name):
            if name == "gpucleanup_server_cell":
                raise AttributeError(name)
            return getattr(real, name)

    monkeypatch.setattr(_native, "held", lambda: Older())
    assert _native.server_cell(True, 5) == 0
    told = status_client.request(target, "status", timeout=10)["state"]
    assert (told["state"], told["cell"]) == ("running", 5)
    assert _native.server_cell(False, 5) == 0
    assert status_client.request(target, "status", timeout=10)["state"]["state"] == "idle"


def test_the_kernels_own_background_work_and_a_park_keep_out_of_each_others_way(kernel, monkeypatch):
    from gpucleanup import _native

    kernel.cell_state("idle", None, 0)
    assert kernel.background(True) is True  # a release on its thread: may run, and is counted
    with pytest.raises(RuntimeError, match="park refused: gpucleanup is giving the frameworks' caches back"):
        kernel.park_step("begin")
    assert kernel.background(False) is True
    assert kernel.park_step("begin")["state"] == "parking"
    assert kernel.background(True) is False  # a park under way: the release must wait for the resume
    kernel.park_step("failed")
    assert kernel.park_step("begin")["state"] == "parking"  # the refused begin was not counted
    kernel.park_step("failed")
    real = _native.held()

    class Older:  # the library of a build from before gpucleanup_server_background: nothing is counted
        def __getattr__(self, name):
            if name == "gpucleanup_server_background":
                raise AttributeError(name)
            return getattr(real, name)

    monkeypatch.setattr(_native, "held", lambda: Older())
    assert _native.server_background(True) == 0 and _native.server_background(False) == 0
    assert kernel.park_step("begin")["state"] == "parking"
    assert _native.server_background(True) == 1  # it still says a park under way, from the park state
    kernel.park_step("failed")
    kernel.close()
    assert kernel.background(True) is True  # the endpoint off: nothing can park the kernel


def test_the_status_server_takes_the_per_cell_states_without_json(kernel):
    from gpucleanup import _native
    from gpucleanup.protocol import status_client

    info = json.loads(kernel.discovery_path.read_text())
    target = status_client.Target(info["endpoint"], Path(info["key_file"]).read_bytes())
    since = 1_700_000_000_000_000_000
    kernel.set_state({"state": "waiting", "device": 0, "cell": 7, "since_ns": since})
    def state() -> dict:  # what the kernel said; the server adds age_s and updated_ns
        reply = status_client.request(target, "status", timeout=10)["state"]
        return {k: v for k, v in reply.items() if k not in ("age_s", "updated_ns")}

    # no cell has ended since the server started: last_cell_ended_ns is null until one does
    assert state() == {"state": "waiting", "device": 0, "cell": 7, "since_ns": since, "last_cell_ended_ns": None}
    _native.server_state("running")  # no cell number: null, as the JSON call says it
    assert state()["state"] == "running" and state()["cell"] is None
    _native.server_state("idle", cell=9, since_ns=since)
    # a running cell that ends: the end is the idle state's own time
    assert state() == {"state": "idle", "since_ns": since, "last_cell_ended_ns": since}
    # what the fields cannot say still goes as JSON, unchanged
    kernel.set_state({"state": "running", "cell": 3, "note": "from a test"})
    told = state()
    assert (told["state"], told["cell"], told["note"]) == ("running", 3, "from a test")
    with pytest.raises(ValueError, match="state must be one of idle, running, draining, waiting"):
        _native.server_state("sleeping")


# ---------------------------------------------------------------- D. one form of notebook path


class _NamedNotebook:
    """A session with a name, as JupyterLab starts one: Jupyter Server then gives its kernel the notebook's
    absolute path in JPY_SESSION_NAME (without a name, the session path itself)."""

    def __new__(cls, server, path: str):
        from server_harness import Notebook

        nb = object.__new__(Notebook)
        from jupyter_client import BlockingKernelClient

        nb.server, nb.path, nb.count = server, path, 0
        (server.root / path).parent.mkdir(parents=True, exist_ok=True)
        session = server.api("POST", "/api/sessions", {"path": path, "name": os.path.basename(path), "type": "notebook",
                                                       "kernel": {"name": "python3"}}, expect=201)
        nb.kernel_id = session["kernel"]["id"]
        nb.kc = BlockingKernelClient(connection_file=str(server.runtime / f"kernel-{nb.kernel_id}.json"))
        nb.kc.load_connection_file()
        nb.kc.start_channels(hb=False)
        nb.kc.wait_for_ready(timeout=GUARD)
        return nb


@pytest.mark.parametrize("named", [True, False], ids=["named session (JupyterLab)", "session without a name"])
def test_a_notebook_is_named_relative_to_its_servers_root_everywhere(tmp_path, named):
    """The page names a notebook by its session path, relative to the server's root; the kernel records it in
    that form (with the root beside it), so ps, status, the drain reply and /metrics name it the same way."""
    sys.path.insert(0, str(ROOT / "tests"))
    from server_harness import Notebook, Server  # noqa: E402  (tests/server_harness.py)

    srv = Server(tmp_path / "srv")
    nb = None
    try:
        nb = (_NamedNotebook if named else Notebook)(srv, "work/sub/fit.ipynb")
        session_name = nb.run("import os; print(os.environ['JPY_SESSION_NAME'])").strip()
        assert session_name == (str(srv.root / "work/sub/fit.ipynb") if named else "work/sub/fit.ipynb")
        nb.load_gpucleanup()
        found = nb.discovery()
        assert (found.notebook, found.notebook_root) == ("work/sub/fit.ipynb", str(srv.root))
        assert found.notebook_path() == str(srv.root / "work" / "sub" / "fit.ipynb")
        env = dict(_env(), JUPYTER_RUNTIME_DIR=str(srv.runtime))

        def run(*args):
            done = subprocess.run([sys.executable, "-m", "gpucleanup.outside.cli", *args], capture_output=True, text=True,
                                  env=env, timeout=GUARD)
            assert done.returncode == 0, done.stderr
            return done.stdout

        (entry,) = json.loads(run("ps", "--json"))
        assert entry["notebook"] == "work/sub/fit.ipynb"
        assert entry["status"]["kernel"]["notebook"] == "work/sub/fit.ipynb"
        assert entry["status"]["kernel"]["notebook_root"] == str(srv.root)
        assert "work/sub/fit.ipynb" in run("ps")
        status = run("status", found.kernel_id)
        assert "\nnotebook   work/sub/fit.ipynb\n" in status
        assert f"\nroot       {srv.root}  (the Jupyter Server's; the notebook is relative to it)\n" in status
        # the absolute path finds it too, as the page's relative one does
        assert json.loads(run("status", str(srv.root / "work/sub/fit.ipynb"), "--json"))["kernel"]["pid"] == found.pid
        drained = json.loads(run("drain", "work/sub/fit.ipynb", "--json"))
        assert drained["kernel"]["notebook"] == "work/sub/fit.ipynb"
        # the page: the server's own session path, the same string
        listed = srv.api("GET", "/api/gpucleanup/kernels")
        assert [e["notebook"] for e in listed["kernels"] if e["kernel_id"] == nb.kernel_id] == ["work/sub/fit.ipynb"]
        # the server's /metrics: a label per kernel, once a collection has seen it
        pytest.importorskip("prometheus_client")
        deadline = time.monotonic() + GUARD
        while True:
            page = srv.request("GET", "/metrics", token=True).body.decode()
            if f'kernel_id="{nb.kernel_id}"' in page or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        labelled = [line for line in page.splitlines() if f'kernel_id="{nb.kernel_id}"' in line]
        assert labelled, page[-2000:]
        assert all('notebook="work/sub/fit.ipynb"' in line for line in labelled), labelled[:3]
    finally:
        if nb is not None:
            nb.close()
        srv.stop()


def test_display_form_is_relative_only_under_the_root():
    from gpucleanup.protocol.notebook_path import display_form

    assert display_form("/srv/root/a/b.ipynb", "/srv/root") == ("a/b.ipynb", "/srv/root")
    assert display_form("/srv/root/../other/b.ipynb", "/srv/root") == ("/srv/root/../other/b.ipynb", None)
    assert display_form("/srv/rooted/b.ipynb", "/srv/root") == ("/srv/rooted/b.ipynb", None)
    assert display_form("/srv/root", "/srv/root") == ("/srv/root", None)
    assert display_form("/srv/root/b.ipynb", None) == ("/srv/root/b.ipynb", None)
    assert display_form("relative/a.ipynb", "/srv/root") == ("relative/a.ipynb", "/srv/root")  # a session path
    assert display_form("../a.ipynb", "/srv/root") == ("../a.ipynb", None)


def test_a_server_file_of_another_pid_root_or_machine_is_not_taken(tmp_path, sleepers):
    # this process stands for the Jupyter Server, a child of it for the kernel
    from gpucleanup.protocol import notebook_path

    runtime = tmp_path / "runtime"
    runtime.mkdir(mode=0o700)
    kernel_pid = sleepers()
    listening = socket.socket()
    listening.bind(("127.0.0.1", 0))
    listening.listen()
    port = listening.getsockname()[1]
    server_file = runtime / f"jpserver-{os.getpid()}.json"

    def root(**fields) -> object:
        server_file.write_text(json.dumps({"pid": os.getpid(), "root_dir": "/srv/root", "port": port, "sock": "",
                                           **fields}))
        return notebook_path.server_root(runtime, "/srv/root/a.ipynb", pid=kernel_pid)

    try:
        assert root() == "/srv/root"
        # another machine's server with the same pid, in a shared runtime directory: its port is not this one's
        other = socket.socket()
        other.bind(("127.0.0.1", 0))
        free = other.getsockname()[1]
        other.close()
        assert root(port=free) is None
        assert root(pid=os.getpid() + 1) is None
        assert root(root_dir="relative") is None
        assert root(root_dir="/home/me") is None  # a root that does not hold the notebook
        unix = tmp_path / "jupyter.sock"
        served = socket.socket(socket.AF_UNIX)
        served.bind(str(unix))
        served.listen()
        try:
            assert root(sock=str(unix)) == "/srv/root"
            assert root(sock=str(tmp_path / "theirs.sock")) is None
        finally:
            served.close()
        server_file.unlink()
        os.mkfifo(server_file)  # never opened: nothing blocks
        assert notebook_path.server_root(runtime, "/srv/root/a.ipynb", pid=kernel_pid) is None
    finally:
        listening.close()
