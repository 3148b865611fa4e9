"""Model-only speed on the default model: decode ms/token (bf16, int8) and prefill
tokens/s at ~1K tokens, against transformers' bf16 model, interleaved in one run.

    .venv/bin/python bench/model_speed.py [--rounds 3] [--steps 32] [--chunks 256,512,1024] [--json]

The input is real code (CPython stdlib). The decode floor is the decode step's weight
bytes over a read bandwidth measured in the same run.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import sysconfig
from pathlib import Path

# Before torch loads: spinning OpenMP waits stall badly on a shared 2-core machine
# (set OMP_WAIT_POLICY=ACTIVE in the environment to measure the spinning policy).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=32, help="decode steps per sample")
    ap.add_argument("--prefill-tokens", type=int, default=1024)
    ap.add_argument("--chunks", default="256,1024", help="prefill step sizes to try")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--no-transformers", action="store_true")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)

    import torch
    from tokenizers import Tokenizer

    from bench import speed_probes as speed
    from engine.model import load_model

    if args.threads:
        torch.set_num_threads(args.threads)
    bf16 = load_model(args.model, dtype="bf16")
    int8 = load_model(args.model, dtype="bf16", quant="int8")
    tok: Tokenizer = bf16.tokenizer
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    text = "".join((stdlib / name).read_text() for name in ("textwrap.py", "shlex.py", "heapq.py"))
    ids = torch.tensor(tok.encode(text).ids)
    prefill_ids = ids[: args.prefill_tokens]
    prompt = ids[:128]
    chunks = [int(c) for c in args.chunks.split(",") if c]

    probes = {
        "decode_ms.engine_bf16": lambda: speed.engine_decode_ms(bf16.model, prompt, args.steps),
        "decode_ms.engine_int8": lambda: speed.engine_decode_ms(int8.model, prompt, args.steps),
    }
    for c in chunks:
        probes[f"prefill_tok_s.engine_bf16_chunk{c}"] = (
            lambda c=c: speed.engine_prefill_tok_s(bf16.model, prefill_ids, c)
        )
    probes[f"prefill_tok_s.engine_int8_chunk{chunks[0]}"] = lambda: speed.engine_prefill_tok_s(
        int8.model, prefill_ids, chunks[0]
    )
    if not args.no_transformers:
        import transformers

        hf = transformers.AutoModelForCausalLM.from_pretrained(bf16.path, dtype=torch.bfloat16).eval()
        probes["decode_ms.transformers_bf16"] = lambda: speed.hf_decode_ms(hf, prompt, args.steps)
        probes["prefill_tok_s.transformers_bf16"] = lambda: speed.hf_prefill_tok_s(hf, prefill_ids)

    bandwidth = speed.memory_bandwidth_gbs()
    timings = speed.interleaved(probes, args.rounds)
    result = {name: round(t.median, 2) for name, t in timings.items()}
    result["memory_bandwidth_gbs"] = round(bandwidth, 1)
    result["decode_floor_ms.bf16"] = round(bf16.model.weight_bytes() / bandwidth / 1e6, 2)
    result["decode_floor_ms.int8"] = round(int8.model.weight_bytes() / bandwidth / 1e6, 2)
    result["threads"] = torch.get_num_threads()
    result["omp_wait_policy"] = os.environ.get("OMP_WAIT_POLICY")
    result["prefill_tokens"] = int(prefill_ids.shape[0])
    if "decode_ms.transformers_bf16" in result:
        hf_dec, hf_pre = result["decode_ms.transformers_bf16"], result["prefill_tok_s.transformers_bf16"]
        result["ratio.decode_speedup_bf16_vs_transformers"] = round(hf_dec / result["decode_ms.engine_bf16"], 2)
        result["ratio.decode_speedup_int8_vs_transformers"] = round(hf_dec / result["decode_ms.engine_int8"], 2)
        best = max(v for k, v in result.items() if k.startswith("prefill_tok_s.engine_bf16"))
        result["ratio.prefill_speedup_bf16_best_chunk_vs_transformers"] = round(best / hf_pre, 2)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        width = max(map(len, result))
        for name, value in result.items():
            print(f"{name:<{width}}  {value}")
        for name, t in timings.items():
            print(f"  samples {name}: {', '.join(f'{s:.1f}' for s in t.samples)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
