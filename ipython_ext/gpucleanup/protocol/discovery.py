"""Discovery files: how the ``gpucleanup`` command, the exporter and the server find every kernel on the machine.

Each kernel with the extension loaded writes one (:func:`describe`, :func:`write`); a reader judges every file it
finds as live, stale or elsewhere (:func:`classify`) and reads it as untrusted input (:func:`scan`). The format,
the names derived from a file's instance, and the rules for judging, reading and removing are share/protocol.md,
"Finding a kernel"; a kernel judged elsewhere is never asked nor touched.
"""

from __future__ import annotations

import errno
import json
import os
import re
import secrets
import socket
import stat
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, List, NamedTuple, Optional, Tuple

DISCOVERY_VERSION = 1
PREFIX = "gpucleanup-"
SUFFIX = ".json"
KEY_DIR = "gpucleanup"
# ASCII digits only (\d takes any Unicode digit), no leading zero, whole name; the instance's random part is
# absent from the names gpucleanup 0.1 wrote (pid only).
_NAME = re.compile(r"gpucleanup-(([1-9][0-9]{0,19})(?:-[0-9a-f]{8})?)\.json", re.ASCII)
_INSTANCE = re.compile(r"[1-9][0-9]{0,19}(?:-[0-9a-f]{8})?", re.ASCII)
_KERNEL_FILE = re.compile(r"^kernel-(.+)\.json$")

# PID_MAX_LIMIT on 64-bit Linux: pid_max can never be raised above it.
PID_LIMIT = 1 << 22
# Largest discovery or key file that is read at all.
MAX_FILE_BYTES = 64 * 1024

LIVE = "live"
STALE = "stale"
ELSEWHERE = "elsewhere"

UNKNOWN_THEIR_NS = "PID namespace unknown (its file records none): its pid cannot be judged here"
UNKNOWN_OWN_NS = "this process's PID namespace is unknown (/proc unreadable here): no pid can be judged"
UNKNOWN_OWN_BOOT = "this machine's boot id is unknown (/proc unreadable here): no file can be judged"

#: Kernel.place: where a kernel that is not judged here runs
ON_ANOTHER_MACHINE = "machine"
IN_ANOTHER_NAMESPACE = "namespace"
PLACE_UNKNOWN = "unknown"

_PID_NS = re.compile(r"pid:\[[0-9]{1,20}\]", re.ASCII)
_NET_NS = re.compile(r"net:\[[0-9]{1,20}\]", re.ASCII)
_MACHINE_ID = re.compile(r"[0-9a-f]{32}", re.ASCII)
# systemd's machine-id(5), then D-Bus's older copy (the same value where both exist)
MACHINE_ID_FILES = ("/etc/machine-id", "/var/lib/dbus/machine-id")
_BOOT_ID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}", re.ASCII)
_TCP = re.compile(r"tcp://(127\.0\.0\.1|\[::1\]):([0-9]{1,5})", re.ASCII)
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")


class BadDiscoveryFile(ValueError):
    """A discovery file that is not one gpucleanup wrote: the message says why, in a few words."""


class UnsafeFile(OSError):
    """A path that is not a regular file of bounded size (a FIFO, a device, a link, too large)."""

    def __init__(self, why: str):
        super().__init__(errno.EINVAL, why)


class InsecureRuntimeDir(PermissionError):
    """A runtime directory every user may write to: gpucleanup puts nothing there."""


# ------------------------------------------------------------------ places


def runtime_dir() -> Path:
    """Jupyter's runtime directory (``$JUPYTER_RUNTIME_DIR`` or the data dir's ``runtime``)."""
    try:
        from jupyter_core.paths import jupyter_runtime_dir
    except ImportError:  # jupyter_core is absent outside Jupyter installs
        if os.environ.get("JUPYTER_RUNTIME_DIR"):
            return Path(os.environ["JUPYTER_RUNTIME_DIR"])
        data = os.environ.get("JUPYTER_DATA_DIR") or os.path.join(
            os.environ.get("XDG_DATA_HOME") or os.path.expanduser("~/.local/share"), "jupyter"
        )
        return Path(data) / "runtime"
    return Path(jupyter_runtime_dir())


def check_runtime_dir(path: Path) -> None:
    """Raises :class:`InsecureRuntimeDir` if every user may write to ``path``.

    The sticky bit is not enough: it stops others from removing or renaming
    our files, but not from creating the names we are about to use (a FIFO,
    a symbolic link, a ``gpucleanup`` directory of theirs), nor from planting
    discovery files that ``gpucleanup ps`` would read. Jupyter creates its
    runtime directory 0700 for the same reason.
    """
    _refuse_open_dir(path, os.stat(path))  # the runtime dir itself may be a link the user made


def _refuse_open_dir(path: Path, info: os.stat_result) -> None:
    if info.st_mode & stat.S_IWOTH:
        raise InsecureRuntimeDir(
            f"runtime directory {path} is writable by every user (mode {stat.S_IMODE(info.st_mode):o}): "
            "gpucleanup writes no discovery file, key or socket there; set JUPYTER_RUNTIME_DIR to a private "
            "directory (yours, mode 0700)"
        )


def prepare_runtime_dir(path: Path) -> Path:
    """Creates the runtime directory (0700) if needed; refuses one that every user may write to, and a
    relative one (it would mean another directory for every working directory, and no socket path)."""
    if not Path(path).is_absolute():
        raise ValueError(
            f"runtime directory {str(path)[:200]!r} is not an absolute path: gpucleanup writes no discovery file, "
            "key or socket there; set JUPYTER_RUNTIME_DIR to the absolute path of a private directory (yours, mode 0700)"
        )
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    check_runtime_dir(path)
    return path


def ensure_private_dir(path: Path) -> Path:
    """Creates ``path`` so that only the user can enter it (0700).

    An existing directory of ours is narrowed to 0700, through a descriptor
    opened with ``O_NOFOLLOW`` (never through a symbolic link); a symbolic
    link, a non-directory, or a directory owned by someone else raises
    PermissionError and is left as it is.
    """
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    info = os.lstat(path)
    if stat.S_ISLNK(info.st_mode):
        raise PermissionError(
            f"{path} is a symbolic link: gpucleanup keeps its keys and sockets only in a directory of its own; "
            "remove the link"
        )
    if not stat.S_ISDIR(info.st_mode):
        raise PermissionError(f"{path} is not a directory: remove it, gpucleanup keeps its keys and sockets there")
    if info.st_uid != os.geteuid():
        raise PermissionError(f"{path} belongs to uid {info.st_uid}, not to you: use a directory of your own")
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        now = os.fstat(fd)
        if (now.st_dev, now.st_ino) != (info.st_dev, info.st_ino):
            raise PermissionError(f"{path} was replaced while gpucleanup checked it")
        if stat.S_IMODE(now.st_mode) & 0o077:
            os.fchmod(fd, 0o700)
    finally:
        os.close(fd)
    return path


def new_instance(pid: Optional[int] = None) -> str:
    """A name no other kernel has, whatever its machine or PID namespace: ``<pid>-<8 random hex digits>``."""
    return f"{pid if pid is not None else os.getpid()}-{secrets.token_hex(4)}"


def discovery_path(pid=None, directory: Optional[Path] = None) -> Path:
    """``<directory>/gpucleanup-<instance>.json``; ``pid`` is an instance (:func:`new_instance`) or, for the
    names of gpucleanup 0.1, a pid (None: this process's pid)."""
    return (directory or runtime_dir()) / f"{PREFIX}{pid if pid is not None else os.getpid()}{SUFFIX}"


def path_for_pid(pid: int, directory: Optional[Path] = None) -> Path:
    """The discovery file of the kernel with ``pid`` in ``directory``: its ``gpucleanup-<pid>-<id>.json`` (the
    most recently changed where kernels of several PID namespaces share the pid), else the name gpucleanup 0.1
    gave it, ``gpucleanup-<pid>.json``, which may not exist. For tools and tests that know a pid; readers that
    judge files use :func:`scan`."""
    directory = Path(directory) if directory is not None else runtime_dir()
    found = []
    try:
        with os.scandir(directory) as entries:
            for entry in entries:
                match = _NAME.fullmatch(entry.name)
                if match and match.group(2) == str(pid) and "-" in match.group(1):
                    try:
                        found.append((entry.stat(follow_symlinks=False).st_mtime_ns, entry.name))
                    except OSError:
                        continue
    except OSError:
        pass
    return directory / (max(found)[1] if found else f"{PREFIX}{int(pid)}{SUFFIX}")


def instance_of(path) -> Optional[str]:
    """The instance a discovery file's name carries (``<pid>-<id>``, or ``<pid>`` for an old name), or None."""
    match = _NAME.fullmatch(os.path.basename(os.fspath(path)))
    return match.group(1) if match else None


def scheme_files(instance) -> Tuple[Tuple[str, int], ...]:
    """The names in ``<runtime>/gpucleanup/`` that the kernel of ``instance`` (or, named the old way, of a
    pid) makes, with their file type."""
    return ((f"{instance}.key", stat.S_IFREG), (f"{instance}.sock", stat.S_IFSOCK),
            (f"{instance}.sock.pub", stat.S_IFSOCK))


# ------------------------------------------------------------------ this process


def _stat_fields(pid: int) -> Optional[list]:
    """Fields 3 onwards of ``/proc/<pid>/stat`` (state first), or None."""
    try:
        with open(f"/proc/{int(pid)}/stat", "rb") as f:
            stat_line = f.read(4096).decode("ascii", "replace")
    except (OSError, ValueError, OverflowError):
        return None
    # The command name (field 2) may hold spaces and parentheses: split after the last ')'.
    return stat_line[stat_line.rfind(")") + 2 :].split()


def process_start_ticks(pid: int) -> Optional[int]:
    """The process's start time in clock ticks since boot (``/proc/<pid>/stat`` field 22), or None."""
    fields = _stat_fields(pid)
    try:
        return int(fields[19]) if fields else None
    except (IndexError, ValueError):
        return None


def pid_namespace() -> Optional[str]:
    """This process's PID namespace, ``pid:[<inode>]`` (``readlink /proc/self/ns/pid``), or None."""
    try:
        value = os.readlink("/proc/self/ns/pid")
    except OSError:
        return None
    return value if _PID_NS.fullmatch(value) else None


def net_namespace() -> Optional[str]:
    """This process's network namespace, ``net:[<inode>]`` (``readlink /proc/self/ns/net``), or None. A kernel on
    loopback TCP is reachable only from its own network namespace: 127.0.0.1 elsewhere is another host's."""
    try:
        value = os.readlink("/proc/self/ns/net")
    except OSError:
        return None
    return value if _NET_NS.fullmatch(value) else None


def boot_id() -> Optional[str]:
    """The running Linux kernel's boot id (``/proc/sys/kernel/random/boot_id``), the same in every container."""
    try:
        with open("/proc/sys/kernel/random/boot_id", "rb") as f:
            value = f.read(64).decode("ascii", "replace").strip()
    except OSError:
        return None
    return value if _BOOT_ID.fullmatch(value) else None


def machine_id() -> Optional[str]:
    """This machine's id (machine-id(5): 32 hex digits, set once at installation), or None where none is set.

    It tells machines apart across boots, where the boot id cannot: a file written during another boot was
    written on another machine, or during an earlier boot of this one, and only this id tells which. A
    container may carry its image's id or none: it is never the only fact a file is judged on (see
    :func:`classify`)."""
    for name in MACHINE_ID_FILES:
        try:
            with open(name, "rb") as f:
                value = f.read(64).decode("ascii", "replace").strip()
        except OSError:
            continue
        if _MACHINE_ID.fullmatch(value):
            return value
    return None


def host_name() -> Optional[str]:
    """This machine's host name (``uname -n``), or None."""
    try:
        value = os.uname().nodename
    except (AttributeError, OSError):
        return None
    return value if value and len(value) <= 255 and not _CONTROL.search(value) else None


def kernel_id_from_connection_file(path: Optional[str]) -> Optional[str]:
    """``kernel-<id>.json`` -> ``<id>`` (Jupyter Server names them so); else the file's stem."""
    if not path:
        return None
    name = os.path.basename(path)
    match = _KERNEL_FILE.match(name)
    return match.group(1) if match else os.path.splitext(name)[0]


def own_connection_file() -> Optional[str]:
    """The connection file of the kernel this process runs, or None outside a kernel."""
    try:
        from ipykernel.connect import get_connection_file

        return get_connection_file()
    except Exception:  # not in a kernel, or ipykernel absent
        return None


def describe(
    *,
    endpoint: str,
    pub_endpoint: str,
    key_file: Optional[str],
    transport: str,
    connection_file: Optional[str] = None,
    notebook: Optional[str] = None,
    started_ns: Optional[int] = None,
    version: Optional[str] = None,
    instance: Optional[str] = None,
    notebook_root: Optional[str] = None,
) -> dict:
    """The discovery record of this process (``instance``: the one in its file's name)."""
    pid = os.getpid()
    return {
        "discovery": DISCOVERY_VERSION,
        "instance": instance,
        "pid": pid,
        "proc_start_ticks": process_start_ticks(pid),
        "pid_ns": pid_namespace(),
        "net_ns": net_namespace(),
        "boot_id": boot_id(),
        "machine_id": machine_id(),
        "host": host_name(),
        "kernel_id": kernel_id_from_connection_file(connection_file),
        "connection_file": connection_file,
        "notebook": notebook,
        "notebook_root": notebook_root,
        "endpoint": endpoint,
        "pub_endpoint": pub_endpoint,
        "transport": transport,
        "key_file": key_file,
        "signature_scheme": "hmac-sha256",
        "protocol": 1,
        "started_ns": started_ns if started_ns is not None else time.time_ns(),
        "version": version,
    }


# ------------------------------------------------------------------ writing


def _temp_name(name: str) -> str:
    # Unpredictable, so that nobody can plant something there first; O_EXCL refuses it anyway.
    return f"{name}.{os.getpid()}.{secrets.token_hex(8)}.tmp"


def write_private(path: Path, data: bytes, mode: int = 0o600) -> os.stat_result:
    """Writes ``data`` to ``path`` atomically with ``mode``, never through a link, never leaving a temp file.

    The bytes go to a new temporary name in the same directory, created with
    ``O_CREAT | O_EXCL | O_NOFOLLOW`` (so nothing planted there is opened),
    which then replaces ``path`` (``rename`` replaces a link, it never
    follows it). On any failure (a full disk included) the temporary file is
    removed and the error raised; ``path`` keeps its old content. A directory
    every user may write to is refused (:func:`check_runtime_dir`). Returns the written file's ``fstat``:
    its device and inode are what tells this file from one someone else put at ``path`` later.
    """
    path = Path(path)
    directory = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        _refuse_open_dir(path.parent, os.fstat(directory))
        tmp = _temp_name(path.name)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode, dir_fd=directory)
        try:
            try:
                os.fchmod(fd, mode)  # the umask may have narrowed it; never wider than asked
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view) :]
                written = os.fstat(fd)
            finally:
                os.close(fd)
            os.replace(tmp, path.name, src_dir_fd=directory, dst_dir_fd=directory)
            return written
        except BaseException:
            try:
                os.unlink(tmp, dir_fd=directory)
            except OSError:
                pass
            raise
    finally:
        os.close(directory)


def write(path: Path, info: dict) -> os.stat_result:
    """Writes the discovery record ``info`` to ``path`` (mode 0600, atomically: readers never see half a file).

    The writer's PID namespace, boot id, machine id and host name are recorded
    when ``info`` does not carry them, so that a reader elsewhere can tell the
    file is not its own. Returns the written file's ``fstat`` (:func:`remove_own`).
    """
    record = dict(info)
    for key, read_own in (("pid_ns", pid_namespace), ("net_ns", net_namespace), ("boot_id", boot_id),
                          ("machine_id", machine_id), ("host", host_name)):
        if key not in record:
            record[key] = read_own()
    return write_private(Path(path), (json.dumps(record, indent=1, sort_keys=True) + "\n").encode("utf-8"))


def file_identity(info: os.stat_result) -> Tuple[int, int]:
    """``(st_dev, st_ino)``: what tells a file from another put at the same name later."""
    return (info.st_dev, info.st_ino)


def remove_own(path: Path, identity: Optional[Tuple[int, int]]) -> bool:
    """Removes ``path`` only if it is still the file whose :func:`file_identity` is ``identity`` (the file
    this process wrote), never one someone else put at that name since; True when removed. Raises nothing
    for a path that is gone or replaced; other OSErrors are raised."""
    if identity is None:
        return False
    try:
        if file_identity(os.lstat(path)) != tuple(identity):
            return False
        os.unlink(path)
        return True
    except FileNotFoundError:
        return False


def remove(path: Path) -> bool:
    try:
        path.unlink()
        return True
    except FileNotFoundError:
        return False


# ------------------------------------------------------------------ reading


_FILE_TYPES = (
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISLNK, "a symbolic link"),
)


def _kind(mode: int) -> str:
    for test, words in _FILE_TYPES:
        if test(mode):
            return words
    return "not a regular file"


def _check_regular(info: os.stat_result, owners: Optional[Iterable[int]]) -> None:
    if stat.S_ISLNK(info.st_mode):
        raise UnsafeFile("a symbolic link")
    if not stat.S_ISREG(info.st_mode):
        raise UnsafeFile(f"not a regular file ({_kind(info.st_mode)})")
    if info.st_size > MAX_FILE_BYTES:
        raise UnsafeFile(f"larger than {MAX_FILE_BYTES} bytes ({info.st_size})")
    if owners is not None and info.st_uid not in owners:
        raise UnsafeFile(f"owned by uid {info.st_uid}, not by you")


def read_bounded(path, dir_fd: Optional[int] = None, owners: Optional[Iterable[int]] = None) -> Tuple[bytes, os.stat_result]:
    """The bytes of a regular file of at most 64 KiB, and its ``fstat``; :class:`UnsafeFile` otherwise.

    Nothing but a regular file is opened: ``lstat`` first, then ``open`` with
    ``O_NOFOLLOW | O_NONBLOCK`` (a FIFO swapped in meanwhile cannot block) and
    ``fstat`` on the descriptor. ``owners``: the uids the file may belong to.
    """
    owners = tuple(owners) if owners is not None else None
    _check_regular(os.lstat(path, dir_fd=dir_fd), owners)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise UnsafeFile("a symbolic link") from None
        raise
    try:
        info = os.fstat(fd)
        _check_regular(info, owners)
        chunks, size = [], 0
        while size <= MAX_FILE_BYTES:
            chunk = os.read(fd, MAX_FILE_BYTES + 1 - size)
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
        if size > MAX_FILE_BYTES:
            raise UnsafeFile(f"larger than {MAX_FILE_BYTES} bytes")
        return b"".join(chunks), info
    finally:
        os.close(fd)


def _show(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _type_name(value) -> str:
    return "null" if value is None else type(value).__name__


def _string(info: dict, key: str, required: bool = False) -> Optional[str]:
    value = info.get(key)
    if value is None and not required:
        return None
    if not isinstance(value, str):
        raise BadDiscoveryFile(f"{key} must be a string{'' if required else ' or null'}, got {_type_name(value)} {_show(value)}")
    if len(value) > 4096 or "\x00" in value:
        raise BadDiscoveryFile(f"{key} is not a plausible value: {_show(value)}")
    return value


def _integer(info: dict, key: str, low: int, high: int, nullable: bool) -> Optional[int]:
    value = info.get(key)
    if value is None and nullable:
        return None
    if not isinstance(value, int) or isinstance(value, bool):
        raise BadDiscoveryFile(f"{key} must be an integer{' or null' if nullable else ''}, got {_type_name(value)} {_show(value)}")
    if not low <= value <= high:
        raise BadDiscoveryFile(f"{key} {value} is out of range ({low} to {high})")
    return value


def _endpoint(info: dict, key: str) -> str:
    value = _string(info, key, required=True)
    if value.startswith("ipc://"):
        where = value[len("ipc://") :]
        if where.startswith("/") and not _CONTROL.search(where):
            return value
    else:
        match = _TCP.fullmatch(value)
        if match and 1 <= int(match.group(2)) <= 65535:
            return value
    raise BadDiscoveryFile(
        f"{key} {_show(value)} is not ipc://<absolute path>, tcp://127.0.0.1:<port> or tcp://[::1]:<port>"
    )


def validate(info, name_pid: Optional[int] = None, name_instance: Optional[str] = None) -> dict:
    """``info`` if it is a discovery record gpucleanup could have written; :class:`BadDiscoveryFile` otherwise.

    Types and ranges of every field this package reads are checked; fields
    it does not know are ignored (a newer writer may add some). ``name_pid`` and ``name_instance``: what the
    file's name says (an old name carries no instance; a new one must match the recorded ``instance``).
    """
    if not isinstance(info, dict):
        raise BadDiscoveryFile(f"not a JSON object but {_type_name(info)}")
    if info.get("discovery") != DISCOVERY_VERSION or isinstance(info.get("discovery"), bool):
        raise BadDiscoveryFile(f"discovery version {_show(info.get('discovery'))} is not {DISCOVERY_VERSION}")
    pid = _integer(info, "pid", 1, PID_LIMIT - 1, nullable=False)
    if name_pid is not None and pid != name_pid:
        raise BadDiscoveryFile(f"pid {pid} does not match the file name's pid {name_pid}")
    instance = _string(info, "instance")
    if instance is not None and not (_INSTANCE.fullmatch(instance) and instance.split("-")[0] == str(pid)):
        raise BadDiscoveryFile(f"instance {_show(instance)} is not <pid>-<8 hex digits> of pid {pid}")
    if name_instance is not None and "-" in name_instance and instance != name_instance:
        raise BadDiscoveryFile(f"instance {_show(instance)} does not match the file name's {name_instance}")
    _integer(info, "proc_start_ticks", 0, (1 << 63) - 1, nullable=True)
    _integer(info, "started_ns", 0, (1 << 63) - 1, nullable=True)
    _integer(info, "protocol", 1, 1, nullable=True)
    pid_ns = _string(info, "pid_ns")
    if pid_ns is not None and not _PID_NS.fullmatch(pid_ns):
        raise BadDiscoveryFile(f"pid_ns {_show(pid_ns)} is not pid:[<inode>]")
    net_ns = _string(info, "net_ns")
    if net_ns is not None and not _NET_NS.fullmatch(net_ns):
        raise BadDiscoveryFile(f"net_ns {_show(net_ns)} is not net:[<inode>]")
    boot = _string(info, "boot_id")
    if boot is not None and not _BOOT_ID.fullmatch(boot):
        raise BadDiscoveryFile(f"boot_id {_show(boot)} is not a boot id")
    machine = _string(info, "machine_id")
    if machine is not None and not _MACHINE_ID.fullmatch(machine):
        raise BadDiscoveryFile(f"machine_id {_show(machine)} is not 32 hex digits")
    host = _string(info, "host")
    if host is not None and (not host or len(host) > 255 or _CONTROL.search(host)):
        raise BadDiscoveryFile(f"host {_show(host)} is not a host name")
    for key in ("kernel_id", "connection_file", "notebook", "version"):
        _string(info, key)
    root = _string(info, "notebook_root")
    if root is not None and not root.startswith("/"):
        raise BadDiscoveryFile(f"notebook_root {_show(root)} is not an absolute path")
    transport = _string(info, "transport", required=True)
    if transport not in ("ipc", "tcp"):
        raise BadDiscoveryFile(f"transport {_show(transport)} is not 'ipc' or 'tcp'")
    _endpoint(info, "endpoint")
    _endpoint(info, "pub_endpoint")
    key_file = _string(info, "key_file")
    if key_file is not None and not key_file.startswith("/"):
        raise BadDiscoveryFile(f"key_file {_show(key_file)} is not an absolute path")
    if key_file is not None and not key_file.isprintable():  # never gpucleanup's: the park lock is named from it
        raise BadDiscoveryFile(f"key_file {_show(key_file)} holds control characters")
    scheme = info.get("signature_scheme")
    if scheme is not None and scheme != "hmac-sha256":
        raise BadDiscoveryFile(f"signature_scheme {_show(scheme)} is not 'hmac-sha256'")
    return info


def read(path: Path) -> Optional[dict]:
    """The validated record in ``path``, or None if it is not a discovery file gpucleanup could have written."""
    path = Path(path)
    match = _NAME.fullmatch(path.name)
    try:
        data, _info = read_bounded(path)
        return validate(json.loads(data.decode("utf-8")), int(match.group(2)) if match else None,
                        match.group(1) if match else None)
    except (OSError, ValueError):
        return None


# ------------------------------------------------------------------ liveness


def _pid_state(pid: int, recorded_ticks: Optional[int]) -> Tuple[str, str]:
    """Whether ``pid`` in this PID namespace is (still) the process that recorded ``recorded_ticks``."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return STALE, "its process is gone"
    except PermissionError:
        pass  # someone else's process holds the pid now; the start time decides
    except (OSError, OverflowError, ValueError) as exc:
        return ELSEWHERE, f"process {pid} cannot be checked here ({exc})"
    fields = _stat_fields(pid)
    if not fields:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return STALE, "its process is gone"
        except OSError:
            pass
        return ELSEWHERE, f"process {pid} cannot be inspected here (/proc/{pid}/stat unreadable)"
    if fields[0] in ("Z", "X"):
        return STALE, "its process has exited (a zombie)"
    if recorded_ticks is None:
        return LIVE, "running (no start time recorded)"
    try:
        now = int(fields[19])
    except (IndexError, ValueError):
        return ELSEWHERE, f"process {pid} cannot be inspected here (/proc/{pid}/stat unreadable)"
    if now != recorded_ticks:
        return STALE, f"pid {pid} now belongs to another process (started at tick {now}, not {recorded_ticks})"
    return LIVE, "running"


def _machine_of(info: dict) -> Tuple[Optional[str], Optional[str]]:
    machine, host = info.get("machine_id"), info.get("host")
    return (machine if isinstance(machine, str) else None, host if isinstance(host, str) else None)


def _another_boot(info: dict, theirs: str, own_machine: Tuple[Optional[str], Optional[str]]) -> Tuple[str, str, Optional[str]]:
    """A file written during another boot: stale only if written on this machine (an earlier boot of it)."""
    machine, host = _machine_of(info)
    if machine and host and all(own_machine):
        if (machine, host) == tuple(own_machine):
            return STALE, f"written during an earlier boot of this machine (boot id {theirs})", None
        return ELSEWHERE, _on_another_machine(machine, host), ON_ANOTHER_MACHINE
    if not all(own_machine):
        return ELSEWHERE, (f"written during another boot (boot id {theirs}), and this machine's id is unknown "
                           f"(no {' or '.join(MACHINE_ID_FILES)}): it may be another machine's"), PLACE_UNKNOWN
    return ELSEWHERE, (f"written during another boot (boot id {theirs}) on a machine it does not name (an older "
                       "gpucleanup): it may be another machine's"), PLACE_UNKNOWN


def _on_another_machine(machine: Optional[str], host: Optional[str]) -> str:
    if host:
        return f"on another machine, host {host}"
    return f"on another machine, machine id {machine}"


def _pid_and_ticks(info: dict) -> Optional[Tuple[int, Optional[int]]]:
    pid = info.get("pid")
    if not isinstance(pid, int) or isinstance(pid, bool) or not 0 < pid < PID_LIMIT:
        return None
    ticks = info.get("proc_start_ticks")
    return pid, ticks if isinstance(ticks, int) and not isinstance(ticks, bool) else None


def judge(info: dict, own_pid_ns: Optional[str] = None, own_boot_id: Optional[str] = None,
          own_machine: Optional[Tuple[Optional[str], Optional[str]]] = None,
          own_net_ns: Optional[str] = None) -> Tuple[str, str, Optional[str]]:
    """:func:`classify`'s ``(state, why)`` and, for ``elsewhere``, where (:attr:`Kernel.place`). A kernel of
    this PID namespace on loopback TCP in another network namespace (a container with the host's PID namespace
    and a network of its own) is judged by its pid, but, alive, is elsewhere: 127.0.0.1 here is not its host.
    ``own_net_ns``: None reads this process's; "" means unknown."""
    own_net_ns = own_net_ns if own_net_ns is not None else net_namespace()
    own_boot_id = own_boot_id if own_boot_id is not None else boot_id()
    own_machine = own_machine if own_machine is not None else (machine_id(), host_name())
    theirs = info.get("boot_id")
    theirs = theirs if isinstance(theirs, str) and theirs else None
    if theirs and own_boot_id and theirs != own_boot_id:
        return _another_boot(info, theirs, own_machine)
    if not (theirs and own_boot_id):
        machine, host = _machine_of(info)
        if machine and host and all(own_machine) and (machine, host) != tuple(own_machine):
            return ELSEWHERE, _on_another_machine(machine, host), ON_ANOTHER_MACHINE
    own_pid_ns = own_pid_ns if own_pid_ns is not None else pid_namespace()
    ns = info.get("pid_ns")
    if not isinstance(ns, str):
        return ELSEWHERE, UNKNOWN_THEIR_NS, PLACE_UNKNOWN
    if not own_pid_ns:
        return ELSEWHERE, UNKNOWN_OWN_NS, PLACE_UNKNOWN
    if not own_boot_id:
        return ELSEWHERE, UNKNOWN_OWN_BOOT, PLACE_UNKNOWN
    if not theirs:
        # a PID namespace's inode is unique only within one boot
        return ELSEWHERE, "its boot is not recorded: its pid cannot be judged here", PLACE_UNKNOWN
    if ns != own_pid_ns:
        return ELSEWHERE, f"another PID namespace, {ns}", IN_ANOTHER_NAMESPACE
    target = _pid_and_ticks(info)
    if target is None:
        return STALE, "no valid pid", None
    state, why = _pid_state(*target)
    if state == ELSEWHERE:
        return state, why, PLACE_UNKNOWN
    net = info.get("net_ns")
    if state == LIVE and info.get("transport") == "tcp" and isinstance(net, str) and own_net_ns and net != own_net_ns:
        # alive in this PID namespace, but its loopback port belongs to another network
        return ELSEWHERE, f"another network namespace, {net}: its loopback port is not reachable from here", \
            IN_ANOTHER_NAMESPACE
    return state, why, None


def classify(info: dict, own_pid_ns: Optional[str] = None, own_boot_id: Optional[str] = None,
             own_machine: Optional[Tuple[Optional[str], Optional[str]]] = None) -> Tuple[str, str]:
    """``(LIVE | STALE | ELSEWHERE, why)`` for a validated record.

    The same boot id (the running Linux kernel's, random at each boot and
    shared by every container on it) is the same machine: the pid is then
    judged, but only when both PID namespaces are known and the same (another
    PID namespace makes the pid meaningless here, and so does an unknown one);
    it must be alive, not a zombie, and started at the recorded clock tick.
    Another boot id proves nothing alone (a home directory shared by the
    nodes of a cluster holds every node's files): the file is stale only when
    it records this machine's id and host name, i.e. was written during an
    earlier boot of this machine; another machine, or one not known on either
    side, is "elsewhere". Unknown is never "stale": nothing is removed on a
    guess. ``own_pid_ns``, ``own_boot_id``: None reads this process's; ""
    means unknown. ``own_machine``: ``(machine id, host name)``, None reads them.
    """
    state, why, _place = judge(info, own_pid_ns, own_boot_id, own_machine)
    return state, why


def is_alive(info: dict) -> bool:
    """Whether the process that wrote ``info`` still runs here (same pid, same start time, this namespace)."""
    try:
        return classify(info)[0] == LIVE
    except Exception:
        return False


# ------------------------------------------------------------------ scanning


@dataclass
class Kernel:
    """One discovery file and what it says (validated); ``elsewhere`` says why it is not reachable from here."""

    path: Path
    info: dict
    elsewhere: Optional[str] = None
    #: the uid that owns the discovery file (None: not known, as for a record not read by :func:`scan`)
    owner: Optional[int] = None
    #: for a kernel elsewhere: ON_ANOTHER_MACHINE, IN_ANOTHER_NAMESPACE or PLACE_UNKNOWN
    place: Optional[str] = None

    @property
    def instance(self) -> str:
        """What its files are named from: the instance in its discovery file's name (an old name: the pid)."""
        return instance_of(self.path) or str(self.pid)

    @property
    def host(self) -> Optional[str]:
        value = self.info.get("host")
        return value if isinstance(value, str) else None

    @property
    def notebook_root(self) -> Optional[str]:
        """The root directory of the Jupyter Server that started it (``notebook`` is relative to it), or None."""
        value = self.info.get("notebook_root")
        return value if isinstance(value, str) else None

    def notebook_path(self) -> Optional[str]:
        """The notebook as an absolute path (``notebook_root`` joined with ``notebook``), or None."""
        if not self.notebook:
            return None
        return os.path.join(self.notebook_root, self.notebook) if self.notebook_root else self.notebook

    @property
    def pid(self) -> int:
        return int(self.info.get("pid", -1))

    @property
    def kernel_id(self) -> Optional[str]:
        return self.info.get("kernel_id")

    @property
    def notebook(self) -> Optional[str]:
        return self.info.get("notebook")

    @property
    def endpoint(self) -> str:
        return self.info.get("endpoint") or ""

    @property
    def pub_endpoint(self) -> str:
        return self.info.get("pub_endpoint") or ""

    @property
    def key_file(self) -> Optional[str]:
        value = self.info.get("key_file")
        return value if isinstance(value, str) else None

    @property
    def label(self) -> str:
        """What a user recognises: the notebook, else the kernel id, else the pid."""
        return self.notebook or self.kernel_id or str(self.pid)

    def alive(self) -> bool:
        return self.elsewhere is None and is_alive(self.info)

    def scheme_key_path(self) -> Path:
        """The only key file this kernel can have: ``<its discovery file's directory>/gpucleanup/<instance>.key``."""
        return self.path.parent / KEY_DIR / f"{self.instance}.key"

    def read_key(self) -> Optional[bytes]:
        """The HMAC key as bytes, None without a key file; OSError if unreadable, :class:`UnsafeFile` if the
        file is not the one the naming scheme gives (:meth:`scheme_key_path`; a discovery file cannot name
        any other path), not a regular file of at most 64 KiB, or not owned by the discovery file's owner
        (so root, reading another user's runtime directory, never reads a file that user could not)."""
        if not self.key_file:
            return None
        expected = self.scheme_key_path()
        try:
            same = (os.path.basename(self.key_file) == expected.name
                    and os.path.realpath(os.path.dirname(self.key_file)) == os.path.realpath(expected.parent))
        except (OSError, ValueError):
            same = False
        if not same:
            raise UnsafeFile(f"not {expected}, the only key file the naming scheme gives")
        owner = self.owner if self.owner is not None else os.geteuid()
        try:
            data, _info = read_bounded(expected, owners={owner})
        except UnsafeFile as exc:
            if owner != os.geteuid() and exc.strerror.startswith("owned by uid"):
                raise UnsafeFile(f"{exc.strerror.split(', not by')[0]}, not by uid {owner}, who owns the discovery "
                                 "file") from None
            raise
        return data.strip()


class Skipped(NamedTuple):
    path: Path
    why: str


class ScanResult(NamedTuple):
    """What :func:`scan` found; ``scan()[0]`` is the live kernels, as it always was."""

    live: List[Kernel]
    stale: List[Path]
    elsewhere: List[Kernel]
    skipped: List[Skipped]


@dataclass
class _Candidate:
    path: Path
    name: str
    pid: int
    stat: Optional[os.stat_result] = None
    info: Optional[dict] = None
    extra: list = field(default_factory=list)


def _listing(fd: int) -> List[Tuple[int, str, str]]:
    """``(pid, instance, name)`` of every discovery file name, by pid."""
    names = []
    with os.scandir(fd) as entries:
        for entry in entries:
            match = _NAME.fullmatch(entry.name)
            if match:
                names.append((int(match.group(2)), match.group(1), entry.name))
    return sorted(names)


def _process_uid(pid: int, proc: str) -> Optional[int]:
    """The real uid of process ``pid`` (``Uid:`` in its status), or None."""
    try:
        with open(f"{proc}/{pid}/status", encoding="utf-8", errors="replace") as fh:
            for line in fh:
                if line.startswith("Uid:"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


def proc_net_address(host: str, port: int) -> Optional[str]:
    """``host:port`` as /proc/net/tcp{,6} write it: each 32-bit word of the address in this machine's byte order,
    in hex, then the port (``[::1]`` and ``::1`` alike); None for a host that is no numeric address."""
    bare = host.strip("[]")
    try:
        packed = socket.inet_pton(socket.AF_INET6 if ":" in bare else socket.AF_INET, bare)
    except (OSError, ValueError):
        return None
    words = [int.from_bytes(packed[i:i + 4], sys.byteorder) for i in range(0, len(packed), 4)]
    return "".join(f"{w:08X}" for w in words) + f":{port:04X}"


def _listening_inode(endpoint: str, pid: int, proc: str) -> Optional[int]:
    """The inode of the listening socket ``endpoint`` names, in process ``pid``'s network namespace, or None."""
    tcp = _TCP.fullmatch(endpoint)
    try:
        if tcp:
            host, port = tcp.group(1), int(tcp.group(2))
            want = proc_net_address(host, port)
            table = "tcp6" if host.startswith("[") else "tcp"
            with open(f"{proc}/{pid}/net/{table}", encoding="ascii", errors="replace") as fh:
                next(fh, None)
                for line in fh:
                    fields = line.split()
                    if len(fields) > 9 and fields[1].upper() == want and fields[3] == "0A":  # 0A: LISTEN
                        return int(fields[9])
            return None
        if endpoint.startswith("ipc://"):
            path = endpoint[len("ipc://"):]
            with open(f"{proc}/{pid}/net/unix", encoding="utf-8", errors="replace") as fh:
                next(fh, None)
                for line in fh:
                    fields = line.split(None, 7)
                    # Num RefCount Protocol Flags Type St Inode Path; flag 0x10000: accepting connections
                    if len(fields) == 8 and fields[7].rstrip("\n") == path and int(fields[3], 16) & 0x10000:
                        return int(fields[6])
            return None
    except (OSError, ValueError):
        return None
    return None


def _socket_inodes(pid: int, proc: str) -> Optional[set]:
    """The inodes of the sockets process ``pid`` holds open, or None when its descriptors cannot be read."""
    found = set()
    try:
        names = os.listdir(f"{proc}/{pid}/fd")
    except OSError:
        return None
    for name in names:
        try:
            target = os.readlink(f"{proc}/{pid}/fd/{name}")
        except OSError:
            continue
        if target.startswith("socket:[") and target.endswith("]"):
            with_digits = target[len("socket:["):-1]
            if with_digits.isdigit():
                found.add(int(with_digits))
    return found


def foreign_record_refusal(info: dict, owner: int, proc: str = "/proc") -> Optional[str]:
    """Why a live record that another user's file holds must not be asked (None: it may), read from /proc
    alone: its process must belong to the file's owner, and each endpoint it names (the status socket and the
    publisher) must be a listening socket that process holds. Without this, whoever writes a runtime directory
    that root (or a reader of a shared one) scans could make ``gpucleanup ps`` and ``drain`` connect to any
    loopback port or socket on the machine, with a ZMTP greeting and a signed request each time."""
    pid = info.get("pid")
    if not isinstance(pid, int):
        return "no valid pid: not asked"
    uid = _process_uid(pid, proc)
    if uid is None:
        return f"the owner of process {pid} cannot be read: not asked"
    if uid != owner:
        return (f"process {pid} belongs to uid {uid}, not to uid {owner}, who owns this file: not asked (a record "
                "names only its own writer's kernel)")
    held = _socket_inodes(pid, proc)
    if held is None:
        return f"the sockets of process {pid} cannot be read: whether it serves the endpoint is unknown, not asked"
    for key in ("endpoint", "pub_endpoint"):
        endpoint = info.get(key)
        if not isinstance(endpoint, str):
            continue
        inode = _listening_inode(endpoint, pid, proc)
        if inode is None:
            return f"nothing listens on its {key} {_show(endpoint)}: not asked"
        if inode not in held:
            return f"its {key} {_show(endpoint)} is not a socket of process {pid}: not asked"
    return None


def scan(directory: Optional[Path] = None, clean: bool = True) -> ScanResult:
    """Every discovery file in ``directory``: live kernels, stale files, kernels elsewhere, skipped files.

    With ``clean``, the stale files (provably those of exited processes on
    this machine) are removed, with the key and socket files the naming
    scheme derives from the instance in the file's name (:func:`scheme_files`);
    they are still returned, so a caller can say so. Nothing else is ever
    removed, and a kernel elsewhere (another machine, another PID namespace)
    is listed, never asked.
    """
    directory = Path(directory) if directory is not None else runtime_dir()
    result = ScanResult([], [], [], [])
    try:
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return result
    try:
        try:
            owners = {os.geteuid(), os.fstat(fd).st_uid}
            names = _listing(fd)
        except OSError:
            return result
        own_ns, own_boot, own_machine = pid_namespace(), boot_id(), (machine_id(), host_name())
        own_net = net_namespace()
        stale: List[Tuple[str, str, os.stat_result]] = []
        for name_pid, instance, name in names:
            path = directory / name
            if not 0 < name_pid < PID_LIMIT:
                result.skipped.append(Skipped(path, f"pid {name_pid} in the file name is out of range (1 to {PID_LIMIT - 1})"))
                continue
            try:
                data, info_stat = read_bounded(name, dir_fd=fd, owners=owners)
            except FileNotFoundError:
                continue  # removed meanwhile: its kernel exited
            except UnsafeFile as exc:
                result.skipped.append(Skipped(path, exc.strerror))
                continue
            except OSError as exc:
                result.skipped.append(Skipped(path, f"cannot be read ({exc.strerror or exc})"))
                continue
            try:
                try:
                    text = data.decode("utf-8")
                except UnicodeDecodeError:
                    raise BadDiscoveryFile("not UTF-8") from None
                try:
                    record = json.loads(text)
                except ValueError as exc:
                    raise BadDiscoveryFile(f"not JSON ({exc})") from None
                info = validate(record, name_pid, instance)
            except (BadDiscoveryFile, RecursionError) as exc:
                result.skipped.append(Skipped(path, str(exc) or type(exc).__name__))
                continue
            state, why, place = judge(info, own_ns or "", own_boot or "", own_machine, own_net or "")
            if state == LIVE and info_stat.st_uid != os.geteuid():
                refusal = foreign_record_refusal(info, info_stat.st_uid)
                if refusal:
                    result.skipped.append(Skipped(path, refusal))
                    continue
            if state == LIVE:
                result.live.append(Kernel(path, info, owner=info_stat.st_uid))
            elif state == ELSEWHERE:
                result.elsewhere.append(Kernel(path, info, elsewhere=why, owner=info_stat.st_uid, place=place))
            else:
                result.stale.append(path)
                stale.append((instance, name, info_stat))
        if clean:
            for instance, name, info_stat in stale:
                _remove_stale(fd, directory, instance, name, info_stat, owners)
    finally:
        os.close(fd)
    return result


def _same_file(a: os.stat_result, b: os.stat_result) -> bool:
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def _remove_stale(fd: int, directory: Path, instance: str, name: str, read_stat: os.stat_result, owners) -> None:
    """Removes the stale discovery file ``name`` and the key and sockets named from its ``instance``.

    The discovery file goes only if it is still the file that was judged
    (a kernel that took the pid meanwhile writes a new file). A key or socket
    goes only if it is the right type and not newer than that discovery file
    (a kernel starting with the same pid writes its key before its discovery file).
    """
    try:
        now = os.lstat(name, dir_fd=fd)
        if not _same_file(now, read_stat):
            return
        os.unlink(name, dir_fd=fd)
    except OSError:
        return
    try:
        key_dir = os.open(KEY_DIR, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
    except OSError:
        return  # none, or a link: nothing of ours to remove there
    try:
        if os.fstat(key_dir).st_uid not in owners:
            return
        for leftover, kind in scheme_files(instance):
            try:
                info = os.lstat(leftover, dir_fd=key_dir)
                if stat.S_IFMT(info.st_mode) != kind or info.st_mtime_ns > read_stat.st_mtime_ns:
                    continue
                os.unlink(leftover, dir_fd=key_dir)
            except OSError:
                pass
        # The dead kernel's park lock (gpucleanup.park.lock): written when it was parked, so after its discovery
        # file; a kernel that took the pid since has rewritten that file, and nothing got this far.
        try:
            info = os.lstat(f"{instance}.park", dir_fd=key_dir)
            if stat.S_ISREG(info.st_mode):
                os.unlink(f"{instance}.park", dir_fd=key_dir)
        except OSError:
            pass
    finally:
        os.close(key_dir)
