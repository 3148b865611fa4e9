"""The peer people run today, replayed: the requests llama.vim / llama.vscode send to
llama.cpp's `/infill` for the keystrokes of a typing trace.

Their layout (llama.vim's `llama#fim`, llama.vscode's `getFimCompletion`):
`input_prefix` = whole lines above the cursor, `prompt` = the cursor's line up to the cursor
(llama.cpp puts it after the middle sentinel, so typing along one line keeps the prompt's
head), `input_suffix` = the rest of the line and whole lines below, `input_extra` = chunks
of other text (their ring buffer; empty here, as efim-lsp's `context` is off by default),
`cache_prompt: true`, `n_indent`, samplers top-k/top-p/infill, `t_max_prompt_ms` and
`t_max_predict_ms`. The windows are cut to the same token budgets as efim-lsp's
(`prefixTokens`/`suffixTokens`), whole lines, so both see the same amount of text.

Replay follows `efim_tools.trace.person`'s pacing: events at the trace's times ("paced":
a late answer moves the rest later) or back to back ("max"); each completion is awaited
before the next event, as those plugins show one suggestion at a time. A completion is
streamed so the time to its first token is seen by the client; the final event's
`timings` give the server's own figures (`prompt_n` tokens evaluated, `cache_n` reused,
`prompt_ms`, `predicted_n`, `predicted_ms`).
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any, Callable, NamedTuple

import httpx

from efim_lsp.trace_format import Trace
from efim_tools.trace.document import TextDocument


class InfillLayout(NamedTuple):
    prefix_tokens: int = 1536
    suffix_tokens: int = 512
    n_predict: int = 64
    t_max_prompt_ms: int = 500
    t_max_predict_ms: int = 1000
    single_line: bool = True  # stop at the line's end, as efim-lsp's `multiline: auto` does on most keys


class PeerRecord(NamedTuple):
    """One `/infill` request as the client saw it."""

    user: int
    trace: str
    index: int
    ttft_ms: float | None  # request sent → first streamed token (None: no token came)
    latency_ms: float  # request sent → stream ended
    prompt_tokens: int  # prompt_n + cache_n: the whole prompt
    cached_tokens: int  # cache_n: reused from the server slot's KV
    prefilled_tokens: int  # prompt_n: evaluated for this request
    server_prompt_ms: float
    predicted_tokens: int
    predicted_ms: float
    text: str
    error: str | None = None


def infill_body(doc_text: str, cursor: int, layout: InfillLayout, count: Callable[[str], int]) -> dict[str, Any]:
    """llama.vim's request for a cursor at code-point offset `cursor` of `doc_text`."""
    line_start = doc_text.rfind("\n", 0, cursor) + 1
    line_end = doc_text.find("\n", cursor)
    line_end = len(doc_text) if line_end < 0 else line_end
    line_prefix = doc_text[line_start:cursor]
    above = doc_text[:line_start].split("\n")[:-1] if line_start else []
    below = doc_text[line_end + 1 :].split("\n") if line_end < len(doc_text) else []
    if below and below[-1] == "":  # the text after a final newline is no line of the buffer
        below.pop()
    prefix_lines: list[str] = []
    budget = layout.prefix_tokens - count(line_prefix)
    for line in reversed(above):
        budget -= count(line + "\n")
        if budget < 0:
            break
        prefix_lines.append(line)
    suffix = doc_text[cursor:line_end] + "\n"
    budget = layout.suffix_tokens - count(suffix)
    for line in below:
        budget -= count(line + "\n")
        if budget < 0:
            break
        suffix += line + "\n"
    indent = len(line_prefix) - len(line_prefix.lstrip(" \t"))
    body: dict[str, Any] = {
        "input_prefix": "".join(line + "\n" for line in reversed(prefix_lines)),
        "input_suffix": suffix,
        "input_extra": [],
        "prompt": line_prefix,
        "n_predict": layout.n_predict,
        "n_indent": indent,
        "top_k": 40,
        "top_p": 0.99,
        "samplers": ["top_k", "top_p", "infill"],
        "stream": True,
        "cache_prompt": True,
        "t_max_prompt_ms": layout.t_max_prompt_ms,
        "t_max_predict_ms": layout.t_max_predict_ms,
    }
    if layout.single_line:
        body["stop"] = ["\n"]
    return body


async def infill(client: httpx.AsyncClient, url: str, body: dict[str, Any]) -> tuple[float | None, float, str, dict[str, Any], str | None]:
    """(ttft_ms, latency_ms, text, timings, error) of one streamed `/infill`."""
    start = time.perf_counter()
    ttft = None
    text = ""
    timings: dict[str, Any] = {}
    try:
        async with client.stream("POST", url + "/infill", json=body) as resp:
            if resp.status_code != 200:
                detail = (await resp.aread()).decode(errors="replace")[:300]
                return None, (time.perf_counter() - start) * 1e3, "", {}, f"HTTP {resp.status_code}: {detail}"
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                event = json.loads(line[6:])
                new = event.get("content", "")
                if new and ttft is None:
                    ttft = (time.perf_counter() - start) * 1e3
                text += new
                if event.get("stop"):
                    timings = event.get("timings") or {}
                    if ttft is None and event.get("tokens_predicted", 0):
                        ttft = (time.perf_counter() - start) * 1e3
    except httpx.HTTPError as exc:
        return ttft, (time.perf_counter() - start) * 1e3, text, timings, f"{type(exc).__name__}: {exc}"
    return ttft, (time.perf_counter() - start) * 1e3, text, timings, None


async def replay_trace(
    url: str,
    trace: Trace,
    *,
    user: int = 0,
    layout: InfillLayout = InfillLayout(),
    count: Callable[[str], int],
    speed: str = "max",
    limit: int | None = None,
    client: httpx.AsyncClient | None = None,
) -> list[PeerRecord]:
    """Replay one trace's edits and completions as llama.vim would send them."""
    own = client is None
    client = client or httpx.AsyncClient(timeout=httpx.Timeout(60.0, connect=5.0))
    docs: dict[str, TextDocument] = {}
    records: list[PeerRecord] = []
    encoding = trace.header.position_encoding
    start = time.perf_counter()
    try:
        for event in trace.events:
            if speed in ("paced", "realtime"):
                delay = start + event.t / 1000.0 - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                elif speed == "paced":
                    start -= delay
            params = event.params
            if event.kind == "open":
                item = params["textDocument"]
                docs[item["uri"]] = TextDocument(item["uri"], item["text"], 0, encoding)
            elif event.kind == "change":
                doc = docs.get(params["textDocument"]["uri"])
                if doc is not None:
                    for change in params["contentChanges"]:
                        doc.apply_change(change)
            elif event.kind == "close":
                docs.pop(params["textDocument"]["uri"], None)
            elif event.kind == "complete":
                if limit is not None and len(records) >= limit:
                    break
                doc = docs.get(params["textDocument"]["uri"])
                if doc is None:
                    continue
                cursor = doc.offset_at(params["position"])
                body = infill_body(doc.text, cursor, layout, count)
                ttft, latency, text, timings, error = await infill(client, url, body)
                cached = int(timings.get("cache_n", 0) or 0)
                evaluated = int(timings.get("prompt_n", 0) or 0)
                records.append(PeerRecord(
                    user=user, trace=Path(trace.path).stem if trace.path else "", index=len(records),
                    ttft_ms=ttft, latency_ms=latency, prompt_tokens=cached + evaluated, cached_tokens=cached,
                    prefilled_tokens=evaluated, server_prompt_ms=float(timings.get("prompt_ms", 0.0) or 0.0),
                    predicted_tokens=int(timings.get("predicted_n", 0) or 0),
                    predicted_ms=float(timings.get("predicted_ms", 0.0) or 0.0), text=text, error=error,
                ))
            # cursor / cancel / show / accept: llama.vim sends nothing for them
    finally:
        if own:
            await client.aclose()
    return records


async def replay_users(url: str, traces: list[Trace], users: int, **kwargs: Any) -> list[PeerRecord]:
    """`users` people, each replaying every trace in turn, at the same time (one server slot
    each where the server has them: llama.cpp picks the server slot by prompt similarity)."""
    async with httpx.AsyncClient(timeout=httpx.Timeout(120.0, connect=5.0)) as client:
        async def one(user: int) -> list[PeerRecord]:
            out: list[PeerRecord] = []
            for trace in traces:
                out += await replay_trace(url, trace, user=user, client=client, **kwargs)
            return out

        results = await asyncio.gather(*(one(u) for u in range(users)))
    return [r for rs in results for r in rs]
