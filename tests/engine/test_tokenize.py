"""Segment-wise tokenization, token healing index, streaming detokenizer."""

from __future__ import annotations

import random

import pytest
from tokenizers import Tokenizer

from engine.templates import Segment, detect_template
from tiny_models import stdlib_sources, tiny_tokenizer_json
from engine.tokenize import SegmentTokenizer, StreamDecoder, ends_at_line_start, ends_inside_identifier


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


def test_roundtrip_bytes_of_vocab(seg_tok, source):
    text = source[:3000] + "\n# héllo 日本 ✓ 🙂\n"
    ids = seg_tok.encode_text(text)
    assert seg_tok.vocab.text_of(ids) == text


def test_healing_drops_last_token_and_constrains_to_its_extensions(seg_tok):
    enc = seg_tok.encode([Segment("def f(x):\n    ", "prefix"), Segment("retu", "increment")], heal=True)
    full = seg_tok.encode_text("retu")
    h = enc.healing
    assert h is not None
    assert h.removed_id == full[-1]
    assert enc.ids == list(seg_tok.encode_text("def f(x):\n    ")) + list(full[:-1])
    allowed = h.allowed_ids.tolist()
    assert h.removed_id in allowed
    bytes_of = seg_tok.vocab.token_bytes
    assert all(bytes_of[i].startswith(h.removed_bytes) for i in allowed)
    # brute force: nothing that starts with the removed text is missing
    expect = {i for i, b in enumerate(bytes_of) if b and b.startswith(h.removed_bytes)}
    assert set(allowed) == expect


@pytest.mark.parametrize("inc", ["x = (", "foo.", "f(x)", ""])
def test_no_healing_after_punctuation(seg_tok, inc):
    enc = seg_tok.encode([Segment("p", "prefix"), Segment(inc, "increment")] if inc else [Segment("p(", "prefix")],
                         heal=True)
    assert enc.healing is None


@pytest.mark.parametrize("text", ["    return ", "x = ", "        ", "\t\t"])
def test_a_trailing_blank_is_healed_as_one_character(seg_tok, text):
    """A space or tab at the end is split off and healed on its own: the first token may be
    any that starts with it (` return` after indentation), not only a longer run of blanks."""
    enc = seg_tok.encode([Segment("def f():\n", "prefix"), Segment(text, "increment")], heal=True)
    h = enc.healing
    assert h is not None and h.removed_bytes == text[-1].encode()
    assert enc.ids == list(seg_tok.encode_text("def f():\n")) + list(seg_tok.encode_text(text[:-1]))
    assert set(h.allowed_ids.tolist()) == {i for i, b in enumerate(seg_tok.vocab.token_bytes) if b and b.startswith(text[-1].encode())}
    assert seg_tok.encode([Segment(text, "increment")]).ids == list(seg_tok.encode_text(text))  # unhealed: as ever


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


def test_ends_at_line_start():
    assert ends_at_line_start("x = 1\n") and ends_at_line_start("a\r")
    assert not ends_at_line_start("x = 1") and not ends_at_line_start("if x:\n    ") and not ends_at_line_start("a\n  b")


@pytest.mark.parametrize("prefix", ["def f(x):\n", "def f(x):\n    y = 1\n", "x = 1\n\n"])
def test_healing_at_a_line_start_lets_the_model_write_break_and_indentation_together(seg_tok, prefix):
    """A prompt ending at a line start ends with a lone line-break (or indentation) token,
    a split ordinary text rarely has: healing drops it, so "\n        " can come back as one."""
    enc = seg_tok.encode([Segment("s", "suffix"), Segment(prefix, "prefix")], heal=True)
    full = seg_tok.encode_text(prefix)
    h = enc.healing
    assert h is not None and h.removed_id == full[-1] and enc.ids[-len(full) + 1 :] == list(full[:-1])
    assert b"\n" in h.removed_bytes or not h.removed_bytes.strip()
    bytes_of = seg_tok.vocab.token_bytes
    assert {i for i, b in enumerate(bytes_of) if b and b.startswith(h.removed_bytes)} == set(h.allowed_ids.tolist())
    assert seg_tok.encode([Segment(prefix, "prefix")], heal=False).healing is None


def test_ends_inside_identifier():
    assert ends_inside_identifier("retu") and ends_inside_identifier("x_1") and ends_inside_identifier("é")
    assert not ends_inside_identifier("x ") and not ends_inside_identifier("f(") and not ends_inside_identifier("")


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
