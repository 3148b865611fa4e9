"""Edit sessions over edit scripts: which keystrokes keep the session, which rebase."""

from __future__ import annotations

import pytest

from efim_lsp.documents import DocumentStore, Edit
from efim_lsp.positions import LineIndex
from efim_lsp.session import MAX_INCREMENT_CHARS, MAX_INCREMENT_LINES, Budget, EditSession
from efim_lsp.window import TokenMeter

from lsp_client_model import range_change

BIG = Budget(10_000, 10_000)


class Editor:
    """A client: a text, a cursor, and the session following its edits."""

    def __init__(self, text: str, cursor: int, budget: Budget = BIG):
        self.text, self.cursor, self.budget = text, cursor, budget
        self.session = EditSession(TokenMeter(lambda s: len(s) // 4 + 1, 4.0))

    def edit(self, start: int, end: int, new: str, cursor: int | None = None) -> None:
        self.session.observe(Edit(start, end, new))
        self.text = self.text[:start] + new + self.text[end:]
        self.cursor = start + len(new) if cursor is None else cursor

    def type(self, chars: str, request: bool = True):
        segs = None
        for ch in chars:
            self.edit(self.cursor, self.cursor, ch)
            if request:
                segs = self.request()
        return segs

    def backspace(self, n: int = 1):
        for _ in range(n):
            self.edit(self.cursor - 1, self.cursor, "")
        return self.request()

    def jump(self, offset: int):
        self.cursor = offset
        return self.request()

    def request(self):
        segs = self.session.segments(LineIndex(self.text), self.cursor, self.budget)
        ws = self.session.window_start
        # The contract: the segments are exactly where the session says they are.
        assert self.text[ws : self.cursor] == segs.prefix + segs.increment
        assert self.text.startswith(segs.suffix, self.cursor)
        assert self.session.consistent(self.text)
        return segs


SRC = "import os\n\ndef f(x):\n    \n    return x\n\nprint(f(1))\n"
BODY = SRC.index("    \n") + 4  # end of the blank indented line inside f


def test_typing_keeps_one_session_and_grows_the_increment():
    ed = Editor(SRC, BODY)
    first = ed.request()
    assert first.rebased and first.increment == ""
    seen = []
    for ch in "y = x + 1":
        segs = ed.type(ch)
        assert not segs.rebased and segs.session_id == first.session_id
        assert segs.prefix == first.prefix and segs.suffix == first.suffix
        seen.append(segs.increment)
    assert seen[-1] == "y = x + 1" and seen[0] == "y"


def test_backspace_inside_the_increment_keeps_the_session():
    ed = Editor(SRC, BODY)
    s0 = ed.request()
    ed.type("retu")
    segs = ed.backspace(2)
    assert not segs.rebased and segs.increment == "re" and segs.session_id == s0.session_id


def test_backspace_past_the_anchor_rebases():
    ed = Editor(SRC, BODY)
    ed.request()
    ed.type("ab")
    segs = ed.backspace(3)  # the third one deletes a space of the indentation (P)
    assert segs.rebased and "anchor" in segs.rebase_reason
    assert segs.increment == "" and segs.prefix.endswith("   ")


def test_newline_inside_the_increment_keeps_the_session():
    ed = Editor(SRC, BODY)
    s0 = ed.request()
    segs = ed.type("y = 1\n    z")
    assert not segs.rebased and segs.increment == "y = 1\n    z" and segs.session_id == s0.session_id


def test_cursor_jump_rebases():
    ed = Editor(SRC, BODY)
    ed.request()
    ed.type("y")
    segs = ed.jump(3)
    assert segs.rebased and "cursor moved" in segs.rebase_reason
    assert segs.prefix == "imp" and segs.increment == ""


def test_paste_at_the_cursor_over_the_limit_rebases_at_the_next_request():
    ed = Editor(SRC, BODY)
    ed.request()
    ed.edit(ed.cursor, ed.cursor, "z" * (MAX_INCREMENT_CHARS + 1))
    segs = ed.request()
    assert segs.rebased and "character limit" in segs.rebase_reason
    assert segs.prefix.endswith("z" * 10) and segs.increment == ""


def test_too_many_lines_in_the_increment_rebases():
    ed = Editor(SRC, BODY)
    ed.request()
    ed.type("a\n" * MAX_INCREMENT_LINES, request=False)
    assert not ed.request().rebased
    ed.type("b\n", request=False)
    assert "line limit" in ed.request().rebase_reason


@pytest.mark.parametrize("at", [0, len("import os\n")])
def test_paste_elsewhere_in_the_window_rebases(at):
    ed = Editor(SRC, BODY)
    ed.request()
    ed.type("y")
    cursor = ed.cursor
    ed.edit(at, at, "import sys\n", cursor=cursor + len("import sys\n"))
    segs = ed.request()
    assert segs.rebased and "anchor" in segs.rebase_reason
    assert "import sys" in segs.prefix and segs.prefix.endswith("    y")


def test_edit_in_the_suffix_rebases():
    ed = Editor(SRC, BODY)
    ed.request()
    ed.type("y")
    at = ed.text.index("return x") + len("return ")
    cursor = ed.cursor
    ed.edit(at, at + 1, "q", cursor=cursor)
    segs = ed.request()
    assert segs.rebased and "suffix" in segs.rebase_reason
    assert "return q" in segs.suffix


def test_edits_outside_the_window_keep_the_session():
    text = "".join(f"line_{i} = {i}\n" for i in range(400))
    cursor = text.index("line_200")
    ed = Editor(text, cursor, Budget(100, 60))
    s0 = ed.request()
    assert not s0.prefix.startswith("line_0 ") and len(s0.suffix) < len(text) - cursor
    ed.type("x = ")
    far_below = len(ed.text) - 5
    ed.edit(far_below, far_below, "# tail\n", cursor=ed.cursor)
    ed.edit(0, 0, "# head\n", cursor=ed.cursor + 7)  # above the window: offsets shift
    segs = ed.request()
    assert not segs.rebased and segs.increment == "x = " and segs.prefix == s0.prefix
    assert segs.session_id == s0.session_id


def test_crlf_text_and_a_crlf_newline_count_as_one_line_break():
    text = "def f():\r\n    \r\n    pass\r\n"
    ed = Editor(text, text.index("    \r\n") + 4)
    s0 = ed.request()
    ed.type("a", request=False)
    ed.edit(ed.cursor, ed.cursor, "\r\n")
    segs = ed.type("    b")
    assert not segs.rebased and segs.increment == "a\r\n    b" and segs.session_id == s0.session_id
    assert segs.suffix.startswith("\r\n    pass")


def test_non_bmp_characters_through_utf16_positions():
    """Drive the session from client-side UTF-16 positions through the document store."""
    uri = "file:///e.py"
    text = "s = '😀'\nt = ''\n"
    store = DocumentStore("utf-16")
    doc = store.open(uri, "python", 0, text)
    session = EditSession(TokenMeter(None, 4.0))
    cursor = text.index("''") + 1
    first = session.segments(doc.index, cursor, BIG)
    client, version = text, 0
    for ch in "𝔘😀x":
        version += 1
        out = store.change(uri, version, [range_change(client, cursor, cursor, ch)])
        client = client[:cursor] + ch + client[cursor:]
        for edit in out.edits:
            session.observe(edit)
        cursor += 1
        assert doc.text == client
    segs = session.segments(doc.index, cursor, BIG)
    assert not segs.rebased and segs.increment == "𝔘😀x" and segs.session_id == first.session_id
    assert segs.prefix.endswith("t = '") and segs.suffix.startswith("'\n")


def test_budget_change_rebases_and_rebases_are_counted():
    ed = Editor(SRC, BODY)
    ed.request()
    ed.budget = Budget(50, 50)
    segs = ed.request()
    assert segs.rebased and "budget" in segs.rebase_reason
    assert ed.session.rebases == 1


def test_prefix_last_layouts_keep_the_session_through_edits_just_before_the_cursor():
    """Suffix-first templates (and prefix-only models) put P_win and inc last: a backspace
    after a jump, or a selection deleted before the cursor, only shortens the prompt's tail."""
    from efim_lsp.documents import Edit  # noqa: PLC0415
    from efim_lsp.positions import LineIndex  # noqa: PLC0415
    from efim_lsp.session import Budget, EditSession  # noqa: PLC0415

    text = "def f(x):\n    return x + 1\n\nprint(f(2))\n"
    cursor = text.index(" + 1") + 4
    budget = Budget(100, 100)
    for prefix_last in (True, False):
        s = EditSession()
        s.prefix_last = prefix_last
        first = s.segments(LineIndex(text), cursor, budget)
        t = text
        for k in range(3):  # backspace x3
            s.observe(Edit(cursor - 1 - k, cursor - k, ""))
            t = t[: cursor - 1 - k] + t[cursor - k :]
        cur = cursor - 3
        t2 = t[:cur] + "2" + t[cur:]
        s.observe(Edit(cur, cur, "2"))
        seg = s.segments(LineIndex(t2), cur + 1, budget)
        assert s.consistent(t2)
        assert seg.prefix + seg.increment + seg.suffix == t2[: cur + 1] + t2[cur + 1 : cur + 1 + len(seg.suffix)]
        if prefix_last:
            assert not seg.rebased and seg.suffix == first.suffix
            assert seg.prefix == first.prefix[:-3] and seg.increment == "2"
        else:
            assert seg.rebased
