"""The kernel's park lock: a file beside its key (``<runtime>/gpucleanup/<instance>.park``, 0600), held with
``flock`` by whoever runs the driver's steps on it.

A resume waits for a park under way to end rather than racing it; a park whose caller was killed leaves the lock
to the next holder, which reads the driver's own state. The lock file also keeps the park's note for its resume.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import stat
import time
from pathlib import Path
from typing import Optional

from . import steps as park_steps

__all__ = ["LockBusy", "LockUnusable", "ParkLock", "lock_path", "wait_limit", "parked_need"]


class LockBusy(Exception):
    """Another party holds the kernel's park lock past the wait allowed."""


class LockUnusable(park_steps.ParkRefused):
    """The kernel's park lock file cannot be used (a link, another user's file, a directory not there)."""


def lock_path(key_file: os.PathLike, pid: int) -> Path:
    """The park lock of kernel ``pid``: beside its key, in the user's private ``gpucleanup`` directory, named as
    its key is (``<instance>.park``: two kernels with one pid in two containers never share a lock)."""
    return Path(key_file).with_suffix(".park")


def wait_limit(limits: park_steps.Limits = park_steps.Limits()) -> float:
    """How long a resume waits for a park under way: the longest a park may take (state, lock, checkpoint,
    and an unlock with a second look at the state after a failure)."""
    return limits.state_s * 2 + limits.lock_s + limits.checkpoint_s + limits.unlock_s


class ParkLock:
    """``flock`` on the kernel's park lock file, waited for at most ``timeout`` seconds.

    The file is opened with ``O_NOFOLLOW`` and must be a regular file of this user: a link or another
    user's file planted at the name is refused, never followed.
    """

    def __init__(self, path: os.PathLike, timeout: float):
        self.path = Path(path)
        self.timeout = float(timeout)
        self._fd: Optional[int] = None

    def __enter__(self) -> "ParkLock":
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            why = ("it is a symbolic link, which is never followed" if exc.errno == errno.ELOOP else
                   exc.strerror or str(exc))
            raise LockUnusable(f"[gpucleanup.park.640] the park lock {self.path} cannot be opened ({why}): nothing "
                               "was done; remove what is at that name if it is not gpucleanup's, then try again") from None
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode) or info.st_uid != os.geteuid():
                raise LockUnusable(f"[gpucleanup.park.641] the park lock {self.path} is not a regular file of this "
                                   "user: nothing was done; remove it (it is not gpucleanup's), then try again")
            if info.st_nlink != 1:  # a hard link planted at the name: the park's note would overwrite that file
                raise LockUnusable(f"[gpucleanup.park.646] the park lock {self.path} has {info.st_nlink} links (a "
                                   "hard link to another file): nothing was done; remove it, then try again")
            deadline = time.monotonic() + self.timeout
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() >= deadline:
                        raise LockBusy(f"another park or resume of this kernel has held {self.path} for over "
                                       f"{self.timeout:.0f} s") from None
                    time.sleep(0.05)
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd
        return self

    def __exit__(self, *exc) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)  # closing the descriptor lets the lock go

    # What a park leaves for its resume, kept in the lock file itself (private to the user, held under the
    # lock): the device memory it held per GPU, so the resume can see first whether there is room for it. After
    # a resume no cell said (from outside, for a request that is no cell), the note is that resume's, for the
    # kernel's next cell to say once (gpucleanup.park.resume_news).

    def read_note(self) -> dict:
        """What the last park wrote (``{"usage": {uuid: bytes}, ...}``), ``{}`` when nothing or unreadable."""
        if self._fd is None:
            return {}
        try:
            data = os.pread(self._fd, 1 << 16, 0)
            note = json.loads(data.decode("utf-8")) if data else {}
        except (OSError, ValueError):
            return {}
        return note if isinstance(note, dict) else {}

    def write_note(self, note: Optional[dict]) -> None:
        if self._fd is None:
            return
        try:
            os.ftruncate(self._fd, 0)
            if note:
                os.pwrite(self._fd, json.dumps(note).encode("utf-8"), 0)
        except OSError:
            pass  # the note is advice for the resume's room check; the lock itself still holds


def peek_note(path: os.PathLike, owners=None) -> dict:
    """The lock file's note read without taking the lock (``park --check``, the page, ``/metrics``): a regular file
    of one of ``owners`` (uids; None: any) only, and ``{}`` when absent, unsafe or being written (malformed)."""
    from ..protocol import discovery

    try:
        data, _ = discovery.read_bounded(path, owners=owners)
        note = json.loads(data.decode("utf-8")) if data else {}
    except (OSError, ValueError):
        return {}
    return note if isinstance(note, dict) else {}


def refused_memo(note: dict) -> Optional[dict]:
    """The note's memo of a checkpoint the driver refused for what the process holds (``{"result", "since_ns"}``,
    written by :func:`~gpucleanup.park.kernel_side.park_kernel`, kept for the process's life: the driver fails
    every later checkpoint of it); None if none."""
    memo = note.get("refused")
    if (isinstance(memo, dict) and isinstance(memo.get("result"), str) and isinstance(memo.get("since_ns"), int)
            and memo["since_ns"] > 0):
        return memo
    return None


def parked_need(note: dict) -> Optional[dict]:
    """The note's device memory per GPU UUID, as the resume's room check takes it; None when absent or malformed."""
    usage = note.get("usage")
    if not isinstance(usage, dict) or not all(isinstance(k, str) and isinstance(v, int) and v >= 0
                                              for k, v in usage.items()):
        return None
    return usage or None
