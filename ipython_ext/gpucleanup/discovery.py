"""Discovery files: how the ``gpucleanup`` command finds every kernel on the machine.

Each kernel with the extension loaded writes one JSON file,
``<jupyter runtime dir>/gpucleanup-<pid>.json`` (mode 0600, written through
``jupyter_core.paths.secure_write``), and removes it when the extension is
unloaded or the process exits. A kernel that was killed leaves its file
behind; such a file is recognised because its pid is gone, or because the
pid now belongs to another process (the process start time recorded in the
file differs from ``/proc/<pid>/stat``), and the command line removes it.

The file's fields (all written by :func:`describe`):

``discovery`` (1), ``pid``, ``proc_start_ticks``, ``kernel_id``,
``connection_file``, ``notebook``, ``endpoint``, ``pub_endpoint``,
``transport`` ("ipc" or "tcp"), ``key_file``, ``signature_scheme``
("hmac-sha256"), ``protocol`` (1), ``started_ns``, ``version``.
"""

from __future__ import annotations

import json
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, List, Optional, Tuple

DISCOVERY_VERSION = 1
PREFIX = "gpucleanup-"
SUFFIX = ".json"
_NAME = re.compile(r"^gpucleanup-(\d+)\.json$")
_KERNEL_FILE = re.compile(r"^kernel-(.+)\.json$")


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


def ensure_private_dir(path: Path) -> Path:
    """Creates ``path`` (and parents) so that only the user can enter it (0700).

    An existing directory of ours is narrowed to 0700; one owned by someone
    else raises PermissionError.
    """
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    info = path.stat()
    if info.st_uid != os.geteuid():
        raise PermissionError(f"{path} belongs to uid {info.st_uid}, not to you: use a directory of your own")
    if info.st_mode & 0o077:
        os.chmod(path, 0o700)
    return path


def discovery_path(pid: Optional[int] = None, directory: Optional[Path] = None) -> Path:
    return (directory or runtime_dir()) / f"{PREFIX}{pid if pid is not None else os.getpid()}{SUFFIX}"


def _stat_fields(pid: int) -> Optional[list]:
    """Fields 3 onwards of ``/proc/<pid>/stat`` (state first), or None."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read().decode("ascii", "replace")
    except OSError:
        return None
    # The command name (field 2) may hold spaces and parentheses: split after the last ')'.
    return stat[stat.rfind(")") + 2 :].split()


def process_start_ticks(pid: int) -> Optional[int]:
    """The process's start time in clock ticks since boot (``/proc/<pid>/stat`` field 22), or None."""
    fields = _stat_fields(pid)
    try:
        return int(fields[19]) if fields else None
    except (IndexError, ValueError):
        return None


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
) -> dict:
    """The discovery record of this process."""
    pid = os.getpid()
    return {
        "discovery": DISCOVERY_VERSION,
        "pid": pid,
        "proc_start_ticks": process_start_ticks(pid),
        "kernel_id": kernel_id_from_connection_file(connection_file),
        "connection_file": connection_file,
        "notebook": notebook,
        "endpoint": endpoint,
        "pub_endpoint": pub_endpoint,
        "transport": transport,
        "key_file": key_file,
        "signature_scheme": "hmac-sha256",
        "protocol": 1,
        "started_ns": started_ns if started_ns is not None else time.time_ns(),
        "version": version,
    }


def write(path: Path, info: dict) -> None:
    """Writes ``info`` to ``path`` with mode 0600, atomically (readers never see half a file)."""
    from jupyter_core.paths import secure_write

    tmp = path.with_name(path.name + f".{os.getpid()}.tmp")
    with secure_write(str(tmp)) as f:
        json.dump(info, f, indent=1, sort_keys=True)
    os.replace(tmp, path)


def remove(path: Path) -> bool:
    try:
        path.unlink()
        return True
    except FileNotFoundError:
        return False


@dataclass
class Kernel:
    """One discovery file and what it says."""

    path: Path
    info: dict

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
        return self.info.get("key_file")

    @property
    def label(self) -> str:
        """What a user recognises: the notebook, else the kernel id, else the pid."""
        return self.notebook or self.kernel_id or str(self.pid)

    def alive(self) -> bool:
        return is_alive(self.info)

    def read_key(self) -> Optional[bytes]:
        """The HMAC key as bytes, None without a key file; OSError if unreadable."""
        if not self.key_file:
            return None
        with open(self.key_file, "rb") as f:
            return f.read().strip()


def is_alive(info: dict) -> bool:
    """Whether the process that wrote ``info`` still runs (same pid, same start time)."""
    try:
        pid = int(info["pid"])
    except (KeyError, TypeError, ValueError):
        return False
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # someone else's process holds the pid now; the start time decides
    fields = _stat_fields(pid)
    if fields and fields[0] in ("Z", "X"):
        return False  # a killed kernel its parent has not reaped yet
    recorded = info.get("proc_start_ticks")
    if recorded is None:
        return True
    return process_start_ticks(pid) == recorded


def read(path: Path) -> Optional[dict]:
    try:
        with open(path, encoding="utf-8") as f:
            info = json.load(f)
    except (OSError, ValueError):
        return None
    return info if isinstance(info, dict) else None


def _files(directory: Path) -> Iterable[Path]:
    try:
        entries = list(directory.iterdir())
    except OSError:
        return []
    return sorted((p for p in entries if _NAME.match(p.name)), key=lambda p: int(_NAME.match(p.name).group(1)))


def scan(directory: Optional[Path] = None, clean: bool = True) -> Tuple[List[Kernel], List[Path]]:
    """Kernels whose discovery files name a live process, and the files of dead ones.

    With ``clean``, the files of dead processes are removed (they are still
    returned in the second list, so a caller can say so).
    """
    directory = directory or runtime_dir()
    live: List[Kernel] = []
    dead: List[Path] = []
    leftovers: List[dict] = []
    for path in _files(directory):
        info = read(path)
        if info is None:
            # Half-written files never exist (os.replace); unreadable JSON is junk
            # only once its pid is gone.
            match = _NAME.match(path.name)
            if match and is_alive({"pid": int(match.group(1))}):
                continue
            dead.append(path)
        elif is_alive(info):
            live.append(Kernel(path, info))
        else:
            dead.append(path)
            leftovers.append(info)
    if clean:
        for path in dead:
            try:
                remove(path)
            except OSError:
                pass
        for info in leftovers:
            _remove_leftovers(info)
    return live, dead


_LEFTOVER = re.compile(r"^\d+\.(key|sock|sock\.pub)$")


def _remove_leftovers(info: dict) -> None:
    # A killed kernel leaves its key file and ipc sockets too. Only names this
    # package makes are removed, so a stray file can never point elsewhere.
    paths = [info.get("key_file") or ""]
    paths += [v[len("ipc://") :] for v in (info.get("endpoint") or "", info.get("pub_endpoint") or "") if v.startswith("ipc://")]
    for value in paths:
        path = Path(value)
        if value and _LEFTOVER.match(path.name) and path.parent.name.startswith("gpucleanup"):
            try:
                path.unlink()
            except OSError:
                pass
