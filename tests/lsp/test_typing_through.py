"""Typing-through: typed characters that match the suggestion on screen."""

from efim_lsp.documents import Edit
from efim_lsp.typing_through import TypingThrough


def typed(tt: TypingThrough, text: str, cursor: int, chars: str) -> tuple[str, int]:
    for ch in chars:
        tt.observe(Edit(cursor, cursor, ch))
        text = text[:cursor] + ch + text[cursor:]
        cursor += 1
    return text, cursor


def test_remainder_while_typing_a_prefix_of_the_suggestion():
    tt = TypingThrough()
    text, cursor = "x = \nnext\n", 4
    tt.remember(cursor, "foo(bar)")
    assert tt.remainder(text, cursor) == "foo(bar)"
    text, cursor = typed(tt, text, cursor, "foo(")
    assert tt.remainder(text, cursor) == "bar)"
    text, cursor = typed(tt, text, cursor, "bar)")
    assert tt.remainder(text, cursor) is None  # fully typed: nothing left to suggest


def test_backspace_inside_the_run_still_matches():
    tt = TypingThrough()
    text, cursor = "x = \n", 4
    tt.remember(cursor, "foo(bar)")
    text, cursor = typed(tt, text, cursor, "fox")
    assert tt.remainder(text, cursor) is None
    tt.observe(Edit(cursor - 1, cursor, ""))
    text, cursor = text[: cursor - 1] + text[cursor:], cursor - 1
    assert tt.remainder(text, cursor) == "o(bar)"


def test_edits_elsewhere_or_cursor_moves_forget_it():
    tt = TypingThrough()
    text, cursor = "x = \ny = 2\n", 4
    tt.remember(cursor, "foo")
    assert tt.remainder(text, cursor + 1) is None  # cursor elsewhere
    tt.observe(Edit(8, 9, "3"))  # an edit below
    assert tt.remainder(text, cursor) is None and not tt.active


def test_edits_above_only_move_it():
    tt = TypingThrough()
    text, cursor = "a\nx = \n", 6
    tt.remember(cursor, "foo")
    tt.observe(Edit(0, 0, "# c\n"))
    text, cursor = "# c\n" + text, cursor + 4
    text, cursor = typed(tt, text, cursor, "f")
    assert tt.remainder(text, cursor) == "oo"


def test_whitespace_only_remainder_is_not_offered():
    tt = TypingThrough()
    text, cursor = "x = \n", 4
    tt.remember(cursor, "ab  ")
    text, cursor = typed(tt, text, cursor, "ab")
    assert tt.remainder(text, cursor) is None


def test_a_backspace_before_the_suggestion_forgets_it():
    """Deleting what the suggestion continues (here the "fi" it completes to "fill") leaves it
    continuing nothing: it must not come back at the new cursor."""
    tt = TypingThrough()
    text, cursor = "from m import fi\n", 16
    tt.remember(cursor, "ll")
    tt.observe(Edit(14, 16, ""))  # both letters selected and deleted
    assert tt.remainder("from m import \n", 14) is None
    tt.remember(16, "ll")
    tt.observe(Edit(15, 16, ""))  # one Backspace
    assert tt.remainder("from m import f\n", 15) is None
