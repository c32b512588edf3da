"""Safetensors checkpoints read and written one tensor at a time, for models larger than RAM.

A safetensors file is an 8-byte little-endian header length N, N bytes of
UTF-8 JSON naming each tensor's dtype, shape and ``data_offsets`` (relative to
the data buffer that follows the header), then the raw little-endian,
row-major bytes of every tensor. Nothing here holds more than one tensor in
memory, and nothing needs the ``safetensors`` package.

- :class:`SafetensorsReader` -- one file: validates the whole header on open,
  then ``read`` fetches one tensor's bytes with ``pread`` (into ``out`` or a new tensor).
- :class:`CheckpointReader` / :func:`open_checkpoint` -- the same API over a file,
  a directory of shards or a Hugging Face ``model.safetensors.index.json``.
- :class:`SafetensorsWriter` -- told every name, dtype and shape up front, writes the
  header, then one tensor at a time in any order; the file appears under its final
  name only once complete and on disk.
- :func:`save_file`, :func:`load_file` -- whole state dicts, for small models and tests.

Hosts are assumed little-endian (every platform PyTorch ships for).

>>> import os, tempfile, torch
>>> from nvoffload.checkpoint import SafetensorsReader, SafetensorsWriter
>>> path = os.path.join(tempfile.mkdtemp(), "model.safetensors")
>>> with SafetensorsWriter(path, {"w": (torch.bfloat16, (2, 3))}) as writer:
...     writer.write("w", torch.ones(2, 3, dtype=torch.bfloat16))
>>> with SafetensorsReader(path) as reader:
...     reader.info("w"), reader.read("w").sum().item()
(TensorInfo(dtype=torch.bfloat16, shape=(2, 3), nbytes=12), 6.0)
"""

from __future__ import annotations

import ctypes
import glob
import json
import math
import os
from collections.abc import KeysView, Mapping, Sequence
from typing import NamedTuple

import torch

from nvoffload.core.atomic import AtomicFile, naming
from nvoffload.io.checksum import crc32c, crc32c_combine

__all__ = [
    "CheckpointError",
    "CheckpointReader",
    "SafetensorsReader",
    "SafetensorsWriter",
    "TensorInfo",
    "load_file",
    "open_checkpoint",
    "save_file",
]

# The dtype names of the safetensors format that PyTorch (>= 2.3) has a dtype for.
_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "C64": torch.complex64,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U64": torch.uint64,
    "U32": torch.uint32,
    "U16": torch.uint16,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
_NAMES: dict[torch.dtype, str] = {dtype: name for name, dtype in _DTYPES.items()}

_METADATA_KEY = "__metadata__"
_INDEX_NAME = "model.safetensors.index.json"
_LENGTH_BYTES = 8  # the header length field, and the alignment writers pad the header to
_MAX_HEADER_BYTES = 100_000_000  # as the reference implementation: a larger length is corruption


class CheckpointError(ValueError):
    """A checkpoint file is malformed or inconsistent: carries the file and, where one is at fault, the tensor."""

    def __init__(self, path: str, detail: str, tensor: str | None = None):
        where = f"{path}, tensor {tensor!r}" if tensor is not None else path
        super().__init__(f"{where}: {detail}")
        self.path = path
        self.tensor = tensor


class TensorInfo(NamedTuple):
    """What a checkpoint holds for one tensor."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    nbytes: int  # bytes of its data in the file


# -- byte I/O ----------------------------------------------------------------


def _bytes_of(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous, non-empty CPU tensor as a writable buffer, without a copy.

    The tensor must stay alive while the buffer is in use.
    """
    nbytes = tensor.numel() * tensor.element_size()
    return memoryview((ctypes.c_ubyte * nbytes).from_address(tensor.data_ptr()))


def _pread_into(fd: int, buf: memoryview, offset: int) -> int:
    """Fill ``buf`` from byte ``offset`` of ``fd``; returns the bytes read (fewer only at end of file)."""
    done = 0
    while done < len(buf):
        n = os.preadv(fd, [buf[done:]], offset + done)
        if n == 0:
            break
        done += n
    return done


def _pwrite_all(fd: int, buf: bytes | memoryview, offset: int) -> None:
    """Write all of ``buf`` at byte ``offset`` of ``fd``."""
    view = memoryview(buf)
    done = 0
    while done < len(view):
        done += os.pwrite(fd, view[done:], offset + done)


# -- header parsing ------------------------------------------------------------


def _unique_keys(pairs: list[tuple[str, object]]) -> dict[str, object]:
    """``json`` object hook that refuses a key given twice (a tensor named twice)."""
    seen: set[str] = set()
    for key, _ in pairs:
        if key in seen:
            raise ValueError(f"key {key!r} appears twice")
        seen.add(key)
    return dict(pairs)


def _is_count(value: object) -> bool:
    """A JSON non-negative integer (``true`` and ``1.0`` are not)."""
    return type(value) is int and value >= 0


def _read_header(fd: int, path: str, file_bytes: int) -> tuple[dict, int]:
    """The header of a safetensors file as a JSON object, and the file offset of its data buffer."""
    if file_bytes < _LENGTH_BYTES:
        raise CheckpointError(
            path, f"the file is {file_bytes} bytes, too short for the {_LENGTH_BYTES}-byte header length"
        )
    length_field = bytearray(_LENGTH_BYTES)
    _pread_into(fd, memoryview(length_field), 0)
    length = int.from_bytes(length_field, "little")
    if length > file_bytes - _LENGTH_BYTES:
        raise CheckpointError(
            path,
            f"header length {length} runs past the end of the file ({file_bytes} bytes): "
            "the file is truncated or not a safetensors file",
        )
    if length > _MAX_HEADER_BYTES:
        raise CheckpointError(path, f"header length {length} exceeds the limit of {_MAX_HEADER_BYTES} bytes")
    raw = bytearray(length)
    if _pread_into(fd, memoryview(raw), _LENGTH_BYTES) != length:
        raise CheckpointError(path, "the file ended inside the header (truncated while being opened?)")
    try:
        header = json.loads(raw.decode("utf-8"), object_pairs_hook=_unique_keys)
    except ValueError as exc:  # UnicodeDecodeError and JSONDecodeError included
        raise CheckpointError(path, f"the header is not valid UTF-8 JSON: {exc}") from None
    if not isinstance(header, dict):
        raise CheckpointError(path, f"the header is a JSON {type(header).__name__}, not an object")
    return header, _LENGTH_BYTES + length


def _parse_metadata(path: str, value: object) -> dict[str, str]:
    if value is None:
        return {}
    if not isinstance(value, dict) or not all(isinstance(v, str) for v in value.values()):
        raise CheckpointError(path, f"{_METADATA_KEY} must map str to str, got {value!r}")
    return value


def _parse_entry(path: str, name: str, entry: object) -> tuple[TensorInfo, int, int]:
    """One tensor's header entry as its info and its ``[begin, end)`` in the data buffer."""
    if not isinstance(entry, dict):
        raise CheckpointError(path, f"the header entry is a JSON {type(entry).__name__}, not an object", name)
    missing = [key for key in ("dtype", "shape", "data_offsets") if key not in entry]
    if missing:
        raise CheckpointError(path, f"the header entry lacks {', '.join(missing)}", name)
    dtype_name, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    if dtype_name not in _DTYPES:
        raise CheckpointError(path, f"unknown dtype {dtype_name!r} (known: {', '.join(_DTYPES)})", name)
    if not isinstance(shape, list) or not all(_is_count(d) for d in shape):
        raise CheckpointError(path, f"shape must be a list of non-negative ints, got {shape!r}", name)
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(map(_is_count, offsets))):
        raise CheckpointError(path, f"data_offsets must be two non-negative ints, got {offsets!r}", name)
    begin, end = offsets
    if begin > end:
        raise CheckpointError(path, f"data_offsets {offsets} end before they begin", name)
    dtype = _DTYPES[dtype_name]
    nbytes = math.prod(shape) * dtype.itemsize
    if end - begin != nbytes:
        raise CheckpointError(
            path,
            f"data_offsets {offsets} span {end - begin} bytes but dtype {dtype_name} and shape {shape} need {nbytes}",
            name,
        )
    return TensorInfo(dtype, tuple(shape), nbytes), begin, end


def _check_layout(path: str, spans: list[tuple[int, int, str]], data_bytes: int) -> None:
    """The tensors' ``(begin, end, name)`` must tile the data buffer exactly, as the format requires."""
    cursor, previous = 0, None
    for begin, end, name in sorted(spans):
        if end > data_bytes:
            raise CheckpointError(
                path,
                f"data_offsets [{begin}, {end}] run past the end of the data buffer ({data_bytes} bytes): "
                "the file is truncated",
                name,
            )
        if begin < cursor:
            raise CheckpointError(path, f"data_offsets [{begin}, {end}] overlap those of {previous!r}", name)
        if begin > cursor:
            raise CheckpointError(
                path, f"data_offsets [{begin}, {end}] leave bytes [{cursor}, {begin}) of the data unused", name
            )
        cursor, previous = end, name
    if cursor != data_bytes:
        raise CheckpointError(path, f"{data_bytes - cursor} bytes follow the last tensor's data")


# -- reading -------------------------------------------------------------------


class SafetensorsReader:
    """One safetensors file, read one tensor at a time.

    The whole header is validated on open: a header length beyond the file,
    invalid JSON, an unknown dtype, offsets that disagree with dtype and shape,
    overlap, leave holes or run past the end of a truncated file all raise
    :class:`CheckpointError` naming the file and the tensor. ``read`` is safe
    to call from several threads at once (it uses ``pread``).

    Args:
        path: the ``.safetensors`` file.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        self._file = open(self.path, "rb", buffering=0)  # closed by close()
        try:
            fd = self._file.fileno()
            file_bytes = os.fstat(fd).st_size
            header, data_start = _read_header(fd, self.path, file_bytes)
            self._metadata = _parse_metadata(self.path, header.pop(_METADATA_KEY, None))
            self._entries: dict[str, tuple[TensorInfo, int]] = {}  # name -> (info, file offset)
            spans = []
            for name, entry in header.items():
                info, begin, end = _parse_entry(self.path, name, entry)
                self._entries[name] = (info, data_start + begin)
                spans.append((begin, end, name))
            _check_layout(self.path, spans, file_bytes - data_start)
        except BaseException:
            self._file.close()
            raise

    @property
    def metadata(self) -> dict[str, str]:
        """The file's ``__metadata__`` (empty when it has none)."""
        return dict(self._metadata)

    def keys(self) -> KeysView[str]:
        """Tensor names, in header order."""
        return self._entries.keys()

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def info(self, name: str) -> TensorInfo:
        """``(dtype, shape, nbytes)`` of tensor ``name``, without reading it."""
        return self._entry(name)[0]

    def read(self, name: str, out: torch.Tensor | None = None) -> torch.Tensor:
        """Read tensor ``name`` from the file, exactly its bytes.

        Without ``out`` the result is a new CPU tensor of the stored dtype and
        shape. ``out`` must be a contiguous CPU tensor of the stored dtype and
        number of elements (any shape); it is filled and returned.
        """
        info, offset = self._entry(name)
        if out is None:
            out = torch.empty(info.shape, dtype=info.dtype)
        else:
            _check_out(name, info, out)
        if self._file.closed:
            raise ValueError(f"read({name!r}): the reader of {self.path} is closed")
        if info.nbytes and _pread_into(self._file.fileno(), _bytes_of(out), offset) != info.nbytes:
            raise CheckpointError(
                self.path, "the file ended inside the tensor's data (truncated after it was opened?)", name
            )
        return out

    def read_slice(self, name: str, start: int, out: torch.Tensor) -> torch.Tensor:
        """Read ``out.numel()`` elements of tensor ``name`` (flat, row-major) from element ``start`` into ``out``,
        a contiguous CPU tensor of the stored dtype: a part of a tensor larger than memory."""
        info, offset = self._entry(name)
        if out.dtype != info.dtype or out.device.type != "cpu" or not out.is_contiguous():
            raise ValueError(f"read_slice({name!r}): out must be a contiguous CPU tensor of {info.dtype}")
        numel = math.prod(info.shape)
        if start < 0 or start + out.numel() > numel:
            raise ValueError(f"read_slice({name!r}): elements [{start}, {start + out.numel()}) outside its {numel}")
        if self._file.closed:
            raise ValueError(f"read_slice({name!r}): the reader of {self.path} is closed")
        nbytes = out.numel() * out.element_size()
        at = offset + start * out.element_size()
        if nbytes and _pread_into(self._file.fileno(), _bytes_of(out), at) != nbytes:
            raise CheckpointError(
                self.path, "the file ended inside the tensor's data (truncated after it was opened?)", name
            )
        return out

    def close(self) -> None:
        """Close the file. Idempotent."""
        self._file.close()

    def __enter__(self) -> SafetensorsReader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _entry(self, name: str) -> tuple[TensorInfo, int]:
        try:
            return self._entries[name]
        except KeyError:
            raise KeyError(f"no tensor named {name!r} in {self.path}") from None


def _check_out(name: str, info: TensorInfo, out: torch.Tensor) -> None:
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"read({name!r}): out must be a torch.Tensor, got {type(out).__name__}")
    if out.dtype != info.dtype or out.numel() * out.element_size() != info.nbytes:
        raise ValueError(
            f"read({name!r}): out has dtype {out.dtype} and {out.numel()} elements, "
            f"the stored tensor has dtype {info.dtype} and shape {info.shape}"
        )
    if out.device.type != "cpu" or out.layout != torch.strided or not out.is_contiguous():
        got = f"a non-contiguous tensor on {out.device}" if out.device.type == "cpu" else f"a tensor on {out.device}"
        raise ValueError(f"read({name!r}): out must be a contiguous CPU tensor, got {got}")


class CheckpointReader:
    """Several safetensors shards read as one checkpoint, with :class:`SafetensorsReader`'s API.

    A tensor name found in two shards raises :class:`CheckpointError`.
    ``metadata`` holds the ``__metadata__`` entries every shard agrees on;
    ``shards`` the readers of the files themselves.

    Args:
        paths: the shard files (at least one).
    """

    def __init__(self, paths: Sequence[str | os.PathLike]):
        if not paths:
            raise ValueError("CheckpointReader needs at least one shard file")
        self.shards: list[SafetensorsReader] = []
        self._where: dict[str, SafetensorsReader] = {}
        try:
            for path in paths:
                self.shards.append(SafetensorsReader(path))
                self._add(self.shards[-1])
        except BaseException:
            self.close()
            raise

    def _add(self, shard: SafetensorsReader) -> None:
        for name in shard.keys():
            other = self._where.setdefault(name, shard)
            if other is not shard:
                raise CheckpointError(shard.path, f"the tensor is also in {other.path}", name)

    @property
    def metadata(self) -> dict[str, str]:
        """The ``__metadata__`` entries (key and value) common to every shard."""
        common = self.shards[0].metadata
        for shard in self.shards[1:]:
            theirs = shard.metadata
            common = {key: value for key, value in common.items() if theirs.get(key) == value}
        return common

    def keys(self) -> KeysView[str]:
        """Tensor names, shard by shard in header order."""
        return self._where.keys()

    def __contains__(self, name: object) -> bool:
        return name in self._where

    def __len__(self) -> int:
        return len(self._where)

    def file_of(self, name: str) -> str:
        """Path of the shard that holds tensor ``name``."""
        return self._shard(name).path

    def info(self, name: str) -> TensorInfo:
        """``(dtype, shape, nbytes)`` of tensor ``name``, without reading it."""
        return self._shard(name).info(name)

    def read(self, name: str, out: torch.Tensor | None = None) -> torch.Tensor:
        """Read tensor ``name`` from its shard: see :meth:`SafetensorsReader.read`."""
        return self._shard(name).read(name, out)

    def read_slice(self, name: str, start: int, out: torch.Tensor) -> torch.Tensor:
        """Read part of tensor ``name`` from its shard: see :meth:`SafetensorsReader.read_slice`."""
        return self._shard(name).read_slice(name, start, out)

    def close(self) -> None:
        """Close every shard. Idempotent."""
        for shard in self.shards:
            shard.close()

    def __enter__(self) -> CheckpointReader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _shard(self, name: str) -> SafetensorsReader:
        try:
            return self._where[name]
        except KeyError:
            raise KeyError(f"no tensor named {name!r} in the checkpoint's {len(self.shards)} shard(s)") from None


def _read_index(index_path: str) -> dict[str, str]:
    """The ``weight_map`` (tensor name -> shard path) of a Hugging Face sharded-checkpoint index."""
    try:
        with open(index_path, encoding="utf-8") as f:
            index = json.load(f)
    except ValueError as exc:
        raise CheckpointError(index_path, f"not a valid JSON index: {exc}") from None
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise CheckpointError(index_path, 'the index needs a "weight_map" object mapping tensor names to shard files')
    base = os.path.dirname(index_path)
    return {name: os.path.join(base, shard) for name, shard in weight_map.items()}


def _open_index(index_path: str) -> CheckpointReader:
    """The shards an index names, checked against its ``weight_map`` both ways."""
    weight_map = _read_index(index_path)
    reader = CheckpointReader(sorted(set(weight_map.values())))
    try:
        for name, shard in weight_map.items():
            if name not in reader or reader.file_of(name) != shard:
                raise CheckpointError(index_path, f"the index maps the tensor to {shard}, which does not hold it", name)
        unlisted = [name for name in reader.keys() if name not in weight_map]
        if unlisted:
            name = unlisted[0]
            raise CheckpointError(index_path, f"the index omits the tensor, stored in {reader.file_of(name)}", name)
    except BaseException:
        reader.close()
        raise
    return reader


def open_checkpoint(path: str | os.PathLike) -> CheckpointReader:
    """Open a checkpoint as one reader, whichever way it is laid out.

    ``path`` is a ``.safetensors`` file; a Hugging Face index
    (``*.json`` with a ``weight_map``, whose shards must hold exactly the
    tensors it lists); or a directory, read through its
    ``model.safetensors.index.json`` when it has one and as all its
    ``*.safetensors`` files otherwise.
    """
    path = os.fspath(path)
    if os.path.isdir(path):
        index_path = os.path.join(path, _INDEX_NAME)
        if os.path.exists(index_path):
            return _open_index(index_path)
        shards = sorted(glob.glob(os.path.join(glob.escape(path), "*.safetensors")))
        if not shards:
            raise FileNotFoundError(f"no *.safetensors files in the directory {path}")
        return CheckpointReader(shards)
    if path.endswith(".json"):
        return _open_index(path)
    return CheckpointReader([path])


# -- writing -------------------------------------------------------------------


def _plan(tensors_info: Mapping[str, tuple[torch.dtype, Sequence[int]]]) -> dict[str, tuple[TensorInfo, int]]:
    """Each tensor's info and offset in the data buffer, in the given order.

    In the data buffer larger elements come first (ties in the given order),
    so that every tensor's data is aligned to its element size.
    """
    infos = {}
    for name, (dtype, shape) in tensors_info.items():
        if not isinstance(name, str) or name == _METADATA_KEY:
            raise ValueError(f"tensor names are str other than {_METADATA_KEY!r}, got {name!r}")
        if dtype not in _NAMES:
            supported = ", ".join(sorted(map(str, _NAMES)))
            raise ValueError(f"tensor {name!r}: dtype {dtype} has no safetensors name (supported: {supported})")
        shape = tuple(shape)
        if not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
            raise ValueError(f"tensor {name!r}: shape must be non-negative ints, got {shape!r}")
        infos[name] = TensorInfo(dtype, shape, math.prod(shape) * dtype.itemsize)
    offsets, offset = {}, 0
    for name, info in sorted(infos.items(), key=lambda item: -item[1].dtype.itemsize):
        offsets[name] = offset
        offset += info.nbytes
    return {name: (info, offsets[name]) for name, info in infos.items()}


def _encode_header(
    layout: dict[str, tuple[TensorInfo, int]], metadata: Mapping[str, str] | None, data_alignment_bytes: int
) -> bytes:
    """The JSON header, padded with spaces so that the data starts at a multiple of ``data_alignment_bytes``
    (8, as the reference writer does; a multiple of 8)."""
    header: dict[str, object] = {}
    if metadata is not None:
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
            raise ValueError(f"metadata must map str to str, got {dict(metadata)!r}")
        header[_METADATA_KEY] = dict(metadata)
    for name, (info, offset) in layout.items():
        header[name] = {
            "dtype": _NAMES[info.dtype],
            "shape": list(info.shape),
            "data_offsets": [offset, offset + info.nbytes],
        }
    encoded = json.dumps(header, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
    return encoded + b" " * (-(_LENGTH_BYTES + len(encoded)) % data_alignment_bytes)


class SafetensorsWriter:
    """Writes a safetensors file one tensor at a time, in any order.

    The header comes first in the file, so the writer is told every tensor's
    name, dtype and shape up front. It writes to a hidden sibling of ``path``
    (an :class:`~nvoffload.core.atomic.AtomicFile`); ``close`` checks that every
    tensor was written exactly once, fsyncs, and renames the file to ``path``,
    so a crash never leaves a partial checkpoint under the final name. Leaving a ``with`` block by an exception, or :meth:`abort`,
    removes the partial file.

    ``checksums`` holds the CRC-32C of each tensor's bytes (of the parts written so far). An I/O error
    (a full disk) is an OSError whose ``filename`` is the partial file.

    Args:
        path: the file to create (replaced if it exists, once complete).
        tensors_info: ``{name: (dtype, shape)}`` of every tensor the file will hold.
        metadata: ``{str: str}`` stored as the header's ``__metadata__``.
        data_alignment_bytes: where the tensors' data starts: at a multiple of this (a multiple of 8; the header
            padded with spaces, as the format allows). 4096 lets O_DIRECT write the tensors
            (:class:`~nvoffload.checkpoint_writer.EngineWriter`).
    """

    def __init__(
        self,
        path: str | os.PathLike,
        tensors_info: Mapping[str, tuple[torch.dtype, Sequence[int]]],
        metadata: Mapping[str, str] | None = None,
        *,
        data_alignment_bytes: int = _LENGTH_BYTES,
    ):
        if data_alignment_bytes < _LENGTH_BYTES or data_alignment_bytes % _LENGTH_BYTES:
            raise ValueError(f"data_alignment_bytes must be a positive multiple of 8, got {data_alignment_bytes!r}")
        self.path = os.fspath(path)
        self._layout = _plan(tensors_info)
        header = _encode_header(self._layout, metadata, data_alignment_bytes)
        self._data_start = _LENGTH_BYTES + len(header)
        self._written = dict.fromkeys(self._layout, 0)  # name -> elements written so far (write_slice: in order)
        self._done: set[str] = set()  # names written completely
        self.checksums: dict[str, int] = dict.fromkeys(self._layout, 0)  # name -> CRC-32C of its bytes so far
        self._file: AtomicFile | None = AtomicFile(self.path)
        try:
            with naming(self._file.tmp_path):
                _pwrite_all(self._file.fd, len(header).to_bytes(_LENGTH_BYTES, "little") + header, 0)
                os.ftruncate(self._file.fd, self._data_start + sum(info.nbytes for info, _ in self._layout.values()))
        except BaseException:
            self.abort()
            raise

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """Write tensor ``name``, whose dtype and shape must be those declared.

        Any device and memory layout: the bytes written are those of a
        contiguous CPU copy (made only when ``tensor`` is not one already).
        """
        info = self._check_write("write", name, tensor)
        if self._written[name] or name in self._done:
            raise ValueError(f"write({name!r}): the tensor was already written to {self.path}")
        if tuple(tensor.shape) != info.shape:
            raise ValueError(
                f"write({name!r}): got dtype {tensor.dtype} and shape {tuple(tensor.shape)}, "
                f"declared dtype {info.dtype} and shape {info.shape}"
            )
        self._put(name, 0, tensor)

    def write_slice(self, name: str, start: int, values: torch.Tensor) -> None:
        """Write ``values`` (any shape, the declared dtype) as elements ``start``, ``start + 1``, ... of tensor
        ``name``, flat and row-major: a tensor larger than memory, in parts. The parts of one tensor come in
        order, each starting where the last ended."""
        info = self._check_write("write_slice", name, values)
        numel = math.prod(info.shape)
        if start != self._written[name] or start + values.numel() > numel:
            raise ValueError(
                f"write_slice({name!r}): elements [{start}, {start + values.numel()}) of {numel}; the next part"
                f" must start at {self._written[name]}"
            )
        self._put(name, start, values)

    def _check_write(self, call: str, name: str, tensor: torch.Tensor) -> TensorInfo:
        if self._file is None:
            raise ValueError(f"{call}({name!r}): the writer of {self.path} is closed")
        if name not in self._layout:
            raise KeyError(f"{call}({name!r}): the tensor was not declared when {self.path} was opened")
        info = self._layout[name][0]
        if not isinstance(tensor, torch.Tensor) or tensor.layout != torch.strided:
            raise TypeError(f"{call}({name!r}): needs a dense torch.Tensor, got {type(tensor).__name__}")
        if tensor.dtype != info.dtype:
            raise ValueError(f"{call}({name!r}): got dtype {tensor.dtype}, declared dtype {info.dtype}")
        return info

    def _put(self, name: str, start: int, tensor: torch.Tensor) -> None:
        crc = 0
        if tensor.numel():
            data = tensor.detach().to("cpu").resolve_conj().resolve_neg().contiguous()
            with naming(self._file.tmp_path):
                _pwrite_all(self._file.fd, _bytes_of(data), self.data_offset(name) + start * data.element_size())
            crc = crc32c(data)
        self.placed(name, start, tensor.numel(), crc)

    @property
    def data_start(self) -> int:
        """Where in the file the tensors' data starts (a multiple of ``data_alignment_bytes``)."""
        return self._data_start

    @property
    def partial_path(self) -> str:
        """The hidden file being written (renamed to ``path`` by :meth:`close`)."""
        return self._file.tmp_path

    def data_offset(self, name: str) -> int:
        """Where in the file the bytes of tensor ``name`` start."""
        return self._data_start + self._layout[name][1]

    def placed(self, name: str, start: int, numel: int, crc: int) -> None:
        """Count elements ``[start, start + numel)`` of tensor ``name`` as written, with ``crc`` the CRC-32C of
        their bytes: for a caller that wrote them itself to :attr:`partial_path` at :meth:`data_offset` (the I/O
        engine's threads, O_DIRECT). The parts of one tensor come in order, as :meth:`write_slice`'s."""
        info = self._layout[name][0]
        if start != self._written[name]:
            raise ValueError(f"placed({name!r}): elements from {start}; the next part must start at {self._written[name]}")
        self.checksums[name] = crc32c_combine(self.checksums[name], crc, numel * info.dtype.itemsize)
        self._written[name] = start + numel
        if self._written[name] == math.prod(info.shape):
            self._done.add(name)

    def close(self) -> None:
        """Finish the file: check every tensor was written, fsync, and rename it to ``path``.

        Raises :class:`CheckpointError` (and removes the partial file) when a
        declared tensor was never written. Idempotent.
        """
        if self._file is None:
            return
        missing = sorted(set(self._layout) - self._done)
        if missing:
            self.abort()
            shown = ", ".join(map(repr, missing[:5])) + (", ..." if len(missing) > 5 else "")
            raise CheckpointError(self.path, f"closed before {len(missing)} declared tensor(s) were written: {shown}")
        file, self._file = self._file, None
        file.commit()

    def abort(self) -> None:
        """Give up: close and remove the partial file, leaving ``path`` untouched.

        Does nothing once the writer is closed or aborted.
        """
        if self._file is not None:
            self._file.abort()
            self._file = None

    def __enter__(self) -> SafetensorsWriter:
        return self

    def __exit__(self, exc_type, *exc) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()


# -- whole state dicts -----------------------------------------------------------


def save_file(
    tensors: Mapping[str, torch.Tensor], path: str | os.PathLike, metadata: Mapping[str, str] | None = None
) -> None:
    """Write ``tensors`` to the safetensors file ``path`` (atomically, see :class:`SafetensorsWriter`).

    Tensors sharing memory (tied weights) are written once per name.
    """
    for name, tensor in tensors.items():
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"save_file: {name!r} is a {type(tensor).__name__}, not a torch.Tensor")
    with SafetensorsWriter(path, {name: (t.dtype, t.shape) for name, t in tensors.items()}, metadata) as writer:
        for name, tensor in tensors.items():
            writer.write(name, tensor)


def load_file(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint (anything :func:`open_checkpoint` opens), as new CPU tensors."""
    with open_checkpoint(path) as reader:
        return {name: reader.read(name) for name in reader.keys()}
