"""`efim export gguf PATH`: the default model (or `--model`) with its FIM adapter merged,
written as a GGUF that llama.cpp's llama-server loads (`efim_tools.export`, docs/model.md
"Exporting to GGUF")."""

from __future__ import annotations

import argparse

# Repeated here (not imported) so `efim --help` loads neither numpy nor torch.
TYPES = ("f32", "f16", "bf16", "q8_0", "q5_1", "q5_0", "q4_1", "q4_0")
DEFAULT_TYPE = "q8_0"


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("export", help="write the model with its FIM adapter merged for other runtimes (gguf)")
    formats = p.add_subparsers(dest="format", metavar="FORMAT", required=True)
    g = formats.add_parser("gguf", help="a GGUF file for llama.cpp (llama-server, /infill)")
    g.add_argument("path", help="the .gguf file to write (replaced only once the new one is complete)")
    g.add_argument(
        "--type", default=DEFAULT_TYPE, type=str.lower,
        help=f"weight type: {', '.join(TYPES)} (default {DEFAULT_TYPE}: half the size of f16, "
             "next-token agreement with the engine measured in docs/model.md)",
    )
    g.add_argument("--model", default="default", help="source model: 'default' or a .gguf file (default: default)")
    g.add_argument("--adapter", default="auto", help="'auto' (the shipped FIM adapter for the default model), 'none', or a LoRA path")
    g.set_defaults(func=run_gguf)


def run_gguf(args: argparse.Namespace) -> int:
    import sys

    if args.type not in TYPES:
        raise ValueError(f"unknown export type {args.type!r}; expected one of: {', '.join(TYPES)}")
    from efim_tools.export import export_gguf

    print(f"efim export: writing {args.path} ({args.type}) ...", file=sys.stderr)
    result = export_gguf(args.path, model=args.model, adapter=args.adapter, export_type=args.type)
    fim = ", ".join(f"{role}={i}" for role, i in result.fim_ids.items()) or "none"
    print(f"wrote {result.path} ({result.n_bytes / 2**20:.1f} MiB, {result.export_type}, {result.n_tensors} tensors, "
          f"{result.vocab_size} tokens)")
    print(f"  source {result.source}; adapter {result.adapter or 'none'}; template {result.template}; FIM ids {fim}")
    if result.suffix_first:
        print("  suffix-first template: start llama-server with --spm-infill for /infill")
    return 0
