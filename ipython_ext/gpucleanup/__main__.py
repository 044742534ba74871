"""``python -m gpucleanup``: the ``gpucleanup`` command (``gpucleanup.cli``)."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
