"""Cross-file training samples: the server's chunks in front, the middle at the sibling's name,
and the prompt what serving renders for the same request."""

from __future__ import annotations

from pathlib import Path

import pytest
from tokenizers import AddedToken, Tokenizer

from engine.api import ContextChunk, InfillRequest
from engine.prompting import PromptBuilder
from engine.text.tokenize import SegmentTokenizer
from tiny_models import tiny_tokenizer_json
from efim_tools.training.crossfile import HELD_OUT_PACKAGES, TRAINING_PACKAGES, CrossFileSource
from efim_tools.training.data import Corpus, training_files
from efim_tools.training.samples import SPM_SENTINELS, SampleBuilder, SampleConfig

ERRORS = '''"""Errors of the toy package."""


class HeaderParseError(ValueError):
    """A header that does not parse."""


class BodyTooLong(ValueError):
    def __init__(self, size, limit):
        self.size = size


def describe(error):
    return str(error)
'''

PARSER = '''"""The toy parser."""

import re

from .errors import HeaderParseError

LINE = re.compile(r"(\\w+): (.*)")


def parse(text):
    out = {}
    for line in text.splitlines():
        m = LINE.match(line)
        if m is None:
            raise HeaderParseError(line)
        out[m.group(1)] = m.group(2)
    return out
'''


@pytest.fixture(scope="module")
def package(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("ws") / "toypkg"
    root.mkdir()
    (root / "__init__.py").write_text('"""Toy."""\n')
    (root / "errors.py").write_text(ERRORS)
    (root / "parser.py").write_text(PARSER)
    return root


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    tok = Tokenizer.from_str(tiny_tokenizer_json(False))
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPM_SENTINELS])
    return tok


def _count(tok):
    return lambda text: len(tok.encode(text, add_special_tokens=False).ids)


def test_held_out_packages_are_refused_and_never_in_the_training_list(tokenizer):
    assert not HELD_OUT_PACKAGES.intersection(TRAINING_PACKAGES)
    with pytest.raises(ValueError, match="held out"):
        CrossFileSource(["asyncio", "logging"], _count(tokenizer))


def test_a_package_without_targets_anywhere_is_a_clear_error(tmp_path, tokenizer):
    (tmp_path / "lone").mkdir()
    (tmp_path / "lone" / "a.py").write_text("x = 1\n")
    (tmp_path / "lone" / "b.py").write_text("y = 2\n")
    with pytest.raises(ValueError, match="none of the cross-file training packages"):
        CrossFileSource([str(tmp_path / "lone"), str(tmp_path / "missing")], _count(tokenizer))


def test_samples_put_the_servers_chunks_in_front_and_the_name_in_the_middle(package, tokenizer):
    source = CrossFileSource([str(package)], _count(tokenizer), at_target_prob=1.0, more_lines_prob=0.0)
    assert [t.name for t in source.targets[0]] == ["HeaderParseError"]  # the import line: its first use
    cfg = SampleConfig(layout="spm", crossfile_prob=1.0, fim_rate=0.5, efim_rate=0.5, fragment_prob=0.0)
    builder = SampleBuilder(tokenizer, Corpus(training_files()), cfg, seed=3, crossfile=source)
    serving = PromptBuilder(builder.fim.template, SegmentTokenizer(tokenizer), fragment_trained=True)
    kinds = set()
    for i in range(12):
        sample = builder.sample(i)
        kinds.add(sample.kind)
        seg = {s.role: s for s in sample.segments}
        middle = "".join(s.text for s in sample.segments if s.role in ("increment", "middle"))
        assert "from .errors import " + middle == "from .errors import HeaderParseError"  # the rest of the line
        assert seg["prefix"].text.endswith("from .errors import ")
        assert seg["suffix"].text.startswith("\n\nLINE = ")
        # The chunks are the gatherer's: the imported module's outline, naming the class.
        assert sample.chunks and any("class HeaderParseError" in c.text for c in sample.chunks)
        assert all(c.text.startswith("# ") for c in sample.chunks)  # no file separator: a comment header
        # One renderer: the ids up to the middle are what serving builds for this request.
        chunks = tuple(ContextChunk(path=c.text.split("\n", 1)[0][2:], text=c.text.split("\n", 1)[1]) for c in sample.chunks)
        inc = seg["increment"].text if "increment" in seg else ""
        req = InfillRequest(key="k", prefix=seg["prefix"].text, suffix=seg["suffix"].text, increment=inc,
                            format="efim", context="prefix", chunks=chunks)
        rendered = serving.encode(req).ids
        assert sample.ids[: len(rendered)] == rendered, i
        n_head = len(rendered) - (len(seg["increment"].ids) if inc else 0)
        assert not any(sample.targets[:n_head]) and all(sample.targets[n_head:])
    assert kinds == {"fim", "efim"}


def test_same_index_same_sample_and_no_chunks_when_off(package, tokenizer):
    corpus = Corpus(training_files())
    source = CrossFileSource([str(package)], _count(tokenizer))
    on = SampleConfig(layout="spm", crossfile_prob=0.5, min_window_tokens=64, max_window_tokens=128)
    a = SampleBuilder(tokenizer, corpus, on, seed=9, crossfile=source)
    b = SampleBuilder(tokenizer, corpus, on, seed=9, crossfile=CrossFileSource([str(package)], _count(tokenizer)))
    assert [a.sample(i).ids for i in range(20)] == [b.sample(i).ids for i in range(20)]
    assert any(a.sample(i).chunks for i in range(20))
    off = SampleConfig(layout="spm", min_window_tokens=64, max_window_tokens=128)
    plain = SampleBuilder(tokenizer, corpus, off, seed=9)
    assert all(not plain.sample(i).chunks for i in range(20))
    with pytest.raises(ValueError, match="CrossFileSource"):
        SampleBuilder(tokenizer, corpus, on, seed=9)
