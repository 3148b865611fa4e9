"""Warm restarts through the real `efim serve`: a server that stops writes each document's
KV to the disk tier; a new server on the same cache directory answers the first request at
the same place with (almost) no prefill, and the files it wrote are private."""

from __future__ import annotations

import asyncio
import os
import stat
import sys
import sysconfig
from pathlib import Path

import pytest

from efim_tools.trace.client import LspClient
from efim_tools.trace.replay import client_capabilities, wait_ready

pytestmark = pytest.mark.slow

URI = "file:///restart/textwrap.py"


def _place() -> tuple[str, dict]:
    text = (Path(sysconfig.get_paths()["stdlib"]) / "textwrap.py").read_text(encoding="utf-8")
    offset = text.index("    def _split(self, text):") + len("    def _split(self, text):\n")
    line = text.count("\n", 0, offset)
    return text, {"line": line, "character": 0}


async def _one_server(model: Path, kv_dir: Path, text: str, position: dict) -> dict:
    """Start a server, open the document, ask once at `position`, stop it; the stats
    the request left (prefilled tokens) and the disk tier's state before the request."""
    env = {**os.environ, "EFIM_KV_DIR": str(kv_dir), "OMP_NUM_THREADS": "1"}
    settings = {"model": str(model), "maxTokens": 8}
    client = LspClient([sys.executable, "-m", "efim_tools.cli", "serve", "--log-level", "warning"], env=env, settings=settings)
    await client.start()
    try:
        await client.request("initialize", {
            "processId": os.getpid(), "clientInfo": {"name": "restart test", "version": "1"}, "rootUri": None,
            "capabilities": client_capabilities("utf-16"), "initializationOptions": settings})
        await client.notify("initialized", {})
        await wait_ready(client, 120)
        # The disk tier preloads recent files when the engine starts; give it a moment.
        for _ in range(100):
            before = await client.request("efim/stats", None)
            if before["kvDisk"]["state"] != "on" or before["kvDisk"]["loadedTokens"] or not any(kv_dir.glob("*.safetensors")):
                break
            await asyncio.sleep(0.05)
        await client.notify("textDocument/didOpen", {"textDocument": {"uri": URI, "languageId": "python", "version": 0, "text": text}})
        start = await client.request("efim/stats", None)
        await client.request("textDocument/inlineCompletion", {
            "textDocument": {"uri": URI}, "position": position, "context": {"triggerKind": 1}})
        after = await client.request("efim/stats", None)
    finally:  # shutdown + exit: the server writes its documents' KV before it leaves
        code = await client.close()
    assert code == 0, client.stderr_tail()
    return {"prefilled": after["prefilledTokens"] - start["prefilledTokens"], "kvDisk": before["kvDisk"]}


def test_a_restarted_server_answers_the_same_place_without_a_prefill(tiny_model_dir, tmp_path):
    kv_dir = tmp_path / "kv"
    text, position = _place()
    cold = asyncio.run(_one_server(tiny_model_dir, kv_dir, text, position))
    assert cold["prefilled"] > 50, cold  # the first answer's window computed (a cold place: the ~100-token small window)
    files = list(kv_dir.glob("*.safetensors"))
    assert files, "the stopped server wrote no KV file"
    assert stat.S_IMODE(kv_dir.stat().st_mode) == 0o700
    assert all(stat.S_IMODE(f.stat().st_mode) == 0o600 for f in files)
    warm = asyncio.run(_one_server(tiny_model_dir, kv_dir, text, position))
    assert warm["kvDisk"]["state"] == "on" and warm["kvDisk"]["loadedTokens"] > 100, warm
    assert warm["prefilled"] <= 4, (cold, warm)  # the window's rows came from disk
