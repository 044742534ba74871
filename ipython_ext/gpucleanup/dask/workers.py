"""``%gpumem --dask [on|off] [--drain] [--json]``: the workers of the kernel's Dask client.

The worker plugin and the calls that reach the workers are ``gpucleanup.dask``'s; this part finds the
kernel's client, says what was done and shows the workers beside the kernel's own memory table. Dask is
imported only where the kernel already imported it.
"""

from __future__ import annotations

import importlib.util
import sys
from typing import Any, Callable, Optional

from IPython.core.error import UsageError

from ..records import report
from ..say import say

__all__ = ["DaskWorkers"]


class DaskWorkers:
    """``kernel_status()``: the kernel's own ``%gpumem`` status, shown above the workers' table."""

    def __init__(self, kernel_status: Callable[[], dict]):
        self._kernel_status = kernel_status

    def gpumem(self, choice: Optional[str], drain: bool, as_json: bool, display: Callable[[Any], None]):
        """``choice``: "on" registers gpucleanup's plugin on the workers, "off" removes it, "show" shows them
        (after a drain with ``drain``); ``as_json`` returns the data instead of showing it."""
        client = self._client()
        from . import plugin as gpucleanup_dask

        if choice == "on":
            gpucleanup_dask.register(client)
            print(say(f"gpucleanup's plugin registered on {len(client.scheduler_info().get('workers', {}))} "
                      "Dask workers: each cleans its GPU memory once idle after its tasks (%gpumem --dask shows them)"))
            return None
        if choice == "off":
            gpucleanup_dask.unregister(client)
            print(say("gpucleanup's plugin removed from the Dask workers"))
            return None
        drained = gpucleanup_dask.drain_cluster(client) if drain else None
        workers = gpucleanup_dask.cluster_memory(client)
        if as_json:
            data = {"kind": "gpumem-dask", "workers": workers}
            if drained is not None:
                data["drained"] = drained
            return report.JSONReport(data)
        if drained is not None:
            for text in report.dask_drain_lines(drained):
                print(text)
        display(report.memory_report(self._kernel_status()))
        display(report.dask_report(workers))
        return None

    @staticmethod
    def _client() -> Any:
        if "distributed" not in sys.modules:
            if importlib.util.find_spec("distributed") is None:
                raise UsageError("%gpumem --dask: Dask's distributed is not installed: pip install "
                                 "'gpucleanup[dask]', then create a client (from dask.distributed import Client; "
                                 "client = Client(...))")
            raise UsageError("%gpumem --dask: Dask's distributed is not imported in this kernel: create a client "
                             "first (from dask.distributed import Client; client = Client(...))")
        try:
            return sys.modules["distributed"].get_client()
        except ValueError:
            raise UsageError("%gpumem --dask: this kernel has no Dask client: create one first "
                             "(from dask.distributed import Client; client = Client(...))") from None
