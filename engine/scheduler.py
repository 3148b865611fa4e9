"""The engine thread's loop: admission, chunked prefill, batched decode — token ids only.

A `Job` is one request as the scheduler sees it; everything about text (templates,
tokenization, detokenization, stop strings) sits behind its `TokenSink`, which the
scheduler calls on the engine thread (`engine.local` implements it).

Per job:
1. admit: `sink.prepare()` gives the prompt ids; reuse = the longer of (a) the rows
   still valid in this document's retained workspace (common prefix with the ids the
   workspace holds, generated tokens included) and (b) the radix cache match, whose
   missing rows are gathered from the pool. At least one prompt token is always
   recomputed (its logits pick the first token). The matched path is pinned.
2. prefill the rest in chunks of <= `chunk_tokens`; after each chunk the new rows are
   committed to the radix cache (so a cancelled prefill keeps what it computed) and
   the pin moves to the new end. Only prompt tokens enter the radix cache: generated
   tokens stay in the document's retained workspace, which the next request of the same
   key reuses (they matter when the user accepts a suggestion).
3. decode: one step per loop iteration for all decoding jobs together (`decode_batch`).

Contracts:
- `submit` and `cancel` are thread-safe and never block on model work.
- A cancel takes effect before the next chunk or decode step of that job.
- Every job ends with exactly one `sink.on_finish` call.
- An exception inside a job's work ends that job with finish_reason "error"; the loop,
  the other jobs and the cache stay consistent (pins released, no slot leaked).
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol

import torch

from engine.api import FinishReason, RequestStats
from engine.blend import BlendCancelled, blend_sequence, previous_spans
from engine.cache import RadixCache, RadixNode, common_prefix_len
from engine.chunks import ChunkStore
from engine.sampler import Sampler

log = logging.getLogger(__name__)


class Prompt(NamedTuple):
    ids: list[int]
    allowed_first: torch.Tensor | None = None  # [n] int64: token healing's first-token set
    healed_tokens: int = 0
    blend: Any = None  # engine.blend.BlendRequest: prefill the chunks by CacheBlend (context="blend")


class TokenSink(Protocol):
    """What the scheduler needs from the text layer. All calls come from the engine thread."""

    def prepare(self, context_length: int) -> Prompt: ...

    def before_step(self) -> FinishReason | None: ...

    def on_token(self, token_id: int) -> FinishReason | None: ...

    def on_finish(self, reason: FinishReason, stats: RequestStats, error: str | None) -> None: ...


@dataclass
class Job:
    request_id: int
    key: str
    sink: TokenSink
    sampler: Sampler
    max_tokens: int
    cache: bool = True
    submitted: float = field(default_factory=time.perf_counter)
    cancelled: bool = False
    # --- engine-thread state
    tokens: list[int] = field(default_factory=list)  # prompt ids, then fed generated ids
    n_prompt: int = 0
    allowed_first: torch.Tensor | None = None
    kv: Any = None  # SequenceKV
    n_valid: int = 0  # rows of kv holding tokens[:n_valid]
    pending: int | None = None  # sampled, not yet fed
    pinned: RadixNode | None = None
    generated: int = 0
    reused: int = 0
    prefilled: int = 0
    healed: int = 0
    t_admit: float = 0.0
    t_first: float = 0.0
    blend: Any = None  # engine.blend.BlendRequest
    blend_spans: Any = ()  # local segments found in the document's previous sequence


class Workspace(NamedTuple):
    kv: Any  # SequenceKV
    ids: list[int]  # the tokens whose rows kv holds, row i = ids[i]


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


def _round_up(n: int, to: int) -> int:
    return (n + to - 1) // to * to


class Scheduler:
    """Owns the model and the cache; `run()` is the engine thread's body."""

    def __init__(
        self,
        model: Any,
        cache: RadixCache,
        *,
        end_ids: frozenset[int] | set[int] = frozenset(),
        chunk_tokens: int = 256,
        retain_workspaces: int = 4,
        workspace_budget_bytes: int | None = None,
        check_integrity: bool = False,
    ) -> None:
        if not 1 <= chunk_tokens:
            raise ValueError("chunk_tokens must be >= 1")
        self.model = model
        self.cache = cache
        self.context_length = int(model.config.max_position)
        self.chunk_tokens = chunk_tokens
        self.retain_workspaces = retain_workspaces
        # Retained workspaces live outside the pool; this caps their bytes (None: count only).
        self.workspace_budget_bytes = workspace_budget_bytes
        self.check_integrity = check_integrity
        self.counters = Counters()
        self._inbox: collections.deque[Job] = collections.deque()
        self._cond = threading.Condition()
        self._closed = False
        self._prefilling: list[Job] = []
        self._decoding: list[Job] = []
        self._spare: collections.OrderedDict[str, Workspace] = collections.OrderedDict()
        self.chunk_store = ChunkStore(cache)  # CacheBlend's chunk KV, in held slots of the same pool
        self._forget: collections.deque[str] = collections.deque()  # chunk origins to drop (any thread)
        self._stepping = False

    # ------------------------------------------------------------ any thread
    def submit(self, job: Job) -> None:
        with self._cond:
            if self._closed:
                raise RuntimeError("engine is closed")
            self._inbox.append(job)
            self._cond.notify()

    def cancel(self, job: Job) -> None:
        """Mark `job` cancelled and wake the loop (idempotent)."""
        job.cancelled = True
        with self._cond:
            self._cond.notify()

    def forget_chunks(self, origin: str) -> None:
        """Drop the chunk KV that came from `origin` (a file that changed) at the next step."""
        self._forget.append(origin)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()

    # ------------------------------------------------------------ engine thread
    def run(self) -> None:
        """Loop until `close()`; then cancel whatever is left."""
        while True:
            with self._cond:
                while not self._closed and not self._inbox and not self._prefilling and not self._decoding:
                    self._cond.wait()
                if self._closed:
                    break
            try:
                self.step()
            except Exception:  # a bug outside any job's guarded work: fail everyone, keep going
                log.exception("engine step failed")
                for job in self._prefilling + self._decoding:
                    self._finish(job, "error", "internal engine error (see log)")
        for job in list(self._inbox) + self._prefilling + self._decoding:
            self._finish(job, "cancelled")
        self._inbox.clear()

    def idle(self) -> bool:
        """No job queued, running, or in the middle of a step."""
        return not self._stepping and not self._inbox and not self._prefilling and not self._decoding

    def step(self) -> None:
        """One unit of work: drop cancelled jobs, admit new ones, one prefill chunk of the
        oldest prefilling job, one batched decode step of every decoding job."""
        self._stepping = True
        try:
            self._step()
        finally:
            self._stepping = False
        if self.check_integrity and self.idle():
            self.cache.check_integrity()
            self.chunk_store.check_integrity()

    def _step(self) -> None:
        # Cancelled jobs go first, so a superseding request of the same document finds
        # the superseded one's workspace retained and reuses its rows.
        for group in (self._prefilling, self._decoding):
            for job in [j for j in group if j.cancelled]:
                self._finish(job, "cancelled")
        while self._forget:
            self.chunk_store.forget_origin(self._forget.popleft())
        while True:
            with self._cond:
                if not self._inbox:
                    break
                job = self._inbox.popleft()
            self._guard(job, self._admit)
        if self._prefilling:
            self._guard(self._prefilling[0], self._prefill_chunk)
        if self._decoding:
            self._decode_step()

    def _guard(self, job: Job, work) -> None:
        try:
            work(job)
        except Exception as exc:  # the job fails; the engine does not
            log.exception("request %d failed", job.request_id)
            self._finish(job, "error", f"{type(exc).__name__}: {exc}")

    # ------------------------------------------------------------ admission
    def _admit(self, job: Job) -> None:
        job.t_admit = time.perf_counter()
        self.counters.requests += 1
        if job.cancelled:
            self._finish(job, "cancelled")
            return
        prompt = job.sink.prepare(self.context_length)
        ids = list(prompt.ids)
        if not ids:
            raise ValueError("empty prompt")
        if len(ids) >= self.context_length:
            raise ValueError(f"prompt of {len(ids)} tokens does not fit the context of {self.context_length}")
        job.tokens, job.n_prompt = ids, len(ids)
        job.allowed_first, job.healed = prompt.allowed_first, prompt.healed_tokens
        n = len(ids)
        want_cap = min(self.context_length, _round_up(n + max(job.max_tokens, 0) + 1, 256))

        ws = self._spare.pop(job.key, None) if job.cache else None
        have = common_prefix_len(ws.ids, ids) if ws is not None else 0
        match = self.cache.match(ids) if job.cache else None
        if match is not None:
            job.pinned = self.cache.pin_match(match)  # before anything can evict it
        reuse = min(max(have, match.n_tokens if match else 0), n - 1)
        job.blend = prompt.blend if job.cache and prompt.blend is not None and prompt.blend.wanted(reuse) else None
        if job.blend is not None and ws is not None:  # copied before the workspace is reused below
            job.blend_spans = previous_spans(ws.ids, ws.kv, ids, job.blend.segments, reuse)
        if ws is not None and ws.kv.capacity >= want_cap:
            kv = ws.kv
        else:
            kv = self.model.new_kv(want_cap)
            keep = min(have, reuse)
            if keep:
                kv.k[:, :, :keep].copy_(ws.kv.k[:, :, :keep])  # [L, H_kv, keep, D]
                kv.v[:, :, :keep].copy_(ws.kv.v[:, :, :keep])
        if reuse > have:
            self.cache.gather(match.slots[have:reuse], kv, have)
        job.kv, job.n_valid, job.reused = kv, reuse, reuse
        self._prefilling.append(job)

    # ------------------------------------------------------------ prefill
    def _prefill_chunk(self, job: Job) -> None:
        # "length" here means max_tokens == 0 (a cache warm-up): prefill, sample nothing.
        reason = job.sink.before_step()
        if reason == "deadline":
            self._finish(job, reason)
            return
        lo = job.n_valid
        if job.blend is not None:  # CacheBlend: the whole rest in one pass (it is the cheap part)
            hi, last = job.n_prompt, True
            try:
                out = blend_sequence(
                    self.model, self.chunk_store, job.tokens[:hi], job.kv, lo, job.blend, job.blend_spans,
                    cancelled=lambda: job.cancelled,
                )
            except BlendCancelled:  # rows >= lo are garbage; n_valid still says lo
                self._finish(job, "cancelled")
                return
            logits, job.blend, job.blend_spans = out.logits, None, ()
            job.reused += out.reused
            job.prefilled += out.prefilled - out.reused  # + (hi - lo) below: recomputed rows + chunks prefilled alone
        else:
            hi = min(job.n_prompt, lo + self.chunk_tokens)
            last = hi == job.n_prompt
            ids = torch.tensor(job.tokens[lo:hi], dtype=torch.int64)  # [T]
            logits = self.model.forward(ids, job.kv, lo, "last" if last else "none")  # [1, V] or [0, V]
        job.n_valid = hi
        job.prefilled += hi - lo
        if job.cache:
            res = self.cache.commit(job.tokens, job.kv, hi, key=job.key)
            if res.node is not None:
                self.cache.pin(res.node)
                if job.pinned is not None:
                    self.cache.unpin(job.pinned)
                job.pinned = res.node
        if not last:
            return
        self._prefilling.remove(job)
        if reason is not None:  # e.g. max_tokens == 0: a cache warm-up
            self._finish(job, reason)
            return
        token = job.sampler.sample(logits[0], job.allowed_first)
        self._accept(job, token)

    # ------------------------------------------------------------ decode
    def _accept(self, job: Job, token: int) -> None:
        if job.generated == 0:
            job.t_first = time.perf_counter()
        job.generated += 1
        reason = job.sink.on_token(token)
        if reason is not None:
            self._finish(job, reason)
            return
        job.pending = token
        if job not in self._decoding:
            self._decoding.append(job)

    def _decode_step(self) -> None:
        batch: list[Job] = []
        for job in list(self._decoding):
            reason = job.sink.before_step()
            if reason is None and job.n_valid >= job.kv.capacity:
                reason = self._grow(job)
            if reason is not None:
                self._finish(job, reason)
            else:
                batch.append(job)
        if not batch:
            return
        ids = torch.tensor([j.pending for j in batch], dtype=torch.int64)  # [B]
        try:
            logits = self.model.decode_batch(ids, [j.kv for j in batch], [j.n_valid for j in batch])  # [B, V]
        except Exception as exc:
            log.exception("decode step failed")
            for job in batch:
                self._finish(job, "error", f"{type(exc).__name__}: {exc}")
            return
        greedy = all(j.sampler.greedy for j in batch)
        picks = logits.argmax(dim=-1).tolist() if greedy else None
        for b, job in enumerate(batch):
            job.tokens.append(job.pending)
            job.n_valid += 1
            job.pending = None
            token = picks[b] if picks is not None else job.sampler.sample(logits[b])
            self._guard(job, lambda j, t=token: self._accept(j, t))

    def _grow(self, job: Job) -> FinishReason | None:
        """Double the job's workspace, up to the context length ("length" when full)."""
        cap = job.kv.capacity
        if cap >= self.context_length:
            return "length"
        kv = self.model.new_kv(min(self.context_length, cap * 2))
        kv.k[:, :, :cap].copy_(job.kv.k)  # [L, H_kv, cap, D]
        kv.v[:, :, :cap].copy_(job.kv.v)
        job.kv = kv
        return None

    # ------------------------------------------------------------ finish
    def _finish(self, job: Job, reason: FinishReason, error: str | None = None) -> None:
        for group in (self._prefilling, self._decoding):
            if job in group:
                group.remove(job)
        if job.pinned is not None:
            try:
                self.cache.unpin(job.pinned)
            except Exception:
                log.exception("unpin failed for request %d", job.request_id)
            job.pinned = None
        if job.cache and error is None and job.kv is not None and job.n_valid > 0:
            self._retain(job.key, Workspace(job.kv, job.tokens[: job.n_valid]))
        job.kv = None
        c = self.counters
        if reason == "cancelled":
            c.cancelled += 1
        elif reason == "error":
            c.errors += 1
        else:
            c.completed += 1
        c.prompt_tokens += job.n_prompt
        c.reused_tokens += job.reused
        c.prefilled_tokens += job.prefilled
        c.generated_tokens += job.generated
        now = time.perf_counter()
        stats = RequestStats(
            prompt_tokens=job.n_prompt,
            reused_tokens=job.reused,
            prefilled_tokens=job.prefilled,
            generated_tokens=job.generated,
            healed_tokens=job.healed,
            queue_ms=max(0.0, (job.t_admit - job.submitted) * 1e3) if job.t_admit else 0.0,
            ttft_ms=(job.t_first - job.submitted) * 1e3 if job.generated else 0.0,
            total_ms=(now - job.submitted) * 1e3,
            decode_ms_per_token=(now - job.t_first) * 1e3 / (job.generated - 1) if job.generated > 1 else 0.0,
        )
        try:
            job.sink.on_finish(reason, stats, error)
        except Exception:
            log.exception("finishing request %d failed", job.request_id)

    def _retain(self, key: str, ws: Workspace) -> None:
        """Keep `ws` as the document's latest workspace; drop the least recently used ones
        beyond the count and byte limits (the newest too, if it alone exceeds the bytes:
        its prompt rows are in the radix cache, only generated rows are lost)."""
        self._spare[key] = ws
        self._spare.move_to_end(key)
        limit = self.workspace_budget_bytes
        while self._spare and (
            len(self._spare) > self.retain_workspaces or (limit is not None and self.workspace_bytes() > limit)
        ):
            self._spare.popitem(last=False)

    def workspace_bytes(self) -> int:
        """Bytes held by retained per-document workspaces (outside the pool, inside the budget)."""
        return sum(w.kv.k.numel() * w.kv.k.element_size() * 2 for w in list(self._spare.values()))


__all__ = ["Scheduler", "Job", "Prompt", "TokenSink", "Workspace", "Counters"]
