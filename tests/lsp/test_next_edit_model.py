"""`nextEdit: "model"`: where the proposers without a model are silent, the model is asked
about the latest change's candidate places with probes after the document's own prompt; the
first place it carries the edit to is offered. A completion request in
flight goes first; a newer request, a change, or a model without probe training: no edit and no
harm."""

from __future__ import annotations

import asyncio

import msgspec

from efim_lsp.next_edit.service import NextEdits
from lsp_fakes import FakeEngine
from test_completer import URI, Rig

TEXT = "def f():\n    x = 8\n    y = x + 8\n    return y * 8\n"


class ProbeEngine(FakeEngine):
    """A model trained on probes (EngineInfo.probes) that answers from a script."""

    def __init__(self, script, probes=True, **kw):
        super().__init__(script, **kw)
        self.probes = probes

    def info(self):
        return msgspec.structs.replace(super().info(), probes=self.probes, template="efim-spm", suffix_first=True)


async def _rig(script, probes=True, **kw):
    rig = await Rig(ProbeEngine(script, probes, **kw), nextEdit="model", warmAhead=False, answerAhead=False).start(TEXT)
    edits = NextEdits(rig.docs, rig.stats, use_model=lambda: True)
    edits.opened(URI)
    return rig, edits


async def _typed(rig, edits, start, end, new):
    """`text[start:end]` replaced by `new`, seen by the completer and the next-edit service."""
    from lsp_client_model import range_change  # noqa: PLC0415

    rig.version += 1
    out = rig.docs.change(URI, rig.version, [range_change(rig.text, start, end, new)])
    rig.completer.changed(URI, out)
    edits.changed(URI, out)


def _answer_by_line(yes_line: str, new: str):
    def script(req):
        if not req.probe:
            return "pass\n"
        head = req.probe.rsplit("\n@", 1)[1]
        return new if head.lstrip().startswith(yes_line) else "8"
    return script


async def test_the_model_offers_the_first_place_it_carries_a_changed_number_to():
    rig, edits = await _rig(_answer_by_line("return", "15"))
    at = TEXT.index("8")
    await _typed(rig, edits, at, at + 1, "15")
    offer = await edits.propose_with_model(URI, rig.version, at + 2, rig.completer)
    assert offer is not None and offer.edit.new_text == "15"
    assert rig.text[: offer.edit.start].endswith("return y * ") and rig.text[offer.edit.start:offer.edit.end] == "8"
    probes = [r for r in rig.engine.requests if r.probe]
    assert len(probes) == 2 and rig.stats.next_edit_probes == 2 and rig.stats.next_edit_model_offers == 1
    for r in probes:  # the document's prompt, then the probe; its own key, no healing
        assert r.key == f"{URI}#next-edit" and r.heal is False and r.stop == ("\n",)
        assert r.prefix + r.increment + r.suffix == rig.text


async def test_no_offer_when_the_model_keeps_every_place_or_is_not_probe_trained():
    rig, edits = await _rig(_answer_by_line("nowhere", "15"))
    at = TEXT.index("8")
    await _typed(rig, edits, at, at + 1, "15")
    assert await edits.propose_with_model(URI, rig.version, at + 2, rig.completer) is None
    rig2, edits2 = await _rig(_answer_by_line("return", "15"), probes=False)
    await _typed(rig2, edits2, at, at + 1, "15")
    assert await edits2.propose_with_model(URI, rig2.version, at + 2, rig2.completer) is None
    assert not [r for r in rig2.engine.requests if r.probe]  # an untrained model is never asked


async def test_the_rules_answer_first_and_the_model_is_not_asked():
    rig, edits = await _rig(_answer_by_line("return", "z"))
    at = TEXT.index("x")
    await _typed(rig, edits, at, at + 1, "z")  # a rename: the rule proposer knows
    offer = await edits.propose_with_model(URI, rig.version, at + 1, rig.completer)
    assert offer is not None and offer.edit.reason.startswith("rename")
    assert not [r for r in rig.engine.requests if r.probe]


async def test_a_newer_request_or_a_change_ends_the_asking_with_no_edit():
    rig, edits = await _rig(_answer_by_line("return", "15"), token_delay=0.05)
    at = TEXT.index("8")
    await _typed(rig, edits, at, at + 1, "15")
    first = asyncio.create_task(edits.propose_with_model(URI, rig.version, at + 2, rig.completer))
    await asyncio.sleep(0.02)
    second = asyncio.create_task(edits.propose_with_model(URI, rig.version, at + 2, rig.completer))
    assert await first is None  # superseded
    assert (await second) is not None
    third = asyncio.create_task(edits.propose_with_model(URI, rig.version, at + 2, rig.completer))
    await asyncio.sleep(0.02)
    await _typed(rig, edits, 0, 0, "#\n")  # the document changes meanwhile
    assert await third is None


async def test_the_probes_wait_for_a_completion_request_in_flight():
    rig, edits = await _rig(_answer_by_line("return", "15"), prefill_delay=0.3)
    at = TEXT.index("8")
    await _typed(rig, edits, at, at + 1, "15")
    completion = asyncio.create_task(rig.complete(at + 2))
    await asyncio.sleep(0.01)
    assert rig.completer.completion_waiting()
    asking = asyncio.create_task(edits.propose_with_model(URI, rig.version, at + 2, rig.completer))
    await asyncio.sleep(0.05)
    assert not completion.done() and not [r for r in rig.engine.requests if r.probe]  # nothing asked while it runs
    await completion
    offer = await asking
    assert offer is not None and offer.edit.new_text == "15"


async def test_a_cold_window_is_probed_through_the_small_first_window_and_warmed_behind():
    body = "".join(f"    v{i} = {i} * 8\n" for i in range(300))
    text = "def f():\n    x = 8\n" + body + "    return x * 8\n"
    rig = await Rig(ProbeEngine(_answer_by_line("nowhere", "15")), nextEdit="model", answerAhead=False).start(text)
    edits = NextEdits(rig.docs, rig.stats, use_model=lambda: True)
    edits.opened(URI)
    at = text.index("8")
    await _typed(rig, edits, at, at + 1, "15")
    assert await edits.propose_with_model(URI, rig.version, at + 2, rig.completer) is None
    probes = [r for r in rig.engine.requests if r.probe]
    assert probes and all(len(r.prefix + r.increment + r.suffix) < len(rig.text) for r in probes)  # the small window
    warm = [r for r in rig.engine.requests if r.background and not r.probe]
    assert warm and len(warm[0].prefix + warm[0].increment + warm[0].suffix) > len(probes[0].prefix + probes[0].suffix)
