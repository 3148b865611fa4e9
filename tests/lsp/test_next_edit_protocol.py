"""Next edits over the protocol, step by step as the copilot-lsp Neovim plugin's NES module
drives it (that plugin is not installable here — no network to its repository): a didChange
that renames a word, `textDocument/copilotInlineEdit` with the document's version, one edit
applied as `edits[1]` with its range and version, `textDocument/didShowInlineEdit`, the edit's
command through `workspace/executeCommand`. The real `efim serve` over stdio; no model needed."""

from __future__ import annotations

from stdio_client import ServerProcess

URI = "file:///work/nes.py"
SRC = "def area(w, h):\n    s = w * h\n    print('w', s)\n    return s\n"


def _edits(server, version, line, character, uri=URI):
    return server.result("textDocument/copilotInlineEdit",
                         {"textDocument": {"uri": uri, "version": version}, "position": {"line": line, "character": character}})


def _change(server, version, line, start, end, text, uri=URI):
    server.notify("textDocument/didChange", {
        "textDocument": {"uri": uri, "version": version},
        "contentChanges": [{"range": {"start": {"line": line, "character": start}, "end": {"line": line, "character": end}}, "text": text}],
    })


def test_the_copilot_lsp_flow_offers_shows_and_accepts_one_edit():
    with ServerProcess() as server:
        init = server.initialize()
        assert "efim.acceptInlineEdit" in init["capabilities"]["executeCommandProvider"]["commands"]
        server.open(URI, SRC, version=1)
        assert _edits(server, 1, 0, 0) == {"edits": []}  # nothing changed yet
        # `s` renamed to `size` on line 1, key by key (the plugin asks after each change).
        _change(server, 2, 1, 4, 5, "s")
        for i, ch in enumerate("ize", 2):
            _change(server, 1 + i, 1, 3 + i, 3 + i, ch)
        result = _edits(server, 5, 1, 8)
        (edit,) = result["edits"]
        assert edit["text"] == "size" and edit["textDocument"] == {"uri": URI, "version": 5}
        assert edit["range"] == {"start": {"line": 2, "character": 15}, "end": {"line": 2, "character": 16}}  # print('w', s)
        assert edit["command"]["command"] == "efim.acceptInlineEdit"
        server.notify("textDocument/didShowInlineEdit", {"item": edit})
        # The client applies edits[1] and runs its command.
        _change(server, 6, 2, 15, 16, "size")
        assert server.result("workspace/executeCommand", {"command": edit["command"]["command"], "arguments": edit["command"]["arguments"]}) is None
        (nxt,) = _edits(server, 6, 2, 19)["edits"]
        assert nxt["range"]["start"] == {"line": 3, "character": 11} and nxt["text"] == "size"
        # Accepting the same id again (stale) is harmless.
        assert server.result("workspace/executeCommand", {"command": "efim.acceptInlineEdit", "arguments": edit["command"]["arguments"]}) is None
        counts = server.result("efim/stats")["nextEdit"]
        assert counts["offered"] == 2 and counts["shown"] == 1 and counts["accepted"] == 1 and counts["staleAccepts"] == 1
        assert server.document_text(URI)["text"] == SRC.replace(" s ", " size ").replace(", s)", ", size)")
        assert server.shutdown_and_exit() == 0


def test_stale_versions_unknown_documents_bad_params_and_off_get_no_edit():
    with ServerProcess() as server:
        server.initialize()
        server.open(URI, SRC, version=1)
        _change(server, 2, 1, 4, 5, "t")
        assert len(_edits(server, 2, 1, 5)["edits"]) == 1
        assert _edits(server, 1, 1, 5) == {"edits": []}  # a version the server no longer has
        assert _edits(server, 2, 1, 5, uri="file:///work/unopened.py") == {"edits": []}
        assert _edits(server, 2, 99, 0)["edits"][0]["text"] == "t"  # a position past the end: no cursor to avoid
        for params in ({}, {"textDocument": "x"}, {"textDocument": {"uri": URI, "version": "2"}}, None):
            assert server.result("textDocument/copilotInlineEdit", params) == {"edits": []}
        server.notify("textDocument/didShowInlineEdit", None)  # an odd notification is ignored
        server.notify("workspace/didChangeConfiguration", {"settings": {"efim": {"nextEdit": "off"}}})
        assert _edits(server, 2, 1, 5) == {"edits": []}
        assert server.result("efim/stats")["nextEdit"]["empty"] >= 6
        assert server.shutdown_and_exit() == 0


def test_ranges_are_in_utf16_units_after_characters_outside_the_bmp():
    text = "def f(v):\n    x = v  # 😀😀\n    print('😀', x)\n"
    with ServerProcess() as server:
        server.initialize(encoding="utf-16")
        server.open(URI, text, version=1)
        _change(server, 2, 1, 4, 5, "y")
        (edit,) = _edits(server, 2, 1, 5)["edits"]
        # `x` on line 2 sits after '😀' (two UTF-16 units): character 16, not 15.
        assert edit["range"] == {"start": {"line": 2, "character": 16}, "end": {"line": 2, "character": 17}}


def test_a_parameter_added_is_offered_at_the_call_and_a_parallel_line_at_the_next():
    text = "def area(w, h):\n    return w * h\n\n\nprint(area(2, 3))\nx.a = a\nx.b = b\nx.c = c\narea(4, 5)\n"
    with ServerProcess() as server:
        server.initialize()
        server.open(URI, text, version=1)
        # `, d` typed after `h` on line 0, key by key.
        for i, ch in enumerate(", d"):
            _change(server, 2 + i, 0, 13 + i, 13 + i, ch)
        (edit,) = _edits(server, 4, 0, 16)["edits"]
        assert edit["text"] == ", d" and edit["range"] == {"start": {"line": 4, "character": 15}, "end": {"line": 4, "character": 15}}
        assert edit["textDocument"] == {"uri": URI, "version": 4}
        # The client applies it: the next call is offered.
        _change(server, 5, 4, 15, 15, ", d")
        (edit,) = _edits(server, 5, 4, 18)["edits"]
        assert edit["text"] == ", d" and edit["range"]["start"] == {"line": 8, "character": 9}
        # `x.a` -> `x._a` on line 5: the same on the next line of the run.
        _change(server, 6, 5, 2, 2, "_")
        (edit,) = _edits(server, 6, 5, 3)["edits"]
        assert edit["text"] == "_b" and edit["range"] == {"start": {"line": 6, "character": 2}, "end": {"line": 6, "character": 3}}
        assert server.shutdown_and_exit() == 0


def test_a_function_renamed_in_one_document_is_offered_at_its_import_and_uses_in_another():
    a_uri, b_uri = "file:///work/proj/a.py", "file:///work/proj/b.py"
    a_text = "def foo(x):\n    return x\n"
    b_text = "import os\nfrom a import foo\n\n\ndef run():\n    # foo is imported\n    return foo(os.sep)\n"
    with ServerProcess() as server:
        server.initialize()
        server.open(a_uri, a_text, version=1)
        server.open(b_uri, b_text, version=1)
        assert _edits(server, 1, 0, 0, uri=b_uri) == {"edits": []}  # nothing renamed yet
        # `foo` -> `bar` on a.py's def line: the selection replaced by "b", then "ar" typed.
        _change(server, 2, 0, 4, 7, "b", uri=a_uri)
        _change(server, 3, 0, 5, 5, "a", uri=a_uri)
        _change(server, 4, 0, 6, 6, "r", uri=a_uri)
        (edit,) = _edits(server, 1, 0, 0, uri=b_uri)["edits"]
        assert edit["text"] == "bar" and edit["textDocument"] == {"uri": b_uri, "version": 1}
        assert edit["range"] == {"start": {"line": 1, "character": 14}, "end": {"line": 1, "character": 17}}
        # The client applies it in b.py: the use below is next (not the comment).
        _change(server, 2, 1, 14, 17, "bar", uri=b_uri)
        (edit,) = _edits(server, 2, 1, 17, uri=b_uri)["edits"]
        assert edit["text"] == "bar" and edit["range"] == {"start": {"line": 6, "character": 11}, "end": {"line": 6, "character": 14}}
        _change(server, 3, 6, 11, 14, "bar", uri=b_uri)
        assert _edits(server, 3, 6, 14, uri=b_uri) == {"edits": []}  # nothing left
        assert _edits(server, 1, 0, 0, uri=b_uri) == {"edits": []}  # a stale version
        assert server.document_text(b_uri)["text"] == b_text.replace("import foo", "import bar").replace("foo(os", "bar(os")
        assert server.shutdown_and_exit() == 0


def test_the_module_name_comes_from_the_path_under_the_workspace_root():
    a_uri, b_uri = "file:///work/proj/pkg/a.py", "file:///work/proj/b.py"
    b_text = "import pkg.a as m\n\nm.foo()\n"
    with ServerProcess() as server:
        server.result("initialize", {"processId": None, "rootUri": "file:///work/proj", "capabilities": {},
                                     "clientInfo": {"name": "stdio-test-client"}})
        server.notify("initialized", {})
        server.open(a_uri, "def foo():\n    pass\n", version=1)
        server.open(b_uri, b_text, version=1)
        _change(server, 2, 0, 4, 7, "bar", uri=a_uri)
        (edit,) = _edits(server, 1, 0, 0, uri=b_uri)["edits"]
        assert edit["text"] == "bar" and edit["range"] == {"start": {"line": 2, "character": 2}, "end": {"line": 2, "character": 5}}
        # Above the root the path is no module name (it would be without a root).
        server.open("file:///work/proj/c.py", "import work.proj.pkg.a as w\nw.foo()\n", version=1)
        assert _edits(server, 1, 0, 0, uri="file:///work/proj/c.py") == {"edits": []}
        assert server.shutdown_and_exit() == 0
