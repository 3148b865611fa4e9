"""Turns across owners: one owner's burst does not starve another's requests.

A request may name its owner (`InfillRequest.owner`: a tenant of a shared engine, e.g. one
editor window of the engine daemon; the engine knows nothing more of it). Requests with the
same owner — all of them, when nobody names one — keep the engine's usual order (oldest
first). Across owners the engine shares its time fairly (`Turns`, a virtual clock per owner,
as a fair-share CPU scheduler does):

- every unit of foreground model work is charged to its owner: each prefill step to the
  request's owner, a batched decode step to the owners of its rows (split by rows);
- each loop step serves the owner with foreground work (prefilling or decoding) that has
  been charged least: its oldest prefilling request gets the step's prefill (and the decode
  step runs for everyone decoding, as always); an owner with nothing but decoding rows gets
  a decode-only step — another owner's long prefill waits for it, instead of every one of
  its tokens waiting for a prefill step of the other's;
- the clocks' floor (`Turns.floor`) is the least charge among the owners with work, and
  it never goes back; an owner new, or back after having nothing to run, starts at the
  floor (time idle is not banked: it cannot come back and take the engine for as long as it
  was away; nor does an owner that ran alone for an hour owe that hour to one that comes
  next); ties go to the owner not served last;
- admitted requests waiting for KV room get it in turns too (`interleave`): each owner's
  oldest, then each owner's second oldest, owners in the order of their charge;
- a step cannot be interrupted, so while the engine is shared (another owner had work in
  the last `SHARED_WINDOW` seconds, `Turns.shared`) a request's prefill step is sized to
  take about `Scheduler.shared_step_seconds` at the measured prefill rate, and not the
  larger solo step: another owner's keystroke that arrives meanwhile waits for one short
  step (smaller steps run the model less efficiently: that is the price of sharing).

So a window typing (a few rows to prefill, then a few tokens to decode: little engine time)
is served next whenever it has work, while another window's burst of long prefills gets
the rest of the engine; one owner alone runs exactly as before.
"""

from __future__ import annotations

import time
from typing import Iterable, Sequence as SequenceType, TypeVar

T = TypeVar("T")

# The engine counts as shared while more than one owner had foreground work within this many seconds.
SHARED_WINDOW = 2.0


class Turns:
    """Seconds of engine time charged per owner with work (engine thread only)."""

    def __init__(self) -> None:
        self.charged: dict[str, float] = {}
        self.floor = 0.0  # the least charge among owners with work, never decreasing
        self.last: str | None = None  # the owner served by the last step
        self.seen: dict[str, float] = {}  # owner -> time.monotonic() it last had foreground work

    def active(self, owners: Iterable[str]) -> list[str]:
        """`owners` (those with foreground work now, in order of their oldest request) with
        their clocks set: a newcomer (or one back from having nothing to run) starts at the
        floor, one that is ahead keeps its charge."""
        owners = list(dict.fromkeys(owners))
        now = time.monotonic()
        for owner in owners:
            self.seen[owner] = now
        known = [self.charged[o] for o in owners if o in self.charged]
        if known:
            self.floor = max(self.floor, min(known))
        for owner in [o for o in self.charged if o not in owners and self.charged[o] <= self.floor]:
            del self.charged[owner]  # idle and not ahead: it would start at the floor anyway
        for owner in owners:
            self.charged[owner] = max(self.charged.get(owner, self.floor), self.floor)
        return owners

    def next(self, owners: Iterable[str]) -> str | None:
        """Which of `owners` (with foreground work, oldest request first) this step serves."""
        owners = self.active(owners)
        if not owners:
            return None
        chosen = min(owners, key=lambda o: (self.charged[o], o == self.last))
        self.last = chosen
        return chosen

    def shared(self, now: float | None = None) -> bool:
        """More than one owner had foreground work in the last `SHARED_WINDOW` seconds."""
        now = time.monotonic() if now is None else now
        for owner in [o for o, t in self.seen.items() if now - t > SHARED_WINDOW]:
            del self.seen[owner]
        return len(self.seen) > 1

    def charge(self, owner: str, seconds: float) -> None:
        start = max(self.charged.get(owner, self.floor), self.floor)
        self.charged[owner] = start + max(0.0, seconds)

    def charge_rows(self, owners: SequenceType[str], seconds: float) -> None:
        """A batched step of one row per entry of `owners`: each owner pays its rows' share."""
        if owners:
            share = seconds / len(owners)
            for owner in owners:
                self.charge(owner, share)

    def order(self, owners: Iterable[str]) -> list[str]:
        """`owners` least-charged first (stable: ties keep their order)."""
        owners = list(dict.fromkeys(owners))
        return sorted(owners, key=lambda o: self.charged.get(o, 0.0))


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


__all__ = ["Turns", "interleave", "SHARED_WINDOW"]
