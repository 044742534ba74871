"""How gpucleanup's own sentences start: ``gpucleanup · <text>``.

A leaf module: the face (the extension, ``%gpumem``, the parking notes, the Dask plugin, the
report) builds every prefixed sentence through :func:`say`, so the prefix and its separator are
written once and no module needs the report to speak.
"""

from __future__ import annotations

__all__ = ["PREFIX", "SEP", "say", "printable"]

PREFIX = "gpucleanup"
SEP = " · "


def say(*parts: str) -> str:
    """``say("GPU0 freed 1.0 GiB")`` -> ``"gpucleanup · GPU0 freed 1.0 GiB"``; several parts are joined
    with the same separator (``say("GPU0 ...", "pinned ...")``)."""
    return SEP.join([PREFIX, *parts])


def printable(text: object) -> str:
    """``text`` with control characters escaped (``\\n``, ``\\x1b``): a path or a name from outside (the
    environment, a cgroup, a file) stays one line and sends nothing to a terminal but its characters."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in str(text))
