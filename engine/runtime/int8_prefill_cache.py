"""The int8 prefill's converted weights, kept on disk between loads.

Converting a mixed model's prefill copies to int8 (`engine.model.int8_prefill.convert`) runs a
calibration prefill and quantises every converted weight: ~2.5 s on 2 cores for the embedded
model, on every load. What it produces depends only on the model's weights, the adapter
merged beside them, the calibration windows and the conversion's own code, so it is stored
once under `<cache_root>/int8-prefill/<key>.safetensors` and read back by later loads
(~80 MB for the embedded model, memory-mapped).

The key is a sha256 over: the converted model folder (named by the GGUF's own sha256), the
adapter's files' sha256, the dtype, torch's version, the source of `engine.model.int8_prefill`
and the calibration token ids. A file is written to a temporary name and renamed (a killed
writer leaves no file under the key), created 0600 in a folder that is the user's and that
no one else may write; a file that cannot be read or does not fit the model is ignored (one
warning) and replaced. The `KEEP` most recently used files are kept, older ones removed.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from pathlib import Path

import torch

from engine.model import int8_prefill
from engine.model.gguf import file_sha256
from engine.paths import cache_root
from kernels.cpu.build import private_dir

log = logging.getLogger(__name__)

FORMAT = 1
# Conversions kept: the most recently used. A new key comes with another model or adapter, and
# with a new version of this package (its source is in the key), so older files are pruned.
KEEP = 4


def cache_key(loaded, adapter: Path | None, calibration: list[list[int]]) -> str:
    """What the converted tensors depend on, hashed (see the module docstring)."""
    root = cache_root()
    adapter_files = []
    if adapter is not None:
        files = sorted(p for p in (adapter.rglob("*") if adapter.is_dir() else [adapter]) if p.is_file())
        adapter_files = [(p.name, file_sha256(p, root)) for p in files]
    parts = {
        "format": FORMAT,
        "model": str(Path(loaded.path).resolve()),
        "adapter": adapter_files,
        "dtype": str(loaded.model.dtype),
        "torch": torch.__version__,
        "code": hashlib.sha256(Path(int8_prefill.__file__).read_bytes()).hexdigest(),
        "calibration": hashlib.sha256(json.dumps(calibration).encode()).hexdigest(),
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:32]


def cache_path(key: str) -> Path:
    return cache_root() / "int8-prefill" / f"{key}.safetensors"


def restore(model, path: Path, rows) -> int | None:
    """The bytes freed by putting the stored conversion back, or None (nothing stored, or a
    file that cannot be used: one warning)."""
    if not path.is_file():
        return None
    from safetensors.torch import load_file  # noqa: PLC0415

    try:
        tensors = load_file(str(path))
        freed = int8_prefill.restore(model, tensors, rows)
    except Exception as exc:  # noqa: BLE001  (a truncated or foreign file: convert again)
        log.warning("prefill: the stored int8 conversion %s is not usable (%s); converting again", path, exc)
        return None
    try:
        os.utime(path)  # its mtime says when it was last used (what `save` prunes by)
    except OSError:
        pass
    return freed


def save(model, path: Path) -> bool:
    """Store the model's conversion under `path`; False (one debug line) where the folder is
    not private or the disk refuses."""
    from safetensors.torch import save_file  # noqa: PLC0415

    if not private_dir(path.parent):
        log.debug("prefill: %s is not a private folder; the int8 conversion is not stored", path.parent)
        return False
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.stem}.", suffix=".tmp")
    os.close(fd)  # mkstemp made it 0600; safetensors writes over it in place
    try:
        save_file({k: v.contiguous() for k, v in int8_prefill.state(model).items()}, tmp)
        os.chmod(tmp, 0o600)
        os.replace(tmp, path)
    except Exception as exc:  # noqa: BLE001  (a full disk, a refused write: the load goes on unstored)
        log.debug("prefill: the int8 conversion was not stored (%s)", exc)
        try:
            os.unlink(tmp)
        except OSError:
            pass
        return False
    _prune(path.parent)
    return True


def _prune(folder: Path) -> None:
    """Remove all but the `KEEP` most recently used conversions (never a file being written:
    those have a temporary name)."""
    try:
        stored = sorted(folder.glob("*.safetensors"), key=lambda p: p.stat().st_mtime_ns, reverse=True)
    except OSError:
        return
    for old in stored[KEEP:]:
        try:
            old.unlink()
        except OSError:
            pass


__all__ = ["cache_key", "cache_path", "restore", "save"]
