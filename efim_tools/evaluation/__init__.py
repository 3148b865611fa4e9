"""Measuring infilling quality (docs/training.md).

Map: `sandbox` (runs generated programs: time, CPU, memory limits, no network, destructive
calls disabled) ← `humaneval` (HumanEval infilling pass@1 under FIM / EFIM / prefix-only)
and `linecompletion` (exact match / edit similarity of line completions on held-out stdlib
modules), both generating through `completer` (greedy decoding with per-segment
tokenization and optional token healing) over a model loaded by `model`.
"""
