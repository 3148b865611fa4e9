"""Cross-file context end to end: `efim serve` (tiny model) with a workspace folder, the
`context` setting switched from off to blend, then typing on top of the blended prompt."""

from __future__ import annotations

import asyncio
import os
import shutil
import sys
import sysconfig
from pathlib import Path

import pytest
import pytest_lsp
from lsprotocol import types as t
from pytest_lsp import ClientServerConfig, LanguageClient, client_capabilities

sys.path.insert(0, str(Path(__file__).resolve().parent))
from lsp_client_helpers import change, inline, open_doc, request, wait_ready  # noqa: E402

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.slow]  # a server process + ~30 requests

SERVER = ClientServerConfig(
    server_command=[sys.executable, "-m", "efim_tools.cli", "serve", "--log-level", "warning", "--kv-budget", "64MB"],
    server_env={**os.environ, "OMP_NUM_THREADS": "1"},
)
STDLIB = Path(sysconfig.get_paths()["stdlib"])


@pytest.fixture(scope="module")
def workspace(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("ws")
    for name in ("textwrap.py", "shlex.py", "string.py"):  # copied at run time, never committed
        shutil.copy(STDLIB / name, root / name)
    return root


@pytest_lsp.fixture(config=SERVER, scope="module")
async def client(lsp_client: LanguageClient, tiny_model_dir, workspace):
    await lsp_client.initialize_session(
        t.InitializeParams(
            capabilities=client_capabilities("visual_studio_code"),
            client_info=t.ClientInfo(name="Visual Studio Code"),
            workspace_folders=[t.WorkspaceFolder(uri=workspace.as_uri(), name="ws")],
            initialization_options={"model": str(tiny_model_dir), "maxTokens": 8, "context": "blend",
                                    "contextChunks": 0, "contextTokens": 256,
                                    # the full window's prompt is measured here, not a jump's small first window
                                    "firstWindowTokens": 0},
        )
    )
    stats = await wait_ready(lsp_client, timeout=120)
    assert stats["model"]["state"] == "ready", stats["model"]
    yield
    await lsp_client.shutdown_session()


async def _prompt_tokens(client, pos, uri) -> tuple[int, int]:
    before = await request(client, "efim/stats")
    await inline(client, pos, uri)
    after = await request(client, "efim/stats")
    return after["promptTokens"] - before["promptTokens"], after["reusedTokens"] - before["reusedTokens"]


async def test_blend_context_enters_the_prompt_and_keystrokes_reuse_it(client: LanguageClient, workspace):
    src = (workspace / "textwrap.py").read_text()
    marker = "    def _split(self, text):"
    body = src.index("\n", src.index(marker)) + 1
    uri = (workspace / "textwrap.py").as_uri()
    open_doc(client, src, uri)
    line, col = src[:body].count("\n"), 8
    pos = t.Position(line, col)

    # Same window budget with and without chunks: contextChunks 0 vs 2 (context stays "blend").
    base_tokens, _ = await _prompt_tokens(client, pos, uri)
    client.workspace_did_change_configuration(t.DidChangeConfigurationParams(settings={"contextChunks": 2}))
    blend_tokens = 0
    for _ in range(60):  # the first request starts indexing the folder in the background
        # Reopen: the same request again would be answered from the suggestion on screen.
        client.text_document_did_close(t.DidCloseTextDocumentParams(t.TextDocumentIdentifier(uri=uri)))
        open_doc(client, src, uri)
        # The folder was indexed completely before this request, so the chunk set it picks
        # is the one the keystrokes below see (a partial index may pick other chunks later).
        indexed = await request(client, "efim/stats")
        blend_tokens, _ = await _prompt_tokens(client, pos, uri)
        ready = indexed["context"]["files"] >= 2 and not indexed["context"]["indexing"]
        if ready and blend_tokens > base_tokens + 50:
            break
        await asyncio.sleep(0.25)
    # The two siblings from disk; the open document itself is chunked only for other documents.
    assert indexed["context"] == {"folders": 1, "files": 2, "chunks": indexed["context"]["chunks"], "indexing": False,
                                  "watch": indexed["context"]["watch"], "kv": indexed["context"]["kv"],
                                  "pausedS": indexed["context"]["pausedS"]}
    assert indexed["context"]["pausedS"] >= 0.0
    assert indexed["context"]["watch"]["state"] in ("watching", "off")  # "off": a server built without watching
    assert indexed["context"]["chunks"] > 2
    assert blend_tokens > base_tokens + 50  # chunks of the sibling modules were added

    typed = "chunks ="
    engine_answers = 0
    for i, ch in enumerate(typed):
        change(client, i + 1, line, col + i, ch, uri=uri)
        before = await request(client, "efim/stats")
        await inline(client, t.Position(line, col + i + 1), uri)
        after = await request(client, "efim/stats")
        prompt = after["promptTokens"] - before["promptTokens"]
        if prompt == 0:
            continue  # answered from the suggestion on screen (typing-through)
        engine_answers += 1
        assert prompt >= 0.9 * blend_tokens  # the same context stayed in the prompt
        # ...and the blended prompt was reused as a plain prefix: only the keystroke is new.
        assert after["prefilledTokens"] - before["prefilledTokens"] <= 4
    assert engine_answers > 0
    check = await request(client, "efim/debug/checkIntegrity")
    assert check["ok"] and check["engine"] == "ok", check


async def test_an_import_list_gets_the_names_the_code_below_uses_without_the_model(client: LanguageClient, workspace):
    """At `from textwrap import ` the workspace's textwrap.py says which of its names the
    file uses and has not imported: they are the answer, no model asked; off without context."""
    uri = (workspace / "use_names.py").as_uri()
    text = "import os\nfrom textwrap import \n\n\ndef show(x):\n    return fill(dedent(x)) + os.sep  # shorten\n"
    open_doc(client, text, uri)
    before = await request(client, "efim/stats")
    result = await inline(client, t.Position(1, len("from textwrap import ")), uri)
    after = await request(client, "efim/stats")
    assert [item.insert_text for item in result.items] == ["dedent, fill"]  # sorted; shorten only in a comment
    assert after["importNames"] - before["importNames"] == 1
    assert after["promptTokens"] == before["promptTokens"]  # the engine was not asked
    # Typed letters narrow it to the names that start with them.
    change(client, 1, 1, len("from textwrap import "), "fi", uri=uri)
    result = await inline(client, t.Position(1, len("from textwrap import fi")), uri)
    assert [item.insert_text for item in result.items][0].startswith("ll")
    # Context off: still answered (no index needed); importNames off: the model answers.
    client.workspace_did_change_configuration(t.DidChangeConfigurationParams(settings={"context": "off"}))
    change(client, 2, 1, len("from textwrap import "), "", end=(1, len("from textwrap import fi")), uri=uri)
    result = await inline(client, t.Position(1, len("from textwrap import ")), uri)
    assert [item.insert_text for item in result.items] == ["dedent, fill"], result.items
    client.workspace_did_change_configuration(t.DidChangeConfigurationParams(settings={"importNames": False}))
    before = await request(client, "efim/stats")
    await inline(client, t.Position(1, len("from textwrap import ")), uri)
    after = await request(client, "efim/stats")
    assert after["importNames"] == before["importNames"]
    client.workspace_did_change_configuration(t.DidChangeConfigurationParams(settings={"importNames": True, "context": "blend"}))
    client.text_document_did_close(t.DidCloseTextDocumentParams(t.TextDocumentIdentifier(uri=uri)))
