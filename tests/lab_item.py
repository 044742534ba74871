"""What gpucleanup's JupyterLab status item says for one kernel entry of the server's API
(``GET api/gpucleanup/kernels``), by the rule ``labextension/src/index.js`` follows (``describe``): per GPU with
bytes held, ``GPU<index> <held>`` and, where the kernel's frameworks or driver pool keep some cached,
`` (<cached> cached)``, its unit left out where it is the held figure's; GPUs joined by `` · ``. The JupyterLab
tests on the fake driver (tests/python) and on the GPU machine (tests/gpu) both hold the item to it."""

from __future__ import annotations

from gpucleanup.units import format_bytes


def item_text(entry: dict, show_cached: bool = True) -> str:
    parts = []
    for held in entry["held"]:
        if held["bytes"] > 0:
            said = format_bytes(held["cached_bytes"])
            if said.split()[1] == format_bytes(held["bytes"]).split()[1]:
                said = said.split()[0]
            cached = f" ({said} cached)" if show_cached and held["cached_bytes"] > 0 else ""
            parts.append(f"GPU{held['index']} {format_bytes(held['bytes'])}{cached}")
    return " · ".join(parts)
