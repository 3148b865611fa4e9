"""Session-scoped fixtures for tests that run peers (llama.cpp) on our models.

Import them into a test module or a conftest (they are plain pytest fixtures):

    from peers_fixtures import exported_gguf, llama_bin  # noqa: F401

- `exported_gguf(export_type="f16", model="default", adapter="auto") -> ExportResult`: the
  model exported by `efim export gguf` into a session temp dir, once per arguments.
- `llama_bin`: the folder of llama.cpp's llama-server/llama-bench; skips the test (saying
  how to build it) when they are not built.
- `load_exported(path, dtype)`: our own loader on an exported file, converted into a temp
  cache (not the user's: each export would leave a 100-300 MB folder there).
- `logit_agreement(reference, other)`: top-1 agreement, max |Δlogit|, mean KL.
"""

from __future__ import annotations

import atexit
import shutil
import tempfile
from pathlib import Path
from typing import NamedTuple

import pytest


@pytest.fixture(scope="session")
def exported_gguf(tmp_path_factory):
    from efim_tools.export import export_gguf

    built: dict[tuple[str, str, str], object] = {}

    def export(export_type: str = "f16", *, model: str = "default", adapter: str = "auto"):
        key = (export_type, str(model), str(adapter))
        if key not in built:
            dest = tmp_path_factory.mktemp("gguf-export") / f"export-{export_type}.gguf"
            built[key] = export_gguf(dest, model=model, adapter=adapter, export_type=export_type)
        return built[key]

    return export


@pytest.fixture(scope="session")
def llama_bin() -> Path:
    from efim_tools.peers.llama_cpp import SETUP_SCRIPT, llama_cpp_bin

    folder = llama_cpp_bin()
    if folder is None:
        pytest.skip(f"llama.cpp's llama-server is not built (run `bash {SETUP_SCRIPT}` or set EFIM_LLAMA_CPP_BIN)")
    return folder


_LOAD_CACHE = Path(tempfile.mkdtemp(prefix="efim-export-loads-"))
atexit.register(shutil.rmtree, _LOAD_CACHE, ignore_errors=True)  # up to 2 GB of converted models per run


def load_exported(path: Path, dtype: str = "fp32"):
    """`engine.model.loader.load_model` on the exported GGUF (no adapter: it is merged in)."""
    from engine.model.gguf import convert_gguf
    from engine.model.loader import load_model

    return load_model(convert_gguf(Path(path), _LOAD_CACHE), dtype=dtype, adapter=None)


class Agreement(NamedTuple):
    top1: float  # share of positions whose argmax agrees
    max_abs_logit: float  # max |Δlogit| over all positions and tokens
    kl: float  # mean over positions of KL(reference || other), nats


def logit_agreement(reference, other) -> Agreement:
    """Compare two [T, V] logit tensors (the reference first)."""
    import torch

    a, b = reference.float(), other.float()
    kl = torch.nn.functional.kl_div(b.log_softmax(-1), a.log_softmax(-1), log_target=True, reduction="none").sum(-1)
    return Agreement(
        float((a.argmax(-1) == b.argmax(-1)).float().mean()), float((a - b).abs().max()), float(kl.mean())
    )


# Held-out stdlib modules (efim_tools.training.data.HELD_OUT_MODULES keeps them out of training).
PROMPT_MODULES = ("heapq.py", "textwrap.py", "fnmatch.py", "shlex.py", "colorsys.py")


def code_requests(modules: tuple[str, ...] = PROMPT_MODULES, *, prefix_chars: int = 900, suffix_chars: int = 400):
    """One `InfillRequest` per module: the cursor halfway into an indented line a third of
    the way down (code, not the docstring), the typed part of that line as the increment."""
    from engine.api import InfillRequest
    from tiny_models import stdlib_sources

    requests = []
    for text in stdlib_sources(modules):
        line_start = text.index("\n    ", len(text) // 3) + 1
        cursor = (line_start + text.index("\n", line_start)) // 2
        requests.append(InfillRequest(
            key="prompt", prefix=text[max(0, line_start - prefix_chars):line_start],
            increment=text[line_start:cursor], suffix=text[cursor:cursor + suffix_chars],
        ))
    return requests


def code_prompts(loaded, modules: tuple[str, ...] = PROMPT_MODULES) -> list[list[int]]:
    """`code_requests` as token ids in the engine's EFIM layout for `loaded`'s template (the
    shipped adapter's: `<spm_suffix> S <spm_prefix> P I`). No token healing."""
    from engine.text.templates import detect_template
    from engine.text.tokenize import SegmentTokenizer

    template = detect_template(loaded.tokenizer)
    tokenizer = SegmentTokenizer(loaded.tokenizer)
    return [tokenizer.encode(template.render(r)).ids for r in code_requests(modules)]


def greedy(loaded, ids: list[int], n: int):
    """The engine model's `n` greedy tokens after `ids` and the logits [n, V] each was chosen from."""
    import torch

    model = loaded.model
    kv = model.new_kv(len(ids) + n)
    logits = model.forward(torch.tensor(ids), kv, 0, "last")  # [1, V]
    out, rows = [], []
    for step in range(n):
        rows.append(logits[0])
        out.append(int(logits[0].argmax()))
        logits = model.forward(torch.tensor(out[-1:]), kv, len(ids) + step, "last")  # [1, V]
    return out, torch.stack(rows)  # [n], [n, V]
