"""The GGUF reader against files written by gguf-py's GGUFWriter (llama.cpp's reference writer):
every metadata type, tensor shapes and offsets, alignment, and the errors a broken file gives."""
from __future__ import annotations

import gguf
import numpy as np
import pytest

from engine_common.model_files.gguf_file import GGML_TYPES, GGUFError, GGUFFile, find_gguf


def _write(path, alignment: int | None = None, tensors=None):
    w = gguf.GGUFWriter(str(path), "llama")
    if alignment is not None:
        w.add_custom_alignment(alignment)
    w.add_uint8("t.u8", 200)
    w.add_int8("t.i8", -5)
    w.add_uint16("t.u16", 60000)
    w.add_int16("t.i16", -30000)
    w.add_uint32("t.u32", 4_000_000_000)
    w.add_int32("t.i32", -2_000_000_000)
    w.add_float32("t.f32", 0.5)
    w.add_bool("t.bool", True)
    w.add_string("t.str", "héllo 🙂")
    w.add_uint64("t.u64", 2**63 + 1)
    w.add_int64("t.i64", -(2**62))
    w.add_float64("t.f64", 1e-300)
    w.add_array("t.ints", [1, -2, 3])
    w.add_array("t.strs", ["a", "", "ü"])
    w.add_array("t.floats", [0.25, 1.5])
    for name, arr in (tensors or {}).items():
        w.add_tensor(name, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_every_metadata_type_reads_back(tmp_path):
    f = GGUFFile.open(_write(tmp_path / "m.gguf"))
    assert f.version == 3
    md = f.metadata
    assert md["general.architecture"] == "llama"
    assert (md["t.u8"], md["t.i8"], md["t.u16"], md["t.i16"]) == (200, -5, 60000, -30000)
    assert (md["t.u32"], md["t.i32"]) == (4_000_000_000, -2_000_000_000)
    assert md["t.f32"] == 0.5 and md["t.bool"] is True and md["t.str"] == "héllo 🙂"
    assert (md["t.u64"], md["t.i64"], md["t.f64"]) == (2**63 + 1, -(2**62), 1e-300)
    assert md["t.ints"] == [1, -2, 3] and md["t.strs"] == ["a", "", "ü"]
    assert md["t.floats"] == [0.25, 1.5]
    assert f.tensors == {}


@pytest.mark.parametrize("alignment", [None, 64])
def test_tensors_shape_offset_and_bytes(tmp_path, alignment):
    rng = np.random.default_rng(0)
    arrays = {"a": rng.standard_normal((3, 32), dtype=np.float32),
              "b": rng.standard_normal(7).astype(np.float16),
              "c": rng.standard_normal((2, 2, 32), dtype=np.float32)}
    f = GGUFFile.open(_write(tmp_path / "t.gguf", alignment, arrays))
    ref = gguf.GGUFReader(str(tmp_path / "t.gguf"))
    for t in ref.tensors:
        info = f.tensors[t.name]
        assert info.offset == t.data_offset and info.nbytes == t.n_bytes
        assert info.shape == arrays[t.name].shape
        assert info.type_name == t.tensor_type.name
        got = f.raw(t.name).view(arrays[t.name].dtype).reshape(info.shape)
        np.testing.assert_array_equal(got, arrays[t.name])


def test_type_table_matches_gguf_py():
    for type_id, (name, block, size) in GGML_TYPES.items():
        qtype = gguf.GGMLQuantizationType(type_id)
        assert qtype.name == name
        assert gguf.GGML_QUANT_SIZES[qtype] == (block, size)


def test_not_a_gguf_file(tmp_path):
    path = tmp_path / "x.gguf"
    path.write_bytes(b"GGML" + b"\0" * 100)
    with pytest.raises(GGUFError, match="is not a GGUF file"):
        GGUFFile.open(path)


def test_unsupported_version(tmp_path):
    path = tmp_path / "v1.gguf"
    path.write_bytes(b"GGUF" + (1).to_bytes(4, "little") + b"\0" * 32)
    with pytest.raises(GGUFError, match="version=1 is not supported"):
        GGUFFile.open(path)


def test_truncated_files_are_refused(tmp_path):
    full = _write(tmp_path / "full.gguf",
                  tensors={"w": np.ones((4, 32), dtype=np.float32)}).read_bytes()
    (tmp_path / "head.gguf").write_bytes(full[:60])
    with pytest.raises(GGUFError, match="truncated"):
        GGUFFile.open(tmp_path / "head.gguf")
    (tmp_path / "data.gguf").write_bytes(full[:-100])
    with pytest.raises(GGUFError, match="'w' ends past the end of the file"):
        GGUFFile.open(tmp_path / "data.gguf")


def test_find_gguf(tmp_path):
    hf_dir = tmp_path / "hf"
    hf_dir.mkdir()
    (hf_dir / "config.json").write_text("{}")
    (hf_dir / "extra.gguf").write_bytes(b"")
    assert find_gguf(hf_dir) is None                       # a HF directory wins
    one = tmp_path / "one"
    one.mkdir()
    (one / "m.gguf").write_bytes(b"")
    assert find_gguf(one) == one / "m.gguf"
    assert find_gguf(one / "m.gguf") == one / "m.gguf"
    assert find_gguf(tmp_path / "missing") is None
    (one / "n.gguf").write_bytes(b"")
    with pytest.raises(GGUFError, match="holds 2 GGUF files .*m.gguf, n.gguf.*name one"):
        find_gguf(one)
