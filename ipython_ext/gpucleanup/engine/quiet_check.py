"""The idle cell without the driver pass: the library's quiet check, the frameworks' quiet tokens and the proof
an idle cell leaves for the next one, as one unit (:class:`QuietCheck`, :class:`IdleProof`).

A cell is proven idle when the last cleanup proved nothing had changed, the library's quiet check
(``native.quiet``: the same devices in use, nothing queued, no driver pool reserving memory, the same free memory
as the pass behind that proof left) says nothing changed since, and the frameworks' figures are those the last
cleanup left with nothing new to give back. With no framework in use the driver's figures alone prove it.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any, List, Optional, Tuple

from .figures import LastPass
from .releases import IdleRelease
from .settings import Settings

#: the cell being cleaned (``cell_pass.CellPass``, which builds on this module: named, not imported)
CellPass = Any

__all__ = ["QuietCheck", "IdleProof"]


@dataclass(eq=False)
class IdleProof:
    """What a cell proven idle by :meth:`QuietCheck.proves` rested on besides the library's quiet check, kept
    for the next cell: the settings, the count of modules imported, the last full cleanup, the release held
    and those not yet reported, the frameworks in use and the quiet token each answered. Every input of the
    frameworks' figures and of :meth:`CellPass.nothing_new` is among them, or checked again by ``proves`` on
    every cell (a forced cell, devices found unusable, a pinned release, a name unbound), or by
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
    def made(cls, cell_pass: CellPass) -> Optional["IdleProof"]:
        """The proof of a cell that :meth:`QuietCheck.proves` just found idle the long way; None where a
        framework in use gave no quiet token this cell (its figures are then read on every cell)."""
        last = cell_pass.since.last
        tokens = []
        if last is None or len(last.stats) != len(cell_pass.adapters):
            return None
        for adapter in cell_pass.adapters:
            # the figures were equal to the last cleanup's, each adapter's among them: its entry is this
            # cell's, and its token the one read this cell
            token = cell_pass.frameworks.token_of(adapter)
            if adapter.name not in last.stats or token is None:
                return None
            tokens.append(token)
        releases = cell_pass.releases
        return cls(cell_pass.settings, len(sys.modules), last, releases.held_job, list(releases.unreported),
                   tuple(cell_pass.adapters), tuple(tokens))

    def stands(self, cell_pass: CellPass) -> bool:
        """Whether this cell finds everything the proof rested on as it was. Each framework's quiet token is
        read again, the one read no proof can spare: a framework's memory may change with no change the
        driver sees (an array deleted into its pool). The last cleanup and the releases not yet reported
        change only in a full pass, which forgets the proof: compared all the same, as the guard of that.
        A token read or trace check that raises does not stand: the long way then says what is wrong."""
        releases = cell_pass.releases
        if (cell_pass.settings is not self.settings or cell_pass.cell.after_forced is not None
                or cell_pass.since.last is not self.last or releases.held_job is not self.held
                or len(sys.modules) != self.modules or releases.unreported != self.jobs):
            return False
        devices = cell_pass.settled
        try:
            if cell_pass.hooks.tracing():  # the allocation trace: every cell gets its record (CellPass._tracing)
                return False
            for adapter, token in zip(self.adapters, self.tokens):  # a loop, not all(): runs on every idle cell
                if adapter.quiet_token(devices, in_use=True) != token:
                    return False
        except Exception:  # a fault of the trace or of an adapter: the long way says what is wrong
            return False
        return True


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

    def proves(self, cell_pass: CellPass, proof: Optional[IdleProof] = None) -> bool:
        """The idle cell without the driver pass: True when the library's quiet check says nothing changed since
        the last cleanup, and the frameworks' figures are those the last cleanup left with nothing new to give
        back (:meth:`CellPass.nothing_new`, over the last cleanup's devices): then no collection could find
        anything either, unless the policy is "always" or the cell unbound a name that held GPU memory (those
        collect: the whole pass runs). False: not proven; what this tried is forgotten, but for what an
        unraisable hook caught, and the whole pass runs. Not armed for Ctrl-C: nothing here waits, and a Ctrl-C
        is a KeyboardInterrupt the extension reports. ``proof``: what the cell before this one, proven idle
        here, rested on; where it still stands (:meth:`IdleProof.stands`), the frameworks' figures and
        ``nothing_new`` would answer as they did, and are not asked again. The tokens are read outside the
        capture of unraisable errors that the long way enters: they free nothing and run no collection, so what
        could arrive there is a finalizer Python's own cyclic collection ran at that moment, reported as it
        would be anywhere in the cell."""
        since, releases = cell_pass.since, cell_pass.releases
        last = since.last
        if (last is None or cell_pass.cell.forced or since.unusable or releases.pinned_job is not None
                or cell_pass.settings.gc == "always" or since.holders.unbound(cell_pass.cell.namespace)):
            return False
        try:
            if cell_pass.native.quiet() is not True:
                return False
        except Exception:  # a library without the check, or one that fails: the pass says what is wrong
            return False
        cell_pass.state = since.driver_state = "ready"
        # the devices, their free bytes and pools are the last cleanup's: what the library just compared
        cell_pass.devices, cell_pass.settled = list(last.devices), list(last.devices)
        if proof is not None and proof.stands(cell_pass):
            cell_pass.adapters, cell_pass.stats_settled = list(proof.adapters), last.stats
            self.proof = proof
            return True
        same = False
        with releases.unraisables.capture() as captured:
            cell_pass.adapters = self.adapters_in_use(cell_pass)
            figures = cell_pass.frameworks.stats(cell_pass.adapters, cell_pass.settled, cell_pass.notes,
                                                 by_token=True) if cell_pass.adapters else {}
            if figures == last.stats:
                cell_pass.stats_settled = last.stats  # the same figures: nothing_new() compares them by identity
                same = cell_pass.nothing_new()
        if same and not captured and not cell_pass.notes:
            self.proof = IdleProof.made(cell_pass)
            return True
        cell_pass.captured.extend(captured)  # said by the whole pass's record
        cell_pass.devices, cell_pass.settled, cell_pass.adapters, cell_pass.notes = [], [], [], []
        cell_pass.stats_settled, cell_pass.state = {}, None
        return False

    def adapters_in_use(self, cell_pass: CellPass) -> list:
        """The adapters in use, as the last idle cell found them when nothing was imported since and the
        settings are the same, else asked afresh. Sound only behind the library's quiet check: a framework
        that starts using the GPU during a cell allocates, which changes the free memory that check compares,
        and the full pass that follows forgets what was kept here (a framework whose use begins without an
        allocation, a context already made by another, holds nothing to give back)."""
        imported, settings = len(sys.modules), cell_pass.settings
        kept = self.adapters_kept
        if kept is not None and kept[0] == imported and (kept[1] is settings or kept[1] == settings):
            return list(kept[2])
        adapters = cell_pass.frameworks.adapters(settings.frameworks, cell_pass.notes)
        self.adapters_kept = (imported, settings, list(adapters))
        return adapters
