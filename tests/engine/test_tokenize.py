"""Segment-wise tokenization, token healing index, streaming detokenizer."""

from __future__ import annotations

import random

import pytest
from tokenizers import Tokenizer

from engine.text.templates import Segment, detect_template
from tiny_models import stdlib_sources, tiny_tokenizer_json
from engine.text.tokenize import SegmentTokenizer, StreamDecoder, ends_with_blank, whole_indentation


@pytest.fixture(scope="module")
def seg_tok() -> SegmentTokenizer:
    return SegmentTokenizer(Tokenizer.from_str(tiny_tokenizer_json(True)))


@pytest.fixture(scope="module")
def source() -> str:
    return stdlib_sources(("textwrap.py",))[0]


def test_segment_ids_do_not_change_when_later_segment_grows(seg_tok, source):
    rng = random.Random(0)
    for _ in range(20):
        cut = rng.randrange(100, len(source) - 200)
        prefix = source[:cut]
        before = None
        for grow in range(1, 12):  # type the next characters one by one into the increment
            inc = source[cut : cut + grow]
            enc = seg_tok.encode([Segment(prefix, "prefix"), Segment(inc, "increment")])
            prefix_ids = enc.ids[: enc.spans[0].end]
            if before is not None:
                assert prefix_ids == before
            before = prefix_ids
            assert enc.ids == list(seg_tok.encode_text(prefix)) + list(seg_tok.encode_text(inc))


def test_sentinels_are_ids_and_special_spellings_in_text_stay_text(seg_tok):
    tok = Tokenizer.from_str(tiny_tokenizer_json(True))
    tpl = detect_template(tok)
    pre = tok.token_to_id("<fim_prefix>")
    enc = seg_tok.encode([Segment(pre, "sentinel"), Segment("x = '<fim_prefix>'", "prefix")])
    assert enc.ids[0] == pre
    assert pre not in enc.ids[1:]
    assert seg_tok.vocab.text_of(enc.ids[1:]) == "x = '<fim_prefix>'"
    assert tpl.name == "starcoder"


def test_long_and_short_texts_get_the_tokenizers_own_ids(seg_tok, source):
    """Texts past the GIL-free threshold go through `encode_batch`, short ones `encode`: the
    ids are the tokenizer's own either way, special spellings included."""
    tok = Tokenizer.from_str(tiny_tokenizer_json(True))
    tok.encode_special_tokens = True
    for text in (source[:40], source[:255], source[:256], source[1000:5000], "x = '<fim_prefix>' " * 40):
        want = tok.encode(text, add_special_tokens=False).ids
        assert list(seg_tok.encode_uncached(text)) == want
        assert seg_tok.count(text) == len(want)


def test_roundtrip_bytes_of_vocab(seg_tok, source):
    text = source[:3000] + "\n# héllo 日本 ✓ 🙂\n"
    ids = seg_tok.encode_text(text)
    assert seg_tok.vocab.text_of(ids) == text


def _consistent_brute_force(vocab, text: bytes) -> set[int]:
    """Tokens that cover `text`, or spell a first part of it when it is spaces and tabs only
    (or when no token covers it)."""
    cover = {i for i, b in enumerate(vocab.token_bytes) if b and b.startswith(text)}
    if text.strip(b" \t") and cover:
        return cover
    return cover | {i for i, b in enumerate(vocab.token_bytes) if b and text.startswith(b) and b != text}


def test_text_no_token_covers_is_spelled_in_first_parts_never_an_empty_set(seg_tok):
    """The soak's IndexError: healed blanks and line breaks the vocabulary has no single token
    for gave an empty allowed set, and the sampler an empty argmax."""
    vocab = seg_tok.vocab
    text = b"\n" * 40 + b"  \t"
    assert not any(b.startswith(text) for b in vocab.token_bytes if b)
    allowed = set(vocab.consistent(text).tolist())
    assert allowed and allowed == _consistent_brute_force(vocab, text)
    assert all(text.startswith(vocab.token_bytes[i]) for i in allowed)


def test_healing_drops_last_token_and_constrains_to_what_agrees_with_it(seg_tok):
    enc = seg_tok.encode([Segment("def f(x):\n    ", "prefix"), Segment("retu", "increment")], heal=True)
    full = seg_tok.encode_text("retu")
    h = enc.healing
    assert h is not None
    assert h.removed_ids == (full[-1],) and h.removed_bytes == seg_tok.vocab.token_bytes[full[-1]]
    assert enc.ids == list(seg_tok.encode_text("def f(x):\n    ")) + list(full[:-1])
    allowed = h.progress(seg_tok.vocab).allowed().tolist()
    assert full[-1] in allowed and len(allowed) == len(set(allowed))
    # brute force: every token that starts with the removed text or spells a first part of it
    assert set(allowed) == _consistent_brute_force(seg_tok.vocab, h.removed_bytes)


def test_healing_progress_spells_the_healed_text_out_over_several_tokens(seg_tok):
    vocab = seg_tok.vocab
    rest = b"        "
    state = seg_tok.encode([Segment("def f():\n", "prefix"), Segment(rest.decode(), "increment")], heal=True)
    assert state.healing is not None and state.healing.removed_bytes == rest
    progress = state.healing.progress(vocab)
    assert set(progress.allowed().tolist()) == _consistent_brute_force(vocab, rest)
    # one space at a time, then a token that covers the rest and goes on
    one = vocab.consistent(b" ")
    space = next(i for i in one.tolist() if vocab.token_bytes[i] == b" ")
    for k in range(1, 8):
        progress = progress.after(space)
        assert progress is not None and progress.rest == rest[k:]
    cover = next(i for i in progress.allowed().tolist() if vocab.token_bytes[i].startswith(progress.rest))
    assert progress.after(cover) is None
    # a line break is never spelled in pieces: "\n" alone does not agree with "\n\n"
    newline = next(i for i, b in enumerate(vocab.token_bytes) if b == b"\n")
    assert newline not in vocab.consistent(b"\n\n").tolist() and newline in vocab.consistent(b"\n").tolist()
    assert space not in vocab.consistent(b" (").tolist()  # nor a blank in front of other text


@pytest.mark.parametrize("inc", ["x = (", "foo.", "f(x)", "if n ="])
def test_healing_after_punctuation_drops_the_last_token(seg_tok, inc):
    """The cursor may split any token ("=" typed, "==" meant): after punctuation the last
    token is healed too, in one token (no first parts: only blanks are spelled in pieces)."""
    enc = seg_tok.encode([Segment("p", "prefix"), Segment(inc, "increment")], heal=True)
    full = seg_tok.encode_text(inc)
    assert enc.healing is not None and enc.healing.removed_ids == (full[-1],)
    assert set(enc.healing.progress(seg_tok.vocab).allowed().tolist()) == {
        i for i, b in enumerate(seg_tok.vocab.token_bytes) if b and b.startswith(enc.healing.removed_bytes)}


def test_no_healing_after_a_sentinel(seg_tok):
    assert seg_tok.encode([Segment("p(", "prefix"), Segment(7, "sentinel")], heal=True).healing is None


@pytest.mark.parametrize("text", ["    return ", "x = ", "        ", "\t\t", "if x:\n    ", "a\n\n"])
def test_trailing_whitespace_tokens_are_all_healed(seg_tok, text):
    """Every whitespace-only token at the end is dropped (indentation cut anywhere, a blank
    after `return`): the model spells the whitespace again in tokens of its own choosing,
    at least as far as it was typed, not only as a longer run of blanks."""
    enc = seg_tok.encode([Segment("def f():\n", "prefix"), Segment(text, "increment")], heal=True)
    full = list(seg_tok.encode_text(text))
    h = enc.healing
    assert h is not None and h.removed_bytes and not h.removed_bytes.strip()
    assert text.encode().endswith(h.removed_bytes)
    assert enc.ids + list(h.removed_ids) == list(seg_tok.encode_text("def f():\n")) + full
    kept = full[: len(full) - len(h.removed_ids)]
    assert not kept or seg_tok.vocab.token_bytes[kept[-1]].strip()  # the token before them has text
    assert seg_tok.encode([Segment(text, "increment")]).ids == full  # unhealed: as ever


@pytest.mark.parametrize("before, after, whole", [
    ("def f():\n    x = 1\n    ", "", True),  # a level an earlier line has
    ("def f():\n    x = 1\n   ", "", False),  # three of four blanks typed so far
    ("def f():\n    if x:\n        ", "", True),  # one step into the block just opened
    ("def f():\n    if x:\n      ", "", False),
    ("def f():\n    if x:\n      ", "      y = 2\n", True),  # as wide as the next line
    ("class A:\n  def f(self):\n    pass\n  ", "", True),  # two-blank steps
    ("class A:\n  def f(self):\n      ", "", False),  # a step here is 2, not 4
    ("if x:\n\ty\n\t", "", True),
    ("x = 1", "", False), ("x = 1\n", "", False), ("", "", False), ("    return ", "", False),
])
def test_whole_indentation(before, after, whole):
    assert whole_indentation(before, after) is whole


def test_a_whole_indentation_heals_only_its_last_blank(seg_tok):
    """The editor indented the fresh line: its last blank is split off and healed, so the
    prompt reads "indented this far" instead of letting the model choose a deeper indent."""
    text = "        "
    enc = seg_tok.encode([Segment("def f():\n    if x:\n", "prefix"), Segment(text, "increment")], heal=True,
                         whole_indent=True)
    h = enc.healing
    assert h is not None and h.removed_bytes == b" " and h.removed_ids == tuple(seg_tok.encode_text(" "))
    assert enc.ids[-len(seg_tok.encode_text(text[:-1])):] == list(seg_tok.encode_text(text[:-1]))
    partial = seg_tok.encode([Segment("def f():\n    if x:\n", "prefix"), Segment(text, "increment")], heal=True)
    assert partial.healing.removed_bytes.endswith(b"  ")  # not whole: every blank token is healed


def test_prefix_index_matches_brute_force(seg_tok):
    vocab = seg_tok.vocab
    rng = random.Random(1)
    probes = [b"", b" ", b"se", b"\xe6", b"\xff\xff", b"zzzzzz"] + [
        vocab.token_bytes[rng.randrange(vocab.size)][:2] for _ in range(30)
    ]
    for p in probes:
        got = set(vocab.allowed(p).tolist())
        want = {i for i, b in enumerate(vocab.token_bytes) if b and b.startswith(p) and i not in vocab.special_ids}
        assert got == want, p


def test_stream_decoder_holds_split_utf8(seg_tok):
    text = "naïve = '日本語' # 🙂 done"
    # feed byte by byte through single-byte tokens so every multi-byte char is split
    vocab = seg_tok.vocab
    byte_token = {b[0]: i for i, b in enumerate(vocab.token_bytes) if len(b) == 1}
    dec = StreamDecoder(vocab)
    out = []
    for byte in text.encode():
        piece = dec.feed(byte_token[byte])
        assert "\ufffd" not in piece
        out.append(piece)
    out.append(dec.flush())
    assert "".join(out) == text
    # and through the tokenizer's own ids
    dec = StreamDecoder(vocab)
    assert "".join(dec.feed(i) for i in seg_tok.encode_text(text)) + dec.flush() == text


def test_ends_with_blank():
    assert ends_with_blank("return ") and ends_with_blank("\t") and ends_with_blank("if x:\n    ")
    assert not ends_with_blank("x = 1\n") and not ends_with_blank("retu") and not ends_with_blank("")


@pytest.mark.parametrize("prefix", ["def f(x):\n", "def f(x):\n    y = 1\n", "x = 1\n\n"])
def test_healing_at_a_line_start_lets_the_model_write_break_and_indentation_together(seg_tok, prefix):
    """A prompt ending at a line start ends with a lone line-break (or indentation) token,
    a split ordinary text rarely has: healing drops it, so "\n        " can come back as one."""
    enc = seg_tok.encode([Segment("s", "suffix"), Segment(prefix, "prefix")], heal=True)
    full = seg_tok.encode_text(prefix)
    h = enc.healing
    k = len(h.removed_ids) if h is not None else 0
    assert k >= 1 and enc.ids[len(enc.ids) - len(full) + k :] == list(full[:-k]) and h.removed_ids == tuple(full[-k:])
    assert b"\n" in h.removed_bytes and prefix.encode().endswith(h.removed_bytes)
    assert set(h.progress(seg_tok.vocab).allowed().tolist()) == _consistent_brute_force(seg_tok.vocab, h.removed_bytes)
    assert seg_tok.encode([Segment(prefix, "prefix")], heal=False).healing is None


def _sentencepiece_like() -> Tokenizer:
    """A Metaspace BPE with byte fallback, like Llama/CodeLlama's tokenizer.json
    (the `<0xNN>` byte tokens are ordinary vocabulary entries there, not added tokens)."""
    import json

    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False)
    tok.train_from_iterator(stdlib_sources(("bisect.py", "heapq.py")), trainer=trainer)
    spec = json.loads(tok.to_str())
    vocab = spec["model"]["vocab"]
    for b in range(256):
        vocab.setdefault(f"<0x{b:02X}>", len(vocab))
    return Tokenizer.from_str(json.dumps(spec))


def test_sentencepiece_dummy_prefix_only_where_asked():
    st = SegmentTokenizer(_sentencepiece_like())
    assert st.adds_dummy_prefix
    plain = st.encode_text("return x", dummy_prefix=False)
    spaced = st.encode_text("return x", dummy_prefix=True)
    assert st.vocab.text_of(plain) == "return x"
    assert st.vocab.text_of(spaced) == " return x"
    # byte fallback tokens decode to their bytes
    assert st.vocab.text_of(st.encode_text("日本")) == "日本"


def test_stream_decoder_skips_healed_bytes(seg_tok):
    ids = seg_tok.encode_text("return value")
    removed = seg_tok.vocab.token_bytes[ids[0]]
    dec = StreamDecoder(seg_tok.vocab, skip_bytes=len(removed))
    out = "".join(dec.feed(i) for i in ids) + dec.flush()
    assert out == "return value"[len(removed.decode()):]
