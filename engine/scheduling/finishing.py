"""Ending a sequence: unpin its radix path, keep its KV for the document, count, tell the sink.

Every sequence ends through `Finisher.finish` exactly once, whatever ended it (a stop, its
deadline, a cancel, an error, the engine closing): it leaves the loop's lanes (waiting for
KV, prefilling, decoding), gives its working KV back to the working share
(`engine.scheduling.working_share`) — a request's rows move to the retained store
(`engine.kv.retained`), which the document's next request reuses — and its figures go into
`Counters` (`efim/stats` reads them) before the sink's terminal call (`TokenSink.on_finish`).

Work on a sequence runs under `Finisher.guard`: an exception ends that sequence with
"error", never the loop. `Finisher.make_room` carries out the working share's decisions
(`WorkingShare.reclaim`): the background sequences it names end "cancelled".
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from engine.api import FinishReason
from engine.kv.retained import RetainedKV, RetainedSequence
from engine.scheduling.fairness import Turns
from engine.scheduling.sequence import Sequence
from engine.scheduling.working_share import WorkingShare

if TYPE_CHECKING:
    from engine.kv.radix import RadixCache

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
    warm_ms: float = 0.0
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


class Finisher:
    """Ends sequences (module docstring). The lanes are the loop's lists, shared: `waiting`
    (admitted, waiting for KV; admission fills it), `prefilling` and `decoding`."""

    def __init__(
        self,
        cache: RadixCache,
        retained: RetainedKV,
        share: WorkingShare,
        counters: Counters,
        *,
        waiting: list[Sequence],
        prefilling: list[Sequence],
        decoding: list[Sequence],
        turns: Turns | None = None,
    ) -> None:
        self.turns = turns  # told how each foreground request ended (the sleeper's credit, fairness)
        self.cache = cache
        self.retained = retained
        self.share = share
        self.counters = counters
        self.waiting = waiting
        self.prefilling = prefilling
        self.decoding = decoding

    def finish(self, seq: Sequence, reason: FinishReason, error: str | None = None) -> None:
        if not self.share.holds(seq) and seq.kv is None:
            # Never given KV (it ended while waiting for room): no work was done on its prompt,
            # so it reports none, like a request that ended in the inbox (reuse ratios stay true).
            seq.n_prompt = 0
        for lane in (self.waiting, self.prefilling, self.decoding):
            if seq in lane:
                lane.remove(seq)
        if seq.pinned is not None:
            try:
                self.cache.unpin(seq.pinned)
            except Exception:
                log.exception("unpin failed for request %d", seq.request_id)
            seq.pinned = None
        if seq.cache and error is None and seq.kv is not None and seq.n_valid > 0:
            self.retained.keep(seq.key, RetainedSequence(seq.kv, seq.tokens[: seq.n_valid], seq.owner))
        seq.kv = None
        self.share.release(seq)  # its working KV is given back (or now counted as retained)
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
            c.warm_ms += seq.compute_s * 1e3
            self._tell_sink(seq, reason, error)
            return
        if self.turns is not None:
            self.turns.ended(seq.owner, cancelled=reason == "cancelled")
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

    def guard(self, seq: Sequence, work: Callable[[Sequence], object]) -> None:
        """Run `work(seq)`; an exception ends `seq` with "error" (the engine goes on)."""
        try:
            work(seq)
        except Exception as exc:  # the sequence fails; the engine does not
            log.exception("request %d failed", seq.request_id)
            self.finish(seq, "error", f"{type(exc).__name__}: {exc}")

    def finish_cancelled_or_expired(self) -> None:
        """Finish the admitted sequences that were cancelled, and the prefilling ones whose
        deadline passed while others ran (decoding ones meet theirs at their next token).
        Cancelled sequences go first, so a superseding request of the same document finds
        the superseded one's KV retained and reuses its rows."""
        for lane in (self.waiting, self.prefilling, self.decoding):
            for seq in [s for s in lane if s.cancel_requested]:
                self.finish(seq, "cancelled")
        now = time.monotonic()
        for seq in [s for s in (*self.waiting, *self.prefilling) if s.expired(now)]:
            self.finish(seq, "deadline")  # waited behind other work past its deadline; rows kept

    def make_room(self, nbytes: int, spare: str | None, foreground: bool, owner: str | None = None) -> bool:
        """Room in the working share for `nbytes` more (`WorkingShare.reclaim`; `owner`: whose
        work needs it, its own retained KV goes first): the running background sequences it
        names for foreground work end "cancelled" (their rows stay committed and retained).
        False, with nothing dropped, when it cannot be made now."""
        for warm in self.share.reclaim(nbytes, spare, foreground, owner):
            self.finish(warm, "cancelled")
        return self.share.fits(nbytes)

    @staticmethod
    def _tell_sink(seq: Sequence, reason: FinishReason, error: str | None) -> None:
        """The sequence's terminal call; a failing sink is logged, never raised."""
        try:
            seq.sink.on_finish(reason, seq.stats(time.perf_counter()), error)
        except Exception:
            what = "a fork of request" if seq.parent is not None else "request"
            log.exception("finishing %s %d failed", what, seq.request_id)


__all__ = ["Counters", "Finisher"]
