"""scripts/ipython_suite.sh, the test command's run of IPython's own suite with gpucleanup in every shell:
what it leaves out says why, its plugins are pinned, its log carries no colour codes, and scripts/test.sh runs
it as a stage of its own, right after ipykernel's.

The suite itself takes minutes; it runs in scripts/test.sh, not here.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "ipython_suite.sh"


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
        assert when in ("loaded", "by-design", "suite-order"), f"{test}: unknown condition {when!r}"
        assert re.match(r"^(tests|IPython)/[\w/]+\.py::[\w.:]+$", test), f"not a test of the suite: {test!r}"
        assert len(reason.split()) >= 6, f"{test}: a reason says why, in a sentence: {reason!r}"
    tests = [test for _, test, _ in entries]
    assert len(tests) == len(set(tests)), f"a test listed twice: {tests}"


def test_only_the_config_doctest_is_left_out_of_every_run():
    # %config lists the shell's configurables, GPUCleanup among them once loaded: left out whatever the show.
    loaded = {test: reason for when, test, reason in left_out() if when == "loaded"}
    assert list(loaded) == ["IPython/core/magics/config.py::IPython.core.magics.config.ConfigMagics.config"]
    assert "GPUCleanup" in next(iter(loaded.values()))


def test_the_by_design_tests_are_those_that_compare_a_cells_output():
    by_design = {test: reason for when, test, reason in left_out() if when == "by-design"}
    assert sorted(by_design) == [
        "tests/test_displayhook.py::test_interactivehooks_ast_modes_semi_suppress",
        "tests/test_displayhook.py::test_output_quiet",
        "tests/test_magic.py::test_notebook_export_json_with_output",
        "tests/test_magic.py::test_tb_syntaxerror",
        "tests/test_magic_terminal.py::test_paste_echo",
    ]
    for test, reason in by_design.items():
        assert "show = always" in reason, f"{test}: the reason names the show it is left out for: {reason!r}"


def test_the_suite_order_ones_are_the_underscore_tests_and_name_gpucleanups_own_proof():
    # tests that fail in that run's order without gpucleanup too are listed apart, and point at the test of
    # gpucleanup's own that proves what they would have
    order = {test: reason for when, test, reason in left_out() if when == "suite-order"}
    assert sorted(order) == [
        "tests/test_displayhook.py::test_underscore_no_overwrite_builtins",
        "tests/test_displayhook.py::test_underscore_no_overwrite_user",
        "tests/test_interactiveshell.py::test_naked_string_cells",
        "tests/test_interactiveshell.py::test_run_cell_asyncio_run",
        "tests/test_interactiveshell.py::test_run_cell_await",
    ]
    proof = "test_underscore_is_the_last_result_after_a_cell_whose_line_was_shown"
    for test, reason in order.items():
        assert "fails without gpucleanup too" in reason and proof in reason, f"{test}: {reason!r}"
    assert f"def {proof}(" in (Path(__file__).parent / "test_extension.py").read_text()


def test_an_unknown_show_is_refused_before_anything_runs():
    run = subprocess.run(["bash", str(SCRIPT), "--show", "loud"], capture_output=True, text=True, timeout=60)
    assert run.returncode == 2
    assert run.stdout == ""
    assert run.stderr == "ipython_suite: --show takes auto, always or never, not loud\n"


def test_the_suite_plugins_are_pinned():
    deps = re.search(r"^suite_deps=\((.*?)\)$", SCRIPT.read_text(encoding="utf-8"), re.M | re.S)
    assert deps
    pins = deps.group(1).split()
    assert {pin.split("==")[0] for pin in pins} == {"pytest-asyncio", "testpath"}
    for pin in pins:
        assert re.fullmatch(r"[A-Za-z0-9_.-]+==[0-9][0-9A-Za-z.]*", pin), f"not an exact pin: {pin!r}"


def test_both_suites_logs_have_no_colour_codes():
    for name in ("ipython_suite.sh", "ipykernel_suite.sh"):
        text = (ROOT / "scripts" / name).read_text(encoding="utf-8")
        assert re.search(r'"\$py" -m pytest [^\n]*--color=no', text), f"{name}: pytest is not told --color=no"


def test_flakys_success_lines_do_not_bury_the_ipykernel_summary():
    # --force-flaky makes every test flaky, and flaky's report then had a line per test that passed at once
    text = (ROOT / "scripts" / "ipykernel_suite.sh").read_text(encoding="utf-8")
    assert "--force-flaky" in text and "--no-success-flaky-report" in text


def test_the_test_command_runs_it_right_after_the_ipykernel_suite():
    text = (ROOT / "scripts" / "test.sh").read_text(encoding="utf-8")
    stage = re.search(r'stage_begin "IPython suite"\n\s*(.*?)\n\s*stage_end "IPython suite"', text, re.S)
    assert stage, "scripts/test.sh has no stage named IPython suite"
    assert stage.group(1).strip() == 'GPUCLEANUP_BUILD_DIR="$build" bash scripts/ipython_suite.sh'
    order = [text.index(f'stage_begin "{name}"') for name in ("ipykernel suite", "IPython suite", "lowest-IPython suites")]
    assert order == sorted(order)
    # skipped when the ipykernel suite is: a partial or repeated run
    block = text[text.index("GPUCLEANUP_SKIP_IPYTHON_SUITE:-0}\" = 1 ]; then"):text.index('stage_begin "IPython suite"')]
    assert '[ ${#pytest_args[@]} -gt 0 ] || [ "$repeat" != 1 ]' in block
