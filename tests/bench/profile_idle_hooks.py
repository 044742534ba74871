#!/usr/bin/env python3
"""Where an idle cell's hooks spend their time on the fake CUDA driver: cProfile of the extension's two hooks.

Method: an IPython shell in this process with ``%load_ext gpucleanup``, the fake driver scripted as
bench_run_cell.py's scenario (``device``: a context on the device; ``unused``: the driver initialised, no context;
``never``: nothing initialised it), 50 cells run through ``run_cell`` first, then N cells of the hooks alone (``pre_run_cell``, ``post_run_cell``)
timed, then N more under cProfile: the mean per cell, how many cells the engine skipped as idle, and the 12
functions with the largest own time.

Usage: python tests/bench/profile_idle_hooks.py {device,unused,never} [N]
(GPUCLEANUP_BUILD_DIR selects the build tree whose fake driver and library are used, default build/)
"""

from __future__ import annotations

import cProfile
import io
import pathlib
import pstats
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import fake_driver  # noqa: E402  (tests/bench/fake_driver.py)
from bench_run_cell import SCENARIOS  # noqa: E402


def main() -> int:
    if len(sys.argv) < 2 or sys.argv[1] not in SCENARIOS:
        print(__doc__.strip().splitlines()[-2], file=sys.stderr)
        return 2
    scenario, n = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 3000
    fake_driver.use(SCENARIOS[scenario])
    from IPython.core.interactiveshell import ExecutionInfo, ExecutionResult, InteractiveShell

    try:
        from gpucleanup.in_kernel import extension
    except ImportError:  # a build before the package's folders (an A/B against an older commit)
        from gpucleanup import extension

    shell = InteractiveShell.instance()
    shell.run_line_magic("load_ext", "gpucleanup")
    ext = extension.get_extension(shell)
    for _ in range(50):
        shell.run_cell("x = 1", store_history=True)
    info = ExecutionInfo("x = 1", True, False, True, None)
    result = ExecutionResult(info)
    result.execution_count = shell.execution_count
    start = time.perf_counter()
    for _ in range(n):
        ext.pre_run_cell(info)
        ext.post_run_cell(result)
    print(f"{scenario}: hooks per cell {(time.perf_counter() - start) / n * 1e6:.1f} us, "
          f"cells skipped as idle {getattr(getattr(ext.engine, 'since', None), 'skipped', '?')}")
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(n):
        ext.pre_run_cell(info)
        ext.post_run_cell(result)
    profile.disable()
    out = io.StringIO()
    pstats.Stats(profile, stream=out).sort_stats("tottime").print_stats(12)
    print(out.getvalue().strip())
    return 0


if __name__ == "__main__":
    sys.exit(main())
