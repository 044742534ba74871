"""The frameworks' figures as the engine reads them: :class:`Held` bytes per device, one
:class:`FrameworkFigures` per framework, :class:`LastPass` (what the last full cleanup left), and
:class:`FrameworkReader`, which finds the adapters in use and reads each one's figures once, keeping the last
answer so that an idle cell's comparison is one of identity. Also the one computation of memory "outside every
pool" that both ``%gpumem`` and a cell's record use.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple

from .releases import Note, guarded, index_of

__all__ = ["Held", "FrameworkFigures", "Stats", "LastPass", "FrameworkReader", "outside_every_pool",
           "pools_reserved", "live_total"]


@dataclass(frozen=True)
class Held:
    """A framework's bytes on one device, or in its pinned host pools: live, and cached (given back
    on a drain, or, for a framework that never gives memory back, reserved)."""

    live: int = 0
    cached: int = 0

    @classmethod
    def read(cls, entry: Any) -> Optional["Held"]:
        if not isinstance(entry, dict):
            return None
        return cls(int(entry.get("live_bytes") or 0), int(entry.get("cached_bytes") or 0))

    def as_dict(self) -> dict:
        return {"live_bytes": self.live, "cached_bytes": self.cached}


_NOTHING_HELD = Held()


@dataclass
class FrameworkFigures:
    """One framework's figures, read once from its adapter's ``stats`` into typed values."""

    devices: Dict[int, Held] = field(default_factory=dict)
    pinned: Optional[Held] = None  # None: not known
    notes: List[str] = field(default_factory=list)
    releases: bool = True  # False: a pool that never gives memory back: its cache is reserved, not freeable
    fix: Optional[str] = None  # what to set so that it does
    pools: List[dict] = field(default_factory=list)  # pools of the user's making (PyCUDA), one entry each

    @classmethod
    def read(cls, adapter: Any, result: dict) -> "FrameworkFigures":
        devices = {}
        for key, entry in (result.get("devices") or {}).items():
            idx, held = index_of(key), Held.read(entry)
            if idx is not None and held is not None:
                devices[idx] = held
        pools = result.get("pools")
        return cls(devices=devices, pinned=Held.read(result.get("pinned")), notes=list(result.get("notes") or []),
                   releases=bool(getattr(adapter, "can_release", True)),
                   fix=_text_or_none(getattr(adapter, "reserved_fix", None)),
                   pools=[dict(p) for p in pools if isinstance(p, dict)] if isinstance(pools, list) else [])

    def on(self, i: int) -> Held:
        return self.devices.get(i, _NOTHING_HELD)


Stats = Dict[str, FrameworkFigures]  # per framework name


@dataclass
class LastPass:
    """What the last full cleanup left: per device its free bytes and driver pools' reserved
    bytes after it, and each framework's figures."""

    devices: Dict[int, Tuple[Optional[int], Optional[int]]]
    stats: Stats


#: what :meth:`FrameworkReader.stats` keeps per framework: (adapter, its last stats answer, the figures read from
#: it, its quiet token read just before that answer)
ReadEntry = Tuple[Any, dict, FrameworkFigures, Optional[tuple]]


class FrameworkReader:
    """Which framework adapters are in use, and their figures, read once per call into :class:`FrameworkFigures`.

    ``find``: a callable returning the adapters in use (None: the real ones, ``gpucleanup.frameworks.active``,
    imported when first needed). ``fixes``: per framework whose pool never gives memory back, what to set so
    that it does, as its figures last said."""

    def __init__(self, find: Optional[Callable[[], Any]] = None):
        self.find = find
        self.read: Dict[str, ReadEntry] = {}
        self.fixes: Dict[str, str] = {}

    def adapters(self, frameworks: Any, notes: List[Note]) -> list:
        """Enabled adapters whose framework is in use (``frameworks``: the settings' per-framework switches).
        Only called once the driver is 'ready'."""
        fn = self.find
        if fn is None:
            try:
                from ..frameworks import active as fn
            except Exception:
                return []  # the adapters are not part of this build
            self.find = fn
        try:
            found = fn()
            adapters = list(found.values() if isinstance(found, dict) else found)
        except Exception as exc:
            notes.append(("adapters:active", f"framework detection failed: {type(exc).__name__}: {exc}"))
            return []
        if not frameworks:  # none turned off (the default): nothing to filter, on every cell
            return adapters
        return [a for a in adapters if bool(frameworks.get(str(getattr(a, "name", "?")), True))]

    def stats(self, adapters: list, devices: List[int], notes: List[Note], by_token: bool = False) -> Stats:
        """Each adapter's figures on ``devices``, read once into a :class:`FrameworkFigures`. An adapter
        that answers what it answered last time gets the very figures built then: on an idle cell the
        comparison with the last cleanup's figures is then one of identity. Each read is preceded by the
        adapter's quiet token (``Adapter.quiet_token``, where it has one); ``by_token`` (an idle cell): an
        adapter whose token is the one read before its last figures is not asked for them again, they stand
        (a change after that token was read shows in the next one)."""
        out: Stats = {}
        for adapter in adapters:
            last = self.read.get(adapter.name)
            if last is not None and last[0] is not adapter:
                last = None
            token = quiet_token(adapter, devices, by_token)
            if by_token and token is not None and last is not None and last[3] == token:
                figures = out[adapter.name] = last[2]
            else:
                result, note = guarded(adapter, "stats", list(devices))
                if note:
                    notes.append(note)
                    continue
                if not isinstance(result, dict):
                    continue
                if last is not None and _same_answer(last[1], result):
                    figures = out[adapter.name] = last[2]
                    result = last[1]
                else:
                    figures = out[adapter.name] = FrameworkFigures.read(adapter, result)
                self.read[adapter.name] = (adapter, result, figures, token)
            if figures.fix:
                self.fixes[adapter.name] = figures.fix
        return out

    def token_of(self, adapter: Any) -> Optional[tuple]:
        """The quiet token read just before ``adapter``'s last figures (None: none, or another adapter's)."""
        read = self.read.get(adapter.name)
        return None if read is None or read[0] is not adapter else read[3]


def quiet_token(adapter: Any, devices: List[int], in_use: bool = False) -> Optional[tuple]:
    """The adapter's quiet token, None where it has none or fails (its figures are read then). ``in_use``:
    an idle cell's adapters, found in use by the last full look."""
    read = getattr(adapter, "quiet_token", None)
    if read is None:
        return None
    try:
        token = read(list(devices), in_use=True) if in_use else read(list(devices))
    except Exception:
        return None
    return token if isinstance(token, tuple) else None


def _same_answer(last: dict, now: dict) -> bool:
    """Two answers of an adapter's ``stats`` are equal; one holding values that cannot be compared
    (an array's ``==`` has no single truth) is taken as different."""
    try:
        return bool(last == now)
    except Exception:
        return False


def live_total(stats: Stats, devices: List[int]) -> int:
    return sum(s.on(i).live for s in stats.values() for i in devices)


def outside_every_pool(used: int, stats: Stats, i: int, pools: int) -> int:
    """Device memory no framework, no framework cache and no driver pool accounts for: ``used`` (the driver's
    figure) less every framework's live and cached bytes on device ``i`` and the driver pools' reserved bytes.
    It holds the CUDA context, raw allocations (``cuMemAlloc``) and, since ``cuMemGetInfo`` is device-wide,
    other processes' memory on the same GPU."""
    known = sum(s.on(i).live + s.on(i).cached for s in stats.values()) + int(pools)
    return max(0, int(used) - known)


def pools_reserved(dev: dict) -> Optional[int]:
    """The driver pools' reserved bytes of one device entry (after a trim where it says so),
    None when the entry lists no pools or a pool's figure is unknown."""
    pools = dev.get("pools")
    if not isinstance(pools, list) or not pools:
        return None if pools is None else 0
    total = 0
    for pool in pools:
        value = pool.get("reserved_after_bytes", pool.get("reserved_bytes")) if isinstance(pool, dict) else None
        if value is None:
            return None
        total += int(value)
    return total


def nothing_new_cached(stats: Optional[FrameworkFigures], devices: List[int], kept: Dict[int, int]) -> bool:
    """True when an adapter's figures name every device and each caches nothing, or the
    very bytes its last drain left there (``kept``)."""
    per_device = stats.devices if stats is not None else {}
    for i in devices:  # a loop, not all(): this runs on every idle cell
        if i not in per_device or per_device[i].cached not in (0, kept.get(i, 0)):
            return False
    return bool(devices)


def per_framework(stats: Stats, i: int, live: bool, releases: Optional[bool] = None) -> Dict[str, int]:
    """Live (or cached) bytes on device ``i`` per framework (``releases``: only frameworks that do,
    or do not, give their cache back), zeros left out."""
    out = {}
    for name, s in stats.items():
        if i in s.devices and (releases is None or s.releases == releases):
            n = s.devices[i].live if live else s.devices[i].cached
            if n:
                out[name] = n
    return out


def status_figures(stats: FrameworkFigures, i: int) -> dict:
    """A framework's figures on device ``i`` for %gpumem: a pool that never gives memory back
    says its cache as ``reserved_bytes`` (not freeable), never as cached."""
    fig = stats.devices[i].as_dict()
    if not stats.releases:
        fig["reserved_bytes"], fig["cached_bytes"] = fig["cached_bytes"], 0
    return fig


def context_only(stats: Stats, i: int) -> bool:
    """Frameworks are in use and none holds anything on device ``i``: its memory is a context no array uses."""
    return bool(stats) and all(i in s.devices and s.devices[i].live + s.devices[i].cached == 0
                               for s in stats.values())


def _text_or_none(value: Any) -> Optional[str]:
    return value if isinstance(value, str) and value else None
