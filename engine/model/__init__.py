"""Model forward passes and loading (see loader.py for specs, transformer.py for the forward)."""

from engine.model.config import SUPPORTED_ARCHITECTURES, ModelConfig
from engine.model.loader import LoadedModel, cache_root, cpu_has_native_bf16, load_model, resolve_dtype
from engine.model.sequence_kv import Int8SequenceKV, SequenceKV
from engine.model.transformer import Transformer

__all__ = [
    "ModelConfig",
    "SUPPORTED_ARCHITECTURES",
    "Transformer",
    "SequenceKV",
    "Int8SequenceKV",
    "LoadedModel",
    "load_model",
    "cache_root",
    "cpu_has_native_bf16",
    "resolve_dtype",
]
