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
    from gpucleanup import extension
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
        kept, skipped = len(ext.history.last()), ext.engine.skipped
        lines = [run({idle!r}) for _ in range(20)]
        idle_skipped, idle_kept = ext.engine.skipped - skipped, len(ext.history.last()) - kept
        grown = run({allocate!r})
        figure(f"{framework}: {{idle_skipped}} of 20 idle cells skipped")
        result(lines=lines, idle_skipped=idle_skipped, idle_kept=idle_kept, grown=grown,
               after=ext.engine.skipped - skipped, last=ext.history.last()[-1]["touched"])
    ''')
    assert r["lines"] == [[]] * 20  # show "auto": an idle cell prints nothing
    assert r["idle_skipped"] == 20 and r["idle_kept"] == 0
    assert r["after"] == 20 and r["last"] is True  # the cell that allocated 256 MiB was cleaned and recorded
    assert any(line.startswith("gpucleanup · GPU0") for line in r["grown"]), r["grown"]
