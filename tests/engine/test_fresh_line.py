"""The fresh-line rule: a whitespace-only answer cannot end while the rule is on
(engine.text.sampler.FreshLine / Sampler), and nothing changes when it is off."""

from __future__ import annotations

import pytest
import torch

from engine.api import InfillRequest
from engine.local import load_engine
from engine.text.sampler import FreshLine, Sampler

# A 6-token vocabulary: 0 "\n", 1 "    ", 2 "x", 3 " = 1", 4 "\n\n", 5 an end token.
ENDS = torch.tensor([True, False, False, False, True, True])
BLANK = torch.tensor([False, True, False, False, False, False])
MASKS = FreshLine(ENDS, BLANK)


def _row(*weights: float) -> torch.Tensor:
    return torch.log(torch.tensor(weights))


def test_greedy_refuses_ends_while_blank_then_is_plain_greedy():
    s = Sampler(fresh_line=MASKS)
    assert not s.greedy and s.constrained  # the scheduler's argmax shortcut must not bypass it
    wants_newline = _row(0.6, 0.2, 0.1, 0.05, 0.04, 0.01)
    assert s.sample(wants_newline) == 1  # "    ": still blank, the rule stays on
    assert s.constrained and s.fresh_line_applied
    assert s.sample(_row(0.5, 0.1, 0.3, 0.05, 0.04, 0.01)) == 2  # "x": text, the rule is lifted
    assert not s.constrained and s.greedy
    assert s.sample(wants_newline) == 0  # plain greedy afterwards


def test_sampled_choices_never_end_a_blank_answer():
    logits = _row(0.4, 0.2, 0.1, 0.1, 0.1, 0.1)
    for seed in range(40):
        s = Sampler(1.0, 0.9, seed, fresh_line=MASKS)
        for _ in range(6):
            if not s.constrained:
                break
            assert not bool(ENDS[s.sample(logits)])


def test_without_the_rule_nothing_changes():
    logits = _row(0.6, 0.2, 0.1, 0.05, 0.04, 0.01)
    assert Sampler().greedy and Sampler().sample(logits) == 0
    plain, ruled = Sampler(1.0, 0.95, 3), Sampler(1.0, 0.95, 3, fresh_line=None)
    assert [plain.sample(logits) for _ in range(30)] == [ruled.sample(logits) for _ in range(30)]


def test_healing_allowed_set_is_intersected():
    s = Sampler(fresh_line=MASKS)
    logits = _row(0.7, 0.1, 0.05, 0.1, 0.04, 0.01)
    assert s.sample(logits, allowed=torch.tensor([0, 3, 4])) == 3  # "\n" refused inside the healed set
    # An allowed set holding only end tokens: the rule gives way rather than fail.
    s = Sampler(fresh_line=MASKS)
    assert s.sample(logits, allowed=torch.tensor([0, 4])) == 0 and not s.constrained


def test_a_healed_line_break_is_judged_on_what_the_token_adds():
    """Healing dropped a lone "\n" (the prompt ended at a line start): the first token must
    start with "\n"; under the rule it may not add another line break, and "\n" plus
    indentation is blank (the rule stays on), not an end."""
    table = [b"\n", b"    ", b"x", b" = 1", b"\n\n", b"", b"\n        ", b"\nx"]
    ends = torch.tensor([True, False, False, False, True, True, True, True])
    blank = torch.tensor([False, True, False, False, False, False, False, False])
    masks = FreshLine(ends, blank, table)
    allowed = torch.tensor([0, 4, 6, 7])  # every token starting with b"\n"
    first = masks.healed(allowed)
    assert first.ends.tolist() == [False, True, False, False] and first.blank.tolist() == [True, False, True, False]
    logits = _row(0.02, 0.02, 0.02, 0.02, 0.5, 0.02, 0.3, 0.1)  # the model wants "\n\n" (a blank line)
    s = Sampler(fresh_line=masks)
    assert s.sample(logits, allowed=allowed) == 6 and s.constrained  # "\n" + indentation, still blank
    assert s.sample(_row(0.5, 0.1, 0.3, 0.05, 0.02, 0.01, 0.01, 0.01)) == 2  # then text
    # Without the token table the whole text is judged: every break-led token would end.
    assert Sampler(fresh_line=FreshLine(ends, blank)).sample(logits, allowed=allowed) == 4


def test_a_healed_text_still_being_spelled_out_is_judged_after_its_rest():
    """Multi-token healing of "\n    " (line break and indentation dropped): a token that
    spells only a first part of it ("\n") adds nothing and stays blank, one that covers it
    is judged on what follows ("\n    x" has text; "\n    \n" ends the line)."""
    table = [b"\n", b"\n    x", b"\n    \n", b"", b"\n        "]
    ends = torch.tensor([True, True, True, True, True])
    blank = torch.tensor([False, False, False, False, False])
    masks = FreshLine(ends, blank, table)
    allowed = torch.tensor([0, 1, 2, 4])
    judged = masks.healed(allowed, b"\n    ")
    assert judged.ends.tolist() == [False, False, True, False] and judged.blank.tolist() == [True, False, False, True]
    logits = _row(0.1, 0.2, 0.6, 0.05, 0.05)  # the model wants the blank line
    s = Sampler(fresh_line=masks)
    assert s.sample(logits, allowed=allowed, healed=b"\n    ") == 1 and not s.constrained


def test_the_table_positions_judge_a_healed_set_as_the_bytes_do():
    """`FreshLine.with_table` (two comparisons per token) classifies a healed set exactly as
    the byte-by-byte reading does, whatever the healed text."""
    table = [b"\n", b"    ", b"x", b" = 1", b"\n\n", b"", b"\n        ", b"\nx", b" ", b"  \n", b"\r\n  ", b" \tx "]
    ends = torch.tensor([b"\n" in b or b"\r" in b for b in table])
    blank = torch.tensor([bool(b) and not b.strip() and b"\n" not in b for b in table])
    fast, slow = FreshLine.with_table(ends, blank, table), FreshLine(ends, blank, table)
    for rest in (b"", b" ", b"  ", b"\n", b"\n  ", b"    "):
        allowed = torch.tensor([i for i, b in enumerate(table) if b and (b.startswith(rest) or rest.startswith(b))])
        if not allowed.numel():
            continue
        a, b = fast.healed(allowed, rest), slow.healed(allowed, rest)
        assert a.ends.tolist() == b.ends.tolist() and a.blank.tolist() == b.blank.tolist(), rest
        # and as the bytes after `rest` read
        after = [table[i][len(rest):] for i in allowed.tolist()]
        assert a.ends.tolist() == [b"\n" in r or b"\r" in r for r in after], rest
        assert a.blank.tolist() == [not r.strip() and b"\n" not in r and b"\r" not in r for r in after], rest


def test_guard_lets_a_confident_blank_line_through():
    sure = _row(0.97, 0.01, 0.01, 0.005, 0.004, 0.001)
    assert Sampler(fresh_line=MASKS, guard=0.9).sample(sure) == 0  # P(blank) 0.975 >= 0.9
    assert Sampler(fresh_line=MASKS, guard=1.0).sample(sure) == 1
    # Accumulated along the path: 0.5 now, then P("    ") 0.3 x 0.9 later = 0.77 >= 0.7.
    s = Sampler(fresh_line=MASKS, guard=0.7)
    assert s.sample(_row(0.5, 0.3, 0.1, 0.05, 0.04, 0.01)) == 1
    assert s.sample(_row(0.9, 0.05, 0.03, 0.01, 0.005, 0.005)) == 0
    with pytest.raises(ValueError):
        Sampler(fresh_line=MASKS, guard=0.0)


def test_masks_sized_to_a_padded_head():
    m = MASKS.sized(8)
    assert m.ends.tolist()[6:] == [False, False] and m.ends.shape[0] == 8
    s = Sampler(fresh_line=MASKS)
    logits = torch.cat([_row(0.6, 0.2, 0.1, 0.05, 0.04, 0.01), torch.full((2,), -1e9)])
    assert s.sample(logits) == 1


@pytest.fixture(scope="module")
def engine(tiny_model_factory):
    eng = load_engine(str(tiny_model_factory("llama")), threads=1)
    yield eng
    eng.close()


def test_prompt_builder_classes(engine):
    fl = engine.prompts.fresh_line(engine.end_ids)
    table = engine.prompts.tokenizer.vocab.token_bytes
    for i in range(len(table)):
        if b"\n" in table[i] or b"\r" in table[i] or i in engine.end_ids:
            assert fl.ends[i] and not fl.blank[i]
        elif table[i] and not table[i].strip():
            assert fl.blank[i]
        else:
            assert not fl.blank[i] and not fl.ends[i]
    assert fl.ends.any() and fl.blank.any()


PREFIX = "def f(x):\n    if x:\n"
SUFFIX = "\n        return x\n    return 0\n"


def _req(**kw) -> InfillRequest:
    base = dict(key="k", prefix=PREFIX, suffix=SUFFIX, format="fim", context="off", max_tokens=12, cache=False)
    return InfillRequest(**{**base, **kw})


def test_engine_answers_are_never_blank_under_the_rule(engine):
    """A random tiny model: with the rule, every request's (and every alternative's) text has
    something other than whitespace before any line break; greedy output without the rule is
    what plain greedy decoding gives (the rule's flag off changes nothing)."""
    for seed in range(4):
        done = engine.submit(_req(fresh_line=True, fresh_line_guard=1.0, n=3, seed=seed, temperature=0.0 if seed % 2 else 0.8)).result(timeout=60)
        for text in (done.text, *done.alternatives):
            first = text.split("\n", 1)[0]
            assert first.strip() or done.finish_reason == "length", (text, done.finish_reason)
    plain = engine.submit(_req()).result(timeout=60)
    off = engine.submit(_req(fresh_line=False, speculate=0)).result(timeout=60)
    assert plain.text == off.text


def test_speculation_after_the_rule_lifts_gives_plain_greedy_output(engine):
    """Prompt-lookup speculation starts once the rule has lifted (the sampler is greedy
    again) and verifies with argmax: same text as decoding without speculation."""
    for prefix in (PREFIX, PREFIX + "        y = x\n", "class A:\n    def f(self):\n"):
        kw = dict(prefix=prefix, fresh_line=True, fresh_line_guard=1.0, max_tokens=24)
        spec = engine.submit(_req(speculate=6, **kw)).result(timeout=60)
        plain = engine.submit(_req(speculate=0, **kw)).result(timeout=60)
        assert spec.text == plain.text
