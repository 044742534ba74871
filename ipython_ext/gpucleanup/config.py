"""What a user can configure: the traits of the ``GPUCleanup`` extension object.

Set them in ``ipython_config.py`` / ``ipython_kernel_config.py``::

    c.GPUCleanup.gc = "never"
    c.GPUCleanup.frameworks = {"jax": False}

or at run time with ``%config GPUCleanup.settle_timeout = 5``. The traits live on
a ``HasTraits`` mixin so that the one object the extension registers is still
named ``GPUCleanup`` (the config section and the ``%config`` name); values are
checked by traitlets, and a refused value raises ``TraitError`` naming the trait.
"""

from __future__ import annotations

from traitlets import Bool, Dict, Enum, Float, HasTraits, Int, TraitError, validate

__all__ = ["GPUCleanupOptions", "GC_POLICIES", "SHOW_POLICIES", "known_frameworks"]

GC_POLICIES = ("auto", "always", "never")
SHOW_POLICIES = ("auto", "always", "never")


def known_frameworks() -> list[str] | None:
    """Names of the framework adapters, or None when the adapters are not importable.

    Importing ``gpucleanup.frameworks`` imports no framework (the adapters look at
    ``sys.modules`` only), so this is safe at configuration time.
    """
    try:
        from .frameworks import ADAPTERS
    except Exception:
        return None
    adapters = ADAPTERS.values() if isinstance(ADAPTERS, dict) else ADAPTERS
    try:
        return sorted(str(a.name) for a in adapters)
    except Exception:
        return None


class GPUCleanupOptions(HasTraits):
    """Traits of the GPUCleanup extension object (see the module docstring)."""

    enabled = Bool(
        True,
        help="Clean up after every cell. %gpumem --off / --on toggle it at run time.",
    ).tag(config=True)

    frameworks = Dict(
        value_trait=Bool(),
        default_value={},
        help=(
            "Framework adapters to switch on or off by name, e.g. {'jax': False}. "
            "Adapters not named here are on. Known names: cupy, torch, numba, jax, rmm, ..."
        ),
    ).tag(config=True)

    pinned = Bool(
        True,
        help="Also empty the frameworks' pinned (page-locked) host memory pools, on a background thread.",
    ).tag(config=True)

    driver_pools = Bool(
        True,
        help=(
            "Trim the CUDA driver's stream-ordered memory pools (cuMemPoolTrimTo) after the framework "
            "drains. The settle before them is one native call that also trims once; this switch "
            "controls the trim after the frameworks released their caches."
        ),
    ).tag(config=True)

    gc = Enum(
        GC_POLICIES,
        default_value="auto",
        help=(
            "Garbage collection after a cell. 'auto': only when a framework reports live GPU memory "
            "(otherwise gc cannot release any): first a young collection (generations 0 and 1, cheap); "
            "a full collection only when the cell also unbound a name of the user namespace or a GPU "
            "array/tensor from it and GPU memory is still live. 'always': a full gc.collect() after every "
            "cell that used the GPU. 'never': no collection."
        ),
    ).tag(config=True)

    settle_timeout = Float(
        30.0,
        min=0.0,
        help=(
            "Seconds to wait at most for queued GPU work before freeing (0: do not wait). A device "
            "still busy at the limit is skipped and the cell returns."
        ),
    ).tag(config=True)

    show = Enum(
        SHOW_POLICIES,
        default_value="auto",
        help=(
            "When to print the summary line: 'auto' when the cell changed GPU memory, something was "
            "freed or something went wrong; 'always' after every cell while CUDA is in use; 'never'."
        ),
    ).tag(config=True)

    history_size = Int(
        100,
        min=1,
        help="How many cell records to keep for %gpumem --history and the status endpoint.",
    ).tag(config=True)

    status_server = Bool(
        True,
        help="Start the status endpoint (gpucleanup on the command line reads it) when the extension loads.",
    ).tag(config=True)

    @validate("settle_timeout")
    def _check_settle_timeout(self, proposal):
        value = proposal["value"]
        if value != value or value in (float("inf"), float("-inf")):
            raise TraitError(f"The 'settle_timeout' trait must be a finite number of seconds >= 0, not {value!r}.")
        return value

    @validate("frameworks")
    def _check_frameworks(self, proposal):
        value = dict(proposal["value"])
        for name in value:
            if not isinstance(name, str):
                raise TraitError(f"The 'frameworks' trait needs framework names as keys, not {name!r}.")
        known = known_frameworks()
        if known:
            unknown = sorted(set(value) - set(known))
            if unknown:
                raise TraitError(
                    f"The 'frameworks' trait got unknown framework name(s) {', '.join(map(repr, unknown))}; "
                    f"known: {', '.join(known)}."
                )
        return value

    def framework_enabled(self, name: str) -> bool:
        return bool(self.frameworks.get(name, True))
