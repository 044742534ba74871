"""A resume that no cell has said yet, kept for the kernel's next cell to say once.

Such a resume was made from outside the kernel or for a request that is no cell; its note waits in the kernel's
park lock file (:mod:`gpucleanup.park.kernel_side`).
"""

from __future__ import annotations

import os
import time
from typing import Callable, Optional

from ..units import format_bytes, format_duration

__all__ = ["FROM_OUTSIDE", "NewsLook", "for_request", "after_resume", "sentence", "take"]

#: how a resume made through the kernel's status endpoint by another process is said
FROM_OUTSIDE = "from outside the kernel (gpucleanup resume or the page)"

_REQUESTS = {
    "execute_request": "for a silent execute (a variable inspector's poll)",
    "comm_open": "for a comm message (a widget)",
    "comm_msg": "for a comm message (a widget)",
    "comm_close": "for a comm message (a widget)",
    "inspect_request": "for an inspection",
    "complete_request": "for a completion",
}


def for_request(msg_type: str) -> str:
    """How a resume made for a request of type ``msg_type`` (one the kernel's request guard resumes for) is said."""
    return _REQUESTS.get(msg_type, f"for a {msg_type}")


def after_resume(park_note: dict, seconds: float, by: str, now_ns: Optional[int] = None) -> dict:
    """The lock file's note after a resume made ``by`` someone no cell will hear: what the park's own note said
    (``parked_bytes``, ``since_ns``: when the park ended) and the resume's time.

    The resume a cell makes before it runs is said at once, under that cell (``resumed ... (parked 42 min)``). A
    resume made any other way has no cell to be said under: from outside the kernel (``gpucleanup resume``, the
    page's Resume), or for a request that is no cell (a completion, an inspection, a widget's comm message, a variable
    inspector's silent execute: what a frontend sends as soon as a notebook is opened again). Whoever resumes writes
    this note in the kernel's park lock file (:mod:`gpucleanup.park.kernel_side`: private to the user, beside the
    key, written under the lock), and the kernel's next cell says it (:func:`take`).
    """
    parked_bytes = park_note.get("parked_bytes")
    parked_ns = park_note.get("since_ns")
    return {"resumed": {
        "by": by,
        "bytes": parked_bytes if isinstance(parked_bytes, int) and parked_bytes > 0 else None,
        "parked_ns": parked_ns if isinstance(parked_ns, int) and parked_ns > 0 else None,
        "resumed_ns": time.time_ns() if now_ns is None else now_ns,
        "seconds": round(float(seconds), 3),
    }}


def sentence(news: dict, now_ns: Optional[int] = None) -> Optional[str]:
    """``resumed 1.5 GiB from host memory in 0.9 s (parked 42 min), 5 min before this cell, for a completion``;
    None when ``news`` is not a resume's note."""
    if not isinstance(news, dict) or not isinstance(news.get("resumed_ns"), int):
        return None
    now_ns = time.time_ns() if now_ns is None else now_ns
    size = news.get("bytes")
    text = f"resumed {format_bytes(size)}" if isinstance(size, int) and size > 0 else "resumed its GPU memory"
    seconds = news.get("seconds")
    if isinstance(seconds, (int, float)):
        text += f" from host memory in {seconds:.1f} s"
    parked_ns = news.get("parked_ns")
    if isinstance(parked_ns, int) and 0 < parked_ns <= news["resumed_ns"]:
        text += f" (parked {format_duration((news['resumed_ns'] - parked_ns) / 1e9)})"
    text += f", {format_duration(max(0.0, (now_ns - news['resumed_ns']) / 1e9))} before this cell"
    by = news.get("by")
    return text + (f", {by}" if isinstance(by, str) and by else "")


def take(lock_file: Optional[os.PathLike]) -> Optional[str]:
    """The sentence of a resume no cell has said yet, cleared as it is taken (so said once); None when there is
    none, or when the lock is held elsewhere this moment (it is said by a later cell). A refused park's memo stays:
    the driver fails every later checkpoint of the process. Never raises.

    The cell shows it as ``gpucleanup · resumed 1.5 GiB from host memory in 0.9 s (parked 42 min), 5 min before this
    cell, for a completion``. The memo is what a park the driver refused for what the kernel holds leaves there (no
    park is tried again: :func:`gpucleanup.park.kernel_side.park_kernel`). Called alone it costs one ``stat`` of that
    file while there is nothing to say (an empty or absent file); a kernel's cells call it through :class:`NewsLook`,
    whose look keeps the interpreter lock. A kernel whose park the driver refused pays the lock and a read as well.
    """
    if lock_file is None:
        return None
    try:
        if os.stat(lock_file).st_size == 0:
            return None
    except OSError:
        return None
    from .lock import LockBusy, ParkLock
    from .steps import ParkRefused

    try:
        with ParkLock(lock_file, 0.2) as lock:
            note = lock.read_note()
            news = note.get("resumed")
            if not isinstance(news, dict):
                return None  # a park's own note (its cell resumes it), or a refused park's memo, which stays
            # said once; a refused park's memo stays
            lock.write_note({"refused": note["refused"]} if "refused" in note else None)
    except (LockBusy, ParkRefused, OSError):
        return None
    return sentence(news) if isinstance(news, dict) else None


class NewsLook:
    """The kernel's look for a resume to say, once per cell: :func:`take` behind the size of the park lock file.

    The size comes from :func:`gpucleanup._native.file_size` (-1 where no regular file is), which keeps the
    interpreter lock as every other call of a cell's hooks does (``os.stat`` gives it up to any waiting thread).
    A file of size 0, or none, has nothing to say; anything else goes to :func:`take`, which locks, reads and
    checks it. Never raises."""

    def __init__(self) -> None:
        self._read_size: Optional[Callable[[bytes], int]] = None  # the library's, loaded at the first look
        self._path: Optional[os.PathLike] = None  # the lock file whose encoded path _encoded is
        self._encoded = b""

    def take(self, lock_file: Optional[os.PathLike]) -> Optional[str]:
        if lock_file is None:
            return None
        try:
            if self._path is not lock_file:
                self._path, self._encoded = lock_file, os.fsencode(lock_file)
            if self._read_size is None:
                from .. import _native

                self._read_size = _native.file_size
            size = self._read_size(self._encoded)
        except Exception:
            return None
        return take(lock_file) if size > 0 else None
