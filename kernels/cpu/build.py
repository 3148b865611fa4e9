"""Compile a C kernel of this folder into a shared library once, and load it with ctypes.

The library is built with the system's C compiler (`$CC`, else `cc`, `gcc` or `clang`) at
`-O3 -march=native` (plain `-O3` where the compiler refuses `-march=native`) and kept in a
cache folder under a name that hashes the source (with the sources of this folder it includes:
`decode_layers.c` compiles three others into one library), the compiler's version, the flags
and the CPU's feature flags: a new source, compiler or machine builds a new file, and a file is never
rebuilt in place (written beside, then renamed, so several processes may build at once).
A cache folder that is not the user's own or that others may write is not trusted: the build
then goes to a private temporary folder for this process. No compiler, a failed build or
`EFIM_C_KERNELS=0` gives `None` and one log line; every caller has a torch path.

A kernel that shares its work over threads asks for OpenMP (`openmp=True`). It gets it only
where the OpenMP runtime torch has loaded is the one `-fopenmp` links (`libgomp.so.1`, matched
by the loader by that name): the kernel's parallel regions then run on torch's own threads,
never on a second pool fighting it for the cores. Elsewhere (another runtime, no OpenMP in the
compiler) the kernel is built without it and runs on one thread.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import re
import shutil
import stat
import subprocess
import tempfile
import time
from pathlib import Path

log = logging.getLogger(__name__)

_SOURCE_DIR = Path(__file__).resolve().parent
_FLAGS = ("-O3", "-shared", "-fPIC", "-std=c11")
_NATIVE = "-march=native"
_LIBS = ("-lm",)
_COMPILE_TIMEOUT_S = 120
_INCLUDED_SOURCE = re.compile(r'^#include "(\w+\.c)"', re.M)


def enabled() -> bool:
    """False when `EFIM_C_KERNELS` is 0/off/false (the A/B switch and the fallback's test)."""
    return os.environ.get("EFIM_C_KERNELS", "1").strip().lower() not in ("0", "off", "false", "no")


def compiler() -> str | None:
    """The C compiler to build with: `$CC`, else the first of cc, gcc, clang on PATH."""
    cc = os.environ.get("CC", "").strip()
    if cc:
        return shutil.which(cc) or (cc if Path(cc).is_file() else None)
    return next((p for p in map(shutil.which, ("cc", "gcc", "clang")) if p), None)


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def private_dir(path: Path) -> bool:
    """The folder exists (created 0700 here if not), is the user's and no one else may write it.
    (Also the engine's check for its other cached files: engine.runtime.int8_prefill_cache.)"""
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        st = path.stat()
    except OSError:
        return False
    return st.st_uid == os.getuid() and not st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)


def torch_openmp_runtime() -> str | None:
    """The path of the OpenMP runtime this process has loaded when it is the one `-fopenmp`
    links by name (`libgomp.so.1`, the only one loaded), else None. Read from /proc/self/maps
    after torch is imported (Linux; None elsewhere)."""
    import torch  # noqa: F401, PLC0415  (its runtime is what is looked for)

    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as f:
            paths = {line.split()[-1] for line in f if "/lib" in line and "omp" in line.rsplit("/", 1)[-1]}
    except OSError:
        return None
    runtimes = {p for p in paths if os.path.basename(p).startswith(("libgomp", "libomp", "libiomp"))}
    if len(runtimes) != 1:
        return None
    (path,) = runtimes
    return path if os.path.basename(path) == "libgomp.so.1" else None


def _build(cc: str, source: Path, out: Path, native: bool, openmp: bool = False) -> str | None:
    """Compile `source` to `out` (atomically); None on success, else the compiler's complaint.
    Tries the richest flags first: -march=native (when `native`), then OpenMP (when `openmp`)."""
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    last = ""
    variants = [(*_FLAGS, _NATIVE), _FLAGS] if native else [_FLAGS]
    if openmp:
        variants = [(*v, "-fopenmp") for v in variants] + variants
    for flags in variants:
        cmd = [cc, *flags, "-o", str(tmp), str(source), *_LIBS]
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=_COMPILE_TIMEOUT_S, check=False)
        except (OSError, subprocess.TimeoutExpired) as e:
            return str(e)
        if done.returncode == 0:
            os.replace(tmp, out)
            return None
        last = (done.stderr or done.stdout).strip().splitlines()[-1:] or [f"exit {done.returncode}"]
        last = last[0]
    tmp.unlink(missing_ok=True)
    return last


@functools.lru_cache(maxsize=None)
def library(name: str, cache_dir: Path | None = None, *, native: bool = True, openmp: bool = False) -> ctypes.CDLL | None:
    """`kernels/cpu/<name>.c` as a loaded library, built into `cache_dir` (kept between runs)
    when that folder is private, else into a temporary folder; None when C kernels are off or
    cannot be built (logged once per name). `native=False` builds for the architecture's
    baseline (no -march=native: the portable loops, which the tests run on an AVX-512 machine).
    `openmp=True` builds with OpenMP where torch's runtime allows it (module docstring)."""
    if not enabled():
        log.info("C kernels off (EFIM_C_KERNELS=0): %s runs on torch", name)
        return None
    cc = compiler()
    if cc is None:
        log.warning("no C compiler (cc, gcc, clang or $CC): the %s kernel runs on torch, decode is slower", name)
        return None
    openmp = openmp and torch_openmp_runtime() is not None
    source = _SOURCE_DIR / f"{name}.c"
    headers = "".join(h.read_text(encoding="utf-8") for h in sorted(_SOURCE_DIR.glob("*.h")))  # the shared header(s)
    text = source.read_text(encoding="utf-8")
    text += "".join((_SOURCE_DIR / inc).read_text(encoding="utf-8") for inc in _INCLUDED_SOURCE.findall(text))
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30, check=False).stdout
    except (OSError, subprocess.TimeoutExpired):
        version = ""
    key = hashlib.sha256(
        b"\0".join(
            s.encode() for s in (text + headers, cc, version, " ".join((*_FLAGS, *_LIBS)), _NATIVE if native else "", "-fopenmp" if openmp else "", _cpu_flags())
        )
    ).hexdigest()[:16]
    kept = cache_dir is not None and private_dir(cache_dir)
    folder = cache_dir if kept else Path(tempfile.mkdtemp(prefix="efim-kernels-"))
    out = folder / f"{name}-{key}.so"
    try:
        if not out.is_file():
            started = time.perf_counter()
            problem = _build(cc, source, out, native, openmp)
            if problem is not None:
                log.warning("C kernel %s failed to build with %s (%s): it runs on torch, decode is slower", name, cc, problem)
                return None
            log.info("C kernel %s built in %.1f s (%s)", name, time.perf_counter() - started, out)
        try:
            return ctypes.CDLL(str(out))
        except OSError as e:
            log.warning("C kernel %s failed to load (%s): it runs on torch", name, e)
            return None
    finally:
        if not kept:  # a loaded library stays mapped once its file is gone: leave no folder behind
            shutil.rmtree(folder, ignore_errors=True)


__all__ = ["library", "compiler", "enabled", "private_dir", "torch_openmp_runtime"]
