"""Park a process: all of its GPU memory, context included, into host memory and back.

The CUDA driver's checkpoint calls do the work (share/FACTS.md §10); this module is the
state machine around them, after the CUDA checkpoint utility and CRIU: every step (lock,
checkpoint, restore, unlock, and each look at the state) runs in a helper process of its own
(:mod:`gpucleanup.park_step`, whose ``cuInit`` is its own) with a time limit, and every
outcome names the state the process is left in and what to do next:

- a lock that does not come in time leaves the process running;
- a failed (or hung) checkpoint unlocks it again: it runs as before;
- a failed restore leaves it parked, its memory safe in host memory, and says how to retry;
- a step that outruns its limit is killed and reported, and the state is read again by a
  fresh helper, so nothing is ever half-parked silently.

Nothing here runs in the parked process, and no driver call is made by the calling process
either: this module only starts helpers and reads their JSON.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional

__all__ = ["Limits", "Step", "Outcome", "ParkRefused", "step", "state", "park", "resume", "host_memory_refusal",
           "unrestorable_refusal", "process_gpu_usage", "loads_jax"]

#: The process states of the driver (CUprocessState), as the helper names them.
RUNNING, LOCKED, CHECKPOINTED, FAILED = "running", "locked", "checkpointed", "failed"


@dataclass(frozen=True)
class Limits:
    """How long each step may take, in seconds, before its helper is killed.

    The checkpoint and the restore move the process's whole device memory (measured: about
    2.5 GB/s to park and 7 GB/s to restore, share/FACTS.md §10): their defaults leave room for
    the largest GPUs. The lock is also bounded by the driver itself (``lock_timeout_s``), so
    that a process busy in a CUDA call is left running rather than waited for.
    """

    state_s: float = 30.0
    lock_s: float = 30.0
    lock_timeout_s: float = 10.0
    checkpoint_s: float = 300.0
    restore_s: float = 300.0
    unlock_s: float = 30.0

    def of(self, name: str) -> float:
        return float(getattr(self, f"{name}_s"))


@dataclass
class Step:
    """One helper's step: what the driver answered and the state after it."""

    name: str
    ok: bool
    result: Optional[str] = None          # CUDA_SUCCESS or the error's name
    state_before: Optional[str] = None
    state: Optional[str] = None           # null: the driver could not say (not a CUDA process, gone)
    seconds: float = 0.0                  # the helper's whole run, start-up included
    hung: bool = False                    # outran its limit and was killed
    refused: Optional[str] = None         # no step could be run: the library's sentence

    def as_dict(self) -> dict:
        return dict(self.__dict__)


@dataclass
class Outcome:
    """What a park or a resume did: ``ok``, the state the process is in now, one sentence."""

    action: str                      # "park" or "resume"
    pid: int
    ok: bool
    state: Optional[str]
    message: str
    steps: List[Step] = field(default_factory=list)
    seconds: float = 0.0
    changed: bool = False            # the process was parked (park) or brought back (resume)
    parked_bytes: Optional[int] = None  # its device memory before the park (nvidia-smi), when known
    waited_s: float = 0.0            # a kernel's park: how long it waited for a release or a drain under way to end

    def as_dict(self) -> dict:
        out = {k: v for k, v in self.__dict__.items() if k != "steps"}
        out["steps"] = [s.as_dict() for s in self.steps]
        return out


class ParkRefused(Exception):
    """Nothing was done: the sentence says why and what to do."""


# ------------------------------------------------------------------ one step


def step(pid: int, name: str, limits: Limits = Limits(), python: Optional[str] = None,
         env: Optional[Dict[str, str]] = None) -> Step:
    """Runs one step in a fresh helper process, killed past ``limits``; never raises for the driver's answer."""
    args = [python or sys.executable, "-m", "gpucleanup.park_step", name, str(int(pid))]
    if name == "lock":
        args.append(str(int(limits.lock_timeout_s * 1000)))
    started = time.monotonic()
    try:
        done = subprocess.run(args, capture_output=True, timeout=limits.of(name), env=env, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        return Step(name, False, hung=True, seconds=time.monotonic() - started)
    seconds = time.monotonic() - started
    try:
        reply = json.loads(done.stdout.decode("utf-8", "replace").strip().splitlines()[-1])
        if not isinstance(reply, dict):
            raise ValueError("not an object")
    except (ValueError, IndexError):
        why = done.stderr.decode("utf-8", "replace").strip().splitlines()
        detail = why[-1] if why else f"exit status {done.returncode}"
        return Step(name, False, refused=f"[gpucleanup.park.610] the park helper gave no answer ({detail[:300]})",
                    seconds=seconds)
    return Step(name, bool(reply.get("ok")), result=reply.get("result"), state_before=reply.get("state_before"),
                state=reply.get("state"), seconds=seconds, refused=reply.get("refused"))


def state(pid: int, limits: Limits = Limits(), env: Optional[Dict[str, str]] = None) -> Step:
    """The process's state as the driver sees it, from a helper (``.state``; None if it cannot say)."""
    return step(pid, "state", limits, env=env)


# ------------------------------------------------------------------ host memory


_MARGIN_FRACTION = 0.05
_MARGIN_MIN = 1 << 30


def host_memory_refusal(parked_bytes: Optional[int], meminfo: str = "/proc/meminfo") -> Optional[str]:
    """A sentence when host memory cannot hold ``parked_bytes`` (MemAvailable less a margin), else None.

    The checkpoint copies the whole device state into the parked process's host memory; the
    margin (5% of MemTotal, at least 1 GiB) keeps the machine out of swap and away from the
    OOM killer, which would take the parked kernel with its data.
    """
    if not parked_bytes:
        return None
    fields: Dict[str, int] = {}
    try:
        with open(meminfo, encoding="ascii") as fh:
            for line in fh:
                key, _, rest = line.partition(":")
                parts = rest.split()
                if parts and parts[0].isdigit():
                    fields[key] = int(parts[0]) * 1024
    except OSError:
        return None
    if "MemAvailable" not in fields:
        return None
    margin = max(_MARGIN_MIN, int(fields.get("MemTotal", 0) * _MARGIN_FRACTION))
    if parked_bytes + margin <= fields["MemAvailable"]:
        return None
    from .report import format_bytes

    return (f"[gpucleanup.park.621] host memory cannot hold this kernel's GPU memory: parking needs "
            f"{format_bytes(parked_bytes)} plus a margin of {format_bytes(margin)}, and only "
            f"{format_bytes(fields['MemAvailable'])} is available: free host memory (or park a smaller kernel)")


# ------------------------------------------------------------------ park and resume


def _resume_hint(pid: int) -> str:
    return f"python -m gpucleanup.park resume {pid}"


def _refusal_for_state(pid: int, found: Step) -> str:
    if found.refused:
        return found.refused
    if found.hung:
        return (f"[gpucleanup.park.611] the driver did not say within {found.seconds:.0f} s what state process "
                f"{pid} is in: nothing was done; check the GPU with nvidia-smi")
    if found.state is None:
        return (f"[gpucleanup.park.612] process {pid} is not a CUDA process the driver can park "
                f"({found.result}): it has not used the GPU, or it has exited")
    if found.state == CHECKPOINTED:
        return f"[gpucleanup.park.613] process {pid} is already parked: resume it with {_resume_hint(pid)}"
    if found.state == LOCKED:
        return (f"[gpucleanup.park.614] process {pid} is locked by an earlier step that did not finish: "
                f"bring it back with {_resume_hint(pid)}")
    return (f"[gpucleanup.park.615] the driver reports process {pid} as {found.state}: it cannot be parked; "
            "save what you can and restart it")


def park(pid: int, limits: Limits = Limits(), env: Optional[Dict[str, str]] = None,
         parked_bytes: Optional[int] = None) -> Outcome:
    """Lock, then checkpoint process ``pid``; on any failure leave it running (or say exactly where it is).

    Raises :class:`ParkRefused` when nothing was done (the process is not running, the driver
    has no checkpoint calls, host memory cannot hold its device memory, ...). Otherwise returns
    an :class:`Outcome` whose ``state`` is ``checkpointed`` when the park worked.
    ``parked_bytes``: the process's device memory when the caller knows it; else it is read
    from ``nvidia-smi`` where there is one.
    """
    started = time.monotonic()
    steps: List[Step] = []
    usage = process_gpu_usage(pid)
    if parked_bytes is None and usage is not None:
        parked_bytes = sum(usage.values())

    def outcome(ok: bool, now: Optional[str], message: str, changed: bool = False) -> Outcome:
        return Outcome("park", pid, ok, now, message, steps, time.monotonic() - started, changed, parked_bytes)

    found = state(pid, limits, env)
    steps.append(found)
    if found.refused or found.hung or found.state != RUNNING:
        raise ParkRefused(_refusal_for_state(pid, found))
    refusal = (unrestorable_refusal(pid, len(usage or {}), loads_jax(pid) if usage and len(usage) > 1 else False)
               or host_memory_refusal(parked_bytes))
    if refusal:
        raise ParkRefused(refusal)

    locked = step(pid, "lock", limits, env=env)
    steps.append(locked)
    if locked.refused:
        raise ParkRefused(locked.refused)
    if not locked.ok:
        now = locked.state if not locked.hung else _state_after_hang(pid, limits, env, steps)
        if now == LOCKED:  # a hung lock that took after all: give the process back
            return _unlock_back(pid, limits, env, steps, outcome, f"the lock step outran its limit of "
                                f"{limits.lock_s:.0f} s")
        if locked.result == "CUDA_ERROR_NOT_READY":
            why = (f"[gpucleanup.park.616] process {pid} did not stop its GPU work within "
                   f"{limits.lock_timeout_s:.0f} s: it was not parked and runs as before; park it when it is idle")
        elif locked.hung:
            why = (f"[gpucleanup.park.617] the lock step outran its limit of {limits.lock_s:.0f} s and was stopped: "
                   f"process {pid} is {now or 'in a state the driver did not report'}")
        else:
            why = (f"[gpucleanup.park.618] the driver refused to lock process {pid} ({locked.result}): it was not "
                   f"parked and is {now or 'in a state the driver did not report'}")
        return outcome(False, now, why)

    checkpointed = step(pid, "checkpoint", limits, env=env)
    steps.append(checkpointed)
    now = checkpointed.state if not checkpointed.hung else _state_after_hang(pid, limits, env, steps)
    if checkpointed.ok or now == CHECKPOINTED:
        return outcome(True, CHECKPOINTED, f"parked process {pid}", changed=True)
    if now == LOCKED:
        what = (f"outran its limit of {limits.checkpoint_s:.0f} s" if checkpointed.hung
                else f"failed with {checkpointed.result}")
        return _unlock_back(pid, limits, env, steps, outcome, f"the checkpoint {what}")
    return outcome(False, now, f"[gpucleanup.park.619] the checkpoint of process {pid} "
                   f"{'outran its limit' if checkpointed.hung else 'failed with ' + str(checkpointed.result)} and "
                   f"left it {now or 'in a state the driver did not report'}: "
                   + ("try " + _resume_hint(pid) if now in (LOCKED, CHECKPOINTED) else
                      "its GPU state may be lost; save what you can and restart it"))


def _state_after_hang(pid: int, limits: Limits, env: Optional[Dict[str, str]], steps: List[Step]) -> Optional[str]:
    again = state(pid, limits, env)
    steps.append(again)
    return again.state


def _unlock_back(pid, limits, env, steps, outcome, what: str) -> Outcome:
    unlocked = step(pid, "unlock", limits, env=env)
    steps.append(unlocked)
    now = unlocked.state if not unlocked.hung else _state_after_hang(pid, limits, env, steps)
    if now == RUNNING:
        return outcome(False, RUNNING, f"[gpucleanup.park.620] {what}: process {pid} was unlocked and runs as "
                       "before, nothing was parked")
    return outcome(False, now, f"[gpucleanup.park.622] {what}, and unlocking it again "
                   f"{'outran its limit' if unlocked.hung else 'failed with ' + str(unlocked.result)}: process "
                   f"{pid} is {now or 'in a state the driver did not report'}; try {_resume_hint(pid)}")


def resume(pid: int, limits: Limits = Limits(), env: Optional[Dict[str, str]] = None) -> Outcome:
    """Bring process ``pid`` back from whatever state a park left it in (restore, then unlock).

    Driven by the driver's own state, not by what was recorded: a checkpointed process is
    restored and unlocked, a locked one unlocked, a running one left alone (``changed`` False).
    A failed restore leaves it parked, its memory still in host memory, and says how to retry.
    """
    started = time.monotonic()
    steps: List[Step] = []

    def outcome(ok: bool, now: Optional[str], message: str, changed: bool = False) -> Outcome:
        return Outcome("resume", pid, ok, now, message, steps, time.monotonic() - started, changed)

    found = state(pid, limits, env)
    steps.append(found)
    if found.refused:
        raise ParkRefused(found.refused)
    if found.hung or found.state is None or found.state == FAILED:
        return outcome(False, found.state, _refusal_for_state(pid, found) if found.state != FAILED else
                       f"[gpucleanup.park.623] the driver reports process {pid} as failed: it cannot be resumed; "
                       "its GPU state is lost, restart it")
    if found.state == RUNNING:
        return outcome(True, RUNNING, f"process {pid} is not parked: nothing to resume")
    if found.state == CHECKPOINTED:
        restored = step(pid, "restore", limits, env=env)
        steps.append(restored)
        now = restored.state if not restored.hung else _state_after_hang(pid, limits, env, steps)
        if not (restored.ok or now == LOCKED):
            what = (f"outran its limit of {limits.restore_s:.0f} s" if restored.hung
                    else f"failed with {restored.result}")
            if now == CHECKPOINTED:
                return outcome(False, now, f"[gpucleanup.park.624] the restore of process {pid} {what}: it stays "
                               f"parked, its GPU memory safe in host memory; retry with {_resume_hint(pid)}")
            return outcome(False, now, f"[gpucleanup.park.625] the restore of process {pid} {what} and left it "
                           f"{now or 'in a state the driver did not report'}: its GPU state may be lost; save "
                           "what you can and restart it")
    unlocked = step(pid, "unlock", limits, env=env)
    steps.append(unlocked)
    now = unlocked.state if not unlocked.hung else _state_after_hang(pid, limits, env, steps)
    if unlocked.ok or now == RUNNING:
        return outcome(True, RUNNING, f"resumed process {pid}", changed=True)
    return outcome(False, now, f"[gpucleanup.park.626] process {pid} was restored but unlocking it "
                   f"{'outran its limit' if unlocked.hung else 'failed with ' + str(unlocked.result)}: it is "
                   f"{now or 'in a state the driver did not report'}; retry with {_resume_hint(pid)}")


def process_gpu_usage(pid: int, timeout: float = 10.0) -> Optional[Dict[str, int]]:
    """The process's device memory per GPU (UUID -> bytes) from ``nvidia-smi --query-compute-apps``;
    ``{}`` when it holds none, None when nvidia-smi cannot say (absent, failed, or the pid unknown here)."""
    try:
        done = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,gpu_uuid,used_memory",
                               "--format=csv,noheader,nounits"], capture_output=True, timeout=timeout,
                              stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if done.returncode != 0:
        return None
    usage: Dict[str, int] = {}
    for line in done.stdout.decode("ascii", "replace").splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 3 and parts[0] == str(pid) and parts[2].isdigit():
            usage[parts[1]] = usage.get(parts[1], 0) + (int(parts[2]) << 20)
    return usage if usage or os.path.exists(f"/proc/{pid}") else None


def process_gpu_bytes(pid: int, timeout: float = 10.0) -> Optional[int]:
    """The process's device memory on every GPU (nvidia-smi), else None."""
    usage = process_gpu_usage(pid, timeout)
    return None if usage is None else sum(usage.values())


def loads_jax(pid: int) -> bool:
    """Whether process ``pid`` has JAX's XLA runtime mapped (``/proc/<pid>/maps``), read without touching it."""
    try:
        with open(f"/proc/{pid}/maps", encoding="utf-8", errors="replace") as fh:
            return any("jaxlib" in line or "xla_extension" in line for line in fh)
    except OSError:
        return False


def unrestorable_refusal(pid: int, gpus: int, jax: bool) -> Optional[str]:
    """A sentence for a process a restore is known not to bring back, else None.

    Measured (share/FACTS.md §10): JAX with contexts on two GPUs was checkpointed, but its restore failed
    and the process was lost, every time; PyTorch on two GPUs and JAX on one came back. So a process with
    JAX loaded and device memory on more than one GPU is refused. cuBLAS, cuDNN and CUDA graphs came back;
    managed memory makes the checkpoint fail cleanly (the process is unlocked and runs on). CUDA IPC, MPS
    and NCCL are not known yet, and are not refused.
    """
    if jax and gpus > 1:
        return (f"[gpucleanup.park.627] process {pid} uses JAX on {gpus} GPUs: a restore of such a process was seen "
                "to fail and lose it, so it is not parked; give it one GPU (CUDA_VISIBLE_DEVICES) to make it "
                "parkable, or free its memory with jax.clear_caches() and del")
    return None

def main(argv: Optional[List[str]] = None) -> int:
    """``python -m gpucleanup.park {state,resume} PID``: what a park left behind, and bringing it back.

    Prints the outcome's sentence (``--json``: the whole outcome); exit status 0 when the process
    runs (or was resumed), 1 when it is still parked or in another state, 2 for bad arguments.
    Parking itself is not offered here: a kernel is parked through gpucleanup's kernel commands,
    which keep its own hooks away from the driver meanwhile.
    """
    import argparse

    parser = argparse.ArgumentParser(prog="python -m gpucleanup.park", description=main.__doc__.splitlines()[0])
    parser.add_argument("action", choices=("state", "resume"))
    parser.add_argument("pid", type=int)
    parser.add_argument("--json", action="store_true", help="print the whole outcome as JSON")
    args = parser.parse_args(argv)
    if args.action == "state":
        found = state(args.pid)
        text = found.refused or (f"process {args.pid} is {found.state}" if found.state else
                                 _refusal_for_state(args.pid, found))
        print(json.dumps(found.as_dict()) if args.json else text)
        return 0 if found.state == RUNNING else 1
    try:
        outcome = resume(args.pid)
    except ParkRefused as refused:
        print(json.dumps({"ok": False, "message": str(refused)}) if args.json else str(refused))
        return 1
    print(json.dumps(outcome.as_dict()) if args.json else outcome.message)
    return 0 if outcome.ok else 1


if __name__ == "__main__":
    sys.exit(main())
