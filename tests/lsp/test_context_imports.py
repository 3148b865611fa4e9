"""Context chosen by what the file imports: import parsing, module resolution, outlines,
and the gatherer's "imports" strategy (stable while typing in one edit session)."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from efim_lsp.context import ContextGatherer
from efim_lsp.context.imports import ImportRef, imports_of
from efim_lsp.context.modules import ModuleResolver
from efim_lsp.context.outline import Outline

PACKAGE = {
    "shop/__init__.py": "",
    "shop/errors.py": '''
        """Errors of the shop."""

        class ShopError(Exception):
            """Base class of every shop error."""

        class OutOfStock(ShopError):
            """No item left."""

            def __init__(self, sku, wanted):
                self.sku = sku

        _internal_counter = 0
        ''',
    "shop/pricing.py": '''
        TAX_RATE = 0.2

        def net_price(gross, rate=TAX_RATE):
            """Price without the tax."""
            return gross / (1 + rate)

        def _rounding(x):
            return round(x, 2)

        class PriceList:
            """Prices per SKU."""

            def price_of(self, sku: str) -> float:
                """The current price of `sku`."""
                return self.prices[sku]

            def _load(self):
                pass
        ''',
    "shop/sub/__init__.py": "",
    "shop/sub/report.py": '''
        from ..pricing import net_price
        import shop.errors as errs

        def weekly_report(items):
            return [net_price(i) for i in items]
        ''',
    "shop/cart.py": '''
        from .errors import OutOfStock
        from . import pricing

        class Cart:
            def total(self):
                return sum(pricing.net_price(p) for p in self.items)
        ''',
    "notes/pricing_notes.md": "net_price is gross / (1 + rate); PriceList price_of returns a float\n" * 8,
}


@pytest.fixture()
def repo(tmp_path: Path) -> Path:
    root = tmp_path / "repo"
    for rel, text in PACKAGE.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text).lstrip("\n"))
    return root


def words(text: str) -> int:
    return max(1, len(text.split()))


@pytest.fixture()
def gatherer(repo):
    g = ContextGatherer(count_tokens=words, watch=False)
    g.set_workspaces([repo])
    assert g.wait_idle(10)
    yield g
    g.close()


# -- imports ---------------------------------------------------------------------------------
def test_imports_of_reads_every_kind_of_import_and_broken_lines():
    text = textwrap.dedent('''
        import os, json as j
        from .errors import (
            ShopError,
            OutOfStock as OOS,
        )
        from . import pricing
        from pkg.mod import *

        def later():
            from ..deep.mod import thing
        from .errors import 
        from .pric
        x = 1  # from nowhere import nothing
    ''')
    refs = imports_of(text)
    assert refs[0] == ImportRef("os", 0, None, "os", 1)
    assert refs[1] == ImportRef("json", 0, None, "j", 1)
    assert refs[2] == ImportRef("errors", 1, ("ShopError", "OutOfStock"), None, 2)
    assert refs[3] == ImportRef("", 1, ("pricing",), None, 6)
    assert refs[4] == ImportRef("pkg.mod", 0, None, None, 7)  # a star import: the whole module
    assert refs[5] == ImportRef("deep.mod", 2, ("thing",), None, 10)  # inside a function
    # lines being typed: the module they name, names unknown
    assert refs[6] == ImportRef("errors", 1, None, None, 11)
    assert refs[7] == ImportRef("pric", 1, None, None, 12)
    assert len(refs) == 8


def test_imports_of_survives_garbage():
    assert imports_of("") == []
    assert imports_of("from\nimport\nfrom . import\n(((\n") == [ImportRef("", 1, None, None, 2)]
    assert imports_of("from x import (a,\n" + "b,\n" * 200) != []  # an unclosed parenthesis ends after a bound


# -- resolution ------------------------------------------------------------------------------
def test_modules_resolve_relative_absolute_and_package_root_imports(repo):
    paths = {str(p) for p in repo.rglob("*.py")}
    resolver = ModuleResolver(paths, [str(repo)])
    cart = str(repo / "shop" / "cart.py")
    report = str(repo / "shop" / "sub" / "report.py")
    [errors] = resolver.resolve(ImportRef("errors", 1, ("OutOfStock",), None, 0), cart)
    assert errors.path == str(repo / "shop" / "errors.py") and errors.names == ("OutOfStock",)
    [pricing] = resolver.resolve(ImportRef("", 1, ("pricing",), None, 0), cart)  # a submodule
    assert pricing.path == str(repo / "shop" / "pricing.py") and pricing.names is None
    [up] = resolver.resolve(ImportRef("pricing", 2, ("net_price",), None, 0), report)
    assert up.path == str(repo / "shop" / "pricing.py")
    [absolute] = resolver.resolve(ImportRef("shop.errors", 0, None, "errs", 0), report)
    assert absolute.path == str(repo / "shop" / "errors.py")
    assert resolver.resolve(ImportRef("os", 0, None, "os", 0), cart) == []
    # A workspace folder that is itself a package: its modules are imported by the package's name.
    inner = ModuleResolver({p for p in paths if "/shop/" in p}, [str(repo / "shop")])
    [found] = inner.resolve(ImportRef("shop.pricing", 0, ("net_price",), None, 0), cart)
    assert found.path == str(repo / "shop" / "pricing.py")


def test_modules_outside_the_index_never_resolve(repo, tmp_path):
    outside = tmp_path / "elsewhere" / "secret.py"
    outside.parent.mkdir()
    outside.write_text("TOKEN = 1\n")
    paths = {str(p) for p in repo.rglob("*.py")}
    resolver = ModuleResolver(paths, [str(repo)])
    assert resolver.resolve(ImportRef("secret", 0, None, "secret", 0), str(repo / "shop" / "cart.py")) == []
    assert resolver.resolve(ImportRef("elsewhere.secret", 0, None, None, 0), str(tmp_path / "x.py")) == []


# -- outlines --------------------------------------------------------------------------------
def test_outline_keeps_signatures_heads_docstrings_and_fits_its_budget(repo):
    outline = Outline.of((repo / "shop" / "pricing.py").read_text())
    full = outline.render(lambda text: True)
    assert "TAX_RATE = 0.2" in full
    assert "def net_price(gross, rate=TAX_RATE):" in full and '"""Price without the tax."""' in full
    assert "class PriceList:" in full and "def price_of(self, sku: str) -> float:" in full
    assert "return" not in full  # bodies are left out
    compile(full, "outline", "exec")  # still Python
    # Less room: detail goes first, private definitions before public ones; names stay.
    smaller = outline.render(lambda text: words(text) <= 20)
    assert words(smaller) <= 20
    assert "_rounding" not in smaller and "net_price" in smaller and "PriceList" in smaller
    tiny = outline.render(lambda text: words(text) <= 5)
    assert words(tiny) <= 5 and tiny.startswith("# ")
    assert outline.render(lambda text: False) == ""
    assert Outline.of("def broken(:\n") is None


# -- the "imports" strategy ------------------------------------------------------------------
def cursor_after(text: str, marker: str) -> int:
    return text.index(marker) + len(marker)


def test_imports_strategy_picks_the_imported_modules_definitions(gatherer, repo):
    path = str(repo / "shop" / "cart.py")
    text = (repo / "shop" / "cart.py").read_text() + "\n    def check(self):\n        raise "
    chunks = gatherer.select(path, text, len(text), max_chunks=4, max_tokens=400, strategy="imports", anchor=1)
    paths = [c.path for c in chunks]
    assert "shop/errors.py" in paths and "shop/pricing.py" in paths
    errors = next(c for c in chunks if c.path == "shop/errors.py")
    assert "class OutOfStock(ShopError):" in errors.text and "def __init__(self, sku, wanted)" in errors.text
    # BM25 over 64-line pieces gets raw file text instead
    bm25 = gatherer.select(path, text, len(text), max_chunks=4, max_tokens=400, strategy="bm25", anchor=2)
    assert all("class OutOfStock(ShopError):\n" not in c.text or "self.sku = sku" in c.text for c in bm25)


def test_the_import_at_the_cursor_comes_last_next_to_the_prompt(gatherer, repo):
    path = str(repo / "shop" / "sub" / "report.py")
    text = "from ..errors import \nfrom ..pricing import net_price\n\nx = net_price(3)\n"
    chunks = gatherer.select(path, text, cursor_after(text, "import "), max_chunks=4, max_tokens=400, strategy="imports", anchor=1)
    assert chunks[-1].path == "shop/errors.py"
    assert "shop/pricing.py" in [c.path for c in chunks]


def test_imports_selection_is_stable_while_typing_in_one_edit_session(gatherer, repo):
    """Keystrokes in one edit session keep the same chunks, in the same order — even when
    the line typed is an import that changes what the file imports — so the prompt stays
    a prefix of the next one and each keystroke prefills only itself."""
    path = str(repo / "shop" / "sub" / "report.py")
    base = "from ..pricing import net_price\n\n"
    first = gatherer.select(path, base, len(base), max_chunks=4, max_tokens=400, strategy="imports", anchor=7)
    assert [c.path for c in first][-1] == "shop/pricing.py"
    for typed in ("f", "from ", "from ..", "from ..err", "from ..errors import Out"):
        text = base + typed
        again = gatherer.select(path, text, len(text), max_chunks=4, max_tokens=400, strategy="imports", anchor=7)
        assert again is first
    # The next edit session (another place, a rebase) picks up the new import.
    text = base + "from ..errors import Out"
    rebased = gatherer.select(path, text, len(text), max_chunks=4, max_tokens=400, strategy="imports", anchor=8)
    assert rebased[-1].path == "shop/errors.py"
    # A file the selection was cut from changes: the session gets its new text.
    gatherer.open_document(str(repo / "shop" / "errors.py"), "class Renamed(Exception):\n    pass\n")
    changed = gatherer.select(path, text, len(text), max_chunks=4, max_tokens=400, strategy="imports", anchor=8)
    assert changed is not rebased and "class Renamed(Exception)" in changed[-1].text


def test_recently_edited_open_documents_then_bm25_fill_what_imports_leave(gatherer, repo):
    path = str(repo / "shop" / "cart.py")
    text = "def describe(price_list):\n    return price_list.price_of('x')\n"  # imports nothing
    scratch = str(repo / "shop" / "scratch.py")
    gatherer.open_document(scratch, "def describe_prices(price_list):\n    return [price_list.price_of(s) for s in skus]\n")
    chunks = gatherer.select(path, text, len(text), max_chunks=3, max_tokens=400, strategy="imports", anchor=1)
    paths = [c.path for c in chunks]
    assert paths[-1] == "shop/scratch.py"  # the open document, nearest the prompt
    assert len(paths) >= 2  # BM25 over the rest (pricing.py, the notes) before it


def test_unknown_strategy_is_a_clear_error(gatherer, repo):
    with pytest.raises(ValueError, match="unknown context selection"):
        gatherer.select(str(repo / "a.py"), "x", 1, strategy="magic")


def test_import_chunks_and_popular_chunks_for_computing_kv_ahead(gatherer, repo):
    cart = (repo / "shop" / "cart.py").read_text()
    ahead = gatherer.import_chunks(str(repo / "shop" / "cart.py"), cart, max_chunks=4, max_tokens=400)
    assert [c.path for c in ahead] == ["shop/errors.py", "shop/pricing.py"]
    # the same chunk a request in that file is given (same text: same KV)
    at_request = gatherer.select(str(repo / "shop" / "cart.py"), cart, len(cart), max_chunks=4, max_tokens=400, strategy="imports", anchor=3)
    assert set(ahead) <= set(at_request)
    popular = gatherer.popular_chunks(max_chunks=4, max_tokens=400)
    assert [c.path for c in popular][:2] == ["shop/errors.py", "shop/pricing.py"]  # imported twice each
