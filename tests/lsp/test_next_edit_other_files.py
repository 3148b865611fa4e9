"""Next edits in other open documents after a module-level rename (efim_lsp.next_edit.other_files):
which renames count, the module names of a URI, the places offered in another document and its
silences, and the service offering them to another document only."""

from __future__ import annotations

from lsp_client_model import range_change

from efim_lsp.documents import DocumentStore
from efim_lsp.next_edit import other_files
from efim_lsp.next_edit.history import Change
from efim_lsp.next_edit.proposer import Rename
from efim_lsp.next_edit.service import NextEdits
from efim_lsp.stats import ServerStats

A = "file:///proj/pkg/a.py"
FOO = (Rename(0, 0, "foo", "bar"), {"a", "pkg.a"})


def _apply(text, edit):
    return text[: edit.start] + edit.new_text + text[edit.end :]


def test_only_module_level_definitions_count_as_renames():
    text = "def bar(x):\n    y = 1\n    return x\n\nLIMIT = 3\nclass Box:\n    pass\n"
    assert other_files.top_level_rename(text, Change(4, "foo", "bar")) == Rename(4, 7, "foo", "bar")
    at = text.index("LIMIT")
    assert other_files.top_level_rename(text, Change(at, "MAX", "LIMIT")).old == "MAX"
    at = text.index("Box")
    assert other_files.top_level_rename(text, Change(at + 3, "", "")) is None  # no change of name
    assert other_files.top_level_rename(text, Change(at, "Bag", "Box")).new == "Box"
    at = text.index("y = 1")
    assert other_files.top_level_rename(text, Change(at, "z", "y")) is None  # a local
    at = text.index("return x") + 7
    assert other_files.top_level_rename(text, Change(at, "v", "x")) is None  # a use, not a definition


def test_module_names_from_the_uri_and_the_workspace_folders():
    assert other_files.module_names(A, ["file:///proj"]) == {"a", "pkg.a"}
    assert other_files.module_names(A, ["file:///proj", "file:///proj/pkg"]) == {"a"}  # the innermost folder
    assert other_files.module_names("file:///proj/pkg/__init__.py", ["file:///proj"]) == {"pkg"}
    assert "a" in other_files.module_names(A)  # no folders: the path's dotted tails, the stem among them
    assert other_files.module_names("file:///proj/my-tools/a.py", ["file:///proj"]) == {"a"}
    assert other_files.module_names("file:///proj/notes.txt", ["file:///proj"]) == set()


def test_a_from_import_is_offered_first_then_the_uses():
    text = "import os\nfrom a import (\n    baz,\n    foo,\n)\n\n\ndef run():\n    return foo(1) + foo.x\n"
    edit = other_files.propose(text, [FOO])
    assert (edit.start, edit.end, edit.new_text) == (text.index("foo,"), text.index("foo,") + 3, "bar")
    text = _apply(text, edit)
    edit = other_files.propose(text, [FOO])
    assert edit.start == text.index("foo(1)") and edit.new_text == "bar"
    text = _apply(text, edit)
    text = _apply(text, other_files.propose(text, [FOO]))
    assert text.endswith("return bar(1) + bar.x\n")
    assert other_files.propose(text, [FOO]) is None  # nothing left


def test_a_package_path_and_an_alias_give_attribute_uses():
    text = "import pkg.a as m\nimport a\n\nm.foo()\na.foo\nx.foo\nm.food()\n"
    edit = other_files.propose(text, [FOO])
    assert edit.start == text.index("m.foo") + 2
    text = _apply(text, edit)
    edit = other_files.propose(text, [FOO])
    assert edit.start == text.index("a.foo") + 2
    text = _apply(text, edit)
    assert other_files.propose(text, [FOO]) is None  # `x.foo` is something else's, `m.food` longer
    # `from pkg import a as m`
    text = "from pkg import a as m\nprint(m.foo)\n"
    assert other_files.propose(text, [FOO]).start == text.index("m.foo") + 2
    # a module that is not the renamed one: silent
    assert other_files.propose("import b\nb.foo()\nfrom c import foo\nfoo()\n", [FOO]) is None


def test_strings_comments_shadowing_and_other_bindings_are_left_alone():
    text = "from a import bar\n# foo was renamed\nprint('foo', f(foo=1))\nfoo()\n"
    edit = other_files.propose(text, [FOO])
    assert edit.start == text.index("foo()")  # not the comment, the string or the keyword argument
    shadowed = "from a import foo\n\n\ndef foo():\n    pass\n\nfoo()\n"
    assert other_files.propose(shadowed, [FOO]) is None
    assert other_files.propose("from a import foo\nfoo = 3\nfoo()\n", [FOO]) is None
    own_foo = "import a\n\n\ndef foo():\n    return a.foo()\n"  # its own foo, and a's through the module
    assert other_files.propose(own_foo, [FOO]).start == own_foo.index("a.foo") + 2
    assert other_files.propose("import a\nfrom b import foo\nfoo()\n", [FOO]) is None
    assert other_files.propose("'''from a import foo'''\nfoo()\n", [FOO]) is None  # an import in a string
    assert other_files.propose("from a import foo as f\nf()\n", [FOO]).start == len("from a import ")


def test_the_service_remembers_a_rename_and_offers_it_in_the_other_document_only():
    store, stats = DocumentStore(), ServerStats()
    service = NextEdits(store, stats, folders=lambda: ["file:///proj"])
    a_text = "def foo(x):\n    return x\n\n\nprint(foo(2))\n"
    b_text = "from pkg.a import foo\n\nfoo(1)\n"
    b_uri = "file:///proj/b.py"
    for uri, text in ((A, a_text), (b_uri, b_text)):
        store.open(uri, "python", 1, text)
        service.opened(uri)
    # `foo` -> `bar` in a.py: the selection replaced by "b", then "ar" typed.
    version = 1
    for start, end, new in ((4, 7, "b"), (5, 5, "a"), (6, 6, "r")):
        version += 1
        outcome = store.change(A, version, [range_change(store.get(A).text, start, end, new)])
        service.changed(A, outcome)
    assert [(r.uri, r.old, r.new) for r in service.renames] == [(A, "foo", "bar")]
    own = service.propose(A, version, 0)
    assert own.edit.start == store.get(A).text.index("foo(2)")  # document A: its own proposer
    offer = service.propose(b_uri, 1, 0)
    assert offer.edit.start == b_text.index("foo") and offer.edit.new_text == "bar"
    assert service.propose(b_uri, 1, b_text.index("foo") + 1) is None  # over the cursor
    assert service.propose(b_uri, 7, 0) is None  # another version
    # Retyped back to `foo`: forgotten.
    outcome = store.change(A, version + 1, [range_change(store.get(A).text, 4, 7, "foo")])
    service.changed(A, outcome)
    assert service.renames == []
    assert service.propose(b_uri, 1, 0) is None


def test_the_renamed_module_itself_gets_its_module_level_uses():
    own = (Rename(0, 0, "foo", "bar"), None)
    text = "def bar():\n    pass\n\n\nx = foo()  # foo\nprint('foo', y.foo)\n"
    edit = other_files.propose(text, [own])
    assert edit.start == text.index("foo()") and edit.reason.endswith("(use in its module)")
    assert other_files.propose(_apply(text, edit), [own]) is None
    assert other_files.propose("from b import foo\n\ndef bar():\n    pass\nfoo()\n", [own]) is None  # another foo


def test_relative_imports_resolve_from_the_importing_document():
    assert other_files.relative_names(A, "file:///proj/pkg/b.py") >= {".a", "..pkg.a"}
    assert other_files.relative_names(A, "file:///proj/pkg/sub/c.py") >= {"..a"}
    rel = (Rename(0, 0, "foo", "bar"), other_files.relative_names(A, "file:///proj/pkg/b.py"))
    text = "from .a import foo\nfoo()\n"
    assert other_files.propose(text, [rel]).start == len("from .a import ")
    text = "from . import a\na.foo()\n"
    assert other_files.propose(text, [rel]).start == text.index("a.foo") + 2
    assert other_files.propose("from .b import foo\nfoo()\n", [rel]) is None  # another module's foo
