"""``gpucleanup exporter``: gpucleanup's Prometheus metrics (``gpucleanup.outside.metrics``) over HTTP, for hosts
without a Jupyter server.

Private to its owner by default (a bearer token in a file only the owner may read), and built to keep answering the
token's holder while other local users flood it (:class:`_GatedServer`).
"""

from __future__ import annotations

import errno
import hmac
import http.client
import io
import logging
import os
import pwd
import re
import resource
import secrets
import selectors
import socket
import stat
import struct
import threading
import time
from collections import OrderedDict
from pathlib import Path
from typing import Any, Dict, Iterable, List, Optional
from urllib.parse import urlsplit

from ..protocol import discovery, status_client

__all__ = [
    "ExporterError",
    "Exporter",
    "token_path",
    "read_token",
    "ensure_token",
    "start_exporter",
    "run_exporter",
    "REQUEST_DEADLINE_S",
    "MAX_PENDING",
    "MAX_CONNECTIONS",
]

log = logging.getLogger("gpucleanup")


class ExporterError(ValueError):
    """The exporter cannot serve as asked; the message is one sentence that says what to do."""


# ---------------------------------------------------------------- the token and its file

#: the token file's name in ``<runtime dir>/gpucleanup/`` (the directory of the kernels' keys, 0700)
TOKEN_FILE = "exporter.token"
_TOKEN = re.compile(r"[A-Za-z0-9._~+/=-]{16,512}", re.ASCII)


def token_path(runtime_dir: Optional[Path] = None) -> Path:
    """Where the exporter keeps its token by default: ``<runtime dir>/gpucleanup/exporter.token``."""
    return (Path(runtime_dir) if runtime_dir is not None else discovery.runtime_dir()) / discovery.KEY_DIR / TOKEN_FILE


def read_token(path: Path) -> str:
    """The bearer token in ``path``: a regular file of yours that no one else may read; ExporterError if not."""
    try:
        data, info = discovery.read_bounded(path, owners={os.geteuid()})
    except discovery.UnsafeFile as exc:
        raise ExporterError(f"token file {path} is {exc.strerror}: give a regular file of yours") from None
    except OSError as exc:
        raise ExporterError(f"cannot read the token file {path} ({exc.strerror or exc})") from None
    if stat.S_IMODE(info.st_mode) & 0o077:
        raise ExporterError(f"token file {path} may be read by others (mode {stat.S_IMODE(info.st_mode):o}): "
                            "chmod 600 it")
    token = data.decode("ascii", "replace").strip()
    if not _TOKEN.fullmatch(token):
        raise ExporterError(f"token file {path} does not hold a token (16 to 512 characters of A-Z a-z 0-9 ._~+/=-)")
    return token


def _user(uid: int) -> str:
    try:
        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except (KeyError, OverflowError):
        return f"uid {uid}"


def _others_may_write(info: os.stat_result, sticky_ok: bool) -> Optional[str]:
    """Why users other than us and root may change what a directory holds (None: they may not).

    Its owner may (so it must be us or root); so may its group and every user when the mode says so (an
    ACL that lets a named user write shows as the group's write bit: the mask). The sticky bit stops
    others from renaming or removing entries that are ours; it is accepted for a directory above the
    token file's (``/tmp``), never for the token file's own directory, where others could still create
    the name before we do.
    """
    mode = stat.S_IMODE(info.st_mode)
    if info.st_uid not in (os.geteuid(), 0):
        return f"belongs to {_user(info.st_uid)}, who may replace what it holds"
    if mode & (stat.S_IWGRP | stat.S_IWOTH) and not (sticky_ok and mode & stat.S_ISVTX):
        who = "every user" if mode & stat.S_IWOTH else "its group"
        return f"may be written by {who} (mode {mode:o})"
    return None


def _make_dirs(directory: Path) -> None:
    """Creates the missing directories of ``directory`` one by one, each 0700; an existing one is left as
    it is (its mode is never changed)."""
    missing = []
    for each in [directory, *directory.parents]:
        if os.path.lexists(each):
            break
        missing.append(each)
    for each in reversed(missing):
        try:
            os.mkdir(each, 0o700)
        except FileExistsError:
            pass  # made meanwhile by someone else: checked below like any directory we did not make


def check_token_dir(path: Path) -> None:
    """Refuses (:class:`ExporterError`) a token file at ``path`` when anyone but us and root may change its
    directory, or any directory above it, so as to put another file at that name or take ours away.

    The rule of OpenSSH's ``StrictModes`` for ``authorized_keys``: every directory from ``/`` down to the
    file's belongs to us or root and is writable by no one else, except that a sticky directory above
    the file's own (``/tmp``) is accepted. Nothing is changed: a team's 2775 directory stays 2775.
    """
    directory = Path(os.path.realpath(path.parent))
    for each in [directory, *directory.parents]:
        try:
            info = os.stat(each)
        except OSError as exc:
            raise ExporterError(f"cannot use the token file {path}: {each} cannot be read ({exc.strerror or exc})") from None
        why = _others_may_write(info, sticky_ok=each != directory)
        if why is not None:
            where = "its directory" if each == directory else "a directory above it,"
            raise ExporterError(
                f"token file {path}: {where} {each} {why}: another user could put a file of their own at that name "
                "or take yours away; keep the token file in a directory that only you (and root) may write "
                "(gpucleanup makes a missing one 0700) and give Prometheus's user a copy of the token")


def ensure_token(path: Path, own_dir: bool = False) -> str:
    """The token in ``path``, written there first (0600, a new random token) when the file does not exist.

    The file's directory is made when missing (each new directory 0700) and must pass
    :func:`check_token_dir`; an existing directory keeps its mode. ``own_dir``: the directory is
    gpucleanup's own key directory (:func:`token_path`), made and kept 0700 as the kernels keep it.
    """
    path = Path(path)
    try:
        if own_dir:
            discovery.ensure_private_dir(path.parent)
        else:
            _make_dirs(path.parent)
    except OSError as exc:
        raise ExporterError(f"cannot make the token file's directory {path.parent} ({exc.strerror or exc})") from None
    check_token_dir(path)
    if not path.exists() and not path.is_symlink():
        try:
            discovery.write_private(path, (secrets.token_urlsafe(32) + "\n").encode("ascii"))
        except OSError as exc:
            raise ExporterError(f"cannot write the token file {path} ({exc.strerror or exc})") from None
    return read_token(path)


# ---------------------------------------------------------------- the server

#: seconds a connection has to send its whole request head; then it is closed
REQUEST_DEADLINE_S = 5.0
#: connections whose request head is still awaited (no thread each; the gate holds them)
MAX_PENDING = 128
#: requests that presented the token, served at once (each a thread); more get 503
MAX_CONNECTIONS = 32
#: seconds a served request's answer may take to be written to a peer that reads slowly
WRITE_TIMEOUT_S = 10.0
#: the largest request head read (a request line and its headers)
MAX_HEAD_BYTES = 16 * 1024
#: connections taken from the listening socket per turn of the gate's loop
_ACCEPTS_PER_TURN = 64


def _pending_cap() -> int:
    """:data:`MAX_PENDING`, and never more than a quarter of the descriptors the process may open (the
    collection needs descriptors of its own to ask the kernels)."""
    try:
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    except (OSError, ValueError):
        soft = resource.RLIM_INFINITY
    if soft == resource.RLIM_INFINITY or soft <= 0:
        return MAX_PENDING
    return max(8, min(MAX_PENDING, soft // 4))


# sock_diag (linux/sock_diag.h, linux/inet_diag.h): one exact lookup of a TCP socket by its four-tuple, answered
# by the kernel from its hash tables, where /proc/net/tcp prints every socket of the namespace each time
_NETLINK_SOCK_DIAG = 4
_SOCK_DIAG_BY_FAMILY = 20
_NLM_F_REQUEST = 1
_NLMSG_ERROR = 2
_INET_DIAG_NOCOOKIE = 0xFFFFFFFF
_TCP_STATES_ALL = 0xFFFFFFFF
_DIAG_TIMEOUT_S = 0.2


def _diag_request(sock: socket.socket, seq: int) -> Optional[bytes]:
    """The inet_diag_req_v2 that asks for the socket at the other end of ``sock`` (its source is our peer)."""
    try:
        local, peer = sock.getsockname(), sock.getpeername()
        src = socket.inet_pton(sock.family, peer[0]).ljust(16, b"\0")
        dst = socket.inet_pton(sock.family, local[0]).ljust(16, b"\0")
    except (OSError, ValueError):
        return None
    sockid = (struct.pack("!HH", peer[1], local[1]) + src + dst
              + struct.pack("=III", 0, _INET_DIAG_NOCOOKIE, _INET_DIAG_NOCOOKIE))
    body = struct.pack("=BBBxI", sock.family, socket.IPPROTO_TCP, 0, _TCP_STATES_ALL) + sockid
    return struct.pack("=IHHII", 16 + len(body), _SOCK_DIAG_BY_FAMILY, _NLM_F_REQUEST, seq, 0) + body


def _diag_peer_uids(socks: List[socket.socket]) -> Optional[Dict[socket.socket, int]]:
    """:func:`tcp_peer_uids` through sock_diag: one request per connection on one netlink socket; None when
    netlink cannot be used here (then /proc/net/tcp is read)."""
    try:
        link = socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, _NETLINK_SOCK_DIAG)
    except (OSError, AttributeError):
        return None
    found: Dict[socket.socket, int] = {}
    try:
        link.settimeout(_DIAG_TIMEOUT_S)
        asked: Dict[int, socket.socket] = {}
        for seq, sock in enumerate(socks, start=1):
            request = _diag_request(sock, seq)
            if request is not None:
                link.send(request)
                asked[seq] = sock
        while asked:
            data = link.recv(65536)
            offset = 0
            while offset + 16 <= len(data):
                length, kind, _flags, seq = struct.unpack_from("=IHHI", data, offset)
                if length < 16:
                    break
                sock = asked.pop(seq, None)
                # inet_diag_msg: family, state, timer, retrans, sockid (48 bytes), expires, rqueue, wqueue, uid
                if sock is not None and kind == _SOCK_DIAG_BY_FAMILY and length >= 16 + 4 + 48 + 16:
                    found[sock] = struct.unpack_from("=I", data, offset + 16 + 4 + 48 + 12)[0]
                offset += (length + 3) & ~3
    except OSError:  # netlink refused, or no answer in time: /proc tells them all
        return None
    finally:
        link.close()
    return found


def tcp_peer_uids(socks: Iterable[socket.socket]) -> Dict[socket.socket, int]:
    """The users owning the other ends of loopback tcp connections: asked of the kernel by sock_diag, one exact
    lookup each, else read from one pass over this network namespace's ``/proc/net/tcp`` and ``tcp6`` (the
    socket whose local address is our peer's and remote address ours); a connection whose other end is not on
    this machine is left out. (Under a flood of churning connections the /proc pass at each eviction cost the
    exporter most of a core: every socket of the machine, printed and parsed, each time.)"""
    socks = list(socks)
    found = _diag_peer_uids(socks)
    return _proc_peer_uids(socks) if found is None else found


def _proc_peer_uids(socks: Iterable[socket.socket]) -> Dict[socket.socket, int]:
    wanted: Dict[tuple, socket.socket] = {}
    for sock in socks:
        try:
            local, peer = sock.getsockname(), sock.getpeername()
            wanted[(discovery.proc_net_address(peer[0], peer[1]), discovery.proc_net_address(local[0], local[1]))] = sock
        except (OSError, ValueError):
            continue
    found: Dict[socket.socket, int] = {}
    if not wanted:
        return found
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table, "r", encoding="ascii", errors="replace") as lines:
                for line in lines:
                    fields = line.split()
                    if len(fields) > 7 and fields[7].isdigit():
                        sock = wanted.get((fields[1], fields[2]))
                        if sock is not None:
                            found[sock] = int(fields[7])
        except OSError:
            continue
    return found


def tcp_peer_uid(sock: socket.socket) -> Optional[int]:
    """The user owning the other end of one loopback tcp connection; None when it cannot be told."""
    return tcp_peer_uids([sock]).get(sock)


class _Waiting:
    """A connection in the gate: when it came, what it has sent, who holds it (asked when needed)."""

    __slots__ = ("since", "head", "address", "holder")

    def __init__(self, address):
        self.since = time.monotonic()
        self.head = bytearray()
        self.address = address
        self.holder: Optional[object] = None


def _answer(sock: socket.socket, status: str, body: bytes, headers: Iterable[tuple] = ()) -> None:
    """A short answer written at once, without waiting (a fresh connection's send buffer takes it), then
    the connection closed."""
    lines = [f"HTTP/1.0 {status}", "Content-Type: text/plain; charset=utf-8", f"Content-Length: {len(body)}",
             "Connection: close", *(f"{k}: {v}" for k, v in headers)]
    try:
        sock.send(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body)
    except OSError:
        pass
    _close(sock)


def _close(sock: socket.socket) -> None:
    try:
        sock.close()
    except OSError:
        pass


UNAUTHORIZED = b"the metrics need the exporter's token: Authorization: Bearer <token>\n"


class _GatedServer:
    """Mixed into wsgiref's threading WSGIServer: ``serve_forever`` is the gate and ``process_request`` gives a
    thread only to a request that passed it.

    A scrape sends ``Authorization: Bearer <token>``, the token in a file of the owner's that no one else may read
    (:func:`token_path` by default). Every local user can reach a loopback port, so the exporter is built to keep
    answering the token's holder (the owner, or a Prometheus running as its own user with a copy of the token)
    while other users flood it:

    - the *gate* (one thread, one ``selectors`` loop) accepts every connection and reads its request head without
      a thread of its own; a connection that has not sent a whole request head within :data:`REQUEST_DEADLINE_S`
      is closed;
    - at most :data:`MAX_PENDING` connections wait in the gate; at that cap a newcomer takes the place of the
      oldest connection of whoever holds the most (the other end's uid for a local peer, asked of the kernel by
      sock_diag, one exact lookup each, else read from ``/proc/net/tcp``; its address otherwise), so one user's
      flood evicts its own connections, never a lone scraper's;
    - only a request that presents the token gets a thread (at most :data:`MAX_CONNECTIONS` at once); one without
      it is answered 401 by the gate at once, and ``/`` and unknown paths likewise.

    ``--public`` asks no token (every request for ``/metrics`` passes the gate) and names no notebook or kernel id
    in the labels.
    """

    daemon_threads = True
    request_queue_size = 128  # the listen backlog: a burst of connections waits there, not refused

    def _gate_init(self, token: Optional[str]) -> None:
        self._expected = f"Bearer {token}".encode("ascii") if token is not None else None
        self._waiting: "OrderedDict[socket.socket, _Waiting]" = OrderedDict()
        self._heads: Dict[socket.socket, bytes] = {}
        self._served_lock = threading.Lock()
        self._served: set = set()
        self._stop = threading.Event()
        self._stopped = threading.Event()
        self._stopped.set()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self.max_pending = _pending_cap()
        #: connections closed for lack of a whole request in time, to make room, or with no thread free
        self.stats = {"timed_out": 0, "evicted": 0, "busy": 0, "unauthorized": 0, "served": 0}

    # -------------------------------------------------------------- the gate's loop

    def serve_forever(self, poll_interval: float = 0.5) -> None:
        self._stopped.clear()
        selector = selectors.DefaultSelector()
        try:
            self.socket.setblocking(False)
            selector.register(self.socket, selectors.EVENT_READ, "listen")
            selector.register(self._wake_r, selectors.EVENT_READ, "wake")
            while not self._stop.is_set():
                timeout = poll_interval
                if self._waiting:
                    first = next(iter(self._waiting.values()))
                    timeout = max(0.0, min(timeout, first.since + REQUEST_DEADLINE_S - time.monotonic()))
                for key, _ in selector.select(timeout):
                    if key.data == "listen":
                        self._accept(selector)
                    elif key.data == "wake":
                        try:
                            self._wake_r.recv(64)
                        except OSError:
                            pass
                    else:
                        self._read(selector, key.fileobj)
                self._expire(selector)
        finally:
            for sock in list(self._waiting):
                self._drop(selector, sock)
            selector.close()
            self._stopped.set()

    def shutdown(self) -> None:
        self._stop.set()
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass
        self._stopped.wait()

    def server_close(self) -> None:
        super().server_close()
        for sock in (getattr(self, "_wake_r", None), getattr(self, "_wake_w", None)):
            if sock is not None:  # none when the bind itself failed
                _close(sock)

    def _accept(self, selector) -> None:
        for _ in range(_ACCEPTS_PER_TURN):
            try:
                sock, address = self.socket.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # out of descriptors: make room, the newcomer waits in the backlog
                if exc.errno in (errno.EMFILE, errno.ENFILE) and self._waiting:
                    self._make_room(selector)
                return
            sock.setblocking(False)
            if len(self._waiting) >= self.max_pending:
                self._make_room(selector)
            self._waiting[sock] = _Waiting(address)
            selector.register(sock, selectors.EVENT_READ, "peer")

    def _make_room(self, selector) -> None:
        """Closes the oldest waiting connection of whoever holds the most of them."""
        unknown = [s for s, w in self._waiting.items() if w.holder is None]
        if unknown:
            uids = tcp_peer_uids(unknown)
            for sock in unknown:
                uid = uids.get(sock)
                self._waiting[sock].holder = ("uid", uid) if uid is not None else ("address", self._waiting[sock].address[0])
        counts: Dict[object, int] = {}
        for waiting in self._waiting.values():
            counts[waiting.holder] = counts.get(waiting.holder, 0) + 1
        heaviest = max(counts.values())
        for sock, waiting in self._waiting.items():  # oldest first
            if counts[waiting.holder] == heaviest:
                self.stats["evicted"] += 1
                self._drop(selector, sock)
                return

    def _expire(self, selector) -> None:
        limit = time.monotonic() - REQUEST_DEADLINE_S
        while self._waiting:
            sock, waiting = next(iter(self._waiting.items()))
            if waiting.since > limit:
                return
            self.stats["timed_out"] += 1
            self._drop(selector, sock)

    def _drop(self, selector, sock) -> None:
        self._waiting.pop(sock, None)
        try:
            selector.unregister(sock)
        except (KeyError, ValueError):
            pass
        _close(sock)

    def _read(self, selector, sock) -> None:
        waiting = self._waiting.get(sock)
        if waiting is None:
            return
        try:
            data = sock.recv(4096)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._drop(selector, sock)
            return
        if not data:
            self._drop(selector, sock)
            return
        waiting.head += data
        end = waiting.head.find(b"\r\n\r\n")
        if end < 0:
            end = waiting.head.find(b"\n\n")
        if end < 0:
            if len(waiting.head) > MAX_HEAD_BYTES:
                self._let_go(selector, sock)
                _answer(sock, "431 Request Header Fields Too Large", b"the request's head is too large\n")
            return
        self._let_go(selector, sock)
        self._route(sock, waiting)

    def _let_go(self, selector, sock) -> None:
        self._waiting.pop(sock, None)
        try:
            selector.unregister(sock)
        except (KeyError, ValueError):
            pass

    def _route(self, sock: socket.socket, waiting: _Waiting) -> None:
        head = bytes(waiting.head)
        first, _, rest = head.partition(b"\n")
        words = first.decode("latin-1").split()
        try:
            headers = http.client.parse_headers(io.BytesIO(rest))
        except (http.client.HTTPException, ValueError):
            headers = None
        if len(words) != 3 or headers is None:
            _answer(sock, "400 Bad Request", b"not an HTTP request\n")
            return
        path = urlsplit(words[1]).path
        if path == "/":
            _answer(sock, "200 OK", b"gpucleanup exporter: the metrics are at /metrics\n")
            return
        if path != "/metrics":
            _answer(sock, "404 Not Found", b"not found: the metrics are at /metrics\n")
            return
        given = (headers.get("Authorization") or "").encode("latin-1", "replace")
        if self._expected is not None and not hmac.compare_digest(given, self._expected):
            self.stats["unauthorized"] += 1
            _answer(sock, "401 Unauthorized", UNAUTHORIZED, [("WWW-Authenticate", 'Bearer realm="gpucleanup"')])
            return
        with self._served_lock:
            busy = len(self._served) >= MAX_CONNECTIONS
            if not busy:
                self._served.add(sock)
        if busy:
            self.stats["busy"] += 1
            _answer(sock, "503 Service Unavailable", b"too many scrapes at once: ask again in a moment\n",
                    [("Retry-After", "1")])
            return
        self.stats["served"] += 1
        sock.settimeout(WRITE_TIMEOUT_S)
        self._heads[sock] = head
        try:
            self.process_request(sock, waiting.address)
        except Exception:  # no thread could be started: the connection goes, the gate goes on
            self._heads.pop(sock, None)
            with self._served_lock:
                self._served.discard(sock)
            _close(sock)

    def process_request_thread(self, request, client_address):
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._heads.pop(request, None)
            with self._served_lock:
                self._served.discard(request)

    @property
    def waiting(self) -> int:
        """Connections in the gate now."""
        return len(self._waiting)

    @property
    def serving(self) -> int:
        """Requests served on threads now."""
        with self._served_lock:
            return len(self._served)


def _wsgi_app(registry, token: Optional[str]):
    """The metrics; the gate has checked the token already, this checks it again (never served without)."""
    from .metrics import _prometheus

    metrics = _prometheus().make_wsgi_app(registry)
    expected = f"Bearer {token}".encode("ascii") if token is not None else None

    def app(environ, start_response):
        given = (environ.get("HTTP_AUTHORIZATION") or "").encode("latin-1", "replace")
        if (environ.get("PATH_INFO") or "/") != "/metrics" or (
                expected is not None and not hmac.compare_digest(given, expected)):
            start_response("401 Unauthorized", [("Content-Type", "text/plain; charset=utf-8"),
                                                ("WWW-Authenticate", 'Bearer realm="gpucleanup"')])
            return [UNAUTHORIZED]
        return metrics(environ, start_response)

    return app


def _bind(port: int, host: str, registry, token: Optional[str] = None) -> Any:
    """The HTTP server bound to (host, port), not yet serving; :class:`ExporterError` when it cannot be."""
    import socketserver
    from wsgiref.simple_server import WSGIRequestHandler, WSGIServer

    if type(port) is not int or not 0 <= port <= 65535:
        raise ExporterError(f"port must be a number from 1 to 65535 (0: any free port), got {port!r}")
    if not isinstance(host, str) or not host:
        raise ExporterError(f"host must be an address or a name to listen on, got {host!r}")
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0][0]
    except socket.gaierror as exc:
        raise ExporterError(f"cannot listen on {host!r} ({exc.strerror}): give an address of this machine "
                            "(127.0.0.1, the default, or ::1)") from None

    class Handler(WSGIRequestHandler):
        timeout = WRITE_TIMEOUT_S

        def setup(self):
            super().setup()
            # the gate read the request head already: the handler reads it from there
            self.rfile = io.BytesIO(self.server._heads.pop(self.request, b""))

        def log_message(self, format, *args):  # a scrape every few seconds is not news
            pass

    class Server(_GatedServer, socketserver.ThreadingMixIn, WSGIServer):
        address_family = family

    try:
        server = Server((host, port), Handler)
    except OSError as exc:
        where = f"{host}:{port}" if ":" not in host else f"[{host}]:{port}"
        if exc.errno == errno.EADDRINUSE:
            raise ExporterError(f"cannot listen on {where}: the port is in use by another program; "
                                "choose another port with --port") from None
        if exc.errno == errno.EACCES:
            raise ExporterError(f"cannot listen on {where}: permission denied (ports below 1024 need "
                                "privileges); choose a port from 1024 up with --port") from None
        if exc.errno == errno.EADDRNOTAVAIL:
            raise ExporterError(f"cannot listen on {where}: {host} is not an address of this machine; "
                                "give one of its addresses with --host") from None
        raise ExporterError(f"cannot listen on {where}: {exc.strerror or exc}") from None
    server._gate_init(token)
    server.set_app(_wsgi_app(registry, token))
    return server


class Exporter:
    """A running exporter: ``url`` is where its metrics are; ``wait()`` blocks while it serves;
    ``shutdown()`` stops it (idempotent; from any thread)."""

    def __init__(self, server: Any, thread: threading.Thread, token_file: Optional[Path] = None,
                 collector: Any = None):
        self.server = server
        self.thread = thread
        #: the file holding the bearer token scrapes must send; None for a public exporter
        self.token_file = token_file
        #: the :class:`gpucleanup.outside.metrics.KernelCollector` it serves
        self.collector = collector
        self._closed = False
        self._close_lock = threading.Lock()

    @property
    def host(self) -> str:
        return self.server.server_address[0]

    @property
    def port(self) -> int:
        return self.server.server_address[1]

    @property
    def url(self) -> str:
        host = self.host
        return f"http://{'[' + host + ']' if ':' in host else host}:{self.port}/metrics"

    def wait(self) -> None:
        """Block until the exporter is shut down (by another thread); Ctrl-C interrupts it
        (KeyboardInterrupt), the exporter still serving: call :meth:`shutdown` then."""
        self.thread.join()

    def shutdown(self) -> None:
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        self.server.shutdown()  # returns once the gate has stopped
        self.thread.join()
        self.server.server_close()

    def __enter__(self) -> "Exporter":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()


def start_exporter(port: int, host: str = "127.0.0.1", runtime_dir: Optional[Path] = None,
                   timeout: float = status_client.DEFAULT_TIMEOUT, token_file: Optional[Path] = None,
                   public: bool = False) -> Exporter:
    """Serve gpucleanup's metrics at ``http://host:port/metrics`` on a thread of its own; returns the
    :class:`Exporter` (``.url``, ``.shutdown()``). ``port`` 0 takes any free port (``.port`` says which).

    Private to its owner by default: a scrape must send ``Authorization: Bearer <token>``, the token in
    ``token_file`` (default :func:`token_path`, created 0600 with a random token when missing; a file
    others may read, or in a directory others may write, is refused, and no existing directory's mode is
    changed); other requests get 401 and no figure. ``public``: no token, and the metrics carry only what
    every local user may see (the labels of ``metrics.PUBLIC_KERNEL_LABELS``).

    Raises :class:`ExporterError` (a sentence to print) when the port is in use, not allowed, the host is
    not an address of this machine, the token file cannot be used, and without prometheus_client.
    """
    from . import metrics

    try:
        registry, collector = metrics.make_registry(runtime_dir, timeout, public=public, with_collector=True)
    except metrics.MetricsUnavailable as exc:
        raise ExporterError(str(exc)) from exc
    except ValueError as exc:  # the timeout
        raise ExporterError(str(exc)) from None
    token = None
    if not public:
        own = token_file is None
        token_file = Path(token_file) if token_file is not None else token_path(runtime_dir)
        token = ensure_token(token_file, own_dir=own)
    server = _bind(port, host, registry, token)
    thread = threading.Thread(target=server.serve_forever, name="gpucleanup-exporter", daemon=True)
    thread.start()
    return Exporter(server, thread, None if public else token_file, collector)


def run_exporter(port: int, host: str = "127.0.0.1", runtime_dir: Optional[Path] = None,
                 timeout: float = status_client.DEFAULT_TIMEOUT) -> int:
    """Serve gpucleanup's metrics at ``http://host:port/metrics`` until Ctrl-C; returns 0.

    For hosts without a Jupyter server (with one, its own ``/metrics`` can show them:
    ``metrics.register_server_collector``). The registry is the exporter's own: only gpucleanup's metrics,
    no process metrics of the exporter. Each scrape asks every kernel of ``runtime_dir`` (default:
    Jupyter's runtime directory, as ``gpucleanup ps``), each at most ``timeout`` seconds.

    Raises :class:`ExporterError` (print it) when it cannot serve (:func:`start_exporter`).
    """
    exporter = start_exporter(port, host, runtime_dir, timeout)
    try:
        print(f"gpucleanup exporter: serving {exporter.url} (Ctrl-C stops)", flush=True)
        print(f"gpucleanup exporter: scrapes send Authorization: Bearer <the token in {exporter.token_file}>",
              flush=True)
        exporter.wait()
    except KeyboardInterrupt:
        pass
    finally:
        exporter.shutdown()
    return 0
