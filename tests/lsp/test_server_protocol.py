"""The real server code over stdio (pytest-lsp, recorded Neovim and VS Code capabilities),
with the in-test FakeEngine: protocol behaviour, bad input, cancellation, settings.
The same flows against the real engine are in tests/lsp/e2e/."""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path

import pytest
import pytest_lsp
from lsprotocol import types as t
from pytest_lsp import ClientServerConfig, LanguageClient

from lsp_client_helpers import BODY, SRC, URI, change, initialize, inline, inline_params, open_doc, plain, request, send_raw, wait_ready

# The servers are module-scoped fixtures, so the tests must run in the module's event loop.
pytestmark = pytest.mark.asyncio(loop_scope="module")

HERE = Path(__file__).resolve().parent


def server_config(**env) -> ClientServerConfig:
    return ClientServerConfig(
        server_command=[sys.executable, str(HERE / "lsp_fake_server.py")],
        server_env={**os.environ, **env},
    )


# One server per client kind for the whole module (a server start costs ~1.5 s of imports):
# tests use their own document URIs and compare counters before/after.
@pytest_lsp.fixture(config=server_config(), params=["neovim", "visual_studio_code"], scope="module")
async def client(lsp_client: LanguageClient, request):
    lsp_client.client_spec = request.param
    lsp_client.init_result = await initialize(lsp_client, request.param)
    yield
    await lsp_client.shutdown_session()


async def test_capabilities_and_load_progress(client: LanguageClient):
    caps = client.init_result.capabilities
    assert caps.inline_completion_provider is not None and caps.completion_provider is not None
    assert caps.text_document_sync.change == t.TextDocumentSyncKind.Incremental
    assert "efim.accepted" in caps.execute_command_provider.commands
    expected = "utf-8" if client.client_spec == "neovim" else "utf-16"  # Neovim offers utf-8 first
    assert caps.position_encoding == expected
    assert (await wait_ready(client))["model"]["state"] == "ready"
    kinds = [type(v).__name__ for reports in client.progress_reports.values() for v in reports]
    assert kinds[0] == "WorkDoneProgressBegin" and kinds[-1] == "WorkDoneProgressEnd"


async def test_inline_completion_item_range_command_and_telemetry(client: LanguageClient):
    await wait_ready(client)
    uri = "file:///work/telemetry.py"
    open_doc(client, uri=uri)
    before = await request(client, "efim/stats")
    result = await inline(client, BODY, uri=uri)
    (item,) = result.items
    assert item.insert_text == "value = compute(x)"
    assert item.range == t.Range(BODY, BODY)  # an insertion at the cursor: replaces nothing
    assert item.command.command == "efim.accepted"
    client.protocol.notify("textDocument/didShowCompletion", {"item": client.protocol._converter.unstructure(item)})
    client.protocol.notify("textDocument/didPartiallyAcceptCompletion", {"item": {}, "acceptedLength": 5})
    await client.workspace_execute_command_async(t.ExecuteCommandParams(command=item.command.command, arguments=item.command.arguments))
    stats = await request(client, "efim/stats")
    delta = {k: stats[k] - before[k] for k in ("shown", "partiallyAccepted", "accepted", "acceptedChars", "requests", "served")}
    assert delta == {"shown": 1, "partiallyAccepted": 1, "accepted": 1, "acceptedChars": 5 + len("value = compute(x)"),
                     "requests": 1, "served": 1}
    for key in ("requests", "served", "typingThroughHits", "cancelled", "promptTokens", "reusedTokens",
                "prefilledTokens", "reuseRatio", "cacheBytes"):
        assert key in stats
    assert set(stats["ttftMs"]) == set(stats["latencyMs"]) == {"p50", "p95", "p99", "mean"}
    assert set(stats["sessions"]) == {"active", "rebases"} and stats["sessions"]["active"] >= 1


async def test_typing_through_and_range_after_non_bmp_characters(client: LanguageClient):
    await wait_ready(client)
    text = "s = '😀😀'; v = \n"
    uri = "file:///work/emoji.py"
    open_doc(client, text, uri=uri)
    before = await request(client, "efim/stats")
    # the cursor sits after two non-BMP characters: its column differs per encoding
    col = {"neovim": len("s = '".encode()) + 8 + len("'; v = "), "visual_studio_code": 5 + 4 + len("'; v = ")}[client.client_spec]
    pos = t.Position(0, col)
    (item,) = (await inline(client, pos, uri)).items
    assert item.range == t.Range(pos, pos)
    change(client, 1, 0, col, "valu", uri=uri)
    pos2 = t.Position(0, col + 4)
    (item2,) = (await inline(client, pos2, uri)).items
    assert item2.insert_text == "e = compute(x)" and item2.range == t.Range(pos2, pos2)
    stats = await request(client, "efim/stats")
    assert stats["typingThroughHits"] - before["typingThroughHits"] == 1


async def test_completion_fallback_inserts_the_suggestion(client: LanguageClient):
    await wait_ready(client)
    uri = "file:///work/fallback.py"
    open_doc(client, uri=uri)
    result = await client.text_document_completion_async(t.CompletionParams(text_document=t.TextDocumentIdentifier(uri=uri), position=BODY))
    (item,) = result.items
    assert item.text_edit.new_text == "value = compute(x)" and item.text_edit.range == t.Range(BODY, BODY)
    assert result.is_incomplete


async def test_bad_input_gets_errors_or_empty_results_and_the_server_lives(client: LanguageClient):
    await wait_ready(client)
    open_doc(client)
    before = await request(client, "efim/stats")
    with pytest.raises(Exception, match="unknown document"):
        await inline(client, BODY, uri="file:///nope.py")
    with pytest.raises(Exception, match="past the end"):
        await inline(client, t.Position(99, 0))
    with pytest.raises(Exception, match="malformed"):
        await send_raw(client, {"jsonrpc": "2.0", "id": "bad-1", "method": "textDocument/inlineCompletion",
                                "params": {"textDocument": {"uri": URI}, "position": "x"}})
    with pytest.raises(Exception, match="not a JSON-RPC 2.0 message"):
        await send_raw(client, {"id": "bad-2", "method": "textDocument/inlineCompletion"})
    change(client, 1, 0, 0, "x", uri="file:///never-opened.py")  # logged and ignored
    open_doc(client, "a\0b = ", uri="file:///bin.py")
    assert not (await inline(client, t.Position(0, 3), uri="file:///bin.py")).items
    # a position past the end of a line means the end of that line (LSP spec), not an error
    assert (await inline(client, t.Position(3, 99))).items
    stats = await request(client, "efim/stats")
    assert stats["declined"].get("unsupportedDocument", 0) - before["declined"].get("unsupportedDocument", 0) == 1


async def test_a_request_without_params_is_answered(client: LanguageClient):
    """Regression: JSON-RPC lets a request omit `params`, but pygls' message classes require
    the member, so `efim/stats` without params came back as InvalidParams (seen from the
    editor clients, which had to send `{}`)."""
    stats = await send_raw(client, {"jsonrpc": "2.0", "id": "no-params", "method": "efim/stats"})
    assert "reuseRatio" in plain(stats)


async def test_version_skip_declines_until_the_client_resends(client: LanguageClient):
    await wait_ready(client)
    uri = "file:///work/skip.py"
    open_doc(client, uri=uri)
    change(client, 2, 3, 4, "v", uri=uri)  # version 1 never arrived
    items = (await inline(client, t.Position(3, 5), uri)).items
    if client.client_spec == "neovim":
        assert items  # Neovim's versions jump by design (batched changedticks): tolerated
        return
    assert not items
    client.text_document_did_change(
        t.DidChangeTextDocumentParams(
            text_document=t.VersionedTextDocumentIdentifier(uri=uri, version=3),
            content_changes=[t.TextDocumentContentChangeWholeDocument(text=SRC)],
        )
    )
    assert (await inline(client, BODY, uri)).items


async def test_bad_setting_is_shown_and_unknown_ones_ignored(client: LanguageClient):
    client.workspace_did_change_configuration(t.DidChangeConfigurationParams(settings={"efim": {"maxTokens": -3, "nonsense": 1, "multiline": "never"}}))
    await wait_ready(client)
    for _ in range(50):
        if any("maxTokens" in m.message for m in client.messages):
            break
        await asyncio.sleep(0.02)
    assert any("maxTokens" in m.message for m in client.messages)
    uri = "file:///work/settings.py"
    open_doc(client, uri=uri)
    assert (await inline(client, BODY, uri)).items


# --- cancellation: a slow engine ----------------------------------------------------------


@pytest_lsp.fixture(config=server_config(EFIM_FAKE_TOKEN_MS="15", EFIM_FAKE_TEXT="a" * 400 + "\n"), scope="module")
async def slow_client(lsp_client: LanguageClient):
    # No deadline: the last answer's 100 tokens at 15 ms each would meet the default 1.5 s one.
    await initialize(lsp_client, "visual_studio_code", {"maxTokens": 100, "timeoutMs": 0})
    yield
    await lsp_client.shutdown_session()


async def test_burst_of_50_keystrokes_answers_only_the_latest_version(slow_client: LanguageClient):
    await wait_ready(slow_client)
    uri = "file:///work/burst.py"
    open_doc(slow_client, uri=uri)
    before = await request(slow_client, "efim/stats")
    futures = []
    for i in range(50):
        change(slow_client, i + 1, 3, 4 + i, "z", uri=uri)
        futures.append(slow_client.protocol.send_request_async("textDocument/inlineCompletion", inline_params(t.Position(3, 5 + i), uri)))
    results = await asyncio.gather(*futures)
    answered = [i for i, r in enumerate(results) if r.items]
    assert answered == [49]
    stats = await request(slow_client, "efim/stats")
    assert stats["cancelled"] > before["cancelled"] and stats["served"] - before["served"] == 1
    check = await request(slow_client, "efim/debug/checkIntegrity")
    assert check["ok"], check


async def test_cancel_request_cancels_the_engine_work(slow_client: LanguageClient):
    await wait_ready(slow_client)
    uri = "file:///work/cancel.py"
    open_doc(slow_client, uri=uri)
    before = await request(slow_client, "efim/stats")
    future = slow_client.protocol.send_request("textDocument/inlineCompletion", inline_params(BODY, uri), msg_id="cancel-me")
    await asyncio.sleep(0.1)
    slow_client.cancel_request(t.CancelParams(id="cancel-me"))
    with pytest.raises(Exception, match="cancel"):
        await asyncio.wrap_future(future)
    stats = await request(slow_client, "efim/stats")
    assert stats["cancelled"] - before["cancelled"] == 1 and stats["served"] == before["served"]


# --- model loading --------------------------------------------------------------------------


@pytest_lsp.fixture(config=server_config(EFIM_FAKE_LOAD_MS="600"), scope="module")
async def loading_client(lsp_client: LanguageClient):
    await initialize(lsp_client, "visual_studio_code")
    yield
    await lsp_client.shutdown_session()


async def test_completion_before_the_model_is_ready_is_empty_not_an_error(loading_client: LanguageClient):
    open_doc(loading_client)
    assert not (await inline(loading_client, BODY)).items
    assert (await wait_ready(loading_client))["model"]["state"] == "ready"
    assert (await inline(loading_client, BODY)).items
    # a model change reloads the engine; a model that cannot load is reported, not fatal
    loading_client.workspace_did_change_configuration(t.DidChangeConfigurationParams(settings={"model": "/missing/model"}))
    await asyncio.sleep(0.05)
    stats = await wait_ready(loading_client)
    assert stats["model"]["state"] == "failed" and "/missing/model" in stats["model"]["error"]
    assert any("failed to load" in m.message for m in loading_client.messages)
    assert not (await inline(loading_client, BODY)).items
    # the adapter is an engine setting too: changing it reloads, and its failure is reported
    loading_client.workspace_did_change_configuration(
        t.DidChangeConfigurationParams(settings={"model": "fake", "adapter": "/missing/adapter"})
    )
    await asyncio.sleep(0.05)
    stats = await wait_ready(loading_client)
    assert stats["model"]["state"] == "failed" and "/missing/adapter" in stats["model"]["error"]
    loading_client.workspace_did_change_configuration(t.DidChangeConfigurationParams(settings={"adapter": "none"}))
    await asyncio.sleep(0.05)
    assert (await wait_ready(loading_client))["model"]["state"] == "ready"
    assert (await inline(loading_client, BODY)).items


async def test_configuration_is_pulled_when_the_notification_carries_none(client: LanguageClient):
    """VS Code's pull model: didChangeConfiguration with null settings, then workspace/configuration."""
    client.set_configuration({"maxTokens": "many"}, section="efim")
    client.workspace_did_change_configuration(t.DidChangeConfigurationParams(settings=None))
    for _ in range(100):
        if any("'many'" in m.message for m in client.messages):
            break
        await asyncio.sleep(0.02)
    assert any("maxTokens='many'" in m.message for m in client.messages)
