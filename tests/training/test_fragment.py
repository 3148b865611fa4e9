"""Fragment tokenization keeps text exact and really cuts inside words."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer

from engine.text.tokenize import SegmentTokenizer
from tiny_models import stdlib_sources, tiny_tokenizer_json
from efim_tools.training.fragment import encode_text, fragment_encode, random_cuts, split_at


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_str(tiny_tokenizer_json(True))


@settings(max_examples=60, deadline=None)
@given(text=st.text(min_size=0, max_size=200), seed=st.integers(0, 2**32), mean=st.floats(1.0, 50.0))
def test_round_trips_any_text(text, seed, mean):
    tok = Tokenizer.from_str(tiny_tokenizer_json(True))
    ids = fragment_encode(SegmentTokenizer(tok), text, random.Random(seed), mean)
    assert tok.decode(ids, skip_special_tokens=False) == text


def test_round_trips_real_code_and_changes_tokenization(tokenizer):
    text = stdlib_sources(("textwrap.py",))[0][:5000]
    plain = encode_text(SegmentTokenizer(tokenizer), text)
    frag = fragment_encode(SegmentTokenizer(tokenizer), text, random.Random(1), mean_chars=8)
    assert tokenizer.decode(frag) == text
    # cuts inside merged tokens force extra, shorter tokens
    assert len(frag) > len(plain) * 1.1


def test_cuts_land_inside_words():
    text = "def function_name(argument):\n    return argument\n" * 20
    cuts = random_cuts(text, random.Random(0), mean_chars=5)
    assert all(0 < c < len(text) for c in cuts) and cuts == sorted(set(cuts))
    inside_word = [c for c in cuts if text[c - 1].isalnum() and text[c].isalnum()]
    assert len(inside_word) > len(cuts) // 4
    assert "".join(split_at(text, cuts)) == text


def test_mean_fragment_length_is_respected():
    text = "x" * 20000
    cuts = random_cuts(text, random.Random(3), mean_chars=20)
    assert 700 < len(cuts) < 1300


def test_bad_mean_is_an_error():
    with pytest.raises(ValueError):
        random_cuts("abc", random.Random(0), 0)
