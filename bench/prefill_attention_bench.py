"""`efim bench prefill-attention`: a prefill step's causal attention, torch's kernel against the
C kernel (kernels/cpu/prefill_attention.py), per layer and inside the embedded model's forward.

Per layer: random bf16 queries, keys and values in the embedded model's shapes (9 query heads
over 3 KV heads of 64), T query rows after `start` cached rows, the two kernels alternated,
median of `--repeat` calls each. Forward (`--forward`): the embedded model as `efim serve`
loads it, a prefill of T rows after `start` with the C kernel and without it, alternated in
rounds, median ms; the ratio is what to read on a shared machine.
"""

from __future__ import annotations

import argparse
import statistics
import time

SHAPES = ((0, 64), (0, 96), (0, 128), (0, 192), (0, 256), (256, 256), (1000, 256), (2000, 256), (100, 32), (1400, 17))
FORWARDS = ((0, 90), (0, 150), (0, 256), (1000, 256))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--repeat", type=int, default=15, help="calls per kernel and shape (median reported)")
    parser.add_argument("--forward", action="store_true", help="also the embedded model's prefill forward with and without it")
    parser.add_argument("--rounds", type=int, default=6, help="--forward: alternated rounds per shape")


def _median_us(fn, repeat: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(times)


def run_cli(args: argparse.Namespace) -> int:
    import torch  # noqa: PLC0415

    from kernels import reference  # noqa: PLC0415
    from kernels.cpu.prefill_attention import PrefillAttention  # noqa: PLC0415

    attend = PrefillAttention.load()
    if attend is None:
        print("no C prefill attention here (no compiler, no AVX512-BF16, or EFIM_C_KERNELS=0): nothing to compare")
        return 1
    h, h_kv, d = 9, 3, 64
    scale = d**-0.5
    print(f"per layer, {h} heads over {h_kv} KV heads of {d}, {torch.get_num_threads()} threads, median of {args.repeat}")
    print(f"{'cached':>7} {'rows':>5} | {'torch µs':>9} {'C µs':>8} {'ratio':>6}")
    g = torch.Generator().manual_seed(0)
    for start, t in SHAPES:
        n = start + t
        q = torch.randn(h, t, d, generator=g).bfloat16()
        k = torch.randn(h_kv, n, d, generator=g).bfloat16()
        v = torch.randn(h_kv, n, d, generator=g).bfloat16()
        ours = _median_us(lambda: attend.attend(q, k, v, scale), args.repeat)
        theirs = _median_us(lambda: reference.attention(q, k, v, None, None, scale), args.repeat)
        print(f"{start:7d} {t:5d} | {theirs:9.0f} {ours:8.0f} {theirs / ours:6.2f}")
    if args.forward:
        _forwards(args.rounds)
    return 0


def _forwards(rounds: int) -> None:
    import torch  # noqa: PLC0415

    from engine.local import load_engine  # noqa: PLC0415

    engine = load_engine("default", kv_budget="1G")
    model = engine.model
    engine.close()  # its thread's OpenMP team goes; this thread computes alone
    kernel = model._prefill_attention
    if kernel is None:
        print("the embedded model runs no C prefill attention here")
        return
    print(f"\nforward of the embedded model ({', '.join(model.c_kernels())}), {rounds} alternated rounds, median ms")
    print(f"{'cached':>7} {'rows':>5} | {'torch':>7} {'C':>7} {'ratio':>6}")
    g = torch.Generator().manual_seed(1)
    for start, t in FORWARDS:
        ids = torch.randint(100, 40_000, (t,), generator=g)
        prefix = torch.randint(100, 40_000, (start,), generator=g)
        times: dict[bool, list[float]] = {True: [], False: []}
        for _ in range(rounds):
            for c in (True, False):
                model._prefill_attention = kernel if c else None
                kv = model.new_kv(start + t + 1)
                with torch.inference_mode():
                    if start:
                        model.forward(prefix, kv, 0, "none")
                    t0 = time.perf_counter()
                    model.forward(ids, kv, start, "last")
                    times[c].append((time.perf_counter() - t0) * 1e3)
        model._prefill_attention = kernel
        ours, theirs = statistics.median(times[True]), statistics.median(times[False])
        print(f"{start:7d} {t:5d} | {theirs:7.1f} {ours:7.1f} {theirs / ours:6.2f}")
