"""The KV budget's working share: how much working KV a sequence needs, and the room for it.

KV budget (docs/reliability.md, "KV budget"): with `working_budget_bytes` set, the KV the
model computes in — every running sequence's working KV (requests, warm-ups, alternatives'
forks; a CacheBlend pass's copied spans while it blends), and the document piece in flight
— plus the retained KV stay within it at every moment (the pool, preallocated, is the rest
of `--kv-budget`). KV is charged before it is allocated (admission, fork, grow, a new
document piece) and given back when its sequence ends (moved to the retained store). To
make room (`WorkingShare.reclaim`) the engine drops retained KV (least recently kept
first), then the document piece in flight, then — for foreground work only — running
background sequences; never a running request's rows. What still does not fit: a request
waits in `Admission.waiting` for running ones to finish (a request alone always fits: its
window is cut at admission), an alternative is not forked (fewer alternatives, logged), a
sequence that would outgrow its KV ends "length", a blend that would not fit is prefilled
plainly.

`WorkingShare` keeps the accounting: the sizes, what is charged (`holding`: the sequences
whose KV it charged, `hold` / `release`; the piece in flight of `documents`) and what to drop
for room (`reclaim`). It ends no sequence itself: `reclaim` names the running background
sequences to end, one at a time, and the caller ends them (`engine.scheduling.finishing`,
`Finisher.make_room`). Admission (`engine.scheduling.admission`), forks and growth
(`engine.scheduling.steps`) and the document pieces (`engine.scheduling.scheduler`) decide when to charge.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterator

from engine.kv.retained import RetainedKV, RetainedSequence, kv_bytes
from engine.scheduling.sequence import Sequence

if TYPE_CHECKING:
    from engine.cacheblend.blend import BlendRequest
    from engine.model.transformer import Transformer
    from engine.scheduling.background import DocumentWork
    from engine.scheduling.model_runner import ModelRunner


class WorkingShare:
    """The KV budget's working share (None: unlimited): running sequences' working KV, the
    document piece in flight and the retained KV together (module docstring).

    It owns `holding` (every sequence whose working KV it charged, oldest first) and reads
    the `retained` store and `documents` (the engine's `DocumentWork`, set by its owner —
    again when it replaces it after a failure — for the piece in flight)."""

    def __init__(
        self,
        model: Transformer,
        runner: ModelRunner,
        working_budget_bytes: int | None,
        *,
        retained: RetainedKV,
    ) -> None:
        self.runner = runner
        self.retained = retained
        self.holding: dict[Sequence, None] = {}
        self.documents: DocumentWork | None = None
        one = model.new_kv(1)  # the allocation unit of a KV format (1 row for both formats today)
        self.row_align = one.capacity
        self.row_bytes = kv_bytes(one) // one.capacity  # one row of a sequence KV
        cfg = model.config  # a row of K/V in the compute dtype (CacheBlend's copied spans are at most that)
        self.dense_row_bytes = 2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * model.dtype.itemsize
        self.set_limit(working_budget_bytes)

    def set_limit(self, working_budget_bytes: int | None) -> None:
        """The share's byte limit (None: unlimited) and the most rows one sequence may have.
        Raising it (a daemon front that asked for a larger --kv-budget) takes effect at once:
        KV already charged stays charged."""
        if working_budget_bytes is None:
            rows_alone = self.runner.context_length
        else:  # the most rows one sequence may have: what the working share holds, in whole allocations
            rows_alone = working_budget_bytes // self.row_bytes // self.row_align * self.row_align
        if rows_alone < 2:
            raise ValueError(
                f"the KV budget's working share ({working_budget_bytes} B) holds {rows_alone} rows of "
                f"{self.row_bytes} B; a sequence needs at least 2: use a larger --kv-budget"
            )
        self.working_limit = working_budget_bytes
        self.rows_alone = rows_alone

    def working_kv_bytes(self) -> int:
        """Bytes of working KV charged now: running sequences (a blending one with its copied
        spans) and the document piece in flight (a best-effort read from any thread)."""
        try:
            held = sum(self.charge_of(s) for s in list(self.holding))
            piece = self.piece_in_flight()
        except (RuntimeError, AttributeError):  # changed under the read
            return 0
        return held + (kv_bytes(piece) if piece is not None else 0)

    def hold(self, seq: Sequence) -> None:
        """`seq`'s working KV is charged from now on (after the room for it was made)."""
        self.holding[seq] = None

    def release(self, seq: Sequence) -> None:
        """`seq` ended: its working KV is given back (or now counted as retained)."""
        self.holding.pop(seq, None)

    def holds(self, seq: Sequence) -> bool:
        return seq in self.holding

    def piece_in_flight(self) -> Any | None:
        """The KV of the document piece being computed, if any."""
        return self.documents.kv_in_flight() if self.documents is not None else None

    def nothing_charged(self) -> bool:
        """No running sequence and no piece in flight: nothing that ends will free room."""
        return not self.holding and self.piece_in_flight() is None

    def charge_of(self, seq: Sequence) -> int:
        """What `seq` holds of the working share: its KV, and while it is still to blend, room
        for the spans the pass copies (`blend_rows`)."""
        kv, blend = seq.kv, seq.blend
        held = kv_bytes(kv) if kv is not None else 0
        if blend is not None:
            held += self.blend_rows(seq, seq.n_valid, blend) * self.dense_row_bytes
        return held

    @staticmethod
    def blend_rows(seq: Sequence, reuse: int, blend: BlendRequest) -> int:
        """Rows a CacheBlend pass from row `reuse` copies besides the sequence's KV: the reused
        spans (at most the rows still to compute) and one chunk prefilled alone after the
        header (at most as many again)."""
        return 2 * (seq.n_prompt - reuse) + len(blend.header)

    def capacity(self, seq: Sequence, prev: RetainedSequence | None) -> tuple[int | None, bool]:
        """(rows of the KV to give `seq`, whether the document's previous KV is reused as it).
        Unlimited: the runner's default. Under a budget: the runner's rounded size when it
        fits the room there is now, else exactly the prompt and `max_tokens` (at most what
        the working share holds); the previous KV whenever it holds that many."""
        exact = min(self.runner.context_length, self.rows_alone, seq.n_prompt + max(seq.max_tokens, 0) + 1)
        if self.working_limit is None:
            rows = self.runner.kv_capacity(seq.n_prompt, seq.max_tokens)
            return None, prev is not None and prev.kv.capacity >= rows
        if prev is not None and prev.kv.capacity >= exact:
            return exact, True
        rounded = self.runner.kv_capacity(seq.n_prompt, seq.max_tokens)
        if rounded <= self.rows_alone and self.rows_bytes(rounded) <= self.room():
            return rounded, False
        return exact, False

    def within_room(self, rows: int, exact: int) -> int:
        """`rows` for a sequence's KV, or — under a budget whose room cannot hold them now —
        `exact` (the rows it may still use) when fewer."""
        if self.working_limit is not None and self.rows_bytes(rows) > self.room():
            return min(rows, exact)
        return rows

    def rows_bytes(self, rows: int | None) -> int:
        """Bytes of a new sequence KV of `rows` rows (as allocated: rounded up to the format's alignment)."""
        align = self.row_align
        return -(-(rows or 0) // align) * align * self.row_bytes

    def room(self) -> int:
        """Bytes of the working share not charged (engine thread)."""
        return self.working_limit - self.retained.nbytes() - self.working_kv_bytes()

    def fits(self, nbytes: int) -> bool:
        """Room for `nbytes` more in the working share now."""
        return self.working_limit is None or nbytes <= 0 or nbytes <= self.room()

    def reclaim(self, nbytes: int, spare: str | None, foreground: bool, owner: str | None = None) -> Iterator[Sequence]:
        """Make room for `nbytes` more: drop retained KV (least recently kept first, `owner`'s
        own first, never `spare`'s), then the document piece in flight, then — for foreground work — yield
        running background sequences, newest first, for the caller to end (its KV is then
        given back, or kept as retained KV and dropped here) before the next is decided.
        Drops and yields nothing when all of that would not be enough (running requests'
        rows are never taken); `fits(nbytes)` says afterwards whether the room was made."""
        if self.fits(nbytes):
            return
        piece = self.piece_in_flight()
        warm = [s for s in self.holding if s.background] if foreground else []
        can_free = (
            self.retained.nbytes_besides(spare)
            + (kv_bytes(piece) if piece is not None else 0)
            + sum(self.charge_of(s) for s in warm)
        )
        if nbytes > self.room() + can_free:
            return
        while nbytes > self.room() and self.retained.evict_oldest(spare, owner):
            pass
        if nbytes > self.room() and piece is not None:
            self.documents.drop_in_flight()
        for bg in reversed(warm):
            if nbytes <= self.room():
                break
            yield bg  # the caller ends it: its rows stay committed; its KV is kept, then dropped below
            while nbytes > self.room() and self.retained.evict_oldest(spare, owner):
                pass


__all__ = ["WorkingShare"]
