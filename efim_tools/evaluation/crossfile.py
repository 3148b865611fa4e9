"""Repository-level completion (`efim eval crossfile`, issue #33): lines whose completion
needs a name defined in another file of the same package, asked of the real server.

Packages (`resolve_package`): a package importable here (`importlib.util.find_spec`: a
standard-library package such as `email`, an installed library) or a folder, read at run
time (nothing is copied into the repository). It must hold at least two modules; test
folders and `__pycache__` are left out.

Targets (`find_targets`): in one module of the package, the first place a name appears
that (a) another module of the package defines at its top level (def, class, assignment),
(b) the module itself does not define at its top level, and (c) does not appear as a whole
word anywhere earlier in the module (code, comments or strings). The place must be a use in
code: a name read, an attribute read off a name (`utils.formatdate`), or a name imported
from the package itself (`from .utils import formatdate`). Builtins, keywords, dunders and
names shorter than 3 characters are left out. The cursor sits right before the name: the
line's text before it is kept, the rest of the line is what is expected, the lines below
stay as the suffix. One target per line (its leftmost name); a seeded sample per package.

Prompts (`run_package`): a fresh `efim serve` per package and configuration, over stdio
(`efim_tools.trace.client`), its root URI and workspace folder the package's folder, so
the cross-file context indexes the sibling modules. Before the first target the server's
index is built (a request on an empty scratch document starts it; its end is awaited),
then each target's module is opened with the line cut at the cursor, one
`textDocument/inlineCompletion` is asked there, and the module is closed. The prompt is the
server's own: window, template, context selection. Measured per target: the time from the
request written to the answer read (client side), and the server's TTFT and prompt tokens
from a reset `efim/stats` segment (`efim_tools.trace.probe`).

Scores (`score`): exact line (the suggestion, stripped, is the rest of the line, stripped),
name hit (the suggestion starts with the expected name as a whole word), edit similarity
(`linecompletion.edit_similarity` of the suggestion against the rest of the line).
"""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import tempfile
from typing import Any, NamedTuple

from efim_tools.crossfile_targets import (  # noqa: F401  (re-exported: the eval's targets)
    SKIP_DIRS,
    Package,
    PackageError,
    Target,
    code_uses,
    find_targets,
    module_targets,
    package_aliases,
    resolve_package,
    top_level_names,
)
from efim_tools.evaluation.linecompletion import edit_similarity
from efim_tools.trace.client import LspClient, measured_server_env
from efim_tools.trace.probe import RequestProbe
from efim_tools.trace.replay import client_capabilities, wait_ready
from efim_tools.trace.report import percentile

# Every setting the eval fixes (the rest are the server's defaults). `firstWindowTokens` 0:
# a just-opened file's first answer would otherwise come from a small window around the
# cursor that carries no context chunks at all (efim_lsp.warm_ahead, efim_lsp.first_window).
BASE_SETTINGS: dict[str, Any] = {"timeoutMs": 0, "maxTokens": 16, "multiline": "never", "firstWindowTokens": 0}
WARMUP_URI = "untitled:efim-crossfile-warmup"
SELECTIONS = ("imports", "bm25")  # the server's `contextSelection`


class Config(NamedTuple):
    name: str
    settings: dict[str, Any]


class Record(NamedTuple):
    config: str
    package: str
    file: str
    line_no: int
    column: int
    name: str
    defined_in: tuple[str, ...]
    expected: str
    suggestion: str
    name_hit: bool
    exact: bool
    edit_similarity: float
    latency_ms: float  # client side: request written -> answer read
    ttft_ms: float | None  # server: request arrival -> first generated token
    prompt_tokens: float | None
    declined: str | None  # why the server answered with nothing (efim/stats "declined")
    # What the context costs later in the same session (`keystrokes`, `jump` in `_ask`):
    # per keystroke typed after the first answer, (client ms, server TTFT ms or None when the
    # answer needed no engine request: typed through); then the first answer after a jump.
    keystrokes: tuple[tuple[float, float | None], ...] = ()
    jump: tuple[float, float | None] | None = None
    import_names: bool = False  # the first answer was the workspace's names for an import list (no model)


# -- scores -------------------------------------------------------------------------------
def name_hit(suggestion: str, name: str) -> bool:
    """The suggestion starts with `name` as a whole word."""
    return re.match(re.escape(name) + r"(?!\w)", suggestion) is not None


def score(suggestion: str, target: Target) -> tuple[bool, bool, float]:
    """(name hit, exact line, edit similarity) of a suggestion at the target's cursor."""
    got = suggestion.split("\n", 1)[0].rstrip()
    return name_hit(got, target.name), got.strip() == target.rest.strip(), edit_similarity(got, target.rest)


def suggestion_at(result: Any, target: Target) -> str:
    """The first item's text from the cursor on (an item whose range starts before the
    cursor repeats what is there; that part is dropped)."""
    items = result.get("items") if isinstance(result, dict) else result
    if not items:
        return ""
    first = items[0]
    text = first.get("insertText")
    text = text.get("value", "") if isinstance(text, dict) else (text or "")
    start = ((first.get("range") or {}).get("start") or {})
    if start.get("line") == target.line_no - 1 and isinstance(start.get("character"), int) and start["character"] < target.character:
        typed = target.before.encode("utf-16-le")[2 * start["character"] :].decode("utf-16-le", "ignore")
        text = text.removeprefix(typed)
    return text


# -- asking the server --------------------------------------------------------------------
def configurations(contexts: list[str], chunks: list[int] | None = None, tokens: list[int] | None = None, extra: dict[str, Any] | None = None) -> list[Config]:
    """One configuration per context mode (`off`, `prefix`, `blend`), crossed with the
    `contextChunks` and `contextTokens` values for the modes that use them."""
    configs = []
    for spec in contexts:
        mode, _, selection = spec.partition(":")
        if mode not in ("off", "prefix", "blend") or (selection and (mode == "off" or selection not in SELECTIONS)):
            raise ValueError(f"unknown context configuration {spec!r} (off, prefix, blend; prefix/blend may add :imports or :bm25)")
        for c in (chunks or [None]) if mode != "off" else [None]:
            for t in (tokens or [None]) if mode != "off" else [None]:
                settings = {**BASE_SETTINGS, **(extra or {}), "context": mode}
                if selection:
                    settings["contextSelection"] = selection
                name = spec
                if c is not None:
                    settings["contextChunks"], name = c, f"{name}/chunks {c}"
                if t is not None:
                    settings["contextTokens"], name = t, f"{name}/tokens {t}"
                configs.append(Config(name, settings))
    return configs


async def _build_index(client: LspClient, context: str, timeout_s: float, request_timeout_s: float) -> dict[str, Any] | None:
    """A request on an empty scratch document (the model takes time to load on its first
    request; the server indexes its workspace from `initialized` on); then, with context on,
    wait until the index is built and, with blend, the chunk KV it computes ahead
    (`context.kv`) is done. The status returned carries `readyS`, the seconds this took."""
    await client.notify("textDocument/didOpen", {"textDocument": {"uri": WARMUP_URI, "languageId": "python", "version": 1, "text": ""}})
    await _answer(client, await client.send_request("textDocument/inlineCompletion", {
        "textDocument": {"uri": WARMUP_URI}, "position": {"line": 0, "character": 0}, "context": {"triggerKind": 2}}), request_timeout_s)
    await client.notify("textDocument/didClose", {"textDocument": {"uri": WARMUP_URI}})
    started = asyncio.get_running_loop().time()
    deadline = started + timeout_s
    while True:
        status = (await client.request("efim/stats", None) or {}).get("context")
        kv = (status or {}).get("kv") or {} if isinstance(status, dict) else {}
        ahead_done = not kv.get("queued") and not kv.get("running")
        done = isinstance(status, dict) and status.get("files") and not status.get("indexing") and ahead_done
        if context == "off" or not isinstance(status, dict) or done or asyncio.get_running_loop().time() > deadline:
            if isinstance(status, dict):
                status = {**status, "readyS": round(asyncio.get_running_loop().time() - started, 1)}
            return status
        await asyncio.sleep(0.1)


async def _answer(client: LspClient, pending, timeout_s: float) -> Any:
    try:
        return await asyncio.wait_for(client.result(pending), timeout_s)
    except asyncio.TimeoutError:
        raise TimeoutError(f"no answer to {pending.method} within {timeout_s:.0f} s; server stderr:\n{client.stderr_tail()}") from None


# After each target's first answer: this many keystrokes (the expected text's first
# characters, a request each), then one jump (a new line opened JUMP_LINES above, a request
# there): what the context costs once the file is open, next to what it costs first.
KEYSTROKES = 3
JUMP_LINES = 30


async def _ask(client: LspClient, probe: RequestProbe, package: Package, target: Target, config: Config, timeout_s: float,
               keystrokes: int = KEYSTROKES, jump: bool = True) -> Record:
    uri = (package.root / target.file).as_uri()
    await client.notify("textDocument/didOpen", {"textDocument": {"uri": uri, "languageId": "python", "version": 1, "text": target.text}})
    latency, ttft, result, seg = await _request(client, probe, uri, target.line_no - 1, target.character, timeout_s)
    suggestion = suggestion_at(result, target)
    hit, exact, sim = score(suggestion, target)
    declined = [k for k, v in (seg.get("declined") or {}).items() if v]
    version, line, character = 1, target.line_no - 1, target.character
    keys = []
    for ch in target.rest[:keystrokes]:  # typed as the person would: the expected text, one key each
        version += 1
        await _insert(client, uri, version, line, character, ch)
        character += len(ch.encode("utf-16-le")) // 2
        ms, key_ttft, _, _ = await _request(client, probe, uri, line, character, timeout_s)
        keys.append((round(ms, 1), key_ttft))
    jumped = None
    if jump:  # a new line under a line JUMP_LINES above (or below, near the top), indented as that line
        lines = target.text.split("\n")
        at = target.line_no - 1 - JUMP_LINES if target.line_no - 1 >= JUMP_LINES else min(len(lines) - 1, target.line_no - 1 + JUMP_LINES)
        if at != target.line_no - 1:
            above = lines[at]
            indent = above[: len(above) - len(above.lstrip())]
            version += 1
            await _insert(client, uri, version, at, len(above.encode("utf-16-le")) // 2, "\n" + indent)
            ms, jump_ttft, _, _ = await _request(client, probe, uri, at + 1, len(indent.encode("utf-16-le")) // 2, timeout_s)
            jumped = (round(ms, 1), jump_ttft)
    await client.notify("textDocument/didClose", {"textDocument": {"uri": uri}})
    return Record(config.name, package.name, target.file, target.line_no, target.column, target.name, target.defined_in, target.rest,
                  suggestion, hit, exact, round(sim, 4), round(latency, 1), ttft, seg.get("promptTokens"),
                  declined[0] if declined and not suggestion else None, tuple(keys), jumped, bool(seg.get("importNames")))


async def _insert(client: LspClient, uri: str, version: int, line: int, character: int, text: str) -> None:
    at = {"line": line, "character": character}
    await client.notify("textDocument/didChange", {"textDocument": {"uri": uri, "version": version},
                                                   "contentChanges": [{"range": {"start": at, "end": at}, "text": text}]})


async def _request(client: LspClient, probe: RequestProbe, uri: str, line: int, character: int,
                   timeout_s: float) -> tuple[float, float | None, Any, dict[str, Any]]:
    """One inline-completion request, awaited: (client ms, server TTFT ms — None when no
    engine request answered it —, the result, the server's stats segment for it)."""
    pending = await client.send_request("textDocument/inlineCompletion", {
        "textDocument": {"uri": uri}, "position": {"line": line, "character": character}, "context": {"triggerKind": 2}})
    result = await _answer(client, pending, timeout_s)
    seg = await probe.segment() or {}
    ttft = (seg.get("ttftMs") or {}).get("p50") if seg.get("requests") == 1 else None
    return pending.latency_ms, ttft or None, result, seg


async def run_package(package: Package, targets: list[Target], config: Config, server: list[str], *,
                      env: dict[str, str] | None = None, ready_timeout_s: float = 900.0, index_timeout_s: float = 300.0,
                      request_timeout_s: float = 600.0, on_target=None, keystrokes: int = KEYSTROKES,
                      jump: bool = True) -> tuple[list[Record], dict[str, Any] | None]:
    """The targets of one package on a fresh server under `config`: their records, and the
    server's context index status once built (None when the server has none)."""
    kv_dir = tempfile.mkdtemp(prefix="efim-crossfile-kv-")
    client = LspClient(server, env=measured_server_env(env, kv_dir), settings=config.settings)
    await client.start()
    try:
        root = package.root.as_uri()
        capabilities = client_capabilities("utf-16")
        capabilities["workspace"]["workspaceFolders"] = True
        await client.request("initialize", {
            "processId": os.getpid(), "clientInfo": {"name": "efim eval crossfile", "version": "1"}, "rootUri": root,
            "workspaceFolders": [{"uri": root, "name": package.name}], "capabilities": capabilities,
            "initializationOptions": config.settings})
        await client.notify("initialized", {})
        await wait_ready(client, ready_timeout_s)
        index = await _build_index(client, config.settings.get("context", "off"), index_timeout_s, request_timeout_s)
        probe = RequestProbe(client)
        await probe.segment()  # zero the counters: the scratch request is not measured
        records = []
        for target in targets:
            records.append(await _ask(client, probe, package, target, config, request_timeout_s, keystrokes, jump))
            if on_target is not None:
                on_target(records[-1])
        return records, index
    finally:
        await client.close()
        shutil.rmtree(kv_dir, ignore_errors=True)


# -- the table ----------------------------------------------------------------------------
class Row(NamedTuple):
    config: str
    package: str
    n: int
    name_hit: float
    exact: float
    edit_similarity: float
    empty: int  # answers with no suggestion
    latency_ms_p50: float | None
    latency_ms_p95: float | None
    ttft_ms_p50: float | None
    prompt_tokens_p50: float | None
    keystroke_ms_p50: float | None = None  # client side, every keystroke after the first answer
    keystroke_ttft_ms_p50: float | None = None  # server, the keystrokes the engine answered
    jump_ms_p50: float | None = None  # the first answer after the jump: client side
    jump_ttft_ms_p50: float | None = None  # ... and server TTFT


def summarize(config: str, package: str, records: list[Record]) -> Row:
    n = len(records)

    def mean(values) -> float:
        return round(sum(values) / n, 3) if n else 0.0

    latencies = [r.latency_ms for r in records]
    return Row(config, package, n, mean(r.name_hit for r in records), mean(r.exact for r in records),
               mean(r.edit_similarity for r in records), sum(not r.suggestion for r in records),
               percentile(latencies, 50), percentile(latencies, 95),
               percentile([r.ttft_ms for r in records if r.ttft_ms is not None], 50),
               percentile([r.prompt_tokens for r in records if r.prompt_tokens is not None], 50),
               percentile([ms for r in records for ms, _ in r.keystrokes], 50),
               percentile([t for r in records for _, t in r.keystrokes if t is not None], 50),
               percentile([r.jump[0] for r in records if r.jump], 50),
               percentile([r.jump[1] for r in records if r.jump and r.jump[1] is not None], 50))


def table(rows: list[Row]) -> str:
    def num(value, fmt="{:.0f}") -> str:
        return "-" if value is None else fmt.format(value)

    out = ["| context | package | n | name hit | exact line | edit sim | empty | first answer p50 / p95 | server TTFT p50 | prompt tokens p50 "
           "| keystroke p50: client / TTFT | jump p50: client / TTFT |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r.config} | {r.package} | {r.n} | {r.name_hit:.3f} | {r.exact:.3f} | {r.edit_similarity:.3f} | {r.empty} | "
                   f"{num(r.latency_ms_p50)} / {num(r.latency_ms_p95)} ms | {num(r.ttft_ms_p50)} ms | {num(r.prompt_tokens_p50)} | "
                   f"{num(r.keystroke_ms_p50)} / {num(r.keystroke_ttft_ms_p50)} ms | {num(r.jump_ms_p50)} / {num(r.jump_ttft_ms_p50)} ms |")
    return "\n".join(out)


__all__ = [
    "BASE_SETTINGS", "Config", "Package", "PackageError", "Record", "Row", "Target", "code_uses", "configurations",
    "find_targets", "module_targets", "name_hit", "package_aliases", "resolve_package", "run_package", "score", "suggestion_at", "summarize",
    "table", "top_level_names",
]
