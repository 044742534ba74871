"""PyTorch: the caching allocator of each device and the pinned host cache.

Nothing here runs unless ``torch.cuda.is_initialized()``: ``import torch`` and the
memory statistics never initialise CUDA, while ``mem_get_info``, ``ipc_collect`` and
``empty_cache`` with no current device can (pytorch#25752). ``empty_cache`` runs
inside ``with torch.cuda.device(i)`` for each given device; on leaving, torch makes
the previous device current again only if its primary context exists.
"""

from __future__ import annotations

import sys
from typing import Any, Optional

from .base import Adapter, Figures, _bytes_text, _figures, _fault, _module, _object


# A pinned host cache owning less than this is left alone. torch pins a few bytes of
# staging for each device-to-host scalar copy (``.item()``, ``float(t)``); releasing
# them after every cell showed up as "pinned 5 B" in the line, cost a cudaFreeHost
# (a device-wide synchronisation) each, and made the next ``.item()`` pin again.
SMALL_PINNED_BYTES = 1 << 20


def _host_stats(torch: Any) -> Optional[dict]:
    """The pinned host cache's counters, or None: nested (``{"reserved_bytes": {"current": n}, ...}``)
    through ``torch._C._cuda_hostMemoryStats`` (the function behind ``host_memory_stats_as_nested_dict``,
    which is the fallback) where this torch has it, else flat
    (``{"reserved_bytes.current": n, ...}``). ``host_memory_stats`` returns the same figures but flattens
    every counter in Python first (30 µs against a few on the GPU machine, tests/bench/profile_cell.py);
    :func:`_current` reads either shape, so nothing is flattened here either."""
    nested = getattr(getattr(torch, "_C", None), "_cuda_hostMemoryStats", None)
    memory = getattr(getattr(torch, "cuda", None), "memory", None)
    nested = nested or getattr(memory, "host_memory_stats_as_nested_dict", None)
    if nested is not None:
        return nested()
    fn = getattr(memory, "host_memory_stats", None)
    return None if fn is None else fn()


def _current(stats: Optional[dict], counter: str) -> Optional[int]:
    """The current value of one counter of the host cache's statistics, nested or flat; None where absent."""
    if not stats:
        return None
    entry = stats.get(counter)
    value = entry.get("current") if isinstance(entry, dict) else stats.get(f"{counter}.current")
    return None if value is None else int(value)


def _device_figures(torch: Any, index: int) -> tuple[int, int]:
    """(allocated, reserved) bytes of torch's caching allocator on one device.

    One call of the nested statistics: ``memory_allocated`` and ``memory_reserved`` each build
    and flatten every counter of the allocator (about 140 µs each against 22 µs for the nested
    one on the GPU machine). The C function behind ``memory_stats_as_nested_dict`` is called
    directly where this torch has it: the adapter reads only once CUDA is initialised, which is
    all that wrapper checks before it normalises the device index it is given.
    """
    read = getattr(getattr(torch, "_C", None), "_cuda_memoryStats", None)
    if read is None:
        cuda = torch.cuda
        read = getattr(cuda, "memory_stats_as_nested_dict", None)
        if read is None:
            return int(cuda.memory_allocated(index)), int(cuda.memory_reserved(index))
    stats = read(index)
    if not stats:  # torch answers {} before its CUDA state exists
        return 0, 0
    return int(stats["allocated_bytes"]["all"]["current"]), int(stats["reserved_bytes"]["all"]["current"])


def _host_owned(stats: Optional[dict]) -> Optional[int]:
    """Bytes of pinned blocks the host cache owns (in use and cached), or None.

    torch 2.5-2.10 call them ``reserved_bytes``; torch >= 2.11 ``allocated_bytes``
    (next to ``active_bytes``).
    """
    reserved = _current(stats, "reserved_bytes")
    if reserved is not None:
        return reserved
    if _current(stats, "active_bytes") is not None:
        return _current(stats, "allocated_bytes")
    return None


def _host_figures(stats: Optional[dict]) -> Optional[tuple[int, int]]:
    """(live, cached) bytes of the pinned host cache where this torch tells them, else None.

    Only torch 2.5-2.10 do: ``allocated_bytes`` is what is handed out. In torch 2.11
    ``active_bytes`` does not drop when a pinned tensor is freed (measured on the GPU
    machine: 8 MiB stayed active after ``del``), so it cannot say what is live.
    """
    owned, live = _current(stats, "reserved_bytes"), _current(stats, "allocated_bytes")
    if owned is None or live is None:
        return None
    return min(live, owned), max(owned - live, 0)


def _host_empty_cache(torch: Any) -> Optional[Any]:
    accelerator_memory = getattr(getattr(torch, "accelerator", None), "memory", None)
    fn = getattr(accelerator_memory, "empty_host_cache", None)
    if fn is None:
        fn = getattr(getattr(torch, "_C", None), "_host_emptyCache", None)
    return fn


class TorchAdapter(Adapter):
    name = "torch"
    modules = ("torch",)
    can_release = True
    packages = ("torch",)
    libraries = ("libc10_cuda", "libtorch")
    oom_types = ("OutOfMemoryError",)  # torch.cuda.OutOfMemoryError
    object_modules = ("torch",)
    objects_subclassed = True  # torch.Tensor subclasses defined by users live in other modules
    member_dicts = ("_parameters", "_buffers", "_modules")  # where torch.nn.Module keeps its members

    def object_kind(self, tp: type) -> Optional[str]:
        tensor = getattr(_module("torch"), "Tensor", None)
        return "torch.Tensor" if isinstance(tensor, type) and issubclass(tp, tensor) else None

    def object_info(self, obj: Any, kind: str) -> Optional[dict]:
        if not getattr(obj, "is_cuda", False):
            return None
        device = getattr(obj.device, "index", None)
        nbytes = int(obj.element_size()) * int(obj.nelement())
        return _object(kind, obj, device, nbytes, str(obj.dtype).replace("torch.", ""))

    def _torch(self) -> Any:
        return _module("torch")

    def _in_use(self) -> bool:
        torch = self._torch()
        cuda = getattr(torch, "cuda", None)
        return cuda is not None and bool(cuda.is_initialized())

    def _stats(self, devices: list[int], result: dict) -> None:
        torch = self._torch()
        cuda = torch.cuda
        for i in devices:
            try:
                allocated, reserved = _device_figures(torch, i)
                result["devices"][i] = _figures(allocated, max(reserved - allocated, 0))
            except Exception as exc:
                result["notes"].append(self._note("stats", f"could not read torch's cache on GPU{i}: {_fault(exc)}"))
        backend = getattr(cuda, "get_allocator_backend", None)
        if backend is not None and backend() == "cudaMallocAsync":
            result["notes"].append(self._note("stats", (
                "torch allocates with cudaMallocAsync: its cache is the driver's default pool, "
                "which empty_cache trims"), 203))

    def _quiet_token(self, devices: list[int]) -> Optional[tuple]:
        """What ``stats`` reads, read without building figures: each device's allocated and reserved bytes
        and the pinned host cache's counters, through the two C functions alone (``torch._C._cuda_memoryStats``
        and ``_cuda_hostMemoryStats``; None where this torch lacks either, or while a pinned release is under
        way, whose figures ``stats`` says are from before it). Reading these never switches devices. The
        allocator backend, whose note ``stats`` adds, is not read: torch fixes it as it loads, and settings
        that name another one later fail an assertion ("Allocator backend parsed at runtime != allocator
        backend parsed at load time", c10/cuda/CUDAAllocatorConfig.cpp), so it is the one the last figures saw."""
        c = getattr(sys.modules.get("torch"), "_C", None)  # self._torch(), written out: on every idle cell
        read_device, read_host = getattr(c, "_cuda_memoryStats", None), getattr(c, "_cuda_hostMemoryStats", None)
        if read_device is None or read_host is None or self._releasing:
            return None
        token: list = []
        for i in devices:
            stats = read_device(i)
            token.append(i)
            if stats:
                token.append(stats["allocated_bytes"]["all"]["current"])
                token.append(stats["reserved_bytes"]["all"]["current"])
        host = read_host() or {}  # nested, as _cuda_hostMemoryStats always answers: {"reserved_bytes": {"current": n}}
        for counter in ("reserved_bytes", "allocated_bytes", "active_bytes"):  # what _pinned_stats reads
            entry = host.get(counter)
            token.append(entry.get("current") if isinstance(entry, dict) else entry)
        return tuple(token)

    def _drain(self, devices: list[int], result: dict) -> None:
        torch = self._torch()
        cuda = torch.cuda
        before = {i: self._reserved(torch, i) for i in devices}
        drained: list[int] = []
        capturing = self._capturing(cuda, devices)
        if not capturing:
            self._clear_library_caches(torch, devices, result)
        for i in devices:
            try:
                if i in capturing:
                    # empty_cache during graph capture trips an internal assert
                    result["notes"].append(self._note("drain", (
                        f"GPU{i}: a CUDA graph is being captured; torch's cache left as is"), 204))
                    continue
                with cuda.device(i):
                    cuda.empty_cache()
                    drained.append(i)
            except Exception as exc:
                result["notes"].append(self._note("drain", f"could not empty torch's cache on GPU{i}: {_fault(exc)}"))
        if drained and cuda.is_initialized():
            try:
                with cuda.device(drained[0]):
                    cuda.ipc_collect()
            except Exception as exc:
                result["notes"].append(self._note("drain", f"torch.cuda.ipc_collect failed: {_fault(exc)}", 205))
        for i in devices:
            after = self._reserved(torch, i)
            if before[i] is not None and after is not None:
                result["freed_bytes"][i] = max(before[i] - after, 0)

    @staticmethod
    def _capturing(cuda: Any, devices: list[int]) -> set:
        """The devices whose current stream is capturing a CUDA graph. A device that cannot be
        switched to is left to the drain, which says so."""
        check = getattr(cuda, "is_current_stream_capturing", None)
        if check is None:
            return set()
        found = set()
        for i in devices:
            try:
                with cuda.device(i):
                    if check():
                        found.add(i)
            except Exception:
                continue
        return found

    def _clear_library_caches(self, torch: Any, devices: list[int], result: dict) -> None:
        """What torch keeps for its libraries, allocated through its caching allocator (so it
        shows as live): the cuBLAS/cuBLASLt workspaces (one per handle and stream, all devices
        at once) and each device's cuFFT plan cache. Given back before ``empty_cache`` so that
        their blocks go with the rest; the next matmul or FFT makes them again. The caller
        leaves them alone while a CUDA graph is being captured on any device (the capture
        uses them)."""
        clear_workspaces = getattr(getattr(torch, "_C", None), "_cuda_clearCublasWorkspaces", None)
        try:
            if clear_workspaces is not None:
                clear_workspaces()
        except Exception as exc:
            result["notes"].append(self._note("drain", f"could not clear torch's cuBLAS workspaces: {_fault(exc)}", 209))
        clear_plans = getattr(torch, "_cufft_clear_plan_cache", None)
        for i in devices if clear_plans is not None else ():
            try:
                clear_plans(i)
            except Exception as exc:
                result["notes"].append(self._note("drain", f"could not clear torch's cuFFT plan cache on GPU{i}: "
                                                           f"{_fault(exc)}", 210))

    @staticmethod
    def _reserved(torch: Any, i: int) -> Optional[int]:
        try:
            return _device_figures(torch, i)[1]
        except Exception:
            return None

    def _pinned_stats(self, notes: list[str]) -> Optional[Figures]:
        stats = _host_stats(self._torch())
        figures = _host_figures(stats)
        if figures is not None:
            return _figures(*figures)
        owned = _host_owned(stats)
        if owned == 0:
            return _figures(0, 0)  # an empty cache: nothing live, nothing cached, nothing to say
        if owned is not None and owned < SMALL_PINNED_BYTES:
            # torch >= 2.11 with only scalar staging pinned: never released (_drain_pinned), so nothing of it
            # is cached; counted live. Unknown figures would make every idle cell try a release in a thread.
            return _figures(owned, 0)
        if owned is None:
            notes.append(self._note("pinned", "this torch does not report its pinned host cache", 206))
        else:
            notes.append(self._note("pinned", (
                f"torch's pinned host cache owns {owned} bytes; this torch does not tell how much of it is in use"),
                208))
        return None

    def _drain_pinned(self, result: dict) -> None:
        torch = self._torch()
        empty = _host_empty_cache(torch)
        if empty is None:
            result["notes"].append(self._note("pinned", "this torch cannot empty its pinned host cache", 207))
            return
        before = _host_owned(_host_stats(torch))
        if before is not None and before < SMALL_PINNED_BYTES:
            return  # scalar staging and the like: not worth unpinning (see SMALL_PINNED_BYTES)
        empty()
        after_stats = _host_stats(torch)
        after = _host_owned(after_stats)
        if before is not None and after is not None:
            result["freed_bytes"] = max(before - after, 0)
        figures = _host_figures(after_stats)
        self._remember_pinned(None if figures is None else _figures(*figures))

    def _describe(self, devices: dict[int, Figures], pinned: Optional[Figures]) -> str:
        live, cached = self._held(devices)
        text = f"torch holds {_bytes_text(live)} in tensors and {_bytes_text(cached)} cached on the GPU"
        if pinned is not None:
            text += f", {_bytes_text(pinned['cached_bytes'])} cached in pinned host memory"
        return text + "; gpucleanup empties the caches after every cell, live tensors stay"
