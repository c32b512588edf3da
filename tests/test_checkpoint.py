"""Safetensors reader and writer: round trips, sharded checkpoints, malformed files, the reference library."""

from __future__ import annotations

import json
import math
import os

import pytest
import torch
from conftest import SCRIPT_PRELOAD, fork_server

from nvoffload.checkpoint import (
    CheckpointError,
    SafetensorsReader,
    SafetensorsWriter,
    TensorInfo,
    load_file,
    open_checkpoint,
    save_file,
)

DTYPES = [
    torch.float64,
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
    torch.complex64,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint64,
    torch.uint32,
    torch.uint16,
    torch.uint8,
    torch.bool,
]
SHAPES = [(3, 5, 7), (), (0,), (4, 0, 3)]  # 0-d and empty tensors included


def make_tensor(shape, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """Random bytes of ``dtype`` (NaNs and every other bit pattern included; bool is 0 or 1)."""
    gen = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=gen).bool()
    nbytes = math.prod(shape) * dtype.itemsize
    return torch.randint(0, 256, (nbytes,), generator=gen, dtype=torch.uint8).view(dtype).reshape(shape)


def raw(tensor: torch.Tensor) -> torch.Tensor:
    flat = tensor.contiguous().reshape(-1)
    return flat.view(torch.uint8) if flat.numel() else torch.empty(0, dtype=torch.uint8)


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal dtype, shape and bytes (so NaNs compare equal)."""
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(raw(a), raw(b))


def all_dtypes_state() -> dict[str, torch.Tensor]:
    return {
        f"{str(dtype).removeprefix('torch.')}.{i}": make_tensor(shape, dtype, seed=i)
        for dtype in DTYPES
        for i, shape in enumerate(SHAPES)
    }


def write_raw(path, header: dict | bytes, data: bytes = b"", length: int | None = None) -> str:
    """A safetensors file with exactly this header and data (``length`` overrides the length field)."""
    encoded = header if isinstance(header, bytes) else json.dumps(header).encode()
    length = len(encoded) if length is None else length
    path = os.fspath(path)
    with open(path, "wb") as f:
        f.write(length.to_bytes(8, "little") + encoded + data)
    return path


def file_header(path) -> tuple[dict, int]:
    """The JSON header of a file and its length field."""
    with open(path, "rb") as f:
        length = int.from_bytes(f.read(8), "little")
        return json.loads(f.read(length)), length


# -- round trips -----------------------------------------------------------------


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_round_trip(tmp_path, dtype, shape):
    x = make_tensor(shape, dtype, seed=1)
    path = tmp_path / "x.safetensors"
    save_file({"x": x}, path, metadata={"format": "pt"})
    with SafetensorsReader(path) as reader:
        assert reader.info("x") == TensorInfo(dtype, shape, x.numel() * x.element_size())
        assert reader.metadata == {"format": "pt"}
        assert same(reader.read("x"), x)


def test_round_trip_many(tmp_path):
    state = all_dtypes_state()
    save_file(state, tmp_path / "m.safetensors")
    back = load_file(tmp_path / "m.safetensors")
    assert list(back) == list(state)
    assert all(same(back[name], state[name]) for name in state)


def test_reader_mapping_api(tmp_path):
    path = tmp_path / "m.safetensors"
    save_file({"b": torch.ones(2), "a": torch.zeros(3, dtype=torch.int8)}, path)
    with SafetensorsReader(path) as reader:
        assert list(reader.keys()) == ["b", "a"]
        assert len(reader) == 2 and "a" in reader and "c" not in reader
        assert reader.metadata == {}
        with pytest.raises(KeyError, match="'c'"):
            reader.info("c")
        with pytest.raises(KeyError, match="'c'"):
            reader.read("c")
    with pytest.raises(ValueError, match="closed"):
        reader.read("a")


def test_write_order_differs_from_header_order(tmp_path):
    dtypes = {"u8": torch.uint8, "f64": torch.float64, "bf16": torch.bfloat16, "f32": torch.float32}
    state = {name: make_tensor((5, 3), dtype, seed=i) for i, (name, dtype) in enumerate(dtypes.items())}
    path = tmp_path / "w.safetensors"
    with SafetensorsWriter(path, {name: (t.dtype, t.shape) for name, t in state.items()}) as writer:
        for name in reversed(list(state)):
            assert not path.exists()  # written under the temporary name until closed
            writer.write(name, state[name])
    assert os.listdir(tmp_path) == ["w.safetensors"]  # nothing left under the temporary name
    header, length = file_header(path)
    assert length % 8 == 0
    # Larger elements first, so every tensor is aligned to its element size.
    assert [header[n]["data_offsets"][0] for n in ("f64", "f32", "bf16", "u8")] == [0, 120, 180, 210]
    back = load_file(path)
    assert all(same(back[name], state[name]) for name in state)


def test_non_contiguous_tensors_written_as_contiguous(tmp_path):
    base = torch.randn(6, 8)
    state = {
        "transposed": base.t(),
        "strided": base[::2, 1::3],
        "expanded": torch.arange(3.0).expand(4, 3),
        "conj": torch.randn(5, dtype=torch.complex64).conj(),
    }
    save_file(state, tmp_path / "nc.safetensors")
    back = load_file(tmp_path / "nc.safetensors")
    for name, tensor in state.items():
        assert torch.equal(back[name], tensor.resolve_conj()), name
        assert back[name].is_contiguous()


def test_read_into_out(tmp_path):
    x = make_tensor((4, 6), torch.bfloat16, seed=2)
    path = tmp_path / "o.safetensors"
    save_file({"x": x, "e": torch.empty(0, 3)}, path)
    with SafetensorsReader(path) as reader:
        out = torch.full((24,), 7.0, dtype=torch.bfloat16)  # any shape with the same number of elements
        assert reader.read("x", out=out) is out
        assert same(out.view(4, 6), x)
        empty = torch.empty(3, 0)
        assert reader.read("e", out=empty) is empty


@pytest.mark.parametrize(
    "out, match",
    [
        (torch.empty(4, 6, dtype=torch.float16), "dtype"),
        (torch.empty(4, 5, dtype=torch.bfloat16), "elements"),
        (torch.empty(6, 4, dtype=torch.bfloat16).t(), "contiguous"),
        (torch.empty(4, 6, dtype=torch.bfloat16, device="meta"), "CPU"),
    ],
    ids=["dtype", "numel", "non-contiguous", "not-cpu"],
)
def test_read_out_mismatch(tmp_path, out, match):
    path = tmp_path / "o.safetensors"
    save_file({"x": torch.zeros(4, 6, dtype=torch.bfloat16)}, path)
    with SafetensorsReader(path) as reader, pytest.raises(ValueError, match=match):
        reader.read("x", out=out)


# -- the writer's checks -------------------------------------------------------------


def test_writer_rejects_misuse(tmp_path):
    path = tmp_path / "w.safetensors"
    writer = SafetensorsWriter(path, {"a": (torch.float32, (2, 3)), "b": (torch.int8, [4])})
    with pytest.raises(KeyError, match="'c'.*not declared"):
        writer.write("c", torch.zeros(2))
    with pytest.raises(ValueError, match="dtype torch.float64"):
        writer.write("a", torch.zeros(2, 3, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"shape \(3, 2\)"):
        writer.write("a", torch.zeros(3, 2))
    with pytest.raises(TypeError, match="torch.Tensor"):
        writer.write("a", [[0.0] * 3] * 2)
    writer.write("a", torch.zeros(2, 3))
    with pytest.raises(ValueError, match="already written"):
        writer.write("a", torch.zeros(2, 3))
    writer.write("b", torch.zeros(4, dtype=torch.int8))
    writer.close()
    writer.close()  # idempotent
    with pytest.raises(ValueError, match="closed"):
        writer.write("a", torch.zeros(2, 3))
    assert set(load_file(path)) == {"a", "b"}


@pytest.mark.parametrize(
    "info, metadata, match",
    [
        ({"x": (torch.complex128, (2,))}, None, "no safetensors name"),
        ({"x": (torch.float32, (2, -1))}, None, "non-negative"),
        ({"x": (torch.float32, (2.0,))}, None, "non-negative"),
        ({"__metadata__": (torch.float32, (2,))}, None, "__metadata__"),
        ({"x": (torch.float32, (2,))}, {"step": 3}, "metadata"),
    ],
    ids=["dtype", "negative-dim", "float-dim", "reserved-name", "metadata"],
)
def test_writer_rejects_bad_declarations(tmp_path, info, metadata, match):
    path = tmp_path / "w.safetensors"
    with pytest.raises(ValueError, match=match):
        SafetensorsWriter(path, info, metadata)
    assert os.listdir(tmp_path) == []


def test_close_before_every_tensor_leaves_no_file(tmp_path):
    path = tmp_path / "w.safetensors"
    writer = SafetensorsWriter(path, {"a": (torch.float32, (2,)), "b": (torch.float32, (2,))})
    writer.write("a", torch.zeros(2))
    with pytest.raises(CheckpointError, match="1 declared tensor.*'b'") as info:
        writer.close()
    assert info.value.path == str(path)
    assert os.listdir(tmp_path) == []


def test_failure_keeps_the_previous_checkpoint(tmp_path):
    path = tmp_path / "w.safetensors"
    save_file({"a": torch.ones(2)}, path)
    with pytest.raises(RuntimeError, match="killed"):
        with SafetensorsWriter(path, {"a": (torch.float32, (2,))}) as writer:
            writer.write("a", torch.zeros(2))
            raise RuntimeError("killed")
    assert os.listdir(tmp_path) == ["w.safetensors"]
    assert torch.equal(load_file(path)["a"], torch.ones(2))


_WRITE_PAST_THE_FILE_SIZE_LIMIT = """
import json, os, resource, signal, sys, torch
from nvoffload.checkpoint import save_file
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the kernel's EFBIG instead of the signal
resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))
try:
    save_file({"a": torch.ones(1 << 20)}, sys.argv[1])
except OSError as exc:
    print(json.dumps({"errno": exc.errno, "filename": exc.filename, "message": str(exc)}))
"""


def test_a_write_past_the_file_size_limit_names_the_file_and_leaves_nothing(tmp_path):
    """A real write error on a real file (RLIMIT_FSIZE: EFBIG, as a full disk's ENOSPC) names the file."""
    import errno

    path = tmp_path / "w.safetensors"  # python -c, forked from the session's server that imported torch once
    done = fork_server(SCRIPT_PRELOAD).run(f"-c {_WRITE_PAST_THE_FILE_SIZE_LIMIT}", [path], timeout=120)
    assert done.returncode == 0 and done.stdout, done.stderr[-3000:]
    got = json.loads(done.stdout)
    partial = str(tmp_path / ".w.safetensors.tmp")
    assert got == {"errno": errno.EFBIG, "filename": partial, "message": f"[Errno 27] File too large: '{partial}'"}
    assert os.listdir(tmp_path) == []


def test_abort(tmp_path):
    path = tmp_path / "w.safetensors"
    writer = SafetensorsWriter(path, {"a": (torch.float32, (2,))})
    writer.write("a", torch.ones(2))
    writer.abort()
    assert os.listdir(tmp_path) == []
    save_file({"a": torch.ones(2)}, path)
    with SafetensorsWriter(path, {"b": (torch.float32, ())}) as writer:
        writer.write("b", torch.tensor(2.0))
    writer.abort()  # nothing to undo once closed
    assert list(load_file(path)) == ["b"]


def test_short_reads_and_writes(tmp_path, monkeypatch):
    """The kernel may move fewer bytes than asked (over 2 GiB on Linux): both loops go on."""
    preadv, pwrite = os.preadv, os.pwrite
    monkeypatch.setattr(os, "preadv", lambda fd, bufs, offset: preadv(fd, [bufs[0][:7]], offset))
    monkeypatch.setattr(os, "pwrite", lambda fd, data, offset: pwrite(fd, data[:5], offset))
    state = {"x": make_tensor((9, 11), torch.float64, seed=3), "y": make_tensor((13,), torch.bfloat16, seed=4)}
    save_file(state, tmp_path / "s.safetensors", metadata={"format": "pt"})
    back = load_file(tmp_path / "s.safetensors")
    assert all(same(back[name], state[name]) for name in state)


# -- the reader's checks -------------------------------------------------------------

F32_X = {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}


@pytest.mark.parametrize(
    "header, data, length, tensor, match",
    [
        (b"", b"", None, None, "not valid UTF-8 JSON"),
        ({"x": F32_X}, bytes(8), 10_000, None, "runs past the end of the file"),
        (b"\xff\xfe{}", b"", None, None, "not valid UTF-8 JSON"),
        (b'{"x": {"dtype": "F32"', b"", None, None, "not valid UTF-8 JSON"),
        (b'{"x": {}, "x": {}}', b"", None, None, "'x' appears twice"),
        (b"[1, 2]", b"", None, None, "JSON list, not an object"),
        ({"__metadata__": {"step": 3}}, b"", None, None, "__metadata__ must map str to str"),
        ({"x": [1]}, b"", None, "x", "not an object"),
        ({"x": {"dtype": "F32", "shape": [2]}}, b"", None, "x", "lacks data_offsets"),
        ({"x": {**F32_X, "dtype": "F128"}}, bytes(8), None, "x", "unknown dtype 'F128'"),
        ({"x": {**F32_X, "shape": [2.0]}}, bytes(8), None, "x", "shape must be"),
        ({"x": {**F32_X, "shape": [-2]}}, bytes(8), None, "x", "shape must be"),
        ({"x": {**F32_X, "data_offsets": [0]}}, bytes(8), None, "x", "data_offsets must be"),
        ({"x": {**F32_X, "data_offsets": [8, 0]}}, bytes(8), None, "x", "end before they begin"),
        ({"x": {**F32_X, "shape": [3]}}, bytes(8), None, "x", r"span 8 bytes but dtype F32 and shape \[3\] need 12"),
        ({"x": F32_X}, bytes(5), None, "x", "run past the end of the data buffer .5 bytes.: the file is truncated"),
        ({"x": F32_X, "y": {**F32_X, "data_offsets": [4, 12]}}, bytes(12), None, "y", "overlap those of 'x'"),
        ({"x": {**F32_X, "data_offsets": [4, 12]}}, bytes(12), None, "x", r"leave bytes \[0, 4\)"),
        ({"x": F32_X}, bytes(9), None, None, "1 bytes follow the last tensor"),
    ],
    ids=[
        "empty-header",
        "header-length-past-end",
        "not-utf8",
        "bad-json",
        "duplicate-key",
        "not-an-object",
        "bad-metadata",
        "entry-not-object",
        "entry-missing-field",
        "unknown-dtype",
        "float-dim",
        "negative-dim",
        "one-offset",
        "reversed-offsets",
        "nbytes-mismatch",
        "truncated",
        "overlap",
        "hole",
        "trailing-bytes",
    ],
)
def test_malformed_file(tmp_path, header, data, length, tensor, match):
    path = write_raw(tmp_path / "bad.safetensors", header, data, length)
    with pytest.raises(CheckpointError, match=match) as info:
        SafetensorsReader(path)
    assert info.value.path == path and info.value.tensor == tensor
    assert path in str(info.value)


def test_file_shorter_than_length_field(tmp_path):
    path = tmp_path / "short.safetensors"
    path.write_bytes(b"\x01\x00")
    with pytest.raises(CheckpointError, match="too short"):
        SafetensorsReader(path)


def test_truncated_checkpoint(tmp_path):
    path = tmp_path / "t.safetensors"
    save_file({"a": torch.ones(4, dtype=torch.float64), "b": torch.ones(3, dtype=torch.float16)}, path)
    os.truncate(path, os.path.getsize(path) - 1)
    with pytest.raises(CheckpointError, match=f"{path}, tensor 'b': .*truncated"):
        SafetensorsReader(path)


def test_truncated_while_open(tmp_path):
    path = tmp_path / "t.safetensors"
    save_file({"a": torch.ones(1000)}, path)
    with SafetensorsReader(path) as reader:
        os.truncate(path, os.path.getsize(path) - 100)
        with pytest.raises(CheckpointError, match="tensor 'a'.*ended inside"):
            reader.read("a")


def test_empty_data_and_zero_size_tensors_only(tmp_path):
    path = tmp_path / "e.safetensors"
    save_file({"a": torch.empty(0), "b": torch.empty(2, 0, dtype=torch.bfloat16)}, path, metadata={})
    back = load_file(path)
    assert same(back["a"], torch.empty(0)) and same(back["b"], torch.empty(2, 0, dtype=torch.bfloat16))


# -- sharded checkpoints -------------------------------------------------------------


def make_shards(directory) -> dict[str, torch.Tensor]:
    """Two shards in ``directory``, as Hugging Face writes them; returns every tensor."""
    shards = {
        "model-00001-of-00002.safetensors": {"embed": make_tensor((8, 4), torch.bfloat16, 1), "norm": torch.ones(4)},
        "model-00002-of-00002.safetensors": {"head": make_tensor((4, 8), torch.bfloat16, 2), "step": torch.tensor(7)},
    }
    for i, (file, tensors) in enumerate(shards.items()):
        save_file(tensors, directory / file, metadata={"format": "pt", "shard": str(i)})
    return {name: t for tensors in shards.values() for name, t in tensors.items()}


def write_index(directory, weight_map: dict[str, str]) -> str:
    path = os.path.join(directory, "model.safetensors.index.json")
    with open(path, "w") as f:
        json.dump({"metadata": {"total_size": 0}, "weight_map": weight_map}, f)
    return path


SHARD_OF = {
    "embed": "model-00001-of-00002.safetensors",
    "norm": "model-00001-of-00002.safetensors",
    "head": "model-00002-of-00002.safetensors",
    "step": "model-00002-of-00002.safetensors",
}


def check_checkpoint(reader, state: dict[str, torch.Tensor], directory) -> None:
    assert list(reader.keys()) == list(state) and len(reader) == len(state)
    assert reader.metadata == {"format": "pt"}  # the entries every shard agrees on
    for name, tensor in state.items():
        assert name in reader
        assert reader.info(name) == (tensor.dtype, tuple(tensor.shape), tensor.numel() * tensor.element_size())
        assert reader.file_of(name) == os.path.join(directory, SHARD_OF[name])
        assert same(reader.read(name), tensor)
        assert same(reader.read(name, out=torch.empty_like(tensor)), tensor)
    with pytest.raises(KeyError, match="'nope'"):
        reader.read("nope")


def test_sharded_directory(tmp_path):
    state = make_shards(tmp_path)
    (tmp_path / "config.json").write_text("{}")
    with open_checkpoint(tmp_path) as reader:
        check_checkpoint(reader, state, str(tmp_path))
        assert [shard.metadata["shard"] for shard in reader.shards] == ["0", "1"]
    assert set(load_file(tmp_path)) == set(state)


def test_sharded_index(tmp_path):
    state = make_shards(tmp_path)
    index = write_index(tmp_path, SHARD_OF)
    with open_checkpoint(index) as reader:
        check_checkpoint(reader, state, str(tmp_path))
    # A directory with an index reads the shards it names, not every file.
    save_file({"embed": torch.zeros(1)}, tmp_path / "consolidated.safetensors")
    with open_checkpoint(tmp_path) as reader:
        check_checkpoint(reader, state, str(tmp_path))


def test_single_file_checkpoint(tmp_path):
    save_file({"a": torch.ones(2)}, tmp_path / "one.safetensors", metadata={"format": "pt"})
    with open_checkpoint(tmp_path / "one.safetensors") as reader:
        assert list(reader.keys()) == ["a"] and reader.metadata == {"format": "pt"}
        assert torch.equal(reader.read("a"), torch.ones(2))


def test_duplicate_name_across_shards(tmp_path):
    save_file({"a": torch.ones(2), "b": torch.ones(2)}, tmp_path / "1.safetensors")
    save_file({"b": torch.zeros(2)}, tmp_path / "2.safetensors")
    with pytest.raises(CheckpointError, match="tensor 'b': the tensor is also in .*1.safetensors") as info:
        open_checkpoint(tmp_path)
    assert info.value.path == str(tmp_path / "2.safetensors") and info.value.tensor == "b"


@pytest.mark.parametrize(
    "weight_map, tensor, match",
    [
        ({**SHARD_OF, "norm": "model-00002-of-00002.safetensors"}, "norm", "does not hold it"),
        ({**SHARD_OF, "extra": "model-00002-of-00002.safetensors"}, "extra", "does not hold it"),
        ({k: v for k, v in SHARD_OF.items() if k != "head"}, "head", "omits the tensor"),
        ({"embed": 3}, None, "weight_map"),
    ],
    ids=["wrong-shard", "missing-tensor", "unlisted-tensor", "bad-weight-map"],
)
def test_inconsistent_index(tmp_path, weight_map, tensor, match):
    make_shards(tmp_path)
    index = write_index(tmp_path, weight_map)
    with pytest.raises(CheckpointError, match=match) as info:
        open_checkpoint(index)
    assert info.value.path == index and info.value.tensor == tensor


def test_index_not_json(tmp_path):
    index = tmp_path / "model.safetensors.index.json"
    index.write_text("{")
    with pytest.raises(CheckpointError, match="not a valid JSON index"):
        open_checkpoint(index)


def test_directory_without_shards(tmp_path):
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors files"):
        open_checkpoint(tmp_path)


# -- the reference implementation ---------------------------------------------------


@pytest.fixture
def reference():
    pytest.importorskip("safetensors")
    import safetensors
    import safetensors.torch

    return safetensors


def test_reference_loads_our_files(tmp_path, reference):
    state = all_dtypes_state()
    path = tmp_path / "ours.safetensors"
    save_file(state, path, metadata={"format": "pt", "note": "ünïcode"})
    back = reference.torch.load_file(path)
    assert set(back) == set(state)
    assert all(same(back[name], state[name]) for name in state)
    with reference.safe_open(path, framework="pt") as f:
        assert f.metadata() == {"format": "pt", "note": "ünïcode"}


def test_we_load_reference_files(tmp_path, reference):
    state = all_dtypes_state()
    path = tmp_path / "theirs.safetensors"
    reference.torch.save_file(state, path, metadata={"format": "pt", "note": "ünïcode"})
    with SafetensorsReader(path) as reader:
        assert reader.metadata == {"format": "pt", "note": "ünïcode"}
        assert set(reader.keys()) == set(state)
        for name, tensor in state.items():
            assert same(reader.read(name), tensor), name


def test_same_bytes_as_reference(tmp_path, reference):
    state = {name: make_tensor((3, 4), torch.float32, seed=i) for i, name in enumerate(["a.bias", "a.weight", "b"])}
    save_file(state, tmp_path / "ours.safetensors", metadata={"format": "pt"})
    reference.torch.save_file(state, tmp_path / "theirs.safetensors", metadata={"format": "pt"})
    assert (tmp_path / "ours.safetensors").read_bytes() == (tmp_path / "theirs.safetensors").read_bytes()
