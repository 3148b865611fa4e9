"""Every Triton kernel compiles for a real GPU target (sm_80) down to a cubin, with no GPU.

The interpreter proves the kernels compute the right thing; it does not run Triton's
compiler, so it cannot catch what only the GPU path meets: type rules of `tl.dot`
(the native bfloat16 dot the interpreter cannot run, see docs/kernels.md), tile shape
limits, control flow the compiler rejects. Ahead-of-time compilation for an explicit
target needs only the `ptxas` shipped with Triton. Runs in a subprocess without
TRITON_INTERPRET (this process decorated the kernels as interpreted).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton", reason="triton is not installed; the Triton kernels cannot be compiled")

REPO = Path(__file__).resolve().parents[2]

SCRIPT = r"""
import sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from kernels.triton.checks import interpreted
from kernels.triton.decode import _decode_split_kernel
from kernels.triton.kv import _kv_deviation_kernel, _kv_gather_kernel, _kv_store_kernel
from kernels.triton.norm import _rms_norm_kernel
from kernels.triton.online_softmax import _merge_splits_kernel
from kernels.triton.prefill import _prefill_kernel
from kernels.triton.rope import _rope_apply_kernel, _rope_shift_kernel

assert not interpreted(_prefill_kernel), "TRITON_INTERPRET leaked into the compile check"
TARGET = GPUTarget("cuda", 80, 32)
FLOATS = {"scale_log2", "eps"}


def compile_one(fn, pointers, constexprs, num_warps=4, num_stages=2):
    sig = {}
    for name in fn.arg_names:
        if name in constexprs:
            sig[name] = "constexpr"
        elif name in pointers:
            sig[name] = "*" + pointers[name]
        elif name in FLOATS:
            sig[name] = "fp32"
        else:
            sig[name] = "i32"
    compiled = triton.compile(ASTSource(fn, sig, constexprs), target=TARGET,
                              options={"num_warps": num_warps, "num_stages": num_stages})
    assert compiled.asm["cubin"], fn.__name__
    print(f"ok {fn.__name__} {constexprs} shared={compiled.metadata.shared}")


def attn_ptrs(dt):
    return {"Q": dt, "K": dt, "V": dt, "OUT": dt, "SLOTS": "i64", "Q_POS": "i64", "K_POS": "i64",
            "SLOT_TABLE": "i64", "SEQ_LENS": "i64", "PART_OUT": "fp32", "PART_LSE": "fp32"}


for dt, d, group, precision in (("bf16", 128, 8, "tf32"), ("fp16", 64, 1, "tf32"), ("fp32", 64, 3, "ieee")):
    for splits in (1, 4):
        compile_one(_prefill_kernel, attn_ptrs(dt), dict(
            GROUP=group, HEAD_DIM=d, BLOCK_D=d, BLOCK_M=64, BLOCK_N=64, HAS_SLOTS=splits == 1, NUM_SPLITS=splits,
            UPCAST=False, PRECISION=precision))
    compile_one(_decode_split_kernel, attn_ptrs(dt), dict(
        GROUP=group, HEAD_DIM=d, BLOCK_D=d, BLOCK_G=16, BLOCK_N=64, NUM_SPLITS=4, UPCAST=False, PRECISION=precision))
compile_one(_merge_splits_kernel, {"PART_OUT": "fp32", "PART_LSE": "fp32", "OUT": "bf16"},
            dict(HEAD_DIM=128, BLOCK_D=128, NUM_SPLITS=4, BLOCK_SPLITS=4))
for neox in (True, False):
    compile_one(_rope_apply_kernel, {"X": "bf16", "COS": "bf16", "SIN": "bf16", "OUT": "bf16"},
                dict(HALF=64, BLOCK_HALF=64, BLOCK_T=16, NEOX=neox))
compile_one(_rope_shift_kernel, {"K": "bf16", "OLD_POS": "i64", "NEW_POS": "i64", "INV_FREQ": "fp32", "OUT": "bf16"},
            dict(HALF=32, BLOCK_HALF=32, BLOCK_S=16, NEOX=True))
compile_one(_kv_store_kernel, {"K_POOL": "bf16", "V_POOL": "bf16", "K": "fp32", "V": "fp32", "SLOTS": "i64"},
            dict(HEAD_DIM=128, BLOCK_H=8, BLOCK_D=128))
compile_one(_kv_gather_kernel, {"POOL": "bf16", "SLOTS": "i64", "OUT": "bf16"}, dict(HEAD_DIM=64, BLOCK_H=4, BLOCK_D=64))
compile_one(_kv_deviation_kernel, {"FRESH": "bf16", "CACHED": "bf16", "OUT": "fp32"},
            dict(HEAD_DIM=64, BLOCK_S=16, BLOCK_D=64))
compile_one(_rms_norm_kernel, {"X": "bf16", "W": "bf16", "OUT": "bf16"}, dict(HIDDEN=576, BLOCK=1024), num_warps=4)
print("all compiled")
"""


@pytest.mark.slow
def test_every_kernel_compiles_for_sm80(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "EFIM_KERNELS")}
    env.update(PYTHONPATH=str(REPO), TRITON_CACHE_DIR=str(tmp_path / "triton-cache"), TRITON_DEFAULT_FP_FUSION="1")
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, cwd=REPO, timeout=600
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert proc.stdout.strip().splitlines()[-1] == "all compiled"
