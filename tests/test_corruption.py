"""A byte flipped on disk under training (checksums are on by default): caught, never trained on.

Parameter streaming and the NVMe optimizer cannot go on from state that is gone: every later call refuses with
a ChecksumError naming the tensor, the file and the way out, and resuming from the last training checkpoint
trains exactly as a run that never met the corruption. Activation offload's saved tensors live for one
iteration: that backward raises, the next iteration trains exactly.
"""

from __future__ import annotations

import copy
import os

import pytest
import torch
from test_streaming import batch, config, make_pair
from torch import nn

import nvoffload
from nvoffload.activations import offload_activations
from nvoffload.io import ChecksumError, TensorStore
from nvoffload.optim.offload import OffloadIOError


def _flip_byte(store: TensorStore, name: str, at: int = 100) -> None:
    """Flip one bit of the bytes stored under ``name``, on disk."""
    extent = store._records[name].extents[0]
    fd = os.open(extent.swap.file.path, os.O_RDWR)
    try:
        byte = os.pread(fd, 1, extent.offset + at)
        os.pwrite(fd, bytes([byte[0] ^ 0x04]), extent.offset + at)
        os.fsync(fd)
    finally:
        os.close(fd)


def _streamed(tmp_path, name, model):
    (tmp_path / name).mkdir()
    return nvoffload.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-3), config(tmp_path / name, model))


def _train(model, opt, cfg, steps, first=0):
    losses = []
    for step in range(first, first + steps):
        x, y = batch(cfg, step)
        loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("where", ["block", "optimizer"])
def test_streaming_refuses_until_resumed_from_the_last_checkpoint(tmp_path, where):
    cfg, ref, model = make_pair("small")
    model, opt = _streamed(tmp_path, "run", model)
    _train(model, opt, cfg, 2)
    nvoffload.save_training_checkpoint(tmp_path / "ckpt", step=2, model=model, optimizer=opt)
    _train(model, opt, cfg, 1, first=2)
    store = opt.session.store
    names = [n for n in store._records if n.startswith("stream.block" if where == "block" else "opt")]
    for name in names:  # every block (or optimizer chunk) on disk: whichever is read next is corrupt
        _flip_byte(store, name)
    opt.session.streamer._cache.close()  # nothing left in host memory: the next reads come from disk
    x, y = batch(cfg, 3)
    for _ in range(2):  # refused, and refused again: no step trains on the flipped byte
        with pytest.raises((ChecksumError, OffloadIOError), match="checksum mismatch") as info:
            model(x, y).backward()
            opt.step()
        message = str(info.value) + str(info.value.__cause__ or "")
        assert "Resume from the last training checkpoint" in message and store.swap_files[0] in message
    opt.close()

    resumed, resumed_opt = _streamed(tmp_path, "resumed", copy.deepcopy(ref))
    nvoffload.load_training_checkpoint(tmp_path / "ckpt", model=resumed, optimizer=resumed_opt)
    got = _train(resumed, resumed_opt, cfg, 2, first=2)
    clean, clean_opt = _streamed(tmp_path, "clean", copy.deepcopy(ref))
    want = _train(clean, clean_opt, cfg, 4)[2:]
    assert got == want
    for (k, a), b in zip(resumed.state_dict().items(), clean.state_dict().values()):
        assert torch.equal(a, b), k
    resumed_opt.close()
    clean_opt.close()


def test_activation_offload_fails_that_backward_and_trains_exactly_next(tmp_path):
    store = TensorStore(tmp_path)
    offload = offload_activations(store, min_bytes=1024, keep_recent_bytes=0, max_pending_write_bytes=0, prefetch_bytes=0)
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(256, 256) for _ in range(4)])
    x = torch.randn(64, 256)
    want = torch.autograd.grad(model(x).sum(), list(model.parameters()))
    with offload:
        y = model(x).sum()
    for write in list(store._pending_puts.values()):
        write.result()
    saved = [n for n in store._records if not n.startswith("stream")]
    assert saved
    for name in saved:
        _flip_byte(store, name)
    with pytest.raises(RuntimeError, match=r"saved activation .* checksum mismatch") as info:
        y.backward()
    assert store.swap_files[0] in str(info.value)
    del y
    model.zero_grad()
    with offload:
        y = model(x).sum()
    y.backward()
    for p, g in zip(model.parameters(), want):
        assert torch.equal(p.grad, g)
    offload.close()
    assert store.used_bytes == 0
    store.close()
    assert not list(tmp_path.iterdir())
