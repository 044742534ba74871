"""The idle cell on a real GPU (issue 25, item 4): with CuPy or PyTorch in use and nothing changed since the
last cleanup, the cell's cleanup stops after reading the frameworks' figures: no record, no publish, no line.
A cell that allocates is never skipped. In an in-process IPython shell, each case in a fresh Python
(conftest.run_script); run with -s to see the figures (FIGURE).
"""

from __future__ import annotations

import pytest

from conftest import require, run_script

SHELL = '''
    import io, contextlib
    from IPython.core.interactiveshell import InteractiveShell
    from gpucleanup.in_kernel import extension
    shell = InteractiveShell.instance()
    def run(code):
        sink = io.StringIO()
        with contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
            res = shell.run_cell(code, store_history=True)
        assert res.error_in_exec is None, sink.getvalue()
        return [l for l in sink.getvalue().splitlines() if l.startswith("gpucleanup")]
    run("%load_ext gpucleanup")
    ext = extension.get_extension(shell)
'''

CASES = {
    "cupy": ("import cupy as cp", "x = cp.ones(1 << 20, dtype=cp.float32)", "x += 1",
             "y = cp.ones(1 << 26, dtype=cp.float32)"),
    "torch": ("import torch", "x = torch.ones(1 << 20, device='cuda')", "x += 1",
              "y = torch.ones(1 << 26, device='cuda')"),
}


@pytest.mark.parametrize("framework", list(CASES))
def test_idle_cells_are_skipped_and_an_allocating_cell_is_not(framework):
    require(framework)
    imported, setup, idle, allocate = CASES[framework]
    r = run_script(SHELL, f'''
        run({imported!r})
        run({setup!r})
        run({idle!r})   # the first cell after the set-up may still find something to give back
        kept, skipped = len(ext.history.last()), ext.engine.since.skipped
        lines = [run({idle!r}) for _ in range(20)]
        idle_skipped, idle_kept = ext.engine.since.skipped - skipped, len(ext.history.last()) - kept
        grown = run({allocate!r})
        figure(f"{framework}: {{idle_skipped}} of 20 idle cells skipped")
        result(lines=lines, idle_skipped=idle_skipped, idle_kept=idle_kept, grown=grown,
               after=ext.engine.since.skipped - skipped, last=ext.history.last()[-1]["touched"])
    ''')
    assert r["lines"] == [[]] * 20  # show "auto": an idle cell prints nothing
    assert r["idle_skipped"] == 20 and r["idle_kept"] == 0
    assert r["after"] == 20 and r["last"] is True  # the cell that allocated 256 MiB was cleaned and recorded
    assert any(line.startswith("gpucleanup · GPU0") for line in r["grown"]), r["grown"]


ARRAYS = {
    "cupy": ("import cupy as cp", "x = cp.ones(1 << 28, dtype=cp.float32)"),
    "torch": ("import torch", "x = torch.ones(1 << 28, device='cuda')"),
}


@pytest.mark.parametrize("framework", list(ARRAYS))
def test_idle_cells_read_the_quiet_token_alone_and_a_deleted_array_is_given_back(framework):
    # CuPy's and PyTorch's quiet tokens on the real frameworks: idle cells build no figures, and a `del` (its
    # GiB goes to the framework's cache, which the driver does not see) changes the token, so it is freed
    require(framework)
    imported, allocate = ARRAYS[framework]
    r = run_script(SHELL, f'''
        from gpucleanup.frameworks import ADAPTERS
        adapter = next(a for a in ADAPTERS if a.name == {framework!r})
        reads, read_figures = [], type(adapter)._stats
        type(adapter)._stats = lambda self, *a: reads.append(1) or read_figures(self, *a)
        run("%config GPUCleanup.release = 'cell'")
        run({imported!r})
        run({allocate!r})
        run("z = 1")  # the first cell after the allocation may still find something to give back
        read, skipped = len(reads), ext.engine.since.skipped
        idle = [run("z = 1") for _ in range(10)]
        idle_reads, idle_skipped = len(reads) - read, ext.engine.since.skipped - skipped
        freed = run("del x")
        figure(f"{framework}: 10 idle cells, {{idle_skipped}} skipped, figures read {{idle_reads}} times; del: {{freed}}")
        result(idle=idle, idle_reads=idle_reads, idle_skipped=idle_skipped, freed=freed)
    ''')
    assert r["idle"] == [[]] * 10 and r["idle_skipped"] == 10
    assert r["idle_reads"] == 0  # the token alone on every idle cell
    assert len(r["freed"]) == 1 and f"freed 1.0 GiB ({framework} 1.0)" in r["freed"][0], r["freed"]


RERUN = '''
_h = cupyx.empty_pinned((16 << 20,), dtype=np.float32)  # 64 MiB staged through pinned memory
_h[:] = 1.0
_d = cp.asarray(_h)
s = float(_d.sum())
del _h, _d
'''


def test_release_rerun_keeps_the_caches_for_a_re_run_and_gives_them_back_as_another_cell_starts():
    # release "rerun": a cell re-run back to back finds CuPy's device and pinned caches as it left them
    # (nothing torn down, no record, no line), and a different cell has them given back as it starts
    require("cupy")
    r = run_script(SHELL, f'''
        run("%config GPUCleanup.release = 'rerun'")
        run("%config GPUCleanup.idle_release_s = 3600")
        run("import cupy as cp, cupyx, numpy as np")
        first = run({RERUN!r})
        import cupy
        pool, pinned = cupy.get_default_memory_pool(), cupy.get_default_pinned_memory_pool()
        cached = (pool.total_bytes(), pinned.n_free_blocks())
        job, skipped = ext.engine.releases.idle_job, ext.engine.since.skipped
        reruns = [run({RERUN!r}) for _ in range(10)]
        same_job = ext.engine.releases.idle_job is job and not job.done.is_set()
        after_reruns = (pool.total_bytes(), pinned.n_free_blocks())
        other = run("z = 1")
        done = job.done.wait(60)
        figure(f"rerun: {{ext.engine.since.skipped - skipped}} of 10 re-runs skipped, caches {{cached}} -> {{after_reruns}}")
        result(first=first, reruns=reruns, skipped=ext.engine.since.skipped - skipped, same_job=same_job, cached=cached,
               after_reruns=after_reruns, other=other, done=done, when=job.when,
               after_other=(pool.total_bytes(), pinned.n_free_blocks()))
    ''')
    assert any("cached 64 MiB until idle or another cell (cupy 64)" in line for line in r["first"]), r["first"]
    assert r["cached"][0] >= 64 << 20  # CuPy's device pool keeps the 64 MiB (its pinned pool may free late)
    assert r["reruns"] == [[]] * 10 and r["skipped"] == 10 and r["same_job"]
    assert r["after_reruns"][0] == r["cached"][0]  # the re-runs re-used the device cache, nothing was rebuilt
    assert r["done"] and r["when"] == "cell"
    assert r["after_other"] == [0, 0], r  # device pool and pinned pool empty once another cell started
