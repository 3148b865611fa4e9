"""Weight formats on the embedded model: quality against the dequantised bf16 reference and
speed, in one run (docs/model.md "Formats").

    .venv/bin/python bench/quant_quality.py [--windows 8] [--window 256] [--rounds 3] [--json]
    .venv/bin/python bench/quant_quality.py --kv [--windows 6] [--kv-window 2048] [--kv-decode 64]

Quality: greedy top-1 agreement and mean KL(reference || format) of the next-token
distribution at every position of `--windows` windows of real code (CPython stdlib, read
at run time), for quant none (the reference: the GGUF dequantised, bf16), int8, int4 and
auto, both on the bare model and with the shipped adapter merged (what `efim serve` runs).
Speed: decode ms/token after a 128-token prompt and prefill tokens/s of 512 tokens in
256-row prefill steps, formats interleaved over `--rounds` rounds (medians), plus the
`Int4Linear` crossover: fused int4 GEMV vs dequantise-then-GEMM by row count on the
model's shapes.

`--decode`: each format as serving runs it — the window prefilled in 256-row prefill steps, its last
`--kv-decode` tokens then fed one at a time, teacher-forced — against the bf16 model run the
same way, per part (prefill rows, decode rows), with the shipped adapter merged: this is where
"mixed" (int4 decode steps, bf16 prefill) differs from bf16, since its decode rows run int4.

`--kv`: the int8 KV cache against the model-dtype KV on the same model (docs/model.md
"int8 KV cache"), per weight format (bf16 and int4, the shipped adapter merged: what
`efim serve` runs), over `--windows` windows of `--kv-window` tokens of real code: the
window is prefilled in 256-row prefill steps (every prefill row's next-token distribution is
compared: those rows attend over dequantised int8 rows) and its last `--kv-decode` tokens
are then fed one at a time, teacher-forced (those rows run the int8 decode attention).
Greedy top-1 agreement and mean KL(model-dtype KV || int8 KV), per part.
Benchmark code, outside the serving path.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import sysconfig
import time
from pathlib import Path

# Before torch loads, as bench/model_speed.py: libgomp's default spin on a shared 2-core
# machine made a first run 30x slower (690 ms per bf16 decode step) and its ratios meaningless.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

FORMATS = ("none", "int8", "int4", "auto")
MODULES = ("textwrap.py", "shlex.py", "heapq.py", "fnmatch.py", "bisect.py", "string.py", "difflib.py", "ftplib.py")


def windows(tokenizer, n: int, size: int) -> list[list[int]]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    out = []
    for name in MODULES:
        ids = tokenizer.encode((stdlib / name).read_text(encoding="utf-8")).ids
        if len(ids) >= size:
            mid = (len(ids) - size) // 2  # the middle of the file: past the imports
            out.append(ids[mid : mid + size])
        if len(out) == n:
            break
    return out


def quality(models: dict, ids_list: list[list[int]]) -> dict[str, dict[str, float]]:
    import torch

    ref_model = models["none"].model
    sums = {q: {"kl": 0.0, "top1": 0.0, "n": 0} for q in models if q != "none"}
    with torch.inference_mode():
        for ids in ids_list:
            x = torch.tensor(ids)
            ref = ref_model.forward(x, ref_model.new_kv(len(ids)), 0, "all")  # [T, V]
            lp = torch.log_softmax(ref, -1)
            for q, loaded in models.items():
                if q == "none":
                    continue
                m = loaded.model
                got = m.forward(x, m.new_kv(len(ids)), 0, "all")  # [T, V]
                lq = torch.log_softmax(got, -1)
                s = sums[q]
                s["kl"] += (lp.exp() * (lp - lq)).sum(-1).sum().item()
                s["top1"] += (ref.argmax(-1) == got.argmax(-1)).sum().item()
                s["n"] += len(ids)
    return {q: {"top1": s["top1"] / s["n"], "kl": s["kl"] / s["n"], "positions": s["n"]} for q, s in sums.items()}


def _kv_logits(model, ids: list[int], n_decode: int, step: int = 256):
    """Float32 logits of every position of `ids` with this model's current kv_dtype:
    rows before the last `n_decode` by prefill steps of `step` rows, the rest by one-token steps."""
    import torch

    x = torch.tensor(ids)
    n = len(ids)
    cut = n - n_decode
    kv = model.new_kv(n)
    out = []
    for start in range(0, cut, step):
        end = min(cut, start + step)
        out.append(model.forward(x[start:end], kv, start, "all"))
    for pos in range(cut, n):
        out.append(model.forward(x[pos : pos + 1], kv, pos, "all"))
    return torch.cat(out), cut


def decode_quality(models: dict, ids_list: list[list[int]], n_decode: int) -> dict[str, dict[str, dict[str, float]]]:
    """Per format: top-1 agreement and mean KL(bf16 || format) over prefill rows and over
    one-token decode rows, every model run by `_kv_logits` (prefill steps, then one-token steps)."""
    import torch

    sums = {q: {part: {"kl": 0.0, "top1": 0.0, "n": 0} for part in ("prefill", "decode")} for q in models if q != "none"}
    with torch.inference_mode():
        for ids in ids_list:
            ref, cut = _kv_logits(models["none"].model, ids, n_decode)
            lp = torch.log_softmax(ref.float(), -1)
            for q, loaded in models.items():
                if q == "none":
                    continue
                got, _ = _kv_logits(loaded.model, ids, n_decode)
                lq = torch.log_softmax(got.float(), -1)
                kl = (lp.exp() * (lp - lq)).sum(-1)  # [T]
                same = ref.argmax(-1) == got.argmax(-1)  # [T]
                for part, rows in (("prefill", slice(0, cut)), ("decode", slice(cut, None))):
                    s = sums[q][part]
                    s["kl"] += kl[rows].sum().item()
                    s["top1"] += same[rows].sum().item()
                    s["n"] += int(same[rows].numel())
    return {
        q: {part: {"top1": s["top1"] / s["n"], "kl": s["kl"] / s["n"], "positions": s["n"]} for part, s in parts.items()}
        for q, parts in sums.items()
    }


def kv_quality(model, ids_list: list[list[int]], n_decode: int) -> dict[str, dict[str, float]]:
    """int8 KV vs the model-dtype KV: top-1 agreement and mean KL over prefill rows and
    over decoded rows, summed over windows."""
    import torch

    sums = {part: {"kl": 0.0, "top1": 0.0, "n": 0} for part in ("prefill", "decode")}
    with torch.inference_mode():
        for ids in ids_list:
            model.set_kv_dtype("model")
            ref, cut = _kv_logits(model, ids, n_decode)
            model.set_kv_dtype("int8")
            got, _ = _kv_logits(model, ids, n_decode)
            model.set_kv_dtype("model")
            lp, lq = torch.log_softmax(ref, -1), torch.log_softmax(got, -1)
            kl = (lp.exp() * (lp - lq)).sum(-1)  # [T]
            top1 = ref.argmax(-1) == got.argmax(-1)  # [T]
            for part, rows in (("prefill", slice(0, cut)), ("decode", slice(cut, None))):
                sums[part]["kl"] += kl[rows].sum().item()
                sums[part]["top1"] += top1[rows].sum().item()
                sums[part]["n"] += kl[rows].numel()
    return {p: {"top1": s["top1"] / s["n"], "kl": s["kl"] / s["n"], "positions": s["n"]} for p, s in sums.items()}


def speed(models: dict, prompt, prefill, rounds: int) -> dict[str, dict[str, float]]:
    from bench import speed_probes

    samples = {q: {"decode_ms": [], "prefill_tok_s": []} for q in models}
    for _ in range(rounds):
        for q, loaded in models.items():  # interleaved: machine load drifts alike for all
            samples[q]["decode_ms"].append(speed_probes.engine_decode_ms(loaded.model, prompt, 32))
            samples[q]["prefill_tok_s"].append(speed_probes.engine_prefill_tok_s(loaded.model, prefill, 256))
    return {
        q: {k: statistics.median(v) for k, v in s.items()} | {"weight_bytes": models[q].model.weight_bytes()}
        for q, s in samples.items()
    }


def crossover(model, rows=(1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 256)) -> list[dict]:
    """Per distinct int4 shape of `model`: µs of the fused kernel and of dequantise+GEMM."""
    import torch

    from engine.model.quant import Int4Linear

    layer = model.layers[0]
    out = []
    for name in ("qkv", "o", "up", "down"):
        lin = getattr(layer, name)
        if not isinstance(lin, Int4Linear):
            continue
        packed, scales_zeros = lin.packed, lin.scales_zeros  # torch's layout (rebuilt where the C kernel's is kept)
        for m in rows:
            x = torch.randn(m, lin.in_features, dtype=scales_zeros.dtype)

            def fused():
                return torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, lin.group, scales_zeros)

            def gemm():
                return torch.mm(x, lin._dequantize_t())

            best = {}
            for label, f in (("fused", fused), ("gemm", gemm)):
                f()
                reps = max(3, min(200, int(2e5 / (m * lin.out_features * lin.in_features / 1e3 + 1))))
                times = []
                for _ in range(3):
                    t = time.perf_counter()
                    for _ in range(reps):
                        f()
                    times.append((time.perf_counter() - t) / reps * 1e6)
                best[label] = min(times)
            out.append({"linear": name, "shape": [lin.out_features, lin.in_features], "rows": m,
                        "fused_us": round(best["fused"], 1), "gemm_us": round(best["gemm"], 1)})
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default")
    ap.add_argument("--windows", type=int, default=8)
    ap.add_argument("--window", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--skip", default="", help="comma list of parts to skip: quality, bare, adapter, speed, crossover")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--kv", action="store_true", help="int8 KV vs model-dtype KV instead of the weight formats")
    ap.add_argument("--kv-window", type=int, default=2048)
    ap.add_argument("--kv-decode", type=int, default=64)
    ap.add_argument("--kv-formats", default="none,int4", help="weight formats of the --kv comparison")
    ap.add_argument("--decode", action="store_true",
                    help="formats run as serving runs them (prefill steps, then one-token steps) vs bf16, per part")
    ap.add_argument("--decode-formats", default="none,int4,mixed", help="weight formats of the --decode comparison")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    skip = set(args.skip.split(","))

    import torch

    from engine.runtime.loading import load_model_for_engine

    if args.decode:
        fmts = args.decode_formats.split(",")
        if fmts[0] != "none":
            fmts.insert(0, "none")
        models = {q: load_model_for_engine(args.model, dtype="bf16", quant=q, adapter="auto").loaded for q in fmts}
        ids_list = windows(models["none"].tokenizer, args.windows, args.kv_window)
        report = {"window": args.kv_window, "decode": args.kv_decode, "windows": len(ids_list)}
        report.update(decode_quality(models, ids_list, args.kv_decode))
        if args.json:
            print(json.dumps(report, indent=1))
            return 0
        print(f"vs bf16, {args.kv_window}-token windows of stdlib code ({len(ids_list)}), last {args.kv_decode} decoded one at a time, adapter merged")
        for q in fmts[1:]:
            for part, v in report[q].items():
                print(f"weights {q:6} {part:8} top1 {v['top1']:.4f}  KL {v['kl']:.5f}  ({v['positions']} positions)")
        return 0

    if args.kv:
        report = {"threads": torch.get_num_threads(), "window": args.kv_window, "decode": args.kv_decode}
        for q in args.kv_formats.split(","):
            loaded = load_model_for_engine(args.model, dtype="bf16", quant=q, adapter="auto").loaded
            ids_list = windows(loaded.tokenizer, args.windows, args.kv_window)
            report[q] = kv_quality(loaded.model, ids_list, args.kv_decode)
            report[q]["windows"] = len(ids_list)
            del loaded
        if args.json:
            print(json.dumps(report, indent=1))
            return 0
        print(f"int8 KV vs bf16 KV, {args.kv_window}-token windows of stdlib code, last {args.kv_decode} decoded one at a time")
        for q in args.kv_formats.split(","):
            for part, v in report[q].items():
                if isinstance(v, dict):
                    print(f"weights {q:5} {part:8} top1 {v['top1']:.4f}  KL {v['kl']:.5f}  ({v['positions']} positions, {report[q]['windows']} windows)")
        return 0

    report: dict = {"threads": torch.get_num_threads()}
    for adapter in ("none", "auto"):
        if (adapter == "auto" and "adapter" in skip) or (adapter == "none" and "bare" in skip):
            continue
        models = {q: load_model_for_engine(args.model, dtype="bf16", quant=q, adapter=adapter).loaded for q in FORMATS}
        key = "bare" if adapter == "none" else "adapter"
        if "quality" not in skip:
            report[f"quality_{key}"] = quality(models, windows(models["none"].tokenizer, args.windows, args.window))
        if "speed" not in skip and adapter == "auto":
            ids = torch.tensor(windows(models["none"].tokenizer, 3, 256)[0] + windows(models["none"].tokenizer, 3, 256)[1])
            report["speed"] = speed(models, ids[:128], ids[:512], args.rounds)
        if "crossover" not in skip and "crossover" not in report:
            report["crossover"] = crossover(models["auto"].model)  # the raw kernel and unpack: an adapter does not matter
        del models
    if args.json:
        print(json.dumps(report, indent=1))
        return 0
    for key in ("quality_bare", "quality_adapter"):
        if key in report:
            print(f"{key}: " + "; ".join(f"{q} top1 {v['top1']:.4f} KL {v['kl']:.5f}" for q, v in report[key].items()))
    for q, v in report.get("speed", {}).items():
        print(f"speed {q}: decode {v['decode_ms']:.2f} ms/token, prefill {v['prefill_tok_s']:.0f} tok/s, weights {v['weight_bytes'] / 1e6:.1f} MB")
    for r in report.get("crossover", []):
        print(f"crossover {r['linear']} {r['shape']} rows {r['rows']}: fused {r['fused_us']} us, gemm {r['gemm_us']} us")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
