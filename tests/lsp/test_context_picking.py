"""`efim_lsp.context.picking` on its own: which chunks BM25 picks, and how they are cut."""

from __future__ import annotations

from efim_lsp.context.chunking import identifiers, split_chunks
from efim_lsp.context.picking import (
    DUPLICATE_FRACTION,
    TRIM_GRID,
    by_relevance,
    duplicate_fraction,
    pick_chunks,
    significant_lines,
    trim_chunk,
    window_text,
)
from efim_lsp.context.ranking import ChunkIndex


def words(text: str) -> int:
    return len(text.split())


def index_of(files: dict[str, str], lines: int = 8) -> ChunkIndex:
    index = ChunkIndex()
    for path, text in files.items():
        index.replace(path, split_chunks(path, text, lines))
    return index


def test_a_chunk_the_window_already_holds_is_not_picked_and_the_excluded_file_never_is():
    shared = "".join(f"    total_price = compute_price(order_{i}, discount_rate)\n" for i in range(8))
    other = "".join(f"    refund = compute_price(refund_{i}, discount_rate) * -1\n" for i in range(8))
    index = index_of({"a.py": shared, "b.py": shared, "c.py": other})
    terms = frozenset(identifiers("compute_price discount_rate"))
    local = significant_lines(shared)  # the prompt window holds a.py's (and so b.py's) lines
    assert duplicate_fraction(shared, local) == 1.0 >= DUPLICATE_FRACTION
    picked = pick_chunks(index, terms, local, 4, 1000, words, exclude_paths={"c.py"})
    assert picked == []  # a.py and b.py duplicate the window; c.py is excluded
    picked = pick_chunks(index, terms, local, 4, 1000, words, exclude_paths={"a.py"})
    assert [p.source.path for p in picked] == ["c.py"]
    assert picked[0].chunk == picked[0].source  # small enough: not trimmed


def test_one_chunk_per_file_when_only_paths_are_given_and_the_budget_holds():
    files = {
        "x.py": "".join(f"def parse_header_{i}(stream): return read_header(stream, {i})\n" for i in range(32)),
        "y.py": "".join(f"def write_header_{i}(stream): return read_header(stream, -{i})\n" for i in range(32)),
    }
    index = index_of(files)
    terms = frozenset(identifiers("read_header stream"))
    picked = pick_chunks(index, terms, set(), 4, 1000, words, exclude_paths=set(), only_paths={"x.py", "y.py"})
    assert sorted(p.source.path for p in picked) == ["x.py", "y.py"]
    budgeted = pick_chunks(index, terms, set(), 4, 60, words, exclude_paths=set())
    assert sum(words(p.chunk.text) for p in budgeted) <= 60
    assert budgeted and all(words(p.chunk.text) <= 32 for p in budgeted)  # each cut to its share (at least 32)


def test_a_trim_keeps_the_grid_aligned_lines_that_mention_the_query():
    lines = [f"filler_{i} = {i}\n" for i in range(40)]
    lines[21] = "checksum = crc32(payload)\n"  # the query's words, on grid row 16..23
    [chunk] = split_chunks("z.py", "".join(lines), 64)
    trimmed = trim_chunk(chunk, frozenset({"crc32", "payload"}), 20, words(chunk.text), words)
    assert "crc32(payload)" in trimmed.text
    assert (trimmed.start_line - chunk.start_line) % TRIM_GRID == 0
    assert words(trimmed.text) <= 20


def test_relevance_order_and_the_window_text():
    index = index_of({"p.py": "alpha beta\n" * 3, "q.py": "alpha\n" * 3})
    picked = pick_chunks(index, frozenset({"alpha", "beta"}), set(), 4, 1000, words, exclude_paths=set())
    ordered = by_relevance(picked)
    assert [p.score for p in ordered] == sorted(p.score for p in picked)
    assert ordered[-1].source.path == "p.py"  # the best match sits last, next to the local text
    text = "".join(f"line {i}\n" for i in range(400))
    cursor = text.index("line 300")
    assert window_text(text, cursor, (10, 20)) == text[10:20]
    around = window_text(text, cursor, None)
    assert around.startswith("line 150\n") and around.endswith("line 349\n")
