"""The engine thread's loop: admit, order, step and finish sequences — token ids only.

The pipeline, one noun a module: a request becomes a `Sequence` (`engine.sequence`); the
scheduler admits it against the radix cache (`engine.cache`) and the document's retained
KV (`engine.retained`), and asks the `ModelRunner` (`engine.model_runner`) for one prefill
chunk or one batched decode step at a time. Text lives behind each sequence's `TokenSink`
(`engine.prompting`).

Per sequence:
1. admit: `sink.prepare()` gives the prompt ids; reuse = the longer of (a) the rows
   still valid in this document's retained KV (common prefix with the ids it holds,
   generated tokens included) and (b) the radix cache match, whose missing rows are
   gathered from the pool. At least one prompt token is always recomputed (its logits
   pick the first token). The matched path is pinned.
2. prefill the rest in chunks of <= `chunk_tokens`, oldest admitted first; after each
   chunk the new rows are committed to the radix cache (so a cancelled prefill keeps what
   it computed) and the pin moves to the new end. Only prompt tokens enter the radix
   cache: generated tokens stay in the document's retained KV, which the next request of
   the same key reuses (they matter when the user accepts a suggestion).
3. decode: one step per loop iteration for all decoding sequences together.
4. finish: unpin, keep the KV for the document, count, tell the sink.

Contracts:
- `submit` and `cancel` are thread-safe and never block on model work.
- A cancel takes effect before the next chunk or decode step of that sequence.
- Every sequence ends with exactly one `sink.on_finish` call.
- An exception inside a sequence's work ends that sequence with finish_reason "error"; the
  loop, the other sequences and the cache stay consistent (pins released, no slot leaked).
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Callable

from engine.api import FinishReason
from engine.blend import BlendCancelled
from engine.cache import RadixCache, common_prefix_len
from engine.chunks import ChunkStore
from engine.model_runner import ModelRunner
from engine.retained import RetainedKV, RetainedSequence
from engine.sequence import Prompt, Sequence, TokenSink

log = logging.getLogger(__name__)


@dataclass
class Counters:
    requests: int = 0
    completed: int = 0
    cancelled: int = 0
    errors: int = 0
    prompt_tokens: int = 0
    reused_tokens: int = 0
    prefilled_tokens: int = 0
    generated_tokens: int = 0


class Scheduler:
    """Owns the model runner, the cache and the retained KV; `run()` is the engine thread's body."""

    def __init__(
        self,
        model: Any,
        cache: RadixCache,
        *,
        chunk_tokens: int = 256,
        retain_documents: int = 4,
        retained_budget_bytes: int | None = None,
        check_integrity: bool = False,
    ) -> None:
        self.cache = cache
        self.chunk_store = ChunkStore(cache)  # CacheBlend's chunk KV, in held slots of the same pool
        self.runner = ModelRunner(model, cache, self.chunk_store, chunk_tokens=chunk_tokens)
        # Retained KV lives outside the pool; `retained_budget_bytes` caps it (None: count only).
        self.retained = RetainedKV(retain_documents, retained_budget_bytes)
        self.check_after_steps = check_integrity  # debugging: check every store whenever idle
        self.counters = Counters()
        self._inbox: collections.deque[Sequence] = collections.deque()
        self._cond = threading.Condition()
        self._closed = False
        self._prefilling: list[Sequence] = []
        self._decoding: list[Sequence] = []
        self._forget: collections.deque[str] = collections.deque()  # chunk origins to drop (any thread)
        self._when_idle: collections.deque[tuple[Callable[[], Any], Future]] = collections.deque()
        self._stepping = False

    @property
    def context_length(self) -> int:
        return self.runner.context_length

    # ------------------------------------------------------------ any thread
    def submit(self, seq: Sequence) -> None:
        with self._cond:
            if self._closed:
                raise RuntimeError("engine is closed")
            self._inbox.append(seq)
            self._cond.notify()

    def cancel(self, seq: Sequence) -> None:
        """Mark `seq` cancelled and wake the loop (idempotent)."""
        seq.cancelled = True
        with self._cond:
            self._cond.notify()

    def forget_chunks(self, origin: str) -> None:
        """Drop the chunk KV that came from `origin` (a file that changed) at the next step."""
        self._forget.append(origin)

    def run_when_idle(self, fn: Callable[[], Any]) -> Future:
        """Run `fn` on the engine thread between steps, once no sequence is queued or running;
        the future gets its result or exception (RuntimeError when the engine closes first;
        a future cancelled before then is skipped)."""
        fut: Future = Future()
        with self._cond:
            if not self._closed:
                self._when_idle.append((fn, fut))
                self._cond.notify()
                return fut
        fut.set_exception(RuntimeError("engine is closed"))
        return fut

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()

    def idle(self) -> bool:
        """No sequence queued, running, or in the middle of a step."""
        return not self._stepping and not self._inbox and not self._prefilling and not self._decoding

    # ------------------------------------------------------------ engine thread
    def run(self) -> None:
        """Loop until `close()`; then cancel whatever is left."""
        while True:
            with self._cond:
                while not (self._closed or self._inbox or self._prefilling or self._decoding or self._when_idle):
                    self._cond.wait()
                if self._closed:
                    break
            try:
                self.step()
            except Exception:  # a bug outside any sequence's guarded work: fail everyone, keep going
                log.exception("engine step failed")
                for seq in self._prefilling + self._decoding:
                    self._finish(seq, "error", "internal engine error (see log)")
        for seq in list(self._inbox) + self._prefilling + self._decoding:
            self._finish(seq, "cancelled")
        self._inbox.clear()
        while self._when_idle:
            _, fut = self._when_idle.popleft()
            if fut.set_running_or_notify_cancel():
                fut.set_exception(RuntimeError("engine is closed"))

    def step(self) -> None:
        """One unit of work: drop cancelled sequences, admit new ones, one prefill chunk of
        the oldest prefilling sequence, one batched decode step of every decoding one."""
        self._stepping = True
        try:
            # Cancelled sequences go first, so a superseding request of the same document
            # finds the superseded one's KV retained and reuses its rows.
            for group in (self._prefilling, self._decoding):
                for seq in [s for s in group if s.cancelled]:
                    self._finish(seq, "cancelled")
            while self._forget:
                self.chunk_store.forget_origin(self._forget.popleft())
            while (seq := self._next_arrival()) is not None:
                self._guard(seq, self._admit)
            if self._prefilling:
                self._guard(self._prefilling[0], self._prefill)
            if self._decoding:
                self._decode()
        finally:
            self._stepping = False
        if self.idle():
            if self.check_after_steps:
                self.check_integrity()
            self._run_idle_work()

    def check_integrity(self) -> None:
        """Raise AssertionError unless the radix cache, the chunk store and the retained KV
        each hold their invariants. Engine thread only, between steps (other threads:
        `run_when_idle(scheduler.check_integrity)`)."""
        self.cache.check_integrity()
        self.chunk_store.check_integrity()
        self.retained.check_integrity()

    def _run_idle_work(self) -> None:
        while True:
            with self._cond:
                if not self._when_idle:
                    return
                fn, fut = self._when_idle.popleft()
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn())
            except Exception as exc:  # handed to the waiter, who reports it
                fut.set_exception(exc)

    def _next_arrival(self) -> Sequence | None:
        with self._cond:
            return self._inbox.popleft() if self._inbox else None

    def _guard(self, seq: Sequence, work) -> None:
        try:
            work(seq)
        except Exception as exc:  # the sequence fails; the engine does not
            log.exception("request %d failed", seq.request_id)
            self._finish(seq, "error", f"{type(exc).__name__}: {exc}")

    # ------------------------------------------------------------ admission
    def _admit(self, seq: Sequence) -> None:
        seq.t_admit = time.perf_counter()
        self.counters.requests += 1
        if seq.cancelled:
            self._finish(seq, "cancelled")
            return
        prompt = seq.sink.prepare(self.context_length)
        ids = list(prompt.ids)
        if not ids:
            raise ValueError("empty prompt")
        if len(ids) >= self.context_length:
            raise ValueError(f"prompt of {len(ids)} tokens does not fit the context of {self.context_length}")
        seq.start(prompt)
        prev = self.retained.take(seq.key) if seq.cache else None
        have = common_prefix_len(prev.ids, ids) if prev is not None else 0
        match = self.cache.match(ids) if seq.cache else None
        if match is not None:
            seq.pinned = self.cache.pin_match(match)  # before anything can evict it
        reuse = min(max(have, match.n_tokens if match else 0), len(ids) - 1)
        wants_blend = seq.cache and prompt.blend is not None and prompt.blend.wanted(reuse)
        seq.blend = prompt.blend if wants_blend else None
        self.runner.load_kv(seq, prev, have, match, reuse)
        self._prefilling.append(seq)

    # ------------------------------------------------------------ prefill
    def _prefill(self, seq: Sequence) -> None:
        # "length" here means max_tokens == 0 (a cache warm-up): prefill, sample nothing.
        reason = seq.sink.before_step()
        if reason == "deadline":
            self._finish(seq, reason)
            return
        try:
            out = self.runner.prefill_chunk(seq)
        except BlendCancelled:
            self._finish(seq, "cancelled")
            return
        if seq.cache:
            self._commit(seq)
        if not out.last:
            return
        self._prefilling.remove(seq)
        if reason is not None:  # e.g. max_tokens == 0: a cache warm-up
            self._finish(seq, reason)
            return
        self._accept(seq, seq.sampler.sample(out.logits[0], seq.allowed_first))

    def _commit(self, seq: Sequence) -> None:
        """Store the prompt rows computed so far in the radix cache; move the pin to their end."""
        res = self.cache.commit(seq.tokens, seq.kv, seq.n_valid, key=seq.key)
        if res.node is not None:
            self.cache.pin(res.node)
            if seq.pinned is not None:
                self.cache.unpin(seq.pinned)
            seq.pinned = res.node

    # ------------------------------------------------------------ decode
    def _accept(self, seq: Sequence, token: int) -> None:
        if seq.generated == 0:
            seq.t_first = time.perf_counter()
        seq.generated += 1
        reason = seq.sink.on_token(token)
        if reason is not None:
            self._finish(seq, reason)
            return
        seq.pending = token
        if seq not in self._decoding:
            self._decoding.append(seq)

    def _decode(self) -> None:
        batch: list[Sequence] = []
        for seq in list(self._decoding):
            reason = seq.sink.before_step()
            if reason is None and seq.n_valid >= seq.kv.capacity and not self.runner.grow(seq):
                reason = "length"
            if reason is not None:
                self._finish(seq, reason)
            else:
                batch.append(seq)
        if not batch:
            return
        try:
            logits = self.runner.decode(batch)  # [B, V]
        except Exception as exc:
            log.exception("decode step failed")
            for seq in batch:
                self._finish(seq, "error", f"{type(exc).__name__}: {exc}")
            return
        greedy = all(s.sampler.greedy for s in batch)
        picks = logits.argmax(dim=-1).tolist() if greedy else None
        for b, seq in enumerate(batch):
            token = picks[b] if picks is not None else seq.sampler.sample(logits[b])
            self._guard(seq, lambda s, t=token: self._accept(s, t))

    # ------------------------------------------------------------ finish
    def _finish(self, seq: Sequence, reason: FinishReason, error: str | None = None) -> None:
        for group in (self._prefilling, self._decoding):
            if seq in group:
                group.remove(seq)
        if seq.pinned is not None:
            try:
                self.cache.unpin(seq.pinned)
            except Exception:
                log.exception("unpin failed for request %d", seq.request_id)
            seq.pinned = None
        if seq.cache and error is None and seq.kv is not None and seq.n_valid > 0:
            self.retained.keep(seq.key, RetainedSequence(seq.kv, seq.tokens[: seq.n_valid]))
        seq.kv = None
        c = self.counters
        if reason == "cancelled":
            c.cancelled += 1
        elif reason == "error":
            c.errors += 1
        else:
            c.completed += 1
        c.prompt_tokens += seq.n_prompt
        c.reused_tokens += seq.reused
        c.prefilled_tokens += seq.prefilled
        c.generated_tokens += seq.generated
        try:
            seq.sink.on_finish(reason, seq.stats(time.perf_counter()), error)
        except Exception:
            log.exception("finishing request %d failed", seq.request_id)


__all__ = ["Scheduler", "Sequence", "Prompt", "TokenSink", "Counters"]
