"""The engine's public boundary: plain-data request/response types and the Engine protocol.

Nothing here knows about LSP, editors or file systems; nothing below the text layer
(`engine.prompting`, one level above the scheduler) knows about strings: the scheduler,
cache and model see token ids and tensors only (docs/design.md, "Layering").

Contracts callers rely on:
- `Engine.submit` never blocks on model work; it returns a `CompletionHandle` at once.
- A newer request with the same `key` supersedes (cancels) the older one.
- A handle always ends with exactly one terminal `StreamEvent` (kind "done" or "error");
  `Completion.finish_reason` says why it ended.
- `InfillRequest` contains strings and numbers only, so it can cross threads and processes.

Thread map (the served process; docs/design.md, "Threads"):
- asyncio event loop (pygls handlers, the completer): `Engine.submit`, `info`, `stats`,
  `count_tokens`, `forget_context`, `keep_document_pieces`, `forget_document`,
  `CompletionHandle.cancel` / `wait`, and awaiting `check_integrity()`'s future
  (`asyncio.wrap_future`). Never `result`, `events`, `wait_idle` or `close` — they block.
- stream pumps (one executor thread per streamed request, `efim_lsp.completer`):
  `CompletionHandle.events()` (blocking iteration) and `cancel`.
- engine thread ("efim-engine", one per `LocalEngine`): the scheduler loop — the radix
  cache, blend store, retained KV, model runner and every `TokenSink` call (prompt
  rendering and tokenization included). Nothing else touches those; other threads reach
  them only through `submit`, `cancel`, `forget_context`, `keep_document_pieces`,
  `forget_document` and `check_integrity`, which enqueue work for it; background warm-ups and
  document pieces run there too, between (and preempted by) requests.
- remote engine thread ("efim-remote", one per `engine.remote.RemoteEngine`, which a
  server with `backend` llama.cpp/openai runs instead of a `LocalEngine`): one asyncio loop
  for every HTTP stream to the inference server, prompt rendering and tokenization, the
  server-slot map and reconnection probes. `submit`, `cancel` and `close` hand it work with
  `call_soon_threadsafe` (never a network wait on the caller's thread); `count_tokens`
  tokenizes on the caller's thread; its `on_fault` is called from that loop (or, for
  faults found while it was built, from the thread that sets `on_fault`).
- daemon client thread ("efim-daemon-client", one per `engine.daemon.DaemonEngine`, which a
  server started with `--daemon` runs instead of a `LocalEngine`): one asyncio loop for the
  Unix socket to the user's engine daemon (another process, which runs the engine thread).
  `submit`, `cancel`, `forget_*`, `keep_document_pieces` and `close` hand it work with
  `call_soon_threadsafe`; `stats` and `count_tokens` wait for the daemon's reply (bounded);
  its `on_fault` is called from that loop.
- context worker ("efim-context", `efim_lsp.context.gatherer`): indexes files, calls
  `count_tokens` (which does not touch the engine thread's tokenizer LRU) and, through the
  gatherer's invalidation listeners, `forget_context` when a file's chunks change.
- file watcher ("efim-watch", `efim_lsp.context.watcher`): only reports changed paths to
  the gatherer; it calls nothing in the engine.
- model loader (an executor thread, `efim_lsp.engine_holder`): the engine factory
  (`engine.local.load_engine`, which does the torch work — weights, pool, the engine
  thread's start — on a thread of its own, "efim-load", that ends when the engine is built:
  a thread that ran parallel torch work keeps an OpenMP team, see `engine.runtime.cpu_threads`) and,
  when an engine is replaced or the server exits, the old engine's `close()`. After loading,
  only the engine thread computes; it sets its own torch thread count each step.
- tests, benchmarks and offline tools may call anything from their own thread, including
  the blocking `result`, `events`, `wait_idle` and `close`.
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import Callable, Iterator, Literal, Protocol, runtime_checkable

import msgspec

PromptFormat = Literal["efim", "fim", "prefix"]
ContextMode = Literal["off", "prefix", "blend"]
FinishReason = Literal["stop", "length", "eos", "cancelled", "deadline", "error"]


class ContextChunk(msgspec.Struct, frozen=True):
    """A piece of another file placed before the FIM prompt (cross-file context)."""

    path: str
    text: str


# Draft length of prompt-lookup speculation (`InfillRequest.speculate`, the server's
# `speculate` setting): measured with `efim bench speculation` (docs/design.md).
DEFAULT_SPECULATE = 6

# The fresh-line rule's confidence guard (`InfillRequest.fresh_line_guard`): the rule lets
# the model answer a blank line once its own probability of doing so reaches this.
# Measured (docs/training.md, "Fresh lines"; default model, 300 HumanEval single-line tasks,
# 300 true-blank held-out lines): 0.9 gave the same answers as no guard (1.0) on both sets;
# 0.8 cost 1.7 points of pass@1 for one true-blank line kept blank, 0.6 cost 7 points. 0.9
# keeps a line blank where the model is all but sure, at no measured cost.
DEFAULT_FRESH_LINE_GUARD = 0.9


class InfillRequest(msgspec.Struct, frozen=True, kw_only=True):
    """One completion at a cursor.

    Segments, as the edit session defines them (docs/design.md, "Prefix stability"):
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
    # Background work (a warm-up): its prompt is prefilled and nothing is sampled (keep
    # `max_tokens` as the real request would have it, so the prompt is cut the same way).
    # It runs only while no foreground request is queued or running, in small prefill steps; it
    # never supersedes a foreground request of the same key, and a foreground request of
    # the same key ends it (keeping what it computed). A newer background request of the
    # same key supersedes it.
    background: bool = False
    # Background work that waits for an idle engine: unlike a warm-up it gets no slice beside a
    # stream of requests (`Scheduler._share_with_warm_up`) — chunk KV computed ahead, which
    # nobody is waiting for. Only with `background`.
    idle_only: bool = False
    # Assemble the local segments from the document's stored KV (`Engine.keep_document_pieces`)
    # and its previous sequence by CacheBlend (`blend_ratio`) when that covers enough rows.
    document_kv: bool = False
    # Alternatives: `n` continuations of one prompt (1..MAX_ALTERNATIVES). The prompt is
    # prefilled once; its sequence then forks into n decode sequences, each with its own
    # copy of the prompt's KV rows, decoded together in the batched decode step. Fork 0 is
    # the request itself (`temperature`, `top_p`, `seed`: greedy by default) and streams
    # the events; forks 1..n-1 sample with `alternatives_temperature` /
    # `alternatives_top_p`, fork i seeded with `(seed or 0) + i`, so a request's
    # alternatives are reproducible. Their texts arrive in `Completion.alternatives`.
    # Background requests ignore `n`.
    n: int = 1
    alternatives_temperature: float = 0.8
    alternatives_top_p: float = 0.95
    # Prompt-lookup speculation (engine.scheduling.speculation): most draft tokens verified per decode
    # step of a greedy request (0: off). Same output as plain greedy decoding, fewer steps.
    speculate: int = DEFAULT_SPECULATE
    # The fresh-line rule (engine.text.sampler.FreshLine), set by the caller when the cursor line is
    # empty and its block goes on (efim_lsp.suggest.fresh_line): while the generated text is
    # whitespace-only, tokens that would end it (a line break, an end token) are refused, so
    # the answer is not a blank line, unless the model's own probability of a blank answer
    # reaches `fresh_line_guard` (in (0, 1]). Applies to every fork (alternatives).
    fresh_line: bool = False
    fresh_line_guard: float = DEFAULT_FRESH_LINE_GUARD
    # Who the request is for, when several clients share one engine (a tenant: the engine
    # daemon sets one per editor window). Across owners the scheduler shares the engine's
    # time fairly — the owner that used it least lately is served next — so one owner's burst
    # does not starve another's requests; one owner's requests keep the usual order, oldest
    # first (engine.scheduling.fairness). "" is an owner like any other (all requests, when
    # nobody names one). It does not scope `key`: callers keep their keys apart.
    owner: str = ""
    # A question asked after the prompt (next-edit checks, `efim_lsp.next_edit.probe`): the
    # template's probe sentinel, then this text tokenized on its own, after the increment. The
    # prompt before it is the document's usual one token for token, so its resident KV is
    # reused and only the probe is prefilled. Only for templates with a probe sentinel (this
    # project's suffix-first adapter); others refuse it. Set `heal=False`: the answer
    # continues the probe's own tokens.
    probe: str = ""


# Most continuations one request may ask for (`InfillRequest.n`).
MAX_ALTERNATIVES = 8


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
    # Decode forwards after the first token, and the speculative ones among them: draft
    # tokens verified and accepted (tokens per step = (generated - 1) / decode_steps).
    decode_steps: int = 0
    verify_steps: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0

    @property
    def prompt_unfinished(self) -> bool:
        """Its prompt's rows were not all computed (a deadline or a cancel ended it while it
        waited or prefilled). False where nothing was counted (a remote server's stream
        that reports no prompt counts)."""
        return self.prompt_tokens > self.reused_tokens + self.prefilled_tokens


class StreamEvent(msgspec.Struct, frozen=True, kw_only=True):
    """`token`: `text` is the new text since the previous event (may be "" for a
    token that completes no character yet). `done` / `error` end the stream."""

    kind: Literal["token", "done", "error"]
    text: str = ""
    completion: "Completion | None" = None
    error: str | None = None


class Completion(msgspec.Struct, frozen=True, kw_only=True):
    """`text`, `finish_reason` and `stats` are fork 0's (the request itself; with n > 1
    `stats` still counts the one prefill). `alternatives` holds the texts of forks 1..n-1
    in fork order (empty, not deduplicated, possibly equal to `text`) and
    `alternatives_finish` why each ended; both are () when n == 1. The terminal event
    comes once every fork has ended."""

    text: str
    finish_reason: FinishReason
    stats: RequestStats
    error: str | None = None
    alternatives: tuple[str, ...] = ()
    alternatives_finish: tuple[FinishReason, ...] = ()


class EngineInfo(msgspec.Struct, frozen=True, kw_only=True):
    model: str
    architecture: str
    template: str  # name of the detected FIM template, or "prefix-only"
    supports_fim: bool
    fragment_trained: bool
    context_length: int
    dtype: str
    quant: str | None = None
    kv_dtype: str | None = None  # the KV cache's format: "model" (the compute dtype) or "int8"; None: not the local engine's
    # The output head's form: "int8, 4-bit screen" (decode steps rank on a 4-bit copy, then the
    # best candidates exactly: engine/model/head_screen.py), "int8", "int4", "dense"; None: not the local engine's.
    head: str | None = None
    # The CPU kernels in C the model runs (kernels/cpu: "decode_attention", "low_rank"); () where
    # none could be built (no C compiler: torch runs them, decode is slower); None: not the local engine's.
    c_kernels: tuple[str, ...] | None = None
    # The form of a mixed model's many-row (prefill) steps: "int8" (W8A8 GEMMs,
    # engine/model/int8_prefill.py) or "bf16" (its bf16 copies); None: not a mixed model, or
    # not the local engine's.
    prefill: str | None = None
    # The template puts the suffix first (`<suf> S <pre> P I`): prefix and increment are
    # adjacent at the end, so an edit just before the cursor changes only the prompt's tail.
    suffix_first: bool = False
    # The engine keeps each document's KV in one server slot of a few (llama.cpp's slots): a
    # second key per document — the language server's first-window requests — would take
    # another slot and evict a document's KV. False: keys are cheap (the local engine's radix
    # cache and retained KV, a server with automatic prefix caching).
    pins_slots: bool = False
    # The template takes a `InfillRequest.probe` (the model was trained on next-edit probes'
    # layout, `efim_lsp.next_edit.probe`); False: probes are refused.
    probes: bool = False


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
    # KV running sequences compute in (their working KV, charged to the same --kv-budget as
    # the bytes above: pool + retained in `cache_bytes_used`).
    working_kv_bytes: int = 0
    # Background work (warm-ups and document pieces), not counted above.
    warm_requests: int = 0
    warm_completed: int = 0
    warm_cancelled: int = 0
    warm_prefilled_tokens: int = 0
    warm_ms: float = 0.0
    document_tokens: int = 0  # tokens of document pieces whose KV is kept
    # Decode forwards and prompt-lookup speculation (as in RequestStats, all requests and forks).
    decode_steps: int = 0
    verify_steps: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    # Disk tier (engine.kv.disk_tier): "off", "on", or "off: <why>" once a disk failure stopped it.
    kv_disk: str = "off"
    kv_disk_loaded_tokens: int = 0  # tokens whose KV came from disk into the radix cache
    kv_disk_saved_files: int = 0

    @classmethod
    def from_counters(cls, counters: object, **measured: int | float | str) -> EngineStats:
        """The stats of an engine from its counters record (the scheduler's `Counters`, the
        remote engine's `Ledger`: any object with attributes): every count named as a
        field here is taken as it is (`warm_ms` rounded to 0.1 ms), and counts of other
        names stay the record's own. `measured`: the fields an engine measures when
        asked (cache bytes, document tokens, the disk tier). One conversion for every
        engine: a count named alike on both sides needs no copying code."""
        fields = {name: getattr(counters, name) for name in cls.__struct_fields__ if hasattr(counters, name)}
        fields["warm_ms"] = round(fields.get("warm_ms", 0.0), 1)
        return cls(**{**fields, **measured})


# The token counts a request reports (`RequestStats`) and that engines and the language
# server total under the same names (`EngineStats`, `efim_lsp.stats.ServerStats`).
TOKEN_COUNTS = ("prompt_tokens", "reused_tokens", "prefilled_tokens", "generated_tokens")


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
        """Tokens `text` takes when tokenized on its own (for window budgets). Any thread."""

    def forget_context(self, path: str) -> None:
        """The file `path` (a `ContextChunk.path`) changed: drop its chunks' cached KV.
        Any thread; never blocks; takes effect before the engine's next step."""

    def computing(self) -> bool:
        """True while this process's engine thread has work now (a request, a warm-up,
        document pieces, chunk KV): Python running on other threads then slows it down (each
        torch call waits for the GIL), so background indexing waits meanwhile. Any thread; a
        racy read. An engine whose model runs in another process answers False."""
        return False

    def check_integrity(self) -> Future[None]:
        """Check every KV store's invariants on the engine thread, between steps, once no
        request is queued or running. The future resolves with None, or fails with the
        AssertionError naming the broken invariant (or RuntimeError once closed). Any
        thread; never blocks — bound the wait on the future."""

    def wait_idle(self, timeout: float = 30.0) -> None:
        """Block until no request is queued or running (TimeoutError after `timeout` s).
        For tests, benchmarks and tools; never from the event loop."""

    def keep_document_pieces(self, key: str, text: str, cursor: int) -> None:
        """Background: compute and keep the KV of `text`'s pieces (the document `key`),
        nearest `cursor` first, within the memory budget. A newer call for the same key
        replaces the older. An empty `text` has no pieces: the call does nothing (the
        document's earlier pieces stay until a newer text replaces them or
        `forget_document` drops them). Never blocks."""

    def forget_document(self, key: str) -> None:
        """Drop the document `key`'s pieces (`keep_document_pieces`) and stop computing them, and
        its working KV kept between keystrokes (the document was closed, or the daemon front
        that had it open left); its cached prefix rows stay, evicted before any open
        document's latest. Any thread; never blocks; takes effect before the engine's next
        step."""

    # Whether the model's weights live in this process (the local engine) or elsewhere (an
    # inference server, the engine daemon): a server switching models closes an engine whose
    # model is here before loading the next, and keeps one whose model is elsewhere serving
    # until the next answers (efim_lsp.engine_holder).
    model_in_this_process: bool

    # Called (kind, message) from the engine's thread when something the user should hear
    # about happened ("engine-crash", "engine-failed", "out-of-memory"); the caller sets it
    # and hands the call to its own thread. None: nobody listens.
    on_fault: Callable[[str, str], None] | None

    def health(self) -> dict:
        """The engine's state for a status report: at least "state" ("running" | "failed"
        | "closed"); a local engine adds restarts, last crash, out-of-memory errors, whether
        its thread is alive and the CPU threads it computes with. Any thread; never blocks."""

    def close(self) -> None: ...


__all__ = [
    "ContextChunk",
    "InfillRequest",
    "RequestStats",
    "StreamEvent",
    "Completion",
    "EngineInfo",
    "EngineStats",
    "TOKEN_COUNTS",
    "EngineError",
    "CompletionHandle",
    "Engine",
    "PromptFormat",
    "ContextMode",
    "FinishReason",
    "MAX_ALTERNATIVES",
    "DEFAULT_SPECULATE",
    "DEFAULT_FRESH_LINE_GUARD",
]
