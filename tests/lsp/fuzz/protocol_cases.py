"""Hostile and buggy client input for the protocol fuzz suite, as hypothesis strategies.

A `Case` is raw bytes for the server's stdin plus what the protocol says must come back:
`id` is the request id to expect an answer for (None: a notification or framing garbage,
nothing must come back for it; kind "invalid-id": an InvalidRequest answer with id null;
"parse-error": a ParseError answer with id null),
`codes` the error codes allowed (None: a result or any error but InternalError).
"""

from __future__ import annotations

import json
from typing import Any, NamedTuple

from hypothesis import strategies as st

from stdio_client import frame

CANARY = "file:///fuzz/canary.py"  # never named by a case: its text must survive every case

URIS = ("file:///fuzz/a.py", "file:///fuzz/b%20c.py", "file:///fuzz/\u00e9\U0001f600.py", "untitled:Untitled-1",
        "http://example.com/x.py", "", "not a uri", "file:///", "file:///fuzz/\udc80.py", "vscode-notebook-cell:/x.ipynb#W0")
TEXTS = ("", "x = 1\n", "a\r\nb\rc\n", "s = '😀'\r\n    ", "\0\1\2binary\xff", "\udc80 lone\ud800", "中文\n" * 3,
         "def f(x):\n    return x\n", "x" * 3000, "\r\n" * 50)
METHODS = ("textDocument/inlineCompletion", "textDocument/completion", "efim/documentText", "efim/stats",
           "efim/debug/checkIntegrity", "workspace/executeCommand", "initialize", "$/cancelRequest",
           "textDocument/didOpen", "textDocument/didChange", "textDocument/didClose", "textDocument/didShowCompletion",
           "textDocument/didPartiallyAcceptCompletion", "workspace/didChangeConfiguration", "efim/didMoveCursor",
           "textDocument/documentHighlight", "textDocument/codeAction", "$/setTrace", "initialized", "textDocument/hover", "efim/nonsense", "$/unknown")
UNKNOWN_METHODS = ("textDocument/hover", "efim/nonsense", "$/unknown")
# Settings a case may send: none of them loads a model or slows every request down.
SETTING_KEYS = ("maxTokens", "multiline", "temperature", "prefixTokens", "suffixTokens", "promptFormat", "context", "nonsense")


class Case(NamedTuple):
    kind: str
    raw: bytes
    id: Any = None
    codes: frozenset[int] | None = None


def _text(alphabet_extra: str = "") -> st.SearchStrategy[str]:
    return st.one_of(st.sampled_from(TEXTS), st.text(alphabet=st.characters(codec=None, exclude_categories=()), max_size=40))


json_scalars = st.one_of(st.none(), st.booleans(), st.integers(-(2**63), 2**63), st.floats(allow_nan=False, allow_infinity=False),
                         st.integers(-3, 10), _text())
json_values = st.recursive(json_scalars, lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)), max_leaves=12)
positions = st.fixed_dictionaries({"line": st.one_of(st.integers(-2, 12), st.integers(-(2**40), 2**40)),
                                   "character": st.one_of(st.integers(-2, 200), st.integers(-(2**40), 2**40))})
uris = st.sampled_from(URIS)
ranges = st.fixed_dictionaries({"start": positions, "end": positions})


def _valid_params(method: str, draw) -> Any:
    doc = {"uri": draw(uris)}
    if method in ("textDocument/inlineCompletion", "textDocument/completion"):
        params = {"textDocument": doc, "position": draw(positions)}
        if method == "textDocument/inlineCompletion":
            params["context"] = {"triggerKind": draw(st.sampled_from([1, 2]))}
        return params
    if method in ("efim/documentText", "textDocument/didClose", "efim/didMoveCursor", "textDocument/documentHighlight"):
        params = {"textDocument": doc}
        if method in ("efim/didMoveCursor", "textDocument/documentHighlight"):
            params["position"] = draw(positions)
        return params
    if method == "textDocument/codeAction":
        return {"textDocument": doc, "range": draw(ranges), "context": {"diagnostics": []}}
    if method == "textDocument/didOpen":
        return {"textDocument": {**doc, "languageId": "python", "version": draw(st.integers(-5, 5)), "text": draw(_text())}}
    if method == "textDocument/didChange":
        change = draw(st.one_of(st.fixed_dictionaries({"range": ranges, "text": _text()}), st.fixed_dictionaries({"text": _text()})))
        return {"textDocument": {**doc, "version": draw(st.integers(-5, 50))}, "contentChanges": [change]}
    if method == "workspace/executeCommand":
        return {"command": draw(st.sampled_from(["efim.accepted", "nonsense"])), "arguments": draw(st.lists(json_values, max_size=2))}
    if method == "workspace/didChangeConfiguration":
        return {"settings": {"efim": draw(st.dictionaries(st.sampled_from(SETTING_KEYS), json_scalars, max_size=3))}}
    if method == "$/cancelRequest":
        return {"id": draw(st.one_of(st.integers(), st.text(max_size=5)))}
    if method == "initialize":
        return {"processId": None, "rootUri": None, "capabilities": {}}
    if method in ("textDocument/didShowCompletion", "textDocument/didPartiallyAcceptCompletion"):
        return {"item": {"insertText": draw(_text())}, "acceptedLength": draw(json_scalars)}
    if method == "efim/stats":
        return draw(st.one_of(st.just({}), st.just(None)))
    return draw(json_values)


def _mutate(value: Any, draw) -> Any:
    """Replace, drop or add one member somewhere inside `value` (wrong types, missing fields)."""
    if isinstance(value, dict) and value and draw(st.booleans()):
        key = draw(st.sampled_from(sorted(value)))
        action = draw(st.sampled_from(["replace", "drop", "recurse", "add"]))
        out = dict(value)
        if action == "drop":
            del out[key]
        elif action == "replace":
            out[key] = draw(json_values)
        elif action == "add":
            out[draw(st.text(max_size=6))] = draw(json_values)
        else:
            out[key] = _mutate(value[key], draw)
        return out
    if isinstance(value, list) and value and draw(st.booleans()):
        i = draw(st.integers(0, len(value) - 1))
        return [*value[:i], _mutate(value[i], draw), *value[i + 1 :]]
    return draw(json_values) if draw(st.booleans()) else value


def _encode(message: Any) -> bytes:
    return json.dumps(message, ensure_ascii=False).encode("utf-8", "surrogatepass")


@st.composite
def messages(draw) -> Case:
    """A JSON-RPC message, valid or with its params mutated, to a known or unknown method."""
    method = draw(st.one_of(st.sampled_from(METHODS), st.text(max_size=20)))
    params = _valid_params(method, draw)
    mutated = draw(st.booleans())
    if mutated:
        params = _mutate(params, draw)
    is_request = draw(st.booleans()) if method not in ("initialize",) else True
    message: dict[str, Any] = {"jsonrpc": "2.0", "method": method}
    if params is not None or draw(st.booleans()):
        message["params"] = params
    if not is_request:
        return Case("notification", frame(_encode(message)))
    weird_id = draw(st.integers(0, 9)) == 0
    msg_id = draw(json_values) if weird_id else draw(st.one_of(st.integers(1 << 40, 1 << 50), st.text(min_size=1, max_size=8).map(lambda s: "fz-" + s)))
    message["id"] = msg_id
    if weird_id and not isinstance(msg_id, (int, str)) or isinstance(msg_id, bool):
        return Case("invalid-id", frame(_encode(message)))  # answered InvalidRequest with id null
    if method == "initialize":
        codes: frozenset[int] | None = frozenset({-32600})
    elif method in UNKNOWN_METHODS or method not in METHODS:
        codes = frozenset({-32601})  # a method nobody registered
    else:
        codes = None
    return Case("request" if not mutated else "mutated-request", frame(_encode(message)), msg_id, codes)


def _header(n: Any) -> bytes:
    return f"Content-Length: {n}\r\n\r\n".encode()


@st.composite
def framing(draw) -> Case:
    """Bytes that are not one well-framed JSON-RPC object."""
    body = _encode({"jsonrpc": "2.0", "method": "efim/nonsense", "params": draw(json_values)})
    kind = draw(st.sampled_from(["garbage", "too-short", "too-long", "non-numeric", "negative", "huge", "non-json",
                                 "json-non-object", "truncated", "invalid-utf8", "no-header", "lf-only", "extra-headers"]))
    if kind == "garbage":
        raw = draw(st.binary(max_size=200))
    elif kind == "too-short":
        raw = _header(draw(st.integers(0, max(0, len(body) - 1)))) + body
    elif kind == "too-long":
        raw = _header(len(body) + draw(st.integers(1, 200))) + body
    elif kind == "non-numeric":
        raw = _header(draw(st.sampled_from(["abc", "", "1e3", "0x10", "12 34", "½"]))) + body
    elif kind == "negative":
        raw = _header(-len(body)) + body
    elif kind == "huge":
        raw = _header(draw(st.sampled_from([10**12, 2**63, 10**40]))) + body
    elif kind == "non-json":
        raw = frame(draw(st.binary(min_size=1, max_size=100)))
    elif kind == "json-non-object":
        raw = frame(_encode(draw(st.one_of(st.lists(json_values, max_size=3), json_scalars))))
    elif kind == "truncated":
        raw = _header(len(body)) + body[: draw(st.integers(0, len(body) - 1))]
    elif kind == "invalid-utf8":
        raw = frame(b'{"jsonrpc": "2.0", "method": "efim/nonsense", "params": "\xff\xfe\xc3"}')
    elif kind == "no-header":
        raw = b"\r\n" + body + b"\r\n"
    elif kind == "lf-only":  # a bare-LF header block is accepted; the message is a notification
        raw = f"Content-Length: {len(body)}\n\n".encode() + body
    else:
        raw = b"Content-Type: application/vscode-jsonrpc; charset=utf-8\r\nX-Junk: 1\r\n" + _header(len(body)) + body
    return Case("framing-" + kind, raw)


cases = st.one_of(messages(), messages(), framing())
