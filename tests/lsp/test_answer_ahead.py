"""Answers ahead (`efim_lsp.answer_ahead`): where a cursor signal settles, the request a
client would make there runs at once; a request at that place joins it (fake engine)."""

from __future__ import annotations

import asyncio

from lsp_fakes import FakeEngine
from test_completer import SRC, URI, Rig

from efim_lsp.answers import Answer, Declined
from efim_lsp.warm_ahead import WARM_SETTLE_SECONDS

SETTLE = WARM_SETTLE_SECONDS * 4
OTHER = "file:///other.py"


def _foreground(engine: FakeEngine):
    return [r for r in engine.requests if not r.background and r.key == URI]  # (the load's first request aside)


async def _settled_ahead(rig: Rig, cursor: int) -> None:
    rig.completer.cursor_moved(URI, cursor)
    await asyncio.sleep(SETTLE)
    ahead = rig.completer._states[URI].ahead
    assert ahead is not None and ahead.cursor == cursor
    await ahead.task


async def test_a_request_where_the_cursor_settled_gets_the_answer_computed_there():
    rig = await Rig(FakeEngine(lambda r: "pass\n")).start()
    cursor = SRC.index("return x")
    await _settled_ahead(rig, cursor)
    assert len(_foreground(rig.engine)) == 1  # the answer ahead, as a request would ask it
    answer = await rig.complete(cursor)
    assert isinstance(answer, Answer) and answer.source == "ahead" and answer.text == "pass"
    assert len(_foreground(rig.engine)) == 1  # no second engine request
    assert (rig.stats.warm_answers, rig.stats.warm_answer_hits, rig.stats.requests, rig.stats.served) == (1, 1, 1, 1)


async def test_a_request_that_arrives_while_it_runs_joins_it():
    rig = await Rig(FakeEngine(lambda r: "value = compute()\n", token_delay=0.02)).start()
    cursor = SRC.index("return x")
    rig.completer.cursor_moved(URI, cursor)
    await asyncio.sleep(SETTLE)
    assert rig.completer._states[URI].ahead is not None
    answer = await rig.complete(cursor)  # while the answer ahead still decodes
    assert isinstance(answer, Answer) and answer.source == "ahead" and answer.text == "value = compute()"
    assert len(_foreground(rig.engine)) == 1 and rig.engine.cancelled == 0


async def test_typing_its_first_characters_shows_the_rest_without_the_engine():
    rig = await Rig(FakeEngine(lambda r: "pass\n")).start()
    cursor = SRC.index("return x")
    await _settled_ahead(rig, cursor)
    rig.edit(cursor, cursor, "pa")
    answer = await rig.complete(cursor + 2)
    assert isinstance(answer, Answer) and answer.source == "typing-through" and answer.text == "ss"
    assert len(_foreground(rig.engine)) == 1


async def test_an_edit_ends_it_and_the_next_request_computes_its_own_answer():
    rig = await Rig(FakeEngine(lambda r: "value = compute()\n", token_delay=0.05)).start()
    cursor = SRC.index("return x")
    rig.completer.cursor_moved(URI, cursor)
    await asyncio.sleep(SETTLE)
    ahead = rig.completer._states[URI].ahead
    rig.edit(cursor, cursor, "z")  # not what it suggests: superseded
    result = await ahead.task
    assert isinstance(result, Declined) and result.code == "superseded"
    answer = await rig.complete(cursor + 1)
    assert isinstance(answer, Answer) and answer.source == "engine"
    assert rig.engine.cancelled >= 1
    assert rig.stats.declined["superseded"] == 0  # its decline is not a client's request's
    assert rig.stats.warm_answers == 0 and rig.stats.warm_answer_hits == 0


async def test_an_answer_ahead_that_found_nothing_answers_the_request_the_same_way():
    rig = await Rig(FakeEngine(lambda r: "\n")).start()  # an empty suggestion
    cursor = SRC.index("return x")
    await _settled_ahead(rig, cursor)
    result = await rig.complete(cursor)
    assert isinstance(result, Declined) and result.code == "empty"
    assert len(_foreground(rig.engine)) == 1 and rig.stats.declined["empty"] == 1


async def test_a_request_in_another_document_ends_the_answer_ahead_in_flight():
    rig = await Rig(FakeEngine(lambda r: "value = compute()\n", token_delay=0.05)).start()
    rig.docs.open(OTHER, "python", 0, "def g():\n    return 2\n")
    rig.completer.opened(OTHER)
    cursor = SRC.index("return x")
    rig.completer.cursor_moved(URI, cursor)
    await asyncio.sleep(SETTLE)
    ahead = rig.completer._states[URI].ahead
    answer = await rig.completer.complete(OTHER, 13, 0, asyncio.get_running_loop().time())
    assert isinstance(answer, Answer)
    result = await ahead.task
    assert isinstance(result, Declined) and result.code == "superseded"


async def test_settings_turn_it_off_and_a_shown_suggestion_is_not_recomputed():
    off = await Rig(FakeEngine(lambda r: "pass\n"), answerAhead=False).start()
    off.completer.cursor_moved(URI, SRC.index("return x"))
    await asyncio.sleep(SETTLE)
    assert _foreground(off.engine) == [] and off.completer._states[URI].ahead is None
    battery = await Rig(FakeEngine(lambda r: "pass\n"), warmAhead=False).start()
    battery.completer.cursor_moved(URI, SRC.index("return x"))
    await asyncio.sleep(SETTLE)
    assert _foreground(battery.engine) == [] and not any(r.background for r in battery.engine.requests)
    rig = await Rig(FakeEngine(lambda r: "pass\n")).start()
    cursor = SRC.index("return x")
    await rig.complete(cursor)  # a request ran to its end here
    rig.completer.cursor_moved(URI, cursor)
    await asyncio.sleep(SETTLE)
    assert len(_foreground(rig.engine)) == 1  # the signal at the same place computes nothing new
