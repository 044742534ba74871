"""scripts/lib/junit_failures.py: what scripts/test.sh says last when a run fails (issue 53, case 5)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "lib" / "junit_failures.py"


def test_failed_and_errored_tests_are_named_by_node_id_with_their_first_line(tmp_path):
    (tmp_path / "tests" / "python").mkdir(parents=True)
    (tmp_path / "tests" / "python" / "test_a.py").write_text("")
    report = tmp_path / "1.xml"
    report.write_text(
        '<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest" errors="1" failures="2">'
        '<testcase classname="tests.python.test_a" name="test_ok" time="0.1"/>'
        '<testcase classname="tests.python.test_a" name="test_bad"><failure message="AssertionError: one is not two'
        '&#10;assert 1 == 2">...</failure></testcase>'
        '<testcase classname="tests.python.test_a.TestK" name="test_m[x-1]"><failure message="RuntimeError: boom">'
        '</failure></testcase>'
        '<testcase classname="tests.python.test_a" name="test_setup"><error message="failed on setup">'
        '</error></testcase>'
        '<testcase classname="tests.python.test_a" name="test_skipped"><skipped message="no GPU"/></testcase>'
        '</testsuite></testsuites>')
    run = subprocess.run([sys.executable, str(SCRIPT), str(report), str(tmp_path / "cut-short.xml")],
                         capture_output=True, text=True, cwd=tmp_path, timeout=60)
    assert run.returncode == 0
    assert run.stdout.splitlines() == [
        "3 test(s) failed:",
        "FAILED tests/python/test_a.py::test_bad - AssertionError: one is not two",
        "FAILED tests/python/test_a.py::TestK::test_m[x-1] - RuntimeError: boom",
        "ERROR tests/python/test_a.py::test_setup - failed on setup",
        f"(no readable report in {tmp_path / 'cut-short.xml'}: [Errno 2] No such file or directory: "
        f"'{tmp_path / 'cut-short.xml'}')",
    ]


def test_a_run_with_no_failure_prints_nothing(tmp_path):
    report = tmp_path / "1.xml"
    report.write_text('<testsuites><testsuite name="pytest"><testcase classname="t" name="test_ok"/></testsuite>'
                      '</testsuites>')
    run = subprocess.run([sys.executable, str(SCRIPT), str(report)], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0 and run.stdout == ""
