"""What a completion request ends with: an `Answer` (a suggestion for a range) or a
`Declined` (why there is none), from the engine, typing-through or an answer ahead."""

from __future__ import annotations

from typing import Literal, NamedTuple


class Answer(NamedTuple):
    text: str  # what to insert, in the document's line endings
    start: int  # the range replaced, in code-point offsets (start == end: an insertion)
    end: int
    version: int
    suggestion_id: int
    source: Literal["engine", "typing-through", "ahead", "imports"]
    # More suggestions for the same range (setting `alternatives`): distinct, non-empty,
    # none equal to `text`, in the engine's fork order.
    alternatives: tuple[str, ...] = ()


class Declined(NamedTuple):
    code: str  # camelCase key of `efim/stats` "declined"
    reason: str


__all__ = ["Answer", "Declined"]
