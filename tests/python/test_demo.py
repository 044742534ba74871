"""The main job, as a newcomer runs it: scripts/demo.py's tour in a real Jupyter kernel on the fake CUDA driver.

Its output is the showcase: every cell with its output, gpucleanup's lines among them, and nothing from other
packages (ipykernel warns on its stderr when a kernel runs over TCP; the demo uses ipc sockets).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import FAKE_CUDA

ROOT = Path(__file__).resolve().parents[2]

pytest.importorskip("nbclient")


def test_the_tour_runs_in_a_kernel_and_shows_only_cells_and_gpucleanup(tmp_path):
    if not FAKE_CUDA.exists():
        pytest.skip(f"the fake CUDA driver is not built ({FAKE_CUDA})")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GPUCLEANUP_", "JPY_"))}
    env.update(JUPYTER_RUNTIME_DIR=str(tmp_path / "runtime"), IPYTHONDIR=str(tmp_path / "ipython"))
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "demo.py"), "--fake-driver", str(FAKE_CUDA)],
                          capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith("No GPU here: running the tour against the fake CUDA driver")
    assert lines[2].startswith("=== share/demo/tour.ipynb (real Jupyter kernel:")
    assert lines[3] == "" and lines[4].startswith("In [1]: ")
    assert any(line.startswith("gpucleanup · GPU0 Fake H100 (scripted) · freed ") for line in lines)
    assert "the kernel process's own stderr" not in done.stdout
    for noise in ("Warning", "WARNING", "without encryption", "Traceback"):
        assert noise not in done.stdout + done.stderr, noise
