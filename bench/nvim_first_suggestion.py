"""`efim bench nvim`: the first suggestion after entering insert mode at a new place, in
Neovim 0.12 with only `lsp/efim.lua` (`vim.lsp.enable('efim')` +
`vim.lsp.inline_completion.enable()`), against the real `efim serve`.

    .venv/bin/python -m bench.nvim_first_suggestion [--jumps 30] [--pause 0.6 | --no-pause]
        [--files statistics,ipaddress,graphlib] [--seed 0] [--model PATH] [--config JSON]
        [--scoped-autocmds] [--json OUT]

What a person does: 2-3 files open (copies of CPython standard-library modules, read from
this machine at run time, in a folder with a `.git` marker: the workspace root lsp/efim.lua
finds), a jump in normal mode to a random line inside a function body — another function
far away in the same file (`{line}G`), or another file (`:buffer N`, then `{line}G`;
`--switch-rate`) — a pause (`--pause`; `--no-pause`: none), then `A` (append at the line's
end). Neovim 0.12's built-in client asks on that InsertEnter (after its own 200 ms
debounce); the suggestion it draws is the first one. Then `<Esc>` and the next jump.

Measured per jump (Neovim and the tap share CLOCK_MONOTONIC with this process):
- to ghost: `A` sent → the built-in client set its ghost-text extmark (its
  `nvim_buf_set_extmark` in the `nvim.lsp.inline_completion` namespace, timed inside Neovim);
- the outcome: "shown", "none" (the server answered without an item: read from the tapped
  answer, so "no suggestion" is not taken for "not yet"), "error" (an error answer, e.g. a
  cancelled request) or "timeout" (no answer within `--wait` seconds);
- `A` → the request written (the client's debounce), request → answer (both at the tap);
- from the server's `efim/stats` (read and reset after each jump, so it covers that jump):
  TTFT of the request, its prompt and prefilled tokens, the warm-ups started, finished and
  cancelled, first-window warm-ups and answers;
- the `efim/didMoveCursor` notifications lsp/efim.lua sent (through lua/efim/cursor.lua).

The Neovim 0.12 the editor tests pin (0.12.0-dev-fbb1caf) predates neovim/neovim#35965: its
built-in client sends one request per buffer the server is attached to at each InsertEnter,
each with the current cursor position and that buffer's URI (so with 3 files open the server
gets 3 requests, 2 of them for places nobody is at). The bench measures the request for the
current document and counts the others; `--scoped-autocmds` gives the client's autocommands
their buffer, as the fix does, for the editor as released.

The server is this checkout's `efim serve`, started by Neovim as `efim serve` from PATH
(a script in a temporary bin folder, behind bench/lsp_tap.py), with the default model and
no settings unless `--model` / `--config` (`init_options`, through `vim.lsp.config`) say
otherwise; its KV disk tier writes into a fresh temporary folder (a new user's state).
Neovim 0.12 is the one editors/setup.sh unpacks (or `--nvim`, or `EFIM_NVIM_MODERN`).

Printed: per jump kind and overall, the jumps, shown, none, and p50 / p90 / max of the time
to ghost text; `--json OUT` writes every jump. Module top level imports only the standard
library (the CLI imports it to add arguments).
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import random
import shlex
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

from bench.nvim_driver import wait_until

DEFAULT_FILES = "statistics,ipaddress,graphlib"  # held out of the adapter's training; no other bench tours them
DEBOUNCE_MS = 200  # Neovim 0.12's vim.lsp.inline_completion: InsertEnter → request

# Loaded into Neovim: the time (vim.uv.hrtime, CLOCK_MONOTONIC ns) of InsertEnter and of the
# first ghost-text extmark after `efim_bench_reset()`. vim.api is one table: the built-in
# client's `api.nvim_buf_set_extmark` looks the wrapper up at each call.
PROBE = """
local ns = vim.api.nvim_create_namespace("nvim.lsp.inline_completion")
_G.efim_bench = { insert_at = vim.NIL, ghost_at = vim.NIL }
function _G.efim_bench_reset()
  _G.efim_bench.insert_at = vim.NIL
  _G.efim_bench.ghost_at = vim.NIL
end
local set_extmark = vim.api.nvim_buf_set_extmark
vim.api.nvim_buf_set_extmark = function(buf, ns_id, row, col, opts)
  local id = set_extmark(buf, ns_id, row, col, opts)
  local current = buf == 0 or buf == vim.api.nvim_get_current_buf()  -- not a ghost drawn in a hidden buffer
  if ns_id == ns and current and _G.efim_bench.ghost_at == vim.NIL then
    _G.efim_bench.ghost_at = vim.uv.hrtime()
  end
  return id
end
vim.api.nvim_create_autocmd("InsertEnter", { callback = function()
  if _G.efim_bench.insert_at == vim.NIL then _G.efim_bench.insert_at = vim.uv.hrtime() end
end })
function _G.efim_bench_stats(reset)
  local c = vim.lsp.get_clients({ name = "efim" })[1]
  if not c then return vim.NIL end
  local r = c:request_sync("efim/stats", reset and { reset = true } or vim.empty_dict(), 10000, 0)
  if not r or r.err then return vim.NIL end
  return r.result
end
"""

# `--scoped-autocmds`: what neovim/neovim#35965 (merged 2025-09-30) changed. Before it, each
# buffer's inline-completion Completor listened to InsertEnter/CursorMovedI/InsertLeave in every
# buffer, so one InsertEnter sent one request per attached buffer, each with the current
# window's cursor and its own document's URI. This gives the autocommands the Completor's
# buffer (its augroup is named "nvim.lsp.inline_completion:<bufnr>"). Loaded before any file opens.
SCOPE_AUTOCMDS = """
local groups = {}
local create_augroup, create_autocmd = vim.api.nvim_create_augroup, vim.api.nvim_create_autocmd
vim.api.nvim_create_augroup = function(name, opts)
  local id = create_augroup(name, opts)
  local bufnr = type(name) == "string" and name:match("^nvim%.lsp%.inline_completion:(%d+)$")
  if bufnr then groups[id] = tonumber(bufnr) end
  return id
end
vim.api.nvim_create_autocmd = function(event, opts)
  if opts and groups[opts.group] and opts.buffer == nil and opts.pattern == nil then
    opts = vim.tbl_extend("force", opts, { buffer = groups[opts.group] })
  end
  return create_autocmd(event, opts)
end
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="`efim serve --model PATH` (default: none — the server's default model, as a new user gets it)")
    parser.add_argument("--config", default=None, help="settings as JSON, sent as initializationOptions through vim.lsp.config('efim', {init_options = ...}) (default: none)")
    parser.add_argument("--files", default=DEFAULT_FILES, help="stdlib modules opened, comma-separated, without .py (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the jumps (default: 0)")
    parser.add_argument("--jumps", type=int, default=30, help="jumps (default: 30)")
    parser.add_argument("--pause", type=float, default=0.6, help="seconds between the jump and `A` (default: 0.6)")
    parser.add_argument("--no-pause", action="store_true", help="`A` right after the jump")
    parser.add_argument("--switch-rate", type=float, default=0.5, help="share of jumps to another file (default: 0.5)")
    parser.add_argument("--far", type=int, default=60, help="a jump in the same file lands at least this many lines away (default: 60)")
    parser.add_argument("--wait", type=float, default=5.0, help="seconds to wait for the answer after `A` (default: 5)")
    parser.add_argument("--settle", type=float, default=2.0, help="seconds between the model being ready and the first jump (default: 2)")
    parser.add_argument("--ready-timeout", type=float, default=600.0, help="seconds to wait for the model to load (default: 600)")
    parser.add_argument("--scoped-autocmds", action="store_true",
                        help="one request per InsertEnter, as Neovim after neovim/neovim#35965 (the pinned 0.12 build sends one per attached buffer)")
    parser.add_argument("--nvim", default=None, help="Neovim 0.12 executable (default: editors/setup.sh's copy, or EFIM_NVIM_MODERN)")
    parser.add_argument("--out", type=Path, default=None, help="keep the workspace, the tapped LSP log and Neovim's lsp.log here")
    parser.add_argument("--json", type=Path, default=None, metavar="OUT", help="write the setup, the summary and every jump as JSON")


# --- the workspace ------------------------------------------------------------------------


def body_lines(text: str) -> list[int]:
    """1-based lines where a statement inside a function body starts (docstrings excluded)."""
    tree = ast.parse(text)
    source = text.splitlines()
    lines: set[int] = set()
    for fn in ast.walk(tree):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        body = fn.body
        if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str):
            body = body[1:]
        for stmt in body:
            for node in ast.walk(stmt):
                if isinstance(node, ast.stmt) and not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    line = source[node.lineno - 1].strip()
                    if line and not line.startswith(("#", "@")):
                        lines.add(node.lineno)
    return sorted(lines)


def plan_jumps(files: list[dict], count: int, *, seed: int, switch_rate: float, far: int) -> list[dict]:
    """`count` jumps: {"file": index, "line": 1-based, "kind": "same-file" | "other-file"}, from file 0 line 1."""
    rng = random.Random(seed)
    at_file, at_line = 0, 1
    out = []
    for _ in range(count):
        if len(files) > 1 and rng.random() < switch_rate:
            target = rng.choice([i for i in range(len(files)) if i != at_file])
            line, kind = rng.choice(files[target]["lines"]), "other-file"
        else:
            target, kind = at_file, "same-file"
            candidates = files[target]["lines"]
            away = [n for n in candidates if abs(n - at_line) >= far]
            line = rng.choice(away) if away else max(candidates, key=lambda n: abs(n - at_line))
        out.append({"file": target, "line": line, "kind": kind})
        at_file, at_line = target, line
    return out


def write_workspace(root: Path, modules: list[str]) -> list[dict]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    (root / ".git").mkdir(parents=True)  # lsp/efim.lua's root marker: the folder is the workspace
    files = []
    for name in modules:
        src = stdlib / f"{name}.py"
        text = src.read_text(encoding="utf-8")
        path = root / (name.replace("/", "_") + ".py")
        path.write_text(text, encoding="utf-8")
        lines = body_lines(text)
        if not lines:
            raise ValueError(f"{src} has no function body to jump into")
        files.append({"module": name, "path": path, "lines": lines, "line_count": text.count("\n") + 1})
    return files


# --- the tapped LSP traffic ---------------------------------------------------------------


class TapLog:
    """bench/lsp_tap.py's log, read incrementally: `entries` grows with each `poll()`."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.entries: list[dict] = []
        self._offset = 0
        self._partial = b""

    def poll(self) -> list[dict]:
        if not self.path.exists():
            return self.entries
        with open(self.path, "rb") as f:
            f.seek(self._offset)
            data = f.read()
        self._offset += len(data)
        data = self._partial + data
        *complete, self._partial = data.split(b"\n")
        self.entries.extend(json.loads(line) for line in complete if line.strip())
        return self.entries

    def sent(self, method: str, start: int = 0) -> list[dict]:
        return [e for e in self.entries[start:] if e["dir"] == "in" and e["message"].get("method") == method]

    def answer(self, request_id, start: int = 0) -> dict | None:
        for e in self.entries[start:]:
            m = e["message"]
            if e["dir"] == "out" and "method" not in m and m.get("id") == request_id:
                return e
        return None


# --- one run ------------------------------------------------------------------------------


def _clock_offset(nvim) -> float:
    """Neovim's vim.uv.hrtime() (s) minus this process's time.monotonic(): 0 on Linux, measured anyway."""
    best = None
    for _ in range(5):
        t1 = time.monotonic()
        hr = nvim.lua("return vim.uv.hrtime()")
        t2 = time.monotonic()
        if best is None or t2 - t1 < best[0]:
            best = (t2 - t1, hr / 1e9 - (t1 + t2) / 2)
    return best[1]


def _wait_group_gone(pgid: int, timeout: float = 10.0) -> None:
    """Until no process of Neovim's group (the tap and the server) is left, at most `timeout` s."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except (ProcessLookupError, PermissionError):
            return
        time.sleep(0.05)


def _ms(x: float | None) -> float | None:
    return None if x is None else round(x * 1000, 1)


def _stats(nvim, reset: bool) -> dict:
    stats = nvim.lua("return efim_bench_stats(...)", reset, timeout=15)
    return stats if isinstance(stats, dict) else {}


def _one_jump(nvim, tap: TapLog, jump: dict, files: list[dict], args, offset: float) -> dict:
    target = files[jump["file"]]
    uri = target["path"].as_uri()
    start = len(tap.poll())
    nvim.lua("efim_bench_reset()")
    on_buffer = nvim.lua("return vim.api.nvim_get_current_buf()") == target["bufnr"]
    keys = ("" if on_buffer else f":buffer {target['bufnr']}<CR>") + f"{jump['line']}G"
    t_jump = time.monotonic()
    nvim.input(keys)
    wait_until(lambda: nvim.lua("return vim.api.nvim_get_current_buf() == ... and vim.api.nvim_win_get_cursor(0)[1] == select(2, ...)",
                           target["bufnr"], jump["line"]), 5, f"the jump to {target['path'].name}:{jump['line']}", 0.005)
    if not args.no_pause:
        time.sleep(max(0.0, t_jump + args.pause - time.monotonic()))
    t0 = time.monotonic()
    nvim.input("A")
    record: dict = {**jump, "file": target["path"].name, "switched": not on_buffer, "pause_s": round(t0 - t_jump, 3)}

    # The first request after `A` and its answer, from the tap; then the ghost, from Neovim.
    deadline = t0 + args.wait
    request = reply = None
    while time.monotonic() < deadline:
        tap.poll()
        if request is None:  # the first one for this document (the pinned build also asks for the others)
            after = [e for e in tap.sent("textDocument/inlineCompletion", start)
                     if e["t"] >= t0 and e["message"]["params"]["textDocument"]["uri"] == uri]
            request = after[0] if after else None
        if request is not None:
            reply = tap.answer(request["message"]["id"], start)
            if reply is not None:
                break
        time.sleep(0.01)
    probe = {}
    if reply is not None:
        message = reply["message"]
        result = message.get("result")
        items = (result.get("items") if isinstance(result, dict) else result) or []
        if "error" in message:
            record["outcome"] = "error"
            record["error"] = message["error"]
        elif items:
            record["outcome"] = "shown"
            try:
                probe = wait_until(lambda: (p := nvim.lua("return efim_bench"))["ghost_at"] is not None and p, 2.0, "the ghost text")
            except TimeoutError:
                record["outcome"] = "not drawn"  # answered with an item, no extmark within 2 s
        else:
            record["outcome"] = "none"
    else:
        record["outcome"] = "timeout"
    probe = probe or nvim.lua("return efim_bench")
    if probe.get("ghost_at") is not None and record["outcome"] != "shown":
        record["ghost_from_other_request"] = True  # a later request drew one (counted as shown)
        record["outcome"] = "shown"
    if record["outcome"] == "shown":
        record["ghost"] = "\n".join(g["text"] for g in nvim.lua("return efim_ghost()"))[:200]
    record["to_ghost_ms"] = _ms(probe["ghost_at"] / 1e9 - offset - t0) if probe.get("ghost_at") is not None else None
    record["to_insert_enter_ms"] = _ms(probe["insert_at"] / 1e9 - offset - t0) if probe.get("insert_at") is not None else None
    record["to_request_ms"] = _ms(request["t"] - t0) if request else None
    record["request_to_answer_ms"] = _ms(reply["t"] - request["t"]) if reply and request else None

    nvim.input("<Esc>")
    wait_until(lambda: nvim.lua("return vim.api.nvim_get_mode().mode == 'n'"), 5, "normal mode")
    stats = _stats(nvim, reset=True)  # this jump's: the previous jump's reset to here
    tap.poll()
    asked = [e["message"]["params"]["textDocument"]["uri"] for e in tap.sent("textDocument/inlineCompletion", start) if e["t"] >= t0]
    record["inline_requests"] = asked.count(uri)
    record["inline_requests_other_documents"] = len(asked) - asked.count(uri)
    record["did_move_cursor"] = len(tap.sent("efim/didMoveCursor", start))
    record["server"] = {
        "requests": stats.get("requests"),
        # The request's TTFT when it was the only one the server computed in this jump; else the p50 of all.
        "ttft_ms": ((stats.get("ttftMs") or {}).get("p50") or None) if stats.get("requests") == 1 else None,
        "ttft_ms_all_p50": (stats.get("ttftMs") or {}).get("p50") or None,
        "prompt_tokens": stats.get("promptTokens"),
        "prefilled_tokens": stats.get("prefilledTokens"),
        "reused_tokens": stats.get("reusedTokens"),
        "first_window_warmups": stats.get("firstWindowWarmups"),
        "first_window_answers": stats.get("firstWindowAnswers"),
        "warmup": stats.get("warmup"),
    }
    return record


def run(args: argparse.Namespace) -> dict:  # noqa: PLR0915 — one straight run: set up, jump, report
    from bench.nvim_driver import GHOST_FN, PLUGIN, TAP, EmbeddedNvim, modern_nvim_path, nvim_version  # noqa: PLC0415
    from efim_tools.trace.client import measured_server_env  # noqa: PLC0415

    exe = args.nvim or str(modern_nvim_path())
    if not (os.path.isfile(exe) and os.access(exe, os.X_OK)):
        raise SystemExit(f"Neovim 0.12 not found at {exe}: `bash editors/setup.sh` installs it (or pass --nvim / set EFIM_NVIM_MODERN)")
    version = nvim_version(exe)
    if version < (0, 12, 0):
        raise SystemExit(f"{exe} is Neovim {'.'.join(map(str, version))}: vim.lsp.inline_completion needs 0.12")
    settings = json.loads(args.config) if args.config else None
    if settings is not None and not isinstance(settings, dict):
        raise SystemExit("--config must be a JSON object")
    modules = [m.strip().removesuffix(".py") for m in args.files.split(",") if m.strip()]

    with tempfile.TemporaryDirectory(prefix="efim-nvim-first-", ignore_cleanup_errors=True) as tmp_name:
        tmp = Path(tmp_name)
        keep = args.out
        base = keep if keep is not None else tmp
        base.mkdir(parents=True, exist_ok=True)
        work, bin_dir, xdg = base / "workspace", tmp / "bin", base / "xdg"
        files = write_workspace(work, modules)
        jumps = plan_jumps(files, args.jumps, seed=args.seed, switch_rate=args.switch_rate, far=args.far)
        log = base / "lsp.jsonl"
        bin_dir.mkdir()
        shim = bin_dir / "efim"  # what `cmd = { "efim", "serve" }` finds first on PATH
        model_args = shlex.join(["--model", args.model]) if args.model else ""
        server = shlex.join([sys.executable, str(TAP), str(log), "--", sys.executable, "-m", "efim_tools.cli"])
        shim.write_text(f'#!/bin/sh\nexec {server} "$@" {model_args}\n')  # "$@": serve
        shim.chmod(0o755)
        env = measured_server_env(None, str(tmp / "kv"))
        for var in ("XDG_CONFIG_HOME", "XDG_DATA_HOME", "XDG_STATE_HOME", "XDG_CACHE_HOME"):
            env[var] = str(xdg / var.lower())  # no user config; Neovim's lsp.log stays here
        env["PATH"] = os.pathsep.join((str(bin_dir), env.get("PATH", "")))
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(PLUGIN.parents[1]), env.get("PYTHONPATH")) if p)
        nvim = EmbeddedNvim(["-u", "NONE", "-i", "NONE", "-n", "--cmd", f"set rtp^={PLUGIN}"], cwd=str(work), env=env, binary=exe)
        try:
            nvim.command("filetype on")
            nvim.lua(GHOST_FN)
            nvim.lua(PROBE)
            if args.scoped_autocmds:
                nvim.lua(SCOPE_AUTOCMDS)
            if settings is not None:
                nvim.lua("vim.lsp.config('efim', { init_options = ... })", settings)
            nvim.lua("vim.lsp.enable('efim'); vim.lsp.inline_completion.enable()")  # the user's two lines
            for f in files:
                nvim.command(f"edit {f['path']}")
                f["bufnr"] = nvim.lua("return vim.api.nvim_get_current_buf()")
            tap = TapLog(log)
            t_start = time.monotonic()
            try:
                wait_until(lambda: nvim.lua("local c = vim.lsp.get_clients({ name = 'efim' })[1] return c ~= nil and c.initialized"),
                      60, "the efim client from lsp/efim.lua to initialize", 0.1)
                wait_until(lambda: tap.poll() is not None and len(tap.sent("textDocument/didOpen")) >= len(files), 30, "didOpen of every file", 0.1)

                def ready():
                    state = (_stats(nvim, reset=False).get("model") or {})
                    if state.get("state") == "failed":
                        raise SystemExit(f"the model failed to load: {state.get('error')}")
                    return state.get("state") == "ready" and state

                model = wait_until(ready, args.ready_timeout, "the model to load", 0.5)
            except TimeoutError:
                lsp_log = xdg / "xdg_state_home" / "nvim" / "lsp.log"
                if lsp_log.exists():
                    print(lsp_log.read_text(errors="replace")[-3000:], file=sys.stderr)
                raise
            load_s = time.monotonic() - t_start
            time.sleep(args.settle)
            nvim.command(f"buffer {files[0]['bufnr']}")
            nvim.input("gg")
            time.sleep(0.3)
            opening = _stats(nvim, reset=True)
            offset = _clock_offset(nvim)
            records = []
            for i, jump in enumerate(jumps):
                record = _one_jump(nvim, tap, jump, files, args, offset)
                records.append(record)
                shown = f"{record['to_ghost_ms']:.0f} ms" if record["to_ghost_ms"] is not None else record["outcome"]
                print(f"jump {i + 1:>3}/{len(jumps)} {record['kind']:<10} {record['file']}:{record['line']:<5} {shown}", file=sys.stderr, flush=True)
            tap.poll()
            errors = [e["message"]["params"]["message"] for e in tap.entries if e["dir"] == "out"
                      and e["message"].get("method") == "window/showMessage" and e["message"]["params"].get("type") == 1]
        finally:
            nvim.close()
            _wait_group_gone(nvim.proc.pid)  # the server may still be writing its KV files into tmp
    setup = {
        "nvim": exe, "nvim_version": ".".join(map(str, version)), "model": args.model or "default", "config": settings,
        "files": [{"module": f["module"], "lines": f["line_count"], "body_lines": len(f["lines"])} for f in files],
        "seed": args.seed, "jumps": args.jumps, "pause_s": 0.0 if args.no_pause else args.pause, "no_pause": args.no_pause,
        "switch_rate": args.switch_rate, "far": args.far, "wait_s": args.wait, "settle_s": args.settle,
        "client_debounce_ms": DEBOUNCE_MS, "scoped_autocmds": args.scoped_autocmds, "threads_machine": os.cpu_count(), "clock_offset_ms": round(offset * 1000, 3),
        "model_load_s": round(load_s, 1), "model_info": model.get("info"),
    }
    return {"setup": setup, "summary": summarise(records), "opening_stats": _slim(opening), "server_errors": errors, "jumps": records}


def _slim(stats: dict) -> dict:
    return {k: stats.get(k) for k in ("requests", "ttftMs", "promptTokens", "prefilledTokens", "firstWindowWarmups", "firstWindowAnswers", "warmup")}


# --- the report ---------------------------------------------------------------------------


def _pct(values: list[float], q: float) -> float | None:
    from bench.percentiles import percentile  # noqa: PLC0415

    return round(percentile(values, q), 1) if values else None


def _cell(records: list[dict]) -> dict:
    to_ghost = [r["to_ghost_ms"] for r in records if r["outcome"] == "shown" and r["to_ghost_ms"] is not None]
    outcomes = [r["outcome"] for r in records]

    def med(key: str) -> float | None:
        return _pct([r[key] for r in records if r.get(key) is not None], 50)

    ttft = [r["server"]["ttft_ms"] for r in records if r["server"].get("ttft_ms")]
    return {
        "jumps": len(records),
        "shown": outcomes.count("shown"),
        "none": outcomes.count("none"),
        "timeout": outcomes.count("timeout"),
        "error": outcomes.count("error"),
        "not_drawn": outcomes.count("not drawn"),
        "to_ghost_ms": {"p50": _pct(to_ghost, 50), "p90": _pct(to_ghost, 90), "max": max(to_ghost) if to_ghost else None},
        "to_request_ms_p50": med("to_request_ms"),
        "request_to_answer_ms_p50": med("request_to_answer_ms"),
        "server_ttft_ms": {"p50": _pct(ttft, 50), "p90": _pct(ttft, 90), "n": len(ttft)},
        "did_move_cursor": sum(r["did_move_cursor"] for r in records),
        "inline_requests": sum(r["inline_requests"] for r in records),
        "inline_requests_other_documents": sum(r["inline_requests_other_documents"] for r in records),
    }


def summarise(records: list[dict]) -> dict:
    warm = [r["server"].get("warmup") or {} for r in records]
    out = {"all": _cell(records)}
    for kind in ("same-file", "other-file"):
        picked = [r for r in records if r["kind"] == kind]
        if picked:
            out[kind] = _cell(picked)
    out["warmup"] = {k: sum(w.get(k) or 0 for w in warm) for k in ("submitted", "completed", "cancelled", "prefilledTokens")}
    out["first_window"] = {
        "warmups": sum(r["server"].get("first_window_warmups") or 0 for r in records),
        "answers": sum(r["server"].get("first_window_answers") or 0 for r in records),
    }
    return out


def table(result: dict) -> str:
    s, summary = result["setup"], result["summary"]

    def num(x) -> str:
        return "-" if x is None else f"{x:.0f}"

    pause = "A at once" if s["no_pause"] else f"pause {s['pause_s']:g} s"
    lines = [
        f"Neovim {s['nvim_version']} + lsp/efim.lua, model {s['model']}, {pause}, seed {s['seed']}, "
        f"files {', '.join(f['module'] for f in s['files'])}",
        f"{'':<11}{'jumps':>6}{'shown':>7}{'none':>6}{'other':>7}{'p50 ms':>8}{'p90 ms':>8}{'max ms':>8}"
        f"{'A→request':>11}{'→answer':>9}{'TTFT p50':>10}",
    ]
    for name in ("all", "same-file", "other-file"):
        c = summary.get(name)
        if not c:
            continue
        g = c["to_ghost_ms"]
        other = c["timeout"] + c["error"] + c["not_drawn"]
        lines.append(
            f"{name:<11}{c['jumps']:>6}{c['shown']:>7}{c['none']:>6}{other:>7}{num(g['p50']):>8}{num(g['p90']):>8}{num(g['max']):>8}"
            f"{num(c['to_request_ms_p50']):>11}{num(c['request_to_answer_ms_p50']):>9}{num(c['server_ttft_ms']['p50']):>10}"
        )
    a, w, fw = summary["all"], summary["warmup"], summary["first_window"]
    lines.append(
        f"time to ghost text: `A` sent → the built-in client's extmark (includes its {s['client_debounce_ms']} ms debounce); "
        f"other = timeout {a['timeout']}, error {a['error']}, not drawn {a['not_drawn']}"
    )
    lines.append(
        f"efim/didMoveCursor sent by lsp/efim.lua: {a['did_move_cursor']}; warm-ups submitted {w['submitted']}, completed {w['completed']}, "
        f"cancelled {w['cancelled']}; first-window warm-ups {fw['warmups']}, answers {fw['answers']}"
    )
    lines.append(
        f"textDocument/inlineCompletion after `A`: {a['inline_requests']} for the document, {a['inline_requests_other_documents']} for "
        f"the other open documents at the same position{' (autocommands scoped as after neovim#35965)' if s['scoped_autocmds'] else ''}; "
        f"TTFT: the server's, for jumps where it computed one request ({a['server_ttft_ms']['n']})"
    )
    if result["server_errors"]:
        lines.append(f"server errors shown: {result['server_errors'][:3]}")
    return "\n".join(lines)


def run_cli(args: argparse.Namespace) -> int:
    result = run(args)
    print(table(result))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1, default=str) + "\n")
        print(f"wrote {args.json}", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run_cli(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
