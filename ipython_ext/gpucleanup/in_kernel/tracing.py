"""Raw allocations traced to their line (opt-in): ``%gpumem --trace on`` or ``trace_allocations``.

The native library's CUPTI callbacks (``native/src/trace.hpp``) keep every live allocation; :class:`Tracer` starts
and stops them and names the Python line each allocation came from.
"""

from __future__ import annotations

import ctypes
import gc
import glob
import os
import re
import sys
import threading
from typing import Any, Dict, List, Optional, Tuple

from ..frameworks import ADAPTERS

__all__ = ["Tracer", "cupti_candidates", "framework_of", "SITE_FN"]

SITE_FN = ctypes.CFUNCTYPE(ctypes.c_longlong)

#: distinct Python sites kept; beyond, allocations are recorded without a site
MAX_SITES = 4096

# Calls the driver's stream-ordered pools serve: counted with the driver pools.
_POOLED_KINDS = frozenset({"cuMemAllocAsync", "cuMemAllocFromPoolAsync"})

_IPYTHON_INPUT = re.compile(r"^<ipython-input-(\d+)-")


def framework_of(caller: Optional[str]) -> Optional[str]:
    """The framework whose pool a driver allocation made by ``caller`` (a library path) belongs to:
    by the package folder it is installed in (the first folder under site-packages), else by the
    library's own name (each adapter's ``packages`` and ``libraries``). A virtual environment's own
    path (``/opt/torch/.venv``) does not count."""
    text = (caller or "").replace("\\", "/")
    for marker in ("/site-packages/", "/dist-packages/"):
        if marker in text:
            package = text.rsplit(marker, 1)[1].split("/", 1)[0].lower()
            for adapter in ADAPTERS:
                if any(_package_is(package, pattern) for pattern in adapter.packages):
                    return adapter.name
    name = os.path.basename(text).lower()
    for adapter in ADAPTERS:
        if any(needle in name for needle in adapter.libraries):
            return adapter.name
    return None


def _package_is(package: str, pattern: str) -> bool:
    # "jax_cuda*": every folder that starts so (jax_cuda12_plugin, jax_cuda13_pjrt, ...)
    return package.startswith(pattern[:-1]) if pattern.endswith("*") else package == pattern


def _utf8(path: str) -> bool:
    # The paths go to the library as JSON: bytes that are not UTF-8 (surrogate escapes) cannot.
    try:
        path.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def cupti_candidates(environ: Optional[dict] = None) -> List[str]:
    """The paths of libcupti to try, in order: ``$GPUCLEANUP_CUPTI``, the ``nvidia-cuda-cupti`` wheel's folder, the
    CUDA Toolkit (``$CUDA_HOME``, ``/usr/local/cuda``), then the loader's own search (``libcupti.so.13``, ``.12``).
    libcupti is loaded at run time (never linked)."""
    env = os.environ if environ is None else environ
    found: List[str] = []

    def add(path: str) -> None:
        if path and path not in found and _utf8(path):
            found.append(path)

    for path in (env.get("GPUCLEANUP_CUPTI") or "").split(os.pathsep):
        add(path.strip())
    for entry in sys.path:
        for pattern in ("nvidia/cuda_cupti/lib/libcupti.so*", "nvidia/cu1*/lib/libcupti.so*"):
            for path in sorted(glob.glob(os.path.join(entry or ".", pattern)), reverse=True):
                add(path)
    roots = [env.get("CUDA_HOME"), env.get("CUDA_PATH"), "/usr/local/cuda"]
    for root in filter(None, roots):
        for sub in ("lib64", "lib", "extras/CUPTI/lib64", "targets/x86_64-linux/lib", "targets/sbsa-linux/lib"):
            for name in ("libcupti.so.13", "libcupti.so.12", "libcupti.so"):
                path = os.path.join(root, sub, name)
                if os.path.exists(path):
                    add(path)
    for name in ("libcupti.so.13", "libcupti.so.12", "libcupti.so"):
        add(name)
    return found


def named_cupti_missing(environ: Optional[dict] = None) -> Optional[str]:
    """Why ``GPUCLEANUP_CUPTI`` cannot be used (None: unset, or it names a file): each path it lists (``:``
    between them) must be an existing file, as a bare library name would be looked up elsewhere than asked."""
    env = os.environ if environ is None else environ
    value = env.get("GPUCLEANUP_CUPTI")
    if value is None or not value.strip():
        return None
    paths = [p.strip() for p in value.split(os.pathsep) if p.strip()]
    missing = [p for p in paths if not os.path.isfile(p)]
    if not missing:
        return None
    shown = ", ".join(repr(p)[1:-1] if p.isprintable() else repr(p) for p in missing[:3])
    return (f"GPUCLEANUP_CUPTI names {shown}, which {'is' if len(missing) == 1 else 'are'} not a file: set it to "
            "the path of a libcupti.so (e.g. /usr/local/cuda/lib64/libcupti.so.13, or the nvidia-cuda-cupti "
            "wheel's), or unset it to let gpucleanup find one")


class Tracer:
    """The extension's side of the trace: starting and stopping it, the cell it is in,
    and turning the library's groups back into sites people can read.

    The native library subscribes to CUPTI's driver-API callbacks for the allocation and free calls only and keeps
    every live allocation with its size, device, thread, cell and the shared object that called the driver. When
    the allocating thread holds the interpreter lock, it also calls :meth:`_site`, which names the Python line: the
    innermost frame, and the frame of a notebook cell when the call came from one. A raw leak then reads
    ``320 MiB in 5 allocations from <cell 3>:2 worker() on 5 threads, never freed``. CUPTI before 13.3 allows one
    subscriber per process; when a profiler holds it the trace stays off and says so (FACTS in README's "Limits").
    """

    def __init__(self, native: Any, shell: Any = None):
        self.native = native
        self.shell = shell
        self.active = False
        self.library: Optional[str] = None
        #: why the last start did not trace (said once per kind by the caller)
        self.refused: Optional[str] = None
        self._sites: List[Optional[Tuple[str, ...]]] = [None]
        self._site_ids: Dict[Tuple[str, ...], int] = {}
        self._site_lock = threading.Lock()
        self._hook = SITE_FN(self._site)  # kept alive while the library may call it

    # -- on and off ----------------------------------------------------------

    def start(self, lines: bool = True) -> dict:
        """Subscribe; returns the library's reply (``active``, ``library``, ``error``).
        ``lines=False``: no Python line is asked for (to measure what asking costs).

        A ``GPUCLEANUP_CUPTI`` that names no file is refused (``active`` False and the ``error``), never passed
        over for another libcupti: the user asked for that one."""
        wrong = named_cupti_missing()
        if wrong:
            self.active, self.library, self.refused = False, None, wrong
            return {"active": False, "library": None, "error": wrong}
        reply = self.native.trace_start(cupti_candidates(), self._hook if lines else None)
        self.active = bool(reply.get("active"))
        self.library = reply.get("library")
        self.refused = None if self.active else (reply.get("error") or "the trace could not start")
        return reply

    def stop(self) -> bool:
        """Unsubscribe; True when a trace was running."""
        if not self.active:
            return False
        reply = self.native.trace_stop()
        self.active = False
        return bool(reply.get("stopped"))

    def set_cell(self, cell: Optional[int]) -> None:
        if self.active:
            self.native.trace_set_cell(-1 if cell is None else int(cell))

    # -- what it found ----------------------------------------------------------

    def groups(self, cell: Optional[int] = None) -> List[dict]:
        """The live traced allocations (of one cell, or all), readable: each group with
        ``site`` (text or None), ``framework`` (whose pool, None: raw) and ``raw``.

        Raw is an allocation whose caller is not a framework's pool (PyTorch's caching allocator, CuPy's pool, RMM,
        XLA) and that was not taken from a stream-ordered pool (``cuMemAllocAsync``, whose memory the driver pools'
        figures already count).
        """
        reply = self.native.trace_report(-1 if cell is None else int(cell))
        out = []
        for group in reply.get("groups") or []:
            entry = dict(group)
            entry["site"] = self.site_text(int(group.get("site") or 0))
            entry["framework"] = framework_of(group.get("caller"))
            entry["raw"] = entry["framework"] is None and group.get("kind") not in _POOLED_KINDS
            out.append(entry)
        return out

    def report(self) -> dict:
        """The library's whole reply, groups made readable (for ``%gpumem --trace`` and ``--json``)."""
        reply = self.native.trace_report(-1)
        reply["groups"] = self.groups(None)
        return reply

    def cell_entries(self, cell: Optional[int]) -> List[dict]:
        """What the cell's record keeps: the raw allocations it made that are still alive."""
        if not self.active or cell is None:
            return []
        entries = []
        for g in self.groups(cell):
            if not g["raw"]:
                continue
            entries.append({
                "device": g.get("device"),
                "bytes": int(g.get("bytes") or 0),
                "count": int(g.get("count") or 0),
                "threads": int(g.get("thread_count") or 0),
                "site": g.get("site"),
                "caller": os.path.basename(g.get("caller") or "") or None,
                "kind": g.get("kind"),
            })
        return entries

    def site_text(self, site: int) -> Optional[str]:
        """``<cell 3>:2 worker()``, or ``file.py:12 f()`` when no cell frame was on the stack."""
        if site <= 0 or site >= len(self._sites):
            return None
        key = self._sites[site]
        if key is None:
            return None
        cell_label, inner = key[0], key[1]
        return cell_label or inner

    # -- called by the library, on the allocating thread, holding the interpreter lock --

    def _site(self) -> int:
        # Runs inside a driver call (CUPTI's callback): no garbage collection may start here, since a
        # finaliser could free GPU memory and call the driver again from within its own call.
        collecting = gc.isenabled()
        if collecting:
            gc.disable()
        try:
            return self._site_id()
        finally:
            if collecting:
                gc.enable()

    def _site_id(self) -> int:
        try:
            frame = sys._getframe(2)
        except ValueError:
            return 0
        try:
            inner = _frame_text(frame, None)
            cell_label = None
            f = frame
            depth = 0
            while f is not None and depth < 64:
                number = self._cell_number(f.f_code.co_filename)
                if number is not None:
                    cell_label = _frame_text(f, number)
                    break
                f = f.f_back
                depth += 1
            key = (cell_label or "", inner)
            with self._site_lock:
                found = self._site_ids.get(key)
                if found is not None:
                    return found
                if len(self._sites) > MAX_SITES:
                    return 0
                self._sites.append(key)
                self._site_ids[key] = len(self._sites) - 1
                return len(self._sites) - 1
        except Exception:
            return 0
        finally:
            del frame

    def _cell_number(self, filename: str) -> Optional[int]:
        compiler = getattr(self.shell, "compile", None)
        mapping = getattr(compiler, "_filename_map", None)
        if isinstance(mapping, dict):
            number = mapping.get(filename)
            if isinstance(number, int):
                return number
        match = _IPYTHON_INPUT.match(filename or "")
        return int(match.group(1)) if match else None


def _frame_text(frame: Any, cell: Optional[int]) -> str:
    code = frame.f_code
    where = f"<cell {cell}>" if cell is not None else os.path.basename(code.co_filename or "?")
    name = code.co_name
    func = "" if name == "<module>" else f" {name}()"
    return f"{where}:{frame.f_lineno}{func}"

