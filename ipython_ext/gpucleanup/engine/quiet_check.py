"""The idle cell without the driver pass: the library's quiet check, the frameworks' quiet tokens and the proof
an idle cell leaves for the next one, as one unit (:class:`QuietCheck`, :class:`QuietFinding`, :class:`IdleProof`).

A cell is proven idle when the last cleanup proved nothing had changed, the library's quiet check
(``native.quiet``: the same devices in use, nothing queued, no driver pool reserving memory, the same free memory
as the pass behind that proof left) says nothing changed since, and the frameworks' figures are those the last
cleanup left with nothing new to give back. With no framework in use the driver's figures alone prove it.
:meth:`QuietCheck.look` says what it found; the cell's pass (``cell_pass.CellPass.proven_idle``) decides.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any, Callable, List, Optional, Sequence, Tuple

from .figures import FrameworkReader, LastPass, Stats
from .releases import IdleRelease, Note, Releases
from .settings import Cell, Settings
from .since_last_pass import SinceLastPass

__all__ = ["QuietCheck", "QuietFinding", "IdleProof"]


@dataclass(eq=False)
class IdleProof:
    """What a cell proven idle by the quiet check rested on besides the library's quiet check, kept
    for the next cell: the settings, the count of modules imported, the last full cleanup, the release held
    and those not yet reported, the frameworks in use and the quiet token each answered. Every input of the
    frameworks' figures and of ``CellPass.nothing_new`` is among them, or checked again by :meth:`QuietCheck.look`
    on every cell (a forced cell, devices found unusable, a pinned release, a name unbound), or by
    :meth:`stands` (a ``%gpumem --drain`` earlier in the cell, the allocation trace): where all of it is as
    it was, the proof's answer stands without its comparisons. Made only where every framework in use has
    a quiet token (one without is read on every cell), and forgotten by any cell not proven idle so. With no
    framework in use it rests on the driver's figures alone."""

    settings: Settings
    modules: int
    last: LastPass
    held: Optional[IdleRelease]
    jobs: List[IdleRelease]
    adapters: Tuple[Any, ...]
    tokens: Tuple[tuple, ...]

    @classmethod
    def made(cls, settings: Settings, last: LastPass, adapters: list, frameworks: FrameworkReader,
             releases: Releases) -> Optional["IdleProof"]:
        """The proof of a cell just found idle the long way (its ``adapters`` with figures equal to ``last``'s);
        None where a framework in use gave no quiet token this cell (its figures are then read on every cell)."""
        tokens = []
        if len(last.stats) != len(adapters):
            return None
        for adapter in adapters:
            # the figures were equal to the last cleanup's, each adapter's among them: its entry is this
            # cell's, and its token the one read this cell
            token = frameworks.token_of(adapter)
            if adapter.name not in last.stats or token is None:
                return None
            tokens.append(token)
        return cls(settings, len(sys.modules), last, releases.held_job, list(releases.unreported),
                   tuple(adapters), tuple(tokens))

    def stands(self, settings: Settings, cell: Cell, last: Optional[LastPass], releases: Releases,
               devices: List[int], tracing: Callable[[], Any]) -> bool:
        """Whether this cell finds everything the proof rested on as it was. Each framework's quiet token is
        read again, the one read no proof can spare: a framework's memory may change with no change the
        driver sees (an array deleted into its pool). The last cleanup and the releases not yet reported
        change only in a full pass, which forgets the proof: compared all the same, as the guard of that.
        A token read or trace check that raises does not stand: the long way then says what is wrong."""
        if (settings is not self.settings or cell.after_forced is not None or last is not self.last
                or releases.held_job is not self.held or len(sys.modules) != self.modules
                or releases.unreported != self.jobs):
            return False
        try:
            if tracing():  # the allocation trace: every cell gets its record (CellPass._tracing)
                return False
            for adapter, token in zip(self.adapters, self.tokens):  # a loop, not all(): runs on every idle cell
                if adapter.quiet_token(devices, in_use=True) != token:
                    return False
        except Exception:  # a fault of the trace or of an adapter: the long way says what is wrong
            return False
        return True


class QuietFinding:
    """What :meth:`QuietCheck.look` found once the library's quiet check said nothing changed: ``devices``, the last
    cleanup's (their free bytes and pools are what the library just compared); ``adapters``, the frameworks in use;
    ``stats``, their figures (the last cleanup's own object where equal, which ``nothing_new`` compares by
    identity; None where they differ); ``notes`` and ``captured``, what reading them said or raised unraisably;
    ``proof``, the last idle cell's proof where it still stands (the figures were not read: its answer stands)."""

    # slots: made on every idle cell
    __slots__ = ("devices", "adapters", "stats", "notes", "captured", "proof")

    def __init__(self, devices: List[int], adapters: list, stats: Optional[Stats], notes: Sequence[Note],
                 captured: Sequence[dict], proof: Optional[IdleProof]):
        self.devices, self.adapters, self.stats = devices, adapters, stats
        self.notes, self.captured, self.proof = notes, captured, proof


class QuietCheck:
    """The idle proof between cells. ``ok``: the last cleanup proved nothing had changed, from a native pass whose
    state the library keeps (or from the quiet check since): the next cell may ask the library's quiet check
    first. ``adapters_kept``: (the number of modules imported, the settings, the adapters in use) as the last idle
    cell proved them; a full pass forgets them (:meth:`adapters_in_use`). ``proof``: what the last cell proven idle
    by the quiet check rested on (:class:`IdleProof`): the next cell, if it finds the same, skips the comparisons
    that proof made; taken by every cell, so it stands only from one cell proven idle to the next."""

    def __init__(self):
        self.ok = False
        self.adapters_kept: Optional[Tuple[int, Settings, list]] = None
        self.proof: Optional[IdleProof] = None

    def take(self) -> Tuple[bool, Optional[IdleProof]]:
        """A cell starts: whether the last one left the quiet check usable, and its proof; both are forgotten
        (set again only by a cell proven idle)."""
        ok, proof = self.ok, self.proof
        self.ok, self.proof = False, None
        return ok, proof

    def forget_adapters(self) -> None:
        self.adapters_kept = None

    def proven(self, proof: Optional[IdleProof]) -> None:
        """A cell was proven idle by the quiet check: the next may ask it first, and rest on ``proof``."""
        self.ok, self.proof = True, proof

    def look(self, native: Any, frameworks: FrameworkReader, since: SinceLastPass, releases: Releases,
             settings: Settings, cell: Cell, tracing: Callable[[], Any],
             proof: Optional[IdleProof] = None) -> Optional[QuietFinding]:
        """The idle cell without the driver pass, as far as this part can tell: None when the quiet check cannot
        answer for this cell (no last cleanup, a forced cell, a device unusable, a pinned release running, the
        policy "always", or a name unbound that held GPU memory: those collect, so the whole pass runs) or the
        library says something changed; else what it found (:class:`QuietFinding`). ``proof``: what the cell
        before this one, proven idle here, rested on; where it still stands (:meth:`IdleProof.stands`), the
        frameworks' figures and ``nothing_new`` would answer as they did, and are not read again. Not armed for
        Ctrl-C: nothing here waits. The figures are read inside the capture of unraisable errors that the long
        way enters; the tokens outside it: they free nothing and run no collection, so what could arrive there
        is a finalizer Python's own cyclic collection ran at that moment, reported as it would be anywhere."""
        last = since.last
        if (last is None or cell.forced or since.unusable or releases.pinned_job is not None
                or settings.gc == "always" or since.holders.unbound(cell.namespace)):
            return None
        try:
            if native.quiet() is not True:
                return None
        except Exception:  # a library without the check, or one that fails: the pass says what is wrong
            return None
        devices = list(last.devices)
        if proof is not None and proof.stands(settings, cell, last, releases, devices, tracing):
            return QuietFinding(devices, list(proof.adapters), last.stats, (), (), proof)
        notes: List[Note] = []
        with releases.unraisables.capture() as captured:
            adapters = self.adapters_in_use(frameworks, settings, notes)
            figures = frameworks.stats(adapters, devices, notes, by_token=True) if adapters else {}
        return QuietFinding(devices, adapters, last.stats if figures == last.stats else None, notes, captured, None)

    def adapters_in_use(self, frameworks: FrameworkReader, settings: Settings, notes: List[Note]) -> list:
        """The adapters in use, as the last idle cell found them when nothing was imported since and the
        settings are the same, else asked afresh. Sound only behind the library's quiet check: a framework
        that starts using the GPU during a cell allocates, which changes the free memory that check compares,
        and the full pass that follows forgets what was kept here (a framework whose use begins without an
        allocation, a context already made by another, holds nothing to give back)."""
        imported = len(sys.modules)
        kept = self.adapters_kept
        if kept is not None and kept[0] == imported and (kept[1] is settings or kept[1] == settings):
            return list(kept[2])
        adapters = frameworks.adapters(settings.frameworks, notes)
        self.adapters_kept = (imported, settings, list(adapters))
        return adapters
