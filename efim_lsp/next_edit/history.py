"""What a person changed in a document, one coalesced replacement per place.

Keystrokes arrive one `didChange` at a time: selecting `n` and typing `count` is a
replacement of "n" by "c" followed by four insertions. `EditHistory.observe` merges an edit
that touches or overlaps the latest change's region into it (typing, Backspace, a selection
retyped), so the latest `Change` says "the original `old` at `start` is now `new`"; an edit
elsewhere starts a new change (the older ones are kept, most recent last, up to `KEPT`).
"""

from __future__ import annotations

from typing import NamedTuple

# Changes kept per document.
KEPT = 16


class Change(NamedTuple):
    """The original text `old` at `start` is now `new` (offsets of the current text)."""

    start: int
    old: str
    new: str

    @property
    def end(self) -> int:
        return self.start + len(self.new)


class EditHistory:
    def __init__(self) -> None:
        self.changes: list[Change] = []

    @property
    def last(self) -> Change | None:
        return self.changes[-1] if self.changes else None

    def clear(self) -> None:
        self.changes.clear()

    def observe(self, start: int, end: int, removed: str, inserted: str) -> None:
        """`text[start:end]` (== `removed`) was replaced by `inserted` (offsets before the edit)."""
        if end - start != len(removed):
            raise ValueError("removed text does not match the edited range")
        if not removed and not inserted:
            return
        delta = len(inserted) - len(removed)
        last = self.last
        if last is not None and start <= last.end and end >= last.start:
            self.changes[-1] = _merge(last, start, end, removed, inserted)
        else:
            self.changes.append(Change(start, removed, inserted))
            del self.changes[:-KEPT]
        # Older changes after the edit move with it; one the edit overlapped is forgotten.
        kept: list[Change] = []
        for i, change in enumerate(self.changes):
            if i == len(self.changes) - 1:
                kept.append(change)
            elif change.end <= start:
                kept.append(change)
            elif change.start >= end:
                kept.append(change._replace(start=change.start + delta))
        self.changes = kept


def _merge(last: Change, a: int, b: int, removed: str, inserted: str) -> Change:
    """`last` (region [rs, re) of the current text) and an edit of [a, b) that touches it."""
    rs, re_ = last.start, last.end
    old = removed[: max(0, rs - a)] + last.old + (removed[len(removed) - (b - re_):] if b > re_ else "")
    new = (last.new[: a - rs] if a > rs else "") + inserted + (last.new[b - rs:] if b < re_ else "")
    return Change(min(a, rs), old, new)


__all__ = ["Change", "EditHistory", "KEPT"]
