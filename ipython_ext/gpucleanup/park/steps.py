"""Park a process: all of its GPU memory, context included, into host memory and back.

The state machine around the CUDA driver's checkpoint calls (share/FACTS.md §10), after the CUDA checkpoint utility
and CRIU. Each step runs in a helper process of its own (:mod:`gpucleanup.park.native_step`), killed past a time
limit; nothing here makes a driver call.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, NamedTuple, Optional, Tuple, Union

from . import parked_hold
from ..say import printable
from ..units import format_bytes, format_duration

__all__ = ["Limits", "Step", "Outcome", "ParkRefused", "Gpu", "step", "state", "park", "resume", "refusals",
           "host_memory_refusal", "cgroup_memory", "cgroup_memory_refusal", "unrestorable_refusal", "room_refusal",
           "process_gpu_usage", "gpus", "compute_apps", "RESUME_MARGIN", "LASTING_RESULTS", "lasting_refusal",
           "refused_again_refusal"]

#: The process states of the driver (CUprocessState), as the helper names them; the last two are named by
#: newer drivers while a checkpoint or a restore is under way.
RUNNING, LOCKED, CHECKPOINTED, FAILED = "running", "locked", "checkpointed", "failed"
CHECKPOINTING, RESTORING = "checkpointing", "restoring"
UNDER_WAY = (CHECKPOINTING, RESTORING)


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
    hold_s: float = 5.0  # the hold while parked: the stops of the threads it holds (parked_hold.py)

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
    restore_map: Optional[int] = None     # restore: how many GPUs its identity map named (0: none passed)
    interrupted: bool = False             # Ctrl-C or SIGTERM came while it ran: it was let finish
    hold: Optional[dict] = None           # restore: whether the process's other threads were held meanwhile
    driver_version: Optional[int] = None  # cuDriverGetVersion in the helper (13000: CUDA 13.0)
    restore_layout_known: Optional[bool] = None  # the driver's restore arguments are laid out as this build's
    restore_thread: Optional[int] = None  # state of a running process: the driver's restore thread in it

    def as_dict(self) -> dict:
        return dict(self.__dict__)


@dataclass
class Outcome:
    """What a park or a resume did: ``ok``, the state the process is in now, one sentence.

    Every outcome names the state the process is left in and what to do next: a lock that does not come in time
    leaves the process running; a failed (or hung) checkpoint unlocks it again: it runs as before; a failed restore
    leaves it parked, its memory safe in host memory, and says how to retry.
    """

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
    usage: Optional[Dict[str, int]] = None  # park: its device memory per GPU UUID before the park (nvidia-smi)
    interrupted: bool = False        # Ctrl-C or SIGTERM came during a step; the message says where it left things
    parked_hold: Optional[dict] = None  # park: the hold while parked (parked_hold.py), kept for the resume

    def as_dict(self) -> dict:
        out = {k: v for k, v in self.__dict__.items() if k != "steps"}
        out["steps"] = [s.as_dict() for s in self.steps]
        return out


class ParkRefused(Exception):
    """Nothing was done: the sentence says why and what to do."""


# ------------------------------------------------------------------ one step


#: Where the helper runs: a directory no other user can write, so that nothing found there is imported.
HELPER_CWD = "/"


def helper_command(name: str, pid: int, extra: Optional[List[str]] = None, python: Optional[str] = None) -> List[str]:
    """The command line of one park helper, which runs gpucleanup's own code and nothing else.

    Python's isolated mode (``-I``: no current directory or script directory on ``sys.path``, no
    ``PYTHON*`` variables, no user site) and the package's own parent directory put first, by its
    installed path: a ``gpucleanup`` package or module planted in the caller's working directory
    (a shared notebook folder, a world-writable directory root runs ``gpucleanup park`` from) is
    never imported, and the helper runs from :data:`HELPER_CWD`.
    """
    home = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # above gpucleanup/park/
    code = (f"import sys; sys.path.insert(0, {home!r}); from gpucleanup.park.native_step import main; "
            "sys.exit(main(sys.argv[1:]))")
    return [python or sys.executable, "-I", "-c", code, name, str(int(pid))] + list(extra or [])


def helper_env(env: Optional[Dict[str, str]] = None) -> Dict[str, str]:
    """The helper's environment: the caller's (or ``env``) without ``CUDA_VISIBLE_DEVICES``, so that the
    helper sees every GPU of the machine, which the restore's GPU map must name (share/FACTS.md §10)."""
    out = dict(os.environ if env is None else env)
    out.pop("CUDA_VISIBLE_DEVICES", None)
    return out


#: Lets a helper hold the kernel's threads (called with the helper's pid as it starts): the kernel names it as
#: its tracer (prctl PR_SET_PTRACER), which Yama's ptrace_scope 1 asks for. None: nobody is asked.
Allow = Optional[Callable[[int], None]]


def _call(name: str, pid: int, limit: float, env: Optional[Dict[str, str]], extra: Optional[List[str]] = None,
          python: Optional[str] = None, on_start: Allow = None) -> Tuple[Optional[dict], Step]:
    """Runs helper step ``name`` to its end or ``limit``: its JSON reply (None when it gave none) and the
    :class:`Step` made of it (or of its silence: hung, or no answer)."""
    started = time.monotonic()
    returncode, stdout, stderr, hung, interrupted = _run_helper(helper_command(name, pid, extra, python),
                                                                helper_env(env), limit, on_start)
    seconds = time.monotonic() - started
    if hung:
        return None, Step(name, False, hung=True, seconds=seconds, interrupted=interrupted)
    try:
        reply = json.loads(stdout.decode("utf-8", "replace").strip().splitlines()[-1])
        if not isinstance(reply, dict):
            raise ValueError("not an object")
    except (ValueError, IndexError):
        why = stderr.decode("utf-8", "replace").strip().splitlines()
        detail = why[-1] if why else f"exit status {returncode}"
        return None, Step(name, False, refused=f"[gpucleanup.park.610] the park helper gave no answer "
                          f"({detail[:300]})", seconds=seconds, interrupted=interrupted)
    return reply, Step(name, bool(reply.get("ok")), result=reply.get("result"), state_before=reply.get("state_before"),
                       state=reply.get("state"), seconds=seconds, refused=reply.get("refused"),
                       restore_map=reply.get("restore_map"), interrupted=interrupted,
                       driver_version=reply.get("driver_version"),
                       restore_layout_known=reply.get("restore_layout_known"),
                       restore_thread=reply.get("restore_thread") if isinstance(reply.get("restore_thread"), int)
                       else None)


def step(pid: int, name: str, limits: Limits = Limits(), python: Optional[str] = None,
         env: Optional[Dict[str, str]] = None) -> Step:
    """Runs one step in a fresh helper process, killed past ``limits``; never raises for the driver's answer.

    Nothing of it runs in the parked process, and no driver call is made by the calling process either: this
    module only starts helpers and reads their JSON."""
    extra = [str(int(limits.lock_timeout_s * 1000))] if name == "lock" else []
    return _call(name, pid, limits.of(name), env, extra, python)[1]


def restore_held(pid: int, limits: Limits = Limits(), env: Optional[Dict[str, str]] = None,
                 allow: Allow = None, held_by: Optional[int] = None) -> Tuple[Step, Optional[Step]]:
    """The restore and, when it worked, the unlock, in one helper that holds every other thread of process
    ``pid`` meanwhile (ptrace), all but the driver's own restore thread: a restore runs alone (DESIGN rule 12;
    a JAX thread that called the driver mid-restore made the driver raise SIGSEGV in it, share/FACTS.md §11).
    ``allow`` is called with the helper's pid as it starts, so that the kernel can name it as its tracer.
    ``held_by``: the helper of the hold while parked (:mod:`.parked_hold`), whose threads stay with it.
    Returns the restore's step (``hold``: what was held) and the unlock's (None when it was not tried)."""
    if held_by:
        env = dict(os.environ if env is None else env, GPUCLEANUP_PARK_HELD_BY=str(int(held_by)))
    reply, restored = _call("resume", pid, limits.restore_s + limits.unlock_s, env, on_start=allow)
    restored.name = "restore"
    if reply is None or restored.refused:
        return restored, None
    restored.hold = reply.get("hold") if isinstance(reply.get("hold"), dict) else None
    if restored.ok:
        restored.state = LOCKED  # the state after the restore alone; the helper's "state" is after its unlock
    unlock = reply.get("unlock") if isinstance(reply.get("unlock"), dict) else {}
    if unlock.get("result") is None:
        return restored, None
    return restored, Step("unlock", bool(unlock.get("ok")), result=unlock.get("result"), state_before=LOCKED,
                          state=reply.get("state"), interrupted=restored.interrupted)


def _run_helper(args: List[str], env: Dict[str, str], limit: float,
                on_start: Allow = None) -> Tuple[int, bytes, bytes, bool, bool]:
    """Runs a helper to its end or its limit: ``(returncode, stdout, stderr, hung, interrupted)``.

    The helper has a session of its own, so a Ctrl-C typed at the terminal (which signals the whole
    foreground process group) never stops a driver call half-way; a Ctrl-C or SIGTERM that reaches the
    caller is noted and the step is let finish within its limit, so the caller can stop at a state it
    can name (a helper killed mid-checkpoint left the driver locked while its kernel said idle).
    """
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
                            env=env, cwd=HELPER_CWD, start_new_session=True)
    if on_start is not None:
        try:
            on_start(proc.pid)
        except Exception:
            pass  # the helper then restores without the permission: its hold says why it could not
    deadline = time.monotonic() + limit
    interrupted = False
    while True:
        try:
            stdout, stderr = proc.communicate(timeout=max(0.0, deadline - time.monotonic()))
            return proc.returncode, stdout or b"", stderr or b"", False, interrupted
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            return proc.returncode, b"", b"", True, interrupted
        except KeyboardInterrupt:
            if not interrupted:  # said at once: a checkpoint of many GiB takes minutes
                step_name = args[4] if len(args) > 4 else "step"
                print(f"gpucleanup: interrupted: the driver's {step_name} under way is let finish (at most "
                      f"{max(0.0, deadline - time.monotonic()):.0f} s more), then it stops where the kernel's state "
                      "can be named", file=sys.stderr, flush=True)
            interrupted = True


def state(pid: int, limits: Limits = Limits(), env: Optional[Dict[str, str]] = None) -> Step:
    """The process's state as the driver sees it, from a helper (``.state``; None if it cannot say)."""
    return step(pid, "state", limits, env=env)


# ------------------------------------------------------------------ host memory: the machine's and the cgroup's


_MARGIN_FRACTION = 0.05
_MARGIN_MIN = 1 << 30
_CGROUP_MARGIN_MIN = 256 << 20


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
    return (f"[gpucleanup.park.621] host memory cannot hold this kernel's GPU memory: parking needs "
            f"{format_bytes(parked_bytes)} plus a margin of {format_bytes(margin)}, and only "
            f"{format_bytes(fields['MemAvailable'])} is available: free host memory (or park a smaller kernel)")


class CgroupMemory(NamedTuple):
    """The tightest memory limit over a process's cgroup and its ancestors: where it is set, the limit,
    what is charged there now, and what is left (``limit - usage``)."""

    path: str
    limit: int
    usage: int

    @property
    def room(self) -> int:
        return max(0, self.limit - self.usage)


def _read_int(path: str) -> Optional[int]:
    try:
        with open(path, encoding="ascii") as fh:
            text = fh.read().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def cgroup_memory(pid: int, proc: str = "/proc", root: str = "/sys/fs/cgroup") -> Optional[CgroupMemory]:
    """The memory limit that binds process ``pid`` (cgroup v2 ``memory.max``/``memory.current``, or v1
    ``memory.limit_in_bytes``/``memory.usage_in_bytes``), the tightest over its cgroup and every ancestor
    (a pod's limit is often set a level above the container's own cgroup); None when none is set or none
    can be read. Read from files alone: the process is not touched.

    A container or a JupyterHub pod with a memory limit kills the kernel when its own park copies more
    into it than the limit leaves, while the machine's ``MemAvailable`` still says yes (share/FACTS.md §10).
    """
    try:
        with open(f"{proc}/{int(pid)}/cgroup", encoding="utf-8", errors="replace") as fh:
            lines = fh.read().splitlines()
    except OSError:
        return None
    candidates: List[Tuple[str, str, str, str]] = []  # (directory, limit file, usage file, the hierarchy's root)
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hierarchy, controllers, relative = parts
        relative = relative.strip()
        if not relative.startswith("/") or "/.." in relative:
            continue
        if hierarchy == "0" and controllers == "":
            candidates.append((os.path.join(root, relative.lstrip("/")), "memory.max", "memory.current", root))
        elif "memory" in controllers.split(","):
            v1 = os.path.join(root, "memory")
            candidates.append((os.path.join(v1, relative.lstrip("/")), "memory.limit_in_bytes",
                               "memory.usage_in_bytes", v1))
    tightest: Optional[CgroupMemory] = None
    for directory, limit_file, usage_file, top in candidates:
        here, stop = os.path.normpath(directory), os.path.normpath(top)
        while True:  # the cgroup, then each ancestor up to the hierarchy's root
            limit, usage = _read_int(os.path.join(here, limit_file)), _read_int(os.path.join(here, usage_file))
            if limit is not None and usage is not None and limit < (1 << 62):  # v1 says "none" with about 2^63
                found = CgroupMemory(here, limit, usage)
                if tightest is None or found.room < tightest.room:
                    tightest = found
            if len(here) <= len(stop):
                break
            here = os.path.dirname(here)
    return tightest


def cgroup_memory_refusal(parked_bytes: Optional[int], memory: Optional[CgroupMemory]) -> Optional[str]:
    """A sentence when the process's cgroup cannot take ``parked_bytes`` more (with a margin of 5% of its
    limit, at least 256 MiB), else None."""
    if not parked_bytes or memory is None:
        return None
    margin = max(_CGROUP_MARGIN_MIN, int(memory.limit * _MARGIN_FRACTION))
    if parked_bytes + margin <= memory.room:
        return None
    return (f"[gpucleanup.park.628] this kernel's memory limit cannot hold its GPU memory: a park copies "
            f"{format_bytes(parked_bytes)} into the kernel's own memory, and its cgroup ({printable(memory.path)}: limit "
            f"{format_bytes(memory.limit)}, {format_bytes(memory.usage)} in use) leaves "
            f"{format_bytes(memory.room)}, less a margin of {format_bytes(margin)}: the out-of-memory killer would "
            "end the kernel; raise the container's memory limit, or free GPU memory first")


# ------------------------------------------------------------------ what nvidia-smi sees


class Gpu(NamedTuple):
    index: int
    uuid: str
    free: int
    total: int


def _smi(query: List[str], timeout: float) -> Optional[List[List[str]]]:
    try:
        done = subprocess.run(["nvidia-smi", *query, "--format=csv,noheader,nounits"], capture_output=True,
                              timeout=timeout, stdin=subprocess.DEVNULL, cwd=HELPER_CWD)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if done.returncode != 0:
        return None
    return [[p.strip() for p in line.split(",")] for line in done.stdout.decode("ascii", "replace").splitlines()
            if line.strip()]


def gpus(timeout: float = 10.0) -> Optional[List[Gpu]]:
    """Every GPU nvidia-smi sees (index, UUID, free and total bytes); None when it cannot say."""
    rows = _smi(["--query-gpu=index,uuid,memory.free,memory.total"], timeout)
    if rows is None:
        return None
    out = [Gpu(int(r[0]), r[1], int(r[2]) << 20, int(r[3]) << 20) for r in rows
           if len(r) == 4 and r[0].isdigit() and r[2].isdigit() and r[3].isdigit()]
    return out or None


def compute_apps(timeout: float = 10.0) -> Optional[List[Tuple[int, str, int]]]:
    """Every process nvidia-smi lists on a GPU: ``(pid, GPU UUID, bytes)``; None when it cannot say. Pids
    are the host's: a process of another PID namespace shows with a pid this one may not know."""
    rows = _smi(["--query-compute-apps=pid,gpu_uuid,used_memory"], timeout)
    if rows is None:
        return None
    return [(int(r[0]), r[1], int(r[2]) << 20) for r in rows if len(r) == 3 and r[0].isdigit() and r[2].isdigit()]


def process_gpu_usage(pid: int, timeout: float = 10.0,
                      apps: Optional[List[Tuple[int, str, int]]] = None) -> Optional[Dict[str, int]]:
    """The process's device memory per GPU (UUID -> bytes) from ``nvidia-smi --query-compute-apps``;
    ``{}`` when it holds none, None when nvidia-smi cannot say (absent, failed, or the pid unknown here)."""
    apps = compute_apps(timeout) if apps is None else apps
    if apps is None:
        return None
    usage: Dict[str, int] = {}
    for app_pid, uuid, used in apps:
        if app_pid == pid:
            usage[uuid] = usage.get(uuid, 0) + used
    return usage if usage or os.path.exists(f"/proc/{pid}") else None


def process_gpu_bytes(pid: int, timeout: float = 10.0) -> Optional[int]:
    """The process's device memory on every GPU (nvidia-smi), else None."""
    usage = process_gpu_usage(pid, timeout)
    return None if usage is None else sum(usage.values())


def _gpu_label(uuid: str, view: Optional[List[Gpu]]) -> str:
    for gpu in view or ():
        if gpu.uuid == uuid:
            return f"GPU{gpu.index}"
    return uuid[:12]


def _owner(pid: int) -> str:
    try:
        import pwd

        return pwd.getpwuid(os.stat(f"/proc/{pid}").st_uid).pw_name
    except (OSError, KeyError, ImportError):
        return ""


def unrestorable_refusal(pid: int, usage: Optional[Dict[str, int]], view: Optional[List[Gpu]] = None) -> Optional[str]:
    """A sentence for a process that a restore is known not to bring back whole, else None.

    Measured on two H200s (share/FACTS.md §10): a process that has used two GPUs together (one cross-GPU
    copy in PyTorch, which turns peer access on) is checkpointed, but its restore fails with
    CUDA_ERROR_INVALID_VALUE, with no GPU map as with the identity map of every GPU, and the process is
    lost; one with memory on two GPUs that never used them together comes back, but its first cross-GPU
    copy after the resume fails (``invalid resource handle``). Whether peer access was ever turned on cannot
    be read from outside the process, so every process with device memory on more than one GPU is refused.
    """
    if not usage or len(usage) < 2:
        return None
    held = ", ".join(f"{_gpu_label(uuid, view)} {format_bytes(n)}" for uuid, n in sorted(
        usage.items(), key=lambda item: _gpu_label(item[0], view)))
    return (f"[gpucleanup.park.627] process {pid} uses {len(usage)} GPUs ({held}): it is not parked, because the "
            "driver cannot restore a process that has used two GPUs together (a cross-GPU copy or peer access: its "
            "restore fails and the process is lost) and one that has not loses its first cross-GPU copy after the "
            "resume; give each kernel one GPU (CUDA_VISIBLE_DEVICES) to make it parkable")


#: Free memory a resume asks for beyond what the process held on a GPU before its park (measured: a restore
#: with 256 MiB to spare brought 5.6 GiB back, share/FACTS.md §10).
RESUME_MARGIN = 256 << 20


def room_refusal(pid: int, need: Optional[Dict[str, int]], view: Optional[List[Gpu]],
                 apps: Optional[List[Tuple[int, str, int]]] = None) -> Optional[str]:
    """A sentence when a GPU lacks room for the resume of ``pid``: ``need`` is what it held per GPU UUID
    before its park, ``view`` what nvidia-smi sees now; None when there is room or nothing to compare.

    A restore without room fails with CUDA_ERROR_OUT_OF_MEMORY, and the next restore, once memory was
    free again, failed with CUDA_ERROR_OPERATING_SYSTEM and lost the process (measured on an H200,
    share/FACTS.md §10): so no restore is tried without room.
    """
    if not need or not view:
        return None
    by_uuid = {gpu.uuid: gpu for gpu in view}
    short = []
    for uuid, wanted in sorted(need.items()):
        gpu = by_uuid.get(uuid)
        if gpu is None:
            return (f"[gpucleanup.park.633] the GPU process {pid} was parked from ({uuid}) is not on this machine "
                    "now: it stays parked with nothing lost; bring that GPU back, then resume it")
        if gpu.free < wanted + RESUME_MARGIN:
            others = sorted(((used, app) for app, on, used in (apps or ()) if on == uuid and app != pid),
                            reverse=True)[:3]
            held = ", ".join(f"pid {app}" + (f" ({owner})" if (owner := _owner(app)) else "") + f" {format_bytes(used)}"
                             for used, app in others)
            short.append(f"GPU{gpu.index} lacks {format_bytes(wanted + RESUME_MARGIN - gpu.free)} for the resume (it "
                         f"needs {format_bytes(wanted)} and a margin of {format_bytes(RESUME_MARGIN)}; "
                         f"{format_bytes(gpu.free)} is free" + (f"; held by {held}" if held else "") + ")")
    if not short:
        return None
    return (f"[gpucleanup.park.630] {'; '.join(short)}: process {pid} stays parked with nothing lost (a restore "
            f"without room can lose it, so none was tried); resume it once the memory is free: {_resume_hint(pid)}")


# ------------------------------------------------------------------ park and resume


def _resume_hint(pid: int) -> str:
    return f"python -m gpucleanup.park resume {pid}"


def _refusal_for_state(pid: int, found: Step, usage: Optional[Dict[str, int]] = None) -> str:
    if found.refused:
        return found.refused
    if found.hung:
        return (f"[gpucleanup.park.611] the driver did not say within {found.seconds:.0f} s what state process "
                f"{pid} is in: nothing was done; check the GPU with nvidia-smi")
    if found.state is None and usage:
        return (f"[gpucleanup.park.634] the driver cannot checkpoint process {pid} ({found.result}), although it "
                f"holds {format_bytes(sum(usage.values()))} of GPU memory: nothing was done; it runs as before (a "
                "process in another container's driver namespace, or one whose CUDA the driver cannot checkpoint)")
    if found.state is None:
        return (f"[gpucleanup.park.612] process {pid} is not a CUDA process the driver can park "
                f"({found.result}): it has not used the GPU, or it has exited")
    if found.state == CHECKPOINTED:
        return f"[gpucleanup.park.613] process {pid} is already parked: resume it with {_resume_hint(pid)}"
    if found.state == LOCKED:
        return (f"[gpucleanup.park.614] process {pid} is locked by an earlier step that did not finish: "
                f"bring it back with {_resume_hint(pid)}")
    if found.state in UNDER_WAY:
        return (f"[gpucleanup.park.632] the driver reports process {pid} as {found.state}: a park or a resume of it "
                "is under way; ask again when it has ended")
    if found.state == FAILED:
        return (f"[gpucleanup.park.615] the driver reports process {pid} as failed: it cannot be parked; "
                "save what you can and restart it")
    return (f"[gpucleanup.park.635] the driver reports process {pid} in a state gpucleanup does not know "
            f"({found.state}): nothing was done; check it with nvidia-smi")


def layout_refusal(found: Optional[Step], view=None) -> Optional[str]:
    """A sentence when the driver lays out the restore's arguments unlike this build (CUDA 12.9 to 13.0) on a
    machine of several GPUs: the restore would go without the GPU map every GPU must be named in (share/FACTS.md
    §10, §12), so the process could not come back. One GPU restores without a map. ``view``: the GPUs, or a
    callable that gives them (asked only when the layout is unknown)."""
    if found is None or found.restore_layout_known is not False:
        return None
    listed = view() if callable(view) else view
    if not listed or len(listed) < 2:
        return None
    version = found.driver_version
    named = f"CUDA {version // 1000}.{version % 1000 // 10}" if isinstance(version, int) else "an unknown CUDA"
    return (f"[gpucleanup.park.650] the driver ({named}) lays out the restore's arguments unlike this gpucleanup "
            f"(built for CUDA 12.9 to 13.0), and this machine has {len(listed)} GPUs, whose restore needs a GPU map in "
            "them: nothing was done; update gpucleanup for this driver to park here")


_MPS_SEEN: Dict[str, Tuple[float, Optional[str]]] = {}  # proc -> (when looked, what was found)


def mps_server(proc: str = "/proc", max_age_s: float = 5.0) -> Optional[str]:
    """``process N, nvidia-cuda-mps-server`` when an MPS server or control daemon runs here, else None; one
    look at every process's name, kept ``max_age_s`` seconds (the page asks for every kernel at each refresh)."""
    seen = _MPS_SEEN.get(proc)
    if seen is not None and time.monotonic() - seen[0] < max_age_s:
        return seen[1]
    found = None
    try:
        names = os.listdir(proc)
    except OSError:
        names = []
    for name in names:
        if not name.isdigit():
            continue
        try:
            with open(f"{proc}/{name}/comm", encoding="utf-8", errors="replace") as fh:
                comm = fh.read().strip()
        except OSError:
            continue
        if comm.startswith("nvidia-cuda-mps"):
            found = f"process {name}, {printable(comm)}"
            break
    _MPS_SEEN[proc] = (time.monotonic(), found)
    return found


#: frameworks whose park is not safe on a GPU, and how their GPU backend shows in /proc/PID/maps
UNPROVEN = {"jax": ("xla_cuda_plugin", "/jaxlib/cuda/")}


def unproven_opt_in(environ: Optional[List[bytes]] = None, env: Optional[Dict[str, str]] = None) -> set:
    """The frameworks ``GPUCLEANUP_PARK_UNPROVEN`` (comma-separated) lets be parked all the same: set for the
    process that parks (the command, the server; ``env`` in its place where the park was given one, as
    :func:`kernel_hold` reads it) or for the kernel itself (``environ``, its ``/proc/PID/environ``)."""
    names = set()
    for value in [(os.environ if env is None else env).get("GPUCLEANUP_PARK_UNPROVEN", "")] + [
            v.split(b"=", 1)[1].decode("utf-8", "replace") for v in environ or ()
            if v.startswith(b"GPUCLEANUP_PARK_UNPROVEN=")]:
        names.update(n.strip() for n in value.split(",") if n.strip())
    return names


def read_maps(pid: int, proc: str = "/proc") -> Optional[str]:
    """Process ``pid``'s ``/proc/PID/maps`` (None: gone, or not readable here); a caller that asks :func:`refusals`
    and :func:`holds_while_parked` of it in one look reads it once and passes it to both."""
    try:
        with open(f"{proc}/{int(pid)}/maps", encoding="utf-8", errors="replace") as fh:
            return fh.read()
    except OSError:
        return None


#: Why a park holds no thread of a JAX kernel while it is parked (the ``unheld`` of :func:`refusals`).
HOLD_TURNED_OFF = "holding is turned off here (GPUCLEANUP_PARK_HOLD=off)"
NOT_A_KERNEL = ("a park by process id alone (gpucleanup.park.park) cannot list a kernel's threads: park it with "
                "gpucleanup park, the page or %gpumem --park")


def kernel_hold(env: Optional[Dict[str, str]] = None) -> Optional[str]:
    """The ``unheld`` of a kernel's park (its own, or one from outside through its status endpoint): None when it
    holds a JAX kernel's threads while parked, else why not (``GPUCLEANUP_PARK_HOLD=off`` in ``env``, or in this
    process's environment)."""
    return HOLD_TURNED_OFF if (os.environ if env is None else env).get("GPUCLEANUP_PARK_HOLD") == "off" else None


def unproven_refusal(pid: int, proc: str = "/proc", environ: Optional[List[bytes]] = None,
                     maps: Optional[str] = None, unheld: Optional[str] = NOT_A_KERNEL,
                     env: Optional[Dict[str, str]] = None) -> Optional[str]:
    """Why a kernel whose framework's park is not safe is not parked (None: none is in use, the park holds its
    threads while parked, or it was let through). On an H100 (driver 580.159.04) JAX kernels parked without that
    hold were lost, 9 of 29 resumed by their next cell and 11 of 11 left parked for 6 s, each by an XLA thread
    faulting in the driver's ``cuStreamQuery`` while the process was checkpointed; with the hold, none of 117
    (share/FACTS.md §11; tests/bench/results/h100-park-hold-*-179687d-2026-12-07.log). ``unheld``: why this park
    holds no thread (None: it holds them, :func:`.parked_hold.start`). ``maps``: the process's ``/proc/PID/maps``
    already read (None: read here). ``env``: the parking process's environment, as :func:`unproven_opt_in`."""
    maps = read_maps(pid, proc) if maps is None else maps
    if maps is None:
        return None
    allowed = unproven_opt_in(environ, env)
    for name, marks in UNPROVEN.items():
        if name in allowed or not any(mark in maps for mark in marks):
            continue
        if unheld is None and name in HOLD_WHILE_PARKED:
            continue
        return (f"[gpucleanup.park.651] process {pid} runs {'JAX' if name == 'jax' else name} on the GPU, whose own "
                "threads call the driver while the process is checkpointed and kill it unless they are held while it "
                f"is parked, and this park holds none ({unheld or 'none are known'}): it is not parked; "
                f"GPUCLEANUP_PARK_UNPROVEN={name} (for the kernel, or for the command or server that parks) parks it "
                "all the same")
    return None


#: The driver's unified-memory device: every CUDA process maps it once (2 MiB on an H100, driver 580.159.04), and
#: each CUDA managed allocation adds a mapping of its own, gone when it is freed (share/FACTS.md §11).
UVM_DEVICE = "/dev/nvidia-uvm"


def managed_bytes(maps: str) -> int:
    """Bytes of CUDA managed memory a process's ``/proc/PID/maps`` shows: its mappings of :data:`UVM_DEVICE`
    beyond the smallest, which every CUDA process has (0: none held, or no CUDA)."""
    sizes = []
    for line in maps.splitlines():
        fields = line.split(None, 5)
        if len(fields) == 6 and fields[5].strip() == UVM_DEVICE:
            lo, _, hi = fields[0].partition("-")
            try:
                sizes.append(int(hi, 16) - int(lo, 16))
            except ValueError:
                continue
    return sum(sizes) - min(sizes) if len(sizes) > 1 else 0


def managed_refusal(pid: int, maps: Optional[str], environ: Optional[List[bytes]] = None,
                    env: Optional[Dict[str, str]] = None) -> Optional[str]:
    """``park.653``: the process holds CUDA managed memory now, which the driver's checkpoint refuses
    (``CUDA_ERROR_NOT_SUPPORTED``, and every later one after it): said before anything is locked, so that the
    process stays parkable once it frees that memory. ``GPUCLEANUP_PARK_UNPROVEN=managed`` lets the park be tried
    all the same (a driver that maps its device otherwise)."""
    held = managed_bytes(maps) if maps else 0
    if not held or "managed" in unproven_opt_in(environ, env):
        return None
    return (f"[gpucleanup.park.653] process {pid} holds {format_bytes(held)} of CUDA managed memory (its mappings "
            f"of {UVM_DEVICE}), which the driver's checkpoint does not support: it is not parked; "
            f"{MANAGED_REMEDY}; GPUCLEANUP_PARK_UNPROVEN=managed tries the park all the same")


def unsupported_refusals(pid: int, proc: str = "/proc", tracing: bool = False,
                         unheld: Optional[str] = NOT_A_KERNEL, maps: Optional[str] = None,
                         env: Optional[Dict[str, str]] = None) -> List[str]:
    """Sentences for what the driver's checkpoint does not support (share/FACTS.md §11), read from files alone
    (and ``tracing``, which only the kernel knows): CUPTI in use, a MIG device among those the process may use
    (``MIG-`` in its ``CUDA_VISIBLE_DEVICES``), and an MPS server on the machine (its clients go through it).

    CUPTI in use means gpucleanup's own ``%gpumem --trace`` on (``tracing``: its subscriber holds CUPTI) or a tool
    injected into the process through ``CUDA_INJECTION64_PATH`` (Nsight Systems, Nsight Compute,
    compute-sanitizer). The library merely loaded is not refused: JAX's XLA plugin and PyTorch's profiler load
    libcupti at import without subscribing; such JAX kernels were parked and resumed on the project's GPU runs
    (tests/bench/results/h100-park-loop-jax-64cf67d-2026-11-27.log), and a refusal for the mapping alone refused
    every one of them (tests/bench/results/h100-park-hold-cupti-refused-2026-12-06.log)."""
    out: List[str] = []
    try:
        with open(f"{proc}/{int(pid)}/environ", "rb") as fh:
            environ = fh.read().split(b"\0")
    except OSError:
        environ = []
    maps = read_maps(pid, proc) if maps is None else maps
    for refusal in (unproven_refusal(pid, proc, environ, maps, unheld, env), managed_refusal(pid, maps, environ, env)):
        if refusal:
            out.append(refusal)
    injected = next((v.split(b"=", 1)[1] for v in environ if v.startswith(b"CUDA_INJECTION64_PATH=")), b"")
    if tracing:
        out.append("[gpucleanup.park.647] %gpumem --trace is on in this kernel: its CUPTI subscriber is something "
                   "the driver's checkpoint does not support, so it is not parked; %gpumem --trace off, then park")
    elif injected:
        out.append(f"[gpucleanup.park.647] process {pid} runs under a CUDA tool injected through "
                   f"CUDA_INJECTION64_PATH={printable(injected.decode('utf-8', 'replace'))[:160]} (a profiler or "
                   "compute-sanitizer, through CUPTI), which the driver's checkpoint does not support: it is not "
                   "parked; restart the kernel without the tool to make it parkable")
    visible = next((v.split(b"=", 1)[1] for v in environ if v.startswith(b"CUDA_VISIBLE_DEVICES=")), b"")
    if b"MIG-" in visible:
        out.append(f"[gpucleanup.park.648] process {pid} runs on a MIG device (CUDA_VISIBLE_DEVICES names "
                   f"{printable(visible.decode('utf-8', 'replace'))[:120]}), which the driver's checkpoint does not "
                   "support: it is not parked")
    server = mps_server(proc)
    if server:
        out.append(f"[gpucleanup.park.649] an MPS server runs on this machine ({server}), and the driver's checkpoint "
                   "does not support MPS clients: nothing is parked while it runs")
    return out


#: What the driver's checkpoint answers for a process holding memory it cannot move (CUDA managed memory); once it
#: has, it fails every later checkpoint of that process with CUDA_ERROR_UNKNOWN, even once the memory is freed
#: (an H100, driver 580.159.04: share/FACTS.md §11), so the refusal lasts as long as the process.
LASTING_RESULTS = ("CUDA_ERROR_NOT_SUPPORTED",)
UNSUPPORTED_MEMORY = ("the process holds memory the driver's checkpoint does not support, such as CUDA managed memory: "
                      "cudaMallocManaged, CuPy's malloc_managed, Numba's managed_array")
REFUSED_FOR_LIFE = ("the driver then fails every later checkpoint of the process, even once that memory is freed, so "
                    "no park of it is tried again; restart the kernel to make it parkable")
MANAGED_REMEDY = ("free it in a cell before any park (CuPy: delete the arrays, then free_all_blocks() on the pool made "
                  "with malloc_managed): a park the driver refuses leaves the process unparkable until it exits")


def lasting_refusal(outcome: "Outcome") -> Optional[str]:
    """The driver's answer when a park's checkpoint was refused for what the process holds and the process runs
    again (unlocked): a park tried before the process changes would be refused the same way. None otherwise."""
    if outcome.ok or outcome.action != "park" or outcome.state != RUNNING:
        return None
    return next((s.result for s in outcome.steps
                 if s.name == "checkpoint" and not s.hung and s.result in LASTING_RESULTS), None)


def refused_again_refusal(pid: int, memo: dict, now_ns: Optional[int] = None) -> str:
    """A park not tried because the driver refused one for what the process holds (``memo``: the park lock's
    note, ``{"result", "since_ns"}``): it would fail every later one (:data:`LASTING_RESULTS`)."""
    now_ns = time.time_ns() if now_ns is None else now_ns
    elapsed = max(0.0, (now_ns - int(memo["since_ns"])) / 1e9)
    ago = format_duration(elapsed) if elapsed >= 1 else "moments"
    return (f"[gpucleanup.park.652] the driver refused to checkpoint process {pid} {ago} ago "
            f"({printable(str(memo['result']))[:60]}: {UNSUPPORTED_MEMORY}); {REFUSED_FOR_LIFE}")


def refusals(pid: int, found: Optional[Step], usage: Optional[Dict[str, int]], view: Optional[List[Gpu]] = None,
             parked_bytes: Optional[int] = None, meminfo: str = "/proc/meminfo", proc: str = "/proc",
             cgroup_root: str = "/sys/fs/cgroup", tracing: bool = False,
             unheld: Optional[str] = NOT_A_KERNEL, maps: Optional[str] = None,
             env: Optional[Dict[str, str]] = None) -> List[str]:
    """Why process ``pid`` cannot be parked now, each reason one sentence (empty: it can), from what is known
    without touching it: the driver's state (``found``, a ``state`` step), the GPUs it uses, host memory and
    its cgroup's limit, whether the kernel's own trace is on (``tracing``), and whether the park holds a JAX
    kernel's threads while parked (``unheld``: None when it does, else why not; :func:`kernel_hold`). The one
    decision every way of parking goes through, and what ``park --check`` says. ``maps``: the process's
    ``/proc/PID/maps`` already read (:func:`read_maps`; None: read here); ``env``: the parking process's
    environment where it is not this one's (:func:`unproven_opt_in`)."""
    out: List[str] = []
    if found is not None and (found.refused or found.hung or found.state != RUNNING):
        out.append(_refusal_for_state(pid, found, usage))
    size = parked_bytes if parked_bytes is not None else (sum(usage.values()) if usage else None)
    for reason in (unrestorable_refusal(pid, usage, view), host_memory_refusal(size, meminfo),
                   cgroup_memory_refusal(size, cgroup_memory(pid, proc, cgroup_root))):
        if reason:
            out.append(reason)
    out.extend(unsupported_refusals(pid, proc, tracing, unheld, maps, env))
    return out


def park(pid: int, limits: Limits = Limits(), env: Optional[Dict[str, str]] = None,
         parked_bytes: Optional[int] = None, tracing: bool = False,
         hold_threads: Optional[Callable[[Optional[int]], Union[List[int], str, None]]] = None,
         allow: Allow = None) -> Outcome:
    """Lock, then checkpoint process ``pid``; on any failure leave it running (or say exactly where it is).

    Raises :class:`ParkRefused` when nothing was done: the first of :func:`refusals` (the process is not
    running, the driver has no checkpoint calls, it uses several GPUs, host or cgroup memory cannot hold its
    device memory, ...). Otherwise returns an :class:`Outcome` whose ``state`` is ``checkpointed`` when the
    park worked. ``parked_bytes``: the process's device memory when the caller knows it; else it is read
    from ``nvidia-smi`` where there is one. A Ctrl-C or SIGTERM lets the step under way finish, then stops:
    after the lock it unlocks (the process runs as before), after the checkpoint the process stays parked.

    ``hold_threads``: for a kernel, gives the threads to hold while parked, from the driver's restore thread
    (:func:`.parked_hold.threads_to_hold` in the kernel, :func:`.parked_hold.listed_threads` outside it; None: it
    cannot say; a sentence: why not, :func:`hold_plan`); they are held when JAX runs in the process
    (:data:`HOLD_WHILE_PARKED`),
    from just after the lock (CRIU freezes a process after its lock: the lock itself needs its threads) until
    :func:`resume` unlocks it (``allow`` names the hold's helper to the kernel). A hold that cannot be made
    unlocks the process again and says ``park.654``: such a kernel would die while parked.
    """
    started = time.monotonic()
    steps: List[Step] = []
    apps = compute_apps()
    usage = process_gpu_usage(pid, apps=apps)
    if parked_bytes is None and usage is not None:
        parked_bytes = sum(usage.values())

    held: Optional[dict] = None

    def outcome(ok: bool, now: Optional[str], message: str, changed: bool = False) -> Outcome:
        if now in (RUNNING, FAILED):  # running again: its threads go on (in any other state they stay held)
            parked_hold.release(held, pid)
        return Outcome("park", pid, ok, now, message, steps, time.monotonic() - started, changed, parked_bytes,
                       usage=usage, interrupted=any(s.interrupted for s in steps),
                       parked_hold=held if now in (CHECKPOINTED, LOCKED) else None)

    found = state(pid, limits, env)
    steps.append(found)
    unheld = kernel_hold(env) if hold_threads is not None else NOT_A_KERNEL
    reasons = refusals(pid, found, usage, gpus() if usage and len(usage) > 1 else None, parked_bytes,
                       tracing=tracing, unheld=unheld, env=env)
    layout = layout_refusal(found, gpus) if not reasons else None
    if reasons or layout:
        raise ParkRefused(reasons[0] if reasons else layout)
    if found.interrupted:
        raise ParkRefused("[gpucleanup.park.631] interrupted (Ctrl-C or SIGTERM) before the lock: nothing was done, "
                          f"process {pid} runs as before")

    hold: Optional[Callable[[], Optional[str]]] = None
    if unheld is None and holds_while_parked(pid):
        listed = hold_plan(pid, found.restore_thread, hold_threads)

        def hold_after_lock() -> Optional[str]:
            """After the lock, as CRIU freezes the process after its lock: the threads listed are stopped; a
            sentence when they could not be."""
            nonlocal held
            limit_ms = max(1, min(60000, int(limits.hold_s * 1000)))
            held = parked_hold.start(pid, helper_command("hold", pid, [str(limit_ms), ",".join(map(str, listed))]),
                                     limit_ms, helper_env(env), HELPER_CWD, allow)
            if not held.get("held"):
                why, held = held.get("why") or "not held", None
                return why
            if not held.get("threads"):
                held = None
            return None

        hold = hold_after_lock

    try:
        return _lock_and_checkpoint(pid, limits, env, steps, outcome, hold)
    except BaseException:
        # Let go only of a process that runs: one left locked or parked keeps its threads held for the resume
        # (which finds the hold by its threads' tracer), as one of them calling the driver now could kill it.
        if held is not None:
            with contextlib.suppress(BaseException):
                if state(pid, limits, env).state == RUNNING:
                    parked_hold.release(held, pid)
        raise


def _lock_and_checkpoint(pid: int, limits: Limits, env: Optional[Dict[str, str]], steps: List[Step],
                         outcome: Callable[..., Outcome], hold: Optional[Callable[[], Optional[str]]]) -> Outcome:
    locked = step(pid, "lock", limits, env=env)
    steps.append(locked)
    if locked.refused:
        raise ParkRefused(locked.refused)
    if locked.ok and locked.interrupted:
        return _unlock_back(pid, limits, env, steps, outcome, "interrupted (Ctrl-C or SIGTERM) during the lock")
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
    try:
        why = hold() if hold is not None else None
    except KeyboardInterrupt:  # Ctrl-C or SIGTERM in the CLI: the helper was stopped, its threads go on
        return _unlock_back(pid, limits, env, steps, outcome, "interrupted (Ctrl-C or SIGTERM) while its threads "
                            "were being held")
    except Exception as exc:  # never a locked kernel left behind: it would hang at its next cell
        why = f"{type(exc).__name__}: {exc}"
    if why is not None:
        back = _unlock_back(pid, limits, env, steps, outcome, f"the threads to hold could not be held ({why})")
        if back.state == RUNNING:
            back.message = hold_refusal(pid, why)
        return back

    checkpointed = step(pid, "checkpoint", limits, env=env)
    steps.append(checkpointed)
    now = checkpointed.state if not checkpointed.hung else _state_after_hang(pid, limits, env, steps)
    if checkpointed.ok or now == CHECKPOINTED:
        if checkpointed.interrupted:
            return outcome(True, CHECKPOINTED, f"parked process {pid}: the interrupt (Ctrl-C or SIGTERM) came during "
                           f"the checkpoint, which was let finish; resume it with {_resume_hint(pid)}", changed=True)
        return outcome(True, CHECKPOINTED, f"parked process {pid}", changed=True)
    if now == LOCKED:
        what = (f"outran its limit of {limits.checkpoint_s:.0f} s" if checkpointed.hung
                else f"failed with {checkpointed.result}"
                + (f" ({UNSUPPORTED_MEMORY}; {REFUSED_FOR_LIFE})" if checkpointed.result in LASTING_RESULTS else ""))
        return _unlock_back(pid, limits, env, steps, outcome, f"the checkpoint {what}")
    return outcome(False, now, f"[gpucleanup.park.619] the checkpoint of process {pid} "
                   f"{'outran its limit' if checkpointed.hung else 'failed with ' + str(checkpointed.result)} and "
                   f"left it {now or 'in a state the driver did not report'}: "
                   + ("try " + _resume_hint(pid) if now in (LOCKED, CHECKPOINTED) else
                      "its GPU state may be lost; save what you can and restart it"))


#: Frameworks whose own threads call the driver while their process is checkpointed (share/FACTS.md §11): a kernel
#: running one has them held while parked (:mod:`.parked_hold`), found in its mappings as :data:`UNPROVEN` says.
HOLD_WHILE_PARKED = ("jax",)


#: Why a kernel's threads could not be listed for a park from outside (:func:`.parked_hold.listed_threads`).
UNLISTED = "the kernel has listed none yet; it lists them as a cell ends: run a cell"
#: The driver's state step named no restore thread: it must run through the checkpoint, and cannot be told apart.
NO_RESTORE_THREAD = "the driver did not name its restore thread, which must run while the others are held"


def busy_threads(names: List[str]) -> str:
    """Why a JAX kernel is not parked while threads of the notebook run (``names``): held, one holding Python's lock
    would stop the kernel; left running, a JAX call of theirs would kill it while parked."""
    return (f"{len(names)} thread{'s' if len(names) > 1 else ''} of the notebook still run{'' if len(names) > 1 else 's'}"
            f" ({', '.join(names[:3])}{', ...' if len(names) > 3 else ''}), which would call JAX while it is parked; "
            "park it once they end")


def ptrace_refusal(proc: str = "/proc") -> Optional[str]:
    """Why no helper of this user can hold another process's threads (Yama's ptrace_scope 3: nobody; 2: only a
    process with CAP_SYS_PTRACE, taken as root here), None when it can."""
    try:
        with open(f"{proc}/sys/kernel/yama/ptrace_scope", encoding="ascii") as fh:
            scope = int(fh.read().strip())
    except (OSError, ValueError):
        return None  # no Yama: ordinary ptrace permissions (same user)
    if scope >= 3:
        return "Yama's ptrace_scope is 3 on this machine: no process may trace another"
    if scope == 2 and os.geteuid() != 0:
        return "Yama's ptrace_scope is 2 on this machine: only root may trace another process"
    return None


def hold_plan(pid: int, restore_thread: Optional[int],
              hold_threads: Callable[[Optional[int]], Union[List[int], str, None]]) -> List[int]:
    """The threads of JAX kernel ``pid`` to hold while it is parked (``hold_threads`` lists them, or says why not);
    ParkRefused with ``park.654`` when they cannot be held, before anything is done."""
    if not restore_thread:
        raise ParkRefused(hold_refusal(pid, NO_RESTORE_THREAD))
    why = ptrace_refusal()
    if why:
        raise ParkRefused(hold_refusal(pid, why))
    listed = hold_threads(restore_thread)
    if listed is None:
        raise ParkRefused(hold_refusal(pid, UNLISTED))
    if isinstance(listed, str):
        raise ParkRefused(hold_refusal(pid, listed))
    return listed


def hold_refusal(pid: int, why: str) -> str:
    """``park.654``: a kernel whose threads must be held while parked, and could not be (``why``)."""
    return (f"[gpucleanup.park.654] process {pid} runs JAX, whose own threads call the driver while the process is "
            f"checkpointed and die there: they are held while it is parked, and this time they could not be ({why}): "
            "it is not parked and runs as before")


def holds_while_parked(pid: int, proc: str = "/proc", maps: Optional[str] = None) -> bool:
    """Whether process ``pid`` runs a framework of :data:`HOLD_WHILE_PARKED` (its mappings; ``maps``: already read)."""
    maps = read_maps(pid, proc) if maps is None else maps
    return maps is not None and any(mark in maps for name in HOLD_WHILE_PARKED for mark in UNPROVEN[name])


def _state_after_hang(pid: int, limits: Limits, env: Optional[Dict[str, str]], steps: List[Step]) -> Optional[str]:
    """The state read again by a fresh helper after a step outran its limit (its helper is killed and the step
    reported), so that nothing is ever half-parked silently."""
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


def resume(pid: int, limits: Limits = Limits(), env: Optional[Dict[str, str]] = None,
           need: Optional[Dict[str, int]] = None, allow: Allow = None, held: Optional[dict] = None) -> Outcome:
    """Bring process ``pid`` back from whatever state a park left it in (restore, then unlock).

    Driven by the driver's own state, not by what was recorded: a checkpointed process is
    restored and unlocked, a locked one unlocked, a running one left alone (``changed`` False).
    ``need``: what it held per GPU UUID before its park (kept by the park); a GPU that lacks room for it
    now is said and no restore is tried. A failed restore leaves it parked, its memory still in host
    memory, and says how to retry. A Ctrl-C or SIGTERM lets the step under way finish. The restore and its
    unlock run with the process's other threads held (:func:`restore_held`); ``allow`` names the helper to
    the kernel first. ``held``: the park's hold while parked (:mod:`.parked_hold`; None: looked for among the
    tracers of the process's threads), ended once the process runs.
    """
    started = time.monotonic()
    steps: List[Step] = []
    held = held if held and held.get("threads") else parked_hold.find(pid)

    def outcome(ok: bool, now: Optional[str], message: str, changed: bool = False) -> Outcome:
        if now == RUNNING or now == FAILED:
            parked_hold.release(held, pid)  # after the unlock: the threads may call the driver again
        return Outcome("resume", pid, ok, now, message, steps, time.monotonic() - started, changed,
                       interrupted=any(s.interrupted for s in steps))

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
    if found.state not in (CHECKPOINTED, LOCKED):  # under way, or a state this gpucleanup does not know
        return outcome(False, found.state, _refusal_for_state(pid, found))
    if found.state == CHECKPOINTED:
        if need:
            apps = compute_apps()
            lacking = room_refusal(pid, need, gpus(), apps)
            if lacking:
                return outcome(False, CHECKPOINTED, lacking)
        restored, unlocked = restore_held(pid, limits, env, allow, held.get("holder") if held else None)
        steps.append(restored)
        if restored.refused:  # the helper ran no driver call: the process is as it was
            return outcome(False, CHECKPOINTED, restored.refused)
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
        if unlocked is not None:
            steps.append(unlocked)
            if unlocked.ok or unlocked.state == RUNNING:
                return outcome(True, RUNNING, f"resumed process {pid}", changed=True)
        # restored but not unlocked (or the unlock not tried): one unlock of its own, as from a park left locked
    unlocked = step(pid, "unlock", limits, env=env)
    steps.append(unlocked)
    now = unlocked.state if not unlocked.hung else _state_after_hang(pid, limits, env, steps)
    if unlocked.ok or now == RUNNING:
        return outcome(True, RUNNING, f"resumed process {pid}", changed=True)
    return outcome(False, now, f"[gpucleanup.park.626] process {pid} was restored but unlocking it "
                   f"{'outran its limit' if unlocked.hung else 'failed with ' + str(unlocked.result)}: it is "
                   f"{now or 'in a state the driver did not report'}; retry with {_resume_hint(pid)}")


def lost(outcome: Outcome) -> bool:
    """Whether a resume left the process where no later resume can bring it back: the driver says it failed,
    or, after a restore or an unlock was tried, in a state that is neither parked, locked nor running (a restore
    that fails can leave a process whose unlock fails for good, share/FACTS.md §11)."""
    if outcome.action != "resume" or outcome.ok:
        return False
    if outcome.state == FAILED:
        return True
    tried = any(s.name in ("restore", "unlock") for s in outcome.steps)
    return tried and outcome.state not in (CHECKPOINTED, LOCKED, RUNNING) + UNDER_WAY


MAX_PID = (1 << 31) - 1  # the driver takes an int: a larger number would wrap onto another process


def pid_argument(text: str) -> int:
    """An argparse type: a process id, 1 to 2^31-1, written in decimal digits alone."""
    import argparse

    if not text.isdigit() or not 1 <= int(text) <= MAX_PID:
        raise argparse.ArgumentTypeError(f"{text!r} is not a process id (a whole number from 1 to {MAX_PID})")
    return int(text)


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
    parser.add_argument("pid", type=pid_argument)
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

