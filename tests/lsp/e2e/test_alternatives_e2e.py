"""The `alternatives` setting end to end: `efim serve` on the tiny random model answers
`textDocument/inlineCompletion` with up to that many distinct items, the first one the
answer `alternatives: 1` gives; the prompt is prefilled once per request."""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path

import pytest
import pytest_lsp
from lsprotocol import types as t
from pytest_lsp import ClientServerConfig, LanguageClient

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from lsp_client_helpers import initialize, inline, open_doc, request, wait_ready  # noqa: E402
from test_lsp_e2e import stdlib_function  # noqa: E402

pytestmark = pytest.mark.asyncio(loop_scope="module")

SERVER = ClientServerConfig(
    server_command=[sys.executable, "-m", "efim_tools.cli", "serve", "--log-level", "warning", "--kv-budget", "64MB"],
    server_env={**os.environ, "OMP_NUM_THREADS": "1"},
)

# (module, a line that starts a function): completions at the blanked body of each.
PLACES = [
    ("textwrap.py", "    def _split(self, text):"),
    ("textwrap.py", "    def _fix_sentence_endings(self, chunks):"),
    ("shlex.py", "    def push_token(self, tok):"),
    ("shlex.py", "    def pop_source(self):"),
]


@pytest_lsp.fixture(config=SERVER, params=["neovim", "visual_studio_code"], scope="module")
async def client(lsp_client: LanguageClient, request, tiny_model_dir):
    lsp_client.client_spec = request.param
    # No cache: every request prefills its whole prompt, so the two settings' prefills compare.
    # No deadline: on a loaded machine the default 1.5 s cut one answer short and not the
    # other ("([" against the whole line), and the test compares content, not speed.
    await initialize(lsp_client, request.param, {"model": str(tiny_model_dir), "maxTokens": 12, "cache": False, "timeoutMs": 0})
    stats = await wait_ready(lsp_client, timeout=120)
    assert stats["model"]["state"] == "ready", stats["model"]
    yield
    await lsp_client.shutdown_session()


def configure(client: LanguageClient, **settings) -> None:
    client.workspace_did_change_configuration(t.DidChangeConfigurationParams(settings={"efim": settings}))


async def test_alternatives_answer_distinct_items_the_first_the_single_answer(client: LanguageClient):
    counts = []
    for i, (module, marker) in enumerate(PLACES):
        text, line, col = stdlib_function(module, marker)
        at = t.Position(line, col)
        # Two documents with the same text (a document's second request would be answered by
        # typing-through): one asked with alternatives 1, the other with 3.
        single_uri, multi_uri = f"file:///alt/{client.client_spec}/{i}/one.py", f"file:///alt/{client.client_spec}/{i}/three.py"
        configure(client, alternatives=1)
        open_doc(client, text, single_uri)
        before = await request(client, "efim/stats")
        single = (await inline(client, at, single_uri)).items
        mid = await request(client, "efim/stats")
        configure(client, alternatives=3)
        open_doc(client, text, multi_uri)
        multi = (await inline(client, at, multi_uri)).items
        after = await request(client, "efim/stats")
        assert len(single) <= 1
        assert 1 <= len(multi) <= 3 if single else len(multi) == 0  # items arrive as a tuple
        texts = [item.insert_text for item in multi]
        assert len(set(texts)) == len(texts) and all(x.strip() for x in texts), texts
        if single:
            assert texts[0] == single[0].insert_text
        for item in multi:
            assert item.range == t.Range(at, at)
            assert item.command.arguments[0]["length"] == len(item.insert_text)
        # The same prompt, prefilled once whether 1 or 3 continuations decode from it.
        prefilled = mid["prefilledTokens"] - before["prefilledTokens"]
        assert prefilled > 100 and after["prefilledTokens"] - mid["prefilledTokens"] == prefilled
        counts.append(len(multi))
    assert max(counts) > 1, counts  # alternatives were answered, not only the first item
    configure(client, alternatives=1)
    check = await request(client, "efim/debug/checkIntegrity")
    assert check["ok"] and check["engine"] == "ok", check


async def test_bad_alternatives_value_is_reported_and_falls_back(client: LanguageClient):
    configure(client, alternatives=7)
    await wait_ready(client)
    for _ in range(100):
        if any("alternatives" in m.message for m in client.messages):
            break
        await asyncio.sleep(0.02)
    assert any("alternatives" in m.message for m in client.messages)
