"""`LocalEngine`: the in-process `engine.api.Engine` (model + radix cache on one thread).

This is the layer that knows text: it renders the FIM template, tokenizes segment by
segment (with token healing), cuts over-long prompts to the context, and turns the
scheduler's token ids back into streamed text with stop rules. Below it (`scheduler`,
`cache`, `model`) everything is token ids and tensors.

Threads: `submit()` runs on the caller's thread and only enqueues; rendering and
tokenization run on the engine thread (an unchanged prefix/suffix is a dict lookup in
the segment LRU), so submit never blocks on the engine.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import time
from pathlib import Path
from typing import Iterator

import torch

from engine.api import (
    Completion,
    EngineError,
    EngineInfo,
    EngineStats,
    FinishReason,
    InfillRequest,
    RequestStats,
    StreamEvent,
)
from engine.blend import blend_request
from engine.cache import RadixCache, default_budget_bytes, parse_bytes
from engine.sampler import Sampler, StopRules
from engine.scheduler import Job, Prompt, Scheduler
from engine.templates import FimTemplate, detect_template
from engine.tokenize import Encoded, SegmentTokenizer, StreamDecoder

log = logging.getLogger(__name__)

_DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float32: "fp32", torch.float16: "fp16"}


class LocalHandle:
    """A submitted request: stream its events, wait for its completion, cancel it."""

    def __init__(self, request_id: int, engine: LocalEngine) -> None:
        self.request_id = request_id
        self._engine = engine
        self._events: queue.SimpleQueue[StreamEvent] = queue.SimpleQueue()
        self._done = threading.Event()
        self._completion: Completion | None = None
        self._lock = threading.Lock()
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future]] = []
        self.job: Job | None = None

    # --- engine side
    def _push(self, event: StreamEvent) -> None:
        self._events.put(event)

    def _complete(self, event: StreamEvent) -> None:
        with self._lock:
            self._completion = event.completion
            self._events.put(event)
            self._done.set()
            waiters, self._waiters = self._waiters, []
        for loop, fut in waiters:
            try:
                loop.call_soon_threadsafe(_resolve, fut, event.completion)
            except RuntimeError:  # the waiter's loop is closed: nobody is listening
                pass

    # --- caller side
    def events(self, timeout: float | None = None) -> Iterator[StreamEvent]:
        """Blocking iterator over stream events, ending with the terminal one. `timeout`
        bounds the wait for each event (TimeoutError). Single consumer: events are handed
        out once."""
        while True:
            try:
                event = self._events.get(timeout=timeout)
            except queue.Empty:
                raise TimeoutError(f"no event from request {self.request_id} within {timeout} s") from None
            yield event
            if event.kind in ("done", "error"):
                return

    def result(self, timeout: float | None = None) -> Completion:
        if not self._done.wait(timeout):
            raise TimeoutError(f"request {self.request_id} not finished within {timeout} s")
        assert self._completion is not None
        return self._completion

    async def wait(self) -> Completion:
        loop = asyncio.get_running_loop()
        with self._lock:
            if self._completion is not None:
                return self._completion
            fut = loop.create_future()
            self._waiters.append((loop, fut))
        return await fut

    def cancel(self) -> None:
        if self.job is not None and not self._done.is_set():
            self._engine.scheduler.cancel(self.job)

    @property
    def done(self) -> bool:
        return self._done.is_set()


def _resolve(fut: asyncio.Future, value: Completion | None) -> None:
    if not fut.done():
        fut.set_result(value)


class _RequestSink:
    """The text side of one request (called on the engine thread only)."""

    def __init__(self, engine: LocalEngine, request: InfillRequest, handle: LocalHandle) -> None:
        self.engine = engine
        self.request = request
        self.handle = handle
        self.rules = StopRules(
            end_ids=engine.end_ids, stop=request.stop, max_tokens=request.max_tokens, deadline=request.deadline
        )
        self.decoder: StreamDecoder | None = None

    def prepare(self, context_length: int) -> Prompt:
        eng, req = self.engine, self.request
        if req.context == "off" and req.chunks:
            req = _replace(req, chunks=())
        segments = eng.template.render(req)
        heal = req.heal if req.heal is not None else not eng.fragment_trained
        enc = eng.tokenizer.encode(segments, heal=heal)
        room = context_length - min(max(req.max_tokens, 1), context_length // 2) - 1
        ids = fit_to_context(enc, room)
        healing = enc.healing
        self.decoder = StreamDecoder(eng.tokenizer.vocab, len(healing.removed_bytes) if healing else 0)
        # CacheBlend needs the chunks' rows as rendered: a prompt cut to fit is prefilled normally.
        blend = blend_request(req, enc, eng.template) if req.context == "blend" and len(ids) == len(enc.ids) else None
        if healing is None:
            return Prompt(ids, blend=blend)
        return Prompt(ids, healing.allowed_ids, 1, blend=blend)

    def before_step(self) -> FinishReason | None:
        return self.rules.before_step()

    def on_token(self, token_id: int) -> FinishReason | None:
        text = self.decoder.feed(token_id)
        chk = self.rules.on_token(token_id, text)
        self.handle._push(StreamEvent(kind="token", text=chk.emit))
        return chk.finish

    def on_finish(self, reason: FinishReason, stats: RequestStats, error: str | None) -> None:
        if reason not in ("stop", "error") and self.decoder is not None:
            held = self.rules.finish_text()  # appended to rules.text
            flushed = self.decoder.flush()  # an unfinished UTF-8 character, if any
            if held or flushed:
                self.handle._push(StreamEvent(kind="token", text=held + flushed))
            text = self.rules.text + flushed
        else:
            text = self.rules.text
        completion = Completion(text=text, finish_reason=reason, stats=stats, error=error)
        self.engine._on_finished(self.handle, completion)
        kind = "error" if reason == "error" else "done"
        self.handle._complete(StreamEvent(kind=kind, completion=completion, error=error))


def _replace(req: InfillRequest, **changes) -> InfillRequest:
    import msgspec  # noqa: PLC0415

    return msgspec.structs.replace(req, **changes)


def fit_to_context(enc: Encoded, budget: int) -> list[int]:
    """`enc.ids` cut to at most `budget` tokens. Order: context chunks (from the left);
    the suffix from its right down to a quarter of the budget; the prefix from its left;
    the rest of the suffix; the increment from its left. Sentinels are kept.

    Why the suffix's far end goes before the prefix: while the increment grows by a
    token per keystroke, cutting one more suffix token (next to the middle sentinel)
    keeps every prefix token — and its cached KV — in place, whereas cutting the
    prefix's left shifts the whole prompt and invalidates all of it."""
    ids = enc.ids
    budget = max(budget, 1)
    excess = len(ids) - budget
    if excess <= 0:
        return list(ids)
    drop = [False] * len(ids)
    suffix_len = sum(sp.end - sp.start for sp in enc.spans if sp.role == "suffix")
    suffix_floor = min(suffix_len, budget // 4)
    plan = [("chunk", "left", 0), ("suffix", "right", suffix_floor), ("prefix", "left", 0),
            ("suffix", "right", 0), ("increment", "left", 0)]
    for role, side, keep in plan:
        spans = [sp for sp in enc.spans if sp.role == role]
        if side == "right":
            spans.reverse()
        for sp in spans:
            left = [i for i in range(sp.start, sp.end) if not drop[i]]
            kept_total = sum(1 for x in enc.spans if x.role == role for i in range(x.start, x.end) if not drop[i])
            take = min(excess, len(left), max(0, kept_total - keep))
            if take <= 0:
                continue
            for i in (left[:take] if side == "left" else left[len(left) - take :]):
                drop[i] = True
            excess -= take
            if excess <= 0:
                break
        if excess <= 0:
            break
    out = [t for t, d in zip(ids, drop) if not d]
    return out[-budget:] if len(out) > budget else out  # only sentinels left over budget


class LocalEngine:
    """In-process engine over a loaded model. Use `load_engine()` to build one."""

    def __init__(
        self,
        loaded,  # engine.model.loader.LoadedModel
        *,
        kv_budget: int | str | None = None,
        chunk_tokens: int = 256,
        fragment_trained: bool = False,
        quant: str | None = None,
        check_integrity: bool = False,
        retain_workspaces: int = 4,
    ) -> None:
        self.loaded = loaded
        self.model = loaded.model
        cfg = self.model.config
        self.template: FimTemplate = detect_template(loaded.tokenizer)
        self.tokenizer = SegmentTokenizer(loaded.tokenizer)
        self.fragment_trained = fragment_trained
        self.quant = quant
        # Any special token ends a completion: code never contains one, and a model that
        # emits `<|endoftext|>` where its config names `<|im_end|>` as EOS is done too.
        self.end_ids = frozenset(cfg.eos_ids) | self.template.stop_ids | self.tokenizer.vocab.special_ids
        budget = parse_bytes(kv_budget) if kv_budget is not None else default_budget_bytes()
        # One budget for all KV: the pool gets 3/4, the retained per-document workspaces
        # (contiguous copies the model computes in, kept so the next keystroke of the same
        # document starts without a gather) at most 1/4.
        self.kv_budget_bytes = budget
        workspace_budget = budget // 4 if retain_workspaces > 0 else 0
        probe = self.model.new_kv(1)
        self.cache = RadixCache(
            n_layers=cfg.n_layers,
            n_kv_heads=cfg.n_kv_heads,
            head_dim=cfg.head_dim,
            dtype=probe.k.dtype,
            budget_bytes=budget - workspace_budget,
        )
        self.scheduler = Scheduler(
            self.model,
            self.cache,
            chunk_tokens=chunk_tokens,
            check_integrity=check_integrity,
            retain_workspaces=retain_workspaces,
            workspace_budget_bytes=workspace_budget,
        )
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._by_key: dict[str, LocalHandle] = {}
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="efim-engine", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        with torch.inference_mode():
            self.scheduler.run()

    # ------------------------------------------------------------ Engine protocol
    def info(self) -> EngineInfo:
        cfg = self.model.config
        return EngineInfo(
            model=self.loaded.name,
            architecture=cfg.architecture,
            template=self.template.name,
            supports_fim=self.template.supports_fim,
            fragment_trained=self.fragment_trained,
            context_length=int(cfg.max_position),
            dtype=_DTYPE_NAMES.get(self.model.dtype, str(self.model.dtype)),
            quant=self.quant,
        )

    def submit(self, request: InfillRequest) -> LocalHandle:
        """Queue `request`; a running request with the same key is cancelled first."""
        if not isinstance(request, InfillRequest):
            raise TypeError(f"submit() takes an InfillRequest, not {type(request).__name__}")
        sampler = Sampler(request.temperature, request.top_p, request.seed)  # ValueError for bad params
        handle = LocalHandle(next(self._ids), self)
        job = Job(
            request_id=handle.request_id,
            key=request.key,
            sink=_RequestSink(self, request, handle),
            sampler=sampler,
            max_tokens=request.max_tokens,
            cache=request.cache,
        )
        handle.job = job
        with self._lock:
            if self._closed:
                raise EngineError("engine is closed")
            old = self._by_key.get(request.key)
            if old is not None and not old.done:
                old.cancel()
            self._by_key[request.key] = handle
            self.scheduler.submit(job)
        return handle

    def _on_finished(self, handle: LocalHandle, completion: Completion) -> None:
        with self._lock:
            key = handle.job.key if handle.job else None
            if key is not None and self._by_key.get(key) is handle:
                del self._by_key[key]

    def stats(self) -> EngineStats:
        c = self.scheduler.counters
        used, free = self.cache.usage()
        workspaces = self.scheduler.workspace_bytes()
        used += workspaces  # retained workspaces are charged to the same budget
        free = max(0, self.kv_budget_bytes - used)
        return EngineStats(
            requests=c.requests,
            completed=c.completed,
            cancelled=c.cancelled,
            prompt_tokens=c.prompt_tokens,
            reused_tokens=c.reused_tokens,
            prefilled_tokens=c.prefilled_tokens,
            generated_tokens=c.generated_tokens,
            evictions=self.cache.evicted_tokens,
            cache_bytes_used=used,
            cache_bytes_free=free,
            cache_bytes_total=used + free,
        )

    def count_tokens(self, text: str) -> int:
        return self.tokenizer.count(text)

    def forget_context(self, path: str) -> None:
        """The file `path` (a `ContextChunk.path`) changed: drop its chunks' cached KV
        (CacheBlend). Thread-safe; takes effect at the engine's next step."""
        self.scheduler.forget_chunks(path)

    def close(self, timeout: float = 10.0) -> None:
        """Stop the engine thread; running requests end "cancelled". Idempotent."""
        with self._lock:
            self._closed = True
        self.scheduler.close()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    def wait_idle(self, timeout: float = 30.0) -> None:
        """Block until no request is queued or running (for tests and benchmarks)."""
        end = time.monotonic() + timeout
        while not self.scheduler.idle():
            if time.monotonic() > end:
                raise TimeoutError("engine still busy")
            time.sleep(0.001)

    def __enter__(self) -> LocalEngine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def load_engine(
    model: str | Path = "default",
    *,
    dtype: str | None = None,
    quant: str | None = None,
    fim_tokens: str = "auto",
    kv_budget: int | str | None = None,
    threads: int | None = None,
    adapter: Path | str | None = "auto",
    fragment_trained: bool | None = None,
    **engine_options,
) -> LocalEngine:
    """Load `model` (see `engine.model.loader.load_model`) and start an engine on it.
    `adapter`: "auto" (the shipped FIM adapter for the default model, when marked ready),
    "none", or a LoRA file/folder (`engine.adapters.resolve_adapter`). `fragment_trained`
    (token healing off) defaults to what the merged adapter's config says
    (`engine.adapters.adapter_heals`); without an adapter, healing is on."""
    from engine.adapters import adapter_heals, resolve_adapter  # noqa: PLC0415
    from engine.model.loader import load_model  # noqa: PLC0415

    if threads is not None:
        if threads < 1:
            raise EngineError(f"threads must be >= 1, not {threads}")
        torch.set_num_threads(threads)
    chosen = resolve_adapter(model, adapter)
    loaded = load_model(model, dtype=dtype, quant=quant, fim_tokens=fim_tokens, adapter=chosen)
    if fragment_trained is None:
        fragment_trained = chosen is not None and not adapter_heals(chosen)
    return LocalEngine(loaded, kv_budget=kv_budget, fragment_trained=fragment_trained, quant=quant, **engine_options)


__all__ = ["LocalEngine", "LocalHandle", "load_engine", "fit_to_context"]
