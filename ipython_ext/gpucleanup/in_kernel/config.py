"""What a user can configure: the traits of the ``GPUCleanup`` extension object (:class:`GPUCleanupOptions`).

They are set in ``ipython_config.py`` / ``ipython_kernel_config.py`` or with ``%config``; a bad value never takes
effect, and the sentence that says so names the values allowed.
"""

from __future__ import annotations

import copy
import sys
from typing import Any, List, Tuple

from traitlets import Bool, Dict, Enum, Float, Int, TraitError, validate
from traitlets.config import Configurable
from traitlets.config.loader import DeferredConfigString

# The adapters' names (importing the adapters imports no framework: they look at sys.modules only);
# imported here under its own name so that the checks below read it through this module.
from ..frameworks import known_frameworks

__all__ = ["GPUCleanupOptions", "GC_POLICIES", "SHOW_POLICIES", "allowed_values"]

GC_POLICIES = ("auto", "always", "never")
SHOW_POLICIES = ("auto", "always", "never")
RELEASE_POLICIES = ("cell", "auto", "idle", "rerun")
# A record is a few KiB: 100,000 of them is already hundreds of MiB of host memory.
MAX_HISTORY_SIZE = 100_000
# A settle longer than a day is a hang by another name.
MAX_SETTLE_TIMEOUT_S = 86_400.0


class _Int(Int):
    """An Int that also refuses True and False (a bool is an int to Python, never a count here)."""

    def validate(self, obj, value):
        if isinstance(value, bool):
            self.error(obj, value)
        return super().validate(obj, value)


class _Float(Float):
    """A Float that also refuses True and False, NaN, and ints too large for a float."""

    def validate(self, obj, value):
        if isinstance(value, bool):
            self.error(obj, value)
        try:
            value = super().validate(obj, value)
        except OverflowError:
            self.error(obj, value)
        if value != value:
            raise TraitError(f"The '{self.name}' trait must be a finite number, not {value!r}.")
        return value


# %config GPUCleanup names each trait's type: <Int>, <Float>, as for traitlets' own (not the private names).
_Int.__name__ = _Int.__qualname__ = "Int"
_Float.__name__ = _Float.__qualname__ = "Float"


class GPUCleanupOptions(Configurable):
    """Traits of the GPUCleanup extension object.

    Set them in ``ipython_config.py`` / ``ipython_kernel_config.py``::

        c.GPUCleanup.gc = "never"
        c.GPUCleanup.frameworks = {"jax": False}

    or at run time with ``%config GPUCleanup.settle_timeout = 5``. The traits live on a ``Configurable`` mixin so
    that the one object the extension registers is still named ``GPUCleanup`` (the config section and the
    ``%config`` name), and so that its config handling below comes before ``Configurable``'s in the MRO; values are
    checked by traitlets, and a refused value raises ``TraitError`` naming the trait.

    Config is read in two ways, and a bad value is handled differently in each:

    - ``%config GPUCleanup.gc = "sometimes"`` (``update_config``): every value of the statement is checked before
      any is set; a refused one is said in one paragraph on stderr that says which values are allowed, nothing
      changes, and the value is taken out of the statement so that the shell does not keep it in its own config
      (where a later ``%reload_ext gpucleanup`` would meet it again);
    - a config file, or the shell's config at load time: each bad value is ignored (the default stays), and
      ``ignored_config`` says which, for the extension to print.
    """

    enabled = Bool(
        True,
        help="Clean up after every cell. %gpumem --off / --on toggle it at run time.",
    ).tag(config=True)

    frameworks = Dict(
        value_trait=Bool(),
        default_value={},
        help=(
            "Framework adapters to switch on or off by name, e.g. {'jax': False}. "
            f"Adapters not named here are on. Known names: {', '.join(known_frameworks())}."
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
            "Garbage collection after a cell. 'auto': only when it can release GPU memory: skipped when "
            "the driver has seen no change since the last cleanup and either no framework kept a cache and "
            "that cleanup left no live GPU memory, or the frameworks' figures are still the ones it left and "
            "no name that held GPU memory was unbound; otherwise first a young collection "
            "(generations 0 and 1, cheap); "
            "a full collection only when the cell also unbound a name of the user namespace or a GPU "
            "array/tensor from it and GPU memory is still live. 'always': a full gc.collect() after every "
            "cell that used the GPU. 'never': no collection."
        ),
    ).tag(config=True)

    settle_timeout = _Float(
        30.0,
        min=0.0,
        max=MAX_SETTLE_TIMEOUT_S,
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

    history_size = _Int(
        100,
        min=1,
        max=MAX_HISTORY_SIZE,
        help="How many cell records to keep for %gpumem --history and the status endpoint.",
    ).tag(config=True)

    status_server = Bool(
        True,
        help="Start the status endpoint (gpucleanup on the command line reads it) when the extension loads.",
    ).tag(config=True)

    release = Enum(
        RELEASE_POLICIES,
        default_value="rerun",
        help=(
            "When the caches a cell leaves are given back. 'cell': device caches, pinned host pools and "
            "the driver's pools after every cell. 'auto': device caches and driver pools after every cell, "
            "pinned host pools once the kernel has been idle idle_release_s seconds (pinning again costs "
            "about 145 ms per GiB, so cells run back to back keep them). 'idle': everything once the kernel "
            "has been idle idle_release_s seconds; a cell that starts sooner finds the caches it left. "
            "'rerun' (the default): the driver's pools after every cell; the frameworks' device caches and "
            "pinned host pools once the kernel has been idle idle_release_s seconds, or as another cell "
            "starts (it waits for them, at most settle_timeout), so only the same cell run again finds them. "
            "%gpumem --drain always gives everything back at once. PyCUDA's pools, which only the kernel's "
            "thread can empty, are emptied as each cell ends under every policy."
        ),
    ).tag(config=True)

    idle_release_s = _Float(
        1.0,
        min=0.05,
        max=3600.0,
        help="Seconds the kernel must stay idle before a release deferred by 'release' runs.",
    ).tag(config=True)

    park_after_idle_s = _Float(
        0.0,
        min=0.0,
        max=30 * 24 * 3600.0,
        help=(
            "Park this kernel once it has been idle this many seconds: all of its GPU memory, the CUDA "
            "context included, goes to host memory and its next cell brings it back (as %gpumem --park "
            "does). 0, the default, never parks by itself."
        ),
    ).tag(config=True)

    status_max_peers = _Int(
        64,
        min=1,
        max=1024,
        help=(
            "Most connections the status endpoint keeps open at once, per socket (requests, records); "
            "never more than an eighth of the process's open-file limit. Connections beyond are closed "
            "at once, so a flood cannot take the kernel's file descriptors."
        ),
    ).tag(config=True)

    release_after_oom = Bool(
        True,
        help=(
            "After a cell fails with a GPU out-of-memory error, clear the local variables of its "
            "traceback's frames before the cleanup, so that the memory they hold comes back for the next "
            "cell (the error and its printed traceback stay; %debug can no longer show those variables). "
            "False keeps them."
        ),
    ).tag(config=True)

    trace_allocations = Bool(
        False,
        help=(
            "Trace raw GPU allocations to their Python line through CUPTI (as %gpumem --trace on), from the "
            "first cell after which CUDA is in use. Each cell's line then names the raw allocations it made and "
            "kept (size, count, cell and line, threads). Costs a few microseconds per allocation call only; CUPTI "
            "allows one subscriber per process before 13.3, so a profiler (torch.profiler, Nsight) and the trace "
            "exclude each other."
        ),
    ).tag(config=True)

    outside_warning_mib = _Int(
        256,
        min=0,
        max=1 << 30,
        help=(
            "Say once per device when device memory outside every pool (no framework, no framework cache, "
            "no driver pool accounts for it: raw allocations, or another process on the GPU) has grown this "
            "many MiB since gpucleanup loaded. 0: never. Each cell's line says its own growth of 16 MiB or more."
        ),
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

    # ------------------------------------------------------------ config

    @classmethod
    def class_get_help(cls, inst=None):
        """``%config GPUCleanup``: traitlets' help with the section's own name as its title.

        traitlets titles it with the class and its bases (``GPUCleanup(Magics, GPUCleanupOptions)``),
        which are how the extension is built, not what a user configures.
        """
        text = super().class_get_help(inst)
        first, _, rest = text.partition("\n")
        if first.endswith(" options") and rest.startswith("-"):
            title = f"{cls.__name__} options"
            rest = rest.partition("\n")[2]
            # underlined with '=': %config strips a leading '--' from every line (the options' prefix)
            return f"{title}\n{'=' * len(title)}\n{rest}"
        return text

    def _own_sections(self, cfg: Any) -> List[str]:
        names = self.section_names()
        return [name for name in names if dict.__contains__(cfg, name)]

    def refused_values(self, values: dict) -> List[Tuple[str, Any, str]]:
        """``(trait, value, allowed)`` for each value of ``values`` this object would refuse.

        Checks with the traits' own validation (type, range, and the cross-validators
        above) on a copy of each value; sets nothing.
        """
        refused = []
        traits = self.traits(config=True)
        for name, value in values.items():
            trait = traits.get(name)
            if trait is None:
                continue  # unknown names: traitlets warns about them itself
            try:
                if isinstance(value, DeferredConfigString):
                    # from the command line (--GPUCleanup.history_size=50): the trait reads the text, as
                    # traitlets does when it applies it
                    value = _Typed(value)
                    trait._validate(self, trait.from_string(value))
                else:
                    trait._validate(self, copy.deepcopy(value))
            except Exception:  # TraitError; or a value that cannot even be copied, read or compared
                refused.append((name, value, allowed_values(name, trait)))
        return refused

    def _split_config(self, cfg: Any) -> Tuple[Any, List[Tuple[str, Any, str]]]:
        """(cfg without the values this object refuses, the refused ones)."""
        refused: List[Tuple[str, Any, str]] = []
        sections = self._own_sections(cfg)
        for section in sections:
            refused.extend(self.refused_values(dict(cfg[section])))
        if not refused:
            return cfg, []
        clean = copy.deepcopy(cfg)
        for section in sections:
            for name, _, _ in refused:
                dict.pop(clean[section], name, None)
        return clean, refused

    def _load_config(self, cfg, section_names=None, traits=None):
        # At construction (config file, or values the shell kept): bad values are
        # ignored and reported, never raised, so gpucleanup still loads.
        clean, refused = self._split_config(cfg)
        if refused:
            seen = getattr(self, "_ignored", None)
            if seen is None:
                seen = self._ignored = []
            for entry in refused:
                line = ignored_sentence(type(self).__name__, *entry)
                if line not in seen:
                    seen.append(line)
        super()._load_config(clean, section_names=section_names, traits=traits)

    def update_config(self, config):
        """``%config``: all values checked before any is set; a refused one changes nothing."""
        refused = []
        for section in self._own_sections(config):
            bad = self.refused_values(dict(config[section]))
            for name, _, _ in bad:
                # %config passes the same statement to every configurable, the shell
                # after us (they go in name order): without the value it cannot keep it
                dict.pop(config[section], name, None)
            refused.extend(bad)
        if refused:
            # Said here, on stderr, as the one sentence a user reads: %config would hand an exception to
            # logging.error, which prints "ERROR:root:" before it.
            print(" ".join(refused_sentence(type(self).__name__, *entry) for entry in refused), file=sys.stderr)
            return
        super().update_config(config)

    @property
    def ignored_config(self) -> List[str]:
        """One sentence per config value ignored at construction (bad values in a config file)."""
        return list(getattr(self, "_ignored", None) or [])

    def framework_enabled(self, name: str) -> bool:
        return bool(self.frameworks.get(name, True))


def allowed_values(name: str, trait: Any) -> str:
    """What a trait accepts, as a user would write it."""
    if isinstance(trait, Enum):
        return "one of " + ", ".join(repr(v) for v in trait.values)
    if isinstance(trait, Bool):
        return "True or False"
    if isinstance(trait, (Int, Float)):
        kind = "a whole number" if isinstance(trait, Int) else "a finite number"
        low, high = getattr(trait, "min", None), getattr(trait, "max", None)
        if low is not None and high is not None:
            return f"{kind} from {_number(low)} to {_number(high)}"
        if low is not None:
            return f"{kind} >= {_number(low)}"
        return kind
    if name == "frameworks":
        known = known_frameworks()
        names = ", ".join(known) if known else "cupy, torch, ..."
        return f"a dict of framework names to True/False, e.g. {{'jax': False}} (names: {names})"
    return trait.info()


def _number(value: float) -> str:
    return f"{value:,.0f}" if float(value).is_integer() else f"{value:g}"


def refused_sentence(cls: str, name: str, value: Any, allowed: str) -> str:
    return (
        f"{cls}.{name} = {_short_repr(value)} refused: {name} must be {allowed}. "
        f"Nothing changed; %config {cls} lists every option."
    )


def ignored_sentence(cls: str, name: str, value: Any, allowed: str) -> str:
    return (
        f"ignored {cls}.{name} = {_short_repr(value)} from the configuration: {name} must be {allowed}; "
        "using the default"
    )


class _Typed(str):
    """A value as typed on the command line: said as typed, without the quotes of a str's repr."""

    def __repr__(self) -> str:
        return str(self)


def _short_repr(value: Any) -> str:
    try:
        text = repr(value)
    except Exception:  # an int too long to convert, a value whose __repr__ raises
        text = f"<a {type(value).__name__}>"
    return text if len(text) <= 60 else text[:57] + "..."

