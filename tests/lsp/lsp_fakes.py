"""An in-test engine implementing `engine.api.Engine`, for unit tests of server logic only.

It "generates" text from a script function, one token per few characters, on a
thread, honouring cancel; its stats model a prefix cache (tokens shared with the
longest earlier prompt count as reused). The end-to-end tests use the real engine.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import queue
import threading
import time
from concurrent.futures import Future
from typing import Callable, Iterator

from engine.api import Completion, EngineInfo, EngineStats, InfillRequest, RequestStats, StreamEvent

CHARS_PER_TOKEN = 4


def render(req: InfillRequest) -> str:
    if req.format == "efim":
        return f"<PRE>{req.prefix}<SUF>{req.suffix}<MID>{req.increment}"
    if req.format == "fim":
        return f"<PRE>{req.prefix}{req.increment}<SUF>{req.suffix}<MID>"
    return req.prefix + req.increment


class FakeHandle:
    _ids = itertools.count(1)

    def __init__(self, engine: "FakeEngine", req: InfillRequest, text: str, stats: RequestStats):
        self.request_id = next(self._ids)
        self.request = req
        self._engine = engine
        self._events: queue.Queue[StreamEvent] = queue.Queue()
        self._cancel = threading.Event()
        self._done = threading.Event()
        self._final: Completion | None = None
        threading.Thread(target=self._run, args=(text, stats), daemon=True).start()

    def _run(self, text: str, stats: RequestStats) -> None:
        start = time.monotonic()
        prefill, deadline = self._engine.prefill_delay, self.request.deadline
        if prefill > 0 and deadline is not None and start + prefill > deadline:
            # The deadline ends it mid-prefill, as the scheduler does: its rows so far kept, no text.
            time.sleep(max(0.0, deadline - start))
            done_share = max(0.0, deadline - start) / prefill
            self._end("", "deadline", {**_to_dict(stats), "prefilled_tokens": int(stats.prefilled_tokens * done_share)}, start)
            return
        time.sleep(prefill)
        gate = self._engine.background_gate
        if self.request.background and gate is not None:  # a warm-up that runs until the test opens the gate
            while not gate.wait(0.005) and not self._cancel.is_set():
                pass
        cuts = [text.find(s) for s in self.request.stop if s and s in text]
        reason = "eos"
        if cuts:
            text, reason = text[: min(cuts)], "stop"
        pieces = [text[i : i + CHARS_PER_TOKEN] for i in range(0, len(text), CHARS_PER_TOKEN)]
        if len(pieces) > self.request.max_tokens:
            pieces, reason = pieces[: self.request.max_tokens], "length"
        out = ""
        for piece in pieces:
            if self._cancel.is_set():
                break
            if self.request.deadline is not None and time.monotonic() >= self.request.deadline:
                reason = "deadline"  # as the scheduler ends a sequence at its deadline: with what it has
                break
            out += piece
            self._events.put(StreamEvent(kind="token", text=piece))
            time.sleep(self._engine.token_delay)
        if self._cancel.is_set():
            reason = "cancelled"
        self._end(out, reason, {**_to_dict(stats), "generated_tokens": len(out) // CHARS_PER_TOKEN}, start)

    def _end(self, out: str, reason: str, counts: dict, start: float) -> None:
        done = {**counts, "total_ms": (time.monotonic() - start) * 1000}
        final = Completion(text=out, finish_reason=reason, stats=RequestStats(**done))
        self._final = final
        self._engine._finished(self, final)
        self._done.set()
        self._events.put(StreamEvent(kind="done", completion=final))

    def events(self, timeout: float | None = None) -> Iterator[StreamEvent]:
        while True:
            event = self._events.get(timeout=timeout)
            yield event
            if event.kind != "token":
                return

    def result(self, timeout: float | None = None) -> Completion:
        self._done.wait(timeout)
        assert self._final is not None
        return self._final

    async def wait(self) -> Completion:
        while not self._done.is_set():
            await asyncio.sleep(0.001)
        assert self._final is not None
        return self._final

    def cancel(self) -> None:
        self._cancel.set()

    @property
    def done(self) -> bool:
        return self._done.is_set()


def _to_dict(stats: RequestStats) -> dict:
    return {f: getattr(stats, f) for f in stats.__struct_fields__}


class FakeEngine:
    def __init__(
        self,
        script: Callable[[InfillRequest], str] = lambda req: "x = 1\n",
        *,
        token_delay: float = 0.0,
        prefill_delay: float = 0.0,
        supports_fim: bool = True,
        context_length: int = 8192,
    ):
        self.script = script
        self.token_delay = token_delay
        self.prefill_delay = prefill_delay
        self.supports_fim = supports_fim
        self.context_length = context_length
        self.requests: list[InfillRequest] = []
        self.handles: list[FakeHandle] = []
        self._prompts: list[str] = []
        self._lock = threading.Lock()
        self._live: set[int] = set()
        self.cancelled = 0
        self.count_calls = 0
        self.closed = False
        self.forgotten: list[str] = []
        self.document_pieces_kept: list[tuple[str, int, int]] = []
        self.documents_forgotten: list[str] = []
        self.background_gate: threading.Event | None = None  # set: background requests wait until it opens
        self.pins_slots = False  # EngineInfo.pins_slots (a llama.cpp server's slots)
        self.suffix_first = False  # EngineInfo.suffix_first (the shipped adapter's efim-spm layout)

    def info(self) -> EngineInfo:
        return EngineInfo(
            model="fake", architecture="fake", template="starcoder" if self.supports_fim else "prefix-only",
            supports_fim=self.supports_fim, fragment_trained=False, context_length=self.context_length, dtype="none",
            pins_slots=self.pins_slots, suffix_first=self.suffix_first,
        )

    def submit(self, request: InfillRequest) -> FakeHandle:
        prompt = render(request)
        with self._lock:
            shared = max((_common_prefix(prompt, p) for p in self._prompts), default=0) if request.cache else 0
            if request.cache:
                self._prompts.append(prompt)
            self.requests.append(request)
        n = math.ceil(len(prompt) / CHARS_PER_TOKEN)
        reused = shared // CHARS_PER_TOKEN
        stats = RequestStats(prompt_tokens=n, reused_tokens=reused, prefilled_tokens=n - reused)
        handle = FakeHandle(self, request, self.script(request), stats)
        with self._lock:
            self._live.add(handle.request_id)
            self.handles.append(handle)
        return handle

    def _finished(self, handle: FakeHandle, completion: Completion) -> None:
        with self._lock:
            self._live.discard(handle.request_id)
            if completion.finish_reason == "cancelled":
                self.cancelled += 1

    def stats(self) -> EngineStats:
        return EngineStats(requests=len(self.requests), cache_bytes_used=1234)

    def count_tokens(self, text: str) -> int:
        self.count_calls += 1
        return math.ceil(len(text) / CHARS_PER_TOKEN)

    def forget_context(self, path: str) -> None:
        self.forgotten.append(path)

    def computing(self) -> bool:
        return False

    def check_integrity(self) -> Future[None]:
        done: Future[None] = Future()
        done.set_result(None)  # nothing to check: the fake holds no KV
        return done

    def wait_idle(self, timeout: float = 30.0) -> None:
        end = time.monotonic() + timeout
        while self._live:
            if time.monotonic() > end:
                raise TimeoutError("fake engine still busy")
            time.sleep(0.001)

    def keep_document_pieces(self, key: str, text: str, cursor: int) -> None:
        self.document_pieces_kept.append((key, len(text), cursor))

    def forget_document(self, key: str) -> None:
        self.documents_forgotten.append(key)

    on_fault = None  # the engine holder sets it; a fake has no faults to report
    model_in_this_process = True

    def health(self) -> dict:
        return {"state": "closed" if self.closed else "running"}

    def close(self) -> None:
        self.closed = True


def _common_prefix(a: str, b: str) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i
