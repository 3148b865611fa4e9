"""One next edit from the non-model proposers, tried in order: a rename's next occurrence
(`proposer`), a changed signature's next call site (`call_sites`), a changed line's next
parallel line (`parallel`). Each is silent unless the latest change is of its kind, so the
order only matters where two could answer: a rename of a shared name in parallel lines
gives the same place either way.
"""

from __future__ import annotations

from efim_lsp.next_edit import call_sites, parallel, proposer
from efim_lsp.next_edit.history import Change
from efim_lsp.next_edit.proposer import NextEdit

PROPOSERS = (proposer.propose, call_sites.propose, parallel.propose)


def propose(text: str, change: Change | None) -> NextEdit | None:
    if change is None:
        return None
    for each in PROPOSERS:
        edit = each(text, change)
        if edit is not None:
            return edit
    return None


__all__ = ["PROPOSERS", "propose"]
