"""Suggestion post-processing cases."""

import pytest

from efim_lsp.suggest import CursorContext, choose_mode, distinct_alternatives, shape


def ctx_at(text_with_cursor: str) -> CursorContext:
    cursor = text_with_cursor.index("|")
    return CursorContext.at(text_with_cursor.replace("|", "", 1), cursor)


@pytest.mark.parametrize(
    "doc, multiline, mode",
    [
        ("x = fo|\n", "auto", "line"),  # mid-statement at end of line
        ("print(|)\n", "auto", "line"),  # code to the right
        ("def f(x):|\n", "auto", "block"),  # end of a line that opens a block
        ("def f(x):\n    |\n", "auto", "block"),  # empty line inside a block
        ("def f(x):\n|\n", "auto", "block"),  # unindented empty line right under an opener
        ("import os\n|\n", "auto", "line"),  # top-level empty line
        ("def f(x):|\n", "never", "line"),
        ("x = fo|\n", "always", "block"),
        ("int main() {|\n", "auto", "block"),
    ],
)
def test_mode(doc, multiline, mode):
    assert choose_mode(ctx_at(doc), multiline) == mode


def test_single_line_cuts_at_the_newline_and_strips_trailing_whitespace():
    ctx = ctx_at("x = fo|\n")
    assert shape("o(bar)   \nmore()\n", ctx, "line") == ("o(bar)", True)


def test_block_is_cut_where_indentation_leaves_it():
    ctx = ctx_at("def f(x):|\n")
    gen = "\n    y = x + 1\n\n    return y\n\ndef g():\n    pass\n"
    assert shape(gen, ctx, "block").text == "\n    y = x + 1\n\n    return y"


def test_block_on_an_empty_line_inside_a_block():
    ctx = ctx_at("def f(x):\n    if x:\n        |\n    return 0\n")
    gen = "x += 1\n        x *= 2\n    return x\n"
    shaped = shape(gen, ctx, "block")
    assert shaped.text == "x += 1\n        x *= 2" and shaped.final


def test_cut_when_the_generation_repeats_the_next_suffix_line():
    ctx = ctx_at("def f(x):\n    y = 1|\n    return y\n")
    assert shape("\n    z = 2\n    return y\n", ctx, "block").text == "\n    z = 2"
    # a single line that would duplicate the next line entirely is no suggestion
    ctx2 = ctx_at("def f(x):\n    |\n    return y\n")
    assert shape("return y\n", ctx2, "block").text == ""


def test_bracket_already_closed_after_the_cursor_is_not_repeated():
    ctx = ctx_at("print(|)\n")
    assert shape("x, y)\n", ctx, "line").text == "x, y"
    ctx = ctx_at("f(a[|])\n")
    assert shape("0])", ctx, "line").text == "0"
    # a closer inside a string does not count; a matched pair inside the suggestion stays
    assert shape("g(')'), 1)", ctx_at("print(|)\n"), "line").text == "g(')'), 1"


def test_closer_not_present_after_the_cursor_is_kept():
    ctx = ctx_at("x = foo(a, |\n")
    assert shape("b)\n", ctx, "line").text == "b)"


def test_overlap_with_the_text_right_of_the_cursor_is_dropped():
    ctx = ctx_at('s = "|"\n')
    assert shape('hello"', ctx, "line").text == "hello"


def test_closing_brace_line_kept_when_the_suffix_lacks_it():
    ctx = ctx_at("int main() {|\n")
    gen = "\n    return 0;\n}\nint other() {\n"
    assert shape(gen, ctx, "block").text == "\n    return 0;\n}"
    ctx_closed = ctx_at("int main() {|\n}\n")
    assert shape(gen, ctx_closed, "block").text == "\n    return 0;"


@pytest.mark.parametrize("gen", ["", "   ", "\n\n", " \n  \n"])
def test_never_an_empty_item(gen):
    assert shape(gen, ctx_at("x = |\n"), "line").text == ""
    assert shape(gen, ctx_at("def f():|\n"), "block").text == ""


def test_a_generation_cut_short_ends_at_a_line_boundary_or_a_whole_word():
    ctx = ctx_at("def f(x):|\n")
    gen = "\n    y = x + 1\n    if y > 2:\n        return fo"
    assert shape(gen, ctx, "block").text.endswith("return fo")  # a finished generation keeps its last line
    assert shape(gen, ctx, "block", cut_short=True).text == "\n    y = x + 1\n    if y > 2:"
    assert shape("\r\n    y = 1\r\n    z = (", ctx, "block", cut_short=True).text == "\n    y = 1"
    # one unfinished line: kept up to its last whole word; a word fragment alone is nothing
    assert shape("o(bar, ba", ctx_at("x = fo|\n"), "line", cut_short=True).text == "o(bar,"
    assert shape("o(bar)\nmore(", ctx_at("x = fo|\n"), "line", cut_short=True).text == "o(bar)"
    assert shape("o_bar_ba", ctx_at("x = fo|\n"), "line", cut_short=True).text == ""
    assert shape("o(bar) + 1", ctx_at("x = fo|\n"), "line", cut_short=True).text == "o(bar) +"


def test_alternatives_cut_short_lose_their_unfinished_line_and_repeats_go():
    ctx = ctx_at("def f(x):|\n")
    first = shape("\n    return x\n", ctx, "block").text
    alts = distinct_alternatives(first, [("\n    return x\n", False), ("\n    y = 2\n    return (y", True), ("\n    y = 2\n", False), ("\n    retu", True)], ctx, "block")
    assert alts == ("\n    y = 2",)


def test_streaming_final_flag():
    ctx = ctx_at("def f(x):|\n")
    assert not shape("\n    y = 1", ctx, "block", done=False).final
    assert not shape("\n    y = 1\n", ctx, "block", done=False).final
    # the dedented line has begun: the block is over, decoding can stop
    assert shape("\n    y = 1\nd", ctx, "block", done=False).final
    assert shape("o(1)\n", ctx_at("x = fo|\n"), "line", done=False).final


def test_crlf_generation_is_split_on_any_line_break():
    ctx = ctx_at("def f(x):|\r\n")
    assert shape("\r\n    return x\r\nprint(1)", ctx, "block").text == "\n    return x"


def test_an_open_docstring_is_closed_where_nothing_below_could_close_it():
    ctx = ctx_at("def f(x):\n    |\n    return x\n")
    assert shape('"""Return x.\n', ctx, "line").text == '"""Return x."""'
    assert shape("'''Return x.", ctx, "line", done=True).text == "'''Return x.'''"
    assert shape('"""Return x."""\n', ctx, "line").text == '"""Return x."""'  # already closed
    assert shape('"""Return x.', ctx, "line", done=False).text == '"""Return x.'  # still streaming: may close itself
    assert shape('"""Return x.\n', ctx, "line", close_docstring=False).text == '"""Return x.'
    # The lines below may hold the end: a docstring being retyped above its body.
    below = ctx_at('def f(x):\n    |\n    More words.\n    """\n    return x\n')
    assert shape('"""Return x.\n', below, "line").text == '"""Return x.'
    # Inside a string already, and on a line with text before the cursor: left alone.
    inside = ctx_at('def f(x):\n    """Doc.\n\n    |\n')
    assert shape('"""\n', inside, "line").text == '"""'
    assert shape('"Return x.\n', ctx_at('def f(x):\n    s = """|\n'), "line").text == '"Return x.'


def test_the_off_side_rule_drops_a_statement_written_where_a_header_belongs():
    # the emptied line was `if y:`; a plain statement above the deeper body would not parse
    text = "def f(x, y):\n    x = 1\n    |\n        return x\n    return y\n"
    ctx = CursorContext.at(text.replace("|", ""), text.index("|"), offside=True)
    assert shape("x += 2\n", ctx, "block").text == ""
    assert shape("if y:\n", ctx, "block").text == "if y:"
    assert shape("x += 2\n    if x > y:", ctx, "block").text == "x += 2\n    if x > y:"
    assert shape("foo(x,", ctx, "block").text == "foo(x,"  # continues onto the deeper line
    assert shape("# the header goes here\n", ctx, "block").text == ""  # a comment leaves it missing
    # a multi-line suggestion loses only its trailing lines that break the rule
    assert shape("x += 2\n    z = 3\n", ctx, "block").text == ""
    assert shape("if y:\n        x = 2\n    z = 3", ctx, "block").text == "if y:\n        x = 2"
    # without the off-side rule (another language) the suggestion stands
    assert shape("x += 2\n", ctx._replace(offside=False), "block").text == "x += 2"


def test_the_off_side_rule_keeps_a_new_header_and_lines_above_code_at_their_level():
    # a header above code at its own level: a new block being written, its body to come
    text = "def f(x):\n    x = 1\n    if x > 0|\n    return x\n"
    ctx = CursorContext.at(text.replace("|", ""), text.index("|"), offside=True)
    assert shape(":\n", ctx, "line").text == ":"
    text = "def f(x):\n    x = 1\n    |\n    # a comment\n    return x\n"
    ctx = CursorContext.at(text.replace("|", ""), text.index("|"), offside=True)
    assert shape("y = 2\n", ctx, "block").text == "y = 2"
    # a comment below does not count; the code line under it does
    text = "def f(x):\n    |\n            # deep comment\n        return x\n"
    ctx = CursorContext.at(text.replace("|", ""), text.index("|"), offside=True)
    assert shape("y = 2\n", ctx, "block").text == "" and shape("if x:\n", ctx, "block").text == "if x:"
    # inside a docstring the lines are text: an indented paragraph below is no body
    text = 'def f(x):\n    """Sum.\n\n    |\n        indented example\n    """\n'
    ctx = CursorContext.at(text.replace("|", ""), text.index("|"), offside=True)
    assert ctx.in_string and shape("Returns the total.\n", ctx, "block").text == "Returns the total."
    # text right of the cursor ends the line, not the suggestion: nothing to judge
    text = "def f(x):\n    y = |x\n        return x\n"
    ctx = CursorContext.at(text.replace("|", ""), text.index("|"), offside=True)
    assert shape("2 * ", ctx, "line").text == "2 *"
