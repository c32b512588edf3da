"""Device tensors to and from NVMe through the transfer engine (the store is host-side), on the CPU stand-in.

Through a slab buffer and the copy streams: the stand-in's copies land late, so a write issued before its copy
landed, or a copy issued before its read, moves stale bytes. By GPUDirect Storage (a stand-in cuFile here): the
dispatcher starts the transfer once the event is reached, and the caller does not wait for it.
"""

import os
import sys
import types

import pytest
import torch

from nvoffload.device import SimDevice
from nvoffload.io import StoreIOError, TensorStore
from nvoffload.transfer import TransferEngine, gds

from held_streams import held_stream

KiB = 1 << 10


@pytest.fixture
def late():
    device = SimDevice(copy_delay_us=3000)  # every stand-in copy lands 3 ms late
    yield device
    device.close()


@pytest.mark.parametrize("checksum", [True, False], ids=["crc", "plain"])
def test_a_tensor_round_trips_through_the_slab_and_late_copies(tmp_path, late, checksum):
    with TensorStore(tmp_path, checksum=checksum) as store, TransferEngine(256 * KiB, late) as engine:
        src = torch.randint(0, 256, (45_001,), dtype=torch.uint8)  # not a multiple of 4 KiB: a padded extent
        staging = engine.slab.allocate(src.numel(), "staging")
        engine.save(store, "x", src, staging).result()
        assert torch.equal(store.get("x").result(), src)  # written once its copy landed (and its CRC verified)
        dst = torch.zeros_like(src)
        engine.wait(engine.load(store, "x", dst, staging))
        assert torch.equal(dst, src)
        engine.slab.free(staging)


def test_a_failed_write_fails_the_save_naming_the_tensor_and_gives_its_space_back(tmp_path, late):
    with TensorStore(tmp_path) as store, TransferEngine(256 * KiB, late) as engine:
        src = torch.ones(40 * KiB, dtype=torch.uint8)
        staging = engine.slab.allocate(src.numel(), "staging")
        store.inject_fault("enospc")
        with pytest.raises(StoreIOError, match="'x'"):
            engine.save(store, "x", src, staging).result()
        assert "x" not in store and store.used_bytes == 0
        engine.save(store, "x", src, staging).result()  # the slab buffer and the extents are free again
        assert torch.equal(store.get("x").result(), src)
        engine.slab.free(staging)


def test_without_gds_a_staging_buffer_is_needed(tmp_path, late):
    with TensorStore(tmp_path) as store, TransferEngine(256 * KiB, late) as engine:
        with pytest.raises(ValueError, match=r"save\('x'\): a host staging buffer .* is needed"):
            engine.save(store, "x", torch.ones(10), None)
        store.put("x", torch.ones(10)).result()
        with pytest.raises(ValueError, match=r"load\('x'\): a host staging buffer .* is needed"):
            engine.load(store, "x", torch.empty(10), None)


class _FileIO:
    """A stand-in for kvikio's CuFile: buffered pread/pwrite of a (CPU) buffer, done at submit."""

    opened: list[str] = []
    closed: list[str] = []

    def __init__(self, path: str):
        self._fd = os.open(path, os.O_RDWR)
        self._path = path
        _FileIO.opened.append(path)

    def submit(self, buffer: torch.Tensor, offset: int, *, write: bool):
        view = memoryview(buffer.numpy()).cast("B")
        if write:
            assert os.pwrite(self._fd, view, offset) == len(view)
        else:
            assert os.preadv(self._fd, [view], offset) == len(view)
        return _Done()

    def close(self) -> None:
        os.close(self._fd)
        _FileIO.closed.append(self._path)


class _Done:
    def done(self) -> bool:
        return True

    def wait(self, timeout_s: float) -> bool:
        return True

    def error(self):
        return None


def test_gds_transfers_start_at_their_event_without_the_caller_waiting(tmp_path, late, monkeypatch):
    """By GPUDirect Storage kvikio reads and writes device memory outside stream order: the put and get waited on the
    host for the GPU on every request. Now the engine's dispatcher waits for the event; the caller returns at once."""
    monkeypatch.setattr(TransferEngine, "direct", lambda self, store, tensor: True)
    monkeypatch.setattr("nvoffload.transfer.engine.GDSFile", _FileIO)
    _FileIO.opened = []
    with TensorStore(tmp_path, checksum=False) as store, TransferEngine(256 * KiB, late) as engine:
        src = torch.zeros(3000)  # "device" memory of the stand-in
        with held_stream(engine) as gate:
            filled = engine.to_device(src, torch.full((3000,), 7.0))  # lands once the block ends
            saved = engine.save(store, "x", src, None, after=filled.event)
            assert not filled.done() and not gate.query()  # save did not wait for the copy on the host
        saved.result()
        assert torch.equal(store.get("x").result(), torch.full((3000,), 7.0))  # written after the copy landed

        dst = torch.full((3000,), 3.0)
        seen = torch.zeros(3000)
        with held_stream(engine, "d2h") as gate:
            read_old = late.copy_stream("d2h").copy(seen, dst, late.record(), "seen")  # reads dst once the block ends
            loaded = engine.load(store, "x", dst, None, after=read_old)
            assert not read_old.query() and not gate.query()  # load did not wait for it on the host
        engine.wait(loaded)
        assert torch.equal(seen, torch.full((3000,), 3.0))  # the read did not overtake the copy reading dst
        assert torch.equal(dst, torch.full((3000,), 7.0))
        assert _FileIO.opened == store.swap_files  # one cuFile handle per swap file, kept by the engine


def _open_fds_to(paths: list[str]) -> list[str]:
    """The paths among ``paths`` (removed or not) that a descriptor of this process still holds open."""
    held = [os.readlink(f"/proc/self/fd/{fd}").removesuffix(" (deleted)") for fd in os.listdir("/proc/self/fd")
            if os.path.exists(f"/proc/self/fd/{fd}") or os.path.islink(f"/proc/self/fd/{fd}")]  # fmt: skip
    return [p for p in paths if p in held]


def test_a_closed_stores_cufile_handles_close_with_it_while_the_engine_stays_open(tmp_path, late, monkeypatch):
    """The engine opened a cuFile handle per swap file and closed them only when it closed: a closed store's
    removed swap files kept their disk space while the engine (a session's, or a shared one) lived on."""
    monkeypatch.setattr(TransferEngine, "direct", lambda self, store, tensor: True)
    monkeypatch.setattr("nvoffload.transfer.engine.GDSFile", _FileIO)
    _FileIO.opened, _FileIO.closed = [], []
    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    with TransferEngine(256 * KiB, late) as engine:
        stores = [TensorStore(tmp_path / d, checksum=False) for d in ("a", "b")]
        for store in stores:
            engine.save(store, "x", torch.full((3000,), 5.0), None).result()
            dst = torch.zeros(3000)
            engine.wait(engine.load(store, "x", dst, None))
            assert torch.equal(dst, torch.full((3000,), 5.0))
        first, second = (store.swap_files for store in stores)
        assert sorted(_FileIO.opened) == sorted(first + second)  # one handle per swap file, reused for the read
        stores[0].close()
        assert sorted(_FileIO.closed) == sorted(first)  # the other store's handles stay open for its transfers
        assert _open_fds_to(first) == [] and not any(os.path.exists(p) for p in first)  # removed, space freed
        engine.save(stores[1], "y", torch.ones(100), None).result()  # still served by its open handles
        assert torch.equal(stores[1].get("y").result(), torch.ones(100))
        stores[1].close()
        assert sorted(_FileIO.closed) == sorted(first + second)
    assert sorted(_FileIO.closed) == sorted(first + second)  # the engine's close closes none twice


def test_the_store_refuses_gds_transfers_it_would_checksum(tmp_path):
    with TensorStore(tmp_path) as store:
        with pytest.raises(ValueError, match=r"put_by\('x'\): this TensorStore checksums its tensors in host memory"):
            store.put_by("x", torch.ones(10), lambda *args: _Done())
        assert "x" not in store


# ---------------------------------------------------------------------------- when GDS is used


def _kvikio(monkeypatch, defaults) -> None:
    monkeypatch.setattr("nvoffload.device.cuda_available", lambda: True)
    monkeypatch.setitem(sys.modules, "kvikio", types.SimpleNamespace(defaults=defaults))
    gds.gds_available.cache_clear()


@pytest.fixture(autouse=True)
def _fresh_probe():
    yield
    gds.gds_available.cache_clear()


class _Mode:
    def __init__(self, name: str):
        self.name = name


@pytest.mark.parametrize(
    ("defaults", "used"),
    [
        (types.SimpleNamespace(is_compat_mode_preferred=lambda: True), False),  # kvikio 24.12+
        (types.SimpleNamespace(is_compat_mode_preferred=lambda: False), True),
        (types.SimpleNamespace(compat_mode=lambda: True), False),  # before 24.12: a bool
        (types.SimpleNamespace(compat_mode=lambda: False), True),
        (types.SimpleNamespace(compat_mode=lambda: _Mode("ON")), False),  # the CompatMode enum
        (types.SimpleNamespace(compat_mode=lambda: _Mode("AUTO")), False),  # unresolved: the sure path
        (types.SimpleNamespace(compat_mode=lambda: _Mode("OFF")), True),
    ],
    ids=["preferred-on", "preferred-off", "bool-on", "bool-off", "enum-on", "enum-auto", "enum-off"],
)
def test_gds_is_used_only_where_kvikio_is_not_in_compatibility_mode(monkeypatch, defaults, used):
    """kvikio in compatibility mode moves the bytes by POSIX I/O, slower than the native path; GDS was used wherever
    kvikio imported."""
    _kvikio(monkeypatch, defaults)
    assert gds.gds_available() is used


def test_gds_is_not_used_without_kvikio(monkeypatch):
    monkeypatch.setattr("nvoffload.device.cuda_available", lambda: True)
    monkeypatch.setitem(sys.modules, "kvikio", None)  # import kvikio raises ImportError
    gds.gds_available.cache_clear()
    assert gds.gds_available() is False
