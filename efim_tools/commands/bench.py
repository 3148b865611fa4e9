"""`efim bench engine|kernels|prefill-attention|blend|jump|soak|restart|peers|saved|team|next-edit|daemon|turns|workspace|nvim`: benchmarks that compare configurations in one run
(soak: load and cancellation through the real server; nvim: what a person sees in Neovim 0.12).

Each target module provides `add_arguments(parser)` and `run_cli(args) -> int`; they are
imported only when their subcommand runs (torch and friends load slowly)."""

from __future__ import annotations

import argparse
import importlib

TARGETS = {
    "engine": ("bench.engine_bench", "prefill/decode speed vs transformers, and keystroke reuse FIM vs EFIM"),
    "kernels": ("bench.kernel_bench", "each kernel against its reference on the present device"),
    "prefill-attention": ("bench.prefill_attention_bench", "a prefill step's attention: torch's kernel against the C one, per layer and in the forward"),
    "blend": ("bench.blend_bench", "CacheBlend quality and TTFT vs full prefill and prefix cache"),
    "jump": ("bench.jump_blend", "a window after a jump assembled from the document's KV vs full prefill"),
    "soak": ("bench.soak", "load and cancellation soak through efim serve: hangs, latency, RSS, integrity"),
    "restart": ("bench.warm_restart", "first suggestion after a restart: cold vs warm from the KV disk tier"),
    "speculation": ("bench.speculation_bench", "prompt-lookup speculation: tokens per step, single-line latency with/without"),
    "peers": ("bench.peers", "the same traces through efim serve (local, llama.cpp backend) and llama.vim's /infill requests"),
    "saved": ("bench.characters_saved", "characters saved on held-out stdlib traces, base model vs its FIM adapter"),
    "team": ("bench.team_load", "editors one inference server serves with EFIM's request pattern (llama.cpp or OpenAI API)"),
    "next-edit": ("bench.next_edit_latency", "next-edit answers through efim serve, client side: idle and while completions run"),
    "daemon": ("bench.daemon_fronts", "efim serve fronts sharing the engine daemon vs one engine each: memory of all processes, keystroke latency, the hop"),
    "turns": ("bench.owner_turns", "one engine, two owners: a typing window's answers alone and during another window's burst of jumps"),
    "workspace": ("bench.workspace_index", "a big workspace indexed while a person types: keystroke latency per phase and memory, context on vs off"),
    "nvim": ("bench.nvim_first_suggestion", "Neovim 0.12 with lsp/efim.lua: the first suggestion after a jump and `A`, to ghost text"),
}


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("bench", help="benchmarks (engine, kernels, prefill-attention, blend, jump, soak, restart, peers, saved, team, next-edit, daemon, turns, workspace, nvim)")
    targets = parser.add_subparsers(dest="target", metavar="TARGET", required=True)
    for name, (module_name, help_text) in TARGETS.items():
        p = targets.add_parser(name, help=help_text)
        p.set_defaults(func=_runner(module_name))
        try:
            importlib.import_module(module_name).add_arguments(p)
        except ModuleNotFoundError as exc:
            if exc.name != module_name:
                raise
            p.set_defaults(func=_missing(module_name))


def _runner(module_name: str):
    def run(args: argparse.Namespace) -> int:
        return importlib.import_module(module_name).run_cli(args)

    return run


def _missing(module_name: str):
    def run(args: argparse.Namespace) -> int:
        raise ValueError(f"{module_name} is not available in this build")

    return run
