"""Client-side helpers for the stdio tests (pytest-lsp), shared by the protocol and e2e tests."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
from concurrent.futures import Future

from lsprotocol import types as t
from pytest_lsp import LanguageClient, client_capabilities

URI = "file:///work/m.py"
SRC = "import os\n\ndef f(x):\n    \n    return x\n"
BODY = t.Position(line=3, character=4)


async def initialize(client: LanguageClient, spec: str, options: dict | None = None) -> t.InitializeResult:
    result = await client.initialize_session(
        t.InitializeParams(
            capabilities=client_capabilities(spec),
            client_info=t.ClientInfo(name="Neovim" if spec == "neovim" else "Visual Studio Code"),
            initialization_options=options or {},
        )
    )
    return result


@contextlib.contextmanager
def one_write(client: LanguageClient):
    """Messages sent inside the block reach the server in one write to its stdin: a burst
    arrives as one piece whatever the machine's load (a client descheduled mid-burst would
    let the server answer an early request before the next keystroke arrives)."""
    writer = client.protocol.writer
    parts: list[bytes] = []
    write = writer.write
    writer.write = parts.append
    try:
        yield
    finally:
        del writer.write  # the class's own method again
        done = write(b"".join(parts))
        if inspect.isawaitable(done):
            asyncio.ensure_future(done)


def plain(obj):
    """pygls' client turns results of custom methods into namedtuples; back to dicts."""
    if hasattr(obj, "_asdict"):
        return {k: plain(v) for k, v in obj._asdict().items()}
    if isinstance(obj, (list, tuple)):
        return [plain(v) for v in obj]
    return obj


# A reply that never comes fails the test with the method's name instead of hanging the suite.
REPLY_TIMEOUT_S = 180.0


async def request(client: LanguageClient, method: str, params=None, timeout: float = REPLY_TIMEOUT_S) -> dict:
    sent = client.protocol.send_request_async(method, params if params is not None else {})
    try:
        return plain(await asyncio.wait_for(sent, timeout))
    except asyncio.TimeoutError:
        raise AssertionError(f"no reply to {method} within {timeout:.0f} s") from None


async def end_server(client: LanguageClient, timeout: float = 30.0) -> None:
    """Shut the server down and wait for it, killing it when it does not go within `timeout`.

    For tests that start a server themselves: pygls' `stop()` waits for the process to exit
    without ending it, so a test that failed before `shutdown` would otherwise hang the suite
    (a fresh-clone CI run sat 75 minutes in `stop()` after an assertion had failed)."""
    process = client._server
    try:
        await asyncio.wait_for(client.shutdown_session(), timeout)
    except Exception:  # noqa: BLE001 - a server that cannot shut down is ended below
        pass
    if process is not None and process.returncode is None:
        process.kill()
    await asyncio.wait_for(client.stop(), timeout)


def send_raw(client: LanguageClient, message: dict) -> asyncio.Future:
    """Write a JSON-RPC message as is (the typed client refuses to send malformed params)."""
    body = json.dumps(message).encode()
    future: Future = Future()
    client.protocol._request_futures[message["id"]] = future
    client.protocol.writer.write(b"Content-Length: %d\r\n\r\n" % len(body) + body)
    return asyncio.wrap_future(future)


async def wait_ready(client: LanguageClient, timeout: float = 10.0) -> dict:
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        stats = await request(client, "efim/stats")
        if stats["model"]["state"] in ("ready", "failed") or asyncio.get_running_loop().time() > deadline:
            return stats
        await asyncio.sleep(0.02)


def open_doc(client: LanguageClient, text: str = SRC, uri: str = URI, version: int = 0) -> None:
    client.text_document_did_open(t.DidOpenTextDocumentParams(t.TextDocumentItem(uri=uri, language_id="python", version=version, text=text)))


def change(client: LanguageClient, version: int, line: int, char: int, text: str, end: tuple[int, int] | None = None, uri: str = URI) -> None:
    end_line, end_char = end or (line, char)
    client.text_document_did_change(
        t.DidChangeTextDocumentParams(
            text_document=t.VersionedTextDocumentIdentifier(uri=uri, version=version),
            content_changes=[t.TextDocumentContentChangePartial(range=t.Range(t.Position(line, char), t.Position(end_line, end_char)), text=text)],
        )
    )


def inline_params(pos: t.Position, uri: str = URI) -> t.InlineCompletionParams:
    return t.InlineCompletionParams(
        text_document=t.TextDocumentIdentifier(uri=uri),
        position=pos,
        context=t.InlineCompletionContext(trigger_kind=t.InlineCompletionTriggerKind.Automatic),
    )


async def inline(client: LanguageClient, pos: t.Position, uri: str = URI) -> t.InlineCompletionList:
    return await client.text_document_inline_completion_async(inline_params(pos, uri))
