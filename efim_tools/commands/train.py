"""`efim train`: fine-tune the default model for FIM/EFIM with fragment tokenization.

Parses arguments and calls `efim_tools.training.train` (torch loads only when the command runs).
Re-running with the same `--out` resumes from its checkpoint."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train", help="train the FIM/EFIM LoRA adapter (fragment tokenization) on the CPython stdlib")
    p.add_argument("--model", default="default", help="'default' (embedded SmolLM2 GGUF), a .gguf file or a HF folder")
    p.add_argument("--out", required=True, help="run folder: checkpoint/, adapter/, train_log.jsonl (resumes if present)")
    frag = p.add_mutually_exclusive_group()
    frag.add_argument("--fragment", dest="fragment", action="store_true", default=True, help="fragment tokenization (default)")
    frag.add_argument("--no-fragment", dest="fragment", action="store_false", help="ordinary tokenization (the baseline)")
    p.add_argument("--fragment-prob", type=float, default=0.5, help="chance a sample's segments are cut into fragments")
    p.add_argument("--steps", type=int, default=400, help="planned optimizer steps (cosine schedule length)")
    p.add_argument("--accum", type=int, default=8, help="samples per optimizer step")
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--embed-lr", type=float, default=1e-3, help="learning rate of the new sentinel rows")
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--alpha", type=float, default=32.0)
    p.add_argument("--window", default="256:512", help="min:max tokens per training window")
    p.add_argument("--line-starts", type=float, default=0.5, help="share of middles starting at a line start or after its indentation")
    p.add_argument("--suffix-informed", type=float, default=0.0, metavar="P", help="share of middles that are a line introducing a name the suffix uses (teaches reading the suffix)")
    p.add_argument("--blank-middles", type=float, default=1.0, metavar="P", help="share of middles whose first line is blank that are kept; the rest start at the next line with code (blank middles teach blank answers on fresh lines)")
    p.add_argument("--healed", type=float, default=0.0, metavar="P", help="share of samples whose prompt ends with text built as serving's token healing prompts the model: its last tokens dropped, the target starting with a token that covers them")
    p.add_argument("--layout", choices=("psm", "spm"), default="psm", help="psm: <fim_prefix> P <fim_suffix> S <fim_middle> (the EFIM paper's layout); spm: <spm_suffix> S <spm_prefix> P, the middle continuing the prefix")
    p.add_argument("--init-from", default="", help="new run only: start from an earlier run's checkpoint adapter, an adapter folder, or 'shipped' (the packaged adapter)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--time-budget", type=float, default=0.0, help="stop (with a checkpoint) after this many seconds; 0 = run to --steps")
    p.add_argument("--save-every", type=int, default=10, help="optimizer steps between checkpoints")
    p.add_argument("--threads", type=int, default=0, help="torch threads per worker (0 = default; with --workers, the cores split evenly)")
    p.add_argument("--workers", type=int, default=1, help="data-parallel worker processes on this machine (2 on 2 cores: one 1-thread worker is as fast as one 2-thread one)")
    p.add_argument("--mix", default="0.45:0.35:0.2", help="FIM:EFIM:plain share of samples (normalised; a new run's setting)")
    p.add_argument("--fp32", action="store_true", help="no bf16 autocast")
    p.add_argument("--crossfile", type=float, default=0.0, metavar="P", help="share of FIM/EFIM samples placed where a line needs a name another module of its package defines, with the context chunks the server's gatherer picks in front (issue #33; packages read where installed)")
    p.add_argument("--crossfile-packages", default="", metavar="A,B", help="packages for --crossfile (default: efim_tools.training.crossfile.TRAINING_PACKAGES; the eval's held-out packages are refused)")
    p.add_argument("--context-tokens", type=int, default=1024, help="the most chunk tokens a cross-file sample carries")
    p.add_argument("--next-edit", type=float, default=0.0, metavar="P", help="share of samples that are next-edit probes: a change synthesised in a training file and one place the server would ask about, answered with the token that belongs there (efim_tools.training.next_edit; --layout spm only)")
    p.set_defaults(func=run)


def _window(text: str) -> tuple[int, int]:
    try:
        lo, hi = (int(x) for x in text.split(":"))
    except ValueError:
        raise ValueError(f"--window must look like 256:512, got {text!r}") from None
    return lo, hi


def _mix(text: str) -> tuple[float, float]:
    try:
        fim, efim, plain = (float(x) for x in text.split(":"))
    except ValueError:
        raise ValueError(f"--mix must look like 0.45:0.35:0.2 (FIM:EFIM:plain), got {text!r}") from None
    total = fim + efim + plain
    if min(fim, efim, plain) < 0 or total <= 0:
        raise ValueError(f"--mix needs non-negative shares with a positive sum, got {text!r}")
    return fim / total, min(efim / total, 1 - fim / total)  # shares sum to at most 1 despite rounding


def run(args: argparse.Namespace) -> int:
    from efim_tools.training.train import TrainConfig, train  # noqa: PLC0415

    lo, hi = _window(args.window)
    fim_rate, efim_rate = _mix(args.mix)
    if not 0 <= args.line_starts <= 1:
        raise ValueError("--line-starts must be in [0, 1]")
    if not 0 <= args.suffix_informed <= 1:
        raise ValueError("--suffix-informed must be in [0, 1]")
    if not 0 <= args.blank_middles <= 1:
        raise ValueError("--blank-middles must be in [0, 1]")
    if not 0 <= args.healed <= 1:
        raise ValueError("--healed must be in [0, 1]")
    if not 0 <= args.crossfile <= 1:
        raise ValueError("--crossfile must be in [0, 1]")
    if not 0 <= args.next_edit <= 1:
        raise ValueError("--next-edit must be in [0, 1]")
    if args.next_edit > 0 and args.layout != "spm":
        raise ValueError("--next-edit needs --layout spm (only the suffix-first layout has a probe sentinel)")
    if args.context_tokens < 64:
        raise ValueError("--context-tokens must be at least 64")
    if args.init_from == "shipped":
        from engine.adapters import SHIPPED_ADAPTER  # noqa: PLC0415

        args.init_from = str(SHIPPED_ADAPTER)
    if args.init_from and not any((Path(args.init_from) / f).is_file() for f in ("checkpoint/state.json", "adapter_config.json")):
        raise ValueError(f"--init-from {args.init_from}: neither a run (checkpoint/state.json) nor an adapter folder (adapter_config.json)")
    if args.time_budget < 0 or args.steps <= 0 or args.accum <= 0:
        raise ValueError("--time-budget must be >= 0, --steps and --accum positive")
    if not 1 <= args.workers <= args.accum:
        raise ValueError(f"--workers must be between 1 and --accum ({args.accum}), got {args.workers}")
    config = TrainConfig(
        model=args.model,
        out=args.out,
        fragment=args.fragment,
        fragment_prob=args.fragment_prob,
        steps=args.steps,
        accum=args.accum,
        lr=args.lr,
        embed_lr=args.embed_lr,
        warmup=args.warmup,
        rank=args.rank,
        alpha=args.alpha,
        min_window=lo,
        max_window=hi,
        seed=args.seed,
        time_budget=args.time_budget,
        save_every=args.save_every,
        threads=args.threads,
        bf16=not args.fp32,
        line_start_prob=args.line_starts,
        init_from=args.init_from,
        fim_rate=fim_rate,
        efim_rate=efim_rate,
        workers=args.workers,
        suffix_informed_prob=args.suffix_informed,
        blank_middle_keep=args.blank_middles,
        healed_prob=args.healed,
        layout=args.layout,
        crossfile_prob=args.crossfile,
        crossfile_packages=tuple(p for p in args.crossfile_packages.split(",") if p),
        context_tokens=args.context_tokens,
        next_edit_prob=args.next_edit,
    )
    result = train(config)
    print(json.dumps({"adapter": str(result.adapter_dir), "finished": result.finished, **result.state._asdict()}), file=sys.stdout)
    return 0
