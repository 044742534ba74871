"""What many test files share: sizes, the ``gpucleanup`` command run as a user runs it, and a bounded wait."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Optional

ROOT = Path(__file__).resolve().parents[2]
GiB = 1 << 30
MiB = 1 << 20


def package_env(env: Optional[dict] = None, **more: str) -> dict:
    """``env`` (default: this process's environment) with the checkout's package first on ``PYTHONPATH``, and
    ``more`` set: what a subprocess needs to import the gpucleanup under test."""
    out = dict(os.environ if env is None else env)
    out["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "ipython_ext"), out.get("PYTHONPATH")]))
    out.update(more)
    return out


def cli(*args: str, env: Optional[dict] = None, timeout: float = 30) -> subprocess.CompletedProcess:
    """``gpucleanup ARGS`` (``python -m gpucleanup``) with ``env`` (default :func:`package_env`), its output as text."""
    return subprocess.run([sys.executable, "-m", "gpucleanup", *args], capture_output=True, text=True,
                          env=package_env() if env is None else env, timeout=timeout)


def wait_until(predicate: Callable[[], object], what: str, limit: float = 60.0) -> None:
    """Polls ``predicate`` every 20 ms until it is true; fails the test saying ``what`` after ``limit`` seconds."""
    deadline = time.monotonic() + limit
    while not predicate():
        assert time.monotonic() < deadline, f"not within {limit:.0f} s: {what}"
        time.sleep(0.02)
