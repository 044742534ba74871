"""Parking a kernel from outside it: ``gpucleanup park|resume KERNEL``, ``gpucleanup park --check``, and the
Jupyter Server page's Park and Resume and its automatic park.

The kernel's state is kept through signed ``park`` requests to its status endpoint (:mod:`..protocol.status_client`),
the driver's steps under the lock are :mod:`.kernel_side`'s, the same as the kernel's own park and resume. Before
anything is done, the process at the kernel's pid must belong to whoever owns the kernel's files.
Nothing here makes a driver call in the calling process: each step runs in a helper (:mod:`.steps`).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

from . import steps as park_steps, kernel_side as parking, parked_hold, resume_news
from .lock import peek_note, refused_memo
from ..protocol import status_client
from ..say import printable

__all__ = ["remote_record", "owner_refusal", "refused_before", "process_uid", "park_from_outside", "check_kernel",
           "hold_refused",
           "resume_from_outside", "allow_from_outside", "not_parked_refusal", "outcome_text"]


def remote_record(target, timeout: float, automatic: bool = False) -> parking.RecordStep:
    """The park steps of a kernel's state as signed ``park`` requests to its status endpoint (``target``:
    a :class:`~gpucleanup.protocol.status_client.Target`); a refusal raises status_client's error, its sentence.
    ``automatic``: the begin is a policy's (the server's ``park_idle_after_s``), which the kernel refuses
    while a thread a cell started still runs."""

    def record(step: str, parked_bytes: Optional[int]) -> dict:
        fields: dict = {"step": step}
        if parked_bytes is not None:
            fields["bytes"] = int(parked_bytes)
        if automatic and step == "begin":
            fields["automatic"] = True
        return status_client.request(target, "park", timeout, **fields).get("state") or {}

    return record


def process_uid(pid: int, proc: str = "/proc") -> Optional[int]:
    """The real uid of process ``pid`` (``/proc/<pid>/status``), None when it cannot be read (gone, hidden)."""
    try:
        with open(f"{proc}/{int(pid)}/status", encoding="ascii", errors="replace") as fh:
            for line in fh:
                if line.startswith("Uid:"):
                    fields = line.split()
                    return int(fields[1]) if len(fields) > 1 and fields[1].isdigit() else None
    except OSError:
        return None
    return None


def _user(uid: Optional[int]) -> str:
    try:
        import pwd

        return f"{uid} ({pwd.getpwuid(uid).pw_name})" if uid is not None else "unknown"
    except (KeyError, ImportError):
        return str(uid)


def owner_refusal(pid: int, lock_file: os.PathLike, proc: str = "/proc") -> Optional[str]:
    """A sentence when process ``pid`` does not belong to whoever owns the kernel's files (the directory of
    its key and park lock), else None. A discovery file and a key can be planted in a directory of one's own
    naming any process: root's ``gpucleanup park`` would then checkpoint a third user's process."""
    directory = Path(lock_file).parent
    try:
        owner = os.stat(directory, follow_symlinks=False).st_uid
    except OSError as exc:
        return (f"[gpucleanup.park.644] the kernel's directory {directory} cannot be read ({exc.strerror}): "
                "nothing was done")
    uid = process_uid(pid, proc)
    if uid is None:
        return (f"[gpucleanup.park.612] process {pid} is not a CUDA process the driver can park (it cannot be "
                "seen here): it has not used the GPU, or it has exited")
    if uid != owner:
        return (f"[gpucleanup.park.643] process {pid} belongs to uid {_user(uid)}, not to uid {_user(owner)}, who "
                f"owns {directory}: its discovery file names another user's process, so nothing was done; remove "
                "that file if it is not a kernel's")
    return None


def refused_before(pid: int, lock_file: os.PathLike) -> Optional[str]:
    """``park.652`` when the driver refused a park of the kernel for what it holds (the lock file's memo, kept for
    the process's life, read without taking the lock, as a file of the process's own user), else None."""
    uid = process_uid(pid)
    memo = refused_memo(peek_note(lock_file, owners={uid})) if uid is not None else None
    return park_steps.refused_again_refusal(pid, memo) if memo is not None else None


def park_from_outside(pid: int, target, timeout: float, lock_file: os.PathLike,
                      automatic: bool = False) -> park_steps.Outcome:
    """``gpucleanup park``, the page's Park and the server's automatic park (``automatic``):
    :func:`~gpucleanup.park.kernel_side.park_kernel` with the kernel's state kept through signed requests to its status
    endpoint (``target``). Refused (ParkRefused) when the process at ``pid`` is not its files' owner's."""
    refusal = owner_refusal(pid, lock_file)
    if refusal:
        raise park_steps.ParkRefused(refusal)
    return parking.park_kernel(pid, remote_record(target, timeout, automatic), lock_file,
                               hold_threads=outside_hold(pid, lock_file, lambda: _blocker(target, timeout)),
                               allow=allow_from_outside(target, timeout))


def outside_hold(pid: int, lock_file: os.PathLike, blocker):
    """A park from outside of a JAX kernel: the threads it listed to hold while parked, or why not (``blocker()``:
    the kernel's state's ``park_blocker``, a thread of the notebook runs)."""
    uid = process_uid(pid)

    def threads(restore_thread: Optional[int]):
        why = blocker()
        if why:
            return ("a thread of the notebook still runs, which would call JAX while it is parked (gpucleanup park "
                    "--check names it); park it once it ends" if "park.642" in why else printable(why))
        return parked_hold.listed_threads(lock_file, pid, restore_thread, uid)

    return threads


def hold_refused(pid: int, lock_file: os.PathLike, maps: Optional[str] = None) -> Optional[str]:
    """``park.654`` as the park's hold would say it, from files alone (the page's cheap check, which has no restore
    thread to hand): Yama's ptrace_scope, a JAX kernel that has listed no thread, or one with a thread it has not
    listed. None: the park holds no thread here, or none of these stands. ``maps``: the process's mappings, already
    read."""
    if park_steps.kernel_hold() is not None or not park_steps.holds_while_parked(pid, maps=maps):
        return None
    why = park_steps.ptrace_refusal()
    if not why:
        listed = parked_hold.listed_threads(lock_file, pid, None, process_uid(pid))
        why = park_steps.UNLISTED if listed is None else (listed if isinstance(listed, str) else None)
    return park_steps.hold_refusal(pid, why) if why else None


def _blocker(target, timeout: float) -> Optional[str]:
    """The kernel's ``park_blocker`` now (None: none, or no answer: the park's own requests then say so)."""
    try:
        state = status_client.request(target, "status", timeout).get("state") or {}
    except status_client.StatusError:
        return None
    return state.get("park_blocker") if isinstance(state.get("park_blocker"), str) else None


def check_kernel(pid: int, target, timeout: float, lock_file: os.PathLike) -> dict:
    """``gpucleanup park --check``: whether kernel ``pid`` can be parked now and, if not, every reason, from
    what can be read without touching it: who owns it, its state (a cell or a drain running, parked already),
    the driver's state of the process (a helper's read-only look: a driver without checkpoint calls says so
    there), the GPUs it uses (nvidia-smi), host memory and its cgroup's limit, and whether the driver ever refused
    a park of it for what it holds (the memo lasts as the process). Returns ``{"parkable",
    "reasons", "usage", "state", "driver_state"}``; never raises for what it finds."""
    out: dict = {"pid": pid, "parkable": False, "reasons": [], "usage": None, "state": None, "driver_state": None,
                 "blocker": None}
    refusal = owner_refusal(pid, lock_file)
    if refusal:
        out["reasons"].append(refusal)
        return out
    try:
        state = status_client.request(target, "status", timeout).get("state") or {}
    except status_client.StatusError as exc:
        state = {}
        out["reasons"].append(f"the kernel did not answer its status request ({exc}): a park would be refused")
    out["state"] = kernel_state = state.get("state")
    refused = refused_before(pid, lock_file) if kernel_state not in ("parking", "parked") else None
    if refused:
        out["reasons"].append(refused)
    # a thread of the notebook's still runs: automatic and bulk parks leave the kernel alone; a person may park it
    out["blocker"] = state.get("park_blocker") if isinstance(state.get("park_blocker"), str) else None
    if kernel_state == "draining" and state.get("cell") is None:
        out["reasons"].append("a drain from outside (gpucleanup drain, the page's Drain) is running the kernel's own "
                              "cleanup (the frameworks' caches, then garbage collection, where objects' finalizers "
                              "run); it ends by itself: ask again when the kernel is idle (a park waits for it up "
                              f"to {parking.BEGIN_WAIT_S:g} s)")
    elif kernel_state in ("running", "draining"):
        cell = state.get("cell")
        out["reasons"].append(f"the kernel is {kernel_state}" + (f" (cell {cell})" if cell else "")
                              + ": a park starts only between cells; ask again when it is idle")
    elif kernel_state in ("parking", "parked"):
        out["reasons"].append(f"the kernel is {kernel_state} already: gpucleanup resume {pid} brings it back")
    found = park_steps.state(pid)
    out["driver_state"] = found.state
    apps = park_steps.compute_apps()
    usage = out["usage"] = park_steps.process_gpu_usage(pid, apps=apps)
    reasons = park_steps.refusals(pid, None if kernel_state in ("parking", "parked") else found, usage,
                                  park_steps.gpus() if usage else None, unheld=park_steps.kernel_hold())
    out["reasons"].extend(reasons)
    if (not reasons and kernel_state not in ("parking", "parked") and park_steps.kernel_hold() is None
            and park_steps.holds_while_parked(pid)):
        try:  # what the park would say
            park_steps.hold_plan(pid, found.restore_thread, outside_hold(pid, lock_file, lambda: out["blocker"]))
        except park_steps.ParkRefused as exc:
            out["reasons"].append(str(exc))
    layout = park_steps.layout_refusal(found, park_steps.gpus) if kernel_state not in ("parking", "parked") else None
    if layout:
        out["reasons"].append(layout)
    out["parkable"] = not out["reasons"]
    return out


def resume_from_outside(pid: int, target, timeout: float, lock_file: os.PathLike,
                        wait: Optional[float] = None) -> tuple:
    """``gpucleanup resume`` and the page's Resume: ``(outcome, state before)``. The driver's state decides
    what is done; the kernel's state is told ``resumed`` only when it said parking or parked (a kernel
    parked by ``python -m gpucleanup.park`` alone never knew)."""
    refusal = owner_refusal(pid, lock_file)
    if refusal:
        raise park_steps.ParkRefused(refusal)
    before = status_client.request(target, "status", timeout).get("state") or {}
    known_parked = before.get("state") in ("parking", "parked")
    record = remote_record(target, timeout) if known_parked else None
    outcome = parking.resume_kernel(pid, record, lock_file, lock_timeout=wait,
                                    by=resume_news.FROM_OUTSIDE if known_parked else None,
                                    allow=allow_from_outside(target, timeout) if known_parked else None)
    if outcome.changed or outcome.interrupted:
        return outcome, before
    if not known_parked and outcome.state in (None, park_steps.RUNNING):
        # never parked: the driver finds it running, or (no GPU used yet) does not know it at all
        raise park_steps.ParkRefused(not_parked_refusal(pid))
    if not outcome.ok and _nothing_tried(outcome):
        # only the driver's state was read (no room, a step under way, a state that cannot be resumed):
        # a refusal, as a park's are, not a failed step
        raise park_steps.ParkRefused(parking.kernel_message(outcome))
    return outcome, before


def allow_from_outside(target, timeout: float):
    """Asks the parked kernel (a signed ``park`` request, step ``tracer``) to let the resume's helper hold its
    threads during the restore; a kernel that cannot (an older gpucleanup) is restored without the hold."""

    def allow(helper_pid: int) -> None:
        status_client.request(target, "park", timeout, step="tracer", pid=int(helper_pid))

    return allow


def not_parked_refusal(pid: int) -> str:
    """``gpucleanup resume`` of a kernel that is not parked."""
    return f"[gpucleanup.park.645] kernel {pid} is not parked: nothing to resume"


def _nothing_tried(outcome: park_steps.Outcome) -> bool:
    """Did the resume stop before any step that changes the process (every step a look at its state that
    answered in time)?"""
    return all(step.name == "state" and not step.hung for step in outcome.steps)


def outcome_text(outcome: park_steps.Outcome, before: Optional[dict] = None) -> str:
    """A park's or a resume's one sentence for a kernel."""
    if outcome.ok and outcome.changed:
        return parking.parked_text(outcome) if outcome.action == "park" else parking.resumed_text(outcome, before)
    return parking.kernel_message(outcome)
