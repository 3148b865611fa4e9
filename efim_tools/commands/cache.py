"""`efim cache ls|clear`: the disk tier's KV files (engine.kv.disk_format) in the user cache.

`ls` lists each file (document, tokens, bytes, age, fingerprint) and the total; `clear`
removes them (`--all`: also the rest of the cache directory, e.g. models converted from
GGUF, which are rebuilt on the next start). Neither loads a model or torch's kernels.
"""

from __future__ import annotations

import argparse
import shutil
import time


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("cache", help="the KV disk tier's files (ls, clear)")
    p.add_argument("--dir", help="the KV directory (default: $EFIM_KV_DIR or <cache>/efim-lsp/kv)")
    actions = p.add_subparsers(dest="action", metavar="ACTION", required=True)
    actions.add_parser("ls", help="list the KV files and their total size").set_defaults(func=run_ls)
    clear = actions.add_parser("clear", help="remove the KV files")
    clear.add_argument("--all", action="store_true", help="also remove the rest of the efim-lsp cache (converted models)")
    clear.set_defaults(func=run_clear)


def _directory(args: argparse.Namespace):
    from pathlib import Path

    from engine.kv.disk_format import kv_directory

    return Path(args.dir).expanduser() if args.dir else kv_directory()


def _size(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GB"


def _age(seconds: float) -> str:
    for unit, span in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= span:
            return f"{seconds / span:.0f}{unit}"
    return f"{seconds:.0f}s"


def run_ls(args: argparse.Namespace) -> int:
    from engine.kv.disk_format import list_files

    directory = _directory(args)
    files = list_files(directory) if directory.is_dir() else []
    now = time.time()
    print(f"{directory}")
    print(f"{'tokens':>7} {'bytes':>9} {'age':>5}  {'fingerprint':<12} document")
    for f in reversed(files):  # newest first
        print(f"{f.n_tokens:>7} {_size(f.nbytes):>9} {_age(now - f.mtime):>5}  {(f.fingerprint[:12] or '?'):<12} {f.document}")
    print(f"{len(files)} files, {_size(sum(f.nbytes for f in files))}")
    return 0


def run_clear(args: argparse.Namespace) -> int:
    from engine.kv.disk_format import clear

    directory = _directory(args)
    n, size = clear(directory) if directory.is_dir() else (0, 0)
    print(f"removed {n} KV files ({_size(size)}) from {directory}")
    if args.all:
        from engine.paths import cache_root

        root = cache_root()
        if root.is_dir():
            shutil.rmtree(root)
            print(f"removed {root}")
    return 0
