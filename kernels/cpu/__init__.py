"""CPU kernels in C for what torch has no single call for, built at first use with the
system's C compiler (`build`) and called through ctypes; each has a torch path its caller
keeps for when no compiler is present (or `EFIM_C_KERNELS=0`).

- `int4_gemv`: a decode step's few rows times a 4-bit weight on AVX512-BF16 dot products, an
  adapter's low-rank term added in the same call where its factors are bf16.
- `low_rank`: an adapter's low-rank term added to a decode step's rows (y += (x Aᵀ) Bᵀ).
- `decode_attention`, `row_ops`: a decode step's RoPE + KV row + attention; its norms and SiLU.
- `decode_layers`: a step of a few rows through every layer in one call, the three above
  compiled into one library and called in the model's order (the Python between them gone).
- `int8_rows`: the passes around an int8 prefill GEMM.
"""
