"""`--kv-budget` is a hard ceiling for all of the engine's KV together: the radix pool
(preallocated, counted whole), the blend store (CacheBlend context chunks and documents'
pieces, held in the pool), the retained per-document KV, and the working KV every running
sequence computes in (requests, background warm-ups, alternatives' forks, the document
piece in flight). The invariant is a concurrent one, so `Ceiling` samples it on the
engine thread at every model call (each prefill step, decode step, blend pass and piece):
pool bytes + retained KV + every running sequence's KV tensors <= budget. The engine
evicts (retained KV, then background work) instead of growing, a request waits for
running ones to finish, and a window that alone cannot fit is cut and answered. `-s`
prints the maxima."""

from __future__ import annotations

import threading
import time

import pytest

from engine.api import ContextChunk, InfillRequest
from engine.local import load_engine
from engine.kv.retained import kv_bytes
from tiny_models import stdlib_sources

BUDGET = 1 << 20  # 1 MiB: a few thousand tokens of the tiny model


def pool_bytes(cache) -> int:
    """The pool's allocated bytes, from its tensors (an int8 pool's scales included)."""
    names = ("k8", "k_scale", "v8", "v_scale") if getattr(cache, "int8", False) else ("k", "v")
    return sum(getattr(cache.pool, name).nbytes for name in names)


class Ceiling:
    """Samples the engine's KV bytes on the engine thread, at every model forward and
    decode step: (pool allocated, pool in use, retained, working, running sequences,
    running foreground sequences). Working = the KV tensors of every prefilling and
    decoding sequence (forks included) and of the document piece in flight, read from
    the tensors themselves, not from the scheduler's own accounting."""

    def __init__(self, eng) -> None:
        self.eng = eng
        self.samples: list[tuple[int, int, int, int, int, int]] = []
        model = eng.scheduler.runner.model
        forward, decode_batch = model.forward, model.decode_batch

        def sampled_forward(*a, **kw):
            self.sample()
            return forward(*a, **kw)

        def sampled_decode(*a, **kw):
            self.sample()
            return decode_batch(*a, **kw)

        model.forward, model.decode_batch = sampled_forward, sampled_decode

    def sample(self) -> None:
        s, cache = self.eng.scheduler, self.eng.cache
        running = [*s._prefilling, *s._decoding]
        working = sum(kv_bytes(q.kv) for q in running if q.kv is not None)
        piece = s.documents.kv_in_flight()
        working += kv_bytes(piece) if piece is not None else 0
        used, _free = cache.usage()
        self.samples.append((pool_bytes(cache), used, s.retained.nbytes(), working, len(running),
                             sum(not q.background for q in running)))

    def max_total(self) -> int:
        """Most bytes held at once: the whole pool (preallocated) + retained + working."""
        return max(p + r + w for p, _u, r, w, _n, _f in self.samples)

    def max_used(self) -> int:
        """Most bytes in use at once: the pool's used slots + retained + working."""
        return max(u + r + w for _p, u, r, w, _n, _f in self.samples)

    def max_working(self) -> int:
        return max(s[3] for s in self.samples)

    def check(self, budget: int) -> None:
        assert self.samples, "the model never ran"
        assert self.max_total() <= budget, f"pool + retained + working KV reached {self.max_total()} B over {budget} B"


def test_kv_budget_caps_pool_blend_store_retained_and_working_kv_together(tiny_model_factory):
    sources = stdlib_sources(("textwrap.py", "shlex.py", "bisect.py", "difflib.py", "argparse.py", "csv.py"))
    eng = load_engine(str(tiny_model_factory("llama")), dtype="fp32", kv_budget=BUDGET, background_step_tokens=32,
                      idle_grace=0.0, step_tokens=64)
    try:
        ceiling = Ceiling(eng)
        pool = pool_bytes(eng.cache)  # preallocated once: the pool never grows
        samples: list[tuple[int, int, int, int]] = []  # (stats used, pool + retained allocated, blend store slots, working)
        stop = threading.Event()

        def sample() -> None:  # what a client sees in efim/stats, read from another thread
            while not stop.is_set():
                s = eng.scheduler
                st = eng.stats()
                allocated = pool + s.retained.nbytes()
                samples.append((st.cache_bytes_used, allocated, s.blend_store.stats().tokens, st.working_kv_bytes))
                time.sleep(0.002)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        handles = []
        for round_ in range(2):
            for i, text in enumerate(sources * 2):  # 12 documents, each far larger than the budget
                key = f"doc{i}"
                at = len(text) // 3 + 997 * round_
                eng.keep_document_pieces(key, text, at)  # documents' pieces (background)
                handles.append(eng.submit(InfillRequest(key=key, prefix=text[max(0, at - 3000):at], suffix=text[at:at + 800],
                                                        max_tokens=4, background=True)))  # a warm-up
                others = [sources[(i + j) % len(sources)] for j in (1, 2)]
                chunks = tuple(ContextChunk(f"ctx{(i + j) % len(sources)}.py", o[len(o) // 2:len(o) // 2 + 900])
                               for j, o in zip((1, 2), others))
                handles.append(eng.submit(InfillRequest(key=key, prefix=text[max(0, at - 2000):at], suffix=text[at:at + 600],
                                                        chunks=chunks, context="blend", max_tokens=6)))
            for h in handles:
                assert h.result(120).finish_reason != "error"
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
        max_blend_slots = max(s[2] for s in samples)
        store, c = eng.scheduler.blend_store, eng.scheduler.counters
        print(f"\nbudget {BUDGET} B (pool {pool} B = {eng.cache.n_slots} slots, working share "
              f"{eng.scheduler.working_limit} B = {eng.scheduler.rows_alone} rows, retained cap {eng.scheduler.retained.budget_bytes} B); "
              f"{len(ceiling.samples)} engine-thread samples: pool + retained + working max {ceiling.max_total()} B, "
              f"in use max {ceiling.max_used()} B, working max {ceiling.max_working()} B; "
              f"{len(samples)} stats samples: stored KV max {max_used} B, pool + retained allocated max {max_allocated} B, "
              f"workingKvBytes max {max(s[3] for s in samples)} B, blend store max {max_blend_slots} slots (cap {store.max_slots}); "
              f"evicted {stats.evictions} tokens; windows cut {c.kv_cut_windows}; requests {stats.requests}, "
              f"warm {stats.warm_requests}, document tokens {stats.document_tokens}")
        ceiling.check(BUDGET)
        assert len(samples) > 100
        assert max_used <= BUDGET, f"stored KV reached {max_used} B over a budget of {BUDGET} B"
        assert max_allocated <= BUDGET, f"pool + retained KV reached {max_allocated} B over {BUDGET} B"
        assert max_blend_slots <= store.max_slots
        assert stats.evictions > 0  # it evicted instead of growing
        assert stats.completed >= 24 and stats.warm_requests >= 24
        assert stats.document_tokens > 0  # the documents' pieces were stored too
        assert ceiling.max_working() > 0 and max(s[3] for s in samples) > 0  # working KV is reported
    finally:
        eng.close()


@pytest.mark.parametrize("kv_dtype", [None, "int8"])
def test_a_window_larger_than_the_budget_is_cut_and_answered(tiny_model_factory, kv_dtype):
    """One request whose window's KV alone exceeds the whole budget (a 3,800-character
    window used to take 768 KiB of working KV beside 764 KiB stored under 1 MiB; this one
    is twice that): its window is cut to what the working share holds, it is answered, and
    the ceiling holds at every step."""
    text = stdlib_sources(("textwrap.py",))[0]
    budget = BUDGET if kv_dtype is None else BUDGET // 4  # int8 rows are 240 B here, fp32 ones 768 B
    eng = load_engine(str(tiny_model_factory("llama")), dtype="fp32", kv_budget=budget, step_tokens=64,
                      check_integrity=True, kv_dtype=kv_dtype)
    try:
        ceiling = Ceiling(eng)
        at = len(text) // 2
        request = InfillRequest(key="one", prefix=text[at - 6000:at], suffix=text[at:at + 1600], max_tokens=4)
        whole = eng.count_tokens(request.prefix) + eng.count_tokens(request.suffix)
        assert (whole + request.max_tokens) * eng.scheduler.row_bytes > budget  # alone more than the budget
        done = eng.submit(request).result(120)
        again = eng.submit(InfillRequest(key="one", prefix=request.prefix, suffix=request.suffix, max_tokens=4,
                                         cache=False)).result(120)
        eng.wait_idle()
        eng.check_integrity().result(60)
        c = eng.scheduler.counters
        print(f"\n{kv_dtype or 'dense'} KV: window {whole} tokens, working share {eng.scheduler.rows_alone} rows: prompt cut to "
              f"{done.stats.prompt_tokens} tokens; pool + retained + working max {ceiling.max_total()} B "
              f"(working max {ceiling.max_working()} B) of {budget} B over {len(ceiling.samples)} samples")
        assert done.finish_reason in ("length", "stop", "eos") and done.stats.generated_tokens > 0
        assert done.stats.prompt_tokens + request.max_tokens + 1 <= eng.scheduler.rows_alone < whole
        assert again.text == done.text  # the cut depends on the budget only, not on what was cached
        assert c.kv_cut_windows == 2
        ceiling.check(budget)
    finally:
        eng.close()


def _prompt_tokens(eng, **req) -> int:
    return eng.submit(InfillRequest(key="probe", cache=False, **req)).result(60).stats.prompt_tokens


def test_alternatives_under_a_tight_budget_fork_fewer_and_keep_the_greedy_answer(tiny_model_factory):
    text = stdlib_sources(("textwrap.py",))[0]
    path = str(tiny_model_factory("llama"))
    at = text.index("def wrap(")
    req = dict(prefix=text[at - 600:at], suffix=text[at:at + 200], increment="def ", max_tokens=8)
    with load_engine(path, dtype="fp32", kv_budget="32M") as roomy:
        n_prompt = _prompt_tokens(roomy, **req)
        row = roomy.scheduler.row_bytes
        full = roomy.submit(InfillRequest(key="a", n=4, **req)).result(60)
    assert len(full.alternatives) == 3
    # The working share holds the request and one fork of exactly its rows, not a second.
    rows = n_prompt + req["max_tokens"] + 1
    budget = 2 * (2 * rows + rows // 2) * row  # working share = half the budget = 2.5 sequences
    eng = load_engine(path, dtype="fp32", kv_budget=budget, check_integrity=True)
    try:
        ceiling = Ceiling(eng)
        single = eng.submit(InfillRequest(key="s", **req)).result(60)
        tight = eng.submit(InfillRequest(key="t", n=4, **req)).result(60)
        eng.wait_idle()
        eng.check_integrity().result(60)
        c = eng.scheduler.counters
        print(f"\nprompt {n_prompt} tokens, working share {eng.scheduler.rows_alone} rows: "
              f"{len(tight.alternatives)} of 3 alternatives forked, {c.kv_skipped_forks} skipped; "
              f"pool + retained + working max {ceiling.max_total()} B of {budget} B")
        assert c.kv_cut_windows == 0  # the window itself fits
        assert tight.text == single.text == full.text  # the greedy item is intact
        assert tight.stats.prompt_tokens == n_prompt
        assert len(tight.alternatives) == len(tight.alternatives_finish) == 1
        assert c.kv_skipped_forks == 2
        ceiling.check(budget)
    finally:
        eng.close()


def _slow_background(eng, seconds: float) -> None:
    """Background prefill steps take at least `seconds` each (so a test can act while
    warm-ups run)."""
    runner = eng.scheduler.runner
    prefill = runner.prefill_step

    def slow(seq, *a, **kw):
        if seq.background:
            time.sleep(seconds)
        return prefill(seq, *a, **kw)

    runner.prefill_step = slow


def test_warm_ups_give_way_to_a_request_under_pressure(tiny_model_factory):
    """Warm-ups of two documents hold most of the working share when a request of a third
    arrives whose window needs the whole share: the warm-ups are dropped (their computed
    rows stay committed), the request is answered in full, later warm-ups run once it is
    done, and the ceiling holds throughout."""
    sources = stdlib_sources(("textwrap.py", "shlex.py", "difflib.py"))
    eng = load_engine(str(tiny_model_factory("llama")), dtype="fp32", kv_budget=BUDGET, step_tokens=64,
                      background_step_tokens=32, check_integrity=True)
    try:
        ceiling = Ceiling(eng)
        _slow_background(eng, 0.05)
        warm = []
        for i, text in enumerate(sources[:2]):
            at = len(text) // 2
            warm.append(eng.submit(InfillRequest(key=f"w{i}", prefix=text[at - 600:at], suffix=text[at:at + 100],
                                                 max_tokens=4, background=True)))
        deadline = time.monotonic() + 30
        while sum(s.background for s in eng.scheduler._prefilling) < 2 and time.monotonic() < deadline:
            time.sleep(0.005)
        assert sum(s.background for s in eng.scheduler._prefilling) == 2  # both warm-ups hold their KV
        text = sources[2]
        at = len(text) // 2
        fg = eng.submit(InfillRequest(key="fg", prefix=text[at - 3000:at], suffix=text[at:at + 800], max_tokens=4))
        done = fg.result(60)
        ends = [h.result(60).finish_reason for h in warm]
        later = eng.submit(InfillRequest(key="w0", prefix=sources[0][100:900], suffix="", max_tokens=2,
                                         background=True)).result(60)
        eng.wait_idle()
        eng.check_integrity().result(60)
        stats = eng.stats()
        print(f"\nwarm-ups ended {ends}, the request {done.finish_reason} ({done.stats.prompt_tokens} prompt tokens), "
              f"a later warm-up {later.finish_reason}; pool + retained + working max {ceiling.max_total()} B of {BUDGET} B, "
              f"most sequences running at once {max(s[4] for s in ceiling.samples)}")
        assert done.finish_reason != "error" and done.finish_reason != "cancelled" and done.stats.generated_tokens > 0
        assert done.stats.prompt_tokens + 5 > eng.scheduler.rows_alone - 64  # the request got (almost) the whole share
        assert "cancelled" in ends and all(e in ("cancelled", "length") for e in ends)
        assert later.finish_reason == "length"  # warm-ups run again once the request is done
        assert stats.warm_cancelled >= 1
        ceiling.check(BUDGET)
    finally:
        eng.close()


@pytest.mark.parametrize("kv_dtype", [None, "int8"])
def test_a_request_waits_for_running_ones_instead_of_growing(tiny_model_factory, kv_dtype):
    """Three requests of different documents, each needing more than half the working
    share, arrive together: they run one after another (never two at once), all are
    answered, none is cut, the ceiling holds."""
    sources = stdlib_sources(("textwrap.py", "shlex.py", "difflib.py"))
    budget = BUDGET if kv_dtype is None else BUDGET // 4  # int8 rows are 240 B here, fp32 ones 768 B
    eng = load_engine(str(tiny_model_factory("llama")), dtype="fp32", kv_budget=budget, step_tokens=64,
                      check_integrity=True, kv_dtype=kv_dtype)
    try:
        ceiling = Ceiling(eng)
        rows = eng.scheduler.rows_alone
        reqs = []
        for i, text in enumerate(sources):
            at, chars = len(text) // 2, 400
            while eng.count_tokens(text[at - chars:at]) <= rows // 2:  # not two at once
                chars += 50
                assert chars < at
            prefix = text[at - chars:at]
            assert eng.count_tokens(prefix) + 4 + 16 < rows  # but one alone
            reqs.append(InfillRequest(key=f"d{i}", prefix=prefix, suffix="", max_tokens=4))
        handles = [eng.submit(r) for r in reqs]
        done = [h.result(120) for h in handles]
        eng.wait_idle()
        eng.check_integrity().result(60)
        most_fg = max(s[5] for s in ceiling.samples)
        print(f"\n{kv_dtype or 'dense'} KV: {[d.stats.prompt_tokens for d in done]} prompt tokens in a share of {rows} rows: "
              f"at most {most_fg} request(s) held KV at once; pool + retained + working max {ceiling.max_total()} B "
              f"of {budget} B; queue ms {[round(d.stats.queue_ms, 1) for d in done]}")
        assert all(d.finish_reason != "error" and d.stats.generated_tokens > 0 for d in done)
        assert all(2 * (d.stats.prompt_tokens + 5) > rows for d in done)
        assert eng.scheduler.counters.kv_cut_windows == 0
        assert most_fg == 1
        ceiling.check(budget)
    finally:
        eng.close()


@pytest.mark.parametrize("share", [0.0, 1.0])
def test_working_share_must_leave_room_for_both(tiny_model_factory, share):
    with pytest.raises(ValueError, match="working_share"):
        load_engine(str(tiny_model_factory("llama")), dtype="fp32", kv_budget=BUDGET, working_share=share)


def test_a_documents_previous_kv_that_does_not_fit_beside_the_new_one_is_dropped(tiny_model_factory):
    """The document's retained KV is too small to reuse for its next, larger window, and
    the two together exceed the working share: the old one is dropped (its prompt rows are
    in the radix cache) and the request runs, instead of waiting for room nothing frees."""
    text = stdlib_sources(("difflib.py",))[0]
    eng = load_engine(str(tiny_model_factory("llama")), dtype="fp32", kv_budget=BUDGET, step_tokens=64,
                      check_integrity=True)
    try:
        ceiling = Ceiling(eng)
        rows, at = eng.scheduler.rows_alone, len(text) // 2
        small, large = 200, 200
        while eng.count_tokens(text[at - small:at]) < 180:
            small += 20
        while eng.count_tokens(text[at - large:at]) < rows - 100:
            large += 20
        first = eng.submit(InfillRequest(key="d", prefix=text[at - small:at], suffix="", max_tokens=4)).result(60)
        eng.wait_idle()
        prev = eng.scheduler.retained.peek("d")
        assert prev is not None and prev.kv.capacity == 256  # kept, too small for the next window
        second = eng.submit(InfillRequest(key="d", prefix=text[at - large:at], suffix="", max_tokens=4)).result(60)
        eng.wait_idle()
        eng.check_integrity().result(60)
        assert first.finish_reason != "error" and second.finish_reason != "error", second.error
        assert (prev.kv.capacity + second.stats.prompt_tokens + 5) * eng.scheduler.row_bytes > eng.scheduler.working_limit
        assert second.stats.generated_tokens > 0 and eng.scheduler.counters.kv_cut_windows == 0
        ceiling.check(BUDGET)
    finally:
        eng.close()


@pytest.mark.parametrize("kv_dtype", [None, "int8"])
def test_a_pool_that_grows_keeps_every_row_at_its_slot_and_frees_the_new_ones(kv_dtype):
    import torch  # noqa: PLC0415

    from engine.kv.pool import SlotPool  # noqa: PLC0415

    pool = SlotPool(n_layers=2, n_kv_heads=2, head_dim=8, dtype=torch.float32, budget_bytes=40 * 256, kv_dtype=kv_dtype)
    before = pool.n_slots
    held = pool.alloc(before - 3)
    k, v = torch.randn(2, held.numel(), 2, 8), torch.randn(2, held.numel(), 2, 8)
    pool.write_slots(held, k, v)
    tree, still_held = held[: held.numel() // 2], held[held.numel() // 2:]
    pool.adopt(tree)
    rows = pool.read_slots(held)
    assert pool.grow(pool.bytes_per_slot * before) == 0 and pool.n_slots == before  # not larger: nothing
    added = pool.grow(pool.bytes_per_slot * (3 * before))
    assert added == 2 * before and pool.n_slots == 3 * before
    assert pool.n_free == 3 + added and pool.n_held == still_held.numel() and pool.n_tree == tree.numel()
    for got, want in zip(pool.read_slots(held), rows):
        assert torch.equal(got, want)  # every row where it was, bit for bit
    pool.check_integrity(tree)
    fresh = pool.alloc(pool.n_free)
    assert fresh.numel() == 3 + added and not set(fresh.tolist()) & set(held.tolist())
    assert int(fresh.max()) == 3 * before - 1
    pool.free(fresh)
    pool.free(still_held)
    pool.check_integrity(tree)


def _window_answered(eng, text: str):
    """A window in the middle of `text`, answered: (its request, its completion)."""
    at = len(text) // 2
    request = InfillRequest(key="a", prefix=text[max(0, at - 1500):at], suffix=text[at:at + 400], max_tokens=4)
    return request, eng.submit(request).result(60)


def _under_load(eng, sources) -> "Ceiling":
    """Twelve windows far larger than the budget's room, after a budget change: none fails,
    the stores check out; the ceiling watched meanwhile is returned."""
    ceiling = Ceiling(eng)
    handles = [eng.submit(InfillRequest(key=f"d{i}", prefix=t[len(t) // 3 - 2500:len(t) // 3], suffix=t[len(t) // 3:][:500],
                                        max_tokens=6)) for i, t in enumerate(sources * 2)]
    for h in handles:
        assert h.result(120).finish_reason != "error"
    eng.wait_idle(60)
    eng.check_integrity().result(30)
    return ceiling


@pytest.mark.parametrize("kv_dtype", [None, "int8"])
def test_a_raised_budget_grows_the_pool_while_serving_keeps_the_cache_and_is_the_new_ceiling(tiny_model_factory, kv_dtype):
    sources = stdlib_sources(("textwrap.py", "shlex.py", "bisect.py", "difflib.py"))
    eng = load_engine(str(tiny_model_factory("llama")), dtype="fp32", kv_budget=BUDGET, kv_dtype=kv_dtype, idle_grace=0.0,
                      step_tokens=64)
    try:
        request, first = _window_answered(eng, sources[0])
        slots, pool_before = eng.cache.n_slots, pool_bytes(eng.cache)
        # Raised while a long request of another document runs: it takes effect between steps.
        busy = eng.submit(InfillRequest(key="b", prefix=sources[1][:400], max_tokens=40, temperature=1.0, seed=3))
        assert eng.grow_kv_budget(2 * BUDGET) == 2 * BUDGET
        assert busy.result(60).finish_reason != "error"
        assert eng.kv_budget_bytes == eng.stats().cache_bytes_total == 2 * BUDGET
        assert eng.cache.n_slots > slots and pool_bytes(eng.cache) > pool_before
        assert eng.scheduler.working_limit == BUDGET  # the working share grew with it (half)
        assert eng.grow_kv_budget(BUDGET) == 2 * BUDGET  # never lowered
        assert eng.stats().evictions == 0  # (so what the next request reuses was not evicted either way)
        again = eng.submit(request).result(60)
        assert again.text == first.text and again.stats.prefilled_tokens <= 2  # the cached rows survived the move
        eng.check_integrity().result(30)
        ceiling = _under_load(eng, sources)
        ceiling.check(2 * BUDGET)  # the new ceiling holds ...
        assert ceiling.max_used() > BUDGET - pool_before  # ... and its room is used (more than the old pool's rows)
    finally:
        eng.close()


@pytest.mark.parametrize("kv_dtype", [None, "int8"])
def test_a_pool_that_shrinks_moves_the_rows_above_its_size_and_says_where(kv_dtype):
    import torch  # noqa: PLC0415

    from engine.kv.pool import SlotPool  # noqa: PLC0415

    pool = SlotPool(n_layers=2, n_kv_heads=2, head_dim=8, dtype=torch.float32, budget_bytes=60 * 256, kv_dtype=kv_dtype)
    before = pool.n_slots
    held = pool.alloc(before // 4)  # the free list hands out the highest slots first: all above before // 2
    assert int(held.min()) >= before // 2
    k, v = torch.randn(2, held.numel(), 2, 8), torch.randn(2, held.numel(), 2, 8)
    pool.write_slots(held, k, v)
    tree, still_held = held[: held.numel() // 2], held[held.numel() // 2:]
    pool.adopt(tree)
    rows = pool.read_slots(held)
    assert pool.shrink(pool.bytes_per_slot * before) is None  # not smaller
    assert pool.shrink(pool.bytes_per_slot * (held.numel() - 1)) is None  # the rows in use do not fit
    assert pool.n_slots == before
    remap = pool.shrink(pool.bytes_per_slot * (before // 2))
    assert remap is not None and pool.n_slots == before // 2
    moved = remap[held]
    assert int(moved.max()) < before // 2 and moved.unique().numel() == held.numel()
    for got, want in zip(pool.read_slots(moved), rows):
        assert torch.equal(got, want)  # every row at its new number, bit for bit
    assert pool.n_held == still_held.numel() and pool.n_tree == tree.numel()
    assert pool.n_free == before // 2 - held.numel()
    pool.check_integrity(remap[tree])
    pool.free(remap[still_held])
    fresh = pool.alloc(pool.n_free)
    assert not set(fresh.tolist()) & set(remap[tree].tolist()) and int(fresh.max()) < before // 2
    pool.free(fresh)
    pool.check_integrity(remap[tree])


@pytest.mark.parametrize("kv_dtype", [None, "int8"])
def test_a_lowered_budget_keeps_what_fits_gives_memory_back_and_is_the_new_ceiling(tiny_model_factory, kv_dtype):
    """The engine daemon lowers its budget when the front that asked for the most leaves:
    at the next idle moment the cached rows that fit stay (the most recent prompt is reused,
    the chunks' rows are where their renumbered slots say), the pool takes the smaller size,
    and nothing later goes past it."""
    import torch  # noqa: PLC0415

    sources = stdlib_sources(("textwrap.py", "shlex.py", "bisect.py", "difflib.py"))
    eng = load_engine(str(tiny_model_factory("llama")), dtype="fp32", kv_budget=8 * BUDGET, kv_dtype=kv_dtype, idle_grace=0.0,
                      step_tokens=64)
    try:
        request, first = _window_answered(eng, sources[0])
        chunks = tuple(ContextChunk(f"ctx{i}.py", s[len(s) // 2:len(s) // 2 + 600]) for i, s in enumerate(sources[1:]))
        for chunk in chunks:  # each chunk's KV computed alone, as the server's chunk prefetch does
            eng.submit(InfillRequest(key="ahead", prefix="", chunks=(chunk,), context="blend", max_tokens=1, background=True)).result(60)
        blended = InfillRequest(key="c", prefix=sources[2][:300], chunks=chunks, context="blend", max_tokens=4)
        blend_first = eng.submit(blended).result(60)
        eng.wait_idle(60)
        store = eng.scheduler.blend_store
        assert store.nbytes() > 0
        rows_before = {key: store.load(entry) for key, entry in store._entries.items()}  # noqa: SLF001
        slots, pool_before = eng.cache.n_slots, pool_bytes(eng.cache)
        assert eng.lower_kv_budget(16 * BUDGET) == 8 * BUDGET  # never raised
        assert eng.lower_kv_budget(2 * BUDGET) == 2 * BUDGET
        assert eng.kv_budget_bytes == eng.stats().cache_bytes_total == 2 * BUDGET
        assert eng.cache.n_slots < slots and pool_bytes(eng.cache) < pool_before
        assert eng.scheduler.working_limit == BUDGET  # the working share shrank with it (half)
        eng.check_integrity().result(30)
        kept = {key: store.load(entry) for key, entry in store._entries.items()}  # noqa: SLF001
        assert kept and set(kept) <= set(rows_before)
        for key, span in kept.items():  # each chunk's rows found at its slots' new numbers, bit for bit
            assert torch.equal(span.k, rows_before[key].k) and torch.equal(span.v, rows_before[key].v)
        again = eng.submit(blended).result(60)  # the most recent prompt's rows fit and survived the move
        assert again.text == blend_first.text and again.stats.prefilled_tokens <= 3
        assert eng.submit(request).result(60).text == first.text
        ceiling = _under_load(eng, sources)
        ceiling.check(2 * BUDGET)  # the lower ceiling holds
    finally:
        eng.close()


def test_a_budget_change_that_times_out_is_dropped_not_done_later_behind_the_callers_back(tiny_model_factory):
    sources = stdlib_sources(("textwrap.py", "shlex.py"))
    eng = load_engine(str(tiny_model_factory("llama")), dtype="fp32", kv_budget=4 * BUDGET, idle_grace=0.0, step_tokens=16)
    try:
        slots = eng.cache.n_slots
        busy = eng.submit(InfillRequest(key="b", prefix=sources[1][:3000], max_tokens=200, temperature=1.0, seed=3))
        # Not idle within 1 ms: the lowering is dropped and the budget stays as it was.
        assert eng.lower_kv_budget(2 * BUDGET, timeout=0.001) == 4 * BUDGET
        assert busy.result(60).finish_reason != "error"
        eng.wait_idle(60)
        time.sleep(0.2)  # an idle moment came: the dropped lowering must not run now
        assert eng.kv_budget_bytes == eng.stats().cache_bytes_total == 4 * BUDGET and eng.cache.n_slots == slots
        eng.check_integrity().result(30)
    finally:
        eng.close()
