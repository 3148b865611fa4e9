"""GGUF export (`efim export gguf`): a model with its FIM adapter merged, for llama.cpp.

- `gguf_file.export_gguf`: the whole export, written atomically.
- `tensors`: llama.cpp's tensor names, Q/K order, the storage type of each tensor per `--type`.
- `vocab`: the vocabulary with the adapter's tokens and the FIM token ids.
"""

from efim_tools.export.gguf_file import ExportResult, export_gguf
from efim_tools.export.tensors import DEFAULT_TYPE, EXPORT_TYPES

__all__ = ["ExportResult", "export_gguf", "DEFAULT_TYPE", "EXPORT_TYPES"]
