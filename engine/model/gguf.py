"""GGUF -> Hugging Face folder, once per file content.

`convert_gguf(path, cache_root)` dequantises every tensor (gguf's reference
dequantisers), renames them to transformers' parameter names, undoes llama.cpp's Q/K
row permutation, builds `tokenizer.json` from the file's vocabulary and merges, and
writes `config.json` + `model.safetensors` + `tokenizer.json` into
`<cache_root>/gguf/<sha256[:24]>-v<format>/`. The folder is written to a temporary
directory and renamed into place, so a crash or a concurrent start never leaves a
half-written folder behind. The sha256 of the file is remembered per (path, size,
mtime), so the second start reads no more than the folder.

Quantised tensors are stored as fp16 (rounding of at most 2^-11 relative, far below the
4/8-bit quantisation step already in the values; bf16 would add 2^-9); float tensors
keep their dtype.

llama.cpp's permutation: for Llama-arch models its converter reorders the rows of
`attn_q`/`attn_k` within each head from the "rotate halves" (neox) layout transformers
uses to interleaved pairs (its own RoPE kernel's layout):
`w.reshape(n_head, 2, D/2, K).swapaxes(1, 2)`. The inverse is
`w.reshape(n_head, D/2, 2, K).swapaxes(1, 2)`. Qwen2 and StarCoder2 files are not
permuted (llama.cpp uses neox RoPE for them).
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from engine.api import EngineError
from engine.model.gguf_metadata import GGUFMetadata
from engine.model.gguf_reader import GGUFError, GGUFFile

if TYPE_CHECKING:  # the annotation only; quant imports torch kernels lazily here
    from engine.model.quant import Int4Groups

log = logging.getLogger(__name__)

SUPPORTED_GGUF_ARCHITECTURES = ("llama", "qwen2", "starcoder2")
_FORMAT_VERSION = 3  # bump when the converted folder's layout changes

# GGUF tensor name (after "blk.N.") -> HF parameter name (after "model.layers.N.").
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
}
_FFN_NAMES = {
    "gated": {"ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"},
    "starcoder2": {"ffn_up": "mlp.c_fc", "ffn_down": "mlp.c_proj"},
}
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
# The same names the other way, for code that writes GGUF files (`efim export gguf`, the
# tests' tiny GGUFs): HF parameter name (after "model.layers.N.") -> GGUF name (after "blk.N.").
HF_TO_GGUF_LAYER: dict[str, str] = {hf: g for g, hf in _LAYER_NAMES.items()} | {
    hf: g for names in _FFN_NAMES.values() for g, hf in names.items()
}
HF_TO_GGUF_GLOBAL: dict[str, str] = {hf: g for g, hf in _GLOBAL_NAMES.items()}

# llama.cpp's pre-tokenizer ids -> how the matching HF tokenizer splits text before BPE.
_GPT2_DIGITS = ("starcoder", "smollm", "refact", "codeshell", "command-r", "exaone", "minerva")
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)
_DEEPSEEK_CODER_SPLITS = (r"[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", r"[一-龥ࠀ-一가-퟿]+")


# ------------------------------------------------------------------------- hashing


def file_sha256(path: Path, state_dir: Path) -> str:
    """sha256 of the file, read 8 MiB at a time; remembered in `state_dir/hashes.json`
    under (resolved path, size, mtime_ns) so an unchanged file is hashed once."""
    st = path.stat()
    key = f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}"
    memo_path = state_dir / "hashes.json"
    try:
        memo = json.loads(memo_path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        memo = {}
    if key in memo:
        return memo[key]
    h = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(8 << 20):
            h.update(block)
    digest = h.hexdigest()
    memo[key] = digest
    state_dir.mkdir(parents=True, exist_ok=True)
    tmp = memo_path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(memo, indent=1), encoding="utf-8")
    os.replace(tmp, memo_path)
    return digest


# ------------------------------------------------------------------------ metadata


def _f32(value: Any) -> float:
    """A float32 metadata value as the shortest decimal that rounds to it (1e-05, not
    9.999999747378752e-06): what the original config most likely said."""
    return float(np.format_float_scientific(np.float32(value), unique=True))


def _hf_config(meta: GGUFMetadata, arch: str, tensor_names: set[str]) -> dict[str, Any]:
    hidden = int(meta.require(f"{arch}.embedding_length"))
    heads = int(meta.require(f"{arch}.attention.head_count"))
    kv_heads = int(meta.get(f"{arch}.attention.head_count_kv", heads))
    tokens = meta.require("tokenizer.ggml.tokens")
    eos = meta.get("tokenizer.ggml.eos_token_id")
    eot = meta.get("tokenizer.ggml.eot_token_id")
    eos_ids = [int(i) for i in dict.fromkeys(x for x in (eos, eot) if x is not None)]
    config: dict[str, Any] = {
        "model_type": arch,
        "architectures": [{"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "starcoder2": "Starcoder2ForCausalLM"}[arch]],
        "vocab_size": int(meta.get(f"{arch}.vocab_size", len(tokens))),
        "hidden_size": hidden,
        "intermediate_size": int(meta.require(f"{arch}.feed_forward_length")),
        "num_hidden_layers": int(meta.require(f"{arch}.block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": int(meta.get(f"{arch}.attention.key_length", hidden // heads)),
        "max_position_embeddings": int(meta.get(f"{arch}.context_length", 4096)),
        "rope_theta": _f32(meta.get(f"{arch}.rope.freq_base", 10000.0)),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": eos_ids[0] if len(eos_ids) == 1 else (eos_ids or None),
        "torch_dtype": "float16",
    }
    if "rope_freqs.weight" in tensor_names:
        raise EngineError("GGUF with precomputed RoPE frequency factors (rope_freqs) is not supported")
    scaling = meta.get(f"{arch}.rope.scaling.type")
    if scaling not in (None, "none"):
        if scaling != "linear":
            raise EngineError(f"GGUF RoPE scaling {scaling!r} is not supported (supported: linear)")
        config["rope_scaling"] = {"rope_type": "linear", "factor": _f32(meta.require(f"{arch}.rope.scaling.factor"))}
    if arch == "starcoder2":
        config.update(
            norm_epsilon=_f32(meta.get(f"{arch}.attention.layer_norm_epsilon", 1e-5)),
            use_bias="blk.0.attn_q.bias" in tensor_names,
            hidden_act="gelu_pytorch_tanh",
        )
    else:
        config.update(
            rms_norm_eps=_f32(meta.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
            hidden_act="silu",
        )
        if arch == "llama":
            config["attention_bias"] = "blk.0.attn_q.bias" in tensor_names
            config["mlp_bias"] = "blk.0.ffn_up.bias" in tensor_names
    return config


# ------------------------------------------------------------------------- tensors


def _hf_name(gguf_name: str, arch: str) -> str | None:
    stem, _, suffix = gguf_name.rpartition(".")  # suffix: weight | bias
    if stem in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[stem]}.{suffix}"
    parts = stem.split(".")
    if len(parts) == 3 and parts[0] == "blk":
        ffn = _FFN_NAMES["starcoder2" if arch == "starcoder2" else "gated"]
        hf = _LAYER_NAMES.get(parts[2]) or ffn.get(parts[2])
        if hf is not None:
            return f"model.layers.{parts[1]}.{hf}.{suffix}"
    return None


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of llama.cpp's Q/K row permutation (rows of each head: interleaved -> halves)."""
    half = w.shape[0] // n_head // 2
    return w.reshape(n_head, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _tensors(reader, arch: str, config: dict[str, Any], path: Path) -> dict[str, torch.Tensor]:
    import gguf  # noqa: PLC0415

    float_types = {
        gguf.GGMLQuantizationType.F32: torch.float32,
        gguf.GGMLQuantizationType.F16: torch.float16,
        gguf.GGMLQuantizationType.BF16: torch.bfloat16,
    }
    out: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        name = _hf_name(t.name, arch)
        if name is None:
            raise EngineError(f"GGUF tensor {t.name!r} has no counterpart in a {arch} model")
        array = dequantize_tensor(t, path)  # numpy, row-major [out, in]
        array = np.asarray(array, dtype=np.float32)
        if not array.flags.writeable:  # float tensors come back as views of the read-only mmap
            array = array.copy()
        if arch == "llama" and (".q_proj." in name or ".k_proj." in name):
            heads = config["num_attention_heads"] if ".q_proj." in name else config["num_key_value_heads"]
            array = unpermute_qk(array, heads)
        dtype = float_types.get(t.tensor_type, torch.float16)
        out[name] = torch.from_numpy(np.ascontiguousarray(array)).to(dtype)
    return out


# ------------------------------------------------------------- kept quantised blocks

# GGML types whose blocks are exact groups of 32 four-bit codes with a scale and a minimum
# (engine.model.quant.Int4Groups); everything else is read through the dequantiser.
INT4_BLOCK_TYPES = ("Q4_0", "Q4_1", "Q4_K")
# Float types: the loader's "auto" keeps these dense (bf16 / fp32).
FLOAT_TYPES = ("F32", "F16", "BF16", "F64")


def dequantize_tensor(t, path: Path) -> np.ndarray:
    """gguf's reference dequantiser for one tensor; EngineError naming the file, the tensor
    and its type when the type has none (or the data is malformed)."""
    import gguf  # noqa: PLC0415

    try:
        return gguf.quants.dequantize(t.data, t.tensor_type)
    except NotImplementedError:
        raise EngineError(
            f"{path}: tensor {t.name!r} has GGML type {t.tensor_type.name}, which this loader cannot read "
            f"(supported: F32, F16, BF16, Q4_0/1, Q5_0/1, Q8_0, K-quants Q2_K-Q6_K, IQ types)"
        ) from None
    except (ValueError, TypeError) as exc:
        raise EngineError(f"{path}: tensor {t.name!r} ({t.tensor_type.name}) is malformed: {exc}") from None


def open_gguf(path: Path) -> GGUFFile:
    """The metadata and tensor table of `path` (`engine.model.gguf_reader.GGUFFile`: what the
    engine uses of `gguf.GGUFReader`, ~17x faster); EngineError for a file that is not (or no
    longer) a whole GGUF.

    The last file's reader is kept (`forget_readers` drops it, and its memory map): a load
    reads the tensor table twice."""
    try:
        st = path.stat()
    except OSError as exc:
        raise EngineError(f"cannot read {path}: {exc}") from None
    return _reader(str(path.resolve()), st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=1)
def _reader(path: str, size: int, mtime_ns: int) -> GGUFFile:
    try:
        return GGUFFile(path)
    except (GGUFError, OSError) as exc:
        raise EngineError(f"cannot read {path} as GGUF: {exc}") from None


def forget_readers() -> None:
    """Drop the kept reader (and its memory map)."""
    _reader.cache_clear()


def gguf_tensor_types(path: Path) -> dict[str, str]:
    """HF parameter name -> GGML type name ("Q4_1", "F32", ...) of every tensor in the file."""
    reader = open_gguf(path)
    arch = GGUFMetadata(reader).require("general.architecture")
    return {name: t.tensor_type.name for t in reader.tensors if (name := _hf_name(t.name, arch)) is not None}


def int4_groups(path: Path, names: set[str]) -> dict[str, "Int4Groups"]:
    """The exact 4-bit groups of the named tensors (HF names) stored as Q4_0, Q4_1 or Q4_K,
    rows un-permuted as `_tensors` does; other tensors are not returned. Nothing is
    dequantised: the codes are the file's, scale and minimum its fp16 values (Q4_K: their
    products with the 6-bit sub-block factors, exact in float32)."""
    from engine.model.quant import Int4Groups  # noqa: PLC0415

    reader = open_gguf(path)
    meta = GGUFMetadata(reader)
    arch = meta.require("general.architecture")
    config = _hf_config(meta, arch, {t.name for t in reader.tensors})
    out: dict[str, Int4Groups] = {}
    for t in reader.tensors:
        name = _hf_name(t.name, arch)
        if name not in names or t.tensor_type.name not in INT4_BLOCK_TYPES:
            continue
        n_out = int(t.shape[1])
        blocks = np.asarray(t.data).reshape(n_out, -1)  # [N, bytes per row]
        try:
            q, scale, minimum = _DECODERS[t.tensor_type.name](blocks)  # [N, K], [N, K/32], [N, K/32]
        except ValueError as exc:  # a row of the wrong byte length
            raise EngineError(f"{path}: tensor {t.name!r} ({t.tensor_type.name}) is malformed: {exc}") from None
        if arch == "llama" and (".q_proj." in name or ".k_proj." in name):
            heads = config["num_attention_heads"] if ".q_proj." in name else config["num_key_value_heads"]
            q, scale, minimum = (unpermute_qk(a, heads) for a in (q, scale, minimum))
        out[name] = Int4Groups(
            torch.from_numpy(np.ascontiguousarray(q)),
            torch.from_numpy(np.ascontiguousarray(scale, dtype=np.float32)),
            torch.from_numpy(np.ascontiguousarray(minimum, dtype=np.float32)),
        )
    return out


def _nibbles(qs: np.ndarray) -> np.ndarray:  # [..., 16] uint8 -> [..., 32]: low nibbles first
    return np.concatenate((qs & 0x0F, qs >> 4), axis=-1)


def _decode_q4_0(rows: np.ndarray):
    n = rows.shape[0]
    b = rows.reshape(n, -1, 18)  # [N, K/32, 18]: fp16 d, 16 bytes of codes
    d = b[..., :2].copy().view(np.float16)[..., 0].astype(np.float32)  # [N, K/32]
    return _nibbles(b[..., 2:]).reshape(n, -1), d, -8.0 * d


def _decode_q4_1(rows: np.ndarray):
    n = rows.shape[0]
    b = rows.reshape(n, -1, 20)  # [N, K/32, 20]: fp16 d, fp16 m, 16 bytes of codes
    dm = b[..., :4].copy().view(np.float16).astype(np.float32)  # [N, K/32, 2]
    return _nibbles(b[..., 4:]).reshape(n, -1), dm[..., 0], dm[..., 1]


def _decode_q4_k(rows: np.ndarray):
    """Q4_K super-block (256 weights): fp16 d, fp16 dmin, 12 bytes of 6-bit (sc, m) pairs
    for 8 sub-blocks of 32, 128 bytes of codes (64 weights per 32 bytes: 32 low nibbles, then 32
    high). Sub-block s: w = d * sc[s] * q - dmin * m[s]."""
    from gguf.quants import Q4_K  # noqa: PLC0415

    n = rows.shape[0]
    b = rows.reshape(-1, 144)  # [N * K/256, 144]
    dd = b[:, :4].copy().view(np.float16).astype(np.float32)  # [B, 2]
    sc, mn = Q4_K.get_scale_min(b[:, 4:16])  # [B, 8] each
    qs = b[:, 16:].reshape(-1, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)  # [B, 4, 2, 32]
    q = (qs & 0x0F).reshape(n, -1)  # [N, K]
    scale = (dd[:, :1] * sc.astype(np.float32)).reshape(n, -1)  # [N, K/32]
    minimum = (-dd[:, 1:] * mn.astype(np.float32)).reshape(n, -1)  # [N, K/32]
    return q, scale, minimum


_DECODERS = {"Q4_0": _decode_q4_0, "Q4_1": _decode_q4_1, "Q4_K": _decode_q4_k}


# ----------------------------------------------------------------------- tokenizer


def _byte_level_pre_tokenizer(pre: str | None):
    from tokenizers import Regex, pre_tokenizers  # noqa: PLC0415

    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    if pre in _GPT2_DIGITS:
        return pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
        )
    if pre in ("qwen2", "deepseek-r1-qwen"):
        return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(_QWEN2_SPLIT), "isolated"), byte_level])
    if pre in ("llama-bpe", "llama3", "llama-v3", "smaug-bpe"):
        return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(_LLAMA3_SPLIT), "isolated"), byte_level])
    if pre == "deepseek-coder":
        splits = [pre_tokenizers.Split(Regex(r), "isolated") for r in _DEEPSEEK_CODER_SPLITS]
        return pre_tokenizers.Sequence([*splits, pre_tokenizers.Digits(individual_digits=True), byte_level])
    if pre not in (None, "default", "gpt-2", "gpt2"):
        log.warning("GGUF pre-tokenizer %r is not known; splitting text as GPT-2 does", pre)
    return pre_tokenizers.ByteLevel(add_prefix_space=False)


def build_tokenizer(meta: GGUFMetadata):
    """A `tokenizers.Tokenizer` equivalent to the file's vocabulary (byte-level BPE), with
    its control tokens as special tokens. SentencePiece vocabularies go through
    transformers' GGUF converter when it is available."""
    from tokenizers import AddedToken, Tokenizer, decoders, models  # noqa: PLC0415

    kind = meta.get("tokenizer.ggml.model")
    if kind != "gpt2":
        return _sentencepiece_tokenizer(meta, kind)
    tokens: list[str] = meta.require("tokenizer.ggml.tokens")
    merges = [tuple(m.split(" ", 1)) for m in meta.require("tokenizer.ggml.merges")]
    types = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    pre = meta.get("tokenizer.ggml.pre")
    vocab = {tok: i for i, tok in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=pre in ("llama-bpe", "llama3")))
    tok.pre_tokenizer = _byte_level_pre_tokenizer(pre)
    tok.decoder = decoders.ByteLevel()
    control = [AddedToken(t, special=True, normalized=False) for t, ty in zip(tokens, types) if ty == 3]
    user = [AddedToken(t, special=False, normalized=False) for t, ty in zip(tokens, types) if ty == 4]
    if control:
        tok.add_special_tokens(control)
    if user:
        tok.add_tokens(user)
    return tok


def _sentencepiece_tokenizer(meta: GGUFMetadata, kind: str | None):
    try:
        from transformers.integrations.gguf.gguf_tokenizer_mapping import (  # noqa: PLC0415
            GGUF_TOKENIZER_MAPPING,
            convert_gguf_tokenizer,
        )
    except ImportError:
        raise EngineError(
            f"GGUF tokenizer model {kind!r} needs transformers' GGUF converter, which this transformers lacks; "
            "supported without it: 'gpt2' (byte-level BPE)"
        ) from None
    tokenizer_dict = {
        name: meta.get(f"tokenizer.{key}")
        for key, name in GGUF_TOKENIZER_MAPPING["tokenizer"].items()
        if meta.get(f"tokenizer.{key}") is not None
    }
    try:
        backend, _ = convert_gguf_tokenizer(meta.require("general.architecture"), tokenizer_dict)
    except Exception as exc:  # transformers raises ValueError/KeyError for unknown layouts
        raise EngineError(f"cannot build a tokenizer from this GGUF ({kind!r}): {exc}") from None
    return backend


# ------------------------------------------------------------------------- convert


def convert_gguf(path: Path, cache_root: Path) -> Path:
    """The HF folder converted from GGUF `path` (converting it on first use)."""
    digest = file_sha256(path, cache_root)
    folder = cache_root / "gguf" / f"{digest[:24]}-v{_FORMAT_VERSION}"  # content, not name: copies share it
    if (folder / "config.json").is_file():
        return folder
    log.info("converting %s into %s (once)", path, folder)
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=folder.parent))
    try:
        write_hf_folder(path, tmp)
        os.chmod(tmp, 0o755)  # mkdtemp creates 0700; the cache is an ordinary user directory
        try:
            os.rename(tmp, folder)
        except OSError:
            if not (folder / "config.json").is_file():  # not a concurrent winner: a real failure
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder


def write_hf_folder(path: Path, dest: Path) -> None:
    from safetensors.torch import save_file  # noqa: PLC0415

    reader = open_gguf(path)
    meta = GGUFMetadata(reader)
    arch = meta.require("general.architecture")
    if arch not in SUPPORTED_GGUF_ARCHITECTURES:
        raise EngineError(
            f"unsupported GGUF architecture {arch!r} in {path}; supported: {', '.join(SUPPORTED_GGUF_ARCHITECTURES)}"
        )
    names = {t.name for t in reader.tensors}
    config = _hf_config(meta, arch, names)
    tokenizer = build_tokenizer(meta)
    weights = _tensors(reader, arch, config, path)
    save_file(weights, str(dest / "model.safetensors"), metadata={"format": "pt", "source": path.name})
    tokenizer.save(str(dest / "tokenizer.json"))
    tokens = meta.require("tokenizer.ggml.tokens")

    def token(key: str) -> str | None:
        i = meta.get(f"tokenizer.ggml.{key}")
        return tokens[i] if i is not None and 0 <= i < len(tokens) else None

    tok_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": token("bos_token_id"),
        "eos_token": token("eos_token_id"),
        "pad_token": token("padding_token_id"),
        "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        "model_max_length": config["max_position_embeddings"],
    }
    if meta.get("tokenizer.chat_template"):
        tok_config["chat_template"] = meta.get("tokenizer.chat_template")
    (dest / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2), encoding="utf-8")
    (dest / "config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")  # written last


__all__ = [
    "convert_gguf",
    "write_hf_folder",
    "build_tokenizer",
    "file_sha256",
    "unpermute_qk",
    "gguf_tensor_types",
    "int4_groups",
    "dequantize_tensor",
    "forget_readers",
    "INT4_BLOCK_TYPES",
    "FLOAT_TYPES",
]
