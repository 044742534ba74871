"""Client of the kernels' status endpoints (protocol 1, share/protocol.md).

A request is the multipart message ``[b"", signature_hex, body_json]`` sent on a
DEALER socket; ``signature_hex`` is HMAC-SHA256 of the body under the kernel's
key (Jupyter's wire-protocol signing), or empty for an unsigned read on ipc.
Every request waits at most its timeout; many kernels are asked at once, so a
stuck one never delays the others.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import time
import uuid
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple, Union

PROTOCOL = 1
DEFAULT_TIMEOUT = 1.0


class StatusError(Exception):
    """A kernel did not answer as asked. ``reason`` is one of: timeout, rejected, bad_reply, unreachable."""

    reason = "error"

    def __init__(self, message: str, error_id: Optional[str] = None):
        super().__init__(message)
        self.error_id = error_id


class StatusTimeout(StatusError):
    reason = "timeout"


class StatusRejected(StatusError):
    """The server answered with an error reply (bad signature, drain refused, ...)."""

    reason = "rejected"


class StatusBadReply(StatusError):
    reason = "bad_reply"


class StatusUnreachable(StatusError):
    reason = "unreachable"


@dataclass
class Target:
    """Where to ask: an endpoint and the key to sign with (None: unsigned)."""

    endpoint: str
    key: Optional[bytes] = None
    label: str = ""
    extra: Dict = field(default_factory=dict)


def sign(key: bytes, body: bytes) -> str:
    return hmac.new(key, body, hashlib.sha256).hexdigest()


def make_request(kind: str, **fields) -> dict:
    body = {"protocol": PROTOCOL, "kind": kind, "id": str(uuid.uuid4()), "time_ns": time.time_ns()}
    body.update(fields)
    return body


def encode(body: dict, key: Optional[bytes]) -> List[bytes]:
    data = json.dumps(body, separators=(",", ":")).encode()
    return [b"", sign(key, data).encode() if key else b"", data]


def decode(frames: Sequence[bytes], key: Optional[bytes], request_id: Optional[str] = None) -> dict:
    """The reply's body; raises StatusBadReply on a wrong shape or signature, StatusRejected on an error reply."""
    if len(frames) != 3 or frames[0] != b"":
        raise StatusBadReply(f"reply has {len(frames)} frames, expected [b'', signature, body]")
    signature, data = frames[1], frames[2]
    try:
        reply = json.loads(data)
    except ValueError as exc:
        raise StatusBadReply(f"reply is not JSON ({exc})") from None
    if key and not hmac.compare_digest(signature, sign(key, data).encode()):
        # A server that refused our signature signs its refusal with its own key, which we
        # lack; believing a refusal grants nothing, so say what it says.
        error = reply.get("error") if isinstance(reply, dict) else None
        if isinstance(error, dict) and error.get("id") == "gpucleanup.server.403":
            raise StatusRejected(error.get("message") or "bad signature", error.get("id"))
        raise StatusBadReply("reply signature does not match the key file: the key file belongs to another kernel")
    if not isinstance(reply, dict) or reply.get("protocol") != PROTOCOL:
        raise StatusBadReply(f"reply speaks protocol {reply.get('protocol') if isinstance(reply, dict) else '?'}, expected {PROTOCOL}")
    if request_id is not None and reply.get("id") not in (request_id, None):
        raise StatusBadReply("reply answers another request")
    if not reply.get("ok"):
        error = reply.get("error") or {}
        raise StatusRejected(error.get("message") or "request refused", error.get("id"))
    return reply


def _reachable(endpoint: str) -> None:
    # zmq connects lazily and would wait the whole timeout for a socket file that is gone.
    if endpoint.startswith("ipc://") and not os.path.exists(endpoint[len("ipc://") :]):
        raise StatusUnreachable(f"socket {endpoint[len('ipc://'):]} is gone: the kernel has exited")


def request_many(
    targets: Sequence[Target],
    kind: str,
    timeout: float = DEFAULT_TIMEOUT,
    context=None,
    **fields,
) -> List[Union[dict, StatusError]]:
    """Asks every target at once; each result is the reply or the StatusError for that target.

    Each target gets ``timeout`` seconds from the moment all requests are sent.
    """
    import zmq

    ctx = context or zmq.Context.instance()
    results: List[Union[dict, StatusError, None]] = [None] * len(targets)
    sockets: Dict[zmq.Socket, Tuple[int, str]] = {}
    poller = zmq.Poller()
    try:
        for i, target in enumerate(targets):
            try:
                _reachable(target.endpoint)
                sock = ctx.socket(zmq.DEALER)
                sock.setsockopt(zmq.LINGER, 0)
                sock.connect(target.endpoint)
            except StatusError as exc:
                results[i] = exc
                continue
            except zmq.ZMQError as exc:
                results[i] = StatusUnreachable(f"cannot connect to {target.endpoint}: {exc}")
                continue
            body = make_request(kind, **fields)
            sockets[sock] = (i, body["id"])
            sock.send_multipart(encode(body, target.key))
            poller.register(sock, zmq.POLLIN)
        deadline = time.monotonic() + timeout
        pending = set(sockets)
        while pending:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            for sock, _ in poller.poll(left * 1000):
                if sock not in pending:
                    continue
                i, request_id = sockets[sock]
                pending.discard(sock)
                poller.unregister(sock)
                try:
                    results[i] = decode(sock.recv_multipart(), targets[i].key, request_id)
                except StatusError as exc:
                    results[i] = exc
        for sock in pending:
            i, _ = sockets[sock]
            results[i] = StatusTimeout(f"no answer within {timeout:g} s")
    finally:
        for sock in sockets:
            sock.close(linger=0)
    return results  # type: ignore[return-value]


def request(target: Target, kind: str, timeout: float = DEFAULT_TIMEOUT, context=None, **fields) -> dict:
    """One request; raises StatusError."""
    result = request_many([target], kind, timeout, context, **fields)[0]
    if isinstance(result, StatusError):
        raise result
    return result


def verify_record(frames: Sequence[bytes], key: Optional[bytes]) -> Optional[dict]:
    """A published record ``[b"record", signature, body]`` as a dict, or None if it is not one of ours."""
    if len(frames) != 3 or frames[0] != b"record":
        return None
    if key and not hmac.compare_digest(frames[1], sign(key, frames[2]).encode()):
        return None
    try:
        message = json.loads(frames[2])
    except ValueError:
        return None
    return message if isinstance(message, dict) and message.get("kind") == "record" else None


class Subscriber:
    """SUB sockets on the kernels' publish endpoints; kernels come and go with add/remove."""

    def __init__(self, context=None):
        import zmq

        self._zmq = zmq
        self._ctx = context or zmq.Context.instance()
        self._poller = zmq.Poller()
        self._by_name: Dict[str, "zmq.Socket"] = {}
        self._targets: Dict["zmq.Socket", Target] = {}

    def __contains__(self, name: str) -> bool:
        return name in self._by_name

    def names(self) -> List[str]:
        return list(self._by_name)

    def add(self, name: str, target: Target) -> None:
        if name in self._by_name:
            return
        zmq = self._zmq
        sock = self._ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SUBSCRIBE, b"record")
        sock.connect(target.endpoint)
        self._poller.register(sock, zmq.POLLIN)
        self._by_name[name] = sock
        self._targets[sock] = target

    def remove(self, name: str) -> None:
        sock = self._by_name.pop(name, None)
        if sock is not None:
            self._poller.unregister(sock)
            self._targets.pop(sock, None)
            sock.close(linger=0)

    def poll(self, timeout: float) -> List[Tuple[Target, dict]]:
        """Records that arrive within ``timeout`` seconds (those with a bad signature are dropped)."""
        out: List[Tuple[Target, dict]] = []
        for sock, _ in self._poller.poll(timeout * 1000):
            target = self._targets[sock]
            while True:
                try:
                    frames = sock.recv_multipart(self._zmq.NOBLOCK)
                except self._zmq.Again:
                    break
                record = verify_record(frames, target.key)
                if record is not None:
                    out.append((target, record))
        return out

    def close(self) -> None:
        for name in list(self._by_name):
            self.remove(name)
