"""`efim bench kernels`: each kernel against its reference on the device present.

For every op it times the pure-torch reference and, on a CUDA device, the Triton kernel
on the same inputs (median of several runs after a warm-up), and prints the achieved
memory bandwidth (bytes the op must move / time) or, for prefill attention, FLOP/s
(4 · D flops per visible query-key pair per head), plus Triton's speed-up.

On a CPU only the references are timed. Triton's interpreter can run the kernels on a
CPU (that is how they are verified), but it executes them in Python/numpy: its timings
say nothing about GPU performance and are never printed as such.

Shapes default to SmolLM2-135M's attention (9 query heads, 3 KV heads, head dim 64,
hidden 576) at a 2k-token context; `--heads/--kv-heads/--head-dim/--context` change them.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any, Callable, NamedTuple


class Case(NamedTuple):
    op: str
    shape: str
    work: float  # bytes (metric "GB/s") or flops (metric "TFLOP/s")
    metric: str
    args: Callable[[], tuple]  # fresh arguments (in-place ops get their own copies)


class KernelTiming(NamedTuple):
    op: str
    shape: str
    impl: str
    ms: float
    rate: float  # in the case's metric
    metric: str


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto", help="auto: cuda if available")
    parser.add_argument("--dtype", choices=("fp32", "bf16", "fp16"), default=None, help="default: bf16 on cuda, fp32 on cpu")
    parser.add_argument("--heads", type=int, default=9)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=576)
    parser.add_argument("--context", type=int, default=2048, help="keys per sequence")
    parser.add_argument("--new-tokens", type=int, default=256, help="prefill queries (new tokens)")
    parser.add_argument("--batch", type=int, default=8, help="sequences in one decode step")
    parser.add_argument("--repeat", type=int, default=10, help="timed runs per op (median reported)")
    parser.add_argument("--ops", default="", help="comma-separated subset of ops (default: all)")
    parser.add_argument(
        "--threads", type=int, default=0,
        help="torch CPU threads (0: torch's default). On a loaded machine OpenMP threads that spin-wait "
        "for a core can make gathers tens of times slower than one thread",
    )
    parser.add_argument("--json", action="store_true", help="print results as JSON lines")
    parser.add_argument(
        "--check", action="store_true",
        help="before timing, run each Triton kernel and its reference on copies of the same inputs and "
        "print the largest difference (a GPU's native kernels, which the interpreter-run tests cannot see)",
    )


def run_cli(args: argparse.Namespace) -> int:
    import torch  # noqa: PLC0415 - keep `efim --help` fast

    from kernels import reference  # noqa: PLC0415

    device = _pick_device(args.device, torch)
    if args.threads < 0:
        raise ValueError("--threads must be >= 0")
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[
        args.dtype or ("bf16" if device == "cuda" else "fp32")
    ]
    if args.heads % args.kv_heads:
        raise ValueError(f"--heads {args.heads} is not a multiple of --kv-heads {args.kv_heads}")
    for name in ("heads", "kv_heads", "head_dim", "hidden", "context", "new_tokens", "batch", "repeat"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
    triton_ops, why_not = _triton_ops(device)
    cases = _cases(args, torch, device, dtype)
    wanted = {s.strip() for s in args.ops.split(",") if s.strip()}
    unknown = wanted - {c.op for c in cases}
    if unknown:
        raise ValueError(f"unknown ops {sorted(unknown)}; choose from {sorted({c.op for c in cases})}")

    out = sys.stdout
    if not args.json:
        threads = f", {torch.get_num_threads()} CPU threads" if device == "cpu" else ""
        out.write(f"device {device}, dtype {str(dtype).removeprefix('torch.')}{threads}; median of {args.repeat} runs\n")
        if why_not:
            out.write(f"Triton: not timed — {why_not}\n")
        out.write(f"{'op':<26} {'shape':<34} {'impl':<10} {'ms':>9} {'rate':>16} {'triton speed-up':>16}\n")
    for case in cases:
        if wanted and case.op not in wanted:
            continue
        impls = [("reference", getattr(reference, case.op))]
        if triton_ops is not None:
            impls.append(("triton", getattr(triton_ops, case.op)))
        if args.check and triton_ops is not None:
            err = _max_difference(case, impls[0][1], impls[1][1], torch)
            if args.json:
                out.write(json.dumps({"op": case.op, "shape": case.shape, "check_max_abs_diff": err}) + "\n")
            else:
                out.write(f"{case.op:<26} {case.shape:<34} check: max |triton - reference| = {err:.3g}\n")
        results = [_time(case, impl, fn, args.repeat, torch, device) for impl, fn in impls]
        for r in results:
            speedup = ""
            if r.impl == "triton":
                speedup = f"{results[0].ms / r.ms:.2f}x"
            if args.json:
                out.write(json.dumps({**r._asdict(), "device": device, "dtype": str(dtype)}) + "\n")
            else:
                out.write(f"{r.op:<26} {r.shape:<34} {r.impl:<10} {r.ms:>9.3f} {r.rate:>10.2f} {r.metric:<5} {speedup:>16}\n")
    return 0


def _pick_device(choice: str, torch: Any) -> str:
    if choice == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device is available")
    if choice == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return choice


def _triton_ops(device: str) -> tuple[Any, str]:
    """(kernels.triton or None, reason it is not timed)."""
    if device != "cuda":
        return None, (
            "Triton kernels need a GPU; on a CPU they only run in Triton's interpreter, whose "
            "timings are not performance. These are the reference (CPU fast path) numbers."
        )
    try:
        from kernels import triton as triton_ops  # noqa: PLC0415
    except Exception as exc:  # missing or broken triton
        return None, f"kernels.triton is unavailable ({exc})"
    from kernels.triton.checks import interpreted  # noqa: PLC0415
    from kernels.triton.prefill import _prefill_kernel  # noqa: PLC0415

    if interpreted(_prefill_kernel):
        return None, "TRITON_INTERPRET=1 is set: interpreter timings are not performance"
    return triton_ops, ""


def _cases(args: argparse.Namespace, torch: Any, device: str, dtype: Any) -> list[Case]:
    gen = torch.Generator(device="cpu").manual_seed(0)
    H, H_kv, D, S, T, B = args.heads, args.kv_heads, args.head_dim, args.context, args.new_tokens, args.batch
    size = torch.tensor([], dtype=dtype).element_size()
    N = max(S * B, S + T)  # pool slots

    def rand(*shape: int, dt: Any = dtype) -> Any:
        return torch.randn(*shape, generator=gen).to(device=device, dtype=dt)

    k_pool, v_pool = rand(N, H_kv, D), rand(N, H_kv, D)  # [N, H_kv, D]
    perm = torch.randperm(N, generator=gen).to(device)  # scattered slots, like a long-lived pool
    scale = D**-0.5
    cases: list[Case] = []

    # Prefill: T new tokens at the end of an S-key sequence (keys include themselves).
    q_pre = rand(T, H, D)  # [T, H, D]
    slots_pre = perm[:S]
    k_pos = torch.arange(S, device=device)
    q_pos = torch.arange(S - T, S, device=device)
    pairs = T * (S - T) + T * (T + 1) // 2  # visible (query, key) pairs per head
    cases.append(Case(
        "paged_attention_prefill", f"T={T} S={S} H={H}/{H_kv} D={D}", 4.0 * D * H * pairs, "TFLOP/s",
        lambda: (q_pre, k_pool, v_pool, slots_pre, k_pos, q_pos, scale),
    ))
    # EFIM's keystroke on the engine's contiguous per-sequence KV: 3 new tokens over S keys.
    q_key = rand(H, 3, D)  # [H, 3, D]
    k_seq, v_seq = rand(H_kv, S, D), rand(H_kv, S, D)  # [H_kv, S, D]
    cases.append(Case(
        "attention", f"T=3 S={S} H={H}/{H_kv} D={D}", 2.0 * S * H_kv * D * size, "GB/s",
        lambda: (q_key, k_seq, v_seq, None, None, scale),
    ))
    # Decode: one query for each of B sequences of S keys.
    q_dec = rand(B, H, D)  # [B, H, D]
    table = perm[: B * S].view(B, S)  # [B, S]
    lens = torch.full((B,), S, device=device)
    cases.append(Case(
        "paged_attention_decode", f"B={B} S={S} H={H}/{H_kv} D={D}", 2.0 * B * S * H_kv * D * size, "GB/s",
        lambda: (q_dec, k_pool, v_pool, table, lens, scale),
    ))
    # RoPE on q and k of the prefill tokens, and CacheBlend's shift of a cached chunk.
    qk = rand(H + H_kv, T, D)  # [H + H_kv, T, D]
    inv_freq = 1.0 / 10000 ** (torch.arange(0, D, 2, device=device, dtype=torch.float32) / D)  # [D/2]
    cos, sin = (t.to(dtype) for t in _cos_sin(torch, q_pos, inv_freq))
    cases.append(Case(
        "rope_apply", f"[{H + H_kv}, {T}, {D}]", 2.0 * qk.numel() * size, "GB/s", lambda: (qk, cos, sin, "neox"),
    ))
    chunk = rand(S, H_kv, D)  # [S, H_kv, D]
    new_pos = k_pos + 1000
    cases.append(Case(
        "rope_shift", f"[{S}, {H_kv}, {D}]", 2.0 * chunk.numel() * size, "GB/s",
        lambda: (chunk, k_pos, new_pos, inv_freq, "neox"),
    ))
    # KV movement and CacheBlend's deviation.
    rows_k, rows_v = rand(T, H_kv, D), rand(T, H_kv, D)  # [T, H_kv, D]
    store_slots = perm[S : S + T]
    cases.append(Case(
        "kv_store", f"T={T} [{H_kv}, {D}]", 4.0 * T * H_kv * D * size, "GB/s",
        lambda: (k_pool, v_pool, rows_k, rows_v, store_slots),
    ))
    gather_out = torch.empty(H_kv, S, D, dtype=dtype, device=device)  # [H_kv, S, D]
    cases.append(Case(
        "kv_gather", f"S={S} [{H_kv}, {D}]", 2.0 * S * H_kv * D * size, "GB/s",
        lambda: (k_pool, slots_pre, gather_out),
    ))
    fresh = rand(S, H_kv, D)  # [S, H_kv, D]
    cases.append(Case(
        "kv_deviation", f"[{S}, {H_kv}, {D}]", 2.0 * chunk.numel() * size, "GB/s", lambda: (fresh, chunk),
    ))
    # RMSNorm over the prefill tokens' hidden states.
    x = rand(T, args.hidden)  # [T, hidden]
    w = rand(args.hidden)
    cases.append(Case(
        "rms_norm", f"[{T}, {args.hidden}]", 2.0 * x.numel() * size, "GB/s", lambda: (x, w, 1e-5),
    ))
    return cases


def _cos_sin(torch: Any, positions: Any, inv_freq: Any) -> tuple[Any, Any]:
    angles = positions.float().unsqueeze(1) * inv_freq.unsqueeze(0)  # [T, D/2]
    return angles.cos(), angles.sin()


def _max_difference(case: Case, ref_fn: Callable, tri_fn: Callable, torch: Any) -> float:
    """Largest absolute difference between the two implementations' results on copies of the
    same inputs; for an in-place op (returns None) the inputs it writes are compared."""

    def run(fn: Callable) -> list[Any]:
        args = [a.clone() if isinstance(a, torch.Tensor) else a for a in case.args()]
        result = fn(*args)
        if result is None:
            return [a for a in args if isinstance(a, torch.Tensor)]
        return list(result) if isinstance(result, (tuple, list)) else [result]

    ref, tri = run(ref_fn), run(tri_fn)
    worst = 0.0
    for a, b in zip(ref, tri):
        if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.is_floating_point():
            worst = max(worst, (a.float() - b.float()).abs().max().item())
    return worst


def _time(case: Case, impl: str, fn: Callable, repeat: int, torch: Any, device: str) -> KernelTiming:
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    args = case.args()
    fn(*args)  # warm-up (and Triton's compilation)
    sync()
    samples = []
    if device == "cuda":
        # Back-to-back launches between two CUDA events: the device time per call, launch
        # overhead included where the GPU outruns the Python that launches (tiny ops), but
        # not the host's synchronisation after every call.
        for _ in range(max(3, repeat // 10)):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(10):
                fn(*args)
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) / 1e3 / 10)
        seconds = statistics.median(samples)
        scale = 1e12 if case.metric == "TFLOP/s" else 1e9
        return KernelTiming(case.op, case.shape, impl, seconds * 1e3, case.work / seconds / scale, case.metric)
    for _ in range(repeat):
        start = time.perf_counter()
        fn(*args)
        sync()
        samples.append(time.perf_counter() - start)
    seconds = statistics.median(samples)
    scale = 1e12 if case.metric == "TFLOP/s" else 1e9
    return KernelTiming(case.op, case.shape, impl, seconds * 1e3, case.work / seconds / scale, case.metric)
