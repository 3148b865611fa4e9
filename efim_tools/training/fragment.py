"""Fragment tokenization: cut text at random character positions, tokenize each piece on its own.

EFIM (docs/design.md, "EFIM") puts the increment behind the middle sentinel, tokenized as its own
segment, so it often ends inside a word ("retu") — a token sequence a normally trained
model never saw before its continuation ("rn"). Training on text whose ids are the
concatenation of independently tokenized fragments teaches the model such boundaries.

Every piece is tokenized as serving tokenizes a prompt segment
(`engine.text.tokenize.SegmentTokenizer`): special-token spellings stay text, no word-boundary
space is added in front.

Contract: for any text and any cut positions, decoding the concatenated ids gives the
text back exactly (fragments are cut at character, not byte, positions).
"""

from __future__ import annotations

import random
from typing import TYPE_CHECKING, Sequence

if TYPE_CHECKING:
    from engine.text.tokenize import SegmentTokenizer


def random_cuts(text: str, rng: random.Random, mean_chars: float) -> list[int]:
    """Sorted cut positions strictly inside `text` (0 < cut < len), on average one per
    `mean_chars` characters (a Bernoulli draw per position, so cuts land anywhere,
    including inside words and inside indentation runs)."""
    if mean_chars <= 0:
        raise ValueError(f"mean_chars must be positive, got {mean_chars}")
    n = len(text)
    if n < 2:
        return []
    p = min(1.0, 1.0 / mean_chars)
    cuts: list[int] = []
    pos = 0
    # Geometric gaps: same distribution as a per-character coin, without n draws.
    while True:
        gap = 1 + int(rng.expovariate(p)) if p < 1.0 else 1
        pos += gap
        if pos >= n:
            return cuts
        cuts.append(pos)


def split_at(text: str, cuts: Sequence[int]) -> list[str]:
    """`text` cut at `cuts` (sorted, inside the text); the pieces concatenate to `text`."""
    pieces, start = [], 0
    for cut in cuts:
        pieces.append(text[start:cut])
        start = cut
    pieces.append(text[start:])
    return [p for p in pieces if p]


def encode_text(tokenizer: SegmentTokenizer, text: str) -> list[int]:
    """Ids of `text` tokenized on its own, as serving tokenizes a segment."""
    return tokenizer.encode_pieces([text])


def encode_fragments(tokenizer: SegmentTokenizer, pieces: Sequence[str]) -> list[int]:
    """Concatenated ids of each piece tokenized on its own."""
    return tokenizer.encode_pieces(pieces)


def fragment_encode(tokenizer: SegmentTokenizer, text: str, rng: random.Random, mean_chars: float) -> list[int]:
    """Fragment tokenization of `text`: random cuts every ~`mean_chars` characters."""
    return encode_fragments(tokenizer, split_at(text, random_cuts(text, rng, mean_chars)))


__all__ = ["random_cuts", "split_at", "encode_text", "encode_fragments", "fragment_encode"]
