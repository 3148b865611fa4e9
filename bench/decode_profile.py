"""Where a decode step, a keystroke and a prefill step spend their time: the top of
torch.profiler's table for each, on the embedded model, at a ~2K-token window, plus the
per-step dispatch floor (the same forward on a model of the same depth with tiny layers,
where no op has work to do: what remains is Python, torch dispatch and kernel launch).

    .venv/bin/python bench/decode_profile.py [--context 2000] [--steps 20] [--top 12] [--threads N]

Profiler overhead inflates the small ops a little; read the shares, and take ms/step from
the untimed-profiler lines. Benchmark code, outside the serving path.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def _mean_ms(fn, n: int) -> float:
    fn()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t) / n * 1e3


def profile_top(fn, n: int, top: int) -> str:
    from torch.profiler import ProfilerActivity, profile  # noqa: PLC0415

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(n):
            fn()
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=top, max_name_column_width=52)


def cases(model, context: int):
    """(name, fn, steps-per-call) for decode, a 3-token keystroke and a 512-token prefill step."""
    import torch  # noqa: PLC0415

    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.vocab_size, (context + 520,), generator=gen)  # [context + 520]
    kv = model.new_kv(context + 520)
    with torch.inference_mode():
        for s in range(0, context, 512):
            model.forward(ids[s : min(s + 512, context)], kv, s, "none")

    def decode():
        with torch.inference_mode():
            model.forward(ids[context : context + 1], kv, context, "all").argmax()

    def keystroke():
        with torch.inference_mode():
            model.forward(ids[context : context + 3], kv, context, "last").argmax()

    def prefill():
        with torch.inference_mode():
            model.forward(ids[context : context + 512], kv, context, "last")

    return [("decode (1 token after %d)" % context, decode), ("keystroke (3 tokens after %d)" % context, keystroke),
            ("prefill step (512 tokens after %d)" % context, prefill)]


def dispatch_floor_ms(model, steps: int) -> float:
    """Decode ms/step of a random model with the same layer count and head counts but 8
    dimensions per head (Qwen2 layout, `bench.model_shapes.random_model`): no op has work
    to do, so what it measures is Python, torch dispatch and each kernel's fixed cost."""
    import torch  # noqa: PLC0415
    import transformers  # noqa: PLC0415

    from bench.model_shapes import random_model  # noqa: PLC0415

    c = model.config
    config = transformers.Qwen2Config(
        hidden_size=8 * c.n_heads, intermediate_size=16 * c.n_heads, num_hidden_layers=c.n_layers,
        num_attention_heads=c.n_heads, num_key_value_heads=c.n_kv_heads, vocab_size=512,
        tie_word_embeddings=True, max_position_embeddings=4096,
    ).to_dict()
    tiny = random_model(config, None, "bf16" if model.dtype == torch.bfloat16 else "fp32")
    kv = tiny.new_kv(256)
    ids = torch.arange(129)
    with torch.inference_mode():
        tiny.forward(ids[:128], kv, 0, "none")
        return _mean_ms(lambda: tiny.forward(ids[128:129], kv, 128, "all"), steps)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default")
    ap.add_argument("--quant", default=None, help="int8 | int4 (default: dense)")
    ap.add_argument("--context", type=int, default=2000)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("--threads", type=int, default=0)
    args = ap.parse_args(argv)

    import torch  # noqa: PLC0415

    from engine.model import load_model  # noqa: PLC0415

    if args.threads:
        torch.set_num_threads(args.threads)
    model = load_model(args.model, dtype="bf16", quant=args.quant).model
    print(f"threads {torch.get_num_threads()}, OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY')}")
    for name, fn in cases(model, args.context):
        n = max(2, args.steps // (8 if "prefill" in name else 1))
        ms = _mean_ms(fn, n)
        print(f"\n== {name}: {ms:.2f} ms/call (no profiler)")
        print(profile_top(fn, n, args.top))
    print(f"\ndispatch floor (same depth, tiny layers): {dispatch_floor_ms(model, 4 * args.steps):.2f} ms/decode step")
    return 0


if __name__ == "__main__":
    sys.exit(main())
