"""The call-site and parallel-line proposers (efim_lsp.next_edit.call_sites, .parallel) and
the dispatcher in front of them: the edits they offer, where they stay silent (text that does
not parse, noise), and that every range they give is valid in the current text."""

from __future__ import annotations

import ast

import pytest
from lsp_client_model import range_change

from efim_lsp.documents import DocumentStore
from efim_lsp.next_edit import call_sites, parallel
from efim_lsp.next_edit.dispatch import propose
from efim_lsp.next_edit.history import EditHistory
from efim_lsp.next_edit.service import NextEdits
from efim_lsp.stats import ServerStats


def typed(text: str, start: int, end: int, new: str) -> tuple[str, EditHistory]:
    """`text[start:end]` retyped as `new` key by key (a deletion: one change), as editors send it."""
    history = EditHistory()
    history.observe(start, end, text[start:end], new[:1])
    text = text[:start] + new[:1] + text[end:]
    for i, ch in enumerate(new[1:], start + 1):
        history.observe(i, i, "", ch)
        text = text[:i] + ch + text[i:]
    return text, history


def edit_at(text: str, anchor: str, old: str, new: str, *, nth: int = 0):
    """Type `new` over `old` inside the `nth` occurrence of `anchor`: (text after, proposal)."""
    at = -1
    for _ in range(nth + 1):
        at = text.index(anchor, at + 1)
    at += anchor.index(old) if old else len(anchor)
    text, history = typed(text, at, at + len(old), new)
    return text, propose(text, history.last)


def applied(text: str, edit) -> str:
    assert edit is not None
    assert 0 <= edit.start <= edit.end <= len(text)  # a valid range in the current text
    return text[: edit.start] + edit.new_text + text[edit.end :]


def line_of(text: str, offset: int) -> str:
    a = text.rfind("\n", 0, offset) + 1
    b = text.find("\n", offset)
    return text[a : b if b >= 0 else len(text)]


CALLS = '''import os


def scale(w, h):
    return w * h


def report(items):
    # scale(1, 2) in a comment is not a call
    print("scale(3, 4) in a string is not one either")
    first = scale(len(items), 2)
    second = scale(w=1, h=3)
    third = scale(*items)
    return first + second + scale(4, 5)


class Box:
    def __init__(self, w):
        self.w = w

    def grow(self, k, fast=False):
        return Box(self.w * k)

    def twice(self):
        return self.grow(2) + self.grow(k=3, fast=True)


total = scale(6, 7) + len(os.sep)
'''


def test_an_added_parameter_is_appended_at_the_next_call_that_lacks_it():
    text, edit = edit_at(CALLS, "def scale(w, h", "", ", depth")
    after = applied(text, edit)
    assert line_of(after, edit.start) == "    first = scale(len(items), 2, depth)"  # not the comment, not the string
    assert edit.reason.startswith("call site of scale: add depth")
    # Applied, the next call: keywords already there, so a keyword.
    history = EditHistory()
    history.observe(edit.start, edit.end, text[edit.start : edit.end], edit.new_text)
    nxt = propose(after, history.last)
    assert nxt is None  # the latest change is now at the call, not the signature
    text2, edit2 = edit_at(CALLS.replace("scale(len(items), 2)", "scale(len(items), 2, depth)"), "def scale(w, h", "", ", depth")
    assert line_of(applied(text2, edit2), edit2.start) == "    second = scale(w=1, h=3, depth=depth)"
    # `*items` cannot be told: passed over, to the call after it.
    done = CALLS.replace("scale(len(items), 2)", "scale(len(items), 2, depth)").replace("scale(w=1, h=3)", "scale(w=1, h=3, depth=depth)")
    text3, edit3 = edit_at(done, "def scale(w, h", "", ", depth")
    assert line_of(applied(text3, edit3), edit3.start) == "    return first + second + scale(4, 5, depth)"


def test_accepted_call_fixes_lead_on_to_the_next_call_and_anything_else_ends_it():
    at = CALLS.index("def scale(w, h") + len("def scale(w, h")
    text, history = typed(CALLS, at, at, ", depth")
    seen = []
    while (edit := propose(text, history.last, history.changes[:-1])) is not None:
        seen.append(line_of(applied(text, edit), edit.start).strip())
        history.observe(edit.start, edit.end, text[edit.start : edit.end], edit.new_text)  # the client applies it
        text = applied(text, edit)
    assert seen == ["first = scale(len(items), 2, depth)", "second = scale(w=1, h=3, depth=depth)",
                    "return first + second + scale(4, 5, depth)", "total = scale(6, 7, depth) + len(os.sep)"]
    # The same argument typed by hand at a call also leads on; another edit ends it.
    text, history = typed(CALLS, at, at, ", depth")
    call = text.index("scale(len(items), 2") + len("scale(len(items), 2")
    for i, ch in enumerate(", depth"):
        history.observe(call + i, call + i, "", ch)
        text = text[: call + i] + ch + text[call + i :]
    assert line_of(text, propose(text, history.last, history.changes[:-1]).start).strip() == "second = scale(w=1, h=3)"
    history.observe(0, 0, "", "#\n")
    text = "#\n" + text
    assert call_sites.propose(text, history.last, history.changes[:-1]) is None


def test_a_default_is_passed_by_keyword_and_a_call_above_comes_last():
    src = "total = scale(6, 7)\n\n\ndef scale(w, h):\n    return w * h\n"
    text, edit = edit_at(src, "def scale(w, h", "", ", depth=1")
    assert applied(text, edit).startswith("total = scale(6, 7, depth=1)\n")
    assert "(above)" in edit.reason


def test_a_dropped_parameter_is_removed_with_its_comma():
    text, edit = edit_at(CALLS, "def scale(w, h", ", h", "")
    after = applied(text, edit)
    assert line_of(after, edit.start) == "    first = scale(len(items))"
    done = CALLS.replace("scale(len(items), 2)", "scale(len(items))")
    text, edit = edit_at(done, "def scale(w, h", ", h", "")
    assert line_of(applied(text, edit), edit.start) == "    second = scale(w=1)"  # by keyword
    # The first of several, and the only one.
    src = "def f(a, b):\n    pass\n\nf(1, 2)\nf(3)\n"
    text, edit = edit_at(src, "def f(a, b", "a, ", "")
    assert applied(text, edit).endswith("f(2)\nf(3)\n")
    src = "def f(a):\n    pass\n\nf(\n    1,\n)\n"
    text, edit = edit_at(src, "def f(a", "a", "")
    assert applied(text, edit).endswith("f()\n")


def test_methods_through_self_and_init_through_the_class():
    text, edit = edit_at(CALLS, "def grow(self, k", "", ", slow")
    after = applied(text, edit)
    assert line_of(after, edit.start) == "        return self.grow(2, slow) + self.grow(k=3, fast=True)"
    text, edit = edit_at(CALLS, "def __init__(self, w", "", ", h=0")
    assert line_of(applied(text, edit), edit.start) == "        return Box(self.w * k, h=0)"
    text, edit = edit_at(CALLS, "def grow(self, k, fast=False", ", fast=False", "")
    assert line_of(applied(text, edit), edit.start) == "        return self.grow(2) + self.grow(k=3)"


def test_call_sites_stay_silent_where_nothing_is_due_or_nothing_can_be_told():
    # The signature is unchanged in arity: a default, an annotation, a rename (that one is
    # the rename proposer's), the body.
    for anchor, old, new in (("fast=False", "False", "True"), ("def scale(w", "w", "w: int"), ("return w * h", "w * h", "h * w")):
        text, history = typed(CALLS, CALLS.index(anchor) + anchor.index(old), CALLS.index(anchor) + anchor.index(old) + len(old), new)
        assert call_sites.propose(text, history.last) is None
    # Half typed: the parameter list not closed yet.
    src = "def scale(w, h):\n    pass\n\nscale(1, 2)\n"
    at = src.index("):")
    text, history = typed(src, at, at + 2, ", d")
    assert "def scale(w, h, d\n" in text and call_sites.propose(text, history.last) is None
    # A signature with *args: which position a call fills cannot be told.
    src = "def f(a, *rest):\n    pass\n\nf(1, 2)\n"
    text, history = typed(src, src.index("a, *"), src.index("a, *") + 1, "a, b")
    assert call_sites.propose(text, history.last) is None
    # No call anywhere; every call fits already.
    src = "def f(a):\n    pass\n"
    text, history = typed(src, src.index("a)"), src.index("a)"), "b, ")
    assert call_sites.propose(text, history.last) is None
    src = "def f(a):\n    pass\n\nf(1, 2)\n"
    text, history = typed(src, src.index("a)") + 1, src.index("a)") + 1, ", b")
    assert call_sites.propose(text, history.last) is None


def test_call_sites_work_in_a_file_that_does_not_parse_and_skip_calls_that_do_not():
    src = CALLS.replace("total = scale(6, 7)", "total = scale(6, 7") + "def broken(:\n"
    with pytest.raises(SyntaxError):
        ast.parse(src)
    src = src.replace("first = scale(len(items), 2)", "first = scale(len(items), 2 +)")  # this call does not parse
    text, edit = edit_at(src, "def scale(w, h", "", ", depth")
    assert line_of(applied(text, edit), edit.start) == "    second = scale(w=1, h=3, depth=depth)"


def test_the_proposed_call_parses_after_the_edit():
    for anchor, old, new in (("def scale(w, h", "", ", depth"), ("def scale(w, h", ", h", ""), ("def grow(self, k", "", ", x=None"),
                             ("def grow(self, k, fast=False", "k, ", "")):
        text, edit = edit_at(CALLS, anchor, old, new)
        after = applied(text, edit)
        start = after.rfind("\n", 0, edit.start) + 1
        ast.parse(after[start : after.find("\n", edit.start)].strip())


PARALLEL = '''class Point:
    def __init__(self, x, y, z, label):
        self.x = x
        self.y = y
        # the third axis
        self.z = z
        self.label = label.strip()
        register(x, 1)
        register(y, 1)
        register(z, 1)
        widths = {
            "x": 8,
            "y": 8,
            "z": 12,
        }
'''


@pytest.mark.parametrize(("anchor", "old", "new", "expected"), [
    (" = x\n", "x", "int(x)", "        self.y = int(y)"),  # a value wrapped
    ("self.x = x\n", ".x", "._x", "        self._y = y"),  # an affix at a `_`
    (" = x\n", "x", "x or 0", "        self.y = y or 0"),  # tokens appended
    ("register(x, 1)", "1)", "1, strict=True)", "        register(y, 1, strict=True)"),
    ("register(x, 1)", "register", "record", "        record(y, 1)"),  # a name the lines share
])
def test_a_change_to_one_parallel_line_is_offered_at_the_next(anchor, old, new, expected):
    text, edit = edit_at(PARALLEL, anchor, old, new)
    assert line_of(applied(text, edit), edit.start) == expected


def test_parallel_lines_below_first_then_above_then_done():
    text, edit = edit_at(PARALLEL, "self.y = y", ".y", "._y")
    assert line_of(applied(text, edit), edit.start) == "        self._z = z"  # over the comment line, below first
    history = EditHistory()
    history.observe(edit.start, edit.end, text[edit.start : edit.end], edit.new_text)  # the client applies it
    text = applied(text, edit)
    edit = propose(text, history.last)
    assert line_of(applied(text, edit), edit.start) == "        self._x = x" and "(above)" in edit.reason
    history.observe(edit.start, edit.end, text[edit.start : edit.end], edit.new_text)
    text = applied(text, edit)
    assert propose(text, history.last) is None  # every line of the run has it


def test_parallel_lines_stay_silent_on_noise():
    cases = [
        ('"x": 8', "8", "9"),  # one literal for another
        ('"y": 8', '"y"', '"yy"'),
        ("register(y, 1)", "y", "q"),  # this line's own value replaced, nothing to carry it
        (" = x\n", "x", "x  # note"),  # a comment
        (" = x\n", "x", "int(x"),  # half typed: a bracket left open
        (" = x\n", "x", "x +"),  # half typed: an operator at the end
        ("self.label = label.strip()", "strip", "lower"),  # no line of its shape around
        ("self.x = x\n", "x = x\n", "x = x\n        self.w = w\n"),  # a new line typed
    ]
    for anchor, old, new in cases:
        text, history = typed(PARALLEL, PARALLEL.index(anchor) + anchor.index(old), PARALLEL.index(anchor) + anchor.index(old) + len(old), new)
        assert parallel.propose(text, history.last) is None, (anchor, old, new)
    # Two lines of a shape are not a run; nor are lines of another indentation.
    src = "a.x = 1\na.y = 2\n\nb.x = 1\n    b.y = 2\nb.z = 3\n"
    text, history = typed(src, 0, 1, "aa")
    assert parallel.propose(text, history.last) is None
    text, history = typed(src, src.index("b.x"), src.index("b.x") + 1, "c")
    assert parallel.propose(text, history.last) is None
    # A default written out differently (`None` -> `-1`, -> `True`) in a run of keyword lines.
    src = "f(\n    a=None,\n    b=None,\n    c=None,\n)\n"
    for new in ("-1", "True", "'x'"):
        text, history = typed(src, src.index("None"), src.index("None") + 4, new)
        assert parallel.propose(text, history.last) is None
    text, history = typed(src, src.index("None"), src.index("None") + 4, "None or 1")
    assert line_of(applied(text, parallel.propose(text, history.last)), text.index("b=")) == "    b=None or 1,"
    # Lines that do not tokenize (an unterminated string) are no run.
    src = "f('a', 1)\nf('b, 1)\nf('c', 1)\n"
    text, history = typed(src, src.index("1)"), src.index("1)") + 1, "1, 2")
    assert parallel.propose(text, history.last) is None


def test_imports_are_not_parallel_lines():
    src = "from a import b\nfrom c import d\nfrom e import f\n"
    text, history = typed(src, src.index("b"), src.index("b") + 1, "b as x")
    assert parallel.propose(text, history.last) is None


def test_the_service_checks_apply_to_call_sites_and_parallel_lines():
    docs, stats = DocumentStore(), ServerStats()
    service = NextEdits(docs, stats)
    uri = "file:///p.py"
    docs.open(uri, "python", 1, CALLS)
    service.opened(uri)
    at = CALLS.index("def scale(w, h") + len("def scale(w, h")
    version = 1
    for i, ch in enumerate(", depth"):
        version += 1
        out = docs.change(uri, version, [range_change(docs.get(uri).text, at + i, at + i, ch)])
        service.changed(uri, out)
    text = docs.get(uri).text
    offer = service.propose(uri, version, at + 7)
    assert offer is not None and line_of(applied(text, offer.edit), offer.edit.start) == "    first = scale(len(items), 2, depth)"
    assert service.propose(uri, version - 1, None) is None  # an older version
    assert service.propose(uri, version, offer.edit.start) is None  # the cursor on the call


def test_a_proposer_that_fails_costs_the_answer_not_the_request(monkeypatch):
    import efim_lsp.next_edit.service as service_module

    def broken(*_args):
        raise RuntimeError("a bug")

    monkeypatch.setattr(service_module, "propose", broken)
    docs, stats = DocumentStore(), ServerStats()
    service = NextEdits(docs, stats)
    docs.open("file:///b.py", "python", 1, CALLS)
    service.opened("file:///b.py")
    service.changed("file:///b.py", docs.change("file:///b.py", 2, [range_change(CALLS, 0, 0, "#")]))
    assert service.propose("file:///b.py", 2, None) is None and stats.next_edit_empty == 1
