"""Not a test (pytest does not collect it): what the remote engine adds to a server's TTFT.

    .venv/bin/python tests/remote/overhead_probe.py instant   # against the fault server (no model)
    .venv/bin/python tests/remote/overhead_probe.py llama     # against llama-server, embedded GGUF

Alternate requests of one edit session go through `RemoteEngine` and through a bare httpx
client posting the same body (the prompt's ids prepared outside the timing). `instant`:
time to the first streamed text from a server that answers at once (the client-side cost
alone). `llama`: client TTFT minus llama-server's `timings.prompt_ms`, three 36-key
sessions. Prints medians and p90; the numbers are as noisy as the machine is loaded.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fault_server import FaultServer  # noqa: E402
from test_llama_server import TYPED, stdlib_function  # noqa: E402

from engine.api import InfillRequest  # noqa: E402
from engine.remote import RemoteEngine  # noqa: E402


def _pct(values: list[float]) -> str:
    ordered = sorted(values)
    return f"n={len(ordered)} p50 {statistics.median(ordered):.2f} ms, p90 {ordered[int(0.9 * len(ordered))]:.2f} ms"


def _bare(client: httpx.Client, url: str, body: dict) -> tuple[float | None, float | None]:
    """(ms to the first streamed text, the server's prompt_ms) for one bare request, read to
    its end as the engine reads its own (a stream closed early keeps llama.cpp's server slot busy
    until its next write, and the next request in that server slot would wait for it)."""
    started = time.perf_counter()
    first = prompt_ms = None
    with client.stream("POST", url + "/completion", json=body) as resp:
        for line in resp.iter_lines():
            if line.startswith("data: "):
                chunk = json.loads(line[6:])
                if chunk.get("content") and first is None:
                    first = (time.perf_counter() - started) * 1e3
                    prompt_ms = (chunk.get("timings") or {}).get("prompt_ms")
    return first, prompt_ms


def run(url: str, sessions: int, keys: str, *, server_timings: bool, model: str = "default") -> None:
    text, cursor = stdlib_function()
    prefix, suffix = text[:cursor][-4000:], text[cursor:][:1500]
    ours: list[tuple[float, float | None]] = []
    bare: list[tuple[float, float | None]] = []
    with RemoteEngine("llama.cpp", url, model=model) as engine, httpx.Client(timeout=120) as client:
        for s in range(sessions):
            key = f"file:///probe{s}.py"
            for i in range(len(keys) + 1):
                req = InfillRequest(key=key, prefix=prefix, suffix=suffix, increment=keys[:i], format="prefix",
                                    max_tokens=8, stop=("\n",))
                if i % 2 == 0:
                    started = time.perf_counter()
                    handle = engine.submit(req)
                    first = next((time.perf_counter() for ev in handle.events(timeout=120) if ev.kind == "token" and ev.text), None)
                    done = handle.result(120)
                    if i and first is not None:
                        prompt_ms = engine.counters.server_prompt_ms[-1] if engine.counters.server_prompt_ms else None
                        ours.append(((first - started) * 1e3, prompt_ms if done.stats.ttft_ms else None))
                else:
                    body = engine.dialect.body(engine._prompt_ids(req), req, model=None, server_slot=engine._server_slot_for(key),
                                               stop=["\n"], remaining_ms=None)
                    first_ms, prompt_ms = _bare(client, url, body)
                    if first_ms is not None:
                        bare.append((first_ms, prompt_ms))
    for name, rows in (("RemoteEngine", ours), ("bare httpx client", bare)):
        print(f"{name}: first text {_pct([a for a, _ in rows])}")
        if server_timings and all(b is not None for _, b in rows):
            print(f"{name}: first text - server prompt_ms {_pct([a - b for a, b in rows])}")


def main() -> None:
    what = sys.argv[1] if len(sys.argv) > 1 else "instant"
    if what == "instant":
        with FaultServer(pieces=["x", " = 1"]) as server:
            run(server.url, 3, "c" * 50, server_timings=False)  # its prompt_ms is a constant
    else:
        from efim_tools.peers.llama_cpp import LlamaServer
        from engine.model.loader import default_model_path

        with LlamaServer(default_model_path(), slots=2, ctx_per_slot=4096, threads=2) as server:
            run(server.url, 3, TYPED, server_timings=True)


if __name__ == "__main__":
    main()
