"""scripts/ipykernel_suite.sh, the test command's run of ipykernel's own suite with gpucleanup in every kernel:
what it leaves out says why, what it runs is pinned, and scripts/test.sh runs it as a stage of its own.

The suite itself takes minutes; it runs in scripts/test.sh, not here.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "ipykernel_suite.sh"
CONDITIONS = re.compile(r"^(always|by-design|no-display|no-[A-Za-z_][A-Za-z0-9_.]*)$")


def left_out() -> list[list[str]]:
    run = subprocess.run(["bash", str(SCRIPT), "--list-left-out"], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    return [line.split("\t") for line in run.stdout.splitlines()]


def test_every_test_left_out_names_its_condition_and_why():
    entries = left_out()
    assert entries, "the list is empty: nothing is left out, or the listing is broken"
    for entry in entries:
        assert len(entry) == 3, f"not condition, test, reason: {entry!r}"
        when, test, reason = entry
        assert CONDITIONS.match(when), f"{test}: unknown condition {when!r}"
        assert re.match(r"^tests/[\w/]+\.py::\w+", test), f"not a test of the suite: {test!r}"
        assert len(reason.split()) >= 6, f"{test}: a reason says why, in a sentence: {reason!r}"
    tests = [test for _, test, _ in entries]
    assert len(tests) == len(set(tests)), f"a test listed twice: {tests}"


def test_only_the_exact_display_outputs_test_is_left_out_by_design():
    # The one test that cannot pass with show = "always" (one more display output per cell): the standing check
    # runs it with the default show instead. Anything else failing with gpucleanup is a defect, not a design.
    by_design = {test: reason for when, test, reason in left_out() if when == "by-design"}
    assert list(by_design) == ["tests/test_kernel.py::test_print_to_correct_cell_from_thread"]
    assert "display output" in next(iter(by_design.values()))


def test_the_race_left_out_always_names_the_tests_it_breaks():
    always = {test: reason for when, test, reason in left_out() if when == "always"}
    assert list(always) == ["tests/test_embed_kernel.py::test_embed_kernel_func"]
    reason = always["tests/test_embed_kernel.py::test_embed_kernel_func"]
    assert "with or without gpucleanup" in reason
    assert "test_install_kernelspec" in reason and "test_zmq_interactive_shell" in reason


def test_an_unknown_show_is_refused_before_anything_runs():
    run = subprocess.run(["bash", str(SCRIPT), "--show", "loud"], capture_output=True, text=True, timeout=60)
    assert run.returncode == 2
    assert run.stdout == ""
    assert run.stderr == "ipykernel_suite: --show takes auto, always or never, not loud\n"


def test_the_suite_and_its_plugins_are_pinned():
    text = SCRIPT.read_text(encoding="utf-8")
    version = re.search(r"^ipykernel_version=(\S+)$", text, re.M)
    digest = re.search(r"^ipykernel_sdist_sha256=(\S+)$", text, re.M)
    deps = re.search(r"^suite_deps=\((.*?)\)$", text, re.M | re.S)
    assert version and re.fullmatch(r"\d+\.\d+\.\d+", version.group(1))
    assert digest and re.fullmatch(r"[0-9a-f]{64}", digest.group(1))
    assert deps
    pins = deps.group(1).split()
    assert len(pins) >= 4
    for pin in pins:
        assert re.fullmatch(r"[A-Za-z0-9_.-]+==[0-9][0-9A-Za-z.]*", pin), f"not an exact pin: {pin!r}"


def test_the_test_command_runs_it_as_a_stage_of_its_own():
    text = (ROOT / "scripts" / "test.sh").read_text(encoding="utf-8")
    stage = re.search(
        r'stage_begin "ipykernel suite"\n\s*(.*?)\n\s*stage_end "ipykernel suite"', text, re.S)
    assert stage, "scripts/test.sh has no stage named ipykernel suite"
    assert stage.group(1).strip() == 'GPUCLEANUP_BUILD_DIR="$build" bash scripts/ipykernel_suite.sh'
    # after the Python suites, before the lowest-IPython run
    order = [text.index(f'stage_begin "{name}"') for name in ("Python suites", "ipykernel suite", "lowest-IPython suites")]
    assert order == sorted(order)
