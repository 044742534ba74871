"""report.py: units, the summary line and the %gpumem tables, from plain records (no GPU, no shell)."""

from __future__ import annotations

import json

import pytest

from gpucleanup.records import report
from support import GiB, MiB  # noqa: E402



@pytest.mark.parametrize(
    "n, text",
    [
        (0, "0 B"),
        (8, "8 B"),
        (1023, "1023 B"),
        (1536, "1.5 KiB"),
        (512 * MiB, "512 MiB"),
        (int(1.5 * MiB), "1.5 MiB"),
        (6 * GiB, "6.0 GiB"),
        (int(79.6 * GiB), "79.6 GiB"),
        (3 * (1 << 40), "3.0 TiB"),
        (-2 * GiB, "-2.0 GiB"),
        (None, "?"),
    ],
)
def test_format_bytes_rounds_for_reading(n, text):
    assert report.format_bytes(n) == text


@pytest.mark.parametrize(
    "seconds, text",
    [(0.0004, "0.4 ms"), (0.004, "4 ms"), (0.012, "12 ms"), (0.9996, "1.0 s"), (2.5, "2.5 s"), (31.2, "31 s"), (125, "2 min 5 s"), (120, "2 min")],
)
def test_format_duration(seconds, text):
    assert report.format_duration(seconds) == text


@pytest.mark.parametrize(
    "name, short",
    [
        ("NVIDIA H100 80GB HBM3", "H100"),
        ("NVIDIA A100-SXM4-80GB", "A100"),
        ("NVIDIA GeForce RTX 4090", "RTX 4090"),
        ("NVIDIA H200", "H200"),
        ("Tesla V100-PCIE-16GB", "V100"),
        ("Fake H100", "Fake H100"),
        (None, ""),
    ],
)
def test_short_device_name(name, short):
    assert report.short_device_name(name) == short


def _record(**over):
    dev = {
        "index": 0,
        "name": "NVIDIA H100 80GB HBM3",
        "state": "drained",
        "settle": {"status": "done", "waited_s": 0.001},
        "total_bytes": int(79.6 * GiB),
        "used_after_bytes": int(2.7 * GiB),
        "freed_bytes": {"cupy": int(5.5 * GiB), "torch": GiB // 2},
        "live_bytes": {"cupy": int(2.1 * GiB)},
        "cached_bytes": {},
        "message": None,
    }
    dev.update(over.pop("device", {}))
    rec = {
        "cell": 3,
        "elapsed_s": 0.012,
        "devices": [dev],
        "pinned": {"freed_bytes": {"cupy": GiB}, "background": [], "pending": False},
        "shown_notes": [],
    }
    rec.update(over)
    return rec


def test_summary_line_has_every_part_in_order():
    assert report.summary_lines(_record()) == [
        "gpucleanup · GPU0 H100 · freed 6.0 GiB (cupy 5.5, torch 0.5) · pinned 1.0 GiB · kept 2.1 GiB live (cupy) · device 2.7/79.6 GiB · 12 ms"
    ]


def test_summary_line_pinned_freed_in_background_and_tiny_parts_keep_their_unit():
    rec = _record(
        device={"freed_bytes": {"cupy": 6 * GiB, "driver": 4 * MiB}, "live_bytes": {}},
        pinned={"freed_bytes": {}, "background": [{"cell": 2, "freed_bytes": {"cupy": GiB}, "elapsed_s": 0.13}], "pending": False},
    )
    assert report.summary_lines(rec) == [
        "gpucleanup · GPU0 H100 · freed 6.0 GiB (cupy 6.0, driver 4.0 MiB) · pinned 1.0 GiB freed in background · device 2.7/79.6 GiB · 12 ms"
    ]


def test_summary_line_says_what_stays_cached_when_a_framework_cannot_release():
    rec = _record(device={"freed_bytes": {}, "cached_bytes": {"jax": 3 * GiB}}, pinned={})
    assert report.summary_lines(rec) == [
        "gpucleanup · GPU0 H100 · freed 0 B · kept 2.1 GiB live (cupy) · held 3.0 GiB cached (jax 3.0) · device 2.7/79.6 GiB · 12 ms"
    ]


def test_summary_line_says_the_cell_left_work_queued_when_the_settle_waited():
    rec = _record(device={"settle": {"status": "done", "waited_s": 0.42}}, pinned={}, elapsed_s=0.428)
    assert report.summary_lines(rec) == [
        "gpucleanup · GPU0 H100 · freed 6.0 GiB (cupy 5.5, torch 0.5) · waited 420 ms for queued work · kept 2.1 GiB live (cupy) · device 2.7/79.6 GiB · 428 ms"
    ]


def test_summary_busy_device_says_what_was_skipped():
    rec = _record(device={"state": "busy", "settle": {"status": "timeout", "waited_s": 30.0, "busy_for_s": 30.0}, "freed_bytes": {}, "live_bytes": {}}, pinned={})
    assert report.summary_lines(rec) == [
        "gpucleanup · GPU0 H100 · busy after 30 s: skipped freeing, queued work keeps running · device 2.7/79.6 GiB · 12 ms"
    ]


def test_summary_one_line_per_device_pinned_on_the_first_and_notes_after():
    second = dict(_record()["devices"][0], index=1, freed_bytes={"torch": 512 * MiB}, live_bytes={})
    rec = _record(shown_notes=["torch.drain failed: RuntimeError: boom"])
    rec["devices"].append(second)
    lines = report.summary_lines(rec)
    assert lines == [
        "gpucleanup · GPU0 H100 · freed 6.0 GiB (cupy 5.5, torch 0.5) · pinned 1.0 GiB · kept 2.1 GiB live (cupy) · device 2.7/79.6 GiB · 12 ms",
        "gpucleanup · GPU1 H100 · freed 512 MiB (torch 512) · device 2.7/79.6 GiB · 12 ms",
        "gpucleanup · torch.drain failed: RuntimeError: boom",
    ]


def test_progress_line():
    assert report.progress_line(0, 5.7) == "gpucleanup · waiting for GPU0 to finish queued work … 5 s"


def test_table_text_is_aligned_and_html_escaped():
    table = report.Table("t <1>", ["", "a", "bb"], [["x", "1 B", "22 B"], ["long label", "333 B", ""]], ["n & m"])
    assert table.text().splitlines() == [
        "t <1>",
        "                a    bb",
        "----------  -----  ----",
        "x             1 B  22 B",
        "long label  333 B",
        "  n & m",
    ]
    html = table.html()
    assert "t &lt;1&gt;" in html and "n &amp; m" in html and html.count("<tr>") == 3


def _status():
    return {
        "driver": {"state": "ready"},
        "enabled": True,
        "devices": [
            {
                "index": 0,
                "name": "NVIDIA H100 80GB HBM3",
                "total_bytes": 80 * GiB,
                "used_bytes": 4 * GiB,
                "frameworks": {"cupy": {"live_bytes": 2 * GiB, "cached_bytes": 512 * MiB}},
                "pools": [{"which": "default", "reserved_bytes": GiB // 2, "used_bytes": 0}],
                "outside_bytes": GiB,
            }
        ],
        "pinned": {"cupy": {"live_bytes": 0, "cached_bytes": GiB}},
        "history": [],
        "notes": [],
    }


def test_memory_report_text_table():
    text = report.memory_report(_status()).text()
    assert text.splitlines()[:9] == [
        "GPU0 H100 — 4.0/80.0 GiB used",
        "                              live / used  cached / reserved",
        "----------------------------  -----------  -----------------",
        "total                            80.0 GiB",
        "used (device, all processes)      4.0 GiB",
        "cupy                              2.0 GiB            512 MiB",
        "driver pool (default)                 0 B            512 MiB",
        "outside every pool                1.0 GiB",
        "  frameworks: live (held by objects) / cached (freeable); driver pools: used / reserved.",
    ]
    assert "the CUDA context (~500 MiB), other processes on this GPU and raw allocations are in it" in text
    assert "pinned host memory pools" in text


def test_memory_report_html_and_text_reprs():
    rep = report.memory_report(_status())
    assert rep._repr_html_().startswith("<div class='gpucleanup-report'><table")
    assert repr(rep) == rep.text()


def test_memory_report_without_driver_says_so():
    rep = report.memory_report({"driver": {"state": "no_driver"}, "devices": [], "enabled": True})
    assert rep.text() == "gpucleanup · no CUDA driver: nothing to clean"


def test_history_table_from_records():
    text = report.history_report([_record()]).text()
    assert text.splitlines() == [
        "last 1 cell",
        "cell    freed   pinned  gc  device used        outside pools  state  time",
        "----  -------  -------  --  -----------------  -------------  -----  -----",
        "[3]   6.0 GiB  1.0 GiB  -   GPU0 2.7/79.6 GiB              -  ok     12 ms",
    ]


def test_history_table_shows_each_cells_growth_outside_every_pool():
    grew, shrank = _record(), _record()
    grew["cell"], shrank["cell"] = 4, 5
    grew["devices"][0]["outside_growth_bytes"] = 320 * MiB
    shrank["devices"][0]["outside_growth_bytes"] = -64 * MiB
    rows = report.history_report([_record(), grew, shrank]).text().splitlines()[3:]
    assert rows == [
        "[3]   6.0 GiB  1.0 GiB  -   GPU0 2.7/79.6 GiB              -  ok     12 ms",
        "[4]   6.0 GiB  1.0 GiB  -   GPU0 2.7/79.6 GiB       +320 MiB  ok     12 ms",
        "[5]   6.0 GiB  1.0 GiB  -   GPU0 2.7/79.6 GiB        -64 MiB  ok     12 ms",
    ]


def test_history_names_drains_apart_and_never_counts_them_as_cells():
    outside, magic = _record(), _record()
    outside.update(cell=None, source="outside")
    magic["cell"] = None
    lines = report.history_report([_record(), outside, magic]).text().splitlines()
    assert lines[0] == "last 1 cell and 2 drains"
    assert [line.split("  ")[0] for line in lines[3:]] == ["[3]", "outside drain", "drain"]
    assert report.history_report([outside]).text().splitlines()[0] == "last 1 drain"


def test_vars_report_largest_first():
    found = [
        {"name": "small", "kind": "cupy.ndarray", "shape": [2], "dtype": "float32", "device": "GPU0", "bytes": 8},
        {"name": "big", "kind": "torch.Tensor", "shape": [1024, 1024], "dtype": "float32", "device": "GPU0", "bytes": 4 * MiB},
    ]
    found[1]["held_by"] = "output cache"
    found[1]["name"] = "Out[3]"
    lines = report.vars_report(found, limit=1).text().splitlines()
    assert lines[1:4] == [
        "name    held by       type          shape      dtype    device    bytes",
        "------  ------------  ------------  ---------  -------  ------  -------",
        "Out[3]  output cache  torch.Tensor  1024×1024  float32  GPU0    4.0 MiB",
    ]
    assert lines[4:] == [
        "  2 objects, 4.0 MiB in all; views of one buffer each count their own size.",
        "  held by output cache: %gpumem --release out (the output cache) or --release traceback (the last "
        "traceback's variables) lets them go",
    ]


def test_json_report_is_a_dict_shown_as_json():
    data = report.JSONReport({"a": 1 << 40})
    assert data["a"] == 1099511627776
    assert json.loads(repr(data)) == {"a": 1099511627776}


def test_memory_report_lists_each_pycuda_pool_under_pycuda_and_says_which_is_not_drained_here():
    status = _status()
    status["devices"][0]["frameworks"]["pycuda"] = {"live_bytes": 64 * MiB, "cached_bytes": 136 * MiB}
    status["framework_pools"] = {"pycuda": [
        {"pool": "DeviceMemoryPool #1", "kind": "device", "device": 0, "thread": "MainThread",
         "live_bytes": 64 * MiB, "cached_bytes": 0, "drained_here": True},
        {"pool": "DeviceMemoryPool #2", "kind": "device", "device": 0, "thread": "loader",
         "live_bytes": 0, "cached_bytes": 136 * MiB, "drained_here": False},
        {"pool": "PageLockedMemoryPool #1", "kind": "pinned", "device": None, "thread": "MainThread",
         "live_bytes": 0, "cached_bytes": 0, "drained_here": True},
    ]}
    rows = report.memory_report(status).text().splitlines()
    start = rows.index(next(r for r in rows if r.startswith("pycuda")))
    width = rows[2].index("  ")  # the first column's width, from the table's rule
    assert [r[:width].rstrip() for r in rows[start:start + 3]] == [
        "pycuda", "  DeviceMemoryPool #1", "  DeviceMemoryPool #2, thread loader: not drained here"]
    assert rows[start + 2].endswith("136 MiB")


def test_a_library_that_cannot_be_loaded_is_said_once_and_not_called_the_driver():
    # %gpumem with GPUCLEANUP_LIBRARY pointing nowhere: the engine's status says it in the driver's entry alone,
    # and the report names gpucleanup's library, not the CUDA driver
    from gpucleanup.engine import after_cell

    message = ("[gpucleanup.python.103] GPUCLEANUP_LIBRARY '/nowhere.so' cannot be opened (No such file or "
               "directory): point GPUCLEANUP_LIBRARY at libgpucleanup.so, or unset it")

    class Missing:
        def snapshot(self):
            raise RuntimeError(message)

    status = after_cell.AfterCell(Missing()).memory_status(after_cell.Settings())
    assert status["notes"] == [] and status["driver"] == {"state": "unusable", "message": message}
    status["enabled"] = True
    assert report.memory_report(status).text() == f"gpucleanup · gpucleanup's native library could not be loaded: {message}"
    assert report.driver_sentence({"state": "unusable", "message": "cuInit failed"}) == "CUDA driver unusable: cuInit failed"


def test_a_deferred_pinned_release_of_unknown_size_says_when_the_pools_are_given_back():
    rerun = {"release": "rerun", "deferred": {"pinned": True}}
    assert report._pinned_segment({}, rerun) == "pinned pools given back once idle or as another cell starts"
    assert report._pinned_segment({}, dict(rerun, release="idle")) == "pinned pools given back once idle"
