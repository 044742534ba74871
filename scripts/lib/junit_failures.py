"""The tests that failed or errored, from pytest's JUnit XML reports: one line each, ``FAILED nodeid``.

    python3 scripts/lib/junit_failures.py build/pytest-reports/*.xml

scripts/test.sh runs it when a run fails, so that the end of a long log names what failed. A report that is
missing or cut short (a suite killed mid-way) is said as such; the exit status is 0 either way.
"""

from __future__ import annotations

import os
import sys
import xml.etree.ElementTree as ET


def node_id(classname: str, name: str) -> str:
    """pytest's node id again (``tests/python/test_a.py::TestK::test_m``) from JUnit's dotted classname: the
    longest leading part that is a file here is the module, the rest its classes."""
    parts = classname.split(".") if classname else []
    for cut in range(len(parts), 0, -1):
        module = "/".join(parts[:cut]) + ".py"
        if os.path.isfile(module):
            return "::".join([module, *parts[cut:], name])
    return "::".join([classname, name]) if classname else name


def failures(path: str) -> list:
    out = []
    for case in ET.parse(path).getroot().iter("testcase"):
        for outcome in ("failure", "error"):
            found = case.find(outcome)
            if found is None:
                continue
            node = node_id(case.get("classname") or "", case.get("name") or "")
            message = (found.get("message") or "").strip().splitlines()
            out.append(f"{'FAILED' if outcome == 'failure' else 'ERROR'} {node}"
                       + (f" - {message[0][:200]}" if message else ""))
    return out


def main(paths: list) -> int:
    lines = []
    for path in paths:
        try:
            lines += failures(path)
        except (OSError, ET.ParseError) as exc:
            lines.append(f"(no readable report in {path}: {exc})")
    if lines:
        print(f"{len([l for l in lines if not l.startswith('(')])} test(s) failed:")
        print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
