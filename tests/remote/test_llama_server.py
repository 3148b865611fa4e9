"""The remote engine against a REAL llama.cpp `llama-server` (efim_tools/peers/llama_cpp.py)
serving the embedded default GGUF — and the same model with the FIM adapter merged, written
by `efim export gguf` — keystroke by keystroke: the server's own cached-token counts show the
EFIM prompts reused while typing, each document keeps its server slot, and `efim serve` with
`backend: "llama.cpp"` does the same end to end. Skipped (saying how to build it) only when
llama-server is not built. Numbers are printed with -s; timings are not asserted."""

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

from engine.api import InfillRequest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "lsp"))
from lsp_client_helpers import change, initialize, inline, open_doc, request, wait_ready  # noqa: E402

pytestmark = pytest.mark.slow

TYPED = "chunks = self.wordsep_re.split(text)"


def _bin():
    from efim_tools.peers.llama_cpp import SETUP_SCRIPT, llama_cpp_bin

    folder = llama_cpp_bin()
    if folder is None:
        pytest.skip(f"llama.cpp's llama-server is not built (run `bash {SETUP_SCRIPT}` or set EFIM_LLAMA_CPP_BIN)")
    return folder


@pytest.fixture(scope="module")
def default_gguf() -> Path:
    from engine.model.loader import default_model_path

    return default_model_path()


@pytest.fixture(scope="module")
def llama_default(default_gguf):
    _bin()
    from efim_tools.peers.llama_cpp import LlamaServer

    with LlamaServer(default_gguf, slots=2, ctx_per_slot=4096, threads=2) as server:
        yield server


@pytest.fixture(scope="module")
def exported_fim_gguf(tmp_path_factory) -> Path:
    _bin()
    from efim_tools.export import export_gguf

    dest = tmp_path_factory.mktemp("remote-export") / "smollm2-efim-q8_0.gguf"
    return export_gguf(dest, export_type="q8_0").path


def stdlib_function() -> tuple[str, int]:
    """textwrap.py with `TextWrapper._split`'s body blanked: (text, offset of the blank line's cursor)."""
    src = (Path(sysconfig.get_paths()["stdlib"]) / "textwrap.py").read_text()
    start = src.index("    def _split(self, text):")
    body_start = src.index("\n", start) + 1
    body_end = src.index("\n    def ", body_start)
    text = src[:body_start] + " " * 8 + "\n" + src[body_end:]
    return text, body_start + 8


def _type(engine, key: str, text: str, cursor: int, typed: str, fmt: str) -> list:
    """One request per keystroke as an edit session sends them: prefix and suffix fixed at
    the session's start, the typed characters in the increment (windows cut by tokens)."""
    prefix, suffix = text[:cursor][-4000:], text[cursor:][:1500]
    done = []
    for i in range(len(typed) + 1):
        req = InfillRequest(key=key, prefix=prefix, suffix=suffix, increment=typed[:i], format=fmt, max_tokens=8,
                            stop=("\n",))
        done.append(engine.submit(req).result(120))
    return done


def _reuse(done) -> float:
    prompt = sum(c.stats.prompt_tokens for c in done)
    return sum(c.stats.reused_tokens for c in done) / prompt


def _report(name: str, engine, done) -> None:
    h = engine.health()
    print(f"\n{name}: {len(done)} requests, reuse while typing {_reuse(done):.4f}, prompt tokens "
          f"{done[-1].stats.prompt_tokens}, prefilled/request {sum(c.stats.prefilled_tokens for c in done) / len(done):.2f}; "
          f"client TTFT {h['clientTtftMs']}, server prompt_ms {h['serverPromptMs']}, remote overhead {h['remoteOverheadMs']}")


@pytest.mark.parametrize("which", ["default", "exported"])
def test_typing_a_function_reuses_the_servers_cache(which, llama_default, default_gguf, request):
    from efim_tools.peers.llama_cpp import LlamaServer
    from engine.remote import RemoteEngine

    text, cursor = stdlib_function()
    if which == "default":
        server, model = llama_default, default_gguf
        return_context = None
    else:
        model = request.getfixturevalue("exported_fim_gguf")
        return_context = LlamaServer(model, slots=2, ctx_per_slot=4096, threads=2)
        server = return_context.start()
    try:
        with RemoteEngine("llama.cpp", server.url, model=str(model)) as engine:
            info = engine.info()
            assert engine.health()["state"] == "connected" and engine.health()["slots"] == 2
            assert engine.health()["modelMismatch"] is None  # the server tokenizes our sentinels to our ids
            fmt = "efim" if info.supports_fim else "prefix"
            assert info.supports_fim == (which == "exported")
            done = _type(engine, "file:///textwrap.py", text, cursor, TYPED, fmt)
            assert all(c.finish_reason in ("stop", "eos", "length") for c in done), [c.error for c in done]
            typing = done[1:]  # the first prompt is the document's cold start
            assert all(c.stats.reused_tokens > 0 for c in typing)
            assert _reuse(typing) >= 0.95, [(c.stats.prompt_tokens, c.stats.reused_tokens) for c in typing]
            assert done[0].stats.prompt_tokens > 500 and done[0].stats.reused_tokens < done[0].stats.prompt_tokens
            assert engine.health()["reuseReported"] == len(done)
            _report(f"llama-server {which} ({info.template})", engine, typing)
    finally:
        if return_context is not None:
            return_context.stop()


def test_two_documents_on_their_own_server_slots_keep_their_reuse(llama_default, default_gguf):
    from engine.remote import RemoteEngine

    text, cursor = stdlib_function()
    other = (Path(sysconfig.get_paths()["stdlib"]) / "heapq.py").read_text()
    other_cursor = other.index("def heappop(heap):") + len("def heappop(heap):\n    ")
    with RemoteEngine("llama.cpp", llama_default.url, model=str(default_gguf)) as engine:
        a1 = _type(engine, "file:///a.py", text, cursor, "chunks", "prefix")
        b1 = _type(engine, "file:///b.py", other, other_cursor, "last", "prefix")
        a2 = _type(engine, "file:///a.py", text, cursor, "chunks = self", "prefix")
        b2 = _type(engine, "file:///b.py", other, other_cursor, "lastelt = heap", "prefix")
        server_slots = engine._server_slots
        assert server_slots["file:///a.py"] != server_slots["file:///b.py"]
        # Coming back to a document after typing in the other: its first prompt is still cached.
        assert a2[0].stats.reused_tokens >= 0.95 * a2[0].stats.prompt_tokens, a2[0].stats
        assert b2[0].stats.reused_tokens >= 0.95 * b2[0].stats.prompt_tokens, b2[0].stats
        assert _reuse(a2 + b2) >= 0.95
        print(f"\ntwo documents: coming back reused {a2[0].stats.reused_tokens}/{a2[0].stats.prompt_tokens} (a), "
              f"{b2[0].stats.reused_tokens}/{b2[0].stats.prompt_tokens} (b); cold starts {a1[0].stats.prompt_tokens}, "
              f"{b1[0].stats.prompt_tokens} tokens")


def test_a_superseded_keystroke_does_not_delay_the_next(llama_default, default_gguf):
    """A keystroke that arrives while the previous one is still prefilling a cold window:
    the old stream is closed and the new request answers."""
    from engine.remote import RemoteEngine

    text, cursor = stdlib_function()
    with RemoteEngine("llama.cpp", llama_default.url, model=str(default_gguf)) as engine:
        prefix, suffix = text[:cursor][-6000:], text[cursor:][:1000]
        slow = engine.submit(InfillRequest(key="file:///s.py", prefix=prefix, suffix=suffix, format="prefix", max_tokens=32))
        fast = engine.submit(InfillRequest(key="file:///s.py", prefix=prefix, suffix=suffix, increment="c", format="prefix",
                                           max_tokens=4, stop=("\n",)))
        assert slow.result(60).finish_reason == "cancelled"
        done = fast.result(120)
        assert done.finish_reason in ("stop", "eos", "length"), done.error
        again = engine.submit(InfillRequest(key="file:///s.py", prefix=prefix, suffix=suffix, increment="ch", format="prefix",
                                            max_tokens=4, stop=("\n",))).result(60)
        assert again.stats.reused_tokens >= 0.95 * again.stats.prompt_tokens


# ---------------------------------------------------------------- end to end: efim serve -> llama-server

SERVER = ClientServerConfig(
    server_command=[sys.executable, "-m", "efim_tools.cli", "serve", "--log-level", "warning"],
    server_env={**os.environ, "OMP_NUM_THREADS": "1"},
)


@pytest_lsp.fixture(config=SERVER, scope="module")
async def lsp(lsp_client: LanguageClient, llama_default):
    await initialize(lsp_client, "visual_studio_code",
                     {"backend": "llama.cpp", "endpoint": llama_default.url, "model": "default", "maxTokens": 12})
    stats = await wait_ready(lsp_client, timeout=120)
    assert stats["model"]["state"] == "ready", stats["model"]
    yield
    await lsp_client.shutdown_session()


@pytest.mark.asyncio(loop_scope="module")
async def test_efim_serve_with_a_llama_cpp_backend_reuses_while_typing(lsp: LanguageClient):
    lsp_client = lsp
    text, cursor = stdlib_function()
    uri = "file:///stdlib/textwrap.py"
    line = text[:cursor].count("\n")
    col = cursor - (text.rfind("\n", 0, cursor) + 1)
    open_doc(lsp_client, text, uri)
    await inline(lsp_client, t.Position(line, col), uri)  # the document's cold start
    before = await request(lsp_client, "efim/stats")
    for i, ch in enumerate(TYPED):
        change(lsp_client, i + 1, line, col + i, ch, uri=uri)
        result = await inline(lsp_client, t.Position(line, col + i + 1), uri)
        for item in result.items:
            assert item.range.start == t.Position(line, col + i + 1)
    stats = await request(lsp_client, "efim/stats")
    d = {k: stats[k] - before[k] for k in ("requests", "promptTokens", "reusedTokens", "prefilledTokens", "typingThroughHits")}
    assert d["requests"] == len(TYPED)
    assert d["promptTokens"] > 0 and d["reusedTokens"] / d["promptTokens"] >= 0.95, d
    engine = stats["engine"]
    assert engine["state"] == "connected" and engine["backend"] == "llama.cpp" and engine["reuseReported"] > 0
    assert stats["model"]["info"]["dtype"] == "remote"
    assert (await request(lsp_client, "efim/documentText", {"textDocument": {"uri": uri}}))["text"] == (
        text[:cursor] + TYPED + text[cursor:])
    print(f"\nefim serve -> llama-server: {d}, reuse {d['reusedTokens'] / d['promptTokens']:.4f}, "
          f"TTFT (server-side, from arrival) {stats['ttftMs']}, client TTFT {engine['clientTtftMs']}, "
          f"llama-server prompt_ms {engine['serverPromptMs']}, remote overhead {engine['remoteOverheadMs']}")
    await asyncio.sleep(0)


def test_a_background_request_warms_the_window_on_the_server(llama_default, default_gguf):
    """Warm-ahead through llama-server (`n_predict: 0`): the first keystroke after it finds
    its prompt cached."""
    from engine.remote import RemoteEngine

    other = (Path(sysconfig.get_paths()["stdlib"]) / "heapq.py").read_text()
    cursor = other.index("def heappushpop(heap, item):") + len("def heappushpop(heap, item):\n    ")
    with RemoteEngine("llama.cpp", llama_default.url, model=str(default_gguf)) as engine:
        base = dict(key="file:///warm.py", prefix=other[:cursor][-4000:], suffix=other[cursor:][:1500], format="prefix",
                    max_tokens=8, stop=("\n",))
        warm = engine.submit(InfillRequest(background=True, **base)).result(120)
        assert warm.finish_reason != "error", warm.error
        assert warm.stats.prompt_tokens > 500 and warm.stats.prefilled_tokens > 0.9 * warm.stats.prompt_tokens
        first = engine.submit(InfillRequest(increment="i", **base)).result(120)
        assert first.stats.reused_tokens >= 0.95 * first.stats.prompt_tokens, first.stats
        assert engine.stats().warm_requests == 1


def _fresh_line_cases(n: int) -> list[tuple[str, str]]:
    """(prefix, suffix) at `n` statement lines of a stdlib module emptied where the language
    server would set the fresh-line rule: the cursor on the empty line of a block that goes on."""
    from efim_lsp.suggest import CursorContext, fresh_line

    src = (Path(sysconfig.get_paths()["stdlib"]) / "difflib.py").read_text()
    lines, cases, offset = src.split("\n"), [], 0
    for i, line in enumerate(lines):
        if i > 100 and line.strip() and line.startswith("        ") and len(cases) < n and i % 17 == 0:
            text = src[:offset] + src[offset + len(line) :]  # the line emptied, its break kept
            if fresh_line(CursorContext.at(text, offset)):
                cases.append((text[:offset][-3000:], text[offset:][:1000]))
        offset += len(line) + 1
    return cases


def test_the_fresh_line_rule_reaches_llama_server_as_a_grammar(exported_fim_gguf):
    """On an empty line of a block that goes on, the exported FIM model may answer a blank
    line; with `fresh_line` the request carries the rule's grammar and every answer has text
    before any line break (the guard does not apply on a server)."""
    from efim_tools.peers.llama_cpp import LlamaServer
    from engine.remote import RemoteEngine

    cases = _fresh_line_cases(6)
    assert len(cases) == 6
    with LlamaServer(exported_fim_gguf, slots=1, ctx_per_slot=4096, threads=2) as server:
        with RemoteEngine("llama.cpp", server.url, model=str(exported_fim_gguf)) as engine:
            answers = {}
            for rule in (False, True):
                answers[rule] = [
                    engine.submit(InfillRequest(key="file:///difflib.py", prefix=p, suffix=s, format="fim", max_tokens=16,
                                                stop=("\n",), fresh_line=rule)).result(120)
                    for p, s in cases
                ]
            assert all(c.finish_reason != "error" for c in answers[False] + answers[True]), [c.error for c in answers[True]]
            first_lines = [c.text.split("\n", 1)[0] for c in answers[True]]
            assert all(line.strip() for line in first_lines), first_lines
            blank_without = sum(not c.text.strip() for c in answers[False])
            print(f"\nllama-server fresh lines: blank answers {blank_without}/{len(cases)} without the rule, 0 with it: {first_lines}")
