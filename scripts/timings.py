"""The one place for how long the two commands take: tests/timings.json, and the README's table made from it.

scripts/test.sh and scripts/demo.sh time each of their stages (scripts/lib/stages.sh) into a file of their
build directory. With GPUCLEANUP_RECORD_TIMINGS=1 a run that passed calls

    python3 scripts/timings.py record --command test --run fresh --stages build/timings.tsv --total 2180

which stores that run in tests/timings.json (with the machine's core count, the date and the commit measured)
and rewrites the README's table between its markers. Nothing else in the repository states these times: the
scripts and the README's prose point here, and tests/python/test_readme.py checks that the README's table is
the one this file makes from tests/timings.json.

    python3 scripts/timings.py readme [--check]   rewrite the README's table (--check: exit 1 if it differs)

Standard library only: it runs before any virtual environment exists.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
TIMINGS = ROOT / "tests" / "timings.json"
README = ROOT / "README.md"
BEGIN = "<!-- timings: made by scripts/timings.py from tests/timings.json; do not edit by hand -->"
END = "<!-- /timings -->"
COMMANDS = {"test": "bash scripts/test.sh", "demo": "bash scripts/demo.sh"}
RUNS = {"fresh": "first run, fresh clone", "again": "again, nothing changed"}


def duration(seconds: float) -> str:
    """``2180`` -> ``36 min 20 s``; under a minute in seconds."""
    s = int(round(seconds))
    if s < 60:
        return f"{s} s"
    if s % 60 == 0:
        return f"{s // 60} min"
    return f"{s // 60} min {s % 60} s"


def read_stages(path: pathlib.Path) -> list[list]:
    """The ``NAME<TAB>seconds`` lines a run wrote, in order; a stage met twice is summed in its first place."""
    order: list[str] = []
    total: dict[str, int] = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        name, sep, secs = line.rpartition("\t")
        if not sep or not name:
            continue
        try:
            value = int(secs)
        except ValueError:
            continue
        if name not in total:
            order.append(name)
            total[name] = 0
        total[name] += value
    return [[name, total[name]] for name in order]


def cell(run: dict | None) -> str:
    """One table cell: the total, then each stage."""
    if not run:
        return "not measured yet"
    stages = ", ".join(f"{name} {duration(secs)}" for name, secs in run["stages"])
    text = f"{duration(run['total_s'])}"
    if run.get("note"):
        text += f", {run['note']}"
    return f"{text} ({stages})" if stages else text


def block(data: dict) -> str:
    """The README's table and its provenance line, between the markers."""
    lines = [BEGIN, "| | " + " | ".join(RUNS.values()) + " |", "|---|" + "---|" * len(RUNS)]
    measured = []
    for command, shown in COMMANDS.items():
        runs = data.get(command, {})
        lines.append(f"| `{shown}` | " + " | ".join(cell(runs.get(run)) for run in RUNS) + " |")
        for run, label in RUNS.items():
            if runs.get(run):
                r = runs[run]
                load = f", load {r['load_1m']:.1f} at its end" if r.get("load_1m") is not None else ""
                measured.append(f"{shown}, {label}: {r['date']}, commit {r['commit']}, {r['cores']} cores{load}")
    lines.append("")
    lines.append("Measured by the runs themselves (`GPUCLEANUP_RECORD_TIMINGS=1`): " + "; ".join(measured) + "."
                 if measured else "No run has been recorded yet.")
    lines.append("")
    lines.append("A first run's time is mostly the set-up: Debian packages and Python wheels downloaded and installed, "
                 "the C++ library built; it grows with a slower network, fewer cores, and other work on the machine "
                 "(the same first demo run took 6 min 41 s on 2 busy cores). The load is the 1-minute load average "
                 "as the run ended, where recorded.")
    lines.append(END)
    return "\n".join(lines)


def replace_block(text: str, new_block: str) -> str:
    start, end = text.find(BEGIN), text.find(END)
    if start < 0 or end < start:
        raise SystemExit(f"timings.py: README.md has no table between {BEGIN!r} and {END!r}")
    return text[:start] + new_block + text[end + len(END):]


def load() -> dict:
    return json.loads(TIMINGS.read_text(encoding="utf-8")) if TIMINGS.exists() else {}


def _commit() -> str:
    try:
        out = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short=12", "HEAD"], check=True,
                             capture_output=True, text=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"],
                               check=True, capture_output=True, text=True).stdout.strip()
        return out + ("+changes" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def cmd_record(args) -> int:
    data = load()
    data.setdefault(args.command, {})[args.run] = {
        "total_s": args.total,
        "stages": read_stages(pathlib.Path(args.stages)),
        "date": datetime.date.today().isoformat(),
        "commit": _commit(),
        "cores": os.cpu_count(),
        "load_1m": round(os.getloadavg()[0], 2),
        "note": args.note,
    }
    TIMINGS.write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")
    README.write_text(replace_block(README.read_text(encoding="utf-8"), block(data)), encoding="utf-8")
    print(f"timings.py: recorded {COMMANDS[args.command]} ({RUNS[args.run]}: {duration(args.total)}) in "
          f"{TIMINGS} and {README}")
    return 0


def cmd_readme(args) -> int:
    text = README.read_text(encoding="utf-8")
    new = replace_block(text, block(load()))
    if args.check:
        if new != text:
            print("timings.py: README.md's table differs from tests/timings.json: run python3 scripts/timings.py readme",
                  file=sys.stderr)
            return 1
        return 0
    README.write_text(new, encoding="utf-8")
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="timings.py", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="what", required=True)
    rec = sub.add_parser("record", help="store one run's stages and rewrite the README's table")
    rec.add_argument("--command", choices=sorted(COMMANDS), required=True)
    rec.add_argument("--run", choices=sorted(RUNS), required=True)
    rec.add_argument("--stages", required=True, help="the NAME<TAB>seconds file the run wrote")
    rec.add_argument("--total", type=int, required=True, help="the whole run, in seconds")
    rec.add_argument("--note", default=None, help="what the reader should know of the run (e.g. set-up already done)")
    rec.set_defaults(run_cmd=cmd_record)
    readme = sub.add_parser("readme", help="rewrite the README's table from tests/timings.json")
    readme.add_argument("--check", action="store_true", help="only say whether it differs (exit 1)")
    readme.set_defaults(run_cmd=cmd_readme)
    args = parser.parse_args(argv)
    return args.run_cmd(args)


if __name__ == "__main__":
    sys.exit(main())
