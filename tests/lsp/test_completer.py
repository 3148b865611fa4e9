"""The completion pipeline against an in-test engine (server logic only; e2e tests use the real engine)."""

from __future__ import annotations

import asyncio
import time

import pytest

from efim_lsp.completer import Answer, Completer, Declined, budget_for
from efim_lsp.documents import DocumentStore, FullChange, RangeChange
from efim_lsp.engine_holder import EngineHolder, EngineSpec
from efim_lsp.settings import Settings, apply
from efim_lsp.stats import ServerStats

from lsp_fakes import FakeEngine
from lsp_client_model import range_change

URI = "file:///m.py"
SRC = "import os\n\ndef f(x):\n    \n    return x\n"
BODY = SRC.index("    \n") + 4


class Rig:
    def __init__(self, engine: FakeEngine, **settings):
        self.engine = engine
        self.docs = DocumentStore()
        self.holder = EngineHolder(lambda model, fim_tokens="auto", adapter="auto", **_options: engine)
        self.stats = ServerStats()
        self.settings = apply(Settings(), settings).settings
        self.completer = Completer(self.docs, self.holder, self.stats, lambda: self.settings)
        self.version = 0

    async def start(self, text: str = SRC):
        assert await self.holder.load(EngineSpec("fake", "auto"))
        self.open(text)
        return self

    def open(self, text: str):
        self.docs.open(URI, "python", self.version, text)
        self.completer.opened(URI)

    @property
    def text(self) -> str:
        return self.docs.get(URI).text

    def edit(self, start: int, end: int, new: str):
        self.version += 1
        out = self.docs.change(URI, self.version, [range_change(self.text, start, end, new)])
        self.completer.changed(URI, out)

    async def complete(self, cursor: int, version: int | None = None):
        v = self.version if version is None else version
        return await self.completer.complete(URI, cursor, v, time.monotonic())


async def test_efim_requests_keep_prefix_and_suffix_and_grow_the_increment():
    rig = await Rig(FakeEngine(lambda r: "pass\n")).start()
    cursor = BODY
    answers = [await rig.complete(cursor)]
    for ch in "y = x":
        rig.edit(cursor, cursor, ch)
        cursor += 1
        answers.append(await rig.complete(cursor))
    reqs = rig.engine.requests[1:]  # [0] is the first request after the load
    assert len(reqs) == 6
    assert {r.prefix for r in reqs} == {SRC[:BODY]} and {r.suffix for r in reqs} == {SRC[BODY:]}
    assert [r.increment for r in reqs] == ["", "y", "y ", "y =", "y = ", "y = x"]
    assert all(r.format == "efim" and r.key == URI for r in reqs)
    assert all(isinstance(a, Answer) and a.text == "pass" and a.start == a.end for a in answers[:1])
    # the fake engine's prefix cache sees each prompt extend the last: all but the first are reused
    assert rig.stats.reuse_ratio > 0.75


async def test_line_mode_asks_the_engine_to_stop_at_newline_and_block_mode_does_not():
    rig = await Rig(FakeEngine(lambda r: "1\n")).start("x = \ndef g():\n")
    await rig.complete(4)
    await rig.complete(len("x = \ndef g():"))
    assert rig.engine.requests[1].stop == ("\n",) and rig.engine.requests[2].stop == ()



async def test_a_request_carries_the_deadline_timeout_ms_sets_and_none_when_zero():
    rig = await Rig(FakeEngine(lambda r: "pass\n")).start()
    before = time.monotonic()
    await rig.complete(BODY)
    fg = [r for r in rig.engine.requests if not r.background]
    assert fg and fg[-1].deadline is not None
    assert before + 1.4 <= fg[-1].deadline <= time.monotonic() + 1.5  # default timeoutMs 1500
    assert all(r.deadline is None for r in rig.engine.requests if r.background)  # warm-ups: no limit
    rig.settings = apply(rig.settings, {"timeoutMs": 0}).settings
    rig.edit(BODY, BODY, "z")
    await rig.complete(BODY + 1)
    assert [r for r in rig.engine.requests if not r.background][-1].deadline is None

async def test_typing_through_answers_without_the_engine():
    rig = await Rig(FakeEngine(lambda r: "value = compute(x)\n")).start()
    first = await rig.complete(BODY)
    assert isinstance(first, Answer) and first.text == "value = compute(x)"
    n = len(rig.engine.requests)
    cursor = BODY
    for ch in "value = ":
        rig.edit(cursor, cursor, ch)
        cursor += 1
        ans = await rig.complete(cursor)
        assert isinstance(ans, Answer) and ans.source == "typing-through"
    assert ans.text == "compute(x)" and len(rig.engine.requests) == n
    assert rig.stats.typing_through_hits == 8
    rig.edit(cursor, cursor, "Z")  # diverges from the suggestion: the engine is asked again
    ans = await rig.complete(cursor + 1)
    assert ans.source == "engine" and len(rig.engine.requests) == n + 1


async def test_newer_request_supersedes_the_older_and_cancels_its_handle():
    rig = await Rig(FakeEngine(lambda r: "a" * 200, token_delay=0.01)).start()
    older = asyncio.ensure_future(rig.complete(BODY))
    await asyncio.sleep(0.03)
    rig.edit(BODY, BODY, "y")
    newer = asyncio.ensure_future(rig.complete(BODY + 1))
    old_result, new_result = await older, await newer
    assert isinstance(old_result, Declined) and old_result.code == "superseded"
    assert isinstance(new_result, Answer)
    assert rig.engine.handles[1].done and rig.engine.handles[1]._final.finish_reason == "cancelled"
    assert rig.stats.cancelled == 1


async def test_a_request_for_an_older_version_gets_no_answer():
    rig = await Rig(FakeEngine()).start()
    rig.edit(BODY, BODY, "y")
    result = await rig.complete(BODY + 1, version=rig.version - 1)
    assert isinstance(result, Declined) and result.code == "stale"
    assert len(rig.engine.requests) == 1  # only the first request after the load: nothing computed for a stale request


async def test_asyncio_cancellation_cancels_the_engine_handle():
    rig = await Rig(FakeEngine(lambda r: "b" * 400, token_delay=0.01)).start()
    task = asyncio.ensure_future(rig.complete(BODY))
    await asyncio.sleep(0.05)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    handle = rig.engine.handles[-1]
    await asyncio.wait_for(handle.wait(), 2)
    assert handle._final.finish_reason == "cancelled" and rig.stats.cancelled == 1


async def test_block_generation_stops_early_once_the_block_ends():
    gen = "\n    return x\n\ndef other():\n" + "    pass\n" * 50
    rig = await Rig(FakeEngine(lambda r: gen, token_delay=0.005)).start("def f(x):\n")
    result = await rig.complete(len("def f(x):"))
    assert isinstance(result, Answer) and result.text == "\n    return x"
    handle = rig.engine.handles[-1]
    await asyncio.wait_for(handle.wait(), 2)
    assert handle._final.finish_reason == "cancelled"  # decoding stopped, not run to max_tokens


async def test_a_generation_that_reaches_max_tokens_is_cut_at_a_line_boundary():
    body = "y = x + 1\n    z = y * 2\n    return compute_the_thing(y, z, x, a_very_long_name)\n"
    rig = await Rig(FakeEngine(lambda r: body), maxTokens=12, multiline="always").start()
    answer = await rig.complete(BODY)
    assert rig.engine.requests[-1].max_tokens == 12
    assert isinstance(answer, Answer) and answer.text == "y = x + 1\n    z = y * 2"  # 48 characters (12 tokens) generated: the third line unfinished
    rig2 = await Rig(FakeEngine(lambda r: "compute_the_thing(y, z, x, a_very_long_name)\n"), maxTokens=3, multiline="never").start()
    answer = await rig2.complete(BODY)
    assert isinstance(answer, Declined) and answer.code == "length" and "maxTokens" in answer.reason
    assert rig2.stats.declined["length"] == 1


async def test_declines_before_the_model_is_ready_and_when_out_of_sync():
    rig = Rig(FakeEngine())
    rig.open(SRC)
    assert (await rig.complete(BODY)).reason == "model loading"
    assert await rig.holder.load(EngineSpec("fake", "auto"))
    rig.version += 2
    out = rig.docs.change(URI, rig.version, [RangeChange(0, 0, 0, 0, "x")])
    rig.completer.changed(URI, out)
    assert "out of sync" in (await rig.complete(BODY)).reason
    rig.version += 1
    rig.completer.changed(URI, rig.docs.change(URI, rig.version, [FullChange(SRC)]))
    assert isinstance(await rig.complete(BODY), Answer)


async def test_failed_model_load_is_reported():
    def broken(model, fim_tokens="auto", adapter="auto", **_options):
        raise FileNotFoundError("no such model: /nope")

    docs = DocumentStore()
    holder = EngineHolder(broken)
    completer = Completer(docs, holder, ServerStats(), Settings)
    assert not await holder.load(EngineSpec("/nope", "auto"))
    docs.open(URI, "python", 0, SRC)
    completer.opened(URI)
    result = await completer.complete(URI, 0, 0, time.monotonic())
    assert isinstance(result, Declined) and "no such model" in result.reason


async def test_crlf_documents_get_crlf_suggestions():
    rig = await Rig(FakeEngine(lambda r: "\n    return 1\n")).start("def f():\r\n")
    result = await rig.complete(len("def f():"))
    assert result.text == "\r\n    return 1"


async def test_models_without_fim_get_prefix_prompts():
    rig = await Rig(FakeEngine(supports_fim=False)).start()
    await rig.complete(BODY)
    req = rig.engine.requests[-1]
    assert req.format == "prefix" and req.suffix == ""


def test_budgets_shrink_to_the_models_context():
    engine = FakeEngine(context_length=1024)
    b = budget_for(Settings(), engine.info(), "efim")
    assert b.prefix_tokens + b.suffix_tokens + Settings().max_tokens <= 1024 - 192
    assert b.prefix_tokens / b.suffix_tokens == pytest.approx(1536 / 512, rel=0.02)
    assert budget_for(Settings(), FakeEngine().info(), "efim") == (1536, 512)


async def test_rebases_are_counted_and_no_cache_setting_reaches_the_engine():
    rig = await Rig(FakeEngine(), cache=False, promptFormat="fim").start()
    await rig.complete(BODY)
    await rig.complete(3)
    assert rig.completer.rebases == 1 and rig.completer.sessions_active == 1
    assert all(not r.cache and r.format == "fim" for r in rig.engine.requests[1:])


async def test_a_generation_the_deadline_ends_is_cut_like_a_max_tokens_cut_and_counted():
    # A busy machine: tokens arrive slowly and `timeoutMs` ends the generation mid-word.
    slow = FakeEngine(lambda r: "compute_the_thing(y, z)\n", token_delay=0.15)
    rig = await Rig(slow, timeoutMs=200, multiline="never").start()
    answer = await rig.complete(BODY)
    assert rig.engine.handles[-1]._final.finish_reason == "deadline"
    assert isinstance(answer, Declined) and answer.code == "deadline" and "timeoutMs (200 ms)" in answer.reason
    assert rig.stats.deadline_cuts == 1 and rig.stats.declined["deadline"] == 1
    # Whole words before the cut are shown, the unfinished one is not.
    words = FakeEngine(lambda r: "x = a + compute_the_thing(y)\n", token_delay=0.1)
    rig2 = await Rig(words, timeoutMs=350, multiline="never").start()
    answer = await rig2.complete(BODY)
    assert rig2.engine.handles[-1]._final.finish_reason == "deadline"
    assert isinstance(answer, Answer) and answer.text in ("x =", "x = a +")  # never "x = a + comp"
    assert rig2.stats.deadline_cuts == 1
    assert rig2.stats.to_wire(None, 0, 0)["deadlineCuts"] == 1
    # Both prompts were computed whole before the cut: nothing is left to finish.
    assert not any(r.background for r in rig.engine.requests + rig2.engine.requests)
    assert rig.stats.warm_after_deadline_cuts == rig2.stats.warm_after_deadline_cuts == 0


@pytest.mark.parametrize("warm_ahead", [True, False])
async def test_a_prompt_the_deadline_cut_mid_prefill_is_finished_in_the_background(warm_ahead):
    """A busy machine: the deadline ends the request while its prompt is prefilled. The rest
    of that prompt goes on as a warm-up (no deadline), so the next request here — or another
    window on the same file — finds it computed; `warmAhead: off` keeps it from running."""
    slow = FakeEngine(lambda r: "pass\n", prefill_delay=0.4)
    rig = await Rig(slow, timeoutMs=100, warmAhead=warm_ahead).start()
    before = len(rig.engine.requests)
    answer = await rig.complete(BODY)
    assert isinstance(answer, Declined) and answer.code == "deadline"
    cut = rig.engine.handles[before]._final
    assert cut.finish_reason == "deadline" and cut.stats.prompt_unfinished
    after = rig.engine.requests[before + 1 :]
    if not warm_ahead:
        assert after == [] and rig.stats.warm_after_deadline_cuts == 0
        return
    (warm,) = after
    asked = rig.engine.requests[before]
    assert warm.background and warm.deadline is None and warm.n == 1
    assert (warm.key, warm.prefix, warm.suffix, warm.increment, warm.max_tokens) == (
        asked.key, asked.prefix, asked.suffix, asked.increment, asked.max_tokens)
    assert rig.stats.warm_after_deadline_cuts == 1 and rig.stats.warm_submitted == 1
    rig.engine.wait_idle()
    await asyncio.sleep(0.05)  # the warm-up's accounting task
    assert rig.stats.warm_completed == 1
    assert rig.stats.to_wire(None, 0, 0)["warmup"]["afterDeadlineCuts"] == 1
