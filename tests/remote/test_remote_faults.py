"""RemoteEngine against a fault-injecting server (tests/remote/fault_server.py): the request it
sends, what it reports, and every fault of issue 16 — server down at start, down mid-stream,
4xx/5xx, garbage, a model without FIM tokens, hanging, a slow stream superseded — each ending
the handle with one terminal event (never an exception), told once per outage, with the
backend reconnecting by itself."""

from __future__ import annotations

import logging
import ssl
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fault_server import FaultServer  # noqa: E402

from engine.api import EngineError, InfillRequest  # noqa: E402
from engine.remote.dialects import FRESH_LINE_GRAMMAR, grammar  # noqa: E402
from engine.remote import RemoteEngine  # noqa: E402


class Faults:
    def __init__(self) -> None:
        self.seen: list[tuple[str, str]] = []

    def __call__(self, kind: str, message: str) -> None:
        self.seen.append((kind, message))

    def kinds(self, word: str) -> list[str]:
        return [k for k, _ in self.seen if word in k]


def _engine(url: str, model: Path, backend: str = "llama.cpp", **kw) -> tuple[RemoteEngine, Faults]:
    kw.setdefault("connect_timeout", 0.5)
    kw.setdefault("discover_timeout", 3.0)
    engine = RemoteEngine(backend, url, model=str(model), **kw)
    faults = Faults()
    engine.on_fault = faults
    return engine, faults


def _req(key: str = "file:///a.py", **kw) -> InfillRequest:
    kw.setdefault("heal", False)  # the fake server's answer does not follow healing's grammar (tested on its own)
    kw.setdefault("prefix", "def add(a, b):\n    ")
    kw.setdefault("suffix", "\n\nprint(add(1, 2))\n")
    return InfillRequest(key=key, **kw)


def _wait(predicate, timeout: float = 10.0) -> None:
    end = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > end:
            raise AssertionError("condition not met in time")
        time.sleep(0.02)


def test_sends_token_ids_streams_text_and_reports_the_servers_reuse(tiny_model_dir):
    with FaultServer() as server:
        engine, faults = _engine(server.url, tiny_model_dir)
        with engine:
            assert engine.health()["state"] == "connected" and engine.health()["slots"] == 2
            handle = engine.submit(_req(increment="re"))
            events = list(handle.events(timeout=10))
            done = events[-1].completion
            assert "".join(e.text for e in events if e.kind == "token") == done.text == "return a + b"
            assert done.finish_reason == "eos"
            first = server.completions()[-1]
            # The prompt is the local engine's rendering, as ids; cache on; the document pinned to a server slot.
            assert first["prompt"] == engine._prompt_ids(_req(increment="re"))
            assert all(isinstance(t, int) for t in first["prompt"])
            assert first["cache_prompt"] is True and first["stream"] is True and first["id_slot"] in (0, 1)
            assert first["timings_per_token"] is True
            # The next keystroke extends the prompt; reuse is the server's count, not assumed.
            second = engine.submit(_req(increment="ret")).result(10)
            body = server.completions()[-1]
            assert body["prompt"][: len(first["prompt"]) - 1] == first["prompt"][:-1]
            assert second.stats.reused_tokens == server.cached[-1] > 0
            assert second.stats.prompt_tokens == len(body["prompt"])
            assert second.stats.prefilled_tokens == len(body["prompt"]) - second.stats.reused_tokens
            assert second.stats.ttft_ms > 0
            st = engine.stats()
            assert st.requests == 2 and st.reused_tokens == second.stats.reused_tokens + done.stats.reused_tokens
            assert engine.health()["reuseReported"] == 2 and engine.health()["remoteOverheadMs"]["n"] == 2
        assert not faults.seen


def test_documents_keep_their_server_slots(tiny_model_dir):
    with FaultServer(slots=2) as server:
        engine, _ = _engine(server.url, tiny_model_dir)
        with engine:
            server_slot = {}
            for key in ("a", "b", "a", "b", "a"):
                engine.submit(_req(key)).result(10)
                server_slot.setdefault(key, set()).add(server.completions()[-1]["id_slot"])
            assert len(server_slot["a"]) == len(server_slot["b"]) == 1 and server_slot["a"] != server_slot["b"]
            engine.submit(_req("c")).result(10)  # a third document takes the least recently used server slot (b's)
            assert server.completions()[-1]["id_slot"] == next(iter(server_slot["b"]))
            engine.submit(_req("a")).result(10)
            assert server.completions()[-1]["id_slot"] == next(iter(server_slot["a"]))


def test_server_down_at_start_fails_fast_tells_once_and_reconnects(tiny_model_dir):
    server = FaultServer()  # not started: its port refuses connections
    engine, faults = _engine(server.url, tiny_model_dir)
    try:
        assert engine.health()["state"] == "unreachable"
        for i in range(5):
            started = time.monotonic()
            done = engine.submit(_req(increment="x" * i)).result(5)
            assert done.finish_reason == "error" and done.text == ""
            assert "unreachable" in done.error and server.url.split("//")[1] in done.error
            assert time.monotonic() - started < 0.5  # no keystroke waits on a connect timeout
        assert len(faults.kinds("unreachable")) == 1, faults.seen
        server.start()  # the server comes up: the background probe finds it
        _wait(lambda: engine.health()["state"] == "connected")
        done = engine.submit(_req()).result(10)
        assert done.finish_reason == "eos" and done.text == "return a + b"
        assert engine.health()["reconnects"] == 1
        server.stop()  # a second outage is told again
        assert engine.submit(_req()).result(10).finish_reason == "error"
        assert len(faults.kinds("unreachable")) == 2, faults.seen
        assert len(set(faults.kinds("unreachable"))) == 2  # distinct kinds: a listener showing each once shows both
    finally:
        engine.close()
        server.stop()


def test_down_mid_stream_is_an_error_then_reconnects(tiny_model_dir):
    with FaultServer(mode="drop") as server:
        engine, faults = _engine(server.url, tiny_model_dir)
        with engine:
            handle = engine.submit(_req())
            events = list(handle.events(timeout=10))
            done = events[-1].completion
            assert done.finish_reason == "error" and "mid-stream" in done.error and done.text == ""
            assert [e.text for e in events if e.kind == "token"] == ["return", " a"]  # streamed before the drop
            assert faults.kinds("unreachable")
            server.mode = "ok"
            _wait(lambda: engine.health()["state"] == "connected")
            assert engine.submit(_req()).result(10).text == "return a + b"


def test_a_connection_closed_before_answering_is_sent_again_once(tiny_model_dir):
    """A kept-alive connection that was closed while idle fails before any answer: the request
    goes again on a new connection, with no fault told; a second such close is a real one."""
    with FaultServer() as server:
        engine, faults = _engine(server.url, tiny_model_dir)
        with engine:
            assert engine.submit(_req()).result(10).text == "return a + b"
            server.close_unanswered = 1
            before = len(server.completions())
            done = engine.submit(_req(increment="r")).result(10)
            assert done.finish_reason == "eos" and done.text == "return a + b" and done.error is None
            assert len(server.completions()) == before + 2  # the request, then the same one again
            assert server.completions()[-1] == server.completions()[-2]
            assert faults.seen == [] and engine.health()["state"] == "connected" and engine.health()["resent"] == 1
            server.close_unanswered = 2
            done = engine.submit(_req(increment="re")).result(10)
            assert done.finish_reason == "error" and "dropped the connection" in done.error
            assert faults.kinds("unreachable") and engine.health()["resent"] == 2


@pytest.mark.parametrize("mode,status", [("http500", 500), ("http400", 400)])
def test_http_errors_carry_the_servers_message_once(tiny_model_dir, mode, status):
    with FaultServer(mode=mode) as server:
        engine, faults = _engine(server.url, tiny_model_dir)
        with engine:
            results = [engine.submit(_req(increment="x" * i)).result(10) for i in range(3)]
            for done in results:
                assert done.finish_reason == "error" and f"HTTP {status}" in done.error
                assert f"injected HTTP {status}" in done.error
            assert len(faults.kinds("http")) == 1 and engine.health()["state"] == "error"
            server.mode = "ok"
            assert engine.submit(_req()).result(10).finish_reason == "eos"
            assert engine.health()["state"] == "connected"


@pytest.mark.parametrize("mode", ["garbage", "badjson", "noend"])
def test_garbage_answers_are_errors_not_exceptions(tiny_model_dir, mode):
    with FaultServer(mode=mode) as server:
        engine, faults = _engine(server.url, tiny_model_dir)
        with engine:
            done = engine.submit(_req()).result(10)
            assert done.finish_reason == "error" and "not a llama.cpp completion" in done.error, done.error
            assert faults.kinds("garbage")


def test_a_hanging_server_ends_at_the_deadline_and_by_read_timeout(tiny_model_dir):
    with FaultServer(mode="hang") as server:
        engine, faults = _engine(server.url, tiny_model_dir, read_timeout=0.5)
        with engine:
            started = time.monotonic()
            done = engine.submit(_req(deadline=time.monotonic() + 0.3)).result(5)
            assert done.finish_reason == "deadline" and done.text == ""
            assert time.monotonic() - started < 0.45
            # The server said nothing: no prompt tokens are counted (neither reused nor prefilled).
            assert done.stats.prompt_tokens == done.stats.prefilled_tokens == done.stats.reused_tokens == 0
            done = engine.submit(_req("b")).result(5)  # no deadline: the read timeout ends it
            assert done.finish_reason == "error" and "sent nothing" in done.error
            assert faults.kinds("timeout")
            server.released.set()


def test_a_slow_stream_is_superseded_by_the_next_keystroke(tiny_model_dir):
    with FaultServer(mode="slow", delay=0.3, pieces=["a"] * 20) as server:
        engine, _ = _engine(server.url, tiny_model_dir)
        with engine:
            slow = engine.submit(_req(increment="r"))
            _wait(lambda: len(server.completions()) == 1)
            time.sleep(0.4)
            server.mode, server.pieces = "ok", ["return", " a"]
            started = time.monotonic()
            fast = engine.submit(_req(increment="re"))
            old = slow.result(5)
            assert old.finish_reason == "cancelled" and time.monotonic() - started < 0.3
            assert fast.result(5).text == "return a"
            _wait(lambda: server.disconnects >= 1, 5)  # the closed stream reached the server


def test_cancel_and_close_end_every_handle(tiny_model_dir):
    with FaultServer(mode="slow", delay=0.2, pieces=["x"] * 50) as server:
        engine, _ = _engine(server.url, tiny_model_dir)
        h1 = engine.submit(_req("a"))
        h2 = engine.submit(_req("b"))
        time.sleep(0.3)
        h1.cancel()
        assert h1.result(3).finish_reason == "cancelled"
        engine.close()
        assert h2.result(3).finish_reason == "cancelled"
        with pytest.raises(EngineError):
            engine.submit(_req("c"))


def test_a_model_without_fim_tokens_is_told_and_completes_from_the_prefix(tiny_model_factory):
    model = tiny_model_factory("llama", fim_tokens=False)
    with FaultServer() as server:
        engine, faults = _engine(server.url, model)
        with engine:
            assert not engine.info().supports_fim
            assert len(faults.kinds("no-fim")) == 1 and "no FIM tokens" in faults.seen[0][1]
            done = engine.submit(_req(format="prefix")).result(10)
            assert done.finish_reason == "eos"
            ids = server.completions()[-1]["prompt"]
            assert ids == list(engine.tokenizer.encode_uncached("def add(a, b):\n    "))


def test_a_server_with_another_vocabulary_is_refused_with_a_message(tiny_model_dir):
    with FaultServer(tokenize=lambda text: [7, 7, 7]) as server:
        engine, faults = _engine(server.url, tiny_model_dir)
        with engine:
            done = engine.submit(_req()).result(5)
            assert done.finish_reason == "error" and "serves another model" in done.error
            assert faults.kinds("model") and engine.health()["modelMismatch"]
            assert engine.health()["state"] == "error"
            assert not server.completions()  # nothing was sent


def test_the_vocabulary_check_passes_when_the_server_agrees(tiny_model_dir):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json"))
    with FaultServer(tokenize=lambda text: tok.encode(text, add_special_tokens=False).ids) as server:
        engine, faults = _engine(server.url, tiny_model_dir)
        with engine:
            assert engine.health()["modelMismatch"] is None
            assert engine.submit(_req()).result(5).finish_reason == "eos"
            assert sum(1 for path, _, _ in server.requests if path == "/tokenize") >= 4


def _self_signed(tmp: Path) -> tuple[Path, Path]:
    cert, key = tmp / "cert.pem", tmp / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert),
         "-days", "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
        check=True, capture_output=True,
    )
    return cert, key


def test_tls_and_bearer_token_the_key_never_shown(tiny_model_dir, tmp_path, monkeypatch, caplog):
    cert, key = _self_signed(tmp_path)
    server_ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server_ctx.load_cert_chain(cert, key)
    secret = "sk-test-0123456789abcdef"
    monkeypatch.setenv("EFIM_TEST_KEY", secret)
    caplog.set_level(logging.DEBUG)
    with FaultServer(ssl_context=server_ctx, require_key=secret) as server:
        assert server.url.startswith("https://")
        client_ctx = ssl.create_default_context(cafile=str(cert))
        engine, faults = _engine(server.url, tiny_model_dir, api_key_env="EFIM_TEST_KEY", verify=client_ctx)
        with engine:
            done = engine.submit(_req()).result(10)
            assert done.finish_reason == "eos" and done.text == "return a + b"
            assert server.requests[-1][1]["Authorization"] == f"Bearer {secret}"
            shown = repr(engine.health()) + repr(engine.info()) + repr(faults.seen) + caplog.text
            assert secret not in shown
        # Without the key the server refuses: an auth fault naming the setting, never the key.
        monkeypatch.setenv("EFIM_TEST_WRONG", "wrong")
        engine, faults = _engine(server.url, tiny_model_dir, api_key_env="EFIM_TEST_WRONG", verify=client_ctx)
        with engine:
            done = engine.submit(_req()).result(10)
            assert done.finish_reason == "error"
            assert any("apiKeyEnv" in m for _, m in faults.seen), faults.seen
        # A client that does not trust the certificate does not connect.
        engine, faults = _engine(server.url, tiny_model_dir, api_key_env="EFIM_TEST_KEY")
        with engine:
            assert engine.health()["state"] == "unreachable" and "CERTIFICATE" in (engine.health()["lastError"] or "").upper()


def test_plain_http_to_another_machine_is_warned_about(tiny_model_dir):
    engine, faults = _engine("http://192.0.2.1:9", tiny_model_dir, connect_timeout=0.2, discover_timeout=1.0)
    with engine:
        assert faults.kinds("insecure") and "unencrypted" in faults.seen[0][1]
    engine, faults = _engine("http://127.0.0.1:9", tiny_model_dir, connect_timeout=0.2, discover_timeout=1.0)
    with engine:
        assert not faults.kinds("insecure")


@pytest.mark.parametrize("url,needle", [
    ("ftp://host/", "http:// or https://"),
    ("http://user:pw@host:8080", "credentials"),
    ("http://host:8080/?key=1", "query"),
    ("", "endpoint"),
])
def test_bad_endpoints_are_refused_clearly(tiny_model_dir, url, needle):
    with pytest.raises(EngineError, match=needle.replace("?", r"\?")) as info:
        RemoteEngine("llama.cpp", url, model=str(tiny_model_dir))
    assert "pw" not in str(info.value)


def test_an_unset_api_key_variable_is_refused(tiny_model_dir, monkeypatch):
    monkeypatch.delenv("EFIM_NOT_SET", raising=False)
    with pytest.raises(EngineError, match="EFIM_NOT_SET"):
        RemoteEngine("llama.cpp", "http://127.0.0.1:9", model=str(tiny_model_dir), api_key_env="EFIM_NOT_SET")


def test_the_fresh_line_rule_is_sent_to_llama_cpp_as_a_grammar(tiny_model_dir):
    with FaultServer() as server:
        engine, faults = _engine(server.url, tiny_model_dir)
        with engine:
            engine.submit(_req(increment="re")).result(10)
            assert "grammar" not in server.completions()[-1]
            engine.submit(_req(increment="", fresh_line=True)).result(10)
            assert server.completions()[-1]["grammar"] == FRESH_LINE_GRAMMAR
            engine.submit(_req(increment="", fresh_line=True, background=True)).result(10)  # a warm-up generates nothing
            assert "grammar" not in server.completions()[-1]


def test_token_healing_on_llama_cpp_constrains_the_answer_by_grammar_and_skips_the_healed_text(tiny_model_dir):
    """Healing on llama.cpp: the prompt loses its last token, the grammar makes the answer
    start with that token's text, and the stream leaves that text out (the user typed it)."""
    with FaultServer(pieces=("ret", "urn", " a", " +", " b")) as server:
        engine, faults = _engine(server.url, tiny_model_dir)
        with engine:
            plain_ids = engine._prompt_ids(_req(increment="ret"))
            done = engine.submit(_req(increment="ret", heal=True)).result(10)
            body = server.completions()[-1]
            healed = engine.tokenizer.vocab.token_bytes[plain_ids[-1]].decode()
            assert "ret".endswith(healed) and body["prompt"] == plain_ids[:-1]
            assert body["grammar"] == grammar(healed)
            # the fake server, like llama.cpp, starts its answer with the grammar's literal (the
            # healed text) and then streams "return a + b": the healed text is left out
            assert done.text == "return a + b" and done.stats.healed_tokens == 1
            # with the fresh-line rule too, the rule's shape follows the healed text
            # (format "prefix": the prompt ends with the prefix, at a line start)
            engine.submit(_req(prefix="def f(x):\n", increment="", format="prefix", heal=True, fresh_line=True)).result(10)
            rule = server.completions()[-1]["grammar"]
            assert rule.startswith('root ::= "') and rule.endswith(FRESH_LINE_GRAMMAR[len("root ::= "):])
            # a stop string inside the healed text: no healing (the server would stop on it at once)
            engine.submit(_req(prefix="def f(x):\n", increment="", format="prefix", heal=True, stop=("\n",))).result(10)
            last = server.completions()[-1]
            assert "grammar" not in last and last["prompt"] == engine._prompt_ids(_req(prefix="def f(x):\n", format="prefix"))
    assert grammar('a"b\\\n\t\x01') == 'root ::= "a\\"b\\\\\\n\\t\\x01" [^\\x00]*\n'
    assert grammar() is None


def test_healed_blanks_reach_llama_cpp_whole(tiny_model_dir):
    """Multi-token healing on llama.cpp: indentation typed part of the way ("   " where the
    code around is indented by 4) is dropped from the prompt token by token, the grammar's
    literal is all of it, and the stream leaves it out."""
    with FaultServer(pieces=("     x = 1",)) as server:  # after the grammar literal, as llama.cpp writes it
        engine, faults = _engine(server.url, tiny_model_dir)
        with engine:
            req = _req(prefix="def f(x):\n    y = x\n", increment="   ", format="prefix", heal=True)
            plain_ids = engine._prompt_ids(_req(prefix="def f(x):\n    y = x\n", increment="   ", format="prefix"))
            done = engine.submit(req).result(10)
            body = server.completions()[-1]
            assert body["grammar"] == grammar("   ")
            dropped = len(plain_ids) - len(body["prompt"])
            assert dropped >= 1 and body["prompt"] == plain_ids[:-dropped] and done.stats.healed_tokens == dropped
            assert engine.tokenizer.vocab.text_of(plain_ids[-dropped:]) == "   "
            assert done.text == "     x = 1"


def test_openai_dialect_request_usage_and_alternatives(tiny_model_dir):
    with FaultServer(model_name="qwen-coder") as server:
        engine, faults = _engine(server.url + "/v1", tiny_model_dir, backend="openai")
        with engine:
            assert engine.health()["remoteModel"] == "qwen-coder"
            done = engine.submit(_req(n=2, increment="re")).result(10)
            body = server.completions()[-1]
            assert body["model"] == "qwen-coder" and body["prompt"] == engine._prompt_ids(_req(increment="re"))
            assert body["stream_options"] == {"include_usage": True, "continuous_usage_stats": True} and body["n"] == 2
            assert "id_slot" not in body and "cache_prompt" not in body
            engine.submit(_req(increment="", fresh_line=True)).result(10)
            assert "grammar" not in server.completions()[-1]  # not sent: no common spelling (documented)
            assert done.text == "return a + b" and done.alternatives == ("return1 a1 +1 b1",)
            again = engine.submit(_req(increment="ret")).result(10)
            assert again.stats.reused_tokens == server.cached[-1] > 0
            assert engine.health()["slots"] is None
            server.mode = "http500"
            assert "injected HTTP 500" in engine.submit(_req()).result(10).error
        assert faults.kinds("http") and not faults.kinds("unreachable")


def test_a_background_request_only_prefills(tiny_model_dir):
    with FaultServer() as server:
        engine, _ = _engine(server.url, tiny_model_dir)
        with engine:
            engine.submit(_req(background=True)).result(10)
            assert server.completions()[-1]["n_predict"] == 0
            assert engine.stats().warm_requests == 1 and engine.stats().requests == 0


def test_a_stop_string_the_server_ignores_ends_the_suggestion_here(tiny_model_dir):
    with FaultServer(pieces=["x = 1", "\nprint", "(x)"]) as server:
        engine, _ = _engine(server.url, tiny_model_dir)
        with engine:
            handle = engine.submit(_req(stop=("\n",)))
            events = list(handle.events(timeout=10))
            assert events[-1].completion.text == "x = 1" and events[-1].completion.finish_reason == "stop"
            assert "".join(e.text for e in events if e.kind == "token") == "x = 1"
            assert server.completions()[-1]["stop"][0] == "\n"


def test_a_server_failing_every_other_request_is_told_once(tiny_model_dir):
    with FaultServer() as server:
        engine, faults = _engine(server.url, tiny_model_dir)
        with engine:
            for i in range(6):
                server.mode = "http500" if i % 2 else "ok"
                engine.submit(_req(increment="x" * i)).result(10)
            assert len(faults.kinds("http")) == 1, faults.seen


def test_a_request_superseded_before_it_started_still_ends(tiny_model_dir):
    """Regression: a keystroke right behind another cancelled the first one's task before its
    first step; such a task never runs its body, and its handle hung (found against llama-server)."""
    with FaultServer(mode="slow", delay=0.05) as server:
        engine, _ = _engine(server.url, tiny_model_dir)
        with engine:
            handles = [engine.submit(_req(increment="x" * i)) for i in range(5)]
            reasons = [h.result(5).finish_reason for h in handles]
            assert reasons[:4] == ["cancelled"] * 4 and reasons[4] == "eos"
