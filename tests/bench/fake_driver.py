"""The fake CUDA driver for the benchmarks that run without a GPU: point gpucleanup at it, and script it.

``use(scenario)``: GPUCLEANUP_LIBCUDA names the build tree's fake driver (GPUCLEANUP_BUILD_DIR, default build/),
GPUCLEANUP_LIBRARY the build tree's library where the gpucleanup imported carries none of its own (the package from
PYTHONPATH=ipython_ext), both unless already set; then the fake takes ``scenario`` (what
``GPUCLEANUP_FAKE_CUDA_SCENARIO`` takes, as a dict). Call it before gpucleanup's library is loaded.
"""

from __future__ import annotations

import ctypes
import importlib.util
import json
import os
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2]


def use(scenario: dict) -> None:
    build = pathlib.Path(os.environ.get("GPUCLEANUP_BUILD_DIR", ROOT / "build"))
    libcuda = os.environ.setdefault("GPUCLEANUP_LIBCUDA", str(build / "tests" / "fake_cuda" / "libcuda.so.1"))
    spec = importlib.util.find_spec("gpucleanup")
    packaged = pathlib.Path(list(spec.submodule_search_locations)[0]) / "libgpucleanup.so" if spec else None
    if packaged is None or not packaged.exists():
        os.environ.setdefault("GPUCLEANUP_LIBRARY", str(build / "native" / "libgpucleanup.so"))
    fake = ctypes.CDLL(libcuda, mode=os.RTLD_LOCAL)
    fake.fake_cuda_reset.argtypes = [ctypes.c_char_p]
    if fake.fake_cuda_reset(json.dumps(scenario).encode()) != 0:
        raise SystemExit(f"the fake CUDA driver {libcuda} refused its scenario")
