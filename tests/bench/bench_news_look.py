#!/usr/bin/env python3
"""What a cell's look for a resume to say costs (``InKernel.resume_before_cell``), the two ways side by side.

Method: an empty park lock file where a kernel's endpoint makes it, ``<runtime>/gpucleanup/<instance>.park`` under a
runtime directory of Jupyter's usual depth (``<tmp>/home/user/.local/share/jupyter/runtime``, built here), then for
each way, interleaved, 7 runs of 20,000 looks; the figure is each way's fastest run, per look. Ways: ``stat``
(:func:`gpucleanup.park.resume_news.take`, a ``stat`` of the path: what each cell did before 2026-12-07),
``os.fstat`` (:class:`gpucleanup.park.resume_news.NewsLook` over the file held open, sized by ``os.fstat``) and
``library`` (the same, sized by ``gpucleanup_file_size``: what each cell does now). The two Python calls give up
the interpreter lock, the library's keeps it. A path walk costs more on an overlay or network file system than on
this one; the ratio here is a floor.

Usage: python tests/bench/bench_news_look.py   (PYTHONPATH=ipython_ext; GPUCLEANUP_LIBRARY: the library's build)
"""

from __future__ import annotations

import os
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
        def os_fstat(fd: int) -> int:
            info = os.fstat(fd)
            return info.st_size if info.st_nlink > 0 else -1

        by_os, by_library = resume_news.NewsLook(size=os_fstat), resume_news.NewsLook()
        ways = {"stat": lambda: resume_news.take(lock), "os.fstat": lambda: by_os.take(lock),
                "library": lambda: by_library.take(lock)}
        best = {name: float("inf") for name in ways}
        for _ in range(7):
            for name, take in ways.items():
                started = time.perf_counter()
                for _ in range(20000):
                    if take() is not None:
                        raise SystemExit("bench_news_look: an empty lock file had news")
                best[name] = min(best[name], (time.perf_counter() - started) / 20000 * 1e6)
        by_os.close()
        by_library.close()
    print("per look, fastest of 7 runs of 20,000: " + ", ".join(f"{name} {us:.2f} us" for name, us in best.items())
          + f"; library/stat {best['library'] / best['stat']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
