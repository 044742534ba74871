"""PyCUDA on a real GPU, in an in-process IPython shell (the after-cell hook runs on the thread
that ran ``import pycuda.autoinit``, as in a Jupyter kernel):

- a ``DeviceMemoryPool`` filled with eight 64 MiB GPUArrays that the cell deletes is empty
  after the cell, and the device's free memory is back where it was;
- five threads that push the context and keep a 64 MiB ``mem_alloc`` each: the cell's line
  says +320 MiB outside every pool;
- a pool made on another thread is named and left alone (PyCUDA prints no "out-of-thread
  context could not be cleaned up");
- a pool made in the cell that imports PyCUDA is drained too (needs
  ``gpucleanup.frameworks.install()`` at the extension's load).

Skipped where PyCUDA cannot be imported.
"""

from __future__ import annotations

from conftest import PYCUDA_THREADS, MiB, require, run_script

# run(code) -> (gpucleanup's lines, everything written to stderr: Python's and, through file
# descriptor 2, PyCUDA's C++ warnings such as "out-of-thread context could not be cleaned up")
SHELL = '''
    import io, contextlib, os, tempfile
    from IPython.core.interactiveshell import InteractiveShell
    shell = InteractiveShell.instance()
    def run(code):
        out, err = io.StringIO(), io.StringIO()
        with tempfile.TemporaryFile() as native:
            saved = os.dup(2)
            os.dup2(native.fileno(), 2)
            try:
                with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                    res = shell.run_cell(code, store_history=True)
            finally:
                os.dup2(saved, 2)
                os.close(saved)
            native.seek(0)
            errors = err.getvalue() + native.read().decode(errors="replace")
        assert res.error_in_exec is None and res.error_before_exec is None, out.getvalue() + errors
        lines = [l for l in out.getvalue().splitlines() if l.startswith("gpucleanup")]
        for l in lines:
            figure(l)
        return lines, errors
'''


def test_a_pool_emptied_by_its_cell_holds_nothing_after_it_and_the_memory_is_back():
    require("pycuda")
    r = run_script(SHELL, '''
        run("%load_ext gpucleanup")
        run("import pycuda.autoinit\\nimport pycuda.driver as drv\\nimport pycuda.gpuarray\\n"
            "import pycuda.tools\\nimport numpy as np")
        run("pool = pycuda.tools.DeviceMemoryPool()")
        drv = shell.user_ns["drv"]
        free_before = drv.mem_get_info()[0]
        lines, err = run("arrays = [gpuarray.GPUArray((64 << 20,), np.uint8, allocator=pool.allocate) for _ in range(8)]\\n"
                         "held_in_cell = pool.held_blocks\\n"
                         "del arrays\\n"
                         "held_after_del = pool.held_blocks")
        free_after = drv.mem_get_info()[0]
        run("held_later = pool.held_blocks\\nactive_later = pool.active_blocks")
        ns = shell.user_ns
        figure(f"free before {free_before}, after {free_after}, off by {free_after - free_before} B")
        result(lines=lines, err=err, free_before=free_before, free_after=free_after,
               held_in_cell=ns["held_in_cell"], held_after_del=ns["held_after_del"],
               held_later=ns["held_later"], active_later=ns["active_later"])
    ''')
    assert r["held_in_cell"] == 0 and r["held_after_del"] == 8, r  # the cell itself left eight blocks held
    assert r["held_later"] == 0 and r["active_later"] == 0, r
    assert abs(r["free_after"] - r["free_before"]) <= 16 * MiB, r
    assert any("freed" in l and "pycuda" in l for l in r["lines"]), r["lines"]
    assert "out-of-thread" not in r["err"], r["err"]


def test_raw_allocations_of_five_threads_are_said_as_growth_outside_every_pool():
    require("pycuda")
    r = run_script(SHELL, '''
        run("%load_ext gpucleanup")
        run("import threading\\nimport pycuda.autoinit\\nimport pycuda.driver as drv\\nctx = pycuda.autoinit.context")
        run("y = 1")
        lines, err = run("''' + PYCUDA_THREADS + '''\\ncount = len(kept)")
        count = shell.user_ns["count"]
        run("for block in kept:\\n    block.free()\\ndel kept")
        result(lines=lines, err=err, count=count)
    ''')
    assert r["count"] == 5
    assert any("+320 MiB outside every pool in this cell (library code and handles, raw allocations, or another "
               "process on GPU0)" in l for l in r["lines"]), r["lines"]
    assert "out-of-thread" not in r["err"], r["err"]


def test_a_pool_made_on_another_thread_is_named_and_left_alone():
    require("pycuda")
    r = run_script(SHELL, '''
        run("%load_ext gpucleanup")
        run("import threading\\nimport pycuda.autoinit\\nimport pycuda.driver as drv\\nimport pycuda.gpuarray\\n"
            "import pycuda.tools\\nimport numpy as np\\nctx = pycuda.autoinit.context")
        lines, err = run(
            "box = {}\\n"
            "def work():\\n"
            "    ctx.push()\\n"
            "    try:\\n"
            "        pool = pycuda.tools.DeviceMemoryPool()\\n"
            "        arrays = [gpuarray.GPUArray((64 << 20,), np.uint8, allocator=pool.allocate) for _ in range(2)]\\n"
            "        del arrays\\n"
            "        box['pool'] = pool\\n"
            "    finally:\\n"
            "        ctx.pop()\\n"
            "t = threading.Thread(target=work, name='loader')\\n"
            "t.start()\\n"
            "t.join()")
        run("held_later = box['pool'].held_blocks\\nd = %gpumem --json")
        held_later = shell.user_ns["held_later"]
        pools = shell.user_ns["d"].get("framework_pools", {}).get("pycuda", [])
        # the user's way: free it on a thread where its context is current
        run("def tidy():\\n    ctx.push()\\n    try:\\n        box['pool'].free_held()\\n    finally:\\n        ctx.pop()\\n"
            "t = threading.Thread(target=tidy)\\nt.start()\\nt.join()\\nheld_tidied = box['pool'].held_blocks")
        result(lines=lines, err=err, held_later=held_later, held_tidied=shell.user_ns["held_tidied"], pools=pools)
    ''')
    assert r["held_later"] == 2, r  # not drained: it belongs to the thread 'loader'
    # two 64 MiB blocks: the pool rounds each up to its bin (136 MiB held on an H100)
    assert any("DeviceMemoryPool #1 holds " in l and " MiB of freed blocks: it was made on thread 'loader'" in l
               for l in r["lines"]), r["lines"]
    assert "out-of-thread" not in r["err"], r["err"]
    assert r["held_tidied"] == 0
    [pool] = r["pools"]  # %gpumem --json names it, with its thread and what it holds
    assert (pool["pool"], pool["thread"], pool["drained_here"], pool["kind"]) == (
        "DeviceMemoryPool #1", "loader", False, "device"), pool
    assert pool["cached_bytes"] >= 128 * MiB, pool


def test_a_pool_made_in_the_cell_that_imports_pycuda_is_drained():
    # needs gpucleanup.frameworks.install() when the extension loads: its finder wraps the pool
    # classes as pycuda._driver is imported, before the cell makes the pool
    require("pycuda")
    r = run_script(SHELL, '''
        run("%load_ext gpucleanup")
        import gpucleanup.frameworks.pycuda as adapter_module
        watching = adapter_module._TRACKER.watching
        lines, err = run("import pycuda.autoinit\\nimport pycuda.gpuarray\\nimport pycuda.tools\\n"
                         "import numpy as np\\npool = pycuda.tools.DeviceMemoryPool()\\n"
                         "arrays = [gpuarray.GPUArray((64 << 20,), np.uint8, allocator=pool.allocate) for _ in range(4)]\\n"
                         "del arrays")
        run("held_later = pool.held_blocks")
        result(lines=lines, err=err, watching=watching, held_later=shell.user_ns["held_later"])
    ''')
    assert r["watching"], "gpucleanup.frameworks.install() was not called when the extension loaded"
    assert r["held_later"] == 0, r


def test_a_page_locked_pool_is_released_after_the_cell_without_a_warning():
    # gpucleanup releases pinned pools on a background thread that has no context current:
    # PyCUDA's page-locked frees (cuMemFreeHost) must work there, and print nothing
    require("pycuda")
    r = run_script(SHELL, '''
        run("%load_ext gpucleanup")
        run("import time\\nimport pycuda.autoinit\\nimport pycuda.tools\\nimport numpy as np")
        lines, err = run("pinned = pycuda.tools.PageLockedMemoryPool()\\n"
                         "blocks = [pinned.allocate((16 << 20,), np.uint8) for _ in range(4)]\\n"
                         "del blocks\\n"
                         "held_in_cell = pinned.held_blocks")
        run("for _ in range(200):\\n    if pinned.held_blocks == 0:\\n        break\\n    time.sleep(0.05)\\n"
            "held_later = pinned.held_blocks")
        more, err2 = run("y = 1")
        result(lines=lines + more, err=err + err2, held_in_cell=shell.user_ns["held_in_cell"],
               held_later=shell.user_ns["held_later"])
    ''')
    assert r["held_in_cell"] == 4, r
    assert r["held_later"] == 0, r
    assert "could not be cleaned up" not in r["err"] and "cuMemFreeHost failed" not in r["err"], r["err"]
