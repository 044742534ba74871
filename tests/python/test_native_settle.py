"""gpucleanup_settle (drain(trim=False)): waits like a drain, never trims the driver's pools."""

from gpucleanup import _native
from support import GiB  # noqa: E402



def test_settle_only_reports_pools_untouched_and_validates(fake_cuda, schemas):
    fake_cuda.reset({"devices": [{"uuid": "GPU-5e771e00-0000-0000-0000-000000000001", "primary_active": True,
                                  "free_bytes": 10 * GiB,
                                  "default_pool": {"reserved_bytes": 2 * GiB, "used_bytes": 0}}]})
    result = _native.drain(timeout=5, trim=False)
    schemas["drain.schema.json"].validate(result)
    assert result["trim"] is False
    device = result["devices"][0]
    assert device["settle"]["status"] == "done"
    assert [(p["reserved_before_bytes"], p["reserved_after_bytes"], p["trimmed"]) for p in device["pools"]] == [(2 * GiB, 2 * GiB, False)]
    assert device["released_bytes"] == 0
    assert fake_cuda.counter("calls.cuCtxSynchronize") == 1
    assert fake_cuda.counter("calls.cuMemPoolTrimTo") == 0

    trimmed = _native.drain(timeout=5)
    assert trimmed["trim"] is True
    assert trimmed["devices"][0]["released_bytes"] == 2 * GiB
