"""The engine thread's loop: admit, order, step and finish sequences — token ids only.

The pipeline, one noun a module (docs/design.md, "Data flow"): a request becomes a `Sequence` (`engine.scheduling.sequence`); the
scheduler admits it against the radix cache (`engine.kv.radix`) and the document's retained
KV (`engine.kv.retained`), and asks the `ModelRunner` (`engine.scheduling.model_runner`) for one prefill
chunk or one batched decode step at a time. Text lives behind each sequence's `TokenSink`
(`engine.prompting`).

Per sequence:
1. admit: `sink.prepare()` gives the prompt ids (cut to what the KV budget's working share
   holds when the whole window would not fit it, see `engine.scheduling.working_share`); the sequence then
   waits until its working KV can be charged to the budget, and gets it: reuse = the longer of (a) the rows
   still valid in this document's retained KV (common prefix with the ids it holds,
   generated tokens included) and (b) the radix cache match, whose missing rows are
   gathered from the pool. At least one prompt token is always recomputed (its logits
   pick the first token). The matched path is pinned.
2. prefill the rest in chunks of <= `chunk_tokens`, oldest admitted first; after each
   chunk the new rows are committed to the radix cache (so a cancelled prefill keeps what
   it computed) and the pin moves to the new end. Only prompt tokens enter the radix
   cache: generated tokens stay in the document's retained KV, which the next request of
   the same key reuses (they matter when the user accepts a suggestion).
3. decode: one step per loop iteration for all decoding sequences together. A request
   with alternatives (`InfillRequest.n`) forks after its prefill into n sequences, each
   with a copy of the prompt's KV rows, decoded in the same batches (`_fork`). A greedy
   request decoding alone verifies a prompt-lookup draft instead (`engine.scheduling.speculation`):
   several tokens for one forward; with others decoding it takes plain batched steps, so
   it never slows them (docs/design.md, "Prompt-lookup speculation").
4. finish: unpin, keep the KV for the document, count, tell the sink.

Background work (docs/design.md, "After a jump") runs only when no foreground sequence is
queued, prefilling or decoding: first background sequences (warm-ups: a window prefilled
where the user just moved, in chunks of `warm_chunk_tokens`; a CacheBlend warm-up gives
way between layers when a foreground request of another document arrives, and starts
again later), then — after `idle_grace` seconds without foreground work — the documents'
pieces (`engine.scheduling.background.DocumentWork`), one chunk a step. A foreground request of a
document ends that document's background sequence at admission (its rows stay: committed
to the radix cache and retained), so the request starts from them. A request therefore
waits for at most one background chunk (or one layer of a blend).

KV budget (docs/reliability.md, "KV budget"): the working share and its accounting are in
`engine.scheduling.working_share` (`Scheduler.share`).

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
from typing import TYPE_CHECKING, Any, Callable

from engine.api import FinishReason
from engine.scheduling.background import DocumentWork
from engine.cacheblend.blend import BlendCancelled
from engine.kv.radix import RadixCache, common_prefix_len
from engine.kv.chunk_store import ChunkStore
from engine.cacheblend.document_kv import DocumentIndex, DocumentPass
from engine.scheduling.working_share import WorkingShare
from engine.scheduling.model_runner import ModelRunner
from engine.kv.retained import RetainedKV, RetainedSequence
from engine.scheduling.sequence import Prompt, Sequence
from engine.scheduling.speculation import VerifyCost, draft_for, speculate_step

if TYPE_CHECKING:
    import torch

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
    # Background sequences and document pieces (not counted above).
    warm_requests: int = 0
    warm_completed: int = 0
    warm_cancelled: int = 0
    warm_prefilled_tokens: int = 0
    warm_seconds: float = 0.0
    # Decode forwards of all sequences (forks included) and prompt-lookup speculation.
    decode_steps: int = 0
    verify_steps: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    # KV budget (working share): windows cut at admission, alternatives not forked, and
    # sequences that ended "length" because their KV could not grow.
    kv_cut_windows: int = 0
    kv_skipped_forks: int = 0
    kv_grow_refused: int = 0


# A local-only CacheBlend is kept when the document's KV covers at least this share of the
# rows still to compute; below it a plain prefill costs about the same.
MIN_LOCAL_COVERAGE = 0.5
# A request alone in the engine prefills in chunks this many times `chunk_tokens`.
SOLO_CHUNK_FACTOR = 2
# Document pieces (documentKv) are prefilled in chunks of this many tokens when the warm-up
# chunk is adaptive.
DOCUMENT_PIECE_CHUNK = 64
# Speculation looks up in at most this many tokens of the document's previous sequence that
# the new prompt does not share (its suggestion, at the end).
LOOKUP_EXTRA_TOKENS = 256


class PrefillRate:
    """Prefill rows per second, a running average over the chunks computed so far; sizes
    the background chunks (`Scheduler.warm_chunk`). Engine thread only."""

    SMALLEST = 64  # rows: smaller chunks are mostly per-call overhead (never below the old fixed size)
    FIRST_GUESS = 64  # rows, before anything was measured
    WEIGHT = 0.3  # of the newest chunk in the average

    def __init__(self) -> None:
        self.rows_per_s: float | None = None

    def observe(self, rows: int, seconds: float) -> None:
        if rows < self.SMALLEST or seconds <= 0:
            return  # a keystroke's 1-2 rows say nothing about a chunk's rate
        rate = rows / seconds
        self.rows_per_s = rate if self.rows_per_s is None else self.rows_per_s + self.WEIGHT * (rate - self.rows_per_s)

    def chunk_for(self, seconds: float, most: int) -> int:
        """Rows that take about `seconds`, a multiple of 32 in [SMALLEST, most]."""
        if self.rows_per_s is None:
            return min(self.FIRST_GUESS, most)
        rows = int(self.rows_per_s * seconds) // 32 * 32
        return max(self.SMALLEST, min(most, rows))


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
        warm_chunk_tokens: int | None = None,
        warm_chunk_seconds: float = 0.1,
        idle_grace: float = 0.25,
        header: tuple[int, ...] = (),
        chunk_store_fraction: float = 0.5,
        before_step: Callable[[], Any] | None = None,
        working_budget_bytes: int | None = None,
    ) -> None:
        self.cache = cache
        self.before_step = before_step  # engine thread, before each unit of work (e.g. CPU threads)
        # CacheBlend's chunk KV and the documents' pieces, in held slots of the same pool.
        self.chunk_store = ChunkStore(cache, max_fraction=chunk_store_fraction)
        self.runner = ModelRunner(model, cache, self.chunk_store, chunk_tokens=chunk_tokens)
        # A warm-up's chunk: fixed when given, else sized to take about `warm_chunk_seconds`
        # at the prefill rate measured so far — a request waits for at most one such chunk,
        # and small chunks are slow (a 64-token chunk ran the model at ~55 % of a 256-token
        # one's tokens/s on a 2-core AVX512 machine), so the chunk is as large as that wait
        # allows on the machine at hand.
        self.warm_chunk_tokens = warm_chunk_tokens
        self.warm_chunk_seconds = warm_chunk_seconds
        self._prefill_rate = PrefillRate()
        self.idle_grace = idle_grace
        # Retained KV lives outside the pool; `retained_budget_bytes` caps it (None: count only).
        self.retained = RetainedKV(retain_documents, retained_budget_bytes)
        self._holding: dict[Sequence, None] = {}  # every sequence with a working KV, oldest first
        # The KV budget's working share (None: unlimited): running sequences' working KV, the
        # document piece in flight and the retained KV together (engine.scheduling.working_share).
        self.share = WorkingShare(
            model, self.runner, working_budget_bytes, retained=self.retained, holding=self._holding,
            document_work=lambda: self.documents, end_background=lambda seq: self._finish(seq, "cancelled"),
        )
        self.documents = self._document_work(model, header)
        self._plans: collections.deque[DocumentPass] = collections.deque()  # from any thread
        self._indexes: dict[str, DocumentIndex] = {}
        self._last_foreground = 0.0  # perf_counter when foreground work last ran
        # Tests set a list here to read the order of engine steps: (what, key, background).
        self.trace: list[tuple[str, str, bool]] | None = None
        self.check_after_steps = check_integrity  # debugging: check every store whenever idle
        self.counters = Counters()
        self._inbox: collections.deque[Sequence] = collections.deque()
        self._cond = threading.Condition()
        self._closed = False
        self._waiting: list[Sequence] = []  # admitted (prompt built), waiting for KV room
        self._prefilling: list[Sequence] = []
        self._decoding: list[Sequence] = []
        self._forget: collections.deque[str] = collections.deque()  # chunk origins to drop (any thread)
        self._when_idle: collections.deque[tuple[Callable[[], Any], Future]] = collections.deque()
        self._stepping = False
        # Speculation: measured cost of a verify row and acceptance (None: drafts as long as allowed).
        self.verify_cost: VerifyCost | None = VerifyCost()

    @property
    def context_length(self) -> int:
        return self.runner.context_length

    # The working share's sizes, kept by `self.share` (`WorkingShare`).
    @property
    def working_limit(self) -> int | None:
        return self.share.working_limit

    @property
    def row_bytes(self) -> int:
        return self.share.row_bytes

    @property
    def rows_alone(self) -> int:
        return self.share.rows_alone

    def _document_work(self, model: Any, header: tuple[int, ...]) -> DocumentWork:
        max_rows = None if self.working_limit is None else self.rows_alone
        return DocumentWork(
            model, self.chunk_store, header, chunk_tokens=self.warm_chunk_tokens or DOCUMENT_PIECE_CHUNK, max_rows=max_rows
        )

    def warm_chunk(self) -> int:
        """Rows a background prefill computes in one step (see `warm_chunk_seconds`)."""
        if self.warm_chunk_tokens is not None:
            return self.warm_chunk_tokens
        return self._prefill_rate.chunk_for(self.warm_chunk_seconds, self.runner.chunk_tokens)

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

    def plan_document(self, work: DocumentPass) -> None:
        """Make `work` its document's background pass (thread-safe; an empty text forgets)."""
        with self._cond:
            self._plans.append(work)
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
        """No sequence queued, running, or in the middle of a step (background pieces may
        still be pending: they never delay a request by more than one chunk)."""
        return (
            not self._stepping and not self._inbox and not self._waiting and not self._prefilling and not self._decoding
        )

    def background_pending(self) -> bool:
        """Document passes or pieces still to compute (best-effort read from any thread)."""
        return bool(self._plans) or self.documents.pending()

    def document_tokens(self) -> int:
        """Tokens of document pieces kept (a best-effort read from any thread)."""
        try:
            return sum(self.chunk_store.tokens_of(key) for key in list(self.documents.origins))
        except RuntimeError:  # the store changed under the read
            return 0

    def working_kv_bytes(self) -> int:
        """Bytes of working KV charged now: running sequences (a blending one with its copied
        spans) and the document piece in flight (a best-effort read from any thread)."""
        return self.share.working_kv_bytes()

    def _foreground_busy(self) -> bool:
        return any(not s.background for s in (*self._prefilling, *self._decoding))

    def _foreground_chunk(self, seq: Sequence) -> int:
        """Rows of a request's next prefill chunk: `SOLO_CHUNK_FACTOR` times the usual chunk
        while it is the only work (nothing else prefilling, decoding or arrived), else the
        usual one. A larger chunk runs the model faster (512 rows: ~17 % more tokens/s than
        256 on a 2-core AVX512/AMX machine); the one cost, a request arriving meanwhile
        waiting for the rest of it, is nil for the same document's next keystroke, which
        supersedes this request and reuses its rows."""
        chunk = self.runner.chunk_tokens
        if len(self._prefilling) == 1 and not self._decoding and not self._inbox and not self._waiting:
            return chunk * SOLO_CHUNK_FACTOR
        return chunk

    def _foreground_waiting(self, key: str | None = None) -> bool:
        """A foreground request of another document than `key` waits in the inbox."""
        with self._cond:
            arrived = any(not s.background and s.key != key for s in self._inbox)
        return arrived or any(not s.background and s.key != key for s in self._waiting)

    def _wait_seconds(self) -> float | None:
        """How long the loop may sleep: None (until woken) when there is nothing at all,
        0 when there is work now, else until the idle grace for document pieces is over."""
        if self._inbox or self._waiting or self._prefilling or self._decoding or self._plans or self._when_idle:
            return 0.0
        if not self.documents.pending():
            return None
        return max(0.0, self._last_foreground + self.idle_grace - time.perf_counter())

    # ------------------------------------------------------------ engine thread
    def run(self) -> None:
        """Loop until `close()`; then cancel whatever is left."""
        while True:
            with self._cond:
                while not self._closed:
                    wait = self._wait_seconds()
                    if wait == 0.0:
                        break
                    self._cond.wait(wait)
                if self._closed:
                    break
            try:
                self.step()
            except Exception:  # a bug outside any sequence's guarded work: fail everyone, keep going
                log.exception("engine step failed")
                for seq in self._prefilling + self._decoding:
                    self._finish(seq, "error", "internal engine error (see log)")
        for seq in list(self._inbox) + self._waiting + self._prefilling + self._decoding:
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
            if self.before_step is not None:
                self.before_step()
            self._finish_cancelled_or_expired()
            while self._forget:
                self.chunk_store.forget_origin(self._forget.popleft())
            while self._plans:
                self.documents.plan(self._plans.popleft())
            # Admit what had arrived when the step began, not what arrives meanwhile: under a
            # flood (many documents typed at once) admitting until the inbox is empty never
            # ends, and every admitted sequence holds a KV the size of its window. Sequences
            # cancelled meanwhile (superseded by a newer keystroke) give theirs back before
            # the next one is allocated.
            for seq in self._take_arrivals():
                self._finish_cancelled_or_expired()
                self._guard(seq, self._admit)
            self._start_waiting()
            foreground = [s for s in self._prefilling if not s.background]
            if foreground:
                self._guard(foreground[0], self._prefill)
            if self._decoding:
                self._decode()
            if foreground or self._decoding:
                self._last_foreground = time.perf_counter()
            elif self._prefilling:  # background sequences only
                self._guard(self._prefilling[0], self._prefill)
            elif self.documents.pending() and time.perf_counter() >= self._last_foreground + self.idle_grace:
                self._document_step()
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
        for seq in (*self._prefilling, *self._decoding):
            assert seq in self._holding, f"request {seq.request_id} runs without a charged KV"
        for seq in self._holding:
            assert seq.kv is not None, f"request {seq.request_id} is charged for a KV it no longer has"
        if self.working_limit is not None:
            used = self.retained.nbytes() + self.working_kv_bytes()
            assert used <= self.working_limit, f"retained + working KV {used} B over the working share {self.working_limit} B"

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

    def _take_arrivals(self) -> list[Sequence]:
        with self._cond:
            arrivals = list(self._inbox)
            self._inbox.clear()
        return arrivals

    def _finish_cancelled_or_expired(self) -> None:
        """Finish the admitted sequences that were cancelled, and the prefilling ones whose
        deadline passed while others ran (decoding ones meet theirs at their next token).
        Cancelled sequences go first, so a superseding request of the same document finds
        the superseded one's KV retained and reuses its rows."""
        for group in (self._waiting, self._prefilling, self._decoding):
            for seq in [s for s in group if s.cancel_requested]:
                self._finish(seq, "cancelled")
        now = time.monotonic()
        for seq in [s for s in (*self._waiting, *self._prefilling) if s.expired(now)]:
            self._finish(seq, "deadline")  # waited behind other work past its deadline; rows kept

    def _guard(self, seq: Sequence, work) -> None:
        try:
            work(seq)
        except Exception as exc:  # the sequence fails; the engine does not
            log.exception("request %d failed", seq.request_id)
            self._finish(seq, "error", f"{type(exc).__name__}: {exc}")

    # ------------------------------------------------------------ admission
    def _note(self, what: str, key: str, background: bool) -> None:
        if self.trace is not None:
            self.trace.append((what, key, background))

    def _admit(self, seq: Sequence) -> None:
        self._note("admit", seq.key, seq.background)
        seq.t_admit = time.perf_counter()
        if seq.background:
            self.counters.warm_requests += 1
        else:
            self.counters.requests += 1
            self._last_foreground = seq.t_admit
            for warm in [s for s in (*self._waiting, *self._prefilling) if s.background and s.key == seq.key]:
                self._finish(warm, "cancelled")  # its rows stay (committed, retained) for this request
        if seq.cancelled:
            self._finish(seq, "cancelled")
            return
        if seq.expired(time.monotonic()):
            self._finish(seq, "deadline")  # waited in the inbox past its deadline: no KV allocated
            return
        prompt = self._prepare(seq)
        ids = list(prompt.ids)
        if not ids:
            raise ValueError("empty prompt")
        if len(ids) >= self.context_length:
            raise ValueError(f"prompt of {len(ids)} tokens does not fit the context of {self.context_length}")
        seq.start(prompt)
        seq.blend = prompt.blend if seq.cache else None  # kept only if still wanted once the reuse is known
        self._waiting.append(seq)

    def _prepare(self, seq: Sequence):
        """The sequence's prompt; when the window and the tokens it may generate need more
        rows than the KV budget's working share holds, the window is cut to what it holds
        (`sink.prepare` fits the prompt and `max_tokens` into the rows it is given)."""
        prompt = seq.sink.prepare(self.context_length)
        if len(prompt.ids) + max(seq.max_tokens, 0) + 1 <= self.rows_alone:
            return prompt
        cut = seq.sink.prepare(min(self.context_length, self.rows_alone))
        c = self.counters
        c.kv_cut_windows += 1
        if c.kv_cut_windows == 1 or c.kv_cut_windows % 100 == 0:
            log.info(
                "request %d: its window of %d tokens (+ %d to generate) needs more KV than the working share of "
                "--kv-budget holds (%d rows of %d B); cut to %d tokens (%d windows cut so far)",
                seq.request_id, len(prompt.ids), seq.max_tokens, self.rows_alone, self.row_bytes, len(cut.ids),
                c.kv_cut_windows,
            )
        return cut

    def _start_waiting(self) -> None:
        """Give KV to the admitted sequences that wait for it: foreground first, each group
        oldest first. One that does not fit yet waits, and so do those behind it, until
        running sequences finish (it fits alone: its window was cut at admission)."""
        order = [s for s in self._waiting if not s.background] + [s for s in self._waiting if s.background]
        for seq in order:
            self._finish_cancelled_or_expired()  # superseded sequences give their KV back first
            if seq not in self._waiting:
                continue  # finished meanwhile
            try:
                started = self._allocate(seq)
            except Exception as exc:  # the sequence fails; the engine does not
                log.exception("request %d failed", seq.request_id)
                self._finish(seq, "error", f"{type(exc).__name__}: {exc}")
                continue
            if not started:
                if not self._holding and self.documents.kv_in_flight() is None:  # nothing will free room: never wait forever
                    log.error("request %d: the KV budget cannot hold it even alone", seq.request_id)
                    self._finish(seq, "error", "the KV budget cannot hold this request")
                    continue
                return

    def _allocate(self, seq: Sequence) -> bool:
        """Charge `seq`'s working KV to the budget and load its reused rows; False (nothing
        changed) when the working share cannot make room now."""
        ids = seq.tokens[: seq.n_prompt]
        prev = self.retained.peek(seq.key) if seq.cache else None
        match = self.cache.match(ids) if seq.cache else None
        while True:
            have = common_prefix_len(prev.ids, ids) if prev is not None else 0
            reuse = min(max(have, match.n_tokens if match else 0), len(ids) - 1)
            if seq.blend is not None and not seq.blend.wanted(reuse):
                seq.blend = None
            capacity, reuses_prev = self.share.capacity(seq, prev)
            need = 0 if reuses_prev else self.share.rows_bytes(capacity)
            spare = seq.key if prev is not None else None
            foreground = not seq.background
            blend = self.share.blend_rows(seq, reuse, seq.blend) * self.share.dense_row_bytes if seq.blend is not None else 0
            if blend and self.share.make_room(need + blend, spare, foreground):
                pass
            elif self.share.make_room(need, spare, foreground):
                if blend:
                    log.debug("request %d: its CacheBlend pass does not fit the KV budget now; prefilled plainly",
                              seq.request_id)
                    seq.blend = None
            elif prev is None or reuses_prev:
                return False
            else:
                prev = None  # the document's previous KV, kept beside a new one, is what does not fit: drop it
                continue
            if prev is None or self.retained.peek(seq.key) is prev:
                break
            prev = None  # a warm-up dropped to make room replaced it in the retained store: plan again without it
        self._waiting.remove(seq)
        seq.t_admit = time.perf_counter()
        if prev is not None:
            self.retained.take(seq.key)  # its bytes move from the retained store to this sequence
            if seq.may_speculate:  # the previous suggestion: worth looking up in
                seq.lookup_extra = prev.ids[max(have, len(prev.ids) - LOOKUP_EXTRA_TOKENS) :]
        if match is not None:  # again: making room may have finished sequences, which reshapes the tree
            match = self.cache.match(ids)
            seq.pinned = self.cache.pin_match(match)  # before anything can evict it
            reuse = min(max(have, match.n_tokens), len(ids) - 1)
        self._holding[seq] = None
        self.runner.load_kv(seq, prev, have, match, reuse, capacity=capacity)
        if seq.blend is not None and seq.blend.local:
            covered = self.runner.add_document_spans(seq, self._document_index(seq.key), reuse)
            if not seq.blend.has_units_after(reuse) and covered < MIN_LOCAL_COVERAGE * (seq.n_prompt - reuse):
                seq.blend, seq.blend_spans = None, ()  # too little of the window is stored: prefill it
        self._prefilling.append(seq)
        return True

    def _document_index(self, key: str) -> DocumentIndex | None:
        """The n-gram index of `key`'s stored pieces (rebuilt when they changed)."""
        index = self._indexes.get(key)
        if index is None or index.stale(self.chunk_store):
            if not self.chunk_store.version_of(key):
                self._indexes.pop(key, None)
                return None
            index = self._indexes[key] = DocumentIndex(self.chunk_store, key)
        return index

    def _document_step(self) -> None:
        self._note("piece", "", True)
        try:
            rows = self.documents.next_rows()  # a new piece's KV is charged before it is allocated
            if rows and not self.share.make_room(self.share.rows_bytes(rows), None, False):
                return  # (cannot happen: nothing else runs, and a piece fits the share alone)
            done = self.documents.step()
        except Exception:  # background work must never take the engine down
            log.exception("document piece prefill failed; dropping the pending passes")
            self.documents = self._document_work(self.runner.model, self.documents.header)
            return
        self.counters.warm_prefilled_tokens += done.tokens
        self.counters.warm_seconds += done.seconds
        for key in [k for k in self._indexes if self._indexes[k].stale(self.chunk_store)]:
            del self._indexes[key]  # rebuilt on the next request that needs it

    # ------------------------------------------------------------ prefill
    def _prefill(self, seq: Sequence) -> None:
        # "length" here means max_tokens == 0 (a cache warm-up): prefill, sample nothing.
        reason = seq.sink.before_step()
        if reason == "deadline":
            self._finish(seq, reason)
            return
        self._note("prefill", seq.key, seq.background)
        t0 = time.perf_counter()
        try:
            if seq.background:
                out = self.runner.prefill_chunk(
                    seq, self.warm_chunk(), preempted=lambda: self._foreground_waiting(seq.key)
                )
            else:
                out = self.runner.prefill_chunk(seq, self._foreground_chunk(seq))
            if not out.blended:
                self._prefill_rate.observe(out.rows, time.perf_counter() - t0)
        except BlendCancelled:
            seq.compute_s += time.perf_counter() - t0
            if seq.cancelled or not seq.background:
                self._finish(seq, "cancelled")
            return  # a background blend gave way: it starts again when the engine is free
        seq.compute_s += time.perf_counter() - t0
        if seq.cache:
            self._commit(seq)
        if not out.last:
            return
        self._prefilling.remove(seq)
        if seq.background:  # a warm-up computes the prompt's rows and never samples
            self._finish(seq, "length")
            return
        if reason is not None:  # e.g. max_tokens == 0: a cache warm-up
            self._finish(seq, reason)
            return
        logits = out.logits[0]  # [V]
        forks = self._forks(seq)
        self._accept(seq, self._sample(seq, logits))
        for fork in forks:
            self._guard(fork, lambda f: self._accept(f, self._sample(f, logits)))

    def _forks(self, seq: Sequence) -> list[Sequence]:
        """`seq`'s alternatives, forked after its prefill while the KV budget holds them: the
        first that does not fit (or fails) ends the forking — fewer alternatives, said in
        the log; the request itself (the greedy one) runs in any case."""
        forks: list[Sequence] = []
        for index, sampler in enumerate(seq.fork_samplers, 1):
            try:
                fork = self._fork(seq, index, sampler)
            except Exception:
                log.exception("forking request %d failed", seq.request_id)
                fork = None
            if fork is None:
                left = len(seq.fork_samplers) - index + 1
                self.counters.kv_skipped_forks += left
                log.info("request %d: %d of %d alternatives forked (the KV budget holds no more now)",
                         seq.request_id, index - 1, len(seq.fork_samplers))
                break
            forks.append(fork)
        return forks

    def _fork(self, seq: Sequence, index: int, sampler) -> Sequence | None:
        """Fork `index` of `seq` right after its prefill: a decode-only sequence with its own
        copy of the prompt's KV rows (nothing is prefilled again) and its own sampler and
        sink. It stores nothing (no radix commit, no retained KV: `cache=False`) and counts
        only its generated tokens; cancelling `seq` cancels it (`Sequence.cancel_requested`).
        None when the KV budget cannot hold its KV now."""
        rows = self.share.within_room(self.runner.fork_capacity(seq), seq.n_valid + max(seq.max_tokens, 0) + 1)
        if not self.share.make_room(self.share.rows_bytes(rows), None, True):
            return None
        kv = self.runner.fork_kv(seq, rows)
        fork = Sequence(
            request_id=seq.request_id, key=seq.key, sink=seq.sink.fork(index), sampler=sampler,
            max_tokens=seq.max_tokens, cache=False, submitted=seq.submitted, parent=seq,
        )
        fork.start(Prompt(seq.tokens[: seq.n_valid], seq.healing))
        fork.kv, fork.n_valid, fork.t_admit = kv, seq.n_valid, seq.t_admit
        self._holding[fork] = None
        return fork

    def _commit(self, seq: Sequence) -> None:
        """Store the prompt rows computed so far in the radix cache; move the pin to their end."""
        res = self.cache.commit(seq.tokens, seq.kv, seq.n_valid, key=seq.key)
        if res.node is not None:
            self.cache.pin(res.node)
            if seq.pinned is not None:
                self.cache.unpin(seq.pinned)
            seq.pinned = res.node

    # ------------------------------------------------------------ decode
    @staticmethod
    def _sample(seq: Sequence, logits: torch.Tensor) -> int:  # logits [V]
        """`seq`'s next token: its sampler's choice, inside token healing's set while the
        healed text is not spelled out yet."""
        if seq.healing is None:
            return seq.sampler.sample(logits)
        return seq.sampler.sample(logits, seq.healing.allowed(), healed=seq.healing.rest)

    def _accept(self, seq: Sequence, token: int) -> bool:
        """Hand `token` to the sink; True while the sequence goes on (`token` is pending)."""
        if seq.generated == 0:
            seq.t_first = time.perf_counter()
        seq.generated += 1
        if seq.healing is not None:
            seq.healing = seq.healing.after(token)
        reason = seq.sink.on_token(token)
        if reason is not None:
            self._finish(seq, reason)
            return False
        seq.pending = token
        if seq not in self._decoding:
            self._decoding.append(seq)
        return True

    def _decode(self) -> None:
        batch: list[Sequence] = []
        for seq in list(self._decoding):
            reason = seq.sink.before_step()
            if reason is None and seq.n_valid >= seq.kv.capacity and not self._grow(seq):
                reason = "length"
            if reason is not None:
                self._finish(seq, reason)
            else:
                batch.append(seq)
        if not batch:
            return
        # Alone, a greedy request verifies a draft; with others it decodes in their batch
        # (a verify forward of its own would re-read every weight and slow them).
        cost = self.verify_cost
        draft = draft_for(batch[0], cost) if len(batch) == 1 and batch[0].may_speculate else []
        if draft:  # one forward verifies it; accepted tokens go through `_accept` in order
            self._guard(batch[0], lambda s: speculate_step(self.runner, s, draft, self._accept, cost))
            return
        t0 = time.perf_counter()
        try:
            logits = self.runner.decode(batch)  # [B, V]
        except Exception as exc:
            log.exception("decode step failed")
            for seq in batch:
                self._finish(seq, "error", f"{type(exc).__name__}: {exc}")
            return
        for seq in batch:
            seq.decode_steps += 1
        if len(batch) == 1 and cost is not None:  # a one-row step: what a verify row is measured against
            cost.observe_plain(time.perf_counter() - t0)
        greedy = all(s.sampler.greedy and s.healing is None for s in batch)
        picks = logits.argmax(dim=-1).tolist() if greedy else None
        for b, seq in enumerate(batch):
            token = picks[b] if picks is not None else self._sample(seq, logits[b])
            self._guard(seq, lambda s, t=token: self._accept(s, t))

    def _grow(self, seq: Sequence) -> bool:
        """A larger KV for a sequence that filled its own: twice the rows, or — when the KV
        budget cannot hold that now — the rows it may still use; False (it ends "length")
        when it is at the context length or the budget holds neither."""
        cap = seq.kv.capacity
        rows = self.share.within_room(min(self.context_length, cap * 2), seq.n_prompt + max(seq.max_tokens, 0) + 1)
        if rows <= cap:
            return False
        if not self.share.make_room(self.share.rows_bytes(rows), None, not seq.background):  # the old KV stays until copied
            self.counters.kv_grow_refused += 1
            log.info("request %d: its KV of %d rows cannot grow within the KV budget now; it ends", seq.request_id, cap)
            return False
        return self.runner.grow(seq, rows)

    # ------------------------------------------------------------ finish
    def _finish(self, seq: Sequence, reason: FinishReason, error: str | None = None) -> None:
        if seq not in self._holding and seq.kv is None:
            # Never given KV (it ended while waiting for room): no work was done on its prompt,
            # so it reports none, like a request that ended in the inbox (reuse ratios stay true).
            seq.n_prompt = 0
        for group in (self._waiting, self._prefilling, self._decoding):
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
        self._holding.pop(seq, None)  # its working KV is given back (or now counted as retained)
        c = self.counters
        c.decode_steps += seq.decode_steps
        c.verify_steps += seq.verify_steps
        c.draft_tokens += seq.draft_tokens
        c.accepted_tokens += seq.accepted_tokens
        if seq.parent is not None:  # a fork: its request's figures count the prefill once
            c.generated_tokens += seq.generated
            self._tell_sink(seq, reason, error)
            return
        if seq.background:
            c.warm_cancelled += reason == "cancelled"
            c.warm_completed += reason != "cancelled"
            c.warm_prefilled_tokens += seq.prefilled
            c.warm_seconds += seq.compute_s
            self._tell_sink(seq, reason, error)
            return
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
        self._tell_sink(seq, reason, error)

    @staticmethod
    def _tell_sink(seq: Sequence, reason: FinishReason, error: str | None) -> None:
        """The sequence's terminal call; a failing sink is logged, never raised."""
        try:
            seq.sink.on_finish(reason, seq.stats(time.perf_counter()), error)
        except Exception:
            what = "a fork of request" if seq.parent is not None else "request"
            log.exception("finishing %s %d failed", what, seq.request_id)


__all__ = ["Scheduler", "Counters", "PrefillRate"]
