"""Synthesised typing: re-applying a trace's edits to the blank file gives the original back.

The edits are re-applied with pygls' own document model (an implementation independent of
ours), counting positions in UTF-16 as the trace says, so a position bug on our side shows
up as a mismatch rather than cancelling out."""

from __future__ import annotations

import sysconfig
from pathlib import Path

import pytest
from lsprotocol import types as lsp
from pygls.workspace import TextDocument as PyglsDocument

from efim_tools.trace.blocks import find_blocks
from efim_lsp.trace_format import read_trace, write_trace
from efim_tools.trace.synth import SynthOptions, synthesize
from efim_tools.trace.typist import TypingStyle

STDLIB = Path(sysconfig.get_paths()["stdlib"])

# CRLF line ends and characters outside the BMP (two UTF-16 units each) inside the bodies.
TRICKY = (
    'def greet(name):\r\n'
    '    """Say hello."""\r\n'
    '    prefix = "héllo 😀 𝄞"\r\n'
    '    if name:\r\n'
    '        return f"{prefix}, {name} 🎉!"\r\n'
    '\r\n'
    '    return prefix + " wörld"\r\n'
    '\r\n'
    '\r\n'
    'class Box:\r\n'
    '    def area(self, 𝑤=1, h=2):\r\n'
    '        total = 𝑤 * h  # ≈ m²\r\n'
    '        for _ in range(3):\r\n'
    '            total += 1\r\n'
    '        return total\r\n'
)


def replay_edits(trace) -> tuple[str, str]:
    """(text after `open`, text after every `change`), applied by pygls."""
    doc = None
    opened = ""
    for event in trace.events:
        if event.kind == "open":
            item = event.params["textDocument"]
            opened = item["text"]
            doc = PyglsDocument(item["uri"], item["text"], version=item["version"])
        elif event.kind == "change":
            for change in event.params["contentChanges"]:
                rng = change["range"]
                doc.apply_change(
                    lsp.TextDocumentContentChangePartial(
                        range=lsp.Range(
                            start=lsp.Position(**rng["start"]), end=lsp.Position(**rng["end"])
                        ),
                        text=change["text"],
                    )
                )
    return opened, doc.source


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_tricky_file_is_rebuilt_exactly(tmp_path, seed):
    src = tmp_path / "tricky.py"
    src.write_bytes(TRICKY.encode("utf-8"))
    style = TypingStyle(typo_rate=0.2, jump_rate=0.05)  # many typos and jumps on a short body
    traces = synthesize([src], SynthOptions(seed=seed, sessions=3, style=style, min_chars=20))
    kinds = set()
    for trace in traces:
        opened, final = replay_edits(trace)
        assert opened != TRICKY
        assert final == TRICKY
        assert "\r\n" in opened  # the blank file keeps its line endings
        kinds.update(e.kind for e in trace.events)
    assert kinds == {"open", "change", "complete", "close"}


def test_stdlib_sessions_round_trip_through_a_file(tmp_path):
    sources = [STDLIB / "textwrap.py", STDLIB / "json" / "decoder.py"]
    traces = synthesize(sources, SynthOptions(seed=7, sessions=4))
    for i, trace in enumerate(traces):
        path = write_trace(tmp_path / f"s{i}.jsonl", trace)
        back = read_trace(path)
        original = Path(back.header.meta["file"]).read_bytes().decode("utf-8")
        opened, final = replay_edits(back)
        assert final == original
        # one completion request per key press, each right after its change
        kinds = [e.kind for e in back.events]
        assert kinds.count("complete") == kinds.count("change") == back.header.meta["keys"]
        for a, b in zip(back.events, back.events[1:]):
            assert b.t >= a.t
            if b.kind == "complete":
                assert a.kind == "change"
    assert len({t.events[0].params["textDocument"]["uri"] for t in traces}) == 4


def test_typing_rate_follows_wpm(tmp_path):
    traces = synthesize([STDLIB / "argparse.py"], SynthOptions(seed=3, sessions=3, style=TypingStyle(wpm=50)))
    for trace in traces:
        changes = [e for e in trace.events if e.kind == "change"]
        minutes = (changes[-1].t - trace.events[0].t) / 60000.0
        rate = len(changes) / minutes
        assert 200 < rate < 260, rate  # ≈ 250 keys a minute, less the pause before the first key
        gaps = sorted(b.t - a.t for a, b in zip(changes, changes[1:]))
        median, p99 = gaps[len(gaps) // 2], gaps[int(len(gaps) * 0.99)]
        assert p99 > 4 * median  # skewed: pauses, not a metronome


def test_brace_and_indent_languages_find_blocks():
    js = "function f(a) {\n  const b = a + 1;\n  if (b) {\n    return '{';\n  }\n  return b;\n}\n"
    blocks = find_blocks(js, "x.js")
    bodies = {js[b.start : b.end] for b in blocks}
    assert "  const b = a + 1;\n  if (b) {\n    return '{';\n  }\n  return b;" in bodies
    yaml_like = "task:\n  run: yes\n  then: no\nother: 1\n"
    (block,) = find_blocks(yaml_like, "x.conf")
    assert yaml_like[block.start : block.end] == "  run: yes\n  then: no"


def test_bad_options_are_refused(tmp_path):
    with pytest.raises(ValueError, match="--wpm"):
        synthesize([STDLIB / "textwrap.py"], SynthOptions(style=TypingStyle(wpm=0)))
    empty = tmp_path / "empty.py"
    empty.write_text("x = 1\n")
    with pytest.raises(ValueError, match="no function body"):
        synthesize([empty], SynthOptions())
    with pytest.raises(FileNotFoundError):
        synthesize([tmp_path / "nope.py"], SynthOptions())


def test_synth_command_writes_private_traces(tmp_path, capsys):
    from efim_tools import cli

    out = tmp_path / "traces"
    assert cli.main(["trace", "synth", str(STDLIB / "textwrap.py"), "-o", str(out), "--sessions", "2", "--seed", "4"]) == 0
    files = sorted(out.glob("*.jsonl"))
    assert len(files) == 2
    for f in files:
        assert f.stat().st_mode & 0o777 == 0o600
        assert read_trace(f).header.meta["seed"] == 4
    assert "completion requests" in capsys.readouterr().err
    assert cli.main(["trace", "synth", str(STDLIB / "textwrap.py"), "-o", str(tmp_path / "one.jsonl"), "--sessions", "2"]) == 2
    assert "holds one session" in capsys.readouterr().err
