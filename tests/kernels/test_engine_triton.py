"""The whole engine on the Triton kernels (interpreter, CPU) gives the reference path's
greedy tokens on a tiny model.

Runs in a subprocess: TRITON_INTERPRET and EFIM_KERNELS must be set before the kernels
are imported and resolved, which this pytest process may already have done.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton", reason="triton is not installed; the Triton kernels cannot be verified")
pytest.importorskip("engine.model.transformer", reason="the engine's Transformer is not built yet")

REPO = Path(__file__).resolve().parents[2]

SCRIPT = r"""
import json, os, sys
from pathlib import Path
import torch
import kernels
from engine.model.config import ModelConfig
from engine.model.loader import read_hf_config, read_safetensors, read_tokenizer
from engine.model.transformer import Transformer

folder = Path(sys.argv[1])
calls = {}
ops = kernels._triton_ops()
for name, fn in list(ops.items()):
    def counted(*a, _fn=fn, _name=name, **k):
        calls[_name] = calls.get(_name, 0) + 1
        return _fn(*a, **k)
    ops[name] = counted

def build(backend):
    os.environ["EFIM_KERNELS"] = backend
    config = ModelConfig.from_hf(read_hf_config(folder))
    return Transformer(config, read_safetensors(folder), dtype=torch.float32)

def greedy(model, ids, n_new):
    kv = model.new_kv(len(ids) + n_new)
    logits = model.forward(torch.tensor(ids), kv, 0, "last")  # [1, V]
    out, rows = [], [logits[0]]
    for step in range(n_new):
        token = int(rows[-1].argmax())
        out.append(token)
        if step + 1 < n_new:
            rows.append(model.forward(torch.tensor([token]), kv, len(ids) + step, "last")[0])
    return out, torch.stack(rows)

def batch_step(model, prompts):
    kvs, starts, last = [], [], []
    for ids in prompts:
        kv = model.new_kv(len(ids) + 1)
        last.append(int(model.forward(torch.tensor(ids[:-1]), kv, 0, "last")[0].argmax()))
        kvs.append(kv)
        starts.append(len(ids) - 1)
    ids = torch.tensor([p[-1] for p in prompts])
    return model.decode_batch(ids, kvs, starts)  # [B, V]

def scattered_rows(model, ids):
    # CacheBlend's layer API: layer 0 on all rows, then layers 1.. on a scattered subset of
    # rows whose queries see the other rows' keys (taken from a full prefill) by position
    kv = model.new_kv(len(ids))
    pos = torch.arange(len(ids))
    h = model.embed(torch.tensor(ids))
    h = model.layer(0, h, pos, kv)
    rows = torch.tensor([1, 4, len(ids) - 1])
    h_sub = h[rows].clone()
    full_kv = model.new_kv(len(ids))
    model.forward(torch.tensor(ids), full_kv, 0, "none")
    for i in range(1, model.config.n_layers):
        kv.k[i].copy_(full_kv.k[i]); kv.v[i].copy_(full_kv.v[i])
        h_sub = model.layer(i, h_sub, rows, kv, key_positions=pos)
    return model.norm_logits(h_sub)  # [3, V]

def cacheblend(model, ids):
    # Two context chunks prefilled alone, placed after a header, 40% of their rows
    # recomputed: exercises rope_shift, kv_deviation, select_top_rows and attention
    # with scattered query rows.
    from engine.cacheblend.blend import ReusedSpan, blend_prefill
    from engine.kv.blend_store import prefill_span

    header, parts, spans, row = [ids[0]], [], [], 1
    for chunk in (ids[1:7], ids[3:12]):
        c = prefill_span(model, list(chunk), header)
        spans.append(ReusedSpan(row, c.k, c.v, c.positions))
        parts += list(chunk)
        row += len(chunk)
    prompt = torch.tensor(header + parts + list(ids[-3:]))
    kv = model.new_kv(len(prompt))
    result = blend_prefill(model, prompt, kv, spans, 0.4)
    return result.logits[0], result.recomputed.tolist()

tok = read_tokenizer(folder)
ids = tok.encode("def add(a, b):\n    return").ids
other = tok.encode("import os\nx =").ids
result = {}
for backend in ("triton", "reference"):
    before = sum(calls.values())
    model = build(backend)
    tokens, logits = greedy(model, ids, 4)
    batch = batch_step(model, [ids, other])
    rows = scattered_rows(model, ids)
    blend_logits, recomputed = cacheblend(model, ids)
    result[backend] = {"tokens": tokens, "logits": logits.tolist(), "batch": batch.tolist(),
                       "rows": rows.tolist(), "blend": blend_logits.tolist(), "recomputed": recomputed,
                       "triton_calls": sum(calls.values()) - before}
result["ops"] = sorted(calls)
print(json.dumps(result))
"""


def test_engine_greedy_output_is_the_same_on_triton_kernels(tiny_model_factory):
    import torch

    folder = tiny_model_factory("llama", num_hidden_layers=2)
    # One torch thread: the interpreter is single-threaded, and spinning OpenMP workers only
    # slow a shared 2-core machine down.
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    env.pop("EFIM_KERNELS", None)
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(folder)], capture_output=True, text=True, env=env, cwd=REPO, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    triton_run, reference_run = result["triton"], result["reference"]
    assert triton_run["triton_calls"] > 0 and reference_run["triton_calls"] == 0
    assert {"attention", "rope_apply", "rms_norm", "rope_shift", "kv_deviation"} <= set(result["ops"])
    assert triton_run["tokens"] == reference_run["tokens"]
    assert triton_run["recomputed"] == reference_run["recomputed"]
    for key in ("logits", "batch", "rows", "blend"):
        torch.testing.assert_close(torch.tensor(triton_run[key]), torch.tensor(reference_run[key]), atol=2e-4, rtol=1e-4)
