#!/usr/bin/env python3
"""What a cell's look for a resume to say costs (``InKernel.resume_before_cell``), the two ways side by side.

Method: an empty park lock file where a kernel's endpoint makes it, ``<runtime>/gpucleanup/<instance>.park`` under a
runtime directory of Jupyter's usual depth (``<tmp>/home/user/.local/share/jupyter/runtime``, built here), then for
each way, interleaved, 7 runs of 20,000 looks; the figure is each way's fastest run, per look. Ways: ``os.stat``
(:func:`gpucleanup.park.resume_news.take`: what each cell did before 2026-12-07, giving the interpreter lock up
around the call) and ``library`` (:class:`gpucleanup.park.resume_news.NewsLook`, an ``lstat`` in the library
through ``gpucleanup_file_size``, keeping it: what each cell does now).

Usage: python tests/bench/bench_news_look.py   (PYTHONPATH=ipython_ext; GPUCLEANUP_LIBRARY: the library's build)
"""

from __future__ import annotations

import pathlib
import sys
import tempfile
import time

from gpucleanup.park import resume_news


def main() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        private = pathlib.Path(tmp, "home/user/.local/share/jupyter/runtime/gpucleanup")
        private.mkdir(parents=True, mode=0o700)
        lock = private / "4242-0123456789abcdef.park"
        lock.write_bytes(b"")
        look = resume_news.NewsLook()
        ways = {"os.stat": lambda: resume_news.take(lock), "library": lambda: look.take(lock)}
        best = {name: float("inf") for name in ways}
        for _ in range(7):
            for name, take in ways.items():
                started = time.perf_counter()
                for _ in range(20000):
                    if take() is not None:
                        raise SystemExit("bench_news_look: an empty lock file had news")
                best[name] = min(best[name], (time.perf_counter() - started) / 20000 * 1e6)
    print("per look, fastest of 7 runs of 20,000: " + ", ".join(f"{name} {us:.2f} us" for name, us in best.items())
          + f"; library/os.stat {best['library'] / best['os.stat']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
