"""The notebook a kernel runs, in the one form every gpucleanup surface shows.

That is the Jupyter Server's own form, relative to the root of the server that started the kernel
(:func:`server_root`, :func:`display_form`); without such a server the notebook stays absolute.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Optional, Tuple

from . import discovery

__all__ = ["server_root", "display_form"]

#: how many ancestors are asked: a kernel spec may start the kernel through a wrapper (a shell, ``conda run``)
ANCESTORS = 4


def _parent(pid: int) -> Optional[int]:
    fields = discovery._stat_fields(pid)
    try:
        return int(fields[1]) if fields else None
    except (IndexError, ValueError):
        return None


def _listening(pid: int, port, sock) -> bool:
    """Whether process ``pid`` holds a socket listening on TCP ``port`` (or bound to the Unix socket ``sock``)
    in this network namespace: ``/proc/<pid>/fd`` against ``/proc/net/{tcp,tcp6,unix}``."""
    wanted = set()
    try:
        if isinstance(sock, str) and sock:
            with open("/proc/net/unix", "rb") as f:
                for line in f.read(1 << 22).decode("utf-8", "replace").splitlines()[1:]:
                    fields = line.split(None, 7)
                    if len(fields) == 8 and fields[7] == sock:
                        wanted.add(fields[6])
        elif isinstance(port, int) and not isinstance(port, bool) and 0 < port < 65536:
            for table in ("/proc/net/tcp", "/proc/net/tcp6"):
                try:
                    with open(table, "rb") as f:
                        lines = f.read(1 << 22).decode("ascii", "replace").splitlines()[1:]
                except FileNotFoundError:
                    continue  # no IPv6
                for line in lines:
                    fields = line.split()
                    # local address ADDR:PORT (hex), state 0A = LISTEN, inode the tenth field
                    if len(fields) > 9 and fields[3] == "0A" and fields[1].rsplit(":", 1)[-1] == f"{port:04X}":
                        wanted.add(fields[9])
        if not wanted:
            return False
        for fd in os.listdir(f"/proc/{int(pid)}/fd"):
            try:
                link = os.readlink(f"/proc/{int(pid)}/fd/{fd}")
            except OSError:
                continue
            if link.startswith("socket:[") and link[len("socket:["):-1] in wanted:
                return True
    except (OSError, ValueError):
        return False
    return False


def _root_of(runtime: Path, pid: int) -> Optional[str]:
    """The ``root_dir`` of ``jpserver-<pid>.json`` in ``runtime``, or None.

    The file is read as untrusted input (``discovery.read_bounded``: a regular file of this user, at most 64 KiB)
    and used only if it names the pid it is named after and if that process is the server the file describes: it
    holds a socket listening on the file's port (or its Unix socket). A runtime directory shared by several machines
    or containers (an NFS home) holds the other servers' files too, and one of them may carry the pid of this
    kernel's parent."""
    try:
        data, _info = discovery.read_bounded(Path(runtime) / f"jpserver-{pid}.json", owners={os.geteuid()})
        info = json.loads(data.decode("utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(info, dict) or info.get("pid") != pid or not _listening(pid, info.get("port"), info.get("sock")):
        return None
    root = info.get("root_dir")
    if not isinstance(root, str) or not root.startswith("/") or "\x00" in root or len(root) > 4096:
        return None
    return os.path.normpath(root)


def server_root(runtime: Path, notebook: Optional[str] = None, pid: Optional[int] = None) -> Optional[str]:
    """The root directory of the Jupyter Server that started process ``pid`` (default: this one), or None.

    ``notebook``: an absolute path the root must contain, or a path relative to the root whose directory must
    exist there (a file of another server that happens to carry an ancestor's pid is passed over).

    Jupyter Server starts a kernel with ``JPY_SESSION_NAME`` set to the notebook's absolute path when the session
    has a name, as JupyterLab's have (the directory of the session's path under the root, joined with the name:
    ``SessionManager.get_kernel_env``), and to the session's path itself, relative to the root, when it has none;
    its own pages and REST API name the notebook by that session path, relative to the root. gpucleanup shows the
    server's form wherever there is a server: the kernel finds the server that started it (its parent, or a near
    ancestor) by the file that server writes in the runtime directory, ``jpserver-<pid>.json``, whose ``root_dir``
    is ``os.path.abspath`` of the root (``ServerApp.server_info``), and records the notebook relative to that root,
    with the root beside it. Without a server (``jupyter console``, an editor that starts kernels itself), or when
    the path is not under the root found, the notebook stays absolute.
    """
    current = pid if pid is not None else os.getpid()
    for _ in range(ANCESTORS):
        parent = os.getppid() if current == os.getpid() else _parent(current)
        if not parent or parent <= 1:
            return None
        root = _root_of(runtime, parent)
        if root is not None and (notebook is None or _holds(root, notebook)):
            return root
        current = parent
    return None


def _holds(root: str, notebook: str) -> bool:
    if os.path.isabs(notebook):
        return _under(notebook, root) is not None
    return _under(os.path.join(root, notebook), root) is not None and os.path.isdir(
        os.path.join(root, os.path.dirname(notebook)))


def _under(path: str, root: str) -> Optional[str]:
    relative = os.path.relpath(os.path.normpath(path), root)
    if relative == os.curdir or relative == os.pardir or relative.startswith(os.pardir + os.sep):
        return None
    return relative


def display_form(notebook: Optional[str], root: Optional[str]) -> Tuple[Optional[str], Optional[str]]:
    """``(notebook, root)`` as gpucleanup records them: relative to ``root`` when ``notebook`` is under it
    (``root`` kept beside it; a relative ``notebook`` is the server's session path already), else the notebook
    as given and no root."""
    if not notebook or not root:
        return notebook, None
    relative = _under(notebook if os.path.isabs(notebook) else os.path.join(root, notebook), root)
    return (relative, root) if relative is not None else (notebook, None)
