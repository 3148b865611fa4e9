"""Beam search for one line (`efim eval humaneval-infilling --beams N`): a beam of one is
greedy decoding, healing constrains every hypothesis, bad widths are refused."""

from __future__ import annotations

import pytest

from efim_tools.evaluation.beam import beam_line
from efim_tools.evaluation.infill import TransformersInfiller
from efim_tools.evaluation.model import load_eval_model

CASES = [("def add(a, b):\n    return ", "\n\nprint(add(1, 2))\n", ""), ("import os\n\ndef main():\n", "\n    return 0\n", "    pa")]


@pytest.fixture(scope="module")
def eval_model(tiny_model_dir):
    return load_eval_model(str(tiny_model_dir), "none")


def _search(infiller: TransformersInfiller, prefix: str, suffix: str, inc: str, width: int, max_tokens: int = 10):
    enc = infiller.prompt(prefix, suffix, inc, "efim", heal=True)
    vocab = infiller.prompts.tokenizer.vocab
    healing = enc.healing
    return enc, beam_line(infiller.em.model, enc.ids, vocab, width=width, max_tokens=max_tokens, eos=infiller.eos,
                          progress=healing.progress(vocab) if healing else None, healed=len(healing.removed_bytes) if healing else 0)


def test_a_beam_of_one_is_greedy_decoding(eval_model):
    greedy = TransformersInfiller(eval_model)
    for prefix, suffix, inc in CASES:
        _, (tokens, text) = _search(greedy, prefix, suffix, inc, width=1)
        expected = greedy.complete(prefix, suffix, inc, "efim", heal=True, max_tokens=10)
        assert text == expected.text and len(tokens) == expected.generated_tokens


def test_wider_beams_keep_healing_and_end_at_the_line(eval_model):
    infiller = TransformersInfiller(eval_model)
    vocab = infiller.prompts.tokenizer.vocab
    enc, (tokens, text) = _search(infiller, *CASES[1], width=3)
    assert enc.healing is not None  # "pa" was dropped from the prompt: the first tokens must spell it
    spelled = b"".join(vocab.token_bytes[t] for t in tokens)
    assert spelled.startswith(enc.healing.removed_bytes) or enc.healing.removed_bytes.startswith(spelled)
    assert "\n" not in text
    assert _search(infiller, *CASES[1], width=3)[1] == (tokens, text)  # deterministic
    through = TransformersInfiller(eval_model, beams=3).complete(*CASES[1], "efim", heal=True, max_tokens=10)
    assert through.text == text


def test_bad_beam_settings_are_refused(eval_model):
    with pytest.raises(ValueError, match="at least 1"):
        TransformersInfiller(eval_model, beams=0)
    with pytest.raises(ValueError, match="single lines"):
        TransformersInfiller(eval_model, beams=2).complete(*CASES[0], "efim", single_line=False)
    with pytest.raises(ValueError, match="at least 1"):
        beam_line(eval_model.model, [1, 2], TransformersInfiller(eval_model).prompts.tokenizer.vocab, width=0, max_tokens=4, eos=set())
