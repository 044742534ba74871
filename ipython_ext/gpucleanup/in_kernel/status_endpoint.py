"""The kernel's side of the status endpoint (share/protocol.md): the native server, its key and its discovery file.

:class:`StatusEndpoint` starts them at load, publishes the kernel's state and each cell's record, and removes them at
unload; cleanup never depends on it.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import secrets
import shutil
import stat
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

from ..protocol import discovery

__all__ = ["StatusEndpoint"]

log = logging.getLogger("gpucleanup")

_REFUSALS_EVERY_S = 5.0  # how often set_state looks at the refused-connections counter

# sun_path holds 108 bytes with its NUL; the publish socket adds ".pub".
_MAX_SOCKET_PATH = 107 - len(".pub")


def _jsonable(value: Any) -> Any:
    return json.loads(json.dumps(value, default=repr))


_STATE_KEYS = {"idle": {"state", "since_ns"}, "running": {"state", "cell", "since_ns"},
               "draining": {"state", "cell", "since_ns"}, "waiting": {"state", "cell", "since_ns", "device"}}


def _state_fields(state: Any) -> Optional[tuple]:
    """(state, cell, since_ns, device) when ``state`` is one the server takes without JSON, else None.
    Twice per cell: plain lookups, no set or generator made."""
    if type(state) is not dict:
        return None
    name = state.get("state")
    keys = _STATE_KEYS.get(name) if type(name) is str else None  # a list would not even hash
    if keys is None:
        return None
    for key in state:
        if key not in keys:
            return None
    cell, since_ns, device = state.get("cell"), state.get("since_ns"), state.get("device")
    # plain ints only (a bool, or an int subclass, goes the JSON way, which says what is wrong with it)
    if ((cell is not None and type(cell) is not int) or (since_ns is not None and type(since_ns) is not int)
            or (device is not None and type(device) is not int)):
        return None
    return (name, cell, since_ns, device)


def _sweep(runtime: Path) -> None:
    """Removes what kernels that died without a word left in ``runtime`` (SIGKILL, a crash): only files
    ``discovery.scan`` proves stale, by the same rules as ``gpucleanup ps``; never raises."""
    try:
        discovery.scan(runtime, clean=True)
    except Exception as exc:  # a kernel loads whatever the directory holds
        log.debug("gpucleanup: sweeping %s failed: %s", runtime, exc)


class StatusEndpoint:
    """The status server of this kernel, found by ``gpucleanup ps`` through a discovery file.

    Used by the extension exactly so::

        endpoint = StatusEndpoint()
        endpoint.start(shell)          # at load
        endpoint.set_state({...})      # before and after every cell
        endpoint.publish(record)       # each finished cell's record
        endpoint.close()               # at unload; also registered with atexit

    None of these ever raises: a failure is kept in :attr:`error` (and logged) and the endpoint stays off, because
    cleanup never depends on it.

    Layout (all private to the user; ``<instance>`` is ``<pid>-<8 random hex digits>``, so that kernels with the
    same pid in other containers or on other machines sharing the directory never share a name)::

        <runtime dir>/gpucleanup-<instance>.json   discovery file, 0600 (discovery.write: O_EXCL temp, rename)
        <runtime dir>/gpucleanup/                  0700
            <instance>.key                         HMAC-SHA256 key, 0600
            <instance>.sock, <instance>.sock.pub   ipc sockets (default transport)

    The endpoint removes only what it wrote: each file's device and inode are kept when it is written, and
    :meth:`close` (and the native SIGTERM handler, given the same paths) removes a path only while it is still
    that file. ``GPUCLEANUP_STATUS_TRANSPORT=tcp`` (or ``StatusEndpoint(transport="tcp")``) binds loopback TCP
    instead; every request must then be signed with the key.
    """

    def __init__(
        self,
        transport: Optional[str] = None,
        history_limit: int = 50,
        runtime_dir: Optional[os.PathLike] = None,
        max_peers: int = 64,
        peer_idle_timeout_s: float = 10.0,
        native: Any = None,
        refusals_every_s: float = _REFUSALS_EVERY_S,
    ):
        self.transport = (transport or os.environ.get("GPUCLEANUP_STATUS_TRANSPORT") or "ipc").lower()
        if transport is None and self.transport not in ("ipc", "tcp"):
            self.transport = "ipc"  # a wrong value in the environment: the default, and the load says so
        self.history_limit = history_limit
        self.max_peers = max_peers
        self.peer_idle_timeout_s = peer_idle_timeout_s
        self._refusals_logged = False
        self._refusals_checked = float("-inf")
        self.refusals_every_s = refusals_every_s
        self._runtime_dir = Path(runtime_dir) if runtime_dir is not None else None
        self._native = native
        self._shell = None
        self._pid: Optional[int] = None
        self._running = False
        self._discovery_path: Optional[Path] = None
        self._key_file: Optional[Path] = None
        self._instance: Optional[str] = None
        # path -> (st_dev, st_ino) of each file this endpoint wrote: the only files it removes
        self._written: dict = {}
        self._sigterm_paths: Optional[dict] = None
        self._runtime: Optional[Path] = None
        self._server_root: Optional[str] = None  # "" once looked for and not found
        self._temp_dir: Optional[Path] = None
        self._atexit = False
        self._sigterm = False  # the native SIGTERM handler holds our paths
        self.info: Optional[dict] = None
        self.error: Optional[str] = None

    # ------------------------------------------------------------------ API

    @property
    def running(self) -> bool:
        return self._running

    @property
    def discovery_path(self) -> Optional[Path]:
        return self._discovery_path

    def start(self, shell: Any) -> None:
        """Starts the native server and writes the discovery file; never raises."""
        if self._running:
            return
        try:
            self._start(shell)
        except Exception as exc:
            self.error = f"{type(exc).__name__}: {exc}"
            log.warning("gpucleanup status endpoint did not start: %s", self.error)
            self._teardown()

    def set_state(self, state: dict) -> None:
        """The kernel's state as ``gpucleanup status`` shows it; never raises."""
        if not self._serving():
            return
        try:
            fields = _state_fields(state)
            if fields is None or fields[0] != "idle":
                self._refresh_notebook()  # not again as each cell ends: the frontend may name the notebook later
            lib = self._lib()
            if fields is not None and hasattr(lib, "server_state"):
                lib.server_state(*fields)  # the per-cell path: no JSON
            else:
                try:
                    lib.server_set_state(state)
                except TypeError:
                    lib.server_set_state(_jsonable(state))
            self._log_refusals()
        except Exception as exc:
            self._note(exc)

    def cell_state(self, state: str, cell: Optional[int] = None, since_ns: Optional[int] = None) -> Optional[int]:
        """A cell's "running" (as it starts) or "idle" (as its hooks end), said twice per cell: what
        :meth:`set_state` does for these, with no dict built and checked, in one library call that also
        answers :meth:`parked` and takes the time itself. ``since_ns``: for a native module without that
        call (now when None). Returns that park state (None: not asked); never raises."""
        if not self._running or self._pid != os.getpid():  # _serving(), written out: twice per cell
            return None
        try:
            running = state != "idle"
            if running:
                self._refresh_notebook()
            lib = self._native or self._lib()
            parked = None
            say = getattr(lib, "server_cell", None)
            if say is not None:  # _native's; it stands in itself for a library older than the call
                parked = say(running, cell)
            else:  # a native module without it (a test's stand-in) takes the JSON way
                since = time.time_ns() if since_ns is None else since_ns
                lib.server_set_state({"state": state, "cell": cell, "since_ns": since} if running
                                     else {"state": state, "since_ns": since})
            if (not running and not self._refusals_logged  # once per cell, and read every few seconds
                    and time.monotonic() - self._refusals_checked >= self.refusals_every_s):
                self._log_refusals()
            return parked
        except Exception as exc:
            self._note(exc)
            return None

    def publish(self, record: dict) -> None:
        """One finished cell's record: kept in the server's history and sent to watchers; never raises."""
        if not self._serving():
            return
        try:
            try:
                self._lib().server_publish(record)
            except TypeError:
                self._lib().server_publish(_jsonable(record))
        except Exception as exc:
            self._note(exc)

    @property
    def park_lock(self) -> Optional[Path]:
        """The park lock file of this kernel (gpucleanup.park.kernel_side), beside its key; None while off."""
        if not self._serving() or self._key_file is None:
            return None
        from ..park.lock import lock_path

        return lock_path(self._key_file, self._pid)

    @property
    def instance(self) -> Optional[str]:
        """What this endpoint's files are named from (``<pid>-<random>``); None while off."""
        return self._instance

    def parked(self) -> int:
        """0: not parked, 1: parking, 2: parked, as the server's state says; no driver call, never raises."""
        if not self._serving():
            return 0
        try:
            fn = getattr(self._native or self._lib(), "server_parked", None)
            return int(fn()) if fn is not None else 0
        except Exception:
            return 0

    def park_blocker(self, why: Optional[str]) -> None:
        """Why no automatic park may begin now (None: it may), for the server to answer an automatic park's
        ``begin`` with; a park a person asks for is not refused by it. Never raises."""
        if not self._serving():
            return
        try:
            fn = getattr(self._native or self._lib(), "server_park_blocker", None)
            if fn is not None:
                fn(why)
        except Exception as exc:
            self._note(exc)

    def background(self, begin: bool, activity: bool = False) -> bool:
        """The kernel's own work on a thread of its own (a release once idle) begins or ends. Begin: True
        when it may run, and until it ends a park is refused; False while a park is under way (its driver
        calls would wait for the resume); an end with ``activity`` (a request that ran the user's code) starts
        an idle kernel's idle time again. With the endpoint off, or a native module without the call (a
        test's stand-in), nothing can park this kernel: True. Never raises."""
        if not self._serving():
            return True
        try:
            fn = getattr(self._native or self._lib(), "server_background", None)
            return fn is None or fn(begin, activity) == 0  # an end always answers 0
        except Exception as exc:
            self._note(exc)
            return True

    def park_step(self, step: str, parked_bytes: Optional[int] = None, then: Optional[dict] = None) -> dict:
        """One park step in the server's state (share/protocol.md, ``park``): the state after it.

        Raises RuntimeError with the server's sentence when the state does not allow the step, or
        when the endpoint is off (parking needs it: it is where the park is kept for the next cell).
        """
        if not self._serving():
            raise RuntimeError("parking needs the status endpoint, which is off"
                               + (f" ({self.error})" if self.error else "")
                               + ": %config GPUCleanup.status_server = True, with a private Jupyter runtime directory")
        if then is not None:
            return self._lib().server_park(step, parked_bytes, then)
        return self._lib().server_park(step, parked_bytes)

    def close(self) -> None:
        """Stops the server and removes the discovery file, key and sockets; idempotent, never raises."""
        try:
            if self._atexit:
                atexit.unregister(self.close)
                self._atexit = False
        except Exception:
            pass
        if self._pid is not None and self._pid != os.getpid():
            # A forked child must not take its parent's endpoint down.
            self._running = False
            return
        self._teardown()

    # ------------------------------------------------------------ internals

    def _serving(self) -> bool:
        # A forked child has the parent's endpoint but not its server: it must not ask a
        # server it lacks, nor rewrite the parent's discovery file (a notebook named later).
        return self._running and self._pid == os.getpid()

    def _lib(self):
        if self._native is None:
            from .. import _native

            self._native = _native
        return self._native

    def _log_refusals(self) -> None:
        # Once per endpoint: connections refused beyond max_peers (a flood of the port).
        # Read at most every few seconds: set_state runs twice per cell, and the counters
        # are a native call and a JSON reply of their own.
        if self._refusals_logged:
            return
        now = time.monotonic()
        if now - self._refusals_checked < self.refusals_every_s:
            return
        self._refusals_checked = now
        read = getattr(self._lib(), "server_connections", None)
        if read is None:
            return
        connections = read()
        refused = connections.get("refused_connections") if isinstance(connections, dict) else None
        if isinstance(refused, int) and refused > 0:
            self._refusals_logged = True
            log.warning(
                "gpucleanup status endpoint refused %d connection(s) beyond its limit of %s per socket on %s: "
                "another process on this machine may be flooding it; the kernel is not affected "
                "(share/protocol.md, Limits)",
                refused,
                connections.get("max_peers"),
                (self.info or {}).get("endpoint"),
            )

    def _note(self, exc: BaseException) -> None:
        self.error = f"{type(exc).__name__}: {exc}"
        log.debug("gpucleanup status endpoint: %s", self.error)

    def _start(self, shell: Any) -> None:
        if self.transport not in ("ipc", "tcp"):
            raise ValueError(f"transport {self.transport!r} is not supported: use 'ipc' or 'tcp'")
        self._shell = shell
        self._pid = pid = os.getpid()
        runtime = self._runtime_dir or discovery.runtime_dir()
        discovery.prepare_runtime_dir(runtime)  # refuses a directory every user may write to
        _sweep(runtime)  # before this kernel's own key: a stale file of its pid takes only what is older
        private = discovery.ensure_private_dir(runtime / "gpucleanup")

        key = secrets.token_hex(32)
        self._instance = instance = discovery.new_instance(pid)
        self._key_file = private / f"{instance}.key"
        self._wrote(self._key_file, discovery.write_private(self._key_file, key.encode("ascii")))
        # The park lock (gpucleanup.park.lock) is made here, empty, rather than by the first park: made by this
        # endpoint, it is one of the files a SIGTERM removes (a kernel culled while its resume at exit ran
        # left it behind for good), and like the others only while it is still the file made here.
        from ..park.lock import lock_path

        park_lock = lock_path(self._key_file, pid)
        self._wrote(park_lock, discovery.write_private(park_lock, b""))

        if self.transport == "tcp":
            endpoint = "tcp://127.0.0.1:0"
        else:
            socket = private / f"{instance}.sock"
            if len(os.fsencode(str(socket))) > _MAX_SOCKET_PATH:
                # A deep runtime dir cannot hold a socket: use a private temp dir.
                self._temp_dir = Path(tempfile.mkdtemp(prefix="gpucleanup-"))
                self._wrote(self._temp_dir, os.lstat(self._temp_dir))
                socket = self._temp_dir / f"{pid}.sock"
            endpoint = f"ipc://{socket}"

        connection_file = discovery.own_connection_file()
        self._server_root = None
        self._runtime = Path(runtime)
        notebook, notebook_root = self._notebook()
        started_ns = time.time_ns()
        kernel = {
            "pid": pid,
            "kernel_id": discovery.kernel_id_from_connection_file(connection_file),
            "connection_file": connection_file,
            "notebook": notebook,
            "notebook_root": notebook_root,
            "started_ns": started_ns,
            "python": sys.version.split()[0],
            "executable": sys.executable,
        }
        bound = self._lib().server_start(
            {
                "endpoint": endpoint,
                "key": key,
                "kernel": kernel,
                "history_limit": int(self.history_limit),
                "max_peers": int(self.max_peers),
                "peer_idle_timeout_s": float(self.peer_idle_timeout_s),
            }
        )
        self._running = True
        try:
            from ..version import __version__ as version
        except ImportError:
            version = None
        self.info = discovery.describe(
            endpoint=bound["endpoint"],
            pub_endpoint=bound["pub_endpoint"],
            key_file=str(self._key_file),
            transport=self.transport,
            connection_file=connection_file,
            notebook=notebook,
            notebook_root=notebook_root,
            started_ns=started_ns,
            version=version,
            instance=instance,
        )
        for endpoint_ in (bound.get("endpoint"), bound.get("pub_endpoint")):
            if isinstance(endpoint_, str) and endpoint_.startswith("ipc://"):
                # made by the server's bind just now, in the user's private directory
                self._wrote(Path(endpoint_[len("ipc://"):]), os.lstat(endpoint_[len("ipc://"):]))
        self._discovery_path = discovery.discovery_path(instance, runtime)
        self._wrote(self._discovery_path, discovery.write(self._discovery_path, self.info))
        atexit.register(self.close)
        self._atexit = True
        self._clean_on_sigterm(bound)
        self.error = None

    def _wrote(self, path: Path, info: os.stat_result) -> None:
        self._written[Path(path)] = discovery.file_identity(info)

    def _clean_on_sigterm(self, bound: dict) -> None:
        """A SIGTERM (a terminated or culled kernel) removes what this endpoint made, as close() does.

        Done by the native library's handler: a Python handler would wait for the main thread, which may be
        waiting in native code for the GPU (sigterm_cleanup.cpp). The discovery file goes first, so that
        nobody finds a kernel whose key is already gone. The handler takes each path's device and inode as it
        is given the list, and removes a path only while it is still that file: the list is given again
        whenever this endpoint rewrites its discovery file (:meth:`_refresh_notebook`).
        """
        files = [str(self._discovery_path), str(self._key_file)]
        if self._key_file is not None:
            from ..park.lock import lock_path

            files.append(str(lock_path(self._key_file, self._pid)))
        for endpoint in (bound.get("endpoint"), bound.get("pub_endpoint")):
            if isinstance(endpoint, str) and endpoint.startswith("ipc://"):
                files.append(endpoint[len("ipc://"):])
        dirs = [str(self._temp_dir)] if self._temp_dir is not None else []
        self._sigterm_paths = {"files": files, "dirs": dirs}
        self._give_sigterm_paths()

    def _give_sigterm_paths(self) -> None:
        if self._sigterm_paths is None:
            return
        # only what is still the file this endpoint wrote: never adopt one someone put at a name since
        paths = {kind: [p for p in names if self._still_written(Path(p))] for kind, names in self._sigterm_paths.items()}
        try:
            self._sigterm = bool(self._lib().sigterm_cleanup(paths))
        except Exception as exc:  # an older library, a path too long: files stay for the next load or ps
            self._note(exc)

    def _still_written(self, path: Path) -> bool:
        try:
            return discovery.file_identity(os.lstat(path)) == self._written.get(path)
        except OSError:
            return False

    def _notebook(self) -> tuple:
        """``(notebook, root)``: relative to the root of the Jupyter Server that started this kernel, with
        that root, or absolute and None (:mod:`gpucleanup.protocol.notebook_path`)."""
        name = os.environ.get("JPY_SESSION_NAME")
        if name:
            # bytes that are not UTF-8 (surrogate escapes) cannot go into the JSON the server takes
            return self._display_form(name.encode("utf-8", "surrogateescape").decode("utf-8", "replace"))
        return self._session_notebook()

    def _display_form(self, notebook: Optional[str]) -> tuple:
        if not notebook or self._runtime is None:
            return notebook, None
        try:
            from ..protocol import notebook_path

            if self._server_root is None:
                self._server_root = notebook_path.server_root(self._runtime, notebook) or ""
            return notebook_path.display_form(notebook, self._server_root or None)
        except Exception as exc:  # a server file that cannot be read: the absolute path, as without a server
            self._note(exc)
            return notebook, None

    def _session_notebook(self) -> tuple:
        """The notebook a frontend named in the kernel's ``__session__`` (with its root), or (None, None)."""
        try:
            value = self._shell.user_ns.get("__session__") if self._shell is not None else None
        except Exception:
            return None, None
        return self._display_form(value) if isinstance(value, str) and value else (None, None)

    def _refresh_notebook(self) -> None:
        # The frontend may name the notebook after the kernel started, in __session__. JPY_SESSION_NAME
        # is not read again: Jupyter Server sets it as it launches the kernel, and the start read it (a
        # missing one would cost a KeyError raised and caught inside os.environ.get on every cell).
        if self.info is None or self.info.get("notebook") or self._discovery_path is None:
            return
        notebook, root = self._session_notebook()
        if notebook:
            if not self._still_written(self._discovery_path):
                return  # not the file this endpoint wrote any more: leave it to whoever put it there
            self.info["notebook"], self.info["notebook_root"] = notebook, root
            self._wrote(self._discovery_path, discovery.write(self._discovery_path, self.info))
            self._give_sigterm_paths()  # the rewritten file is a new inode

    def _teardown(self) -> None:
        if getattr(self, "_sigterm", False):
            self._sigterm = False
            try:
                self._lib().sigterm_cleanup(None)
            except Exception as exc:
                self._note(exc)
        if self._running:
            self._running = False
            try:
                self._lib().server_stop()
            except Exception as exc:
                self._note(exc)
        park_lock = None
        if self._key_file is not None and self._pid is not None:
            from ..park.lock import lock_path

            park_lock = lock_path(self._key_file, self._pid)
        for path in (self._discovery_path, self._key_file):
            if path is not None:
                try:
                    discovery.remove_own(path, self._written.get(path))
                except Exception as exc:
                    self._note(exc)
        if park_lock is not None:
            # written by whoever parked this kernel, under this endpoint's own instance: no other kernel's name
            try:
                if stat.S_ISREG(os.lstat(park_lock).st_mode):
                    park_lock.unlink()
            except FileNotFoundError:
                pass
            except Exception as exc:
                self._note(exc)
        self._discovery_path = None
        self._key_file = None
        self._sigterm_paths = None
        if self._temp_dir is not None:
            # mkdtemp's private directory, only if it is still the one made here
            try:
                if discovery.file_identity(os.lstat(self._temp_dir)) == self._written.get(self._temp_dir):
                    shutil.rmtree(self._temp_dir, ignore_errors=True)
            except OSError:
                pass
            self._temp_dir = None
        self._written = {}
