"""%gpumem: tables (text and HTML), --json, --drain, --history, --vars, --off/--on, wrong flags."""

from __future__ import annotations

import sys
import types

import pytest
from IPython.core.error import UsageError
from IPython.utils.capture import capture_output

import gpucleanup
import gpucleanup._native  # noqa: F401  (the package attribute a stand-in replaces)
import gpucleanup.frameworks
import gpucleanup.in_kernel.status_endpoint
from gpucleanup.in_kernel import extension, magics
from gpucleanup.frameworks import objects
from shell_stand_ins import StandInAdapter, StandInEndpoint, StandInNative, _lines, shell  # noqa: F401  (fixture)
from support import GiB, MiB


@pytest.fixture
def stand_in(monkeypatch):
    """The stand-ins of test_extension.py; as there, a cell's caches given back as it ends (release "cell")."""
    from IPython.core.interactiveshell import InteractiveShell

    monkeypatch.setitem(InteractiveShell.instance().config.GPUCleanup, "release", "cell")
    native = StandInNative()
    cupy = StandInAdapter("cupy", native, live={0: 2 * GiB}, cached={0: 512 * MiB}, pinned_cached=GiB)
    native.device(0).used += 2 * GiB + 512 * MiB
    monkeypatch.setattr(gpucleanup, "_native", native)
    monkeypatch.setattr(gpucleanup.frameworks, "active", lambda: [cupy])
    monkeypatch.setattr(gpucleanup.in_kernel.status_endpoint, "StatusEndpoint", lambda: StandInEndpoint())
    return types.SimpleNamespace(native=native, cupy=cupy)


def _display(ip, line):
    with capture_output() as cap:
        value = ip.run_line_magic("gpumem", line)
    return value, cap


def test_gpumem_text_table_stand_in(shell, stand_in):  # noqa: F811
    shell.run_line_magic("load_ext", "gpucleanup")
    value, cap = _display(shell, "")
    assert value is None  # displayed, not returned: nothing lands in Out / _
    assert len(cap.outputs) == 1
    text = cap.outputs[0].data["text/plain"]
    assert text.splitlines() == [
        "GPU0 H100 — 4.5/80.0 GiB used",
        "                              live / used  cached / reserved",
        "----------------------------  -----------  -----------------",
        "total                            80.0 GiB",
        "used (device, all processes)      4.5 GiB",
        "cupy                              2.0 GiB            512 MiB",
        "driver pool (default)                 0 B            1.0 GiB",
        "outside every pool                1.0 GiB",
        "  frameworks: live (held by objects) / cached (freeable); driver pools: used / reserved.",
        "  outside every pool = device used - everything known: the CUDA context (~500 MiB), other processes on this GPU and raw allocations are in it.",
        "",
        "pinned host memory pools",
        "      live   cached",
        "----  ----  -------",
        "cupy   0 B  1.0 GiB",
    ]


def test_gpumem_gives_rich_frontends_html_stand_in(shell, stand_in):  # noqa: F811
    shell.run_line_magic("load_ext", "gpucleanup")
    _, cap = _display(shell, "")
    html = cap.outputs[0].data["text/html"]
    assert html.startswith("<div class='gpucleanup-report'><table")
    assert "<td style='text-align:left'>outside every pool</td><td style='text-align:right'>1.0 GiB</td>" in html


def test_gpumem_json_has_exact_bytes_stand_in(shell, stand_in):  # noqa: F811
    shell.run_line_magic("load_ext", "gpucleanup")
    data = shell.run_line_magic("gpumem", "--json")
    assert isinstance(data, dict)
    dev = data["devices"][0]
    assert dev["total_bytes"] == 80 * GiB
    assert dev["used_bytes"] == 4 * GiB + 512 * MiB
    assert dev["frameworks"] == {"cupy": {"live_bytes": 2 * GiB, "cached_bytes": 512 * MiB}}
    assert dev["outside_bytes"] == GiB
    assert data["pinned"] == {"cupy": {"live_bytes": 0, "cached_bytes": GiB}}
    assert data["frameworks"] == {"cupy": "cupy stand-in"}
    import json

    assert json.loads(repr(data))["devices"][0]["total_bytes"] == 80 * GiB


def test_gpumem_drain_cleans_now_and_prints_the_line_stand_in(shell, stand_in, capsys):  # noqa: F811
    shell.run_line_magic("load_ext", "gpucleanup")
    shell.run_line_magic("gpumem", "--drain")
    assert _lines(capsys.readouterr().out) == [
        "gpucleanup · GPU0 H100 · freed 1.5 GiB (driver 1.0, cupy 0.5) · pinned 1.0 GiB · kept 2.0 GiB live (cupy) · device 3.0/80.0 GiB · <t>"
    ]
    shell.run_line_magic("gpumem", "--drain")  # printed even when nothing changed
    assert _lines(capsys.readouterr().out) == ["gpucleanup · GPU0 H100 · freed 0 B · kept 2.0 GiB live (cupy) · device 3.0/80.0 GiB · <t>"]


def test_gpumem_history_n_stand_in(shell, stand_in, capsys):  # noqa: F811
    shell.run_line_magic("load_ext", "gpucleanup")
    for i in range(3):
        stand_in.cupy.live[0] += 64 * MiB  # each cell allocates: none is an idle cell (those add no record)
        stand_in.native.device(0).used += 64 * MiB
        shell.run_cell(f"x = {i}", store_history=True)
    _, cap = _display(shell, "--history 2")
    lines = cap.outputs[0].data["text/plain"].splitlines()
    assert lines[0] == "last 2 cells"
    assert len(lines) == 5
    data = shell.run_line_magic("gpumem", "--json --history 3")
    assert len(data["history"]) == 3 and data["history"][0]["devices"][0]["freed_bytes"] == {"cupy": 512 * MiB, "driver": GiB}


def test_gpumem_history_when_empty_stand_in(shell, stand_in):  # noqa: F811
    shell.run_line_magic("load_ext", "gpucleanup")
    _, cap = _display(shell, "--history")
    assert cap.outputs[0].data["text/plain"] == "gpucleanup · no cell recorded yet"


class _Device:
    def __init__(self, index):
        self.id = index
        self.index = index


def _fake_cupy_ndarray():
    cls = type("ndarray", (), {})
    cls.__module__ = "cupy._core.core"
    return cls


def test_gpumem_vars_lists_the_largest_gpu_objects_by_name_stand_in(shell, stand_in, monkeypatch):  # noqa: F811
    ndarray = _fake_cupy_ndarray()

    def array(shape, nbytes, dtype="float32"):
        a = ndarray()
        a.shape, a.nbytes, a.dtype, a.device = shape, nbytes, dtype, _Device(0)
        return a

    class Tensor:
        pass

    Tensor.__module__ = "torch"
    torch = types.ModuleType("torch")
    torch.Tensor = Tensor
    monkeypatch.setitem(sys.modules, "torch", torch)

    def tensor(shape, is_cuda=True):
        t = Tensor()
        t.shape, t.is_cuda, t.device, t.dtype = shape, is_cuda, _Device(1), "torch.float16"
        t.element_size = lambda: 2
        t.nelement = lambda: shape[0] * shape[1]
        return t

    class Model:
        pass

    model = Model()
    model.__dict__["_parameters"] = {"weight": tensor((1024, 1024))}
    big = array((4096, 4096), 64 * MiB)
    shell.user_ns.update(x=big, y=[array((10,), 40)], z={"m": model, "cpu": tensor((8, 8), is_cuda=False)}, alias=big)
    try:
        shell.run_line_magic("load_ext", "gpucleanup")
        _, cap = _display(shell, "--vars")
        assert cap.outputs[0].data["text/plain"].splitlines() == [
            "GPU arrays and tensors the kernel keeps",
            "name           held by   type          shape      dtype    device    bytes",
            "-------------  --------  ------------  ---------  -------  ------  -------",
            "x              variable  cupy.ndarray  4096×4096  float32  GPU0     64 MiB",
            "z['m'].weight  variable  torch.Tensor  1024×1024  float16  GPU1    2.0 MiB",
            "y[0]           variable  cupy.ndarray  10         float32  GPU0       40 B",
            "  3 objects, 66 MiB in all; views of one buffer each count their own size.",
        ]
        data = shell.run_line_magic("gpumem", "--json --vars 1")
        assert data["vars"] == [{"kind": "cupy.ndarray", "shape": [4096, 4096], "dtype": "float32", "device": "GPU0", "bytes": 64 * MiB, "name": "x",
                                 "held_by": "variable"}]
    finally:
        for name in ("alias",):
            shell.user_ns.pop(name, None)


def test_gpumem_vars_never_imports_a_framework(shell, stand_in):  # noqa: F811
    before = set(sys.modules)
    objects.find_gpu_objects({"a": 1, "b": [object()], "c": {"d": "e"}})
    assert {m for m in set(sys.modules) - before if m.split(".")[0] in ("cupy", "torch", "jax", "numba")} == set()


def test_gpumem_off_and_on_pause_the_automatic_cleanup_stand_in(shell, stand_in, capsys):  # noqa: F811
    shell.run_line_magic("load_ext", "gpucleanup")
    shell.run_line_magic("gpumem", "--off")
    assert capsys.readouterr().out == "gpucleanup · automatic cleanup paused (%gpumem --on resumes it)\n"
    stand_in.native.calls.clear()
    shell.run_cell("x = 1", store_history=True)
    assert stand_in.native.calls == {}
    _, cap = _display(shell, "")
    assert "automatic cleanup is off (%gpumem --on resumes it)" in cap.outputs[0].data["text/plain"]
    shell.run_line_magic("gpumem", "--on")
    assert capsys.readouterr().out == "gpucleanup · automatic cleanup resumed\n"
    shell.run_cell("x = 2", store_history=True)
    assert (stand_in.native.calls["after_cell"], stand_in.native.calls["trim"]) == (1, 1)  # the pass, the trim after cupy


def test_gpumem_on_cell_prints_no_line_when_nothing_was_freed(shell, fake_cuda, capsys):
    # The cell that runs %gpumem --on had no snapshot from before it (paused then):
    # with nothing freed and nothing wrong, the default "auto" mode stays quiet.
    fake_cuda.reset({"devices": [{"uuid": "GPU-0f0f0000-0000-0000-0000-0000000000aa", "primary_active": True}]})
    shell.run_line_magic("load_ext", "gpucleanup")
    shell.run_cell("%gpumem --off", store_history=True)
    capsys.readouterr()
    shell.run_cell("%gpumem --on", store_history=True)
    assert capsys.readouterr().out == "gpucleanup · automatic cleanup resumed\n"


@pytest.mark.parametrize(
    "line, message",
    [
        ("--jsn", "%gpumem: unrecognized arguments: --jsn. Did you mean --json? Usage: %gpumem [--json] [--drain] [--history [N]] [--vars [N]] [--release out|traceback|NAME] [--trace [on|off]] [--dask [on|off]] [--plot [N]] [--off | --on] [--park] (details: %gpumem?)"),
        ("--hist 3", "Did you mean --history?"),
        ("--off --on", "%gpumem: --off and --on contradict each other: pass one of them."),
        ("--history 0", "%gpumem: --history N needs N >= 1, got 0."),
        ("--vars many", "argument --vars: invalid int value: 'many'"),
        ("extra", "unrecognized arguments: extra"),
    ],
)
def test_gpumem_wrong_flag_raises_usage_error_with_the_fix_stand_in(shell, stand_in, line, message):  # noqa: F811
    shell.run_line_magic("load_ext", "gpucleanup")
    with pytest.raises(UsageError) as err:
        shell.run_line_magic("gpumem", line)
    assert message in str(err.value)


def test_gpumem_help_documents_every_option_stand_in(shell, stand_in):  # noqa: F811
    shell.run_line_magic("load_ext", "gpucleanup")
    doc = shell.find_line_magic("gpumem").__doc__
    for option in ("--json", "--drain", "--history", "--vars", "--off", "--on", "outside every", "%config GPUCleanup"):
        assert option in doc
    assert "--trace" in doc and "CUPTI" in doc
    assert ("::\n\n  %gpumem [--json] [--drain] [--history [N]] [--vars [N]] [--release WHAT]\n"
            "              [--trace [on|off]] [--dask [on|off]] [--plot [N]] [--park]\n"
            "              [--off] [--on]") in doc
    assert "--park" in doc and "host memory" in doc


def test_gpumem_help_reads_as_the_usage_line_and_is_dedented():
    from gpucleanup.in_kernel.extension import GPUCleanup

    doc = GPUCleanup.gpumem.__doc__  # what %gpumem? shows
    options = doc[doc.index("options:"):].splitlines()
    assert "<" not in doc[doc.index("options:"):]  # no --history <[N]>
    assert [line.split()[:2] for line in options if line.startswith(("  --history", "  --trace", "  --plot"))] == [
        ["--history", "[N]"], ["--trace", "[on|off]"], ["--plot", "[N]"]]
    assert "\n\nWith no option, a table per device in use: total and used memory (device-wide,\nas the driver" in doc
    described = doc[doc.index("GPU memory of this kernel"):doc.index("Settings (")]
    assert not [line for line in described.splitlines() if line.startswith("    ")]  # no line keeps the source's indent


def test_gpumem_without_driver_says_so_stand_in(shell, stand_in):  # noqa: F811
    stand_in.native.state = "no_driver"
    shell.run_line_magic("load_ext", "gpucleanup")
    _, cap = _display(shell, "")
    assert cap.outputs[0].data["text/plain"] == "gpucleanup · no CUDA driver: nothing to clean"


def test_gpumem_with_the_fake_driver(shell, fake_cuda, monkeypatch):  # noqa: F811
    monkeypatch.setattr(gpucleanup.frameworks, "active", lambda: [])
    monkeypatch.setattr(gpucleanup.in_kernel.status_endpoint, "StatusEndpoint", lambda: StandInEndpoint())
    fake_cuda.reset({"devices": [{"name": "Fake H100", "primary_active": True, "default_pool": {"reserved_bytes": GiB, "used_bytes": 256 * MiB}}, {"primary_active": False}]})
    shell.run_line_magic("load_ext", "gpucleanup")
    data = shell.run_line_magic("gpumem", "--json")
    assert [d["index"] for d in data["devices"]] == [0]  # only devices in use
    dev = data["devices"][0]
    assert dev["total_bytes"] == 85899345920
    assert dev["pools"] == [{"which": "default", "reserved_bytes": GiB, "used_bytes": 256 * MiB}]
    assert dev["outside_bytes"] == 512 * MiB  # the fake's context
    _, cap = _display(shell, "")
    from shell_stand_ins import _fake_name

    assert cap.outputs[0].data["text/plain"].splitlines()[0] == f"GPU0 {_fake_name()} — 1.5/80.0 GiB used"
    assert fake_cuda.counter("contexts_created") == 0


def test_unbalanced_quote_is_a_usage_error_stand_in(shell, stand_in):  # noqa: F811
    shell.run_line_magic("load_ext", "gpucleanup")
    with pytest.raises(UsageError) as err:
        shell.run_line_magic("gpumem", '"unterminated')
    assert str(err.value) == (
        "%gpumem: cannot read the options (No closing quotation): check the quotes. "
        "Usage: %gpumem [--json] [--drain] [--history [N]] [--vars [N]] [--release out|traceback|NAME] [--trace [on|off]] [--dask [on|off]] [--plot [N]] [--off | --on] [--park]"
    )


class _Hostile:
    """A user object whose __class__ raises: isinstance() on it raises too."""

    @property
    def __class__(self):
        raise RuntimeError("do not ask me my class")


def test_an_object_whose_class_raises_does_not_break_vars_or_the_cell_stand_in(shell, stand_in, capsys):  # noqa: F811
    shell.user_ns["hostile"] = _Hostile()
    shell.user_ns["hostiles"] = [_Hostile(), {"k": _Hostile()}]
    try:
        shell.run_line_magic("load_ext", "gpucleanup")
        shell.run_cell("x = 1", store_history=True)
        assert "failed" not in capsys.readouterr().out  # no "snapshot before the cell failed"
        found = shell.run_line_magic("gpumem", "--vars --json")
        assert found["vars"] == []
        assert objects.gpu_holder_names(shell.user_ns) == {}
    finally:
        shell.user_ns.pop("hostile", None)
        shell.user_ns.pop("hostiles", None)


def test_off_without_a_driver_says_there_is_nothing_to_pause_stand_in(shell, stand_in, capsys):  # noqa: F811
    stand_in.native.state = "no_driver"
    shell.run_line_magic("load_ext", "gpucleanup")
    capsys.readouterr()
    shell.run_line_magic("gpumem", "--off")
    assert capsys.readouterr().out == "gpucleanup · no cleanup runs after cells in this kernel (no CUDA driver): nothing to pause\n"
