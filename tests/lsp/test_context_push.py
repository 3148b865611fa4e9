"""The server tells its context source what is open and where (the source never asks):
the document and folder handlers push documents and workspace folders, the engine holder
pushes each new engine. The real server's handlers, driven in process; nothing reaches
the gatherer until a request wants context."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from efim_lsp.context.source import WorkspaceContext, uri_to_path
from efim_lsp.engine_holder import EngineSpec
from efim_lsp.server import build_server
from efim_lsp.settings import Settings

sys.path.insert(0, str(Path(__file__).resolve().parent))
from lsp_fakes import FakeEngine  # noqa: E402

ON = Settings(context="blend", context_chunks=4, context_tokens=400)


class _Client:
    """Feeds JSON-RPC messages to the server's protocol and keeps what it writes back."""

    def __init__(self, server) -> None:
        self.server, self.sent = server, []
        server.protocol.set_writer(self, include_headers=False)

    def write(self, data: bytes) -> None:
        self.sent.append(json.loads(data))

    def close(self) -> None:
        pass

    def send(self, method: str, params, msg_id: int | None = None) -> None:
        message = {"jsonrpc": "2.0", "method": method, "params": params}
        if msg_id is not None:
            message["id"] = msg_id
        protocol = self.server.protocol
        protocol.handle_message(protocol.structure_message(message))


def _spy(monkeypatch, gatherer, name: str) -> list[str]:
    """The paths the source hands to `gatherer.<name>`."""
    calls: list[str] = []
    method = getattr(gatherer, name)
    monkeypatch.setattr(gatherer, name, lambda path, *args: (calls.append(path), method(path, *args))[1])
    return calls


def _folder(tmp_path: Path, name: str, source: str) -> Path:
    root = tmp_path / name
    root.mkdir()
    (root / "lib.py").write_text(source)
    return root


async def test_handlers_push_documents_and_folders_and_the_holder_pushes_the_engine(tmp_path, monkeypatch):
    first = _folder(tmp_path, "first", "def convert_currency(amount, exchange_rate):\n    return amount * exchange_rate\n")
    second = _folder(tmp_path, "second", "def parse_invoice(lines):\n    return [l for l in lines]\n")
    engine = FakeEngine()
    source = WorkspaceContext(watch=False)
    server = build_server(lambda model, **_options: engine, context_source=source)
    client = _Client(server)
    closed = _spy(monkeypatch, source.gatherer, "close_document")
    try:
        client.send("initialize", {"processId": None, "rootUri": None, "capabilities": {},
                                   "workspaceFolders": [{"uri": first.as_uri(), "name": "first"}]}, msg_id=1)
        assert "result" in client.sent[-1]
        scratch = (tmp_path / "scratch.py").as_uri()  # open, outside every folder
        client.send("textDocument/didOpen", {"textDocument": {"uri": scratch, "languageId": "python", "version": 1,
                                                              "text": "def exchange_rate_table():\n    return {'eur': exchange_rate}\n"}})
        # Told, not yet indexed: a folder is scanned at the first request that wants context.
        assert source.status()["folders"] == 0 and source.status()["files"] == 0

        text = "total = convert_currency(price, exchange_rate)\n"
        source.chunks("file:///elsewhere.py", text, len(text), ON)
        assert source.gatherer.wait_idle(10)
        paths = [c.path for c in source.chunks("file:///elsewhere.py", text + "\n", len(text) + 1, ON)]
        assert "lib.py" in paths and uri_to_path(scratch) in paths
        assert source.status()["folders"] == 1

        client.send("workspace/didChangeWorkspaceFolders",
                    {"event": {"added": [{"uri": second.as_uri(), "name": "second"}], "removed": []}})
        source.chunks("file:///elsewhere.py", text, len(text), ON)
        assert source.gatherer.wait_idle(10)
        assert source.status()["folders"] == 2

        # The engine: pushed by the holder when it serves, withdrawn when it closes.
        assert await server.holder.load(EngineSpec("fake", "auto"))
        calls = engine.count_calls
        source.gatherer.count_tokens("a fresh text to count")
        assert engine.count_calls == calls + 1

        # An edit reaches the source (and the engine drops the old chunk KV); a close too.
        client.send("textDocument/didChange", {"textDocument": {"uri": scratch, "version": 2},
                                               "contentChanges": [{"text": "def other_rate():\n    return 2\n"}]})
        source.chunks("file:///elsewhere.py", text, len(text), ON)
        assert uri_to_path(scratch) in engine.forgotten
        client.send("textDocument/didClose", {"textDocument": {"uri": scratch}})
        source.chunks("file:///elsewhere.py", text, len(text), ON)
        assert closed == [uri_to_path(scratch)]

        server.holder.close()
        calls = engine.count_calls
        source.gatherer.count_tokens("another fresh text")
        assert engine.count_calls == calls  # no engine: the estimate counts
    finally:
        server.close()
        source.close()


async def test_with_context_off_nothing_is_indexed_or_chunked(tmp_path, monkeypatch):
    root = _folder(tmp_path, "ws", "def helper():\n    return 1\n")
    source = WorkspaceContext(watch=False)
    server = build_server(lambda model, **_options: FakeEngine(), context_source=source)
    client = _Client(server)
    handed = _spy(monkeypatch, source.gatherer, "change_document")
    try:
        client.send("initialize", {"processId": None, "rootUri": root.as_uri(), "capabilities": {}}, msg_id=1)
        uri = (root / "main.py").as_uri()
        client.send("textDocument/didOpen", {"textDocument": {"uri": uri, "languageId": "python", "version": 1, "text": "x = 1\n"}})
        client.send("textDocument/didChange", {"textDocument": {"uri": uri, "version": 2},
                                               "contentChanges": [{"text": "x = 2\n"}]})
        assert source.chunks(uri, "x = 2\n", 0, Settings(context="off")) == ()
        assert source.status()["folders"] == 0 and source.status()["files"] == 0 and handed == []
        source.chunks(uri, "x = 2\n", 0, ON)  # the root URI stands for the folders the client did not send
        assert source.gatherer.wait_idle(10)
        assert source.status()["folders"] == 1 and handed == [uri_to_path(uri)]  # the latest text, once
    finally:
        server.close()
        source.close()
