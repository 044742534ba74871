"""What the extension says as it loads, heard in a kernel too.

Loaded from a cell (``%load_ext gpucleanup``) its sentences are that cell's output. Loaded as a Jupyter kernel
starts (``c.InteractiveShellApp.extensions`` in ``ipython_kernel_config.py``), no request is under way: ipykernel
sends what is printed then with no parent, and no frontend shows it. So there each sentence also goes to the
kernel process's own stderr at once (the terminal or log of whoever started Jupyter), and waits for the first
cell: it comes out with that cell's output, as a display output of gpucleanup's own (like the summary line), once.
"""

from __future__ import annotations

import sys
from typing import Any, Callable, List

from .say import printable, say

__all__ = ["LoadNotes"]


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
