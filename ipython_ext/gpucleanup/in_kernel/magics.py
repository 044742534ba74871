"""``%gpumem``: its arguments.

The magic itself is a method of the extension object (``extension.GPUCleanup.gpumem``,
so that one object is the magics, the configurable and the event handler); this
module holds its argument parser. Finding GPU arrays and tensors is framework
knowledge: ``frameworks/objects.py``.
"""

from __future__ import annotations

import difflib
import inspect
import re
import textwrap
from typing import Any, Callable

from IPython.core.error import UsageError
from IPython.core.magic_arguments import MagicHelpFormatter, argument, magic_arguments, parse_argstring
from IPython.utils.process import arg_split

__all__ = ["gpumem_arguments", "parse_gpumem", "settings_help", "with_settings", "OPTIONS", "PLOT_ALL", "unregister_magics"]

OPTIONS = ("--json", "--drain", "--history", "--vars", "--release", "--trace", "--dask", "--plot", "--off", "--on",
           "--park")
USAGE = ("%gpumem [--json] [--drain] [--history [N]] [--vars [N]] [--release out|traceback|NAME] "
         "[--trace [on|off]] [--dask [on|off]] [--plot [N]] [--off | --on] [--park]")


class _All:
    """``--plot`` with no N: every record the history keeps (not a str: argparse would convert it as an N)."""

    def __repr__(self) -> str:
        return "all"


PLOT_ALL = _All()

_ARGUMENTS = [
    magic_arguments(),
    argument("--json", action="store_true", help="The status as JSON with exact bytes (a dict: d = %%gpumem --json)."),
    argument("--drain", action="store_true", help="Clean up now, as after a cell, and print the summary line."),
    argument(
        "--history",
        nargs="?",
        const=10,
        default=None,
        type=int,
        metavar="N",
        help="The records of the last N cells (default 10).",
    ),
    argument(
        "--vars",
        nargs="?",
        const=20,
        default=None,
        type=int,
        metavar="N",
        help=(
            "The N largest GPU arrays and tensors the kernel keeps (default 20): name, what holds it "
            "(a variable, the output cache as Out[N], or the last traceback as function: variable), type, "
            "shape, dtype, device and bytes."
        ),
    ),
    argument(
        "--release",
        default=None,
        metavar="WHAT",
        help=(
            "Let go of GPU memory the kernel keeps, then clean up and say what came back. 'out': the "
            "output-cache entries (Out[N], _N, _) that hold a GPU array or tensor, only those; 'traceback': "
            "the local variables of the last traceback's frames (the error and its text stay; %%debug can no "
            "longer show those variables); NAME: a variable and every reference IPython keeps to it (as %%xdel)."
        ),
    ),
    argument(
        "--trace",
        nargs="?",
        const="show",
        default=None,
        metavar="on|off",
        help=(
            "Raw GPU allocations traced to their Python line through CUPTI. 'on' starts tracing (CUDA must "
            "already be in use; CUPTI is loaded from $GPUCLEANUP_CUPTI, the nvidia-cuda-cupti wheel or the CUDA "
            "Toolkit), 'off' stops it; alone, the live traced allocations by site, thread and library. Only "
            "allocation and free calls are traced. CUPTI before 13.3 allows one subscriber per process: with "
            "torch.profiler or Nsight running, the trace cannot start, and says so."
        ),
    ),
    argument(
        "--dask",
        nargs="?",
        const="show",
        default=None,
        metavar="on|off",
        help=(
            "The Dask workers of this kernel's client (distributed's default client). 'on' registers "
            "gpucleanup's worker plugin (each worker cleans its GPU memory once idle after its tasks), 'off' "
            "removes it; alone, per worker: GPU, device used, live, cached, freed since the last look, cleanups, "
            "state. With --drain: clean every idle worker now (busy ones are skipped and say so)."
        ),
    ),
    argument(
        "--plot",
        nargs="?",
        const=PLOT_ALL,
        default=None,
        type=int,
        metavar="N",
        help=(
            "Device memory over the last N cells (default: every record kept, see history_size), per device in "
            "use: used after the cleanup, live, cached and outside every pool, and what each cleanup freed. "
            "Rich frontends get an image (PNG with matplotlib, else SVG), terminals one text sparkline per "
            "series. With --json: the timeline's data with exact bytes."
        ),
    ),
    argument(
        "--park",
        action="store_true",
        help=(
            "Park this kernel as soon as this cell has ended: every byte of its GPU memory, the CUDA context "
            "included, goes to host memory through the driver's checkpoint calls, and the GPU is free for "
            "others. The next cell brings it back first and says so. Refused, with the reason, where a "
            "restore is known to fail or host memory cannot hold it."
        ),
    ),
    argument("--off", action="store_true", help="Pause the automatic cleanup after each cell."),
    argument("--on", action="store_true", help="Resume the automatic cleanup after each cell."),
]


def settings_help(options_cls) -> str:
    """Every configurable trait of ``options_cls``: name, default and the first sentence of its help.

    Made from the traits themselves, so that ``%gpumem?`` names every setting there is.
    """
    traits = options_cls.class_traits(config=True)
    rows = []
    for name in sorted(traits):
        trait = traits[name]
        rows.append((f"{name} = {trait.default()!r}", _first_sentence(trait.help or "")))
    width = max(len(left) for left, _ in rows)
    lines = [f"Settings ({len(rows)}): %config GPUCleanup.<name> = value at run time, or c.GPUCleanup.<name> in",
             "ipython_config.py / ipython_kernel_config.py; %config GPUCleanup describes each in full.",
             ""]
    for left, right in rows:
        wrapped = textwrap.wrap(right, width=max(40, 100 - width - 4)) or [""]
        lines.append(f"  {left.ljust(width)}  {wrapped[0]}")
        lines += [" " * (width + 4) + more for more in wrapped[1:]]
    return "\n".join(lines)


def _first_sentence(text: str) -> str:
    """Up to the first full stop that ends a sentence (not the one of "e.g.")."""
    match = re.search(r"(?<!e\.g)(?<!i\.e)\.(\s|$)", text)
    return text[:match.start() + 1] if match else text


def with_settings(options_cls) -> Callable:
    """Append :func:`settings_help` of ``options_cls`` to the decorated function's docstring."""

    def decorate(func: Callable) -> Callable:
        # dedented first, as IPython's own magics read in %gpumem?: the settings appended below start at the margin
        func.__doc__ = inspect.cleandoc(func.__doc__ or "") + "\n\n" + settings_help(options_cls) + "\n"
        return func

    return decorate


class _HelpFormatter(MagicHelpFormatter):
    """IPython's, except that an option's value is written as the usage line writes it (``--history [N]``),
    not wrapped in ``<...>`` (``--history <[N]>``), which IPython adds for reStructuredText."""

    def _format_action_invocation(self, action) -> str:
        if not action.option_strings or action.nargs == 0:
            return super()._format_action_invocation(action)
        value = self._format_args(action, action.dest.upper())
        return ", ".join(f"{option} {value}" for option in action.option_strings)


def gpumem_arguments(func: Callable) -> Callable:
    """Decorate the ``gpumem`` magic method with its arguments (``%gpumem?`` shows them)."""
    for deco in reversed(_ARGUMENTS):
        func = deco(func)
    # "--dr" must not silently mean --drain (MagicArgumentParser takes no allow_abbrev)
    func.parser.allow_abbrev = False
    # the help again, as magic_arguments made it, with the options written as the usage line writes them
    func.parser.formatter_class = _HelpFormatter
    func.__doc__ = func.parser.format_help()
    return func


def parse_gpumem(method: Callable, line: str):
    """Parse a ``%gpumem`` line; a wrong flag raises ``UsageError`` saying how to fix it."""
    try:
        args = parse_argstring(method, line)
    except UsageError as exc:
        raise UsageError(_fix_hint(str(exc), line)) from None
    except ValueError as exc:  # shlex: "No closing quotation", "No escaped character"
        raise UsageError(f"%gpumem: cannot read the options ({exc}): check the quotes. Usage: {USAGE}") from None
    given = [token.split("=", 1)[0] for token in arg_split(line, posix=True)]
    for option in OPTIONS:
        if given.count(option) > 1:
            # argparse would keep the last one silently: "--history 3 --history 30" is a typo either way
            raise UsageError(f"%gpumem: {option} is given {given.count(option)} times: pass it once. Usage: {USAGE}")
    if args.off and args.on:
        raise UsageError(f"%gpumem: --off and --on contradict each other: pass one of them. Usage: {USAGE}")
    if args.release is not None and (args.drain or args.off or args.on):
        raise UsageError(f"%gpumem: --release cleans up by itself: pass it alone. Usage: {USAGE}")
    if args.trace is not None and args.trace not in ("on", "off", "show"):
        raise UsageError(f"%gpumem: --trace takes on or off (or nothing, to show the trace), got {args.trace!r}. "
                         f"Usage: {USAGE}")
    if args.dask is not None and args.dask not in ("on", "off", "show"):
        raise UsageError(f"%gpumem: --dask takes on or off (or nothing, to show the workers), got {args.dask!r}. "
                         f"Usage: {USAGE}")
    if args.dask is not None and (args.off or args.on or args.release is not None or args.trace is not None
                                  or (args.drain and args.dask != "show")):
        raise UsageError(f"%gpumem: --dask goes alone, with --json, or (to drain the workers) with --drain. "
                         f"Usage: {USAGE}")
    if args.trace is not None and (args.drain or args.off or args.on or args.release is not None):
        raise UsageError(f"%gpumem: --trace goes alone (or with --json). Usage: {USAGE}")
    if args.park:
        others = [f"--{flag}" for flag in ("json", "drain", "off", "on") if getattr(args, flag)]
        others += [f"--{flag}" for flag in ("release", "trace", "dask", "history", "vars", "plot")
                   if getattr(args, flag) is not None]
        if others:
            raise UsageError(f"%gpumem: --park goes alone, not with {' or '.join(others)}. Usage: {USAGE}")
    if args.plot is not None:
        others = [f"--{flag}" for flag in ("drain", "off", "on") if getattr(args, flag)]
        others += [f"--{flag}" for flag in ("release", "trace", "dask", "history", "vars") if getattr(args, flag) is not None]
        if others:
            raise UsageError(f"%gpumem: --plot goes alone (or with --json), not with {' or '.join(others)}: run them "
                             f"one after the other. Usage: {USAGE}")
    for flag in ("history", "vars", "plot"):
        value = getattr(args, flag)
        if value is not None and value is not PLOT_ALL and value < 1:
            raise UsageError(f"%gpumem: --{flag} N needs N >= 1, got {value}. Usage: {USAGE}")
    return args


def _fix_hint(message: str, line: str) -> str:
    hint = ""
    for token in line.split():
        if token.startswith("-") and token not in OPTIONS:
            close = difflib.get_close_matches(token if token.startswith("--") else "-" + token, OPTIONS, n=1)
            if close:
                hint = f" Did you mean {close[0]}?"
            break
    return f"%gpumem: {message}.{hint} Usage: {USAGE} (details: %gpumem?)"


def unregister_magics(manager: Any, owner: Any) -> None:
    """Takes ``%gpumem`` and ``owner``'s registry entry out of IPython's magics ``manager`` (unload), where they are
    still ``owner``'s (a newer load's are left alone)."""
    line = manager.magics.get("line", {})
    bound = line.get("gpumem")
    if bound is not None and getattr(bound, "__self__", None) is owner:
        del line["gpumem"]
    if manager.registry.get(type(owner).__name__) is owner:
        del manager.registry[type(owner).__name__]
