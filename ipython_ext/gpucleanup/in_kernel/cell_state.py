"""Which cells are under way in the kernel, as its ``pre_run_cell`` / ``post_run_cell`` hooks count them.

A cell may run another (``%%capture``, ``%run -i``: ``run_cell`` from inside a cell), and a tool that awaits
``run_cell_async`` itself gets a ``pre_run_cell`` with no ``post_run_cell``. :class:`CellState` keeps the
nesting depth (the cleanup is the outermost cell's), the count of cells under way that a drain from
outside reads (``outside_drain.OutsideDrain``, whose condition shares :attr:`CellState.lock`), and what
``%gpumem --drain`` did in the running cell. No driver call, no shell.
"""

from __future__ import annotations

import functools
import threading
from typing import Any, Optional

from ..records.record import CellRecord
from ..units import count_of

__all__ = ["CellState", "a_cell_runs_code", "running_cell_number", "unended_cells"]


class CellState:
    """The cells under way: counted by the hooks, read by the drain from outside."""

    def __init__(self) -> None:
        # Taken alone where nothing waits or is woken; the drain from outside builds its condition on it, so that
        # a cell counted in and a drain that checks the count are one step each (OutsideDrain.cell_starts, .run).
        self.lock = threading.RLock()
        self.depth = 0  # cells running: more than one while a cell runs another (%%capture)
        self.under_way = 0  # from pre_run_cell to the end of its post_run_cell (nested ones too): counted in by
        #                     OutsideDrain.cell_starts, under the lock, in the step in which a drain's is checked
        self.forced: Optional[CellRecord] = None  # what %gpumem --drain did in the running cell

    def counted_out(self) -> None:
        """``post_run_cell`` has ended."""
        with self.lock:
            self.under_way = max(0, self.under_way - 1)

    def enter(self) -> int:
        """A cell begins; its depth: 1 for a cell of its own, more for a ``run_cell`` from inside one."""
        self.depth += 1
        return self.depth

    def leave(self) -> int:
        """A cell's ``post_run_cell``; the depth left: more than 0 for a cell run from inside another."""
        self.depth = max(0, self.depth - 1)
        return self.depth

    def put_right(self) -> int:
        """A cell starts while the depth says another runs, but none runs code: the earlier cells' ``post_run_cell``
        never came (IPython fires it only from ``run_cell``, so a tool that awaits ``run_cell_async`` itself leaves
        it out). Counted as still running, they would make every later cell "nested": no line, no cleanup, drains
        refused, a park asked for never done. Only this cell is counted from now on; returns how many were
        dropped (:func:`unended_cells` says it)."""
        unended = self.depth - 1
        self.depth = 1
        with self.lock:
            self.under_way = 1  # this cell's
        return unended

    def busy(self) -> bool:
        """Is a cell under way (its hooks included)?"""
        return self.under_way > 0 or self.depth > 0


def unended_cells(unended: int) -> str:
    """The sentence said once when :meth:`CellState.put_right` dropped ``unended`` cells."""
    return (f"{count_of(unended, 'cell')} run through run_cell_async got no post_run_cell (IPython fires it only "
            f"from run_cell): gpucleanup had counted {'it' if unended == 1 else 'them'} as still running; put right, "
            "this cell and the next are cleaned as usual")


def a_cell_runs_code() -> bool:
    """Whether a cell's code is running further up this thread's stack (IPython's ``run_code`` frame): a
    ``run_cell`` from inside a cell (``%%capture``, ``%run -i``) is nested in it; one from outside any cell is not.
    Asked only when the depth says a cell runs, never on a plain cell."""
    import sys

    from IPython.core.interactiveshell import InteractiveShell

    target = InteractiveShell.run_code.__code__
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code is target:
            return True
        frame = frame.f_back
    return False


@functools.lru_cache(maxsize=None)
def _counts_before_pre_run_cell() -> bool:
    """Does this IPython count a cell before ``pre_run_cell`` (so the running cell is count - 1)?

    IPython 9.8 moved ``execution_count += 1`` from the end of ``run_cell_async`` to
    before the ``pre_run_cell`` event; 8.x and 9.0-9.7 count after the cell
    (IPython/core/interactiveshell.py, ``run_cell_async``, in each release).
    """
    try:
        import IPython

        return tuple(IPython.version_info[:2]) >= (9, 8)
    except Exception:
        return True


def running_cell_number(shell: Any, info: Any = None) -> Optional[int]:
    """The number of the cell about to run, as ``pre_run_cell`` sees it, on every IPython."""
    count = getattr(shell, "execution_count", None)
    if not isinstance(count, int):
        return None
    stores = info is None or getattr(info, "store_history", True)
    if stores and _counts_before_pre_run_cell():
        count -= 1
    return count
