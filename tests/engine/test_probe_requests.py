"""A next-edit probe after a document's prompt reuses that prompt's KV: only the probe is
prefilled, and the answer is what the same prompt computed from scratch answers."""

from __future__ import annotations

import pytest
from tokenizers import AddedToken, Tokenizer

from engine.api import InfillRequest
from engine.local import load_engine
from tiny_models import make_tiny_model, tiny_tokenizer_json
from efim_tools.training.samples import SPM_SENTINELS

SOURCE = "def area(width, height):\n    total = width * height\n    return total\n" * 6


@pytest.fixture(scope="module")
def spm_model(tmp_path_factory):
    tok = Tokenizer.from_str(tiny_tokenizer_json(False))
    base = tok.get_vocab_size()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPM_SENTINELS])
    dest = make_tiny_model(tmp_path_factory.mktemp("spm"), fim_tokens=False, vocab_size=base + len(SPM_SENTINELS))
    (dest / "tokenizer.json").write_text(tok.to_str(), encoding="utf-8")
    return dest


def test_a_probe_prefills_only_itself_and_answers_as_from_scratch(spm_model):
    eng = load_engine(str(spm_model), dtype="fp32", kv_budget="16M", adapter="none")
    try:
        assert eng.info().template == "efim-spm"
        at = SOURCE.index("total", 200)
        doc = dict(prefix=SOURCE[:at], increment="area_", suffix=SOURCE[at + 5:], format="efim", context="off", heal=False)
        eng.submit(InfillRequest(key="doc", max_tokens=1, **doc)).result(timeout=120)
        probe = "-    total = width * height\n+    area_ = width * height\n@    return "
        warm = eng.submit(InfillRequest(key="doc/probe", probe=probe, max_tokens=4, speculate=0, **doc)).result(timeout=120)
        assert warm.finish_reason != "error", warm.error
        probe_tokens = eng.count_tokens(probe) + 1  # and its sentinel
        assert warm.stats.prefilled_tokens <= probe_tokens + 1
        assert warm.stats.reused_tokens >= warm.stats.prompt_tokens - probe_tokens - 1
        cold = eng.submit(InfillRequest(key="cold", probe=probe, max_tokens=4, speculate=0, cache=False, **doc)).result(timeout=120)
        assert cold.text == warm.text and cold.stats.prompt_tokens == warm.stats.prompt_tokens
    finally:
        eng.close()


def test_a_model_without_a_probe_sentinel_refuses_a_probe(tiny_model_factory):
    eng = load_engine(str(tiny_model_factory("llama")), dtype="fp32", kv_budget="8M")
    try:
        done = eng.submit(InfillRequest(key="k", prefix="a = 1\n", probe="-a\n+b\n@")).result(timeout=120)
        assert done.finish_reason == "error" and "probe" in (done.error or "")
    finally:
        eng.close()


def test_only_an_adapter_trained_on_probes_says_so(tmp_path):
    import json

    from engine.adapters import SHIPPED_ADAPTER, adapter_probes

    def folder(name, config):
        path = tmp_path / name
        path.mkdir()
        (path / "adapter_config.json").write_text(json.dumps(config))
        return path

    assert adapter_probes(folder("explicit", {"next_edit": "probe"}))
    assert adapter_probes(folder("trained", {"training": {"config": {"next_edit_prob": 0.4}}}))
    assert not adapter_probes(folder("plain", {"training": {"config": {"next_edit_prob": 0.0}}}))
    assert not adapter_probes(folder("odd", {"training": "?"}))
    assert not adapter_probes(None) and not adapter_probes(tmp_path / "missing")
    shipped = json.loads((SHIPPED_ADAPTER / "adapter_config.json").read_text())
    assert adapter_probes(SHIPPED_ADAPTER) == (shipped.get("next_edit") == "probe")
