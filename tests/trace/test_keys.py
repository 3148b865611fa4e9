"""The key-press split every typist shares: tabs, auto-indentation after Enter, unicode."""

from __future__ import annotations

import random

from efim_tools.trace.blocks import Block
from efim_tools.trace.keys import key_presses
from efim_tools.trace.typist import TypingStyle, type_block


def test_enter_brings_the_next_lines_indentation_spaces_and_tabs_alike():
    body = "if x:\n    y = 1\n\tz = 2\n \t w\n"
    assert key_presses(body) == [
        "i", "f", " ", "x", ":", "\n    ", "y", " ", "=", " ", "1", "\n\t", "z", " ", "=", " ", "2", "\n \t ", "w", "\n",
    ]


def test_a_tab_inside_a_line_is_its_own_key():
    assert key_presses("a\tb  c") == ["a", "\t", "b", " ", " ", "c"]


def test_leading_indentation_is_one_edit_and_blank_lines_are_one_enter_each():
    assert key_presses("\t  x\n\n\ty") == ["\t  ", "x", "\n", "\n\t", "y"]


def test_each_line_break_kind_is_one_enter():
    assert key_presses("a\r\n  b\rc\n\td") == ["a", "\r\n  ", "b", "\r", "c", "\n\t", "d"]


def test_a_character_is_one_key_in_code_points():
    assert key_presses("é日😀𝄞") == ["é", "日", "😀", "𝄞"]
    assert key_presses("e\u0301") == ["e", "\u0301"]  # a combining accent: its own code point


def test_joining_the_keys_gives_the_body_back():
    for body in ("", " ", "\t\n", "def f():\r\n\treturn '😀'\r\n", "x\n    \n    y\n\n"):
        assert "".join(key_presses(body)) == body


def test_the_typist_types_exactly_these_keys():
    original = "def f():\n\tif x:\n\t\treturn 'é😀'\n\treturn 0\n"
    block = Block(9, len(original) - 1, "f", 3)
    _, keys = type_block(original, block, TypingStyle(wpm=50, typo_rate=0.0, jump_rate=0.0), random.Random(0))
    assert [k.text for k in keys] == key_presses(original[block.start : block.end])
    assert {k.kind for k in keys} == {"type"}
