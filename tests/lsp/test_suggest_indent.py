"""shape()'s indentation snap: 1-3 stray leading spaces on an already indented empty line."""

from __future__ import annotations

from efim_lsp.suggest import CursorContext, shape


def _shape(doc: str, generated: str, mode="line", **kw) -> str:
    cursor = doc.index("|")
    return shape(generated, CursorContext.at(doc.replace("|", "", 1), cursor), mode, **kw).text


def test_a_stray_space_after_the_indentation_is_dropped():
    doc = "def f(x):\n    y = 1\n    |\n    return y\n"
    assert _shape(doc, " z = y + 1") == "z = y + 1"
    assert _shape(doc, "  z = y + 1\n") == "z = y + 1"
    assert _shape(doc, " z = y + 1", snap_indent=False) == " z = y + 1"


def test_deeper_levels_tabs_and_unindented_lines_are_kept():
    assert _shape("def f(x):\n    if x:\n    |\n", "    y = 1") == "    y = 1"  # a whole level after an opener
    assert _shape("def f(x):\n    if x:\n    |\n", " y = 1") == " y = 1"  # after an opener: not guessed
    assert _shape("def f(x):\n    y = 1\n    |\n      z = 2\n", "  w = 3") == "  w = 3"  # a level the code below uses
    assert _shape("def f(x):\n\ty = 1\n\t|\n", " z") == " z"  # tabs
    assert _shape("x = 1\n|\n", " y = 2") == " y = 2"  # nothing typed


def test_under_an_opener_the_typed_body_level_counts():
    assert _shape("def f(x):\n    if x:\n        |\n    return x\n", " y = 1") == "y = 1"
    assert _shape("def f(x):\n    if x:\n    |\n    return x\n", " y = 1") == " y = 1"
