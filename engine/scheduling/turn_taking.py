"""Turn-taking across owners over the scheduler's lanes: which request a loop step serves,
which warm-up gets a slice, and when a running step gives way to another owner.

`engine.scheduling.fairness.Turns` keeps the accounting (each owner's decayed engine time,
the sleeper's credit); this module applies it to the sequences the scheduler holds — the
inbox (under the scheduler's lock), the prefilling and the decoding lanes — so the loop in
`engine.scheduling.scheduler` only asks. One owner alone is served in the engine's usual
order (oldest first). Engine thread only, except that `other_owner_waiting` takes the lock
for the inbox it shares with `Scheduler.submit`.
"""

from __future__ import annotations

import threading
import time
from collections import deque

from engine.scheduling.fairness import SHORT_STEP_ROWS, URGENT_AGE, Turns
from engine.scheduling.sequence import Sequence


class OwnerTurns:
    def __init__(
        self, turns: Turns, inbox: deque[Sequence], lock: threading.Condition, prefilling: list[Sequence],
        decoding: list[Sequence],
    ) -> None:
        self.turns = turns
        self._inbox = inbox
        self._lock = lock
        self._prefilling = prefilling
        self._decoding = decoding
        self.urgent_age = URGENT_AGE  # a request running this long has its owner served first
        self.short_rows = SHORT_STEP_ROWS  # a prefill step of at most this many rows is short

    def serve(self, foreground: list[Sequence]) -> tuple[Sequence | None, str | None]:
        """(the prefilling request this step serves, the owner whose decode-only turn it is).
        The request: the oldest of the owner whose turn it is (`Turns.next`, over the owners
        with foreground work and, while windows share the engine, those with only a warm-up:
        `warm_ups_of_idle_owners`), and every decoding sequence decodes too (turn None). When
        that owner has only decoding rows: no request, and the step decodes that owner's rows
        alone; when it has only a warm-up: that warm-up's step. Nothing prefilling: everyone
        decodes together. One owner: its oldest."""
        owners = [s.owner for s in foreground] + [s.owner for s in self._decoding]
        if not foreground:
            self.turns.served_all(owners)
            return None, None
        warming = self.warm_ups_of_idle_owners(owners)
        if len(set(owners)) == 1 and not warming:
            self.turns.next(owners)
            return foreground[0], None
        owner = self.turns.next(
            owners, urgent=self.urgent_owner(foreground), short=self.short_steps(foreground, owners), warm_only=list(warming))
        if owner in warming:
            return warming[owner], None
        prefill = next((s for s in foreground if s.owner == owner), None)
        return prefill, (owner if prefill is None else None)

    def warm_ups_of_idle_owners(self, owners: list[str]) -> dict[str, Sequence]:
        """While windows share the engine (`Turns.shared`): the oldest warm-up of each owner
        with no request running (not in `owners`). It takes turns like a long prefill of its
        owner's — another window's burst of requests, never idle, would otherwise keep this
        window on its first window for as long as it lasts. One owner alone: none (its
        warm-ups run when it has no request, as always)."""
        if not self.turns.shared():
            return {}
        warming: dict[str, Sequence] = {}
        for seq in self._prefilling:
            if seq.background and not seq.idle_only and seq.owner not in owners:
                warming.setdefault(seq.owner, seq)
        return warming

    def short_steps(self, foreground: list[Sequence], owners: list[str]) -> set[str]:
        """The owners whose step would be short (`fairness.SHORT_STEP_ROWS`): a decode-only
        step (nothing of theirs prefilling), or the prefill of their oldest request with at
        most `short_rows` rows left and no blend to run."""
        oldest: dict[str, Sequence] = {}
        for seq in foreground:
            oldest.setdefault(seq.owner, seq)
        return {
            o for o in owners
            if o not in oldest or (oldest[o].blend is None and len(oldest[o].tokens) - oldest[o].n_valid <= self.short_rows)
        }

    def urgent_owner(self, foreground: list[Sequence]) -> str | None:
        """The owner of the oldest foreground request (prefilling or decoding) that has run
        `urgent_age` seconds, if any (engine.scheduling.fairness, `URGENT_AGE`)."""
        oldest = min((s for s in (*foreground, *self._decoding) if not s.background), key=lambda s: s.submitted, default=None)
        if oldest is None or time.perf_counter() - oldest.submitted < self.urgent_age:
            return None
        return oldest.owner

    def other_owner_waiting(self, owner: str, submitted: float) -> bool:
        """For a step of `owner`'s request submitted at `submitted`: a foreground request of
        another owner has arrived (not admitted yet), or another owner's running request older
        than this one has become urgent (the oldest urgent request's owner has every turn
        until it ends, so a step begun before that gives way at a layer; a younger one would
        not be served instead)."""
        with self._lock:
            if any(not s.background and s.owner != owner for s in self._inbox):
                return True
        old = min(time.perf_counter() - self.urgent_age, submitted)
        return any(s.owner != owner and not s.background and s.submitted <= old for s in (*self._prefilling, *self._decoding))

    def short_step_waiting(self, owner: str) -> bool:
        """Another owner than `owner` has a foreground request whose next step is short."""
        foreground = [s for s in self._prefilling if not s.background and s.owner != owner]
        others = {s.owner for s in foreground} | {s.owner for s in self._decoding if not s.background and s.owner != owner}
        return bool(others and self.short_steps(foreground, list(others)))

    def another_owner_running(self, owner: str) -> bool:
        """A foreground request of another owner than `owner` is prefilling or decoding."""
        return any(s.owner != owner and not s.background for s in (*self._prefilling, *self._decoding))

    def warm_up_for(self, served: str | None) -> Sequence | None:
        """The warm-up that gets a slice beside the requests (`Scheduler._share_with_warm_up`):
        the oldest; while windows share the engine (`Turns.shared`), the oldest of the owner
        this step served, and none while another owner's request waits with a short step
        (`short_steps`: decoding, or a keystroke's few rows) — another window's warm-ups
        never cut into a request of this one (a burst of jumps leaves a warm-up behind each,
        and gets a step between this one's tokens while passed over), while this window's
        own warm-up still gets its slices beside another's long prefill."""
        shared = self.turns.shared()
        if shared and served is not None and self.short_step_waiting(served):
            return None
        return next((s for s in self._prefilling if s.background and not s.idle_only and (not shared or s.owner == served)), None)


__all__ = ["OwnerTurns"]
