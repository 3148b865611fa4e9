"""The server's next edits: each document's history, proposals with ids, their fate.

`NextEdits` is told every applied `didChange` (`changed`) and asked for a proposal at a
request (`propose`). A proposal is only made for the document version the client asked
about, for a document in sync, with a range inside the current text that does not touch the
cursor (where an inline suggestion may be pending). Accepting an id that is stale or unknown
is counted and otherwise harmless.

With `nextEdit: "model"` (`use_model`), `propose_with_model` also asks the model where the
proposers are silent: the latest change's candidate places (`probe`), each a probe the
`ProbeAsker` (the completer) runs after the document's prompt.

The service sees every document, so it also remembers the recent renames of module-level
names (`other_files`): a document whose own proposers are silent is offered the same rename
where it uses a name renamed in another document's module.
"""

from __future__ import annotations

import collections
import itertools
import logging
from collections.abc import Callable, Iterable
from typing import NamedTuple, Protocol

from efim_lsp.documents import ChangeOutcome, DocumentStore
from efim_lsp.next_edit import other_files, probe
from efim_lsp.next_edit.dispatch import propose
from efim_lsp.next_edit.history import EditHistory
from efim_lsp.next_edit.proposer import NextEdit
from efim_lsp.stats import ServerStats

log = logging.getLogger(__name__)

# Offered proposals remembered for the accept command.
OFFERED_KEPT = 64


class Offer(NamedTuple):
    id: int
    uri: str
    version: int
    edit: NextEdit


class ProbeAsker(Protocol):
    """Who runs the model's probes (the completer, which knows the engine and the prompt)."""

    def probes_answered(self) -> bool: ...

    async def ask_probe(self, uri: str, cursor: int, probe: str, max_tokens: int) -> str | None: ...


class NextEdits:
    def __init__(
        self,
        documents: DocumentStore,
        stats: ServerStats,
        enabled: Callable[[], bool] = lambda: True,
        folders: Callable[[], Iterable[str]] = lambda: (),
        use_model: Callable[[], bool] = lambda: False,
    ):
        self.documents = documents
        self.stats = stats
        self.enabled = enabled  # the `nextEdit` setting is not "off"
        self.folders = folders  # the workspace folders' URIs (module names of other files)
        self.use_model = use_model  # the `nextEdit` setting is "model"
        self._asking: dict[str, int] = {}  # uri -> the newest model request's number
        self._said_untrained = False  # logged once: nextEdit "model" with a model not trained on probes
        self.renames: list[other_files.RecentRename] = []  # module-level renames, most recent last
        self._histories: dict[str, EditHistory] = {}
        self._offered: collections.OrderedDict[int, Offer] = collections.OrderedDict()
        self._ids = itertools.count(1)

    # -- documents -------------------------------------------------------------
    def opened(self, uri: str) -> None:
        self._histories[uri] = EditHistory()

    def closed(self, uri: str) -> None:
        self._histories.pop(uri, None)

    def changed(self, uri: str, outcome: ChangeOutcome) -> None:
        history = self._histories.get(uri)
        if history is None:
            return
        if outcome.resynced or not outcome.in_sync:
            history.clear()  # a replaced or untrusted text: earlier offsets mean nothing
            return
        for edit, removed in zip(outcome.edits, outcome.removed):
            history.observe(edit.start, edit.end, removed, edit.new_text)
        doc = self.documents.get(uri)
        if doc is not None and outcome.edits:
            try:
                other_files.remember(self.renames, uri, doc.text, history.last)
            except Exception:
                log.exception("next-edit rename memory failed on %s", uri)

    # -- requests --------------------------------------------------------------
    def propose(self, uri: str, version: int | None, cursor: int | None) -> Offer | None:
        """The next edit for `uri` at `version` (None: the current one), or None."""
        self.stats.next_edit_requests += 1
        doc = self._current(uri, version)
        if doc is None:
            return self._none()
        return self._offer(uri, doc, self._rules(uri, doc), cursor)

    async def propose_with_model(self, uri: str, version: int | None, cursor: int | None, asker: ProbeAsker) -> Offer | None:
        """`propose`, and where the proposers without a model are silent, the model asked about
        the latest change's candidate places (`probe`), nearest first; the first it carries
        the edit to is offered. A client's completion request in flight goes first (the probes
        wait for it); a newer request for the document or a change to it ends the asking with
        no edit."""
        self.stats.next_edit_requests += 1
        doc = self._current(uri, version)
        if doc is None:
            return self._none()
        edit = self._rules(uri, doc)
        if edit is None and self.use_model() and not asker.probes_answered() and not self._said_untrained:
            self._said_untrained = True
            log.info('nextEdit "model": the loaded model was not trained on next-edit probes (efim train --next-edit); '
                     "next edits come from the proposers without a model")
        if edit is None and self.use_model() and asker.probes_answered():
            number = self._asking[uri] = self._asking.get(uri, 0) + 1
            try:
                edit = await self._ask_model(uri, doc, cursor, asker, number)
            except Exception:  # a probe's failure costs this answer, never the request
                log.exception("next-edit model failed on %s", uri)
                edit = None
            finally:
                if self._asking.get(uri) == number:
                    del self._asking[uri]
            if edit is not None and self._current(uri, doc.version) is not doc:
                edit = None  # the document changed while the model was asked
            if edit is not None:
                self.stats.next_edit_model_offers += 1
        return self._offer(uri, doc, edit, cursor)

    async def _ask_model(self, uri: str, doc, cursor: int | None, asker: ProbeAsker, number: int):
        history = self._histories.get(uri)
        change = probe.token_change(doc.text, history.last if history is not None else None)
        if change is None:
            return None
        version = doc.version
        budget = min(24, 2 * max(len(change.old), len(change.new)) + 2)
        for cand in probe.candidates(doc.text, change):
            if self._asking.get(uri) != number or self.documents.get(uri) is not doc or doc.version != version:
                return None  # superseded by a newer request or a change
            answer = await asker.ask_probe(uri, cursor if cursor is not None else change.end, cand.probe, budget)
            if answer is None:
                return None
            self.stats.next_edit_probes += 1
            if probe.accepts(answer, change):
                return probe.as_edit(cand, change)
        return None

    def _current(self, uri: str, version: int | None):
        """The document when a proposal can be made for `version` (None: the current one)."""
        doc = self.documents.get(uri)
        if not self.enabled() or doc is None or uri not in self._histories or not doc.in_sync or doc.unsupported:
            return None
        if version is not None and version != doc.version:
            return None
        return doc

    def _rules(self, uri: str, doc):
        """The proposers without a model: this document's, then other files' renames."""
        history = self._histories[uri]
        try:
            edit = propose(doc.text, history.last, history.changes[:-1])
            if edit is None and self.renames:
                edit = self._from_other_files(uri, doc.text)
        except Exception:  # a proposer's bug costs this answer, never the request
            log.exception("next-edit proposer failed on %s", uri)
            edit = None
        return edit

    def _offer(self, uri: str, doc, edit, cursor: int | None) -> Offer | None:
        """`edit` offered, if its range is valid in the current text and clear of the cursor."""
        if edit is None or not (0 <= edit.start <= edit.end <= len(doc.text)):
            return self._none()
        if doc.text[edit.start : edit.end] == edit.new_text:
            return self._none()
        if cursor is not None and edit.start <= cursor <= edit.end:
            return self._none()  # where the cursor is, the inline suggestion has the say
        offer = Offer(next(self._ids), uri, doc.version, edit)
        self._offered[offer.id] = offer
        while len(self._offered) > OFFERED_KEPT:
            self._offered.popitem(last=False)
        self.stats.next_edit_offered += 1
        return offer

    def _from_other_files(self, uri: str, text: str):
        try:
            folders = list(self.folders() or ())
        except RuntimeError:  # pygls: no workspace before `initialize`
            folders = []
        renames = [
            (r, other_files.module_names(r.uri, folders) | other_files.relative_names(r.uri, uri) if r.uri != uri else None)
            for r in reversed(self.renames)
        ]
        return other_files.propose(text, renames)

    def refused(self) -> None:
        """A request whose params name no document and version: counted, answered empty."""
        self.stats.next_edit_requests += 1
        self._none()

    def shown(self) -> None:
        self.stats.next_edit_shown += 1

    def accepted(self, offer_id: object) -> bool:
        """The client applied an offered edit: True when it was the document's current one."""
        offer = self._offered.pop(offer_id, None) if isinstance(offer_id, int) else None
        doc = self.documents.get(offer.uri) if offer is not None else None
        if offer is None or doc is None:
            self.stats.next_edit_stale_accepts += 1
            return False
        self.stats.next_edit_accepted += 1
        return True

    def _none(self) -> None:
        self.stats.next_edit_empty += 1
        return None


__all__ = ["NextEdits", "Offer", "ProbeAsker"]
