"""What the extension says as it loads reaches the user when it loads from ``ipython_kernel_config.py``.

A kernel that loads gpucleanup as it starts serves no request then, so what is printed reaches no frontend. Each
sentence goes to the kernel process's stderr at once and comes out with the first cell's output, as a display
output of gpucleanup's own, once. Each test starts a real kernel (tests/kernel_harness.py) with the config file.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from test_kernel import TIMEOUT, _kernel_env

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from kernel_harness import Kernel  # noqa: E402  (tests/kernel_harness.py)

pytest.importorskip("ipykernel")

SCENARIO = '{"devices": [{"total_bytes": 85899345920, "free_bytes": 85899345920, "primary_active": false}]}'


def _start(tmp_path: Path, config: str, **env: str) -> tuple:
    """A kernel whose profile loads gpucleanup with ``config``; its stderr goes to a file."""
    env.setdefault("GPUCLEANUP_FAKE_CUDA_SCENARIO", SCENARIO)
    environ = _kernel_env(tmp_path, **env)
    profile = Path(environ["IPYTHONDIR"]) / "profile_default"
    profile.mkdir(parents=True)
    (profile / "ipython_kernel_config.py").write_text(
        "c.InteractiveShellApp.extensions = ['gpucleanup']\n" + config)
    stderr_path = tmp_path / "kernel-stderr.txt"
    stderr = open(stderr_path, "w")
    kernel = Kernel(environ, python=sys.executable, stderr=stderr, ready=TIMEOUT, timeout=TIMEOUT)
    return kernel, stderr, stderr_path


def _run(tmp_path: Path, config: str, **env: str) -> tuple:
    """The first two cells' gpucleanup lines and the kernel's stderr."""
    kernel, stderr, stderr_path = _start(tmp_path, config, **env)
    try:
        first = kernel.execute("x = 1")
        second = kernel.execute("x = 2")
    finally:
        kernel.stop()
        stderr.close()
    return first, second, stderr_path.read_text()


def test_a_bad_value_in_the_kernel_config_is_said_with_the_first_cell_and_on_stderr(tmp_path):
    first, second, stderr = _run(tmp_path, 'c.GPUCleanup.gc = "sometimes"\n')
    said = [line for line in first.gpucleanup.splitlines() if "GPUCleanup.gc" in line]
    assert len(said) == 1 and said[0].startswith("gpucleanup · ") and "'sometimes'" in said[0], first.gpucleanup
    assert said[0] in stderr
    assert "GPUCleanup.gc" not in second.gpucleanup  # once
    assert first.error is None and first.stdout == ""  # the cell's own output is untouched


def test_a_missing_library_is_said_with_the_first_cell(tmp_path):
    first, second, stderr = _run(tmp_path, "", GPUCLEANUP_LIBRARY=str(tmp_path / "libgpucleanup-absent.so"))
    lines = first.gpucleanup.splitlines()
    assert len(lines) == 1 and lines[0].startswith("gpucleanup · gpucleanup's native library could not be loaded")
    assert lines[0].endswith("nothing is cleaned after cells; reinstall gpucleanup")
    assert lines[0] in stderr and second.gpucleanup == ""


def test_no_cuda_driver_is_said_with_the_first_cell(tmp_path):
    first, second, stderr = _run(tmp_path, "", GPUCLEANUP_LIBCUDA=str(tmp_path / "libcuda-absent.so.1"))
    lines = first.gpucleanup.splitlines()
    assert len(lines) == 1 and lines[0].startswith("gpucleanup · no CUDA driver found (")
    assert lines[0].endswith("nothing to clean, no cleanup after cells")
    assert lines[0] in stderr and second.gpucleanup == ""


def test_a_load_from_a_cell_says_it_in_that_cell_only(tmp_path):
    environ = _kernel_env(tmp_path, GPUCLEANUP_LIBCUDA=str(tmp_path / "libcuda-absent.so.1"))
    kernel = Kernel(environ, python=sys.executable, ready=TIMEOUT, timeout=TIMEOUT)
    try:
        loaded = kernel.execute("%load_ext gpucleanup")
        after = kernel.execute("x = 1")
    finally:
        kernel.stop()
    assert "no CUDA driver found" in loaded.stdout
    assert "no CUDA driver found" not in after  # nothing kept for a later cell


def test_a_gpucleanup_variable_with_a_value_it_does_not_take_is_said_with_what_it_is_read_as():
    from gpucleanup.in_kernel.load_notes import environment_notes

    assert environment_notes({}) == []
    assert environment_notes({"GPUCLEANUP_NATIVE_GIL": "release", "GPUCLEANUP_STATUS_TRANSPORT": "TCP",
                              "GPUCLEANUP_PARK_HOLD": "off", "GPUCLEANUP_PARK_HOLD_MS": "250",
                              "GPUCLEANUP_TRACE_CALLER": "0", "GPUCLEANUP_PARK_RESTORE_MAP": "none"}) == []
    assert environment_notes({"GPUCLEANUP_NATIVE_GIL": "relase", "GPUCLEANUP_PARK_HOLD_MS": "250ms"}) == [
        "GPUCLEANUP_NATIVE_GIL='relase' is not one of hold, release: it is read as hold (set one of those, or unset it)",
        "GPUCLEANUP_PARK_HOLD_MS='250ms' is not a whole number of milliseconds from 1 to 60000: it is read as 5000 "
        "(set one, or unset it)",
    ]
    # read exactly as the library reads them: "OFF" is no "off"
    assert environment_notes({"GPUCLEANUP_PARK_HOLD": "OFF"}) == [
        "GPUCLEANUP_PARK_HOLD='OFF' is not one of on, off: it is read as on (set one of those, or unset it)"]
    assert environment_notes({"GPUCLEANUP_PARK_HOLD_MS": "0"})[0].startswith("GPUCLEANUP_PARK_HOLD_MS='0' is not")
    [long] = environment_notes({"GPUCLEANUP_PARK_RESTORE_MAP": "x" * 5000})
    assert long.startswith("GPUCLEANUP_PARK_RESTORE_MAP='xxx") and "..." in long and len(long) < 200
