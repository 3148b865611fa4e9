"""Admission: a request's prompt, then its working KV and the rows it reuses.

Two stages, both on the engine thread (`engine.scheduling.scheduler` calls them each step):
1. `Admission.admit`: `sink.prepare()` gives the prompt ids — cut to what the KV budget's
   working share holds when the whole window would not fit it (`_prepare`, see
   `engine.scheduling.working_share`). A foreground request of a document ends that
   document's background sequence here (its rows stay: committed to the radix cache and
   retained), so the request starts from them. The sequence then waits in `waiting`.
2. `Admission.start_waiting`: the waiting sequences get their working KV once the working
   share can hold it — foreground first, each group oldest first (foreground requests of
   several owners in turns, `engine.scheduling.fairness`); one that does not fit
   yet waits, and so do those behind it (`_allocate`). Reuse = the longer of (a) the rows
   still valid in this document's retained KV (common prefix with the ids it holds,
   generated tokens included) and (b) the radix cache match, whose missing rows are
   gathered from the pool. At least one prompt token is always recomputed (its logits
   pick the first token). The matched path is pinned. A CacheBlend pass (`engine.cacheblend`)
   is kept only while still worth it after that reuse and while the share holds its
   copied spans; else the window is prefilled plainly. The sequence then prefills.

`Admission` alone fills and orders `waiting`, and charges each window to the KV budget's
`WorkingShare` (the step runner charges forks and growth to the same share); sequences end
through the `Finisher` (`engine.scheduling.finishing`).
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from engine.cacheblend.document_kv import DocumentIndex
from engine.kv.radix import common_prefix_len
from engine.scheduling.fairness import Turns, interleave
from engine.scheduling.finishing import Counters, Finisher
from engine.scheduling.sequence import Prompt, Sequence
from engine.scheduling.working_share import WorkingShare

if TYPE_CHECKING:
    from engine.kv.blend_store import BlendStore
    from engine.kv.radix import RadixCache
    from engine.kv.retained import RetainedKV
    from engine.scheduling.model_runner import ModelRunner

log = logging.getLogger(__name__)

# A local-only CacheBlend is kept when the document's KV covers at least this share of the
# rows still to compute; below it a plain prefill costs about the same.
MIN_LOCAL_COVERAGE = 0.5
# Speculation looks up in at most this many tokens of the document's previous sequence that
# the new prompt does not share (its suggestion, at the end).
LOOKUP_EXTRA_TOKENS = 256


class Admission:
    """Admits sequences (module docstring). `waiting` and `prefilling` are the loop's lanes,
    shared: admission alone adds to `waiting`, and moves a sequence that got its KV to
    `prefilling`."""

    def __init__(
        self,
        runner: ModelRunner,
        cache: RadixCache,
        retained: RetainedKV,
        share: WorkingShare,
        blend_store: BlendStore,
        finisher: Finisher,
        counters: Counters,
        *,
        waiting: list[Sequence],
        prefilling: list[Sequence],
        turns: Turns | None = None,
    ) -> None:
        self.runner = runner
        self.cache = cache
        self.retained = retained
        self.share = share
        self.blend_store = blend_store
        self.finisher = finisher
        self.counters = counters
        self.waiting = waiting
        self.prefilling = prefilling
        self.turns = turns if turns is not None else Turns()
        self._indexes: dict[str, DocumentIndex] = {}

    # ------------------------------------------------------------ the prompt
    def admit(self, seq: Sequence) -> None:
        """Build `seq`'s prompt and queue it for KV (or end it: cancelled, past its deadline)."""
        seq.t_admit = time.perf_counter()
        if seq.background:
            self.counters.warm_requests += 1
        else:
            self.counters.requests += 1
            for warm in [s for s in (*self.waiting, *self.prefilling) if s.background and s.key == seq.key]:
                self.finisher.finish(warm, "cancelled")  # its rows stay (committed, retained) for this request
        if seq.cancelled:
            self.finisher.finish(seq, "cancelled")
            return
        if seq.expired(time.monotonic()):
            self.finisher.finish(seq, "deadline")  # waited in the inbox past its deadline: no KV allocated
            return
        prompt = self._prepare(seq)
        ids = list(prompt.ids)
        if not ids:
            raise ValueError("empty prompt")
        context_length = self.runner.context_length
        if len(ids) >= context_length:
            raise ValueError(f"prompt of {len(ids)} tokens does not fit the context of {context_length}")
        seq.start(prompt)
        seq.blend = prompt.blend if seq.cache else None  # kept only if still wanted once the reuse is known
        self.waiting.append(seq)

    def _prepare(self, seq: Sequence) -> Prompt:
        """The sequence's prompt; when the window and the tokens it may generate need more
        rows than the KV budget's working share holds, the window is cut to what it holds
        (`sink.prepare` fits the prompt and `max_tokens` into the rows it is given)."""
        context_length, rows_alone = self.runner.context_length, self.share.rows_alone
        prompt = seq.sink.prepare(context_length)
        if len(prompt.ids) + max(seq.max_tokens, 0) + 1 <= rows_alone:
            return prompt
        cut = seq.sink.prepare(min(context_length, rows_alone))
        c = self.counters
        c.kv_cut_windows += 1
        if c.kv_cut_windows == 1 or c.kv_cut_windows % 100 == 0:
            log.info(
                "request %d: its window of %d tokens (+ %d to generate) needs more KV than the working share of "
                "--kv-budget holds (%d rows of %d B); cut to %d tokens (%d windows cut so far)",
                seq.request_id, len(prompt.ids), seq.max_tokens, rows_alone, self.share.row_bytes, len(cut.ids),
                c.kv_cut_windows,
            )
        return cut

    # ------------------------------------------------------------ the KV
    def start_waiting(self) -> None:
        """Give KV to the admitted sequences that wait for it: foreground first, each group
        oldest first — foreground ones of several owners in turns (each owner's oldest, then
        each one's second, ..., owners least-charged first: `engine.scheduling.fairness`).
        One that does not fit yet waits, and so do those behind it, until running sequences
        finish (it fits alone: its window was cut at admission)."""
        foreground = [s for s in self.waiting if not s.background]
        owners = self.turns.order(s.owner for s in foreground)
        order = interleave(foreground, lambda s: s.owner, owners) + [s for s in self.waiting if s.background]
        for seq in order:
            self.finisher.finish_cancelled_or_expired()  # superseded sequences give their KV back first
            if seq not in self.waiting:
                continue  # finished meanwhile
            try:
                started = self._allocate(seq)
            except Exception as exc:  # the sequence fails; the engine does not
                log.exception("request %d failed", seq.request_id)
                self.finisher.finish(seq, "error", f"{type(exc).__name__}: {exc}")
                continue
            if not started:
                if self.share.nothing_charged():  # nothing will free room: never wait forever
                    log.error("request %d: the KV budget cannot hold it even alone", seq.request_id)
                    self.finisher.finish(seq, "error", "the KV budget cannot hold this request")
                    continue
                return

    def _allocate(self, seq: Sequence) -> bool:
        """Charge `seq`'s working KV to the budget and load its reused rows; False (nothing
        changed) when the working share cannot make room now."""
        share, make_room = self.share, self.finisher.make_room
        ids = seq.tokens[: seq.n_prompt]
        prev = self.retained.peek(seq.key) if seq.cache else None
        match = self.cache.match(ids) if seq.cache else None
        while True:
            have = common_prefix_len(prev.ids, ids) if prev is not None else 0
            reuse = min(max(have, match.n_tokens if match else 0), len(ids) - 1)
            if seq.blend is not None and not seq.blend.wanted(reuse):
                seq.blend = None
            capacity, reuses_prev = share.capacity(seq, prev)
            need = 0 if reuses_prev else share.rows_bytes(capacity)
            spare = seq.key if prev is not None else None
            foreground = not seq.background
            blend = share.blend_rows(seq, reuse, seq.blend) * share.dense_row_bytes if seq.blend is not None else 0
            if blend and make_room(need + blend, spare, foreground, seq.owner):
                pass
            elif make_room(need, spare, foreground, seq.owner):
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
        self.waiting.remove(seq)
        seq.t_admit = time.perf_counter()
        if prev is not None:
            self.retained.take(seq.key)  # its bytes move from the retained store to this sequence
            if seq.may_speculate:  # the previous suggestion: worth looking up in
                seq.lookup_extra = prev.ids[max(have, len(prev.ids) - LOOKUP_EXTRA_TOKENS) :]
        if match is not None:  # again: making room may have finished sequences, which reshapes the tree
            match = self.cache.match(ids)
            seq.pinned = self.cache.pin_match(match)  # before anything can evict it
            reuse = min(max(have, match.n_tokens), len(ids) - 1)
        share.hold(seq)
        self.runner.load_kv(seq, prev, have, match, reuse, capacity=capacity)
        if seq.blend is not None and seq.blend.local:
            covered = self.runner.add_document_spans(seq, self._document_index(seq.key), reuse)
            if not seq.blend.has_units_after(reuse) and covered < MIN_LOCAL_COVERAGE * (seq.n_prompt - reuse):
                seq.blend, seq.blend_spans = None, ()  # too little of the window is stored: prefill it
        self.prefilling.append(seq)
        return True

    # ------------------------------------------------------------ the documents' pieces
    def _document_index(self, key: str) -> DocumentIndex | None:
        """The n-gram index of `key`'s stored pieces (rebuilt when they changed)."""
        index = self._indexes.get(key)
        if index is None or index.stale(self.blend_store):
            if not self.blend_store.version_of(key):
                self._indexes.pop(key, None)
                return None
            index = self._indexes[key] = DocumentIndex(self.blend_store, key)
        return index

    def drop_stale_indexes(self) -> None:
        """Forget the indexes of pieces that changed (rebuilt on the next request that needs one)."""
        for key in [k for k in self._indexes if self._indexes[k].stale(self.blend_store)]:
            del self._indexes[key]


__all__ = ["Admission", "MIN_LOCAL_COVERAGE", "LOOKUP_EXTRA_TOKENS"]
