"""The allocation trace (%gpumem --trace on) on a real GPU, with the real CUPTI of the machine,
in an in-process IPython shell:

- five PyCUDA threads that each keep a 64 MiB mem_alloc: the cell's line names the 320 MiB,
  the five allocations, the cell's line and function and the five threads;
- five threads that cuMemAlloc 64 MiB through cuda-bindings (the calls release the
  interpreter lock): the 320 MiB and the library that made them are named;
- a pool made with cuMemPoolCreate (as RMM's async resource does) becomes known while
  tracing and is trimmed after the cell: free device memory back within 16 MiB.
"""

from __future__ import annotations

from conftest import PYCUDA_THREADS, MiB, require, run_script

SHELL = '''
    import io, contextlib
    from IPython.core.interactiveshell import InteractiveShell
    shell = InteractiveShell.instance()
    def run(code):
        sink = io.StringIO()
        with contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
            res = shell.run_cell(code, store_history=True)
        assert res.error_in_exec is None and res.error_before_exec is None, sink.getvalue()
        lines = [l for l in sink.getvalue().splitlines() if l.startswith("gpucleanup")]
        for l in lines:
            figure(l)
        return res.execution_count, lines
'''



def test_five_pycuda_threads_raw_allocations_are_traced_to_their_line():
    require("pycuda")
    r = run_script(SHELL, '''
        run("%load_ext gpucleanup")
        run("import threading\\nimport pycuda.autoinit\\nimport pycuda.driver as drv\\nctx = pycuda.autoinit.context")
        _, on = run("%gpumem --trace on")
        cell, lines = run("''' + PYCUDA_THREADS + '''")
        _, table = run("t = %gpumem --trace --json")
        groups = [g for g in shell.user_ns["t"]["groups"] if g["raw"]]
        run("for block in kept:\\n    block.free()\\ndel kept")
        _, off = run("%gpumem --trace off")
        result(on=on, cell=cell, lines=lines, groups=groups, off=off)
    ''')
    assert r["on"][0].startswith("gpucleanup · tracing raw GPU allocations to their line (CUPTI: "), r["on"]
    expected = (f"+320 MiB outside every pool in this cell (320 MiB in 5 allocations from <cell {r['cell']}>:6 work() "
                "on 5 threads, never freed)")
    assert any(expected in l for l in r["lines"]), r["lines"]
    [group] = r["groups"]
    assert (group["bytes"], group["count"], group["thread_count"], group["kind"]) == (320 * MiB, 5, 5, "cuMemAlloc")
    assert "_driver" in group["caller"]  # PyCUDA's extension module called the driver
    assert r["off"] == ["gpucleanup · allocation trace stopped (what it found stays in %gpumem --trace)"]


def test_five_cuda_bindings_threads_raw_allocations_are_named_with_their_library():
    require("torch")
    require("cuda.bindings")
    r = run_script(SHELL, '''
        run("%load_ext gpucleanup")
        run("import threading, torch\\nfrom cuda.bindings import driver as cu\\n"
            "x = torch.ones(1, device='cuda')\\nerr, ctx = cu.cuCtxGetCurrent()")
        run("%gpumem --trace on")
        cell, lines = run(
            "kept = []\\n"
            "def work():\\n"
            "    cu.cuCtxSetCurrent(ctx)\\n"
            "    err, ptr = cu.cuMemAlloc(64 << 20)\\n"
            "    kept.append((int(err), ptr))\\n"
            "threads = [threading.Thread(target=work) for _ in range(5)]\\n"
            "for t in threads:\\n"
            "    t.start()\\n"
            "for t in threads:\\n"
            "    t.join()")
        errors = [e for e, _ in shell.user_ns["kept"]]
        run("for _, ptr in kept:\\n    cu.cuMemFree(ptr)\\ndel kept")
        result(cell=cell, lines=lines, errors=errors)
    ''')
    assert r["errors"] == [0] * 5
    line = next(l for l in r["lines"] if "outside every pool in this cell" in l)
    assert "+320 MiB outside every pool in this cell (320 MiB in 5 allocations " in line, line
    assert "on 5 threads, never freed)" in line, line


def test_a_pool_made_with_cu_mem_pool_create_is_trimmed_while_tracing():
    require("torch")
    require("cuda.bindings")
    r = run_script(SHELL, '''
        run("%load_ext gpucleanup")
        run("import torch\\nfrom cuda.bindings import driver as cu\\nx = torch.ones(1, device='cuda')\\n"
            "torch.cuda.synchronize()")
        run("%gpumem --trace on")
        torch = shell.user_ns["torch"]
        free_before = torch.cuda.mem_get_info(0)[0]
        cell, lines = run(
            "props = cu.CUmemPoolProps()\\n"
            "props.allocType = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED\\n"
            "props.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE\\n"
            "props.location.id = 0\\n"
            "err, pool = cu.cuMemPoolCreate(props)\\n"
            "threshold = cu.cuuint64_t(2 ** 62)\\n"
            "cu.cuMemPoolSetAttribute(pool, cu.CUmemPool_attribute.CU_MEMPOOL_ATTR_RELEASE_THRESHOLD, threshold)\\n"
            "err, stream = cu.cuStreamCreate(0)\\n"
            "err, ptr = cu.cuMemAllocFromPoolAsync(512 << 20, pool, stream)\\n"
            "cu.cuMemFreeAsync(ptr, stream)\\n"
            "cu.cuStreamSynchronize(stream)\\n"
            "err, reserved = cu.cuMemPoolGetAttribute(pool, cu.CUmemPool_attribute.CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT)\\n"
            "reserved_in_cell = int(reserved)")
        free_after = torch.cuda.mem_get_info(0)[0]
        run("err, reserved = cu.cuMemPoolGetAttribute(pool, cu.CUmemPool_attribute.CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT)\\n"
            "reserved_later = int(reserved)")
        figure(f"pool reserved in the cell {shell.user_ns['reserved_in_cell']}, after {shell.user_ns['reserved_later']}; "
               f"free before {free_before}, after {free_after}")
        result(lines=lines, reserved_in_cell=shell.user_ns["reserved_in_cell"],
               reserved_later=shell.user_ns["reserved_later"], free_before=free_before, free_after=free_after)
    ''')
    assert r["reserved_in_cell"] >= 512 * MiB, r
    assert r["reserved_later"] == 0, r
    assert abs(r["free_after"] - r["free_before"]) <= 16 * MiB, r
    assert any("freed 512 MiB" in l for l in r["lines"]), r["lines"]


def test_a_cuda_librarys_own_allocations_are_named_by_library():
    # CuPy's first matrix product makes cuBLAS's handle and workspace: memory outside every pool
    # that no CuPy call gives back; the trace names the library that allocated it
    require("cupy")
    r = run_script(SHELL, '''
        run("%load_ext gpucleanup")
        run("import cupy as cp\\nx = cp.ones(4)")
        run("%gpumem --trace on")
        cell, lines = run("a = cp.ones((256, 256), dtype=cp.float32)\\nb = a @ a\\ncp.cuda.Device().synchronize()")
        _, _ = run("t = %gpumem --trace --json")
        groups = [(g["caller"], g["bytes"], g["raw"], g["site"]) for g in shell.user_ns["t"]["groups"]]
        for g in groups:
            figure(f"traced: {g}")
        result(cell=cell, lines=lines, groups=groups)
    ''')
    libraries = [caller for caller, _, raw, _ in r["groups"] if raw and caller and "libcublas" in caller]
    assert libraries, r["groups"]
    assert any("libcublas" in l for l in r["lines"]), r["lines"]
