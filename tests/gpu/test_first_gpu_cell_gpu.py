"""The line tells the truth from the first GPU cell (issue 25), on a real GPU, in an in-process IPython shell
where gpucleanup is loaded before anything touched CUDA:

- PyTorch's first GPU cell says what it took (the context, outside every pool) and what torch keeps live;
  a tensor left in that cell's Out[N] is named;
- JAX's first GPU cell says what its allocator reserved, as "reserved by jax", never "cached", with what to
  set said once;
- cuda-python alone (no framework): five threads keep 64 MiB each with cuMemAlloc in the first GPU cell,
  then a cell keeps 256 MiB more: both said as memory outside every pool.

Each scenario runs in a fresh Python (conftest.run_script). Run with -s to see the lines (FIGURE).
"""

from __future__ import annotations

import re

import pytest

from conftest import GiB, MiB, require, run_script

SHELL = '''
    import io, contextlib
    from IPython.core.interactiveshell import InteractiveShell
    shell = InteractiveShell.instance()
    def run(code):
        sink = io.StringIO()
        with contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
            res = shell.run_cell(code, store_history=True)
        assert res.error_in_exec is None, sink.getvalue()
        lines = [l for l in sink.getvalue().splitlines() if l.startswith("gpucleanup")]
        for l in lines:
            figure(f"[{res.execution_count}] {l}")
        return res.execution_count, lines
    run("%load_ext gpucleanup")
'''


def _outside(line: str, index: int = 0) -> int:
    """The bytes of "first use of GPUi: [a context no array uses, ]N unit outside every pool" in a line."""
    m = re.search(rf"first use of GPU{index}: (?:a context no array uses, )?([0-9.]+) (GiB|MiB|KiB|B) outside every pool",
                  line)
    assert m is not None, line
    return int(float(m.group(1)) * {"GiB": GiB, "MiB": MiB, "KiB": 1 << 10, "B": 1}[m.group(2)])


def test_torch_first_gpu_cell_says_what_it_took_and_names_its_out():
    require("torch")
    r = run_script(SHELL, '''
        _, imported = run("import torch")
        _, first = run("x = torch.ones(1 << 28, device='cuda')")      # 1 GiB, the first GPU call of the kernel
        n, out = run("torch.ones(1 << 28, device='cuda') * 2")          # 1 GiB more, left in Out[n] only
        result(imported=imported, first=first, out=out, n=n)
    ''')
    assert r["imported"] == []  # importing torch makes no context: nothing to say
    [first] = [l for l in r["first"] if l.startswith("gpucleanup · GPU0")]
    assert "kept 1.0 GiB live (torch)" in first, first
    assert 64 * MiB <= _outside(first) <= 2 * GiB, first  # torch's context and libraries, outside every pool
    [out] = [l for l in r["out"] if l.startswith("gpucleanup · GPU0")]
    assert f"kept 2.0 GiB live (torch): Out[{r['n']}] 1.0 GiB" in out, out


def test_torch_first_gpu_cell_left_in_out_is_named_on_that_cell():
    require("torch")
    r = run_script(SHELL, '''
        run("import torch")
        n, lines = run("torch.ones(1 << 28, device='cuda') * 2")        # the kernel's first GPU cell
        result(lines=lines, n=n)
    ''')
    [line] = [l for l in r["lines"] if l.startswith("gpucleanup · GPU0")]
    assert "first use of GPU0: " in line and f"kept 1.0 GiB live (torch): Out[{r['n']}] 1.0 GiB" in line, line


def test_jax_first_gpu_cell_says_what_it_reserved_never_cached():
    require("jax")
    r = run_script(SHELL, '''
        import os
        for name in ("XLA_PYTHON_CLIENT_PREALLOCATE", "XLA_PYTHON_CLIENT_ALLOCATOR", "XLA_PYTHON_CLIENT_MEM_FRACTION"):
            assert name not in os.environ, name
        run("import jax, jax.numpy as jnp")
        _, first = run("y = jnp.ones((1024, 1024)); y.block_until_ready()")
        run("%config GPUCleanup.show = 'always'")
        _, again = run("z = 1")
        result(first=first, again=again)
    ''')
    [first] = [l for l in r["first"] if l.startswith("gpucleanup · GPU0")]
    assert "first use of GPU0: " in first, first
    assert re.search(r"reserved by jax [0-9.]+ GiB \(not freeable: XLA_PYTHON_CLIENT_PREALLOCATE=false before import",
                     first), first
    assert "cached" not in " ".join(r["first"] + r["again"])
    [again] = [l for l in r["again"] if l.startswith("gpucleanup · GPU0")]
    assert "reserved by jax" in again and "not freeable" not in again, again


def _cuda_python() -> str:
    for module in ("cuda.bindings.driver", "cuda.cuda"):
        try:
            require(module)
            return module
        except pytest.skip.Exception:
            continue
    pytest.skip("cuda-python is not installed here")


def test_cuda_python_threads_with_cumemalloc_are_said_outside_every_pool_with_no_framework():
    module = _cuda_python()
    r = run_script(SHELL, f'''
        run("from {module} import *\\nimport threading\\nimport {module} as drv")
        cell = (
            "kept = []\\n"
            "lock = threading.Lock()\\n"
            "def work(n):\\n"
            "    err, = drv.cuInit(0)\\n"
            "    err, dev = drv.cuDeviceGet(0)\\n"
            "    err, ctx = drv.cuDevicePrimaryCtxRetain(dev)\\n"
            "    drv.cuCtxPushCurrent(ctx)\\n"
            "    err, ptr = drv.cuMemAlloc(n)\\n"
            "    assert int(err) == 0, err\\n"
            "    with lock:\\n"
            "        kept.append(ptr)\\n"
            "    drv.cuCtxPopCurrent()\\n"
            "threads = [threading.Thread(target=work, args=(64 << 20,)) for _ in range(5)]\\n"
            "for t in threads:\\n"
            "    t.start()\\n"
            "for t in threads:\\n"
            "    t.join()\\n"
            "assert len(kept) == 5"
        )
        _, first = run(cell)
        _, more = run("work(256 << 20)\\nassert len(kept) == 6")
        result(first=first, more=more)
    ''')
    # the cell's own line ("gpucleanup · GPU0 <name> · ..."), not the once-per-GPU note ("gpucleanup · GPU0: ...")
    [first] = [l for l in r["first"] if l.startswith("gpucleanup · GPU0 ")]
    assert _outside(first) >= 320 * MiB, first  # the context and the five threads' 320 MiB
    [more] = [l for l in r["more"] if l.startswith("gpucleanup · GPU0 ")]
    assert "+256 MiB outside every pool in this cell" in more, more
