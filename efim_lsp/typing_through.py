"""Typing-through: the user types what the suggestion on screen says.

After a suggestion `g` is shown at offset `start`, the characters the user
types at the cursor are followed edit by edit. While they are exactly a prefix
of `g` (and nothing else in the document changed), the answer to the next
request is the rest of `g`, at once and without the engine (docs/design.md, "Data flow").
Any other edit — a change elsewhere, a cursor that left the typed run, a
character that differs from the suggestion — forgets the suggestion.
"""

from __future__ import annotations

from typing import NamedTuple

from efim_lsp.documents import Edit


class _Shown(NamedTuple):
    start: int  # document offset where the suggestion was inserted
    end: int  # end of what the user typed since (start <= end)
    text: str  # the suggestion as shown


class TypingThrough:
    """One document's last suggestion and the typing since."""

    def __init__(self) -> None:
        self._shown: _Shown | None = None

    def remember(self, start: int, text: str) -> None:
        self._shown = _Shown(start, start, text) if text else None

    def forget(self) -> None:
        self._shown = None

    @property
    def active(self) -> bool:
        return self._shown is not None

    def observe(self, edit: Edit) -> None:
        shown = self._shown
        if shown is None:
            return
        if shown.start <= edit.start and edit.end <= shown.end:
            self._shown = shown._replace(end=shown.end + edit.delta)  # typing/backspacing the run
        elif edit.end < shown.start:
            d = edit.delta  # above: the run only moves (an edit reaching its start, e.g. a Backspace before it, changes what it continues)
            self._shown = shown._replace(start=shown.start + d, end=shown.end + d)
        else:
            self._shown = None

    def remainder(self, text: str, cursor: int) -> str | None:
        """The rest of the suggestion if the cursor ends a typed prefix of it, else None."""
        shown = self._shown
        if shown is None or cursor != shown.end:
            return None
        typed = text[shown.start : shown.end]
        if len(typed) >= len(shown.text) or not shown.text.startswith(typed):
            return None
        rest = shown.text[len(typed) :]
        return rest if rest.strip() else None
