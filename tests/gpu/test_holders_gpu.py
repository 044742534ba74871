"""Hidden holders on a real GPU, in an in-process IPython shell with PyTorch: a tensor left in
Out[N] and a failed cell's traceback after a real out-of-memory error, named by the line and
given back (torch's allocated bytes and the device's free memory back where they were)."""

from __future__ import annotations

from conftest import GiB, MiB, TOLERANCE, require, run_script


def test_out_and_an_out_of_memory_traceback_are_named_and_given_back():
    require("torch")
    r = run_script('''
        import io, contextlib, torch
        from IPython.core.interactiveshell import InteractiveShell
        shell = InteractiveShell.instance()
        def run(code):
            sink = io.StringIO()
            with contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
                res = shell.run_cell(code, store_history=True)
            return res, [l for l in sink.getvalue().splitlines() if l.startswith("gpucleanup")]
        run("import torch\\nw = torch.ones(1024, device='cuda')\\ntorch.cuda.synchronize()")
        run("%config GPUCleanup.release = 'cell'")  # the memory is checked right after each cell
        run("%load_ext gpucleanup")
        base_alloc = torch.cuda.memory_allocated(0)
        base_free = torch.cuda.mem_get_info(0)[0]
        res, out_lines = run("torch.ones(256 * 1024 ** 2, device='cuda')")   # 1 GiB left in Out[N]
        out_cell = res.execution_count
        del res
        held_alloc = torch.cuda.memory_allocated(0)
        _, release_lines = run("%gpumem --release out")
        after_out_alloc = torch.cuda.memory_allocated(0)
        run("def fit():\\n    batch = torch.empty(4 * 1024 ** 3, dtype=torch.uint8, device='cuda')\\n"
            "    return torch.empty(1024 ** 4, dtype=torch.uint8, device='cuda')")
        res, oom_lines = run("fit()")
        oom_cell = res.execution_count
        oom_type = type(res.error_in_exec).__name__
        del res
        after_oom_alloc = torch.cuda.memory_allocated(0)
        after_oom_free = torch.cuda.mem_get_info(0)[0]
        res, again_lines = run("again = torch.empty(4 * 1024 ** 3, dtype=torch.uint8, device='cuda')\\ndel again")
        again_ok = res.error_in_exec is None
        del res
        for l in out_lines + release_lines + oom_lines + again_lines:
            figure(l)
        result(out_cell=out_cell, out_lines=out_lines, release_lines=release_lines, oom_cell=oom_cell,
               oom_type=oom_type, oom_lines=oom_lines, base_alloc=base_alloc, held_alloc=held_alloc,
               after_out_alloc=after_out_alloc, after_oom_alloc=after_oom_alloc, base_free=base_free,
               after_oom_free=after_oom_free, again_ok=again_ok)
    ''')
    assert r["held_alloc"] - r["base_alloc"] == GiB
    assert any("kept " in l and f": Out[{r['out_cell']}] 1.0 GiB" in l for l in r["out_lines"]), r["out_lines"]
    assert r["release_lines"][0] == f"gpucleanup · released Out[{r['out_cell']}] from the output cache"
    assert r["after_out_alloc"] == r["base_alloc"]
    assert r["oom_type"] == "OutOfMemoryError"
    assert r["oom_lines"][0].startswith(f"gpucleanup · out of GPU memory in cell [{r['oom_cell']}]: released 4.0 GiB "
                                        "held by 1 variable of its traceback"), r["oom_lines"]
    assert r["after_oom_alloc"] == r["base_alloc"]
    assert abs(r["after_oom_free"] - r["base_free"]) <= TOLERANCE
    assert r["again_ok"] is True


def test_a_training_step_leaves_nothing_allocated_once_its_objects_are_deleted():
    # cuBLAS workspaces are allocated through torch's caching allocator: without clearing them
    # a deleted model still leaves tens of MiB allocated and reserved
    require("torch")
    r = run_script('''
        import io, contextlib, torch
        from IPython.core.interactiveshell import InteractiveShell
        shell = InteractiveShell.instance()
        def run(code):
            sink = io.StringIO()
            with contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
                res = shell.run_cell(code, store_history=True)
            assert res.error_in_exec is None, sink.getvalue()
            return [l for l in sink.getvalue().splitlines() if l.startswith("gpucleanup")]
        run("import torch\\nx0 = torch.ones(1, device='cuda')\\ntorch.cuda.synchronize()")
        run("%config GPUCleanup.release = 'cell'")  # the memory is checked right after each cell
        run("%load_ext gpucleanup")
        base = torch.cuda.memory_allocated(0)
        run("model = torch.nn.Sequential(*[torch.nn.Linear(2048, 2048) for _ in range(4)]).cuda()\\n"
            "opt = torch.optim.Adam(model.parameters())\\n"
            "for _ in range(3):\\n"
            "    loss = model(torch.randn(512, 2048, device='cuda')).square().mean()\\n"
            "    opt.zero_grad(); loss.backward(); opt.step()\\n"
            "value = float(loss)")
        lines = run("del model, opt, loss")
        for l in lines:
            figure(l)
        result(base=base, allocated=torch.cuda.memory_allocated(0), reserved=torch.cuda.memory_reserved(0), lines=lines)
    ''')
    assert r["allocated"] == r["base"]
    assert r["reserved"] - r["allocated"] <= 2 * MiB  # the block of x0's segment stays


def test_raw_allocations_are_said_as_growth_outside_every_pool():
    # five raw cuMemAlloc of 64 MiB made through ctypes, never freed: no framework and no pool
    # accounts for them, and the cell's line says so
    require("torch")
    r = run_script('''
        import io, contextlib, torch
        from IPython.core.interactiveshell import InteractiveShell
        shell = InteractiveShell.instance()
        def run(code):
            sink = io.StringIO()
            with contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
                res = shell.run_cell(code, store_history=True)
            assert res.error_in_exec is None, sink.getvalue()
            return [l for l in sink.getvalue().splitlines() if l.startswith("gpucleanup")]
        run("import torch, ctypes\\nx0 = torch.ones(1, device='cuda')\\ntorch.cuda.synchronize()")
        run("%load_ext gpucleanup")
        run("y = 1")
        lines = run("cuda = ctypes.CDLL('libcuda.so.1')\\nptrs = [ctypes.c_uint64() for _ in range(5)]\\n"
                    "codes = [cuda.cuMemAlloc_v2(ctypes.byref(p), ctypes.c_size_t(64 << 20)) for p in ptrs]")
        codes = shell.user_ns["codes"]
        for l in lines:
            figure(l)
        result(lines=lines, codes=codes)
    ''')
    assert r["codes"] == [0] * 5
    assert any("+320 MiB outside every pool in this cell (library code and handles, raw allocations, or another process on GPU0)" in l
               for l in r["lines"]), r["lines"]
