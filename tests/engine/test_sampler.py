"""Sampler choices and stop rules."""

from __future__ import annotations

import time

import pytest
import torch

from engine.text.sampler import Sampler, StopRules, greedy_batch


def test_greedy_and_allowed_mask():
    logits = torch.tensor([0.0, 5.0, 1.0, 3.0])
    s = Sampler()
    assert s.sample(logits) == 1
    assert s.sample(logits, allowed=torch.tensor([0, 2, 3])) == 3
    assert greedy_batch(torch.stack([logits, -logits])) == [1, 0]


def test_seeded_sampling_is_reproducible_and_respects_top_p():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    draws = lambda seed: [Sampler(1.0, 1.0, seed).sample(logits) for _ in range(1)] + [
        x for x in _many(Sampler(1.0, 1.0, seed), logits, 50)
    ]
    assert draws(7) == draws(7)
    # top_p=0.6 keeps tokens 0 and 1 only (0.5 < 0.6 <= 0.8)
    picks = set(_many(Sampler(1.0, 0.6, 3), logits, 200))
    assert picks <= {0, 1} and picks == {0, 1}
    # sampling under a mask never leaves it
    allowed = torch.tensor([2, 3])
    s = Sampler(1.0, 1.0, 0)
    assert {s.sample(logits, allowed) for _ in range(50)} <= {2, 3}


def _many(s, logits, n):
    return [s.sample(logits) for _ in range(n)]


def test_bad_params():
    with pytest.raises(ValueError):
        Sampler(-1.0)
    with pytest.raises(ValueError):
        Sampler(1.0, top_p=0.0)


def test_stop_string_across_tokens_is_never_streamed():
    rules = StopRules(end_ids=[0], stop=["\n\n"], max_tokens=50)
    out = []
    for piece in ["def f", "():", "\n", "    pass", "\n", "\nclass"]:
        chk = rules.on_token(5, piece)
        out.append(chk.emit)
        if chk.finish:
            break
    assert chk.finish == "stop"
    assert "".join(out) == "def f():\n    pass"
    assert rules.text == "def f():\n    pass"


def test_partial_stop_prefix_released_when_not_a_stop():
    rules = StopRules(end_ids=[0], stop=["END"], max_tokens=3)
    assert rules.on_token(5, "x E").emit == "x "  # "E" could start "END"
    assert rules.on_token(5, "Nd").emit == "ENd"
    chk = rules.on_token(5, "E")
    assert chk.finish == "length" and chk.emit == "E"  # held text released at the end
    assert rules.text == "x ENdE"


def test_eos_length_deadline():
    rules = StopRules(end_ids=[9], max_tokens=2)
    assert rules.on_token(9, "").finish == "eos"
    rules = StopRules(end_ids=[9], max_tokens=1)
    assert rules.before_step() is None
    assert rules.on_token(3, "a").finish == "length"
    assert rules.before_step() == "length"
    rules = StopRules(end_ids=[9], deadline=time.monotonic() - 1)
    assert rules.before_step() == "deadline"
    assert StopRules(end_ids=[], max_tokens=0).before_step() == "length"
