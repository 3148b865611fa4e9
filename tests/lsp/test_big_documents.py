"""Big input through the real `efim serve` (tiny model): a 100,000-character line and a 5 MB
file are served like any other document — the prompt is cut to the window's budget, typing
is answered at every keystroke, the server's copy stays exact, and memory grows by a small
multiple of the file. Timings and memory are printed (run with `-s`), never asserted
except the memory bound."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from efim_lsp.documents import DocumentStore, RangeChange, text_checksum
from stdio_client import ServerProcess, inline_params

PREFIX_TOKENS, SUFFIX_TOKENS, MAX_TOKENS = 256, 64, 8
LINE = "    total = compute(alpha, beta) + offset  # a line of ordinary code\n"


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    with ServerProcess(["--model", str(tiny_model_dir), "--kv-budget", "64MB"]) as proc:
        proc.initialize({"maxTokens": MAX_TOKENS, "prefixTokens": PREFIX_TOKENS, "suffixTokens": SUFFIX_TOKENS})
        assert proc.wait_model()["model"]["state"] == "ready"
        yield proc
        assert not proc.violations
        assert proc.shutdown_and_exit() == 0


def complete(server: ServerProcess, uri: str, line: int, character: int) -> tuple[dict, float]:
    started = time.monotonic()
    reply = server.request("textDocument/inlineCompletion", inline_params(uri, line, character), timeout=120)
    assert "result" in reply, reply
    return reply["result"], (time.monotonic() - started) * 1000


def typed(server: ServerProcess, uri: str, text: str, line: int, col: int, keys: str) -> tuple[str, list[float]]:
    """Type `keys` at (line, col) of an ASCII text, asking for a completion after each;
    returns the client's text and the latencies (ms)."""
    times = []
    base = _offset(text, line, col)
    for i, ch in enumerate(keys):
        at = {"line": line, "character": col + i}
        server.notify("textDocument/didChange", {"textDocument": {"uri": uri, "version": i + 1},
                                                 "contentChanges": [{"range": {"start": at, "end": at}, "text": ch}]})
        text = text[: base + i] + ch + text[base + i :]
        _, ms = complete(server, uri, line, col + i + 1)
        times.append(ms)
    return text, times


def _offset(text: str, line: int, col: int) -> int:
    start = 0
    for _ in range(line):
        start = text.index("\n", start) + 1
    return start + col  # ASCII test texts


def test_a_100000_character_line_is_cut_to_the_window_budget(server):
    uri = "file:///big/long_line.py"
    line = "data = [" + ", ".join(f"{i}" for i in range(30000))
    line = line[:100_000]
    text = "import os\n" + line + "\nprint(data)\n"
    server.open(uri, text)
    small = "file:///big/small.py"
    small_text = "import os\n" + line[:200] + "\nprint(data)\n"
    server.open(small, small_text)
    complete(server, small, 1, 100)
    _, small_times = typed(server, small, small_text, 1, 100, "abcdefghij")  # the usual latency, for comparison
    before = server.result("efim/stats")
    result, first_ms = complete(server, uri, 1, 50_000)
    after = server.result("efim/stats")
    assert isinstance(result["items"], list)
    prompt = after["promptTokens"] - before["promptTokens"]
    # The window holds the budget's tokens, not the line's ~40,000.
    assert 0 < prompt <= PREFIX_TOKENS + SUFFIX_TOKENS + 200, prompt
    _, times = typed(server, uri, text, 1, 50_000, "abcdefghij")
    assert server.document_text(uri)["checksum"] == text_checksum(
        text[: _offset(text, 1, 50_000)] + "abcdefghij" + text[_offset(text, 1, 50_000) :])
    print(f"\n100,000-character line: first completion {first_ms:.0f} ms (prompt {prompt} tokens), keystrokes "
          f"p50 {sorted(times)[len(times) // 2]:.0f} ms max {max(times):.0f} ms; the same keystrokes in a 200-character line: "
          f"p50 {sorted(small_times)[len(small_times) // 2]:.0f} ms max {max(small_times):.0f} ms")


def test_a_5mb_file_gets_completions_and_memory_grows_by_a_small_multiple(server):
    uri = "file:///big/generated.py"
    text = LINE * (5_000_000 // len(LINE))
    size_mb = len(text.encode()) / 1e6
    rss0 = rss_mb(server.proc.pid)
    server.open(uri, text)
    line = text.count("\n") // 2
    result, first_ms = complete(server, uri, line, 4)
    assert isinstance(result["items"], list)
    rss_open = rss_mb(server.proc.pid)
    text, times = typed(server, uri, text, line, 4, "result = value + 1")
    copy = server.document_text(uri)
    assert copy["inSync"] and copy["checksum"] == text_checksum(text)
    stats = server.result("efim/stats")
    assert "unsupportedDocument" not in stats["declined"], stats["declined"]
    rss_typed = rss_mb(server.proc.pid)
    grown = rss_typed - rss0
    print(f"\n5 MB file ({size_mb:.1f} MB, {text.count(chr(10))} lines): first completion {first_ms:.0f} ms, "
          f"{len(times)} keystrokes p50 {sorted(times)[len(times) // 2]:.0f} ms max {max(times):.0f} ms; "
          f"RSS {rss0:.0f} MB -> {rss_open:.0f} MB after didOpen -> {rss_typed:.0f} MB after typing (+{grown:.0f} MB)")
    assert grown < 12 * size_mb, f"RSS grew by {grown:.0f} MB for a {size_mb:.1f} MB file"


def test_a_keystroke_in_a_5mb_document_costs_the_edit_not_the_document():
    """In-process: applying keystrokes to a 5 MB document and converting positions (printed, no timing asserted);
    the line table must equal a rebuilt one."""
    from efim_lsp.positions import line_starts

    text = LINE * (5_000_000 // len(LINE))
    store = DocumentStore()
    store.open("file:///k.py", "python", 0, text)
    doc = store.get("file:///k.py")
    doc.index  # build the line table once, as the first request does
    line = text.count("\n") // 2
    started = time.perf_counter()
    for i in range(200):
        store.change("file:///k.py", i + 1, [RangeChange(line, 4 + i, line, 4 + i, "x")])
        doc.index.position(doc.index.starts[line] + 5 + i)
    per_key = (time.perf_counter() - started) / 200 * 1000
    assert list(doc.index.starts) == line_starts(doc.text)
    print(f"\n5 MB document: {per_key:.2f} ms per keystroke (apply + line table + a position)")


def test_a_50mb_file_gets_completions_and_memory_grows_by_a_small_multiple(tiny_model_dir):
    """A server of its own (no other documents): open 50 MB, type, and bound the RSS growth."""
    uri = "file:///big/huge.py"
    text = LINE * (50_000_000 // len(LINE))
    size_mb = len(text.encode()) / 1e6
    with ServerProcess(["--model", str(tiny_model_dir), "--kv-budget", "64MB", "--no-kv-disk"]) as proc:
        proc.initialize({"maxTokens": MAX_TOKENS, "prefixTokens": PREFIX_TOKENS, "suffixTokens": SUFFIX_TOKENS})
        assert proc.wait_model()["model"]["state"] == "ready"
        proc.open("file:///big/small.py", "x = 1\n")
        complete(proc, "file:///big/small.py", 1, 0)
        rss0 = rss_mb(proc.proc.pid)
        started = time.monotonic()
        proc.open(uri, text)
        line = text.count("\n") // 2
        result, first_ms = complete(proc, uri, line, 4)
        open_s = time.monotonic() - started
        assert isinstance(result["items"], list)
        rss_open = rss_mb(proc.proc.pid)
        text, times = typed(proc, uri, text, line, 4, "result = value + 1")
        copy = proc.result("efim/stats")["documents"][uri]
        assert copy["inSync"] and copy["checksum"] == text_checksum(text) and copy["length"] == len(text)
        stats = proc.result("efim/stats")
        assert "unsupportedDocument" not in stats["declined"], stats["declined"]
        rss_typed = rss_mb(proc.proc.pid)
        grown = rss_typed - rss0
        print(f"\n50 MB file ({size_mb:.1f} MB, {text.count(chr(10))} lines): didOpen + first completion {open_s:.1f} s "
              f"(completion {first_ms:.0f} ms), {len(times)} keystrokes p50 {sorted(times)[len(times) // 2]:.0f} ms "
              f"max {max(times):.0f} ms; RSS {rss0:.0f} MB -> {rss_open:.0f} MB after didOpen -> {rss_typed:.0f} MB "
              f"after typing (+{grown:.0f} MB)")
        assert grown < 6 * size_mb, f"RSS grew by {grown:.0f} MB for a {size_mb:.1f} MB file"
        assert not proc.violations
        assert proc.shutdown_and_exit() == 0
