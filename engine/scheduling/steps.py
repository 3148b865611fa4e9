"""The step runner: one unit of model work on sequences that already hold their KV.

The loop (`engine.scheduling.scheduler`) decides what runs and how much; `StepRunner` runs
it through the `ModelRunner` (`engine.scheduling.model_runner`) and hands each sampled
token to the sequence's sink:
- prefill: one prefill step of a prefilling sequence's prompt (`prefill`). After each step the
  new rows are committed to the radix cache (so a cancelled prefill keeps what it
  computed) and the pin moves to their end (`_commit`). Only prompt tokens enter the radix
  cache: generated tokens stay in the document's retained KV, which the next request of
  the same key reuses (they matter when the user accepts a suggestion). After the last
  step the first token is sampled; a warm-up (background) samples nothing.
- fork: a request with alternatives (`InfillRequest.n`) forks after its prefill into n
  sequences, each with a copy of the prompt's KV rows, decoded in the same batches
  (`_fork`), as many as the KV budget's working share holds now.
- decode: one step for all decoding sequences together (`decode`). A greedy request
  decoding alone verifies a prompt-lookup draft instead (`engine.scheduling.speculation`):
  several tokens for one forward; with others decoding it takes plain batched steps, so it
  never slows them (docs/design.md, "Prompt-lookup speculation"). A sequence that filled
  its KV grows it first (`_grow`), within the working share.

It never admits: admission policy lives in `engine.scheduling.admission`. Sequences end
through the `Finisher` (`engine.scheduling.finishing`).
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Callable

from engine.cacheblend.blend import BlendCancelled
from engine.scheduling.finishing import Counters, Finisher
from engine.scheduling.sequence import Prompt, Sequence
from engine.scheduling.speculation import VerifyCost, draft_for, speculate_step
from engine.scheduling.working_share import WorkingShare

if TYPE_CHECKING:
    import torch

    from engine.kv.radix import RadixCache
    from engine.scheduling.model_runner import ModelRunner
    from engine.text.sampler import Sampler

log = logging.getLogger(__name__)


class PrefillRate:
    """Prefill rows per second, a running average over the prefill steps computed so far;
    sizes the background steps (`Scheduler.background_step_rows`). Engine thread only."""

    SMALLEST = 64  # rows: smaller steps are mostly per-call overhead (never below the old fixed size)
    FIRST_GUESS = 64  # rows, before anything was measured
    WEIGHT = 0.3  # of the newest step in the average

    def __init__(self) -> None:
        self.rows_per_s: float | None = None

    def observe(self, rows: int, seconds: float) -> None:
        if rows < self.SMALLEST or seconds <= 0:
            return  # a keystroke's 1-2 rows say nothing about a prefill step's rate
        rate = rows / seconds
        self.rows_per_s = rate if self.rows_per_s is None else self.rows_per_s + self.WEIGHT * (rate - self.rows_per_s)

    def rows_for(self, seconds: float, most: int) -> int:
        """Rows that take about `seconds`, a multiple of 32 in [SMALLEST, most]."""
        if self.rows_per_s is None:
            return min(self.FIRST_GUESS, most)
        rows = int(self.rows_per_s * seconds) // 32 * 32
        return max(self.SMALLEST, min(most, rows))


class StepRunner:
    """Runs prefill and decode steps (module docstring). `prefilling` and `decoding`
    are the loop's lanes, shared: a sequence leaves `prefilling` after its last step and
    joins `decoding` with its first token."""

    def __init__(
        self,
        runner: ModelRunner,
        cache: RadixCache,
        share: WorkingShare,
        finisher: Finisher,
        counters: Counters,
        *,
        prefilling: list[Sequence],
        decoding: list[Sequence],
    ) -> None:
        self.runner = runner
        self.cache = cache
        self.share = share
        self.finisher = finisher
        self.counters = counters
        self.prefilling = prefilling
        self.decoding = decoding
        self.prefill_rate = PrefillRate()
        # Speculation: measured cost of a verify row and acceptance (None: drafts as long as allowed).
        self.verify_cost: VerifyCost | None = VerifyCost()
        # Tests set a list here to read the order of engine steps: (what, key, background).
        self.trace: list[tuple[str, str, bool]] | None = None

    def note(self, what: str, key: str, background: bool) -> None:
        if self.trace is not None:
            self.trace.append((what, key, background))

    # ------------------------------------------------------------ prefill
    def prefill(self, seq: Sequence, rows: int, preempted: Callable[[], bool] | None = None) -> None:
        """One prefill step of at most `rows` of `seq`'s prompt; a background sequence gives way
        between layers when `preempted()` turns true (a blend starts again later, a plain step
        goes on from the layer it reached)."""
        # "length" here means max_tokens == 0 (a cache warm-up): prefill, sample nothing.
        reason = seq.sink.before_step()
        if reason == "deadline":
            self.finisher.finish(seq, reason)
            return
        self.note("prefill", seq.key, seq.background)
        t0 = time.perf_counter()
        try:
            out = self.runner.prefill_step(seq, rows, preempted=preempted)
            if not out.blended and not out.paused:
                self.prefill_rate.observe(out.rows, time.perf_counter() - t0)
        except BlendCancelled:
            seq.compute_s += time.perf_counter() - t0
            if seq.cancelled or not seq.background:
                self.finisher.finish(seq, "cancelled")
            return  # a background blend gave way: it starts again when the engine is free
        seq.compute_s += time.perf_counter() - t0
        if out.rows == 0 and out.paused:
            return  # gave way between layers to a foreground request: goes on at its next step
        if seq.cache:
            self._commit(seq)
        if not out.last:
            return
        self.prefilling.remove(seq)
        if seq.background:  # a warm-up computes the prompt's rows and never samples
            self.finisher.finish(seq, "length")
            return
        if reason is not None:  # e.g. max_tokens == 0: a cache warm-up
            self.finisher.finish(seq, reason)
            return
        logits = out.logits[0]  # [V]
        forks = self._forks(seq)
        self._accept(seq, self._sample(seq, logits))
        for fork in forks:
            self.finisher.guard(fork, lambda f: self._accept(f, self._sample(f, logits)))

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

    def _fork(self, seq: Sequence, index: int, sampler: Sampler) -> Sequence | None:
        """Fork `index` of `seq` right after its prefill: a decode-only sequence with its own
        copy of the prompt's KV rows (nothing is prefilled again) and its own sampler and
        sink. It stores nothing (no radix commit, no retained KV: `cache=False`) and counts
        only its generated tokens; cancelling `seq` cancels it (`Sequence.cancel_requested`).
        None when the KV budget cannot hold its KV now."""
        rows = self.share.within_room(self.runner.fork_capacity(seq), seq.n_valid + max(seq.max_tokens, 0) + 1)
        if not self.finisher.make_room(self.share.rows_bytes(rows), None, True, seq.owner):
            return None
        kv = self.runner.fork_kv(seq, rows)
        fork = Sequence(
            request_id=seq.request_id, key=seq.key, sink=seq.sink.fork(index), sampler=sampler,
            max_tokens=seq.max_tokens, cache=False, submitted=seq.submitted, parent=seq, owner=seq.owner,
        )
        fork.start(Prompt(seq.tokens[: seq.n_valid], seq.healing))
        fork.kv, fork.n_valid, fork.t_admit = kv, seq.n_valid, seq.t_admit
        self.share.hold(fork)
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
            self.finisher.finish(seq, reason)
            return False
        seq.pending = token
        if seq not in self.decoding:
            self.decoding.append(seq)
        return True

    def decode(self, only: list[Sequence] | None = None) -> None:
        """One decode step of every decoding sequence — or of those in `only` (one owner's
        turn, `engine.scheduling.fairness`) — or one verify step of a lone greedy one."""
        batch: list[Sequence] = []
        for seq in list(self.decoding) if only is None else [s for s in only if s in self.decoding]:
            reason = seq.sink.before_step()
            if reason is None and seq.n_valid >= seq.kv.capacity and not self._grow(seq):
                reason = "length"
            if reason is not None:
                self.finisher.finish(seq, reason)
            else:
                batch.append(seq)
        if self.trace is not None:
            for seq in batch:
                self.note("decode", seq.key, seq.background)
        if not batch:
            return
        # Alone, a greedy request verifies a draft; with others it decodes in their batch
        # (a verify forward of its own would re-read every weight and slow them).
        cost = self.verify_cost
        draft = draft_for(batch[0], cost) if len(batch) == 1 and batch[0].may_speculate else []
        if draft:  # one forward verifies it; accepted tokens go through `_accept` in order
            self.finisher.guard(batch[0], lambda s: speculate_step(self.runner, s, draft, self._accept, cost))
            return
        t0 = time.perf_counter()
        try:
            logits = self.runner.decode(batch)  # [B, V]
        except Exception as exc:
            log.exception("decode step failed")
            for seq in batch:
                self.finisher.finish(seq, "error", f"{type(exc).__name__}: {exc}")
            return
        for seq in batch:
            seq.decode_steps += 1
        if len(batch) == 1 and cost is not None:  # a one-row step: what a verify row is measured against
            cost.observe_plain(time.perf_counter() - t0)
        greedy = all(s.sampler.greedy and s.healing is None for s in batch)
        picks = logits.argmax(dim=-1).tolist() if greedy else None
        for b, seq in enumerate(batch):
            token = picks[b] if picks is not None else self._sample(seq, logits[b])
            self.finisher.guard(seq, lambda s, t=token: self._accept(s, t))

    def _grow(self, seq: Sequence) -> bool:
        """A larger KV for a sequence that filled its own: twice the rows, or — when the KV
        budget cannot hold that now — the rows it may still use; False (it ends "length")
        when it is at the context length or the budget holds neither."""
        cap = seq.kv.capacity
        rows = self.share.within_room(min(self.runner.context_length, cap * 2), seq.n_prompt + max(seq.max_tokens, 0) + 1)
        if rows <= cap:
            return False
        if not self.finisher.make_room(self.share.rows_bytes(rows), None, not seq.background, seq.owner):  # the old KV stays until copied
            self.counters.kv_grow_refused += 1
            log.info("request %d: its KV of %d rows cannot grow within the KV budget now; it ends", seq.request_id, cap)
            return False
        return self.runner.grow(seq, rows)


__all__ = ["StepRunner", "PrefillRate"]
