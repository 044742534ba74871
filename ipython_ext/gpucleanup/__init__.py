"""gpucleanup: frees GPU memory after every Jupyter cell.

In IPython or Jupyter::

    %load_ext gpucleanup     # clean after every cell, print one summary line
    %gpumem                  # status at any time

From Python::

    import gpucleanup
    gpucleanup.snapshot()            # per-device memory, driver pools
    gpucleanup.drain(timeout=30)     # settle and trim the driver pools now

Nothing happens at import: no driver is loaded and no framework imported.
"""

from __future__ import annotations

from .version import __version__


__all__ = ["snapshot", "drain", "load_ipython_extension", "unload_ipython_extension", "__version__"]


def snapshot() -> dict:
    """Per-device memory as the CUDA driver sees it (see share/schema/snapshot.schema.json).

    Without a driver, or before anything in the process initialised CUDA, the
    result says so in ``result["driver"]["state"]`` and lists no devices.
    """
    from . import _native

    return _native.snapshot()


def drain(timeout: float = 30.0) -> dict:
    """Wait (at most ``timeout`` seconds) for queued GPU work, then trim the driver's memory pools.

    Only devices whose CUDA context already exists are touched. The result
    follows share/schema/drain.schema.json.
    """
    from . import _native

    return _native.drain(timeout=timeout)


def load_ipython_extension(ipython):  # pragma: no cover - exercised through IPython
    from .in_kernel.extension import load_ipython_extension as _load

    _load(ipython)


def unload_ipython_extension(ipython):  # pragma: no cover - exercised through IPython
    from .in_kernel.extension import unload_ipython_extension as _unload

    _unload(ipython)
