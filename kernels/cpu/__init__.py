"""CPU kernels in C for what torch has no single call for, built at first use with the
system's C compiler (`build`) and called through ctypes; each has a torch path its caller
keeps for when no compiler is present (or `EFIM_C_KERNELS=0`).

- `low_rank`: an adapter's low-rank term added to a decode step's rows (y += (x Aᵀ) Bᵀ).
"""
