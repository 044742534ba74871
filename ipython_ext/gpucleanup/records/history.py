"""The bounded history of cell records.

A record is plain data (JSON-ready: str keys, ints for bytes, floats for
seconds), built by the extension after each cell and read by ``%gpumem``, the
status endpoint and, later, plots. Its shape::

    {
      "cell": 12 | None,              # execution count; None for %gpumem --drain
      "time_ns": ...,                 # wall clock when the cleanup finished
      "elapsed_s": 0.012,             # time the cleanup took
      "driver_state": "ready",
      "touched": True,                # the cell changed GPU memory
      "shown": True,                  # a summary line was printed
      "interrupted": False,           # Ctrl-C stopped the cleanup
      "devices": [{
          "index": 0, "name": "NVIDIA H100 80GB HBM3", "state": "drained" | "busy" | "unusable"
                                                      | "error" | "interrupted",
          "settle": {"status": "done", "waited_s": 0.0, "busy_for_s": None},
          "total_bytes": ...,
          "used_at_start_bytes": ...,     # device used when the cell started (None: CUDA was not in use)
          "used_before_bytes": ...,       # ... when it ended, before the cleanup
          "used_after_bytes": ...,        # ... after the cleanup
          "freed_bytes": {"cupy": ..., "driver": ...},
          "live_bytes": {"cupy": ...}, "cached_bytes": {"jax": ...},
          "message": None,                # the driver's one line for a busy/unusable device
          "quiet": False,                 # unusable and already said: no line any more
      }],
      "pinned": {"freed_bytes": {"cupy": ...},          # released by this cell's cleanup
                 "background": [{"cell": 11, "freed_bytes": {...}, "elapsed_s": ...}],  # finished since
                 "pending": False,                       # a release still runs in the background
                 "pools": {"cupy": {"live_bytes": ..., "cached_bytes": ...}}},
      "gc": {"policy": "auto", "ran": None | "young" | "full", "elapsed_s": ..., "collected": ...},
      "notes": ["..."],               # every note of this cell
      "shown_notes": ["..."],         # the ones printed (first of their kind)
      "unraisable": [{"type": ..., "message": ..., "object": ...}],
    }
"""

from __future__ import annotations

import collections
import copy
from typing import Deque, List, Optional

__all__ = ["History"]


class History:
    """The last ``size`` records, oldest first."""

    def __init__(self, size: int = 100):
        self._records: Deque[dict] = collections.deque(maxlen=max(1, int(size)))

    @property
    def size(self) -> int:
        return self._records.maxlen or 0

    def resize(self, size: int) -> None:
        self._records = collections.deque(self._records, maxlen=max(1, int(size)))

    def append(self, record: dict) -> None:
        self._records.append(record)

    def last(self, n: Optional[int] = None) -> List[dict]:
        """The last ``n`` records (all when None), oldest first, as copies."""
        records = list(self._records)
        if n is not None:
            records = records[-n:] if n > 0 else []
        return copy.deepcopy(records)

    def __len__(self) -> int:
        return len(self._records)

    def clear(self) -> None:
        self._records.clear()
