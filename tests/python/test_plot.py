"""%gpumem --plot: the matplotlib figure and its PNG, the SVG without matplotlib, the text
sparklines, the argument errors, and the magic in a shell over the fake CUDA driver."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import xml.etree.ElementTree as ET

import pytest
from IPython.core.error import UsageError
from IPython.core.formatters import DisplayFormatter
from IPython.utils.capture import capture_output

import gpucleanup
import gpucleanup.frameworks
import gpucleanup.in_kernel.status_endpoint
from gpucleanup.in_kernel import extension
from gpucleanup.records import plot, timeline
from shell_stand_ins import StandInAdapter, StandInEndpoint, _fake_name, _run, real, shell  # noqa: F401  (fixtures)
from support import ROOT, GiB, MiB

SVG_NS = "{http://www.w3.org/2000/svg}"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
H100 = "NVIDIA H100 80GB HBM3"


def _device(index=0, used=None, live=0, cached=0, outside=None, freed=0, before=None, name=H100, total=80 * GiB):
    return {"index": index, "name": name, "total_bytes": total, "state": "drained", "used_before_bytes": before,
            "used_after_bytes": used, "live_bytes": {"cupy": live} if live else {},
            "cached_bytes": {"torch": cached} if cached else {}, "outside_bytes": outside,
            "freed_bytes": {"cupy": freed} if freed else {}}


def _record(cell, *devices):
    return {"cell": cell, "time_ns": 1, "devices": list(devices)}


def _session():
    """Three cells and a drain on one H100: the numbers the tests below check."""
    return [
        _record(1, _device(used=GiB, outside=512 * MiB)),
        _record(2, _device(used=3 * GiB, live=2 * GiB, cached=512 * MiB, outside=512 * MiB, freed=GiB, before=4 * GiB)),
        _record(None, _device(used=2 * GiB + 512 * MiB, live=2 * GiB, outside=512 * MiB, freed=512 * MiB)),
        _record(3, _device(used=4 * GiB, live=3 * GiB, cached=512 * MiB, outside=None)),
    ]


def _data(records=None):
    return timeline.series(_session() if records is None else records)


# ------------------------------------------------------------------ layout


def test_positions_put_cells_at_their_number_and_drains_between_them_in_order():
    points = [{"cell": 4}, {"cell": None}, {"cell": None}, {"cell": 5}, {"cell": 9}, {"cell": None}]
    assert plot.positions(points) == ([4.0, 4 + 1 / 3, 4 + 2 / 3, 5.0, 9.0, 9.5], False)
    assert plot.positions([{"cell": None}, {"cell": 3}]) == ([2.5, 3.0], False)
    assert plot.positions([{"cell": None}, {"cell": None}]) == ([1.0, 2.0], False)


def test_positions_go_by_order_when_the_cell_numbers_restart():
    # %reset starts counting again: placed by order, labelled by cell
    assert plot.positions([{"cell": 7}, {"cell": 8}, {"cell": 1}, {"cell": None}]) == ([1.0, 2.0, 3.0, 4.0], True)


# ------------------------------------------------------------------ matplotlib


def test_figure_draws_one_line_per_series_the_freed_markers_and_the_drain():
    fig = plot.figure(_data())
    assert len(fig.axes) == 1
    ax = fig.axes[0]
    assert ax.get_title(loc="left") == "GPU0 H100 · 80.0 GiB total"
    assert ax.get_ylabel() == "GiB" and ax.get_xlabel() == "cell (In [N])"
    lines = {line.get_label(): line for line in ax.get_lines() if not line.get_label().startswith("_")}
    assert list(lines) == ["used (after cleanup)", "live", "cached", "outside every pool"]
    xs = [1.0, 2.0, 2.5, 3.0]  # the drain between cells 2 and 3
    assert list(lines["used (after cleanup)"].get_xdata()) == xs
    assert list(lines["used (after cleanup)"].get_ydata()) == [1.0, 3.0, 2.5, 4.0]
    assert list(lines["live"].get_ydata()) == [0.0, 2.0, 2.0, 3.0]
    assert list(lines["cached"].get_ydata()) == [0.0, 0.5, 0.0, 0.5]
    outside = list(lines["outside every pool"].get_ydata())
    assert outside[:3] == [0.5, 0.5, 0.5] and outside[3] != outside[3]  # unknown: NaN, a gap, not a zero
    drains = [c for c in ax.collections if c.get_label() == plot.DRAIN_LABEL]
    assert len(drains) == 1 and [seg[0][0] for seg in drains[0].get_segments()] == [2.5]
    freed = [c for c in ax.collections if c.get_label() == plot.FREED_LABEL]
    assert len(freed) == 1
    # at the level before each cleanup: 4 GiB before cell 2's, used + freed where not known (the drain)
    assert freed[0].get_offsets().tolist() == [[2.0, 4.0], [2.5, 3.0]]
    sizes = list(freed[0].get_sizes())
    assert sizes[0] > sizes[1]  # sized by the bytes freed
    assert sorted(t.get_text() for t in ax.texts) == ["1.0 GiB", "512 MiB"]
    legend = ax.get_legend()
    assert [t.get_text() for t in legend.get_texts()] == [
        "used (after cleanup)", "live", "cached", "outside every pool", plot.FREED_LABEL, "%gpumem --drain"]


def test_figure_has_a_panel_per_device_each_in_its_own_unit():
    records = [
        _record(1, _device(used=5 * GiB, live=4 * GiB, outside=GiB), _device(index=1, used=300 * MiB, outside=300 * MiB,
                                                                          name="NVIDIA A100-SXM4-40GB", total=40 * GiB)),
        _record(2, _device(used=6 * GiB, live=5 * GiB, outside=GiB), _device(index=1, used=400 * MiB, live=100 * MiB,
                                                                          outside=300 * MiB, freed=64 * MiB,
                                                                          name="NVIDIA A100-SXM4-40GB", total=40 * GiB)),
    ]
    fig = plot.figure(_data(records))
    assert [ax.get_title(loc="left") for ax in fig.axes] == ["GPU0 H100 · 80.0 GiB total", "GPU1 A100 · 40.0 GiB total"]
    assert [ax.get_ylabel() for ax in fig.axes] == ["GiB", "MiB"]
    used = [line for line in fig.axes[1].get_lines() if line.get_label() == "used (after cleanup)"][0]
    assert list(used.get_ydata()) == [300.0, 400.0]
    assert [c.get_label() for c in fig.axes[0].collections if c.get_label() == plot.FREED_LABEL] == []
    # one legend, beside the first panel, for what any panel draws (here only GPU1 freed something)
    assert fig.axes[1].get_legend() is None
    assert [t.get_text() for t in fig.axes[0].get_legend().get_texts()] == [
        "used (after cleanup)", "live", "cached", "outside every pool", plot.FREED_LABEL]


def test_figure_after_a_restart_of_the_cell_numbers_labels_each_place_by_its_cell():
    records = [_record(c, _device(used=GiB, outside=GiB)) for c in (7, 8, None, 1, 2)]
    ax = plot.figure(_data(records)).axes[0]
    assert ax.get_xlabel() == "cell, in the order run (In [N])"
    used = [line for line in ax.get_lines() if line.get_label() == "used (after cleanup)"][0]
    assert list(used.get_xdata()) == [1.0, 2.0, 3.0, 4.0, 5.0]
    formatter = ax.xaxis.get_major_formatter()
    assert [formatter(x, None) for x in (1, 2, 3, 4, 5, 6)] == ["7", "8", "drain", "1", "2", ""]


def test_figure_of_many_records_draws_groups_with_their_largest_values():
    records = [_record(c, _device(used=(c % 7) * MiB, outside=MiB, freed=MiB)) for c in range(1, 2502)]
    ax = plot.figure(_data(records)).axes[0]
    assert ax.get_xlabel() == "cell (In [N]); each point: the largest of 3 records (freed: their sum)"
    used = [line for line in ax.get_lines() if line.get_label() == "used (after cleanup)"][0]
    assert len(used.get_xdata()) == 834  # 2501 records, 3 a point
    assert list(used.get_xdata()[:2]) == [3.0, 6.0] and used.get_xdata()[-1] == 2501.0  # at each group's last cell
    assert list(used.get_ydata()[:3]) == [3.0, 6.0, 2.0]  # max of (1, 2, 3), (4, 5, 6), (0, 1, 2)
    freed = [c for c in ax.collections if c.get_label() == plot.FREED_LABEL][0]
    assert len(freed.get_offsets()) == 834
    labels = sorted(float(t.get_text().split()[0]) for t in ax.texts)
    assert len(labels) == 12 and set(labels) == {3.0}  # freed 1 MiB a record: 3 MiB a group, 12 labels at most
    xs = sorted(t.xy[0] for t in ax.texts)
    assert min(b - a for a, b in zip(xs, xs[1:])) >= 2500 / 12  # written apart from each other


def test_png_is_a_png_at_twice_the_density():
    data = plot.png(_data())
    assert data[:8] == PNG_MAGIC
    width, height = plot.png_size(data)
    assert (width, height) == (1800, 660)  # 9 x 3.3 inches at 200 dpi
    shown = plot.TimelinePlot(_session())._repr_png_()
    assert shown[0][:8] == PNG_MAGIC and shown[1] == {"width": 900, "height": 330}


def test_png_leaves_pyplot_and_the_backend_alone():
    script = (
        "import sys, matplotlib\n"
        "backend = dict.__getitem__(matplotlib.rcParams, 'backend')\n"
        "from gpucleanup.records import plot, timeline\n"
        f"records = {_session()!r}\n"
        "data = plot.png(timeline.series(records))\n"
        "assert data[:4] == b'\\x89PNG'\n"
        "print('matplotlib.pyplot' in sys.modules, dict.__getitem__(matplotlib.rcParams, 'backend') == backend)\n"
    )
    env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "ipython_ext"))
    env.pop("MPLBACKEND", None)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["False", "True"]


# ------------------------------------------------------------------ SVG


def test_svg_is_valid_xml_with_one_polyline_per_series_escaped_names_and_freed_markers():
    records = [
        _record(1, _device(used=GiB, live=GiB // 2, cached=GiB // 4, outside=GiB // 4, name='NVIDIA <Fake> & "GPU"\x01')),
        _record(2, _device(used=2 * GiB, live=GiB, cached=GiB // 2, outside=GiB // 2, freed=GiB, before=3 * GiB,
                           name='NVIDIA <Fake> & "GPU"\x01')),
    ]
    text = plot.svg(_data(records))
    assert "&lt;Fake&gt; &amp; &quot;GPU&quot;" in text and "<Fake>" not in text and "\x01" not in text
    root = ET.fromstring(text)  # valid XML
    assert root.tag == SVG_NS + "svg"
    devices = root.findall(f"{SVG_NS}g[@class='device']")
    assert len(devices) == 1
    title = devices[0].find(f"{SVG_NS}text[@class='title']").text
    assert title == 'GPU0 <Fake> & "GPU"\ufffd · 80.0 GiB total'
    series = devices[0].findall(f"{SVG_NS}g[@class='series']")
    assert [g.get("data-series") for g in series] == ["used_bytes", "live_bytes", "cached_bytes", "outside_bytes"]
    assert [len(g.findall(f"{SVG_NS}polyline")) for g in series] == [1, 1, 1, 1]
    assert [len(g.find(f"{SVG_NS}polyline").get("points").split()) for g in series] == [2, 2, 2, 2]
    freed = devices[0].find(f"{SVG_NS}g[@class='freed']")
    markers = freed.findall(f"{SVG_NS}path")
    assert [m.find(f"{SVG_NS}title").text for m in markers] == ["cell [2]: freed 1.0 GiB"]
    assert [t.text for t in freed.findall(f"{SVG_NS}text")] == ["1.0 GiB"]
    assert devices[0].find(f"{SVG_NS}text[@class='ylabel']").text == "GiB"
    legend = [t.text for t in root.find(f"{SVG_NS}g[@class='legend']").findall(f"{SVG_NS}text")]
    assert legend == ["used (after cleanup)", "live", "cached", "outside every pool", plot.FREED_LABEL]


def test_svg_breaks_a_line_where_a_value_is_unknown_and_marks_drains():
    root = ET.fromstring(plot.svg(_data()))
    series = {g.get("data-series"): g for g in root.iter(f"{SVG_NS}g") if g.get("class") == "series"}
    outside = series["outside_bytes"].findall(f"{SVG_NS}polyline")
    assert [len(p.get("points").split()) for p in outside] == [3]  # the last point is unknown: not drawn
    drains = [g for g in root.iter(f"{SVG_NS}g") if g.get("class") == "drains"]
    assert len(drains) == 1 and len(drains[0].findall(f"{SVG_NS}line")) == 1
    titles = [p.find(f"{SVG_NS}title").text for g in root.iter(f"{SVG_NS}g") if g.get("class") == "freed"
              for p in g.findall(f"{SVG_NS}path")]
    assert titles == ["cell [2]: freed 1.0 GiB", "%gpumem --drain: freed 512 MiB"]


# ------------------------------------------------------------------ text


def test_sparklines_of_a_small_session():
    assert plot.sparklines(_data()) == "\n".join([
        "GPU0 H100 · 80.0 GiB total · cells [1]–[3], 1 drain · scale 0–4.0 GiB",
        "  used     ▃▆▅█  min 1.0 GiB, max 4.0 GiB",
        "  live     ▁▅▅▆  min 0 B, max 3.0 GiB",
        "  cached   ▁▂▁▂  min 0 B, max 512 MiB",
        "  outside  ▂▂▂   min 512 MiB, max 512 MiB",
        "  freed    ·▃▂·  1.5 GiB in 2 cleanups, most 1.0 GiB in [2]",
    ])


def test_sparklines_share_marks_past_the_width():
    records = [_record(i, _device(used=i * MiB, outside=MiB, freed=MiB if i % 2 and i <= 60 else 0)) for i in range(1, 121)]
    text = plot.sparklines(_data(records), width=60)
    lines = text.splitlines()
    assert lines[0] == "GPU0 H100 · 80.0 GiB total · cells [1]–[120] · scale 0–120 MiB · each mark: 2 records"
    used = lines[1].split()[1]
    assert len(used) == 60 and used[-1] == "█"
    # a pair's sum, on the freed line's own scale: 1 MiB in each of the first 30 pairs, nothing after
    assert lines[-1] == "  freed    " + "█" * 30 + "·" * 30 + ("  30 MiB in 30 cleanups, most 1.0 MiB in [1]; "
                                                            "scale 0–1.0 MiB a mark")


def test_nothing_recorded_says_so_in_one_line():
    shown = plot.TimelinePlot([])
    assert shown.text() == plot.EMPTY == ("gpucleanup · nothing to plot yet: a record is made as each cell ends (this "
                                          "cell's comes after it), so %gpumem --plot draws from the next cell on")
    assert shown._repr_png_() is None and shown._repr_svg_() is None
    data, _ = DisplayFormatter().format(shown)
    assert data == {"text/plain": plot.EMPTY}
    with pytest.raises(ValueError, match="no point"):
        plot.figure(timeline.series([]))


# ------------------------------------------------------------------ what the frontend gets


def test_rich_frontends_get_the_png_and_the_text():
    data, metadata = DisplayFormatter().format(plot.TimelinePlot(_session()))
    assert set(data) == {"text/plain", "image/png"}
    assert data["text/plain"] == plot.sparklines(_data())
    assert metadata["image/png"] == {"width": 900, "height": 330}


def test_a_text_only_frontend_never_draws_the_image(monkeypatch):
    # the terminal IPython activates only text/plain (TerminalInteractiveShell.init_display_formatter)
    drawn = []
    monkeypatch.setattr(plot, "png", lambda data: drawn.append(data))
    data, _ = DisplayFormatter(active_types=["text/plain"]).format(plot.TimelinePlot(_session()))
    assert data == {"text/plain": plot.sparklines(_data())}
    assert drawn == []


def test_svg_when_matplotlib_is_not_importable(monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    data, _ = DisplayFormatter().format(plot.TimelinePlot(_session()))
    assert set(data) == {"text/plain", "image/svg+xml"}
    assert ET.fromstring(data["image/svg+xml"]).tag == SVG_NS + "svg"


def test_plot_in_a_shell_without_matplotlib_shows_the_svg(shell, fake_cupy, fake_cuda, capsys, monkeypatch):  # noqa: F811
    _fake_session(shell, fake_cuda, fake_cupy, capsys)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with capture_output() as cap:
        shell.run_line_magic("gpumem", "--plot")
    (shown,) = cap.outputs
    assert set(shown.data) == {"text/plain", "image/svg+xml"}
    root = ET.fromstring(shown.data["image/svg+xml"])
    assert len([g for g in root.iter(f"{SVG_NS}g") if g.get("class") == "series"]) == 4


def test_svg_when_matplotlib_fails_to_draw(monkeypatch):
    def broken(_data):
        raise RuntimeError("latex was not found")

    monkeypatch.setattr(plot, "png", broken)
    shown = plot.TimelinePlot(_session())
    data, _ = DisplayFormatter().format(shown)
    assert set(data) == {"text/plain", "image/svg+xml"}
    assert shown.png_error == "RuntimeError: latex was not found"


# ------------------------------------------------------------------ %gpumem --plot


@pytest.mark.parametrize(
    "line, message",
    [
        ("--plot 0", "%gpumem: --plot N needs N >= 1, got 0."),
        ("--plot -3", "%gpumem: --plot N needs N >= 1, got -3."),
        ("--plot --drain", "%gpumem: --plot goes alone (or with --json), not with --drain: run them one after the other."),
        ("--plot 5 --history 2", "%gpumem: --plot goes alone (or with --json), not with --history"),
        ("--plot --off", "%gpumem: --plot goes alone (or with --json), not with --off"),
        ("--plot ten", "%gpumem: argument --plot: invalid int value: 'ten'."),
    ],
)
def test_plot_argument_errors(shell, real, fake_cuda, line, message):  # noqa: F811
    shell.run_line_magic("load_ext", "gpucleanup")
    with pytest.raises(UsageError) as raised:
        shell.run_line_magic("gpumem", line)
    assert str(raised.value).startswith(message)
    assert "Usage: %gpumem" in str(raised.value) and "[--plot [N]]" in str(raised.value)


def test_plot_is_in_the_magics_help(shell, real, fake_cuda):  # noqa: F811
    shell.run_line_magic("load_ext", "gpucleanup")
    doc = shell.find_line_magic("gpumem").__doc__
    assert "[--plot [N]]" in doc
    help_text = " ".join(doc[doc.index("  --plot [N]"):].split())  # argparse wraps the help's lines
    assert help_text.startswith("--plot [N] Device memory over the last N cells (default: every record kept")
    assert "terminals one text sparkline per series. With --json: the timeline's data with exact bytes." in help_text


def test_plot_before_any_gpu_use_says_so(shell, real, fake_cuda):  # noqa: F811
    shell.run_line_magic("load_ext", "gpucleanup")
    with capture_output() as cap:
        value = shell.run_line_magic("gpumem", "--plot")
    assert value is None
    assert [o.data for o in cap.outputs] == [{"text/plain": plot.EMPTY}]


class FakeDriverCupy(StandInAdapter):
    """A CuPy-like adapter whose pool lives in the fake driver's device memory: what it holds is
    used on the device, and what its drain frees comes back to the driver's free bytes."""

    def __init__(self, fake_cuda):
        super().__init__("cupy", native=None)
        self.fake = fake_cuda

    def _free_bytes(self, delta):
        free = self.fake.state()["devices"][0]["free_bytes"]
        self.fake.update({"devices": [{"free_bytes": free + delta}]})

    def allocate(self, live=0, cached=0):
        self.live[0] = self.live.get(0, 0) + live
        self.cached[0] = self.cached.get(0, 0) + cached
        self._free_bytes(-(live + cached))

    def release(self, live):
        """``del`` of arrays: their blocks go back to the pool's cache, still used on the device."""
        self.live[0] -= live
        self.cached[0] = self.cached.get(0, 0) + live

    def drain(self, devices):
        self._call("drain")
        freed = {}
        for i in devices:
            n = self.cached.pop(i, 0)
            if n:
                freed[i] = n
                self._free_bytes(n)
        return {"freed_bytes": freed, "notes": []}


@pytest.fixture
def fake_cupy(fake_cuda, monkeypatch):
    """The real libgpucleanup over the fake driver, with a CuPy-like adapter whose memory the fake counts."""
    cupy = FakeDriverCupy(fake_cuda)
    monkeypatch.setattr(gpucleanup.frameworks, "active", lambda: [cupy])
    monkeypatch.setattr(gpucleanup.in_kernel.status_endpoint, "StatusEndpoint", lambda: StandInEndpoint())
    return cupy


def _fake_session(shell, fake_cuda, cupy, capsys):  # noqa: F811
    """Three cells and a drain over the fake driver (a 512 MiB context at the start); the cells' numbers."""
    fake_cuda.reset({"devices": [{"name": "Fake H100", "primary_active": True}]})
    shell.run_line_magic("config", "GPUCleanup.release = 'cell'")  # each cell's frees on its own record
    shell.run_line_magic("load_ext", "gpucleanup")
    cupy.allocate(live=2 * GiB, cached=512 * MiB)  # arrays kept, temporaries left in the pool
    first, _ = _run(shell, "x = 1", capsys)
    cupy.allocate(live=GiB, cached=GiB)
    fake_cuda.update({"devices": [{"free_bytes": fake_cuda.state()["devices"][0]["free_bytes"] - 2 * GiB,
                                   "default_pool": {"reserved_bytes": GiB, "used_bytes": 0}}]})  # 1 GiB raw + 1 GiB pool
    second, _ = _run(shell, "x = 2", capsys)
    cupy.release(2 * GiB)  # del of the first arrays
    shell.run_line_magic("gpumem", "--drain")
    # nothing changed since the drain: an idle cell, which adds no record unless every cell is shown
    shell.run_line_magic("config", "GPUCleanup.show = 'always'")
    third, _ = _run(shell, "x = 3", capsys)
    capsys.readouterr()
    return first.execution_count, second.execution_count, third.execution_count


def test_plot_in_a_shell_over_the_fake_driver(shell, fake_cupy, fake_cuda, capsys):  # noqa: F811
    first, second, third = _fake_session(shell, fake_cuda, fake_cupy, capsys)
    with capture_output() as cap:
        value = shell.run_line_magic("gpumem", "--plot")
    assert value is None  # displayed, not returned: nothing lands in Out / _
    assert len(cap.outputs) == 1
    shown = cap.outputs[0]
    assert shown.data["image/png"][:8] == PNG_MAGIC  # IPython's capture keeps the bytes as they came
    assert shown.data["text/plain"] == "\n".join([
        f"GPU0 {_fake_name()} · 80.0 GiB total · cells [{first}]–[{third}], 1 drain · scale 0–4.5 GiB",
        "  used     ▅█▅▅  min 2.5 GiB, max 4.5 GiB",
        "  live     ▄▆▃▃  min 1.0 GiB, max 3.0 GiB",
        "  cached   ▁▁▁▁  min 0 B, max 0 B",
        "  outside  ▂▃▃▃  min 512 MiB, max 1.5 GiB",
        f"  freed    ▂▄▄·  4.5 GiB in 3 cleanups, most 2.0 GiB in [{second}]",
    ])


def test_plot_json_in_a_shell_over_the_fake_driver(shell, fake_cupy, fake_cuda, capsys):  # noqa: F811
    first, second, third = _fake_session(shell, fake_cuda, fake_cupy, capsys)
    data = shell.run_line_magic("gpumem", "--plot --json")
    assert isinstance(data, dict) and data["timeline"] == timeline.VERSION and data["cells"] == 4
    (device,) = data["devices"]
    assert device["index"] == 0 and device["total_bytes"] == 80 * GiB
    fields = ("cell", "used_before_bytes", "used_bytes", "live_bytes", "cached_bytes", "outside_bytes", "freed_bytes")
    assert [tuple(p[f] for f in fields) for p in device["points"]] == [
        (first, 3 * GiB, 2560 * MiB, 2 * GiB, 0, 512 * MiB, 512 * MiB),  # context 512 MiB + 2 GiB of arrays kept
        (second, 6656 * MiB, 4608 * MiB, 3 * GiB, 0, 1536 * MiB, 2 * GiB),  # + 1 GiB raw: outside every pool
        (None, 4608 * MiB, 2560 * MiB, GiB, 0, 1536 * MiB, 2 * GiB),  # the drain after del
        (third, 2560 * MiB, 2560 * MiB, GiB, 0, 1536 * MiB, 0),
    ]
    assert json.loads(repr(data)) == json.loads(json.dumps(data))  # shown as its JSON text
    last = shell.run_line_magic("gpumem", "--plot 2 --json")
    assert [p["cell"] for p in last["devices"][0]["points"]] == [None, third]


def test_drains_are_labelled_by_what_asked_for_them():
    magic, outside, cell = {"cell": None}, {"cell": None, "source": "outside"}, {"cell": 3}
    assert plot.drains_label([cell, magic]) == "%gpumem --drain"
    assert plot.drains_label([cell, outside]) == "drain from outside"
    assert plot.drains_label([magic, outside]) == "%gpumem --drain or drain from outside"
    from gpucleanup.records import timeline

    record = {"cell": None, "source": "outside", "time_ns": 1,
              "devices": [{"index": 0, "used_after_bytes": 1 << 30, "freed_bytes": {"cupy": 1 << 20}}]}
    [point] = timeline.series([record])["devices"][0]["points"]
    assert point["source"] == "outside" and point["cell"] is None
