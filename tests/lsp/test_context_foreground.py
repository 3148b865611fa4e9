"""Background indexing gives way to requests and to the engine (`context.foreground`), and a
big workspace's index reads outlines only when asked (`context.definitions`)."""

from __future__ import annotations

import sys
import threading
import time

from efim_lsp.context import ContextGatherer
from efim_lsp.context.chunking import identifiers, split_chunks
from efim_lsp.context.foreground import ForegroundGate


def test_pause_point_returns_at_once_when_nothing_runs():
    gate = ForegroundGate()
    started = time.monotonic()
    gate.pause_point(5.0)
    assert time.monotonic() - started < 0.5
    assert gate.paused_s < 0.5


def test_pause_point_waits_for_the_request_and_no_longer():
    gate = ForegroundGate()
    done_at: list[float] = []

    def background() -> None:
        gate.pause_point(5.0)
        done_at.append(time.monotonic())

    with gate.busy():
        worker = threading.Thread(target=background)
        worker.start()
        time.sleep(0.3)
        assert not done_at  # still waiting while the request runs
        left = time.monotonic()
    worker.join(5)
    assert done_at and done_at[0] >= left
    assert done_at[0] - left < 1.0  # woken when the request ended, not at the 5 s cap
    assert gate.paused_s >= 0.25


def test_pause_point_gives_up_after_its_cap_under_constant_load():
    gate = ForegroundGate()
    with gate.busy():
        started = time.monotonic()
        gate.pause_point(0.2)
        waited = time.monotonic() - started
    assert 0.15 <= waited < 2.0


def test_pause_point_waits_while_the_engine_computes():
    gate = ForegroundGate()
    computing = threading.Event()
    computing.set()
    gate.watch_engine(computing.is_set)
    threading.Timer(0.3, computing.clear).start()
    started = time.monotonic()
    gate.pause_point(5.0)
    waited = time.monotonic() - started
    assert 0.25 <= waited < 2.0
    gate.watch_engine(None)  # no engine: nothing to wait for
    assert not gate.is_busy

    def broken() -> bool:
        raise RuntimeError("engine closed")

    gate.watch_engine(broken)
    assert not gate.is_busy  # an engine that fails to answer is not waited for


def test_scan_waits_while_a_request_runs(tmp_path):
    root = tmp_path / "ws"
    root.mkdir()
    for i in range(30):
        (root / f"m{i}.py").write_text(f"def f{i}(x):\n    return x + {i}\n")
    g = ContextGatherer(watch=False)
    try:
        with g.gate.busy():
            g.set_workspaces([root])
            time.sleep(0.5)
            during = g.status()["files"]
            assert g.status()["indexing"] is True
        assert during <= 1  # at most the file it was reading when the request came
        assert g.wait_idle(10)
        assert g.status()["files"] == 30
        assert g.status()["pausedS"] > 0.3
    finally:
        g.close()


def test_outlines_are_read_when_asked_and_never_from_changed_text(tmp_path):
    root = tmp_path / "ws"
    (root / "pkg").mkdir(parents=True)
    rates = root / "pkg" / "rates.py"
    rates.write_text('def exchange_rate(currency: str) -> float:\n    """The rate today."""\n    return RATES[currency]\n')
    g = ContextGatherer(watch=False)
    try:
        g.set_workspaces([root])
        assert g.wait_idle(10)
        assert not g.definitions._outlines  # noqa: SLF001 — indexing parsed no outline
        chunk = g.definition_chunk(str(rates), 200)
        assert chunk is not None and "def exchange_rate(currency: str) -> float" in chunk.text
        assert len(g.definitions._outlines) == 1  # noqa: SLF001
        # The file changes on disk and the index has not seen it yet (no watcher here): the
        # outline of the new text is not passed off as the indexed one's.
        rates.write_text("def other_rate():\n    pass\n")
        g.definitions.forget_rendered()
        g.definitions._outlines.clear()  # noqa: SLF001
        assert g.definition_chunk(str(rates), 200) is None
        # An open document's text is what the outline is read from.
        text = "def opened_rate(day):\n    return day\n"
        g.open_document(str(rates), text)
        g.select(str(root / "main.py"), "import pkg.rates\n", 0)  # refreshes the open document
        chunk = g.definition_chunk(str(rates), 200)
        assert chunk is not None and "def opened_rate(day)" in chunk.text
    finally:
        g.close()


def test_index_terms_are_shared_strings():
    text = "total_amount = compute_total(total_amount)\n"
    a = split_chunks("a.py", text)[0].terms
    b = split_chunks("b.py", "x = total_amount\n")[0].terms
    shared = next(k for k in a if k == "total_amount")
    assert shared is next(k for k in b if k == "total_amount")
    assert shared is sys.intern("total_amount")
    assert identifiers(text) == a  # the same counts either way
    assert identifiers("If Return self total") == {"total": 1}  # stop words dropped, lower-cased


def test_planning_the_popular_chunks_offers_pauses(tmp_path):
    root = tmp_path / "ws"
    (root / "pkg").mkdir(parents=True)
    (root / "pkg" / "__init__.py").write_text("")
    (root / "pkg" / "core.py").write_text("def shared(x):\n    return x\n")
    for i in range(5):
        (root / f"user{i}.py").write_text("from pkg.core import shared\n\nprint(shared(1))\n")
    g = ContextGatherer(watch=False)
    try:
        g.set_workspaces([root])
        assert g.wait_idle(10)
        pauses: list[int] = []
        chunks = g.popular_chunks(limit=4, pause=lambda: pauses.append(1))
        assert [c.path for c in chunks] == ["pkg/core.py"]
        assert len(pauses) >= 2  # while counting importers, and before the outline is read
        pauses.clear()
        assert g.import_chunks(str(root / "user0.py"), "from pkg.core import shared\n", pause=lambda: pauses.append(1))
        assert pauses
    finally:
        g.close()


def test_disk_files_chunks_are_kept_without_text_and_cut_back_out_when_asked():
    from efim_lsp.context.ranking import ChunkIndex

    files = {"/ws/rates.py": "def exchange_rate(currency):\n    return RATES[currency]\n" * 3}
    reads: list[str] = []

    def read_text(path: str):
        reads.append(path)
        return files.get(path)

    index = ChunkIndex(read_text=read_text)
    chunks = split_chunks("/ws/rates.py", files["/ws/rates.py"], 2)
    index.replace("/ws/rates.py", chunks, keep_text=False)
    assert all(c.text == "" for c in index._by_path["/ws/rates.py"])  # noqa: SLF001 — nothing of the text kept
    assert index.digests_of("/ws/rates.py") == tuple(c.digest for c in chunks) and not reads
    found = index.search(["exchange_rate", "currency"], limit=4)
    assert [s.chunk.text for s in found] and all(s.chunk.text in files["/ws/rates.py"] for s in found)
    assert {s.chunk.digest for s in found} <= {c.digest for c in chunks}
    assert reads == ["/ws/rates.py"]  # one read for every chunk of the file
    assert [c.text for c in index.chunks_of("/ws/rates.py")] == [c.text for c in chunks]
    # The file changes on disk before the index hears of it: its old chunks are not passed off
    # with the new text (and the lines read are forgotten when the file is indexed again).
    files["/ws/rates.py"] = "def other(x):\n    return x\n" * 3
    index.replace("/ws/other.py", split_chunks("/ws/other.py", "x = 1\n"), keep_text=False)
    index._texts.clear()  # noqa: SLF001 — as if evicted
    assert index.search(["exchange_rate"], limit=4) == []
    assert index.chunks_of("/ws/rates.py") == []
    index.replace("/ws/rates.py", split_chunks("/ws/rates.py", files["/ws/rates.py"], 2), keep_text=False)
    assert index.search(["other"], limit=4)[0].chunk.text.startswith("def other")
    # Kept text (an open document's) is handed back as kept, never read.
    reads.clear()
    index.replace("/ws/open.py", split_chunks("/ws/open.py", "def opened_here():\n    pass\n"))
    assert index.search(["opened_here"], limit=1)[0].chunk.text.startswith("def opened_here") and not reads


def test_an_open_documents_chunks_let_go_of_their_text_once_it_is_read_from_disk_again():
    from efim_lsp.context.ranking import ChunkIndex

    text = "def exchange_rate(currency):\n    return RATES[currency]\n"
    index = ChunkIndex(read_text=lambda path: text)
    index.replace("/ws/rates.py", split_chunks("/ws/rates.py", text))  # the editor's text: kept
    assert index._by_digest and all(c.text for c in index._by_digest.values())  # noqa: SLF001
    assert not index.replace("/ws/rates.py", split_chunks("/ws/rates.py", text), keep_text=False)  # same chunks, from disk
    assert all(c.text == "" for c in index._by_digest.values())  # noqa: SLF001 — in every map
    assert all(c.text == "" for c in index._by_id.values())  # noqa: SLF001
    assert index.search(["exchange_rate"], limit=1)[0].chunk.text == text  # read back when asked
