"""The training thread's work per streamed block: what the streamer's hooks add to each block's call and gradient,
and what they leave to other threads (bench/bench_overlap.py --host-profile measures the time)."""

from __future__ import annotations

import importlib
import threading
import time
import weakref
from pathlib import Path

import torch

from nvoffload.io import TensorStore
from nvoffload.memory import MemoryManager
from nvoffload.models import GPT, GPTConfig
from nvoffload.streaming import ParameterStreamer

MiB = 1 << 20


def streamed_gpt(tmp_path, *, n_layer: int = 2, host_blocks: int = 8, tight: bool = False):
    """A small GPT streamed on the stand-in, with host memory for ``host_blocks`` of its blocks, and device memory
    for plenty, or (``tight``) for the least streaming takes: twice the resident parameters and 3 blocks."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=128, seq_len=16, n_layer=n_layer, n_head=2, d_model=32))
    block = sum(p.numel() * 4 for p in model.blocks[0].parameters())
    resident = sum(p.numel() * 4 for n, p in model.named_parameters() if not n.startswith("blocks."))
    store = TensorStore([tmp_path])
    memory = MemoryManager(
        device_memory_bytes=2 * resident + 3 * block if tight else 64 * MiB,
        cpu_memory_bytes=host_blocks * (-(-block // 4096) * 4096),
    )  # fmt: skip
    x = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    return model, store, memory, ParameterStreamer(model, store, memory, device="cpu"), x


def graph_nodes(root) -> set[str]:
    """The names of the autograd nodes ``root`` reaches."""
    seen, todo, names = set(), [root], set()
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        names.add(type(node).__name__)
        todo.extend(n for n, _ in node.next_functions)
    return names


def test_a_block_call_adds_no_autograd_function_around_its_inputs_and_outputs(tmp_path):
    """The streamer learns that a call's output gradient is ready and that its inputs' are from hooks on the
    call's own graph, not from the identity functions of a full backward hook (a Python autograd function on
    each side of every call, forward and backward); its blocks are still held and let go in backward."""
    model, store, _, streamer, x = streamed_gpt(tmp_path)
    try:
        loss = model(x, x)
        assert "BackwardHookFunctionBackward" not in graph_nodes(loss.grad_fn)
        loss.backward()
        assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in model.blocks.parameters())
        assert all(p.untyped_storage().nbytes() == 0 for p in model.blocks.parameters())
    finally:
        streamer.close()
        store.close()


def test_the_block_inputs_are_freed_by_backward_while_the_loss_is_still_held(tmp_path):
    """A loop keeps its ``loss`` (and so the graph's nodes, with the hooks the streamer set on them) until the next
    step: the hooks must not keep the blocks' inputs (activations on the device) alive that long."""
    model, store, _, streamer, x = streamed_gpt(tmp_path, n_layer=3)
    inputs = []
    handles = [b.register_forward_pre_hook(lambda _, args: inputs.append(weakref.ref(args[0]))) for b in model.blocks]
    try:
        loss = model(x, x)
        loss.backward()
        assert len(inputs) == 3 and loss.grad_fn is not None
        assert [ref() is None for ref in inputs] == [True] * 3
    finally:
        for h in handles:
            h.remove()
        streamer.close()
        store.close()


def test_gradients_are_counted_without_a_finalizer_each(tmp_path):
    """Each gradient is counted in the device budget until it is freed through a record of its own (a weak
    reference with a callback), not a ``weakref.finalize`` per gradient (a global registry entry each)."""
    model, store, memory, streamer, x = streamed_gpt(tmp_path)
    try:
        resident = memory.stats()["device"].used_bytes
        finalizers = len(weakref.finalize._registry)
        model(x, x).backward()
        assert len(weakref.finalize._registry) == finalizers
        grads = sum(p.grad.numel() * 4 for p in model.parameters())
        assert memory.stats()["device"].used_bytes == resident + grads
        model.zero_grad()
        assert memory.stats()["device"].used_bytes == resident
    finally:
        streamer.close()
        store.close()


def test_a_write_back_started_by_a_hook_runs_off_the_training_thread(tmp_path):
    """A changed block that a forward's read-ahead evicts is written back from the transfer engine's thread, not
    from the hook that evicts it (a submit may wait for an earlier write of the block, for room in the I/O queue);
    the store then holds its new weights."""
    model, store, _, streamer, x = streamed_gpt(tmp_path, n_layer=6, host_blocks=3)
    try:
        first = model.blocks[0].qkv.weight
        weights = streamer.weights.acquire(first)
        weights.add_(1.0)
        expected = weights.clone()
        streamer.weights.release(first, modified=True)
        puts, put = [], store.put

        def recording_put(name, tensor, **kw):
            puts.append((name, threading.current_thread()))
            return put(name, tensor, **kw)

        store.put = recording_put
        with torch.no_grad():
            model(x)
        written = [thread for name, thread in puts if name == "stream.block0"]
        assert written and threading.main_thread() not in written
        torch.testing.assert_close(streamer.weights.gather(first).view(-1), expected, rtol=0, atol=0)
    finally:
        streamer.close()
        store.close()


def test_blocks_are_read_ahead_in_the_order_of_each_pass_as_far_as_the_budget_goes(tmp_path):
    """Forward reads the blocks it needs in order, backward in reverse, each once; when a block begins, nothing
    was read beyond the next block (copied to the device next) and ``prefetch_blocks`` (1) after it."""
    model, store, _, streamer, x = streamed_gpt(tmp_path, n_layer=6, host_blocks=4)
    try:
        reads, get = [], store.get

        def recording_get(name, **kw):
            reads.append(int(name.removeprefix("stream.block")))
            return get(name, **kw)

        store.get = recording_get
        began = []  # (block, the furthest block read) as each block's forward begins, after the streamer's pre-hook
        for i, block in enumerate(model.blocks):
            block.register_forward_pre_hook(lambda m, args, i=i: began.append((i, max(reads, default=-1))))
        loss = model(x, x)
        assert reads == sorted(set(reads)) and len(reads) >= 2
        assert began and all(furthest <= i + 2 for i, furthest in began)
        reads.clear()
        loss.backward()
        assert reads == sorted(set(reads), reverse=True) and len(reads) >= 2
    finally:
        streamer.close()
        store.close()


def test_a_block_waiting_for_device_memory_wakes_as_gradients_are_freed_not_on_a_timer(tmp_path):
    """Backward short of device memory while the optimizer holds the gradients it took waits for them: woken by
    each gradient freed, it checks what is pending once before the first, not every half second (it polled)."""
    model, store, _, streamer, x = streamed_gpt(tmp_path, n_layer=4, tight=True)
    taken, freed_at = [], []  # the gradients the stand-in optimizer holds; when it freed them

    def take(p):  # after the streamer's hook: the optimizer takes the gradient, frees it once the timer fired
        if not freed_at:
            taken.append(p.grad)
        p.grad = None

    def free():
        freed_at.append(time.perf_counter())
        taken.clear()

    for p in model.parameters():
        p.register_post_accumulate_grad_hook(take)
    ledger = streamer._residency.gradients
    checks, queued_bytes = [], ledger.queued_bytes
    ledger.queued_bytes = lambda: (checks.append(time.perf_counter()), queued_bytes())[1]
    timer = threading.Timer(1.6, free)
    try:
        loss = model(x, x)
        timer.start()
        loss.backward()
        assert freed_at and streamer.stats().grad_wait_s > 1.0  # it waited for the gradients
        assert len([t for t in checks if t < freed_at[0]]) == 1
    finally:
        timer.cancel()
        streamer.close()
        store.close()


def test_bench_overlap_host_profile_quick(tmp_path, monkeypatch):
    """Smoke run of ``bench/bench_overlap.py --host-profile``: the streamer's host time per block pass, its top
    costs, and the streamed step over the compute step."""
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "bench"))
    bench = importlib.import_module("bench_overlap")
    runs = bench.main(["--quick", "--device", "cpu", "--host-profile", "--repeats", "1", "--results-dir", str(tmp_path)])
    run = runs["this"]
    assert 0 < run["host_ms_per_block_pass"] < run["profiled_step_ms_per_block_pass"]
    assert run["top_ms_per_block_pass"] and run["streamed/compute_cpu"] > 0
    assert (tmp_path / "bench_overlap_host_time.json").exists()
