"""pygls 2.1 keeps the future of every notification whose handler is a coroutine, a thread
or a generator (its own didOpen/didChange/didClose are generators) under a fresh uuid in
`JsonRpcProtocol._request_futures`, forever: the daemon soak's fronts grew ~2.4 MB a minute
(~2 KB per keystroke, docs/reliability.md). `EfimProtocol` takes each one out when its handler
ends; only requests still running stay."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

from efim_lsp.server import build_server

sys.path.insert(0, str(Path(__file__).resolve().parent))
from lsp_fakes import FakeEngine  # noqa: E402


class _Client:
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


async def test_handled_notifications_leave_no_future_behind():
    server = build_server(lambda model, **_options: FakeEngine())
    client = _Client(server)
    client.send("initialize", {"processId": None, "rootUri": None, "capabilities": {}}, msg_id=1)
    uri = "file:///w/a.py"
    client.send("textDocument/didOpen", {"textDocument": {"uri": uri, "languageId": "python", "version": 0, "text": "x = 1\n"}})
    for version in range(1, 301):  # typing: one didChange per key, as the soak's typists do
        client.send("textDocument/didChange", {"textDocument": {"uri": uri, "version": version},
                                               "contentChanges": [{"range": {"start": {"line": 1, "character": version - 1},
                                                                             "end": {"line": 1, "character": version - 1}},
                                                                   "text": "y"}]})
    client.send("workspace/didChangeConfiguration", {"settings": {"efim": {"maxTokens": 16}}})  # an async handler
    client.send("textDocument/didClose", {"textDocument": {"uri": uri}})
    await asyncio.sleep(0.1)  # the coroutine handler's future ends on the loop
    assert len(server.protocol._request_futures) == 0, len(server.protocol._request_futures)
