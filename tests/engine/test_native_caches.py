"""`engine.runtime.native_caches`: the shape-keyed native caches are bounded before the
engine's first forward, and a value the user set is kept."""

from __future__ import annotations

import os

from engine.runtime.native_caches import CAPACITY, VARIABLES, bound_native_caches


def test_the_native_shape_caches_are_bounded_unless_the_user_set_them(monkeypatch):
    for name in VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("LRU_CACHE_CAPACITY", "7")  # the user's value stays
    got = bound_native_caches()
    assert got == {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": str(CAPACITY), "LRU_CACHE_CAPACITY": "7"}
    assert os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == str(CAPACITY)


def test_loading_a_model_for_an_engine_bounds_them_first(monkeypatch, tiny_model_factory):
    from engine.runtime.loading import load_model_for_engine  # noqa: PLC0415

    for name in VARIABLES:
        monkeypatch.delenv(name, raising=False)
    load_model_for_engine(str(tiny_model_factory("llama")), dtype="fp32", adapter="none")
    assert {name: os.environ.get(name) for name in VARIABLES} == {name: str(CAPACITY) for name in VARIABLES}
