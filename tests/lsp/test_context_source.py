"""WorkspaceContext: the completer's context source, synced from a (fake) server's state."""

from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace

from efim_lsp.context.source import WorkspaceContext, uri_to_path
from efim_lsp.settings import Settings


class FakeEngine:
    def __init__(self):
        self.forgotten: list[str] = []

    def count_tokens(self, text: str) -> int:
        return len(text.split())

    def forget_context(self, path: str) -> None:
        self.forgotten.append(path)


class FakeHost:
    """A `ContextHost`: one workspace folder, documents held as (version, text)."""

    def __init__(self, root: Path, docs: dict[str, str], engine=None):
        self.root, self.engine = root, engine
        self._store = {uri: SimpleNamespace(text=text, version=1) for uri, text in docs.items()}

    def workspace_folders(self):
        return [self.root.as_uri()]

    def open_documents(self):
        return [(uri, doc.version, doc.text) for uri, doc in self._store.items()]

    def context_engine(self):
        return self.engine


def eventually(predicate, timeout=10.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


def test_chunks_follow_the_server_state(tmp_path):
    root = tmp_path / "proj"
    (root / "lib").mkdir(parents=True)
    (root / "lib" / "money.py").write_text("def convert_currency(amount, exchange_rate):\n    return amount * exchange_rate\n")
    (root / "lib" / "noise.py").write_text("def unrelated_helper():\n    return 42\n")
    editing = (root / "app.py").as_uri()
    scratch = (tmp_path / "scratch.py").as_uri()
    engine = FakeEngine()
    docs = {editing: "", scratch: "def exchange_rate_table():\n    return {'eur': exchange_rate}\n"}
    server = FakeHost(root, docs, engine)
    source = WorkspaceContext(watch=True).bind(server)
    try:
        text = "total = convert_currency(price, exchange_rate)\n"
        off = Settings(context="off")
        assert source.chunks(editing, text, len(text), off) == ()
        on = Settings(context="blend", context_chunks=4, context_tokens=400)
        source.chunks(editing, text, len(text), on)  # first call: starts indexing the folder
        assert source.gatherer.wait_idle(10)
        chunks = source.chunks(editing, text + "\n", len(text) + 1, on)
        paths = [c.path for c in chunks]
        assert "lib/money.py" in paths  # workspace file, shown relative to its folder
        assert uri_to_path(scratch) in paths  # an open document outside the folder
        assert "lib/noise.py" not in paths
        assert source.gatherer.count_tokens("a b c") == 3  # the engine's tokenizer is attached

        # The open document changes in the editor: the engine is told to drop its chunk KV.
        server._store[scratch] = SimpleNamespace(text="def other():\n    return exchange_rate\n", version=2)
        source.chunks(editing, text + "  ", len(text) + 2, on)
        assert uri_to_path(scratch) in engine.forgotten

        # A file changes on disk: its chunk KV goes too.
        assert source.gatherer.wait_watching(10)
        (root / "lib" / "money.py").write_text("def convert_currency(amount, rate, fee):\n    return amount * rate - fee\n")
        assert eventually(lambda: "lib/money.py" in engine.forgotten)
    finally:
        source.close()
