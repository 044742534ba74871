"""The torch adapter against a real PyTorch (a CPU build is enough): with torch
imported and CUDA never initialised, no verb initialises CUDA."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")


def test_torch_adapter_with_real_torch_never_initialises_cuda():
    from gpucleanup.frameworks import ADAPTERS, active

    adapter = next(a for a in ADAPTERS if a.name == "torch")
    assert torch.cuda.is_initialized() is False

    assert adapter.in_use() is False
    assert adapter.stats([0, 1]) == {"devices": {0: {"live_bytes": 0, "cached_bytes": 0},
                                                 1: {"live_bytes": 0, "cached_bytes": 0}},
                                     "pinned": None, "notes": []}
    assert adapter.drain([0]) == {"freed_bytes": {0: 0}, "notes": []}
    assert adapter.drain_pinned() == {"freed_bytes": 0, "notes": []}
    assert adapter.describe() == "torch is not in use in this kernel"
    assert "torch" not in [a.name for a in active()]

    assert torch.cuda.is_initialized() is False


def test_torch_adapter_with_real_torch_reads_the_real_statistics_functions():
    # The adapter feature-detects these; a torch that renamed them would silently
    # report nothing, so pin the names this torch has.
    from gpucleanup.frameworks.torch import _host_empty_cache

    assert callable(torch.cuda.memory_allocated) and callable(torch.cuda.memory_reserved)
    assert callable(torch.cuda.is_initialized)
    assert callable(getattr(torch.cuda.memory, "host_memory_stats", None))
    # the per-cell reads: one nested call per device and one for the pinned cache
    assert callable(getattr(torch.cuda, "memory_stats_as_nested_dict", None))
    assert callable(getattr(torch.cuda.memory, "host_memory_stats_as_nested_dict", None))
    assert torch.cuda.memory_stats_as_nested_dict(0) == {}  # CUDA not initialised: nothing, nothing started
    # the library caches a drain clears (the cuBLAS one exists in CUDA builds only)
    assert callable(getattr(torch, "_cufft_clear_plan_cache", None))
    assert _host_empty_cache(torch) is not None
    assert torch.cuda.is_initialized() is False
