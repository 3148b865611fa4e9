"""Segment-wise tokenization, token healing and streaming detokenization.

- `SegmentTokenizer.encode(segments)` tokenizes every text segment on its own and
  concatenates the ids (sentinels are ids already). A segment's ids therefore never
  change when a later segment grows — the property EFIM's KV reuse rests on
  (docs/design.md, "Prefix stability").
  Text that happens to spell a special token (`<|endoftext|>` in a user's file) is
  tokenized as plain text, never as the special token.
- Token healing: when healing is on and the last segment is text, its last token is
  dropped — or, when it ends with whitespace, every trailing whitespace-only token — and
  the generated tokens must spell the dropped text out again before anything else
  (`HealingProgress`): each must cover the rest of it (its bytes start with it:
  `VocabIndex.allowed`, a sorted-bytes index built once per tokenizer; a lookup is two
  bisections) or, in a run of blanks, spell a first part of it (`VocabIndex.consistent`). The
  cursor splits text where ordinary text has no token boundary: inside a word ("retu"),
  after punctuation ("=" before "=="), at a line break, which ordinary text writes
  together with the next line's indentation ("\n        "; after a lone "\n" the model
  mostly answers a blank line), or inside a run of blanks ("   " cut from "        return",
  whose own tokens are "       " + " return"). A whole indentation (`whole_indentation`:
  a level the lines around have, as an editor leaves a fresh line) is the exception: only
  its last blank, split off as a token of its own, is healed, so the prompt reads "indented
  this far"; healing all of it lets the model indent deeper (measured in docs/training.md).
- `StreamDecoder` turns generated ids into text incrementally, holding back the bytes
  of a UTF-8 character split across tokens.

Token bytes come straight from the vocabulary (byte-level BPE through the GPT-2 byte
map, SentencePiece through `▁` and `<0xNN>` byte fallback), so streaming never calls
the tokenizer's decoder and never loses a leading space.
"""

from __future__ import annotations

import bisect
import json
from collections import OrderedDict
from typing import TYPE_CHECKING, NamedTuple, Sequence

import torch

from engine.text.templates import Segment, SegmentRole

if TYPE_CHECKING:
    from tokenizers import Tokenizer

# Marker put in front of a text to learn (and strip) what a SentencePiece tokenizer's
# word-boundary space does to it — the trick CodeLlama's reference code uses.
_MARKER = "☺"


def _gpt2_byte_decoder() -> dict[str, int]:
    """The inverse of GPT-2's bytes→printable-unicode map used by byte-level BPE."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars = printable[:]
    n = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(printable, chars)}


def _decoder_kind(tokenizer: Tokenizer) -> str:
    """"bytelevel", "sentencepiece" or "other", from the serialized decoder."""
    spec = json.loads(tokenizer.to_str()).get("decoder") or {}
    kinds = [spec.get("type")] + [d.get("type") for d in spec.get("decoders", []) or []]
    if "ByteLevel" in kinds:
        return "bytelevel"
    if "Metaspace" in kinds or "ByteFallback" in kinds or any(
        d.get("type") == "Replace" and d.get("pattern", {}).get("String") == "▁" for d in spec.get("decoders", []) or []
    ):
        return "sentencepiece"
    return "other"


def _remembered(cache: OrderedDict, key: bytes, make) -> torch.Tensor:
    """`make(key)` through a 256-entry LRU `cache`."""
    hit = cache.get(key)
    if hit is not None:
        cache.move_to_end(key)
        return hit
    value = cache[key] = make(key)
    if len(cache) > 256:
        cache.popitem(last=False)
    return value


def _prefix_upper_bound(prefix: bytes) -> bytes | None:
    """The smallest byte string greater than every string starting with `prefix`
    (None: no upper bound, the prefix is all 0xff)."""
    b = bytearray(prefix)
    while b and b[-1] == 0xFF:
        b.pop()
    if not b:
        return None
    b[-1] += 1
    return bytes(b)


class VocabIndex:
    """Bytes of every token id and a prefix index over them (built once per tokenizer).

    Special tokens (added tokens flagged special) have empty bytes and are never
    allowed by `allowed()`."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        size = tokenizer.get_vocab_size(with_added_tokens=True)
        added = tokenizer.get_added_tokens_decoder()
        self.special_ids = frozenset(i for i, t in added.items() if t.special)
        kind = _decoder_kind(tokenizer)
        byte_map = _gpt2_byte_decoder() if kind == "bytelevel" else None
        if byte_map is not None:  # str.translate to code points < 256, then latin-1: C speed over 49k pieces
            byte_table = {ord(c): b for c, b in byte_map.items()}
            for cp in range(256):  # a char of the byte range that is no key must fail the encode, as a KeyError did
                byte_table.setdefault(cp, 0xFFFF)
        token_bytes: list[bytes] = [b""] * size
        for tid in range(size):
            if tid in self.special_ids:
                continue
            piece = tokenizer.id_to_token(tid)
            if piece is None:
                continue
            if tid in added:  # added non-special tokens are matched as literal text
                token_bytes[tid] = added[tid].content.encode("utf-8")
            elif byte_map is not None:
                try:
                    token_bytes[tid] = piece.translate(byte_table).encode("latin-1")
                except UnicodeEncodeError:  # a char outside the byte-level alphabet: the piece as text
                    token_bytes[tid] = piece.encode("utf-8")
            elif kind == "sentencepiece":
                if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
                    token_bytes[tid] = bytes([int(piece[3:5], 16)])
                else:
                    token_bytes[tid] = piece.replace("▁", " ").encode("utf-8")
            else:
                token_bytes[tid] = tokenizer.decode([tid], skip_special_tokens=False).encode("utf-8")
        self.token_bytes = token_bytes
        order = sorted((b, i) for i, b in enumerate(token_bytes) if b)
        self._sorted_bytes = [b for b, _ in order]
        self._sorted_ids = torch.tensor([i for _, i in order], dtype=torch.int64)  # [V']
        self._allowed_cache: OrderedDict[bytes, torch.Tensor] = OrderedDict()
        self._consistent_cache: OrderedDict[bytes, torch.Tensor] = OrderedDict()

    @property
    def size(self) -> int:
        return len(self.token_bytes)

    def allowed(self, prefix: bytes) -> torch.Tensor:  # [n] int64, ascending by bytes
        """Ids of every non-special token whose bytes start with `prefix` (all of them
        for an empty prefix). A view into a shared tensor: do not modify."""
        return _remembered(self._allowed_cache, prefix, self._starting_with)

    def _starting_with(self, prefix: bytes) -> torch.Tensor:  # [n] int64
        lo = bisect.bisect_left(self._sorted_bytes, prefix)
        upper = _prefix_upper_bound(prefix)
        hi = len(self._sorted_bytes) if upper is None else bisect.bisect_left(self._sorted_bytes, upper, lo)
        return self._sorted_ids[lo:hi]

    def consistent(self, text: bytes) -> torch.Tensor:  # [n] int64
        """Ids of every non-special token that agrees with `text` as the next piece of it:
        its bytes start with `text` (`allowed(text)`), or — when `text` is spaces and tabs
        only — are a first part of it (a run of blanks is spelled in pieces of the model's
        choosing; anything else is covered in one token, as single-token healing does: a
        lone "\n" before a healed "\n\n" is a split the model answers with a blank line).
        Text that no token covers (several healed tokens of blanks and line breaks the
        vocabulary has no single token for) is spelled in first parts too: never an empty set,
        which left the sampler nothing to choose from (an `argmax()` IndexError in the soak)."""
        return _remembered(self._consistent_cache, text, self._agreeing_with)

    def _agreeing_with(self, text: bytes) -> torch.Tensor:  # [n] int64
        ids = self.allowed(text)
        if text.strip(b" \t") and len(ids):
            return ids
        parts = [self._exactly(text[:k]) for k in range(1, len(text))]  # the first parts that are tokens
        return torch.cat([*parts, ids])

    def _exactly(self, piece: bytes) -> torch.Tensor:  # [n] int64: the ids whose bytes are `piece`
        lo = bisect.bisect_left(self._sorted_bytes, piece)
        hi = bisect.bisect_right(self._sorted_bytes, piece, lo)
        return self._sorted_ids[lo:hi]

    def text_of(self, ids: Sequence[int]) -> str:
        """Text of `ids` (special tokens contribute nothing; invalid UTF-8 is replaced)."""
        return b"".join(self.token_bytes[i] for i in ids).decode("utf-8", errors="replace")


class SegmentSpan(NamedTuple):
    start: int  # first id of the segment in `Encoded.ids`
    end: int  # one past its last id
    role: SegmentRole


class Healing(NamedTuple):
    """The tokens dropped by token healing: generation spells their text out again first."""

    removed_ids: tuple[int, ...]  # the prompt's last ids, dropped
    removed_bytes: bytes  # their text (non-empty)

    def progress(self, vocab: "VocabIndex") -> "HealingProgress":
        """The constraint at the first generated token: nothing spelled out yet."""
        return HealingProgress(vocab, self.removed_bytes)


class HealingProgress(NamedTuple):
    """Multi-token healing while it lasts: the healed text not yet spelled out by the
    generated tokens (`rest`, non-empty). Each token must agree with it
    (`VocabIndex.consistent`): cover it (its bytes start with `rest`) or, in a run of
    blanks, spell a first part of it; `after(token)` is the next state (None once covered).
    Immutable: a fork of a sequence shares its parent's."""

    vocab: "VocabIndex"
    rest: bytes

    def allowed(self) -> torch.Tensor:  # [n] int64
        return self.vocab.consistent(self.rest)

    def after(self, token_id: int) -> "HealingProgress | None":
        spelled = len(self.vocab.token_bytes[token_id])
        return HealingProgress(self.vocab, self.rest[spelled:]) if spelled < len(self.rest) else None


class Encoded(NamedTuple):
    ids: list[int]
    spans: tuple[SegmentSpan, ...]
    healing: Healing | None


def ends_with_blank(text: str) -> bool:
    """True when `text` ends with a space or a tab (`return `, `x = `, indentation):
    ordinary text puts the last one in front of the next word (` x`, `       ` + ` return`)."""
    return text.endswith((" ", "\t"))


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip(" \t"))


def whole_indentation(before: str, after: str, *, lookback: int = 60) -> bool:
    """Whether the blanks that end `before` (the text up to the cursor, whose line holds
    only blanks so far) look like a whole indentation rather than part of one: as wide as
    an earlier line's (among the last `lookback` non-blank lines), as the next non-blank
    line of `after`, or one step deeper than the line before when that line opens a block
    (`:`, `{`, `(`, `[`; a step is the smallest indentation change seen, else 4). An editor
    that indents by itself puts a whole one there; a person still typing it may not."""
    line = before[before.rfind("\n") + 1 :]
    if not line or line.strip(" \t"):
        return False
    width = len(line)
    earlier = [ln for ln in before[: len(before) - len(line)].rsplit("\n", 4 * lookback)[-4 * lookback :] if ln.strip()]
    earlier = earlier[-lookback:]
    levels = [_indent(ln) for ln in earlier]
    if width in levels:
        return True
    following = next((ln for ln in after.split("\n", 64)[:64] if ln.strip()), None)
    if following is not None and _indent(following) == width:
        return True
    if earlier and earlier[-1].rstrip().endswith((":", "{", "(", "[")):
        steps = [abs(a - b) for a, b in zip(levels, levels[1:]) if a != b]
        return width == levels[-1] + (min(steps) if steps else 4)
    return False


# Most trailing whitespace-only tokens token healing drops (indentation is one or two).
HEAL_MAX_TOKENS = 8


# Texts from this many characters are tokenized without holding the GIL (`SegmentTokenizer._raw`);
# shorter ones (a keystroke's increment) cost less than the hand-off to the tokenizer's worker.
_RELEASE_GIL_CHARS = 256


class SegmentTokenizer:
    """Tokenizes prompt segments independently. A small LRU remembers the ids of recent
    texts, so an unchanged prefix or suffix costs a dict lookup; `encode`/`encode_text`
    belong to one thread (the engine's), `count` is safe from any thread."""

    def __init__(self, tokenizer: Tokenizer, *, cache_size: int = 64) -> None:
        from tokenizers import Tokenizer as _Tokenizer  # noqa: PLC0415

        # A private copy: special-token spellings inside user text must stay plain text.
        self._tok = _Tokenizer.from_str(tokenizer.to_str())
        self._tok.encode_special_tokens = True
        self.vocab = VocabIndex(tokenizer)
        self._cache: OrderedDict[tuple[str, bool], tuple[int, ...]] = OrderedDict()
        self._cache_size = cache_size
        x = self._raw("x")
        self.adds_dummy_prefix = bool(x) and self.vocab.token_bytes[x[0]].startswith(b" ")
        self._marker_ids = self._raw(_MARKER)

    def _raw(self, text: str) -> list[int]:
        if len(text) >= _RELEASE_GIL_CHARS:
            # The same ids; `encode_batch` lets go of the GIL while it works (`encode` keeps
            # it): a window's text takes 2-4 ms, and the other threads of the process —
            # the engine's between its ops, the server's or daemon's loop — run meanwhile.
            return self._tok.encode_batch([text], add_special_tokens=False)[0].ids
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_text(self, text: str, *, dummy_prefix: bool = False) -> tuple[int, ...]:
        """Ids of `text` on its own, without BOS. `dummy_prefix=False` removes the
        word-boundary space a SentencePiece tokenizer puts in front (no-op otherwise)."""
        if not text:
            return ()
        key = (text, dummy_prefix)
        hit = self._cache.get(key)
        if hit is not None:
            self._cache.move_to_end(key)
            return hit
        ids = self._encode(text, dummy_prefix)
        self._cache[key] = ids
        if len(self._cache) > self._cache_size:
            self._cache.popitem(last=False)
        return ids

    def _encode(self, text: str, dummy_prefix: bool) -> tuple[int, ...]:
        if self.adds_dummy_prefix and not dummy_prefix:
            full = self._raw(_MARKER + text)
            m = len(self._marker_ids)
            return tuple(full[m:]) if full[:m] == self._marker_ids else tuple(self._raw(text))
        return tuple(self._raw(text))

    def encode_uncached(self, text: str) -> tuple[int, ...]:
        """Ids of `text` on its own, like `encode_text`, bypassing the LRU (for bulk text
        such as a document's pieces, which would evict the prompt segments it keeps)."""
        return self._encode(text, False) if text else ()

    def encode_pieces(self, pieces: Sequence[str]) -> list[int]:
        """Concatenated ids of each piece tokenized on its own, exactly as `encode_text`
        tokenizes a segment, without the LRU (safe from any thread): fragment tokenization
        for training goes through here, so training sees serving's segment ids."""
        return [i for piece in pieces for i in self.encode_uncached(piece)]

    def count(self, text: str) -> int:
        """Tokens `text` takes when tokenized on its own. Safe from any thread (it does
        not touch the LRU, which belongs to the engine thread)."""
        return len(self._encode(text, False)) if text else 0

    def encode(self, segments: Sequence[Segment], *, heal: bool = False, whole_indent: bool = False) -> Encoded:
        """Concatenated ids of `segments`. With `heal`, if the last segment is text, its
        last tokens are dropped and returned in `healing` (`healed_count`): the generated
        text must spell them out again first, in tokens of the model's own choosing.

        `whole_indent`: the blanks that end the last segment are a whole indentation
        (`whole_indentation`): only the last one is healed, split off as a token of its own
        — `       ` + ` ` then reads as "this line is indented this far" (ordinary text
        tokenizes an 8-blank indentation `       ` + ` return`), where healing every blank
        would let the model indent deeper than the editor did."""
        ids: list[int] = []
        spans: list[SegmentSpan] = []
        healing = None
        for n, seg in enumerate(segments):
            start = len(ids)
            if isinstance(seg.value, str):
                if heal and n == len(segments) - 1:
                    seg_ids, removed = self.heal_split(seg.value, whole_indent=whole_indent, dummy_prefix=seg.dummy_prefix)
                    if removed:
                        healing = Healing(removed, b"".join(self.vocab.token_bytes[i] for i in removed))
                else:
                    seg_ids = self.encode_text(seg.value, dummy_prefix=seg.dummy_prefix)
                ids.extend(seg_ids)
            else:
                ids.append(int(seg.value))
            spans.append(SegmentSpan(start, len(ids), seg.role))
        return Encoded(ids, tuple(spans), healing)

    def heal_split(self, text: str, ids: Sequence[int] | None = None, *, whole_indent: bool = False,
                   dummy_prefix: bool = False) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """The ids of a prompt's last text segment split as token healing splits them:
        (kept, dropped), dropped empty when nothing is healed. `ids` are the segment's ids
        when they are not `text` tokenized whole (training's fragments); `whole_indent` as in
        `encode` (the segment is then tokenized afresh, its last blank split off)."""
        if whole_indent and ends_with_blank(text):
            tail = self.encode_text(text[-1])
            if len(tail) == 1:
                return self.encode_text(text[:-1], dummy_prefix=dummy_prefix), tail
        ids = tuple(ids) if ids is not None else self.encode_text(text, dummy_prefix=dummy_prefix)
        drop = self.healed_count(ids)
        return (ids[:-drop], ids[-drop:]) if drop else (ids, ())

    def healed_count(self, ids: Sequence[int]) -> int:
        """How many of the last `ids` of a prompt's last text token healing drops.

        Every trailing whitespace-only token, up to `HEAL_MAX_TOKENS`: a prompt that ends
        with indentation or a blank ends with a split ordinary text rarely has (`   ` cut
        from `        return`, whose own tokens are `       ` + ` return`); the model then
        spells the whitespace again its own way, at least as far as it was typed.
        Otherwise the last token, whatever it ends with: inside a word (`retu`), at a line
        break merged with what precedes it (`):\n`), or after punctuation (`=` before `==`,
        `(` before `()`) — the cursor may split any token ordinary text would have."""
        table = self.vocab.token_bytes
        drop = 0
        while drop < min(len(ids), HEAL_MAX_TOKENS):
            piece = table[ids[-1 - drop]]
            if not piece or piece.strip(b" \t\r\n"):
                break
            drop += 1
        if drop == 0 and ids and table[ids[-1]]:
            drop = 1
        return drop


class StreamDecoder:
    """Incremental detokenizer: `feed(id)` returns the text completed by that token
    (possibly ""), holding back an incomplete UTF-8 character; `flush()` returns the rest.
    `skip_bytes`: drop the first n bytes of the stream (token healing regenerates the
    text of the dropped prompt token, which the user has already typed)."""

    def __init__(self, vocab: VocabIndex, skip_bytes: int = 0) -> None:
        self._bytes = vocab.token_bytes
        self._buf = b""
        self._skip = skip_bytes

    def feed(self, token_id: int) -> str:
        buf = self._buf + self._bytes[token_id]
        if self._skip:
            dropped = min(self._skip, len(buf))
            buf, self._skip = buf[dropped:], self._skip - dropped
        n = len(buf)
        cut = n
        # Only the last 1-3 bytes can be an unfinished character: find its lead byte.
        for back in range(1, min(4, n) + 1):
            b = buf[n - back]
            if b & 0xC0 == 0x80:
                continue  # continuation byte: keep looking for the lead
            if b >= 0xC0:
                need = 2 if b < 0xE0 else 3 if b < 0xF0 else 4
                if back < need:
                    cut = n - back
            break
        self._buf = buf[cut:]
        return buf[:cut].decode("utf-8", errors="replace")

    def flush(self) -> str:
        out = self._buf.decode("utf-8", errors="replace")
        self._buf = b""
        return out


__all__ = ["VocabIndex", "SegmentTokenizer", "SegmentSpan", "Encoded", "Healing", "HealingProgress", "StreamDecoder",
           "ends_with_blank", "whole_indentation"]
