"""`efim complete FILE --line L --col C`: one completion at a 0-based position, on the local engine.

For a one-shot in EFIM format the increment is the cursor line's text left of the
cursor (what an edit session would hold after typing that line); the prefix is the
text before that line and the suffix the text after the cursor. Prefix and suffix are
windowed at line boundaries to a token budget. `--json` prints
`{"text", "prompt_tokens", "reused_tokens", "ttft_ms", "total_ms"}`.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("complete", help="one completion at FILE:LINE:COL (0-based) on the local engine")
    p.add_argument("file", type=Path, help="source file")
    p.add_argument("--line", type=int, required=True, help="0-based line of the cursor")
    p.add_argument("--col", type=int, required=True, help="0-based column (characters) of the cursor")
    p.add_argument("--model", default="default", help="'default', a Hugging Face folder or a .gguf file")
    p.add_argument("--format", choices=("efim", "fim", "prefix"), default="efim", help="prompt layout")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--json", action="store_true", help="print a JSON object instead of the text")
    p.add_argument("--dtype", help="bf16 or fp32 (default: bf16 where the CPU has native bf16)")
    p.add_argument("--quant", choices=("none", "int8", "int4", "auto", "mixed"), help="weight format (docs/model.md)")
    p.add_argument(
        "--fim-tokens",
        choices=("auto", "add"),
        default="auto",
        help="'add' gives a model without FIM sentinels the StarCoder ones (untrained: for speed "
        "measurements; completion quality needs a trained adapter)",
    )
    p.add_argument("--adapter", default="auto", help="'auto' (the shipped FIM adapter for --model default, when marked ready), 'none', or a LoRA file/folder merged at load")
    p.add_argument("--kv-budget", help="KV pool budget, e.g. 512M or 2G")
    p.add_argument("--kv-dtype", choices=("auto", "bf16", "fp16", "fp32", "int8"), default="auto", help="KV cache format: auto (the model dtype) or int8 (docs/model.md)")
    p.add_argument("--threads", type=int, help="torch threads")
    p.add_argument("--prefix-tokens", type=int, default=1536, help="token budget of the prefix window")
    p.add_argument("--suffix-tokens", type=int, default=512, help="token budget of the suffix window")
    p.set_defaults(func=run)


def split_at(text: str, line: int, col: int) -> tuple[str, str, str]:
    """(text before the cursor line, cursor line left of the cursor, text after the cursor).
    ValueError for a position outside the text."""
    lines = text.split("\n")
    if not 0 <= line < len(lines):
        raise ValueError(f"line {line} is outside the file (it has {len(lines)} lines, 0-based)")
    if not 0 <= col <= len(lines[line]):
        raise ValueError(f"column {col} is outside line {line} (it has {len(lines[line])} characters, 0-based)")
    before = "".join(s + "\n" for s in lines[:line])
    return before, lines[line][:col], text[len(before) + col :]


def window(text: str, budget: int, count, *, keep_end: bool) -> str:
    """The longest run of whole lines of `text` ending at its end (`keep_end`) or starting
    at its start that fits `budget` tokens (binary search over the line count)."""
    if count(text) <= budget:
        return text
    lines = text.splitlines(keepends=True)
    lo, hi = 0, len(lines)  # lo lines fit
    while lo < hi:
        mid = (lo + hi + 1) // 2
        part = "".join(lines[-mid:] if keep_end else lines[:mid])
        if count(part) <= budget:
            lo = mid
        else:
            hi = mid - 1
    if lo == 0:
        return ""
    return "".join(lines[-lo:] if keep_end else lines[:lo])


def run(args: argparse.Namespace) -> int:
    text = args.file.read_text(encoding="utf-8")  # FileNotFoundError -> clear CLI error
    if args.max_tokens < 0:
        raise ValueError("--max-tokens must be >= 0")
    before, line_left, after = split_at(text, args.line, args.col)

    from engine.api import EngineError, InfillRequest  # noqa: PLC0415 - torch loads here, not at `efim --help`
    from engine.local import load_engine  # noqa: PLC0415

    engine = load_engine(
        args.model,
        dtype=args.dtype,
        quant=args.quant,
        fim_tokens=args.fim_tokens,
        kv_budget=args.kv_budget,
        threads=args.threads,
        adapter=args.adapter,
        kv_dtype=args.kv_dtype,
    )
    try:
        count = engine.count_tokens
        if args.format == "efim":
            prefix, increment = window(before, args.prefix_tokens, count, keep_end=True), line_left
        else:
            prefix, increment = window(before + line_left, args.prefix_tokens, count, keep_end=True), ""
        suffix = window(after, args.suffix_tokens, count, keep_end=False)
        request = InfillRequest(
            key=str(args.file),
            prefix=prefix,
            suffix=suffix,
            increment=increment,
            format=args.format,
            max_tokens=args.max_tokens,
            stop=tuple(args.stop),
        )
        done = engine.submit(request).result()
    finally:
        engine.close()
    if done.finish_reason == "error":
        raise EngineError(f"completion failed: {done.error}")
    s = done.stats
    if args.json:
        out = {
            "text": done.text,
            "prompt_tokens": s.prompt_tokens,
            "reused_tokens": s.reused_tokens,
            "ttft_ms": round(s.ttft_ms, 2),
            "total_ms": round(s.total_ms, 2),
        }
        print(json.dumps(out))
    else:
        sys.stdout.write(done.text + ("" if done.text.endswith("\n") else "\n"))
        print(
            f"[{done.finish_reason}] prompt {s.prompt_tokens} tokens, reused {s.reused_tokens}, "
            f"ttft {s.ttft_ms:.0f} ms, total {s.total_ms:.0f} ms",
            file=sys.stderr,
        )
    return 0
