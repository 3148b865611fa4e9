"""Fine-tuning the embedded default model for FIM/EFIM (docs/training.md).

Map: `data` (stdlib corpus + held-out list) → `fragment` (fragment tokenization) →
`samples` (FIM / EFIM / plain sample builders) → `lora` (adapter modules, save/merge) →
`train` (the loop: bf16 autocast, accumulation, cosine schedule, time budget, resume).
`base` finds the base model to train (the default GGUF as a Hugging Face folder).
Torch is imported only by `lora`, `base` and `train`.
"""
