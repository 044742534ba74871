"""What one cell's cleanup does (the extension's traits, read when the cell ends, as one frozen value) and what
the extension hands the engine about that cell.

A leaf: the engine's parts, the extension and the Dask plugin all build or read it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, List, Mapping, Optional, Union

if TYPE_CHECKING:
    from ..records.record import CellRecord

__all__ = ["Settings", "Cell"]



@dataclass(frozen=True)
class Settings:
    """What one cell's cleanup does: the extension's traits, read when the cell ends."""

    gc: str = "auto"
    pinned: bool = True
    driver_pools: bool = True
    settle_timeout: float = 30.0
    show: str = "auto"
    frameworks: Mapping[str, bool] = field(default_factory=dict)
    #: "cell": every cache after every cell; "auto": device caches after every cell, pinned
    #: host pools once the kernel is idle; "idle": everything once the kernel is idle; "rerun":
    #: the driver's pools after every cell, the frameworks' caches once the kernel is idle or as
    #: soon as a cell other than the one that left them starts. "cell" here, for callers without
    #: cells (the Dask worker plugin); the extension's trait defaults to "rerun"
    release: str = "cell"
    #: how long the kernel must stay idle before a deferred release runs
    idle_release_s: float = 1.0
    #: say once per device when memory outside every pool grew this much since loading (0: never)
    outside_warning_mib: int = 256

    def framework_enabled(self, name: str) -> bool:
        return bool(self.frameworks.get(name, True))


@dataclass
class Cell:
    """What the extension hands the engine about one cell (see :meth:`~.after_cell.AfterCell.run`)."""

    number: Optional[int] = None
    namespace: Optional[dict] = None
    forced: bool = False  # %gpumem --drain
    after_forced: Optional["CellRecord"] = None  # the record of a %gpumem --drain earlier in the cell
    hidden: Union[None, List[dict], Callable[[], List[dict]]] = None  # holders no variable names
