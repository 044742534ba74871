"""The package's version, read once from VERSION beside this file.

A leaf module: the CLI, the status endpoint and the server import it instead of the
package's face (``gpucleanup/__init__.py``).
"""

from __future__ import annotations

__all__ = ["__version__"]


def _read_version() -> str:
    # The version lives once, in VERSION beside this file (CMake and pyproject.toml read it too).
    from importlib import resources

    try:
        return resources.files(__package__).joinpath("VERSION").read_text(encoding="ascii").strip()
    except OSError:  # pragma: no cover - a broken install
        return "unknown"


__version__ = _read_version()
