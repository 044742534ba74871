"""Which GPU state survives a park/resume cycle (issue 26, item 3 and 5): the rows of the README's table.

Each scenario builds some state in a fresh process (a cuBLAS handle, a captured CUDA graph, a Numba
kernel, PyCUDA's autoinit context, managed memory, ...), computes a result, is parked and resumed with
gpucleanup.park, then computes again from the same state. Whatever the driver does, the rule that
matters is checked: the process is never lost. A park is either refused or fails with the process left
running, or it works and the resume brings every value back equal.

The outcome of each row is printed as ``FIGURE survival <scenario>: ...`` (run pytest with -s).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import require, subprocess_env

# Each scenario: (module it needs, set-up code, an expression giving a JSON-able result from the state).
SCENARIOS = {
    "torch-cublas": ("torch", "import torch\ng = torch.Generator(device='cuda').manual_seed(3)\n"
                              "a = torch.rand(512, 512, device='cuda', generator=g)\n",
                     "float((a @ a).sum().item())"),
    "torch-cuda-graph": ("torch", "import torch\nx = torch.arange(1 << 20, device='cuda', dtype=torch.float32)\n"
                                  "y = torch.empty_like(x)\ns = torch.cuda.Stream()\ns.wait_stream(torch.cuda.current_stream())\n"
                                  "with torch.cuda.stream(s):\n    y.copy_(x * 2 + 1)\n"
                                  "torch.cuda.current_stream().wait_stream(s)\ngraph = torch.cuda.CUDAGraph()\n"
                                  "with torch.cuda.graph(graph):\n    y.copy_(x * 2 + 1)\n"
                                  "def run():\n    y.zero_()\n    graph.replay()\n    torch.cuda.synchronize()\n"
                                  "    return float(y.sum().item())\n",
                         "run()"),
    "torch-cudnn": ("torch", "import torch\ng = torch.Generator(device='cuda').manual_seed(4)\n"
                             "conv = torch.nn.Conv2d(3, 8, 3).cuda()\nimg = torch.rand(2, 3, 32, 32, device='cuda', generator=g)\n",
                    "float(conv(img).double().sum().item())"),
    "numba": ("numba", "from numba import cuda\nimport numpy as np\n@cuda.jit\ndef twice(a, o):\n"
                       "    i = cuda.grid(1)\n    if i < a.size:\n        o[i] = a[i] * 2\n"
                       "d = cuda.to_device(np.arange(1 << 16, dtype=np.float32))\no = cuda.device_array_like(d)\n"
                       "def run():\n    twice[256, 256](d, o)\n    return float(o.copy_to_host().sum())\n",
              "run()"),
    "pycuda-autoinit": ("pycuda", "import pycuda.autoinit\nimport pycuda.gpuarray as ga\nimport numpy as np\n"
                                  "g = ga.to_gpu(np.arange(1 << 16, dtype=np.float32))\n",
                        "float((g * 3).get().sum())"),
    "cupy-managed": ("cupy", "import cupy as cp\ncp.cuda.set_allocator(cp.cuda.MemoryPool(cp.cuda.malloc_managed).malloc)\n"
                             "m = cp.arange(1 << 20, dtype=cp.float32)\n",
                     "float((m * 2).sum())"),
}

TARGET = r"""
import json, sys
setup, expression = sys.argv[1], sys.argv[2]
exec(setup)
print(json.dumps({"ready": eval(expression)}), flush=True)
for line in sys.stdin:
    print(json.dumps({"value": eval(expression)}), flush=True)
"""


def ask(proc) -> float:
    proc.stdin.write("again\n")
    proc.stdin.flush()
    line = proc.stdout.readline()
    assert line, "the process did not answer: it was lost"
    return json.loads(line)["value"]


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_a_park_never_loses_the_process_and_a_resume_brings_its_state_back(scenario):
    module, setup, expression = SCENARIOS[scenario]
    require(module)
    from gpucleanup.park import steps as park

    proc = subprocess.Popen([sys.executable, "-c", TARGET, setup, expression], text=True,
                            env=subprocess_env(CUDA_VISIBLE_DEVICES="0"), stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        line = proc.stdout.readline()
        if not line:  # before any park: the framework cannot run here (e.g. a Numba too old for this NumPy)
            why = proc.stderr.read().strip().splitlines()
            pytest.skip(f"{scenario}: its set-up fails on this machine, before any park: {why[-1] if why else '?'}")
        first = json.loads(line)["ready"]
        before = ask(proc)
        helpers = subprocess_env()
        try:
            parked = park.park(proc.pid, env=helpers)
        except park.ParkRefused as refused:
            print(f"FIGURE survival {scenario}: refused ({refused})")
            assert ask(proc) == before
            return
        if not parked.ok:
            print(f"FIGURE survival {scenario}: park failed, process {parked.state}: {parked.message}")
            assert parked.state == "running", parked.message
            assert ask(proc) == before
            return
        resumed = park.resume(proc.pid, env=helpers)
        assert resumed.ok, f"resume failed, process {resumed.state}: {resumed.message}"
        after = ask(proc)
        print(f"FIGURE survival {scenario}: parked in {parked.seconds:.2f} s, resumed in {resumed.seconds:.2f} s; "
              f"result before {before!r}, after {after!r} (first {first!r})")
        assert after == before
    finally:
        proc.kill()
        proc.wait()
