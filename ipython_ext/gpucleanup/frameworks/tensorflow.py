"""TensorFlow: reported, never released by gpucleanup's adapter.

TensorFlow's default allocator (BFC) keeps its GPU memory until the process ends; with
``TF_GPU_ALLOCATOR=cuda_malloc_async`` that memory is the driver pool's, which gpucleanup trims after each cell.
"""

from __future__ import annotations

import os
from typing import Optional

from .base import Adapter, Figures, _bytes_text, _figures, _fault, _module


def _context_ready() -> bool:
    """Whether TensorFlow's eager context already exists: listing GPUs otherwise creates a context on every GPU."""
    context = _module("tensorflow.python.eager.context")
    safe = getattr(context, "context_safe", None)
    if safe is None:
        return False
    ctx = safe()
    return ctx is not None and getattr(ctx, "_context_handle", None) is not None


def _async_allocator() -> bool:
    """``TF_GPU_ALLOCATOR=cuda_malloc_async``, read from ``os.environ``: set after TensorFlow started, it changes
    nothing in TensorFlow and the adapter's note would be wrong."""
    return os.environ.get("TF_GPU_ALLOCATOR") == "cuda_malloc_async"


class TensorflowAdapter(Adapter):
    """TensorFlow's memory, reported as live or as the driver pool's; never released.

    TensorFlow's default allocator (BFC) never gives GPU memory back until the process ends (TensorFlow's GPU
    guide; tensorflow#36465 and #48545, open); ``clear_session()`` frees graph state, not memory
    (tensorflow#17048). No API reports how much the BFC allocator caches:
    ``tf.config.experimental.get_memory_info(dev)`` gives only the bytes in use now and at peak, which the adapter
    reports as live; the rest shows as memory outside every pool.

    With ``TF_GPU_ALLOCATOR=cuda_malloc_async`` set before TensorFlow starts, XLA's allocator takes memory from
    each device's default stream-ordered pool (with its release threshold raised): that memory is the driver
    pool's, and gpucleanup's trim of the driver's pools (``cuMemPoolTrimTo``) gives back what TensorFlow freed
    after each cell. The adapter then reports no bytes of its own (they would be counted twice) and says so.

    The adapter reads ``tf.config.experimental.get_memory_info`` only when TensorFlow's eager context already
    exists; where it cannot tell safely it reports nothing but what TensorFlow does. TensorFlow's logical GPU i is
    taken to be CUDA device i (true unless ``tf.config.set_visible_devices`` reordered them).
    """

    name = "tensorflow"
    modules = ("tensorflow",)
    can_release = False
    packages = ("tensorflow",)
    libraries = ("libtensorflow",)
    #: what lets tensorflow's memory be given back (said once per kernel on the line)
    reserved_fix = "TF_GPU_ALLOCATOR=cuda_malloc_async before import"

    def _in_use(self) -> bool:
        return _module("tensorflow") is not None and _context_ready()

    def _stats(self, devices: list[int], result: dict) -> None:
        tf = _module("tensorflow")
        for i in devices:
            result["devices"][i] = _figures()
        if _async_allocator():
            result["notes"].append(self._note("stats", (
                "tensorflow allocates from each device's default stream-ordered pool "
                "(TF_GPU_ALLOCATOR=cuda_malloc_async): its memory is counted as the driver pool's, "
                "and what it frees is trimmed after each cell"), 202))
            return
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
            "tensorflow's default (BFC) allocator gives no memory back until the process ends, and no API "
            "says how much it caches: its tensors are counted as live (get_memory_info), the rest shows as "
            "memory outside every pool; TF_GPU_ALLOCATOR=cuda_malloc_async, set before tensorflow starts, "
            "lets gpucleanup's driver-pool trim give back what it frees"), 201))

    def _describe(self, devices: dict[int, Figures], pinned: Optional[Figures]) -> str:
        if _async_allocator():
            return ("tensorflow holds its memory in the driver's default pool (TF_GPU_ALLOCATOR=cuda_malloc_async): "
                    "it is counted there, and gpucleanup trims what tensorflow frees after every cell")
        live, _ = self._held(devices)
        text = (f"tensorflow holds {_bytes_text(live)} in tensors and keeps the rest of its memory until the "
                "process exits: restart the kernel to release it")
        return text + "; with TF_GPU_ALLOCATOR=cuda_malloc_async, gpucleanup's driver-pool trim reaches what it frees"
