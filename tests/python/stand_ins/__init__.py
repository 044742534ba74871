"""Small stand-ins for GPU frameworks, for the adapters' contract tests.

Each ``install_*`` builds fake modules that mimic the few calls the adapter makes,
puts them into ``sys.modules`` (through pytest's ``monkeypatch``, so they leave
afterwards) and returns the stand-in, whose ``calls`` list records every call and
whose ``violations`` list records every call that would have initialised CUDA,
created a context or touched a device that was not given.
"""

from .world import World  # noqa: F401
from .cupy import install_cupy  # noqa: F401
from .torch import install_torch  # noqa: F401
from .numba import install_numba  # noqa: F401
from .jax import install_jax  # noqa: F401
from .rmm import install_rmm  # noqa: F401
from .tensorflow import install_tensorflow  # noqa: F401
from .pycuda import install_pycuda  # noqa: F401
