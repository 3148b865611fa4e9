"""Blend store: span rows live in held slots of the radix cache's pool, under its budget."""

from __future__ import annotations

import pytest
import torch

from engine.kv.blend_store import BlendStore, SpanKV, prefill_span, span_key
from engine.kv.radix import RadixCache

L, H, D = 2, 2, 4


def _cache(slots: int) -> RadixCache:
    per_slot = 2 * L * H * D * 4
    return RadixCache(n_layers=L, n_kv_heads=H, head_dim=D, dtype=torch.float32, budget_bytes=slots * per_slot)


def _kv(n: int, seed: int) -> SpanKV:
    g = torch.Generator().manual_seed(seed)
    return SpanKV(torch.randn(L, n, H, D, generator=g), torch.randn(L, n, H, D, generator=g), torch.arange(1, n + 1))


def _check(cache, store):
    cache.check_integrity()
    store.check_integrity()


def test_add_lookup_load_roundtrip():
    cache = _cache(64)
    store = BlendStore(cache, blend_store_share=0.5)
    kv = _kv(5, 0)
    entry = store.insert([1, 2, 3, 4, 5], kv, origin="a.py")
    assert entry is not None and [1, 2, 3, 4, 5] in store
    assert store.match([1, 2, 3, 4, 5]) is entry
    assert store.match([1, 2, 3, 4]) is None
    got = store.load(entry)
    assert torch.equal(got.k, kv.k) and torch.equal(got.v, kv.v) and torch.equal(got.positions, kv.positions)
    assert cache.n_free == 64 - 5  # the same pool, the same budget
    s = store.stats()
    assert (s.entries, s.tokens, s.hits, s.misses) == (1, 5, 1, 1)
    assert s.bytes_used == 5 * cache.bytes_per_slot
    _check(cache, store)


def test_lru_eviction_within_its_share_and_forget_origin():
    cache = _cache(40)
    store = BlendStore(cache, blend_store_share=0.5)  # 20 slots
    for i in range(3):
        assert store.insert([10 * i + j for j in range(6)], _kv(6, i), origin=f"f{i}.py") is not None
    store.match([0, 1, 2, 3, 4, 5])  # span 0 becomes most recently used
    assert store.insert(list(range(100, 106)), _kv(6, 9), origin="f1.py") is not None  # 24 > 20: evicts span 1
    assert [10, 11, 12, 13, 14, 15] not in store and [0, 1, 2, 3, 4, 5] in store
    assert store.stats().evictions == 1
    _check(cache, store)
    assert store.forget_origin("f1.py") == 1
    assert list(range(100, 106)) not in store
    assert store.insert(list(range(50)), _kv(50, 1)) is None  # larger than its share: refused, nothing lost
    _check(cache, store)
    store.clear()
    assert cache.n_free == 40
    _check(cache, store)


def test_blend_store_and_radix_tree_share_the_pool():
    cache = _cache(32)
    store = BlendStore(cache, blend_store_share=0.5)
    # The radix tree fills the pool; adding a span evicts unpinned tree leaves.
    kv = type("KV", (), {})()
    kv.k = torch.randn(L, H, 30, D)
    kv.v = torch.randn(L, H, 30, D)
    res = cache.commit(list(range(30)), kv, 30, key="doc")
    assert res.n_stored == 30
    assert store.insert([7] * 8, _kv(8, 3)) is not None
    assert cache.match(list(range(30))).n_tokens < 30
    _check(cache, store)
    # A full pool that eviction cannot free: the store gives back its own entries first...
    filler = cache.alloc(cache.n_free)
    assert store.insert([8] * 8, _kv(8, 4)) is not None
    assert [7] * 8 not in store and store.stats().evictions == 1
    _check(cache, store)
    # ...and with nothing of its own left to give, it stores nothing and says so.
    store.clear()
    more = cache.alloc(cache.n_free)
    assert store.insert([9] * 4, _kv(4, 5)) is None
    assert len(store) == 0
    cache.free(filler)
    cache.free(more)
    _check(cache, store)
    assert cache.n_free == cache.n_slots


def test_keys_are_content_hashes_checked_on_hit():
    assert span_key([1, 2, 3]) == span_key((1, 2, 3))
    assert span_key([1, 2, 3]) != span_key([3, 2, 1])
    cache = _cache(16)
    store = BlendStore(cache, blend_store_share=1.0)
    entry = store.insert([1, 2, 3], _kv(3, 0))
    # Forge a collision: the same key with other ids is a miss, never a wrong hit.
    store._entries[entry.key] = entry._replace(ids=(9, 9, 9))
    assert store.match([1, 2, 3]) is None
    with pytest.raises(ValueError, match="rows"):
        store.insert([1, 2], _kv(3, 0))


def test_prefill_span_drops_the_header_rows(tiny_model_factory):
    from engine.model.loader import load_model

    model = load_model(tiny_model_factory("llama"), dtype="fp32").model
    ids = [5, 17, 300, 42]
    c = prefill_span(model, ids, header=[0])
    kv = model.new_kv(5)
    model.forward(torch.tensor([0, *ids]), kv, 0, "none")
    assert torch.equal(c.positions, torch.tensor([1, 2, 3, 4]))
    torch.testing.assert_close(c.k, kv.k[:, :, 1:5].transpose(1, 2))
    torch.testing.assert_close(c.v, kv.v[:, :, 1:5].transpose(1, 2))
    with pytest.raises(ValueError, match="empty"):
        prefill_span(model, [], header=[0])


def test_prefill_span_gives_way_between_layers_when_asked(tiny_model_factory):
    """`stop` (a background span and a request arriving): polled between layers; true at once
    -> abandoned (None) after one layer; never true -> the same rows as without it."""
    from engine.model.loader import load_model

    model = load_model(tiny_model_factory("llama"), dtype="fp32").model
    ids = [5, 17, 300, 42, 7, 9]
    plain = prefill_span(model, ids, header=[0])
    polled: list[int] = []
    kept = prefill_span(model, ids, header=[0], stop=lambda: polled.append(1) is not None)
    assert kept is not None and len(polled) == model.config.n_layers - 1  # between every two layers
    torch.testing.assert_close(kept.k, plain.k)
    torch.testing.assert_close(kept.v, plain.v)
    assert prefill_span(model, ids, header=[0], stop=lambda: True) is None
