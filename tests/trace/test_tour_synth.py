"""Navigation tours (`efim trace synth --tour`): deterministic, exact, and shaped as our clients send them.

Exactness is checked twice over, independently of the synthesiser's own document: the
trace's LSP changes are applied to a fresh `TextDocument` (the replayer's model) and to
pygls' document, and after every change the text must be what the planned edits said
(`Tour.expected`, computed on plain strings)."""

from __future__ import annotations

import ast
import hashlib
import statistics
import sysconfig
from pathlib import Path

import msgspec
import pytest
from lsprotocol import types as lsp
from pygls.workspace import TextDocument as PyglsDocument

from efim_lsp.trace_format import DEFAULT_METHODS, read_trace
from efim_tools import cli
from efim_tools.trace.document import TextDocument, units
from efim_tools.trace.jumps import PAUSE_SPLIT_MS, derived_marks, jump_marks
from efim_tools.trace.tour import DEBOUNCE_MS, NO_PAUSE_MS, READING_MS, TourOptions, synthesize_tours

STDLIB = Path(sysconfig.get_paths()["stdlib"])
SOURCES = [STDLIB / "textwrap.py", STDLIB / "shlex.py", STDLIB / "csv.py"]

# CRLF line ends and characters outside the BMP (two UTF-16 units each) on the lines a tour edits.
TRICKY = (
    "import os\r\n"
    "\r\n"
    "\r\n"
    "def label(path, width=20):\r\n"
    "    name = os.path.basename(path) or path  # 📁 or 📄\r\n"
    "    if os.path.isdir(path):\r\n"
    "        name = '📁 ' + name + '𝄞'\r\n"
    "    return name.ljust(width)\r\n"
    "\r\n"
    "\r\n"
    "def total_size(paths):\r\n"
    "    total = 0  # bytes, 𝔟\r\n"
    "    for p in paths:\r\n"
    "        total += os.path.getsize(p)\r\n"
    "    return total\r\n"
    "\r\n"
    "\r\n"
    "class Box:\r\n"
    "    def area(self, 𝑤=1, h=2):\r\n"
    "        total = 𝑤 * h  # ≈ m²\r\n"
    "        return total + 1\r\n"
)


def sha1(text: str) -> str:
    return hashlib.sha1(text.encode("utf-8", "surrogatepass")).hexdigest()


def check_exact(tour) -> dict[str, str]:
    """Apply every change with two independent document models; compare with the plan."""
    ours: dict[str, TextDocument] = {}
    theirs: dict[str, PyglsDocument] = {}
    expected = {index: (uri, digest) for index, uri, digest in tour.expected}
    changes = 0
    for i, event in enumerate(tour.trace.events):
        if event.kind == "open":
            item = event.params["textDocument"]
            ours[item["uri"]] = TextDocument(item["uri"], item["text"], item["version"])
            theirs[item["uri"]] = PyglsDocument(item["uri"], item["text"], version=item["version"])
        elif event.kind == "change":
            uri = event.uri
            for change in event.params["contentChanges"]:
                ours[uri].apply_change(change)
                rng = change["range"]
                theirs[uri].apply_change(
                    lsp.TextDocumentContentChangePartial(
                        range=lsp.Range(start=lsp.Position(**rng["start"]), end=lsp.Position(**rng["end"])),
                        text=change["text"],
                    )
                )
            changes += 1
            assert expected[i] == (uri, sha1(ours[uri].text)), f"event {i}"
            assert theirs[uri].source == ours[uri].text, f"event {i}"
    assert changes == len(tour.expected) > 0
    return {uri: doc.text for uri, doc in ours.items()}


def test_same_seed_same_tours_other_seed_other_tours():
    def encoded(seed):
        tours = synthesize_tours(SOURCES, TourOptions(seed=seed, sessions=2, visits=6))
        return [[msgspec.json.encode(e) for e in t.trace.events] for t in tours], [t.trace.header.meta for t in tours]

    assert encoded(4) == encoded(4)
    assert encoded(4)[0] != encoded(5)[0]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_stdlib_tours_replay_exactly_and_keep_python_parsing(seed):
    (tour,) = synthesize_tours(SOURCES, TourOptions(seed=seed, visits=10, undo_rate=0.5))
    final = check_exact(tour)
    assert len(final) == 3  # several files open in one trace
    for text in final.values():
        ast.parse(text)
    actions = tour.trace.header.meta["actions"]
    assert sum(v for k, v in actions.items() if k != "undo") == 10


@pytest.mark.parametrize("seed", range(4))
def test_crlf_and_astral_characters_stay_exact(tmp_path, seed):
    src = tmp_path / "tricky.py"
    src.write_bytes(TRICKY.encode("utf-8"))
    other = tmp_path / "other.py"
    other.write_bytes(TRICKY.replace("label", "name_of").encode("utf-8"))
    (tour,) = synthesize_tours([src, other], TourOptions(seed=seed, visits=8, files=2))
    final = check_exact(tour)
    for text in final.values():
        assert "\r\n" in text and "\n" not in text.replace("\r\n", "")  # edits keep CRLF
        ast.parse(text)


def test_cursor_events_point_where_the_next_edit_happens():
    tours = synthesize_tours(SOURCES, TourOptions(seed=3, sessions=3, visits=10))
    switches = same = 0
    for tour in tours:
        docs: dict[str, TextDocument] = {}
        last_cursor = None
        for event in tour.trace.events:
            if event.kind == "open":
                item = event.params["textDocument"]
                docs[item["uri"]] = TextDocument(item["uri"], item["text"])
            elif event.kind == "cursor":
                assert event.lsp_method == DEFAULT_METHODS["cursor"] == "efim/didMoveCursor"
                assert set(event.params) == {"textDocument", "position"}
                assert set(event.params["position"]) == {"line", "character"}
                doc = docs[event.uri]  # an open document
                pos = event.params["position"]
                lines = doc.text.split("\r\n") if "\r\n" in doc.text else doc.text.split("\n")
                assert 0 <= pos["line"] < len(lines)
                assert 0 <= pos["character"] <= units(lines[pos["line"]])
                last_cursor = event
            elif event.kind == "change":
                if last_cursor is not None:
                    # the first key after a jump edits at the landing position
                    (change,) = event.params["contentChanges"]
                    assert change["range"]["end"] == last_cursor.params["position"]
                    assert event.uri == last_cursor.uri
                    last_cursor = None
                docs[event.uri].apply_change(event.params["contentChanges"][0])
        jumps = tour.trace.header.meta["jumps"]
        switches += sum(j["switch"] for j in jumps)
        same += sum(not j["switch"] for j in jumps)
    assert switches > 3 and same > 3  # both kinds of jump


def test_every_jump_is_marked_with_its_pause():
    tours = synthesize_tours(SOURCES, TourOptions(seed=8, sessions=3, visits=12))
    pauses = []
    for tour in tours:
        trace = tour.trace
        marks = jump_marks(trace)
        assert len(marks) == 12 == len(trace.header.meta["jumps"])
        events = trace.events
        for i, mark in marks.items():
            assert events[i].kind == "complete" and events[i - 1].kind == "change"
            # the header's marks say what the events say
            cursor = max(j for j in range(i) if events[j].kind == "cursor")
            assert all(e.kind != "change" for e in events[cursor + 1 : i - 1])
            assert mark.pause_ms == pytest.approx(events[i - 1].t - events[cursor].t, abs=0.11)
        derived = derived_marks(trace)
        assert derived.keys() == marks.keys()
        assert [d.switch for d in derived.values()] == [m.switch for m in marks.values()]
        pauses += [m.pause_ms for m in marks.values()]
    paused = [p for p in pauses if p >= PAUSE_SPLIT_MS]
    quick = [p for p in pauses if p < READING_MS[0]]
    assert paused and quick
    for p in pauses:
        assert NO_PAUSE_MS[0] <= p <= NO_PAUSE_MS[1] + 0.1 or READING_MS[0] - 0.1 <= p <= READING_MS[1] + 0.1


def test_keys_come_at_a_persons_pace():
    (tour,) = synthesize_tours(SOURCES, TourOptions(seed=2, visits=12))
    events = tour.trace.events
    gaps = []
    previous = None
    for event in events:
        if event.kind == "cursor":
            previous = None
        elif event.kind == "change":
            (change,) = event.params["contentChanges"]
            typed = len(change["text"]) == 1 and change["range"]["start"] == change["range"]["end"]
            if previous is not None and typed:
                gaps.append(event.t - previous)
            previous = event.t
    assert len(gaps) > 30
    assert all(80 - 0.1 <= g <= 250 + 0.1 for g in gaps)
    assert 100 < statistics.median(gaps) < 200
    # the cursor notification leaves the debounce after the cursor settles: never at the edit's time
    cursors = [e.t for e in events if e.kind == "cursor"]
    assert cursors[0] >= DEBOUNCE_MS


def test_sources_without_functions_are_refused(tmp_path):
    flat = tmp_path / "flat.py"
    flat.write_text("x = 1\ny = 2\n")
    with pytest.raises(ValueError, match="at least 2 functions"):
        synthesize_tours([flat], TourOptions())
    with pytest.raises(ValueError, match="--visits"):
        synthesize_tours(SOURCES, TourOptions(visits=0))
    with pytest.raises(ValueError, match="--no-pause-rate"):
        synthesize_tours(SOURCES, TourOptions(no_pause_rate=1.5))


def test_tour_command_writes_readable_traces(tmp_path, capsys):
    out = tmp_path / "tours"
    argv = ["trace", "synth", "--tour", *map(str, SOURCES), "-o", str(out), "--sessions", "2", "--visits", "4", "--seed", "1",
            "--client-styles", "ours"]  # one style: the file names tours had before styles (the default: tests/trace/test_client_styles.py)
    assert cli.main(argv) == 0
    files = sorted(out.glob("tour-*.jsonl"))
    assert len(files) == 2
    for f in files:
        assert f.stat().st_mode & 0o777 == 0o600
        trace = read_trace(f)
        assert trace.header.meta["tour"] is True and trace.header.meta["seed"] == 1
        assert len(jump_marks(trace)) == 4
        assert any(e.kind == "cursor" for e in trace.events)
    assert "4 jumps" in capsys.readouterr().err
    assert cli.main(["trace", "synth", "--tour", str(SOURCES[0]), "-o", str(out), "--files", "0"]) == 2
    assert "--files" in capsys.readouterr().err
