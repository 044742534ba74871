"""Stand-in for PyTorch's CUDA side: caching allocator per device, host cache, device guard."""

from __future__ import annotations

import contextlib

from .world import World, install, module


class TorchStandIn:
    def __init__(self, world: World, initialised: bool, allocated, reserved, host_active, host_owned,
                 backend: str, capturing, host_keys: str):
        self.world = world
        self.initialised = initialised
        self.allocated = dict(allocated or {})
        self.reserved = dict(reserved or {})
        self.host_active = host_active
        self.host_owned = host_owned
        self.backend = backend
        self.capturing = set(capturing or ())
        self.host_keys = host_keys
        self.workspace: dict = {}  # cuBLAS workspace bytes per device, counted in allocated

    def _guard(self, name):
        self.world.calls.append((name, self.world.current))
        if not self.initialised:
            self.world.violations.append(f"torch.cuda.{name} called while torch has not initialised CUDA")


def install_torch(monkeypatch, world: World, initialised=True, allocated=None, reserved=None,
                  host_active=0, host_owned=0, backend="native", capturing=(), host_keys="2.11",
                  host_empty="_C", nested=True) -> TorchStandIn:
    """``nested``: True, this torch has ``memory_stats_as_nested_dict`` and
    ``host_memory_stats_as_nested_dict`` and the C functions behind them (``torch._C._cuda_memoryStats``,
    ``_cuda_hostMemoryStats``: every torch the adapter reads them from calls those); "wrappers": only the
    Python functions; False: neither, the adapter falls back to
    ``memory_allocated``/``memory_reserved``/``host_memory_stats``."""
    t = TorchStandIn(world, initialised, allocated, reserved, host_active, host_owned, backend, capturing, host_keys)

    def is_initialized():
        return t.initialised

    def memory_allocated(i):
        return t.allocated.get(i, 0) if t.initialised else 0

    def memory_reserved(i):
        return t.reserved.get(i, 0) if t.initialised else 0

    def empty_cache():
        # like the native allocator: frees the cache of every device
        t._guard("empty_cache")
        if t.world.current is None:
            t.world.violations.append("empty_cache with no current device creates a context on device 0")
        for i in list(t.reserved):
            t.reserved[i] = t.allocated.get(i, 0)

    def ipc_collect():
        t._guard("ipc_collect")

    def mem_get_info(*a):  # pragma: no cover - must never be called
        t.world.violations.append("torch.cuda.mem_get_info")
        raise AssertionError("mem_get_info")

    @contextlib.contextmanager
    def device(i):
        t._guard(f"device({i})")
        previous = t.world.current
        t.world.set_device(i, "torch.cuda.device")
        try:
            yield
        finally:
            # torch._C._cuda_maybeExchangeDevice: restore only a device with a context
            if previous is not None and previous in t.world.active:
                t.world.current = previous
                t.world.calls.append(("restore", previous))

    def get_allocator_backend():
        return t.backend

    def is_current_stream_capturing():
        return t.world.current in t.capturing

    def host_memory_stats():
        t.world.calls.append(("host_memory_stats", None))
        if t.host_keys == "2.11":
            return {"active_bytes.current": t.host_active, "allocated_bytes.current": t.host_owned,
                    "num_host_alloc": 1}
        if t.host_keys == "2.5":
            return {"allocated_bytes.current": t.host_active, "reserved_bytes.current": t.host_owned}
        return {"num_host_alloc": 1}

    def memory_stats_as_nested_dict(i):
        if not t.initialised:
            return {}
        return {"allocated_bytes": {"all": {"current": t.allocated.get(i, 0), "peak": 0}, "large_pool": {}},
                "reserved_bytes": {"all": {"current": t.reserved.get(i, 0), "peak": 0}}, "num_alloc_retries": 0}

    def host_memory_stats_as_nested_dict():
        flat = host_memory_stats()
        t.world.calls[-1] = ("host_memory_stats_as_nested_dict", None)
        nested_stats: dict = {}
        for key, value in flat.items():
            outer, _, inner = key.partition(".")
            if inner:
                nested_stats.setdefault(outer, {})[inner] = value
            else:
                nested_stats[outer] = value
        return nested_stats

    def clear_cublas_workspaces():
        # like at::cuda::clearCublasWorkspaces: every device's workspaces go back to the cache
        t._guard("clear_cublas_workspaces")
        for i, n in list(t.workspace.items()):
            t.allocated[i] = t.allocated.get(i, 0) - n
        t.workspace.clear()

    def cufft_clear_plan_cache(i):
        t._guard(f"cufft_clear_plan_cache({i})")

    def host_empty_cache():
        t._guard("host_empty_cache")
        t.host_owned = t.host_active

    memory = module("torch.cuda.memory", host_memory_stats=host_memory_stats)
    if nested:
        memory.host_memory_stats_as_nested_dict = host_memory_stats_as_nested_dict
    cuda = module(
        "torch.cuda", is_initialized=is_initialized, memory_allocated=memory_allocated,
        memory_reserved=memory_reserved, empty_cache=empty_cache, ipc_collect=ipc_collect,
        mem_get_info=mem_get_info, device=device, get_allocator_backend=get_allocator_backend,
        is_current_stream_capturing=is_current_stream_capturing, memory=memory,
    )
    if nested:
        cuda.memory_stats_as_nested_dict = memory_stats_as_nested_dict
    c = module("torch._C", _cuda_clearCublasWorkspaces=clear_cublas_workspaces)
    if nested is True:  # the C functions behind the nested wrappers, as every torch that has those
        c._cuda_memoryStats = memory_stats_as_nested_dict
        c._cuda_hostMemoryStats = host_memory_stats_as_nested_dict
    torch = module("torch", cuda=cuda, _C=c, _cufft_clear_plan_cache=cufft_clear_plan_cache)
    if host_empty == "_C":
        c._host_emptyCache = host_empty_cache
    elif host_empty == "accelerator":
        accelerator_memory = module("torch.accelerator.memory", empty_host_cache=host_empty_cache)
        torch.accelerator = module("torch.accelerator", memory=accelerator_memory)
    install(monkeypatch, {"torch": torch, "torch.cuda": cuda, "torch.cuda.memory": memory, "torch._C": c})
    return t
