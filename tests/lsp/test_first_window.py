"""First answers at a new place (efim_lsp.first_window): a small window of the same session
answers while the full window is prefilled in the background (fake engine)."""

from __future__ import annotations

import asyncio
import threading

from efim_lsp.completer import Answer
from efim_lsp.first_window import ComputedPrompts, first_window_key, small_window
from efim_lsp.session import Segments
from efim_lsp.window import TokenMeter

from lsp_fakes import CHARS_PER_TOKEN, FakeEngine, render
from test_completer import URI, Rig

# A long file: 400 functions, the cursor in the middle of it (far from either end).
LONG = "".join(f"def f{i}(x):\n    y = x * {i}\n    return y + {i}\n\n" for i in range(400))
MIDDLE = LONG.index("def f200(")
JUMP = LONG.index("def f300(")
SMALL = 128  # firstWindowTokens in these tests


def _requests(engine: FakeEngine):
    """The document's requests (not the engine's first request after the load)."""
    return [r for r in engine.requests if r.key.startswith("file:")]


def _foreground(engine: FakeEngine):
    return [r for r in _requests(engine) if not r.background]


def _background(engine: FakeEngine):
    return [r for r in _requests(engine) if r.background]


async def _rig(**settings) -> Rig:
    engine = FakeEngine(lambda r: "pass\n")
    engine.background_gate = threading.Event()
    return await Rig(engine, **{"firstWindowTokens": SMALL, **settings}).start(LONG)


async def _until(predicate, timeout: float = 5.0) -> None:
    for _ in range(int(timeout / 0.005)):
        if predicate():
            return
        await asyncio.sleep(0.005)
    raise AssertionError("condition not reached")


async def test_a_cold_place_is_answered_from_the_small_window_while_the_full_one_warms():
    rig = await _rig()
    answer = await rig.complete(MIDDLE)
    assert isinstance(answer, Answer)
    (warm,) = _background(rig.engine)
    (small,) = _foreground(rig.engine)
    assert warm.key == URI and warm.increment == ""  # the full window, in the background
    assert small.key == first_window_key(URI)
    assert warm.prefix.endswith(small.prefix) and warm.suffix.startswith(small.suffix)
    assert len(small.prefix) < len(warm.prefix) / 4 and LONG[: MIDDLE - len(small.prefix)].endswith("\n")
    assert len(render(small)) / CHARS_PER_TOKEN <= SMALL * 1.2
    assert rig.stats.first_window_answers == 1
    # The answer's request reaches the engine before the warm-up: submitted after it, it
    # waited for the warm-up's first prefill step to pause.
    assert _requests(rig.engine).index(small) < _requests(rig.engine).index(warm)


async def test_keystrokes_keep_the_same_small_window_until_the_warm_up_has_run_then_use_the_full_one():
    rig = await _rig()
    cursor = MIDDLE
    await rig.complete(cursor)
    for ch in "ab":
        rig.edit(cursor, cursor, ch)
        cursor += 1
        await rig.complete(cursor)
    smalls = _foreground(rig.engine)
    assert [r.key for r in smalls] == [first_window_key(URI)] * 3
    assert len({(r.prefix, r.suffix) for r in smalls}) == 1  # one small window: each prompt extends the last
    assert render(smalls[2]).startswith(render(smalls[1])[: -len("a")])
    assert [r.increment for r in smalls] == ["", "a", "ab"]
    assert len(_background(rig.engine)) == 1  # one warm-up for the session, never cancelled
    warm = _background(rig.engine)[0]
    rig.engine.background_gate.set()
    await _until(lambda: rig.stats.warm_completed == 1)
    rig.edit(cursor, cursor, "c")
    cursor += 1
    await rig.complete(cursor)
    full = rig.engine.requests[-1]
    assert full.key == URI and not full.background and full.increment == "abc"
    assert (full.prefix, full.suffix) == (warm.prefix, warm.suffix)
    assert rig.stats.first_window_answers == 3


async def test_a_place_whose_full_window_was_computed_gets_the_full_window_at_once():
    rig = await _rig()
    rig.engine.background_gate.set()
    # Back and forth: the token meter calibrates on the first visits (a window cut with a
    # different chars-per-token ratio starts elsewhere, and is rightly cold).
    for place in (len(LONG) // 10, MIDDLE, JUMP, MIDDLE, JUMP):
        await rig.complete(place)
        await _until(lambda: rig.stats.warm_completed + rig.stats.warm_cancelled == rig.stats.warm_submitted)
    before = len(_requests(rig.engine))
    await rig.complete(MIDDLE)  # back where the full window was computed
    (back,) = _requests(rig.engine)[before:]
    assert back.key == URI and not back.background
    assert rig.stats.first_window_answers >= 3


async def test_off_when_the_setting_is_zero_or_the_whole_window_is_small():
    off = await _rig(firstWindowTokens=0)
    await off.complete(MIDDLE)
    assert [(r.key, r.background) for r in _requests(off.engine)] == [(URI, False)]
    short = FakeEngine(lambda r: "pass\n")
    rig = await Rig(short, firstWindowTokens=SMALL).start("def f(x):\n    \n    return x\n")
    await rig.complete(14)
    assert [r.key for r in _requests(short)] == [URI]


async def test_off_on_a_backend_that_pins_each_key_to_a_server_slot():
    engine = FakeEngine(lambda r: "pass\n")
    engine.pins_slots = True
    rig = await Rig(engine, firstWindowTokens=SMALL).start(LONG)
    await rig.complete(MIDDLE)
    assert [(r.key, r.background) for r in _requests(engine)] == [(URI, False)]


async def test_off_without_warm_ahead_or_cache():
    for settings in ({"warmAhead": False}, {"cache": False}):
        rig = await _rig(**settings)
        await rig.complete(MIDDLE)
        assert [r.key for r in _requests(rig.engine)] == [URI], settings


def test_the_small_window_is_a_cut_at_line_starts_within_its_budget():
    meter = TokenMeter(lambda text: len(text) // 3)
    prefix, suffix = LONG[:MIDDLE], LONG[MIDDLE:]
    win = small_window(Segments(prefix, suffix, "", 7, True, None), 200, meter)
    assert win.session_id == 7 and prefix.endswith(win.prefix) and suffix.startswith(win.suffix)
    assert (LONG[: MIDDLE - len(win.prefix)]).endswith("\n")  # cut at a line start
    assert meter.tokens(win.prefix) <= 150 and meter.tokens(win.suffix) <= 50
    assert meter.tokens(win.prefix) >= 100  # most of the budget is used


def test_computed_prompts_measure_what_a_full_request_would_prefill():
    known = ComputedPrompts()
    assert known.uncached_chars("abcdef") == 6
    known.add("abcXYZ")
    known.add("abcdeQ")
    assert known.uncached_chars("abcdef") == 1  # shares "abcde" with the second
    assert known.uncached_chars("zzz") == 3
    for i in range(10):
        known.add(f"other{i}")
    assert known.uncached_chars("abcdef") == 6  # only the last few places are kept


async def test_an_edit_at_a_cold_place_warms_its_small_window_first_and_the_request_after_a_pause_extends_it():
    """A plain client's jump: delete a line's tail (a didChange away from the session), pause,
    retype. The edit warms the small window, then the full one; the request that follows is
    answered from the small window, whose prompt it extends (what the warm-up computed).
    (No answer ahead: its foreground request at the edit raced the one asked for here.)"""
    rig = await _rig(answerAhead=False)
    await rig.complete(MIDDLE)  # the session lives at MIDDLE
    await _until(lambda: len(_background(rig.engine)) == 1)
    line_end = LONG.index("\n", JUMP)
    rig.edit(line_end - 4, line_end, "")  # "(x):" deleted: the edit ends at the new place
    cursor = line_end - 4
    await _until(lambda: len(_background(rig.engine)) == 3)
    small_warm, full_warm = _background(rig.engine)[1:]
    assert small_warm.key == first_window_key(URI) and full_warm.key == URI  # the small one first
    assert full_warm.prefix.endswith(small_warm.prefix) and full_warm.suffix.startswith(small_warm.suffix)
    assert rig.stats.first_window_warmups == 1  # (a request answers from its small window itself)
    rig.edit(cursor, cursor, "(")
    cursor += 1
    await rig.complete(cursor)  # (the fake's "pass" is no answer after "def f300(": shaped away)
    request = _foreground(rig.engine)[-1]
    assert request.key == first_window_key(URI) and (request.prefix, request.suffix) == (small_warm.prefix, small_warm.suffix)
    assert render(request).startswith(render(small_warm)) and request.increment == "("
    assert len(_background(rig.engine)) == 3  # the full warm-up of the session goes on


async def test_a_backspace_after_a_warmed_landing_is_seen_by_the_small_window():
    """Suffix-first (the prefix last): a Backspace past the anchor moves the anchor back and
    the session's prefix loses its end. The small window warmed at the landing must lose the
    same end — the deleted character was offered back as if it were still there (an empty or
    wrong first answer after a signalled jump)."""
    engine = FakeEngine(lambda r: "pass\n")
    engine.suffix_first = True
    engine.background_gate = threading.Event()
    rig = await Rig(engine, **{"firstWindowTokens": SMALL, "answerAhead": False}).start(LONG)  # (see above)
    await rig.complete(MIDDLE)
    line_end = LONG.index("\n", JUMP)  # "def f300(x):|"
    rig.completer.cursor_moved(URI, line_end)
    await _until(lambda: any(r.key == first_window_key(URI) for r in _background(rig.engine)))
    small_warm = next(r for r in _background(rig.engine) if r.key == first_window_key(URI))
    assert small_warm.prefix.endswith("def f300(x):")
    rig.edit(line_end - 1, line_end, "")  # Backspace: ":" deleted
    await rig.complete(line_end - 1)
    request = _foreground(rig.engine)[-1]
    assert request.key == first_window_key(URI)
    text = rig.docs.get(URI).text
    assert (request.prefix + request.increment).endswith("def f300(x)") and text[: line_end - 1].endswith(request.prefix + request.increment)
    assert request.prefix == small_warm.prefix[:-1]  # the same head: its rows stay computed
    assert request.suffix == small_warm.suffix


async def test_a_place_already_computed_gets_no_small_window_warm_up():
    rig = await _rig()
    rig.engine.background_gate.set()
    await rig.complete(MIDDLE)
    await _until(lambda: rig.stats.warm_completed == 1)
    smalls = rig.stats.first_window_warmups
    rig.completer.cursor_moved(URI, MIDDLE + 1)  # the same session's window, computed
    await asyncio.sleep(0.1)
    assert rig.stats.first_window_warmups == smalls


def test_the_small_window_does_not_depend_on_what_the_session_meter_counted_before():
    """Cut at a cursor signal or at the first request, the small window is the same: it is cut
    with a fresh meter, not with the session's (whose ratio moves with every count)."""
    segments = Segments(LONG[:MIDDLE], LONG[MIDDLE:], "", 3, True, None)
    meter = TokenMeter(lambda text: len(text) // 2 + text.count("\n") * 3)
    sample = LONG[MIDDLE - 3000 : MIDDLE + 1000]
    first = small_window(segments, SMALL, meter.calibrated(sample))
    meter.tokens("x" * 5000)  # a dense count moves the session meter's ratio
    assert meter.calibrated(sample).chars_per_token == len(sample) / (len(sample) // 2 + sample.count("\n") * 3)
    assert meter.chars_per_token != meter.calibrated(sample).chars_per_token
    assert small_window(segments, SMALL, meter.calibrated(sample)) == first


async def test_a_signal_in_another_document_ends_the_warm_ups_where_the_person_was():
    """Background prefills run in arrival order: the full window still warming in the file the
    person left would hold back the small window where they are now. It ends instead (its rows
    stay retained with its document)."""
    rig = await _rig()
    rig.completer.cursor_moved(URI, JUMP)
    await _until(lambda: len(_background(rig.engine)) == 2)  # small + full, held at the gate
    left = [h for h in rig.engine.handles if h.request.background and h.request.key.startswith(URI)]
    other = "file:///other.py"
    rig.docs.open(other, "python", 0, LONG)
    rig.completer.opened(other)
    rig.completer.cursor_moved(other, MIDDLE)
    await _until(lambda: any(r.key.startswith(other) for r in rig.engine.requests if r.background))
    assert len(left) == 2
    await _until(lambda: all(h.done for h in left))  # cancelled (the fake ends them on its own thread)
    assert rig.stats.warm_left == 2
    # the document the person is in keeps its own
    mine = [h for h in rig.engine.handles if h.request.background and h.request.key.startswith(other)]
    assert mine and not any(h.done for h in mine)
    rig.engine.background_gate.set()
