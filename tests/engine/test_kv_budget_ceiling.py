"""`--kv-budget` is a hard ceiling for all of the engine's stored KV together: the radix
pool, the chunk store (CacheBlend context chunks and documents' pieces, held in the pool)
and the retained per-document KV. More and larger documents than fit are opened, with
context chunks (`context="blend"`), background warm-ups and document pieces
(`warm_document`); a thread samples the engine's KV bytes all along. The engine must evict
instead of growing. In-flight sequences' working KV is not part of the stored KV; its
largest sample is printed (`-s`), not bounded here."""

from __future__ import annotations

import threading
import time

import pytest

from engine.api import ContextChunk, InfillRequest
from engine.local import load_engine
from engine.retained import kv_bytes
from tiny_models import stdlib_sources

BUDGET = 1 << 20  # 1 MiB: a few thousand tokens of the tiny model


def test_kv_budget_caps_pool_chunk_store_and_retained_kv_together(tiny_model_factory):
    sources = stdlib_sources(("textwrap.py", "shlex.py", "bisect.py", "difflib.py", "argparse.py", "csv.py"))
    eng = load_engine(str(tiny_model_factory("llama")), dtype="fp32", kv_budget=BUDGET, warm_chunk_tokens=32,
                      idle_grace=0.0, chunk_tokens=64)
    try:
        pool_bytes = eng.cache.k.nbytes + eng.cache.v.nbytes  # preallocated once: the pool never grows
        samples: list[tuple[int, int, int, int]] = []  # (stats used, pool + retained allocated, chunk slots, in-flight)
        stop = threading.Event()

        def sample() -> None:
            while not stop.is_set():
                s = eng.scheduler
                st = eng.stats()
                allocated = eng.cache.k.nbytes + eng.cache.v.nbytes + s.retained.nbytes()
                try:
                    working = sum(kv_bytes(q.kv) for q in list(s._prefilling) + list(s._decoding) if q.kv is not None)
                except (RuntimeError, AttributeError):
                    working = 0
                samples.append((st.cache_bytes_used, allocated, s.chunk_store.stats().tokens, working))
                time.sleep(0.002)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        handles = []
        for round_ in range(2):
            for i, text in enumerate(sources * 2):  # 12 documents, each far larger than the budget
                key = f"doc{i}"
                at = len(text) // 3 + 997 * round_
                eng.warm_document(key, text, at)  # documents' pieces (background)
                handles.append(eng.submit(InfillRequest(key=key, prefix=text[max(0, at - 3000):at], suffix=text[at:at + 800],
                                                        max_tokens=4, background=True)))  # a warm-up
                others = [sources[(i + j) % len(sources)] for j in (1, 2)]
                chunks = tuple(ContextChunk(f"ctx{(i + j) % len(sources)}.py", o[len(o) // 2:len(o) // 2 + 900])
                               for j, o in zip((1, 2), others))
                handles.append(eng.submit(InfillRequest(key=key, prefix=text[max(0, at - 2000):at], suffix=text[at:at + 600],
                                                        chunks=chunks, context="blend", max_tokens=6)))
            for h in handles:
                h.result(120)
            eng.wait_idle(120)
            deadline = time.monotonic() + 60  # let the document pieces run
            while eng.scheduler.background_pending() and time.monotonic() < deadline:
                time.sleep(0.05)
        stop.set()
        sampler.join(5)
        eng.check_integrity().result(60)
        stats = eng.stats()
        max_used = max(s[0] for s in samples)
        max_allocated = max(s[1] for s in samples)
        max_chunk_slots = max(s[2] for s in samples)
        max_working = max(s[3] for s in samples)
        store = eng.scheduler.chunk_store
        print(f"\nbudget {BUDGET} B (pool {pool_bytes} B = {eng.cache.n_slots} slots, retained cap {BUDGET // 4} B); "
              f"{len(samples)} samples: stored KV max {max_used} B, pool + retained allocated max {max_allocated} B, "
              f"chunk store max {max_chunk_slots} slots (cap {store.max_slots}); evicted {stats.evictions} tokens; "
              f"in-flight working KV max {max_working} B; requests {stats.requests}, warm {stats.warm_requests}, "
              f"document tokens {stats.document_tokens}")
        assert len(samples) > 100
        assert max_used <= BUDGET, f"stored KV reached {max_used} B over a budget of {BUDGET} B"
        assert max_allocated <= BUDGET, f"pool + retained KV reached {max_allocated} B over {BUDGET} B"
        assert max_chunk_slots <= store.max_slots
        assert stats.evictions > 0  # it evicted instead of growing
        assert stats.completed >= 24 and stats.warm_requests >= 24
        assert stats.document_tokens > 0  # the documents' pieces were stored too
    finally:
        eng.close()


@pytest.mark.xfail(strict=True, reason="open: a running request's working KV is not charged to --kv-budget")
def test_a_running_sequences_working_kv_is_not_yet_within_the_budget(tiny_model_factory):
    """Open gap, kept as a strict xfail: the contiguous KV a running request computes in
    (sized to its window, outside the pool until it finishes) is not charged to the budget
    while it runs, so one request can hold more than the whole `--kv-budget` (measured: one
    request 768 KiB of working KV beside 764 KiB stored; the requests in flight together
    up to 9.4 MB in the test above, under a 1 MiB budget). Fixing it needs admission
    control in the scheduler."""
    sources = stdlib_sources(("textwrap.py",))
    eng = load_engine(str(tiny_model_factory("llama")), dtype="fp32", kv_budget=BUDGET, chunk_tokens=64)
    try:
        runner = eng.scheduler.runner
        prefill, seen = runner.prefill_chunk, []

        def recording(seq, *a, **kw):
            seen.append(kv_bytes(seq.kv))
            return prefill(seq, *a, **kw)

        runner.prefill_chunk = recording
        text = sources[0]
        at = len(text) // 2
        eng.submit(InfillRequest(key="one", prefix=text[at - 3000:at], suffix=text[at:at + 800], max_tokens=4)).result(120)
        assert seen
        stored = eng.stats().cache_bytes_used
        assert stored + max(seen) <= BUDGET, f"working KV {max(seen)} B + stored {stored} B > budget {BUDGET} B"
    finally:
        eng.close()
