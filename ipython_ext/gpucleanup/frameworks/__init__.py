"""One adapter per GPU framework: is it in use, what does it hold, free what it caches.

:data:`ADAPTERS` lists them; the verbs and the rules every adapter keeps are :mod:`.base`'s. A new framework is
its adapter module and one line in :data:`ADAPTERS`.
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
