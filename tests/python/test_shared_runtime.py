"""One Jupyter runtime directory shared by several machines and containers (issue 42, cases 1 and 2).

1. Two machines on one runtime directory (an NFS home shared by a cluster's nodes): "host B" is a mount and UTS
   namespace whose ``/proc/sys/kernel/random/boot_id`` and ``/etc/machine-id`` are other files bind-mounted over
   the real ones, and whose host name is another. Host B's ``gpucleanup ps`` and a kernel loading gpucleanup there
   (the load-time sweep) keep host A's live kernel's discovery file, key and sockets, list it as on another
   machine, never ask it; host A's ``gpucleanup ps`` still finds and asks it.
2. Two PID namespaces (two containers) with the same pid on one runtime directory: each kernel's files have
   names of their own, both are listed, and the exit of one (unload, then SIGTERM) removes only its own files.
3. A kernel whose file was replaced by someone else's (the same name) leaves that file alone, at unload and on
   SIGTERM.

Every kernel is a real ipykernel (tests/kernel_harness.py through test_kernel.kernel); the ones "elsewhere" run
through a small launcher script that puts them in their namespace. These need root (CI runs as root); where a
facility is missing the test is skipped with what is missing. No assertion on elapsed time: waits are bounded
only to turn a hang into a failure.
"""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from test_kernel import execute, kernel

pytest.importorskip("jupyter_client")

from gpucleanup.protocol import discovery  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
GUARD = 120  # seconds: only there to turn a hang into a failure
SAME_PID = 30000  # the pid both containers' kernels get (as in the issue)
HOST_B_BOOT = "11111111-2222-4333-8444-555555555555"
HOST_B_MACHINE = "0123456789abcdef0123456789abcdef"
SCENARIO = json.dumps({"devices": [{"primary_active": True}]})


def _env(runtime: Path) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "ipython_ext"), env.get("PYTHONPATH")]))
    env["JUPYTER_RUNTIME_DIR"] = str(runtime)
    return env


def _ps(runtime: Path, *more: str) -> subprocess.CompletedProcess:
    """``gpucleanup ps --json`` (or the command given) here, on host A."""
    return _run([sys.executable, "-m", "gpucleanup.outside.cli", *(more or ("ps", "--json"))], env=_env(runtime))


def _run(argv, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, timeout=GUARD, **kw)


def _probe(argv, what: str) -> None:
    """Skips the test, saying what is missing, unless ``argv`` runs here."""
    try:
        probe = _run(argv)
    except FileNotFoundError as exc:
        pytest.skip(f"{exc.filename} is not installed: {what} needs it")
    if probe.returncode != 0:
        pytest.skip(f"{what} is not possible here ({' '.join(argv[:6])} ...: {probe.stderr.strip()[:200]})")


def _launcher(path: Path, script: str) -> str:
    """A file Kernel(python=...) runs as its interpreter: ``script`` with this Python as ``$0``."""
    path.write_text(f"#!/bin/sh\nexec {script} {sys.executable} \"$@\"\n")
    path.chmod(0o755)
    return str(path)


# ---------------------------------------------------------------- host B


def _machine_id_file() -> str:
    for name in discovery.MACHINE_ID_FILES:
        if os.path.isfile(name):
            return name
    pytest.skip("this machine has no machine id (/etc/machine-id, /var/lib/dbus/machine-id) to stand another over")


def _host_b(tmp_path: Path, boot_id: str = HOST_B_BOOT, another_machine: bool = True) -> str:
    """The shell prefix of a command that runs on "host B": its own boot id, and (``another_machine``) its own
    machine id and host name; without, this machine after a reboot."""
    boot, machine = tmp_path / "boot_id", tmp_path / "machine-id"
    boot.write_text(boot_id + "\n")
    machine.write_text(HOST_B_MACHINE + "\n")
    steps = [f"mount --bind {boot} /proc/sys/kernel/random/boot_id"]
    if another_machine:
        steps += [f"mount --bind {machine} {_machine_id_file()}", "hostname hostb"]
    inner = " && ".join([*steps, 'exec "$0" "$@"'])
    prefix = f"unshare --mount --uts --propagation private sh -c '{inner}'"
    _probe(["sh", "-c", f"{prefix} sh -c 'cat /proc/sys/kernel/random/boot_id; hostname'"],
           "a second machine (unshare --mount --uts, mount --bind over boot_id and machine-id)")
    seen = _run(["sh", "-c", f"{prefix} cat /proc/sys/kernel/random/boot_id"]).stdout.strip()
    assert seen == boot_id
    return prefix


def _on_host_b(prefix: str, runtime: Path, *argv: str) -> subprocess.CompletedProcess:
    quoted = " ".join(f"'{a}'" for a in argv)
    return _run(["sh", "-c", f"{prefix} {quoted}"], env=_env(runtime))


def _files(runtime: Path, loaded: dict) -> list:
    """A loaded kernel's discovery file, key and two sockets, named from its instance (the sockets in a private
    temporary directory where the runtime directory is too deep for a socket path)."""
    info, instance = loaded["info"], loaded["instance"]
    files = [runtime / f"gpucleanup-{instance}.json", Path(info["key_file"]),
             Path(info["endpoint"][len("ipc://"):]), Path(info["pub_endpoint"][len("ipc://"):])]
    assert files[1] == runtime / "gpucleanup" / f"{instance}.key"
    assert files[2].name in (f"{instance}.sock", f"{loaded['pid']}.sock") and files[3].name == files[2].name + ".pub"
    return files


def _identity(paths) -> list:
    return [(os.lstat(p).st_dev, os.lstat(p).st_ino) for p in paths]


def _loaded(kc) -> dict:
    """Loads gpucleanup in kernel ``kc``; what its endpoint wrote: pid, instance, discovery record."""
    execute(kc, "%load_ext gpucleanup")
    out = execute(kc, "import os, json; from gpucleanup.in_kernel import extension as _e\n"
                      "_ep = _e._instances[get_ipython()]._endpoint\n"
                      "print(json.dumps({'pid': os.getpid(), 'instance': _ep.instance, 'info': _ep.info}))")
    assert out["error"] is None, out["error"]
    return json.loads(out["stdout"])


def test_host_b_keeps_and_lists_host_a_live_kernel(tmp_path):
    prefix = _host_b(tmp_path)
    runtime = tmp_path / "runtime"
    with kernel(tmp_path, GPUCLEANUP_FAKE_CUDA_SCENARIO=SCENARIO) as a:
        mine = _loaded(a)
        files = _files(runtime, mine)
        assert all(os.path.lexists(p) for p in files)
        before = _identity(files)
        assert mine["info"]["machine_id"] == discovery.machine_id()

        # host B's ps: host A's kernel listed as on another machine, not asked, nothing removed
        seen = _on_host_b(prefix, runtime, sys.executable, "-m", "gpucleanup.outside.cli", "ps", "--json")
        assert seen.returncode == 0, seen.stderr
        (entry,) = json.loads(seen.stdout)
        assert (entry["pid"], entry["elsewhere"], entry["place"], entry["host"]) == (
            mine["pid"], True, "machine", discovery.host_name())
        assert entry["elsewhere_reason"] == f"on another machine, host {discovery.host_name()}"
        assert "status" not in entry and "error" not in entry
        table = _on_host_b(prefix, runtime, sys.executable, "-m", "gpucleanup.outside.cli", "ps")
        assert table.returncode == 0, table.stderr
        assert f"elsewhere (on another machine, host {discovery.host_name()})" in table.stdout
        # a Prometheus scrape on host B: counted as elsewhere, not asked, nothing removed
        if __import__("importlib").util.find_spec("prometheus_client") is not None:
            scrape = _on_host_b(prefix, runtime, sys.executable, "-c",
                                "from prometheus_client import generate_latest; from gpucleanup.outside import metrics; "
                                "print(generate_latest(metrics.make_registry()).decode())")
            assert scrape.returncode == 0, scrape.stderr
            assert "\ngpucleanup_kernels 0.0\n" in scrape.stdout and "\ngpucleanup_kernels_elsewhere 1.0\n" in scrape.stdout
            assert _identity(files) == before
        # drain, park or status from host B: refused, saying where to ask
        for command in ("status", "drain", "park"):
            refused = _on_host_b(prefix, runtime, sys.executable, "-m", "gpucleanup.outside.cli", command, str(mine["pid"]))
            assert (refused.returncode, refused.stdout) == (1, ""), refused
            assert refused.stderr == (
                f"gpucleanup: kernel {mine['pid']} is elsewhere (on another machine, host {discovery.host_name()}): "
                f"its pid means nothing here; run gpucleanup on host {discovery.host_name()}\n")
        assert _identity(files) == before

        # a kernel loading gpucleanup on host B (the load-time sweep), and its own ps
        launcher = _launcher(tmp_path / "host-b-python", prefix)
        with kernel(tmp_path, python=launcher, GPUCLEANUP_FAKE_CUDA_SCENARIO=SCENARIO) as b:
            theirs = _loaded(b)
            assert theirs["info"]["boot_id"] == HOST_B_BOOT and theirs["info"]["host"] == "hostb"
            inside = execute(b, "import subprocess, sys, json\n"
                                "r = subprocess.run([sys.executable, '-m', 'gpucleanup.outside.cli', 'ps', '--json'], "
                                "capture_output=True, text=True, timeout=60)\n"
                                "print(json.dumps([[e['pid'], e['elsewhere'], e.get('place'), 'status' in e] "
                                "for e in json.loads(r.stdout)]))")
            assert inside["error"] is None, inside["error"]
            assert sorted(json.loads(inside["stdout"])) == sorted(
                [[mine["pid"], True, "machine", False], [theirs["pid"], False, None, True]])
            assert _identity(files) == before

            # host A's ps: its own kernel live and answering, host B's listed as on another machine
            here = _ps(runtime)
            assert here.returncode == 0, here.stderr
            entries = {e["discovery_file"]: e for e in json.loads(here.stdout)}
            ours = entries[str(files[0])]
            assert ours["elsewhere"] is False and ours["status"]["kernel"]["pid"] == mine["pid"]
            other = entries[str(runtime / f"gpucleanup-{theirs['instance']}.json")]
            assert (other["elsewhere"], other["place"], other["host"]) == (True, "machine", "hostb")
            assert _identity(files) == before
        assert _identity(files) == before
        status = _ps(runtime, "status", str(mine["pid"]))
        assert status.returncode == 0, status.stderr


def test_an_earlier_boot_of_this_machine_is_still_swept(tmp_path):
    # the other half of the rule: the same machine id and host name, another boot id, is provably stale
    rebooted = _host_b(tmp_path, boot_id=str(uuid.uuid4()), another_machine=False)
    runtime = tmp_path / "runtime"
    with kernel(tmp_path, GPUCLEANUP_FAKE_CUDA_SCENARIO=SCENARIO) as a:
        mine = _loaded(a)
        files = _files(runtime, mine)
    # ended by the harness with SIGKILL (as by a power cut): its files stay
    assert all(os.path.lexists(p) for p in files)
    seen = _on_host_b(rebooted, runtime, sys.executable, "-m", "gpucleanup.outside.cli", "ps", "--json")
    assert (seen.returncode, seen.stdout) == (0, "[]\n"), seen.stderr
    assert [p for p in files if os.path.lexists(p)] == []


# ---------------------------------------------------------------- two PID namespaces, one pid


def _same_pid_launcher(tmp_path: Path, name: str) -> str:
    # The namespace's first process writes ns_last_pid, then starts the kernel (a fork: the pid asked for; not
    # the last command, so that no shell runs it by exec as pid 1). Its parent is that process, pid 1 in there:
    # ipykernel would take that for its launcher's exit (JPY_PARENT_PID names the launcher, outside), so it is
    # not told, as a kernel a server in the container starts is not.
    inner = (f"echo {SAME_PID - 1} > /proc/sys/kernel/ns_last_pid && unset JPY_PARENT_PID && \"$0\" \"$@\"; "
             "exit $?")
    return _launcher(tmp_path / name, f"unshare --pid --fork --kill-child --mount-proc sh -c '{inner}'")


def _outer_pid(inner: int, ns: str) -> int:
    """The pid, in this namespace, of process ``inner`` of PID namespace ``ns``."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            if os.readlink(f"/proc/{entry}/ns/pid") != ns:
                continue
            for line in open(f"/proc/{entry}/status"):
                if line.startswith("NSpid:") and line.split()[-1] == str(inner):
                    return int(entry)
        except OSError:
            continue
    raise AssertionError(f"no process {inner} in {ns}")


def _wait_gone(pid: int) -> None:
    deadline = time.monotonic() + GUARD
    while time.monotonic() < deadline:
        try:
            state = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
        except OSError:
            return
        if state in ("Z", "X"):
            return
        time.sleep(0.05)
    raise AssertionError(f"process {pid} still runs after SIGTERM")


def test_two_containers_with_the_same_pid_keep_their_own_files(tmp_path):
    _probe(["unshare", "--pid", "--fork", "--kill-child", "--mount-proc", "sh", "-c",
            f"echo {SAME_PID - 1} > /proc/sys/kernel/ns_last_pid && sh -c 'test $$ = {SAME_PID}'; exit $?"],
           "two PID namespaces with the same pid (unshare --pid --mount-proc, writing ns_last_pid)")
    runtime = tmp_path / "runtime"
    one_python, two_python = _same_pid_launcher(tmp_path, "one"), _same_pid_launcher(tmp_path, "two")
    with kernel(tmp_path, python=one_python, GPUCLEANUP_FAKE_CUDA_SCENARIO=SCENARIO) as one:
        first = _loaded(one)
        assert first["pid"] == SAME_PID
        first_files = _files(runtime, first)
        kept = _identity(first_files)
        key = first_files[1].read_bytes()

        with kernel(tmp_path, python=two_python, GPUCLEANUP_FAKE_CUDA_SCENARIO=SCENARIO) as two:
            second = _loaded(two)
            assert second["pid"] == SAME_PID and second["info"]["pid_ns"] != first["info"]["pid_ns"]
            assert second["instance"] != first["instance"]
            second_files = _files(runtime, second)
            assert all(os.path.lexists(p) for p in first_files + second_files)
            assert _identity(first_files) == kept and first_files[1].read_bytes() == key
            # the host's ps lists both, each in its PID namespace
            here = _ps(runtime)
            assert sorted((e["pid"], e["place"]) for e in json.loads(here.stdout)) == [
                (SAME_PID, "namespace"), (SAME_PID, "namespace")]

            # the second one's unload removes its own files only
            execute(two, "%unload_ext gpucleanup")
            assert [p for p in second_files if os.path.lexists(p)] == []
            assert _identity(first_files) == kept and first_files[1].read_bytes() == key

            # loaded again, then ended by SIGTERM: its own files go, the first one's stay
            again = _loaded(two)
            again_files = _files(runtime, again)
            assert all(os.path.lexists(p) for p in again_files)
            outer = _outer_pid(SAME_PID, again["info"]["pid_ns"])
            os.kill(outer, signal.SIGTERM)
            _wait_gone(outer)
            assert [p for p in again_files if os.path.lexists(p)] == []
            assert _identity(first_files) == kept and first_files[1].read_bytes() == key

        # the first kernel still finds itself, live and answering, from its own namespace
        inside = execute(one, "import subprocess, sys, json\n"
                              "r = subprocess.run([sys.executable, '-m', 'gpucleanup.outside.cli', 'ps', '--json'], "
                              "capture_output=True, text=True, timeout=60)\n"
                              "print(json.dumps([[e['pid'], e['elsewhere'], e['status']['kernel']['pid']] "
                              "for e in json.loads(r.stdout)]))")
        assert inside["error"] is None, inside["error"]
        assert json.loads(inside["stdout"]) == [[SAME_PID, False, SAME_PID]]


# ---------------------------------------------------------------- a file replaced by someone else's


def _replace(path: Path, content: bytes) -> tuple:
    """Someone else's file put at ``path`` (a new inode, renamed over it, as any writer does)."""
    other = path.with_name(path.name + ".other")
    other.write_bytes(content)
    os.chmod(other, 0o600)
    os.replace(other, path)
    return (os.lstat(path).st_dev, os.lstat(path).st_ino)


def test_a_kernel_leaves_alone_a_file_someone_put_in_place_of_its_own(tmp_path):
    runtime = tmp_path / "runtime"
    with kernel(tmp_path, GPUCLEANUP_FAKE_CUDA_SCENARIO=SCENARIO) as kc:
        # at unload
        mine = _loaded(kc)
        record, key, sock, pub = _files(runtime, mine)
        theirs = {record: b'{"someone": "else"}\n', key: b"f" * 64}
        replaced = {path: _replace(path, content) for path, content in theirs.items()}
        execute(kc, "%unload_ext gpucleanup")
        for path, content in theirs.items():
            assert path.read_bytes() == content
            assert (os.lstat(path).st_dev, os.lstat(path).st_ino) == replaced[path]
        assert not os.path.lexists(sock) and not os.path.lexists(pub)

        # on SIGTERM (the native handler)
        mine = _loaded(kc)
        record, key, sock, pub = _files(runtime, mine)
        theirs = {record: b'{"someone": "else", "again": 1}\n', key: b"e" * 64}
        for path, content in theirs.items():
            _replace(path, content)
        os.kill(mine["pid"], signal.SIGTERM)
        _wait_gone(mine["pid"])
        for path, content in theirs.items():
            assert path.read_bytes() == content
        assert not os.path.lexists(sock) and not os.path.lexists(pub)  # its own sockets still went


# ---------------------------------------------------------------- loopback TCP from another network namespace


def test_a_tcp_kernel_is_not_asked_from_another_network_namespace(tmp_path):
    # A container with the host's PID namespace and a network of its own (a monitoring container run with
    # --pid=host) judges the kernel's pid as its own, but 127.0.0.1 there is another host: whatever listens on
    # the kernel's port in that namespace would be sent the request. It is listed, never asked.
    _probe(["unshare", "--net", "true"], "another network namespace (unshare --net)")
    runtime = tmp_path / "runtime"
    with kernel(tmp_path, GPUCLEANUP_FAKE_CUDA_SCENARIO=SCENARIO, GPUCLEANUP_STATUS_TRANSPORT="tcp") as kc:
        mine = _loaded(kc)
        assert mine["info"]["transport"] == "tcp" and mine["info"]["endpoint"].startswith("tcp://127.0.0.1:")
        seen = _run(["unshare", "--net", sys.executable, "-m", "gpucleanup.outside.cli", "ps", "--json"], env=_env(runtime))
        assert seen.returncode == 0, seen.stderr
        (entry,) = json.loads(seen.stdout)
        assert (entry["pid"], entry["elsewhere"], entry["place"]) == (mine["pid"], True, "namespace")
        assert entry["elsewhere_reason"].startswith("another network namespace, net:[")
        assert "status" not in entry and "error" not in entry
        assert os.path.exists(runtime / f"gpucleanup-{mine['instance']}.json")
        # from its own network namespace it is asked as always
        (here,) = json.loads(_ps(runtime).stdout)
        assert here["elsewhere"] is False and here["status"]["kernel"]["pid"] == mine["pid"]
    # once it is gone, a reader in another network namespace proves it stale like any other
    gone = _run(["unshare", "--net", sys.executable, "-m", "gpucleanup.outside.cli", "ps", "--json"], env=_env(runtime))
    assert (gone.returncode, gone.stdout) == (0, "[]\n"), gone.stderr
    assert not os.path.exists(runtime / f"gpucleanup-{mine['instance']}.json")
