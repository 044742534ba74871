"""What a newcomer reads: help made from the settings themselves, refusals as plain sentences, advice that can be
followed on the machine at hand, and a command line that helps when called bare or wrongly."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
from IPython.core.interactiveshell import InteractiveShell
from IPython.utils.capture import capture_output

from gpucleanup.outside import cli
from gpucleanup.in_kernel import extension
from gpucleanup.protocol import status_client
from gpucleanup import units
from gpucleanup.in_kernel.config import GPUCleanupOptions

TRAITS = sorted(GPUCleanupOptions.class_trait_names(config=True))


@pytest.fixture
def shell(fake_cuda):
    """The process's shell with gpucleanup loaded on the fake driver (one device in use)."""
    fake_cuda.reset({"devices": [{"primary_active": True}]})
    ip = InteractiveShell.instance()
    ip.config.pop("GPUCleanup", None)
    with capture_output():
        ip.run_line_magic("load_ext", "gpucleanup")
    yield ip
    ip.extension_manager.unload_extension("gpucleanup")
    ip.config.pop("GPUCleanup", None)


def _ipython(tmp_path, *args, **env) -> subprocess.CompletedProcess:
    """``ipython --quick ARGS`` in a process of its own (the driver is loaded once per process)."""
    full = {k: v for k, v in os.environ.items() if not k.startswith(("GPUCLEANUP_", "JPY_"))}
    full.update(IPYTHONDIR=str(tmp_path / "ipython"), JUPYTER_RUNTIME_DIR=str(tmp_path / "runtime"), **env)
    return subprocess.run([sys.executable, "-m", "IPython", "--quick", *args], capture_output=True, text=True,
                          timeout=120, env=full, cwd=tmp_path)


def test_there_are_sixteen_settings_and_the_gpumem_help_names_each_with_its_default():
    assert len(TRAITS) == 16
    doc = extension.GPUCleanup.gpumem.__doc__
    assert "Settings (16): %config GPUCleanup.<name> = value at run time" in doc
    defaults = GPUCleanupOptions.class_traits(config=True)
    for name in TRAITS:
        assert f"\n  {name} = {defaults[name].default()!r} " in doc, name


def test_config_help_uses_the_sections_name_and_public_type_names(shell, capsys):
    shell.run_line_magic("config", "GPUCleanup")
    text = capsys.readouterr().out
    lines = text.splitlines()
    assert lines[:2] == ["GPUCleanup options", "=" * len("GPUCleanup options")]
    for name in TRAITS:
        assert f"GPUCleanup.{name}=" in text
    for private in ("Magics", "GPUCleanupOptions", "<_Int>", "<_Float>"):
        assert private not in text
    assert "GPUCleanup.history_size=<Int>" in text and "GPUCleanup.settle_timeout=<Float>" in text


NO_DRIVER_SAYS = {
    "--trace on": "allocation trace not started: no CUDA driver in this kernel, so there are no GPU allocations to "
                  "trace",
    "--trace": "the allocation trace is off: no CUDA driver in this kernel, so there are no GPU allocations to trace",
    "--plot": "nothing to plot: no CUDA driver in this kernel, so no cell is cleaned up or recorded",
    "--plot 5": "nothing to plot: no CUDA driver in this kernel, so no cell is cleaned up or recorded",
    "--history": "no cell recorded: no CUDA driver in this kernel, so no cleanup runs after cells",
}


def test_without_a_driver_the_magic_says_why_there_is_nothing_instead_of_advice(tmp_path):
    code = ["%load_ext gpucleanup"]
    for line in NO_DRIVER_SAYS:
        code += ["print('>>>')", f"r = get_ipython().run_line_magic('gpumem', {line!r})", "print('result', r)"]
    code += ["print('>>>')", "d = %gpumem --history --json", "print(d['history'], d['devices'], d['driver']['state'])"]
    done = _ipython(tmp_path, "-c", "\n".join(code), GPUCLEANUP_LIBCUDA=str(tmp_path / "no-libcuda.so.1"))
    assert (done.returncode, done.stderr) == (0, "")
    blocks = done.stdout.split(">>>\n")
    assert blocks[0] == f"gpucleanup · no CUDA driver found ({tmp_path / 'no-libcuda.so.1'}): nothing to clean, " \
                        "no cleanup after cells\n"
    for said, block in zip(NO_DRIVER_SAYS.values(), blocks[1:]):
        assert block.splitlines() == [f"gpucleanup · {said}", "result None"]
    # data is still data: --json answers with an empty history rather than a sentence
    assert blocks[-1] == "[] [] no_driver\n"
    assert "then try again" not in done.stdout and "run a cell" not in done.stdout


def test_command_line_config_values_are_read_as_the_trait_reads_them(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUCLEANUP_")}
    env.update(IPYTHONDIR=str(tmp_path / "ipython"), JUPYTER_RUNTIME_DIR=str(tmp_path / "runtime"),
               GPUCLEANUP_LIBCUDA=str(tmp_path / "none"))
    code = ("%load_ext gpucleanup\nfrom gpucleanup.in_kernel.extension import get_extension\n"
            "x = get_extension(get_ipython())\nprint(x.history_size, x.gc, x.frameworks, x.settle_timeout)")
    done = subprocess.run([sys.executable, "-m", "IPython", "--quick", "--GPUCleanup.history_size=50",
                           "--GPUCleanup.gc=never", "--GPUCleanup.frameworks={'jax': False}",
                           "--GPUCleanup.settle_timeout=2.5", "-c", code],
                          capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path)
    assert done.returncode == 0 and done.stderr == ""
    assert done.stdout.splitlines()[-1] == "50 never {'jax': False} 2.5"
    assert "ignored" not in done.stdout


def _cli(*args, env=None):
    return subprocess.run([sys.executable, "-m", "gpucleanup", *args], capture_output=True, text=True, timeout=60,
                          env=env)


def test_the_cli_with_no_command_prints_its_help_and_exits_0():
    done = _cli()
    assert done.returncode == 0 and done.stderr == ""
    assert done.stdout.startswith("usage: gpucleanup ")
    for command in ("ps", "status", "watch", "drain", "exporter"):
        assert f"    {command} " in done.stdout
    assert "Exit status:" in done.stdout


def test_an_unknown_option_of_a_command_gets_that_commands_usage():
    done = _cli("watch", "--bogus")
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.startswith("usage: gpucleanup watch ")
    assert done.stderr.rstrip().endswith("gpucleanup watch: error: unrecognized arguments: --bogus")


def test_an_unknown_option_before_any_command_gets_the_top_level_usage():
    done = _cli("--bogus")
    assert done.returncode == 2
    assert done.stderr.rstrip().endswith("gpucleanup: error: unrecognized arguments: --bogus")


@pytest.mark.parametrize("label, who", [("4242", "4242"), ("", "4242"), ("analysis.ipynb", "4242 analysis.ipynb")])
def test_watch_names_a_kernel_once(label, who):
    target = status_client.Target("ipc:///nonexistent", None, label)
    message = {"kernel": {"pid": 4242}, "time_ns": time.time_ns(), "record": {"cell": 3, "elapsed_s": 0.002}}
    line = cli._record_line(target, message)
    stamp, rest = line.split("  ", 1)
    assert rest.startswith(who + "  ")
    assert rest.count("4242") == 1


def test_counts_are_said_in_the_right_number():
    assert units.count_of(1, "frame") == "1 frame"
    assert units.count_of(2, "frame") == "2 frames"
    assert units.count_of(0, "GPU object") == "0 GPU objects"


def test_the_refusal_is_a_plain_sentence_on_stderr_in_a_kernel(tmp_path):
    from test_kernel import execute, kernel

    with kernel(tmp_path, GPUCLEANUP_LIBCUDA=str(tmp_path / "none")) as kc:
        execute(kc, "%load_ext gpucleanup")
        cell = execute(kc, "%config GPUCleanup.gc = 'sometimes'")
        assert cell["stderr"] == ("GPUCleanup.gc = 'sometimes' refused: gc must be one of 'auto', 'always', 'never'. "
                                  "Nothing changed; %config GPUCleanup lists every option.\n")
        assert cell["stdout"] == "" and cell["error"] is None and cell["reply"]["status"] == "ok"
        after = execute(kc, "from gpucleanup.in_kernel.extension import get_extension; print(get_extension(get_ipython()).gc)")
        assert after["stdout"] == "auto\n"


def test_a_cell_awaited_through_run_cell_async_does_not_switch_gpucleanup_off(shell):
    import asyncio

    ext = extension.get_extension(shell)
    # IPython fires pre_run_cell inside run_cell_async, post_run_cell only from run_cell: a tool that awaits
    # run_cell_async itself leaves the count of cells under way at one.
    asyncio.run(shell.run_cell_async("a = 1", store_history=False, transformed_cell="a = 1\n"))
    assert ext.cells.depth == 1
    with capture_output() as first:
        shell.run_cell("b = 2")
    said = [line for o in first.outputs for line in o.data.get("text/plain", "").splitlines() if "run_cell_async" in line]
    assert said == ["gpucleanup · 1 cell run through run_cell_async got no post_run_cell (IPython fires it only from "
                    "run_cell): gpucleanup had counted it as still running; put right, this cell and the next are "
                    "cleaned as usual"]
    assert (ext.cells.depth, ext.cells.under_way) == (0, 0)
    with capture_output() as second:
        shell.run_cell("c = 3")
    assert not [o for o in second.outputs if "run_cell_async" in o.data.get("text/plain", "")]  # said once
    assert (ext.cells.depth, ext.cells.under_way) == (0, 0)


def test_a_cell_run_from_inside_a_cell_is_still_left_to_the_enclosing_one(shell):
    ext = extension.get_extension(shell)
    with capture_output() as out:
        shell.run_cell("%%capture inner\nx = 1")
    assert not [o for o in out.outputs if "run_cell_async" in o.data.get("text/plain", "")]
    assert (ext.cells.depth, ext.cells.under_way) == (0, 0)
    depth_inside = []
    shell.user_ns["_depth_inside"] = lambda: depth_inside.append(ext.cells.depth)
    with capture_output() as out:
        shell.run_cell("get_ipython().run_cell('_depth_inside()')")
    assert depth_inside == [2] and not [o for o in out.outputs if "run_cell_async" in o.data.get("text/plain", "")]
    assert (ext.cells.depth, ext.cells.under_way) == (0, 0)
