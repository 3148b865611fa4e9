"""The language server's fresh-line test (efim_lsp.suggest.fresh_line): set only on an empty
cursor line inside a block that goes on."""

from __future__ import annotations

import pytest

from efim_lsp.suggest import CursorContext, fresh_line


def _at(doc: str) -> bool:
    """`doc` with `|` at the cursor."""
    cursor = doc.index("|")
    return fresh_line(CursorContext.at(doc.replace("|", "", 1), cursor))


@pytest.mark.parametrize(
    "doc",
    [
        "def f(x):\n    y = 1\n|\n    return y\n",  # between two body lines
        "def f(x):\n    y = 1\n    |\n    return y\n",  # the editor typed the indentation
        "def f(x):\n|\n    return x\n",  # right under an opener
        "def f(x):\n    if x:\n        y = 1\n|",  # the text ends inside the block
        "x = call(a,\n|\n)\n",  # a statement goes on
        "def f(x):\n    for i in x:\n        pass\n        |\n",  # typed indentation, nothing below
        'def f(x):\n    """Doc."""\n|\n    return x\n',  # after a closed docstring
    ],
)
def test_set_on_empty_lines_of_continuing_blocks(doc):
    assert _at(doc)


@pytest.mark.parametrize(
    "doc",
    [
        "def f(x):\n    y = 1|\n    return y\n",  # text before the cursor
        "def f(x):\n    |y = 1\n",  # text after the cursor
        "import os\n|\nimport sys\n",  # top level: a blank line is as likely as code
        "def f(x):\n    return x\n|\n\ndef g():\n    pass\n",  # top level after a function
        "class A:\n    def f(self):\n        return 1\n|\n    def g(self):\n        pass\n",  # the body ended (dedent)
        "class A:\n    x = 1\n|\n    def g(self):\n        pass\n",  # before a def: the blank line is the convention
        "class A:\n    x = 1\n|\n    @property\n    def g(self):\n        pass\n",  # before a decorator
        "def f(x):\n    if x:\n        y = 1\n|\n    return y\n",  # the inner block ended
        'def f(x):\n    """Doc.\n|\n    More doc.\n    """\n',  # a docstring's paragraphs
        "def f(x):\n    '''Doc.\n    \"\"\"\n|\n    More doc.\n    '''\n",  # the other quote inside is text
    ],
)
def test_not_set_elsewhere(doc):
    assert not _at(doc)


async def test_the_completer_sets_the_flag_from_the_rule():
    from lsp_fakes import FakeEngine
    from test_completer import BODY, Rig

    rig = await Rig(FakeEngine(lambda r: "pass\n")).start()
    await rig.complete(BODY)  # the empty, indented line of f's body
    rig.edit(BODY, BODY, "y")
    await rig.complete(BODY + 1)  # text typed on it
    asked = rig.engine.requests[1:]  # [0] is the first request after the load
    assert [r.fresh_line for r in asked] == [True, False]
    assert not rig.engine.requests[0].fresh_line
