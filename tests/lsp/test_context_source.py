"""WorkspaceContext: the completer's context source, told by the server what is open and where."""

from __future__ import annotations

import time

from efim_lsp.context.source import WorkspaceContext, uri_to_path
from efim_lsp.settings import Settings


class FakeEngine:
    def __init__(self):
        self.forgotten: list[str] = []

    def count_tokens(self, text: str) -> int:
        return len(text.split())

    def forget_context(self, path: str) -> None:
        self.forgotten.append(path)

    def computing(self) -> bool:
        return False


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
    source = WorkspaceContext(watch=True)
    # What the server pushes: its folder, the open documents, the engine once loaded.
    source.set_folders([root.as_uri()])
    source.document_changed(editing, 1, "")
    source.document_changed(scratch, 1, "def exchange_rate_table():\n    return {'eur': exchange_rate}\n")
    source.set_engine(engine)
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
        source.document_changed(scratch, 2, "def other():\n    return exchange_rate\n")
        source.chunks(editing, text + "  ", len(text) + 2, on)
        assert uri_to_path(scratch) in engine.forgotten

        # A file changes on disk: its chunk KV goes too.
        assert source.gatherer.wait_watching(10)
        (root / "lib" / "money.py").write_text("def convert_currency(amount, rate, fee):\n    return amount * rate - fee\n")
        assert eventually(lambda: "lib/money.py" in engine.forgotten)
    finally:
        source.close()
