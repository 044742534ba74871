"""What the extension says as it loads, heard in a kernel too.

Loaded from a cell (``%load_ext gpucleanup``) its sentences are that cell's output. Loaded as a Jupyter kernel
starts (``c.InteractiveShellApp.extensions`` in ``ipython_kernel_config.py``), no request is under way: ipykernel
sends what is printed then with no parent, and no frontend shows it. So there each sentence also goes to the
kernel process's own stderr at once (the terminal or log of whoever started Jupyter), and waits for the first
cell: it comes out with that cell's output, as a display output of gpucleanup's own (like the summary line), once.
"""

from __future__ import annotations

import sys
from typing import Any, Callable, List, Optional, Tuple

from ..say import printable, say

__all__ = ["LoadNotes", "environment_notes", "no_cleanup_here", "no_hooks_reason", "probe_failure"]


class LoadNotes:
    """The sentences of one load: :meth:`say` each; :meth:`remove` as the extension unloads."""

    def __init__(self, shell: Any, show: Callable[[List[str]], None]):
        self.shell = shell
        self.show = show  # the extension's display output (GPUCleanup._say)
        self.waiting: List[str] = []  # said while no request was under way, for the first cell

    def _before_any_request(self) -> bool:
        """A kernel that serves no request now: it is starting (a cell's request sets ipykernel's parent)."""
        return getattr(self.shell, "kernel", None) is not None and not getattr(self.shell, "parent_header", None)

    def say(self, text: str) -> None:
        # one line, its control characters escaped: a value from a kernelspec's argv or a config file may carry
        # ESC, BEL or a newline, which would reach the terminal of whoever started Jupyter
        line = say(printable(text))
        print(line)  # terminal IPython, and a load from a cell: the cell's own output
        if not self._before_any_request():
            return
        try:
            stream = sys.__stderr__
            if stream is not None:
                stream.write(line + "\n")
                stream.flush()
        except (OSError, ValueError):
            pass  # a closed or broken stderr: the first cell still gets the sentence
        if not self.waiting:
            self.shell.events.register("post_run_cell", self._first_cell)
        self.waiting.append(line)

    def _first_cell(self, result: Any = None) -> None:
        """The first cell's end: the sentences said at load, once, then this hook goes."""
        lines, self.waiting = self.waiting, []
        self.remove()
        try:
            self.show(lines)
        except Exception:  # never into the user's cell
            pass

    def remove(self) -> None:
        try:
            self.shell.events.unregister("post_run_cell", self._first_cell)
        except ValueError:
            pass


#: gpucleanup's own environment variables that take a word, and the words each takes (README "Environment
#: variables"); any other value is read as the first word listed (the default)
_ENV_WORDS = {
    "GPUCLEANUP_STATUS_TRANSPORT": ("ipc", "tcp"),
    "GPUCLEANUP_NATIVE_GIL": ("hold", "release"),
    "GPUCLEANUP_TRACE_CALLER": ("1", "0"),
    "GPUCLEANUP_PARK_RESTORE_MAP": ("identity", "none"),
    "GPUCLEANUP_PARK_HOLD": ("on", "off"),
}
#: the ones that take a whole number of milliseconds: (lowest, highest, the default)
_ENV_NUMBERS = {"GPUCLEANUP_PARK_HOLD_MS": (1, 60000, 5000)}


def _shown(value: str) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def environment_notes(environ=None) -> List[str]:
    """One sentence per gpucleanup variable whose value is none of those it takes (a typo would otherwise pass
    silently, and the default be used): what was found, what it is read as, and what to set."""
    import os

    env = os.environ if environ is None else environ
    out: List[str] = []
    for name, words in _ENV_WORDS.items():
        value = env.get(name)
        # read as the code reads them: exactly, but for the transport, which is lowercased
        if value is None or value == "" or (value.lower() if name == "GPUCLEANUP_STATUS_TRANSPORT" else value) in words:
            continue
        out.append(f"{name}={_shown(value)} is not one of {', '.join(words)}: it is read as {words[0]} "
                   f"(set one of those, or unset it)")
    value = env.get("GPUCLEANUP_PARK_UNPROVEN")
    if value:
        from ..park.steps import UNPROVEN

        unknown = [n for n in (n.strip() for n in value.split(",")) if n and n not in UNPROVEN]
        if unknown:
            out.append(f"GPUCLEANUP_PARK_UNPROVEN={_shown(value)} names {_shown(', '.join(unknown))}, which is not "
                       f"among the frameworks whose parks wait for proof ({', '.join(sorted(UNPROVEN))}): ignored there")
    for name, (low, high, default) in _ENV_NUMBERS.items():
        value = env.get(name)
        if value is None or value == "":
            continue
        number = int(value) if value.isascii() and value.isdigit() else None  # digits only, as the library
        if number is None or not low <= number <= high:
            out.append(f"{name}={_shown(value)} is not a whole number of milliseconds from {low} to {high}: it is read "
                       f"as {default} (set one, or unset it)")
    return out


def no_hooks_reason(driver_state: Optional[str]) -> str:
    """Why no cleanup runs after cells, from the driver state the last probe found (no driver, no GPU, no native
    library)."""
    if driver_state == "no_driver":
        return "no CUDA driver"
    if driver_state == "unusable":
        return "the CUDA driver is unusable"
    if driver_state == "ready":
        return "no GPU on this machine"
    return "the native library could not be loaded"


def probe_failure(exc: BaseException) -> Tuple[Optional[str], str]:
    """What load says when the native library's probe raised: ``(driver state, sentence)``. A
    ``[gpucleanup.driver.*]`` error means the library loaded and the driver it found cannot be used (its message
    says why and what to do); anything else, that the library itself could not be loaded."""
    if str(exc).startswith("[gpucleanup.driver."):
        return "unusable", f"{exc}: no cleanup after cells"
    return None, (f"gpucleanup's native library could not be loaded ({type(exc).__name__}: {exc}): nothing is "
                  "cleaned after cells; reinstall gpucleanup")


def no_cleanup_here(probe: dict) -> Optional[str]:
    """Why no cleanup can ever run after cells here, from the native library's probe (no driver, an unusable one,
    no GPU); None where the cell hooks go in."""
    driver = probe.get("driver") or {}
    state = driver.get("state")
    where = printable(driver.get("path") or "libcuda.so.1")
    if state == "no_driver":
        return f"no CUDA driver found ({where}): nothing to clean, no cleanup after cells"
    if state == "unusable":
        return f"the CUDA driver {where} is unusable ({driver.get('message')}): no cleanup after cells"
    if state == "ready" and not probe.get("devices"):
        return "no GPU on this machine: nothing to clean, no cleanup after cells"
    return None
