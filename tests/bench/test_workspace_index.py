"""`efim bench workspace`'s workspace and typing task (the server run itself is a benchmark)."""

from __future__ import annotations

from bench.workspace_index import _phase, synthesise_workspace, typing_task
from efim_lsp.context.workspace import ContextFolder


def test_the_workspace_has_the_files_asked_for_and_a_folder_the_index_prunes(tmp_path):
    source = tmp_path / "lib"
    (source / "pkg").mkdir(parents=True)
    for i in range(7):
        (source / ("pkg" if i % 2 else "") / f"m{i}.py").write_text(f"X{i} = {i}\n")
    (source / "site-packages").mkdir()
    (source / "site-packages" / "other.py").write_text("Y = 1\n")
    root = tmp_path / "ws"
    assert synthesise_workspace(root, 17, source) == 17
    written = sorted(p.relative_to(root).as_posix() for p in root.rglob("*.py") if "node_modules" not in p.parts)
    assert len(written) == 17
    assert {p.split("/")[0] for p in written} == {"copy0", "copy1", "copy2"}
    assert not any("site-packages" in p for p in written)
    assert (root / "node_modules" / "lib" / "m0.py").is_file()
    indexed = list(ContextFolder(root).scan())
    assert len(indexed) == 17  # node_modules is never indexed


def test_typing_task_removes_whole_lines_and_gives_them_back():
    text = "".join(f"line {i} = {i}\n" for i in range(100))
    doc, cursor, typed = typing_task(text, 50)
    assert doc[:cursor] + typed + doc[cursor:] == text
    assert doc[cursor - 1] == "\n" and typed.endswith("\n") and 0 < len(typed) <= 50


def test_phases_follow_the_servers_context_status():
    assert _phase("off", {}) == "after"
    assert _phase("blend", {"files": 0, "indexing": True}) == "indexing"
    assert _phase("blend", {"files": 10, "indexing": True}) == "indexing"
    assert _phase("blend", {"files": 10, "indexing": False, "kv": {"queued": 3}}) == "chunk KV"
    assert _phase("blend", {"files": 10, "indexing": False, "kv": {"queued": 0, "running": False}}) == "after"
    assert _phase("prefix", {"files": 10, "indexing": False, "kv": {"queued": 3}}) == "after"
