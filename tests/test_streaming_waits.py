"""Who waits for the store's slow requests: never the training thread's hooks, never under the host cache's lock,
and never a copy compute waits for queued behind a write-back. A gate held shut by the test stands for a slow disk
(the real request runs; its future ends once the test opens the gate), so each wait is shown, not timed."""

from __future__ import annotations

import threading

import pytest
import torch
from torch import nn

from nvoffload.io import TensorStore
from nvoffload.streaming._blocks import partition
from nvoffload.streaming._host_cache import HostCache
from nvoffload.transfer import WAIT_LIMIT_S, Future, TransferEngine

STARTS_WITHIN_S = 30.0  # what a dispatcher thread that is free takes to start a chain's next step, with room to spare


class _Gated:
    """A store request held back until ``gate`` opens, as the one part of its future; records who waited for it,
    and refuses the main (training) thread's wait when ``main_may_wait`` is false."""

    def __init__(self, request: Future, gate: threading.Event, waiting: threading.Event, main_may_wait: bool):
        self.request, self.gate, self.waiting, self.main_may_wait = request, gate, waiting, main_may_wait

    def done(self) -> bool:
        return self.gate.is_set() and self.request.done()

    def wait(self, timeout_s: float) -> bool:
        if threading.current_thread() is threading.main_thread() and not (self.main_may_wait or self.gate.is_set()):
            raise AssertionError("the training thread waited for a store request behind the gate")
        self.waiting.set()
        if not self.gate.wait(timeout_s):
            return False
        self.request.exception(timeout_s)
        return True

    def error(self, what: str | None) -> BaseException | None:
        return self.request.exception(0)


def gate(store: TensorStore, method: str, *, main_may_wait: bool = True) -> tuple[threading.Event, threading.Event]:
    """Hold back every ``store.<method>`` request until the returned gate is set; the second event is set once
    someone waits for one."""
    shut, waiting, real = threading.Event(), threading.Event(), getattr(store, method)

    def gated(*args, **kw) -> Future:
        return Future([_Gated(real(*args, **kw), shut, waiting, main_may_wait)])

    setattr(store, method, gated)
    return shut, waiting


@pytest.fixture
def two_block_cache(tmp_path):
    """Three blocks (linear layers) in a host cache with room for two, on the CPU stand-in: the last two cached."""
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(32, 32) for _ in range(3)))
    blocks, _ = partition(model, list(model))
    block_bytes = -(-blocks[0].nbytes // 4096) * 4096
    engine = TransferEngine(2 * block_bytes, "cpu")
    store = TensorStore([tmp_path])
    cache = HostCache(store, engine, read_ahead_bytes=2 * block_bytes)
    for block in blocks:

        def fill(host, block=block):
            for j, p in enumerate(block.params):
                block.view(host, j).copy_(p.detach())

        cache.install(block, fill)
    yield cache, blocks, store
    cache.close()
    store.close()
    engine.close()


def params_of(block, host: torch.Tensor) -> list[torch.Tensor]:
    return [block.view(host, j).clone() for j in range(len(block.params))]


def test_pin_waits_for_the_store_outside_the_cache_lock(two_block_cache):
    """The optimizer's worker pinning a block the store is still reading waits without the cache's lock: the
    training thread's hooks (which take it every block) are not held up by that read."""
    cache, blocks, store = two_block_cache
    first = blocks[0]  # evicted when the third was installed: read from the store
    shut, waiting = gate(store, "get")
    pinned: list[torch.Tensor] = []
    worker = threading.Thread(target=lambda: pinned.append(cache.pin(first)), name="a stand-in optimizer worker")
    worker.start()
    try:
        assert waiting.wait(WAIT_LIMIT_S), "the pin never waited for its read"
        free = cache._lock.acquire(blocking=False)
        if free:
            cache._lock.release()
    finally:
        shut.set()
        worker.join(WAIT_LIMIT_S)
    assert free, "HostCache.pin held the cache's lock while it waited for the store"
    expected = [p.detach() for p in first.params]
    assert all(torch.equal(a, b) for a, b in zip(params_of(first, pinned[0]), expected))
    cache.unpin(first, modified=False)


def test_a_block_needing_room_from_a_changed_one_never_waits_for_its_write_back(two_block_cache):
    """A hook that needs a block's host copy while the least recently used cached block is changed does not write it
    back itself: the write-back goes to the transfer engine's write lane, and the room comes from a block that
    needs none; the changed block's new weights reach the store once its write lands."""
    cache, blocks, store = two_block_cache
    changed, clean, needed = blocks[1], blocks[2], blocks[0]
    host = cache.pin(changed)
    host.add_(1)  # its bytes change (whatever they mean)
    expected = host.clone()
    cache.unpin(changed, modified=True)
    cache.pin(clean)
    cache.unpin(clean, modified=False)  # least recently used: the changed block, then the clean one
    shut, _ = gate(store, "put", main_may_wait=False)
    try:
        host, loading = cache.pin_loading(needed)  # on the training thread, as a hook's copy to the device does
        if loading is not None:
            loading.result()
        assert all(torch.equal(a, p.detach()) for a, p in zip(params_of(needed, host), needed.params))
        cache.unpin(needed, modified=False)
    finally:
        shut.set()
    cache.flush()
    with cache.pinned(changed) as now:
        assert torch.equal(now, expected)
    written = torch.empty(changed.nbytes, dtype=torch.uint8)
    store.get(changed.name, out=written).result()
    assert torch.equal(written, expected)


def test_a_copy_compute_waits_for_is_not_queued_behind_a_write_back(tmp_path):
    """The dispatcher starts the copy of a read (a block's or an activation's load) while a write-back's store
    submit is stuck (waiting for an earlier write of its entry, or for room in the I/O queue): chains that compute
    waits for have a lane of their own."""
    with TensorStore([tmp_path]) as store, TransferEngine(1 << 20, "cpu") as engine:
        block = torch.arange(1024, dtype=torch.float32)
        store.put("block", block).result()
        staging = [engine.slab.allocate(block.numel() * 4, "staging").view(torch.float32) for _ in range(2)]
        stuck, entered, put = threading.Event(), threading.Event(), store.put

        def stuck_put(name, tensor):
            entered.set()
            stuck.wait(WAIT_LIMIT_S)
            return put(name, tensor)

        store.put = stuck_put
        saved = engine.save(store, "activation", torch.ones(1024), staging[0])
        try:
            assert entered.wait(WAIT_LIMIT_S), "the write-back's submit never started"
            dst = torch.zeros(1024)
            loaded = engine.load(store, "block", dst, staging[1])
            assert loaded.chain.wait_started(STARTS_WITHIN_S), "the read's copy was queued behind the write-back"
            engine.wait(loaded)
            assert torch.equal(dst, block)
        finally:
            stuck.set()
        saved.result()
        assert torch.equal(store.get("activation").result(), torch.ones(1024))
