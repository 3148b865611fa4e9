"""Decode attention of one token over an int8 KV cache vs today's bf16 KV, per torch op
(issue 15: "int8 KV cache (per-head scales) so decode attention at a 2 K window reads half
the bytes"). Decides which op the int8 path of `engine.model.transformer` uses.

    .venv/bin/python bench/kv_int8.py [--keys 512 2048 4096] [--reps 30] [--rounds 3]
    .venv/bin/python bench/kv_int8.py --decode [--window 2048] [--steps 24] [--rounds 3]

Every variant runs one decode step's attention over all layers of a model shape (135M:
30 layers, 9 q / 3 kv heads; 0.5B: 24 layers, 14 q / 2 kv heads; head_dim 64), the new
token's K/V row written (quantised where the cache is int8) before it attends, as the model
does. Variants alternate call by call (rotating order; medians of `--rounds` x `--reps`
calls each), all in one run:

- `bf16`: today's path: copy the row, `kernels.reference.attention` (SDPA, q heads of a kv
  head as rows: one call per layer).
- `deq+sdpa`: int8 K/V with per-(token, kv-head) scales, dequantised to bf16, then SDPA —
  the naive baseline.
- `w8pack`: scores per kv head by `aten._weight_int8pack_mm(q_g [G, D], K_h [S, D] int8,
  k_scale_h [S])` (exactly its shape: per-row scales), fp32 softmax, V's per-token scale
  folded into the probabilities, and P'_h [G, cap] x V^T_h [D, cap] by the same op with
  unit scales (V stored transposed per head so the op's B operand is contiguous; the rows
  past S get probability 0 — the whole capacity is read).
- `w8fused`: as `w8pack` with one call per layer for K and one for V: q [H, D] against
  the layer's whole K slab [H_kv * cap, D] and P' [H, cap] against the V^T slab
  [H_kv * D, cap], keeping the diagonal (own kv head) blocks: G x the multiply-adds of
  `w8pack`, the same bytes, 2 op calls instead of 2 H_kv.
- `int_mm-k`: scores by `torch._int_mm` with q quantised per row (int8 x int8 -> int32),
  V as `w8pack`.

Prints ms per decode step (all layers' attention, writing included) and the ratio to bf16.

`--decode`: the whole model's decode step (`Transformer.forward` of one token) at a
`--window`-token context, KV in the model dtype (bf16) vs int8 (`kv_dtype="int8"`, what the
engine runs), weights bf16 and int4, 135M (the embedded model) and the 0.5B shape (random
weights, `bench.model_shapes`). The context rows are random (speed does not depend on
them), written through the KV's own `write`; the two KV formats alternate step by step on
each model, models in rounds, the median step per configuration, all in one run. `--prefill` adds the prefill tok/s of the
window (256-row prefill steps) per configuration. Benchmark code, outside the serving path.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as bench/quant_quality.py: libgomp spin on a shared machine

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from kernels.reference import attention  # noqa: E402

SHAPES = {"135m": (30, 9, 3, 64), "0.5b": (24, 14, 2, 64)}  # layers, q heads, kv heads, head_dim
W8 = torch.ops.aten._weight_int8pack_mm


def _quant_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # [..., D] -> int8 [..., D], scale [...]
    scale = x.abs().amax(-1, keepdim=True).float().clamp_min_(1e-8).div_(127.0)
    return x.float().div(scale).round_().to(torch.int8), scale.squeeze(-1)


def _cap(s: int) -> int:
    return (s + 1 + 64 + 255) // 256 * 256  # the runner's workspace rounding (prompt + max_tokens + 1)


class Case:
    """One shape at S keys: the bf16 and int8 workspaces of every layer, random content."""

    def __init__(self, shape: str, s: int) -> None:
        self.L, self.H, self.Hkv, self.D = SHAPES[shape]
        self.G = self.H // self.Hkv
        self.s, cap = s, _cap(s)
        g = torch.Generator().manual_seed(0)
        k = torch.randn(self.L, self.Hkv, cap, self.D, generator=g).to(torch.bfloat16)
        v = torch.randn(self.L, self.Hkv, cap, self.D, generator=g).to(torch.bfloat16)
        self.k, self.v = k, v
        self.k8, ks = _quant_rows(k)
        self.ks = ks.to(torch.bfloat16)  # [L, H_kv, cap]
        v8, vs = _quant_rows(v)
        self.v8 = v8  # [L, H_kv, cap, D]
        self.vs = vs  # [L, H_kv, cap] float32
        self.vt8 = v8.transpose(2, 3).contiguous()  # [L, H_kv, D, cap]
        self.q = torch.randn(self.H, 1, self.D, generator=g).to(torch.bfloat16)
        self.new_k = torch.randn(self.Hkv, self.D, generator=g).to(torch.bfloat16)
        self.new_v = torch.randn(self.Hkv, self.D, generator=g).to(torch.bfloat16)
        self.ones = torch.ones(self.D, dtype=torch.bfloat16)
        self.scale = 1.0 / self.D**0.5

    # ------------------------------------------------------------------ variants
    def bf16(self) -> torch.Tensor:
        s = self.s
        for i in range(self.L):
            self.k[i, :, s].copy_(self.new_k)
            self.v[i, :, s].copy_(self.new_v)
            out = attention(self.q, self.k[i, :, : s + 1], self.v[i, :, : s + 1], None, None, self.scale)
        return out

    def _write_int8(self, i: int, vt: bool) -> None:
        s = self.s
        kv8, kvs = _quant_rows(torch.stack((self.new_k, self.new_v)))  # [2, H_kv, D], [2, H_kv]
        self.k8[i, :, s].copy_(kv8[0])
        self.ks[i, :, s].copy_(kvs[0])
        (self.vt8[i, :, :, s] if vt else self.v8[i, :, s]).copy_(kv8[1])
        self.vs[i, :, s].copy_(kvs[1])

    def deq_sdpa(self) -> torch.Tensor:
        n = self.s + 1
        for i in range(self.L):
            self._write_int8(i, vt=False)
            k = self.k8[i, :, :n].to(torch.bfloat16).mul_(self.ks[i, :, :n, None])
            v = self.v8[i, :, :n].to(torch.bfloat16).mul_(self.vs[i, :, :n, None].to(torch.bfloat16))
            out = attention(self.q, k, v, None, None, self.scale)
        return out

    def _scores_w8(self, i: int, q: torch.Tensor, n: int) -> torch.Tensor:  # [H_kv, G, n] fp32
        return torch.stack([W8(q[h], self.k8[i, h, :n], self.ks[i, h, :n]) for h in range(self.Hkv)]).float()

    def w8pack(self) -> torch.Tensor:
        n, cap = self.s + 1, self.vt8.shape[-1]
        q = self.q.view(self.Hkv, self.G, self.D)
        for i in range(self.L):
            self._write_int8(i, vt=True)
            p = torch.softmax(self._scores_w8(i, q, n).mul_(self.scale), -1)  # [H_kv, G, n]
            pv = torch.zeros(self.Hkv, self.G, cap, dtype=torch.bfloat16)
            pv[:, :, :n] = p.mul_(self.vs[i, :, None, :n])
            out = torch.stack([W8(pv[h], self.vt8[i, h], self.ones) for h in range(self.Hkv)])  # [H_kv, G, D]
        return out

    def w8fused(self) -> torch.Tensor:
        """All kv heads in one `_weight_int8pack_mm` each for K and V: q [H, D] against the
        layer's whole K slab [H_kv * cap, D] (contiguous), the diagonal head blocks kept
        (G x more multiply-adds than needed, the bytes read once); V^T slab [H_kv * D, cap]."""
        n, cap = self.s + 1, self.vt8.shape[-1]
        H, Hkv, G, D = self.H, self.Hkv, self.G, self.D
        q = self.q.view(H, D)
        ones = self.ones.repeat(Hkv)
        pv = torch.zeros(Hkv, G, cap, dtype=torch.bfloat16)
        for i in range(self.L):
            self._write_int8(i, vt=True)
            sc = W8(q, self.k8[i].view(Hkv * cap, D), self.ks[i].view(Hkv * cap))  # [H, H_kv cap]
            sc = sc.view(Hkv, G, Hkv, cap).diagonal(0, 0, 2).permute(2, 0, 1)[:, :, :n]  # [H_kv, G, n]
            p = torch.softmax(sc.float().mul_(self.scale), -1)
            torch.mul(p, self.vs[i, :, None, :n], out=pv[:, :, :n])
            pv[:, :, n:].zero_()
            out = W8(pv.view(H, cap), self.vt8[i].view(Hkv * D, cap), ones)  # [H, H_kv D]
            out = out.view(Hkv, G, Hkv, D).diagonal(0, 0, 2).permute(2, 0, 1)  # [H_kv, G, D]
        return out

    def int_mm_k(self) -> torch.Tensor:
        n, cap = self.s + 1, self.vt8.shape[-1]
        q8, qs = _quant_rows(self.q.view(self.Hkv, self.G, self.D))  # [H_kv, G, D], [H_kv, G]
        for i in range(self.L):
            self._write_int8(i, vt=True)
            sc = torch.stack([torch._int_mm(q8[h], self.k8[i, h, :n].t()) for h in range(self.Hkv)]).float()
            sc.mul_(qs[..., None] * self.scale).mul_(self.ks[i, :, None, :n].float())
            p = torch.softmax(sc, -1)
            pv = torch.zeros(self.Hkv, self.G, cap, dtype=torch.bfloat16)
            pv[:, :, :n] = p.mul_(self.vs[i, :, None, :n])
            out = torch.stack([W8(pv[h], self.vt8[i, h], self.ones) for h in range(self.Hkv)])
        return out

    VARIANTS = {"bf16": "bf16", "deq+sdpa": "deq_sdpa", "w8pack": "w8pack", "w8fused": "w8fused", "int_mm-k": "int_mm_k"}

    def check(self) -> dict[str, float]:
        """Max abs difference of each int8 variant's output (last layer, last head group)
        from the bf16 reference: the variants must compute the same attention."""
        ref = self.bf16().float().reshape(self.H, self.D)
        out = {}
        for name, fn in self.VARIANTS.items():
            if name != "bf16":
                out[name] = float((getattr(self, fn)().float().reshape(self.H, self.D) - ref).abs().max())
        return out


def decode_table(window: int, steps: int, rounds: int, shapes: list[str], formats: list[str], prefill: bool) -> int:
    """Model-level decode ms/token at `window` context tokens, bf16 vs int8 KV (see --decode)."""
    from bench import model_shapes  # noqa: PLC0415

    configs = []  # (shape, weights, model)
    for shape in shapes:
        weights = model_shapes.random_weights(model_shapes.qwen2_config(shape)) if shape != "135m" else None
        for fmt in formats:
            quant = None if fmt == "bf16" else fmt
            configs.append((shape, fmt, model_shapes.build(shape, quant, weights=weights).model))
        del weights
    kvs = {}
    g = torch.Generator().manual_seed(0)
    for shape, fmt, model in configs:
        c = model.config
        for kv_dtype in ("model", "int8"):
            model.set_kv_dtype(kv_dtype)
            kv = model.new_kv(window + steps * rounds + 8)
            rows = (c.n_layers, c.n_kv_heads, window, c.head_dim)
            kv.write(0, torch.randn(rows, generator=g).to(model.dtype), torch.randn(rows, generator=g).to(model.dtype))
            kvs[shape, fmt, kv_dtype] = kv
    times: dict[tuple, list[float]] = {k: [] for k in kvs}
    pos = dict.fromkeys(kvs, window)
    tok = torch.tensor([17])
    with torch.inference_mode():
        for r in range(rounds + 1):  # round 0 warms up and is dropped
            for shape, fmt, model in configs:
                # The two KV formats alternate step by step on the same model (its weights
                # stay as warm in the caches for both; a burst of load hits both alike).
                for j in range(2 * steps):
                    kv_dtype = ("model", "int8")[j % 2]
                    key = (shape, fmt, kv_dtype)
                    model.set_kv_dtype(kv_dtype)
                    t0 = time.perf_counter()
                    model.forward(tok, kvs[key], pos[key])
                    times[key].append((time.perf_counter() - t0) * 1e3)
                    pos[key] += 1
            if r == 0:
                times = {k: [] for k in times}
                pos = dict.fromkeys(kvs, window)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; decode ms/token (median of {steps} x {rounds} "
          f"steps) at {window} context tokens")
    print(f"{'shape':6} {'weights':7} {'bf16 KV':>9} {'int8 KV':>9} {'int8/bf16':>9} {'KV MB/step bf16 -> int8':>24}")
    for shape, fmt, model in configs:
        a = statistics.median(times[shape, fmt, "model"])
        b = statistics.median(times[shape, fmt, "int8"])
        c = model.config
        dense_mb = 2 * c.n_layers * c.n_kv_heads * window * c.head_dim * 2 / 1e6
        int8_mb = 2 * c.n_layers * c.n_kv_heads * window * (c.head_dim + 2) / 1e6
        print(f"{shape:6} {fmt:7} {a:9.2f} {b:9.2f} {b / a:9.2f} {dense_mb:11.1f} -> {int8_mb:.1f}")
    if prefill:
        # Prefill of the window in 256-row steps (each step attends over dequantised int8
        # rows): one prefill per configuration, interleaved, after the decode table.
        from bench import speed_probes  # noqa: PLC0415

        ids = torch.randint(100, 20000, (window,), generator=g)
        print(f"prefill of {window} tokens in 256-row steps, tok/s:")
        for shape, fmt, model in configs:
            tok_s = {}
            for kv_dtype in ("model", "int8"):
                model.set_kv_dtype(kv_dtype)
                tok_s[kv_dtype] = speed_probes.engine_prefill_tok_s(model, ids, 256)
            model.set_kv_dtype("model")
            print(f"{shape:6} {fmt:7} {tok_s['model']:9.0f} {tok_s['int8']:9.0f} {tok_s['int8'] / tok_s['model']:9.2f}")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--keys", type=int, nargs="+", default=[512, 2048, 4096])
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--decode", action="store_true", help="the whole model's decode step, bf16 vs int8 KV")
    ap.add_argument("--window", type=int, default=2048)
    ap.add_argument("--prefill", action="store_true", help="with --decode: also prefill tok/s of the window, bf16 vs int8 KV")
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--formats", nargs="+", default=["bf16", "int4"], choices=["bf16", "int8", "int4"])
    ap.add_argument("--threads", type=int, help="torch threads (default: torch's)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.decode:
        return decode_table(args.window, args.steps, args.rounds, args.shapes, args.formats, args.prefill)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; ms per decode step (all layers' attention)")
    names = list(Case.VARIANTS)
    print(f"{'shape':6} {'S':>5} " + " ".join(f"{n:>16}" for n in names))
    with torch.inference_mode():
        for shape in args.shapes:
            for s in args.keys:
                case = Case(shape, s)
                err = case.check()
                times: dict[str, list[float]] = {n: [] for n in names}
                fns = {n: getattr(case, Case.VARIANTS[n]) for n in names}
                for fn in fns.values():
                    fn()  # warm-up
                for rep_i in range(args.rounds * args.reps):
                    # One call of every variant per repetition, the order rotated: a
                    # neighbour's burst on the shared cores lands on all of them alike.
                    order = names[rep_i % len(names):] + names[: rep_i % len(names)]
                    for n in order:
                        t0 = time.perf_counter()
                        fns[n]()
                        times[n].append((time.perf_counter() - t0) * 1e3)
                med = {n: statistics.median(t) for n, t in times.items()}
                cells = [f"{med[n]:7.2f} ({med[n] / med['bf16']:4.2f}x)" for n in names]
                print(f"{shape:6} {s:5d} " + " ".join(f"{c:>16}" for c in cells))
                print(f"{'':12} max |int8 - bf16| of the output: " + ", ".join(f"{k} {v:.3f}" for k, v in err.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
