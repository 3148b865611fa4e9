"""`efim serve --kv-dtype int8` through the real server (tiny model): the engine loads with
an int8 KV cache and answers an inline completion."""

from __future__ import annotations

from stdio_client import ServerProcess, inline_params, serve_env

TEXT = "def add(a, b):\n    return a + b\n\ndef mul(a, b):\n    \n"
URI = "file:///work/kv_dtype.py"


def test_serve_with_an_int8_kv_cache_answers(tiny_model_dir):
    args = ["--model", str(tiny_model_dir), "--no-kv-disk", "--dtype", "fp32", "--kv-dtype", "int8", "--kv-budget", "16M"]
    with ServerProcess(args, env=serve_env()) as server:
        server.initialize({"maxTokens": 3})
        stats = server.wait_model()
        assert stats["model"]["state"] == "ready", stats["model"]
        assert stats["model"]["info"]["kv_dtype"] == "int8"  # efim/stats says which KV format serves
        server.open(URI, TEXT)
        reply = server.request("textDocument/inlineCompletion", inline_params(URI, 4, 4), timeout=120)
        assert "error" not in reply, reply
        assert server.violations == []


def test_serve_refuses_an_unknown_kv_dtype():
    import subprocess

    from stdio_client import serve_command

    done = subprocess.run(serve_command("--kv-dtype", "int4"), capture_output=True, text=True, timeout=60, env=serve_env())
    assert done.returncode == 2
    assert "--kv-dtype" in done.stderr and "int8" in done.stderr
