"""A simulated person replaying one typing trace against a live server.

What the person does with each event of the trace:
- `open`, `change`, `close`: sent as recorded, except that versions are renumbered (an
  accepted suggestion replaces many key presses by one edit) and, when a trace is
  replayed by more than one user at once, URIs get a per-copy path segment.
- `cursor`: sent as the notification it names (`efim/didMoveCursor` by default); a
  request still running on that document is cancelled first, as editors do when the
  cursor leaves.
- `complete`: sent as a request. Under `speed="max"` the person waits for the answer
  before the next key; under `"realtime"` the recorded gaps are kept and a key press
  that arrives while its document's request is still running cancels it with
  `$/cancelRequest`, as editors do; under `"paced"` the person waits for each answer
  and keeps the recorded gaps too: an event is sent at its recorded time or, when an
  answer came later than that, when the answer came, and the rest of the trace moves
  later by as much (so a pause before a key is never shortened by a slow answer).
- an answer that is still current is shown (`textDocument/didShowCompletion`); if its
  text is what the trace types next, the person accepts it at the next key press:
  the accept notification, one edit inserting the accepted text, and the trace resumes
  after the key press that would have typed the same text by hand (see
  `_find_accept`). The document therefore always equals the trace's at that point.
- recorded `show`/`accept` events describe the recorded server's answers, not this
  one's, so they are not forwarded; recorded `cancel` events are.

A completion request that is the first after a jump (`jumps.py`) is recorded with the
pause before it; every request after a jump with that jump's pattern, and the first after
the jump's first edit as such (`first_key`). Only the first `limit` completion requests
of each trace are sent (the edits before each still apply). All times are
`time.perf_counter()` on this side of the pipe.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from typing import Any, Callable, Literal, NamedTuple, Protocol

import msgspec

from efim_tools.trace.client import LspClient, Pending, ResponseError, ServerCrashed
from efim_tools.trace.document import TextDocument
from efim_tools.trace.jumps import JumpMark, first_keys, jump_marks, stop_patterns
from efim_lsp.trace_format import Event, Trace

log = logging.getLogger(__name__)

Outcome = Literal["answered", "cancelled", "late", "timeout", "error"]
MIN_ACCEPT = 3  # characters: accepting fewer than this is no faster than typing them


class RequestRecord(msgspec.Struct, kw_only=True):
    """One completion request as the client saw it."""

    user: int
    trace: str
    index: int  # n-th completion request of this trace (0-based)
    sent_ms: float  # since the configuration's replay started
    outcome: Outcome
    latency_ms: float | None = None  # request written → answer parsed
    ttft_ms: float | None = None  # server-reported time to first token, when it says
    items: int = 0
    chars: int = 0  # length of the first suggestion's text
    accepted: int = 0  # characters of this answer the person accepted
    # Checked at the key press after the answer was shown (None: never checked, e.g. it was
    # superseded first): did the first item (the greedy one) match what the trace typed next,
    # did any item (alternatives)? "Match" is the acceptance rule (`MIN_ACCEPT`).
    first_matched: bool | None = None
    any_matched: bool | None = None
    accepted_item: int | None = None  # index of the item the person accepted (cycling to it)
    # the first request after a jump: the pause before it (ms) and whether it switched files
    jump_pause_ms: float | None = None
    jump_switch: bool = False
    pattern: str | None = None  # the pattern of the jump this request follows (`tour.PATTERNS`), when the trace says
    first_key: bool = False  # the first request after a jump's first edit (most clients: the jump's first request)
    # this request's share of the server's counters (`probe.RequestProbe`, serial replays)
    prompt_tokens: float | None = None
    prefilled_tokens: float | None = None
    warmup_tokens: float | None = None  # background warm-up since the previous request
    warmup_ms: float | None = None
    warmup_submitted: float | None = None  # warm-ups the server started since the previous request
    warmup_cancelled: float | None = None


class Moment(NamedTuple):
    """What the person sees when an answer lands (for live displays such as `efim demo`)."""

    user: int
    trace: str
    index: int
    line: str  # the cursor's line, up to the cursor
    suggestion: str  # text the suggestion would add at the cursor
    latency_ms: float | None
    outcome: Outcome
    accepted: int = 0



class Observer(NamedTuple):
    on_answer: Callable[[Moment], None] | None = None
    on_accept: Callable[[Moment], None] | None = None
    on_request: Callable[[int], None] | None = None  # called with the running request count



def suggestion_of(result: Any) -> dict[str, Any] | None:
    """First inline item of a result (InlineCompletionList, a bare item list, or null)."""
    items = result.get("items") if isinstance(result, dict) else result
    if not items:
        return None
    item = items[0]
    return item if isinstance(item, dict) else None


def item_text(item: dict[str, Any]) -> str:
    text = item.get("insertText", "")
    if isinstance(text, dict):  # StringValue (snippet)
        text = text.get("value", "")
    return text if isinstance(text, str) else ""


def suggestions_of(result: Any) -> tuple[dict[str, Any], ...]:
    """Every inline item of a result, in the server's order (the first is the greedy one)."""
    items = result.get("items") if isinstance(result, dict) else result
    return tuple(item for item in items if isinstance(item, dict)) if isinstance(items, list) else ()


def item_count(result: Any) -> int:
    items = result.get("items") if isinstance(result, dict) else result
    return len(items) if isinstance(items, list) else 0


def server_ttft(result: Any) -> float | None:
    """Per-request time to first token, if the server reports one alongside its answer.

    Looked for in the first item's `data` or the list's `data` (either `ttftMs` or
    `stats.ttftMs`); None means only client-side latency exists for this request."""
    candidates = []
    if isinstance(result, dict):
        candidates.append(result.get("data"))
        item = suggestion_of(result)
        if item:
            candidates.append(item.get("data"))
    for data in candidates:
        if isinstance(data, dict):
            value = data.get("ttftMs", (data.get("stats") or {}).get("ttftMs") if isinstance(data.get("stats"), dict) else None)
            if isinstance(value, (int, float)):
                return float(value)
    return None


class FirstRequestProbe(Protocol):
    """Brackets each trace's first completion request (serial replays only), so the cold
    start of a document can be told apart from the keystrokes after it."""

    async def before_first(self) -> None: ...

    async def after_first(self) -> None: ...


class ReplaySettings(Protocol):
    """What a person reads of the replay's options (`replay.ReplayOptions`). This module
    never imports `replay`: the replay drives people, not the other way round."""

    speed: str
    limit: int | None
    accept: bool
    request_timeout_s: float


class ReplayTally(Protocol):
    """What a person adds to its configuration's result (`replay.ConfigResult`)."""

    records: list[RequestRecord]
    accepts: int
    accepted_chars: int
    cancels_sent: int
    final_digests: dict[str, str]


class RequestProbeLike(Protocol):
    """Called after each answered request of a serial replay (`probe.RequestProbe`)."""

    async def after_request(self, record: RequestRecord) -> None: ...


class Stage(NamedTuple):
    """What every person of one configuration's replay shares."""

    client: LspClient
    options: ReplaySettings
    result: ReplayTally
    clock0: float  # perf_counter() when the replay started
    observer: Observer
    counter: list[int]  # completion requests sent so far, all people together
    probe: FirstRequestProbe | None = None
    request_probe: RequestProbeLike | None = None


class ReceivedAnswer(NamedTuple):
    """The last answer a person got for a document (what it may accept while typing on)."""

    version: int
    cursor: int
    item: dict[str, Any]  # the first item
    record: RequestRecord
    items: tuple[dict[str, Any], ...] = ()  # all items (alternatives), `item` first


class Person:
    """One simulated person replaying one trace."""

    def __init__(self, stage: Stage, trace: Trace, user: int, copy: int) -> None:
        self.client = stage.client
        self.trace = trace
        self.user = user
        self.copy = copy
        self.options = stage.options
        self.result = stage.result
        self.clock0 = stage.clock0
        self.observer = stage.observer
        self.counter = stage.counter
        self.probe = stage.probe
        self.request_probe = stage.request_probe
        self.marks = jump_marks(trace)
        self.keys = first_keys(trace)
        self.patterns = stop_patterns(trace)
        self.encoding = trace.header.position_encoding
        self.docs: dict[str, TextDocument] = {}
        self.inflight: dict[str, tuple[Pending, RequestRecord, asyncio.Task | None]] = {}
        self.answers: dict[str, ReceivedAnswer] = {}
        self.id_map: dict[Any, Pending] = {}
        self.tasks: list[asyncio.Task] = []
        self.completes = 0
        self.name = trace.name if copy == 0 else f"{trace.name}#{copy}"

    def uri(self, uri: str | None) -> str:
        if uri is None or self.copy == 0:
            return uri or ""
        head, _, tail = uri.rpartition("/")
        return f"{head}/copy{self.copy}/{tail}"

    def _params(self, event: Event) -> dict[str, Any]:
        params = dict(event.params)
        if "textDocument" in params and isinstance(params["textDocument"], dict):
            params["textDocument"] = dict(params["textDocument"], uri=self.uri(event.uri))
        return params

    async def run(self) -> None:
        events = self.trace.events
        speed = self.options.speed
        timed = speed in ("realtime", "paced")
        start = time.perf_counter()
        offset = 0.0  # ms of trace time skipped by accepted suggestions
        i = 0
        try:
            while i < len(events):
                event = events[i]
                if timed:
                    delay = start + (event.t - offset) / 1000.0 - time.perf_counter()
                    if delay > 0:
                        await asyncio.sleep(delay)
                    elif speed == "paced":
                        start -= delay  # behind: an answer came late; the rest moves later
                kind = event.kind
                if kind == "open":
                    await self._open(event)
                elif kind == "change":
                    uri = self.uri(event.uri)
                    accept = self._find_accept(i, uri) if self.options.accept else None
                    await self._supersede(uri)
                    if accept is not None:
                        resume, text, answer, full = accept
                        await self._accept(uri, text, answer, full)
                        offset += events[resume].t - event.t
                        i = resume + 1
                        continue
                    await self._change(uri, event)
                elif kind == "complete":
                    if self.options.limit is not None and self.completes >= self.options.limit:
                        break
                    await self._complete(event, self.marks.get(i), self.patterns.get(i), i in self.keys)
                elif kind == "cursor":
                    await self._cursor(event)
                elif kind == "cancel":
                    pending = self.id_map.get(event.params.get("id"))
                    if pending is not None and await self.client.cancel(pending):
                        self.result.cancels_sent += 1
                elif kind == "close":
                    uri = self.uri(event.uri)
                    await self._supersede(uri)
                    if uri in self.docs:
                        await self._close(uri)
                # show / accept: the recorded server's answers, not ours (see module doc)
                i += 1
            await self._drain()
            for uri in list(self.docs):  # stopped early (--limit): leave the server tidy
                await self._close(uri)
        finally:
            for task in self.tasks:
                if not task.done():
                    task.cancel()

    async def _close(self, uri: str) -> None:
        doc = self.docs.pop(uri)
        self.result.final_digests[f"{self.name}:{uri}"] = hashlib.sha1(doc.text.encode("utf-8", "surrogatepass")).hexdigest()
        await self.client.notify("textDocument/didClose", {"textDocument": {"uri": uri}})

    async def _open(self, event: Event) -> None:
        params = self._params(event)
        item = params["textDocument"]
        self.docs[item["uri"]] = TextDocument(item["uri"], item["text"], int(item.get("version", 0)), self.encoding)
        await self.client.notify("textDocument/didOpen", params)

    async def _change(self, uri: str, event: Event) -> None:
        doc = self.docs.get(uri)
        params = self._params(event)
        if doc is not None:
            for change in params["contentChanges"]:
                doc.apply_change(change)
                # Characters the person typed by hand (a replace counts what it inserted).
                self.result.typed_chars += len(change.get("text", ""))
            doc.version += 1
            params["textDocument"] = dict(params["textDocument"], version=doc.version)
        await self.client.notify("textDocument/didChange", params)

    async def _cursor(self, event: Event) -> None:
        uri = self.uri(event.uri)
        if event.id is not None:
            # An editor's own request about the cursor's place (a document highlight, a code
            # action): sent as a request, its answer not waited for; it supersedes nothing.
            pending = await self.client.send_request(event.lsp_method, self._params(event))
            self.tasks.append(asyncio.create_task(swallow(pending)))
            return
        await self._supersede(uri)
        params = self._params(event)
        doc = self.docs.get(uri)
        if doc is not None and "version" in params.get("textDocument", {}):
            params["textDocument"] = dict(params["textDocument"], version=doc.version)
        await self.client.notify(event.lsp_method, params)

    async def _supersede(self, uri: str) -> None:
        """A key press on a document whose request is still running: cancel the request."""
        entry = self.inflight.pop(uri, None)
        self.answers.pop(uri, None)
        if entry is None:
            return
        pending, record, _task = entry
        if await self.client.cancel(pending):
            self.result.cancels_sent += 1
            record.outcome = "cancelled"  # provisional: becomes "late" if an answer still comes

    async def _complete(self, event: Event, jump: JumpMark | None = None, pattern: str | None = None, first_key: bool = False) -> None:
        uri = self.uri(event.uri)
        await self._supersede(uri)
        doc = self.docs.get(uri)
        params = self._params(event)
        cursor = doc.offset_at(params["position"]) if doc is not None and "position" in params else 0
        version = doc.version if doc is not None else 0
        first = self.completes == 0
        if first and self.probe is not None:
            await self.probe.before_first()
        pending = await self.client.send_request(event.lsp_method, params)
        if event.id is not None:
            self.id_map[event.id] = pending
        record = RequestRecord(
            user=self.user,
            trace=self.name,
            index=self.completes,
            sent_ms=(pending.sent - self.clock0) * 1000.0,
            outcome="answered",
            pattern=pattern,
            first_key=first_key,
        )
        if jump is not None:
            record.jump_pause_ms = jump.pause_ms
            record.jump_switch = jump.switch
        self.completes += 1
        self.result.records.append(record)
        self.counter[0] += 1
        if self.observer.on_request:
            self.observer.on_request(self.counter[0])
        if self.options.speed in ("max", "paced"):
            await self._await_answer(uri, pending, record, version, cursor)
            if first and self.probe is not None:
                await self.probe.after_first()
            if self.request_probe is not None:
                await self.request_probe.after_request(record)
        else:
            task = asyncio.create_task(self._await_answer(uri, pending, record, version, cursor))
            self.tasks.append(task)
            self.inflight[uri] = (pending, record, task)

    async def _await_answer(self, uri: str, pending: Pending, record: RequestRecord, version: int, cursor: int) -> None:
        try:
            result = await asyncio.wait_for(asyncio.shield(pending.future), self.options.request_timeout_s)
        except asyncio.TimeoutError:
            await self.client.cancel(pending)
            record.outcome = "timeout"
            return
        except ResponseError as exc:
            record.outcome = "cancelled" if exc.cancelled else "error"
            if not exc.cancelled:
                log.warning("completion request failed: %s", exc)
            return
        finally:
            entry = self.inflight.get(uri)
            if entry is not None and entry[0] is pending:
                del self.inflight[uri]
        record.latency_ms = pending.latency_ms
        record.ttft_ms = server_ttft(result)
        record.items = item_count(result)
        superseded = record.outcome == "cancelled"
        if superseded:
            record.outcome = "late"
        item = suggestion_of(result)
        doc = self.docs.get(uri)
        current = not superseded and doc is not None and doc.version == version
        if item is not None:
            record.chars = len(item_text(item))
        if current and item is not None:
            self.answers[uri] = ReceivedAnswer(version, cursor, item, record, suggestions_of(result) or (item,))
            await self.client.notify("textDocument/didShowCompletion", {"item": item})
        if self.observer.on_answer and doc is not None and current:
            self.observer.on_answer(self._moment(doc, cursor, item, record))

    def _moment(self, doc: TextDocument, cursor: int, item: dict[str, Any] | None, record: RequestRecord, accepted: int = 0) -> Moment:
        line_start = doc.text.rfind("\n", 0, cursor) + 1
        added = ""
        if item is not None:
            span = item_span(doc, item, cursor)
            if span is not None:
                added = item_text(item)[cursor - span[0] :]
        return Moment(self.user, self.name, record.index, doc.text[line_start:cursor].rstrip("\r"), added, record.latency_ms, record.outcome, accepted)

    def _find_accept(self, i: int, uri: str) -> tuple[int, str, ReceivedAnswer, bool] | None:
        """Would the person accept the current suggestion instead of pressing key `i`?

        Each item of the answer is matched against what the trace types next (`_match`);
        the person takes the first item that matches, in the server's order — the greedy
        one first, then the alternatives as an editor cycles them. The answer's record
        notes whether its first item and whether any item matched. Returns (index of the
        change event to resume after, accepted text, answer with the taken item first,
        whole suggestion?) or None."""
        answer = self.answers.get(uri)
        doc = self.docs.get(uri)
        if answer is None or doc is None or answer.version != doc.version:
            return None
        matches = [self._match(i, uri, doc, answer.cursor, item) for item in (answer.items or (answer.item,))]
        record = answer.record
        if record.first_matched is None:
            record.first_matched = matches[0] is not None
            record.any_matched = any(m is not None for m in matches)
        for index, found in enumerate(matches):
            if found is not None:
                j, text, full = found
                record.accepted_item = index
                return j, text, answer._replace(item=answer.items[index]) if index else answer, full
        return None

    def _match(self, i: int, uri: str, doc: TextDocument, cursor: int, item: dict[str, Any]) -> tuple[int, str, bool] | None:
        """How much of `item` the trace types from change event `i` on, if enough to accept.

        Looks ahead through the trace, following the text typed at the answer's cursor
        (edits anywhere else end the look-ahead), for the latest point where the typed text
        is the longest prefix of the item's addition. Returns (index of that change event,
        accepted text, whole item?) or None."""
        span = item_span(doc, item, cursor)
        if span is None:
            return None
        added = item_text(item)[cursor - span[0] :]
        if len(added) < 2:
            return None
        c = cursor
        tail = len(doc.text) - c  # the text after the cursor never changes while typing here
        scratch = TextDocument(uri, doc.text, doc.version, self.encoding)
        best: tuple[int, int] | None = None  # (accepted length, event index)
        events = self.trace.events
        budget = 3 * len(added) + 20
        for j in range(i, min(len(events), i + 2 * budget)):
            event = events[j]
            if event.kind in ("complete", "cancel", "show", "accept"):
                continue
            if event.kind != "change" or self.uri(event.uri) != uri:
                break
            ok = True
            for change in event.params["contentChanges"]:
                before = len(scratch.text)
                if "range" not in change:
                    ok = False
                    break
                start, end = scratch.apply_change(change)
                if start < c or end > before - tail:
                    ok = False
                    break
            if not ok:
                break
            typed = scratch.text[c : len(scratch.text) - tail]
            if len(typed) > len(added) + 8:
                break
            if typed and added.startswith(typed) and (best is None or len(typed) >= best[0]):
                best = (len(typed), j)
        if best is None:
            return None
        length, j = best
        if length < MIN_ACCEPT and not (length == len(added) and length >= 2):
            return None
        return j, added[:length], length == len(added)

    async def _accept(self, uri: str, text: str, answer: ReceivedAnswer, full: bool) -> None:
        doc = self.docs[uri]
        change = doc.edit(answer.cursor, answer.cursor, text)
        doc.version += 1
        await self.client.notify(
            "textDocument/didChange",
            {"textDocument": {"uri": uri, "version": doc.version}, "contentChanges": [change]},
        )
        command = answer.item.get("command") if full else None
        if isinstance(command, dict) and command.get("command"):
            pending = await self.client.send_request(
                "workspace/executeCommand", {"command": command["command"], "arguments": command.get("arguments", [])}
            )
            self.tasks.append(asyncio.create_task(swallow(pending)))
        else:
            await self.client.notify(
                "textDocument/didPartiallyAcceptCompletion", {"item": answer.item, "acceptedLength": len(text)}
            )
        answer.record.accepted = len(text)
        self.result.accepts += 1
        self.result.accepted_chars += len(text)
        if self.observer.on_accept:
            self.observer.on_accept(self._moment(doc, answer.cursor + len(text), None, answer.record, len(text)))

    async def _drain(self) -> None:
        while self.tasks:
            tasks, self.tasks = self.tasks, []
            await asyncio.gather(*tasks, return_exceptions=False)


async def swallow(pending: Pending) -> None:
    try:
        await pending.future
    except (ResponseError, ServerCrashed):
        pass


def item_span(doc: TextDocument, item: dict[str, Any], cursor: int) -> tuple[int, int] | None:
    """Code-point span an item replaces, if it ends at the cursor and agrees with the text
    it replaces (the only shape a person can accept as typing ahead)."""
    rng = item.get("range")
    if rng is None:
        return cursor, cursor
    start, end = doc.offset_at(rng["start"]), doc.offset_at(rng["end"])
    if end != cursor or start > cursor:
        return None
    if not item_text(item).startswith(doc.text[start:cursor]):
        return None
    return start, end
