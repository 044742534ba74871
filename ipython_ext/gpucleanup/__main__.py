"""``python -m gpucleanup``: the ``gpucleanup`` command (``gpucleanup.outside.cli``)."""

import sys

from .outside.cli import main

if __name__ == "__main__":
    sys.exit(main())
