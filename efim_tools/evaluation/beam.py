"""Beam search for one line (`efim eval humaneval-infilling --beams N`, transformers backend).

An experiment, not a serving path: does spending compute on the search, instead of greedy
decoding, find better single lines with the same model? The beam keeps the `width` best
partial lines by summed log-probability; a hypothesis ends at a token holding a line break
after some text, or at an end token. Token healing is kept per hypothesis (its first tokens
must spell the dropped text, `HealingProgress`), so the prompt and its constraint are
serving's. The search stops when no live hypothesis can beat the best ended one (scores
only fall).
"""

from __future__ import annotations

import math
from typing import Iterable, NamedTuple

import torch

from engine.text.tokenize import HealingProgress, StreamDecoder, VocabIndex


class _Hypothesis(NamedTuple):
    score: float  # summed log-probability of `tokens`
    tokens: tuple[int, ...]
    progress: HealingProgress | None  # healing still to spell out, or None


def _text(vocab: VocabIndex, tokens: Iterable[int], healed: int) -> str:
    decoder = StreamDecoder(vocab, healed)
    return "".join(decoder.feed(t) for t in tokens) + decoder.flush()


@torch.inference_mode()
def beam_line(model, ids: list[int], vocab: VocabIndex, *, width: int, max_tokens: int, eos: frozenset[int] | set[int],
              progress: HealingProgress | None = None, healed: int = 0) -> tuple[list[int], str]:
    """(tokens, text) of the best line `model` (a transformers causal LM) continues `ids`
    with, by beam search of `width`; `healed`: bytes of the prompt healing dropped (the text
    starts after them). The text is cut at its line break (leading blank lines dropped)."""
    if width < 1:
        raise ValueError(f"beam width must be at least 1, not {width}")
    out = model(input_ids=torch.tensor([ids]), use_cache=True)
    cache = out.past_key_values
    logp = torch.log_softmax(out.logits[:, -1].float(), dim=-1)  # [beams, V]
    live = [_Hypothesis(0.0, (), progress)]
    ended: list[_Hypothesis] = []
    for step in range(max_tokens):
        candidates = []
        for b, hyp in enumerate(live):
            scores = logp[b]
            if hyp.progress is not None:
                allowed = hyp.progress.allowed()
                masked = torch.full_like(scores, -math.inf)
                masked[allowed] = scores[allowed]
                scores = masked
            top = torch.topk(scores, min(2 * width, scores.numel()))
            candidates += [(hyp.score + v, b, t) for v, t in zip(top.values.tolist(), top.indices.tolist()) if v > -math.inf]
        candidates.sort(key=lambda c: -c[0])
        kept: list[_Hypothesis] = []
        parents: list[int] = []
        for score, b, token in candidates:
            hyp = live[b]
            if token in eos:
                ended.append(_Hypothesis(score, hyp.tokens, None))
                continue
            tokens = hyp.tokens + (token,)
            if "\n" in _text(vocab, tokens, healed).lstrip("\n"):
                ended.append(_Hypothesis(score, tokens, None))
                continue
            kept.append(_Hypothesis(score, tokens, hyp.progress.after(token) if hyp.progress is not None else None))
            parents.append(b)
            if len(kept) == width:
                break
        if not kept or (ended and max(e.score for e in ended) >= kept[0].score):
            break
        if step == 0:
            cache.batch_repeat_interleave(len(kept))
        else:
            cache.reorder_cache(torch.tensor(parents))
        out = model(input_ids=torch.tensor([[h.tokens[-1]] for h in kept]), past_key_values=cache, use_cache=True)
        cache = out.past_key_values
        logp = torch.log_softmax(out.logits[:, -1].float(), dim=-1)
        live = kept
    best = max(ended or live, key=lambda h: h.score)
    text = _text(vocab, best.tokens, healed).lstrip("\n").split("\n", 1)[0]
    return list(best.tokens), text


__all__ = ["beam_line"]
