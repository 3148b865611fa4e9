"""`engine.model.gguf_reader.GGUFFile` reads what `gguf.GGUFReader` reads (every metadata
value and type, every tensor's table entry and data), in either byte order, and says where
a broken file stops making sense."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from engine.api import EngineError
from engine.model import gguf as gguf_convert
from engine.model.gguf_reader import GGUFError, GGUFFile
from tiny_models import write_tiny_gguf

gguf = pytest.importorskip("gguf")


def write_every_kind(path: Path, endianess=None) -> Path:
    """A GGUF holding one metadata value of every type (arrays of numbers, bools and strings,
    unicode included) and tensors of float, integer and quantised types."""
    kwargs = {} if endianess is None else {"endianess": endianess}
    writer = gguf.GGUFWriter(str(path), "llama", **kwargs)
    vt = gguf.GGUFValueType
    writer.add_uint8("k.u8", 250)
    writer.add_int8("k.i8", -7)
    writer.add_uint16("k.u16", 65000)
    writer.add_int16("k.i16", -300)
    writer.add_uint32("k.u32", 4_000_000_000)
    writer.add_int32("k.i32", -2_000_000_000)
    writer.add_float32("k.f32", 0.25)
    writer.add_uint64("k.u64", 2**63 + 5)
    writer.add_int64("k.i64", -(2**62))
    writer.add_float64("k.f64", -1.5e-300)
    writer.add_bool("k.bool", True)
    writer.add_string("k.str", "héllo ✓ 𝄞")
    writer.add_string("k.empty", "")
    writer.add_array("k.strs", ["a", "", "ünï", "x" * 300])
    writer.add_array("k.ints", [1, -2, 3])
    writer.add_array("k.floats", [0.5, -0.125])
    writer.add_key_value("k.bools", [True, False, True], vt.ARRAY, sub_type=vt.BOOL)
    writer.add_key_value("k.u8s", [0, 255, 7], vt.ARRAY, sub_type=vt.UINT8)
    rng = np.random.default_rng(0)
    writer.add_tensor("f32", rng.standard_normal((3, 5)).astype(np.float32))
    writer.add_tensor("f16", rng.standard_normal((4, 2, 3)).astype(np.float16))
    writer.add_tensor("i32", np.arange(7, dtype=np.int32))
    for qtype in ("Q8_0", "Q4_0"):
        qt = gguf.GGMLQuantizationType[qtype]
        q = gguf.quants.quantize(rng.standard_normal((2, 64)).astype(np.float32), qt)
        writer.add_tensor(qtype.lower(), q, raw_shape=q.shape, raw_dtype=qt)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def assert_same_as_gguf(path: Path) -> GGUFFile:
    ours, theirs = GGUFFile(path), gguf.GGUFReader(str(path))
    fields = {k: f for k, f in theirs.fields.items() if not k.startswith("GGUF.")}  # its own header entries
    assert list(ours.fields) == list(fields)
    for key, field in fields.items():
        assert ours.fields[key].contents() == field.contents(), key
        assert ours.fields[key].types == field.types, key
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for a, b in zip(ours.tensors, theirs.tensors):
        assert a.tensor_type == b.tensor_type and a.shape.tolist() == b.shape.tolist(), a.name
        assert (a.n_elements, a.n_bytes, a.data_offset) == (b.n_elements, b.n_bytes, b.data_offset), a.name
        assert a.data.shape == b.data.shape and a.data.dtype == b.data.dtype, a.name
        np.testing.assert_array_equal(a.data, b.data)
    return ours


def test_every_metadata_type_and_tensor_type_reads_as_ggufs_reader_reads_it(tmp_path):
    ours = assert_same_as_gguf(write_every_kind(tmp_path / "kinds.gguf"))
    assert ours.fields["k.str"].contents() == "héllo ✓ 𝄞"
    assert ours.fields["k.bools"].contents() == [True, False, True]
    assert ours.fields["k.u64"].contents() == 2**63 + 5
    assert not ours.tensors[0].data.flags.writeable  # a view of the read-only map


def test_a_big_endian_file_reads_the_same_values(tmp_path):
    little = GGUFFile(write_every_kind(tmp_path / "le.gguf"))
    big = GGUFFile(write_every_kind(tmp_path / "be.gguf", gguf.GGUFEndian.BIG))
    assert big.byte_order == ">"
    assert {k: f.contents() for k, f in big.fields.items()} == {k: f.contents() for k, f in little.fields.items()}
    for a, b in zip(big.tensors, little.tensors):
        np.testing.assert_array_equal(a.data, b.data)


def test_a_tiny_models_gguf_reads_the_same(tiny_model_factory, tmp_path):
    path = write_tiny_gguf(tiny_model_factory("llama"), tmp_path / "tiny.gguf", q8_0=("mlp",), qtype="Q4_1")
    ours = assert_same_as_gguf(path)
    assert len(ours.fields["tokenizer.ggml.tokens"].contents()) > 100


def test_the_embedded_model_reads_the_same():
    from engine.model.loader import default_model_path

    try:
        path = default_model_path()
    except EngineError:
        pytest.skip("the default model's package is not installed")
    assert_same_as_gguf(path)


@pytest.mark.parametrize("cut", [3, 4, 8, 30, 200, "mid-vocabulary", "tensor table", "tensor data"])
def test_a_cut_file_says_where_it_stops(tiny_model_factory, tmp_path, cut):
    whole = write_tiny_gguf(tiny_model_factory("llama"), tmp_path / "whole.gguf").read_bytes()
    table_end = GGUFFile(tmp_path / "whole.gguf").tensors[0].data_offset
    at = {"mid-vocabulary": whole.index(b"tokenizer.ggml.tokens") + 2000, "tensor table": table_end - 40,
          "tensor data": len(whole) - 100}.get(cut, cut)
    broken = tmp_path / "cut.gguf"
    broken.write_bytes(whole[:at])
    with pytest.raises(GGUFError, match="past the end|magic|empty|claims"):
        GGUFFile(broken)
    with pytest.raises(EngineError, match="cannot read .*cut.gguf as GGUF"):
        gguf_convert.open_gguf(broken)


def test_nonsense_in_the_header_is_named(tmp_path):
    path = tmp_path / "bad.gguf"
    path.write_bytes(b"")
    with pytest.raises(GGUFError, match="empty"):
        GGUFFile(path)
    path.write_bytes(b"GGML" + b"\0" * 40)
    with pytest.raises(GGUFError, match="no GGUF magic"):
        GGUFFile(path)
    path.write_bytes(b"GGUF" + (7).to_bytes(4, "little") + b"\0" * 40)
    with pytest.raises(GGUFError, match="version 7"):
        GGUFFile(path)
    # one field of an unknown value type (99)
    key = b"k"
    body = (3).to_bytes(4, "little") + (0).to_bytes(8, "little") + (1).to_bytes(8, "little")
    body += len(key).to_bytes(8, "little") + key + (99).to_bytes(4, "little")
    path.write_bytes(b"GGUF" + body + b"\0" * 16)
    with pytest.raises(GGUFError, match="unknown value type 99"):
        GGUFFile(path)
    # a string array claiming more strings than the file has bytes
    body = (3).to_bytes(4, "little") + (0).to_bytes(8, "little") + (1).to_bytes(8, "little")
    body += len(key).to_bytes(8, "little") + key + (9).to_bytes(4, "little") + (8).to_bytes(4, "little")
    body += (2**40).to_bytes(8, "little")
    path.write_bytes(b"GGUF" + body)
    with pytest.raises(GGUFError, match="claims 1099511627776 strings"):
        GGUFFile(path)
    # a key that is not UTF-8
    body = (3).to_bytes(4, "little") + (0).to_bytes(8, "little") + (1).to_bytes(8, "little")
    body += (2).to_bytes(8, "little") + b"\xff\xfe" + (4).to_bytes(4, "little") + (1).to_bytes(4, "little")
    path.write_bytes(b"GGUF" + body)
    with pytest.raises(GGUFError, match="not UTF-8"):
        GGUFFile(path)
    # an alignment that is not a power of two, or not a number
    for value, kind in ((b"\x03\x00\x00\x00", 4), (b"\x02\x00\x00\x00\x00\x00\x00\x00ab", 8)):
        key = b"general.alignment"
        body = (3).to_bytes(4, "little") + (0).to_bytes(8, "little") + (1).to_bytes(8, "little")
        body += len(key).to_bytes(8, "little") + key + kind.to_bytes(4, "little") + value
        path.write_bytes(b"GGUF" + body + b"\0" * 32)
        with pytest.raises(GGUFError, match="general.alignment"):
            GGUFFile(path)
