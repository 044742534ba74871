"""The bounded history of cell records, read by ``%gpumem``, the status endpoint and the plots.

A record is plain JSON-ready data (``records/record.py``), its shape ``share/schema/cell_record.schema.json``.
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
