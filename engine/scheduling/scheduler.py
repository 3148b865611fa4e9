"""The engine thread's loop: take arrivals, admit, step, finish — token ids only.

The pipeline, one noun a module (docs/design.md, "Data flow"): a request becomes a
`Sequence` (`engine.scheduling.sequence`) whose text lives behind its `TokenSink`
(`engine.prompting`). Each loop step (`Scheduler.step`):
1. ends what was cancelled or expired (`engine.scheduling.finishing`);
2. admits what arrived when the step began, then gives waiting sequences their working KV
   from the radix cache (`engine.kv.radix`), the document's retained KV (`engine.kv.retained`)
   and the KV budget's working share (`engine.scheduling.admission`, `.working_share`);
3. runs one prefill step of the oldest prefilling request (`_foreground_step_rows` rows) and
   one batched decode step of every decoding sequence, forks and prompt-lookup speculation
   included (`engine.scheduling.steps` on the `engine.scheduling.model_runner.ModelRunner`).
   With requests of several owners (`InfillRequest.owner`, e.g. the engine daemon's editor
   windows) the step serves the owner that used the engine least lately: its oldest
   prefilling request, or — an owner with only decoding rows — a decode step alone
   (`engine.scheduling.turn_taking` over `engine.scheduling.fairness`' accounting);
4. ends sequences as their sinks say (`Finisher.finish`: unpin, keep the KV for the
   document, count, tell the sink).

Background work (docs/design.md, "After a jump") runs only when no foreground sequence is
queued, prefilling or decoding: first background sequences (warm-ups: a window prefilled
where the user just moved, in steps of `background_step_rows` rows; a CacheBlend warm-up
gives way between layers when a foreground request of another document arrives, and starts
again later), then — after `idle_grace` seconds without foreground work — the documents'
pieces (`engine.scheduling.background.DocumentWork`), one prefill step at a time. A
foreground request of a document ends that document's background sequence at admission, so
it starts from its rows. A request therefore waits for at most one background step (or one
layer of a blend).

Contracts:
- `submit` and `cancel` are thread-safe and never block on model work.
- A cancel takes effect before the next prefill or decode step of that sequence.
- Every sequence ends with exactly one `sink.on_finish` call.
- An exception inside a sequence's work ends that sequence with finish_reason "error"; the
  loop, the other sequences and the cache stay consistent (pins released, no slot leaked).
- `abandon` ends everything of a scheduler whose thread died (`engine.local`).
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, Callable

from engine.kv.blend_store import BlendStore
from engine.kv.radix import RadixCache
from engine.kv.retained import RetainedKV
from engine.scheduling.admission import Admission
from engine.scheduling.background import DocumentWork
from engine.scheduling.fairness import Turns
from engine.scheduling.finishing import Counters, Finisher
from engine.scheduling.model_runner import ModelRunner
from engine.scheduling.sequence import Sequence
from engine.scheduling.speculation import VerifyCost
from engine.scheduling.steps import StepRunner
from engine.scheduling.turn_taking import OwnerTurns
from engine.scheduling.working_share import WorkingShare

if TYPE_CHECKING:
    from engine.cacheblend.document_kv import DocumentPass
    from engine.model.transformer import Transformer

log = logging.getLogger(__name__)


# A request alone in the engine prefills in steps this many times `step_tokens`.
SOLO_STEP_FACTOR = 2
# Document pieces (documentKv) are prefilled in steps of this many tokens when the
# background step is adaptive.
PIECE_STEP_TOKENS = 64
# A kept window's KV compacted for a smaller budget keeps room for this many rows past its
# own (a keystroke and its suggestion); a longer one grows it again.
RETAINED_HEADROOM_ROWS = 64


class Scheduler:
    """Owns the model runner, the cache and the retained KV; `run()` is the engine thread's body."""

    def __init__(
        self,
        model: Transformer,
        cache: RadixCache,
        *,
        step_tokens: int = 256,
        retain_documents: int = 4,
        retained_budget_bytes: int | None = None,
        check_integrity: bool = False,
        background_step_tokens: int | None = None,
        background_step_seconds: float = 0.1,
        background_min_slice: float = 0.025,
        background_share_after: float = 0.2,
        idle_grace: float = 0.25,
        header: tuple[int, ...] = (),
        blend_store_share: float = 0.5,
        before_step: Callable[[], Any] | None = None,
        working_budget_bytes: int | None = None,
        shared_step_seconds: float = 0.15,
        interleaved_step_seconds: float = 0.025,
    ) -> None:
        self.cache = cache
        self.before_step = before_step  # engine thread, before each unit of work (e.g. CPU threads)
        # CacheBlend's context chunks and the documents' pieces, in held slots of the same pool.
        self.blend_store = BlendStore(cache, blend_store_share=blend_store_share)
        self.runner = ModelRunner(model, cache, self.blend_store, step_tokens=step_tokens)
        # A background prefill step: fixed when given, else sized to take about
        # `background_step_seconds` at the prefill rate measured so far — a request waits for
        # at most one such step, and small steps are slow (a 64-token step ran the model at
        # ~55 % of a 256-token one's tokens/s on a 2-core AVX512 machine), so the step is as
        # large as that wait allows on the machine at hand.
        self.background_step_tokens = background_step_tokens
        self.background_step_seconds = background_step_seconds
        # A background step runs at least this long before it pauses for a foreground request.
        self.background_min_slice = background_min_slice
        # Seconds of foreground work after which a waiting warm-up gets a slice anyway.
        self.background_share_after = background_share_after
        self._foreground_since_warm = 0.0
        self.idle_grace = idle_grace
        # While several owners share the engine (engine.scheduling.fairness), a request's prefill
        # step is sized to take about this long: what another owner's keystroke waits at most.
        self.shared_step_seconds = shared_step_seconds
        # ... and about this long while another owner's request is running (its next step waits for this one).
        self.interleaved_step_seconds = interleaved_step_seconds
        # Retained KV lives outside the pool; `retained_budget_bytes` caps it (None: count only).
        self.retained = RetainedKV(retain_documents, retained_budget_bytes)
        # The KV budget's working share (None: unlimited): running sequences' working KV, the
        # document piece in flight and the retained KV together (engine.scheduling.working_share).
        self.share = WorkingShare(model, self.runner, working_budget_bytes, retained=self.retained)
        self.documents = self._document_work(model, header)
        # Document passes to plan, or (a str) documents whose pieces to forget, in arrival order (any thread).
        self._plans: collections.deque[DocumentPass | str] = collections.deque()
        self._last_foreground = 0.0  # perf_counter when foreground work last ran
        self.check_after_steps = check_integrity  # debugging: check every store whenever idle
        self.counters = Counters()
        self._inbox: collections.deque[Sequence] = collections.deque()
        self._cond = threading.Condition()
        self._closed = False
        # The lanes: admitted (prompt built) and waiting for KV room, prefilling, decoding.
        self._waiting: list[Sequence] = []
        self._prefilling: list[Sequence] = []
        self._decoding: list[Sequence] = []
        # Turns across owners (`InfillRequest.owner`): engine time charged per owner
        # (engine.scheduling.fairness); one owner alone runs in the usual order.
        self.turns = Turns()
        self.finisher = Finisher(
            cache, self.retained, self.share, self.counters,
            waiting=self._waiting, prefilling=self._prefilling, decoding=self._decoding, turns=self.turns,
        )
        self.owner_turns = OwnerTurns(self.turns, self._inbox, self._cond, self._prefilling, self._decoding)
        self.admission = Admission(
            self.runner, cache, self.retained, self.share, self.blend_store, self.finisher, self.counters,
            waiting=self._waiting, prefilling=self._prefilling, turns=self.turns,
        )
        self.steps = StepRunner(
            self.runner, cache, self.share, self.finisher, self.counters,
            prefilling=self._prefilling, decoding=self._decoding,
        )
        self._forget: collections.deque[str] = collections.deque()  # context chunks' origins to drop (any thread)
        self._when_idle: collections.deque[tuple[Callable[[], Any], Future]] = collections.deque()
        self._between: collections.deque[tuple[Callable[[], Any], Future]] = collections.deque()  # next step's start
        self._stepping = False

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

    @property
    def documents(self) -> DocumentWork:
        """The documents' background pieces; the working share charges their piece in flight."""
        return self._documents

    @documents.setter
    def documents(self, work: DocumentWork) -> None:
        self._documents = self.share.documents = work

    # Kept by the step runner; tests set them.
    @property
    def trace(self) -> list[tuple[str, str, bool]] | None:
        """A list here gets the order of engine steps: (what, key, background)."""
        return self.steps.trace

    @trace.setter
    def trace(self, trace: list[tuple[str, str, bool]] | None) -> None:
        self.steps.trace = trace

    @property
    def verify_cost(self) -> VerifyCost | None:
        """Speculation: measured cost of a verify row and acceptance (None: drafts as long as allowed)."""
        return self.steps.verify_cost

    @verify_cost.setter
    def verify_cost(self, cost: VerifyCost | None) -> None:
        self.steps.verify_cost = cost

    def _document_work(self, model: Transformer, header: tuple[int, ...]) -> DocumentWork:
        return DocumentWork(
            model, self.blend_store, header, step_tokens=self.background_step_tokens or PIECE_STEP_TOKENS,
            max_rows=self._piece_max_rows(),
        )

    def _piece_max_rows(self) -> int | None:
        """Most rows a document piece's KV may have: what the working share lets one sequence have."""
        return None if self.working_limit is None else self.rows_alone

    def background_step_rows(self) -> int:
        """Rows a background prefill computes in one step (see `background_step_seconds`)."""
        if self.background_step_tokens is not None:
            return self.background_step_tokens
        return self.steps.prefill_rate.rows_for(self.background_step_seconds, self.runner.step_tokens)

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
        """Make `work` its document's background pass (thread-safe)."""
        if not work.text:
            raise ValueError("a document pass needs the document's text (forget_document drops a document)")
        with self._cond:
            self._plans.append(work)
            self._cond.notify()

    def forget_document(self, key: str) -> None:
        """Drop the document's pieces and its pass, in flight included, at the next step
        (thread-safe; ordered with `plan_document`)."""
        with self._cond:
            self._plans.append(key)
            self._cond.notify()

    def forget_chunks(self, origin: str) -> None:
        """Drop the context chunks' KV that came from `origin` (a file that changed) at the next step."""
        self._forget.append(origin)

    def run_when_idle(self, fn: Callable[[], Any]) -> Future:
        """Run `fn` on the engine thread between steps, once no sequence is queued or running;
        the future gets its result or exception (RuntimeError when the engine closes first;
        a future cancelled before then is skipped)."""
        return self._queue_work(self._when_idle, fn)

    def run_between_steps(self, fn: Callable[[], Any]) -> Future:
        """Run `fn` on the engine thread at the start of the next step, busy or not (e.g. a
        larger KV budget); the future as `run_when_idle`'s."""
        return self._queue_work(self._between, fn)

    def _queue_work(self, queue: collections.deque[tuple[Callable[[], Any], Future]], fn: Callable[[], Any]) -> Future:
        fut: Future = Future()
        with self._cond:
            if not self._closed:
                queue.append((fn, fut))
                self._cond.notify()
                return fut
        fut.set_exception(RuntimeError("engine is closed"))
        return fut

    def grow_budget(self, pool_bytes: int, working_bytes: int, retained_bytes: int) -> int:
        """Engine thread: a larger KV budget's parts — the pool takes more slots (every
        stored row stays); the blend store's share of it, the working share and the retained
        share grow with it. Returns the pool slots added."""
        added = self.cache.grow(pool_bytes)  # the blend store's share of it follows (BlendStore.max_slots)
        self.share.set_limit(working_bytes)
        self.retained.budget_bytes = retained_bytes
        self.documents.max_rows = self._piece_max_rows()
        return added

    def shrink_budget(self, pool_bytes: int, working_bytes: int, retained_bytes: int) -> bool:
        """Engine thread, idle (nothing queued, running or pinned): a smaller KV budget's parts.
        The blend store evicts to its share of the smaller pool, the tree evicts leaves until
        the rows in use fit, the pool moves the rows above its new size down and takes smaller
        tensors (the memory goes back); the retained documents are dropped oldest first to fit
        their share. False (nothing changed but evictions): rows still in use do not fit."""
        if not self.idle():
            return False
        before = self.share.working_limit
        self.share.set_limit(working_bytes)  # first: ValueError when too small, before anything moved
        self.blend_store.fit(int(pool_bytes) // self.cache.bytes_per_slot)
        remap = self.cache.shrink(pool_bytes)
        if remap is None:
            self.share.set_limit(before)
            return False
        self.blend_store.renumber(remap)
        self.retained.budget_bytes = retained_bytes
        self.retained.compact(self._compact_kv)  # rows allocated under the larger budget, unused
        while self.retained.nbytes() > retained_bytes and self.retained.evict_oldest():
            pass
        self.documents.max_rows = self._piece_max_rows()
        return True

    def _compact_kv(self, kv, rows: int):
        """`kv` with room for `rows` and a keystroke's worth more (whole allocations), its rows
        copied; `kv` itself when that is not smaller."""
        align = self.share.row_align
        capacity = min(self.context_length, -(-(rows + RETAINED_HEADROOM_ROWS) // align) * align)
        if capacity >= kv.capacity:
            return kv
        smaller = self.runner.model.new_kv(capacity)
        smaller.copy_rows(kv, rows)
        return smaller

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()

    def idle(self) -> bool:
        """No sequence queued, running, or in the middle of a step (background pieces may
        still be pending: they never delay a request by more than one step)."""
        return (
            not self._stepping and not self._inbox and not self._waiting and not self._prefilling and not self._decoding
        )

    def computing(self) -> bool:
        """In a step, or a step is due now (best-effort read from any thread)."""
        return self._stepping or self._wait_seconds() == 0.0

    def background_pending(self) -> bool:
        """Document passes or pieces still to compute (best-effort read from any thread)."""
        return bool(self._plans) or self.documents.pending()

    def document_tokens(self) -> int:
        """Tokens of document pieces kept (a best-effort read from any thread)."""
        try:
            return sum(self.blend_store.tokens_of(key) for key in list(self.documents.origins))
        except RuntimeError:  # the store changed under the read
            return 0

    def working_kv_bytes(self) -> int:
        """Bytes of working KV charged now: running sequences (a blending one with its copied
        spans) and the document piece in flight (a best-effort read from any thread)."""
        return self.share.working_kv_bytes()

    def abandon(self, reason: str, unfinished: Callable[[Sequence], None] | None = None) -> int:
        """End every sequence of a scheduler whose thread died with "error" (queued ones
        included) and fail its idle-work futures; returns how many foreground sequences were
        ended. Its state may be half-updated, so each finish is guarded: a sequence whose
        finish fails is logged and handed to `unfinished` (its owner ends it another way)."""
        with self._cond:
            seqs = list(self._inbox) + self._waiting + self._prefilling + self._decoding
            self._inbox.clear()
            idle_work = list(self._between) + list(self._when_idle)
            self._between.clear()
            self._when_idle.clear()
        ended = 0
        for seq in dict.fromkeys(seqs):  # once each, in order
            ended += not seq.background
            try:
                self.finisher.finish(seq, "error", reason)
            except Exception:
                log.exception("finishing request %d after the crash failed", seq.request_id)
                if unfinished is not None:
                    unfinished(seq)
        for _, fut in idle_work:
            if fut.set_running_or_notify_cancel():
                fut.set_exception(RuntimeError(reason))
        return ended

    def _foreground_step_rows(self, seq: Sequence) -> int:
        """Rows of a request's next prefill step: `SOLO_STEP_FACTOR` times the usual step
        while it is the only work (nothing else prefilling, decoding or arrived), else the
        usual one. A larger step runs the model faster (512 rows: ~17 % more tokens/s than
        256 on a 2-core AVX512/AMX machine); the one cost, a request arriving meanwhile
        waiting for the rest of it, is nil for the same document's next keystroke, which
        supersedes this request and reuses its rows. While several owners share the engine
        (`Turns.shared`), a step of about `shared_step_seconds` instead (at most the usual
        one): another owner's request waits for it; and of about `interleaved_step_seconds`
        while another owner's request is running (passed over for a while, this request got
        a step between that one's: each of its tokens would wait for the whole step)."""
        rows = self.runner.step_tokens
        if self.turns.shared():  # another owner's next request waits for this step: keep it short
            seconds = self.shared_step_seconds
            if self.owner_turns.another_owner_running(seq.owner):
                seconds = self.interleaved_step_seconds
            return self.steps.prefill_rate.rows_for(seconds, rows)
        if len(self._prefilling) == 1 and not self._decoding and not self._inbox and not self._waiting:
            return rows * SOLO_STEP_FACTOR
        return rows

    def _foreground_waiting(self, key: str | None = None) -> bool:
        """A foreground request of another document than `key` waits in the inbox."""
        with self._cond:
            arrived = any(not s.background and s.key != key for s in self._inbox)
        return arrived or any(not s.background and s.key != key for s in self._waiting)

    def _wait_seconds(self) -> float | None:
        """How long the loop may sleep: None (until woken) when there is nothing at all,
        0 when there is work now, else until the idle grace for document pieces is over."""
        if self._inbox or self._waiting or self._prefilling or self._decoding or self._plans or self._when_idle or self._between:
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
                    self.finisher.finish(seq, "error", "internal engine error (see log)")
        for seq in list(self._inbox) + self._waiting + self._prefilling + self._decoding:
            self.finisher.finish(seq, "cancelled")
        self._inbox.clear()
        for queue in (self._between, self._when_idle):
            while queue:
                _, fut = queue.popleft()
                if fut.set_running_or_notify_cancel():
                    fut.set_exception(RuntimeError("engine is closed"))

    def step(self) -> None:
        """One unit of work: drop cancelled sequences, admit new ones, one prefill step of
        the oldest prefilling sequence (of the owner whose turn it is), one batched decode
        step of every decoding one."""
        self._stepping = True
        try:
            if self.before_step is not None:
                self.before_step()
            self._run_work(self._between)
            self.finisher.finish_cancelled_or_expired()
            while self._forget:
                self.blend_store.forget_origin(self._forget.popleft())
            while self._plans:
                item = self._plans.popleft()
                if isinstance(item, str):
                    self.documents.forget(item)
                    # Its rows stop being a document's latest (evicted before those that are)
                    # and its working KV kept between keystrokes goes: a closed document, or a
                    # daemon front's that left, must not outlast the documents still in use.
                    self.cache.set_latest(item, self.cache.root)
                    self.retained.take(item)
                else:
                    self.documents.plan(item)
            # Admit what had arrived when the step began, not what arrives meanwhile: under a
            # flood (many documents typed at once) admitting until the inbox is empty never
            # ends, and every admitted sequence holds a KV the size of its window. Sequences
            # cancelled meanwhile (superseded by a newer keystroke) give theirs back before
            # the next one is allocated.
            for seq in self._take_arrivals():
                self.finisher.finish_cancelled_or_expired()
                self.finisher.guard(seq, self._admit)
            self.admission.start_waiting()
            foreground = [s for s in self._prefilling if not s.background]
            began = time.perf_counter()
            prefill, turn = self.owner_turns.serve(foreground)
            if prefill is not None:
                # (a warm-up served in its owner's turn gives way to the requests running
                # beside it once its slice is over, as a warm-up's slice between them does)
                self._charged(prefill, lambda seq: self._prefill(seq, during_foreground=seq.background))
            if self._decoding:
                # An owner's decode-only turn decodes its rows alone (a lone greedy one verifies a
                # speculation draft); else every decoding sequence, as always.
                rows = self._decoding if turn is None else [s for s in self._decoding if s.owner == turn]
                owners = [s.owner for s in rows]
                t0 = time.perf_counter()
                self.steps.decode(None if turn is None else rows)
                self.turns.charge_rows(owners, time.perf_counter() - t0)
            if foreground or self._decoding:
                self._last_foreground = time.perf_counter()
                served = prefill.owner if prefill is not None else turn
                self._share_with_warm_up(self._last_foreground - began, served)
            elif self._prefilling:  # background sequences only
                self._foreground_since_warm = 0.0
                # Charged to its owner like its requests: a window that jumps 20 times a second
                # leaves a warm-up behind each jump, and that work is what its usage must show,
                # or the window typing beside it (a few tokens a request) looks the heavier one.
                self._charged(self._prefilling[0], self._prefill)
            elif self.documents.pending() and time.perf_counter() >= self._last_foreground + self.idle_grace:
                self._document_step()
        finally:
            self._stepping = False
        if self.idle():
            if self.check_after_steps:
                self.check_integrity()
            self._run_idle_work()

    def _share_with_warm_up(self, foreground_s: float, served: str | None) -> None:
        """While foreground work keeps coming, a waiting warm-up still gets a slice after every
        `background_share_after` seconds of it (its slice: a fifth to a third of the engine): else keystrokes
        typed back to back would keep a person on a first window for as long as they type.
        While windows share the engine (`Turns.shared`), only a warm-up of the owner this step
        served gets one, charged to that owner: another window's warm-ups never cut into a
        request of this one (`OwnerTurns.warm_up_for`)."""
        warm = self.owner_turns.warm_up_for(served)
        if warm is None:
            self._foreground_since_warm = 0.0
            return
        self._foreground_since_warm += foreground_s
        if self._foreground_since_warm >= self.background_share_after:
            self._foreground_since_warm = 0.0
            # Its slice, then it pauses for the requests that are running as well as new ones.
            self._charged(warm, lambda seq: self._prefill(seq, during_foreground=True))

    def _charged(self, seq: Sequence, work: Callable[[Sequence], object]) -> None:
        """`work(seq)` under the finisher's guard, its seconds charged to `seq.owner` (fairness)."""
        t0 = time.perf_counter()
        self.finisher.guard(seq, work)
        self.turns.charge(seq.owner, time.perf_counter() - t0)

    def check_integrity(self) -> None:
        """Raise AssertionError unless the radix cache, the blend store and the retained KV
        each hold their invariants. Engine thread only, between steps (other threads:
        `run_when_idle(scheduler.check_integrity)`)."""
        self.cache.check_integrity()
        self.blend_store.check_integrity()
        self.retained.check_integrity()
        for seq in (*self._prefilling, *self._decoding):
            assert self.share.holds(seq), f"request {seq.request_id} runs without a charged KV"
        for seq in self.share.holding:
            assert seq.kv is not None, f"request {seq.request_id} is charged for a KV it no longer has"
        if self.working_limit is not None:
            used = self.retained.nbytes() + self.working_kv_bytes()
            assert used <= self.working_limit, f"retained + working KV {used} B over the working share {self.working_limit} B"

    def _run_idle_work(self) -> None:
        self._run_work(self._when_idle)

    def _run_work(self, queue: collections.deque[tuple[Callable[[], Any], Future]]) -> None:
        while True:
            with self._cond:
                if not queue:
                    return
                fn, fut = queue.popleft()
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

    # ------------------------------------------------------------ what a step runs
    def _admit(self, seq: Sequence) -> None:
        self.steps.note("admit", seq.key, seq.background)
        if not seq.background:
            self._last_foreground = time.perf_counter()
        self.admission.admit(seq)

    def _prefill(self, seq: Sequence, during_foreground: bool = False) -> None:
        """One prefill step of `seq`'s prompt: a request's sized by `_foreground_step_rows`; a
        warm-up's by `background_step_rows`, giving way to a foreground request of another
        document (`during_foreground`: a warm-up's share while requests run — it gives way to
        those too once its slice is over)."""
        if seq.background:
            # It gives way between layers to a request of another document once it has run its
            # slice: `background_min_slice` seconds right after a jump, growing with the time it
            # has spent paused (a quarter of it, up to a whole step), so a warm-up still gets
            # about a fifth of the engine while keystrokes come back to back — else a person
            # typing fast would stay on a first window for as long as they type.
            began = time.perf_counter()
            if seq.paused_at is not None:
                seq.starved_s += began - seq.paused_at
            slice_s = min(max(self.background_min_slice, seq.starved_s / 4), self.background_step_seconds)
            if seq.idle_only:
                slice_s = 0.0  # chunk KV ahead: nobody waits for it, it owes no request a wait

            def preempted() -> bool:
                if time.perf_counter() - began < slice_s:
                    return False
                running = during_foreground and bool(self._decoding or any(not s.background for s in self._prefilling))
                return running or self._foreground_waiting(seq.key)

            self.steps.prefill(seq, self.background_step_rows(), preempted=preempted)
            seq.paused_at = time.perf_counter() if seq.paused is not None else None
        elif self.turns.shared() and seq.blend is None:
            # Windows share the engine: another owner's request arriving mid-step takes the
            # engine after the layer running now, not after the whole step (its own rows are
            # few: a keystroke); this step goes on from that layer at its owner's next turn.
            self.steps.prefill(seq, self._foreground_step_rows(seq), preempted=lambda: self.owner_turns.other_owner_waiting(seq.owner, seq.submitted))
        else:
            self.steps.prefill(seq, self._foreground_step_rows(seq))

    def _document_step(self) -> None:
        self.steps.note("piece", "", True)
        try:
            rows = self.documents.next_rows()  # a new piece's KV is charged before it is allocated
            if rows and not self.finisher.make_room(self.share.rows_bytes(rows), None, False):
                return  # (cannot happen: nothing else runs, and a piece fits the share alone)
            done = self.documents.step()
        except Exception:  # background work must never take the engine down
            log.exception("document piece prefill failed; dropping the pending passes")
            self.documents = self._document_work(self.runner.model, self.documents.header)
            return
        self.counters.warm_prefilled_tokens += done.tokens
        self.counters.warm_ms += done.seconds * 1e3
        self.admission.drop_stale_indexes()


__all__ = ["Scheduler", "SOLO_STEP_FACTOR"]
