"""`adapter` option resolution: auto / none / a path; auto only for the default model and only
when the shipped adapter's card marks it ready."""

from __future__ import annotations

import json

import pytest

import engine.adapters as adapters
from engine.api import EngineError


def _fake_shipped(tmp_path, ready: bool | None):
    folder = tmp_path / "smollm2-efim"
    folder.mkdir()
    config = {"format": "efim-lora/1"}
    if ready is not None:
        config["ready"] = ready
    (folder / "adapter_config.json").write_text(json.dumps(config))
    (folder / "adapter_model.safetensors").write_bytes(b"")
    return folder


@pytest.mark.parametrize("value", [None, "", "none"])
def test_none_means_no_adapter(value):
    assert adapters.resolve_adapter("default", value) is None


@pytest.mark.parametrize(("ready", "expected"), [(True, True), (False, False), (None, False)])
def test_auto_takes_the_shipped_adapter_for_the_default_model_only_when_ready(tmp_path, monkeypatch, ready, expected):
    folder = _fake_shipped(tmp_path, ready)
    monkeypatch.setattr(adapters, "SHIPPED_ADAPTER", folder)
    assert adapters.resolve_adapter("default", "auto") == (folder if expected else None)
    assert adapters.resolve_adapter(str(tmp_path / "some-model"), "auto") is None  # not ours to patch


def test_auto_without_weights_is_not_ready(tmp_path, monkeypatch):
    folder = _fake_shipped(tmp_path, True)
    (folder / "adapter_model.safetensors").unlink()
    monkeypatch.setattr(adapters, "SHIPPED_ADAPTER", folder)
    assert adapters.resolve_adapter("default", "auto") is None


def test_an_explicit_path_must_exist(tmp_path):
    assert adapters.resolve_adapter("default", tmp_path) == tmp_path
    with pytest.raises(EngineError, match="nowhere"):
        adapters.resolve_adapter("default", tmp_path / "nowhere")


def test_the_shipped_card_states_readiness_explicitly():
    config = json.loads((adapters.SHIPPED_ADAPTER / "adapter_config.json").read_text())
    assert isinstance(config.get("ready"), bool), "the card's evaluation decides; say so in adapter_config.json"


@pytest.mark.parametrize(
    ("config", "heals"),
    [({"fragment_trained": True}, False), ({"fragment_trained": False}, True), ({}, True),
     ({"fragment_trained": True, "healing": "on"}, True), ({"healing": "off"}, False)],
)
def test_healing_follows_the_adapter_card(tmp_path, config, heals):
    (tmp_path / "adapter_config.json").write_text(json.dumps(config))
    assert adapters.adapter_heals(tmp_path) is heals
    assert adapters.adapter_heals(tmp_path / "adapter_model.safetensors") is heals  # the file form too


def test_the_shipped_card_states_its_healing(tmp_path):
    config = json.loads((adapters.SHIPPED_ADAPTER / "adapter_config.json").read_text())
    assert config.get("healing") in ("on", "off"), "measured in the card's table; say which is better"
