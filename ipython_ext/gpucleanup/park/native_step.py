"""The park helper: one step of parking another process, in a short-lived process of its own (:func:`main`).

The caller (:mod:`gpucleanup.park`) bounds it in time and kills it past its limit. This process calls ``cuInit``
itself; the kernel's process never runs this module.
"""

from __future__ import annotations

import json
import sys
from typing import List, Optional, Tuple

STEPS = ("state", "lock", "checkpoint", "restore", "unlock", "resume")
USAGE = f"usage: python -m gpucleanup.park.native_step {{{','.join(STEPS)}}} PID [LOCK_TIMEOUT_MS]"

#: The library takes the pid as a C int and the lock timeout as a C unsigned int: a larger number would
#: wrap there (``4294967297`` would act on pid 1), so these bounds are checked here, before it is loaded.
PID_MAX = 2 ** 31 - 1
LOCK_TIMEOUT_MS_MAX = 2 ** 32 - 1


def decimal(text: str, name: str, high: int, low: int, fix: str) -> Tuple[Optional[int], str]:
    """``text`` as an int in ``low..high``, or None and the sentence that says what is wrong and ``fix``.

    Only ASCII digits count: ``int()`` alone would also take a sign, spaces, underscores and other
    scripts' digits, and a number not written plainly is more likely a mistake than meant.
    """
    shown = repr(text) if len(text) <= 40 else repr(text[:40]) + "..."
    if not text or not all("0" <= c <= "9" for c in text):
        return None, (f"{name} must be a decimal integer from {low} to {high} in digits alone (no sign, space or "
                      f"exponent), got {shown}: {fix}")
    digits = text.lstrip("0") or "0"
    # Its length first: int() of thousands of digits is slow, or refused by Python itself.
    value = int(digits) if len(digits) <= len(str(high)) else None
    if value is None or not low <= value <= high:
        return None, f"{name} must be from {low} to {high}, got {shown}: {fix}"
    return value, ""


def main(argv: Optional[List[str]] = None) -> int:
    """``python -m gpucleanup.park.native_step STEP PID [LOCK_TIMEOUT_MS]``: one of the CUDA driver's checkpoint calls.

    Runs ``state``, ``lock``, ``checkpoint``, ``restore`` or ``unlock`` (``resume`` is a restore and an unlock with
    the process's other threads held meanwhile) on process ``PID`` and prints one JSON object on stdout: the
    library's step result, or ``{"ok": false, "refused": "<sentence>", "status": N}`` when no step could be run (a
    driver without checkpoint calls, a pid that is not another process, a failed ``cuInit``). ``PID`` (1 to
    2**31 - 1) and ``LOCK_TIMEOUT_MS`` (0 to 2**32 - 1) are checked before the library is loaded: anything else
    prints the usage and a sentence on stderr, and exits with status 2.

    This process calls ``cuInit`` itself: the rule never to initialise CUDA is about the kernel's process, which
    never runs this module. Each step gets a process of its own because a long-lived process that had done a cycle
    was seen to hang the next lock (share/FACTS.md §10).
    """
    args = sys.argv[1:] if argv is None else list(argv)
    if args and args[0] == "hold":
        return _hold(args[1:])
    if len(args) not in (2, 3) or args[0] not in STEPS:
        print(USAGE, file=sys.stderr)
        return 2
    pid, why = decimal(args[1], "PID", PID_MAX, 1, "pass the id of the process to act on")
    timeout_ms: Optional[int] = 0
    if pid is not None and len(args) == 3:
        timeout_ms, why = decimal(args[2], "LOCK_TIMEOUT_MS", LOCK_TIMEOUT_MS_MAX, 0,
                                  "pass the lock's limit in milliseconds (0: no limit)")
    if pid is None or timeout_ms is None:
        # The sentence last: gpucleanup.park quotes the helper's last line of stderr when it gives no answer.
        print(USAGE, file=sys.stderr)
        print(f"park_step: {why}", file=sys.stderr)
        return 2
    from .. import _native

    try:
        result = _native.checkpoint_step(pid, args[0], timeout_ms)
    except _native.NativeError as exc:
        result = {"ok": False, "step": args[0], "pid": pid, "refused": str(exc), "status": exc.status}
    print(json.dumps(result), flush=True)
    return 0


HOLD_USAGE = "usage: python -m gpucleanup.park.native_step hold PID LIMIT_MS TID[,TID...]"


def _hold(args: List[str]) -> int:
    """``hold PID LIMIT_MS TIDS``: the park's hold while parked (:mod:`gpucleanup.park.parked_hold`)."""
    if len(args) != 3:
        print(HOLD_USAGE, file=sys.stderr)
        return 2
    pid, why = decimal(args[0], "PID", PID_MAX, 1, "pass the id of the process to act on")
    limit_ms: Optional[int] = None
    tids: List[int] = []
    if pid is not None:
        limit_ms, why = decimal(args[1], "LIMIT_MS", 60000, 1, "pass how long the stops may take, in milliseconds")
    if limit_ms is not None:
        for text in args[2].split(",") if args[2] else []:
            tid, why = decimal(text, "TID", PID_MAX, 1, "pass the thread ids to hold, comma-separated")
            if tid is None:
                break
            tids.append(tid)
        else:
            from .parked_hold import serve

            return serve(pid, limit_ms, tids)
    print(HOLD_USAGE, file=sys.stderr)
    print(f"park_step: {why}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
