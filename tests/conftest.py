"""Shared fixtures. Append new shared fixtures at the end of this file (tests of several packages use it).

Tiny models: `tiny_model_dir` is the llama-family tiny model (SmolLM2-like, tied
embeddings, FIM tokens). Parametrise the architecture indirectly:

    @pytest.mark.parametrize("tiny_model_dir", ["llama", "qwen2", "starcoder2"], indirect=True)
    def test_x(tiny_model_dir): ...

`tiny_model_factory(arch, **overrides)` builds (once per session) any other variant.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path

# Before anything imports torch (libgomp reads this once, at load): OpenMP threads that
# spin while waiting turn every parallel region into a stall when the 2 cores are shared
# with other processes (measured: a 3-token forward of the default model took 3 s
# instead of 0.05 s with 2 threads on a loaded machine). Passive waiting costs a few
# microseconds per region on an idle machine.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# The disk tier is on by default in `efim serve`: servers the tests start write their KV
# files here, never into the user's cache.
os.environ.setdefault("EFIM_KV_DIR", tempfile.mkdtemp(prefix="efim-kv-tests-"))

# `efim serve` runs its engine in the user's engine daemon by default; the servers the
# tests start keep their own engine (a daemon shared across tests would carry KV and state
# from one test into the next). The daemon's tests pass --daemon (which beats this) and
# test the default with this variable removed.
os.environ["EFIM_DAEMON"] = "0"

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def tiny_model_factory(tmp_path_factory):
    """Callable `(arch="llama", *, fim_tokens=True, seed=0, **overrides) -> Path`, cached per session."""
    from tiny_models import make_tiny_model

    built: dict[str, Path] = {}

    def make(arch: str = "llama", *, fim_tokens: bool = True, seed: int = 0, **overrides) -> Path:
        key = json.dumps([arch, fim_tokens, seed, overrides], sort_keys=True, default=str)
        if key not in built:
            name = f"tiny-{arch}-{hashlib.sha1(key.encode()).hexdigest()[:10]}"
            dest = tmp_path_factory.mktemp(name)
            built[key] = make_tiny_model(dest, arch, fim_tokens=fim_tokens, seed=seed, **overrides)
        return built[key]

    return make


@pytest.fixture(scope="session")
def tiny_model_dir(request, tiny_model_factory) -> Path:
    """A tiny random HF model folder; `request.param` (indirect parametrisation) picks the arch."""
    arch = getattr(request, "param", "llama")
    return tiny_model_factory(arch)
