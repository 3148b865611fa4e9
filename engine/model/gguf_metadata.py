"""Typed reads of a GGUF file's metadata fields, by key.

The local loader (`engine.model.gguf`: config, tokenizer, tensor table) and the remote
engine's vocabulary (`engine.remote.vocabulary`: the tokenizer only) read the same keys
of the same files; both go through `GGUFMetadata`, so a missing key reads the same
everywhere. Values come decoded (`Field.contents()` of `engine.model.gguf_reader`, as of
`gguf.GGUFReader`): strings as `str`, arrays as lists (of `str` for string arrays),
numbers as Python numbers.

The reader is handed in: `engine.model.gguf.open_gguf` opens (and keeps) one per file.
"""

from __future__ import annotations

from typing import Any

from engine.api import EngineError


class GGUFMetadata:
    """The metadata of one GGUF reader (`GGUFFile`, or `gguf.GGUFReader`): `get` with a default, `require` or EngineError."""

    def __init__(self, reader) -> None:
        self.reader = reader

    def get(self, key: str, default: Any = None) -> Any:
        """The decoded value of `key`, or `default` when the file has no such field."""
        field = self.reader.fields.get(key)
        return default if field is None else field.contents()

    def require(self, key: str) -> Any:
        """The decoded value of `key`; EngineError naming the key when the file lacks it."""
        value = self.get(key)
        if value is None:
            raise EngineError(f"GGUF file lacks the metadata key {key!r}")
        return value


__all__ = ["GGUFMetadata"]
