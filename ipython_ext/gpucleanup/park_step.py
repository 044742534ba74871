"""The park helper: one step of parking another process, in a short-lived process of its own.

``python -m gpucleanup.park_step STEP PID [LOCK_TIMEOUT_MS]`` runs one of the CUDA driver's
checkpoint calls (``state``, ``lock``, ``checkpoint``, ``restore``, ``unlock``) on process
``PID`` and prints one JSON object on stdout: the library's step result, or
``{"ok": false, "refused": "<sentence>", "status": N}`` when no step could be run (a driver
without checkpoint calls, a pid that is not another process, a failed ``cuInit``).

This process calls ``cuInit`` itself: the rule never to initialise CUDA is about the kernel's
process, which never runs this module. Each step gets a process of its own because a
long-lived process that had done a cycle was seen to hang the next lock (share/FACTS.md §10);
the caller (:mod:`gpucleanup.park`) bounds it in time and kills it past its limit.
"""

from __future__ import annotations

import json
import sys
from typing import List, Optional

STEPS = ("state", "lock", "checkpoint", "restore", "unlock")


def main(argv: Optional[List[str]] = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) not in (2, 3) or args[0] not in STEPS or not args[1].isdigit() or (len(args) == 3 and not args[2].isdigit()):
        print(f"usage: python -m gpucleanup.park_step {{{','.join(STEPS)}}} PID [LOCK_TIMEOUT_MS]", file=sys.stderr)
        return 2
    from . import _native

    try:
        result = _native.checkpoint_step(int(args[1]), args[0], int(args[2]) if len(args) == 3 else 0)
    except _native.NativeError as exc:
        result = {"ok": False, "step": args[0], "pid": int(args[1]), "refused": str(exc), "status": exc.status}
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
