"""One next edit from the non-model proposers, tried in order: a rename's next occurrence
(`proposer`), a changed signature's next call site (`call_sites`), a changed line's next
parallel line (`parallel`). Each is silent unless the latest change is of its kind, so the
order only matters where two could answer: a name shared by parallel lines renamed — the
rename's next occurrence first (docs/design.md, "Next edits", has the numbers for the other
orders).
"""

from __future__ import annotations

from collections.abc import Sequence

from efim_lsp.next_edit import call_sites, parallel, proposer
from efim_lsp.next_edit.history import Change
from efim_lsp.next_edit.proposer import NextEdit


def propose(text: str, change: Change | None, earlier: Sequence[Change] = ()) -> NextEdit | None:
    """The next edit after `change` (the latest); `earlier`: the older changes, oldest first
    (a signature change that call fixes have followed still leads to the next call)."""
    if change is None:
        return None
    return proposer.propose(text, change) or call_sites.propose(text, change, earlier) or parallel.propose(text, change)


__all__ = ["propose"]
