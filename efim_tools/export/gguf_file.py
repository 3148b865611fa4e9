"""`export_gguf(dest, model=..., adapter=..., export_type=...)`: a model with its FIM adapter
merged, written as one GGUF file that llama.cpp's llama-server loads (docs/model.md,
"Exporting to GGUF").

The weights are the ones the local engine computes with: the source GGUF converted by
`engine.model.gguf` (the engine's cache folder), the adapter merged by
`engine.model.loader.merge_adapter` (the same call `load_model` makes). Every metadata key
of the source is copied (architecture, RoPE, tokenizer, chat template) except the ones an
export rewrites: the vocabulary (the adapter's tokens appended as control tokens at the ids
it was trained with), the FIM token ids, the file type and `efim.*` (what was merged).

Nothing half-written is left behind: the file is written under a temporary name in the
destination's folder and renamed over `dest` only when complete.
"""

from __future__ import annotations

import logging
import os
import tempfile
from pathlib import Path
from typing import Any, NamedTuple

from efim_tools.export.tensors import DEFAULT_TYPE, EXPORT_TYPES, check_type, gguf_tensors
from efim_tools.export.vocab import FIM_ROLES, extend_vocabulary, fim_token_ids

log = logging.getLogger(__name__)

# Keys an export writes itself (the writer adds general.architecture).
_REWRITTEN = {
    "general.architecture", "general.file_type", "general.quantization_version",
    "tokenizer.ggml.tokens", "tokenizer.ggml.token_type", "tokenizer.ggml.scores",
}
_FIM_KEY = "tokenizer.ggml.fim_{}_token_id"


class ExportResult(NamedTuple):
    path: Path
    export_type: str
    source: Path  # the source GGUF
    adapter: Path | None  # the adapter merged, or None
    n_tensors: int
    n_bytes: int
    vocab_size: int
    fim_ids: dict[str, int]  # role (pre, suf, mid, pad, rep, sep) -> token id
    template: str  # the engine's template name for the merged vocabulary
    suffix_first: bool  # llama-server needs --spm-infill for /infill


def check_destination(dest: str | Path) -> Path:
    """`dest` as a path whose folder exists and is writable; ValueError / FileNotFoundError
    saying what is wrong. An existing file is replaced (only once the new one is complete)."""
    path = Path(dest).expanduser()
    if path.is_dir():
        raise ValueError(f"{path} is a directory; give the path of the .gguf file to write")
    folder = path.parent if str(path.parent) else Path(".")
    if folder.exists() and not folder.is_dir():
        raise ValueError(f"cannot write {path}: {folder} is not a folder")
    if not folder.is_dir():
        raise FileNotFoundError(f"cannot write {path}: the folder {folder} does not exist")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise ValueError(f"cannot write {path}: the folder {folder} is not writable")
    if path.exists() and not os.access(path, os.W_OK):
        raise ValueError(f"cannot write {path}: the file exists and is not writable")
    return path


class MergedModel(NamedTuple):
    """A source GGUF with an adapter merged, as the engine would load it."""

    source: Path
    adapter: Path | None
    reader: Any  # gguf.GGUFReader of the source (its metadata is copied)
    config: dict  # HF config after the merge (vocab_size grown by the adapter's tokens)
    weights: dict  # HF name -> torch tensor, the adapter merged
    added: list[tuple[int, str]]  # the adapter's tokens (id, content)
    template: Any  # engine.text.templates.FimTemplate of the merged vocabulary


def merged_model(model: str | Path, adapter: str | Path | None) -> MergedModel:
    """Load `model`'s weights and merge `adapter` exactly as `engine.model.loader.load_model`
    does (same conversion folder, same `merge_adapter`), without building the engine's model."""
    from engine.adapters import resolve_adapter  # noqa: PLC0415
    from engine.model.gguf import convert_gguf, open_gguf  # noqa: PLC0415
    from engine.model.loader import (  # noqa: PLC0415
        adapter_added_tokens,
        add_tokens_with_ids,
        cache_root,
        merge_adapter,
        read_hf_config,
        read_safetensors,
        read_tokenizer,
        resolve_spec,
    )
    from engine.text.templates import detect_template  # noqa: PLC0415

    source = resolve_spec(model)
    if not source.is_file():
        raise ValueError(
            f"model {source} is a Hugging Face folder; export reads GGUF sources only "
            "(convert the folder with llama.cpp's convert_hf_to_gguf.py, then pass the .gguf)"
        )
    chosen = resolve_adapter(model, adapter)
    reader = open_gguf(source)  # EngineError for a file that is not a whole GGUF
    folder = convert_gguf(source, cache_root())  # the engine's own converted weights
    config = read_hf_config(folder)
    weights = read_safetensors(folder)
    added: list[tuple[int, str]] = []
    if chosen is not None:
        config = merge_adapter(chosen, config, weights)
        added = adapter_added_tokens(chosen)
    tokenizer = read_tokenizer(folder)
    add_tokens_with_ids(tokenizer, added)
    return MergedModel(source, chosen, reader, config, weights, added, detect_template(tokenizer))


def export_gguf(
    dest: str | Path,
    *,
    model: str | Path = "default",
    adapter: str | Path | None = "auto",
    export_type: str = DEFAULT_TYPE,
) -> ExportResult:
    """Write `model` with `adapter` merged ("auto": the shipped FIM adapter for the default
    model, as the engine picks it; "none"; or a LoRA path) to `dest` as a GGUF of
    `export_type` (`tensors.EXPORT_TYPES`). Bad input raises ValueError / FileNotFoundError /
    EngineError with a clear message, and leaves no file behind (nor touches `dest`)."""
    from engine.model.gguf_metadata import GGUFMetadata  # noqa: PLC0415

    export_type = check_type(export_type)
    path = check_destination(dest)
    try:  # claim the temporary name first: an unwritable folder fails before the slow part
        fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    except OSError as exc:
        raise ValueError(f"cannot write {path}: {exc.strerror or exc}") from None
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        merged = merged_model(model, adapter)
        fields = {k: f for k, f in merged.reader.fields.items() if not k.startswith("GGUF.")}
        meta = GGUFMetadata(merged.reader)
        rows = int(merged.weights["model.embed_tokens.weight"].shape[0])
        vocab = extend_vocabulary(
            meta.get("tokenizer.ggml.tokens"), meta.get("tokenizer.ggml.token_type"),
            meta.get("tokenizer.ggml.scores"), merged.added, rows,
        )
        fim_ids = fim_token_ids(vocab.tokens, merged.template)
        try:
            n_tensors = _write(tmp, fields, merged, vocab, fim_ids, export_type)
            umask = os.umask(0)
            os.umask(umask)
            os.chmod(tmp, 0o666 & ~umask)  # mkstemp made it 0600; an ordinary file, like any download
            os.replace(tmp, path)
        except OSError as exc:  # a full disk, a folder removed under us: say so, keep nothing
            raise ValueError(f"cannot write {path}: {exc.strerror or exc}") from None
    finally:
        tmp.unlink(missing_ok=True)
    if not fim_ids.keys() >= {"pre", "suf", "mid"}:
        log.warning("%s has no FIM tokens (pre/suf/mid): llama-server's /infill will refuse it", path)
    return ExportResult(
        path, export_type, merged.source, merged.adapter, n_tensors, path.stat().st_size, len(vocab.tokens), fim_ids,
        merged.template.name, merged.template.suffix_first,
    )


def _write(tmp: Path, fields: dict, merged: MergedModel, vocab, fim_ids: dict[str, int], export_type: str) -> int:
    """Write the GGUF to `tmp`; returns the number of tensors."""
    import gguf  # noqa: PLC0415

    arch = fields["general.architecture"].contents()
    rewritten = _REWRITTEN | {f"{arch}.vocab_size"} | {_FIM_KEY.format(r) for r in FIM_ROLES}
    writer = gguf.GGUFWriter(str(tmp), arch)
    for key, field in fields.items():
        if key not in rewritten:
            _copy_field(writer, key, field)
    writer.add_file_type(int(gguf.LlamaFileType[EXPORT_TYPES[export_type][1]]))
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    writer.add_uint32(f"{arch}.vocab_size", len(vocab.tokens))
    writer.add_token_list(vocab.tokens)
    writer.add_token_types(vocab.token_types)
    if vocab.scores is not None:
        writer.add_token_scores(vocab.scores)
    for role, token_id in fim_ids.items():
        writer.add_uint32(_FIM_KEY.format(role), int(token_id))
    writer.add_string("efim.adapter", merged.adapter.name if merged.adapter is not None else "none")
    writer.add_string("efim.template", merged.template.name)
    n_tensors = 0
    for t in gguf_tensors(merged.weights, merged.config, export_type):
        if t.ggml_type in ("F32", "F16"):
            writer.add_tensor(t.name, t.data)
        else:
            writer.add_tensor(t.name, t.data, raw_shape=t.data.shape, raw_dtype=gguf.GGMLQuantizationType[t.ggml_type])
        n_tensors += 1
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return n_tensors


def _copy_field(writer, key: str, field) -> None:
    import gguf  # noqa: PLC0415

    types = field.types
    if types[0] == gguf.GGUFValueType.ARRAY:
        if len(types) != 2:
            log.warning("not copying %s: nested arrays are not supported", key)
            return
        writer.add_key_value(key, field.contents(), types[0], sub_type=types[1])
    else:
        writer.add_key_value(key, field.contents(), types[0])


__all__ = ["ExportResult", "MergedModel", "export_gguf", "merged_model", "check_destination"]
