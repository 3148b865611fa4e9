"""Position encodings at the edge: UTF-16 (default), UTF-8, UTF-32, and LSP line breaks."""

import pytest

from efim_lsp.positions import LineIndex, PositionError

TEXT = "a😀b\r\nxé\rz\n"  # non-BMP, CRLF, lone CR, LF, trailing newline


def test_line_starts_follow_lsp_breaks():
    assert LineIndex(TEXT).starts == [0, 5, 8, 10]
    assert LineIndex("").starts == [0]
    assert LineIndex("\r\n\r\n").starts == [0, 2, 4]


@pytest.mark.parametrize(
    "encoding, character, offset",
    [
        ("utf-16", 1, 1), ("utf-16", 3, 2), ("utf-16", 4, 3),  # 😀 is two UTF-16 units
        ("utf-8", 5, 2), ("utf-8", 6, 3),  # and four UTF-8 bytes
        ("utf-32", 2, 2), ("utf-32", 3, 3),
    ],
)
def test_offsets_in_each_encoding(encoding, character, offset):
    assert LineIndex(TEXT).offset(0, character, encoding) == offset


def test_inside_a_surrogate_pair_snaps_to_the_character_start():
    assert LineIndex(TEXT).offset(0, 2, "utf-16") == 1
    assert LineIndex(TEXT).offset(0, 3, "utf-8") == 1


def test_character_past_line_end_clamps_and_never_lands_in_the_break():
    index = LineIndex(TEXT)
    assert index.offset(0, 99) == 3  # before "\r\n"
    assert index.offset(1, 99) == 7  # before the lone "\r"
    assert index.offset(3, 0) == len(TEXT)


def test_line_past_end_is_an_error_except_the_whole_document_end():
    index = LineIndex("ab")
    assert index.offset(1, 0) == 2
    with pytest.raises(PositionError):
        index.offset(1, 1)
    with pytest.raises(PositionError):
        index.offset(5, 0)
    with pytest.raises(PositionError):
        index.offset(-1, 0)


@pytest.mark.parametrize("encoding", ["utf-8", "utf-16", "utf-32"])
def test_position_round_trips(encoding):
    index = LineIndex(TEXT)
    for offset in range(len(TEXT) + 1):
        if TEXT[offset - 1 : offset + 1] == "\r\n":
            continue  # between CR and LF is not a position
        line, character = index.position(offset, encoding)
        assert index.offset(line, character, encoding) == offset


# --- LineStarts: the line table kept per edit --------------------------------------------

from hypothesis import given, settings, strategies as st  # noqa: E402

from efim_lsp.positions import LineStarts, line_starts  # noqa: E402

_PIECES = st.sampled_from(["a", "bc", "\n", "\r", "\r\n", "😀", " "])
_TEXT = st.lists(_PIECES, max_size=30).map("".join)


@settings(max_examples=200, deadline=None)
@given(text=_TEXT, edits=st.lists(st.tuples(st.integers(0, 200), st.integers(0, 20), _TEXT), max_size=12))
def test_line_starts_kept_per_edit_equal_a_rebuilt_table(text, edits):
    """Any edit (offsets between a CR and its LF included: the table must not care), in any order."""
    starts = LineStarts(text)
    for where, length, new in edits:
        start = where % (len(text) + 1)
        end = min(len(text), start + length)
        text = text[:start] + new + text[end:]
        starts.edit(start, end, len(new), text)
        assert list(starts) == line_starts(text), (start, end, new, text)
        assert len(starts) == len(line_starts(text))
    for offset in range(len(text) + 1):
        assert LineIndex(text, starts).position(offset) == LineIndex(text).position(offset)
