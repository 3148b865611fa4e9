"""The disk tier's files: a document's last sequence KV, one safetensors file each.

Layout: `<dir>/<fp16>-<doc16>-<ids16>.safetensors`, where `fp16` is the first 16 hex of
the model fingerprint (model files, adapter, dtype, quant, template, `FORMAT_VERSION`;
`engine.kv.disk_tier.fingerprint`), `doc16` of sha256(document key) and `ids16` of
sha256(token ids). Tensors: `ids` int64 [n], `k` and `v` [L, H_kv, n, D] in the pool's
dtype (row i = the token ids[i], keys after RoPE). Metadata (strings): `format`,
`fingerprint` (full), `document`, `n_tokens`, `ids_sha256`, `sha256` (of the ids', k's
and v's bytes, in that order), `dtype`, `shape` ("L,H,D").

Contracts:
- A file is complete or absent: it is written to a temp file unique to the writer
  (`mkstemp` in the same directory) and `os.replace`d into place, so two servers sharing
  the directory never see (or leave) a partial file under a final name.
- Nothing is loaded unverified: `load` checks the header (format, fingerprint, shape,
  declared size == file size) and the checksum of the bytes before returning tensors. A
  file that fails (truncated, corrupted, written by another format, a name that lies about
  its fingerprint) is warned about once and deleted; `load` returns None. A file that
  vanished (another process evicted it) is a plain miss, without a warning.
- A write that fails for the disk's sake (no space, read-only, permissions) turns the store
  off (`disable`; `disabled` says why, logged once); it never raises. Afterwards `save` and
  `load` are no-ops; the engine serves as before.
- Files are 0600 in a 0700 directory (one the store creates; an existing one is left as is). After each write the directory is kept within
  `budget_bytes`: files are removed oldest first by mtime (`load` touches a file, so this
  is least recently used), whatever their fingerprint (two models share one budget).
  Files of other fingerprints are never loaded and never deleted as bad: they belong to
  another model the user switches to, not to garbage.

`KVDiskStore` is the disk tier's `KVStore` (`engine.kv.store`), keyed by document:
`match` loads its newest file, `insert` writes `DocumentRows`, `evict(n)` frees bytes.

Thread-safe by construction: no state but `disabled` and the warned-about set; called from
the disk tier's thread (and from the closing thread at shutdown), never the engine thread.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import struct
import tempfile
import time
from pathlib import Path
from typing import Any, NamedTuple

import torch

from engine.kv.store import DocumentKey

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
SUFFIX = ".safetensors"
_TMP_PREFIX = ".tmp-"
_STALE_TMP_SECONDS = 3600.0  # a temp file this old belongs to a writer that died
# Errors that mean "this disk will not take our files", as opposed to a bug.
_DISK_ERRNOS = {errno.ENOSPC, errno.EROFS, errno.EACCES, errno.EPERM, errno.EDQUOT, errno.ENOTDIR, errno.EEXIST}


class DocumentRows(NamedTuple):
    """What `KVDiskStore.insert` writes for a document: its ids and their rows."""

    ids: list[int]
    k: torch.Tensor  # [L, H_kv, n, D]
    v: torch.Tensor  # [L, H_kv, n, D]


class StoredKV(NamedTuple):
    key: str  # the document
    ids: list[int]
    k: torch.Tensor  # [L, H_kv, n, D]
    v: torch.Tensor  # [L, H_kv, n, D]
    nbytes: int  # file size
    seconds: float  # read + verify


class DiskFile(NamedTuple):
    path: Path
    document: str
    n_tokens: int
    nbytes: int
    mtime: float
    fingerprint: str  # full hex; "" when the header is unreadable


class BadFile(Exception):
    """A file that must not be loaded (the message says why)."""


def kv_directory() -> Path:
    """$EFIM_KV_DIR, else `<cache_root>/kv` ($EFIM_CACHE_DIR, $XDG_CACHE_HOME/efim-lsp or
    ~/.cache/efim-lsp: `engine.paths.cache_root`)."""
    if os.environ.get("EFIM_KV_DIR"):
        return Path(os.environ["EFIM_KV_DIR"]).expanduser()
    from engine.paths import cache_root  # noqa: PLC0415

    return cache_root() / "kv"


def _short(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _bytes_of(t: torch.Tensor) -> memoryview:
    return memoryview(t.contiguous().view(torch.uint8).numpy())  # any dtype, bf16 included


def digest(ids: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> str:
    h = hashlib.sha256()
    for t in (ids, k, v):
        h.update(_bytes_of(t))
    return h.hexdigest()


def read_header(path: Path) -> tuple[dict[str, Any], int]:
    """(the safetensors JSON header, the file size it declares) without reading tensors."""
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise BadFile("shorter than a safetensors header")
        (n,) = struct.unpack("<Q", raw)
        if n > 1 << 20:
            raise BadFile(f"header of {n} bytes")
        text = f.read(n)
        if len(text) != n:
            raise BadFile("truncated inside its header")
    try:
        header = json.loads(text)
    except ValueError as exc:
        raise BadFile(f"unreadable header ({exc})") from None
    if not isinstance(header, dict):
        raise BadFile("unreadable header")
    end = max((int(t["data_offsets"][1]) for name, t in header.items() if name != "__metadata__"), default=0)
    return header, 8 + n + end


def describe(path: Path) -> DiskFile:
    """What `efim cache ls` shows of one file (header only; never raises for a bad file)."""
    st = path.stat()
    try:
        meta = read_header(path)[0].get("__metadata__") or {}
        return DiskFile(path, meta.get("document", "?"), int(meta.get("n_tokens", 0)), st.st_size, st.st_mtime, meta.get("fingerprint", ""))
    except (OSError, BadFile, ValueError, KeyError, TypeError):
        return DiskFile(path, "?", 0, st.st_size, st.st_mtime, "")


def list_files(directory: Path) -> list[DiskFile]:
    """Every KV file in `directory`, oldest first (no temp files)."""
    out = []
    for path in directory.glob("*" + SUFFIX):
        try:
            out.append(describe(path))
        except FileNotFoundError:  # evicted by another process meanwhile
            continue
    return sorted(out, key=lambda f: f.mtime)


def clear(directory: Path) -> tuple[int, int]:
    """Remove every KV file and stale temp file; returns (files, bytes) removed."""
    n = size = 0
    for path in [*directory.glob("*" + SUFFIX), *directory.glob(_TMP_PREFIX + "*")]:
        try:
            b = path.stat().st_size
            path.unlink()
        except FileNotFoundError:
            continue
        n, size = n + 1, size + b
    return n, size


class KVDiskStore:
    """Save, find, verify-and-load and evict one fingerprint's KV files in one directory."""

    def __init__(self, directory: Path, fingerprint: str, budget_bytes: int, shape: tuple[int, int, int], dtype: torch.dtype) -> None:
        self.directory = Path(directory)
        self.fingerprint = fingerprint
        self.prefix = fingerprint[:16]
        self.budget_bytes = int(budget_bytes)
        self.shape = shape  # (L, H_kv, D)
        self.dtype = dtype
        self.disabled: str | None = None
        self.bad_files = 0  # files deleted as bad (warned about once each)
        self._ready = False

    # ------------------------------------------------------------ names
    def path_for(self, key: str, ids_sha: str) -> Path:
        return self.directory / f"{self.prefix}-{_short(key)}-{ids_sha[:16]}{SUFFIX}"

    def files_of(self, key: str) -> list[Path]:
        """This fingerprint's files of document `key`, newest first."""
        return self._newest_first(self.directory.glob(f"{self.prefix}-{_short(key)}-*{SUFFIX}"))

    def recent(self) -> list[Path]:
        """This fingerprint's files, newest first."""
        return self._newest_first(self.directory.glob(f"{self.prefix}-*{SUFFIX}"))

    @staticmethod
    def _newest_first(paths) -> list[Path]:
        dated = []
        for p in paths:
            try:
                dated.append((p.stat().st_mtime, p))
            except FileNotFoundError:
                continue
        return [p for _, p in sorted(dated, key=lambda t: t[0], reverse=True)]

    # ------------------------------------------------------------ writing
    def disable(self, why: str) -> None:
        """Turn the store off for good (a disk that will not take our files): `save` and
        `load` do nothing from now on. Logged once; the first reason stays."""
        if self.disabled is None:
            self.disabled = why
            log.warning("KV disk tier off: %s (the server keeps serving without it)", why)

    def _ensure_directory(self) -> None:
        if self._ready:
            return
        # A directory we create is ours alone (it holds the user's source, as KV); one that
        # exists is left as it is (EFIM_KV_DIR may name a shared folder: never chmod it).
        self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        self._ready = True

    def save(self, key: str, ids: list[int], k: torch.Tensor, v: torch.Tensor) -> Path | None:
        """Write document `key`'s KV (rows of `ids`, k/v [L, H_kv, n, D]) unless this exact
        sequence is stored already (then only mark it used); drop the document's files older
        than this one (two processes saving the same document each keep the other's newer
        file, so the newest survives) and keep the directory within budget. None when the store is off or the write failed."""
        if self.disabled is not None:
            return None
        ids_t = torch.tensor(ids, dtype=torch.int64)  # [n]
        ids_sha = hashlib.sha256(_bytes_of(ids_t)).hexdigest()
        path = self.path_for(key, ids_sha)
        try:
            self._ensure_directory()
            if path.exists():
                os.utime(path)
                return path
            k, v = k.contiguous(), v.contiguous()  # [L, H_kv, n, D]
            meta = {
                "format": str(FORMAT_VERSION),
                "fingerprint": self.fingerprint,
                "document": key,
                "n_tokens": str(len(ids)),
                "ids_sha256": ids_sha,
                "sha256": digest(ids_t, k, v),
                "dtype": str(k.dtype).removeprefix("torch."),
                "shape": ",".join(map(str, self.shape)),
            }
            from safetensors.torch import save  # noqa: PLC0415

            self._write_atomically(path, save({"ids": ids_t, "k": k, "v": v}, metadata=meta))
        except OSError as exc:
            if exc.errno in _DISK_ERRNOS or isinstance(exc, (PermissionError, NotADirectoryError, FileExistsError)):
                self.disable(f"cannot write {self.directory}: {exc.strerror or exc}")
                return None
            raise
        files = self.files_of(key)  # newest first
        if path in files:  # drop the document's older files; a newer one (another process's) stays
            for old in files[files.index(path) + 1 :]:
                _unlink(old)
        self.evict()
        return path

    def _write_atomically(self, path: Path, data: bytes) -> None:
        fd, tmp = tempfile.mkstemp(prefix=_TMP_PREFIX, suffix=".part", dir=self.directory)  # 0600, unique name
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            _unlink(Path(tmp))
            raise

    def insert(self, key: DocumentKey, rows: DocumentRows) -> Path | None:
        """`save` document `key`'s `rows`: the file's path, None when the store is off or
        the write failed."""
        return self.save(key, rows.ids, rows.k, rows.v)

    def evict(self, n: int = 0) -> int:
        """Remove the least recently used files (any fingerprint) until at least `n` bytes
        are freed and the directory is within budget, and temp files of writers that died;
        returns bytes of KV files removed."""
        files = list_files(self.directory)
        total = sum(f.nbytes for f in files)
        freed = 0
        for f in files:
            if total - freed <= self.budget_bytes and freed >= n:
                break
            if _unlink(f.path):
                freed += f.nbytes
        now = time.time()
        for tmp in self.directory.glob(_TMP_PREFIX + "*"):
            try:
                if now - tmp.stat().st_mtime > _STALE_TMP_SECONDS:
                    _unlink(tmp)
            except FileNotFoundError:
                continue
        return freed

    def nbytes(self) -> int:
        """Bytes of the directory's KV files, every fingerprint's (they share the budget)."""
        total = 0
        for path in self.directory.glob("*" + SUFFIX):
            try:
                total += path.stat().st_size
            except FileNotFoundError:  # evicted by another process meanwhile
                continue
        return total

    # ------------------------------------------------------------ reading
    def match(self, key: DocumentKey) -> StoredKV | None:
        """Document `key`'s newest file of this fingerprint, verified and loaded (`load`);
        None when there is none, it is bad, or it belongs to another document whose name
        hashes alike."""
        for path in self.files_of(key)[:1]:
            stored = self.load(path)
            if stored is not None and stored.key == key:
                return stored
        return None

    def load(self, path: Path) -> StoredKV | None:
        """The verified contents of `path`; None (and the file deleted, one warning) when it
        is bad, None without a word when it is gone or the store is off."""
        if self.disabled is not None:
            return None
        t0 = time.perf_counter()
        try:
            got = self._read_verified(path)
        except FileNotFoundError:
            return None
        except (BadFile, OSError, ValueError, RuntimeError) as exc:  # safetensors raises its own errors too
            self.bad_files += 1
            log.warning("KV file %s ignored and deleted: %s", path.name, exc)
            _unlink(path)
            return None
        try:
            os.utime(path)  # used: last to be evicted
        except OSError:
            pass
        key, ids, k, v, size = got
        return StoredKV(key, ids, k, v, size, time.perf_counter() - t0)

    def _read_verified(self, path: Path):
        header, declared = read_header(path)
        size = path.stat().st_size
        if size != declared:
            raise BadFile(f"{size} bytes on disk, its header declares {declared} (truncated?)")
        meta = header.get("__metadata__") or {}
        if meta.get("format") != str(FORMAT_VERSION):
            raise BadFile(f"format {meta.get('format')!r}, this engine reads {FORMAT_VERSION}")
        if meta.get("fingerprint") != self.fingerprint:
            raise BadFile("written for another model, adapter, dtype or template")
        from safetensors.torch import load as load_bytes  # noqa: PLC0415

        with open(path, "rb") as f:
            data = f.read()
        if len(data) != declared:
            raise BadFile("changed while read")
        tensors = load_bytes(data)
        ids_t, k, v = tensors.get("ids"), tensors.get("k"), tensors.get("v")
        if ids_t is None or k is None or v is None:
            raise BadFile("missing tensors")
        n = ids_t.shape[0]
        want = (self.shape[0], self.shape[1], n, self.shape[2])
        if ids_t.dtype != torch.int64 or n < 1 or str(n) != meta.get("n_tokens"):
            raise BadFile("ids disagree with the metadata")
        if tuple(k.shape) != want or tuple(v.shape) != want or k.dtype != self.dtype or v.dtype != self.dtype:
            raise BadFile(f"k/v {tuple(k.shape)} {k.dtype}, this model's are {want} {self.dtype}")
        if digest(ids_t, k, v) != meta.get("sha256"):
            raise BadFile("checksum mismatch (corrupted)")
        return meta.get("document", ""), ids_t.tolist(), k, v, size


    # ------------------------------------------------------------ checks
    def check_integrity(self) -> None:
        """Raise AssertionError unless every file of this fingerprint is whole as far as its
        header tells: this format and fingerprint, named for the document and ids it holds,
        exactly as long as it declares (the bytes' checksum is verified at `load`). The
        budget is not checked: processes sharing the directory may be between a write and
        its eviction."""
        for path in self.recent():
            try:
                header, declared = read_header(path)
                size = path.stat().st_size
            except FileNotFoundError:  # evicted by another process meanwhile
                continue
            except (BadFile, OSError) as exc:
                raise AssertionError(f"{path.name}: {exc}") from None
            meta = header.get("__metadata__") or {}
            assert size == declared, f"{path.name}: {size} bytes, its header declares {declared}"
            assert meta.get("format") == str(FORMAT_VERSION), f"{path.name}: format {meta.get('format')!r}"
            assert meta.get("fingerprint") == self.fingerprint, f"{path.name}: another fingerprint under this one's name"
            want = self.path_for(str(meta.get("document")), str(meta.get("ids_sha256")))
            assert path == want, f"{path.name}: named for another document or other ids than it holds"


def _unlink(path: Path) -> bool:
    try:
        path.unlink()
        return True
    except FileNotFoundError:
        return False


__all__ = ["KVDiskStore", "DocumentRows", "StoredKV", "DiskFile", "BadFile", "FORMAT_VERSION", "kv_directory", "list_files", "clear", "describe", "digest"]
