"""Parking: a process's whole GPU footprint moved to host memory and back through the driver's checkpoint calls.

``gpucleanup.park.park(pid)`` and ``resume(pid)`` for any process, ``python -m gpucleanup.park {state,resume} PID``;
the steps are :mod:`.steps`, the helper process :mod:`.native_step`, the lock :mod:`.lock`, the kernel's side
:mod:`.kernel_side`, a park from outside :mod:`.from_outside`.
"""

from .steps import Limits, Outcome, ParkRefused, park, resume, state

__all__ = ["Limits", "Outcome", "ParkRefused", "park", "resume", "state"]
