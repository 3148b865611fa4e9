"""`efim serve`'s real server code with a scripted engine, for replayer tests.

The engine is an oracle: it knows the original files (a JSON list of texts in
$EFIM_ORACLE_TARGETS) and continues the prompt with what the original says comes
next, one character per token, sleeping $EFIM_ORACLE_TOKEN_MS between tokens. So a
replay sees suggestions it *should* accept (testing the accept path deterministically)
and requests slow enough to be cancelled (testing realtime cancellation). The
token counts it reports are made up (one per character) and are only checked for
being passed through, never as measurements.

Run as a script: `python tests/trace/oracle_server.py` speaks LSP on stdio.
$EFIM_ORACLE_CRASH_AFTER=N makes the process die at the (N+1)-th engine request;
$EFIM_ORACLE_RECORD=DIR installs the `--record` observer, as `efim serve --record` does.
$EFIM_ORACLE_DECOY=1 makes a request for alternatives (n > 1) answer a wrong first text and
the true continuation as its alternative, so a replay can tell the first item from the others.
$EFIM_ORACLE_LOG=FILE appends every incoming message (method, params, and a request's id) to
FILE as a JSON line, so a test can see what the replayer sent, methods the server ignores included.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import queue
import sys
import threading
import time
from concurrent.futures import Future

from engine.api import Completion, EngineInfo, EngineStats, InfillRequest, RequestStats, StreamEvent


class OracleHandle:
    _ids = itertools.count(1)

    def __init__(self, engine: "OracleEngine", request: InfillRequest) -> None:
        self.request_id = next(self._ids)
        self._events: queue.Queue = queue.Queue()
        self._cancelled = threading.Event()
        self._done = threading.Event()
        self._final: Completion | None = None
        threading.Thread(target=self._run, args=(engine, request), daemon=True).start()

    def _run(self, engine: "OracleEngine", request: InfillRequest) -> None:
        t0 = time.monotonic()
        truth = engine.continuation(request)
        decoy = engine.decoy and request.n > 1
        text = "zz_decoy()" if decoy else truth
        out, reason, first = "", "length", None
        for ch in text[: request.max_tokens]:
            if self._cancelled.is_set():
                reason = "cancelled"
                break
            time.sleep(engine.token_s)
            if first is None:
                first = time.monotonic()
            if any(stop in ch for stop in request.stop):
                reason = "stop"
                break
            out += ch
            self._events.put(StreamEvent(kind="token", text=ch))
        else:
            reason = "stop" if text else "eos"
        prompt = len(request.prefix) + len(request.suffix) + len(request.increment)
        reused = engine.reuse(request.key, prompt)
        stats = RequestStats(
            prompt_tokens=prompt,
            reused_tokens=reused,
            prefilled_tokens=prompt - reused,
            generated_tokens=len(out),
            ttft_ms=((first or time.monotonic()) - t0) * 1000,
            total_ms=(time.monotonic() - t0) * 1000,
        )
        engine.count(stats, cancelled=reason == "cancelled")
        alternatives = tuple(_cut(truth, request) for _ in range(request.n - 1)) if decoy else ("",) * (request.n - 1)
        self._final = Completion(text=out, finish_reason=reason, stats=stats, alternatives=alternatives,
                                 alternatives_finish=("stop",) * len(alternatives))
        self._events.put(StreamEvent(kind="done", completion=self._final))
        self._done.set()

    def events(self, timeout: float | None = None):
        while True:
            event = self._events.get(timeout=timeout)
            yield event
            if event.kind != "token":
                return

    def result(self, timeout: float | None = None) -> Completion:
        self._done.wait(timeout)
        return self._final

    async def wait(self) -> Completion:
        while not self._done.is_set():
            await asyncio.sleep(0.005)
        return self._final

    def cancel(self) -> None:
        self._cancelled.set()

    @property
    def done(self) -> bool:
        return self._done.is_set()


def _cut(text: str, request: InfillRequest) -> str:
    """`text` as the token stream would end it: at most `max_tokens` characters, before a stop."""
    out = ""
    for ch in text[: request.max_tokens]:
        if any(stop in ch for stop in request.stop):
            break
        out += ch
    return out


class OracleEngine:
    def __init__(self, targets: list[str], token_ms: float) -> None:
        self.targets = targets
        self.token_s = token_ms / 1000.0
        self._last_prompt: dict[str, int] = {}
        self._stats = EngineStats()
        self._lock = threading.Lock()
        self.submitted = 0
        self.decoy = os.environ.get("EFIM_ORACLE_DECOY") == "1"
        crash = os.environ.get("EFIM_ORACLE_CRASH_AFTER")
        self.crash_after = int(crash) if crash else None

    def continuation(self, request: InfillRequest) -> str:
        left = request.prefix + request.increment
        for target in self.targets:
            at = target.rfind(left) if left else -1
            if at >= 0:
                return target[at + len(left) :]
        return ""

    def reuse(self, key: str, prompt: int) -> int:
        with self._lock:
            previous = self._last_prompt.get(key, 0)
            self._last_prompt[key] = prompt
            return min(previous, prompt)

    def count(self, stats: RequestStats, cancelled: bool) -> None:
        with self._lock:
            s = self._stats
            self._stats = EngineStats(
                requests=s.requests + 1,
                completed=s.completed + (not cancelled),
                cancelled=s.cancelled + cancelled,
                prompt_tokens=s.prompt_tokens + stats.prompt_tokens,
                reused_tokens=s.reused_tokens + stats.reused_tokens,
                prefilled_tokens=s.prefilled_tokens + stats.prefilled_tokens,
                generated_tokens=s.generated_tokens + stats.generated_tokens,
            )

    def info(self) -> EngineInfo:
        return EngineInfo(model="oracle", architecture="oracle", template="starcoder", supports_fim=True,
                          fragment_trained=True, context_length=1 << 20, dtype="none")

    def submit(self, request: InfillRequest) -> OracleHandle:
        self.submitted += 1
        if self.crash_after is not None and self.submitted > self.crash_after:
            print(f"oracle: crashing on purpose after {self.crash_after} requests", file=sys.stderr, flush=True)
            os._exit(3)
        return OracleHandle(self, request)

    def stats(self) -> EngineStats:
        return self._stats

    def count_tokens(self, text: str) -> int:
        return len(text)

    def forget_context(self, path: str) -> None:
        pass  # no chunk KV

    def check_integrity(self) -> Future[None]:
        done: Future[None] = Future()
        done.set_result(None)  # no KV to check
        return done

    def wait_idle(self, timeout: float = 30.0) -> None:
        pass  # handles finish on their own timers

    def keep_document_pieces(self, key: str, text: str, cursor: int) -> None:
        pass  # nothing to precompute for an oracle

    def forget_document(self, key: str) -> None:
        pass  # nothing kept

    on_fault = None  # the engine holder sets it; an oracle has no faults to report
    model_in_this_process = True

    def health(self) -> dict:
        return {"state": "running"}

    def close(self) -> None:
        pass


def main() -> int:
    from efim_lsp.server import build_server

    with open(os.environ["EFIM_ORACLE_TARGETS"], encoding="utf-8") as fh:
        targets = json.load(fh)
    token_ms = float(os.environ.get("EFIM_ORACLE_TOKEN_MS", "0"))

    def factory(model: str, *, fim_tokens: str = "auto", adapter: str = "auto", **_engine_options) -> OracleEngine:
        return OracleEngine(targets, token_ms)

    recorder = None
    if os.environ.get("EFIM_ORACLE_RECORD"):
        from efim_lsp.recording import make_recorder

        recorder = make_recorder(os.environ["EFIM_ORACLE_RECORD"])
    observer = recorder
    if os.environ.get("EFIM_ORACLE_LOG"):
        log_file = open(os.environ["EFIM_ORACLE_LOG"], "a", encoding="utf-8")

        def observer(direction: str, message: dict, at: float) -> None:
            if direction == "in" and "method" in message:
                entry = {"method": message["method"], "params": message.get("params"), "at": at}
                if "id" in message:
                    entry["id"] = message["id"]
                log_file.write(json.dumps(entry) + "\n")
                log_file.flush()
            if recorder is not None:
                recorder(direction, message, at)

    server = build_server(factory, message_observer=observer)
    try:
        server.start_io()
    finally:
        server.close()
        if recorder is not None:
            recorder.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
