"""The soak and churn program (tests/soak/soak.py), in its short version.

The full run (2,000 cells, 200 reload cycles, 50 kernels) is ``scripts/soak.sh``; here the same
program runs 200 cells, 20 load/reload/unload cycles and 5 kernels in real kernels on the fake CUDA
driver, and its verdict and figures are checked. The resident-memory limit (5 MiB of growth after the
warm-up) is part of the verdict at this size too: these parts grow by well under 1 MiB, so the limit
holds with a wide margin and does not make the test flaky. Nothing here is timed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import BUILD, FAKE_CUDA

pytest.importorskip("jupyter_client")
pytest.importorskip("ipykernel")

ROOT = Path(__file__).resolve().parents[2]
SOAK = ROOT / "tests" / "soak" / "soak.py"
sys.path.insert(0, str(SOAK.parent))
import soak  # noqa: E402  (tests/soak/soak.py)
from support import MiB  # noqa: E402

CELLS, RELOADS, KERNELS = 200, 20, 5


def _run(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    env = dict(os.environ, GPUCLEANUP_BUILD_DIR=str(BUILD))
    return subprocess.run([sys.executable, str(SOAK), *args], env=env, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def short_soak(tmp_path_factory):
    if not FAKE_CUDA.exists() or not (BUILD / "native" / "libgpucleanup.so").exists():
        pytest.fail(f"build libgpucleanup and the fake driver first ({BUILD})")
    out = tmp_path_factory.mktemp("soak") / "soak.json"
    done = _run("--cells", str(CELLS), "--reloads", str(RELOADS), "--kernels", str(KERNELS), "--json", str(out),
                "--quiet")
    return done, json.loads(out.read_text()) if out.exists() else None


def test_the_short_soak_passes_and_says_so(short_soak):
    done, result = short_soak
    assert done.returncode == 0, done.stdout + done.stderr
    assert result["verdict"] == "pass" and result["problems"] == []
    assert "verdict: pass" in done.stdout
    assert "figures: " in done.stdout
    assert result["kernel_output"] == {"lines": 0, "first": []}


def test_every_cell_gpumem_and_status_request_of_the_cells_part_is_answered(short_soak):
    _, result = short_soak
    cells = result["parts"]["cells"]
    assert cells["sent"] == {"cells": CELLS, "gpumem": CELLS // 10, "status": CELLS // 10}
    assert cells["received"] == cells["sent"]


def test_the_fake_drivers_changes_are_all_in_the_schedule_and_said_as_they_should_be(short_soak):
    _, result = short_soak
    cells = result["parts"]["cells"]
    assert set(cells["schedule"]) == {"idle", "fill", "in_use", "not_in_use", "live", "stall", "fault", "sticky",
                                      "release"}
    assert cells["schedule"]["sticky"] == 1
    # every cell that left a synchronize hanging said GPU0 was busy; the sticky error was said once
    assert cells["stalls"] > 0 and cells["stalls_said_busy"] == cells["stalls"]
    assert cells["lines"]["unusable"] == 1
    assert cells["examples"]["unusable"] == "gpucleanup · GPU0 is unusable after CUDA_ERROR_ILLEGAL_ADDRESS: restart the kernel"
    assert cells["lines"]["freed"] > 0


@pytest.mark.parametrize("part", ["cells", "reload"])
def test_a_kernels_descriptors_and_sockets_end_where_the_warm_up_left_them_and_threads_no_higher(short_soak, part):
    _, result = short_soak
    figures = result["parts"][part]
    grown = figures["growth_after_warm_up"]
    # GPU0's sticky error gives its watchdog thread back: the cells part may end with one thread fewer
    assert (grown["fds"], grown["sockets"]) == (0, 0) and grown["threads"] <= 0, figures["resources"]
    if soak.asan_preloaded(os.environ):
        # scripts/sanitizers.sh: ASan's quarantine keeps freed memory resident, so no limit, and it says so
        assert result["parameters"]["rss_limit_mib"] is None
        assert "AddressSanitizer" in result["parameters"]["rss_limit_off"]
    else:
        assert result["parameters"]["rss_limit_mib"] == 5.0 and result["parameters"]["rss_limit_off"] is None
        assert grown["rss_bytes"] <= 5 * MiB


def test_every_load_and_reload_writes_the_discovery_file_and_every_unload_removes_it(short_soak):
    _, result = short_soak
    reload = result["parts"]["reload"]
    assert reload["discovery"] == {"present_when_loaded": 2 * RELOADS, "absent_after_unload": RELOADS}
    # one cell before the cycles, then four per cycle; a status request after each load and reload
    assert reload["sent"] == {"cells": 1 + 4 * RELOADS, "status": 2 * RELOADS}
    assert reload["received"] == reload["sent"]


def test_kernels_come_and_go_under_gpucleanup_ps_and_leave_nothing_behind(short_soak):
    _, result = short_soak
    kernels = result["parts"]["kernels"]
    assert kernels["stopped"] == {"shutdown": 3, "killed": 2}
    assert kernels["sent"] == {"cells": 2 * KERNELS, "status": KERNELS}
    assert kernels["received"] == kernels["sent"]
    assert kernels["runtime_dir"] == {"start": [], "end": []}
    ps = kernels["ps"]
    assert ps["runs"] >= 2 and ps["ok"] == ps["runs"] and ps["failures"] == [] and ps["stderr"] == []
    start, end = kernels["resources"]["warm_up"], kernels["resources"]["end"]
    assert (end["fds"], end["sockets"]) == (start["fds"], start["sockets"]) and end["threads"] <= start["threads"]


def test_the_schedule_is_the_same_for_the_same_seed_and_ends_by_letting_a_stall_go():
    first, again, other = soak.schedule(500, 1), soak.schedule(500, 1), soak.schedule(500, 2)
    assert first == again and first != other
    assert first[450] == {"device": 0, "sticky": 700, "why": "sticky"}
    assert first[-1] == {"device": 0, "why": "release"}
    assert soak.cell_code(499, first[-1]) == "x = [499] * 100\n_soak(0)"
    stall = next(s for s in first if s and s["why"] == "stall")
    assert soak.cell_code(7, stall) == "x = [7] * 100\n_soak(0, sync=-1, fill=536870912)"


def test_growth_beyond_the_limit_and_counts_not_back_are_problems():
    part = {"resources": {"warm_up": {"rss_bytes": 100 * MiB, "threads": 19, "fds": 80, "sockets": 24},
                          "end": {"rss_bytes": 106 * MiB, "threads": 20, "fds": 80, "sockets": 25}}}
    problems = []
    soak.growth(part, problems, 5 * MiB, "cells")
    assert part["growth_after_warm_up"] == {"rss_bytes": 6 * MiB, "threads": 1, "fds": 0, "sockets": 1}
    assert problems == [
        "cells: resident memory grew by 6.0 MiB after the warm-up (limit 5 MiB)",
        "cells: threads 19 after the warm-up, 20 at the end",
        "cells: sockets 24 after the warm-up, 25 at the end",
    ]
    # a thread fewer is no problem (an unusable device's watchdog ended); a descriptor fewer is
    fewer = {"resources": {"warm_up": dict(part["resources"]["warm_up"]),
                           "end": dict(part["resources"]["warm_up"], threads=18, fds=79)}}
    problems = []
    soak.growth(fewer, problems, 5 * MiB, "cells")
    assert problems == ["cells: fds 80 after the warm-up, 79 at the end"]
    within = {"resources": {"warm_up": dict(part["resources"]["warm_up"]),
                            "end": dict(part["resources"]["warm_up"], rss_bytes=104 * MiB)}}
    problems = []
    soak.growth(within, problems, 5 * MiB, "reload")
    assert problems == []
    # no resident-memory limit (under AddressSanitizer): the counts are still checked
    problems = []
    soak.growth(part, problems, None, "cells")
    assert part["growth_after_warm_up"]["rss_bytes"] == 6 * MiB
    assert problems == ["cells: threads 19 after the warm-up, 20 at the end",
                        "cells: sockets 24 after the warm-up, 25 at the end"]


@pytest.mark.parametrize("preload, under", [
    ("", False),
    ("/usr/lib/gcc/x86_64-linux-gnu/12/libasan.so /usr/lib/x86_64-linux-gnu/libstdc++.so.6.0.30", True),
    ("/usr/lib/x86_64-linux-gnu/libasan.so.8:/lib/libfoo.so", True),
    ("/usr/lib/x86_64-linux-gnu/libtsan.so.2", False),
    ("/opt/notlibasan/libjemalloc.so", False),
])
def test_the_kernels_are_known_to_run_under_asan_by_the_preloaded_runtime(preload, under):
    assert soak.asan_preloaded({"LD_PRELOAD": preload}) is under


UNLOAD_FREES = """
import gc
gc.disable()  # only what gpucleanup collects itself is collected
from IPython.core.interactiveshell import InteractiveShell
ip = InteractiveShell.instance()
for i in range(3):
    for code in ("%load_ext gpucleanup", f"x = {i}", "%reload_ext gpucleanup", "%unload_ext gpucleanup"):
        ip.run_cell(code, store_history=True)
print(sum(type(o).__name__ == "GPUCleanup" for o in gc.get_objects()))
"""


def test_an_unloaded_extension_is_freed_at_once_not_left_to_a_later_collection(tmp_path):
    # What the reload part found: the unloaded object is reference cycles; left to the interpreter's next
    # full collection, reloads piled them up and the kernel's memory grew with each (BENCHMARKS.md).
    env = dict(os.environ, PYTHONPATH=str(ROOT / "ipython_ext"), JUPYTER_RUNTIME_DIR=str(tmp_path / "runtime"),
               IPYTHONDIR=str(tmp_path / "ipython"),
               GPUCLEANUP_FAKE_CUDA_SCENARIO=json.dumps({"devices": [{"primary_active": True}]}))
    done = subprocess.run([sys.executable, "-c", UNLOAD_FREES], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == "0"


def test_a_missing_build_is_exit_2_saying_how_to_build(tmp_path):
    done = _run("--build-dir", str(tmp_path / "nowhere"), timeout=60)
    assert done.returncode == 2
    assert f"soak: {tmp_path / 'nowhere' / 'native' / 'libgpucleanup.so'} is missing: build first" in done.stderr


def test_negative_sizes_are_usage_errors():
    done = _run("--cells", "-1", timeout=60)
    assert done.returncode == 2
    assert "--cells needs a number >= 0, got -1" in done.stderr
