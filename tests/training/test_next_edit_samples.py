"""Next-edit training samples: serving's own prompt with the server's own probe, and answers
that say whether the edit is carried to that place."""

from __future__ import annotations

import random

import pytest
from tokenizers import AddedToken, Tokenizer

from engine.api import InfillRequest
from engine.prompting import PromptBuilder
from engine.text.templates import detect_template
from engine.text.tokenize import SegmentTokenizer
from tiny_models import tiny_tokenizer_json
from efim_tools.training.data import Corpus, training_files
from efim_tools.training.next_edit import draw_question
from efim_tools.training.samples import SENTINELS, FimIds, SampleBuilder, SampleConfig, next_edit_sample


@pytest.fixture(scope="module")
def spm_tokenizer() -> Tokenizer:
    tok = Tokenizer.from_str(tiny_tokenizer_json(False))
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SENTINELS["spm"]])
    return tok


@pytest.fixture(scope="module")
def corpus() -> Corpus:
    return Corpus(training_files())


def _changed_token(question: str) -> tuple[str, str]:
    """The token the probe's two lines differ in (old, new)."""
    _, before, after, _ = question.split("\n", 3)  # scope, -before, +after, the candidate's scope and head
    before, after = before[1:], after[1:]
    i = 0
    while i < min(len(before), len(after)) and before[i] == after[i]:
        i += 1
    j = 0
    while j < min(len(before), len(after)) - i and before[-1 - j] == after[-1 - j]:
        j += 1
    while i > 0 and (before[i - 1].isalnum() or before[i - 1] == "_"):
        i -= 1
    while j > 0 and (before[len(before) - j].isalnum() or before[len(before) - j] == "_"):
        j -= 1
    return before[i : len(before) - j], after[i : len(after) - j]


def test_a_next_edit_sample_is_serving_prompt_then_the_probe(spm_tokenizer, corpus):
    serving = PromptBuilder(detect_template(spm_tokenizer), SegmentTokenizer(spm_tokenizer), fragment_trained=True)
    cfg = SampleConfig(layout="spm", fragment=True, fragment_prob=0.0, next_edit_prob=1.0, min_window_tokens=64, max_window_tokens=160)
    builder = SampleBuilder(spm_tokenizer, corpus, cfg, seed=3)
    answers = {"new": 0, "old": 0}
    for i in range(40):
        sample = builder.sample(i)
        assert sample.kind == "next-edit"
        seg = {s.role: s for s in sample.segments}
        *_, question, target = sample.segments
        req = InfillRequest(key="k", prefix=seg["prefix"].text, suffix=seg["suffix"].text,
                            increment=seg["increment"].text if "increment" in seg else "", probe=question.text, heal=False)
        rendered = serving.encode(req).ids
        assert sample.ids[: len(rendered)] == rendered, i
        assert sample.ids[len(rendered):] == [*target.ids, spm_tokenizer.token_to_id("<|endoftext|>")]
        assert sample.targets == [False] * len(rendered) + [True] * (len(target.ids) + 1)
        old, new = _changed_token(question.text)
        assert target.text in (old, new), (question.text, target.text)
        answers["new" if target.text == new else "old"] += 1
        # the cursor is right after the changed token: the prompt's text ends with the new token
        assert (seg["prefix"].text + (seg["increment"].text if "increment" in seg else "")).endswith(new)
    assert answers["new"] >= 5 and answers["old"] >= 5  # both answers are taught


def test_number_and_word_changes_are_never_carried(spm_tokenizer):
    text = "def f(a):\n    x = a + 8\n    y = 'red box'\n    z = a * 8\n    w = 'box'\n    return x + y + z\n"
    fim = FimIds.from_tokenizer(spm_tokenizer, "spm")
    cfg = SampleConfig(layout="spm", next_edit_prob=1.0)
    seen = {}
    for seed in range(200):
        rng = random.Random(seed)
        question = draw_question(text, rng)
        if question is None:
            continue
        sample = next_edit_sample(SegmentTokenizer(spm_tokenizer), fim, question, rng, cfg, 64)
        assert question.carried == (sample.segments[-1].text != _changed_token(question.probe)[0])
        question, target = sample.segments[-2:]
        old, new = _changed_token(question.text)
        seen.setdefault("number" if old.isdigit() else old, set()).add(target.text == new)
    assert seen.get("number") == {False}  # 8 -> 9 at one place is not carried to the other 8
    assert True in seen.get("a", ())  # the parameter renamed: carried to its other uses


def test_next_edit_samples_need_the_suffix_first_layout():
    with pytest.raises(ValueError, match="suffix-first"):
        SampleConfig(layout="psm", next_edit_prob=0.5).validate()
