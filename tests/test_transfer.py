"""The transfer engine: futures, the host slab, the stand-in's asynchronous copies, queues, NVMe<->device chains."""

import errno
import threading
import time

import pytest
import torch
from conftest import SCRIPT_PRELOAD, fork_server, mapping_size

import nvoffload.trace
from nvoffload.device import SimDevice
from nvoffload.io import StoreIOError, TensorStore
from nvoffload.memory import MemoryBudgetError
from nvoffload.transfer import Future, HostSlab, ReadAhead, TransferEngine, WriteBehind, relay


# ---------------------------------------------------------------------------- Future


def test_future_completed_failed_and_all_of():
    assert Future.completed(7).result() == 7
    boom = OSError(errno.EIO, "boom")
    with pytest.raises(OSError, match="boom"):
        Future.failed(boom).result()
    both = Future.all_of([Future.completed(1), Future.failed(boom), Future.completed(2)])
    assert both.done()
    with pytest.raises(OSError, match="boom"):
        both.result()
    assert both.exception() is boom  # the same error every time


def test_a_ctrl_c_during_a_wait_is_raised_not_returned_as_the_transfers_error():
    """Future.exception() returns the transfer's error; a KeyboardInterrupt that lands in this thread while it waits
    is raised (returned, a caller that records write errors swallowed the Ctrl-C and training went on)."""

    class Interrupted:
        def done(self):
            return False

        def wait(self, timeout_s):
            raise KeyboardInterrupt

        def error(self, what):
            return None

    future = Future([Interrupted()], what="a write")
    with pytest.raises(KeyboardInterrupt):
        future.exception()
    assert not future.done()
    failed = Future.failed(OSError(5, "EIO"))
    assert isinstance(failed.exception(), OSError)  # the transfer's own error is returned


def test_future_timeout_names_the_transfer_and_stays_pending():
    device = SimDevice(copy_delay_us=300_000)
    engine = TransferEngine(1 << 16, device)
    dst = torch.zeros(4)
    fut = engine.to_host(dst, torch.ones(4), what="the slow one")
    with pytest.raises(TimeoutError, match="the slow one still running"):
        fut.result(timeout=0.01)
    assert fut.result() is dst and torch.equal(dst, torch.ones(4))  # waited again: the copy landed
    engine.close()
    device.close()


# ---------------------------------------------------------------------------- the host slab


def test_slab_is_one_mapping_of_exactly_the_budget():
    budget = (3 << 20) + 12345
    slab = HostSlab(budget, "test budget")
    try:
        assert slab.capacity_bytes == budget - budget % 4096
        assert slab.address % 4096 == 0
        # The real allocation, read from the kernel's map of this process: within the budget.
        assert mapping_size(slab.address) <= budget
        a = slab.allocate(5000, "a")
        b = slab.allocate(70_000, "b")
        assert a.data_ptr() % 4096 == 0 and b.data_ptr() % 4096 == 0
        assert slab.address <= a.data_ptr() < slab.address + slab.capacity_bytes
        assert slab.used_bytes == 8192 + 73728
        slab.free(a)
        slab.free(b)
        assert slab.used_bytes == 0 and slab.peak_bytes == 8192 + 73728
    finally:
        slab.close()


def test_slab_refuses_with_a_message_naming_the_holders():
    slab = HostSlab(64 << 10, "the optimizer's staging")
    held = slab.allocate(48 << 10, "chunk 3")
    with pytest.raises(MemoryBudgetError, match=r"chunk 4 needs 32768 bytes of the optimizer's staging.*chunk 3: 49152"):
        slab.allocate(32 << 10, "chunk 4")
    with pytest.raises(MemoryBudgetError, match="more than its whole budget"):
        slab.allocate(1 << 20, "huge")
    with pytest.raises(ValueError, match="not allocated"):
        slab.free(torch.empty(4, dtype=torch.uint8))
    slab.free(held)
    slab.close()
    with pytest.raises(RuntimeError, match="closed"):
        slab.allocate(1, "late")


def test_slab_allocation_waits_for_another_thread_to_free():
    """The allocation waits until the other thread frees (the order checked, not a time: the suite runs loaded)."""
    slab = HostSlab(64 << 10, "staging")
    held = slab.allocate(64 << 10, "first")
    freeing = threading.Event()

    def free_later():
        time.sleep(0.05)  # most likely after allocate started waiting; either order must end in the allocation
        freeing.set()
        slab.free(held)

    threading.Thread(target=free_later).start()
    second = slab.allocate(32 << 10, "second", wait_s=10)
    assert freeing.is_set()  # it had no room before the free
    slab.free(second)
    slab.close()


def test_carved_slab_shares_the_parent_allocation():
    parent = HostSlab(1 << 20, "shared host budget")
    child = parent.carve(256 << 10, "activations")
    assert parent.used_bytes == 256 << 10
    buf = child.allocate(100, "x")
    assert parent.address <= buf.data_ptr() < parent.address + parent.capacity_bytes
    child.free(buf)
    child.close()
    assert parent.used_bytes == 0
    parent.close()


# ---------------------------------------------------------------------------- the stand-in's copies


def test_stand_in_copies_land_late_and_in_order():
    device = SimDevice(copy_delay_us=20_000)
    engine = TransferEngine(1 << 16, device)
    dst = torch.zeros(1000)
    issued = time.monotonic()
    first = engine.to_device(dst, torch.full((1000,), 1.0))
    second = engine.to_device(dst, torch.full((1000,), 2.0))
    # Nothing lands within the delay: a read here (a missing wait) sees the old contents. Seen landed, the delay
    # has passed by the time it was seen (a thread descheduled 20 ms under load may see it landed).
    landed = dst.sum().item() != 0.0 or first.done()
    assert not landed or time.monotonic() - issued >= 0.02
    engine.wait(second)
    assert time.monotonic() - issued >= 0.02
    assert first.done() and torch.equal(dst, torch.full((1000,), 2.0))  # the later copy landed last
    engine.close()
    device.close()


def test_stand_in_copy_reads_its_source_when_it_runs():
    """As on a GPU: a host buffer reused before its copy ran is what gets copied."""
    device = SimDevice(copy_delay_us=20_000)
    engine = TransferEngine(1 << 16, device)
    src, dst = torch.ones(10), torch.zeros(10)
    fut = engine.to_device(dst, src)
    src.fill_(5.0)  # the hazard a missing wait before reuse causes
    engine.wait(fut)
    assert torch.equal(dst, torch.full((10,), 5.0))
    engine.close()
    device.close()


def test_stand_in_rate_limits_copies():
    device = SimDevice(copy_gbps=0.1)  # 100 MB/s: 4 MB take 40 ms
    engine = TransferEngine(1 << 16, device)
    start = time.monotonic()
    fut = engine.to_host(torch.empty(1 << 20), torch.ones(1 << 20))
    fut.result()
    assert time.monotonic() - start >= 0.04
    engine.close()
    device.close()


def test_stand_in_trace_records_each_copy_and_version_bumps_at_issue():
    device = SimDevice(copy_delay_us=5_000, copy_gbps=1.0)
    engine = TransferEngine(1 << 16, device)
    dst = torch.zeros(1 << 18)
    version = dst._version
    with nvoffload.trace.tracing() as recorded:
        issued_s = (time.monotonic_ns() - recorded.start_ns) / 1e9
        fut = engine.to_device(dst, torch.ones(1 << 18), what="a block")
        assert dst._version == version + 1  # autograd sees the write when it is issued, as with CUDA's copy_
        engine.wait(fut)
    assert dst._version == version + 1 and dst.sum().item() == 1 << 18
    ((track, name, start, end, args),) = recorded.spans()
    assert (track, name, args) == ("h2d", "a block", {"bytes": 1 << 20})
    # 1 MiB at 1 GB/s takes 1 ms, and it lands no sooner than 5 ms after its issue
    assert issued_s + 0.004 <= start <= end and end - start >= 0.001
    engine.close()
    device.close()


def test_stand_in_copy_error_reaches_the_future():
    device = SimDevice()
    engine = TransferEngine(1 << 16, device)
    overlapping = torch.empty(1).expand(4)  # copy_ refuses to write one element four times
    fut = engine.to_host(overlapping, torch.ones(4), what="the bad copy")
    with pytest.raises(RuntimeError, match="single memory location"):
        fut.result()
    with pytest.raises(ValueError, match="shape"):
        engine.to_host(torch.empty(3), torch.ones(4))
    engine.close()
    device.close()


def test_environment_sets_the_stand_in_delay(monkeypatch):
    monkeypatch.setenv("NVOFFLOAD_SIM_COPY_DELAY_US", "1500")
    assert SimDevice().copy_delay_us == 1500
    monkeypatch.setenv("NVOFFLOAD_SIM_COPY_DELAY_US", "soon")
    with pytest.raises(ValueError, match="NVOFFLOAD_SIM_COPY_DELAY_US"):
        SimDevice()


# ---------------------------------------------------------------------------- queues


def test_write_behind_keeps_the_budget_and_every_error():
    flags, done = [], []

    def start(i):
        gate = threading.Event()
        flags.append(gate)
        fut = Future([_Gate(gate, OSError(errno.ENOSPC, f"disk full {i}") if i == 1 else None)])
        return fut

    wb = WriteBehind(200, "test writes")
    for i in range(2):
        wb.submit(100, lambda i=i: start(i), lambda err, i=i: done.append((i, err)))
    assert wb.in_flight_bytes == 200
    threading.Timer(0.05, lambda: [g.set() for g in flags]).start()
    wb.submit(100, lambda: start(2), lambda err: done.append((2, err)))  # waits for write 0
    assert [i for i, _ in done] == [0] and wb.in_flight_bytes == 200
    flags[2].set()
    with pytest.raises(OSError, match="disk full 1"):
        wb.drain()
    assert [(i, type(e).__name__ if e else None) for i, e in done] == [(0, None), (1, "OSError"), (2, None)]
    wb.drain()  # the error was reported once


def test_write_behind_waits_for_its_oldest_write_and_can_leave_errors_to_the_done_hooks():
    gates = [threading.Event() for _ in range(3)]
    done = []
    wb = WriteBehind(1000, "test writes", keep_errors=False)
    for i, gate in enumerate(gates):
        error = OSError(errno.EIO, f"write {i} failed") if i == 0 else None
        wb.submit(10, lambda gate=gate, error=error: Future([_Gate(gate, error)]), lambda err, i=i: done.append((i, err)))
    threading.Timer(0.05, gates[0].set).start()
    assert wb.wait_oldest() and [i for i, _ in done] == [0] and wb.in_flight_bytes == 20
    assert "write 0 failed" in str(done[0][1])
    for gate in gates[1:]:
        gate.set()
    wb.drain()  # the error went to its done hook only
    assert [i for i, _ in done] == [0, 1, 2] and not wb.wait_oldest()


def test_write_behind_waits_for_one_write_and_those_before_it_only():
    gates = [threading.Event() for _ in range(3)]
    done = []
    wb = WriteBehind(1000, "test writes", keep_errors=False)
    futures = [
        wb.submit(10, lambda gate=gate: Future([_Gate(gate)]), lambda err, i=i: done.append(i)) for i, gate in enumerate(gates)
    ]
    threading.Timer(0.05, lambda: [g.set() for g in gates[:2]]).start()
    assert wb.wait_for(futures[1]) and done == [0, 1] and wb.in_flight_bytes == 10  # the third stays in flight
    assert not wb.wait_for(futures[1]) and not wb.wait_for(Future.completed())  # reaped, or never submitted
    gates[2].set()
    assert wb.wait_for(futures[2]) and done == [0, 1, 2] and wb.in_flight_bytes == 0


def test_a_write_stuck_past_the_wait_limit_keeps_its_buffer(monkeypatch):
    """A write still running after NVOFFLOAD_WAIT_LIMIT_S raises TimeoutError and stays in flight: its done hook
    (which releases its buffer) does not run under the write, and runs once the write ends."""
    from nvoffload.core import future as future_module

    monkeypatch.setattr(future_module, "WAIT_LIMIT_S", 0.05)
    gate, done = threading.Event(), []
    wb = WriteBehind(100, "test writes")
    wb.submit(100, lambda: Future([_Gate(gate)]), done.append)
    with pytest.raises(TimeoutError, match="still running after 0.05 s"):
        wb.submit(100, lambda: Future.completed(), done.append)  # waits for the stuck write to make room
    assert done == [] and wb.in_flight_bytes == 100
    gate.set()
    wb.drain()
    assert done == [None] and wb.in_flight_bytes == 0


class _Gate:
    def __init__(self, gate, error=None):
        self.gate, self._error = gate, error

    def done(self):
        return self.gate.is_set()

    def wait(self, timeout_s):
        return self.gate.wait(timeout_s)

    def error(self, what):
        return self._error


def test_read_ahead_follows_the_plan_within_its_budget():
    started, dropped = [], []

    def start(key):
        started.append(key)
        return Future.completed(key), 10

    ra = ReadAhead(25, lambda key: 10, start, lambda key, fut: dropped.append(key))
    ra.plan(["a", "b", "c", "d"])
    ra.pump()
    assert started == ["a", "b"]  # a third would pass 25 bytes
    assert ra.take("a").result() == "a"
    ra.pump()
    assert started == ["a", "b", "c"]
    assert ra.take("x") is None
    ra.plan(["d", "c"])  # b is no longer wanted
    assert dropped == ["b"]
    ra.pump()
    assert started == ["a", "b", "c", "d"] and ra.waiting_bytes == 20
    ra.clear()
    assert sorted(dropped) == ["b", "c", "d"] and ra.waiting_bytes == 0


def test_read_ahead_keeps_what_the_caller_has_within_its_budget():
    """keep() counts data already where a read would bring it as a read started: taken or dropped like one, and
    only where pump() would start a read (budget 0: one at a time)."""
    dropped = []
    ra = ReadAhead(0, lambda key: 10, lambda key: (Future.completed(key), 10), lambda key, fut: dropped.append(key))
    assert ra.keep("a", Future.completed(), 10) and ra.waiting() == ["a"] and ra.waiting_bytes == 10
    assert not ra.keep("b", Future.completed(), 10)  # one read alone past the budget, not two
    assert not ra.keep("a", Future.completed(), 10)
    ra.plan(["a"])  # planned: kept, and not read again
    ra.pump()
    assert ra.waiting() == ["a"] and dropped == []
    ra.plan(["b"])
    assert dropped == ["a"]
    ra.pump()
    assert ra.waiting() == ["b"] and ra.take("b").result() == "b"
    assert ra.keep("c", Future.completed(), 10) and ra.take("c") is not None and ra.waiting_bytes == 0


def _later(work, delay_s: float) -> Future:
    """A future done once ``work()`` ran on a timer thread ``delay_s`` from now."""
    gate = threading.Event()
    threading.Timer(delay_s, lambda: (work(), gate.set())).start()
    return Future([_Gate(gate)])


def test_relay_reads_ahead_into_a_ring_and_reuses_a_buffer_only_once_its_writes_are_done():
    """Six items through a ring of three 4 KiB buffers (12 KiB in flight): each write sees its own item's read,
    no buffer is read into while a write from it runs, at most half the ring is read ahead of the writes, and the
    call returns with every write done."""
    busy: set[int] = set()  # buffers between their read and the end of the writes from them
    written, started, ahead, lock = [], [], [], threading.Lock()

    def read(item, buffer):
        started.append(item)
        with lock:
            assert buffer.data_ptr() not in busy, "a buffer read into while a write from it was running"
            busy.add(buffer.data_ptr())
        return _later(lambda: buffer.fill_(item), 0.005)

    def write(item, buffer):
        assert bool((buffer == item).all()), f"item {item}'s write saw {buffer[0].item()}"
        ahead.append(len(started) - 1 - item)  # reads started past this item's

        def land():
            with lock:
                written.append(item)
                busy.discard(buffer.data_ptr())

        return _later(land, 0.02)

    relay(list(range(6)), 4096, 3 * 4096, read, write)
    assert written == list(range(6)) and not busy
    assert ahead == [1, 1, 1, 1, 1, 0]  # one read ahead of each write: half the ring


def test_relay_raises_a_failed_read_and_a_ring_has_two_buffers_at_least():
    buffers = set()

    def read(item, buffer):
        buffers.add(buffer.data_ptr())
        return Future.failed(OSError(errno.EIO, f"read {item} failed")) if item == 3 else Future.completed()

    with pytest.raises(OSError, match="read 3 failed"):
        relay(list(range(5)), 4096, 1, read, lambda item, buffer: Future.completed())
    assert len(buffers) == 2
    relay([], 4096, 1, read, read)  # nothing to move


# ---------------------------------------------------------------------------- NVMe <-> device


@pytest.mark.parametrize("delay_us", [0, 2000])
def test_load_and_save_through_the_slab(tmp_path, delay_us):
    device = SimDevice(copy_delay_us=delay_us)
    with TensorStore(tmp_path) as store, TransferEngine(1 << 20, device) as engine:
        x = torch.randn(3000)
        staging = engine.slab.allocate(x.numel() * 4, "staging").view(torch.float32)
        engine.save(store, "x", x, staging).result()
        dst = torch.zeros(3000)
        fut = engine.load(store, "x", dst, staging)
        engine.wait(fut)
        assert torch.equal(dst, x)
        engine.slab.free(staging)
    device.close()


def test_load_reports_the_read_error_naming_the_tensor(tmp_path):
    device = SimDevice()
    with TensorStore(tmp_path) as store, TransferEngine(1 << 20, device) as engine:
        store.put("w", torch.ones(4096)).result()
        store.inject_fault("eio")
        staging = engine.slab.allocate(4096 * 4, "staging").view(torch.float32)
        dst = torch.zeros(4096)
        fut = engine.load(store, "w", dst, staging)
        with pytest.raises(StoreIOError, match="'w'"):
            engine.wait(fut)
        assert dst.sum().item() == 0  # nothing copied after a failed read
        engine.slab.free(staging)
    device.close()


def test_closed_engine_refuses_transfers():
    engine = TransferEngine(1 << 16, "cpu")
    engine.close()
    with pytest.raises(RuntimeError, match="closed"):
        engine.to_device(torch.empty(1), torch.empty(1), what="w")


# ---------------------------------------------------------------------------- CUDA


@pytest.mark.cuda
def test_cuda_copies_are_ordered_by_events():
    with TransferEngine(16 << 20, "cuda") as engine:
        host = engine.slab.allocate(4 << 20, "h").view(torch.float32)
        assert engine.slab.page_locked
        host.copy_(torch.arange(host.numel(), dtype=torch.float32))
        dev = torch.empty(host.numel(), device="cuda")
        fut = engine.to_device(dev, host)
        engine.wait(fut)  # the compute stream waits; the host does not
        doubled = dev * 2
        back = engine.slab.allocate(4 << 20, "b").view(torch.float32)
        engine.to_host(back, doubled).result()
        assert torch.equal(back, host * 2)
        engine.slab.free(host)
        engine.slab.free(back)


@pytest.mark.cuda
@pytest.mark.parametrize("use_gds", [False, pytest.param(True, marks=pytest.mark.gds)])
def test_cuda_load_and_save(tmp_path, use_gds):
    from nvoffload.io import IOConfig

    store = TensorStore(tmp_path, config=IOConfig(use_gds=use_gds), checksum=not use_gds)
    with store, TransferEngine(16 << 20, "cuda") as engine:
        x = torch.randn(1 << 20, device="cuda")
        staging = engine.slab.allocate(4 << 20, "s").view(torch.float32)
        y = x * 3  # produced on the compute stream just before the save
        if use_gds and not engine.direct(store, y):
            pytest.skip("kvikio is not installed, or in compatibility mode: no GPUDirect Storage here")
        engine.save(store, "y", y, staging).result()
        dst = torch.empty_like(y)
        engine.wait(engine.load(store, "y", dst, staging))
        assert torch.equal(dst, x * 3)
        engine.slab.free(staging)


_EXIT_WITH_COPIES_IN_FLIGHT = """
import torch
from nvoffload.device import SimDevice
from nvoffload.transfer import TransferEngine
engine = TransferEngine(1 << 20, SimDevice())
src = torch.ones(1 << 26)
dst = torch.empty(1 << 26)
futures = [engine.to_host(dst, src) for _ in range(16)]
"""


def test_a_script_that_exits_with_copies_in_flight_exits_cleanly():
    """At exit the workers finish their queued copies and are joined: a daemon thread still inside a torch copy when
    the interpreter finalized aborted the process ("terminate called without an active exception", exit 134; 5 runs
    in 6 before)."""
    for _ in range(3):  # python -c SCRIPT, forked from the session's server that imported torch and nvoffload once
        done = fork_server(SCRIPT_PRELOAD).run(f"-c {_EXIT_WITH_COPIES_IN_FLIGHT}", [], timeout=120)
        assert done.returncode == 0, done.stderr[-2000:]
