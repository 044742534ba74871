#!/usr/bin/env python3
"""Writes the seed corpus of the fuzz targets into tests/fuzz/corpus/<target>/.

Each seed is one input in the target's own framing (see the comment at the top of each
tests/fuzz/fuzz_*.cpp): a mode byte, then frames separated by b"\\xff\\xfe". The seeds are
small and made by hand here, so that they can be read and changed; findings of the fuzzer
that are kept go into the same directories under names starting with "finding-" and are
not written by this script.

Usage: python3 tests/fuzz/make_corpus.py   (rewrites the seeds it knows, leaves others alone)
"""
import hashlib
import hmac
import json
import pathlib
import struct

HERE = pathlib.Path(__file__).resolve().parent
SEP = b"\xff\xfe"
KEY = b"fuzz-key-0123456789abcdef"  # kKey of fuzz_status_request.cpp
NOW = 1_700_000_000_000_000_000  # kNow of the targets

# fuzz_status_request mode bits
HAS_KEY, REQUIRE, SIGN, TWICE, SMALL = 0x01, 0x02, 0x04, 0x08, 0x10


def body(kind, **fields):
    request = {"protocol": 1, "kind": kind, "id": "3f1c2a9e-5b7d-4e8f-9a0b-1c2d3e4f5a6b", "time_ns": NOW}
    request.update(fields)
    return json.dumps(request, separators=(",", ":")).encode()


def sign(data, key=KEY):
    return hmac.new(key, data, hashlib.sha256).hexdigest().encode()


def request_seeds():
    seeds = {}
    # The client's own framing: [b"", signature, body] after the routing id; the target signs.
    for kind, fields in [("status", {}), ("history", {"limit": 5}), ("ping", {}), ("drain", {"timeout_s": 2.5}),
                         ("drain", {})]:
        name = kind + ("-" + "-".join(fields) if fields else "")
        seeds[f"signed-{name}"] = bytes([HAS_KEY | SIGN]) + SEP + body(kind, **fields)
        seeds[f"signed-required-twice-{name}"] = bytes([HAS_KEY | REQUIRE | SIGN | TWICE]) + SEP + body(kind, **fields)
    # Signed in the input itself, as a client would.
    status = body("status")
    seeds["presigned-status"] = bytes([HAS_KEY | REQUIRE]) + SEP + sign(status) + SEP + status
    seeds["bad-signature"] = bytes([HAS_KEY | REQUIRE]) + SEP + b"0" * 64 + SEP + status
    seeds["signature-upper-case"] = bytes([HAS_KEY]) + SEP + sign(status).upper() + SEP + status
    seeds["signed-but-no-key"] = bytes([SIGN]) + SEP + status
    # Unsigned: [b"", b"", body], [body], REQ's [b"", body].
    seeds["unsigned-status"] = bytes([0]) + SEP + SEP + status
    seeds["unsigned-bare-ping"] = bytes([0]) + body("ping")
    seeds["unsigned-req-history"] = bytes([HAS_KEY | TWICE]) + SEP + body("history", limit=0)
    seeds["unsigned-where-required"] = bytes([HAS_KEY | REQUIRE]) + SEP + SEP + status
    seeds["unsigned-drain"] = bytes([HAS_KEY]) + SEP + SEP + body("drain")
    seeds["keyless-drain"] = bytes([SIGN]) + SEP + body("drain")
    # Frames, sizes, JSON.
    seeds["three-frames"] = bytes([0]) + b"a" + SEP + b"b" + SEP + b"c"
    seeds["no-frame"] = bytes([0])
    seeds["oversized"] = bytes([SMALL | SIGN | HAS_KEY]) + SEP + body("status", padding="x" * 300)
    seeds["not-json"] = bytes([HAS_KEY | SIGN]) + SEP + b"{not json"
    seeds["not-utf8"] = bytes([HAS_KEY | SIGN]) + SEP + b'{"kind":"\xc3\x28"}'
    seeds["array"] = bytes([HAS_KEY | SIGN]) + SEP + b"[1,2]"
    seeds["deep-40"] = bytes([HAS_KEY | SIGN]) + SEP + b"[" * 40 + b"]" * 40
    deep = b'{"protocol":1,"kind":"ping","time_ns":%d,"x":' % NOW + b"[" * 31 + b"]" * 31 + b"}"
    seeds["deep-32-taken"] = bytes([HAS_KEY | SIGN]) + SEP + deep
    seeds["deep-33"] = bytes([HAS_KEY | SIGN]) + SEP + deep.replace(b"[" * 31, b"[" * 32).replace(b"]" * 31, b"]" * 32)
    # Fields.
    seeds["protocol-2"] = bytes([HAS_KEY | SIGN]) + SEP + body("status", protocol=2)
    seeds["protocol-string"] = bytes([HAS_KEY | SIGN]) + SEP + body("status", protocol="1")
    seeds["kind-unknown"] = bytes([HAS_KEY | SIGN | TWICE]) + SEP + body("reboot")
    seeds["kind-number"] = bytes([HAS_KEY | SIGN]) + SEP + body(7)
    seeds["id-too-long"] = bytes([HAS_KEY | SIGN]) + SEP + body("ping", id="i" * 257)
    seeds["id-256-unicode"] = bytes([HAS_KEY | SIGN]) + SEP + body("ping", id="\u00e9" * 128)
    seeds["id-number"] = bytes([HAS_KEY | SIGN]) + SEP + body("ping", id=12)
    seeds["id-null"] = bytes([0]) + SEP + SEP + body("ping", id=None)
    seeds["no-time"] = bytes([HAS_KEY | SIGN]) + SEP + json.dumps({"protocol": 1, "kind": "status"}).encode()
    seeds["time-float"] = bytes([HAS_KEY | SIGN]) + SEP + body("status", time_ns=1.7e18)
    seeds["time-stale"] = bytes([HAS_KEY | SIGN]) + SEP + body("status", time_ns=NOW - 61_000_000_000)
    seeds["time-future"] = bytes([HAS_KEY | SIGN]) + SEP + body("status", time_ns=NOW + 61_000_000_000)
    seeds["time-edge"] = bytes([HAS_KEY | SIGN]) + SEP + body("status", time_ns=NOW + 60_000_000_000)
    seeds["time-huge"] = bytes([HAS_KEY | SIGN]) + SEP + body("status", time_ns=2**64 - 1)
    seeds["limit-negative"] = bytes([HAS_KEY | SIGN]) + SEP + body("history", limit=-1)
    seeds["limit-huge"] = bytes([HAS_KEY | SIGN]) + SEP + body("history", limit=2**64 - 1)
    seeds["limit-null"] = bytes([HAS_KEY | SIGN]) + SEP + body("history", limit=None)
    seeds["timeout-too-long"] = bytes([HAS_KEY | SIGN]) + SEP + body("drain", timeout_s=1e9)
    seeds["timeout-negative"] = bytes([HAS_KEY | SIGN]) + SEP + body("drain", timeout_s=-0.5)
    seeds["timeout-string"] = bytes([HAS_KEY | SIGN]) + SEP + body("drain", timeout_s="1")
    seeds["timeout-max"] = bytes([HAS_KEY | SIGN]) + SEP + body("drain", timeout_s=60)
    return seeds


def config(**fields):
    return json.dumps(fields).encode()


def native_json_seeds():
    seeds = {}
    full = {"endpoint": "ipc:///run/user/1000/gpucleanup/4242.sock", "key": "0123abcd-4567-89ef", "history_limit": 50,
            "kernel": {"pid": 4242, "kernel_id": "k-1", "notebook": "a.ipynb"}, "pub_endpoint": "", "require_signature": False,
            "max_request_bytes": 65536, "replay_window_s": 60, "snapshot_timeout_s": 0.25, "drain_timeout_s": 10,
            "max_drain_timeout_s": 60, "max_peers": 64, "peer_idle_timeout_s": 10, "peer_grace_s": 1,
            "handshake_timeout_s": 2, "heartbeat_interval_s": 2}
    seeds["config-full"] = b"\x00" + json.dumps(full).encode()
    seeds["config-tcp"] = b"\x00" + config(endpoint="tcp://127.0.0.1:0", key="k", kernel=None)
    seeds["config-no-key"] = b"\x00" + config(endpoint="ipc:///tmp/x/s", require_signature=True)
    seeds["config-tiny-requests"] = b"\x00" + config(endpoint="inproc://x", key="k", max_request_bytes=10)
    seeds["config-long-window"] = b"\x00" + config(endpoint="inproc://x", key="k", replay_window_s=3.15e7)
    seeds["config-replay-window-centuries"] = b"\x00" + config(endpoint="inproc://x", key="k", replay_window_s=1e10)
    seeds["config-snapshot-timeout-huge"] = b"\x00" + config(endpoint="inproc://x", snapshot_timeout_s=1e300)
    seeds["config-no-endpoint"] = b"\x00" + config(key="k")
    seeds["config-bad-count"] = b"\x00" + config(endpoint="ipc:///x", history_limit=-1)
    seeds["config-bad-peers"] = b"\x00" + config(endpoint="ipc:///x", max_peers=0)
    seeds["config-bad-seconds"] = b"\x00" + config(endpoint="ipc:///x", replay_window_s="60")
    seeds["config-bad-bool"] = b"\x00" + config(endpoint="ipc:///x", require_signature=1)
    seeds["config-array"] = b"\x00" + b'["endpoint"]'
    seeds["config-deep-kernel"] = b"\x00" + b'{"endpoint":"inproc://x","kernel":' + b"[" * 200 + b"]" * 200 + b"}"
    seeds["state-idle"] = b"\x01" + b'{"state": "idle"}'
    seeds["state-running"] = b"\x01" + b'{"state": "running", "cell": 12, "since_ns": %d}' % NOW
    seeds["state-not-object"] = b"\x01" + b'"idle"'
    seeds["state-bom"] = b"\x01" + b'\xef\xbb\xbf{"state": "idle"}'
    record = {"cell": 3, "kind": "after_cell", "devices": [{"index": 0, "used_bytes": 1 << 30, "freed_bytes": 0}],
              "wall_s": 0.25, "note": "caf\u00e9"}
    seeds["record"] = b"\x02" + json.dumps(record).encode()
    seeds["record-spaces"] = b"\x02" + b" \n\t" + json.dumps(record, indent=1).encode() + b"\r\n "
    seeds["record-bom"] = b"\x02" + b"\xef\xbb\xbf" + json.dumps(record).encode()
    seeds["record-trailing"] = b"\x02" + b"{} {}"
    seeds["record-array"] = b"\x02" + b"[{}]"
    seeds["record-escapes"] = b"\x02" + b'{"a\\u0000b": "\\ud83d\\ude00", "c": [1e308, -0, 1E-5, true, null]}'
    seeds["record-not-utf8"] = b"\x02" + b'{"a": "\xff"}'
    seeds["candidates"] = b"\x03" + b'["libcupti.so.13", "/usr/local/cuda/extras/CUPTI/lib64/libcupti.so"]'
    seeds["candidates-empty"] = b"\x03" + b"[]"
    seeds["candidates-number"] = b"\x03" + b'["libcupti.so", 13]'
    seeds["candidates-object"] = b"\x03" + b'{"a": "b"}'
    return seeds


def signature_seeds():
    seeds = {}
    data = b"what do ya want for nothing?"
    good = hmac.new(b"Jefe", data, hashlib.sha256).hexdigest().encode()
    seeds["rfc4231-2"] = b"\x00" + b"Jefe" + SEP + data + SEP + good
    seeds["rfc4231-2-wrong"] = b"\x02" + b"Jefe" + SEP + data + SEP + good[:-1] + b"0"
    seeds["short"] = b"\x04" + b"Jefe" + SEP + data + SEP + b"5bdc"
    seeds["empty-key"] = b"\x06" + SEP + b"{}" + SEP + hmac.new(b"", b"{}", hashlib.sha256).hexdigest().encode()
    seeds["long-key"] = b"\x08" + b"\xaa" * 131 + SEP + b"Test Using Larger Than Block-Size Key" + SEP
    seeds["nothing"] = b"\x00"

    def admissions(window_ns, capacity, ops):
        out = b"\x01" + struct.pack("<q", window_ns) + bytes([capacity])
        for signature, request, now in ops:
            out += bytes([signature]) + struct.pack("<q", request) + struct.pack("<q", now)
        return out

    seeds["replay-minute"] = admissions(60_000_000_000, 4, [(0, NOW, NOW), (0, NOW, NOW + 1), (1, NOW - 61_000_000_000, NOW),
                                                            (2, NOW + 61_000_000_000, NOW), (3, NOW, NOW + 70_000_000_000)])
    seeds["replay-capacity"] = admissions(1000, 2, [(i, 1500, 1500) for i in range(6)] + [(0, 1500, 1500)])
    seeds["replay-clock-back"] = admissions(1000, 8, [(0, 5000, 5000), (1, 100, 100), (0, 5000, 5000)])
    seeds["replay-long-window"] = admissions(2**63 - 1, 3, [(0, NOW, NOW), (1, -2**63, NOW), (2, 2**63 - 1, NOW)])
    return seeds


def main():
    for target, seeds in [("fuzz_status_request", request_seeds()), ("fuzz_native_json", native_json_seeds()),
                          ("fuzz_signature", signature_seeds())]:
        directory = HERE / "corpus" / target
        directory.mkdir(parents=True, exist_ok=True)
        for name, data in seeds.items():
            (directory / name).write_bytes(data)
        print(f"{target}: {len(seeds)} seeds in {directory.relative_to(HERE.parent.parent)}")


if __name__ == "__main__":
    main()
