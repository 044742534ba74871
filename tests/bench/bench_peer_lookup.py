"""What the exporter's gate pays to tell who holds a waiting connection, with many loopback connections open.

At its cap of waiting connections the gate evicts the oldest connection of whoever holds the most, and so asks
whose each newcomer is. Before, each ask read and parsed ``/proc/net/tcp`` and ``tcp6`` (every socket of the
network namespace, printed by the kernel each time); now it asks the kernel by sock_diag, one exact lookup per
connection. Both ways are timed side by side in one process, interleaved round by round, over the same sockets:
``--connections`` loopback connections held open (each is two sockets in the table), one lookup of one
connection per call, as the gate makes at each eviction under churn.

    python tests/bench/bench_peer_lookup.py --connections 300 --calls 300 --json out.json

Prints the median and 90th percentile per call of each way and their ratio. Runs anywhere (no GPU, no root).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "ipython_ext"))
from gpucleanup.outside import exporter  # noqa: E402


def percentile(values, q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--connections", type=int, default=300)
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json")
    args = parser.parse_args()

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(args.connections + 8)
    clients, accepted = [], []
    for _ in range(args.connections):
        clients.append(socket.create_connection(listener.getsockname()))
        accepted.append(listener.accept()[0])
    uid = os.getuid()
    ways = {"proc_net_tcp": exporter._proc_peer_uids, "sock_diag": exporter._diag_peer_uids}
    for name, way in ways.items():  # both must tell the same user before anything is timed
        found = way(accepted[:3])
        assert found == {s: uid for s in accepted[:3]}, (name, found)
    times = {name: [] for name in ways}
    for round_ in range(args.rounds):
        for name, way in (ways.items() if round_ % 2 == 0 else reversed(list(ways.items()))):
            for i in range(args.calls // args.rounds):
                sock = accepted[(round_ * 7919 + i) % len(accepted)]
                started = time.perf_counter()
                way([sock])
                times[name].append(time.perf_counter() - started)
    summary = {name: {"median_ms": round(statistics.median(t) * 1e3, 4), "p90_ms": round(percentile(t, 0.9) * 1e3, 4),
                      "calls": len(t)} for name, t in times.items()}
    ratio = summary["proc_net_tcp"]["median_ms"] / summary["sock_diag"]["median_ms"]
    result = {"connections": args.connections, "sockets_in_table": 2 * args.connections + 1, "summary": summary,
              "median_ratio_proc_over_diag": round(ratio, 1), "cpus": os.cpu_count()}
    for name, s in summary.items():
        print(f"{name:13s} median {s['median_ms']:.4f} ms  p90 {s['p90_ms']:.4f} ms  ({s['calls']} calls)")
    print(f"with {args.connections} loopback connections open: /proc/net/tcp costs {ratio:.1f}x sock_diag per lookup")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    for sock in clients + accepted:
        sock.close()
    listener.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
