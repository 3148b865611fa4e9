"""Runs the model for the scheduler: a sequence's KV at admission, one prefill step (or
one CacheBlend pass), one batched decode step or one speculative verify, KV growth.

The runner moves rows and computes; it decides nothing about which sequence runs when
(that is `engine.scheduling.scheduler`) and never touches the radix tree's pins or the retained KV
store. Engine thread only.

Contracts:
- After `load_kv`, rows `0 .. seq.n_valid-1` of `seq.kv` hold `seq.tokens[:n_valid]`.
- `prefill_step` advances `seq.n_valid` by the rows it computed; on `BlendCancelled` it
  computed nothing valid (rows >= n_valid are garbage, n_valid is unchanged).
- `decode` feeds every sequence's `pending` token and advances its `n_valid` by one; when
  it raises, no sequence has advanced.
- `verify` (speculation) computes rows for `pending` and a draft but advances nothing; the
  caller feeds the ones that stand with `feed_pending`.
"""

from __future__ import annotations

from typing import Any, NamedTuple, TYPE_CHECKING

import torch

from engine.cacheblend.blend import blend_sequence, previous_spans
from engine.cacheblend.document_kv import DocumentIndex, covered_rows, document_spans, span_ranges
from engine.kv.blend_store import BlendStore
from engine.kv.radix import MatchResult, RadixCache
from engine.kv.retained import RetainedSequence
from engine.scheduling.sequence import Sequence

if TYPE_CHECKING:
    from engine.model.transformer import Transformer


class PrefillOut(NamedTuple):
    logits: torch.Tensor  # [1, V] after the prompt's last row, [0, V] before it
    last: bool  # the prompt is complete
    rows: int  # prompt rows this call made valid
    blended: bool  # by a CacheBlend pass (not a plain step: its time says nothing of the prefill rate)
    # The step gave way between layers (rows 0: nothing valid yet), or it finished a step that had
    # (then `rows` took more than this call's time): either way its time is no prefill rate.
    paused: bool = False


def needs_exact_head(seq: Sequence) -> bool:
    """Whether `seq`'s next token reads more of the logits than their argmax: sampling with a
    temperature, the fresh-line rule's probabilities, or a choice inside token healing's set.
    A model whose head ranks the vocabulary on a 4-bit screen (`engine.model.head_screen`)
    then computes every logit exactly; a greedy step keeps the screen (its argmax is exact)."""
    return seq.healing is not None or not seq.sampler.greedy


def _never() -> bool:
    return False


def _round_up(n: int, to: int) -> int:
    return (n + to - 1) // to * to


# A request's last prefill step of more rows than this is split (its last row alone) when it
# may be preempted (`ModelRunner.prefill_step`).
_SPLIT_LAST_ABOVE = 8


class ModelRunner:
    def __init__(self, model: Transformer, cache: RadixCache, blend_store: BlendStore, *, step_tokens: int = 256) -> None:
        if not 1 <= step_tokens:
            raise ValueError("step_tokens must be >= 1")
        self.model = model
        self.cache = cache
        self.blend_store = blend_store
        self.step_tokens = step_tokens
        self.context_length = int(model.config.max_position)

    def kv_capacity(self, n_prompt: int, max_tokens: int) -> int:
        """Rows `load_kv` gives a sequence of `n_prompt` prompt tokens that may generate
        `max_tokens` when no capacity is asked for: all of them, rounded up to 256 (fewer
        grows), at most the context length."""
        return min(self.context_length, _round_up(n_prompt + max(max_tokens, 0) + 1, 256))

    def load_kv(
        self, seq: Sequence, prev: RetainedSequence | None, have: int, match: MatchResult | None, reuse: int,
        capacity: int | None = None,
    ) -> None:
        """Give `seq` a KV holding its first `reuse` prompt rows: the document's previous KV
        `prev` (valid for its first `have` rows) when it is large enough, else a new one
        with those rows copied; rows the radix `match` has beyond `have` are gathered from
        the pool. CacheBlend's local spans are read from `prev` first (it may be reused).
        `capacity`: the rows of a new KV (default `kv_capacity`; the scheduler passes what
        the KV budget holds)."""
        n = seq.n_prompt
        want_cap = capacity if capacity is not None else self.kv_capacity(n, seq.max_tokens)
        if seq.blend is not None and prev is not None:
            seq.blend_spans = previous_spans(prev.ids, prev.kv, seq.tokens, seq.blend.segments, reuse)
        if prev is not None and prev.kv.capacity >= want_cap:
            kv = prev.kv
        else:
            kv = self.model.new_kv(want_cap)
            keep = min(have, reuse)
            if keep:
                kv.copy_rows(prev.kv, keep)
        if reuse > have:
            self.cache.pool.gather(match.slots[have:reuse], kv, have)
        seq.kv, seq.n_valid, seq.reused = kv, reuse, reuse

    def add_document_spans(self, seq: Sequence, index: DocumentIndex | None, reuse: int) -> int:
        """Add to `seq.blend_spans` the runs of its local segments found in the document's
        stored pieces (rows >= `reuse`, not already covered); returns the rows covered."""
        if index is not None and len(index):
            seq.blend_spans = [
                *seq.blend_spans,
                *document_spans(
                    self.blend_store, index, seq.tokens, seq.blend.segments, reuse, span_ranges(seq.blend_spans)
                ),
            ]
        return covered_rows([s for s in seq.blend_spans if s.start >= reuse])

    def prefill_step(self, seq: Sequence, limit: int | None = None, preempted=None) -> PrefillOut:
        """Compute the next prompt rows: up to `limit` (default `step_tokens`), or — when the
        sequence blends — the whole rest in one CacheBlend pass (it is the cheap part).
        Raises `engine.cacheblend.blend.BlendCancelled` when the sequence is cancelled mid-blend, or
        when `preempted()` turns true between layers (a background sequence giving way; the
        scheduler passes no `preempted` to a request that blends)."""
        lo = seq.n_valid
        blended = seq.blend is not None
        pause = seq.paused if seq.paused is not None and seq.paused.start == lo else None
        step_hi = min(seq.n_prompt, lo + (limit or self.step_tokens))
        if preempted is not None and not seq.background and not blended and step_hi == seq.n_prompt and step_hi - lo > _SPLIT_LAST_ABOVE:
            # A request's last step samples, so it cannot pause; while another window may
            # arrive, its last row is left to a step of its own and the rest may pause: a first
            # window of ~90 rows (one step, 80-150 ms on 2 cores) kept another window's
            # keystroke waiting for all of it (traced through the daemon under a burst). The
            # extra one-row forward costs about a decode step.
            step_hi -= 1
        if blended:
            hi, last = seq.n_prompt, True
            stop = (lambda: seq.cancelled or preempted()) if preempted is not None else (lambda: seq.cancelled)
            out = blend_sequence(
                self.model, self.blend_store, seq.tokens[:hi], seq.kv, lo, seq.blend, seq.blend_spans,
                cancelled=stop,
            )
            logits, seq.blend, seq.blend_spans = out.logits, None, ()
            seq.reused += out.reused
            seq.prefilled += out.prefilled - out.reused  # + (hi - lo) below: recomputed rows + chunks prefilled alone
        elif pause is not None or preempted is not None and (seq.background or step_hi < seq.n_prompt):
            # A step that samples nothing (a warm-up's, or a request's before its last) may
            # pause between layers when `preempted()` turns true (a foreground request for a
            # warm-up, another window's request while windows share the engine): the request
            # that arrived waits for one layer, not the whole step. It goes on from that layer.
            hi = lo + pause.rows if pause is not None else step_hi
            last = hi == seq.n_prompt
            ids = torch.tensor(seq.tokens[lo:hi], dtype=torch.int64)  # [T]
            seq.paused = self.model.prefill_pausable(ids, seq.kv, lo, resume=pause, stop=preempted or _never)
            logits = torch.empty(0, self.model.vocab_size)
            if seq.paused is not None:
                return PrefillOut(logits, False, 0, False, paused=True)
            seq.n_valid = hi
            seq.prefilled += hi - lo
            return PrefillOut(logits, last, hi - lo, False, paused=pause is not None)
        else:
            seq.paused = None  # (a pause of rows since computed another way: nothing to resume)
            hi = step_hi
            last = hi == seq.n_prompt
            ids = torch.tensor(seq.tokens[lo:hi], dtype=torch.int64)  # [T]
            logits = self.model.forward(ids, seq.kv, lo, "last" if last else "none", exact_head=needs_exact_head(seq))  # [1, V] or [0, V]
        seq.n_valid = hi
        seq.prefilled += hi - lo
        return PrefillOut(logits, last, hi - lo, blended)

    def decode(self, batch: list[Sequence]) -> torch.Tensor:
        """One decode step for `batch` together: feed each `pending` token; logits [B, V]."""
        ids = torch.tensor([s.pending for s in batch], dtype=torch.int64)  # [B]
        exact = any(needs_exact_head(s) for s in batch)
        logits = self.model.decode_batch(ids, [s.kv for s in batch], [s.n_valid for s in batch], exact_head=exact)  # [B, V]
        for seq in batch:
            self.feed_pending(seq)
        return logits

    def verify(self, seq: Sequence, draft: list[int]) -> torch.Tensor:
        """Prompt-lookup speculation (`engine.scheduling.speculation`): run `[pending] + draft` at rows
        `n_valid ..` of `seq`'s KV in one forward; logits [k+1, V], row i after pending and
        draft[:i]. Advances nothing: the caller feeds the rows that stand (`feed_pending`);
        the others stay beyond `n_valid` as garbage. Needs `n_valid + k + 1 <= capacity`."""
        ids = torch.tensor([seq.pending, *draft], dtype=torch.int64)  # [k+1]
        return self.model.forward(ids, seq.kv, seq.n_valid, "all")  # [k+1, V]

    @staticmethod
    def feed_pending(seq: Sequence) -> None:
        """`seq.pending`'s row (just computed) is valid: it joins `tokens`, `n_valid` + 1."""
        seq.tokens.append(seq.pending)
        seq.n_valid += 1
        seq.pending = None

    def fork_capacity(self, seq: Sequence) -> int:
        """Rows `fork_kv` gives a fork of `seq` by default: room for the request's
        `max_tokens`, at most `seq.kv`'s capacity."""
        return min(seq.kv.capacity, _round_up(seq.n_valid + max(seq.max_tokens, 0) + 1, 256))

    def fork_kv(self, seq: Sequence, capacity: int | None = None) -> Any:
        """A new KV (`capacity` rows, default `fork_capacity`) holding a copy of `seq`'s valid
        rows: a fork of the request (alternatives) decodes into its own rows without
        prefilling the prompt again."""
        n = seq.n_valid
        kv = self.model.new_kv(capacity if capacity is not None else self.fork_capacity(seq))
        kv.copy_rows(seq.kv, n)
        return kv

    def grow(self, seq: Sequence, capacity: int | None = None) -> bool:
        """Give the sequence a larger KV: `capacity` rows, by default twice its rows, at most
        the context length (False when it cannot grow)."""
        cap = seq.kv.capacity
        new_cap = min(self.context_length, capacity if capacity is not None else cap * 2)
        if new_cap <= cap:
            return False
        kv = self.model.new_kv(new_cap)
        kv.copy_rows(seq.kv, cap)
        seq.kv = kv
        return True


__all__ = ["ModelRunner", "PrefillOut"]
