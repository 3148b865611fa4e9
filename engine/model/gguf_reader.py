"""A GGUF file's metadata and tensor table, read in one pass over a memory map.

`gguf.GGUFReader` (the `gguf` package) builds a numpy view for every part of every
metadata value: the 49k-token vocabulary and 48k merges of the embedded model are ~250,000
views, 3-4.5 s of every model load (docs/model.md, "Load time"). `GGUFFile` reads the
same file with `struct` over the bytes and numpy only for arrays of numbers and for tensor
data, and offers what the engine uses of the package's reader, under the same names:

- `fields`: key -> `Field` with `types` (`gguf.GGUFValueType`, the item type after
  ARRAY) and `contents()` (strings as `str`, arrays as lists, numbers as Python numbers);
- `tensors`: `Tensor` (`name`, `tensor_type` (`gguf.GGMLQuantizationType`), `shape` in
  GGUF order (innermost first), `n_elements`, `n_bytes`, `data_offset`, `data`: a
  read-only view of the map, numpy order, quantised rows as their bytes).

The `gguf` package stays the writer, the type tables and the dequantisers. Format:
https://github.com/ggml-org/ggml/blob/master/docs/gguf.md (versions 2 and 3, either byte
order). A file that is not a whole GGUF raises `GGUFError` saying where it stops making sense.
"""

from __future__ import annotations

import mmap
import struct
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

_MAGIC = b"GGUF"
_DEFAULT_ALIGNMENT = 32
# GGUFValueType -> (struct code, numpy dtype) for the fixed-size scalar types.
_SCALARS: dict[int, tuple[str, str]] = {
    0: ("B", "u1"), 1: ("b", "i1"), 2: ("H", "u2"), 3: ("h", "i2"), 4: ("I", "u4"), 5: ("i", "i4"),
    6: ("f", "f4"), 7: ("?", "u1"), 10: ("Q", "u8"), 11: ("q", "i8"), 12: ("d", "f8"),
}
_STRING, _ARRAY, _BOOL = 8, 9, 7
# Tensor types whose data numpy reads as numbers; every other type is read as its bytes.
_NUMERIC_TENSORS = {"F32": "f4", "F16": "f2", "F64": "f8", "I8": "i1", "I16": "i2", "I32": "i4", "I64": "i8"}


class GGUFError(ValueError):
    """The file is not a whole GGUF (the message says where reading stopped)."""


class Field(NamedTuple):
    types: list  # [GGUFValueType] or [ARRAY, item type]
    value: Any

    def contents(self) -> Any:
        return self.value


class Tensor(NamedTuple):
    name: str
    tensor_type: Any  # gguf.GGMLQuantizationType
    shape: np.ndarray  # GGUF order: innermost dimension first
    n_elements: int
    n_bytes: int
    data_offset: int
    data: np.ndarray


class _Cursor:
    """Reads little- or big-endian values from `buf`, checking each against its end."""

    def __init__(self, buf, order: str) -> None:
        self.buf, self.order, self.pos, self.end = buf, order, 0, len(buf)

    def need(self, n: int, what: str) -> None:
        if n < 0 or self.pos + n > self.end:
            raise GGUFError(f"{what} at byte {self.pos} runs past the end of the file ({self.end} bytes)")

    def scalar(self, code: str, what: str) -> Any:
        size = struct.calcsize(code)
        self.need(size, what)
        (value,) = struct.unpack_from(self.order + code, self.buf, self.pos)
        self.pos += size
        return value

    def string(self, what: str) -> str:
        n = self.scalar("Q", what)
        self.need(n, what)
        raw = self.buf[self.pos:self.pos + n]
        self.pos += n
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise GGUFError(f"{what} at byte {self.pos - n} is not UTF-8: {exc}") from None

    def strings(self, count: int, what: str) -> list[str]:
        buf, order, pos, end = self.buf, self.order + "Q", self.pos, self.end
        unpack = struct.unpack_from
        out = [""] * count
        try:
            for i in range(count):
                if pos + 8 > end:
                    raise GGUFError(f"{what} item {i} at byte {pos} runs past the end of the file ({end} bytes)")
                (n,) = unpack(order, buf, pos)
                pos += 8
                if pos + n > end:
                    raise GGUFError(f"{what} item {i} at byte {pos} runs past the end of the file ({end} bytes)")
                out[i] = buf[pos:pos + n].decode("utf-8")
                pos += n
        except UnicodeDecodeError as exc:
            raise GGUFError(f"{what} item {i} at byte {pos} is not UTF-8: {exc}") from None
        self.pos = pos
        return out

    def numbers(self, dtype: str, count: int, what: str) -> np.ndarray:
        dt = np.dtype(dtype).newbyteorder("<" if self.order == "<" else ">")
        self.need(count * dt.itemsize, what)
        out = np.frombuffer(self.buf, dtype=dt, count=count, offset=self.pos)
        self.pos += count * dt.itemsize
        return out


class GGUFFile:
    """The metadata and tensor table of the GGUF at `path` (see the module docstring)."""

    def __init__(self, path: str | Path) -> None:
        import gguf  # noqa: PLC0415  (the type enums and block sizes)

        self.path = str(path)
        with open(self.path, "rb") as f:
            try:
                self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            except ValueError:  # an empty file cannot be mapped
                raise GGUFError("the file is empty") from None
        buf = self._map
        if buf[:4] != _MAGIC:
            raise GGUFError(f"no GGUF magic (the file starts with {bytes(buf[:4])!r})")
        order = "<"
        cur = _Cursor(buf, order)
        cur.pos = 4
        version = cur.scalar("I", "the version")
        if version & 0xFFFF == 0:  # a big-endian file read little-endian
            order = ">"
            cur = _Cursor(buf, order)
            cur.pos = 4
            version = cur.scalar("I", "the version")
        if version not in (2, 3):
            raise GGUFError(f"GGUF version {version} is not supported (2 and 3 are)")
        self.version, self.byte_order = version, order
        n_tensors = cur.scalar("Q", "the tensor count")
        n_fields = cur.scalar("Q", "the metadata count")
        value_types = gguf.GGUFValueType
        self.fields: dict[str, Field] = {}
        for i in range(n_fields):
            key = cur.string(f"metadata key {i}")
            if key in self.fields:
                raise GGUFError(f"metadata key {key!r} appears twice")
            kind = cur.scalar("I", f"the type of {key!r}")
            if kind == _ARRAY:
                item = cur.scalar("I", f"the item type of {key!r}")
                count = cur.scalar("Q", f"the length of {key!r}")
                value = self._array(cur, item, count, key)
                types = [value_types(_ARRAY), value_types(item)]
                if item == _ARRAY:  # nested: the inner item types are not recorded (as gguf's reader)
                    types.append(value_types(_ARRAY))
            else:
                value = self._value(cur, kind, key)
                types = [value_types(kind)]
            self.fields[key] = Field(types, value)
        alignment = self.fields.get("general.alignment")
        align = alignment.value if alignment is not None else _DEFAULT_ALIGNMENT
        if not isinstance(align, int) or isinstance(align, bool) or align <= 0 or align & (align - 1):
            raise GGUFError(f"general.alignment {align} is not a power of two")
        infos = []
        for i in range(n_tensors):
            name = cur.string(f"tensor name {i}")
            n_dims = cur.scalar("I", f"the rank of tensor {name!r}")
            if n_dims > 8:
                raise GGUFError(f"tensor {name!r} has {n_dims} dimensions")
            dims = cur.numbers("u8", n_dims, f"the shape of tensor {name!r}").astype(np.int64)
            raw_type = cur.scalar("I", f"the type of tensor {name!r}")
            offset = cur.scalar("Q", f"the offset of tensor {name!r}")
            infos.append((name, dims, raw_type, offset))
        data_start = -(-cur.pos // align) * align
        self.tensors: list[Tensor] = []
        seen: set[str] = set()
        for name, dims, raw_type, offset in infos:
            if name in seen:
                raise GGUFError(f"tensor {name!r} appears twice")
            seen.add(name)
            try:
                ttype = gguf.GGMLQuantizationType(raw_type)
            except ValueError:
                raise GGUFError(f"tensor {name!r} has unknown GGML type {raw_type}") from None
            block, type_size = gguf.GGML_QUANT_SIZES[ttype]
            n_elements = int(np.prod(dims)) if len(dims) else 1
            np_dims = tuple(int(d) for d in reversed(dims.tolist()))
            if np_dims and np_dims[-1] % block:
                raise GGUFError(f"tensor {name!r}: rows of {np_dims[-1]} are not whole {ttype.name} blocks of {block}")
            n_bytes = n_elements * type_size // block
            start = data_start + offset
            if start + n_bytes > len(buf):
                raise GGUFError(
                    f"tensor {name!r} ({n_bytes} bytes at {start}) runs past the end of the file ({len(buf)} bytes)"
                )
            numeric = _NUMERIC_TENSORS.get(ttype.name)
            if numeric is not None:
                dt = np.dtype(numeric).newbyteorder(order)
                data = np.frombuffer(buf, dtype=dt, count=n_elements, offset=start).reshape(np_dims)
            else:
                byte_dims = (*np_dims[:-1], np_dims[-1] // block * type_size) if np_dims else (n_bytes,)
                data = np.frombuffer(buf, dtype=np.uint8, count=n_bytes, offset=start).reshape(byte_dims)
            self.tensors.append(Tensor(name, ttype, dims, n_elements, n_bytes, start, data))

    @staticmethod
    def _value(cur: _Cursor, kind: int, key: str) -> Any:
        if kind == _STRING:
            return cur.string(f"the value of {key!r}")
        if kind not in _SCALARS:
            raise GGUFError(f"metadata {key!r} has unknown value type {kind}")
        value = cur.scalar(_SCALARS[kind][0], f"the value of {key!r}")
        return bool(value) if kind == _BOOL else value

    @staticmethod
    def _array(cur: _Cursor, item: int, count: int, key: str) -> list:
        if item == _STRING:
            if count > cur.end:  # every string takes at least its 8-byte length
                raise GGUFError(f"metadata {key!r} claims {count} strings in a {cur.end}-byte file")
            return cur.strings(count, f"metadata {key!r}")
        if item == _ARRAY:
            return [GGUFFile._array(cur, cur.scalar("I", key), cur.scalar("Q", key), key) for _ in range(count)]
        if item not in _SCALARS:
            raise GGUFError(f"metadata {key!r} has unknown item type {item}")
        values = cur.numbers(_SCALARS[item][1], count, f"metadata {key!r}").tolist()
        return [bool(v) for v in values] if item == _BOOL else values


__all__ = ["GGUFError", "GGUFFile", "Field", "Tensor"]
