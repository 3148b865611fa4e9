"""A model switch that fails, through the real `efim serve` (tiny model): the settings name
a broken file after a working model was serving. The switch is refused with one message that
names the file and what is wrong, `efim/stats` keeps the state `ready` with that error, the
previous model keeps answering, and switching back loads.

A local load closes the previous engine before it reads the new model (two models need not
fit in memory at once: `efim_lsp/engine_holder.py`), so the loader's weight-free checks
(format, tensor types, vocabulary: `engine.local.check_model`, docs/model.md "Bad input")
run first, while the old engine still serves."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from stdio_client import ServerProcess, inline_params, serve_env
from tiny_models import write_tiny_gguf

TEXT = "def add(a, b):\n    return a + b\n\ndef mul(a, b):\n    \n"
URI = "file:///work/reload.py"


def switch_model(server: ServerProcess, model: str, want: str) -> dict:
    """Send the new `model` setting; wait until the state is `want` ("failed" / "ready") for it."""
    server.notify("workspace/didChangeConfiguration", {"settings": {"efim": {"model": model}}})
    import time

    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:  # the state passes through "loading"
        stats = server.result("efim/stats")
        state, info, error = stats["model"]["state"], stats["model"]["info"] or {}, stats["model"]["error"] or ""
        if want == state == "failed" and Path(model).name in error:
            return stats
        if want == "kept" and state == "ready" and Path(model).name in error:
            return stats
        if want == state == "ready" and info.get("model") == Path(model).name and not error:
            return stats
        time.sleep(0.05)
    raise AssertionError(f"the switch never settled: {stats['model']}\n{server.stderr()[-3000:]}")


def test_switching_to_a_gguf_with_an_unreadable_tensor_type(tiny_model_dir, tmp_path):
    import gguf

    def q8_1(w, qtype):
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        return np.zeros((w.shape[0], w.shape[1] // block * size), dtype=np.uint8)

    bad = write_tiny_gguf(tiny_model_dir, tmp_path / "exotic.gguf", q8_0=("mlp.up_proj",), qtype="Q8_1", quantize=q8_1)
    env = serve_env(EFIM_CACHE_DIR=str(tmp_path / "cache"))
    with ServerProcess(["--model", str(tiny_model_dir), "--no-kv-disk", "--quant", "auto"], env=env) as server:
        server.initialize({"maxTokens": 2})
        assert server.wait_model()["model"]["state"] == "ready"
        server.open(URI, TEXT)
        assert "result" in server.request("textDocument/inlineCompletion", inline_params(URI, 4, 4), timeout=120)
        stats = switch_model(server, str(bad), "kept")
        assert stats["model"]["state"] == "ready", stats["model"]
        assert "exotic.gguf" in stats["model"]["error"] and "Q8_1" in stats["model"]["error"], stats["model"]
        assert stats["model"]["info"]["model"] == Path(tiny_model_dir).name  # the previous model serves on
        shown = [m for m in server.shown_messages() if "model failed to load" in m]
        assert len(shown) == 1 and "Q8_1" in shown[0] and "kept the previous model" in shown[0], server.shown_messages()
        reply = server.request("textDocument/inlineCompletion", inline_params(URI, 4, 4), timeout=120)
        assert "result" in reply and "error" not in reply, reply  # answered by the previous model
        assert server.document_text(URI)["text"] == TEXT  # the documents survive the switch
        back = switch_model(server, str(tiny_model_dir), "ready")
        assert back["model"]["state"] == "ready" and back["model"]["error"] is None, back["model"]
        assert "result" in server.request("textDocument/inlineCompletion", inline_params(URI, 4, 4), timeout=120)
        assert not server.violations
        assert server.shutdown_and_exit() == 0
