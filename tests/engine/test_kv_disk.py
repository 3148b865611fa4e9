"""The KV disk tier (engine.kv.disk_format, engine.kv.disk_tier): files verified before use, written
atomically, bounded; a restarted engine's first request reuses what the last one computed."""

from __future__ import annotations

import logging
import multiprocessing
import os
import stat
import time
from pathlib import Path

import pytest
import torch

from engine.api import InfillRequest
from engine.kv.disk_format import KVDiskStore, list_files
from engine.local import load_engine
from tiny_models import stdlib_sources

SHAPE = (3, 2, 16)  # L, H_kv, D of the tiny llama


@pytest.fixture(scope="module")
def model(tiny_model_factory) -> str:
    return str(tiny_model_factory("llama"))


@pytest.fixture(scope="module")
def request_at() -> InfillRequest:
    src = stdlib_sources(("textwrap.py",))[0]
    at = src.index("def wrap(")
    return InfillRequest(key="file:///textwrap.py", prefix=src[at - 1200 : at], suffix=src[at : at + 600], max_tokens=8)


def store(directory: Path, fp: str = "a" * 64, budget: int = 1 << 30, dtype=torch.float32) -> KVDiskStore:
    return KVDiskStore(directory, fp, budget, SHAPE, dtype)


def rows(n: int, seed: int = 0, dtype=torch.float32) -> tuple[list[int], torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(SHAPE[0], SHAPE[1], n, SHAPE[2], generator=g).to(dtype)  # [L, H_kv, n, D]
    v = torch.randn(SHAPE[0], SHAPE[1], n, SHAPE[2], generator=g).to(dtype)
    return list(range(seed, seed + n)), k, v


def engine(model: str, directory: Path, **kw):
    return load_engine(model, dtype="fp32", kv_budget="32M", kv_disk=str(directory), check_integrity=True, **kw)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_round_trip_is_bit_exact_and_private(tmp_path, dtype):
    s = store(tmp_path / "kv", dtype=dtype)
    ids, k, v = rows(37, dtype=dtype)
    path = s.save("doc", ids, k, v)
    got = s.load(path)
    assert got is not None and got.key == "doc" and got.ids == ids
    assert torch.equal(got.k, k) and torch.equal(got.v, v) and got.k.dtype == dtype
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE((tmp_path / "kv").stat().st_mode) == 0o700
    assert [p.name for p in (tmp_path / "kv").iterdir()] == [path.name]  # no temp file left


def test_restarted_engine_first_request_prefills_one_token(model, request_at, tmp_path):
    first = engine(model, tmp_path)
    cold = first.submit(request_at).result(60)
    first.close()  # writes the document's retained KV
    assert cold.stats.prefilled_tokens == cold.stats.prompt_tokens > 100
    assert len(list_files(tmp_path)) == 1

    second = engine(model, tmp_path)
    try:
        assert second.disk_tier.wait_loaded(30)
        assert second.stats().kv_disk_loaded_tokens >= cold.stats.prompt_tokens
        warm = second.submit(request_at).result(60)
        assert warm.stats.prefilled_tokens == 1  # the one row whose logits pick the first token
        assert warm.stats.reused_tokens == warm.stats.prompt_tokens - 1
        assert warm.text == cold.text
        second.check_integrity().result(30)
    finally:
        second.close()


def test_idle_engine_writes_without_closing(model, request_at, tmp_path):
    eng = engine(model, tmp_path)
    try:
        eng.submit(request_at).result(60)
        end = time.monotonic() + 15
        while not list_files(tmp_path) and time.monotonic() < end:
            time.sleep(0.1)
        assert len(list_files(tmp_path)) == 1  # after idle_seconds (2 s) without a request
        assert eng.disk_tier.save_now() == 0  # nothing changed since: nothing written twice
    finally:
        eng.close()


def _corrupt(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-5] ^= 0xFF
    path.write_bytes(bytes(data))


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:-100])


def _other_fingerprint(path: Path) -> None:
    """A file written for model B renamed into model A's name space (the name lies)."""
    other = store(path.parent / "b", fp="b" * 64)
    ids, k, v = rows(20, seed=3)
    os.replace(other.save("doc", ids, k, v), path)


def _other_format(path: Path) -> None:
    from safetensors.torch import load_file, save_file

    tensors = load_file(path)
    from engine.kv.disk_format import read_header

    meta = read_header(path)[0]["__metadata__"]
    save_file(tensors, path, metadata={**meta, "format": "999"})


@pytest.mark.parametrize("damage", [_corrupt, _truncate, _other_fingerprint, _other_format])
def test_bad_file_is_ignored_warned_once_and_deleted(tmp_path, caplog, damage):
    s = store(tmp_path)
    ids, k, v = rows(20)
    path = s.save("doc", ids, k, v)
    damage(path)
    with caplog.at_level(logging.WARNING, logger="engine.kv.disk_format"):
        assert s.load(path) is None
        assert s.load(path) is None  # gone: a miss, no second warning
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and path.name in warnings[0].getMessage()
    assert not path.exists() and s.bad_files == 1


def test_engine_with_a_corrupted_file_prefills_normally(model, request_at, tmp_path, caplog):
    first = engine(model, tmp_path)
    cold = first.submit(request_at).result(60)
    first.close()
    (path,) = [f.path for f in list_files(tmp_path)]
    _corrupt(path)
    with caplog.at_level(logging.WARNING, logger="engine.kv.disk_format"):
        second = engine(model, tmp_path)
        try:
            assert second.disk_tier.wait_loaded(30)
            assert not path.exists()
            again = second.submit(request_at).result(60)
            fp = second.disk_tier.store.fingerprint
        finally:
            second.close()
    assert again.stats.prefilled_tokens == again.stats.prompt_tokens and again.text == cold.text
    assert sum("ignored and deleted" in r.getMessage() for r in caplog.records) == 1
    assert KVDiskStore(tmp_path, fp, 1 << 30, SHAPE, torch.float32).load(path) is not None  # rewritten whole at close


def test_other_models_files_are_neither_loaded_nor_deleted(model, tiny_model_factory, request_at, tmp_path):
    other = engine(str(tiny_model_factory("llama", seed=1)), tmp_path)
    other.submit(request_at).result(60)
    other.close()
    (theirs,) = list_files(tmp_path)
    eng = engine(model, tmp_path)
    try:
        assert eng.disk_tier.wait_loaded(30)
        got = eng.submit(request_at).result(60)
        assert got.stats.prefilled_tokens == got.stats.prompt_tokens
        assert eng.stats().kv_disk_loaded_tokens == 0
    finally:
        eng.close()
    assert theirs.path.exists() and theirs.fingerprint != list_files(tmp_path)[-1].fingerprint


def test_unwritable_directory_turns_the_tier_off_and_the_engine_serves(model, request_at, tmp_path, caplog):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")  # root ignores chmod; a path under a file fails for anyone
    with caplog.at_level(logging.WARNING, logger="engine.kv.disk_format"):
        eng = engine(model, blocker / "kv")
        try:
            eng.submit(request_at).result(60)
            assert eng.disk_tier.save_now() == 0
            assert eng.stats().kv_disk.startswith("off: cannot write")
            again = eng.submit(request_at).result(60)
            assert again.finish_reason in ("length", "eos", "stop")
            assert eng.disk_tier.save_now() == 0
        finally:
            eng.close()
    assert sum("KV disk tier off" in r.getMessage() for r in caplog.records) == 1


def _writer(directory: str, seed: int, rounds: int) -> None:
    s = store(Path(directory))
    for i in range(rounds):
        ids, k, v = rows(64 + (seed * 7 + i) % 13, seed=seed * 1000 + i)
        s.save(f"doc{i % 3}", ids, k, v)  # both processes write the same documents


def test_two_processes_writing_one_directory_leave_only_valid_files(tmp_path):
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_writer, args=(str(tmp_path), seed, 30)) for seed in (1, 2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0
    s = store(tmp_path)
    files = list(tmp_path.iterdir())
    assert files and all(f.suffix == ".safetensors" for f in files)  # no temp file left
    for f in files:
        assert s.load(f) is not None, f
    assert s.bad_files == 0


def test_budget_evicts_least_recently_used(tmp_path):
    s = store(tmp_path)
    paths = []
    for i in range(3):
        ids, k, v = rows(50, seed=i)
        paths.append(s.save(f"doc{i}", ids, k, v))
        time.sleep(0.02)
    size = paths[0].stat().st_size
    s.load(paths[0])  # used: now the most recent
    s.budget_bytes = 3 * size  # room for three
    ids, k, v = rows(50, seed=9)
    newest = s.save("doc9", ids, k, v)
    assert newest.exists() and paths[0].exists()
    assert not paths[1].exists() and paths[2].exists()  # the least recently used went
    assert sum(f.nbytes for f in list_files(tmp_path)) <= s.budget_bytes


def test_a_document_keeps_one_file(tmp_path):
    s = store(tmp_path)
    for seed in range(3):
        s.save("doc", *rows(30, seed=seed))
    assert len(list_files(tmp_path)) == 1 and s.load(list_files(tmp_path)[0].path).ids == rows(30, seed=2)[0]


def test_a_newer_file_another_process_wrote_survives_a_save(tmp_path):
    """Two processes saving one document: each drops only files older than its own, so the
    newest file survives whatever the interleaving (both deleting each other's left none)."""
    mine, theirs = store(tmp_path), store(tmp_path)
    newer = theirs.save("doc", *rows(30, seed=2))
    later = time.time() + 60
    os.utime(newer, (later, later))  # written after the save below begins
    older = mine.save("doc", *rows(30, seed=1))
    assert newer.exists() and mine.files_of("doc")[0] == newer
    assert older.exists() and len(list_files(tmp_path)) == 2  # not older than itself: the next save drops it
