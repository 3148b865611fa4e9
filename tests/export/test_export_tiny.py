"""`efim export gguf` on tiny random models (fast): the exported GGUF holds the weights the
engine computes with (adapter merged), llama.cpp's metadata (vocabulary with the adapter's
tokens, FIM ids, file type, tensor types), and bad input fails clearly, leaving nothing."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import pytest
import torch

from efim_tools import cli
from efim_tools.export import export_gguf
from efim_tools.export.tensors import storage_type
from engine.api import EngineError
from engine.model.loader import load_model
from peers_fixtures import load_exported, logit_agreement
from tiny_models import stdlib_sources, write_tiny_gguf

CODE = stdlib_sources(("textwrap.py",))[0][:2000]
SPM = ["<spm_prefix>", "<spm_middle>", "<spm_suffix>", "<spm_pad>"]


@pytest.fixture(autouse=True)
def cache_dir(tmp_path, monkeypatch) -> Path:
    d = tmp_path / "cache"
    monkeypatch.setenv("EFIM_CACHE_DIR", str(d))
    return d


def _tiny_gguf(tiny_model_factory, tmp_path, arch="llama", fim_tokens=True) -> Path:
    return write_tiny_gguf(tiny_model_factory(arch, fim_tokens=fim_tokens), tmp_path / f"tiny-{arch}.gguf")


def _spm_adapter(tmp_path: Path, vocab: int = 1536, hidden: int = 64) -> Path:
    """A LoRA on q/k/down of layer 0 and the four suffix-first sentinels (random rows)."""
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(1)
    tensors = {"model.embed_tokens.extra": torch.randn(4, hidden, generator=g) * 0.1}
    for module, (out, inp) in {"self_attn.q_proj": (64, 64), "self_attn.k_proj": (32, 64), "mlp.down_proj": (64, 128)}.items():
        tensors[f"model.layers.0.{module}.weight.lora_A"] = torch.randn(4, inp, generator=g) * 0.2  # [r, in]
        tensors[f"model.layers.0.{module}.weight.lora_B"] = torch.randn(out, 4, generator=g) * 0.2  # [out, r]
    path = tmp_path / "spm-adapter.safetensors"
    save_file(tensors, str(path), metadata={"alpha": "8", "added_tokens": json.dumps([[vocab + i, n] for i, n in enumerate(SPM)])})
    return path


def _logits(loaded, ids):
    return loaded.model.forward(torch.tensor(ids), loaded.model.new_kv(len(ids)), 0, "all")  # [T, V]


def _prompt(loaded) -> list[int]:
    tid = loaded.tokenizer.token_to_id
    text = loaded.tokenizer.encode(CODE).ids
    return [tid("<spm_suffix>"), *text[60:100], tid("<spm_prefix>"), *text[:60]]


def test_export_holds_the_merged_weights_and_the_adapters_sentinels(tiny_model_factory, tmp_path):
    source = _tiny_gguf(tiny_model_factory, tmp_path, fim_tokens=False)
    adapter = _spm_adapter(tmp_path)
    result = export_gguf(tmp_path / "out.gguf", model=source, adapter=adapter, export_type="f32")
    assert result.template == "efim-spm" and result.suffix_first
    assert result.fim_ids == {"pre": 1536, "suf": 1538, "mid": 1537, "pad": 1539}  # no rep/sep: the template has none
    engine = load_model(source, dtype="fp32", adapter=adapter)
    exported = load_exported(result.path)
    ids = _prompt(engine)
    assert ids == _prompt(exported)  # same vocabulary, the sentinels as special tokens
    torch.testing.assert_close(_logits(exported, ids), _logits(engine, ids), rtol=0, atol=1e-5)
    base = load_model(source, dtype="fp32", adapter=None)
    assert (_logits(base, ids[-10:]) - _logits(engine, ids[-10:])[:, :1536]).abs().max() > 1e-3  # the merge mattered

    reader = gguf.GGUFReader(str(result.path))
    field = lambda key: reader.fields[key].contents()  # noqa: E731
    tokens, types = field("tokenizer.ggml.tokens"), field("tokenizer.ggml.token_type")
    assert len(tokens) == len(types) == field("llama.vocab_size") == 1540
    assert tokens[1536:] == SPM and types[1536:] == [3, 3, 3, 3]  # control tokens
    assert field("tokenizer.ggml.fim_pre_token_id") == 1536 and field("tokenizer.ggml.fim_suf_token_id") == 1538
    assert "tokenizer.ggml.fim_sep_token_id" not in reader.fields
    assert field("general.file_type") == gguf.LlamaFileType.ALL_F32
    assert field("efim.adapter") == adapter.name and field("efim.template") == "efim-spm"
    assert field("tokenizer.ggml.merges") == gguf.GGUFReader(str(source)).fields["tokenizer.ggml.merges"].contents()


@pytest.mark.parametrize("arch", ["qwen2", "starcoder2"])
def test_other_architectures_round_trip(arch, tiny_model_factory, tmp_path):
    """Biases, untied heads (qwen2) and LayerNorm biases (starcoder2) survive; no Q/K
    permutation outside "llama". FIM ids come from the StarCoder sentinels, rep/sep included."""
    source = _tiny_gguf(tiny_model_factory, tmp_path, arch=arch)
    result = export_gguf(tmp_path / "out.gguf", model=source, adapter="none", export_type="f32")
    engine, exported = load_model(source, dtype="fp32", adapter=None), load_exported(result.path)
    ids = engine.tokenizer.encode(CODE).ids[:80]
    torch.testing.assert_close(_logits(exported, ids), _logits(engine, ids), rtol=0, atol=1e-5)
    tid = engine.tokenizer.token_to_id
    assert result.template == "starcoder"
    assert result.fim_ids == {"pre": tid("<fim_prefix>"), "suf": tid("<fim_suffix>"), "mid": tid("<fim_middle>"),
                              "pad": tid("<fim_pad>"), "sep": tid("<file_sep>"), "rep": tid("<repo_name>")}


def test_quantised_types_store_each_tensor_as_documented(tiny_model_factory, tmp_path):
    source = _tiny_gguf(tiny_model_factory, tmp_path)
    engine = load_model(source, dtype="fp32", adapter=None)
    ids = engine.tokenizer.encode(CODE).ids[:80]
    reference = _logits(engine, ids)
    kl = {}
    for export_type, ggml in (("f16", "F16"), ("bf16", "BF16"), ("q8_0", "Q8_0"), ("q4_0", "Q4_0")):
        result = export_gguf(tmp_path / f"{export_type}.gguf", model=source, adapter="none", export_type=export_type)
        types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(str(result.path)).tensors}
        assert types["blk.0.attn_q.weight"] == ggml and types["blk.0.attn_norm.weight"] == "F32"
        assert types["token_embd.weight"] == ("Q8_0" if export_type == "q4_0" else ggml)  # the tied head keeps 8 bits
        agreement = logit_agreement(reference, _logits(load_exported(result.path), ids))
        kl[export_type] = agreement.kl
        print(export_type, agreement)
    # Random tiny models have near-ties everywhere, so top-1 says little here; KL grows with the error.
    assert kl["f16"] < 1e-5 and kl["bf16"] < 1e-3 and kl["q8_0"] < 1e-3 and kl["q4_0"] < 0.05, kl
    assert kl["f16"] < kl["q8_0"] < kl["q4_0"], kl
    assert storage_type("blk.0.attn_q.weight", (64, 48), "q8_0") == "F16"  # 48 is not a multiple of 32


# ------------------------------------------------------------------------ errors


def _leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("."))


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"export_type": "q3_k"}, ValueError, "unknown export type 'q3_k'"),
        ({"model": "nowhere/model.gguf"}, EngineError, "not found"),
        ({"adapter": "nowhere/adapter"}, EngineError, "adapter .* not found"),
    ],
)
def test_bad_input_fails_clearly_and_keeps_the_existing_file(kwargs, error, match, tiny_model_factory, tmp_path, monkeypatch):
    source = _tiny_gguf(tiny_model_factory, tmp_path)
    monkeypatch.chdir(tmp_path)
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    dest = out_dir / "model.gguf"
    dest.write_bytes(b"an earlier export")
    with pytest.raises(error, match=match):
        export_gguf(dest, **{"model": source, **kwargs})
    assert dest.read_bytes() == b"an earlier export"
    assert _leftovers(out_dir) == []


def test_unwritable_destinations_are_refused_before_any_work(tiny_model_factory, tmp_path):
    source = _tiny_gguf(tiny_model_factory, tmp_path)
    (tmp_path / "a-file").write_text("x")
    (tmp_path / "a-dir").mkdir()
    with pytest.raises(FileNotFoundError, match="does not exist"):
        export_gguf(tmp_path / "missing" / "x.gguf", model=source)
    with pytest.raises(ValueError, match="not a folder"):
        export_gguf(tmp_path / "a-file" / "x.gguf", model=source)
    with pytest.raises(ValueError, match="is a directory"):
        export_gguf(tmp_path / "a-dir", model=source)
    with pytest.raises(ValueError, match="cannot write"):
        export_gguf("/proc/efim-export-test.gguf", model=source)  # even root cannot create files in /proc


def test_a_write_that_fails_midway_leaves_nothing(tiny_model_factory, tmp_path, monkeypatch):
    import efim_tools.export.gguf_file as gguf_file

    source = _tiny_gguf(tiny_model_factory, tmp_path)
    out_dir = tmp_path / "out"
    out_dir.mkdir()

    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(gguf.GGUFWriter, "write_tensors_to_file", disk_full)
    with pytest.raises(ValueError, match="No space left"):
        gguf_file.export_gguf(out_dir / "x.gguf", model=source)
    assert list(out_dir.iterdir()) == []


def test_hf_folder_sources_are_refused_with_the_way_out(tiny_model_factory, tmp_path):
    with pytest.raises(ValueError, match="convert_hf_to_gguf"):
        export_gguf(tmp_path / "x.gguf", model=tiny_model_factory("llama"))
    assert list(tmp_path.glob("*.gguf")) == []


def test_cli(tiny_model_factory, tmp_path, capsys):
    source = _tiny_gguf(tiny_model_factory, tmp_path)
    assert cli.main(["export", "gguf", str(tmp_path / "x.gguf"), "--type", "Q8_0", "--model", str(source), "--adapter", "none"]) == 0
    out = capsys.readouterr().out
    assert "q8_0" in out and "FIM ids pre=" in out
    assert gguf.GGUFReader(str(tmp_path / "x.gguf")).fields["general.file_type"].contents() == gguf.LlamaFileType.MOSTLY_Q8_0
    assert cli.main(["export", "gguf", str(tmp_path / "y.gguf"), "--type", "q3", "--model", str(source)]) == 2
    assert "unknown export type 'q3'" in capsys.readouterr().err
    assert not (tmp_path / "y.gguf").exists()
