"""The engine's public boundary: plain-data request/response types and the Engine protocol.

Nothing here knows about LSP, editors or file systems; nothing below this module
knows about strings (see STYLE.md: "an engine that knows no tokenizer" — the
layer that renders templates and tokenizes lives in `engine.local`, one level
above the scheduler, which sees only token ids).

Contracts callers rely on:
- `Engine.submit` never blocks on model work; it returns a `CompletionHandle` at once.
- A newer request with the same `key` supersedes (cancels) the older one.
- A handle always ends with exactly one terminal `StreamEvent` (kind "done" or "error");
  `Completion.finish_reason` says why it ended.
- `InfillRequest` contains strings and numbers only, so it can cross threads and processes.
"""

from __future__ import annotations

from typing import Iterator, Literal, Protocol, runtime_checkable

import msgspec

PromptFormat = Literal["efim", "fim", "prefix"]
ContextMode = Literal["off", "prefix", "blend"]
FinishReason = Literal["stop", "length", "eos", "cancelled", "deadline", "error"]


class ContextChunk(msgspec.Struct, frozen=True):
    """A piece of another file placed before the FIM prompt (cross-file context)."""

    path: str
    text: str


class InfillRequest(msgspec.Struct, frozen=True, kw_only=True):
    """One completion at a cursor.

    Segments, as the edit session defines them (DESIGN.md §2.4):
    `text == prefix + increment + suffix` around the cursor, the cursor right after
    `increment`. `format="efim"` renders `PRE prefix SUF suffix MID increment`;
    `format="fim"` renders `PRE prefix+increment SUF suffix MID`; `format="prefix"`
    renders `prefix+increment` alone (models without FIM tokens).
    """

    key: str
    prefix: str
    suffix: str = ""
    increment: str = ""
    chunks: tuple[ContextChunk, ...] = ()
    format: PromptFormat = "efim"
    context: ContextMode = "prefix"
    max_tokens: int = 64
    stop: tuple[str, ...] = ()
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    # Absolute `time.monotonic()` after which decoding stops (finish_reason "deadline").
    deadline: float | None = None
    # False: recompute the whole prompt (the no-cache baseline); nothing is reused or stored.
    cache: bool = True
    # Token healing for increments that end mid-word; None = the engine decides
    # (on unless the model is fragment-trained).
    heal: bool | None = None
    blend_ratio: float = 0.15
    # Background work (a warm-up: usually max_tokens=0): runs only while no foreground
    # request is queued or running, in small chunks; it never supersedes a foreground
    # request of the same key, and a foreground request of the same key ends it (keeping
    # what it computed). A newer background request of the same key supersedes it.
    background: bool = False
    # Assemble the local segments from the document's stored KV (`Engine.warm_document`)
    # and its previous sequence by CacheBlend (`blend_ratio`) when that covers enough rows.
    document_kv: bool = False


class RequestStats(msgspec.Struct, frozen=True, kw_only=True):
    prompt_tokens: int = 0
    reused_tokens: int = 0
    prefilled_tokens: int = 0
    generated_tokens: int = 0
    healed_tokens: int = 0
    queue_ms: float = 0.0
    ttft_ms: float = 0.0
    total_ms: float = 0.0
    decode_ms_per_token: float = 0.0


class StreamEvent(msgspec.Struct, frozen=True, kw_only=True):
    """`token`: `text` is the new text since the previous event (may be "" for a
    token that completes no character yet). `done` / `error` end the stream."""

    kind: Literal["token", "done", "error"]
    text: str = ""
    completion: "Completion | None" = None
    error: str | None = None


class Completion(msgspec.Struct, frozen=True, kw_only=True):
    text: str
    finish_reason: FinishReason
    stats: RequestStats
    error: str | None = None


class EngineInfo(msgspec.Struct, frozen=True, kw_only=True):
    model: str
    architecture: str
    template: str  # name of the detected FIM template, or "prefix-only"
    supports_fim: bool
    fragment_trained: bool
    context_length: int
    dtype: str
    quant: str | None = None


class EngineStats(msgspec.Struct, frozen=True, kw_only=True):
    requests: int = 0
    completed: int = 0
    cancelled: int = 0
    prompt_tokens: int = 0
    reused_tokens: int = 0
    prefilled_tokens: int = 0
    generated_tokens: int = 0
    evictions: int = 0
    cache_bytes_used: int = 0
    cache_bytes_free: int = 0
    cache_bytes_total: int = 0
    # Background work (warm-ups and document pieces), not counted above.
    warm_requests: int = 0
    warm_completed: int = 0
    warm_cancelled: int = 0
    warm_prefilled_tokens: int = 0
    warm_ms: float = 0.0
    document_tokens: int = 0  # tokens of document pieces whose KV is kept


class EngineError(Exception):
    """A problem the caller can act on (bad model path, unsupported architecture...)."""


@runtime_checkable
class CompletionHandle(Protocol):
    request_id: int

    def events(self, timeout: float | None = None) -> Iterator[StreamEvent]:
        """Blocking iterator over stream events, ending with the terminal one."""

    def result(self, timeout: float | None = None) -> Completion:
        """Block until the terminal event; return the completion."""

    async def wait(self) -> Completion:
        """Await the completion from an asyncio loop without blocking it."""

    def cancel(self) -> None:
        """Ask the engine to stop; safe to call at any time, any number of times."""

    @property
    def done(self) -> bool: ...


@runtime_checkable
class Engine(Protocol):
    def info(self) -> EngineInfo: ...

    def submit(self, request: InfillRequest) -> CompletionHandle: ...

    def stats(self) -> EngineStats: ...

    def count_tokens(self, text: str) -> int:
        """Tokens `text` takes when tokenized on its own (for window budgets)."""

    def warm_document(self, key: str, text: str, cursor: int) -> None:
        """Background: compute and keep the KV of `text`'s pieces (the document `key`),
        nearest `cursor` first, within the memory budget. A newer call for the same key
        replaces the older; an empty `text` forgets the document's pieces. Never blocks."""

    def close(self) -> None: ...


__all__ = [
    "ContextChunk",
    "InfillRequest",
    "RequestStats",
    "StreamEvent",
    "Completion",
    "EngineInfo",
    "EngineStats",
    "EngineError",
    "CompletionHandle",
    "Engine",
    "PromptFormat",
    "ContextMode",
    "FinishReason",
]
