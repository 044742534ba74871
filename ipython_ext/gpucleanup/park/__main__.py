"""``python -m gpucleanup.park {state,resume} PID`` (:func:`gpucleanup.park.steps.main`)."""

import sys

from .steps import main

if __name__ == "__main__":
    sys.exit(main())
