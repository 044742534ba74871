"""Runs the demo notebooks in a real Jupyter kernel and prints every cell with its output.

With a GPU (a CUDA driver that reports a device, checked in a subprocess so
this process never initialises CUDA) it runs share/examples/*.ipynb for the
frameworks that are installed. Without one it runs share/demo/tour.ipynb
against the fake CUDA driver from the test suite, with a scripted device whose
driver pool holds memory, and says so.

Usage: python scripts/demo.py [NOTEBOOK ...] [--fake-driver PATH]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import pathlib
import subprocess
import sys

import tempfile

import nbformat
from jupyter_client.manager import KernelManager
from nbclient import NotebookClient

ROOT = pathlib.Path(__file__).resolve().parents[1]

# A device whose primary context is active (the kernel "uses" it) and whose
# default memory pool keeps 6 GiB reserved with 512 MiB in use: the drain
# after the first cell trims the 5.5 GiB nobody uses.
FAKE_SCENARIO = {
    "devices": [
        {
            "name": "Fake H100 (scripted)",
            "total_bytes": 85520809984,
            "free_bytes": 70000000000,
            "primary_active": True,
            "default_pool": {"reserved_bytes": 6 << 30, "used_bytes": 512 << 20},
        }
    ]
}

# notebook -> the frameworks it needs
GPU_NOTEBOOKS = {
    "cupy_images.ipynb": ("cupy",),
    "torch_training.ipynb": ("torch",),
    "mixed_frameworks.ipynb": ("cupy", "torch", "numba"),
}


def gpu_present() -> bool:
    code = (
        "import ctypes,sys\n"
        "try: lib = ctypes.CDLL('libcuda.so.1')\n"
        "except OSError: sys.exit(1)\n"
        "n = ctypes.c_int(0)\n"
        "sys.exit(0 if lib.cuInit(0) == 0 and lib.cuDeviceGetCount(ctypes.byref(n)) == 0 and n.value > 0 else 1)\n"
    )
    return subprocess.run([sys.executable, "-c", code]).returncode == 0


def show(nb_path: pathlib.Path, env: dict) -> int:
    nb = nbformat.read(nb_path, as_version=4)
    print(f"=== {nb_path.relative_to(ROOT)} (real Jupyter kernel: {sys.executable} -m ipykernel)")
    old_env = dict(os.environ)
    os.environ.update(env)
    try:
        # The kernel talks to this process over ipc sockets in a private directory: over TCP, ipykernel warns
        # on its stderr (which is this terminal) that the channel is not encrypted.
        # Its own stderr (other packages' warnings) is kept apart and shown after the cells, named as such.
        with tempfile.TemporaryDirectory(prefix="gpucleanup-demo-") as sockets, \
                tempfile.TemporaryFile("w+", encoding="utf-8", errors="replace") as kernel_stderr:
            km = KernelManager(kernel_name="python3", transport="ipc", ip=os.path.join(sockets, "kernel"))
            NotebookClient(nb, km=km, timeout=600, allow_errors=True).execute(stderr=kernel_stderr)
            kernel_stderr.seek(0)
            stray = kernel_stderr.read()
    finally:
        os.environ.clear()
        os.environ.update(old_env)
    failed = 0
    for n, cell in enumerate(c for c in nb.cells if c.cell_type == "code"):
        print(f"\nIn [{n + 1}]: " + cell.source.replace("\n", "\n        "))
        for out in cell.get("outputs", []):
            if out.output_type == "stream":
                sys.stdout.write(out.text)
            elif out.output_type in ("execute_result", "display_data"):
                print(out.data.get("text/plain", ""))
            elif out.output_type == "error":
                print(f"{out.ename}: {out.evalue}")
                failed += out.ename not in ("UsageError",)
    if stray.strip():
        print("\n--- the kernel process's own stderr (not a cell's output):")
        sys.stdout.write(stray if stray.endswith("\n") else stray + "\n")
    print()
    return failed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("notebooks", nargs="*", type=pathlib.Path)
    parser.add_argument("--fake-driver", type=pathlib.Path, default=ROOT / "build" / "tests" / "fake_cuda" / "libcuda.so.1")
    args = parser.parse_args()

    env: dict = {}
    notebooks = list(args.notebooks)
    if not notebooks and gpu_present():
        notebooks = [ROOT / "share" / "examples" / nb for nb, needs in GPU_NOTEBOOKS.items()
                     if all(importlib.util.find_spec(mod) is not None for mod in needs)]
    if not notebooks:
        print("No GPU here: running the tour against the fake CUDA driver of the test suite "
              f"({args.fake_driver}), with one scripted device. On a GPU machine the same command "
              "runs share/examples/ on the real device.\n")
        env = {"GPUCLEANUP_LIBCUDA": str(args.fake_driver), "GPUCLEANUP_FAKE_CUDA_SCENARIO": json.dumps(FAKE_SCENARIO)}
        notebooks = [ROOT / "share" / "demo" / "tour.ipynb"]
    return 1 if sum(show(nb, env) for nb in notebooks) else 0


if __name__ == "__main__":
    sys.exit(main())
