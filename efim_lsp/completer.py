"""The completion pipeline, in code-point offsets (no LSP types, no pygls).

    request ─▶ version/sync checks ─▶ typing-through ─▶ edit session (segments)
            ─▶ InfillRequest ─▶ engine handle (streamed) ─▶ shape ─▶ Answer

Cancellation: a newer request on the same document, or any change to
the document, supersedes the request in flight — its engine handle is cancelled
at once and it answers nothing. An asyncio cancellation (pygls does this for
`$/cancelRequest`) cancels the engine handle too. An answer is only ever for
the document version the request arrived with.

Streaming (`efim_lsp.streaming`): the server sees the first token when it
happens (server-side TTFT) and stops decoding as soon as the suggestion is
complete (a block whose indentation ended, a line that ended).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from typing import Callable, ContextManager, Literal, Protocol, Sequence

import msgspec

from efim_lsp.answer_ahead import AnswerAhead
from efim_lsp.answers import Answer, Declined
from efim_lsp.document_state import UNFINISHED, DocumentState, PendingRequest
from efim_lsp.documents import ChangeOutcome, DocumentStore
from efim_lsp.engine_holder import EngineHolder
from efim_lsp.session import Budget, EditSession, Segments
from efim_lsp.settings import Settings
from efim_lsp.stats import ServerStats
from efim_lsp.streaming import StreamReader
from efim_lsp.suggest import (
    OFFSIDE_LANGUAGES,
    CursorContext,
    choose_mode,
    distinct_alternatives,
    fresh_line,
    shape,
)
from efim_lsp.warm_ahead import WarmAhead
from efim_lsp.window import TokenMeter
from engine.api import ContextChunk, EngineInfo, InfillRequest

log = logging.getLogger(__name__)

# Tokens kept free in the model's context beside the two windows: the increment
# (session limit ~384 chars) and the template's sentinels.
INCREMENT_RESERVE_TOKENS = 192
SENTINEL_RESERVE_TOKENS = 16


class ContextSource(Protocol):
    """Cross-file context for a request (`efim_lsp.context.source.WorkspaceContext`)."""

    def chunks(self, uri: str, text: str, cursor: int, settings: Settings, anchor: object = None) -> Sequence[ContextChunk]:
        """Chunks for a request at `cursor`; the same ones while `anchor` (the edit session) stays."""

    def import_completion(self, uri: str, text: str, cursor: int, settings: Settings) -> str:
        """Names to insert at a name's place in a `from X import` list, from the workspace's
        module X ("" when there is nothing to offer: the model answers then)."""

    def status(self) -> dict[str, object]:
        """Index counters for `efim/stats` ("context")."""

    def busy(self) -> ContextManager[None]:
        """Held while a request is answered: background indexing waits meanwhile."""


# The most one next-edit probe may take before it ends with what it has; how long it waits
# for a client's completion request in flight, and how often it looks.
PROBE_DEADLINE_S = 1.0
PROBE_WAIT_S = 2.0
PROBE_POLL_S = 0.005


def prompt_format(settings: Settings, info: EngineInfo | None) -> Literal["efim", "fim", "prefix"]:
    if info is not None and not info.supports_fim:
        return "prefix"  # a model without FIM sentinels sees P + inc alone
    return settings.prompt_format


def budget_for(settings: Settings, info: EngineInfo | None, fmt: str) -> Budget:
    """Window budgets from the settings, shrunk to fit the model's context if needed."""
    prefix, suffix = settings.prefix_tokens, settings.suffix_tokens
    if fmt == "prefix":
        suffix = 0
    if info is not None and info.context_length > 0:
        reserve = settings.max_tokens + INCREMENT_RESERVE_TOKENS + SENTINEL_RESERVE_TOKENS
        if settings.context != "off":
            reserve += settings.context_tokens
        room = max(info.context_length - reserve, 32)
        if prefix + suffix > room:
            scale = room / (prefix + suffix)
            prefix, suffix = int(prefix * scale), int(suffix * scale)
    return Budget(prefix, suffix)


class Completer:
    def __init__(
        self,
        documents: DocumentStore,
        holder: EngineHolder,
        stats: ServerStats,
        settings: Callable[[], Settings],
        *,
        context_source: ContextSource | None = None,
        stream_workers: int = 8,
    ):
        self.documents = documents
        self.holder = holder
        self.stats = stats
        self.settings = settings
        self.context_source = context_source
        self._states: dict[str, DocumentState] = {}
        self.warm_ahead = WarmAhead(documents, holder, stats, settings, self._states, self._request_at)
        self.answer_ahead = AnswerAhead(self._states, documents, stats, self._run)
        self.warm_ahead.after_warm = self._answer_ahead_at
        self._streams = StreamReader(stream_workers)
        self._ids = itertools.count(1)

    # -- document lifecycle (called synchronously, in message order) --------
    def opened(self, uri: str) -> None:
        old = self._states.pop(uri, None)
        if old and old.pending:
            old.pending.supersede("document re-opened")
        if old:
            old.stop_warming()
        self._states[uri] = DocumentState(TokenMeter(self._count_tokens))
        self.keep_document_pieces(uri, 0)
        last = self.warm_ahead.last_cursor(uri)
        if last is not None:  # opened again: the person is likely back where they last worked
            self.cursor_moved(uri, last)

    def changed(self, uri: str, outcome: ChangeOutcome) -> None:
        state = self._states.get(uri)
        if state is None:
            return
        if state.pending is not None:
            state.pending.supersede("document changed")
        if outcome.resynced:
            state.session.forget("document replaced")
            state.typed.forget()
            state.stop_warming()  # its prompt was of the old text
            state.computed.clear()
        was_alive = state.session.alive
        for edit in outcome.edits:
            state.session.observe(edit)
            state.typed.observe(edit)
        if not outcome.in_sync:
            state.session.forget("document out of sync")
            state.typed.forget()
            state.stop_warming()
        elif outcome.edits:
            # Every edit is a cursor signal (docs/design.md "After a jump"): the person is
            # where the last edit ends. Typing at the live session's cursor needs none (the
            # request that follows continues the session); any other edit — one that ended
            # the session, one above or below its window that left it alive, the first edit
            # of a document without a session — warms there unless a request follows at once.
            last = outcome.edits[-1]
            end = last.start + len(last.new_text)
            if not (was_alive and state.session.alive and state.session.cursor == end):
                self.cursor_moved(uri, end)

    def closed(self, uri: str) -> None:
        state = self._states.pop(uri, None)
        if state and state.pending:
            state.pending.supersede("document closed")
        if state:
            state.stop_warming()
        engine = self.holder.engine
        if engine is not None:
            engine.forget_document(uri)

    def reset_sessions(self, reason: str) -> None:
        """Settings that shape prompts changed: every document starts a new session."""
        for state in self._states.values():
            if state.pending:
                state.pending.supersede(reason)
            state.session.end(reason)
            state.typed.forget()
            state.computed.clear()  # a reloaded engine holds none of them

    def cancel_all(self, reason: str) -> None:
        for state in self._states.values():
            if state.pending:
                state.pending.supersede(reason)

    @property
    def sessions_active(self) -> int:
        return sum(1 for s in self._states.values() if s.session.alive)

    @property
    def rebases(self) -> int:
        return sum(s.session.rebases for s in self._states.values())

    def reset_counters(self) -> None:
        self.stats.reset()
        for state in self._states.values():
            state.session.rebases = 0
            state.session.reasons.clear()

    @property
    def uris(self) -> list[str]:
        return list(self._states)

    def session(self, uri: str) -> EditSession | None:
        state = self._states.get(uri)
        return state.session if state else None

    def close(self) -> None:
        self.cancel_all("server shutting down")
        self._streams.close()

    # -- requests ------------------------------------------------------------
    async def complete(self, uri: str, cursor: int, version: int | None, arrival: float) -> Answer | Declined:
        """Answer a completion request at `cursor` (an offset into the current text).

        `version` is the document version when the request arrived; an answer is only
        given for that version. Background indexing waits while it runs (`ContextSource.busy`).
        """
        with self.context_source.busy() if self.context_source is not None else contextlib.nullcontext():
            return await self._complete(uri, cursor, version, arrival)

    async def _complete(self, uri: str, cursor: int, version: int | None, arrival: float) -> Answer | Declined:
        stats = self.stats
        stats.requests += 1
        doc = self.documents.get(uri)
        state = self._states.get(uri)
        if doc is None or state is None:
            return self._decline("unknownDocument", "unknown document")
        if version is not None and doc.version != version:
            return self._decline("stale", "the document changed before the request started")
        if not doc.in_sync:
            return self._decline("outOfSync", f"document out of sync ({doc.sync_problem}); waiting for the client to re-send it")
        if doc.unsupported:
            return self._decline("unsupportedDocument", doc.unsupported)
        version = doc.version
        self.warm_ahead.remember_cursor(uri, cursor)
        self.answer_ahead.cancel_running("a request elsewhere", keep=uri)
        try:
            joined = await self.answer_ahead.join(uri, state, cursor, version, arrival)
        except asyncio.CancelledError:
            stats.cancelled += 1
            raise
        if joined is not None:  # computed here since the cursor settled (efim_lsp.answer_ahead)
            return joined._replace(source="ahead") if isinstance(joined, Answer) else joined
        if state.pending is not None:
            state.pending.supersede("a newer request")
        if state.warm_timer is not None:  # the request itself is the better warm-up
            state.warm_timer.cancel()
            state.warm_timer = None

        rest = state.typed.remainder(doc.text, cursor)
        if rest is not None:
            stats.typing_through_hits += 1
            stats.served += 1
            stats.latency.add((time.monotonic() - arrival) * 1000)
            return Answer(rest, cursor, cursor, version, next(self._ids), "typing-through")

        if not self.holder.ready:
            if self.holder.state == "failed":
                return self._decline("modelFailed", f"model failed to load: {self.holder.error}")
            return self._decline("modelLoading", "model loading")

        pending = PendingRequest(version)
        state.pending = pending
        try:
            state.served_at = None
            result = await self._run(uri, doc, state, pending, cursor, arrival)
            if pending.superseded is None:
                state.served_at = cursor
            return result
        except asyncio.CancelledError:
            pending.supersede("request cancelled ($/cancelRequest)")
            stats.cancelled += 1
            current = self.documents.get(uri)
            if current is not None and current.version == version:
                # A cancelled request still says where the person is (its rows computed so
                # far stay cached): warm there, unless a newer signal or request replaces it.
                self.cursor_moved(uri, cursor)
            raise
        finally:
            if state.pending is pending:
                state.pending = None

    async def _run(
        self, uri, doc, state: DocumentState, pending: PendingRequest, cursor: int, arrival: float,
        stats: ServerStats | None = None,
    ) -> Answer | Declined:
        """The engine's answer at `cursor`; counted in `stats` (default: the server's; an answer
        ahead counts its own, `efim_lsp.answer_ahead`)."""
        stats = self.stats if stats is None else stats
        settings = self.settings()
        names = self.context_source.import_completion(uri, doc.text, cursor, settings) if self.context_source is not None else ""
        if names:  # the workspace knows which names this import list needs: no model asked
            stats.import_names += 1
            stats.served += 1
            stats.latency.add((time.monotonic() - arrival) * 1000)
            state.typed.remember(cursor, names)
            return Answer(names, cursor, cursor, doc.version, next(self._ids), "imports")
        if settings.debounce_ms:
            await asyncio.sleep(settings.debounce_ms / 1000)
            if pending.superseded:
                stats.cancelled += 1
                return self._decline("superseded", f"superseded: {pending.superseded}", stats)
        engine, info = self.holder.engine, self.holder.info
        if engine is None:
            return self._decline("modelLoading", "model loading", stats)
        ctx = CursorContext.at(doc.text, cursor, offside=doc.language_id in OFFSIDE_LANGUAGES)
        mode = choose_mode(ctx, settings.multiline)
        request, segments = self._request_at(uri, doc, state, cursor, settings, info)
        if segments.rebased:
            log.debug("%s: session %d (%s)", uri, segments.session_id, segments.rebase_reason)
        full_prompt = self.warm_ahead.prompt_of(request, segments, info)
        small, warm_up = self.warm_ahead.small_request(uri, state, request, segments, full_prompt, settings)
        if small is not None:
            request = small
        # A request that cannot finish within `timeoutMs` of its arrival (a machine busy with
        # several documents' prefills) ends then with what it has; its rows stay cached.
        deadline = arrival + settings.timeout_ms / 1000 if settings.timeout_ms else None
        # An empty line inside a block that goes on: a blank answer would show nothing.
        request = msgspec.structs.replace(
            request, stop=("\n",) if mode == "line" else (), deadline=deadline, fresh_line=fresh_line(ctx)
        )
        try:
            handle = engine.submit(request)
        except Exception as exc:  # a closed engine (reload in progress), a request it refuses
            log.warning("%s: the engine refused the request: %s", uri, exc)
            return self._decline("engineError", f"engine error: {type(exc).__name__}: {exc}", stats)
        pending.handle = handle
        if warm_up is not None:  # the full window, behind the small one the engine has now
            warm_up()
        if pending.superseded:  # superseded while submitting (cannot happen on one loop; cheap to check)
            handle.cancel()
        streamed = await self._streams.read(handle, ctx, mode, stats, forks=request.n > 1)
        if streamed.first_token_at is not None:
            stats.ttft.add((streamed.first_token_at - arrival) * 1000)

        if pending.superseded:
            stats.cancelled += 1
            return self._decline("superseded", f"superseded: {pending.superseded}", stats)
        if self.documents.get(uri) is not doc or doc.version != pending.version:
            return self._decline("stale", "the document changed while generating", stats)
        if streamed.error:
            log.warning("%s: engine error: %s", uri, streamed.error)
            return self._decline("engineError", f"engine error: {streamed.error}", stats)
        elapsed_ms = (time.monotonic() - arrival) * 1000
        stats.latency.add(elapsed_ms)
        stats.engine_latency.add(elapsed_ms)
        done = streamed.completion
        if small is None and done is not None and done.finish_reason not in UNFINISHED:
            state.computed.add(full_prompt)  # its whole prompt was computed: the next one starts from it
        elif small is not None:
            stats.first_window_answers += 1
        # An answer the token limit or the deadline ended is cut by one rule: its last line is
        # unfinished, so it shows up to its last line break or its last whole word.
        cut_by = done.finish_reason if done is not None and done.finish_reason in ("length", "deadline") else None
        if cut_by == "deadline":
            stats.deadline_cuts += 1
            if small is None and done.stats.prompt_unfinished:
                self.warm_ahead.finish_cut_prompt(uri, state, request, segments, full_prompt)
        text = shape(streamed.text, ctx, mode, done=True, cut_short=cut_by is not None).text
        if not text:
            if cut_by == "length" and shape(streamed.text, ctx, mode, done=True).text:
                return self._decline("length", f"only part of a word generated within maxTokens ({request.max_tokens} tokens)", stats)
            if cut_by == "deadline":
                what = "only part of a word" if streamed.text.strip() else "nothing"
                return self._decline("deadline", f"{what} generated within timeoutMs ({settings.timeout_ms} ms)", stats)
            return self._decline("empty", "empty suggestion", stats)
        alternatives: tuple[str, ...] = ()
        if done is not None and done.alternatives:
            ended = [(t, why == "length") for t, why in zip(done.alternatives, done.alternatives_finish) if why != "error"]
            alternatives = distinct_alternatives(text, ended, ctx, mode)
        eol = doc.eol
        if eol != "\n":
            text = text.replace("\n", eol)
            alternatives = tuple(alt.replace("\n", eol) for alt in alternatives)
        state.typed.remember(cursor, text)
        stats.served += 1
        return Answer(text, cursor, cursor, pending.version, next(self._ids), "engine", alternatives)

    def _request_at(self, uri: str, doc, state: DocumentState, cursor: int, settings: Settings, info: EngineInfo | None) -> tuple[InfillRequest, Segments]:
        """The engine request for a completion at `cursor` (rebasing the edit session when
        its rules say so). A warm-up renders the same prompt, so what it computes is
        exactly the prefix the first request there will match."""
        fmt = prompt_format(settings, info)
        state.session.prefix_last = fmt == "prefix" or bool(info is not None and info.suffix_first)
        segments = state.session.segments(doc.index, cursor, budget_for(settings, info, fmt))
        # Cross-file context enters requests here and only here. Chunks should stay
        # identical while an edit session lives, or the prompt's prefix (and the KV
        # behind it) changes at every keystroke.
        chunks: tuple[ContextChunk, ...] = ()
        if self.context_source is not None and settings.context != "off":
            chunks = tuple(self.context_source.chunks(uri, doc.text, cursor, settings, anchor=segments.session_id))[: settings.context_chunks]
        request = InfillRequest(
            key=uri,
            prefix=segments.prefix,
            suffix=segments.suffix,
            increment=segments.increment,
            chunks=chunks,
            format=fmt,
            context=settings.context,
            max_tokens=settings.max_tokens,
            temperature=settings.temperature,
            cache=settings.cache,
            blend_ratio=settings.blend_ratio,
            document_kv=settings.document_kv and settings.cache,
            n=settings.alternatives,
            speculate=settings.speculate,
        )
        return request, segments

    # -- next-edit probes (efim_lsp.next_edit.probe) ---------------------------
    def completion_waiting(self) -> bool:
        """A client's completion request is in flight on some document (next-edit work waits
        for none); an answer computed ahead is not one (`efim_lsp.answer_ahead`)."""
        return any(state.pending is not None and not state.pending.ahead for state in self._states.values())

    def probes_answered(self) -> bool:
        """The loaded model answers next-edit probes (an adapter trained on them)."""
        info = self.holder.info
        return self.holder.ready and info is not None and info.probes

    async def ask_probe(self, uri: str, cursor: int, probe: str, max_tokens: int) -> str | None:
        """The model's answer to a next-edit `probe` asked after the document's prompt at
        `cursor` (the prompt a completion there sends, whose KV the engine holds: only the
        probe is prefilled; while that window is cold, the small first window's), or None when
        it cannot be asked now. A client's completion request in flight goes first: the probe
        waits for it (up to `PROBE_WAIT_S`), and then finds the prompt that completion
        computed. Cancelling the caller cancels the engine's work."""
        give_up = time.monotonic() + PROBE_WAIT_S
        while self.completion_waiting():
            if time.monotonic() >= give_up:
                return None
            await asyncio.sleep(PROBE_POLL_S)
        doc, state = self.documents.get(uri), self._states.get(uri)
        if doc is None or state is None or not self.probes_answered():
            return None
        engine, info, settings = self.holder.engine, self.holder.info, self.settings()
        request, segments = self._request_at(uri, doc, state, cursor, settings, info)
        # Where nothing computed the window yet (no completion asked here), the probe goes after
        # the small first window, and the full one is warmed behind it (efim_lsp.warm_ahead).
        full_prompt = self.warm_ahead.prompt_of(request, segments, info)
        small, warm_up = self.warm_ahead.small_request(uri, state, request, segments, full_prompt, settings)
        request = msgspec.structs.replace(
            small if small is not None else request, key=f"{uri}#next-edit", probe=probe, max_tokens=max_tokens,
            heal=False, stop=("\n",), speculate=0, n=1, temperature=0.0, deadline=time.monotonic() + PROBE_DEADLINE_S,
            document_kv=False,  # the document's stored pieces are kept under its own key, not the probe's
        )
        try:
            handle = engine.submit(request)
        except Exception as exc:  # a closed engine (reload in progress), a request it refuses
            log.warning("%s: the engine refused a next-edit probe: %s", uri, exc)
            return None
        if warm_up is not None:
            warm_up()
        try:
            done = await handle.wait()
        except asyncio.CancelledError:
            handle.cancel()
            raise
        if done.finish_reason in ("error", "cancelled"):
            if done.finish_reason == "error":
                log.warning("%s: next-edit probe failed: %s", uri, done.error)
            return None
        return done.text

    # -- cursor signals (efim_lsp.warm_ahead) --------------------------------
    def cursor_moved(self, uri: str, cursor: int) -> None:
        """A cursor signal: warm the window a request at `cursor` would need."""
        self.warm_ahead.cursor_moved(uri, cursor)

    def position_asked(self, uri: str, cursor: int) -> bool:
        """An editor's own request named `cursor` (see `WarmAhead.position_asked`)."""
        return self.warm_ahead.position_asked(uri, cursor)

    def _answer_ahead_at(self, uri: str, cursor: int) -> bool:
        """After a settled cursor signal's warm-up: the answer a request at `cursor` would
        get, computed now (`efim_lsp.answer_ahead`), where the settings allow speculative work."""
        settings = self.settings()
        if not (settings.answer_ahead and settings.warm_ahead and settings.cache) or not self.holder.ready:
            return False
        return self.answer_ahead.start(uri, cursor)

    def warm(self, uri: str, cursor: int) -> bool:
        """Submit the warm-up for `cursor` now (see `WarmAhead.warm`)."""
        return self.warm_ahead.warm(uri, cursor)

    def keep_document_pieces(self, uri: str, cursor: int) -> None:
        self.warm_ahead.keep_document_pieces(uri, cursor)

    def _decline(self, code: str, reason: str, stats: ServerStats | None = None) -> Declined:
        (self.stats if stats is None else stats).declined[code] += 1
        log.debug("completion declined: %s", reason)
        return Declined(code, reason)

    def _count_tokens(self, text: str) -> int:
        engine = self.holder.engine
        if engine is None:
            raise RuntimeError("no engine yet")
        return engine.count_tokens(text)
