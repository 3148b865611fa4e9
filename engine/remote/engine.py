"""`RemoteEngine`: the `engine.api.Engine` protocol over an inference server's HTTP API.

The language server keeps everything it has with the local engine — documents, edit
sessions, windows, suggestion shaping, typing-through, stats — and only the forward
passes move to the server. Prompts are rendered and tokenized here by the local engine's
own code (`engine.text.templates`, `engine.text.tokenize`, `engine.prompting.PromptBuilder`, with the
tokenizer of the `model` setting: `engine.remote.vocabulary`) and sent as token ids, so
the last prompt stays an exact token prefix of the next and the server's prefix cache
(llama.cpp `cache_prompt` + per-server-slot KV, vLLM automatic prefix caching, SGLang's radix
cache) reuses it. Reuse is what the server reports (`engine.remote.dialects.Usage`), never
assumed.

Threads: one asyncio loop on a thread of its own ("efim-remote") runs every HTTP exchange
(httpx, one stream per request), the prompt rendering and tokenization, the server-slot map and
the backend's state (`engine.remote.connection.Link`). `submit`, `cancel` and `close` only
hand work to that loop (`call_soon_threadsafe`); they never block on the network.
`count_tokens` runs on the caller's thread (the segment tokenizer's `count` is
thread-safe). Handles are the local engine's kind (`engine.handle.RequestHandle`): events
are pushed from the loop thread, consumed anywhere.

Per request:
- supersession: a newer request with the same key cancels the older one, which closes its
  stream (llama.cpp and vLLM stop a request whose client went away);
- deadline (`InfillRequest.deadline`): the stream is closed then and the completion is
  what arrived, finish_reason "deadline"; llama.cpp is also sent `t_max_predict_ms`;
- token healing: on llama.cpp the prompt's last token is dropped and the answer's text is
  constrained to start with it (a GBNF grammar, `engine.remote.dialects.grammar`), so the
  server may write it merged with what follows; the stream skips that text. OpenAI-style
  servers have no common way to constrain the text (`logit_bias` would bias every token,
  not only the first): there the prompt keeps its last token (docs/deploy.md);
- `context: "blend"` is sent as plain prefix context (CacheBlend needs the engine's KV);
  `keep_document_pieces`, `forget_document`, `forget_context` do nothing; `check_integrity` has no
  KV to check;
- a background request (a warm-up) prefills the prompt on the server (llama.cpp
  `n_predict: 0`, OpenAI `max_tokens: 1`) so the first keystroke there finds it cached;
- faults never raise into the caller: every handle ends with one terminal event, an
  empty completion with finish_reason "error" carrying a message, and the backend's
  state changes as `connection.Link` describes (one report per outage through `on_fault`).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import ssl
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future
from pathlib import Path

import httpx
import msgspec

from engine.api import (
    MAX_ALTERNATIVES,
    Completion,
    EngineError,
    EngineInfo,
    EngineStats,
    FinishReason,
    InfillRequest,
    RequestStats,
    StreamEvent,
)
from engine.fault_reporting import FaultReporting
from engine.handle import RequestHandle
from engine.prompting import PromptBuilder
from engine.remote.connection import Link, api_key_from_env, parse_endpoint
from engine.remote.dialects import DIALECTS, ServerFacts, SseEvent, Usage
from engine.remote.ledger import Ledger, merge_usage, summary
from engine.remote.stream import GarbageAnswer, HttpStatus, ServerError, describe, error_body, sse_payloads
from engine.remote.vocabulary import load_vocabulary
from engine.text.sampler import StopRules
from engine.text.templates import detect_template
from engine.text.tokenize import SegmentTokenizer

log = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 3.0
# Longest silence inside a stream (a server prefilling a long prompt sends nothing until its
# first token); a request's own deadline (`timeoutMs`) usually ends it much sooner.
READ_TIMEOUT_S = 60.0
DISCOVER_TIMEOUT_S = 10.0


class _Call:
    """One request on the wire (loop thread, except `stop`'s flag)."""

    __slots__ = ("request", "handle", "task", "submitted", "stopped", "background")

    def __init__(self, request: InfillRequest, handle: RequestHandle[_Call]) -> None:
        self.request = request
        self.handle = handle
        self.task: asyncio.Task | None = None
        self.submitted = time.monotonic()
        self.stopped: FinishReason | None = None  # "cancelled" or "deadline" once asked to stop
        self.background = request.background

    def stop(self, reason: FinishReason) -> None:
        if self.stopped is None:
            self.stopped = reason
        if self.task is not None and not self.task.done():
            self.task.cancel()


class _StopOnLoop:
    """A handle's `Canceller`: stops the call on the loop thread (the caller's thread only
    hands it over)."""

    __slots__ = ("_engine",)

    def __init__(self, engine: "RemoteEngine") -> None:
        self._engine = engine

    def cancel(self, call: _Call) -> None:
        self._engine._on_loop(call.stop, "cancelled")


class RemoteEngine(FaultReporting):
    """An engine whose forward passes run on an inference server. See the module docstring."""

    model_in_this_process = False  # the server's (engine.api.Engine)

    def __init__(
        self,
        backend: str,
        endpoint: str,
        *,
        model: str | Path = "default",
        remote_model: str | None = None,
        api_key_env: str | None = None,
        connect_timeout: float = CONNECT_TIMEOUT_S,
        read_timeout: float = READ_TIMEOUT_S,
        verify: bool | ssl.SSLContext = True,
        discover_timeout: float = DISCOVER_TIMEOUT_S,
    ) -> None:
        if backend not in DIALECTS:
            raise EngineError(f"unknown backend {backend!r}; expected one of: local, {', '.join(DIALECTS)}")
        self.endpoint = parse_endpoint(endpoint)
        key = api_key_from_env(api_key_env)
        self.dialect = DIALECTS[backend](self.endpoint.base)
        self.remote_model = remote_model or None
        vocab = load_vocabulary(model)
        self.vocab = vocab
        self.template = detect_template(vocab.tokenizer)
        self.tokenizer = SegmentTokenizer(vocab.tokenizer)
        self.prompts = PromptBuilder(self.template, self.tokenizer, fragment_trained=False)
        self._stop_texts = self._sentinel_texts()
        self._context_length = vocab.context_length
        self.facts = ServerFacts()
        FaultReporting.__init__(self)
        self.link = Link(self._report)
        self.counters = Ledger()
        self._canceller = _StopOnLoop(self)
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._live: dict[tuple[str, bool], _Call] = {}
        self._server_slots: OrderedDict[str, int] = OrderedDict()  # key -> server slot, least recently used first
        self._mismatch: str | None = None  # the server serves another vocabulary: requests would be garbage
        self._closed = False
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        self._client_options = dict(
            headers=headers, verify=verify, trust_env=True,
            timeout=httpx.Timeout(connect=connect_timeout, read=read_timeout, write=10.0, pool=connect_timeout),
        )
        if not self.endpoint.secure and not self.endpoint.loopback:
            self.link.fault("insecure", (
                f"the endpoint {self.endpoint.display} is plain HTTP to another machine: prompts (your code)"
                + (" and the API key" if key else "") + " travel unencrypted; use https://"
            ))
        if not self.template.supports_fim:
            self.link.fault("no-fim", (
                f"the model {vocab.name} has no FIM tokens: suggestions continue the text before the cursor only "
                "(serve a code model with FIM tokens, e.g. Qwen2.5-Coder, and name its GGUF/folder in `model`)"
            ))
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run_loop, name="efim-remote", daemon=True)
        self._thread.start()
        self._client: httpx.AsyncClient = self._call_sync(self._new_client(), 5.0)
        self._prober: asyncio.Task | None = None
        try:  # learn server slots and context now, so `info()` is right; a server down at start is no error
            self._call_sync(self._connect(), discover_timeout)
        except Exception as exc:  # noqa: BLE001 - reported through the link already, or a timeout
            log.debug("first contact with %s: %s", self.endpoint.display, exc)
        self._on_loop(self._ensure_prober)

    # ------------------------------------------------------------ loop thread plumbing
    def _run_loop(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_forever()

    def _on_loop(self, fn, *args) -> None:
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the loop is closed (engine closed)
            pass

    def _call_sync(self, coro, timeout: float):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    async def _new_client(self) -> httpx.AsyncClient:
        return httpx.AsyncClient(**self._client_options)

    # ------------------------------------------------------------ discovery and reconnection
    async def _connect(self) -> None:
        """Ask the server what it is; `link.ok()` on success, classified failure otherwise."""
        try:
            facts = await self.dialect.discover(self._client)
            await self._check_vocabulary()
        except httpx.HTTPStatusError as exc:
            status = exc.response.status_code
            why = f"{exc.request.url.path} answered HTTP {status}"
            if status in (401, 403):
                self.link.error("auth", why, f"the backend {self.endpoint.display} refused the credentials (HTTP {status}); check `apiKeyEnv`")
            self.link.unreachable(why, f"the backend {self.endpoint.display} is not ready ({why}); retrying")
            raise
        except (httpx.TransportError, GarbageAnswer, ServerError) as exc:
            why = describe(exc)
            self.link.unreachable(why, f"cannot reach the backend {self.endpoint.display} ({why}); retrying in the background")
            raise
        self.facts = facts
        if facts.context_length:
            self._context_length = min(self.vocab.context_length, facts.context_length)
        if self.remote_model is None and facts.model and self.dialect.name == "openai":
            self.remote_model = facts.model
        if self._mismatch:
            return  # reachable, but serving another model: the state stays "error" (requests are refused)
        self.link.ok()
        log.info("backend %s (%s): %s, %d server slot(s), context %d", self.endpoint.display, self.dialect.name,
                 facts.model, facts.server_slots, self._context_length)

    async def _check_vocabulary(self) -> None:
        """The server must tokenize our sentinels (and plain code) to the ids we send;
        otherwise it serves another model than `model` names and every prompt is garbage."""
        probes = []
        t = self.template
        for tid in (t.prefix_id, t.suffix_id, t.middle_id):
            if tid is not None:
                probes.append((self.vocab.tokenizer.id_to_token(tid), [tid]))
        sample = "def add(a, b):\n    return a + b\n"
        probes.append((sample, list(self.tokenizer.encode_uncached(sample))))
        for text, ours in probes:
            theirs = await self.dialect.token_ids(self._client, text)
            if theirs is None:
                return  # the server cannot tell us: trust the settings
            if theirs != ours:
                self._mismatch = (
                    f"the backend's model tokenizes {text!r} as {theirs[:8]} where {self.vocab.name} gives {ours[:8]}: "
                    f"it serves another model; set `model` to the GGUF/folder the server serves"
                )
                self.link.error("model", self._mismatch, self._mismatch)
                return
        self._mismatch = None

    def _ensure_prober(self) -> None:
        if self._closed or (self._prober is not None and not self._prober.done()):
            return
        self._prober = self._loop.create_task(self._probe_while_unreachable())

    async def _probe_while_unreachable(self) -> None:
        """While the backend is unreachable: probe with backoff until it answers."""
        while not self._closed and self.link.state in ("unreachable", "connecting"):
            await asyncio.sleep(max(0.0, self.link.next_probe_at - time.monotonic()))
            try:
                await self._connect()
            except Exception as exc:  # noqa: BLE001 - classified in _connect
                wait = self.link.failed_probe(describe(exc))
                log.debug("backend probe failed (%s); next in %.1f s", describe(exc), wait)

    # ------------------------------------------------------------ Engine protocol
    def info(self) -> EngineInfo:
        return EngineInfo(
            model=f"{self.vocab.name} @ {self.endpoint.display}",
            architecture=f"{self.dialect.name}:{self.vocab.architecture}",
            template=self.template.name,
            supports_fim=self.template.supports_fim,
            fragment_trained=False,
            context_length=self._context_length,
            dtype="remote",
            suffix_first=self.template.suffix_first,
            pins_slots=self.dialect.server_slot_pinning,
        )

    def submit(self, request: InfillRequest) -> RequestHandle[_Call]:
        if not isinstance(request, InfillRequest):
            raise TypeError(f"submit() takes an InfillRequest, not {type(request).__name__}")
        if not 1 <= request.n <= MAX_ALTERNATIVES:
            raise ValueError(f"n must be in 1..{MAX_ALTERNATIVES}; got {request.n}")
        if not (request.temperature >= 0 and 0 < request.top_p <= 1):
            raise ValueError(f"temperature must be >= 0 and top_p in (0, 1]; got {request.temperature}, {request.top_p}")
        if request.probe:
            raise ValueError("a remote backend takes no probe (next-edit checks need the local engine's adapter)")
        handle: RequestHandle[_Call] = RequestHandle(next(self._ids), self._canceller)
        call = _Call(request, handle)
        handle.work = call
        with self._lock:
            if self._closed:
                raise EngineError("engine is closed")
            old = [self._live.get((request.key, True))]
            if not request.background:
                old.append(self._live.get((request.key, False)))
            self._live[(request.key, request.background)] = call
        for previous in old:
            if previous is not None:
                self._on_loop(previous.stop, "cancelled")
        self._on_loop(self._start, call)
        return handle

    def _start(self, call: _Call) -> None:
        if call.stopped is not None:
            self._finish(call, "", call.stopped, RequestStats())
            return
        call.task = self._loop.create_task(self._serve(call))
        # A task cancelled before its first step never runs `_serve`'s body (and its except
        # clauses): the handle is ended here then, so it cannot hang.
        call.task.add_done_callback(lambda _task: self._end_unfinished(call))
        deadline = call.request.deadline
        if deadline is not None:
            self._loop.call_later(max(0.0, deadline - time.monotonic()), call.stop, "deadline")

    def _end_unfinished(self, call: _Call) -> None:
        if not call.handle.done:
            self._finish(call, "", call.stopped or "cancelled", RequestStats())

    def stats(self) -> EngineStats:
        return EngineStats.from_counters(self.counters)

    def count_tokens(self, text: str) -> int:
        return self.tokenizer.count(text)

    def forget_context(self, path: str) -> None:
        """Nothing: the server's prefix cache drops a changed chunk's KV by itself (its tokens differ)."""

    def computing(self) -> bool:
        """False: the model computes in the inference server's process."""
        return False

    def keep_document_pieces(self, key: str, text: str, cursor: int) -> None:
        """Nothing: document pieces assembled by CacheBlend need the engine's own KV."""

    def forget_document(self, key: str) -> None:
        """Nothing: no document pieces are kept (`keep_document_pieces`)."""

    def check_integrity(self) -> Future[None]:
        fut: Future[None] = Future()
        if self._closed:
            fut.set_exception(RuntimeError("engine is closed"))
        else:
            fut.set_result(None)  # no KV is held here: the server owns it
        return fut

    def wait_idle(self, timeout: float = 30.0) -> None:
        end = time.monotonic() + timeout
        while True:
            with self._lock:
                busy = any(not c.handle.done for c in self._live.values())
            if not busy:
                return
            if time.monotonic() > end:
                raise TimeoutError("remote requests still running")
            time.sleep(0.005)

    def health(self) -> dict:
        """The backend's state for `efim/stats` "engine" (any thread; no network)."""
        c = self.counters
        out = {
            **self.link.snapshot(),
            "backend": self.dialect.name,
            "endpoint": self.endpoint.display,
            "remoteModel": self.remote_model or self.facts.model,
            "slots": self.facts.server_slots if self.dialect.server_slot_pinning else None,  # the stats key keeps its name
            "contextLength": self._context_length,
            "modelMismatch": self._mismatch,
            # Reuse is what the server reported: requests whose answer carried cached-token counts.
            "reuseReported": c.reuse_reported,
            "resent": c.resent,  # requests sent again after a kept-alive connection closed unanswered
            "clientTtftMs": summary(c.client_ttft),
            "serverPromptMs": summary(c.server_prompt_ms),
            "remoteOverheadMs": summary(c.overhead_ms),
        }
        return out

    def close(self, timeout: float = 5.0) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            calls = list(self._live.values())
        self.link.close()
        for call in calls:
            self._on_loop(call.stop, "cancelled")

        async def shutdown() -> None:
            tasks = [c.task for c in calls if c.task is not None]
            if self._prober is not None:
                self._prober.cancel()
            if tasks:
                await asyncio.wait(tasks, timeout=timeout)
            await self._client.aclose()

        try:
            self._call_sync(shutdown(), timeout + 1)
        except Exception as exc:  # noqa: BLE001 - closing must not fail
            log.debug("closing the remote engine: %s", exc)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout)
        if not self._thread.is_alive():
            self._loop.close()

    def __enter__(self) -> "RemoteEngine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------ one request
    def _prompt_ids(self, req: InfillRequest) -> list[int]:
        return self._prompt(req)[0]

    def _prompt(self, req: InfillRequest) -> tuple[list[int], str, int]:
        """The prompt as the local engine renders it (no CacheBlend), fitted to the server's
        context, the text token healing removed from its end ("" when none) and how many
        tokens that was. Healing only where the server can constrain the answer's text
        (llama.cpp's grammar), and not when a stop string lies in the healed text (the
        server would stop on it)."""
        heal = self.dialect.heals and (req.heal if req.heal is not None else not self.prompts.fragment_trained)
        req = msgspec.structs.replace(
            req, heal=heal, document_kv=False, context="prefix" if req.context == "blend" else req.context,
        )
        built = self.prompts.build(req, self._context_length)
        if built.healed:
            try:
                healed = built.healed.decode("utf-8")
            except UnicodeDecodeError:  # a token that starts inside a character: not as text
                healed = None
            if healed is not None and not any(s and s in healed for s in (*req.stop, *self._stop_texts)):
                return built.prompt.ids, healed, built.prompt.healed_tokens
            built = self.prompts.build(msgspec.structs.replace(req, heal=False), self._context_length)
        return built.prompt.ids, "", 0

    def _server_slot_for(self, key: str) -> int | None:
        """The document's server slot: stable while it stays among the `server_slots` most
        recently used documents."""
        if not self.dialect.server_slot_pinning:
            return None
        n = max(1, self.facts.server_slots)
        if key in self._server_slots:
            self._server_slots.move_to_end(key)
            return self._server_slots[key]
        taken = set(self._server_slots.values())
        free = [s for s in range(n) if s not in taken]
        if free:
            server_slot = free[0]
        else:  # the least recently used document gives its server slot up
            _, server_slot = self._server_slots.popitem(last=False)
        self._server_slots[key] = server_slot
        return server_slot

    async def _serve(self, call: _Call) -> None:
        req = call.request
        rules = StopRules(end_ids=(), stop=tuple(req.stop) + self._stop_texts, max_tokens=1 << 30)
        extra: dict[int, str] = {}
        extra_finish: dict[int, FinishReason] = {}
        usage = Usage()
        first: float | None = None
        generated = 0
        finish: FinishReason | None = None
        own_stop = False  # fork 0 matched a stop string here (the server may not have yet)
        error: str | None = None
        ids: list[int] = []
        healed, healed_tokens = "", 0
        try:
            if not self.link.usable:
                raise _Refused(f"the backend {self.endpoint.display} is unreachable ({self.link.last_error}); reconnecting")
            if self._mismatch:
                raise _Refused(self._mismatch)
            ids, healed, healed_tokens = self._prompt(req)
            remaining = None if req.deadline is None else int((req.deadline - time.monotonic()) * 1000)
            body = self.dialect.body(
                ids, req, model=self.remote_model, server_slot=self._server_slot_for(req.key),
                stop=list(dict.fromkeys(req.stop + self._stop_texts)), remaining_ms=remaining, healed=healed,
            )
            skip = len(healed)  # the answer starts with the healed text, which the user has typed
            resp = await self._open_stream(body)
            try:
                if resp.status_code >= 400:
                    raise HttpStatus(resp.status_code, await error_body(resp))
                async for payload in sse_payloads(resp.aiter_lines()):
                    event: SseEvent = self.dialect.parse(payload)
                    if event.usage is not None:
                        usage = merge_usage(usage, event.usage)
                    for index, text in event.texts.items():
                        if index:
                            extra[index] = extra.get(index, "") + text
                            continue
                        if finish is not None:
                            continue  # fork 0 ended on our stop string; the others may still stream
                        if first is None:
                            first = time.monotonic()
                        generated += 1
                        if skip:
                            text, skip = text[skip:], max(0, skip - len(text))
                            if not text:
                                continue
                        check = rules.on_token(-1, text)
                        if check.emit:
                            call.handle.push(StreamEvent(kind="token", text=check.emit))
                        if check.finish is not None:
                            finish, own_stop = "stop", True
                    for index, why in event.finished.items():
                        if index:
                            extra_finish[index] = why
                        elif finish is None:
                            finish = why
                    if own_stop and req.n <= 1:
                        break  # our own stop string matched before the server's: close the stream now
                # Otherwise read to the end: usage may come after the last text (OpenAI's final event).
                if finish is None:
                    raise GarbageAnswer("the stream ended without its final event")
            finally:
                await resp.aclose()
            self.link.ok()
        except asyncio.CancelledError:
            finish = call.stopped or "cancelled"
        except _Refused as exc:
            finish, error = "error", str(exc)
        except HttpStatus as exc:
            finish, error = "error", f"the backend answered HTTP {exc.status}: {exc.message}"
            kind = "auth" if exc.status in (401, 403) else "http"
            hint = " (check `apiKeyEnv`)" if kind == "auth" else ""
            self.link.error(kind, f"HTTP {exc.status}: {exc.message}", f"{error}{hint}")
        except (GarbageAnswer, ServerError) as exc:
            finish = "error"
            error = f"the backend's answer is not a {self.dialect.name} completion: {exc}" if isinstance(exc, GarbageAnswer) \
                else f"the backend reported an error: {exc}"
            self.link.error("garbage" if isinstance(exc, GarbageAnswer) else "server", str(exc), error)
        except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
            finish, error = "error", f"cannot reach the backend {self.endpoint.display}: {describe(exc)}"
            self.link.unreachable(describe(exc), f"{error}; reconnecting in the background")
            self._ensure_prober()
        except httpx.ReadTimeout as exc:
            finish, error = "error", f"the backend {self.endpoint.display} sent nothing for {self._client.timeout.read:.0f} s"
            self.link.error("timeout", describe(exc), error)
        except (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError) as exc:
            finish = "error"
            error = f"the backend {self.endpoint.display} dropped the connection{' mid-stream' if first else ''}: {describe(exc)}"
            self.link.unreachable(describe(exc), f"{error}; reconnecting in the background")
            self._ensure_prober()
        except httpx.HTTPError as exc:
            finish, error = "error", f"request to the backend failed: {describe(exc)}"
            self.link.error("http", describe(exc), error)
        except Exception as exc:  # a bug here must not leave the handle hanging
            log.exception("remote request %d failed", call.handle.request_id)
            finish, error = "error", f"{type(exc).__name__}: {exc}"
        if call.stopped == "deadline" and finish == "cancelled":
            finish = "deadline"
        if finish not in ("stop", "error"):
            held = rules.finish_text()  # text held back in case it started a stop string: it did not
            if held:
                call.handle.push(StreamEvent(kind="token", text=held))
        text = rules.text
        stats = self.counters.request_stats(call.submitted, call.background, usage, first, generated)
        if healed:
            stats = msgspec.structs.replace(stats, healed_tokens=healed_tokens)
        alternatives = tuple(extra.get(i, "") for i in range(1, req.n)) if req.n > 1 and finish != "error" else ()
        alt_finish = tuple(extra_finish.get(i, finish or "stop") for i in range(1, req.n)) if alternatives else ()
        self._finish(call, text if finish != "error" else "", finish or "error", stats, error, alternatives, alt_finish)

    async def _open_stream(self, body: dict) -> httpx.Response:
        """POST a completion; the response once its headers are in (the caller closes it).

        A kept-alive connection that the server or a proxy closed while it sat idle in the
        pool fails before any byte of an answer arrives ("Server disconnected without sending
        a response", a reset): that request never reached the model, so it goes once more on
        a new connection instead of being reported as an outage. A second failure is real."""
        request = self._client.build_request("POST", self.dialect.completion_url(), json=body)  # body encoded once
        try:
            return await self._client.send(request, stream=True)
        except (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError) as exc:
            log.info("the backend closed a connection before answering (%s); sending again on a new one", describe(exc))
            self.counters.resent += 1
            return await self._client.send(request, stream=True)

    def _finish(self, call: _Call, text: str, reason: FinishReason, stats: RequestStats, error: str | None = None,
                alternatives: tuple[str, ...] = (), alternatives_finish: tuple[FinishReason, ...] = ()) -> None:
        req = call.request
        with self._lock:
            live_key = (req.key, req.background)
            if self._live.get(live_key) is call:
                del self._live[live_key]
        self.counters.finished(call.background, reason, stats)
        completion = Completion(text=text, finish_reason=reason, stats=stats, error=error,
                                alternatives=alternatives, alternatives_finish=alternatives_finish)
        kind = "error" if reason == "error" else "done"
        call.handle.complete(StreamEvent(kind=kind, completion=completion, error=error))

    def _sentinel_texts(self) -> tuple[str, ...]:
        """The template's end tokens as text: sent as stop strings (a server that prints
        special tokens stops there too) and cut from what streams back."""
        tok = self.vocab.tokenizer
        texts = []
        for tid in sorted(self.template.stop_ids):
            piece = tok.id_to_token(tid)
            if piece and piece.startswith("<") and piece.endswith(">"):
                texts.append(piece)
        return tuple(texts)


class _Refused(Exception):
    """Not sent: the backend is known to be unreachable or to serve another vocabulary."""


def open_remote_engine(backend: str, endpoint: str, **options) -> RemoteEngine:
    """`RemoteEngine(backend, endpoint, **options)`: what `efim serve`'s engine factory calls."""
    return RemoteEngine(backend, endpoint, **options)


__all__ = ["RemoteEngine", "open_remote_engine", "CONNECT_TIMEOUT_S", "READ_TIMEOUT_S"]
