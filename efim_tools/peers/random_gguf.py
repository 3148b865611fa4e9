"""GGUF files of real model shapes with random weights, for speed measurements.

Speed does not depend on what the weights learned, so a Qwen2.5-Coder-1.5B-shaped file with
random weights times like the real one. The vocabulary (tokenizer metadata) is copied from
a vocab-only or full GGUF of the same family (llama.cpp's source ships
`models/ggml-vocab-qwen2.gguf`; the embedded SmolLM2 GGUF carries its own), so llama.cpp
loads the file and tokenizes as the real model does.

    python -m efim_tools.peers.random_gguf --shape qwen2.5-coder-1.5b --vocab ggml-vocab-qwen2.gguf \
        --type f16 -o /tmp/qwen-1.5b-random.gguf

Needs only numpy and the `gguf` package (llama.cpp's gguf-py on a machine without it:
put its folder on PYTHONPATH).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import NamedTuple

import numpy as np


class Shape(NamedTuple):
    arch: str  # GGUF architecture name
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    rope_theta: float
    context: int
    qkv_bias: bool
    tied: bool


# The real models' config.json values (Hugging Face), as users load them.
SHAPES: dict[str, Shape] = {
    "smollm2-135m": Shape("llama", 576, 1536, 30, 9, 3, 100000.0, 8192, False, True),
    "qwen2.5-coder-0.5b": Shape("qwen2", 896, 4864, 24, 14, 2, 1000000.0, 32768, True, True),
    "qwen2.5-coder-1.5b": Shape("qwen2", 1536, 8960, 28, 12, 2, 1000000.0, 32768, True, True),
    "qwen2.5-coder-7b": Shape("qwen2", 3584, 18944, 28, 28, 4, 1000000.0, 32768, True, False),
}

TYPES = ("f16", "bf16", "f32", "q8_0", "q4_0", "q4_1")


def _copy_vocab(writer, vocab_path: Path) -> int:
    """Copy `tokenizer.*` keys from a GGUF; return the vocabulary size."""
    import gguf  # noqa: PLC0415

    reader = gguf.GGUFReader(str(vocab_path))
    size = 0
    for name, field in reader.fields.items():
        if not name.startswith("tokenizer."):
            continue
        vtype = field.types[0]
        value = field.contents()
        if vtype == gguf.GGUFValueType.ARRAY:
            writer.add_key_value(name, value, vtype, sub_type=field.types[-1])
            if name == "tokenizer.ggml.tokens":
                size = len(value)
        else:
            writer.add_key_value(name, value, vtype)
    if not size:
        raise ValueError(f"{vocab_path}: no tokenizer.ggml.tokens; not a GGUF with a vocabulary")
    return size


def write_random_gguf(out: Path, shape: Shape, vocab: Path, qtype: str = "f16", seed: int = 0) -> Path:
    import gguf  # noqa: PLC0415

    if qtype not in TYPES:
        raise ValueError(f"unknown type {qtype!r}; choose from {TYPES}")
    rng = np.random.default_rng(seed)
    out = Path(out)
    tmp = out.with_name(out.name + ".part")
    writer = gguf.GGUFWriter(str(tmp), shape.arch)
    writer.add_name(f"random-{shape.arch}-{shape.hidden}x{shape.layers}")
    writer.add_context_length(shape.context)
    writer.add_embedding_length(shape.hidden)
    writer.add_feed_forward_length(shape.intermediate)
    writer.add_block_count(shape.layers)
    writer.add_head_count(shape.heads)
    writer.add_head_count_kv(shape.kv_heads)
    writer.add_rope_freq_base(shape.rope_theta)
    writer.add_layer_norm_rms_eps(1e-6)
    head_dim = shape.hidden // shape.heads
    if shape.arch == "llama":
        writer.add_rope_dimension_count(head_dim)
    n_vocab = _copy_vocab(writer, vocab)
    writer.add_file_type({"f32": 0, "f16": 1, "q4_0": 2, "q4_1": 3, "q8_0": 7, "bf16": 32}[qtype])

    ggml = {"f32": gguf.GGMLQuantizationType.F32, "f16": gguf.GGMLQuantizationType.F16,
            "bf16": gguf.GGMLQuantizationType.BF16, "q8_0": gguf.GGMLQuantizationType.Q8_0,
            "q4_0": gguf.GGMLQuantizationType.Q4_0, "q4_1": gguf.GGMLQuantizationType.Q4_1}[qtype]

    def matrix(name: str, rows: int, cols: int) -> None:  # a [rows, cols] weight
        w = (rng.standard_normal((rows, cols), dtype=np.float32) * (cols ** -0.5)).astype(np.float32)
        if qtype == "f32":
            writer.add_tensor(name, w)
        elif qtype == "f16":
            writer.add_tensor(name, w.astype(np.float16))
        else:
            data = gguf.quants.quantize(w, ggml)
            writer.add_tensor(name, data, raw_shape=data.shape, raw_dtype=ggml)

    def vector(name: str, n: int, value: float | None = None) -> None:
        v = np.full(n, value, np.float32) if value is not None else rng.standard_normal(n, dtype=np.float32) * 0.02
        writer.add_tensor(name, v)

    kv = shape.kv_heads * head_dim
    matrix("token_embd.weight", n_vocab, shape.hidden)
    for i in range(shape.layers):
        p = f"blk.{i}."
        vector(p + "attn_norm.weight", shape.hidden, 1.0)
        matrix(p + "attn_q.weight", shape.hidden, shape.hidden)
        matrix(p + "attn_k.weight", kv, shape.hidden)
        matrix(p + "attn_v.weight", kv, shape.hidden)
        if shape.qkv_bias:
            vector(p + "attn_q.bias", shape.hidden)
            vector(p + "attn_k.bias", kv)
            vector(p + "attn_v.bias", kv)
        matrix(p + "attn_output.weight", shape.hidden, shape.hidden)
        vector(p + "ffn_norm.weight", shape.hidden, 1.0)
        matrix(p + "ffn_gate.weight", shape.intermediate, shape.hidden)
        matrix(p + "ffn_up.weight", shape.intermediate, shape.hidden)
        matrix(p + "ffn_down.weight", shape.hidden, shape.intermediate)
    vector("output_norm.weight", shape.hidden, 1.0)
    if not shape.tied:
        matrix("output.weight", n_vocab, shape.hidden)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tmp.replace(out)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), required=True)
    parser.add_argument("--vocab", type=Path, required=True, help="a GGUF whose tokenizer.* metadata is copied")
    parser.add_argument("--type", choices=TYPES, default="f16")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("-o", "--output", type=Path, required=True)
    args = parser.parse_args(argv)
    path = write_random_gguf(args.output, SHAPES[args.shape], args.vocab, args.type, args.seed)
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
