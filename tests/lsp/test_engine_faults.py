"""Faults through the real `efim serve` process (tiny model): a model that is missing or
corrupt at start, a load that fails mid-way, an out-of-memory error during a prefill and a
crash of the engine thread (both injected with the `EFIM_FAULT` test hook,
`engine/runtime/faults.py`). Each gives one `window/showMessage` and a log line; the server keeps
answering (empty completions while there is no model; a completion after the fault
succeeds) and `efim/stats` says the state (`model.state`, `engine`)."""

from __future__ import annotations

import json
import shutil

from stdio_client import ServerProcess, inline_params, serve_env

TEXT = "def add(a, b):\n    return a + b\n\ndef mul(a, b):\n    \n"
FAULT_URI = "file:///work/fault.py"  # the EFIM_FAULT hooks fire for keys containing "fault"
FINE_URI = "file:///work/fine.py"


def complete(server: ServerProcess, uri: str) -> dict:
    reply = server.request("textDocument/inlineCompletion", inline_params(uri, 4, 4), timeout=120)
    assert "result" in reply, reply
    return reply["result"]


def assert_no_model_and_still_serving(server: ServerProcess, needle: str) -> dict:
    stats = server.wait_model()
    assert stats["model"]["state"] == "failed" and needle in stats["model"]["error"], stats["model"]
    assert stats["engine"] == {"state": "none"}
    server.open(FINE_URI, TEXT)
    for _ in range(3):
        assert complete(server, FINE_URI) == {"items": []}
    assert server.result("efim/stats")["declined"]["modelFailed"] == 3
    assert server.document_text(FINE_URI)["text"] == TEXT  # the session goes on
    shown = [m for m in server.shown_messages() if "model failed to load" in m]
    assert len(shown) == 1 and needle in shown[0], server.shown_messages()
    assert "failed to load" in server.stderr()  # the log line
    assert not server.violations
    return stats


def test_a_model_path_that_does_not_exist(tmp_path):
    with ServerProcess(["--model", str(tmp_path / "no-such-model")]) as server:
        server.initialize()
        assert_no_model_and_still_serving(server, "not found")
        assert server.shutdown_and_exit() == 0


def test_a_truncated_gguf_given_in_initialization_options(tmp_path):
    gguf = tmp_path / "broken.gguf"
    gguf.write_bytes(b"GGUF\x03\x00\x00\x00" + b"\x07" * 13)  # header cut short
    env = serve_env(EFIM_CACHE_DIR=str(tmp_path / "cache"))
    with ServerProcess(["--model", str(tmp_path / "no-such-model")], env=env) as server:
        server.initialize({"model": str(gguf)})  # initializationOptions override --model
        stats = assert_no_model_and_still_serving(server, "")
        assert "gguf" in stats["model"]["error"].lower(), stats["model"]
        print(f"\ntruncated gguf: {stats['model']['error']}")
        assert server.shutdown_and_exit() == 0


def _sharded_with_a_truncated_shard(src, dest):
    """The tiny model split into two safetensors shards (with an index), the second cut in half."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dest)
    tensors = load_file(str(dest / "model.safetensors"))
    (dest / "model.safetensors").unlink()
    names = sorted(tensors)
    half = len(names) // 2
    shards = {"model-00001-of-00002.safetensors": names[:half], "model-00002-of-00002.safetensors": names[half:]}
    for shard, keys in shards.items():
        save_file({k: tensors[k].contiguous() for k in keys}, str(dest / shard), metadata={"format": "pt"})
    weight_map = {k: shard for shard, keys in shards.items() for k in keys}
    (dest / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    second = dest / "model-00002-of-00002.safetensors"
    data = second.read_bytes()
    second.write_bytes(data[: len(data) // 2])
    return dest


def test_a_load_that_fails_mid_way_a_truncated_shard(tiny_model_dir, tmp_path):
    folder = _sharded_with_a_truncated_shard(tiny_model_dir, tmp_path / "sharded")
    with ServerProcess(["--model", str(folder)]) as server:
        server.initialize()
        stats = assert_no_model_and_still_serving(server, "")
        print(f"\ntruncated shard: {stats['model']['error']}")
        assert server.shutdown_and_exit() == 0


def _served_with_fault(tiny_model_dir, fault: str) -> ServerProcess:
    server = ServerProcess(["--model", str(tiny_model_dir), "--kv-budget", "32MB", "--no-kv-disk"],
                           env=serve_env(EFIM_FAULT=fault))
    server.initialize({"maxTokens": 4})
    assert server.wait_model()["model"]["state"] == "ready"
    server.open(FAULT_URI, TEXT)
    server.open(FINE_URI, TEXT)
    return server


def test_out_of_memory_during_a_prefill_is_one_message_and_the_next_completion_succeeds(tiny_model_dir):
    with _served_with_fault(tiny_model_dir, "prefill-oom") as server:
        assert complete(server, FAULT_URI) == {"items": []}  # the request that ran out of memory
        stats = server.result("efim/stats")
        assert stats["declined"].get("engineError") == 1, stats["declined"]
        assert stats["engine"]["outOfMemory"] == 1 and stats["engine"]["state"] == "running", stats["engine"]
        server.notify("textDocument/didChange", {"textDocument": {"uri": FAULT_URI, "version": 1},
                                                 "contentChanges": [{"range": {"start": {"line": 4, "character": 4}, "end": {"line": 4, "character": 4}}, "text": "r"}]})
        reply = server.request("textDocument/inlineCompletion", inline_params(FAULT_URI, 4, 5), timeout=120)
        assert "result" in reply, reply
        after = server.result("efim/stats")
        assert after["declined"].get("engineError") == 1  # the next completion was computed, not declined
        assert after["promptTokens"] > stats["promptTokens"]  # the engine computed it
        assert complete(server, FINE_URI) is not None
        shown = [m for m in server.shown_messages() if "out of memory" in m]
        assert len(shown) == 1 and "OutOfMemoryError" in shown[0], server.shown_messages()
        assert server.stderr().count("out of memory while computing a completion") == 1  # the log line
        print(f"\nOOM: message {shown[0]!r}")
        assert server.shutdown_and_exit() == 0


def test_a_crash_of_the_engine_thread_is_reported_once_and_the_engine_restarts(tiny_model_dir):
    with _served_with_fault(tiny_model_dir, "engine-crash") as server:
        assert complete(server, FAULT_URI) == {"items": []}  # in flight at the crash: an error, no hang
        stats = server.result("efim/stats")
        assert stats["engine"]["state"] == "running" and stats["engine"]["restarts"] == 1, stats["engine"]
        assert "InjectedCrash" in stats["engine"]["lastCrash"] and stats["engine"]["threadAlive"]
        assert stats["declined"].get("engineError") == 1, stats["declined"]
        for uri in (FINE_URI, FAULT_URI):  # the restarted engine computes completions
            complete(server, uri)
        after = server.result("efim/stats")
        assert after["declined"].get("engineError") == 1, after["declined"]
        assert after["engine"]["restarts"] == 1
        shown = [m for m in server.shown_messages() if "engine thread crashed" in m]
        assert len(shown) == 1 and "restarted" in shown[0], server.shown_messages()
        log = server.stderr()
        assert "the engine thread died" in log and "InjectedCrash" in log
        check = server.result("efim/debug/checkIntegrity", timeout=60)
        assert check["ok"], check
        assert server.shutdown_and_exit() == 0
