"""TensorFlow: reported, never released.

TensorFlow's allocator keeps GPU memory for the life of the process;
``clear_session()`` frees graph state, not memory (tensorflow#17048, #36465). The
adapter reads ``tf.config.experimental.get_memory_info`` only when TensorFlow's
eager context already exists (listing GPUs otherwise creates a context on every
GPU); where it cannot tell safely it reports nothing but what TensorFlow does.
TensorFlow's logical GPU i is taken to be CUDA device i (true unless
``tf.config.set_visible_devices`` reordered them).
"""

from __future__ import annotations

import os
from typing import Optional

from .base import Adapter, Figures, _bytes_text, _figures, _fault, _module


def _context_ready() -> bool:
    context = _module("tensorflow.python.eager.context")
    safe = getattr(context, "context_safe", None)
    if safe is None:
        return False
    ctx = safe()
    return ctx is not None and getattr(ctx, "_context_handle", None) is not None


class TensorflowAdapter(Adapter):
    name = "tensorflow"
    can_release = False

    def _in_use(self) -> bool:
        return _module("tensorflow") is not None and _context_ready()

    def _stats(self, devices: list[int], result: dict) -> None:
        tf = _module("tensorflow")
        for i in devices:
            result["devices"][i] = _figures()
        config = getattr(tf, "config", None)
        logical = [d.name for d in config.list_logical_devices("GPU")]
        get_info = config.experimental.get_memory_info
        for i in devices:
            if not any(name.endswith(f"GPU:{i}") for name in logical):
                continue
            try:
                info = get_info(f"GPU:{i}")
                result["devices"][i] = _figures(int(info.get("current", 0)), 0)
            except Exception as exc:
                result["notes"].append(self._note("stats", f"could not read tensorflow's memory on GPU{i}: {_fault(exc)}"))
        result["notes"].append(self._note("stats", (
            "tensorflow does not say how much it keeps beyond live tensors; "
            "the device figures show it as memory outside known pools"), 201))

    def _describe(self, devices: dict[int, Figures], pinned: Optional[Figures]) -> str:
        live, _ = self._held(devices)
        text = (f"tensorflow holds {_bytes_text(live)} in tensors and keeps the rest of its memory until the "
                "process exits: restart the kernel to release it")
        if os.environ.get("TF_GPU_ALLOCATOR", "") != "cuda_malloc_async":
            text += "; with TF_GPU_ALLOCATOR=cuda_malloc_async, gpucleanup's driver-pool trim reaches what it frees"
        return text
