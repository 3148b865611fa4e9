"""RadixCache: matching, insertion, splitting, pins, eviction, gather/commit, integrity."""

from __future__ import annotations

import random
from typing import NamedTuple

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.kv.budget import default_budget_bytes, parse_bytes
from engine.kv.radix import RadixCache, common_prefix_len

L, H, D = 2, 2, 4


class KV(NamedTuple):  # same fields as engine.model.transformer.SequenceKV
    k: torch.Tensor  # [L, H_kv, cap, D]
    v: torch.Tensor


def make_cache(slots: int, **kw) -> RadixCache:
    per = 2 * L * H * D * 4
    return RadixCache(n_layers=L, n_kv_heads=H, head_dim=D, dtype=torch.float32, budget_bytes=slots * per, **kw)


def workspace_for(ids: list[int], cap: int | None = None) -> KV:
    """A workspace whose row for token position p holds a value derived from (ids[:p+1])
    so rows of equal prefixes are equal, like real KV."""
    cap = cap or len(ids) + 8
    k = torch.zeros(L, H, cap, D)
    h = 0
    for p, t in enumerate(ids):
        h = (h * 31 + t + 7) % 100003
        k[:, :, p] = float(h)
    return KV(k, -k.clone())


def store(cache: RadixCache, ids: list[int], key: str | None = None):
    return cache.commit(ids, workspace_for(ids), len(ids), key)


def test_parse_bytes_and_default_budget():
    assert parse_bytes("512M") == 512 << 20
    assert parse_bytes("2G") == 2 << 30
    assert parse_bytes("1.5GiB") == int(1.5 * (1 << 30))
    assert parse_bytes("1000") == 1000
    with pytest.raises(ValueError, match="512M"):
        parse_bytes("lots")
    assert 0 < default_budget_bytes() <= 4 << 30


def test_common_prefix_len():
    rng = random.Random(0)
    for _ in range(200):
        a = [rng.randrange(3) for _ in range(rng.randrange(60))]
        b = a[: rng.randrange(len(a) + 1)] + [rng.randrange(3) for _ in range(rng.randrange(60))]
        want = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        assert common_prefix_len(a, b) == want


def test_match_insert_split_and_gather_roundtrip():
    cache = make_cache(100)
    a = [1, 2, 3, 4, 5, 6]
    b = [1, 2, 3, 9, 9]
    assert store(cache, a).n_stored == 6
    assert cache.match(b).n_tokens == 3
    r = store(cache, b)
    assert r.n_stored == 2 and r.n_cached == 5  # only the divergent tail is new
    cache.check_integrity()
    for ids in (a, b):
        m = cache.match(ids + [42])
        assert m.n_tokens == len(ids)
        ws = KV(torch.zeros(L, H, 16, D), torch.zeros(L, H, 16, D))
        cache.gather(m.slots, ws, 0)
        want = workspace_for(ids)
        assert torch.equal(ws.k[:, :, : len(ids)], want.k[:, :, : len(ids)])
        assert torch.equal(ws.v[:, :, : len(ids)], want.v[:, :, : len(ids)])
    assert cache.stats().slots_used == 8


def test_a_long_gather_copies_the_same_rows_as_a_short_one():
    """Gathers of many rows copy per (layer, head) straight into the workspace, short ones
    through one index_select: both land the pool's rows at the workspace's rows, each head's
    its own, the rest of the workspace untouched."""
    cache = make_cache(1200)
    ids = [(i * 7919) % 50_000 + 1 for i in range(700)]
    store(cache, ids)
    m = cache.match(ids + [42])
    want = workspace_for(ids)
    want.k[:, 1] += 0.5  # heads differ, so a head copied into another's place shows
    want.v[:, 0] -= 0.25
    cache.pool.store_rows(m.slots, want, 0, len(ids))
    for n, start in ((700, 0), (300, 5), (20, 3)):
        ws = KV(torch.full((L, H, 720, D), -1.0), torch.full((L, H, 720, D), -1.0))
        cache.gather(m.slots[:n], ws, start)
        assert torch.equal(ws.k[:, :, start : start + n], want.k[:, :, :n])
        assert torch.equal(ws.v[:, :, start : start + n], want.v[:, :, :n])
        assert (ws.k[:, :, :start] == -1).all() and (ws.k[:, :, start + n :] == -1).all()


def test_match_does_not_split_or_change_tree():
    cache = make_cache(50)
    store(cache, [1, 2, 3, 4])
    before = [(n.ids[:], n.slots.tolist()) for n in cache.nodes()]
    m = cache.match([1, 2, 7])
    assert m.n_tokens == 2
    assert [(n.ids[:], n.slots.tolist()) for n in cache.nodes()] == before


def test_keystroke_chain_stays_short_by_path_compression():
    """Appending 1-2 tokens per keystroke must not grow the path one node per keystroke."""
    cache = make_cache(1000)
    ids = list(range(100, 200))
    store(cache, ids, key="doc")
    for step in range(50):
        ids = ids + [step % 7, 300 + step]
        node = store(cache, ids, key="doc").node
        cache.pin(node)  # the running request pins its path, then lets go of it
        cache.unpin(node)
    assert len(cache.nodes()) <= 2
    assert cache.match(ids).n_tokens == len(ids)
    cache.check_integrity()


def test_eviction_lru_and_latest_per_document_kept():
    cache = make_cache(20, min_evict=1)
    store(cache, [1] * 6, key="a")  # a's latest
    store(cache, [2] * 6, key="b")
    store(cache, [3] * 6)  # not anyone's latest: evicted first although newest
    r = store(cache, [4] * 6, key="c")
    assert r.n_stored == 6
    # token-granular: only the 4 missing slots were taken, from the tail of the unkept leaf
    assert cache.match([3] * 6).n_tokens == 2
    assert cache.match([1] * 6).n_tokens == 6 and cache.match([2] * 6).n_tokens == 6
    # under more pressure, the least recently used document goes (trimmed at its tail first)
    cache.match([4] * 6)  # touch c, then a: b is now the least recently used
    cache.match([1] * 6)
    store(cache, [5] * 6, key="d")
    assert cache.match([3] * 6).n_tokens == 0
    assert cache.match([2] * 6).n_tokens == 2
    assert cache.match([1] * 6).n_tokens == 6
    assert cache.evictions >= 2 and cache.stats().evicted_tokens >= 10
    cache.check_integrity()


def test_pinned_path_is_never_evicted_and_full_pool_fails_softly():
    cache = make_cache(10, min_evict=1)
    node = store(cache, list(range(8))).node
    cache.pin(node)
    r = store(cache, [50, 51, 52, 53])  # needs 4, only 2 free, the rest pinned
    assert r.node is None and r.n_stored == 0
    assert cache.match(list(range(8))).n_tokens == 8
    cache.check_integrity()
    cache.unpin(node)
    assert store(cache, [50, 51, 52, 53]).n_stored == 4
    with pytest.raises(RuntimeError):
        cache.unpin(cache.root)
    cache.check_integrity()


def test_evict_zero_is_safe_and_clear():
    cache = make_cache(30)
    store(cache, [1, 2, 3], key="x")
    assert cache.evict(0) == 0
    assert cache.match([1, 2, 3]).n_tokens == 3
    assert cache.clear() == 3
    assert cache.stats().slots_used == 0
    cache.check_integrity()


def test_insert_frees_duplicate_held_slots():
    cache = make_cache(30)
    store(cache, [1, 2, 3])
    held = cache.alloc(4)
    res = cache.insert([1, 2, 3, 4], held)
    assert res.n_existing == 3
    assert cache.stats().slots_used == 4  # 3 duplicates went back to the free list
    cache.check_integrity()


def test_budget_too_small_is_a_clear_error():
    with pytest.raises(ValueError, match="holds no token"):
        RadixCache(n_layers=L, n_kv_heads=H, head_dim=D, dtype=torch.float32, budget_bytes=10)


ops = st.lists(
    st.tuples(st.sampled_from(["store", "pin", "unpin", "evict", "match"]),
              st.lists(st.integers(0, 3), min_size=1, max_size=12), st.integers(0, 3)),
    min_size=1, max_size=40,
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops)
def test_random_operations_keep_integrity(seq):
    cache = make_cache(24, min_evict=1)
    pinned = []
    for op, ids, k in seq:
        if op == "store":
            r = store(cache, ids, key=f"doc{k}")
            if r.node is not None:
                m = cache.match(ids)
                assert m.n_tokens == len(ids)
                ws = KV(torch.zeros(L, H, len(ids), D), torch.zeros(L, H, len(ids), D))
                cache.gather(m.slots, ws)
                assert torch.equal(ws.k, workspace_for(ids).k[:, :, : len(ids)])
        elif op == "pin":
            m = cache.match(ids)
            if k % 2:
                pinned.append(cache.pin_match(m))
            else:
                cache.pin(m.node)
                pinned.append(m.node)
        elif op == "unpin" and pinned:
            cache.unpin(pinned.pop(k % len(pinned)))
        elif op == "evict":
            cache.evict(k * 3)
        else:
            cache.match(ids)
        cache.check_integrity()
    for node in pinned:
        cache.unpin(node)
    cache.clear()
    cache.check_integrity()
    assert cache.stats().slots_used == 0


def test_pin_match_protects_only_the_matched_part():
    """Regression: pinning a match that ended one token into another document's node
    pinned that whole node, so a new document could evict nothing and was not cached."""
    cache = make_cache(20, min_evict=1)
    store(cache, [0] + [1] * 14, key="a")  # shares only its first token with the next
    m = cache.match([0] + [2] * 10)
    assert m.n_tokens == 1 and m.in_node == 1
    node = cache.pin_match(m)
    assert store(cache, [0] + [2] * 10, key="b").n_stored == 10  # a's unmatched tail was evictable
    cache.unpin(node)
    assert cache.match([0] + [2] * 10).n_tokens == 11
    cache.check_integrity()
