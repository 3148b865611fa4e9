"""The one KV-store contract (engine.kv.store.KVStore): the radix cache, the blend store, the
retained KV and the disk store each match what they inserted, free what they evict, count
their bytes, and have an integrity check that passes and catches a corrupted state."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable, NamedTuple

import pytest
import torch

from engine.kv.blend_store import BlendStore, SpanKV
from engine.kv.disk_format import DocumentRows, KVDiskStore
from engine.kv.pool import SlotPool
from engine.kv.radix import RadixCache
from engine.kv.retained import RetainedKV, RetainedSequence
from engine.kv.store import KVStore
from engine.model.sequence_kv import SequenceKV

L, H, D = 2, 2, 4
PER_SLOT = 2 * L * H * D * 4  # fp32 bytes of one token's K and V rows


def _cache(slots: int = 32) -> RadixCache:
    return RadixCache(n_layers=L, n_kv_heads=H, head_dim=D, dtype=torch.float32, budget_bytes=slots * PER_SLOT)


def _rows(n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(L, H, n, D, generator=g), torch.randn(L, H, n, D, generator=g)  # [L, H_kv, n, D]


class Case(NamedTuple):
    store: Any  # a KVStore
    key: Any
    value: Callable[[], Any]  # a fresh value to insert under `key`
    hit: Callable[[Any], bool]  # `match(key)` found what was inserted
    miss: Callable[[Any], bool]  # `match(key)` found nothing
    unit: int  # `evict(unit)` frees the inserted value
    corrupt: Callable[[], None]  # break an invariant behind the store's back (value inserted)


def radix_case(_tmp: Path) -> Case:
    cache = _cache()
    ids = list(range(1, 11))
    return Case(
        cache, ids, lambda: cache.alloc(len(ids)),
        hit=lambda m: m.n_tokens == len(ids), miss=lambda m: m.n_tokens == 0, unit=len(ids),
        corrupt=lambda: cache.pool.release(cache.match(ids).slots[:3]),  # freed, still in the tree
    )


def blend_case(_tmp: Path) -> Case:
    store = BlendStore(_cache(), blend_store_share=0.5)
    ids = (5, 6, 7, 8, 9)

    def value() -> SpanKV:
        k, v = _rows(len(ids))
        return SpanKV(k.transpose(1, 2), v.transpose(1, 2), torch.arange(1, len(ids) + 1))  # [L, n, H_kv, D]

    def corrupt() -> None:
        store.pool.free(store.match(ids).slots)  # freed in the pool while the store lists them

    return Case(
        store, ids, value, hit=lambda e: e is not None and e.ids == ids, miss=lambda e: e is None,
        unit=len(ids), corrupt=corrupt,
    )


def retained_case(_tmp: Path) -> Case:
    store = RetainedKV(max_entries=4)

    def value() -> RetainedSequence:
        return RetainedSequence(SequenceKV(*_rows(8)), list(range(6)))

    def corrupt() -> None:  # more ids than the KV has rows
        store.insert("file:///other.py", RetainedSequence(SequenceKV(*_rows(4)), list(range(9))))

    return Case(
        store, "file:///a.py", value, hit=lambda s: s is not None and s.ids == list(range(6)),
        miss=lambda s: s is None, unit=1, corrupt=corrupt,
    )


def disk_case(tmp: Path) -> Case:
    store = KVDiskStore(tmp / "kv", "f" * 64, 1 << 20, (L, H, D), torch.float32)
    ids = list(range(3, 15))

    def corrupt() -> None:  # a truncated file
        (path,) = store.files_of("file:///a.py")
        os.truncate(path, path.stat().st_size - 8)

    return Case(
        store, "file:///a.py", lambda: DocumentRows(ids, *_rows(len(ids))),
        hit=lambda s: s is not None and s.ids == ids, miss=lambda s: s is None, unit=1, corrupt=corrupt,
    )


@pytest.mark.parametrize("make", [radix_case, blend_case, retained_case, disk_case], ids=lambda f: f.__name__)
def test_every_store_keeps_the_contract(make, tmp_path):
    case = make(tmp_path)
    store: KVStore = case.store
    assert isinstance(store, KVStore)
    store.check_integrity()
    empty = store.nbytes()
    assert case.miss(store.match(case.key))

    store.insert(case.key, case.value())
    assert case.hit(store.match(case.key))
    assert store.nbytes() > empty
    store.check_integrity()

    assert store.evict(0) == 0 and case.hit(store.match(case.key))  # evicting 0 is always safe
    freed = store.evict(case.unit)
    assert freed >= case.unit
    assert store.nbytes() == empty
    assert case.miss(store.match(case.key))
    store.check_integrity()

    store.insert(case.key, case.value())
    store.check_integrity()
    case.corrupt()
    with pytest.raises(AssertionError):
        store.check_integrity()


def test_stores_count_what_they_hold():
    cache = _cache(32)
    spans = BlendStore(cache, blend_store_share=0.5)
    cache.insert(list(range(1, 8)), cache.alloc(7))
    k, v = _rows(4, 1)
    spans.insert((40, 41, 42, 43), SpanKV(k.transpose(1, 2), v.transpose(1, 2), torch.arange(4)))
    assert cache.nbytes() == 7 * PER_SLOT and spans.nbytes() == 4 * PER_SLOT  # tree and held slots apart
    assert cache.usage() == (11 * PER_SLOT, 21 * PER_SLOT)  # one pool, one budget
    retained = RetainedKV()
    seq = RetainedSequence(SequenceKV(*_rows(8)), [1, 2, 3])
    retained.insert("a", seq)
    assert retained.nbytes() == seq.kv.nbytes() == 2 * L * H * 8 * D * 4


def test_retained_evicts_least_recently_kept_first_and_spares():
    store = RetainedKV(max_entries=4)
    for i, key in enumerate("abc"):
        store.insert(key, RetainedSequence(SequenceKV(*_rows(4)), [i + 1]))  # three texts: nothing shared
    one = store.nbytes() // 3
    assert store.evict(one + 1, spare="a") == 2 * one  # b and c go; a is spared
    assert list(k for k, _ in store.entries()) == ["a"]
    assert store.match("a") is store.peek("a") is not None


def test_retained_makes_room_from_the_asking_owners_own_entries_first():
    """One window's burst of jumps replaces its own retained KV before the KV of the window
    someone is typing in: at the count limit and when the scheduler makes room for an owner's
    work. Without owners (one window) it is least recently kept first, as before."""
    store = RetainedKV(max_entries=3)
    store.insert("A/doc", RetainedSequence(SequenceKV(*_rows(4)), [1], "A"))  # the typing window
    for i in range(5):  # the other window's jumps, each under two keys of its own
        store.insert("B/doc", RetainedSequence(SequenceKV(*_rows(4)), [10 + i], "B"))
        store.insert(f"B/small{i % 2}", RetainedSequence(SequenceKV(*_rows(4)), [20 + i], "B"))
    assert "A/doc" in store and len(store) == 3
    assert store.evict_oldest(spare="B/doc", owner="B") and "A/doc" in store  # B's older small window went
    assert store.evict_oldest(spare="B/doc", owner="B") and list(k for k, _ in store.entries()) == ["B/doc"]
    plain = RetainedKV(max_entries=2)
    for key in "abc":
        plain.insert(key, RetainedSequence(SequenceKV(*_rows(4)), [ord(key)]))
    assert [k for k, _ in plain.entries()] == ["b", "c"]
    assert plain.evict_oldest(owner="") and [k for k, _ in plain.entries()] == ["c"]


def test_pool_marks_follow_each_slot():
    pool = SlotPool(n_layers=L, n_kv_heads=H, head_dim=D, dtype=torch.float32, budget_bytes=8 * PER_SLOT)
    none = torch.empty(0, dtype=torch.int64)
    a = pool.alloc(5)
    assert pool.alloc(4) is None and pool.n_free == 3  # the pool evicts nothing
    assert pool.is_held(a) and (pool.n_held, pool.n_tree) == (5, 0)
    pool.adopt(a[:3])
    assert (pool.n_held, pool.n_tree) == (2, 3) and torch.equal(pool.held_among(a), a[3:])
    pool.check_integrity(a[:3])
    with pytest.raises(RuntimeError):
        pool.free(a[:1])  # the tree's, not held
    with pytest.raises(RuntimeError):
        pool.release(a[3:])  # held, not the tree's
    pool.release(a[:3])
    pool.free(a[3:])
    pool.check_integrity(none)
    assert pool.n_free == pool.n_slots == 8
    with pytest.raises(AssertionError):
        pool.check_integrity(a[:1])  # a tree that claims a free slot


def test_radix_cache_over_a_given_pool():
    pool = SlotPool(n_layers=L, n_kv_heads=H, head_dim=D, dtype=torch.float32, budget_bytes=16 * PER_SLOT)
    cache = RadixCache(pool=pool, min_evict=1)
    assert cache.pool is pool and cache.n_slots == 16 and cache.bytes_per_slot == PER_SLOT
    cache.insert([1, 2, 3], cache.alloc(3))
    assert pool.n_tree == 3
    with pytest.raises(TypeError):
        RadixCache(pool=pool, n_layers=L)
    with pytest.raises(TypeError):
        RadixCache(n_layers=L, n_kv_heads=H)


def test_disk_store_turned_off_stores_and_finds_nothing(tmp_path):
    store = KVDiskStore(tmp_path / "kv", "f" * 64, 1 << 20, (L, H, D), torch.float32)
    ids = [1, 2, 3]
    assert store.insert("doc", DocumentRows(ids, *_rows(3))) is not None
    store.disable("test")
    store.disable("a second reason")
    assert store.disabled == "test"
    assert store.insert("doc2", DocumentRows(ids, *_rows(3))) is None and store.match("doc") is None


def test_disk_store_integrity_catches_a_file_under_another_documents_name(tmp_path):
    store = KVDiskStore(tmp_path / "kv", "f" * 64, 1 << 20, (L, H, D), torch.float32)
    path = store.insert("doc", DocumentRows([1, 2, 3], *_rows(3)))
    store.check_integrity()
    path.rename(store.path_for("other", "0" * 64))
    with pytest.raises(AssertionError, match="named for another"):
        store.check_integrity()


def test_retained_keeps_one_kv_for_the_same_rows_under_several_keys():
    """The same file in two editor windows (two daemon fronts: two keys) keeps its rows once;
    a longer text's KV serves a shorter one it extends; taking an entry hands out its KV as
    it is and drops the entries sharing it (the taker writes to it); dropping an entry frees
    bytes only with the last one on its KV."""
    store = RetainedKV(max_entries=8)
    kv_a = SequenceKV(*_rows(8, 1))
    store.insert("a", RetainedSequence(kv_a, [5, 6, 7, 8]))
    one = store.nbytes()
    store.insert("b", RetainedSequence(SequenceKV(*_rows(8, 2)), [5, 6, 7, 8]))
    assert store.match("b").kv is kv_a and store.nbytes() == one and store.shared("a") and store.shared("b")
    store.insert("c", RetainedSequence(SequenceKV(*_rows(8, 3)), [5, 6, 9]))  # differs at the third id
    assert store.match("c").kv is not kv_a and store.nbytes() == 2 * one and not store.shared("c")
    # What making room may free besides a document's own KV: b's shares a's, so only c's.
    assert store.nbytes_besides("a") == store.nbytes_besides("b") == one and store.nbytes_besides(None) == 2 * one
    store.check_integrity()

    taken = store.take("b")
    assert taken.kv is kv_a and taken.ids == [5, 6, 7, 8]
    assert store.match("a") is None and store.match("c") is not None and store.nbytes() == one  # a went with it

    # A longer text that extends a kept one: both on the longer KV, the shorter KV let go.
    store.insert("a", RetainedSequence(kv_a, [5, 6, 7, 8]))
    kv_d = SequenceKV(*_rows(8, 5))
    store.insert("d", RetainedSequence(kv_d, [5, 6, 7, 8, 10, 11]))
    assert store.match("a").kv is kv_d and store.match("a").ids == [5, 6, 7, 8]
    assert store.nbytes() == 2 * one  # c's and d's
    # A shorter text that a kept one extends takes the kept KV.
    store.insert("e", RetainedSequence(SequenceKV(*_rows(8, 6)), [5, 6, 7]))
    assert store.match("e").kv is kv_d and store.nbytes() == 2 * one
    # A document's own previous entry is replaced, never shared with.
    store.insert("d", RetainedSequence(SequenceKV(*_rows(8, 7)), [5, 6, 7, 8, 10, 11]))
    assert store.match("d").kv is store.match("a").kv is store.match("e").kv and store.nbytes() == 2 * one
    store.check_integrity()

    # Freed with the last entry on it: a (its KV shared) frees nothing, c frees its own.
    assert list(k for k, _ in store.entries()) == ["c", "a", "e", "d"]
    assert store.evict(1, spare="c") == one  # a and e free nothing (d keeps their KV), then d frees it
    assert [k for k, _ in store.entries()] == ["c"] and store.nbytes() == one
    assert store.evict_oldest() and store.nbytes() == 0 and not store.evict_oldest()


def test_retained_compacts_each_kv_to_the_rows_its_entries_use_keeping_order_and_sharing():
    """A budget coming down (`Scheduler.shrink_budget`): each kept KV gets the capacity the
    resize gives for the most rows any of its entries uses; entries that shared a KV share
    the new one; the order (least recently kept first) stays; the rows are the same."""
    store = RetainedKV(max_entries=4)
    big = SequenceKV(*_rows(16))
    store.insert("a", RetainedSequence(big, [1, 2, 3]))
    store.insert("b", RetainedSequence(SequenceKV(*_rows(16, 1)), [9]))
    store.insert("c", RetainedSequence(SequenceKV(*_rows(16, 2)), [1, 2, 3, 4, 5]))  # extends a: they share c's KV
    assert store.peek("a").kv is store.peek("c").kv
    before = store.nbytes()
    asked: list[int] = []

    def resize(kv, rows):
        asked.append(rows)
        smaller = SequenceKV(*_rows(rows))
        smaller.copy_rows(kv, rows)
        return smaller

    old_c = store.peek("c").kv
    order = [k for k, _ in store.entries()]
    store.compact(resize)
    assert sorted(asked) == [1, 5]  # one resize per KV, for its longest entry
    assert [k for k, _ in store.entries()] == order
    assert store.peek("a").kv is store.peek("c").kv and store.peek("c").kv.capacity == 5
    assert torch.equal(store.peek("c").kv.k[:, :, :5], old_c.k[:, :, :5])
    assert store.nbytes() < before
