"""`efim bench team`: how many editors one inference server serves with EFIM's request pattern.

Each simulated editor is a person typing into one file: a window of `--window` tokens
(prefix + suffix) laid out as EFIM lays it out, `PRE prefix SUF suffix MID increment`, sent
as token ids (what efim-lsp's remote backend sends), and every key press adds one token to
the increment — so each prompt extends the previous one and the server's prefix cache
(llama.cpp `cache_prompt` with one slot per editor, vLLM automatic prefix caching, SGLang
RadixAttention) only has the new token to compute. Every `--jump-every` keys the person
jumps elsewhere: a new window, prefilled whole. Keys come `--keys-per-s` a second; a key that
arrives while the previous request still streams closes that stream (as the editor's
server does: the next keystroke supersedes) and sends the new one.

Per editor count it prints keystroke TTFT p50/p95/p99 (client-side: request sent → first
streamed token), TTFT after a jump, the share of prompt tokens the server reports as cached,
requests answered and superseded. Token ids are random within the vocabulary (speed does
not depend on the text); the sentinel ids are the model's FIM ids (`--fim-ids`), or plain
ids when the model has none.

Needs only httpx and the standard library, so it also runs on a GPU machine beside the
server being measured:

    python -m bench.team_load --url http://127.0.0.1:8080 --dialect llama.cpp --editors 1,4,16 --seconds 20
    python -m bench.team_load --url http://gpu:8000 --dialect openai --model qwen --editors 8,32,64
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from typing import Any, NamedTuple

from bench.percentiles import percentile


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", required=True, help="the server's base URL")
    parser.add_argument("--dialect", choices=("llama.cpp", "openai"), default="llama.cpp")
    parser.add_argument("--model", default="", help="model name (openai dialect)")
    parser.add_argument("--editors", default="1,4,16", help="comma-separated editor counts, each measured in turn")
    parser.add_argument("--seconds", type=float, default=20.0, help="measured time per editor count")
    parser.add_argument("--window", type=int, default=2048, help="prompt tokens of a window (prefix + suffix)")
    parser.add_argument("--keys-per-s", type=float, default=4.0, help="key presses per second per editor (~50 wpm)")
    parser.add_argument("--jump-every", type=int, default=40, help="keys between jumps (a new window each)")
    parser.add_argument("--n-predict", type=int, default=16, help="tokens generated per request")
    parser.add_argument("--vocab", type=int, default=32000, help="ids are drawn below this")
    parser.add_argument("--fim-ids", default="", help="PRE,SUF,MID token ids (default: three ordinary ids)")
    parser.add_argument("--slots", type=int, default=0, help="llama.cpp slots (default: one per editor)")
    parser.add_argument("--no-pin", action="store_true", help="llama.cpp: no id_slot (the server picks a slot by prompt similarity)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print one JSON line per editor count")


class Sample(NamedTuple):
    ttft_ms: float | None
    jump: bool
    prompt_tokens: int
    cached_tokens: int
    superseded: bool
    error: str | None
    total_ms: float | None = None  # request sent → stream ended (answered requests)


class Editor:
    def __init__(self, index: int, args: argparse.Namespace, rng: random.Random) -> None:
        self.index = index
        self.args = args
        self.rng = rng
        fim = [int(x) for x in args.fim_ids.split(",")] if args.fim_ids else [1, 2, 3]
        self.pre, self.suf, self.mid = fim
        self.samples: list[Sample] = []
        self._new_window()

    def _ids(self, n: int) -> list[int]:
        low = min(1000, self.args.vocab // 4)
        return [self.rng.randrange(low, self.args.vocab - 1) for _ in range(n)]

    def _new_window(self) -> None:
        suffix = self.args.window // 4
        self.prefix = self._ids(self.args.window - suffix)
        self.suffix = self._ids(suffix)
        self.increment: list[int] = []
        self.jumped = True

    def key(self, count: int) -> list[int]:
        if count and count % self.args.jump_every == 0:
            self._new_window()
        else:
            self.increment.append(self._ids(1)[0])
        return [self.pre, *self.prefix, self.suf, *self.suffix, self.mid, *self.increment]

    def body(self, prompt: list[int]) -> tuple[str, dict[str, Any]]:
        a = self.args
        if a.dialect == "llama.cpp":
            slots = a.slots or 0
            body = {"prompt": prompt, "n_predict": a.n_predict, "cache_prompt": True, "stream": True, "temperature": 0.0}
            if not a.no_pin:
                body["id_slot"] = self.index % slots if slots else self.index
            return "/completion", body
        return "/v1/completions", {
            "model": a.model, "prompt": prompt, "max_tokens": a.n_predict, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True},
        }


async def _request(client: Any, url: str, path: str, body: dict[str, Any], jump: bool, dialect: str,
                   seen: dict[str, float] | None = None) -> Sample:
    """One streamed request; `seen["ttft"]` is set at its first token (read when it is superseded)."""
    start = time.perf_counter()
    seen = {} if seen is None else seen
    ttft = None
    cached = prompt_n = 0
    try:
        async with client.stream("POST", url + path, json=body) as resp:
            if resp.status_code != 200:
                text = (await resp.aread()).decode(errors="replace")[:200]
                return Sample(None, jump, len(body["prompt"]), 0, False, f"HTTP {resp.status_code}: {text}")
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if dialect == "llama.cpp":
                    if ttft is None and (event.get("content") or event.get("tokens")):
                        ttft = seen["ttft"] = (time.perf_counter() - start) * 1e3
                    if event.get("stop"):
                        t = event.get("timings") or {}
                        cached, prompt_n = int(t.get("cache_n", 0)), int(t.get("prompt_n", 0))
                else:
                    choices = event.get("choices") or []
                    if ttft is None and choices and choices[0].get("text"):
                        ttft = seen["ttft"] = (time.perf_counter() - start) * 1e3
                    usage = event.get("usage")
                    if usage:
                        details = usage.get("prompt_tokens_details") or {}
                        cached = int(details.get("cached_tokens") or 0)
                        prompt_n = int(usage.get("prompt_tokens", 0)) - cached
    except asyncio.CancelledError:
        raise
    except Exception as exc:  # noqa: BLE001 - a benchmark reports every failure as a sample
        return Sample(ttft, jump, len(body["prompt"]), 0, False, f"{type(exc).__name__}: {exc}")
    return Sample(ttft, jump, cached + prompt_n or len(body["prompt"]), cached, False, None,
                  (time.perf_counter() - start) * 1e3)


async def _run_editor(editor: Editor, client: Any, url: str, stop_at: float) -> None:
    interval = 1.0 / editor.args.keys_per_s
    count = 0
    task: asyncio.Task | None = None
    task_jump = False
    seen: dict[str, float] = {}
    next_key = time.perf_counter() + editor.rng.random() * interval  # editors out of step
    while True:
        now = time.perf_counter()
        if now >= stop_at:
            break
        if next_key > now:
            await asyncio.sleep(next_key - now)
        prompt = editor.key(count)
        count += 1
        next_key += interval
        if task is not None and not task.done():
            task.cancel()  # closes the stream: the server stops this request
            editor.samples.append(Sample(seen.get("ttft"), task_jump, 0, 0, True, None))
        elif task is not None:
            editor.samples.append(task.result())
        path, body = editor.body(prompt)
        task_jump, editor.jumped = editor.jumped, False
        seen = {}
        task = asyncio.ensure_future(_request(client, url, path, body, task_jump, editor.args.dialect, seen))
    if task is not None:
        try:
            editor.samples.append(await asyncio.wait_for(task, timeout=30))
        except asyncio.TimeoutError:
            editor.samples.append(Sample(None, task_jump, 0, 0, True, "timeout"))


async def measure(args: argparse.Namespace, editors: int) -> dict[str, Any]:
    import httpx  # noqa: PLC0415

    rng = random.Random(args.seed * 1000 + editors)
    crowd = [Editor(i, args, random.Random(rng.random())) for i in range(editors)]
    limits = httpx.Limits(max_connections=editors * 2 + 4, max_keepalive_connections=editors * 2 + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(60.0, connect=5.0), limits=limits) as client:
        # Each editor's first window, prefilled before the clock starts (a person had the file open).
        await asyncio.gather(*(_request(client, args.url, *e.body(e.key(0)), True, args.dialect) for e in crowd))
        for e in crowd:
            e.jumped = False
        stop_at = time.perf_counter() + args.seconds
        await asyncio.gather(*(_run_editor(e, client, args.url, stop_at) for e in crowd))
    samples = [s for e in crowd for s in e.samples]
    keys = [s.ttft_ms for s in samples if s.ttft_ms is not None and not s.jump]
    jumps = [s.ttft_ms for s in samples if s.ttft_ms is not None and s.jump]
    answered = [s for s in samples if not s.superseded and s.error is None]
    no_token = sum(1 for s in samples if s.superseded and s.ttft_ms is None)
    prompt = sum(s.prompt_tokens for s in answered if not s.jump)
    cached = sum(s.cached_tokens for s in answered if not s.jump)
    errors = [s.error for s in samples if s.error]
    return {
        "editors": editors, "seconds": args.seconds, "requests": len(samples), "answered": len(answered),
        "superseded": sum(s.superseded for s in samples), "superseded_before_first_token": no_token, "errors": len(errors), "first_error": errors[0] if errors else None,
        "key_ttft_p50": percentile(keys, 50), "key_ttft_p95": percentile(keys, 95), "key_ttft_p99": percentile(keys, 99),
        "key_ttft_mean": statistics.fmean(keys) if keys else float("nan"),
        "jump_ttft_p50": percentile(jumps, 50), "jump_ttft_p95": percentile(jumps, 95), "jumps": len(jumps),
        "cached_share": cached / prompt if prompt else float("nan"),
        "answer_p50": percentile([s.total_ms for s in answered if s.total_ms is not None and not s.jump], 50),
    }


def run_cli(args: argparse.Namespace) -> int:
    counts = [int(x) for x in args.editors.split(",") if x.strip()]
    if not counts or min(counts) < 1:
        raise ValueError("--editors: a comma-separated list of counts >= 1")
    if args.window < 8 or args.keys_per_s <= 0 or args.jump_every < 2:
        raise ValueError("--window >= 8, --keys-per-s > 0 and --jump-every >= 2")
    out = sys.stdout
    if not args.json:
        out.write(f"{args.dialect} at {args.url}: window {args.window} tokens, {args.keys_per_s:g} keys/s per editor, "
                  f"a jump every {args.jump_every} keys, {args.n_predict} tokens per answer, {args.seconds:g} s each\n")
        out.write(f"{'editors':>7} {'requests':>8} {'answered':>8} {'superseded (no token)':>21} {'errors':>6} "
                  f"{'key TTFT p50/p95/p99 ms':>26} {'jump TTFT p50/p95':>18} {'cached':>7} {'answer p50':>10}\n")
    for n in counts:
        r = asyncio.run(measure(args, n))
        if args.json:
            out.write(json.dumps(r) + "\n")
        else:
            out.write(
                f"{n:>7} {r['requests']:>8} {r['answered']:>8} {r['superseded']:>10} ({r['superseded_before_first_token']:>7}) {r['errors']:>6} "
                f"{r['key_ttft_p50']:>8.1f}/{r['key_ttft_p95']:>7.1f}/{r['key_ttft_p99']:>7.1f} "
                f"{r['jump_ttft_p50']:>8.1f}/{r['jump_ttft_p95']:>7.1f} {r['cached_share']:>7.3f} {r['answer_p50']:>10.1f}\n"
            )
            if r["first_error"]:
                out.write(f"        first error: {r['first_error']}\n")
        out.flush()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    return run_cli(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
