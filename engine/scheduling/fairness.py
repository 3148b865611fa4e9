"""Turns across owners: one owner's burst does not starve another's requests.

A request may name its owner (`InfillRequest.owner`: a tenant of a shared engine, e.g. one
editor window of the engine daemon; the engine knows nothing more of it). Requests with the
same owner — all of them, when nobody names one — keep the engine's usual order (oldest
first). Across owners the engine serves the owner that used it least lately (`Turns`, decayed
usage per owner, as classic fair-share CPU schedulers do):

- every unit of model work is charged to its owner: each prefill step to the request's (or
  warm-up's) owner, a batched decode step to the owners of its rows (split by rows);
- the charges decay (time constant `MEMORY`, 3 s): an owner's usage is what it ran lately;
- each loop step serves one owner with foreground work (prefilling or decoding): its oldest
  prefilling request gets the step's prefill (and the decode step runs for everyone
  decoding, as always); an owner with nothing but decoding rows gets a decode-only step —
  another owner's long prefill waits for it, instead of every one of its tokens waiting for
  a prefill step of the other's;
- which owner: a *short* step first — a decode-only step, or a prefill of at most
  `SHORT_STEP_ROWS` rows (a keystroke's few new tokens) — before another owner's long
  prefill (a jump's window), as shortest-job-first does for the time people wait; among
  owners whose steps are alike, the least recent usage; ties go to the owner not served last.
  A typing window's answer, a few milliseconds a step, no longer waits for a burst's 50 ms
  prefill steps between its tokens because it typed more than the burst lately;
- an owner with work passed over for `PASSED_OVER` seconds gets the next step, whatever its
  usage or step: a long prefill is never starved by another owner's stream of short steps;
- while owners share the engine, an owner with no request running has its warm-up take
  turns like a long prefill of its own (`OwnerTurns.warm_ups_of_idle_owners`): another
  owner's burst never leaves the engine idle, the usual time for warm-ups;
- an owner back from having no foreground work has `WAKE_CREDIT` (1 s) taken off its usage
  (a sleeper's credit): a window that types is idle between keystrokes, a burst is not — work
  arriving within `REPLACED_WITHIN` of the owner's last request being cancelled (superseded)
  is its replacement and gets no credit;
- so a light owner (a window typing: a few rows to prefill, a few tokens to decode) is
  served first whenever it has work, as long as it used the engine less than the other
  lately (credit included), and two heavy owners alternate; an owner that ran alone for long waits at most
  about `MEMORY * ln 2` (2.1 s) for a heavy newcomer (which starts with no usage) to catch
  up with its decaying usage;
- admitted requests waiting for KV room get it in turns too (`interleave`): each owner's
  oldest, then each owner's second oldest, owners least recent usage first;
- a request that has run for `URGENT_AGE` seconds without finishing is *urgent*: its owner
  has every turn until it ends (the oldest urgent request first when several are). A
  window's keystroke whose answer takes long (many tokens to decode) would otherwise get a
  token per prefill step of a burst's windows and reach its deadline; a burst's requests,
  superseded by the next one long before, are never urgent;
- a step cannot be interrupted, so while the engine is shared (another owner had work in
  the last `SHARED_WINDOW` seconds, `Turns.shared`) a request's prefill step is sized to
  take about `Scheduler.shared_step_seconds` at the measured prefill rate, and not the
  larger solo step: another owner's keystroke that arrives meanwhile waits for one short
  step (smaller steps run the model less efficiently: that is the price of sharing).

One owner alone runs exactly as before.
"""

from __future__ import annotations

import math
import time
from typing import Collection, Iterable, Sequence as SequenceType, TypeVar

T = TypeVar("T")

# Usage is remembered with this time constant (seconds; half-life MEMORY * ln 2 = 2.1 s): long
# enough that a burst's owner stays "heavy" between its requests, short enough that an owner
# which ran alone for long is not held back for more than about MEMORY * ln 2 once another
# heavy owner arrives (the newcomer, with no usage, goes first until its usage meets the
# other's decaying one).
MEMORY = 3.0
# An owner back from having no foreground work has this many seconds taken off its usage (a
# sleeper's credit, as fair-share CPU schedulers give a task that wakes): a window that types
# is idle between keystrokes, so each keystroke's request runs first for up to this much
# engine time even when the window used about as much lately as a burst that never pauses.
WAKE_CREDIT = 1.0
# Work that comes back within this many seconds of the owner's last request being cancelled is
# that request's replacement, not a return from idle: no sleeper's credit. A burst of jumps
# supersedes its request every ~50 ms and, without this, found itself "back from idle" in the
# step between the cancel and the next admission — credited a second each time, it took turns
# from a typing window whose request had just arrived (measured: 300 ms waits, see
# docs/daemon.md "Fairness"). A person who stops after a cancel is idle again past this.
REPLACED_WITHIN = 0.25
# The engine counts as shared while more than one owner had foreground work within this many seconds.
SHARED_WINDOW = 2.0
# A step prefilling at most this many rows is short (a keystroke's new tokens; a jump's first
# window is ~100-250 rows): it goes before another owner's long prefill step.
SHORT_STEP_ROWS = 64
# An owner with foreground work passed over this long (seconds) gets the next step.
PASSED_OVER = 0.25
# A foreground request running this long (seconds since it was submitted) has its owner served
# first until it ends: well above a keystroke's typical answer on 2 cores (~0.1-0.2 s), well
# below the 1.5 s default deadline, so the longest answers of a window finish alone.
URGENT_AGE = 0.25


class Turns:
    """Each owner's recent engine time (seconds, decayed with a half-life of
    `MEMORY * ln 2`), and which owner a step serves: the one that used the engine least
    lately. Engine thread only (`clock` is settable for tests)."""

    def __init__(self, memory: float = MEMORY, clock=time.monotonic) -> None:
        self.memory = memory
        self.clock = clock
        self.usage: dict[str, tuple[float, float]] = {}  # owner -> (decayed seconds, at clock)
        self.last: str | None = None  # the owner served by the last step
        self.seen: dict[str, float] = {}  # owner -> time.monotonic() it last had foreground work
        self.awake: set[str] = set()  # the owners with foreground work at the last `active` call
        self.wake_credit = WAKE_CREDIT
        self.spent: dict[str, float] = {}  # owner -> engine seconds charged to it, not decayed (reported)
        self.cancelled_at: dict[str, float] = {}  # owner -> time.monotonic() its last request ended cancelled
        self.passed_over = PASSED_OVER
        self.waiting: dict[str, float] = {}  # owner -> clock() since when it has had work and not been served

    def used(self, owner: str, now: float | None = None) -> float:
        """`owner`'s recent engine time now (decayed)."""
        used, at = self.usage.get(owner, (0.0, 0.0))
        now = self.clock() if now is None else now
        return used * math.exp(-max(0.0, now - at) / self.memory) if used else 0.0

    def active(self, owners: Iterable[str]) -> list[str]:
        """`owners` (those with foreground work now, in order of their oldest request), noted
        as seen; owners whose usage has decayed away are forgotten."""
        owners = list(dict.fromkeys(owners))
        now = time.monotonic()
        at = self.clock()
        for owner in owners:
            self.seen[owner] = now
            if owner not in self.awake and owner in self.usage and not self._replaced(owner, now):
                # back from idle: the sleeper's credit
                self.usage[owner] = (max(0.0, self.used(owner, at) - self.wake_credit), at)
        self.awake = set(owners)
        if len(self.usage) > len(owners):
            for owner in [o for o in self.usage if o not in owners and self.used(o, at) < 1e-4]:
                del self.usage[owner]
                self.cancelled_at.pop(owner, None)
        return owners

    def next(
        self, owners: Iterable[str], urgent: str | None = None, short: Collection[str] = (), warm_only: Collection[str] = (),
    ) -> str | None:
        """Which of `owners` (with foreground work, oldest request first; then those in
        `warm_only`, with nothing but a warm-up) this step serves: the owner of the `urgent`
        request (see `URGENT_AGE`) if there is one; else the one with a request passed over
        longest if that was `passed_over` or longer (a warm-up is never owed a step); else an
        owner whose step is `short` before the others, and among those alike the least recent
        usage; a tie goes to the one not served last."""
        given = list(owners)
        owners = self.active([o for o in given if o not in warm_only]) + list(dict.fromkeys(o for o in warm_only if o not in given))
        if not owners:
            self.waiting.clear()
            return None
        now = self.clock()
        waiting = {o: self.waiting.get(o, now) for o in owners if o not in warm_only}
        starved = min(waiting, key=waiting.__getitem__, default=None)
        if urgent in owners:
            chosen = urgent
        elif starved is not None and now - waiting[starved] >= self.passed_over:
            chosen = starved
        else:
            chosen = min(owners, key=lambda o: (o not in short, self.used(o, now), o == self.last))
        waiting.pop(chosen, None)
        self.waiting = waiting
        self.last = chosen
        return chosen

    def served_all(self, owners: Iterable[str]) -> None:
        """A step served every one of `owners` (everyone decoding together): noted active, none passed over."""
        self.active(owners)
        self.waiting.clear()

    def ended(self, owner: str, cancelled: bool) -> None:
        """A foreground request of `owner` ended: answered, or `cancelled` (superseded by the
        owner's next request, or given up)."""
        if cancelled:
            self.cancelled_at[owner] = time.monotonic()
        else:
            self.cancelled_at.pop(owner, None)

    def _replaced(self, owner: str, now: float) -> bool:
        """`owner`'s last request was cancelled less than `REPLACED_WITHIN` ago: the work now
        is its replacement (a burst of jumps, each superseding the last), not a return from idle."""
        at = self.cancelled_at.get(owner)
        return at is not None and now - at < REPLACED_WITHIN

    def shared(self, now: float | None = None) -> bool:
        """More than one owner had foreground work in the last `SHARED_WINDOW` seconds."""
        now = time.monotonic() if now is None else now
        for owner in [o for o, t in self.seen.items() if now - t > SHARED_WINDOW]:
            del self.seen[owner]
        return len(self.seen) > 1

    def charge(self, owner: str, seconds: float) -> None:
        now = self.clock()
        seconds = max(0.0, seconds)
        self.usage[owner] = (self.used(owner, now) + seconds, now)
        self.spent[owner] = self.spent.get(owner, 0.0) + seconds

    def spent_by_owner(self) -> dict[str, float]:
        """Engine seconds charged to each owner so far (its prefill steps, its share of the
        decode steps); a copy, safe to take from any thread."""
        return dict(self.spent)

    def charge_rows(self, owners: SequenceType[str], seconds: float) -> None:
        """A batched step of one row per entry of `owners`: each owner pays its rows' share."""
        if owners:
            share = seconds / len(owners)
            for owner in owners:
                self.charge(owner, share)

    def order(self, owners: Iterable[str]) -> list[str]:
        """`owners` least recent usage first (stable: ties keep their order)."""
        owners = list(dict.fromkeys(owners))
        now = self.clock()
        return sorted(owners, key=lambda o: self.used(o, now))


def interleave(items: SequenceType[T], owner_of, owners_first: SequenceType[str] = ()) -> list[T]:
    """`items` (oldest first) in turns across owners: each owner's first, then each owner's
    second, ...; owners in the order `owners_first` gives, the others after it in order of
    their first item. One owner: `items` unchanged."""
    groups: dict[str, list[T]] = {o: [] for o in owners_first}
    for item in items:
        groups.setdefault(owner_of(item), []).append(item)
    lanes = [g for g in groups.values() if g]
    if len(lanes) <= 1:
        return list(items)
    out: list[T] = []
    for i in range(max(len(g) for g in lanes)):
        out.extend(g[i] for g in lanes if i < len(g))
    return out


__all__ = ["Turns", "interleave", "PASSED_OVER", "SHARED_WINDOW", "SHORT_STEP_ROWS", "URGENT_AGE"]
