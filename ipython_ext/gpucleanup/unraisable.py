"""The one capture of ``sys.unraisablehook`` in gpucleanup.

Frameworks print tracebacks through ``sys.unraisablehook`` from ``__dealloc__`` while
their caches are freed (CuPy after a sticky CUDA error). gpucleanup turns them into
one line of the summary instead of a page of output.
"""

from __future__ import annotations

import contextlib
import sys
import threading
from typing import Callable, Dict, List, Optional

__all__ = ["UnraisableCapture", "CAPTURE", "summarize_unraisables"]


class UnraisableCapture:
    """Captures what ``sys.unraisablehook`` receives on the capturing thread during a drain.

    Frameworks print tracebacks through it from ``__dealloc__`` (CuPy after a sticky
    error). The hook is process-wide, so it is installed while at least one capture
    runs (the main thread's drain, a background pinned release) and restored after;
    reports from other threads go to the hook that was there before. Only strings
    are kept: the exception's frames could hold GPU memory alive.
    """

    def __init__(self):
        self._lock = threading.Lock()
        self._saved: Optional[Callable] = None
        # per thread, a stack of lists: a capture inside a capture (an adapter's own,
        # inside the engine's) takes what arrives while it runs, the outer one the rest
        self._by_thread: Dict[int, List[List[dict]]] = {}
        self._local = threading.local()

    def capture(self) -> "_Capture":
        """A context manager whose value is the list that gets what arrives on this thread while it is
        entered. A small object rather than a generator: the engine enters one on every cell."""
        return _Capture(self)

    def _begin(self, entries: List[dict]) -> None:
        with self._lock:
            if not self._by_thread:
                self._saved = sys.unraisablehook
                sys.unraisablehook = self._hook
            self._by_thread.setdefault(threading.get_ident(), []).append(entries)

    def _end(self, entries: List[dict]) -> None:
        tid = threading.get_ident()
        with self._lock:
            stack = self._by_thread.get(tid, [])
            if stack and stack[-1] is entries:
                stack.pop()
            if not stack:
                self._by_thread.pop(tid, None)
            if not self._by_thread:
                if sys.unraisablehook == self._hook:
                    sys.unraisablehook = self._saved or sys.__unraisablehook__
                self._saved = None

    @contextlib.contextmanager
    def source(self, name: str):
        """Attribute what is captured meanwhile on this thread to ``name`` (an adapter)."""
        previous = getattr(self._local, "source", None)
        self._local.source = name
        try:
            yield
        finally:
            self._local.source = previous

    def _hook(self, unraisable) -> None:
        stack = self._by_thread.get(threading.get_ident())
        entries = stack[-1] if stack else None
        if entries is None:
            (self._saved or sys.__unraisablehook__)(unraisable)
            return
        exc_type = getattr(unraisable, "exc_type", None)
        obj = getattr(unraisable, "object", None)
        source = getattr(self._local, "source", None)
        if not source:
            module = obj if isinstance(obj, str) else getattr(obj, "__module__", None)
            module = module or getattr(exc_type, "__module__", "") or ""
            source = "" if module == "builtins" else module.split(".", 1)[0]
        entries.append(
            {
                "source": source or "a framework",
                "type": getattr(exc_type, "__name__", str(exc_type)),
                "message": str(getattr(unraisable, "exc_value", ""))[:300],
                "object": (obj if isinstance(obj, str) else repr(obj))[:200],
                "err_msg": str(getattr(unraisable, "err_msg", "") or "")[:200],
            }
        )


class _Capture:
    """:meth:`UnraisableCapture.capture`'s context: its own list of entries."""

    __slots__ = ("owner", "entries")

    def __init__(self, owner: UnraisableCapture):
        self.owner = owner
        self.entries: List[dict] = []

    def __enter__(self) -> List[dict]:
        self.owner._begin(self.entries)
        return self.entries

    def __exit__(self, *exc: object) -> None:
        self.owner._end(self.entries)


def summarize_unraisables(entries: List[dict]) -> Optional[str]:
    """One line for the tracebacks a drain printed through sys.unraisablehook."""
    if not entries:
        return None
    first = entries[0]
    detail = f"{first['type']}: {first['message']}" if first["message"] else first["type"]
    count = len(entries)
    what = "traceback" if count == 1 else "tracebacks"
    return f"{count} {what} from {first['source']} while freeing captured (first: {detail})"


#: The capture every part of gpucleanup uses (the engine, the CuPy adapter).
CAPTURE = UnraisableCapture()
