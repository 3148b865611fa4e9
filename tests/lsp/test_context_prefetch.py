"""Chunk KV computed ahead (`efim_lsp.context.prefetch.ChunkPrefetch`) against a fake engine:
what is submitted, in which order, one at a time, and again after a change."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from efim_lsp.context.prefetch import PREFETCH_KEY, ChunkPrefetch
from engine.api import ContextChunk

pytestmark = pytest.mark.asyncio


class FakeHandle:
    def __init__(self, engine: FakeEngine) -> None:
        self.engine = engine
        self.finished = asyncio.get_running_loop().create_future()

    async def wait(self):
        return await self.finished


class FakeEngine:
    def __init__(self, local: bool = True) -> None:
        self.requests = []
        self.handles: list[FakeHandle] = []
        self.local = local

    def info(self):
        return SimpleNamespace(kv_dtype="model" if self.local else None)

    def submit(self, request):
        self.requests.append(request)
        handle = FakeHandle(self)
        self.handles.append(handle)
        return handle

    def in_flight(self) -> int:
        return sum(not h.finished.done() for h in self.handles)

    async def finish_all(self, rounds: int = 50) -> None:
        for _ in range(rounds):
            await asyncio.sleep(0.01)
            assert self.in_flight() <= 1  # one chunk at a time
            for h in self.handles:
                if not h.finished.done():
                    h.finished.set_result(SimpleNamespace(finish_reason="length"))


def settings(context: str = "blend") -> SimpleNamespace:
    return SimpleNamespace(context=context, cache=True, prompt_format="efim", blend_ratio=0.15, context_chunks=4, context_tokens=1024)


A, B, C = (ContextChunk(path=p, text=f"def {p[0]}(): ...\n") for p in ("a.py", "b.py", "c.py"))


async def test_likely_chunks_are_computed_in_plan_order_one_at_a_time_as_background_blends():
    plan = [A, B, C]
    prefetch = ChunkPrefetch(lambda s: list(plan), lambda timeout: True)
    engine = FakeEngine()
    prefetch.configure(engine, settings())
    await engine.finish_all()
    assert [r.chunks for r in engine.requests] == [(A,), (B,), (C,)]
    r = engine.requests[0]
    assert r.background and r.context == "blend" and r.key == PREFETCH_KEY and r.prefix == "" and r.blend_ratio == 0.15
    assert prefetch.status() == {"queued": 0, "computed": 3, "failed": 0, "running": False}

    # Nothing new: a kick computes nothing again.
    prefetch.kick()
    await engine.finish_all(5)
    assert len(engine.requests) == 3
    # A file changed: its chunk's KV was dropped, so it is computed again (its new text
    # comes from the next plan).
    plan[1] = ContextChunk(path="b.py", text="def b2(): ...\n")
    prefetch.forget("b.py")
    await engine.finish_all()
    assert [r.chunks for r in engine.requests[3:]] == [(plan[1],)]


async def test_nothing_is_computed_ahead_without_blend_or_a_local_engine():
    prefetch = ChunkPrefetch(lambda s: [A], lambda timeout: True)
    engine = FakeEngine()
    prefetch.configure(engine, settings("prefix"))
    prefetch.configure(None, settings("blend"))
    remote = FakeEngine(local=False)
    prefetch.configure(remote, settings("blend"))
    await asyncio.sleep(0.05)
    assert engine.requests == [] and remote.requests == []


async def test_a_refused_request_or_a_failing_plan_never_hurts():
    class Refusing(FakeEngine):
        def submit(self, request):
            raise RuntimeError("engine closed")

    prefetch = ChunkPrefetch(lambda s: [A, B], lambda timeout: True)
    prefetch.configure(Refusing(), settings())
    await asyncio.sleep(0.05)
    assert prefetch.status()["failed"] == 2

    def broken(_settings):
        raise OSError("disk gone")

    failing = ChunkPrefetch(broken, lambda timeout: True)
    failing.configure(FakeEngine(), settings())
    await asyncio.sleep(0.05)
    assert failing.status()["running"] is False
