"""Turns across owners on one engine: a typing window's answers alone and during another
window's burst of jumps, the same requests both times (no server, no daemon).

    .venv/bin/efim bench turns [--model default] [--keys 150] [--rounds 3] [--rate 20] [--json OUT]

Owner A types the body of `heapq._siftup` back: a request per key at the cursor (the
increment growing, the window fixed, each answer awaited), as an editor window's keystrokes
reach the engine. Owner B jumps RATE times a second to a random place of `textwrap.py`: a
first-window request and a full-window warm-up, each pair cancelling the last (a burst never
waits for its answers). Each round types the keys alone, then again (another document key,
the same prompts) while B bursts; the engine is the same, so both phases type from the same
cached window and get the same answers (greedy): the difference is the engine's turn-taking
(`engine.scheduling.fairness`, `turn_taking`) and what the burst's CPU work takes from it.

`efim bench daemon --fair` measures the same through `efim serve` fronts and the daemon, where
the answers of the two phases may differ (what the server answered ahead, which window) and
most keystrokes never reach the engine; this one isolates the engine. Reports A's latency
(submit to last token) p50/p95/p99 alone and during the burst, pooled over the rounds, their
ratios, each round's p99 ratio, B's request rate, and each owner's engine seconds.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import sysconfig
import threading
import time
from pathlib import Path

from bench.lsp_typing import blank_function
from bench.percentiles import percentile, percentiles

MODULE, FUNCTION = "heapq.py", "_siftup"
OTHER = "textwrap.py"


def typed_function(module: str, function: str) -> tuple[str, str, str]:
    """(the stdlib `module`'s text before `function`'s body, the body from its first line's
    indent, the text after it): `bench.lsp_typing.blank_function`'s cut, the indent typed too."""
    text, cursor, body = blank_function(module, function)
    start = text.rindex("\n", 0, cursor) + 1  # the body's first line: only its indent is left in `text`
    return text[:start], text[start:cursor] + body, text[cursor:]


def run(args: argparse.Namespace) -> dict:
    from engine.api import InfillRequest  # noqa: PLC0415 - torch loads slowly
    from engine.local import load_engine  # noqa: PLC0415

    before, body, after = typed_function(MODULE, FUNCTION)
    other = (Path(sysconfig.get_paths()["stdlib"]) / OTHER).read_text()
    body = body[: args.keys]
    options = {"dtype": args.dtype} if args.dtype else {}
    engine = load_engine(args.model, adapter=args.adapter, kv_budget=args.kv_budget, **options)

    def typing(key: str) -> list[float]:
        latencies = []
        for i in range(len(body)):
            request = InfillRequest(key=key, prefix=before[-args.prefix_chars:], suffix=after[: args.suffix_chars],
                                    increment=body[: i + 1], max_tokens=args.max_tokens, stop=("\n\n",), owner="A")
            started = time.perf_counter()
            engine.submit(request).result(60)
            latencies.append((time.perf_counter() - started) * 1e3)
        return latencies

    def burst(stop: threading.Event, rng: random.Random, sent: list[int]) -> None:
        handles = []
        while not stop.is_set():
            for handle in handles:
                handle.cancel()
            at = rng.randrange(len(other) // 4, len(other) - 200)
            handles = [
                engine.submit(InfillRequest(key="jumps", prefix=other[max(0, at - args.prefix_chars // 3):at],
                                            suffix=other[at:at + 200], max_tokens=args.max_tokens, owner="B")),
                engine.submit(InfillRequest(key="jumps", prefix=other[max(0, at - args.prefix_chars):at],
                                            suffix=other[at:at + args.suffix_chars], max_tokens=0, background=True, owner="B")),
            ]
            sent[0] += 1
            time.sleep(1.0 / args.rate)
        for handle in handles:
            handle.cancel()

    try:
        typing("warm")  # the window's KV cached: every phase starts from it
        solo_all: list[float] = []
        busy_all: list[float] = []
        rounds = []
        for r in range(args.rounds):
            time.sleep(args.pause)
            solo = typing(f"solo{r}")
            time.sleep(args.pause)
            stop, sent = threading.Event(), [0]
            burster = threading.Thread(target=burst, args=(stop, random.Random(r), sent), daemon=True)
            started = time.monotonic()
            burster.start()
            time.sleep(0.5)  # the burst under way
            busy = typing(f"busy{r}")
            stop.set()
            burster.join()
            rate = sent[0] / (time.monotonic() - started)
            rounds.append({"p99_ratio": round(percentile(busy, 99) / percentile(solo, 99), 2), "burst_per_s": round(rate, 1)})
            print(json.dumps({"round": r, **rounds[-1]}), file=sys.stderr, flush=True)
            solo_all += solo
            busy_all += busy
        spent = engine.scheduler.turns.spent_by_owner()
    finally:
        engine.close()
    solo_ms, busy_ms = percentiles(solo_all), percentiles(busy_all)
    return {
        "model": args.model, "keys": len(body), "rounds": args.rounds, "requests_per_phase": len(solo_all),
        "solo_ms": solo_ms, "with_burst_ms": busy_ms,
        "ratios": {q: round(busy_ms[q] / solo_ms[q], 2) for q in (50, 95, 99)},
        "round_p99_ratios": [r["p99_ratio"] for r in rounds], "burst_per_s": [r["burst_per_s"] for r in rounds],
        "engine_s": {owner: round(s, 2) for owner, s in sorted(spent.items())},
    }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="default")
    parser.add_argument("--adapter", default="auto")
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--kv-budget", default=None)
    parser.add_argument("--keys", type=int, default=150, help="keys of the body typed per phase (a request each)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of (alone, during the burst), pooled")
    parser.add_argument("--rate", type=float, default=20.0, help="owner B's jumps per second")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--prefix-chars", type=int, default=2500)
    parser.add_argument("--suffix-chars", type=int, default=600)
    parser.add_argument("--pause", type=float, default=2.5, help="seconds of idle engine before each phase")
    parser.add_argument("--json", type=Path, help="also write the results here")


def run_cli(args: argparse.Namespace) -> int:
    results = run(args)
    print(json.dumps(results), flush=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    return run_cli(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
