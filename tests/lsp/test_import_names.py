"""Import names (`efim_lsp.context.import_names`): where a `from X import` list wants a name,
which of X's names the file needs, in the order the list keeps."""

from __future__ import annotations

import pytest

from efim_lsp.context.source import WorkspaceContext
from efim_lsp.context.import_names import code_only, missing_names, site_at, suggestion, top_level_names

MODULE = "STATE_A = 1\nSTATE_B = 2\n\nclass Thing:\n    pass\n\nclass Other:\n    pass\n\ndef helper():\n    pass\n\nif True:\n    def guarded():\n        pass\nfrom os import sep as SEP\n"


def _at_end(text: str):
    return site_at(text, len(text))


@pytest.mark.parametrize("text", [
    "from .errors import ", "from .errors import A, ", "from .errors import A, Bo", "from errors import (\n    A,\n    ",
    "from . import ", "from pkg.sub import (A,", "from .errors import A", "x = 1\n  from a.b import A as C, D",
])
def test_a_site_is_where_a_name_starts_or_is_being_typed(text):
    site = _at_end(text)
    assert site is not None, text


@pytest.mark.parametrize("text", [
    "from .errors import A ", "from .errors import A as ", "from .errors import A as B",
    "from .errors import *", "import errors, ", "x = from_ import ", "from .errors import (A, B)", "from .errors import A\n",
])
def test_no_site_elsewhere(text):
    assert _at_end(text) is None, text


def test_a_site_knows_its_module_names_and_the_bracketed_layout():
    text = "from ..pkg.errors import (\n    Alpha,\n    Beta as B,\n    \n    Delta,\n)\n"
    cursor = text.index("    \n") + 4
    site = site_at(text, cursor)
    assert (site.module, site.level, site.line) == ("pkg.errors", 2, 0)
    assert site.before == ("Alpha", "Beta") and site.after == ("Delta",) and site.one_per_line
    assert site.end == len(text) - 1  # after the bracket
    assert site_at(text, cursor - 1) is None  # inside the indentation: not at a name's place
    assert site_at("from x import Fo", 15) is None  # inside a word


def test_top_level_names_are_every_binding_a_from_import_can_ask_for():
    assert top_level_names(MODULE) == {"STATE_A", "STATE_B", "Thing", "Other", "helper", "guarded", "SEP"}
    assert top_level_names("def broken(:\n") == frozenset()


def test_missing_names_are_used_below_and_not_bound_yet():
    names = top_level_names(MODULE)
    text = ("from .mod import \nfrom .other import Other\n\nSTATE_B = 3\n\n"
            "def f():\n    x = helper()  # Thing\n    return guarded(x), 'STATE_A', obj.SEP\n")
    site = site_at(text, text.index("\n"))
    # helper and guarded are used; Thing only in a comment, STATE_A only in a string, SEP only as an
    # attribute; Other is imported by another statement; STATE_B is defined here.
    assert missing_names(site, text, names, imported_elsewhere={"Other"}) == ["guarded", "helper"]
    assert missing_names(site_at("from .mod import he\nhelper()\n", 19), "from .mod import he\nhelper()\n", names) == ["helper"]


def test_sorted_lists_get_the_name_that_belongs_at_the_cursor():
    names = {"Alpha", "Beta", "Gamma", "Delta", "Zeta"}
    text = "from .m import (\n    Beta,\n    \n    Zeta,\n)\nuse(Alpha, Beta, Gamma, Delta, Zeta)\n"
    site = site_at(text, text.index("    \n") + 4)
    # Beta < ? < Zeta: Delta and Gamma fit there (Alpha would go above Beta).
    assert missing_names(site, text, names) == ["Delta", "Gamma"]
    assert suggestion(site, ["Delta", "Gamma"], "", "    ") == "Delta,"  # one name per line, as the list is written
    # isort's order-by-type: CONSTANTS, Classes, functions.
    text = "from .m import CONST, Klass, \nuse(func, Other, ZED)\n"
    site = site_at(text, text.index("\n"))
    assert missing_names(site, text, {"func", "Other", "ZED"}) == ["Other", "func"]  # ZED belongs before Klass
    # Unsorted list: the order of first use.
    text = "from .m import Zed, Abe, \nuse(yy, bb)\n"
    site = site_at(text, text.index("\n"))
    assert missing_names(site, text, {"bb", "yy"}) == ["yy", "bb"]


def test_a_packages_all_counts_as_a_use():
    text = 'from .core import \n\n__all__ = ["Engine", "run"]\n'
    site = site_at(text, text.index("\n"))
    assert missing_names(site, text, {"Engine", "run", "other"}) == ["Engine", "run"]


def test_suggestion_joins_names_only_where_the_line_ends():
    site = site_at("from m import ", 14)
    assert suggestion(site, ["alpha", "beta", "gamma"], "", "from m import ") == "alpha, beta, gamma"
    assert suggestion(site, ["alpha", "beta"], "  # note", "from m import ") == "alpha"
    long = [f"name_{i:02d}_" + "x" * 20 for i in range(9)]
    assert len("from m import " + suggestion(site, long, "", "from m import ")) <= 100
    typed = site_at("from m import al", 16)
    assert suggestion(typed, ["alpha"], "", "from m import al") == "pha"


def test_code_only_keeps_offsets():
    text = 'a = "x # y"  # c\nb = """q\nr"""\n'
    out = code_only(text)
    assert len(out) == len(text) and out.count("\n") == text.count("\n") and "x" not in out and "q" not in out


class _Settings:
    import_names = True


def test_the_workspace_answers_from_the_module_on_disk_or_open_and_nothing_outside(tmp_path):
    pkg = tmp_path / "ws" / "pkg"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "errors.py").write_text("class HeaderError(Exception):\n    pass\n\nclass BodyError(Exception):\n    pass\n")
    (tmp_path / "outside.py").write_text("def secret():\n    pass\n")
    source = WorkspaceContext(watch=False)
    try:
        source.set_folders([(tmp_path / "ws").as_uri()])  # no index is built: context is off
        uri = (pkg / "parser.py").as_uri()
        text = "from .errors import \n\n\ndef f(x):\n    raise HeaderError(x)\n"
        at = text.index("\n")
        assert source.import_completion(uri, text, at, _Settings()) == "HeaderError"
        assert source.import_completion(uri, text, 3, _Settings()) == ""  # not at a name's place
        off = _Settings()
        off.import_names = False
        assert source.import_completion(uri, text, at, off) == ""
        # A module outside the workspace folders is never read (`from .. import` climbs out of it).
        above = "from ..outside import \nsecret()\n"
        assert source.import_completion((tmp_path / "ws" / "mod.py").as_uri(), above, above.index("\n"), _Settings()) == ""
        # errors.py open and half typed: its names are the ones it had; a new one once it parses.
        errors_uri = (pkg / "errors.py").as_uri()
        source.document_changed(errors_uri, 2, "class HeaderError(Exception):\n    pass\n\nclass Body(\n")
        assert source.import_completion(uri, text, at, _Settings()) == "HeaderError"
        source.document_changed(errors_uri, 3, "class HeaderError(Exception):\n    pass\n\nclass Odd(Exception):\n    pass\n")
        text2 = text + "    raise Odd()\n"
        assert source.import_completion(uri, text2, at, _Settings()) == "HeaderError, Odd"
        # On disk, a changed file is read again.
        source.document_closed(errors_uri)
        (pkg / "errors.py").write_text("class Renamed(Exception):\n    pass\n" + " " * 7)  # another size: another version
        assert source.import_completion(uri, "from .errors import \nRenamed\n", 20, _Settings()) == "Renamed"
    finally:
        source.gatherer.close()
