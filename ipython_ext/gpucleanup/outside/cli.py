"""``gpucleanup``: GPU memory of every Jupyter kernel on this machine, from outside the kernels.

    gpucleanup ps                     one line per kernel: state, memory per device, last cell
    gpucleanup status KERNEL [--json] one kernel in full (KERNEL: pid, kernel id or a unique prefix, notebook)
    gpucleanup watch [KERNEL]         cell records as they happen, until Ctrl-C
    gpucleanup drain KERNEL           settle, trim the driver pools and run its own cleanup now (between cells)
    gpucleanup park KERNEL            move all its GPU memory, context included, to host memory (between cells)
    gpucleanup park --check KERNEL    whether it can be parked now, and every reason why not (touches nothing)
    gpucleanup resume KERNEL          bring a parked kernel's GPU memory back (its next cell also does)
    gpucleanup exporter [--port N]    Prometheus metrics of every kernel over HTTP, until Ctrl-C

``python -m gpucleanup`` is the same command. Every command takes ``--json``. Colour only on a
terminal, and never with ``NO_COLOR`` set (https://no-color.org) or ``TERM=dumb``.

Kernels are found through their discovery files in Jupyter's runtime directory;
files provably left by exited kernels are removed on the way, kernels of another
PID namespace are shown as "elsewhere" and left alone, and a discovery file that
cannot be used is skipped with one line on stderr. Each kernel gets at most
``--timeout`` seconds (default 1), and all are asked at once.

Exit status: (the page's REST API answers the same outcomes with the HTTP status in brackets)
  0    done [200]; ps --json with no kernel prints []; park --check: it can
       be parked now
  1    no kernel with gpucleanup; KERNEL unknown, ambiguous or dead [404]
  2    usage: unknown command or option, option value out of range [400]
  3    a kernel did not answer within --timeout [504]
  4    refused, nothing was done [409]: a cell or a drain is running, the
       kernel is parked already (park) or not parked (resume), another park
       of it is under way, no room to resume it, it cannot be parked (park
       --check says why); also a key file that cannot be used, or an answer
       that cannot be read [502]
  5    drain: the kernel answered, but a device was not drained (busy,
       unusable, failed) or its CUDA driver is unusable [200, "drained":
       false]
  6    park, resume: a driver step failed [500, "ok": false]; the message
       says what state the process is in and what to do
  7    cannot run here: exporter without prometheus_client (pip install
       'gpucleanup[server]'), or its port or token file cannot be used
  130  interrupted (Ctrl-C; SIGTERM too during park and resume, which let the
       driver's step under way finish and say the state they left), except
       watch and exporter, whose way to stop is Ctrl-C (exporter: SIGTERM
       too), which exit 0
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import json
import math
import os
import re
import signal
import sys
import time
from pathlib import Path
from typing import List, Optional, Sequence

from ..protocol import discovery
from . import kernels as kernels_view
from ..park import steps as park_steps, kernel_side as parking, from_outside as remote_park
from ..protocol import status_client
from ..records import report
from ..records.report import Table, format_bytes, format_duration
from ..say import printable

EXIT_OK = 0
EXIT_NOT_FOUND = 1
EXIT_USAGE = 2
EXIT_NO_ANSWER = 3
EXIT_REFUSED = 4
EXIT_NOT_DRAINED = 5
EXIT_NOT_PARKED = 6
EXIT_CANNOT_RUN = 7
EXIT_INTERRUPTED = 130

# The status server refuses a drain timeout outside 0..max_drain_timeout_s
# (share/protocol.md, default 60): checked here so that it is a usage error.
MAX_DRAIN_TIMEOUT = 60.0
# zmq's poll takes an int of milliseconds (about 24.8 days); a day is plenty.
MAX_TIMEOUT = 86400.0


class CliError(Exception):
    def __init__(self, message: str, code: int):
        super().__init__(message)
        self.code = code


# ------------------------------------------------------------------ kernels


def _scan(args) -> discovery.ScanResult:
    """The discovery files; each bad one said once on stderr (``gpucleanup: skipped PATH: WHY``)."""
    directory = Path(args.runtime_dir) if args.runtime_dir else None
    found = discovery.scan(directory, clean=True)
    _say_skipped(args, found.skipped)
    _say_skipped_summary(args)
    return found


#: ``text`` with control characters escaped: nothing a discovery file, a kernel's reply or a thread's name
#: holds may drive the terminal or start a line that looks like gpucleanup's own
_safe = printable


def _no_kernels_message(args) -> str:
    where = args.runtime_dir or str(discovery.runtime_dir())
    return (
        f"no kernel with gpucleanup is running (no usable discovery file in {where}): "
        "run %load_ext gpucleanup in a kernel first"
    )


def _matching(kernels, query: str) -> list:
    """The kernels ``query`` names: by pid, kernel id or notebook (as shown, or absolute); else by the notebook's
    file name; else by a prefix of the kernel id."""
    exact = [k for k in kernels if query in (str(k.pid), k.kernel_id, k.notebook, k.notebook_path())]
    if not exact:
        exact = [k for k in kernels if k.notebook and os.path.basename(k.notebook) == query]
    if not exact:
        exact = [k for k in kernels if k.kernel_id and k.kernel_id.startswith(query)]
    return exact


def _resolve(args, query: str) -> discovery.Kernel:
    if not query or not query.strip():
        # an unset variable in a script ("gpucleanup park $KERNEL") must not pick the only kernel
        raise CliError("KERNEL is empty: give a pid, a kernel id (or a unique prefix) or a notebook; gpucleanup ps "
                       "lists them", EXIT_USAGE)
    found = _scan(args)
    kernels, dead = found.live, found.stale
    exact = _matching(kernels, query)
    if len(exact) == 1:
        return exact[0]
    if len(exact) > 1:
        names = ", ".join(f"{k.pid} ({k.kernel_id})" for k in exact)
        raise CliError(f"{query!r} matches {len(exact)} kernels: {names}; give more of the kernel id or the pid", EXIT_NOT_FOUND)
    if any((discovery.instance_of(p) or "").split("-")[0] == query for p in dead):
        raise CliError(f"kernel {query} is dead: its process is gone (its discovery file was removed)", EXIT_NOT_FOUND)
    elsewhere = _matching(found.elsewhere, query)
    if elsewhere:
        k = elsewhere[0]
        raise CliError(
            f"kernel {k.pid} is elsewhere ({k.elsewhere}): its pid means nothing here; "
            f"{kernels_view.where_to_ask(k)}",
            EXIT_NOT_FOUND,
        )
    if not kernels and not found.elsewhere:
        raise CliError(_no_kernels_message(args), EXIT_NOT_FOUND)
    raise CliError(f"no kernel {query!r}: gpucleanup ps lists the kernels (pid, kernel id or notebook)", EXIT_NOT_FOUND)


def _target(kernel: discovery.Kernel, endpoint: Optional[str] = None) -> status_client.Target:
    """The kernel's endpoint and key; CliError for a key file that cannot be used."""
    try:
        key = kernel.read_key()
    except discovery.UnsafeFile as exc:
        raise CliError(
            f"kernel {kernel.pid}: its {_bad_key_file(kernel, exc)}: gpucleanup writes a regular file there; "
            "restart the kernel",
            EXIT_REFUSED,
        ) from None
    except OSError as exc:
        raise CliError(
            f"kernel {kernel.pid}: cannot read its key file {kernel.key_file} ({exc.strerror}): "
            "run gpucleanup as the user who started the kernel",
            EXIT_REFUSED,
        ) from None
    return status_client.Target(endpoint or kernel.endpoint, key, kernel.label)


def _failure(kernel: discovery.Kernel, error: status_client.StatusError, timeout: float) -> CliError:
    who = f"kernel {kernel.pid}"
    if isinstance(error, status_client.StatusTimeout):
        return CliError(
            f"{who} did not answer within {timeout:g} s: the process may be stopped or overloaded "
            "(--timeout waits longer)",
            EXIT_NO_ANSWER,
        )
    if isinstance(error, status_client.StatusUnreachable):
        return CliError(f"{who}: {error}", EXIT_NO_ANSWER)
    if error.error_id == "gpucleanup.server.403":
        return CliError(
            f"{who} refused the request: its key file {kernel.key_file} does not hold the kernel's key "
            f"(the file was replaced or belongs to another kernel): {error}",
            EXIT_REFUSED,
        )
    return CliError(f"{who}: {error}", EXIT_REFUSED)


def _bad_key_file(kernel: discovery.Kernel, error: discovery.UnsafeFile) -> str:
    return f"key file {kernel.key_file} is {error.strerror}"


# ------------------------------------------------------------------ reading replies


_total = kernels_view.total
device_rows = kernels_view.device_rows


def state_text(state: Optional[dict], reply: Optional[dict] = None) -> str:
    """``running cell 12 for 5.2 s``, ``idle for 3 min 2 s`` (since its last cell ended, whatever a park or a
    drain did since), ``parked 8.2 GiB in host memory for 42 min``; ``reply``: the status reply it comes from."""
    server = reply.get("server") if isinstance(reply, dict) else None
    return kernels_view.state_text(state, server.get("started_ns") if isinstance(server, dict) else None) or "?"


def memory_text(reply: dict) -> str:
    rows = device_rows(reply)
    if not rows:
        driver = ((reply.get("snapshot") or {}).get("driver") or {}).get("state")
        return "no GPU in use" if driver in (None, "not_initialized", "ready") else f"no GPU ({driver})"
    parts = []
    for dev in rows:
        text = f"GPU{dev['index']} live {format_bytes(_total(dev['live_bytes']))} cached {format_bytes(_total(dev['cached_bytes']))}"
        if dev.get("driver_pool_reserved_bytes"):
            text += f" pool {format_bytes(dev['driver_pool_reserved_bytes'])}"
        parts.append(text)
    return "; ".join(parts)


def last_cell_text(reply: dict) -> str:
    record = reply.get("last_record")
    if not isinstance(record, dict):
        return "-"
    freed = sum(_total(d.get("freed_bytes")) for d in record.get("devices") or [] if isinstance(d, dict))
    freed += _total((record.get("pinned") or {}).get("freed_bytes"))
    cell = record.get("cell")
    if record.get("source") == "outside":
        return f"drain from outside freed {format_bytes(freed)}"
    return f"cell {cell} freed {format_bytes(freed)}" if cell is not None else f"freed {format_bytes(freed)}"


# ------------------------------------------------------------------ colour

_CODES = {"green": "32", "yellow": "33", "red": "31", "magenta": "35", "dim": "2", "bold": "1"}


def colour_wanted(stream=None) -> bool:
    """Colour only on a terminal, never with NO_COLOR set to anything non-empty or TERM=dumb."""
    stream = stream or sys.stdout
    if os.environ.get("NO_COLOR") or os.environ.get("TERM") == "dumb":
        return False
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


def _paint(text: str, colour: Optional[str], on: bool) -> str:
    return f"\033[{_CODES[colour]}m{text}\033[0m" if on and colour else text


def state_colour(text: str) -> Optional[str]:
    """The colour of a state cell: idle green, running yellow, waiting and draining magenta, failures red."""
    word = text.split(" ", 1)[0]
    if word == "idle":
        return "green"
    if word == "running":
        return "yellow"
    if word in ("waiting", "draining"):
        return "magenta"
    if word == "elsewhere":
        return "dim"
    if word in ("no", "refused:", "?") or text.startswith("kernel "):
        return "red"
    return None


def _table(headers: Sequence[str], rows: Sequence[Sequence[str]], colour_column: Optional[int] = None,
           colour: bool = False) -> str:
    """The command's tables: ``report.Table``, as %gpumem's, without title or rule; the state column coloured."""
    paint = None
    if colour and colour_column is not None:
        def paint(_row: int, column: int, value: str, padded: str) -> str:
            return _paint(padded, state_colour(value), True) if column == colour_column else padded
    return Table("", headers, rows, align="l" * len(headers), rule=False).text(paint)


def _kernel_name(kernel: discovery.Kernel) -> str:
    if kernel.notebook and kernel.kernel_id:
        return _safe(f"{kernel.kernel_id[:8]} ({kernel.notebook})")
    return _safe(kernel.notebook or kernel.kernel_id or "-")


# ------------------------------------------------------------------ commands


#: skipped files said one line each; past that, one line says how many more (a directory of planted files
#: must not flood the terminal)
MAX_SKIPPED_LINES = 5


def _say_skipped(args, skipped) -> None:
    said = args.__dict__.setdefault("_skipped_said", set())
    held = args.__dict__.setdefault("_skipped_held", [])
    for path, why in skipped:
        if (path, why) in said:
            continue
        said.add((path, why))
        if len(said) <= MAX_SKIPPED_LINES:
            print(f"gpucleanup: skipped {path}: {_safe(why)}", file=sys.stderr, flush=True)
        else:
            held.append(path)


def _say_skipped_summary(args) -> None:
    """One line for the skipped files not said one by one."""
    held = args.__dict__.get("_skipped_held") or []
    if held:
        where = args.runtime_dir or str(discovery.runtime_dir())
        print(f"gpucleanup: skipped {len(held)} more unusable file{'s' if len(held) != 1 else ''} in {_safe(where)} "
              f"(the first {MAX_SKIPPED_LINES} are said above)", file=sys.stderr, flush=True)
        held.clear()


def cmd_ps(args) -> int:
    directory = Path(args.runtime_dir) if args.runtime_dir else None
    gathered = kernels_view.gather(directory, args.timeout)
    _say_skipped(args, gathered.skipped)
    views = []
    for view in gathered.kernels:
        if view.error_kind == "bad_key" and isinstance(view.exception, discovery.UnsafeFile):
            # A FIFO, a device, a link or a huge file as the key: skipped like a bad discovery file.
            _say_skipped(args, [(view.kernel.path, _bad_key_file(view.kernel, view.exception))])
            continue
        views.append(view)
    _say_skipped_summary(args)
    if not views:
        # For a script no kernel is an answer, not a failure: an empty list.
        if args.json:
            print("[]")
            return EXIT_OK
        raise CliError(_no_kernels_message(args), EXIT_NOT_FOUND)
    if args.json:
        out = []
        for view in views:
            kernel = view.kernel
            entry = {"pid": kernel.pid, "kernel_id": kernel.kernel_id, "notebook": kernel.notebook,
                     "discovery_file": str(kernel.path), "elsewhere": view.elsewhere is not None}
            if view.elsewhere is not None:
                # Not asked: its pid, endpoint and key are another machine's or namespace's. Its file is left alone.
                entry["elsewhere_reason"] = view.elsewhere
                entry["place"] = kernel.place
                entry["host"] = kernel.host
            elif view.status is None:
                entry["error"] = str(_view_error(view, args.timeout))
            else:
                entry["status"] = view.status
            out.append(entry)
        print(json.dumps(out, indent=1))
        return EXIT_OK
    rows = []
    for view in views:
        kernel = view.kernel
        if view.elsewhere is not None:
            rows.append([str(kernel.pid), _kernel_name(kernel), f"elsewhere ({_safe(view.elsewhere)})", "", ""])
        elif view.status is None:
            rows.append([str(kernel.pid), _kernel_name(kernel), _short_error(_view_error(view, args.timeout)), "", ""])
        else:
            reply = view.status
            rows.append([str(kernel.pid), _kernel_name(kernel), state_text(reply.get("state"), reply), memory_text(reply),
                         last_cell_text(reply)])
    print(_table(["PID", "KERNEL", "STATE", "GPU MEMORY", "LAST CELL"], rows, colour_column=2,
                 colour=colour_wanted()))
    return EXIT_OK


def _view_error(view: kernels_view.KernelView, timeout: float) -> CliError:
    """The CliError of a kernel that could not be asked, as status and drain would raise it."""
    if isinstance(view.exception, status_client.StatusError):
        return _failure(view.kernel, view.exception, timeout)
    if isinstance(view.exception, OSError):
        return CliError(
            f"kernel {view.kernel.pid}: cannot read its key file {view.kernel.key_file} ({view.exception.strerror}): "
            "run gpucleanup as the user who started the kernel",
            EXIT_REFUSED,
        )
    return CliError(f"kernel {view.kernel.pid}: {view.error}", EXIT_REFUSED)


def _short_error(error: CliError) -> str:
    if error.code == EXIT_NO_ANSWER:
        return "no answer"
    text = str(error)
    return "refused: " + text.split(": ", 1)[-1][:60] if error.code == EXIT_REFUSED else text[:60]


def _ask(args, kernel: discovery.Kernel, kind: str, timeout: float, **fields) -> dict:
    target = _target(kernel)
    try:
        return status_client.request(target, kind, timeout, **fields)
    except status_client.StatusError as exc:
        raise _failure(kernel, exc, timeout) from None


def cmd_status(args) -> int:
    kernel = _resolve(args, args.kernel)
    reply = _ask(args, kernel, "status", args.timeout)
    if args.json:
        print(json.dumps(reply, indent=1))
        return EXIT_OK
    kinfo = reply.get("kernel") or {}
    lines = [
        f"kernel     {kernel.pid}  {_safe(kernel.kernel_id or '-')}",
        f"notebook   {_safe(kinfo.get('notebook') or kernel.notebook or '-')}",
    ]
    root = kinfo.get("notebook_root") if kinfo.get("notebook") else kernel.notebook_root
    if isinstance(root, str) and root:
        lines.append(f"root       {_safe(root)}  (the Jupyter Server's; the notebook is relative to it)")
    lines += [
        f"state      {_safe(state_text(reply.get('state'), reply))}",
        f"endpoint   {_safe(kernel.endpoint)}",
    ]
    snapshot = reply.get("snapshot") or {}
    driver = snapshot.get("driver") or {}
    lines.append(f"driver     {_safe(driver.get('state', '?'))}"
                 + (f" ({_safe(reply.get('snapshot_status'))})" if reply.get("snapshot_status") != "fresh" else ""))
    rows = []
    for dev in device_rows(reply):
        frameworks = sorted(set(dev["live_bytes"]) | set(dev["cached_bytes"]))
        fw = ", ".join(
            f"{name} {format_bytes(dev['live_bytes'].get(name, 0))} live/{format_bytes(dev['cached_bytes'].get(name, 0))} cached"
            for name in frameworks
        ) or "-"
        used = dev.get("used_bytes")
        total = dev.get("total_bytes")
        rows.append([
            f"GPU{dev['index']}",
            dev.get("name") or "",
            f"{format_bytes(used)}/{format_bytes(total)}" if used is not None else "-",
            format_bytes(dev["driver_pool_reserved_bytes"]) if dev.get("driver_pool_reserved_bytes") is not None else "-",
            fw,
        ])
    if rows:
        lines.append("")
        lines.append(_table(["DEVICE", "NAME", "USED/TOTAL", "DRIVER POOLS", "FRAMEWORK POOLS (live/cached)"], rows))
    else:
        lines.append("devices    no GPU in use")
    lines.append("")
    lines.append(f"last cell  {_safe(last_cell_text(reply))}")
    print("\n".join(lines))
    return EXIT_OK


def cmd_drain(args) -> int:
    kernel = _resolve(args, args.kernel)
    # A kernel that does not answer at all (stopped, hung in its server) is said within --timeout: a status
    # round trip first (under a millisecond), then the drain, whose reply comes after it, as long as it may take.
    _ask(args, kernel, "status", args.timeout)
    reply = _ask(args, kernel, "drain", args.timeout + args.drain_timeout, timeout_s=args.drain_timeout)
    result = reply.get("result") or {}
    devices = [dev for dev in result.get("devices") or [] if isinstance(dev, dict)]
    problems = [f"kernel {kernel.pid} {text}" for text in _drain_problems(result, devices, args.drain_timeout)]
    if args.json:
        print(json.dumps(reply, indent=1))
    else:
        driver = result.get("driver") or {}
        if not devices and driver.get("state") not in _BROKEN_DRIVER:
            print(f"kernel {kernel.pid}: drained; no GPU in use")
        for dev in devices:
            if dev.get("state") != "drained":
                continue  # said on stderr below, with what to do
            print(_safe(f"kernel {kernel.pid} GPU{dev.get('index')}: {report.drained_text(result, dev)}"))
        for note in report.drain_kernel_notes(result):
            print(f"kernel {kernel.pid}: {_safe(note)}")
    if problems:
        # stdout is flushed first so that a terminal shows the report before the failures.
        sys.stdout.flush()
        for text in problems:
            print(f"gpucleanup: {_safe(text)}", file=sys.stderr)
        return EXIT_NOT_DRAINED
    return EXIT_OK


def _park_lock(kernel: discovery.Kernel) -> Path:
    if not kernel.key_file:
        raise CliError(f"kernel {kernel.pid} has no key file: it cannot be parked from outside", EXIT_REFUSED)
    return parking.lock_path(kernel.key_file, kernel.pid)


class _TermAsInterrupt:
    """SIGTERM acts as Ctrl-C while a park or a resume runs: the step under way is let finish (its helper
    has a session of its own), then the park stops where it can say what state the kernel is in."""

    def __enter__(self):
        import signal

        try:
            self._old = signal.signal(signal.SIGTERM, signal.default_int_handler)
        except ValueError:  # not the main thread
            self._old = None
        return self

    def __exit__(self, *exc) -> None:
        import signal

        if self._old is not None:
            signal.signal(signal.SIGTERM, self._old)


def _resolve_for(args, action: str) -> discovery.Kernel:
    """:func:`_resolve` for park and resume: with ``--json``, a kernel not found still prints one object (the
    README's promise to scripts), then the error goes to stderr with its exit status."""
    try:
        return _resolve(args, args.kernel)
    except CliError as exc:
        if args.json:
            if action == "check":
                print(json.dumps({"pid": None, "kernel": args.kernel, "parkable": False, "reasons": [str(exc)]},
                                 indent=1))
            else:
                print(json.dumps({"action": action, "pid": None, "kernel": args.kernel, "ok": False,
                                  "changed": False, "message": str(exc)}, indent=1))
            sys.stdout.flush()
        raise


def cmd_park(args) -> int:
    kernel = _resolve_for(args, "check" if args.check else "park")
    if args.check:
        return _park_check(args, kernel)
    try:
        with _TermAsInterrupt():
            outcome = remote_park.park_from_outside(kernel.pid, _target(kernel), args.timeout, _park_lock(kernel))
    except status_client.StatusError as exc:
        raise _not_done(args, kernel, "park", _failure(kernel, exc, args.timeout)) from None
    except (park_steps.ParkRefused, parking.LockBusy, OSError) as exc:
        raise _not_done(args, kernel, "park", CliError(f"kernel {kernel.pid} not parked: {exc}", EXIT_REFUSED)) from None
    except KeyboardInterrupt:
        raise CliError(f"kernel {kernel.pid}: interrupted before the driver's first step: nothing was parked",
                       EXIT_INTERRUPTED) from None
    return _park_outcome(args, kernel, outcome, remote_park.outcome_text(outcome))


def _park_check(args, kernel: discovery.Kernel) -> int:
    """``gpucleanup park --check``: whether the kernel can be parked now, and why not; touches nothing."""
    found = remote_park.check_kernel(kernel.pid, _target(kernel), args.timeout, _park_lock(kernel))
    if args.json:
        print(json.dumps(found, indent=1))
    elif found["parkable"]:
        held = sum((found.get("usage") or {}).values())
        print(f"kernel {kernel.pid} can be parked now" + (f": it holds {format_bytes(held)} of GPU memory, which host "
                                                           "memory and its memory limit can take" if held else ""))
    else:
        print(f"kernel {kernel.pid} cannot be parked now:")
        for reason in found["reasons"]:
            print(f"  - {_safe(reason)}")
    if found.get("blocker") and not args.json:
        print(f"  but automatic and bulk parks leave it alone: {_safe(found['blocker'])}")
    return EXIT_OK if found["parkable"] else EXIT_REFUSED


def cmd_resume(args) -> int:
    kernel = _resolve_for(args, "resume")
    try:
        with _TermAsInterrupt():
            outcome, before = remote_park.resume_from_outside(kernel.pid, _target(kernel), args.timeout,
                                                          _park_lock(kernel), args.wait)
    except status_client.StatusError as exc:
        raise _not_done(args, kernel, "resume", _failure(kernel, exc, args.timeout)) from None
    except (park_steps.ParkRefused, parking.LockBusy, OSError) as exc:
        raise _not_done(args, kernel, "resume", CliError(f"kernel {kernel.pid} not resumed: {exc}",
                                                         EXIT_REFUSED)) from None
    except KeyboardInterrupt:
        raise CliError(f"kernel {kernel.pid}: interrupted before the driver's first step: nothing was done",
                       EXIT_INTERRUPTED) from None
    return _park_outcome(args, kernel, outcome, remote_park.outcome_text(outcome, before))


def _not_done(args, kernel: discovery.Kernel, action: str, error: CliError) -> CliError:
    """A park or resume that did nothing (refused, no answer): with --json its object on stdout all the same,
    so that a script reads one object whatever happened; ``error`` goes to stderr with its exit status."""
    if args.json:
        print(json.dumps({"action": action, "pid": kernel.pid, "ok": False, "changed": False,
                          "message": str(error)}, indent=1))
    return error


def _park_outcome(args, kernel: discovery.Kernel, outcome: park_steps.Outcome, text: str) -> int:
    text = _safe(text)  # the kernel's refusals and the helper's reasons are in it
    if args.json:
        print(json.dumps(outcome.as_dict(), indent=1))
    elif outcome.ok:
        print(f"kernel {kernel.pid}: {text}")
    if not outcome.ok:
        sys.stdout.flush()
        print(f"gpucleanup: kernel {kernel.pid}: {text}", file=sys.stderr)
    if outcome.interrupted:
        if outcome.ok and not args.json:
            print(f"gpucleanup: kernel {kernel.pid}: interrupted (Ctrl-C or SIGTERM) after the step under way had "
                  "finished: " + ("it is parked; its next cell brings it back" if outcome.action == "park" and
                                  outcome.state == park_steps.CHECKPOINTED else f"it is {outcome.state}"),
                  file=sys.stderr)
        return EXIT_INTERRUPTED
    return EXIT_OK if outcome.ok else EXIT_NOT_PARKED


# Without devices a drain did nothing: fine when no GPU was ever used
# (not_initialized, no_driver), a failure when the driver cannot be used.
_BROKEN_DRIVER = ("unusable", "exiting")


def _drain_problems(result: dict, devices: List[dict], drain_timeout: float) -> List[str]:
    """One line per device the drain did not drain: which, why, and what to do."""
    problems = []
    driver = result.get("driver") or {}
    if not devices and driver.get("state") in _BROKEN_DRIVER:
        problems.append(f"nothing drained, the CUDA driver is {driver['state']}: {driver.get('message') or 'no reason given'}")
    for dev in devices:
        state = dev.get("state")
        if state == "drained":
            continue
        gpu = f"GPU{dev.get('index')}"
        settle = dev.get("settle") or {}
        status = settle.get("status")
        busy_for = settle.get("busy_for_s")
        if state == "busy" and status == "still_busy":
            since = f" queued {format_duration(busy_for)} ago" if isinstance(busy_for, (int, float)) else ""
            problems.append(
                f"{gpu} busy: its work{since} is still running, and a wait for it is under way already (the "
                "kernel's own cleanup after its last cell, or an earlier drain) or cannot be made without holding the "
                "GPU's context, so its memory pools were not trimmed; try again when that work has finished"
            )
        elif state == "busy" and status == "interrupted":
            problems.append(
                f"{gpu} busy: the wait for its queued work was interrupted, so its memory pools were not trimmed; "
                "try again"
            )
        elif state == "busy":
            hint = (
                f"try again later, or with a longer --drain-timeout (at most {MAX_DRAIN_TIMEOUT:g})"
                if drain_timeout < MAX_DRAIN_TIMEOUT else "try again when that work has finished"
            )
            problems.append(
                f"{gpu} busy: the work the kernel queued on it did not finish within {drain_timeout:g} s, so its "
                f"memory pools were not trimmed; {hint}"
            )
        elif state == "unusable":
            # The library's message names the device, the error and what to do (restart the kernel).
            problems.append(f"{gpu} unusable: {dev.get('message') or 'restart the kernel'}")
        else:
            # A failed call that leaves the device usable: the next drain may well succeed.
            problems.append(f"{gpu} {state or 'not drained'}: {dev.get('message') or 'no reason given'}; try again")
    return problems


def _record_line(target: status_client.Target, message: dict, colour: bool = False) -> str:
    record = message.get("record") or {}
    kernel = message.get("kernel") or {}
    pid = str(kernel.get("pid", "?"))
    # a terminal IPython has no kernel id or notebook: its label is the pid, said once
    who = _safe(pid if target.label in ("", pid) else f"{pid} {target.label}")
    stamp = time.strftime("%H:%M:%S", time.localtime((message.get("time_ns") or time.time_ns()) / 1e9))
    parts = [_paint(stamp, "dim", colour), _paint(who, "bold", colour),
             _paint(_safe(last_cell_text({"last_record": record})), "green", colour)]
    memory = _safe(memory_text({"last_record": record}))
    if memory and not memory.startswith("no GPU"):
        parts.append(memory)
    if isinstance(record.get("elapsed_s"), (int, float)):
        parts.append(format_duration(record["elapsed_s"]))
    return "  ".join(parts)


def cmd_watch(args) -> int:
    only = _resolve(args, args.kernel) if args.kernel else None
    subscriber = status_client.Subscriber()
    announced = False
    colour = colour_wanted()
    try:
        next_scan = 0.0
        while True:
            now = time.monotonic()
            if now >= next_scan:
                kernels = [only] if only else _scan(args).live
                if only and not only.alive():
                    raise CliError(f"kernel {only.pid} has exited", EXIT_NOT_FOUND)
                names = {str(k.pid): k for k in kernels}
                for name in subscriber.names():
                    if name not in names:
                        subscriber.remove(name)
                for name, kernel in names.items():
                    if name not in subscriber:
                        try:
                            subscriber.add(name, _target(kernel, kernel.pub_endpoint))
                        except CliError as exc:
                            print(f"gpucleanup: {_safe(exc)}", file=sys.stderr)
                if not announced:
                    if not names:
                        raise CliError(_no_kernels_message(args), EXIT_NOT_FOUND)
                    print(f"watching {len(names)} kernel(s); Ctrl-C stops", file=sys.stderr, flush=True)
                    announced = True
                next_scan = now + 2.0
            for target, message in subscriber.poll(0.5):
                if args.json:
                    print(json.dumps(message), flush=True)
                else:
                    print(_record_line(target, message, colour), flush=True)
    except KeyboardInterrupt:
        return EXIT_OK
    finally:
        subscriber.close()


def cmd_exporter(args) -> int:
    """Prometheus metrics of every kernel (``gpucleanup.outside.metrics``) on http://HOST:PORT/metrics until Ctrl-C."""
    from . import exporter

    directory = Path(args.runtime_dir) if args.runtime_dir else None

    def stop(signum, frame):
        raise KeyboardInterrupt

    # Ctrl-C and SIGTERM (a service manager's stop) end it cleanly, with exit 0 as for watch; set here because a
    # script that starts it with `&` leaves SIGINT ignored, and Python then never raises KeyboardInterrupt
    previous = {}
    for signum in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(ValueError, OSError):  # not the main thread (an embedding caller): as it was
            previous[signum] = signal.signal(signum, stop)
    try:
        return _serve_metrics(args, exporter, directory)
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def _serve_metrics(args, exporter, directory) -> int:
    try:
        server = exporter.start_exporter(args.port, args.host, runtime_dir=directory, timeout=args.timeout,
                                         token_file=args.token_file, public=args.public)
    except exporter.ExporterError as exc:
        raise CliError(str(exc), EXIT_CANNOT_RUN) from None
    try:
        url = f"http://{_url_host(args.host)}:{server.port}/metrics"
        token_file = str(server.token_file) if server.token_file is not None else None
        if args.json:
            print(json.dumps({"url": url, "host": args.host, "port": server.port, "pid": os.getpid(),
                              "token_file": token_file}), flush=True)
        else:
            print(f"gpucleanup: Prometheus metrics of every kernel on {url} (Ctrl-C stops)", flush=True)
            if token_file is not None:
                print(f"gpucleanup: scrapes send Authorization: Bearer <the token in {token_file}>", flush=True)
            else:
                print("gpucleanup: public: no token asked; no notebook or kernel id in the labels", flush=True)
        server.wait()
    except KeyboardInterrupt:
        return EXIT_OK
    finally:
        server.shutdown()
    return EXIT_OK


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def _port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be a port number from 0 (any free port) to 65535, got {text!r}")
    return value


# ------------------------------------------------------------------ entry point


def _seconds(low: float, high: float, low_ok: bool):
    """An argparse type: a finite number of seconds in the range, else a usage error that names the range."""
    allowed = f"from {low:g} to {high:g}" if low_ok else f"greater than {low:g} and at most {high:g}"

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        # float() takes "nan" and "inf", which no comparison below would catch.
        if not math.isfinite(value) or value > high or value < low or (value == low and not low_ok):
            raise argparse.ArgumentTypeError(f"must be a number of seconds {allowed}, got {text!r}")
        return value

    return parse


def _version() -> str:
    # The running package's own version first: with the source tree on
    # PYTHONPATH the installed distribution's metadata may describe another copy.
    try:
        from ..version import __version__ as version
    except ImportError:
        version = None
    if version:
        return version
    from importlib import metadata

    try:
        return metadata.version("gpucleanup")
    except metadata.PackageNotFoundError:
        return "unknown"


def _parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--timeout", type=_seconds(0, MAX_TIMEOUT, low_ok=False), default=status_client.DEFAULT_TIMEOUT,
                        metavar="SECONDS",
                        help=f"how long to wait for each kernel (default: %(default)s, at most {MAX_TIMEOUT:g})")
    common.add_argument("--runtime-dir", default=None, help=argparse.SUPPRESS)

    parser = argparse.ArgumentParser(
        prog="gpucleanup",
        description="GPU memory of every Jupyter kernel with gpucleanup loaded, asked from outside the kernels.",
        # The module docstring's table, so that --help and the docs cannot disagree.
        epilog=__doc__[__doc__.index("Exit status"):].rstrip(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"gpucleanup {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")  # none: the help (main)
    parser.set_defaults(commands={})
    ps = sub.add_parser("ps", parents=[common], help="one line per kernel")
    ps.add_argument("--json", action="store_true", help="every kernel's full status as JSON (exact bytes)")
    ps.set_defaults(run=cmd_ps)
    status = sub.add_parser("status", parents=[common], help="one kernel in full")
    status.add_argument("kernel", metavar="KERNEL", help="pid, kernel id (or a unique prefix) or notebook")
    status.add_argument("--json", action="store_true", help="the status reply as JSON (exact bytes)")
    status.set_defaults(run=cmd_status)
    watch = sub.add_parser("watch", parents=[common], help="cell records as they happen, until Ctrl-C")
    watch.add_argument("kernel", metavar="KERNEL", nargs="?", help="only this kernel")
    watch.add_argument("--json", action="store_true", help="one JSON message per line")
    watch.set_defaults(run=cmd_watch)
    drain = sub.add_parser("drain", parents=[common],
                           help="settle, trim the driver pools and run the kernel's own cleanup now (between cells only)")
    drain.add_argument("kernel", metavar="KERNEL", help="pid, kernel id (or a unique prefix) or notebook")
    drain.add_argument("--drain-timeout", type=_seconds(0, MAX_DRAIN_TIMEOUT, low_ok=True), default=10.0,
                       metavar="SECONDS",
                       help=f"longest wait for queued GPU work (default: %(default)s, 0 trims without waiting, "
                            f"at most {MAX_DRAIN_TIMEOUT:g})")
    drain.add_argument("--json", action="store_true", help="the drain reply as JSON (exact bytes)")
    drain.set_defaults(run=cmd_drain)
    park = sub.add_parser("park", parents=[common],
                          help="move all its GPU memory, context included, to host memory (between cells only)")
    park.add_argument("kernel", metavar="KERNEL", help="pid, kernel id (or a unique prefix) or notebook")
    park.add_argument("--json", action="store_true", help="the park's outcome as JSON (every step)")
    park.add_argument("--check", action="store_true",
                      help="only say whether it can be parked now, and why not (touches nothing; exit 0 or 4)")
    park.set_defaults(run=cmd_park)
    resume = sub.add_parser("resume", parents=[common], help="bring a parked kernel's GPU memory back")
    resume.add_argument("kernel", metavar="KERNEL", help="pid, kernel id (or a unique prefix) or notebook")
    resume.add_argument("--wait", type=_seconds(0, 3600, low_ok=True), default=parking.wait_limit(), metavar="SECONDS",
                        help="longest wait for a park of it still under way (default: %(default)s)")
    resume.add_argument("--json", action="store_true", help="the resume's outcome as JSON (every step)")
    resume.set_defaults(run=cmd_resume)
    exporter = sub.add_parser("exporter", parents=[common],
                              help="Prometheus metrics of every kernel over HTTP (for hosts without a Jupyter server)")
    exporter.add_argument("--port", type=_port, default=9445, help="TCP port (default: %(default)s; 0: any free port)")
    exporter.add_argument("--host", default="127.0.0.1",
                          help="address to listen on (default: %(default)s, this machine only)")
    exporter.add_argument("--token-file", default=None, metavar="PATH",
                          help="the bearer token scrapes must send (default: exporter.token in the runtime "
                               "directory's gpucleanup/, made 0600 with a random token when missing); its "
                               "directory must be writable by you and root only, and keeps its mode")
    exporter.add_argument("--public", action="store_true",
                          help="answer every scrape without a token, with no notebook or kernel id in the labels")
    exporter.add_argument("--json", action="store_true", help="say where it listens as one JSON line")
    exporter.set_defaults(run=cmd_exporter)
    parser.set_defaults(commands=dict(sub.choices))
    parser.set_defaults(command_names=sorted(sub.choices))  # for "did you mean" on a mistyped command
    return parser


def _refuse_unknown(command: argparse.ArgumentParser, name: str, unknown: List[str]) -> None:
    """Arguments the command did not take: one of its own options written before it (``gpucleanup --json ps``)
    is said to go after it; a near miss (``--jsno``) gets "did you mean"; anything else is unrecognised."""
    options = sorted(set(re.findall(r"(?<![\w-])--[a-z][\w-]*", command.format_help())))
    misplaced = [token for token in unknown if token.split("=", 1)[0] in options]
    if misplaced:
        shown = " ".join(misplaced)
        command.error(f"{shown} is an option of {name}: it goes after the command (gpucleanup {name} {shown})")
    hints = []
    for token in unknown:
        close = difflib.get_close_matches(token.split("=", 1)[0], options, n=1) if token.startswith("-") else []
        if close:
            hints.append(f"{token}: did you mean {close[0]}?")
    command.error(f"unrecognized arguments: {' '.join(unknown)}" + (" (" + "; ".join(hints) + ")" if hints else ""))


def _refuse_unknown_command(parser: argparse.ArgumentParser, argv: Sequence[str]) -> None:
    """A first word that is no command and no option (``gpucleanup stauts``): refused with the near miss, if any,
    before argparse's "invalid choice" list."""
    commands = parser.get_default("command_names") or []
    first = next(iter(argv), None)
    if first is None or first.startswith("-") or first in commands:
        return
    close = difflib.get_close_matches(first, commands, n=1)
    parser.error(f"unknown command '{_safe(first)}'" + (f": did you mean {close[0]!r}?" if close else "")
                 + f" (the commands: {', '.join(commands)})")


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = _parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    _refuse_unknown_command(parser, argv)
    args, unknown = parser.parse_known_args(argv)
    if args.command is None:
        if unknown:  # an option before any command: the top level's usage says what exists
            parser.error(f"unrecognized arguments: {' '.join(unknown)}")
        parser.print_help()
        return EXIT_OK
    if unknown:
        # argparse would report it with the top level's usage; the command's own usage is what helps
        _refuse_unknown(args.commands[args.command], args.command, unknown)
    try:
        return args.run(args)
    except CliError as exc:
        print(f"gpucleanup: {_safe(exc)}", file=sys.stderr)  # its sentence may carry a file's or a kernel's words
        return exc.code
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        return EXIT_OK


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
