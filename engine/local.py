"""`LocalEngine`: the in-process `engine.api.Engine` (model + radix cache on one thread).

It wires the pieces: the text side (`engine.prompting`: template, segment tokenizer,
fit to context, streamed text), the handle callers hold (`engine.handle`), and the
scheduler that owns the engine thread (`engine.scheduling.scheduler`, token ids and tensors only).
`load_engine` builds one from a model name or path (loading itself: `engine.runtime.loading`).

Threads: `submit()` runs on the caller's thread and only enqueues; rendering and
tokenization run on the engine thread (an unchanged prefix/suffix is a dict lookup in
the segment LRU), so submit never blocks on the engine.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import itertools
import logging
import os
import threading
import time
from concurrent.futures import Future
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import torch

from engine.api import MAX_ALTERNATIVES, Completion, EngineError, EngineInfo, EngineStats, InfillRequest
from engine.runtime import faults
from engine.runtime.recovery import CrashRecord, abandon, is_out_of_memory
from engine.kv.budget import default_budget_bytes, parse_bytes
from engine.kv.radix import RadixCache
from engine.runtime.cpu_threads import ThreadGovernor, on_a_thread_that_ends, team_affinity
from engine.kv.disk_tier import DiskTier, attach_disk_tier
from engine.model import int8_prefill
from engine.model.head_screen import head_form
from engine.cacheblend.document_kv import DocumentPass
from engine.handle import RequestHandle
from engine.runtime.loading import load_model_for_engine
from engine.prompting import PromptBuilder, RequestSink
from engine.text.sampler import FreshLine, Sampler
from engine.scheduling.scheduler import Scheduler
from engine.scheduling.sequence import Sequence
from engine.text.templates import FimTemplate, detect_template
from engine.text.tokenize import SegmentTokenizer

if TYPE_CHECKING:
    from engine.model.loader import LoadedModel

log = logging.getLogger(__name__)

_SKIPPED = object()  # a budget change that timed out and was cancelled before it began

_DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float32: "fp32", torch.float16: "fp16"}

# glibc's malloc raises its mmap threshold to the size of each large block freed, up to
# 32 MiB, so after the first window's KV (15-40 MB per sequence, allocated and dropped at
# keystroke rate) is freed, the next ones are carved from the heap, which fragments and
# never shrinks: a soak of 8 documents typed at once grew the server from 1.1 to 7.8 GB.
# A fixed 1 MiB threshold keeps every large tensor in its own mapping, returned on free.
_M_MMAP_THRESHOLD = -3
_MMAP_THRESHOLD_BYTES = 1 << 20
_heap_fixed = False


def _keep_large_blocks_out_of_the_heap() -> None:
    """Set glibc's mmap threshold once per process (no-op elsewhere, or when the user set
    MALLOC_MMAP_THRESHOLD_ themselves)."""
    global _heap_fixed
    if _heap_fixed or "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return
    _heap_fixed = True
    try:
        libc = ctypes.CDLL(None)
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc
        return
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    if not mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_BYTES):
        log.debug("mallopt(M_MMAP_THRESHOLD) refused")


class LocalEngine:
    """In-process engine over a loaded model. Use `load_engine()` to build one."""

    model_in_this_process = True  # engine.api.Engine

    def __init__(
        self,
        loaded: LoadedModel,
        *,
        kv_budget: int | str | None = None,
        step_tokens: int = 256,
        fragment_trained: bool = False,
        quant: str | None = None,
        check_integrity: bool = False,
        retain_documents: int = 4,
        background_step_tokens: int | None = None,
        background_min_slice: float = 0.025,
        background_share_after: float = 0.2,
        idle_grace: float = 0.25,
        blend_store_share: float = 0.5,
        working_share: float = 0.5,
        kv_disk: bool | str | Path = False,
        kv_disk_budget: int | str = "2G",
        adapter_path: Path | None = None,
        adaptive_threads: bool = True,
        kv_dtype: str | None = None,
    ) -> None:
        _keep_large_blocks_out_of_the_heap()
        self.loaded = loaded
        self.model = loaded.model
        cfg = self.model.config
        self.template: FimTemplate = detect_template(loaded.tokenizer)
        from engine.adapters import adapter_probes  # noqa: PLC0415

        # Next-edit probes are answered only by a model trained on their layout.
        self.probes = self.template.probe_id is not None and adapter_probes(adapter_path)
        self.tokenizer = SegmentTokenizer(loaded.tokenizer)
        self.fragment_trained = fragment_trained
        self.prompts = PromptBuilder(self.template, self.tokenizer, fragment_trained=fragment_trained)
        self.quant = quant
        self.end_ids = self.prompts.end_ids(cfg.eos_ids)
        self.prompts.fresh_line(self.end_ids)  # the fresh-line masks (~25 ms over a 49k vocabulary): at load, not on a keystroke
        budget = parse_bytes(kv_budget) if kv_budget is not None else default_budget_bytes()
        # One ceiling for all KV (docs/reliability.md, "KV budget"): the radix pool is
        # preallocated with (1 - working_share) of it; the working share holds the KV the
        # model computes in — every running sequence's (requests, warm-ups, alternatives'
        # forks, the document piece in flight) — and, in what that leaves, the retained
        # per-document KV (kept so the next keystroke of a document starts without a
        # gather), at most 1/4 of the budget. The scheduler charges working KV before it
        # allocates it, so pool + working + retained never exceed the budget.
        if not 0.0 < working_share < 1.0:
            raise ValueError(f"working_share must be in (0, 1), got {working_share}")
        self.kv_budget_bytes = budget
        self._working_share, self._retains = working_share, retain_documents > 0
        pool_budget, working_budget, retained_budget = self._budget_parts(budget)
        try:  # "int8": KV rows in int8 with per-(token, head) scales, pool included (docs/model.md)
            self.model.set_kv_dtype(kv_dtype)
        except ValueError as exc:
            raise EngineError(str(exc)) from None
        self.kv_dtype = self.model.kv_dtype  # "model" | "int8"
        self._pool_budget = pool_budget
        # The engine thread uses up to torch's thread count (its default, or `threads` given
        # to `load_engine`), fewer while other processes keep cores busy; a team that fills the
        # machine is pinned one thread per CPU (engine.runtime.cpu_threads).
        team = team_affinity() if adaptive_threads and getattr(self.model, "device", torch.device("cpu")).type == "cpu" else None
        self.threads = ThreadGovernor(torch.get_num_threads(), team=team) if adaptive_threads else None
        self._scheduler_options = dict(
            before_step=self.threads.apply if self.threads is not None else None,
            step_tokens=step_tokens,
            background_step_tokens=background_step_tokens,
            background_min_slice=background_min_slice,
            background_share_after=background_share_after,
            idle_grace=idle_grace,
            header=tuple(self.template.bos_ids),
            blend_store_share=blend_store_share,
            check_integrity=check_integrity,
            retain_documents=retain_documents,
            retained_budget_bytes=retained_budget,
            working_budget_bytes=working_budget,
        )
        self.cache, self.scheduler = self._new_scheduler()
        faults.install_from_env(self.scheduler)  # test hook (EFIM_FAULT); nothing when unset
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._grow_lock = threading.Lock()  # one budget raise at a time (grow_kv_budget)
        # Engine-thread health (`health()`): restarts after a crash, and out-of-memory errors.
        self.crashes = CrashRecord()
        self.state = "running"  # "running" | "failed" (crashed too often) | "closed"
        self.oom_errors = 0
        # Called (kind, message) on the engine thread when something the user should hear
        # about happened: "engine-crash", "engine-failed", "out-of-memory". The server sets it.
        self.on_fault: Callable[[str, str], None] | None = None
        self._canceller = _CancelOnCurrentScheduler(self)
        self._by_key: dict[str, RequestHandle[Sequence]] = {}
        self._warming: dict[str, RequestHandle[Sequence]] = {}  # background requests, by key
        self._closed = False
        self.disk_tier = None  # attached below, once the thread runs
        self._thread = self._start_thread(self.scheduler)
        # Disk tier (engine.kv.disk_tier): True = the user cache directory, or a directory.
        self.disk_tier: DiskTier | None = (
            attach_disk_tier(self, kv_disk, parse_bytes(kv_disk_budget), adapter_path) if kv_disk else None
        )

    @property
    def document_cap_tokens(self) -> int:
        """Most tokens of one document's pieces kept: half the blend store's share of the pool."""
        return max(1, int(self.cache.n_slots * self._scheduler_options["blend_store_share"] / 2))

    def _budget_parts(self, budget: int) -> tuple[int, int, int]:
        """(pool, working share, retained share within it) of a KV budget."""
        working = int(budget * self._working_share)
        retained = min(budget // 4, working) if self._retains else 0
        return budget - working, working, retained

    def grow_kv_budget(self, budget: int | str, timeout: float | None = 60.0) -> int:
        """Raise the KV ceiling to `budget` while serving (never lowers it): at the engine's
        next step the pool takes the larger size — every cached row stays where it is —
        and the working and retained shares grow with it. For the engine daemon, whose
        budget is the largest any front asked for. Returns the budget in force; raises
        EngineError when the engine cannot take it (closed, failed, no step within `timeout`)."""
        want = parse_bytes(budget)
        with self._grow_lock:  # not self._lock: the engine thread takes that one as requests finish
            if want <= self.kv_budget_bytes:
                return self.kv_budget_bytes
            pool, working, retained = self._budget_parts(want)
            scheduler = self.scheduler
            future = scheduler.run_between_steps(lambda: scheduler.grow_budget(pool, working, retained))
            if self._budget_step(future, timeout, want, "raise") is _SKIPPED:
                raise EngineError(f"could not raise the KV budget to {want} bytes: the engine took no step within {timeout} s")
            return self._take_budget(want, "raised")

    def lower_kv_budget(self, budget: int | str, timeout: float | None = 60.0) -> int:
        """Lower the KV ceiling to `budget` while serving (never raises it): once the engine
        is idle, the cached rows beyond the smaller pool are evicted (least recently used
        first), the rest move into a smaller pool and the old one's memory goes back; the
        working and retained shares shrink with it. For the engine daemon when the front that
        asked for the largest budget leaves. Returns the budget in force (unchanged when the
        rows in use do not fit, or the engine was not idle within `timeout`); raises
        EngineError when the engine cannot take it."""
        want = parse_bytes(budget)
        with self._grow_lock:
            if want >= self.kv_budget_bytes:
                return self.kv_budget_bytes
            pool, working, retained = self._budget_parts(want)
            scheduler = self.scheduler
            future = scheduler.run_when_idle(lambda: scheduler.shrink_budget(pool, working, retained))
            done = self._budget_step(future, timeout, want, "lower")
            if done is _SKIPPED:
                log.info("KV budget kept at %d bytes: the engine was not idle within %s s", self.kv_budget_bytes, timeout)
                return self.kv_budget_bytes
            if not done:
                log.info("KV budget kept at %d bytes: the rows in use do not fit %d", self.kv_budget_bytes, want)
                return self.kv_budget_bytes
            return self._take_budget(want, "lowered")

    def _budget_step(self, future: Future, timeout: float | None, want: int, verb: str) -> object:
        """The outcome of a budget change queued on the engine thread: its result; `_SKIPPED`
        when `timeout` passed and it was cancelled before it began (nothing changed, and it
        never will behind the caller's back); EngineError when it failed (closed, crashed
        meanwhile, the pool could not be allocated, a share too small for a sequence)."""
        try:
            try:
                return future.result(timeout)
            except concurrent.futures.TimeoutError:
                if future.cancel():
                    return _SKIPPED
                return future.result()  # it began meanwhile: its outcome is the budget's
        except Exception as exc:
            raise EngineError(f"could not {verb} the KV budget to {want} bytes: {exc}") from exc

    def _take_budget(self, want: int, verb: str) -> int:
        """The engine thread changed the pool and shares for `want`: it is the budget now."""
        pool, working, retained = self._budget_parts(want)
        self._pool_budget = pool
        self._scheduler_options.update(working_budget_bytes=working, retained_budget_bytes=retained)
        self.kv_budget_bytes = want
        log.info("KV budget %s to %d bytes (pool %d slots)", verb, want, self.cache.n_slots)
        return want

    def _new_scheduler(self) -> tuple[RadixCache, Scheduler]:
        cfg = self.model.config
        cache = RadixCache(
            n_layers=cfg.n_layers,
            n_kv_heads=cfg.n_kv_heads,
            head_dim=cfg.head_dim,
            dtype=self.model.dtype,  # the compute dtype (an int8 pool keeps its scales in it)
            budget_bytes=self._pool_budget,
            kv_dtype=self.kv_dtype,
        )
        return cache, Scheduler(self.model, cache, **self._scheduler_options)

    def _start_thread(self, scheduler: Scheduler) -> threading.Thread:
        thread = threading.Thread(target=self._run, args=(scheduler,), name="efim-engine", daemon=True)
        thread.start()
        return thread

    def _run(self, scheduler: Scheduler) -> None:
        if self.threads is not None:
            self.threads.on_new_thread()
        try:
            with torch.inference_mode():
                scheduler.run()
        except BaseException as exc:  # the loop itself died (its steps' Exceptions are caught inside)
            log.critical("the engine thread died", exc_info=exc)
            self._recover(scheduler, f"{type(exc).__name__}: {exc}")

    # ------------------------------------------------------------ crash recovery
    def _recover(self, dead: Scheduler, what: str) -> None:
        """`dead`'s thread is gone: end its queued and running requests with "error", and —
        unless the engine is closed or crashed too often — start a fresh scheduler (new KV
        pool, blend store and retained KV: the dead one's state may be half-updated) on a new
        engine thread. Runs on the dying thread, or on a submitter's (`_check_thread`)."""
        crashes = self.crashes
        with crashes.lock:
            if dead is not self.scheduler:
                return  # already recovered
            crashes.crashed(what)
            with self._lock:  # submitters see the new scheduler, or the failed state, never the dead one
                dead.close()
                restart = not self._closed and crashes.may_restart()
                if restart:
                    self.cache, self.scheduler = self._new_scheduler()
                elif not self._closed:
                    self.state = "failed"
            failed = abandon(dead, f"the engine thread crashed ({what})")
            if restart:
                if self.disk_tier is not None:
                    self.disk_tier.scheduler = self.scheduler
                crashes.restarts += 1
                self._thread = self._start_thread(self.scheduler)
                message = (f"the engine thread crashed ({what}) and was restarted; {failed} request(s) failed, "
                           "the KV cache was dropped")
                log.error("%s", message)
                self._report("engine-crash", message)
            elif self.state == "failed":
                message = (f"the engine thread crashed {crashes.recent} times within "
                           f"{crashes.window_s:.0f} s (last: {what}); the engine is stopped, reload the model")
                log.error("%s", message)
                self._report("engine-failed", message)

    def _check_thread(self) -> None:
        """Watchdog (on submit): an engine thread that is gone without reporting is recovered here."""
        scheduler, thread = self.scheduler, self._thread
        if not thread.is_alive() and self.state == "running" and not self._closed:
            thread.join(0.5)  # a dying thread may still be recovering
            if not thread.is_alive() and scheduler is self.scheduler:
                self._recover(scheduler, "the engine thread was found dead")

    def _report(self, kind: str, message: str) -> None:
        callback = self.on_fault
        if callback is None:
            return
        try:
            callback(kind, message)
        except Exception:
            log.exception("reporting an engine fault failed")

    def health(self) -> dict:
        """The engine thread's state for `efim/stats` "engine" (any thread)."""
        return {
            "state": self.state,
            "restarts": self.crashes.restarts,
            "lastCrash": self.crashes.last,
            "outOfMemory": self.oom_errors,
            "threadAlive": self._thread.is_alive(),
            # CPU threads the engine computes with now, and how often the load changed it.
            "cpuThreads": self.threads.threads if self.threads is not None else torch.get_num_threads(),
            "cpuThreadChanges": self.threads.changes if self.threads is not None else 0,
            "cpuThreadsPinned": self.threads.pinned if self.threads is not None else 0,
        }

    # ------------------------------------------------------------ Engine protocol
    def info(self) -> EngineInfo:
        cfg = self.model.config
        return EngineInfo(
            model=self.loaded.name,
            architecture=cfg.architecture,
            template=self.template.name,
            supports_fim=self.template.supports_fim,
            fragment_trained=self.fragment_trained,
            context_length=int(cfg.max_position),
            dtype=_DTYPE_NAMES.get(self.model.dtype, str(self.model.dtype)),
            quant=self.quant,
            kv_dtype=self.kv_dtype,
            suffix_first=self.template.suffix_first,
            probes=self.probes,
            head=head_form(self.model.lm_head),
            c_kernels=self.model.c_kernels(),
            prefill=None if self.quant != "mixed" else ("int8" if int8_prefill.in_use(self.model) else "bf16"),
        )

    def submit(self, request: InfillRequest) -> RequestHandle[Sequence]:
        """Queue `request`; a running request with the same key and priority is cancelled
        first (a foreground request ends its document's warm-up in the scheduler instead,
        keeping what the warm-up computed)."""
        if not isinstance(request, InfillRequest):
            raise TypeError(f"submit() takes an InfillRequest, not {type(request).__name__}")
        fresh = self.prompts.fresh_line(self.end_ids) if request.fresh_line and not request.background else None
        guard = request.fresh_line_guard
        sampler = Sampler(request.temperature, request.top_p, request.seed, fresh_line=fresh, guard=guard)  # ValueError for bad params
        fork_samplers = () if request.background else _fork_samplers(request, fresh)
        self._check_thread()
        if self.state == "failed":
            raise EngineError(f"the engine stopped after repeated crashes (last: {self.crashes.last})")
        handle: RequestHandle[Sequence] = RequestHandle(next(self._ids), self._canceller)
        seq = Sequence(
            request_id=handle.request_id,
            key=request.key,
            sink=RequestSink(self.prompts, request, handle, end_ids=self.end_ids, on_finished=self._on_finished),
            sampler=sampler,
            max_tokens=request.max_tokens,
            cache=request.cache,
            background=request.background,
            idle_only=request.background and request.idle_only,
            deadline=request.deadline,
            owner=request.owner,
            fork_samplers=fork_samplers,
            speculate=_speculate(request),
        )
        handle.work = seq
        tier = self.disk_tier
        if tier is not None and request.cache:
            tier.request(request.key)  # ready for this document's next request, if on disk
        live = self._warming if request.background else self._by_key
        with self._lock:
            if self._closed:
                raise EngineError("engine is closed")
            old = live.get(request.key)
            if old is not None and not old.done:
                old.cancel()
            live[request.key] = handle
            self.scheduler.submit(seq)
        return handle

    def keep_document_pieces(self, key: str, text: str, cursor: int) -> None:
        """Background: keep the KV of `text`'s pieces (see `engine.cacheblend.document_kv`), nearest
        `cursor` first, at most `document_cap_tokens` of them; "" has none and does nothing
        (`forget_document` drops a document's pieces). Thread-safe and immediate: cutting
        and tokenizing happen on the engine thread."""
        if not isinstance(text, str) or not isinstance(key, str):
            raise TypeError("keep_document_pieces(key: str, text: str, cursor: int)")
        if not text:
            return
        cursor = min(max(int(cursor), 0), len(text))
        self.scheduler.plan_document(
            DocumentPass(key, text, cursor, self.tokenizer.encode_uncached, self.document_cap_tokens)
        )

    def forget_document(self, key: str) -> None:
        """Drop the document's pieces, its pass (in flight included) and its kept working KV
        at the engine's next step (`engine.api.Engine.forget_document`). Thread-safe and
        immediate."""
        if not isinstance(key, str):
            raise TypeError("forget_document(key: str)")
        self.scheduler.forget_document(key)

    def _on_finished(self, handle: RequestHandle[Sequence], completion: Completion) -> None:
        with self._lock:
            seq = handle.work
            if seq is not None:
                live = self._warming if seq.background else self._by_key
                if live.get(seq.key) is handle:
                    del live[seq.key]
        if completion.finish_reason == "error" and is_out_of_memory(completion.error):
            self._out_of_memory(completion.error or "")

    def _out_of_memory(self, error: str) -> None:
        """A request failed for want of memory (engine thread, from its sink): free the
        retained KV (the only KV outside the preallocated pool) and report it."""
        self.oom_errors += 1
        self.scheduler.retained.clear()
        message = f"out of memory while computing a completion ({error}); that request failed, the documents' KV was freed"
        log.error("%s", message)
        self._report("out-of-memory", message)

    def engine_seconds_by_owner(self) -> dict[str, float]:
        """Engine seconds each owner (`InfillRequest.owner`: a daemon's front) was charged by
        the scheduler's turns since the engine thread started (engine.scheduling.fairness)."""
        return self.scheduler.turns.spent_by_owner()

    def stats(self) -> EngineStats:
        c = self.scheduler.counters
        used, free = self.cache.usage()
        used += self.scheduler.retained.nbytes()  # retained KV is charged to the same budget
        working = self.scheduler.working_kv_bytes()  # and so is the KV running sequences compute in
        free = max(0, self.kv_budget_bytes - used - working)
        return EngineStats.from_counters(
            c,
            evictions=self.cache.evicted_tokens,
            cache_bytes_used=used,
            cache_bytes_free=free,
            cache_bytes_total=self.kv_budget_bytes,
            working_kv_bytes=working,
            document_tokens=self.scheduler.document_tokens(),
            **self._disk_stats(),
        )

    def _disk_stats(self) -> dict:
        tier = self.disk_tier
        if tier is None:
            return {}
        d = tier.stats()
        return {"kv_disk": d.state, "kv_disk_loaded_tokens": d.loaded_tokens, "kv_disk_saved_files": d.saved_files}

    def count_tokens(self, text: str) -> int:
        return self.tokenizer.count(text)

    def forget_context(self, path: str) -> None:
        """The file `path` (a `ContextChunk.path`) changed: drop its chunks' cached KV
        (CacheBlend). Thread-safe; takes effect at the engine's next step."""
        self.scheduler.forget_chunks(path)

    def computing(self) -> bool:
        """True while the engine thread has work now (`engine.api.Engine.computing`)."""
        return self.scheduler.computing()

    def check_integrity(self) -> Future[None]:
        """The radix cache's, blend store's and retained KV's invariants, checked on the
        engine thread once it is idle (`Scheduler.check_integrity`). Never blocks."""
        return self.scheduler.run_when_idle(self.scheduler.check_integrity)

    def close(self, timeout: float = 10.0) -> None:
        """Stop the engine thread; running requests end "cancelled". Idempotent."""
        with self._lock:
            self._closed = True
            self.state = "closed"
        self.scheduler.close()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout)
        if self.disk_tier is not None:  # the retained KV is read here only once the engine thread stopped
            tier, self.disk_tier = self.disk_tier, None
            tier.close(None if self._thread.is_alive() else self.scheduler.retained)

    def wait_idle(self, timeout: float = 30.0) -> None:
        """Block until no request is queued or running (tests, benchmarks, tools; never
        from the event loop)."""
        end = time.monotonic() + timeout
        while not self.scheduler.idle():
            if time.monotonic() > end:
                raise TimeoutError("engine still busy")
            time.sleep(0.001)

    def __enter__(self) -> LocalEngine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _speculate(request: InfillRequest) -> int:
    """The request's draft length (engine.scheduling.speculation); ValueError outside 0..64."""
    if not isinstance(request.speculate, int) or not 0 <= request.speculate <= 64:
        raise ValueError(f"speculate must be an int in 0..64; got {request.speculate!r}")
    return request.speculate


def _fork_samplers(request: InfillRequest, fresh_line: FreshLine | None = None) -> tuple[Sampler, ...]:
    """The samplers of a request's alternatives: fork i (1..n-1) seeded with (seed or 0) + i,
    so the same request gets the same alternatives; each under the request's fresh-line rule.
    ValueError for a bad `n` or parameters."""
    if not 1 <= request.n <= MAX_ALTERNATIVES:
        raise ValueError(f"n must be in 1..{MAX_ALTERNATIVES}; got {request.n}")
    base = request.seed if request.seed is not None else 0
    return tuple(
        Sampler(request.alternatives_temperature, request.alternatives_top_p, base + i, fresh_line=fresh_line, guard=request.fresh_line_guard)
        for i in range(1, request.n)
    )


class _CancelOnCurrentScheduler:
    """A handle's `Canceller`: cancels on the scheduler the engine runs now, not on the
    one the request was submitted to (a handle must not keep a crashed scheduler, and its
    KV pool, alive)."""

    __slots__ = ("_engine",)

    def __init__(self, engine: LocalEngine) -> None:
        self._engine = engine

    def cancel(self, seq: Sequence) -> None:
        self._engine.scheduler.cancel(seq)


def load_engine(
    model: str | Path = "default",
    *,
    dtype: str | None = None,
    quant: str | None = None,
    fim_tokens: str = "auto",
    kv_budget: int | str | None = None,
    threads: int | None = None,
    adapter: Path | str | None = "auto",
    fragment_trained: bool | None = None,
    prefill: str | None = None,
    **engine_options,
) -> LocalEngine:
    """Load `model` with its adapter (`engine.runtime.loading.load_model_for_engine`: what `adapter`
    and `fragment_trained` mean) and start an engine on it; `engine_options` go to
    `LocalEngine`.

    The loading runs on a thread of its own that ends when the engine is built: every
    thread that runs parallel torch work keeps an OpenMP team alive, and with more team
    threads than CPUs libgomp stops spinning between kernels, which made the engine
    thread's prefill 1.6x slower (engine.runtime.cpu_threads)."""

    def build() -> LocalEngine:
        try:  # the KV budget is committed beside the weights: the loader checks both fit
            reserve = parse_bytes(kv_budget) if kv_budget is not None else default_budget_bytes()
        except ValueError:
            reserve = 0  # LocalEngine reports the bad budget
        got = load_model_for_engine(
            model, dtype=dtype, quant=quant, fim_tokens=fim_tokens, threads=threads, adapter=adapter,
            fragment_trained=fragment_trained, reserve_bytes=reserve, prefill=prefill,
        )
        return LocalEngine(
            got.loaded, kv_budget=kv_budget, fragment_trained=got.fragment_trained, quant=got.quant,
            adapter_path=got.adapter, **engine_options,
        )

    return on_a_thread_that_ends(build, name="efim-load")


__all__ = ["LocalEngine", "check_model", "load_engine"]


def check_model(
    model: str | Path = "default",
    *,
    quant: str | None = None,
    fim_tokens: str = "auto",
    adapter: Path | str | None = "auto",
) -> None:
    """Pre-flight for `load_engine` with the same arguments: every check of the model's and
    the adapter's files that reads no weight (`engine.model.loader.inspect_model`), raising
    the EngineError the load would raise. A server runs it before closing the engine it
    serves with, so a bad model leaves the old one serving (`efim_lsp.engine_holder`).
    The memory check is left to the load, when the old engine's memory is free."""
    from engine.adapters import resolve_adapter  # noqa: PLC0415
    from engine.model.gguf import forget_readers  # noqa: PLC0415
    from engine.model.loader import inspect_model  # noqa: PLC0415

    resolve_adapter(model, adapter)
    try:
        inspect_model(model, quant=quant, fim_tokens=fim_tokens)
    finally:
        forget_readers()
