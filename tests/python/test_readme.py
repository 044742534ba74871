"""The README tells the truth: its marked examples are what the current code prints, and its timings table is the
one scripts/timings.py makes from tests/timings.json.

An example is marked with ``<!-- example: NAME -->`` on the line before its fence. Inside the fence, lines that
start with a prompt (``In [N]:`` or ``$ ``) are what the user typed; what follows each, up to the next prompt (blank
lines around it left out), is what was printed. Each name below says how the current code makes that output: from data
recorded on the H100 (rendered again here), or by running the command without a GPU driver.
"""

from __future__ import annotations

import ctypes
import importlib.util
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
RESULTS = ROOT / "tests" / "bench" / "results" / "server"
PROMPT = re.compile(r"^(In \[\d+\]: |\$ )")


def examples() -> dict:
    """NAME -> [(prompt line, output text)] for every marked example of the README."""
    text = README.read_text(encoding="utf-8")
    found = {}
    for match in re.finditer(r"<!-- example: ([\w-]+) -->\n```[^\n]*\n(.*?)\n```", text, re.S):
        pairs, prompt, lines = [], None, []
        for line in match.group(2).split("\n") + ["$ end"]:
            if PROMPT.match(line):
                if prompt is not None:
                    pairs.append((prompt, "\n".join(lines).strip("\n")))
                prompt, lines = line, []
            elif prompt is not None:
                lines.append(line)
        found[match.group(1)] = pairs
    return found


EXAMPLES = examples()


def _no_driver_env() -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GPUCLEANUP_", "JPY_"))}
    return env


def _driver_present() -> bool:
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    return True


no_driver = pytest.mark.skipif(_driver_present(), reason="a CUDA driver is installed: the no-driver examples need none")


def _run(args, tmp_path, **kw) -> subprocess.CompletedProcess:
    env = _no_driver_env()
    env["IPYTHONDIR"] = str(tmp_path / "ipython")
    env["JUPYTER_RUNTIME_DIR"] = str(tmp_path / "runtime")
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=120, env=env,
                          cwd=tmp_path, **kw)


def test_every_marked_example_is_checked_here():
    assert set(EXAMPLES) == {"h200-demo-cupy", "gpumem-table", "gpumem-vars", "plot-sparklines",
                             "no-driver-snapshot", "no-driver-magics", "config-refusals"}
    assert all(EXAMPLES[name] for name in EXAMPLES)


def test_the_first_example_is_one_notebook_of_one_recorded_h200_run():
    # every cell of the example, in order, is the cell of that number in the CuPy notebook's part of the run's log,
    # and its line is the line the run printed after it (the code is shortened in the README, the lines are not)
    log = (ROOT / "tests" / "bench" / "results" / "h200-demo-rerun-2026-11-26.log").read_text(encoding="utf-8")
    part = log.split("=== share/examples/cupy_images.ipynb", 1)[1].split("\n=== ", 1)[0]
    recorded = {}
    for cell in re.split(r"\n(?=In \[\d+\]: )", part):
        number = re.match(r"In \[(\d+)\]: ", cell)
        if number:
            recorded[int(number.group(1))] = [line for line in cell.splitlines() if line.startswith("gpucleanup · ")]
    shown = EXAMPLES["h200-demo-cupy"]
    assert [int(re.match(r"In \[(\d+)\]", prompt).group(1)) for prompt, _ in shown] == [1, 2, 3, 4, 5]
    for prompt, output in shown:
        number = int(re.match(r"In \[(\d+)\]", prompt).group(1))
        lines = [line for line in output.splitlines() if line.startswith("gpucleanup · ")]
        assert lines and lines == recorded[number], prompt


def test_the_gpumem_table_is_what_the_code_prints_from_the_h100_record():
    from gpucleanup.records import report

    [(prompt, shown)] = EXAMPLES["gpumem-table"]
    assert prompt.endswith("%gpumem")
    data = json.loads((RESULTS / "gpumem-cupy.json").read_text())
    assert shown == str(report.memory_report(data)).rstrip("\n")
    # the columns a newcomer will see: the last cells' table has the outside-every-pool column
    assert "outside pools" in shown.splitlines()[shown.splitlines().index("last cells") + 1]


def test_the_vars_table_is_what_the_code_prints_for_one_array():
    from gpucleanup.records import report

    [(prompt, shown)] = EXAMPLES["gpumem-vars"]
    assert prompt.endswith("%gpumem --vars")
    entry = {"name": "b", "held_by": "variable", "kind": "cupy.ndarray", "shape": [8192, 8192], "dtype": "float32",
             "device": "GPU0", "bytes": 256 << 20}
    assert shown == str(report.vars_report([entry], 20)).rstrip("\n")


def test_the_sparklines_are_what_the_code_draws_from_the_h100_timeline():
    from gpucleanup.records import plot

    [(prompt, shown)] = EXAMPLES["plot-sparklines"]
    assert prompt.endswith("%gpumem --plot")
    kernels = json.loads((RESULTS / "server-kernels.json").read_text())["kernels"]
    [cupy] = [k for k in kernels if k["notebook"] == "session/cupy_session.ipynb"]
    assert shown == plot.sparklines(cupy["timeline"]).rstrip("\n")


@no_driver
def test_the_snapshot_without_a_driver_is_what_python_prints(tmp_path):
    [(prompt, shown)] = EXAMPLES["no-driver-snapshot"]
    code = re.fullmatch(r'\$ python -c "(.*)"', prompt).group(1)
    done = _run(["-c", code], tmp_path)
    assert (done.returncode, done.stderr) == (0, "")
    assert done.stdout == shown + "\n"


@no_driver
def test_load_ext_and_plot_without_a_driver_say_so(tmp_path):
    [(load, loaded), (plot_prompt, plotted)] = EXAMPLES["no-driver-magics"]
    assert load.endswith("%load_ext gpucleanup") and plot_prompt.endswith("%gpumem --plot")
    done = _run(["-m", "IPython", "--quick", "-c", "%load_ext gpucleanup\n%gpumem --plot"], tmp_path)
    assert (done.returncode, done.stderr) == (0, "")
    assert done.stdout == loaded + "\n" + plotted + "\n"


@no_driver
def test_the_config_refusals_are_what_ipython_shows(tmp_path):
    [(statement, refused), (command, ignored)] = EXAMPLES["config-refusals"]
    magic = statement.split(": ", 1)[1]
    done = _run(["-m", "IPython", "--quick", "-c", f"%load_ext gpucleanup\n{magic}"], tmp_path)
    assert done.returncode == 0
    assert done.stderr == refused + "\n"  # on stderr, as it is, with no log prefix
    argv = shlex.split(command[2:])
    assert argv[0] == "ipython" and argv[-2] == "-c"
    done = _run(["-m", "IPython", *argv[1:]], tmp_path)
    assert done.returncode == 0 and done.stderr == ""
    assert done.stdout.splitlines()[0] == ignored


def _timings_module():
    spec = importlib.util.spec_from_file_location("timings", ROOT / "scripts" / "timings.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_readme_timings_table_is_made_from_the_timings_file():
    timings = _timings_module()
    text = README.read_text(encoding="utf-8")
    expected = timings.block(timings.load())
    assert expected in text
    assert text.count(timings.BEGIN) == 1 and text.count(timings.END) == 1


def test_timings_are_recorded_from_a_runs_stage_file(tmp_path, monkeypatch):
    timings = _timings_module()
    readme = tmp_path / "README.md"
    readme.write_text(f"before\n{timings.BEGIN}\nold\n{timings.END}\nafter\n")
    store = tmp_path / "timings.json"
    monkeypatch.setattr(timings, "README", readme)
    monkeypatch.setattr(timings, "TIMINGS", store)
    stages = tmp_path / "stages.tsv"
    stages.write_text("set-up\t161\nC++ build\t220\nPython suites\t375\nPython suites\t5\nnot a line\n")
    assert timings.main(["record", "--command", "test", "--run", "fresh", "--stages", str(stages),
                         "--total", "2180"]) == 0
    data = json.loads(store.read_text())
    assert data["test"]["fresh"]["stages"] == [["set-up", 161], ["C++ build", 220], ["Python suites", 380]]
    assert data["test"]["fresh"]["total_s"] == 2180
    monkeypatch.setattr(timings.os, "getloadavg", lambda: (3.456, 2.0, 1.0))
    assert timings.main(["record", "--command", "test", "--run", "fresh", "--stages", str(stages),
                         "--total", "2180"]) == 0
    data = json.loads(store.read_text())
    assert data["test"]["fresh"]["load_1m"] == 3.46 and data["test"]["fresh"]["cores"] == os.cpu_count()
    assert f"{os.cpu_count()} cores, load 3.5 at its end" in readme.read_text()
    text = readme.read_text()
    assert text.startswith("before\n") and text.endswith("after\n") and "old" not in text
    row = next(line for line in text.splitlines() if line.startswith("| `bash scripts/test.sh`"))
    assert row == ("| `bash scripts/test.sh` | 36 min 20 s (set-up 2 min 41 s, C++ build 3 min 40 s, "
                   "Python suites 6 min 20 s) | not measured yet |")
    assert timings.main(["readme", "--check"]) == 0
    readme.write_text(text.replace("36 min 20 s", "20 min"))
    assert timings.main(["readme", "--check"]) == 1


def test_the_scripts_state_no_durations_of_their_own():
    """Measured times live in tests/timings.json only; a script that says "about N minutes" goes stale."""
    for script in ("test.sh", "demo.sh", "setup.sh", "sanitizers.sh", "fuzz.sh"):
        text = (ROOT / "scripts" / script).read_text()
        assert not re.search(r"about \d+ (min|minute|s\b)", text), script


def test_ci_runs_the_readmes_two_commands():
    ci = (ROOT / ".ci" / "run").read_text()
    readme = README.read_text()
    for command in ("bash scripts/demo.sh", "bash scripts/test.sh"):
        assert command in ci and f"\n{command}" in readme
    assert ci.index("bash scripts/demo.sh") < ci.index("bash scripts/test.sh")
