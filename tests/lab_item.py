"""What gpucleanup's JupyterLab status item says for one kernel entry of the server's API
(``GET api/gpucleanup/kernels``), by the rule ``labextension/src/index.js`` follows (``describe``): per GPU with
bytes held, ``GPU<index> <held>`` and, where the kernel's frameworks or driver pool keep some cached,
`` (<cached number> cached)``; GPUs joined by `` · ``. The JupyterLab tests on the fake driver (tests/python) and on
the GPU machine (tests/gpu) both hold the item to it."""

from __future__ import annotations

from gpucleanup.units import format_bytes


def item_text(entry: dict, show_cached: bool = True) -> str:
    parts = []
    for held in entry["held"]:
        if held["bytes"] > 0:
            cached = (f" ({format_bytes(held['cached_bytes']).split()[0]} cached)"
                      if show_cached and held["cached_bytes"] > 0 else "")
            parts.append(f"GPU{held['index']} {format_bytes(held['bytes'])}{cached}")
    return " · ".join(parts)
