"""Activation offload: gradients equal the plain model's, swap space comes back, errors are clear."""

import contextlib
import doctest
import gc
import importlib
import os
import time

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from nvoffload.activations import ActivationOffloadConfig, SavedTensorCounter, offload_activations
from nvoffload.device import SimDevice
from nvoffload.memory import MemoryBudgetError
from nvoffload.models.gpt import GPT, GPTConfig
from nvoffload.transfer import ReadAhead, TransferEngine, WriteBehind

from conftest import DEVICES

TARGETS = ["cpu", "nvme"]
# "spill": NVMe, with the first SPILL_RESIDENT_BYTES of the tensors kept in host memory (about 40% of the tiny GPT's)
WITH_SPILL = [*TARGETS, "spill"]
SPILL_RESIDENT_BYTES = 1 << 20


class CNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.c1 = nn.Conv2d(3, 16, 3, padding=1)
        self.bn = nn.BatchNorm2d(16)
        self.c2 = nn.Conv2d(16, 32, 3, padding=1)
        self.fc = nn.Linear(32 * 8 * 8, 10)

    def forward(self, x, y):
        x = F.max_pool2d(F.relu(self.bn(self.c1(x))), 2)
        x = F.max_pool2d(F.gelu(self.c2(x)), 2)
        return F.cross_entropy(self.fc(x.flatten(1)), y)


class ViewsInplace(nn.Module):
    """Views, transposes, strided slices, expands and in-place ops on saved tensors' neighbours."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(64, 192)
        self.b = nn.Linear(64, 64)

    def forward(self, x, y):
        h = self.a(x)  # (n, 192)
        q, k, v = h.split(64, dim=1)  # strided views of one storage
        s = (q * k).sigmoid()  # saves q and k (non-dense views)
        t = v.t().contiguous().t()  # dense, transposed strides
        u = s * t
        u.relu_()  # in place on a non-saved intermediate
        w = self.b(u)
        w = w.view(-1, 8, 8).transpose(1, 2)  # saved as a transposed view by bmm below
        z = torch.bmm(w, w)
        z = z + h[:, ::3].view(-1, 8, 8)  # strided slice
        z.mul_(0.5)
        e = z.exp()  # exp saves its output
        return (e * e.mean(0, keepdim=True).expand_as(e)).mean() + F.mse_loss(z.flatten(1), y)


def make_case(name):
    torch.manual_seed(0)
    if name == "gpt":
        model = GPT(GPTConfig.preset("tiny"))
        inputs = (torch.randint(0, 256, (4, 64)), torch.randint(0, 256, (4, 64)))
    elif name == "cnn":
        model = CNN()
        inputs = (torch.randn(8, 3, 32, 32), torch.randint(0, 10, (8,)))
    else:
        model = ViewsInplace()
        inputs = (torch.randn(256, 64), torch.randn(256, 64))
    return model, inputs


def step(model, inputs, ctx=None):
    model.zero_grad(set_to_none=True)
    if ctx is None:
        loss = model(*inputs)
    else:
        with ctx:
            loss = model(*inputs)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def assert_same(ref, got):
    assert torch.equal(ref[0], got[0]), (ref[0], got[0])
    for name, g in ref[1].items():
        assert torch.equal(g, got[1][name]), f"gradient of {name} differs"


def make_offload(target, tmp_path, **kw):
    kw.setdefault("min_bytes", 1024)
    if "transfer" not in kw:
        kw.setdefault("host_memory_bytes", 64 << 20)  # page-locked with CUDA: not a quarter of the machine per test
    if target == "spill":
        kw.setdefault("host_resident_bytes", SPILL_RESIDENT_BYTES)
    if target in ("nvme", "spill"):
        return offload_activations(tmp_path, **kw)
    return offload_activations(target="cpu", **kw)


def wait_for_writes(*offloads):
    """Wait until every write the contexts have in flight has ended. Under load a write can stay in flight
    through forward and whole backward passes (NVOFFLOAD_SIM_COPY_DELAY_US=1500000 does it every time): a
    test that asserts on what is in the store, or on reads, waits here instead of assuming a speed."""
    for offload in offloads:
        for record in list(offload._records.values()):
            if record.write is not None:
                record.write.future.result(timeout=60)


def assert_released(offload, graph_alive=False):
    """Swap space free; with the graph freed, nothing held in memory either.

    While a graph is alive its small tensors (left in place) still count as resident. What a released tensor
    held goes once its transfers ended (no host wait where it is released): waited for here first.
    """
    with offload._locked():
        offload._writes.drain()
        if offload._tier is not None:
            offload._tier.frees.drain()
    stats = offload.stats()
    assert stats.offloaded_bytes == 0
    assert stats.live_records == 0
    assert graph_alive or stats.resident_bytes == 0
    assert offload._tier is None or offload._tier.slab.used_bytes == offload._tier.host_bytes == 0  # every buffer back


SETTINGS = {
    "all-out-no-prefetch": dict(keep_recent_bytes=0, prefetch_bytes=0),
    "all-out-prefetch": dict(keep_recent_bytes=0, prefetch_bytes=1 << 30),
    "all-out-written-first": dict(keep_recent_bytes=0, prefetch_bytes=1 << 30, max_pending_write_bytes=0),
    "forwarding": dict(keep_recent_bytes=300_000, prefetch_bytes=200_000),
}


@pytest.mark.parametrize("target", WITH_SPILL)
@pytest.mark.parametrize("settings", list(SETTINGS))
@pytest.mark.parametrize("case", ["gpt", "cnn", "views"])
def test_gradients_bitwise_equal(case, settings, target, tmp_path):
    model, inputs = make_case(case)
    BN_STATE = {k: v.clone() for k, v in model.state_dict().items()}
    ref = step(model, inputs)
    model.load_state_dict(BN_STATE)  # batch norm running stats: same start
    offload = make_offload(target, tmp_path, **SETTINGS[settings])
    got = step(model, inputs, offload)
    assert_same(ref, got)
    stats = offload.stats()
    assert stats.bytes_written > 0
    assert stats.peak_offloaded_bytes > 0
    # Every offloaded tensor is read back once, or used from memory because its
    # write was still in flight when backward (or its read-ahead) reached it.
    assert stats.bytes_read <= stats.bytes_written
    assert stats.reads_prefetched + stats.reads_avoided <= stats.tensors_written
    if settings == "all-out-no-prefetch":
        assert stats.tensors_forwarded == 0 and stats.reads_prefetched == 0
    if settings == "all-out-written-first":  # each write done before the next save: nothing in flight
        assert stats.reads_avoided == 0 and stats.bytes_read == stats.bytes_written and stats.reads_prefetched > 0
    if settings == "forwarding":
        assert stats.tensors_forwarded > 0
    kept = {"cpu": stats.bytes_written, "nvme": 0}.get(target)
    assert stats.host_bytes_written == kept if kept is not None else 0 < stats.host_bytes_written <= SPILL_RESIDENT_BYTES
    assert_released(offload)


@pytest.mark.parametrize("case", ["gpt", "views"])
def test_spilling_keeps_in_host_memory_what_fits_and_writes_only_the_rest_to_nvme(case, tmp_path):
    """host_resident_bytes: the tensors are kept in host memory while they fit in it, the others go to the
    store; backward reads each from where it is, and the gradients are the plain model's."""
    from nvoffload.io import TensorStore

    model, inputs = make_case(case)
    ref = step(model, inputs)
    all_out = make_offload("nvme", tmp_path, keep_recent_bytes=0)
    step(model, inputs, all_out)
    total = all_out.stats().bytes_written
    assert all_out.stats().host_bytes_written == 0
    (tmp_path / "store").mkdir()
    with TensorStore(str(tmp_path / "store")) as store:
        offload = offload_activations(store, min_bytes=1024, keep_recent_bytes=0, host_memory_bytes=64 << 20,
                                      host_resident_bytes=total // 2)  # fmt: skip
        model.zero_grad(set_to_none=True)
        with offload:
            loss = model(*inputs)
        wait_for_writes(offload)
        stats = offload.stats()
        kept, spilled = stats.host_bytes_written, total - stats.host_bytes_written
        assert stats.bytes_written == total and total // 4 < kept <= total // 2  # the first half, as far as it fits
        assert offload._tier.host_bytes == kept
        assert spilled <= store.used_bytes < spilled + 4096 * stats.tensors_written  # only the rest in the store
        loss.backward()
        assert store.used_bytes == 0
        got = (loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()})
        assert_same(ref, got)
        assert offload.stats().bytes_read == total  # each read back once, from where it was
        assert_released(offload)


@pytest.mark.parametrize("target", WITH_SPILL)
def test_peak_resident_below_plain_saved_tensors(target, tmp_path):
    model, inputs = make_case("gpt")
    counter = SavedTensorCounter()
    step(model, inputs, counter)
    # Nothing kept, read ahead or left writing: what remains is what one backward node needs at once.
    offload = make_offload(target, tmp_path, keep_recent_bytes=0, prefetch_bytes=0, max_pending_write_bytes=0)
    step(model, inputs, offload)
    stats = offload.stats()
    assert counter.resident_bytes == 0
    assert stats.bytes_written > counter.peak_resident_bytes // 2
    assert stats.peak_resident_bytes < counter.peak_resident_bytes // 4


@pytest.mark.parametrize("target", WITH_SPILL)
def test_forward_without_backward_releases(target, tmp_path):
    model, inputs = make_case("gpt")
    offload = make_offload(target, tmp_path, keep_recent_bytes=0)
    with offload:
        loss = model(*inputs)
    assert offload.stats().offloaded_bytes > 0
    del loss
    gc.collect()
    assert_released(offload)
    if target == "nvme":  # an owned store stays open for the next step, empty
        assert offload._tier.store.used_bytes == 0
    offload.close()
    assert offload._tier is None


def test_user_store_shared_and_left_open(tmp_path):
    from nvoffload.io import TensorStore

    model, inputs = make_case("gpt")
    ref = step(model, inputs)
    with TensorStore(str(tmp_path)) as store:
        outer = offload_activations(store, min_bytes=1024, keep_recent_bytes=0)
        inner = offload_activations(store, min_bytes=1024, keep_recent_bytes=0)
        with outer:
            model.zero_grad(set_to_none=True)
            h = model.tok_emb(inputs[0]) + model.pos_emb(torch.arange(64))
            h = model.blocks[0](h)
            with inner:
                h = model.blocks[1](h)
            logits = F.linear(model.ln_f(h), model.tok_emb.weight)
            loss = F.cross_entropy(logits.view(-1, 256), inputs[1].reshape(-1))
        wait_for_writes(outer, inner)  # a write reaches the store once its copy to the host has landed
        assert store.used_bytes > 0
        assert inner.stats().bytes_written > 0 and outer.stats().bytes_written > 0
        loss.backward()
        assert store.used_bytes == 0
        store.put("still-open", torch.ones(4)).result()
    assert torch.equal(ref[0], loss.detach())


@pytest.mark.parametrize("target", WITH_SPILL)
def test_exception_in_block_releases(target, tmp_path):
    model, inputs = make_case("gpt")
    offload = make_offload(target, tmp_path, keep_recent_bytes=0)
    kept = []
    with pytest.raises(KeyError, match="boom"):
        with offload:
            kept.append(model(*inputs))
            raise KeyError("boom")
    assert_released(offload, graph_alive=True)
    with pytest.raises(RuntimeError, match="released before backward"):
        kept[0].backward()


def test_close_releases_and_later_backward_fails(tmp_path):
    model, inputs = make_case("gpt")
    offload = make_offload("cpu", tmp_path, keep_recent_bytes=0)
    with offload:
        loss = model(*inputs)
    offload.close()
    assert_released(offload, graph_alive=True)
    with pytest.raises(RuntimeError, match="released before backward"):
        loss.backward()
    with pytest.raises(RuntimeError, match="closed"):
        with offload:
            pass


@pytest.mark.parametrize("target", WITH_SPILL)
@pytest.mark.parametrize("reentrant", [True, False])
def test_checkpoint(reentrant, target, tmp_path):
    model, inputs = make_case("gpt")
    ref = step(model, inputs)

    def forward(idx, targets):
        x = model.tok_emb(idx) + model.pos_emb(torch.arange(idx.shape[1]))
        for block in model.blocks:
            x = checkpoint(block, x, use_reentrant=reentrant)
        logits = F.linear(model.ln_f(x), model.tok_emb.weight)
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))

    for backward_inside in (True, False):
        offload = make_offload(target, tmp_path, keep_recent_bytes=0)
        model.zero_grad(set_to_none=True)
        with offload:
            loss = forward(*inputs)
            if backward_inside:
                loss.backward()  # re-entrant recomputation then saves through the hooks too
        if not backward_inside:
            loss.backward()
        assert_same(ref, (loss.detach(), {n: p.grad for n, p in model.named_parameters()}))
        assert offload.stats().bytes_written > 0
        assert_released(offload)


@pytest.mark.parametrize("target", WITH_SPILL)
def test_gradient_accumulation_and_retain_graph(target, tmp_path):
    model, inputs = make_case("gpt")
    other = (torch.randint(0, 256, (4, 64)), torch.randint(0, 256, (4, 64)))
    model.zero_grad(set_to_none=True)
    (model(*inputs) + model(*other)).backward()
    ref = {n: p.grad.clone() for n, p in model.named_parameters()}

    offload = make_offload(target, tmp_path, keep_recent_bytes=0, prefetch_bytes=100_000)
    model.zero_grad(set_to_none=True)
    with offload:
        l1 = model(*inputs)
        l2 = model(*other)
    (l1 + l2).backward(retain_graph=True)
    for n, p in model.named_parameters():
        assert torch.equal(p.grad, ref[n]), n
    assert offload.stats().offloaded_bytes > 0  # graph retained: swap kept
    model.zero_grad(set_to_none=True)
    (l1 + l2).backward()  # second pass reads everything again
    for n, p in model.named_parameters():
        assert torch.equal(p.grad, ref[n]), n
    del l1, l2
    assert_released(offload)


@pytest.mark.parametrize("target", WITH_SPILL)
def test_double_backward(target, tmp_path):
    torch.manual_seed(0)
    lin = nn.Linear(64, 64)
    x = torch.randn(128, 64)

    def penalty(ctx):
        lin.zero_grad(set_to_none=True)
        xr = x.clone().requires_grad_()
        with ctx:
            y = torch.tanh(lin(xr)).pow(3).sum()
        (g,) = torch.autograd.grad(y, xr, create_graph=True)
        g.square().sum().backward()
        return lin.weight.grad.clone()

    offload = make_offload(target, tmp_path, keep_recent_bytes=0)
    assert torch.equal(penalty(torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t)), penalty(offload))
    assert offload.stats().bytes_written > 0
    assert_released(offload)


def test_dedup_and_small_and_parameters_stay():
    torch.manual_seed(0)
    lin = nn.Linear(256, 256)  # weight: 256 KiB, saved by mm as a view of a parameter
    x = torch.randn(512, 256)
    offload = offload_activations(target="cpu", min_bytes=4096, keep_recent_bytes=0)
    with offload:
        h = lin(x)  # saves x (input: offloaded), weight (parameter: stays)
        y = h * h  # saves h twice: written once
        small = y[:1, :8].sin()  # saves a 32-byte slice: stays
        loss = y.mean() + small.sum()
    stats = offload.stats()
    assert stats.dedup_hits == 1
    assert stats.tensors_written == 2
    assert stats.bytes_written == 2 * 512 * 256 * 4
    loss.backward()
    assert_released(offload)


@pytest.mark.parametrize("target", WITH_SPILL)
def test_views_inside_one_extent_are_written_once(target, tmp_path):
    torch.manual_seed(0)
    lin = nn.Linear(64, 256)
    w2 = nn.Parameter(torch.randn(512, 32))
    x = torch.randn(512, 64)

    def run(ctx):
        lin.zero_grad(set_to_none=True)
        w2.grad = None
        with ctx:
            h = torch.tanh(lin(x))  # saves x (128 KiB) and h, tanh's output (512 KiB)
            a = h.t() @ w2  # saves h.t(): h's extent, other strides
            b = h.view(-1, 128)[1:].sin()  # saves a slice inside h's extent
            loss = a.square().mean() + b.mean()  # a (32 KiB): under min_bytes
        loss.backward()
        return loss.detach(), lin.weight.grad.clone(), w2.grad.clone()

    offload = make_offload(target, tmp_path, min_bytes=64 << 10, keep_recent_bytes=0)
    ref = run(contextlib.nullcontext())
    got = run(offload)
    assert all(torch.equal(a, b) for a, b in zip(ref, got))
    stats = offload.stats()
    assert (stats.tensors_written, stats.dedup_hits) == (2, 2)
    assert stats.bytes_written == (512 * 64 + 512 * 256) * 4
    assert_released(offload)


class WithBuffer(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(128, 128)
        self.register_buffer("scale", torch.rand(512, 128))  # 256 KiB, saved by the product below

    def forward(self, x):
        return (self.lin(x) * self.scale).square().mean()


@pytest.mark.parametrize("target", WITH_SPILL)
def test_buffers_stay_in_place(target, tmp_path):
    torch.manual_seed(0)
    model, x = WithBuffer(), torch.randn(512, 128)
    ref = step(model, (x,))
    counter = SavedTensorCounter()
    step(model, (x,), counter)
    offload = make_offload(target, tmp_path, keep_recent_bytes=0)
    assert_same(ref, step(model, (x,), offload))
    stats = offload.stats()
    assert stats.tensors_written == 2 and stats.bytes_written == 2 * 512 * 128 * 4  # x and the product
    assert counter.peak_resident_bytes == 2 * 512 * 128 * 4  # the counter leaves buffers out too
    assert_released(offload)


@pytest.mark.parametrize("copy_delay_us", [0, 200_000])
def test_dropped_context_removes_its_swap_files_without_gc(tmp_path, monkeypatch, copy_delay_us):
    # With the copies slowed, backward uses tensors whose writes are still in flight (read back avoided) and
    # releases them before their writes end: the context must not be kept alive by them.
    monkeypatch.setenv("NVOFFLOAD_SIM_COPY_DELAY_US", str(copy_delay_us))
    model, inputs = make_case("gpt")
    swap_files = lambda: [f for f in os.listdir(tmp_path) if f.endswith(".swap")]  # noqa: E731
    gc.collect()
    gc.disable()
    try:
        for _ in range(2):  # a new context each step, as in the README
            offload = make_offload("nvme", tmp_path, keep_recent_bytes=0)
            step(model, inputs, offload)
            assert offload.stats().bytes_written > 0
            del offload
            assert swap_files() == []
        offload = make_offload("nvme", tmp_path, keep_recent_bytes=0)
        with offload:
            loss = model(*inputs)
        del offload  # the graph's handles keep it alive until backward is done
        assert len(swap_files()) == 1
        loss.backward()
        del loss
        assert swap_files() == []
    finally:
        gc.enable()


def test_reads_after_the_kept_tensors_and_in_a_second_backward_are_prefetched(tmp_path):
    model, inputs = make_case("gpt")
    offload = make_offload("nvme", tmp_path, keep_recent_bytes=300_000, prefetch_bytes=1 << 30)
    with offload:
        loss = model(*inputs)
    loss.backward(retain_graph=True)
    first = offload.stats()
    assert first.tensors_forwarded > 0 and first.tensors_written > 0
    # Each written tensor (the first stored one too) was read ahead, or kept on
    # the device because its write was still in flight: none was read on demand.
    assert first.reads_prefetched + first.reads_avoided == first.tensors_written
    wait_for_writes(offload)  # the second backward reads back only what was written (run 14 of a busy loop:
    # every write still in flight through both passes, all 70 uses avoided and nothing read)
    loss.backward()
    second = offload.stats()
    assert 0 < second.bytes_read - first.bytes_read <= first.bytes_written  # kept ones were dropped after use
    assert (second.reads_prefetched + second.reads_avoided) - (first.reads_prefetched + first.reads_avoided) == first.tensors_written
    del loss
    assert_released(offload)


def test_memory_bounds_of_keep_recent_and_prefetch(tmp_path):
    model, inputs = make_case("gpt")
    largest = 4 * 64 * 256 * 4  # the tiny GPT's biggest saved tensor (the MLP's hidden layer)

    def peak(keep, prefetch):
        offload = make_offload("nvme", tmp_path, keep_recent_bytes=keep, prefetch_bytes=prefetch, max_pending_write_bytes=0)
        step(model, inputs, offload)
        return offload.stats().peak_resident_bytes

    base = peak(0, 0)
    for budget in (100_000, 600_000):
        assert base <= peak(budget, 0) <= base + budget + largest
        ahead = peak(0, budget)
        assert base <= ahead <= base + budget + largest
    assert ahead > base + largest  # 600 KB of reads ahead do take memory


def test_forwarding_keeps_recent_in_memory():
    model, inputs = make_case("gpt")
    offload = offload_activations(target="cpu", min_bytes=1024, keep_recent_bytes=1 << 30)
    step(model, inputs, offload)
    stats = offload.stats()
    assert stats.tensors_written == 0 and stats.tensors_forwarded > 0 and stats.bytes_read == 0
    assert offload._tier is None  # nothing written: neither store nor engine opened


def test_inplace_after_save_raises():
    x = torch.randn(256, 256, requires_grad=True)
    offload = offload_activations(target="cpu", min_bytes=1024)
    with offload:
        b = x * 2
        c = b.sin()  # saves b
        b.mul_(2)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        c.sum().backward()


def test_counter_with_save_on_cpu():
    x = torch.randn(256, 256, requires_grad=True)
    plain = SavedTensorCounter()
    with plain:
        y = x.sin().sin()
    assert plain.resident_bytes == 256 * 256 * 4 and plain.offloaded_bytes == 0
    y.sum().backward()
    wrapped = SavedTensorCounter(torch.autograd.graph.save_on_cpu(pin_memory=True))
    with wrapped:
        y = x.sin().sin()
    assert wrapped.resident_bytes == 0 and wrapped.offloaded_bytes == 256 * 256 * 4
    y.sum().backward()
    assert wrapped.offloaded_bytes == 0 and wrapped.peak_offloaded_bytes == 256 * 256 * 4


def test_bad_settings(tmp_path):
    with pytest.raises(ValueError, match="min_bytes must be >= 0"):
        offload_activations(target="cpu", min_bytes=-1)
    with pytest.raises(ValueError, match="keep_recent_bytes must be >= 0"):
        offload_activations(target="cpu", keep_recent_bytes=-5)
    with pytest.raises(ValueError, match="prefetch_bytes must be an int"):
        offload_activations(target="cpu", prefetch_bytes=1.5)
    with pytest.raises(ValueError, match="unknown offload target 'gpu'"):
        offload_activations(tmp_path, target="gpu")
    with pytest.raises(ValueError, match="needs swap_dir"):
        offload_activations()
    with pytest.raises(ValueError, match="only used with target='nvme'"):
        offload_activations(tmp_path, target="cpu")
    with pytest.raises(ValueError, match="either config or keywords"):
        offload_activations(target="cpu", config=ActivationOffloadConfig(target="cpu"))
    with pytest.raises(ValueError, match="host_resident_bytes is for target='nvme'"):
        offload_activations(target="cpu", host_resident_bytes=1 << 20)
    with pytest.raises(ValueError, match="host_resident_bytes must be >= 0"):
        offload_activations(tmp_path, host_resident_bytes=-1)
    with pytest.raises(ValueError, match=r"host_memory_bytes \(1048576\) must hold host_resident_bytes"):
        offload_activations(tmp_path, host_resident_bytes=1 << 20, host_memory_bytes=1 << 20)
    from nvoffload import OffloadConfig

    with pytest.raises(ValueError, match="activation_host_bytes keeps offloaded activations in host memory"):
        OffloadConfig(swap_dirs=[tmp_path], activation_host_bytes=1 << 20)
    with pytest.raises(ValueError, match="activation_host_bytes must be an int number of bytes >= 0"):
        OffloadConfig(swap_dirs=[tmp_path], offload_activations=True, activation_host_bytes=-1)
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        offload_activations(tmp_path / "missing")
    with pytest.raises(NotADirectoryError, match="is not a directory"):
        offload_activations(blocker)
    with pytest.raises(TypeError, match="a path or a list of paths, got 5"):
        offload_activations(5)
    with pytest.raises(TypeError, match="a path or a list of paths, got b'/tmp'"):
        offload_activations(b"/tmp")
    with pytest.raises(TypeError, match=r"must be paths \(str or os.PathLike\), got 7"):
        offload_activations([tmp_path, 7])
    with pytest.raises(ValueError, match="at least one swap directory"):
        offload_activations([])
    with pytest.raises(ValueError, match="host_memory_bytes must be None or an int >= 4096"):
        offload_activations(target="cpu", host_memory_bytes=100)


# ---------------------------------------------------------------------------- the transfer engine underneath


def _grads_with_offload(target, tmp_path, **kw):
    model, inputs = make_case("views")
    ref = step(model, inputs)
    # Each write done before the next save: none in flight when backward runs, every tensor is read back.
    offload = make_offload(target, tmp_path, keep_recent_bytes=0, max_pending_write_bytes=0, **kw)
    got = step(model, inputs, offload)
    assert offload.stats().bytes_read > 0
    return ref, got, offload


@pytest.mark.parametrize("target", WITH_SPILL)
def test_a_missing_wait_gives_wrong_gradients(target, tmp_path, monkeypatch):
    """The stand-in's copies land late: unpack must wait for the read-back, or backward reads garbage."""
    monkeypatch.setenv("NVOFFLOAD_SIM_COPY_DELAY_US", "20000")
    ref, got, _ = _grads_with_offload(target, tmp_path, prefetch_bytes=0)
    assert_same(ref, got)
    monkeypatch.setattr(TransferEngine, "wait", lambda self, future: None)
    ref, got, _ = _grads_with_offload(target, tmp_path, prefetch_bytes=0)
    assert not all(torch.equal(g, got[1][n]) for n, g in ref[1].items())


@pytest.mark.parametrize("target", WITH_SPILL)
def test_reads_reach_the_device_ahead_of_unpack(target, tmp_path, monkeypatch):
    """With prefetch, each tensor's copy to the device starts before backward unpacks the tensor needed before it."""
    events = []
    for method in ("to_device", "load"):
        original = getattr(TransferEngine, method)

        def logged(self, *args, _original=original, _method=method, **kw):
            name = kw["what"] if _method == "to_device" else args[1]
            if name.startswith("act"):
                events.append(("start", name))
            return _original(self, *args, **kw)

        monkeypatch.setattr(TransferEngine, method, logged)
    wait = TransferEngine.wait

    def logged_wait(self, future):
        events.append(("wait", future.what))
        wait(self, future)

    monkeypatch.setattr(TransferEngine, "wait", logged_wait)
    ref, got, offload = _grads_with_offload(target, tmp_path, prefetch_bytes=1 << 30)
    assert_same(ref, got)

    def read_ahead():
        """The tensors whose copy started before backward waited for the tensor it needed before them."""
        first = {}
        for i, event in enumerate(events):
            first.setdefault(event, i)
        waited = list(dict.fromkeys(name for kind, name in events if kind == "wait"))  # in the order of need
        events.clear()
        return waited, [n for before, n in zip(waited, waited[1:]) if first[("start", n)] < first[("wait", before)]]

    waited, ahead = read_ahead()
    assert len(waited) > 3 and len(ahead) == offload.stats().reads_prefetched >= len(waited) // 2
    _grads_with_offload(target, tmp_path, prefetch_bytes=0)
    assert read_ahead()[1] == []  # without prefetch, each read starts when backward asks for it


@pytest.mark.parametrize("target", WITH_SPILL)
def test_writes_and_reads_ahead_go_through_the_transfer_engines_queues(target, tmp_path, monkeypatch):
    """Activation offload kept a write-behind (its writes in flight and their bytes) and a read-ahead (a sorted list
    of stored tensors and a byte count) of its own; they are the transfer engine's WriteBehind and ReadAhead now:
    every write is submitted to a WriteBehind, every read ahead is taken from a ReadAhead (issue 32)."""
    writes, taken = [], []
    submit, take = WriteBehind.submit, ReadAhead.take

    def submitted(self, nbytes, start, done=None):
        if self.what == "activation offload's writes":
            writes.append(nbytes)
        return submit(self, nbytes, start, done)

    def took(self, key):
        future = take(self, key)
        if future is not None:
            taken.append(key)
        return future

    monkeypatch.setattr(WriteBehind, "submit", submitted)
    monkeypatch.setattr(ReadAhead, "take", took)
    ref, got, offload = _grads_with_offload(target, tmp_path, prefetch_bytes=1 << 30)
    assert_same(ref, got)
    stats = offload.stats()
    assert len(writes) == stats.tensors_written > 3 and sum(writes) == stats.bytes_written
    assert len(taken) == len(set(taken)) == stats.reads_prefetched > 3  # each read ahead taken once, by backward


class _SlowBackward(torch.autograd.Function):
    """Identity whose backward takes long enough for every write in flight to end."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        time.sleep(2.0)
        return grad


def test_a_tensor_used_again_after_its_write_ends_stays_on_the_device(tmp_path):
    """``h`` is saved twice; backward's first use finds its write (slow copies) still in flight and uses the
    original: it stays for the second use, after the write ended, instead of being dropped and read back
    (it was counted both avoided and read, one run in a few under load)."""
    with TransferEngine(8 << 20, SimDevice(copy_delay_us=1_500_000)) as engine:  # writes in flight for 1.5 s
        offload = make_offload("nvme", tmp_path, keep_recent_bytes=0, prefetch_bytes=0, min_bytes=4096, transfer=engine)
        a = torch.randn(256, 256, requires_grad=True)
        w = torch.randn(256, requires_grad=True)  # under min_bytes: stays resident
        with offload:
            h = a.sin()  # saved by the two products
            z = _SlowBackward.apply(h * w) * h  # backward: h (write in flight), then the slow step, then h again
        z.sum().backward()
        stats = offload.stats()
        assert stats.tensors_written >= 2 and stats.reads_avoided == stats.tensors_written and stats.bytes_read == 0
        torch.testing.assert_close(a.grad, (2 * h * w * a.cos()).detach())
        offload.close()


def test_shared_engine_is_used_and_left_open(tmp_path):
    model, inputs = make_case("gpt")
    ref = step(model, inputs)
    with TransferEngine(8 << 20, "cpu") as engine:
        for target in TARGETS:
            offload = make_offload(target, tmp_path, keep_recent_bytes=0, transfer=engine)
            assert_same(ref, step(model, inputs, offload))
            assert offload._tier.engine is engine and engine.slab.peak_bytes > 0
            assert_released(offload)
            offload.close()
            assert engine.slab.used_bytes == 0
            engine.to_host(torch.empty(4), torch.ones(4)).result()  # still open


@pytest.mark.parametrize("target", TARGETS)
def test_host_memory_is_the_budget(target, tmp_path):
    model, inputs = make_case("gpt")
    ref = step(model, inputs)
    budget = 1 << 20  # under the 2.5 MB the tiny GPT offloads
    offload = make_offload(target, tmp_path, keep_recent_bytes=0, prefetch_bytes=1 << 30, host_memory_bytes=budget)
    if target == "cpu":  # the slab holds the offloaded tensors: too small
        with pytest.raises(MemoryBudgetError, match="activation offload host memory"):
            step(model, inputs, offload)
        assert_released(offload, graph_alive=True)
    else:  # the slab only stages copies: writes wait for room, prefetch stops at it
        assert_same(ref, step(model, inputs, offload))
        assert offload.stats().bytes_written > budget
        assert offload._tier.slab.peak_bytes <= budget
        assert_released(offload)
        largest = 4 * 64 * 256 * 4  # the tiny GPT's biggest saved tensor: staged in pieces of half the slab
        offload = make_offload(target, tmp_path, keep_recent_bytes=0, host_memory_bytes=largest // 2)
        assert_same(ref, step(model, inputs, offload))
        assert offload._tier.slab.peak_bytes <= largest // 2
        assert_released(offload)


@pytest.mark.cuda
@pytest.mark.parametrize("target", WITH_SPILL)
def test_cuda_gradients_equal(target, tmp_path):
    assert "cuda" in DEVICES
    model, inputs = make_case("gpt")
    model = model.cuda()
    inputs = tuple(t.cuda() for t in inputs)
    ref = step(model, inputs)
    offload = make_offload(target, tmp_path, keep_recent_bytes=0, prefetch_bytes=1 << 20)
    got = step(model, inputs, offload)
    assert_same(ref, got)
    assert offload.stats().bytes_written > 0 and offload.stats().reads_prefetched > 0
    if target == "spill":  # page-locked slab buffers hold what fits, the rest went through them to NVMe
        assert 0 < offload.stats().host_bytes_written <= SPILL_RESIDENT_BYTES < offload.stats().bytes_written
    assert_released(offload)


@pytest.mark.cuda
@pytest.mark.parametrize("target", WITH_SPILL)
def test_cuda_copies_out_and_back_on_their_own_streams(target, tmp_path, monkeypatch):
    from nvoffload import device

    streams = {"d2h": set(), "h2d": set()}
    copy = device._CudaCopyStream.copy

    def logged(self, dst, src, after, what=None):
        streams["h2d" if dst.is_cuda else "d2h"].add(self._stream.stream_id)
        return copy(self, dst, src, after, what)

    monkeypatch.setattr(device._CudaCopyStream, "copy", logged)
    model, inputs = make_case("views")
    model = model.cuda()
    inputs = tuple(t.cuda() for t in inputs)
    ref = step(model, inputs)
    offload = make_offload(target, tmp_path, keep_recent_bytes=0, prefetch_bytes=1 << 30)
    assert_same(ref, step(model, inputs, offload))
    compute = torch.cuda.current_stream().stream_id
    assert len(streams["d2h"]) == 1 and len(streams["h2d"]) <= 1  # GPUDirect Storage reads need no h2d copy
    assert streams["d2h"].isdisjoint(streams["h2d"]) and compute not in streams["d2h"] | streams["h2d"]
    assert offload._tier.slab.page_locked
    assert_released(offload)


@pytest.mark.parametrize(
    "module",
    ["counting", "offload"],
)
def test_docstring_examples_run(module):
    result = doctest.testmod(importlib.import_module(f"nvoffload.activations.{module}"))
    assert result.attempted > 0 and result.failed == 0


def _offloaded_linear_stack(tmp_path):
    """A store, an offload writing every saved tensor at once (nothing kept or read ahead), four Linear layers,
    an input and the reference gradients."""
    from nvoffload.io import TensorStore

    store = TensorStore(tmp_path)
    offload = offload_activations(store, min_bytes=1024, keep_recent_bytes=0, max_pending_write_bytes=0, prefetch_bytes=0)
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(256, 256) for _ in range(4)])
    x = torch.randn(64, 256)
    return store, offload, model, x, torch.autograd.grad(model(x).sum(), list(model.parameters()))


def _next_iteration_is_exact_and_close_releases(tmp_path, store, offload, model, x, want):
    model.zero_grad()
    with offload:
        y = model(x).sum()  # the same input tensor again
    y.backward()
    for p, g in zip(model.parameters(), want):
        assert torch.equal(p.grad, g)
    offload.close()
    offload.close()
    assert store.used_bytes == 0
    store.close()
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize(
    "fault, message",
    [("eio", r"writing saved activation .* failed: \[Errno 5\]"), ("enospc", r"writing saved activation .* failed: \[Errno 28\]"),
     ("short_read", r"reading saved activation .* back failed: .*short")],
    ids=["eio-write", "enospc-write", "short-read"],
)  # fmt: skip
def test_a_failed_write_or_read_fails_that_backward_only_and_close_releases_everything(tmp_path, fault, message):
    """An EIO or a full disk while a saved tensor is written, or a short read as it comes back: that backward
    raises naming the tensor, the next trains exactly, and close() releases everything (it raised KeyError on
    every call for the tensor a failed write left no space for, and kept the swap file)."""
    store, offload, model, x, want = _offloaded_linear_stack(tmp_path)
    store.inject_fault(fault, after_ops=2 if fault != "short_read" else 0)  # short reads strike reads only
    with offload:
        y = model(x).sum()
    with pytest.raises(RuntimeError, match=message):
        y.backward()
    del y
    _next_iteration_is_exact_and_close_releases(tmp_path, store, offload, model, x, want)


def test_a_flipped_byte_fails_that_backward_only_and_the_input_is_written_anew(tmp_path):
    """A byte flipped on disk under every saved tensor (checksums are on by default): that backward raises naming
    the tensor and file; the next iteration, with the same input tensor (which forward would otherwise share with
    the damaged record), trains exactly."""
    from conftest import flip_stored_byte

    store, offload, model, x, want = _offloaded_linear_stack(tmp_path)
    with offload:
        y = model(x).sum()
    for write in list(store._pending_puts.values()):
        write.result()
    for name in list(store._records):
        flip_stored_byte(store, name)
    with pytest.raises(RuntimeError, match=r"reading saved activation .* back failed: checksum mismatch") as info:
        y.backward()
    assert store.swap_files[0] in str(info.value)  # info keeps the failed graph, and its records, alive
    del y
    _next_iteration_is_exact_and_close_releases(tmp_path, store, offload, model, x, want)