"""Answers computed where the cursor settles, before anyone asks.

A cursor signal (`efim/didMoveCursor`, an editor's own document-highlight or code-action
request, an edit away from the live session, a re-open) says where the person is. The
warm-up prefills the window a request there needs (`efim_lsp.warm_ahead`); the answer
ahead goes one step further and runs that request itself, as the completer would for a
client asking at that cursor, while the person reads or pauses:

- a request that then arrives at the same cursor of the same document version joins it:
  it is answered with the suggestion computed (or being computed) there, without starting
  over — what Neovim's built-in client does 200 ms after `InsertEnter`, and any client that
  asks where the cursor landed;
- the suggestion is remembered as shown-to-be (`TypingThrough`), so a person who types its
  first characters gets the rest at once;
- anything else — an edit, a request elsewhere, a newer signal — supersedes it like a
  superseded request: the rows it computed stay cached, so the next request starts from them.

It runs as a foreground engine request (the engine's background work only prefills), so it
is started only at a settled signal, one at a time across documents, and gives way to every
request and edit. Its engine tokens are counted with the warm-ups' (`efim/stats` "warmup":
`answers`, `answerHits`). `answerAhead: false` (or `warmAhead: false`) turns it off.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Awaitable, Callable, NamedTuple

from efim_lsp.answers import Answer, Declined
from efim_lsp.document_state import DocumentState, PendingRequest
from efim_lsp.stats import ServerStats
from efim_lsp.warm_ahead import workable_at
from engine.api import RequestStats

log = logging.getLogger(__name__)

# The completer's request path: (uri, doc, state, pending, cursor, arrival, stats) -> Answer | Declined.
Run = Callable[..., Awaitable[object]]

# What an answer ahead ends with that a request at the same place would end with too (the
# same prompt, greedy): given to a joining request as it is. Others (superseded, stale, an
# engine error) leave the request to compute its own answer.
_FINAL_DECLINES = frozenset({"empty", "length"})


@dataclass(eq=False)
class AheadRecord(ServerStats):
    """The request path's counts of one answer ahead: kept apart from the clients' requests,
    except its engine work, which goes to the server's warm-up counters (also when the
    stream's end is read after the answer, `Completer._drain`)."""

    into: ServerStats | None = None

    def add_engine_request(self, stats: RequestStats) -> None:
        super().add_engine_request(stats)
        if self.into is not None:
            self.into.warm_prefilled_tokens += stats.prefilled_tokens
            self.into.warm_answer_tokens += stats.generated_tokens
            self.into.warm_compute_ms += max(0.0, stats.total_ms - stats.queue_ms)


class Ahead(NamedTuple):
    cursor: int
    version: int
    pending: PendingRequest
    task: asyncio.Task


class AnswerAhead:
    """The answers ahead of the open documents (one per document, at most one running)."""

    def __init__(self, states: dict[str, DocumentState], documents, stats: ServerStats, run: Run) -> None:
        self._states = states  # the completer's, shared
        self.documents = documents
        self.stats = stats
        self._run = run
        self._running: Ahead | None = None
        self._uri: str | None = None

    def start(self, uri: str, cursor: int) -> bool:
        """Run the request a client asking at `cursor` would make, now. False when there is
        nothing to do: a request in flight there, an answer here already (computed ahead
        or shown), a document out of sync."""
        state, doc = self._states.get(uri), self.documents.get(uri)
        if state is None or doc is None or not workable_at(doc, cursor):
            return False
        if state.pending is not None and not state.pending.ahead:
            return False  # a request of the client's own is running
        if state.session.alive and state.session.cursor == cursor and state.served_at == cursor:
            return False  # the last request here ran to its end: a request now gets what it got
        current = state.ahead
        if current is not None and current.cursor == cursor and current.version == doc.version:
            return False  # computed (or being computed) here already
        if state.typed.remainder(doc.text, cursor) is not None:
            return False  # the suggestion shown here still stands
        self.cancel_running("a newer cursor signal")
        pending = PendingRequest(doc.version, ahead=True)
        state.pending = pending
        loop = asyncio.get_running_loop()
        task = loop.create_task(self._compute(uri, doc, state, pending, cursor))
        state.ahead = Ahead(cursor, doc.version, pending, task)
        self._running, self._uri = state.ahead, uri
        return True

    def cancel_running(self, reason: str, *, keep: str | None = None) -> None:
        """End the answer ahead in flight (unless it is `keep`'s): a request or signal elsewhere."""
        running = self._running
        if running is not None and not running.task.done() and self._uri != keep:
            running.pending.supersede(reason)

    async def join(self, uri: str, state: DocumentState, cursor: int, version: int, arrival: float):
        """The answer for a request at `cursor` of `version` from the answer ahead there, once
        it is done; None when there is none (or it ended without one a request would get)."""
        ahead = state.ahead
        if ahead is None or ahead.cursor != cursor or ahead.version != version:
            return None
        try:
            result = await asyncio.shield(ahead.task)
        except asyncio.CancelledError:
            if ahead.task.cancelled():
                return None
            raise  # the joining request itself was cancelled
        except Exception:
            return None
        doc = self.documents.get(uri)
        if doc is None or doc.version != version:
            return None
        if isinstance(result, Answer):
            if result.source == "imports":
                self.stats.import_names += 1
            self.stats.warm_answer_hits += 1
            self.stats.served += 1
            self.stats.latency.add((time.monotonic() - arrival) * 1000)
            return result
        if isinstance(result, Declined) and result.code in _FINAL_DECLINES:
            self.stats.warm_answer_hits += 1
            self.stats.declined[result.code] += 1
            return result
        return None

    async def _compute(self, uri: str, doc, state: DocumentState, pending: PendingRequest, cursor: int):
        record = AheadRecord(into=self.stats)  # not a client's request: counted apart
        try:
            result = await self._run(uri, doc, state, pending, cursor, time.monotonic(), stats=record)
        except Exception:
            log.exception("answer ahead at %s:%d failed", uri, cursor)
            return None
        finally:
            if state.pending is pending:
                state.pending = None
        if pending.superseded is None:
            state.served_at = cursor  # it ran to its end: its KV is the engine's latest here
            if record.served:
                self.stats.warm_answers += 1
        return result


__all__ = ["AnswerAhead", "Ahead"]
