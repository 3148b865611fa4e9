"""Next edits without a model (efim_lsp.next_edit): the edit history's coalescing, the
rename proposer's places and silences, and the service's version/range/cursor rules."""

from __future__ import annotations

import re

from efim_lsp.documents import DocumentStore, FullChange
from efim_lsp.next_edit.history import Change, EditHistory
from efim_lsp.next_edit.proposer import enclosing_block, propose, rename_of
from efim_lsp.next_edit.service import NextEdits
from efim_lsp.stats import ServerStats

from lsp_client_model import range_change

SRC = '''import os


def total(paths, limit):
    size = 0
    for path in paths:
        if size > limit:
            break
        size += os.path.getsize(path)
    return size


def other(path):
    return path.upper()
'''


def typed(text: str, start: int, end: int, new: str, *, by_keys: bool = True) -> tuple[str, EditHistory]:
    """`text[start:end]` retyped as `new`: the selection replaced by the first key, then one
    key at a time (what an editor sends), or at once."""
    history = EditHistory()
    if not by_keys:
        history.observe(start, end, text[start:end], new)
        return text[:start] + new + text[end:], history
    history.observe(start, end, text[start:end], new[:1])
    text = text[:start] + new[:1] + text[end:]
    for i, ch in enumerate(new[1:], start + 1):
        history.observe(i, i, "", ch)
        text = text[:i] + ch + text[i:]
    return text, history


def test_keystrokes_over_a_selection_coalesce_into_one_replacement():
    start = SRC.index("size = 0")
    text, history = typed(SRC, start, start + 4, "total")
    assert history.changes == [Change(start, "size", "total")]
    # Backspace at the end, then retyped: still the same change.
    history.observe(start + 4, start + 5, "l", "")
    history.observe(start + 4, start + 4, "", "L")
    assert history.last == Change(start, "size", "totaL")
    # An edit elsewhere starts another change; one before the first moves it.
    history.observe(0, 0, "", "# x\n")
    assert history.changes == [Change(start + 4, "size", "totaL"), Change(0, "", "# x\n")]


def test_a_rename_is_proposed_at_the_next_occurrence_below_in_the_function():
    start = SRC.index("size = 0")
    text, history = typed(SRC, start, start + 4, "total")
    edit = propose(text, history.last)
    at = text.index("size > limit")
    assert (edit.start, edit.end, edit.new_text) == (at, at + 4, "total")
    # Applied, the next proposal is the next one, and the last one in the function ends it.
    while edit is not None:
        text = text[: edit.start] + edit.new_text + text[edit.end :]
        history.observe(edit.start, edit.end, "size", "total")
        edit = propose(text, history.last)
    assert re.search(r"\bsize\b", text[text.index("def total") : text.index("def other")]) is None


def test_a_parameter_rename_on_the_def_line_stays_in_its_function():
    start = SRC.index("paths, limit")
    text, history = typed(SRC, start, start + 5, "files")
    edit = propose(text, history.last)
    assert text[edit.start : edit.end] == "paths" and edit.start == text.index("in paths") + 3
    # `path` in other() is another variable: renaming total's `path` never reaches it.
    start = text.index("for path") + 4
    text, history = typed(text, start, start + 4, "p")
    edit = propose(text, history.last)
    assert edit.start == text.index("getsize(path)") + len("getsize(")
    assert edit.start < text.index("def other")


def test_typing_at_the_end_of_a_name_is_a_rename_of_the_whole_word():
    at = SRC.index("limit):") + len("limit")
    text, history = typed(SRC, at, at, "_bytes")
    assert rename_of(text, history.last).old == "limit" and rename_of(text, history.last).new == "limit_bytes"
    edit = propose(text, history.last)
    assert text[edit.start : edit.end] == "limit" and edit.new_text == "limit_bytes"


def test_above_when_nothing_is_left_below():
    at = SRC.index("return size") + len("return ")
    text, history = typed(SRC, at, at + 4, "n")
    edit = propose(text, history.last)
    assert text[edit.start : edit.end] == "size" and edit.start == text.index("size += os") and edit.new_text == "n"


def test_silence_when_no_rename_is_due():
    # New code typed on a new line.
    at = SRC.index("    return size")
    text, history = typed(SRC, at, at, "    print(size)\n")
    assert propose(text, history.last) is None
    # A literal changed.
    at = SRC.index("0\n")
    text, history = typed(SRC, at, at + 1, "10")
    assert propose(text, history.last) is None
    # A name with no other occurrence in its function.
    at = SRC.index("os.path")
    text, history = typed(SRC, at, at + 2, "osx")
    assert propose(text, history.last) is None
    # A keyword or a constant changed (`if` -> `elif`, `True` -> `False`).
    at = SRC.index("if size")
    text, history = typed(SRC, at, at + 2, "elif")
    assert propose(text + "    if x:\n        pass\n", history.last) is None
    flag = "def f(a):\n    a = True\n    return True\n"
    text, history = typed(flag, flag.index("True"), flag.index("True") + 4, "False")
    assert propose(text, history.last) is None
    # Lines deleted.
    at = SRC.index("        if size")
    end = SRC.index("        size +=")
    text, history = typed(SRC, at, end, "", by_keys=False)
    assert propose(text, history.last) is None
    assert propose(SRC, None) is None


def test_the_enclosing_block_is_the_function_around_the_offset():
    lo, hi = enclosing_block(SRC, SRC.index("break"))
    assert SRC[lo:hi].startswith("def total(") and "def other" not in SRC[lo:hi]
    assert enclosing_block(SRC, SRC.index("import os")) == (0, len(SRC))


def _service(text: str = SRC):
    docs, stats = DocumentStore(), ServerStats()
    service = NextEdits(docs, stats)
    docs.open("file:///a.py", "python", 1, text)
    service.opened("file:///a.py")
    return docs, stats, service


def _change(docs, service, version, start, end, new):
    out = docs.change("file:///a.py", version, [range_change(docs.get("file:///a.py").text, start, end, new)])
    service.changed("file:///a.py", out)


def test_the_service_offers_only_for_the_current_version_and_away_from_the_cursor():
    docs, stats, service = _service()
    start = SRC.index("size = 0")
    for i, ch in enumerate("total"):
        _change(docs, service, 2 + i, start + i, start + (4 if i == 0 else i), ch)
    version = docs.get("file:///a.py").version
    assert service.propose("file:///a.py", version - 1, None) is None  # an older version
    assert service.propose("file:///unknown.py", 1, None) is None
    offer = service.propose("file:///a.py", version, start + 5)
    assert offer is not None and docs.get("file:///a.py").text[offer.edit.start : offer.edit.end] == "size"
    assert service.propose("file:///a.py", version, offer.edit.start + 1) is None  # the cursor is in it
    assert service.accepted(offer.id) and not service.accepted(offer.id) and not service.accepted("x")
    assert (stats.next_edit_requests, stats.next_edit_offered, stats.next_edit_accepted, stats.next_edit_stale_accepts) == (4, 1, 1, 2)
    # A full-text change forgets the history: its offsets mean nothing in the new text.
    service.changed("file:///a.py", docs.change("file:///a.py", version + 1, [FullChange(SRC)]))
    assert service.propose("file:///a.py", version + 1, None) is None


def test_off_answers_nothing():
    docs, stats, service = _service()
    service.enabled = lambda: False
    start = SRC.index("size = 0")
    _change(docs, service, 2, start, start + 4, "total")
    assert service.propose("file:///a.py", 2, None) is None and stats.next_edit_empty == 1
