"""Scheduler rules between owners (editor windows sharing one engine): turns, urgency, layers given
way, warm-ups charged; driven synchronously with `step()` (no engine thread)."""

from __future__ import annotations

import pytest

from engine.scheduling.sequence import Sequence
from scheduler_doubles import Sink, make, job, drain, prompt


@pytest.fixture(scope="module")
def model(tiny_model_factory):
    from engine.model.loader import load_model

    return load_model(str(tiny_model_factory("llama")), dtype="fp32").model


def _owner_job(sink, key, owner, order):
    """A job of `owner` whose end is recorded in `order`."""
    seq = job(sink, key)
    seq.owner = owner
    finish = sink.on_finish

    def on_finish(reason, stats, error):
        order.append(key)
        finish(reason, stats, error)

    sink.on_finish = on_finish
    return seq


def _flood_then_one(model, owners: tuple[str, str]):
    """Owner A floods (six requests of distinct documents); once A's first has begun its
    prefill, owner B sends one. Returns the trace and the order the requests ended in."""
    s = make(model, step=32)
    s.trace = trace = []
    order: list[str] = []
    for i in range(6):
        s.submit(_owner_job(Sink(prompt(200, 20 + i), max_tokens=2), f"a{i}", owners[0], order))
    s.step()  # admits A's six; a0 prefills
    b = _owner_job(Sink(prompt(100, 40), max_tokens=2), "b", owners[1], order)
    s.submit(b)
    drain(s)
    assert b.sink.finished[0] == "length" and len(order) == 7
    s.cache.check_integrity()
    return [(what, key) for what, key, _ in trace if what in ("admit", "prefill")], order


def test_a_flood_of_one_owner_does_not_keep_another_owners_request_waiting(model):
    """Owners (`InfillRequest.owner`, the engine daemon's fronts) take turns: with A's
    backlog of five more documents queued, B's one request prefills right after its
    admission — before any of A's backlog — and ends before any of it. Without owners
    (one owner: the usual order, oldest first) the same request waits for all of A's."""
    steps, order = _flood_then_one(model, ("front1", "front2"))
    b_admitted = steps.index(("admit", "b"))
    prefills = [key for what, key in steps[b_admitted:] if what == "prefill"]
    assert prefills[0] == "b", prefills  # the very next prefill step is B's
    first_of_backlog = min(prefills.index(f"a{i}") for i in range(1, 6))
    assert prefills.index("b") < first_of_backlog
    assert order.index("b") < min(order.index(f"a{i}") for i in range(1, 6)), order

    steps, order = _flood_then_one(model, ("", ""))
    prefills = [key for what, key in steps if what == "prefill"]
    assert all(prefills.index(f"a{i}") < prefills.index("b") for i in range(6)), prefills
    assert order[-1] == "b", order


class _FixedCosts:
    """Turns charged fixed costs instead of measured seconds (a deterministic order): a
    prefill step 10, a decode row 1."""

    def __init__(self, turns):
        self.turns = turns

    def install(self):
        turns = self.turns
        turns.clock = lambda: 0.0  # no decay
        charge = turns.charge  # the class's, bound: charge_rows below calls it, not the patched one
        turns.charge = lambda owner, seconds: charge(owner, 10.0)
        turns.charge_rows = lambda owners, seconds: [charge(owner, 1.0) for owner in owners]


def _decode_a_while_b_arrives(s, a, b, before_b=None) -> tuple[int, int]:
    """Prefill `a` until it decodes, then (after `before_b`) submit `b` and step until `a`
    ends: (steps while `a` decoded, `b`'s prefill steps among them; `s.trace` is set here)."""
    s.trace = trace = []
    s.submit(a)
    while a.n_valid < a.n_prompt:  # a's prompt prefilled: it decodes from now on
        s.step()
    if before_b is not None:
        before_b()
    s.submit(b)
    a_steps = 0
    while a.sink.finished is None:
        s.step()
        a_steps += 1
    return a_steps, sum(1 for what, key, _ in trace if what == "prefill" and key == "b")


def test_an_owner_with_only_decoding_rows_is_not_held_to_one_token_per_prefill_step(model):
    """Owner A decodes while owner B prefills a long window. Without turns every step held
    one of B's prefill steps, so each of A's tokens waited for one; with them A's decode-only
    steps (short) go before B's long prefill although B used the engine less (here nothing
    decays and no time passes: B is never passed over for `PASSED_OVER`), and B's window is
    prefilled once A's answer is done."""
    s = make(model, step=32)
    s.verify_cost = None  # speculation's drafts as long as allowed: no measured timing
    _FixedCosts(s.turns).install()
    s.turns.charge("A", 100.0)  # A: the heavier owner lately
    order: list[str] = []
    a = _owner_job(Sink(prompt(40, 50), max_tokens=20), "a", "A", order)
    b = _owner_job(Sink(prompt(900, 51), max_tokens=1), "b", "B", order)
    a_steps, b_steps = _decode_a_while_b_arrives(s, a, b)
    assert len(a.sink.tokens) == 20
    assert b_steps == 0, (b_steps, a_steps)
    drain(s)
    assert order == ["a", "b"] and b.sink.finished[0] == "length"

    # The same without owners: one of B's prefill steps with each step of A's decoding.
    s = make(model, step=32)
    s.verify_cost = None
    a = job(Sink(prompt(40, 50), max_tokens=20), "a")
    b = job(Sink(prompt(900, 51), max_tokens=1), "b")
    a_steps, b_steps = _decode_a_while_b_arrives(s, a, b)
    assert b_steps >= a_steps - 2, (b_steps, a_steps)  # all but the step that admits it and the one that ends a
    drain(s)


def test_an_urgent_request_has_its_owner_served_until_it_ends(model):
    """A request running `urgent_age` seconds (fairness.URGENT_AGE) has its owner served
    first although that owner used the engine more lately: owner A (heavy) prefills, owner B
    (light) sends a long window while A's long window is still prefilling. While A is not
    urgent, B's lighter usage gives B the prefill steps; once A's request is urgent, B's
    window waits until A's answer is done — a window's slow answer is not stretched to its
    deadline by another's burst."""
    def run(urgent_age: float) -> tuple[int, list[str]]:
        s = make(model, step=32)
        s.verify_cost = None
        s.owner_turns.urgent_age = urgent_age
        s.turns.passed_over = float("inf")  # the order here is usage's and urgency's
        s.trace = trace = []
        order: list[str] = []
        a = _owner_job(Sink(prompt(600, 50), max_tokens=2), "a", "A", order)
        b = _owner_job(Sink(prompt(900, 51), max_tokens=1), "b", "B", order)
        s.submit(a)
        s.step()  # admits a; its first prefill step
        s.turns.charge("A", 100.0)  # A: the heavy owner (it typed a lot lately)
        s.submit(b)
        while a.sink.finished is None:
            s.step()
        b_steps = sum(1 for what, key, _ in trace if what == "prefill" and key == "b")
        drain(s)
        assert a.sink.finished[0] == b.sink.finished[0] == "length"
        return b_steps, order

    b_steps, order = run(float("inf"))  # never urgent: the turns alone (two long prefills alike)
    assert order == ["b", "a"] and b_steps >= 900 // 64, (b_steps, order)  # B (least usage) prefilled all along, done first
    b_steps, order = run(0.0)  # urgent at once: A's owner has every turn until its answer ends
    assert b_steps == 0 and order == ["a", "b"], (b_steps, order)


def test_another_owners_request_waits_for_a_layer_of_a_prefill_step_not_the_step(model):
    """While windows share the engine (`Turns.shared`), a request of another owner arriving
    during a prefill step takes the engine after the layer running then: the step pauses with
    its rows so far written, the newcomer is admitted and prefilled at the next step, and the
    paused step goes on from its layer afterwards — the same answer as without the pause.
    A request's last prefill step samples, so its last row is left to a step of its own and
    the rest may pause: a one-step prompt (a first window) gives way too."""
    for rows in (600, 50):
        _another_owner_waits_for_a_layer(model, rows)


def _another_owner_waits_for_a_layer(model, rows: int) -> None:
    def run(pause: bool) -> tuple[list[int], list[tuple[str, str]], Sequence]:
        s = make(model, step=64)
        s.owner_turns.urgent_age = 1e9  # the order here is the turns', not urgency's (a slow machine ages a)
        s.trace = trace = []
        s.turns.active(["A", "B"])  # both windows had work a moment ago: they share the engine
        order: list[str] = []
        a = _owner_job(Sink(prompt(rows, 60), max_tokens=3), "a", "A", order)
        b = _owner_job(Sink(prompt(50, 61), max_tokens=2), "b", "B", order)
        real, checks = s.owner_turns.other_owner_waiting, []

        def arriving(owner: str, submitted: float) -> bool:  # b arrives while the second layer of a's first step runs
            checks.append(owner)
            if pause and len(checks) == 2:
                s.submit(b)
            return real(owner, submitted)

        s.owner_turns.other_owner_waiting = arriving
        s.submit(a)
        s.step()  # admits a; its first prefill step
        if pause:
            assert a.paused is not None and a.paused.layer == 2 and a.n_valid == 0 and b.sink.finished is None
        else:
            assert a.paused is None and a.n_valid > 0
            s.submit(b)
        drain(s)
        if rows > 64:  # (a one-step prompt is all but done once b is prefilled: either may end first)
            assert order == ["b", "a"]
        assert a.sink.finished[0] == b.sink.finished[0] == "length"
        assert a.sink.finished[1].prefilled_tokens == rows
        s.cache.check_integrity()
        return a.sink.tokens, [(what, key) for what, key, _ in trace if what in ("admit", "prefill")], a

    tokens, steps, _ = run(pause=True)
    assert steps[:4] == [("admit", "a"), ("prefill", "a"), ("admit", "b"), ("prefill", "b")], steps
    plain, _, _ = run(pause=False)
    assert tokens == plain and len(tokens) == 3


def test_turns_serve_the_owner_of_least_recent_usage():
    import math

    from engine.scheduling.fairness import Turns, interleave

    now = [0.0]
    t = Turns(memory=3.0, clock=lambda: now[0])
    assert t.next([]) is None
    assert t.next(["A"]) == "A"
    t.charge("A", 5.0)
    assert t.next(["A", "B"], urgent="A") == "A"  # an urgent request's owner first, whatever its usage
    assert t.next(["A", "B"], urgent="C") == "B"  # (an urgent owner with nothing to run: the usual rule)
    assert t.next(["A", "B"]) == "B"  # B used nothing lately
    t.charge("B", 6.0)
    assert t.next(["A", "B"]) == "A"
    t.charge("A", 1.0)  # A 6, B 6: a tie goes to the one not served last
    assert t.next(["A", "B"]) == "B"
    now[0] += 3.0 * math.log(2)  # usage halves in MEMORY * ln 2
    assert abs(t.used("A") - 3.0) < 1e-9 and abs(t.used("B") - 3.0) < 1e-9
    t.charge_rows(["A", "A", "B"], 3.0)
    assert abs(t.used("A") - 5.0) < 1e-9 and abs(t.used("B") - 4.0) < 1e-9
    assert t.order(["A", "B", "C"]) == ["C", "B", "A"]  # C: none
    now[0] += 100.0
    t.next(["C"])
    assert set(t.usage) == set()  # decayed away: forgotten
    assert t.spent_by_owner() == {"A": 8.0, "B": 7.0}  # what each was charged, not decayed (reported per front)
    items = [("A", 1), ("A", 2), ("A", 3), ("B", 1), ("C", 1), ("B", 2)]
    assert interleave(items, lambda x: x[0], ["B"]) == [("B", 1), ("A", 1), ("C", 1), ("B", 2), ("A", 2), ("A", 3)]
    assert interleave(items[:3], lambda x: x[0]) == items[:3]

    # An owner that ran alone for long (the engine busy all the time) waits a bounded time
    # for a heavy newcomer: about MEMORY * ln 2, while the newcomer's usage catches up with
    # its decaying one — not as long as it ran alone.
    now[0] = 0.0
    t = Turns(memory=3.0, clock=lambda: now[0])
    for _ in range(600):  # 60 s alone, in 0.1 s steps
        assert t.next(["A"]) == "A"
        t.charge("A", 0.1)
        now[0] += 0.1
    waited = 0
    while t.next(["A", "B"]) == "B":
        t.charge("B", 0.1)
        now[0] += 0.1
        waited += 1
    assert 0 < waited * 0.1 <= 3.0 * math.log(2) + 0.2, waited

    # An owner back from idle (a window between keystrokes) gets the sleeper's credit: one
    # that never pauses (a burst) does not.
    now[0] = 0.0
    t = Turns(memory=3.0, clock=lambda: now[0])
    t.next(["A", "B"])
    t.charge("A", 2.0)
    t.charge("B", 1.5)
    assert t.next(["A", "B"]) == "B"
    assert t.next(["B"]) == "B"  # A has nothing to run for a moment
    assert t.next(["A", "B"]) == "A" and abs(t.used("A") - (2.0 - t.wake_credit)) < 1e-9
    assert abs(t.used("B") - 1.5) < 1e-9


def test_a_burst_whose_request_was_superseded_gets_no_sleepers_credit():
    """An owner whose last request was cancelled moments ago (superseded by its next: a burst
    of jumps) is not back from idle when its next one runs; one whose request was answered
    is, and so is one that stayed away past `REPLACED_WITHIN` after a cancel."""
    from engine.scheduling.fairness import REPLACED_WITHIN, Turns

    now = [0.0]
    t = Turns(memory=3.0, clock=lambda: now[0])
    t.next(["A", "B"])
    t.charge("A", 1.9)
    t.charge("B", 2.0)
    t.ended("B", cancelled=True)  # B's request superseded; its replacement not admitted yet
    assert t.next(["A"]) == "A"
    assert t.next(["A", "B"]) == "A"  # B's replacement runs: no credit, so A (less usage) goes first
    assert abs(t.used("B") - 2.0) < 1e-9
    t.ended("A", cancelled=False)  # A answered, then back with its next keystroke
    assert t.next(["B"]) == "B"
    assert t.next(["A", "B"]) == "A" and abs(t.used("A") - (1.9 - t.wake_credit)) < 1e-9
    t.ended("B", cancelled=True)
    assert t.next(["A"]) == "A"
    t.cancelled_at["B"] -= REPLACED_WITHIN  # B stayed away after its cancel: idle again
    assert t.next(["A", "B"]) in ("A", "B") and abs(t.used("B") - (2.0 - t.wake_credit)) < 1e-9


def test_a_warm_up_alone_is_charged_to_its_owner(model):
    """A warm-up's steps are its owner's engine time whether they run beside requests or alone
    (a window jumping 20 times a second leaves a warm-up behind each jump: its usage must show
    it, or a window typing beside it looks the heavier one)."""
    s = make(model, step=64)
    warm = _owner_job(Sink(prompt(300, 62), max_tokens=2), "w", "B", [])
    warm.background = True
    s.submit(warm)
    drain(s)
    assert warm.sink.finished is not None and warm.prefilled == 300
    assert s.turns.spent_by_owner().get("B", 0.0) > 0.0


def test_a_prefill_step_gives_way_at_a_layer_when_another_owners_request_turns_urgent(model):
    """A request of another owner that has been running `URGENT_AGE` has every turn until it
    ends; a prefill step begun before it turned urgent gives way at the next layer instead of
    running to its end."""
    s = make(model, step=64)
    s.turns.active(["A", "B"])  # both windows had work a moment ago: they share the engine
    s.owner_turns.urgent_age = 1e9  # nobody urgent yet
    order: list[str] = []
    b = _owner_job(Sink(prompt(20, 63), max_tokens=40), "b", "B", order)
    s.submit(b)
    for _ in range(50):
        s.step()
        if b in s._decoding:
            break
    assert b in s._decoding
    # a: a keystroke's short prompt (a step alike B's decode-only one: the least usage's turn)
    a = _owner_job(Sink(prompt(50, 64), max_tokens=2), "a", "A", order)
    real, checks = s.owner_turns.other_owner_waiting, []

    def turning(owner: str, submitted: float) -> bool:  # b turns urgent while the second layer of a's step runs
        checks.append(owner)
        if len(checks) == 2:
            s.owner_turns.urgent_age = 0.0
        return real(owner, submitted)

    s.owner_turns.other_owner_waiting = turning
    s.submit(a)
    s.step()  # admits a; its first prefill step (A has used nothing: its turn) gives way at layer 2
    assert a.paused is not None and a.paused.layer == 2 and a.n_valid == 0
    drain(s)
    assert order == ["b", "a"] and a.sink.finished[1].prefilled_tokens == 50


def test_a_step_gives_way_only_to_an_older_urgent_request_of_another_owner():
    """`OwnerTurns.other_owner_waiting`: a new arrival of another owner, or another owner's
    urgent request older than the one stepping; never a younger one (the stepping request,
    the older, would be served again) nor the owner's own."""
    import collections
    import threading
    import time
    from types import SimpleNamespace

    from engine.scheduling.fairness import Turns
    from engine.scheduling.turn_taking import OwnerTurns

    now = time.perf_counter()
    req = lambda owner, age, background=False: SimpleNamespace(owner=owner, background=background, submitted=now - age)  # noqa: E731
    inbox, decoding = collections.deque(), []
    turns = OwnerTurns(Turns(), inbox, threading.Condition(), [], decoding)
    turns.urgent_age = 0.25
    decoding.extend([req("B", 0.5), req("A", 2.0), req("C", 0.9, background=True)])
    assert turns.other_owner_waiting("A", now - 0.1)  # B's urgent request is older than A's 0.1 s one
    assert not turns.other_owner_waiting("A", now - 1.0)  # ... younger than A's 1 s one
    assert turns.other_owner_waiting("B", now - 0.1)  # A's 2 s request is older and urgent
    assert not turns.other_owner_waiting("C", now - 3.0)  # nothing older than 3 s; C's own warm-up never counts
    inbox.append(req("C", 0.0))
    assert turns.other_owner_waiting("A", now - 1.0)  # a new arrival of another owner


def test_a_short_step_goes_first_and_an_owner_passed_over_gets_a_turn():
    """`Turns.next`: an owner whose step is short (a decode-only step, a keystroke's few rows)
    goes before another's long prefill whatever their usage; an owner with work passed over
    for `PASSED_OVER` gets the next step; among steps alike, the least recent usage; an
    urgent request's owner before all."""
    from engine.scheduling.fairness import PASSED_OVER, Turns

    now = [0.0]
    t = Turns(memory=3.0, clock=lambda: now[0])
    t.charge("A", 5.0)  # A: the heavy owner lately
    assert t.next(["A", "B"], short={"A"}) == "A"
    now[0] += PASSED_OVER / 2
    assert t.next(["A", "B"], short={"A"}) == "A"
    now[0] += PASSED_OVER / 2  # B has had work and no step for PASSED_OVER
    assert t.next(["A", "B"], short={"A"}) == "B"
    assert t.next(["A", "B"], short={"A"}) == "A"  # served, B waits again from now
    assert t.next(["A", "B"], short={"A", "B"}) == "B"  # steps alike: the least usage
    assert t.next(["A", "B"], short={"B"}, urgent="A") == "A"
    now[0] += PASSED_OVER  # B passed over since the urgent step
    assert t.next(["A", "B"], short={"B"}) == "B"
    assert t.next(["A", "B"], short={"B"}) == "B"  # short, and A waited no time yet
    now[0] += PASSED_OVER
    assert t.next(["A", "B"], short={"B"}) == "A"  # now A is the one passed over
    now[0] += PASSED_OVER
    assert t.next(["B"]) == "B"  # A had nothing to run: no longer waiting
    assert t.next(["A", "B"], short={"B"}) == "B"
    t.served_all(["A", "B"])  # a step decoding everyone's rows: nobody passed over
    now[0] += PASSED_OVER / 2
    assert t.next(["A", "B"], short={"B"}) == "B"

    # An owner with nothing but a warm-up (`warm_only`) takes turns like a long prefill, and is
    # never owed a step for having been passed over.
    now[0] = 0.0
    t = Turns(memory=3.0, clock=lambda: now[0])
    assert t.next(["B"], short={"B"}, warm_only=["A"]) == "B"
    now[0] += 2 * PASSED_OVER
    assert t.next(["B"], short={"B"}, warm_only=["A"]) == "B"
    t.charge("B", 1.0)
    assert t.next(["B"], warm_only=["A"]) == "A"  # both long: A used less


def test_a_step_beside_another_owners_running_request_is_short(model):
    """While another owner's request is running, a request's prefill step is sized to about
    `interleaved_step_seconds` (each of that request's next steps waits for it), not
    `shared_step_seconds`."""
    s = make(model, step=256)
    s.steps.prefill_rate.rows_per_s = 10_000.0  # a measured rate: 0.15 s would be 1,500 rows
    s.turns.active(["A", "B"])  # both windows had work a moment ago: they share the engine
    b = _owner_job(Sink(prompt(900, 70), max_tokens=1), "b", "B", [])
    s.submit(b)
    s._take_arrivals()
    s._admit(b)
    assert s._foreground_step_rows(b) == 256  # the usual step, at most
    a = _owner_job(Sink(prompt(20, 71), max_tokens=30), "a", "A", [])
    s._decoding.append(a)  # (A's request decoding)
    assert s._foreground_step_rows(b) == int(10_000 * s.interleaved_step_seconds) // 32 * 32
    s._decoding.remove(a)
    drain(s)


def test_a_window_served_beside_another_windows_short_step_gets_no_warm_up_slice():
    """`OwnerTurns.warm_up_for`: while windows share the engine, the served owner's warm-up gets
    a slice only while no other owner's request waits with a short step (a burst's window,
    given a step between a typing window's tokens because it was passed over, does not also
    run its warm-up there), and still beside another's long prefill; alone, the oldest
    warm-up whoever's it is."""
    import collections
    import threading
    from types import SimpleNamespace

    from engine.scheduling.fairness import Turns
    from engine.scheduling.turn_taking import OwnerTurns

    seq = lambda owner, background: SimpleNamespace(owner=owner, background=background, idle_only=False)  # noqa: E731
    warm, typing = seq("B", True), seq("A", False)
    prefilling, decoding = [warm], [typing]
    turns = OwnerTurns(Turns(), collections.deque(), threading.Condition(), prefilling, decoding)
    assert turns.warm_up_for("A") is warm  # one window: the oldest warm-up
    turns.turns.active(["A", "B"])  # both windows had work a moment ago
    assert turns.warm_up_for("A") is None  # not A's
    assert turns.warm_up_for("B") is None  # B's, but A's request is decoding (short steps)
    decoding.clear()
    assert turns.warm_up_for("B") is warm
    window = SimpleNamespace(owner="A", background=False, idle_only=False, blend=None, tokens=[0] * 500, n_valid=0)
    prefilling.append(window)  # A's request prefills a long window: B's warm-up still gets its slice
    assert turns.warm_up_for("B") is warm
    window.n_valid = 480  # ... its last 20 rows: a short step
    assert turns.warm_up_for("B") is None


def test_a_window_with_only_a_warm_up_takes_turns_with_another_windows_requests(model):
    """While windows share the engine, an owner with no request running has its warm-up take
    turns like a long prefill of its own (another window that never stops sending requests
    would otherwise keep it waiting for as long as it lasts); one owner alone keeps the usual
    order, its warm-up after its requests."""
    def run(owners: tuple[str, str]) -> list[str]:
        s = make(model, step=32)
        s.owner_turns.urgent_age = 1e9
        if owners[0] != owners[1]:
            s.turns.active(list(owners))  # both windows had work a moment ago: they share the engine
        s.trace = trace = []
        warm = _owner_job(Sink(prompt(300, 90), max_tokens=0), "w", owners[0], [])
        warm.background = True
        request = _owner_job(Sink(prompt(600, 91), max_tokens=1), "r", owners[1], [])
        s.submit(warm)
        s.submit(request)
        while request.sink.finished is None:
            s.step()
        drain(s)
        assert warm.sink.finished[0] == "length" and warm.prefilled == 300
        return [key for what, key, _ in trace if what == "prefill"]

    prefills = run(("A", "B"))
    assert prefills.index("w") < len(prefills) - 1 - prefills[::-1].index("r"), prefills  # A's warm-up began before B's request ended
    prefills = run(("", ""))
    assert prefills.index("w") > prefills.index("r") and all(k == "w" for k in prefills[prefills.index("w"):]), prefills
