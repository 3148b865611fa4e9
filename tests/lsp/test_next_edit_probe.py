"""The model's next-edit questions: which change is asked about, where, and with what probe."""

from __future__ import annotations

from efim_lsp.next_edit.history import Change
from efim_lsp.next_edit.probe import LINES_AROUND, accepts, as_edit, candidates, token_change

TEXT = '''def area(width, height):
    total = width * height
    label = "width of box"
    # width in cm
    print(self.width, width, 8)
    return total + width + 8
'''


def _changed(text: str, old: str, new: str, nth: int = 0) -> tuple[str, Change]:
    at = -1
    for _ in range(nth + 1):
        at = text.index(old, at + 1)
    return text[:at] + new + text[at + len(old):], Change(at, old, new)


def test_a_rename_typed_inside_a_word_is_widened_to_the_whole_name():
    at = TEXT.index("width", TEXT.index("width") + 1) + 3  # "th" of the second `width` retyped as "e"
    text = TEXT[:at] + "e" + TEXT[at + 2:]
    tc = token_change(text, Change(at, "th", "e"))
    assert (tc.old, tc.new, tc.kind) == ("width", "wide", "name")
    assert text[tc.start:tc.end] == "wide"


def test_kinds():
    text, change = _changed(TEXT, "width", "size", 1)
    assert token_change(text, change).kind == "name"
    text, change = _changed(TEXT, "width", "size", 4)  # self.width
    assert token_change(text, change).kind == "attribute"
    text, change = _changed(TEXT, "8", "9")
    assert token_change(text, change)[2:] == ("8", "9", "number")
    text, change = _changed(TEXT, "box", "bin")
    assert token_change(text, change).kind == "word"
    text, change = _changed(TEXT, "cm", "mm")  # inside a comment: never asked
    assert token_change(text, change) is None
    text, change = _changed(TEXT, "width * height", "width + height")  # an operator: not a token change
    assert token_change(text, change) is None
    assert token_change(TEXT, None) is None
    assert token_change(TEXT, Change(3, "x", "zz")) is None  # the history does not match the text


def test_candidates_are_the_same_kind_nearest_below_first_then_above():
    text, change = _changed(TEXT, "width", "size", 1)  # `total = width * height`
    tc = token_change(text, change)
    found = candidates(text, tc, limit=10)
    # below: print(..., width, ...) then `return total + width`; above: the parameter. Not the
    # string's "width", not the comment's, not `self.width`.
    assert [text.count("\n", 0, c.start) for c in found] == [4, 5, 0]
    assert all(text[c.start:c.end] == "width" for c in found)
    assert len(candidates(text, tc)) == 3  # MAX_CANDIDATES by default


def test_number_and_word_candidates_stay_in_their_place():
    text, change = _changed(TEXT, "8", "15")
    tc = token_change(text, change)
    (only,) = candidates(text, tc)
    assert text[only.start:only.end] == "8" and text[: only.start].endswith("width + ")
    text, change = _changed(TEXT, "box", "bin")
    assert candidates(text, token_change(text, change)) == []  # "box" nowhere else in a string


def test_probe_text_and_answer():
    text, change = _changed(TEXT, "total", "area_", 0)
    tc = token_change(text, change)
    (cand,) = candidates(text, tc)
    assert cand.probe == ("def area(width, height):\n-    total = width * height\n+    area_ = width * height\n"
                          "def area(width, height):\n@    return ")
    assert accepts("area_", tc) and accepts(" area_\n", tc)
    assert not accepts("total", tc) and not accepts("area", tc)
    edit = as_edit(cand, tc)
    assert text[edit.start:edit.end] == "total" and edit.new_text == "area_"


def test_candidates_only_within_lines_around():
    far = "x = 1\n" + "pass\n" * (LINES_AROUND + 5) + "y = x\n"
    text, change = _changed(far, "x", "z")
    assert candidates(text, token_change(text, change)) == []
    near = "x = 1\n" + "pass\n" * (LINES_AROUND - 5) + "y = x\n"
    text, change = _changed(near, "x", "z")
    assert len(candidates(text, token_change(text, change))) == 1


def test_the_probe_names_the_function_around_the_change_and_around_the_candidate():
    text = "top = 1\n\ndef f(top):\n    return top\n\n\ndef g():\n    return top\n"
    at = text.index("return top") + 7
    changed, change = text[:at] + "peak" + text[at + 3:], Change(at, "top", "peak")
    found = candidates(changed, token_change(changed, change))
    scopes = [c.probe.split("\n")[3] for c in found]
    assert all(c.probe.split("\n")[0] == "def f(top):" for c in found)
    assert scopes == ["def g():", "def f(top):", ""]  # below in g; above: f's parameter, the module's name
