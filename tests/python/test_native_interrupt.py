"""Ctrl-C during gpucleanup.drain() stops the wait, never the caller."""

import os
import signal
import threading
import time

import gpucleanup


def _send_sigint_once_waiting(fake_cuda, done: threading.Event) -> None:
    # Poll the fake until the watchdog sits in cuCtxSynchronize, then interrupt.
    while fake_cuda.counter("syncs_in_flight") < 1 and not done.is_set():
        time.sleep(0.01)
    if not done.is_set():
        os.kill(os.getpid(), signal.SIGINT)


def test_ctrl_c_during_drain_abandons_the_wait_and_is_reported_not_raised(fake_cuda):
    fake_cuda.reset({"devices": [{"uuid": "GPU-1a7e0000-0000-0000-0000-00000000c7c1", "primary_active": True,
                                  "sync_seconds": -1}]})
    done = threading.Event()
    sender = threading.Thread(target=_send_sigint_once_waiting, args=(fake_cuda, done))
    sender.start()
    try:
        result = gpucleanup.drain(timeout=60)
    finally:
        done.set()
        sender.join()
    assert result["keyboard_interrupt"] is True
    assert result["interrupted"] is True
    assert result["elapsed_s"] < 60
    assert result["devices"][0]["settle"]["status"] == "interrupted"
    # The caller's own SIGINT handling is back in place.
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
