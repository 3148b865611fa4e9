"""Warm-ahead: prefill the window where the person is before their first key there.

Every cursor signal (a cursor notification, an edit away from the live session, a re-open,
a cancelled request) schedules a background warm-up of the prompt a request at that place
would send (docs/design.md "After a jump"); where that place is cold, the session's small
window is warmed first (`efim_lsp.first_window`), and a request that arrives before the full
window is computed is answered from the small one (`small_request`). Signals closer
together than `WARM_SETTLE_SECONDS` replace each other. Owns no document state: the
completer's `DocumentState`s are shared with it, and it builds prompts with the completer's
`request_at`, so what a warm-up computes is exactly what the first request there matches.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import logging
from typing import Callable

import msgspec

from efim_lsp.document_state import UNFINISHED, DocumentState
from efim_lsp.documents import Document, DocumentStore
from efim_lsp.engine_holder import EngineHolder
from efim_lsp.first_window import first_window_key, is_cold, prompt_text, small_window
from efim_lsp.session import Segments
from efim_lsp.settings import Settings
from efim_lsp.stats import ServerStats
from engine.api import CompletionHandle, Engine, EngineInfo, InfillRequest

log = logging.getLogger(__name__)

# Cursor signals closer together than this replace each other before a warm-up starts
# (clients debounce too; this bounds what a flood of notifications can cost).
WARM_SETTLE_SECONDS = 0.03
# Documents whose last cursor position is remembered for a re-open.
LAST_CURSORS_KEPT = 256

# (uri, document, state, cursor, settings, engine info) -> (the request, its segments)
RequestAt = Callable[[str, object, DocumentState, int, Settings, "EngineInfo | None"], "tuple[InfillRequest, Segments]"]


def workable_at(doc: Document, cursor: int) -> bool:
    """Whether work ahead of a request (a warm-up, an answer ahead) may be done at `cursor`:
    the server's copy of the document is exact, completion is on for it (a request would
    decline otherwise), and `cursor` still lies in its text (a signal's cursor is kept
    while it settles and across a re-open, and the text may have shrunk since)."""
    return doc.in_sync and not doc.unsupported and 0 <= cursor <= len(doc.text)


def document_pass(engine: Engine, uri: str, text: str, cursor: int) -> None:
    """The document's background pass (documentKv); a document emptied keeps no pieces."""
    if text:
        engine.keep_document_pieces(uri, text, cursor)
    else:
        engine.forget_document(uri)


def _warming(state: DocumentState, prompt: str) -> bool:
    """A warm-up of the document computes `prompt` now."""
    return state.warming is not None and not state.warming.done and state.warming_prompt == prompt


class WarmAhead:
    """Background warm-ups of the documents' windows, at the cursor signals they get."""

    def __init__(
        self,
        documents: DocumentStore,
        holder: EngineHolder,
        stats: ServerStats,
        settings: Callable[[], Settings],
        states: dict[str, DocumentState],
        request_at: RequestAt,
    ) -> None:
        self.documents = documents
        self.holder = holder
        self.stats = stats
        self.settings = settings
        self._states = states  # the completer's, shared
        self._request_at = request_at
        # Where the person last was in each document (requests and cursor signals), kept
        # across close and re-open (least recently used dropped past LAST_CURSORS_KEPT).
        self._last: collections.OrderedDict[str, int] = collections.OrderedDict()
        self._drains: set[asyncio.Task] = set()
        # Called after a settled signal's warm-up with (uri, cursor): the completer's answer ahead.
        self.after_warm: Callable[[str, int], bool] | None = None

    def last_cursor(self, uri: str) -> int | None:
        return self._last.get(uri)

    def cursor_moved(self, uri: str, cursor: int) -> None:
        """A cursor notification (or an edit that moved the session away): warm the
        window a request at `cursor` would need, once the signals settle. Notifications
        arriving faster than `WARM_SETTLE_SECONDS` replace each other: a flood costs what
        the last one costs."""
        state = self._states.get(uri)
        if state is None:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # no event loop (a caller outside the server): nothing to schedule on
            return
        self.remember_cursor(uri, cursor)
        state.warm_cursor = cursor
        if state.warm_timer is not None:
            state.warm_timer.cancel()
        state.warm_timer = loop.call_later(WARM_SETTLE_SECONDS, self._warm_now, uri)

    def position_asked(self, uri: str, cursor: int) -> bool:
        """An editor asked about `cursor` (a document highlight, a code action): where the
        person is, from clients that send nothing of ours. Typing at the live session's
        cursor is no news (the request that follows continues the session); any other
        place is a cursor signal. True when it was taken as one."""
        state = self._states.get(uri)
        if state is None or (state.session.alive and state.session.cursor == cursor):
            return False
        self.stats.warm_position_signals += 1
        self.cursor_moved(uri, cursor)
        return True

    def remember_cursor(self, uri: str, cursor: int) -> None:
        self._last[uri] = cursor
        self._last.move_to_end(uri)
        while len(self._last) > LAST_CURSORS_KEPT:
            self._last.popitem(last=False)

    def _warm_now(self, uri: str) -> None:
        state = self._states.get(uri)
        if state is None:
            return
        state.warm_timer = None
        cursor, state.warm_cursor = state.warm_cursor, None
        if cursor is None:
            return
        try:
            self.warm(uri, cursor)
            if self.after_warm is not None:
                self.after_warm(uri, cursor)
        except Exception:  # a warm-up is an optimisation: never let it hurt the server
            log.exception("warm-up at %s:%d failed", uri, cursor)

    def keep_document_pieces(self, uri: str, cursor: int) -> None:
        """Let the engine compute the document's pieces in the background (documentKv)."""
        settings, engine, doc = self.settings(), self.holder.engine, self.documents.get(uri)
        if engine is None or doc is None or not self.holder.ready or not settings.document_kv or not settings.cache:
            return
        if doc.in_sync and not doc.unsupported:
            document_pass(engine, uri, doc.text, cursor)

    def warm(self, uri: str, cursor: int) -> bool:
        """Submit the background warm-up for `cursor` now; False when there is nothing to
        do (no engine, a request in flight, the live session already serves `cursor`)."""
        settings = self.settings()
        engine, info = self.holder.engine, self.holder.info
        doc, state = self.documents.get(uri), self._states.get(uri)
        if engine is None or doc is None or state is None or not self.holder.ready:
            return False
        if not workable_at(doc, cursor) or not settings.cache:
            return False
        if settings.document_kv:
            document_pass(engine, uri, doc.text, cursor)
        if not settings.warm_ahead or (state.pending is not None and not state.pending.ahead):
            return False
        if state.session.alive and state.session.cursor == cursor and state.served_at == cursor:
            return False  # the last request here ran to its end: its prompt's KV is the engine's
        request, segments = self._request_at(uri, doc, state, cursor, settings, info)
        prompt = self.prompt_of(request, segments, info)
        if _warming(state, prompt):
            return False  # the warm-up in flight computes this prompt: a repeated signal keeps it
        # Where the full window is cold, its small window first (a few hundred ms): a request
        # after a pause then finds the first answer's prompt computed (efim_lsp.first_window).
        small = self.small_window_for(state, request, segments, settings) if self.is_cold_at(state, prompt, settings) else None
        self._leave_other_documents(uri)
        if small is not None:
            self.submit_small_warmup(uri, state, small)
        return self.submit_warmup(uri, state, request, segments, prompt)

    def _leave_other_documents(self, uri: str) -> None:
        """The person is in `uri` now: warm-ups still running in other documents end (their
        rows stay with their documents, retained by the engine, so a return there resumes
        them). The engine runs background prefills in arrival order, so a full window still
        being warmed where the person was would otherwise hold back the small window where
        they are — most of a file switch's first-answer wait."""
        for other_uri, other in self._states.items():
            if other_uri == uri:
                continue
            for handle in (other.warming, other.warming_small):
                if handle is not None and not handle.done:
                    handle.cancel()
                    self.stats.warm_left += 1

    def submit_warmup(self, uri: str, state: DocumentState, request: InfillRequest, segments: Segments, prompt: str) -> bool:
        """Prefill `request`'s prompt in the background (replacing the warm-up in flight)."""
        engine = self.holder.engine
        if engine is None:
            return False
        # Same max_tokens as the request it stands in for: the prompt is fitted to the
        # context identically; the engine samples nothing for a background request.
        request = msgspec.structs.replace(request, background=True, n=1)
        try:
            handle = engine.submit(request)
        except Exception as exc:
            log.debug("%s: warm-up refused: %s", uri, exc)
            return False
        if state.warming is not None and not state.warming.done:
            state.warming.cancel()
        state.warming, state.warming_session, state.warming_prompt = handle, segments.session_id, prompt
        self.stats.warm_submitted += 1
        task = asyncio.get_running_loop().create_task(self._account_warmup(handle, state, prompt))
        self._drains.add(task)
        task.add_done_callback(self._drains.discard)
        return True

    def finish_cut_prompt(self, uri: str, state: DocumentState, request: InfillRequest, segments: Segments, prompt: str) -> bool:
        """A request the `timeoutMs` deadline ended before its prompt was prefilled: the
        rest of that prompt in the background (it keeps the rows computed so far), so the
        next request here — the next key, or another editor window on the same file through
        the engine daemon — finds the window computed instead of meeting the same deadline.
        False when warm-ups are off or this prompt is already being warmed."""
        settings = self.settings()
        if not settings.warm_ahead or not settings.cache or not self.holder.ready:
            return False
        if _warming(state, prompt):
            return False
        if not self.submit_warmup(uri, state, msgspec.structs.replace(request, deadline=None), segments, prompt):
            return False
        self.stats.warm_after_deadline_cuts += 1
        return True

    async def _account_warmup(self, handle: CompletionHandle, state: DocumentState, prompt: str) -> None:
        completion = await handle.wait()
        if completion is not None:
            self.stats.add_warmup(completion.stats, completion.finish_reason)
            if completion.finish_reason not in UNFINISHED:
                state.computed.add(prompt)

    # -- first answers at a new place (efim_lsp.first_window) ------------------
    def prompt_of(self, request: InfillRequest, segments: Segments, info: EngineInfo | None) -> str:
        chunks = "".join(c.text for c in request.chunks)
        suffix_first = bool(info is not None and info.suffix_first)
        return prompt_text(segments, suffix_first=suffix_first, with_suffix=request.format != "prefix", chunks=chunks)

    def small_window_for(
        self, state: DocumentState, request: InfillRequest, segments: Segments, settings: Settings
    ) -> InfillRequest | None:
        """The small-window form of `request`; None when first windows are off or the whole
        window is small."""
        tokens = settings.first_window_tokens
        if not tokens or not settings.cache or not settings.warm_ahead:
            return None
        if self.holder.info is not None and self.holder.info.pins_slots:
            return None  # its own key would take a server slot from a document's KV
        small = state.small.following(segments) if state.small is not None else None
        if small is None:
            # A meter of its own, its ratio measured on the text around the cursor: the small
            # window must depend on the session's segments alone. Cut with the session's meter
            # it moved with whatever was counted before — at a cursor signal one cut, at the
            # first request another — and with this 135M model where the small window starts
            # decides many answers (docs/navigation.md).
            meter = state.session.meter.calibrated(segments.prefix[-3000:] + segments.suffix[:1000])
            small = small_window(segments, tokens, meter)
        state.small = small
        if small.prefix == segments.prefix and small.suffix == segments.suffix and not request.chunks:
            return None  # the whole window is small
        return msgspec.structs.replace(
            request, key=first_window_key(request.key), prefix=small.prefix, suffix=small.suffix, chunks=(), document_kv=False
        )

    def submit_small_warmup(self, uri: str, state: DocumentState, small: InfillRequest) -> None:
        """Prefill the small window in the background ahead of the full one (the scheduler
        runs background prefills in arrival order). A request of the session ends it at
        admission and starts from its rows."""
        engine = self.holder.engine
        if engine is None:
            return
        try:
            handle = engine.submit(msgspec.structs.replace(small, background=True, n=1))
        except Exception as exc:
            log.debug("%s: small-window warm-up refused: %s", uri, exc)
            return
        if state.warming_small is not None and not state.warming_small.done:
            state.warming_small.cancel()
        state.warming_small = handle
        self.stats.first_window_warmups += 1

    def small_request(
        self, uri: str, state: DocumentState, request: InfillRequest, segments: Segments, prompt: str, settings: Settings
    ) -> tuple[InfillRequest | None, Callable[[], bool] | None]:
        """(the small-window request that answers now while the session's full window is
        computed in the background, the full window's warm-up to submit right after it);
        (None, None) when the full window is (nearly) computed, or when first windows are
        off. The caller submits the small request first: submitted first, the warm-up's
        first prefill step started before the answer's request arrived, which then waited
        for that step's first pause (docs/navigation.md)."""
        small = self.small_window_for(state, request, segments, settings)
        if small is None:
            return None, None
        warming_here = state.warming is not None and not state.warming.done and state.warming_session == segments.session_id
        if warming_here:
            return small, None
        if not self.is_cold_at(state, prompt, settings) or self.holder.engine is None:
            return None, None
        return small, functools.partial(self.submit_warmup, uri, state, request, segments, prompt)

    @staticmethod
    def is_cold_at(state: DocumentState, prompt: str, settings: Settings) -> bool:
        return is_cold(state.computed.uncached_chars(prompt), state.session.meter, settings.first_window_tokens)
