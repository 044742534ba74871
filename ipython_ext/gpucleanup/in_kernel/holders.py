"""Hidden holders of GPU memory: IPython's output cache and the last exception's frames.

A cell whose last expression is a tensor leaves it in ``Out[N]`` (and ``_N``, ``_``);
a cell that fails leaves every local of every frame of its traceback alive
(``sys.last_traceback``, IPython's ``last_execution_result``, the formatter used by
``%debug``). Both keep GPU memory that no variable names. This module finds GPU
arrays and tensors held that way and lets them go on request, without importing
IPython: the shell is used through its attributes (``user_ns``, ``history_manager``,
``displayhook``, ``last_execution_result``).

Frames are cleared with ``frame.clear()`` (as ``traceback.clear_frames`` does): the exception,
its message and its formatted traceback stay, the frames' local variables go, so
``%debug`` can no longer show them.
"""

from __future__ import annotations

import sys
from typing import Any, Dict, Iterator, List, Optional

from ..frameworks import ADAPTERS
from ..frameworks.objects import find_gpu_objects
from ..units import count_of, format_bytes

__all__ = [
    "held_after_cell",
    "output_cache_objects",
    "traceback_objects",
    "last_exception",
    "is_out_of_memory",
    "release_output_cache",
    "release_after_oom",
    "release_traceback",
    "variable_refusal",
]

# Bounds of a walk through frames: a deep recursion that failed has thousands.
MAX_FRAMES = 200
MAX_EXCEPTIONS = 20


def _holds_gpu(value: Any) -> List[dict]:
    return find_gpu_objects({"v": value}, max_depth=3, max_visits=2_000)


def output_cache_objects(shell: Any) -> List[dict]:
    """GPU objects held by the output cache: ``Out[N]`` entries (``_N``, ``_``, ``__``,
    ``___`` are the same objects), each ``gpu_object_info`` plus ``name`` and ``held_by``."""
    out_cache = _output_hist(shell)
    found = find_gpu_objects({}, out_cache)
    for entry in found:
        entry["held_by"] = "output cache"
    return found


def held_after_cell(shell: Any, result: Any, cell: Optional[int]) -> List[dict]:
    """What one cell just left hidden: GPU objects in its own ``Out[N]`` and in the frames of
    its error. Looks at that cell's output and traceback only (the per-cell path), each
    entry ``{"held_by", "name", "device", "bytes"}``."""
    found: List[dict] = []
    out_cache = _output_hist(shell)
    if cell is not None and cell in out_cache:
        found += find_gpu_objects({}, {cell: out_cache[cell]}, max_depth=3, max_visits=2_000)
        for entry in found:
            entry["held_by"] = f"Out[{cell}]"
    error = getattr(result, "error_in_exec", None) if result is not None else None
    if isinstance(error, BaseException):
        found += traceback_objects(error, cell, getattr(shell, "user_ns", None))
    return [{"held_by": f["held_by"], "name": f["name"], "device": f.get("device"), "bytes": int(f.get("bytes") or 0)}
            for f in found]


def _output_hist(shell: Any) -> Dict[Any, Any]:
    cache = getattr(getattr(shell, "history_manager", None), "output_hist", None)
    return cache if isinstance(cache, dict) else {}


def last_exception(shell: Any) -> Optional[BaseException]:
    """The exception whose traceback IPython keeps: the last cell's, else ``sys.last_value``."""
    result = getattr(shell, "last_execution_result", None)
    error = getattr(result, "error_in_exec", None) if result is not None else None
    if isinstance(error, BaseException):
        return error
    for name in ("last_exc", "last_value"):
        value = getattr(sys, name, None)
        if isinstance(value, BaseException):
            return value
    return None


def _chain(exc: Optional[BaseException]) -> Iterator[BaseException]:
    """The exception and those it was raised from or during, each once."""
    seen: set = set()
    todo = [exc] if exc is not None else []
    while todo and len(seen) < MAX_EXCEPTIONS:
        current = todo.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        yield current
        todo.extend([current.__cause__, current.__context__])


# Frames of the shell itself (IPython's run_code, ipykernel): their locals are the shell,
# which reaches everything; they are not the user's.
_SHELL_MODULES = ("IPython", "ipykernel", "gpucleanup")


def _frames(exc: BaseException) -> Iterator[Any]:
    """The frames of ``exc``'s traceback that ran the user's code."""
    tb = exc.__traceback__
    count = 0
    while tb is not None and count < MAX_FRAMES:
        frame = tb.tb_frame
        module = str(frame.f_globals.get("__name__") or "")
        if module.split(".", 1)[0] not in _SHELL_MODULES:
            yield frame
        tb = tb.tb_next
        count += 1


def traceback_objects(exc: Optional[BaseException], cell: Optional[int], user_ns: Optional[dict] = None) -> List[dict]:
    """GPU objects held by the local variables of ``exc``'s frames (and of the exceptions
    chained to it), each ``gpu_object_info`` plus ``name`` (``function: variable``) and
    ``held_by`` (``traceback of cell [N]``). A cell's own top-level frame is skipped:
    its locals are the user's namespace."""
    holder = f"traceback of cell [{cell}]" if cell is not None else "the last traceback"
    found: List[dict] = []
    seen: set = set()
    for error in _chain(exc):
        for frame in _frames(error):
            try:
                local_vars = frame.f_locals
            except Exception:
                continue
            if user_ns is not None and local_vars is user_ns:
                continue
            if frame.f_code.co_name == "<module>" and frame.f_globals is local_vars:
                continue
            function = frame.f_code.co_name
            for entry in find_gpu_objects(dict(local_vars), max_depth=3, max_visits=5_000):
                key = (id(frame), entry["name"])
                if key in seen:
                    continue
                seen.add(key)
                entry["name"] = f"{function}: {entry['name']}"
                entry["held_by"] = holder
                found.append(entry)
    return found


# CUDA's own words for it (the driver's, the runtime's), whichever framework raised; each framework's
# exception types and words are on its adapter (oom_types, oom_texts).
_CUDA_OOM_TEXTS = ("out of memory", "cudaerrormemoryallocation", "cuda_error_out_of_memory")


def is_out_of_memory(exc: Optional[BaseException]) -> bool:
    """An out-of-memory error of a GPU framework, or one raised while handling such an error."""
    types = {name for adapter in ADAPTERS for name in adapter.oom_types}
    texts = _CUDA_OOM_TEXTS + tuple(text for adapter in ADAPTERS for text in adapter.oom_texts)
    for error in _chain(exc):
        if type(error).__name__ in types:
            return True
        try:
            text = str(error).lower()
        except Exception:
            continue
        if any(marker in text for marker in texts):
            return True
    return False


def release_output_cache(shell: Any) -> List[str]:
    """Drops every output-cache entry that holds a GPU object: ``Out[N]``, ``_N``, and
    ``_``/``__``/``___`` where they are that object. Returns the ``Out[N]`` names dropped.
    Outputs that hold no GPU object stay."""
    out_cache = _output_hist(shell)
    user_ns = getattr(shell, "user_ns", None)
    user_ns = user_ns if isinstance(user_ns, dict) else {}
    hidden = getattr(shell, "user_ns_hidden", None)
    hidden = hidden if isinstance(hidden, dict) else {}
    displayhook = getattr(shell, "displayhook", None)
    dropped: List[str] = []
    for key, value in list(out_cache.items()):
        if not _holds_gpu(value):
            continue
        del out_cache[key]
        dropped.append(f"Out[{key}]")
        for ns in (user_ns, hidden):  # push(interactive=False) puts _N and _ in both
            if ns.get(f"_{key}") is value:
                del ns[f"_{key}"]
            for name in ("_", "__", "___"):
                if ns.get(name) is value:
                    ns[name] = ""
        for name in ("_", "__", "___"):
            if displayhook is not None and getattr(displayhook, name, None) is value:
                setattr(displayhook, name, "")
        result = getattr(shell, "last_execution_result", None)
        if result is not None and getattr(result, "result", None) is value:
            result.result = None
    return dropped


def release_after_oom(exc: Optional[BaseException], cell: Optional[int], user_ns: Optional[dict] = None) -> Optional[str]:
    """A cell's GPU out-of-memory error (``exc``): the frames of its traceback let go of the GPU objects they
    hold (the error stays); the sentence that says so, None when ``exc`` is no such error or they held none."""
    if exc is None or not is_out_of_memory(exc):
        return None
    held = traceback_objects(exc, cell, user_ns)
    if not held:
        return None
    frames = release_traceback(exc)
    total = sum(int(f.get("bytes") or 0) for f in held)
    return (f"out of GPU memory in cell [{cell}]: released {format_bytes(total)} held by "
            f"{count_of(len(held), 'variable')} of its traceback ({count_of(frames, 'frame')}; the error stays, %debug "
            "no longer shows them; %config GPUCleanup.release_after_oom = False keeps them)")


def release_traceback(exc: Optional[BaseException]) -> int:
    """Clears the local variables of every finished frame of ``exc`` and of the exceptions
    chained to it; returns the frames cleared. The exception and its text stay."""
    cleared = 0
    for error in _chain(exc):
        for frame in _frames(error):
            try:
                frame.clear()
            except RuntimeError:  # still running (the frame of the code asking): left as it is
                continue
            try:
                # Python 3.11 and 3.12 keep the dict an earlier f_locals made (ours included);
                # reading it again drops from it what clear() took away
                frame.f_locals
            except Exception:
                pass
            cleared += 1
    return cleared


# Values that hold no GPU memory and that many names may share (small ints, interned strings,
# None, True): deleting "every reference IPython keeps" to one of them deletes unrelated variables.
_SHARED_VALUES = (bool, int, float, complex, str, bytes, type(None), type(Ellipsis), type(NotImplemented))


def variable_refusal(shell: Any, name: str) -> Optional[str]:
    """Why ``%gpumem --release NAME`` must leave ``name`` alone, or None when it may delete it (as %xdel).

    Refused: a name that is not in the user namespace; Python's own names (``__builtins__``, ...);
    IPython's own (``In``, ``Out``, ``_oh``, ... while they still hold what IPython put there); a value
    that holds no GPU memory and may be shared by other names (None, a number, a string), whose
    deletion by identity would delete those names too.
    """
    namespace = getattr(shell, "user_ns", None) or {}
    if name not in namespace:
        return f"{name!r} is not a variable of this kernel"
    if name.startswith("__") and name.endswith("__"):
        return f"{name} is Python's own, not a variable that holds GPU memory"
    hidden = getattr(shell, "user_ns_hidden", None) or {}
    value = namespace[name]
    if name in hidden and hidden[name] is value:
        return f"{name} is IPython's own (for GPU arrays in the output cache pass out)"
    if isinstance(value, _SHARED_VALUES):
        try:
            shown = repr(value) if not isinstance(value, (str, bytes)) else repr(value[:40])
        except ValueError:  # an int too long to convert
            shown = "..."
        shown = shown if len(shown) <= 40 else shown[:37] + "..."
        return (f"{name} is {type(value).__name__} {shown}, which holds no GPU memory (deleting it by identity "
                "would delete every other name bound to the same object)")
    return None


def kept_objects(shell: Any) -> List[dict]:
    """The GPU objects the kernel keeps (``%gpumem --vars``): through variables, the output cache and the last
    traceback, most memory first."""
    found = find_gpu_objects(shell.user_ns)
    for entry in found:
        entry["held_by"] = "variable"
    found += output_cache_objects(shell)
    error = last_exception(shell)
    result = getattr(shell, "last_execution_result", None)
    cell = getattr(result, "execution_count", None) if getattr(result, "error_in_exec", None) is error else None
    found += traceback_objects(error, cell, shell.user_ns)
    return sorted(found, key=lambda f: -int(f.get("bytes") or 0))


def release(shell: Any, what: str) -> str:
    """``%gpumem --release out|traceback|NAME``: lets go of what the kernel keeps there; the sentence that says
    what was let go. Raises ValueError, with why, for a name that is no variable holding GPU memory."""
    if what == "out":
        dropped = release_output_cache(shell)
        return (f"released {', '.join(dropped)} from the output cache" if dropped
                else "no output-cache entry holds a GPU array or tensor")
    if what == "traceback":
        error = last_exception(shell)
        if error is None:
            return "there is no last traceback"
        held = traceback_objects(error, None, shell.user_ns)
        frames = release_traceback(error)
        return (f"cleared {count_of(frames, 'frame')} of the last traceback ({count_of(len(held), 'GPU object')}, "
                f"{format_bytes(sum(int(f.get('bytes') or 0) for f in held))}); %debug no longer shows their variables")
    refused = variable_refusal(shell, what)
    if refused is not None:
        raise ValueError(refused)
    shell.del_var(what, by_name=False)
    return f"deleted {what} and every reference IPython kept to it (as %xdel)"
