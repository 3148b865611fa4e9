"""The disk tier in the engine: retained KV written when idle and at close, read back at
start (and at a document's first request) into the radix cache. Files: `engine.kv.disk_format`.

Why: a restarted server otherwise starts cold — the first suggestion in every file waits
for a full prefill although the same prompt was computed an hour ago.

Threads (engine.api's thread map; "efim-kv-disk" is one more):
- the tier's own thread ("efim-kv-disk") does all file I/O: reading and verifying files,
  writing snapshots, evicting. It never touches the radix cache or the retained KV.
- the engine thread only copies rows: `_snapshot` (clones of each changed retained
  sequence, at idle, through `Scheduler.run_when_idle`) and `_insert` (a loaded file's rows
  committed to the radix cache as a prefix, also at idle). Neither does I/O.
- `request(key)` (any thread, from `LocalEngine.submit`) only enqueues.

Contracts:
- A request never waits for the disk: a load enters the radix cache only while the engine
  is idle, so a request admitted before the load is ready prefills as it would without the
  tier; a request admitted after it matches the loaded prefix like any committed one (the
  rows are the same bytes the earlier process computed, so the reuse is exact).
- What is written is a retained sequence whose ids or length changed since it was last
  written (or loaded): an idle engine writes nothing twice.
- At `close` (after the engine thread stopped) the retained sequences not yet on disk are
  written by the closing thread. A disk failure turns the tier off; the engine serves on.
"""

from __future__ import annotations

import hashlib
import json
import logging
import queue
import threading
import time
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from pathlib import Path
from typing import Any, Callable, NamedTuple, Protocol

import torch

from engine.kv.disk_format import FORMAT_VERSION, DocumentRows, KVDiskStore, StoredKV, kv_directory
from engine.kv.radix import RadixCache
from engine.kv.retained import RetainedKV

log = logging.getLogger(__name__)

_RECENT = object()  # queue marker: preload the most recent documents


class _Rows(NamedTuple):
    """The `kv` that `RadixCache.commit` reads: rows 0..n-1 of k and v, in the compute dtype
    (an int8 pool quantises them as it stores them)."""

    k: torch.Tensor  # [L, H_kv, n, D]
    v: torch.Tensor  # [L, H_kv, n, D]

    quantized = False

    def read(self, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k[:, :, lo:hi], self.v[:, :, lo:hi]


class _Snapshot(NamedTuple):
    key: str
    ids: list[int]
    k: torch.Tensor  # [L, H_kv, n, D] (a clone: the engine reuses the retained rows)
    v: torch.Tensor  # [L, H_kv, n, D]
    signature: tuple[int, int]


class Activity(Protocol):
    """The scheduler's counters the tier watches to tell when the engine went idle
    (`engine.scheduling.scheduler.Counters`)."""

    completed: int
    cancelled: int
    errors: int
    warm_completed: int
    warm_cancelled: int


class TierScheduler(Protocol):
    """What the tier uses of `engine.scheduling.scheduler.Scheduler`: the two stores it
    copies rows between, the counters that tell activity, and its idle queue."""

    @property
    def cache(self) -> RadixCache: ...

    @property
    def retained(self) -> RetainedKV: ...

    @property
    def counters(self) -> Activity: ...

    def run_when_idle(self, fn: Callable[[], Any]) -> Future: ...

    def idle(self) -> bool: ...


class DiskTierStats(NamedTuple):
    state: str  # "on", or "off: <why>" after a disk failure
    saved_files: int
    saved_bytes: int
    loaded_files: int
    loaded_tokens: int  # tokens whose rows entered the radix cache from disk
    loaded_bytes: int
    load_seconds: float  # reading + verifying the loaded files
    bad_files: int


def _signature(ids: list[int]) -> tuple[int, int]:
    return len(ids), hash(tuple(ids))


def _file_stats(path: Path | None) -> list:
    """(name, size, mtime_ns) of a file, or of a folder's weight/config files."""
    if path is None:
        return []
    path = Path(path)
    files = [path] if path.is_file() else sorted(p for p in path.glob("*") if p.suffix in (".safetensors", ".json", ".gguf"))
    out = []
    for p in files:
        st = p.stat()
        out.append([p.name, st.st_size, st.st_mtime_ns])
    return out


def fingerprint(loaded: Any, template: Any, kv_dtype: torch.dtype | str, quant: str | None, adapter: Path | None) -> str:
    """sha256 over what makes a KV row valid: the model's files, the merged adapter, the KV
    dtype, quantisation, the template's ids and the file format version."""
    path = Path(loaded.path)
    ident = {
        "format": FORMAT_VERSION,
        "model": loaded.name,
        "path": str(path.resolve()),
        "files": _file_stats(path),
        "adapter": [str(adapter), _file_stats(adapter)] if adapter is not None else None,
        "kv_dtype": str(kv_dtype),
        "quant": quant,
        "template": [
            template.name, template.prefix_id, template.suffix_id, template.middle_id,
            template.suffix_first, template.file_sep_id, list(template.bos_ids),
        ],
    }
    return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()


class DiskTier:
    """One engine's disk tier: a thread that loads and writes, and two engine-thread callbacks."""

    def __init__(
        self,
        scheduler: TierScheduler,
        store: KVDiskStore,
        *,
        idle_seconds: float = 2.0,
        preload_documents: int = 4,
        preload_tokens: int | None = None,
        poll_seconds: float = 0.25,
    ) -> None:
        self.scheduler = scheduler
        self.store = store
        self.idle_seconds = idle_seconds
        self.preload_documents = preload_documents
        self.preload_tokens = preload_tokens
        self.poll_seconds = poll_seconds
        self._queue: queue.Queue = queue.Queue()
        self._requested: set[str] = set()  # keys looked up already (any thread; under _lock)
        self._saved: dict[str, tuple[int, int]] = {}  # key -> signature on disk (under _lock)
        self._lock = threading.Lock()
        self._inserts: list[Future] = []  # loads handed to the engine thread
        self._busy = 0  # queue items being worked on
        self._stop = threading.Event()
        self._last_activity = -1
        self._activity_at = time.monotonic()
        self._dirty = False
        self.saved_files = self.saved_bytes = 0
        self.loaded_files = self.loaded_tokens = self.loaded_bytes = 0
        self.load_seconds = 0.0
        self._thread = threading.Thread(target=self._run, name="efim-kv-disk", daemon=True)

    def start(self, preload: bool = True) -> DiskTier:
        if preload and self.preload_documents > 0:
            self._queue.put(_RECENT)
        self._thread.start()
        return self

    # ------------------------------------------------------------ any thread
    def request(self, key: str) -> None:
        """Look for `key`'s file (once per key; never blocks)."""
        with self._lock:
            if key in self._requested:
                return
            self._requested.add(key)
        self._queue.put(key)

    def stats(self) -> DiskTierStats:
        return DiskTierStats(
            "on" if self.store.disabled is None else f"off: {self.store.disabled}",
            self.saved_files, self.saved_bytes, self.loaded_files, self.loaded_tokens, self.loaded_bytes,
            round(self.load_seconds, 4), self.store.bad_files,
        )

    def wait_loaded(self, timeout: float = 30.0) -> bool:
        """Block until every requested load is read and inserted (tests, benchmarks; never
        the event loop). False on timeout."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            with self._lock:
                pending = self._busy or not self._queue.empty() or any(not f.done() for f in self._inserts)
            if not pending:
                return True
            time.sleep(0.005)
        return False

    def save_now(self, timeout: float = 30.0) -> int:
        """Snapshot (on the engine thread, once idle) and write what changed; files written.
        Tests and benchmarks; the tier's thread does the same after `idle_seconds` idle."""
        return self._save(self._take_snapshot(timeout))

    def close(self, retained: RetainedKV | None, timeout: float = 10.0) -> int:
        """Stop the tier's thread; then write `retained`'s sequences not on disk yet (pass
        the engine's RetainedKV only once the engine thread has stopped; None skips).
        Returns files written."""
        self._stop.set()
        self._queue.put(None)
        if self._thread.is_alive():
            self._thread.join(timeout)
        if retained is None or self._thread.is_alive():
            return 0
        snaps = []
        for key, seq in retained.entries():
            n = len(seq.ids)
            sig = _signature(seq.ids)
            if self._saved.get(key) != sig:
                snaps.append(_Snapshot(key, list(seq.ids), *seq.kv.read(0, n), sig))  # the engine thread has stopped
        return self._save(snaps)

    # ------------------------------------------------------------ the tier's thread
    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                item = self._queue.get(timeout=self.poll_seconds)
            except queue.Empty:
                item = None
            if item is None:
                if not self._stop.is_set():
                    self._maybe_save()
                continue
            with self._lock:
                self._busy += 1
            try:
                if item is _RECENT:
                    self._preload_recent()
                else:
                    self._load_key(item)
            except Exception:  # the tier is an optimisation: it must never take the engine down
                log.exception("KV disk load failed")
            finally:
                with self._lock:
                    self._busy -= 1

    def _preload_recent(self) -> None:
        budget = self.preload_tokens
        for path in self.store.recent()[: self.preload_documents]:
            stored = self.store.load(path)
            if stored is None:
                continue
            if budget is not None:
                if len(stored.ids) > budget:
                    continue
                budget -= len(stored.ids)
            with self._lock:
                self._requested.add(stored.key)
            self._hand_over(stored)

    def _load_key(self, key: str) -> None:
        stored = self.store.match(key)
        if stored is not None:
            self._hand_over(stored)

    def _hand_over(self, stored: StoredKV) -> None:
        self.loaded_bytes += stored.nbytes
        self.load_seconds += stored.seconds
        fut = self.scheduler.run_when_idle(lambda: self._insert(stored))
        with self._lock:
            self._inserts = [f for f in self._inserts if not f.done()] + [fut]

    def _maybe_save(self) -> None:
        c = self.scheduler.counters
        activity = c.completed + c.cancelled + c.errors + c.warm_completed + c.warm_cancelled
        now = time.monotonic()
        if activity != self._last_activity:
            self._last_activity, self._activity_at, self._dirty = activity, now, True
            return
        if self._dirty and now - self._activity_at >= self.idle_seconds and self.scheduler.idle():
            self._dirty = False
            try:
                self._save(self._take_snapshot(timeout=5.0))
            except Exception:
                log.exception("KV disk save failed")

    def _take_snapshot(self, timeout: float) -> list[_Snapshot]:
        fut = self.scheduler.run_when_idle(self._snapshot)
        try:
            return fut.result(timeout)
        except FutureTimeout:
            fut.cancel()  # the engine stayed busy: try at the next idle
            self._dirty = True
            return []
        except RuntimeError:  # the engine closed first
            return []

    def _save(self, snaps: list[_Snapshot]) -> int:
        written = 0
        for snap in snaps:
            if self.store.disabled is not None:
                break
            try:
                path = self.store.insert(snap.key, DocumentRows(snap.ids, snap.k, snap.v))
            except Exception as exc:  # an unexpected I/O error: off, like a full disk
                self.store.disable(f"writing failed: {type(exc).__name__}: {exc}")
                break
            if path is None:
                continue
            with self._lock:
                self._saved[snap.key] = snap.signature
            written += 1
            self.saved_files += 1
            try:
                self.saved_bytes += path.stat().st_size
            except OSError:
                pass
        return written

    # ------------------------------------------------------------ engine thread
    def _snapshot(self) -> list[_Snapshot]:
        """Clones of the retained sequences not on disk in this form (engine thread, idle)."""
        out = []
        for key, seq in self.scheduler.retained.entries():
            sig = _signature(seq.ids)
            with self._lock:
                if self._saved.get(key) == sig:
                    continue
            n = len(seq.ids)
            k, v = seq.kv.read(0, n)  # [L, H_kv, n, D] in the compute dtype (an int8 KV dequantised)
            out.append(_Snapshot(key, list(seq.ids), k.clone(), v.clone(), sig))
        return out

    def _insert(self, stored: StoredKV) -> int:
        """Commit a loaded file's rows to the radix cache as `stored.key`'s latest sequence
        (engine thread, idle). Rows the tree has already are not copied; returns rows stored."""
        res = self.scheduler.cache.commit(stored.ids, _Rows(stored.k, stored.v), len(stored.ids), key=stored.key)
        if res.node is not None:
            self.loaded_files += 1
            self.loaded_tokens += res.n_cached
            with self._lock:
                self._saved[stored.key] = _signature(stored.ids)  # on disk already
        return res.n_stored


def attach_disk_tier(
    engine: Any,  # engine.local.LocalEngine, after its scheduler started
    where: bool | str | Path,
    budget_bytes: int,
    adapter: Path | None = None,
    **options: Any,
) -> DiskTier:
    """A started tier for `engine`: `where` is True (the default directory,
    `engine.kv.disk_format.kv_directory`) or a directory; `options` go to `DiskTier`."""
    directory = kv_directory() if where is True else Path(where)
    pool = engine.cache.pool
    # Files hold rows in the compute dtype; an int8 pool writes its rows dequantised and
    # quantises what it loads, under a fingerprint of its own (a dense engine must not take
    # rows that went through int8, nor the other way round).
    kv_format = f"int8/{pool.dtype}" if pool.int8 else pool.dtype
    fp = fingerprint(engine.loaded, engine.template, kv_format, engine.quant, adapter)
    shape = (pool.n_layers, pool.n_kv_heads, pool.head_dim)
    store = KVDiskStore(directory, fp, budget_bytes, shape, pool.dtype)
    options.setdefault("preload_tokens", pool.n_slots // 2)  # half the pool at most
    return DiskTier(engine.scheduler, store, **options).start()


__all__ = ["DiskTier", "DiskTierStats", "TierScheduler", "attach_disk_tier", "fingerprint"]
