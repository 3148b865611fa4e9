"""The server's copy of a document stays exactly the client's, or says it is out of sync."""

import re

from hypothesis import given, settings, strategies as st

from efim_lsp.documents import MAX_DOCUMENT_CHARS, DocumentStore, Edit, FullChange, RangeChange
from lsp_client_model import range_change

URI = "file:///t.py"


def test_incremental_edits_report_code_point_edits():
    store = DocumentStore()
    store.open(URI, "python", 1, "x😀 = 1\n")
    out = store.change(URI, 2, [range_change("x😀 = 1\n", 3, 3, "0")])
    assert store.get(URI).text == "x😀 0= 1\n"
    assert out.edits == [Edit(3, 3, "0")] and out.in_sync and not out.resynced


def test_version_skip_marks_out_of_sync_until_a_full_text_change():
    store = DocumentStore()
    store.open(URI, "python", 1, "abc")
    store.change(URI, 3, [range_change("abc", 3, 3, "d")])
    doc = store.get(URI)
    assert not doc.in_sync and "skipped" in doc.sync_problem
    assert doc.text == "abc"  # the delta after a lost change is not applied
    store.change(URI, 4, [range_change("abc", 0, 0, "z")])
    assert doc.text == "abc" and not doc.in_sync
    out = store.change(URI, 5, [FullChange("hello")])
    assert out.resynced and doc.in_sync and doc.text == "hello"


def test_version_going_backwards_is_detected():
    store = DocumentStore()
    store.open(URI, "python", 5, "abc")
    store.change(URI, 5, [range_change("abc", 0, 0, "x")])
    assert not store.get(URI).in_sync


def test_lenient_versions_accept_gaps():
    store = DocumentStore(strict_versions=False)
    store.open(URI, "python", 1, "abc")
    store.change(URI, 7, [range_change("abc", 3, 3, "d")])
    assert store.get(URI).in_sync and store.get(URI).text == "abcd"


def test_range_outside_text_marks_out_of_sync():
    store = DocumentStore()
    store.open(URI, "python", 1, "abc")
    store.change(URI, 2, [RangeChange(5, 0, 5, 0, "x")])
    assert not store.get(URI).in_sync


def test_binary_and_huge_documents_are_unsupported_but_tracked():
    store = DocumentStore()
    doc = store.open(URI, "python", 1, "a\0b")
    assert doc.unsupported and "NUL" in doc.unsupported
    store.change(URI, 2, [range_change("a\0b", 1, 2, "")])
    assert doc.text == "ab" and doc.unsupported is None
    big = store.open("file:///big", "python", 1, "x" * (MAX_DOCUMENT_CHARS + 1))
    assert big.unsupported and "larger" in big.unsupported


def test_reopen_and_close():
    store = DocumentStore()
    store.open(URI, "python", 1, "abc")
    store.change(URI, 3, [range_change("abc", 0, 0, "x")])
    assert not store.get(URI).in_sync
    store.open(URI, "python", 4, "new")
    assert store.get(URI).in_sync and store.get(URI).text == "new"
    store.close(URI)
    assert store.get(URI) is None


ALPHABET = st.sampled_from(list("ab \t()😀é") + ["\n", "\r\n", "\r", "𝔘"])


@st.composite
def edit_scripts(draw):
    text = "".join(draw(st.lists(ALPHABET, max_size=30)))
    script = []
    current = text
    for _ in range(draw(st.integers(1, 25))):
        a = draw(st.integers(0, len(current)))
        b = draw(st.integers(a, min(len(current), a + 6)))
        # Never split a CRLF pair: no LSP position lies between its two characters.
        if 0 < a < len(current) and current[a - 1 : a + 1] == "\r\n":
            a -= 1
        if 0 < b < len(current) and current[b - 1 : b + 1] == "\r\n":
            b += 1
        new = "".join(draw(st.lists(ALPHABET, max_size=4)))
        script.append((a, b, new))
        current = current[:a] + new + current[b:]
    return text, script


@settings(max_examples=150, deadline=None)
@given(edit_scripts(), st.sampled_from(["utf-16", "utf-8", "utf-32"]))
def test_server_text_equals_client_text_after_random_incremental_edits(case, encoding):
    text, script = case
    store = DocumentStore(encoding)
    store.open(URI, "python", 0, text)
    client = text
    for version, (a, b, new) in enumerate(script, 1):
        change = range_change(client, a, b, new, encoding)
        client = client[:a] + new + client[b:]
        out = store.change(URI, version, [change])
        assert out.in_sync
        assert store.get(URI).text == client
        assert store.get(URI).index.starts == [0, *(m.end() for m in re.finditer(r"\r\n|\r|\n", client))]


@settings(max_examples=60, deadline=None)
@given(edit_scripts())
def test_several_changes_in_one_notification_apply_in_order(case):
    text, script = case
    store = DocumentStore()
    store.open(URI, "python", 0, text)
    client, changes = text, []
    for a, b, new in script:
        changes.append(range_change(client, a, b, new))
        client = client[:a] + new + client[b:]
    store.change(URI, 1, changes)
    assert store.get(URI).text == client
