"""Hidden holders of GPU memory, with stand-in arrays: IPython's output cache and the last
traceback, named by %gpumem --vars and let go by %gpumem --release and release_after_oom."""

from __future__ import annotations

import gc
import sys
import weakref

import pytest
from IPython.core.error import UsageError
from IPython.utils.capture import capture_output

from gpucleanup.in_kernel import extension, holders
from shell_stand_ins import _lines, shell  # noqa: F401  (fixture)
from support import MiB
from test_magics import _Device, _fake_cupy_ndarray, stand_in  # noqa: F401

NDARRAY = _fake_cupy_ndarray()
NDARRAY.__weakref__  # noqa: B018  (instances can be watched with weakref)


def _array(nbytes: int):
    a = NDARRAY()
    a.shape, a.nbytes, a.dtype, a.device = (nbytes // 4,), nbytes, "float32", _Device(0)
    return a


class OutOfMemoryError(RuntimeError):
    """Named like torch.cuda.OutOfMemoryError and cupy.cuda.memory.OutOfMemoryError."""


@pytest.fixture
def arrays(shell):  # noqa: F811
    shell.user_ns.update(make=_array, OutOfMemoryError=OutOfMemoryError, MiB=MiB, watch=weakref.ref)
    shell.run_cell("import gc")
    yield shell
    # the shell is shared by the suite: leave no stand-in array in its output cache or last traceback
    holders.release_output_cache(shell)
    holders.release_traceback(holders.last_exception(shell))
    shell.last_execution_result = None
    for name in ("last_type", "last_value", "last_traceback", "last_exc"):
        if hasattr(sys, name):
            setattr(sys, name, None)
    for name in ("make", "OutOfMemoryError", "MiB", "watch", "probe", "fit", "w", "x"):
        shell.user_ns.pop(name, None)


def _run(shell, code):  # noqa: F811
    with capture_output() as cap:
        result = shell.run_cell(code, store_history=True)
    return result, _said(cap)


def _said(cap) -> str:
    """What the cell printed, then gpucleanup's own output (a display output of its own, never the stdout)."""
    return cap.stdout + "".join(o.data["text/plain"] + "\n" for o in cap.outputs if "gpucleanup" in (o.metadata or {}))


def _gone(shell, name: str) -> bool:
    gc.collect()
    return shell.user_ns[name]() is None


def test_a_gpu_array_left_in_the_output_cache_is_named_and_released_alone(arrays, stand_in):  # noqa: F811
    shell = arrays
    shell.run_line_magic("load_ext", "gpucleanup")
    result, _ = _run(shell, "make(64 * MiB)")
    cell = result.execution_count
    del result  # the test's own reference to the cell's result
    _run(shell, "[1, 2, 3]")  # a CPU output stays
    _run(shell, f"w = watch(Out[{cell}])")
    found = holders.output_cache_objects(shell)
    assert [(f["name"], f["held_by"], f["bytes"]) for f in found] == [(f"Out[{cell}]", "output cache", 64 * MiB)]
    assert not _gone(shell, "w")
    with capture_output() as cap:
        shell.run_line_magic("gpumem", "--release out")
    assert _lines(cap.stdout)[0] == f"gpucleanup · released Out[{cell}] from the output cache"
    assert _gone(shell, "w")
    out = shell.history_manager.output_hist
    assert cell not in out and f"_{cell}" not in shell.user_ns
    assert [1, 2, 3] in out.values()  # outputs that hold no GPU object stay


def test_an_out_of_memory_error_lets_its_frames_go_before_the_cleanup(arrays, stand_in):  # noqa: F811
    shell = arrays
    shell.run_line_magic("load_ext", "gpucleanup")
    _run(shell, "def fit():\n    batch = make(4096 * MiB)\n    probe.append(watch(batch))\n"
                "    raise OutOfMemoryError('CUDA out of memory. Tried to allocate 4.00 GiB')\nprobe = []")
    result, text = _run(shell, "fit()")
    cell = result.execution_count
    assert isinstance(result.error_in_exec, OutOfMemoryError)
    assert "OutOfMemoryError" in text  # the user's traceback is printed, untouched
    assert _lines(text)[0] == (
        f"gpucleanup · out of GPU memory in cell [{cell}]: released 4.0 GiB held by 1 variable of its traceback "
        "(2 frames; the error stays, %debug no longer shows them; %config GPUCleanup.release_after_oom = False "
        "keeps them)")
    gc.collect()
    assert shell.user_ns["probe"][0]() is None
    assert "Tried to allocate 4.00 GiB" in str(sys.last_value)  # the error itself stays


def test_without_release_after_oom_the_traceback_is_named_then_released_on_request(arrays, stand_in):  # noqa: F811
    shell = arrays
    shell.run_line_magic("load_ext", "gpucleanup")
    shell.run_line_magic("config", "GPUCleanup.release_after_oom = False")
    _run(shell, "def fit():\n    batch = make(256 * MiB)\n    probe.append(watch(batch))\n"
                "    raise OutOfMemoryError('out of memory')\nprobe = []")
    result, text = _run(shell, "fit()")
    cell = result.execution_count
    assert "released" not in text
    gc.collect()
    assert shell.user_ns["probe"][0]() is not None
    data = shell.run_line_magic("gpumem", "--json --vars")
    assert [(v["name"], v["held_by"], v["bytes"]) for v in data["vars"]] == [
        ("fit: batch", f"traceback of cell [{cell}]", 256 * MiB)]
    with capture_output() as cap:
        shell.run_line_magic("gpumem", "--release traceback")
    assert _lines(cap.stdout)[0] == ("gpucleanup · cleared 2 frames of the last traceback (1 GPU object, 256 MiB); "
                                     "%debug no longer shows their variables")
    gc.collect()
    assert shell.user_ns["probe"][0]() is None


def test_an_error_that_is_not_out_of_memory_keeps_its_frames(arrays, stand_in):  # noqa: F811
    shell = arrays
    shell.run_line_magic("load_ext", "gpucleanup")
    _run(shell, "def fit():\n    batch = make(MiB)\n    probe.append(watch(batch))\n    raise ValueError('bad shape')\n"
                "probe = []")
    _, text = _run(shell, "fit()")
    assert "released" not in text
    gc.collect()
    assert shell.user_ns["probe"][0]() is not None


def test_release_a_name_deletes_it_everywhere_ipython_keeps_it(arrays, stand_in):  # noqa: F811
    shell = arrays
    shell.run_line_magic("load_ext", "gpucleanup")
    _run(shell, "x = make(MiB)\nw = watch(x)")
    _run(shell, "x")  # now also Out[N], _N and _
    with capture_output() as cap:
        shell.run_line_magic("gpumem", "--release x")
    assert _lines(cap.stdout)[0] == "gpucleanup · deleted x and every reference IPython kept to it (as %xdel)"
    assert "x" not in shell.user_ns
    assert _gone(shell, "w")
    with pytest.raises(UsageError, match="'nosuch' is not a variable of this kernel: pass out, traceback or the name"):
        shell.run_line_magic("gpumem", "--release nosuch")
    with pytest.raises(UsageError, match="--release cleans up by itself: pass it alone"):
        shell.run_line_magic("gpumem", "--release out --drain")


def test_out_of_memory_is_told_by_type_name_message_or_chain():
    assert holders.is_out_of_memory(OutOfMemoryError("x"))
    assert holders.is_out_of_memory(RuntimeError("CUDA error: out of memory"))
    assert holders.is_out_of_memory(RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate"))
    try:
        try:
            raise OutOfMemoryError("first")
        except OutOfMemoryError:
            raise KeyError("while handling it")
    except KeyError as chained:
        assert holders.is_out_of_memory(chained)
    assert not holders.is_out_of_memory(ValueError("bad shape"))
    assert not holders.is_out_of_memory(None)


def test_the_line_names_what_a_cell_left_hidden_stand_in(arrays, stand_in):  # noqa: F811
    shell = arrays
    shell.run_line_magic("load_ext", "gpucleanup")
    shell.run_line_magic("config", "GPUCleanup.release_after_oom = False")
    shell.run_line_magic("config", "GPUCleanup.show = 'always'")
    result, text = _run(shell, "make(64 * MiB)")
    cell = result.execution_count
    [line] = _lines(text)
    assert f"kept 2.0 GiB live (cupy): Out[{cell}] 64 MiB" in line
    record = extension.get_extension(shell).history.last(1)[0]
    assert record["hidden"] == [{"held_by": f"Out[{cell}]", "name": f"Out[{cell}]", "device": "GPU0", "bytes": 64 * MiB}]
    _run(shell, "def fit():\n    batch = make(256 * MiB)\n    raise OutOfMemoryError('out of memory')")
    result, text = _run(shell, "fit()")
    cell = result.execution_count
    line = _lines(text)[-1]
    assert f"kept 2.0 GiB live (cupy): traceback of cell [{cell}] 256 MiB (fit: batch)" in line
