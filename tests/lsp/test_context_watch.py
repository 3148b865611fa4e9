"""Disk changes seen through watchfiles invalidate a file's chunks (real writes in a temp workspace)."""

from __future__ import annotations

import os
import threading
import time

import pytest

from efim_lsp.context import ContextGatherer


def eventually(predicate, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


@pytest.fixture
def watched(tmp_path):
    root = tmp_path / "ws"
    (root / "pkg").mkdir(parents=True)
    (root / "pkg" / "rates.py").write_text("def exchange_rate(currency):\n    return RATES[currency]\n")
    events: list[str] = []
    lock = threading.Lock()

    def record(key: str) -> None:
        with lock:
            events.append(key)

    g = ContextGatherer(watch=True, debounce_ms=50)
    g.add_listener(record)
    g.set_workspaces([root])
    assert g.wait_idle(10)
    assert g.wait_watching(10)
    yield g, root, events
    g.close()


QUERY = "total = convert(amount, exchange_rate(currency), fee_schedule)\n"


def texts(g: ContextGatherer, key) -> list[str]:
    return [c.text for c in g.index.chunks_of(str(key))]


def test_disk_writes_add_change_and_remove_chunks(watched):
    g, root, events = watched
    rates = root / "pkg" / "rates.py"
    editing = str(root / "main.py")
    first = g.select(editing, QUERY, len(QUERY))
    assert [c.path for c in first] == ["pkg/rates.py"]

    fees = root / "pkg" / "fees.py"
    fees.write_text("def fee_schedule(amount):\n    return amount * 0.01\n")
    assert eventually(lambda: texts(g, fees))

    rates.write_text("def exchange_rate(currency):\n    return LIVE_RATES.lookup(currency)\n")
    assert eventually(lambda: any("LIVE_RATES" in t for t in texts(g, rates)))
    assert str(rates) in events
    # The remembered selection held the old text of rates.py: it is recomputed, not served stale.
    fresh = g.select(editing, QUERY, len(QUERY))
    assert any("LIVE_RATES" in c.text for c in fresh)
    assert not any("RATES[currency]" in c.text for c in fresh)

    fees.unlink()
    assert eventually(lambda: not texts(g, fees))
    assert events.count(str(fees)) == 1  # removed (added: announced to nobody, its chunks were new)


def test_gitignore_and_vendor_changes_on_disk(watched):
    g, root, _events = watched
    (root / "node_modules" / "lib").mkdir(parents=True)
    (root / "node_modules" / "lib" / "index.js").write_text("function exchange_rate() {}\n")
    (root / "pkg" / "generated.py").write_text("exchange_rate_table = {}\n")
    assert eventually(lambda: texts(g, root / "pkg" / "generated.py"))
    (root / ".gitignore").write_text("generated.py\n")
    assert eventually(lambda: not texts(g, root / "pkg" / "generated.py"))
    g.wait_idle(10)
    assert not texts(g, root / "node_modules" / "lib" / "index.js")


def test_open_documents_win_over_disk_and_closing_keeps_chunks(watched):
    g, root, _events = watched
    rates = root / "pkg" / "rates.py"
    g.open_document(str(rates), "def exchange_rate(currency):\n    return EDITOR_RATES[currency]\n")
    g.select(str(root / "main.py"), QUERY, len(QUERY))  # re-chunks the edited document
    assert any("EDITOR_RATES" in t for t in texts(g, rates))
    rates.write_text("def exchange_rate(currency):\n    return DISK_RATES[currency]\n")
    time.sleep(0.5)
    g.wait_idle(10)
    assert any("EDITOR_RATES" in t for t in texts(g, rates))  # unsaved editor text wins while open
    g.close_document(str(rates))
    assert any("EDITOR_RATES" in t for t in texts(g, rates))  # closing keeps its chunks
    os.utime(rates)
    rates.write_text("def exchange_rate(currency):\n    return SAVED_RATES[currency]\n")
    assert eventually(lambda: any("SAVED_RATES" in t for t in texts(g, rates)))


def test_status_counts_the_index_and_reports_queued_disk_work(tmp_path):
    root = tmp_path / "ws"
    root.mkdir()
    for i in range(3):
        (root / f"m{i}.py").write_text("".join(f"def f{i}_{n}(x):\n    return x + {n}\n" for n in range(40)))
    g = ContextGatherer(watch=False)
    try:
        assert g.status() == {"folders": 0, "files": 0, "chunks": 0, "indexing": False, "pausedS": 0.0, "watch": {"state": "off"}}
        with g._lock:  # noqa: SLF001 — holding it stalls the worker's scan, so it is still queued
            g.set_workspaces([root])
            assert g.status()["indexing"] is True
        assert g.wait_idle(10)
        status = g.status()
        assert status["folders"] == 1 and status["files"] == 3 and not status["indexing"]
        assert status["chunks"] >= 6  # 80 lines per file at 64-line chunks: at least two each
    finally:
        g.close()
