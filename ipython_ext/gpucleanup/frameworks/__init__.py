"""One adapter per GPU framework: is it in use, what does it hold, free what it caches.

The extension calls these only after the native probe reports the CUDA driver as
initialised (``driver.state == "ready"``), and passes the indices of the devices
whose primary context is already active. Every adapter keeps to these rules:

- it never imports a framework: it acts only on modules already in ``sys.modules``;
- it never initialises CUDA nor creates a context: it switches only to the devices
  it is given, and puts the calling thread's current device (and context) back;
- it raises nothing for a fault of the framework: each verb returns notes instead.
  Notes start with a stable id, ``[gpucleanup.<adapter>.<number>]``.

Verbs (the same on every adapter)::

    in_use()              -> bool
    stats(devices)        -> {"devices": {idx: {"live_bytes", "cached_bytes"}},
                              "pinned": {"live_bytes", "cached_bytes"} | None, "notes": [str]}
    drain(devices)        -> {"freed_bytes": {idx: int}, "notes": [str]}
    drain_pinned()        -> {"freed_bytes": int, "notes": [str]}
    describe()            -> str
    quiet_token(devices, in_use=False)  -> tuple | None

``quiet_token`` is optional and cheap: a value that differs whenever ``stats(devices)``
could answer otherwise (None: the adapter cannot tell without reading its figures). An
idle cell compares it with the one read just before the last figures, and reads the
figures again only when it differs; it passes ``in_use=True`` (the framework was found in
use and nothing was imported since), so the adapter does not ask again. CuPy and PyTorch
have one.

An adapter whose device caches only the kernel's thread can empty sets ``drains_on_cell_thread``
(PyCUDA): the engine then empties them as each cell ends, never on a release's thread.

``live_bytes`` is what the framework's objects hold, ``cached_bytes`` what it keeps
for reuse (for frameworks that cannot release, what they hold beyond live objects).
``drain_pinned`` may take about 130 ms per GiB; it may run on another thread while
``stats`` runs: ``stats`` never waits for it and reports the figures read before
that release began.

``install()`` / ``uninstall()`` (the extension's load and unload) put in place and remove
what an adapter needs to see objects as they are made: PyCUDA keeps no registry of its
memory pools, so ``frameworks/pycuda.py`` watches their making from PyCUDA's import on.

What the rest of gpucleanup knows of a framework is on its adapter class (``base.Adapter``:
``packages`` and ``libraries`` for the trace, ``oom_types`` and ``oom_texts`` for the hidden
holders, ``object_modules``, ``object_kind`` and ``object_info`` for its GPU objects, ``name``
for the configuration), read from ``ADAPTERS``: a new framework is its adapter module and
one line below.
"""

from __future__ import annotations

import sys

from .base import Adapter
from .cupy import CupyAdapter
from .torch import TorchAdapter
from .numba import NumbaAdapter
from .jax import JaxAdapter
from .rmm import RmmAdapter
from .tensorflow import TensorflowAdapter
from .pycuda import PycudaAdapter
from . import pycuda as _pycuda

__all__ = ["Adapter", "ADAPTERS", "active", "known_frameworks", "install", "uninstall"]

ADAPTERS: tuple[Adapter, ...] = (
    CupyAdapter(),
    TorchAdapter(),
    NumbaAdapter(),
    PycudaAdapter(),
    JaxAdapter(),
    RmmAdapter(),
    TensorflowAdapter(),
)


def known_frameworks() -> list[str]:
    """The names of the framework adapters, sorted (the keys of the ``frameworks`` option, the Dask
    plugin's too). Safe at configuration time: importing the adapters imports no framework."""
    return sorted(str(adapter.name) for adapter in ADAPTERS)


def active() -> list[Adapter]:
    """The adapters whose framework is imported and in use (a failing check counts as not in use)."""
    found = []
    imported = sys.modules
    for adapter in ADAPTERS:
        if adapter.modules and imported.keys().isdisjoint(adapter.modules):
            continue  # never imported: not in use, and its in_use would say so at a higher cost
        try:
            if adapter.in_use():
                found.append(adapter)
        except Exception:
            continue
    return found


def install() -> None:
    """At the extension's load: from now on, PyCUDA's pools are seen as they are made (a
    ``sys.meta_path`` finder that reacts only to PyCUDA's driver modules; nothing else is
    imported or touched). Counted: each ``install`` needs one ``uninstall``."""
    _pycuda.install()


def uninstall() -> None:
    """At the extension's unload: undoes ``install``."""
    _pycuda.uninstall()
