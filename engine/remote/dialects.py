"""What each kind of server is sent and answers: request bodies, stream events, discovery.

Both dialects send the prompt as a list of token ids (rendered and tokenized here, by the
local engine's code), so the server sees exactly the ids the EFIM session extends and its
prefix cache matches them token for token.

- `llama.cpp` (llama.cpp's own `llama-server`): `POST /completion` with `cache_prompt`,
  `id_slot` (each document pinned to a server slot), `timings_per_token` (every event carries
  `timings`, so a stream we close early still says how much of the prompt was cached:
  `cache_n` reused, `prompt_n` computed, `prompt_ms`). Discovery: `GET /props`
  (`total_slots`, the per-server-slot `n_ctx`), `POST /tokenize` with `parse_special` to check that
  the server's model has our FIM sentinels with the same ids. Health: `GET /health`.
  Token healing and the fresh-line rule are sent as a GBNF `grammar` (`grammar`), which
  constrains the generated text: healing drops the prompt's last token and the answer
  must start with that token's text (the server may write it merged with what follows,
  "\n        " after a healed "\n"; the stream skips it, the user has typed it); the
  fresh-line rule (`InfillRequest.fresh_line`) then asks for spaces and tabs, a character
  that is not whitespace, then anything — the answer cannot end, nor break the line, while
  it is blank. The server cannot report the model's own probability of a blank answer, so
  the rule's guard does not apply there: a line the model is sure is blank gets text anyway.
- `openai` (vLLM, SGLang, llama.cpp's `/v1`): `POST <base>/completions` (base ending in
  `/v1`, added when missing) with `stream_options: {include_usage, continuous_usage_stats}`
  (usage on every event: vLLM; a server that only sends it at the end still reports it
  there); cached tokens from `usage.prompt_tokens_details.cached_tokens` (vLLM needs
  `--enable-prompt-tokens-details`; without it reuse is reported as unknown, not 0).
  Alternatives with `n`. Discovery and health: `GET <base>/models`. The fresh-line rule is
  not sent (each server spells constrained decoding its own way: vLLM's structured
  outputs, SGLang's `regex`); the answer may be blank there.

`parse` never raises for a missing optional field; it raises `GarbageAnswer` for an event
that is not the dialect's shape.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from engine.api import FinishReason, InfillRequest
from engine.remote.stream import GarbageAnswer, shown


class Usage(NamedTuple):
    """What the server says about one request; None where it says nothing."""

    prompt_tokens: int | None = None
    cached_tokens: int | None = None  # prompt tokens whose KV the server reused
    prompt_ms: float | None = None  # the server's prefill time (llama.cpp)
    generated_tokens: int | None = None
    ms_per_token: float | None = None  # the server's decode time per token (llama.cpp)


class SseEvent(NamedTuple):
    """What one server-sent event of a completion stream says."""

    texts: dict[int, str]  # choice index -> new text
    finished: dict[int, FinishReason]  # choice index -> why it ended
    usage: Usage | None


class ServerFacts(NamedTuple):
    model: str | None = None
    server_slots: int = 1
    context_length: int | None = None  # tokens one request may use (prompt + generated)


def _int(value: Any) -> int | None:
    return int(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _float(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _gbnf_literal(text: str) -> str:
    """`text` as a GBNF string literal."""
    out = []
    for ch in text:
        if ch in '"\\':
            out.append("\\" + ch)
        elif ch == "\n":
            out.append("\\n")
        elif ch == "\r":
            out.append("\\r")
        elif ch == "\t":
            out.append("\\t")
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\x{ord(ch):02X}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


def grammar(healed: str = "", fresh_line: bool = False) -> str | None:
    """The llama.cpp grammar for a request: the healed text first (token healing), then the
    fresh-line rule's shape or anything; None when neither applies."""
    if not healed and not fresh_line:
        return None
    rest = "[ \\t]* [^ \\t\\r\\n] [^\\x00]*" if fresh_line else "[^\\x00]*"
    return f"root ::= {_gbnf_literal(healed) + ' ' if healed else ''}{rest}\n"


# The fresh-line rule alone: whitespace without a line break, then text. End of generation
# is allowed only where the grammar may end, i.e. after that text.
FRESH_LINE_GRAMMAR = grammar(fresh_line=True)


class LlamaCppDialect:
    name = "llama.cpp"
    server_slot_pinning = True
    max_choices = 1  # alternatives: one item (documented)
    heals = True  # token healing through the grammar

    def __init__(self, base: str) -> None:
        self.base = base

    def completion_url(self) -> str:
        return self.base + "/completion"

    def health_url(self) -> str:
        return self.base + "/health"

    def body(self, ids: list[int], req: InfillRequest, *, model: str | None, server_slot: int | None, stop: list[str],
             remaining_ms: int | None, healed: str = "") -> dict:
        body: dict[str, Any] = {
            "prompt": ids,
            "n_predict": 0 if req.background else req.max_tokens,
            "stream": True,
            "cache_prompt": bool(req.cache),
            "timings_per_token": True,
            "temperature": req.temperature,
            "top_p": req.top_p,
            "stop": stop,
            "n_probs": 0,
        }
        if req.seed is not None:
            body["seed"] = req.seed
        if server_slot is not None:
            body["id_slot"] = server_slot
        if remaining_ms is not None and not req.background:
            body["t_max_predict_ms"] = max(1, remaining_ms)  # the server stops decoding at the deadline too
        rule = None if req.background else grammar(healed, req.fresh_line)
        if rule is not None:
            body["grammar"] = rule
        return body

    def parse(self, payload: dict) -> SseEvent:
        content = payload.get("content", "")
        if not isinstance(content, str):
            raise GarbageAnswer(f"llama.cpp event without text content: {shown(str(payload))}")
        if "content" not in payload and "stop" not in payload and "timings" not in payload:
            raise GarbageAnswer(f"not a llama.cpp /completion event: {shown(str(payload))}")
        finished: dict[int, FinishReason] = {}
        if payload.get("stop") is True:
            stop_type = payload.get("stop_type")
            if stop_type == "eos" or payload.get("stopped_eos"):
                finished[0] = "eos"
            elif stop_type == "word" or payload.get("stopped_word"):
                finished[0] = "stop"
            else:
                finished[0] = "length"
        return SseEvent({0: content} if content else {}, finished, self._usage(payload))

    @staticmethod
    def _usage(payload: dict) -> Usage | None:
        t = payload.get("timings")
        if not isinstance(t, dict):
            return None
        cached, computed = _int(t.get("cache_n")), _int(t.get("prompt_n"))
        prompt = cached + computed if cached is not None and computed is not None else None
        return Usage(prompt, cached, _float(t.get("prompt_ms")), _int(t.get("predicted_n")),
                     _float(t.get("predicted_per_token_ms")))

    async def discover(self, client) -> ServerFacts:
        """`/props`: server slots and the per-server-slot context (raises httpx errors; the caller classifies)."""
        resp = await client.get(self.base + "/props")
        resp.raise_for_status()
        props = _json_object(resp)
        settings = props.get("default_generation_settings") or {}
        n_ctx = _int(settings.get("n_ctx")) if isinstance(settings, dict) else None
        n_ctx = n_ctx or _int(props.get("n_ctx"))
        server_slots = _int(props.get("total_slots")) or 1
        model = props.get("model_alias") or props.get("model_path")
        return ServerFacts(str(model) if model else None, max(1, server_slots), n_ctx)

    async def token_ids(self, client, text: str) -> list[int] | None:
        """The server's ids for `text` with special tokens parsed (None: no /tokenize)."""
        resp = await client.post(self.base + "/tokenize", json={"content": text, "add_special": False, "parse_special": True})
        if resp.status_code == 404:
            return None
        resp.raise_for_status()
        tokens = _json_object(resp).get("tokens")
        if not isinstance(tokens, list):
            raise GarbageAnswer(f"/tokenize answered {shown(resp.text)}")
        return [t if isinstance(t, int) else t.get("id") for t in tokens]


class OpenAIDialect:
    name = "openai"
    server_slot_pinning = False
    max_choices = 8
    heals = False  # no common way to constrain the text (documented)

    def __init__(self, base: str) -> None:
        self.base = base if base.endswith("/v1") else base + "/v1"

    def completion_url(self) -> str:
        return self.base + "/completions"

    def health_url(self) -> str:
        return self.base + "/models"

    def body(self, ids: list[int], req: InfillRequest, *, model: str | None, server_slot: int | None, stop: list[str],
             remaining_ms: int | None, healed: str = "") -> dict:
        body: dict[str, Any] = {
            "model": model or "",
            "prompt": ids,
            # A background request only fills the server's prefix cache; 1 is the least a
            # completion may ask for.
            "max_tokens": 1 if req.background else req.max_tokens,
            "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True},
            "temperature": req.temperature,
            "top_p": req.top_p,
            "stop": stop,
        }
        if req.seed is not None:
            body["seed"] = req.seed
        if req.n > 1 and not req.background:
            body["n"] = min(req.n, self.max_choices)
        return body

    def parse(self, payload: dict) -> SseEvent:
        choices = payload.get("choices")
        if not isinstance(choices, list):
            raise GarbageAnswer(f"not an OpenAI completion event (no choices): {shown(str(payload))}")
        texts: dict[int, str] = {}
        finished: dict[int, FinishReason] = {}
        for choice in choices:
            if not isinstance(choice, dict):
                raise GarbageAnswer(f"an OpenAI choice that is not an object: {shown(str(choice))}")
            index = _int(choice.get("index")) or 0
            text = choice.get("text") or ""
            if not isinstance(text, str):
                raise GarbageAnswer(f"an OpenAI choice whose text is not a string: {shown(str(choice))}")
            if text:
                texts[index] = texts.get(index, "") + text
            reason = choice.get("finish_reason")
            if reason:
                finished[index] = "length" if reason == "length" else "stop"
        return SseEvent(texts, finished, self._usage(payload.get("usage")))

    @staticmethod
    def _usage(usage: Any) -> Usage | None:
        if not isinstance(usage, dict):
            return None
        details = usage.get("prompt_tokens_details")
        cached = _int(details.get("cached_tokens")) if isinstance(details, dict) else None
        return Usage(_int(usage.get("prompt_tokens")), cached, None, _int(usage.get("completion_tokens")), None)

    async def discover(self, client) -> ServerFacts:
        resp = await client.get(self.base + "/models")
        resp.raise_for_status()
        data = _json_object(resp).get("data")
        if not isinstance(data, list):
            raise GarbageAnswer(f"{self.base}/models answered {shown(resp.text)}")
        first = data[0] if data and isinstance(data[0], dict) else {}
        return ServerFacts(first.get("id"), 1, _int(first.get("max_model_len")))

    async def token_ids(self, client, text: str) -> list[int] | None:
        return None  # vLLM's /tokenize is outside /v1 and not in SGLang: the check is llama.cpp's only


def _json_object(resp) -> dict:
    try:
        value = resp.json()
    except ValueError:
        raise GarbageAnswer(f"{resp.request.url.path} answered {shown(resp.text)}") from None
    if not isinstance(value, dict):
        raise GarbageAnswer(f"{resp.request.url.path} answered {shown(resp.text)}")
    return value


DIALECTS = {"llama.cpp": LlamaCppDialect, "openai": OpenAIDialect}

__all__ = ["SseEvent", "Usage", "ServerFacts", "LlamaCppDialect", "OpenAIDialect", "DIALECTS"]
