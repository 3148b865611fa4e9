"""The context ranker and selection rules on a small fixture repo (written at test time)."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from efim_lsp.context import ContextGatherer, split_chunks
from efim_lsp.context.ranking import ChunkIndex

FIXTURE = {
    "shop/cart.py": '''
        from shop.discount import Discount, apply_discount

        class Cart:
            """Items a customer intends to buy."""

            def __init__(self):
                self.items = []

            def add_item(self, item, quantity=1):
                self.items.append((item, quantity))

            def remove_item(self, item):
                self.items = [(i, q) for i, q in self.items if i != item]

            def subtotal(self):
                return sum(item.price * quantity for item, quantity in self.items)
        ''',
    "shop/discount.py": '''
        class Discount:
            def __init__(self, percent, code):
                self.percent = percent
                self.code = code

        def apply_discount(price, discount):
            """Price after the discount's percent is taken off."""
            return price * (100 - discount.percent) / 100
        ''',
    "shop/inventory.py": '''
        class Inventory:
            def __init__(self):
                self.stock_level = {}
                self.reorder_threshold = 5

            def restock(self, sku, count):
                self.stock_level[sku] = self.stock_level.get(sku, 0) + count

            def needs_reorder(self, sku):
                return self.stock_level.get(sku, 0) < self.reorder_threshold
        ''',
    "geometry/vector.py": '''
        import math

        class Vector:
            def __init__(self, x, y, z):
                self.x, self.y, self.z = x, y, z

            def dot(self, other):
                return self.x * other.x + self.y * other.y + self.z * other.z

            def norm(self):
                return math.sqrt(self.dot(self))
        ''',
    "geometry/matrix.py": '''
        from geometry.vector import Vector

        class Matrix:
            def __init__(self, rows):
                self.rows = rows

            def transpose(self):
                return Matrix([list(col) for col in zip(*self.rows)])

            def multiply(self, vector):
                return Vector(*(sum(a * b for a, b in zip(row, (vector.x, vector.y, vector.z))) for row in self.rows))
        ''',
    "README.md": "# Fixture shop\n\nA toy repository used by the context-ranking tests.\n",
}

CHECKOUT = textwrap.dedent(
    '''
    from shop.cart import Cart

    def checkout(cart, discount):
        subtotal = cart.subtotal()
        total = apply_discount(subtotal, discount)
        return total
    '''
).lstrip()


def write_repo(root: Path) -> Path:
    for rel, body in FIXTURE.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(body).lstrip(), encoding="utf-8")
    return root


def words(text: str) -> int:
    return len(text.split())


@pytest.fixture
def repo(tmp_path):
    return write_repo(tmp_path / "repo")


@pytest.fixture
def gatherer(repo):
    g = ContextGatherer(count_tokens=words, watch=False)
    g.set_workspaces([repo])
    assert g.wait_idle(10)
    yield g
    g.close()


def test_index_search_ranks_by_shared_identifiers():
    index = ChunkIndex()
    for rel, body in FIXTURE.items():
        index.replace(rel, split_chunks(rel, textwrap.dedent(body)))
    ranked = index.search({"discount", "percent", "price"})
    assert ranked[0].chunk.path == "shop/discount.py"
    assert all(r.score > 0 for r in ranked)
    assert [r.chunk.path for r in index.search({"vector", "dot"})][:2] == ["geometry/vector.py", "geometry/matrix.py"]
    assert index.search({"nothing_matches_this"}) == []
    assert index.replace("shop/discount.py", []) and "shop/discount.py" not in index.paths()


def test_select_prefers_related_files_and_respects_budgets(gatherer, repo):
    path = str(repo / "shop" / "checkout.py")
    chunks = gatherer.select(path, CHECKOUT, len(CHECKOUT), max_chunks=2, max_tokens=1000)
    assert {c.path for c in chunks} == {"shop/discount.py", "shop/cart.py"}
    from efim_lsp.context.chunking import identifiers

    best = gatherer.index.search(identifiers(CHECKOUT), exclude_paths=(path,))[0].chunk
    assert chunks[-1].path == gatherer.display_path(best.path)  # most relevant last, next to the prompt

    g2 = ContextGatherer(count_tokens=words, watch=False)
    g2.set_workspaces([repo])
    g2.wait_idle(10)
    small = g2.select(path, CHECKOUT, len(CHECKOUT), max_chunks=4, max_tokens=40)
    assert small
    assert sum(words(c.text) for c in small) <= 40
    assert all(words(c.text) <= 32 for c in small)  # per chunk: max(MIN_CHUNK_TOKENS, 40 // 4)
    g2.close()


def test_long_chunks_are_trimmed_to_the_per_chunk_budget(tmp_path):
    root = tmp_path / "ws"
    root.mkdir()
    filler = "".join(f"unrelated_{i} = {i}\n" for i in range(40))
    (root / "big.py").write_text(filler + "def apply_discount(price, discount):\n    return price - discount\n" + filler)
    g = ContextGatherer(count_tokens=words, watch=False, chunk_lines=200)
    g.set_workspaces([root])
    g.wait_idle(10)
    (chunk,) = g.select(str(root / "main.py"), CHECKOUT, len(CHECKOUT), max_chunks=4, max_tokens=160)
    assert words(chunk.text) <= 40
    assert "apply_discount" in chunk.text  # the trimmed run keeps the related lines
    g.close()


def test_the_edited_document_and_copies_of_its_window_are_never_context(gatherer, repo):
    path = str(repo / "shop" / "checkout.py")
    (repo / "shop" / "checkout_copy.py").write_text(CHECKOUT)
    g = ContextGatherer(count_tokens=words, watch=False)
    g.set_workspaces([repo])
    g.wait_idle(10)
    g.open_document(path, CHECKOUT)
    chunks = g.select(path, CHECKOUT, len(CHECKOUT), max_chunks=4, max_tokens=10_000)
    assert chunks
    assert all(c.path not in ("shop/checkout.py", "shop/checkout_copy.py") for c in chunks)
    g.close()


def test_selection_is_stable_while_typing_in_one_place(gatherer, repo):
    path = str(repo / "shop" / "checkout.py")
    first = gatherer.select(path, CHECKOUT, len(CHECKOUT), max_chunks=2, max_tokens=1000)
    typed = CHECKOUT + "\n    tot"
    again = gatherer.select(path, typed, len(typed), max_chunks=2, max_tokens=1000)
    assert again is first  # the remembered selection, not a recomputation
    # The user moves to code about another topic: a new selection follows the cursor.
    other = CHECKOUT + "\n\n" + "m = Matrix(rows)\nv = Vector(1, 2, 3)\nprint(m.multiply(v).dot(v), v.norm(), m.transpose())\n" * 3
    moved = gatherer.select(path, other, len(other), max_chunks=2, max_tokens=1000)
    assert {c.path for c in moved} == {"geometry/matrix.py", "geometry/vector.py"}
    back = gatherer.select(path, CHECKOUT, len(CHECKOUT), max_chunks=2, max_tokens=1000)
    assert back == first
    # A new anchor (the edit session rebased) forces a fresh selection of the same chunks.
    rebased = gatherer.select(path, CHECKOUT, len(CHECKOUT), max_chunks=2, max_tokens=1000, anchor=1)
    assert rebased == back and rebased is not back
    # A better candidate appearing (another file changed) is picked up at the next request.
    extra = "def apply_discount_twice(price, discount, cart):\n    return apply_discount(apply_discount(cart.subtotal(), discount), discount)\n"
    gatherer.open_document(str(repo / "shop" / "extra.py"), extra)
    again = gatherer.select(path, CHECKOUT, len(CHECKOUT), max_chunks=2, max_tokens=1000, anchor=1)
    assert "shop/extra.py" in [c.path for c in again]


def test_a_selection_from_a_half_built_index_does_not_stick(repo):
    """Regression: the first request after a folder was added came before its scan; the
    empty selection was then returned for as long as the user typed in that place."""
    g = ContextGatherer(count_tokens=words, watch=False)
    path = str(repo / "shop" / "checkout.py")
    assert g.select(path, CHECKOUT, len(CHECKOUT)) == ()  # nothing indexed yet
    g.set_workspaces([repo])
    assert g.wait_idle(10)
    assert g.select(path, CHECKOUT, len(CHECKOUT)) != ()
    g.close()


def test_open_documents_are_candidates_and_edits_invalidate(gatherer, repo):
    events: list[str] = []
    gatherer.add_listener(events.append)
    scratch = str(repo.parent / "scratch" / "pricing_rules.py")  # open, outside the workspace
    gatherer.open_document(scratch, "def seasonal_discount(price, discount):\n    return apply_discount(price, discount)\n")
    path = str(repo / "shop" / "checkout.py")
    text = CHECKOUT + "    seasonal_discount(total, discount)\n"
    chunks = gatherer.select(path, text, len(text), max_chunks=4, max_tokens=1000)
    assert any("seasonal_discount" in c.text for c in chunks)
    assert events == []  # indexed lazily on first use; new chunks have no KV anywhere to drop

    # An editor change replaces the document's chunks; the remembered selection is dropped.
    gatherer.change_document(scratch, "def seasonal_markup(price):\n    return price * 2\n")
    after = gatherer.select(path, text, len(text), max_chunks=4, max_tokens=1000)
    assert events == [scratch]  # its old chunks changed
    assert not any("seasonal_discount(price" in c.text for c in after)

    # Closing keeps the chunks (with the last editor text).
    gatherer.close_document(scratch)
    assert any("seasonal_markup" in c.text for c in gatherer.index.chunks_of(scratch))


def test_bad_arguments_are_harmless(gatherer, repo):
    path = str(repo / "a.py")
    assert gatherer.select(path, "", 0) == ()
    assert gatherer.select(path, CHECKOUT, 10_000, max_chunks=0) == ()
    assert isinstance(gatherer.select(path, CHECKOUT, -5), tuple)
    gatherer.open_document(str(repo / "bin.dat"), "\0\0binary")
    assert gatherer.select(path, CHECKOUT, len(CHECKOUT)) is not None
    assert gatherer.index.chunks_of(str(repo / "bin.dat")) == []
