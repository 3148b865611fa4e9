"""Warm-ahead in the completion pipeline: cursor signals become background warm-ups
whose prompt is exactly the prefix the first request there renders (fake engine)."""

from __future__ import annotations

import asyncio
import threading

from lsp_fakes import FakeEngine, render
from test_completer import SRC, URI, Rig

from efim_lsp.completer import Answer
from efim_lsp.documents import FullChange
from efim_lsp.warm_ahead import WARM_SETTLE_SECONDS

SETTLE = WARM_SETTLE_SECONDS * 4


def _warmups(engine: FakeEngine):
    return [r for r in engine.requests if r.background]


async def test_a_cursor_signal_warms_exactly_the_prompt_the_next_request_extends():
    rig = await Rig(FakeEngine(lambda r: "pass\n")).start()
    target = SRC.index("return x")
    rig.completer.cursor_moved(URI, target)
    await asyncio.sleep(SETTLE)
    (warm,) = _warmups(rig.engine)
    assert warm.background and warm.key == URI and warm.increment == ""
    rig.edit(target, target, "y")
    answer = await rig.complete(target + 1)
    assert isinstance(answer, Answer)
    real = rig.engine.requests[-1]
    assert not real.background and real.increment == "y"
    assert render(real).startswith(render(warm))  # the warm-up's prompt is an exact prefix
    assert rig.stats.warm_submitted == 1


async def test_a_flood_of_cursor_signals_costs_one_warm_up_at_the_last_position():
    rig = await Rig(FakeEngine()).start()
    for k in range(100):
        rig.completer.cursor_moved(URI, k % len(SRC))
    last = 99 % len(SRC)
    await asyncio.sleep(SETTLE)
    (warm,) = _warmups(rig.engine)
    assert len(warm.prefix) == last  # prefix window = text before the last cursor (small file)


async def test_no_warm_up_where_the_live_session_already_is_or_for_unknown_documents():
    rig = await Rig(FakeEngine()).start()
    cursor = SRC.index("return")
    await rig.complete(cursor)
    rig.completer.cursor_moved(URI, cursor)
    rig.completer.cursor_moved("file:///not-open.py", 3)
    await asyncio.sleep(SETTLE)
    assert _warmups(rig.engine) == []


async def test_a_request_right_after_the_signal_replaces_the_warm_up():
    rig = await Rig(FakeEngine()).start()
    cursor = SRC.index("return")
    rig.completer.cursor_moved(URI, cursor)
    await rig.complete(cursor)  # arrives before the signal settled
    await asyncio.sleep(SETTLE)
    assert _warmups(rig.engine) == []


async def test_settings_turn_warm_ahead_and_document_kv_off():
    rig = await Rig(FakeEngine(), warmAhead=False, documentKv=False).start()
    rig.completer.cursor_moved(URI, 5)
    await asyncio.sleep(SETTLE)
    assert _warmups(rig.engine) == [] and rig.engine.document_pieces_kept == []
    on = await Rig(FakeEngine(), warmAhead=False, documentKv=True).start()
    on.completer.cursor_moved(URI, 5)
    await asyncio.sleep(SETTLE)
    assert _warmups(on.engine) == []
    assert (URI, len(SRC), 5) in on.engine.document_pieces_kept
    await on.complete(5)
    assert on.engine.requests[-1].document_kv  # requests may assemble from the document's KV


async def test_an_edit_away_from_the_session_warms_where_it_ends():
    rig = await Rig(FakeEngine()).start()
    cursor = SRC.index("return")
    await rig.complete(cursor)
    at = SRC.index("import os") + len("import os")
    rig.edit(at, at, ", sys")  # above the session: it ends (an edit in the prefix window)
    await asyncio.sleep(SETTLE)
    (warm,) = _warmups(rig.engine)
    assert warm.prefix.endswith("import os, sys")


async def test_closing_a_document_cancels_its_pending_warm_up_and_forgets_its_pieces():
    rig = await Rig(FakeEngine()).start()
    rig.completer.cursor_moved(URI, 5)
    rig.docs.close(URI)
    rig.completer.closed(URI)
    await asyncio.sleep(SETTLE)
    assert _warmups(rig.engine) == []
    assert rig.engine.documents_forgotten[-1] == URI


async def test_a_document_emptied_forgets_its_pieces_instead_of_warming_an_empty_text():
    rig = await Rig(FakeEngine(), warmAhead=False, documentKv=True).start()
    rig.edit(0, len(SRC), "")
    rig.completer.cursor_moved(URI, 0)
    await asyncio.sleep(SETTLE)
    assert rig.engine.documents_forgotten == [URI]
    assert all(length > 0 for _, length, _ in rig.engine.document_pieces_kept)


# -- every signal a client already gives is a cursor signal (issue #31) --------


async def test_an_edit_below_the_live_window_warms_where_it_ends():
    """A jump-and-edit that leaves the live session alive (the edit is outside its window)
    still says where the person is: a plain LSP client sends nothing else."""
    far = "\n".join(f"line_{k} = {k}" for k in range(400)) + "\n"
    rig = await Rig(FakeEngine(), prefixTokens=16, suffixTokens=16).start(SRC + far)
    cursor = SRC.index("return")
    await rig.complete(cursor)
    assert rig.completer.session(URI).alive
    at = rig.text.index("line_300 = 300") + len("line_300 = 300")
    rig.edit(at, at, "0")  # far below the window: the session stays alive
    assert rig.completer.session(URI).alive
    await asyncio.sleep(SETTLE)
    (warm,) = _warmups(rig.engine)
    assert warm.prefix.endswith("line_300 = 3000")


async def test_typing_at_the_session_cursor_is_no_cursor_signal():
    rig = await Rig(FakeEngine()).start()
    cursor = SRC.index("return")
    await rig.complete(cursor)
    rig.edit(cursor, cursor, "x")
    rig.edit(cursor + 1, cursor + 1, "y")
    rig.edit(cursor + 1, cursor + 2, "")  # a backspace inside the increment
    await asyncio.sleep(SETTLE)
    assert _warmups(rig.engine) == []


async def test_the_first_edit_of_a_document_without_a_session_warms_unless_a_request_follows():
    rig = await Rig(FakeEngine()).start()
    at = SRC.index("return")
    rig.edit(at, at, "z")  # a plain client's first key after opening: no session yet
    await asyncio.sleep(SETTLE)
    (warm,) = _warmups(rig.engine)
    assert warm.prefix.endswith("z")
    quick = await Rig(FakeEngine()).start()
    quick.edit(at, at, "z")
    await quick.complete(at + 1)  # the request follows at once: it is the better warm-up
    await asyncio.sleep(SETTLE)
    assert _warmups(quick.engine) == []


async def test_a_cancelled_request_warms_where_it_was_asked():
    """Neovim 0.12 asks on InsertEnter; a request cancelled before its answer
    ($/cancelRequest) still tells where the person is."""
    slow = FakeEngine(lambda r: "pass\n")
    rig = await Rig(slow).start()
    cursor = SRC.index("return")
    task = asyncio.get_running_loop().create_task(rig.complete(cursor))
    await asyncio.sleep(0)
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        pass
    await asyncio.sleep(SETTLE)
    warms = _warmups(rig.engine)
    assert warms and len(warms[-1].prefix) == cursor


async def test_a_reopened_document_warms_where_the_person_last_was():
    rig = await Rig(FakeEngine()).start()
    cursor = SRC.index("return")
    await rig.complete(cursor)
    rig.docs.close(URI)
    rig.completer.closed(URI)
    rig.version += 1
    rig.open(SRC)
    await asyncio.sleep(SETTLE)
    (warm,) = _warmups(rig.engine)
    assert len(warm.prefix) == cursor
    # Positions past the end after a shorter re-open warm nothing and raise nothing.
    rig.docs.close(URI)
    rig.completer.closed(URI)
    rig.version += 1
    rig.open("x = 1\n")
    await asyncio.sleep(SETTLE)
    assert len(_warmups(rig.engine)) == 1


async def test_a_document_replaced_or_out_of_sync_drops_its_warm_up():
    slow = FakeEngine()
    rig = await Rig(slow).start()
    rig.completer.cursor_moved(URI, SRC.index("return"))
    await asyncio.sleep(SETTLE)
    (warm,) = _warmups(rig.engine)
    state = rig.completer._states[URI]
    assert state.warming is not None
    rig.version += 1
    out = rig.docs.change(URI, rig.version, [FullChange("x = 1\n")])
    rig.completer.changed(URI, out)
    assert state.warming is None


# -- the editors' own requests about the cursor's place (document highlights, code actions) --


async def test_a_place_an_editor_asks_about_is_a_cursor_signal_unless_it_is_where_the_person_types():
    rig = await Rig(FakeEngine()).start()
    cursor = SRC.index("return")
    await rig.complete(cursor)
    assert not rig.completer.position_asked(URI, cursor)  # asked while typing: no news
    assert not rig.completer.position_asked("file:///not-open.py", 3)
    target = SRC.index("import os")
    assert rig.completer.position_asked(URI, target)
    await asyncio.sleep(SETTLE)
    (warm,) = _warmups(rig.engine)
    assert len(warm.prefix) == target
    assert rig.stats.warm_position_signals == 1


async def test_a_repeated_signal_keeps_the_warm_up_in_flight_for_the_same_prompt():
    rig = await Rig(FakeEngine()).start()
    rig.engine.background_gate = threading.Event()  # background requests stay in flight until set
    target = SRC.index("import os")
    assert rig.completer.position_asked(URI, target)
    await asyncio.sleep(SETTLE)
    # asked again: the warm-up's session is there now, so it is no news
    assert not rig.completer.position_asked(URI, target)
    rig.completer.cursor_moved(URI, target)  # a client's cursor notification for the same place
    await asyncio.sleep(SETTLE)
    warm_ups = _warmups(rig.engine)
    rig.engine.background_gate.set()
    assert rig.stats.warm_position_signals == 1
    # the small window's warm-up and the full window's, once each
    assert rig.stats.warm_submitted == 1 and len(warm_ups) == 1 + rig.stats.first_window_warmups
