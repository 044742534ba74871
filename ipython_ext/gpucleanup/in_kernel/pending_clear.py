"""Whether a cell ends with a ``clear_output(wait=True)`` that no output has followed yet.

gpucleanup's line after such a cell would be the output that clears it and would wipe what the cell drew, so the
line is left out (:class:`PendingClear`).
"""

from __future__ import annotations

import sys
import threading
from typing import Any, List, Optional, Tuple

from ..records.report import OUTPUT_TAG

_STREAMS = ("stdout", "stderr")
_NONE = object()  # a stream with no write of its own


def _message_type(msg: Any) -> Optional[str]:
    if not isinstance(msg, dict):
        return None
    kind = msg.get("msg_type")
    if kind is None and isinstance(msg.get("header"), dict):
        kind = msg["header"].get("msg_type")
    return kind if isinstance(kind, str) else None


class PendingClear:
    """A hook on the shell's display publisher that follows the last ``clear_output`` of the cell.

    ``IPython.display.clear_output(wait=True)`` asks the frontend to clear the cell's output at its *next* output
    (a progress display that redraws without flicker). A cell that ends with such a clear still pending shows what
    it drew until something else is output: gpucleanup's line after the cell would be that output, and would wipe
    what the user's cell showed (nbclient's own ``Clear Output.ipynb`` checks exactly this). So the line waits:
    while a clear is pending at the end of a cell, gpucleanup says nothing after it (the cell's record stays in
    ``%gpumem --history`` and the status endpoint).

    What is seen, on the shell's own display publisher while gpucleanup is loaded: its ``clear_output`` calls
    (wrapped: ipykernel before 6.29 sends the clear without its hooks), every display message it sends from the
    kernel's main thread, through its public ``register_hook`` (the mechanism ipywidgets' Output uses), and the
    cell's own result (``Out[N]``, which the frontend shows, clearing first). Text printed after the clear takes it
    too: while a clear is pending, and only then, ``sys.stdout`` and ``sys.stderr`` have a ``write`` of their own
    that notes the first text and removes itself (a stream that takes no attribute, or one replaced meanwhile, is
    not seen: the clear then counts as pending, and the line is left out). Terminal IPython has no such publisher:
    nothing is pending there.
    """

    def __init__(self, shell: Any):
        self._publisher = getattr(shell, "display_pub", None)
        self._installed = False
        self._wrapper: Any = None
        # (stream, its write of ours, the write it had of its own or _NONE) while a clear is pending; IPython's
        # own tee into its history is such a write of the stream's own, and is put back
        self._watched: List[Tuple[Any, Any, Any]] = []
        self._lock = threading.RLock()  # a write of ours may come while the cell's thread sets the state
        self.pending = False

    def install(self) -> bool:
        """Registers the hook and wraps ``clear_output`` where the publisher takes hooks (ipykernel's); False
        where it does not (terminal IPython)."""
        publisher = self._publisher
        register = getattr(publisher, "register_hook", None)
        if register is None or self._installed:
            return self._installed
        original = publisher.clear_output

        def clear_output(wait: bool = False) -> Any:
            answer = original(wait)  # flushes the streams first: text printed before the clear is not after it
            self._set(bool(wait))
            return answer

        clear_output.__wrapped__ = original  # type: ignore[attr-defined]
        publisher.clear_output = clear_output
        self._wrapper = clear_output
        register(self)
        self._installed = True
        return True

    def remove(self) -> None:
        self._set(False)
        if not self._installed:
            return
        publisher = self._publisher
        unregister = getattr(publisher, "unregister_hook", None)
        if unregister is not None:
            unregister(self)
        if vars(publisher).get("clear_output") is self._wrapper:  # another's wrapper over ours is left alone
            del publisher.clear_output
        self._installed = False

    def cell_starts(self) -> None:
        self._set(False)

    def _set(self, pending: bool) -> None:
        if not pending and not self.pending and not self._watched:
            return  # every cell's start and every display without a clear: nothing to change, no lock taken
        with self._lock:
            self.pending = pending
            if pending and not self._watched:
                self._watch_streams()
            elif not pending:
                self._unwatch_streams()

    def _watch_streams(self) -> None:
        for name in _STREAMS:
            stream = getattr(sys, name, None)
            if stream is None:
                continue
            original = stream.write
            try:
                own = vars(stream).get("write", _NONE)
            except TypeError:  # no __dict__: nothing can be put on it
                continue

            def write(text, _original=original):
                if text:
                    self._set(False)  # the frontend clears at this text, and shows it: nothing pending now
                return _original(text)

            try:
                stream.write = write
            except (AttributeError, TypeError):
                continue
            self._watched.append((stream, write, own))

    def _unwatch_streams(self) -> None:
        watched, self._watched = self._watched, []
        for stream, write, own in watched:
            try:
                if vars(stream).get("write") is not write:  # another's write over ours is left alone
                    continue
                if own is _NONE:
                    del stream.write
                else:
                    stream.write = own
            except (AttributeError, TypeError):
                pass

    def __call__(self, msg: Any) -> Any:
        """Sees each message and hands it on unchanged (a hook that returned None would drop it)."""
        try:
            kind = _message_type(msg)
            if kind == "clear_output":
                content = msg.get("content") if isinstance(msg.get("content"), dict) else {}
                self._set(bool(content.get("wait")))
            elif kind in ("display_data", "update_display_data"):
                metadata = msg.get("metadata") if isinstance(msg.get("metadata"), dict) else {}
                if OUTPUT_TAG not in metadata:  # gpucleanup's own line never ends a wait it was held for
                    self._set(False)
        except Exception:
            pass
        return msg

    def holds_the_line(self, result: Any = None) -> bool:
        """Whether what gpucleanup would say after the cell must be left out: a ``clear_output(wait=True)``
        is pending and the cell shows no result of its own (an ``Out[N]`` would take the clear first). The
        streams are let go either way: the cell has ended."""
        held = self.pending and getattr(result, "result", None) is None
        if self._watched:
            with self._lock:
                self._unwatch_streams()
        return held
