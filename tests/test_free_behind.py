"""Memory let go while a copy still uses it is freed behind that copy, never by a host wait of the thread that lets
it go (``nvoffload.transfer.FreeBehind``): the device residency's blocks, activation offload's reads back, the
optimizer's reads ahead. Each test holds the stand-in's host-to-device stream behind an event it completes itself,
so a copy is in flight for as long as the test says: on code that waits for the copy, the call under test returns
only once a fallback timer opens the stream, and the test sees the copy done."""

from __future__ import annotations

import torch

from nvoffload.activations import offload_activations
from nvoffload.io import TensorStore
from nvoffload.memory import MemoryManager
from nvoffload.models import GPT, GPTConfig
from nvoffload.streaming import ParameterStreamer
from nvoffload.transfer import FreeBehind, Future, TransferEngine

from held_streams import held_stream

def test_free_behind_runs_releases_once_their_transfers_are_done_without_waiting():
    with TransferEngine(1 << 20, "cpu") as engine:
        frees, released = FreeBehind("test buffers"), []
        with held_stream(engine) as gate:
            copy = engine.to_device(torch.empty(4), torch.ones(4))
            frees.free(copy, lambda: released.append("held"), 16)
            frees.free(Future.completed(), lambda: released.append("done"))
            assert released == ["done"] and frees.pending_bytes == 16 and not gate.query()
            assert frees.reap() == 0 and released == ["done"]
        assert frees.wait_oldest() and released == ["done", "held"] and frees.pending_bytes == 0
        assert not frees.wait_oldest()


def test_a_block_dropped_while_its_copy_runs_is_freed_behind_the_copy(tmp_path):
    """The residency's staged block let go before its copy landed: the training thread does not wait, and the
    block's device storage, its device bytes and its pinned host copy stay until the copy ended."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=128, seq_len=16, n_layer=2, n_head=2, d_model=32))
    store = TensorStore([tmp_path])
    memory = MemoryManager(device_memory_bytes=64 << 20, cpu_memory_bytes=4 << 20)
    streamer = ParameterStreamer(model, store, memory, device="cpu")
    residency, block = streamer._residency, streamer._blocks[0]
    storage = block.params[0].untyped_storage()
    try:
        used = memory.stats()["device"].used_bytes
        with held_stream(streamer.transfer) as gate:
            residency.stage(block)
            copy = residency._copies[block]
            assert memory.stats()["device"].used_bytes == used + block.nbytes
            residency.stage(None)  # lets it go: returns while the copy is held
            assert not gate.query() and not copy.done()
            assert storage.nbytes() == block.nbytes and memory.stats()["device"].used_bytes == used + block.nbytes
            assert streamer.cache._lru[block].pins == 1
        copy.result()
        residency.stage(None)  # the next call reaps it
        assert storage.nbytes() == 0 and memory.stats()["device"].used_bytes == used
        assert streamer.cache._lru[block].pins == 0
        x = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
        model(x, x).backward()  # and the block comes back as before
    finally:
        streamer.close()
        store.close()


def offloaded_mlp(engine: TransferEngine):
    """A forward of a small MLP whose saved tensors go to host memory through ``engine``: the loss and the context."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU()) for _ in range(4)))
    offload = offload_activations(target="cpu", min_bytes=1024, keep_recent_bytes=0, transfer=engine,
                                  max_pending_write_bytes=1 << 30)  # fmt: skip
    with offload:
        loss = model(torch.randn(32, 64)).square().mean()
    return loss, offload


def test_a_saved_tensor_released_while_its_write_runs_is_freed_behind_the_write():
    """A graph freed while its saved tensors are still being written (forward without backward): releasing them
    does not wait for the writes; their host buffers and originals stay counted until the writes ended."""
    with TransferEngine(8 << 20, "cpu") as engine:
        with held_stream(engine, "d2h") as gate:
            loss, offload = offloaded_mlp(engine)
            written = offload.stats().offloaded_bytes
            assert written > 0
            del loss  # releases every saved tensor
            assert not gate.query() and offload.stats().live_records == 0
            assert offload.stats().offloaded_bytes == written and engine.slab.used_bytes >= written
        with offload._locked():
            offload._writes.drain()
        stats = offload.stats()
        assert stats.offloaded_bytes == 0 and stats.resident_bytes == 0 and engine.slab.used_bytes == 0
        offload.close()


def test_a_read_ahead_dropped_while_its_copy_runs_is_freed_behind_the_copy():
    """Backward's read-ahead made again (new writes, a new pass) drops the reads it started and no longer plans:
    the training thread does not wait for their copies; their device tensors stay counted until the copies ended."""
    with TransferEngine(8 << 20, "cpu") as engine:
        loss, offload = offloaded_mlp(engine)
        with offload._locked():
            offload._writes.drain()
        handles = list(offload._records)
        with held_stream(engine) as gate:
            with offload._locked():
                offload._read_ahead_of(handles[-1] + 1)  # as unpacking a tensor saved after them would
                reading = [r for r in offload._records.values() if r.load is not None]
                copies = [r.load.future for r in reading]
            assert reading and offload.stats().resident_bytes == sum(r.nbytes for r in reading)
            with offload._locked():
                offload._plan_stale = True
                offload._read_ahead_of(handles[-1] + 1)  # made again: the reads in flight are not in it
            assert not gate.query() and not any(copy.done() for copy in copies)
            assert all(r.load is None for r in reading)  # dropped
            assert offload.stats().resident_bytes == sum(r.nbytes for r in reading)
        offload._tier.frees.drain()
        assert offload.stats().resident_bytes == 0
        del loss
        offload.close()
