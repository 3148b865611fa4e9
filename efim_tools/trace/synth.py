"""Synthetic typing sessions from real source files.

A session opens a file whose chosen function body is blanked, retypes the body as
`typist.type_block` says a person would — one `change` per key press, each followed
by a `complete` request at the cursor as editors send them — and closes the file.
Suggestions are not accepted here: whether a suggestion matches depends on the server
that answers, so the replayer accepts one when it equals what the trace types next.

Each session gets its own URI (`file:///efim-synth/sNNN/<name>`), so sessions replayed
side by side on one server never share a document, and no server reads the original
file (with the body still in it) from disk.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import NamedTuple

from efim_tools.trace.blocks import Block, find_blocks, typeable
from efim_tools.trace.document import TextDocument
from efim_lsp.trace_format import Event, Header, Trace, utc_now
from efim_tools.trace.typist import TypingStyle, type_block

LANGUAGE_IDS = {
    ".py": "python", ".pyi": "python", ".js": "javascript", ".jsx": "javascriptreact",
    ".ts": "typescript", ".tsx": "typescriptreact", ".c": "c", ".h": "c", ".cc": "cpp",
    ".cpp": "cpp", ".hpp": "cpp", ".java": "java", ".go": "go", ".rs": "rust", ".rb": "ruby",
    ".lua": "lua", ".cs": "csharp", ".kt": "kotlin", ".swift": "swift", ".php": "php",
}
SOURCE_SUFFIXES = frozenset(LANGUAGE_IDS)


class SynthOptions(NamedTuple):
    seed: int = 0
    sessions: int = 1
    style: TypingStyle = TypingStyle()
    min_chars: int = 80  # bodies shorter than this barely exercise a session
    max_chars: int = 700  # ~3 minutes of typing at 250 keys/min


class TypeableFile(NamedTuple):
    path: Path
    text: str
    blocks: list[Block]


def load_sources(paths: list[str | Path], options: SynthOptions) -> list[TypeableFile]:
    """Read each file (a directory stands for its source files) and find typeable blocks.

    Files are read as UTF-8 with their line endings untouched (CRLF stays CRLF)."""
    out = []
    for f, text in read_sources(paths):
        blocks = typeable(find_blocks(text, f), text, min_chars=options.min_chars, max_chars=options.max_chars)
        out.append(TypeableFile(f, text, blocks))
    return out


def read_sources(paths: list[str | Path]) -> list[tuple[Path, str]]:
    """(path, text) of each file; a directory stands for its source files. Read as UTF-8
    with line endings untouched; FileNotFoundError / ValueError name the file."""
    files: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            files.extend(sorted(f for f in p.iterdir() if f.suffix in SOURCE_SUFFIXES and f.is_file()))
        elif p.is_file():
            files.append(p)
        else:
            raise FileNotFoundError(f"{p}: no such source file")
    out = []
    for f in files:
        try:
            out.append((f, f.read_bytes().decode("utf-8")))
        except UnicodeDecodeError as exc:
            raise ValueError(f"{f}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    return out


def session_trace(source: TypeableFile, block: Block, options: SynthOptions, rng: random.Random, index: int) -> Trace:
    blank, keys = type_block(source.text, block, options.style, rng)
    uri = f"file:///efim-synth/s{index:03d}/{source.path.name}"
    doc = TextDocument(uri, blank, version=1)
    events = [
        Event(
            t=0.0,
            kind="open",
            params={
                "textDocument": {
                    "uri": uri,
                    "languageId": LANGUAGE_IDS.get(source.path.suffix, "plaintext"),
                    "version": 1,
                    "text": blank,
                }
            },
        )
    ]
    request_id = 0
    for key in keys:
        change = doc.edit(key.start, key.end, key.text)
        doc.version += 1
        events.append(
            Event(
                t=key.t,
                kind="change",
                params={"textDocument": {"uri": uri, "version": doc.version}, "contentChanges": [change]},
            )
        )
        request_id += 1
        events.append(
            Event(
                t=round(key.t + 1.0, 1),
                kind="complete",
                id=request_id,
                params={
                    "textDocument": {"uri": uri},
                    "position": doc.position_at(key.cursor).to_lsp(),
                    "context": {"triggerKind": 2},  # Automatic: the editor asked, not the user
                },
            )
        )
    if doc.text != source.text:  # the typist's contract; cheap to check, fatal to miss
        raise AssertionError(f"synthesised edits do not rebuild {source.path} ({block.name})")
    end = (keys[-1].t if keys else 0.0) + 1000.0
    events.append(Event(t=round(end, 1), kind="close", params={"textDocument": {"uri": uri}}))
    style = options.style
    header = Header(
        created=utc_now(),
        source="synth",
        client={"name": "efim trace synth"},
        meta={
            "file": str(source.path),
            "function": block.name,
            "body_start": block.start,
            "body_chars": block.end - block.start,
            "keys": len(keys),
            "seed": options.seed,
            "session": index,
            "wpm": style.wpm,
            "typo_rate": style.typo_rate,
            "jump_rate": style.jump_rate,
        },
    )
    return Trace(header=header, events=events)


def synthesize(paths: list[str | Path], options: SynthOptions) -> list[Trace]:
    """`options.sessions` traces, each a different block, files visited in random turns."""
    if options.sessions < 1:
        raise ValueError(f"--sessions must be at least 1, got {options.sessions}")
    sources = [s for s in load_sources(paths, options) if s.blocks]
    if not sources:
        raise ValueError(
            f"no function body of {options.min_chars}-{options.max_chars} characters found in the given sources"
        )
    rng = random.Random(options.seed)
    unused = {i: list(s.blocks) for i, s in enumerate(sources)}
    traces = []
    for index in range(options.sessions):
        live = [i for i, blocks in unused.items() if blocks]
        if not live:  # every block used: start over rather than fail
            unused = {i: list(s.blocks) for i, s in enumerate(sources)}
            live = list(unused)
        i = rng.choice(live)
        block = unused[i].pop(rng.randrange(len(unused[i])))
        traces.append(session_trace(sources[i], block, options, rng, index))
    return traces
