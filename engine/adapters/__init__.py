"""Adapters shipped with the package (data only): `smollm2-efim/` is the FIM/EFIM LoRA for
the embedded SmolLM2-135M-Instruct, format `efim-lora/1` (see `engine.training.lora` and
docs/training.md)."""
