"""Background work of the engine thread: computing documents' pieces while nothing else runs.

`DocumentWork` holds the latest `DocumentPass` of every document
(`Engine.keep_document_pieces`) and does it one small step at a time: a step prefills at
most `step_tokens` tokens of one piece on a private sequence; a piece whose ids are
complete goes into the `BlendStore` under its document's key. The scheduler calls `step()` only when no
foreground sequence is queued or running, so a request waits for at most one step.

Contracts:
- Nothing here runs unless the scheduler calls `step()`; `step()` never raises for a
  piece it cannot store (a full pool): it drops that document's pass and says so.
- A newer pass of the same document replaces the older at once; the piece in flight is
  finished only if the new pass still wants it. `forget` drops a document: its pass and
  its stored pieces.
- Pieces of a document that its newest pass no longer has (edited away) are dropped
  from the store when that pass completes.
"""

from __future__ import annotations

import collections
import logging
import time
from typing import Any, NamedTuple, TYPE_CHECKING

import torch

from engine.cacheblend.document_kv import DocumentPass

if TYPE_CHECKING:
    from engine.model.sequence_kv import KV
    from engine.model.transformer import Transformer
    from engine.kv.blend_store import BlendStore

log = logging.getLogger(__name__)


class _PieceInFlight(NamedTuple):
    """The piece being prefilled: its document, its ids, its KV so far."""
    key: str
    ids: tuple[int, ...]
    kv: KV  # header + ids
    done: int  # rows of kv computed (header included)


class StepResult(NamedTuple):
    tokens: int  # tokens prefilled by this step
    seconds: float


class DocumentWork:
    """Documents' passes, most recently asked first; one piece prefilled at a time."""

    def __init__(
        self, model: Transformer, store: BlendStore, header: tuple[int, ...] = (), step_tokens: int = 64, max_rows: int | None = None
    ) -> None:
        if step_tokens < 1:
            raise ValueError("step_tokens must be >= 1")
        self.model = model
        self.store = store
        self.header = tuple(header)
        self.step_tokens = step_tokens
        # A piece whose KV (header + ids) needs more rows is skipped: the KV budget's working
        # share could never hold it (None: no limit).
        self.max_rows = max_rows
        self._passes: collections.OrderedDict[str, DocumentPass] = collections.OrderedDict()
        self._inflight: _PieceInFlight | None = None
        self.origins: set[str] = set()  # documents with pieces in the store
        self._memos: dict[str, dict[str, tuple[int, ...]]] = {}  # finished passes' piece ids
        self.pieces_stored = 0
        self.tokens_prefilled = 0
        self.seconds = 0.0

    # ------------------------------------------------------------ engine thread
    def plan(self, work: DocumentPass) -> None:
        """Make `work` the document's pass (most recent first)."""
        old = self._passes.pop(work.key, None)
        if old is not None:
            work.memo = old.memo or work.memo
        else:
            work.memo = self._memos.pop(work.key, work.memo)
        self._passes[work.key] = work
        self._passes.move_to_end(work.key, last=False)

    def forget(self, key: str) -> None:
        """Drop the document's pass (in flight included), its pieces and its memo."""
        self._passes.pop(key, None)
        if self._inflight is not None and self._inflight.key == key:
            self._inflight = None
        self.store.forget_origin(key)
        self.origins.discard(key)
        self._memos.pop(key, None)

    def pending(self) -> bool:
        return self._inflight is not None or bool(self._passes)

    def kv_in_flight(self) -> Any | None:
        """The KV of the piece being computed (None between pieces): charged to the KV budget."""
        return self._inflight.kv if self._inflight is not None else None

    def next_rows(self) -> int:
        """Rows of the KV the next `step()` allocates for a new piece (0 while a piece is in
        flight, or when none is left), so the scheduler can make room first."""
        if self._inflight is not None:
            return 0
        found = self._next_ids()
        return len(self.header) + len(found[1]) if found is not None else 0

    def drop_in_flight(self) -> None:
        """Forget the piece being computed, freeing its KV (a later step starts it again)."""
        self._inflight = None

    def step(self) -> StepResult:
        """Prefill up to `step_tokens` tokens of the next missing piece (0 when done)."""
        t0 = time.perf_counter()
        if self._inflight is None:
            self._inflight = self._next_piece()
            if self._inflight is None:
                return StepResult(0, 0.0)
        key, ids, kv, done = self._inflight
        full = (*self.header, *ids)
        hi = min(len(full), done + self.step_tokens)
        self.model.forward(torch.tensor(full[done:hi], dtype=torch.int64), kv, done, "none")  # [T] ids
        n = hi - done
        if hi < len(full):
            self._inflight = _PieceInFlight(key, ids, kv, hi)
        else:
            self._inflight = None
            self._store(key, ids, kv)
        dt = time.perf_counter() - t0
        self.tokens_prefilled += n
        self.seconds += dt
        return StepResult(n, dt)

    def _next_piece(self) -> _PieceInFlight | None:
        found = self._next_ids()
        if found is None:
            return None
        key, ids = found
        return _PieceInFlight(key, ids, self.model.new_kv(len(self.header) + len(ids)), 0)

    def _next_ids(self) -> tuple[str, tuple[int, ...]] | None:
        """(document, ids) of the next piece to compute; completes the passes that are done."""
        limit = self.max_rows
        while self._passes:
            key, work = next(iter(self._passes.items()))
            for ids in work.ids_in_order():
                if ids not in self.store and (limit is None or len(self.header) + len(ids) <= limit):
                    return key, ids
            self._complete(key, work)
        return None

    def _store(self, key: str, ids: tuple[int, ...], kv: KV) -> None:
        work = self._passes.get(key)
        if work is None or ids not in set(work.ids_in_order()):
            return  # replaced or forgotten meanwhile
        h, n = len(self.header), len(ids)
        from engine.kv.blend_store import SpanKV  # noqa: PLC0415

        k, v = kv.read(h, h + n)  # [L, H_kv, n, D], dequantised when the KV is int8
        rows = SpanKV(
            k.transpose(1, 2).contiguous(),  # [L, n, H_kv, D]
            v.transpose(1, 2).contiguous(),  # [L, n, H_kv, D]
            torch.arange(h, h + n, dtype=torch.int64),
        )
        if self.store.insert(ids, rows, key) is None:
            log.info("document KV for %s: the pool has no room for more pieces; stopping its pass", key)
            self._passes.pop(key, None)
            return
        self.pieces_stored += 1
        self.origins.add(key)

    def _complete(self, key: str, work: DocumentPass) -> None:
        """The pass is done: drop its document's pieces it no longer has."""
        self._passes.pop(key, None)
        self._memos[key] = work.memo
        wanted = set(work.ids_in_order())
        for entry in self.store.entries_of(key):
            if entry.ids not in wanted:
                self.store.drop(entry)


__all__ = ["DocumentWork", "StepResult"]
