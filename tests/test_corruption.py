"""A byte flipped on disk under parameter streaming and the NVMe optimizer (checksums are on by default): caught,
never trained on. They cannot go on from state that is gone: every later call refuses with a ChecksumError naming
the tensor, the file and the way out, and resuming from the last training checkpoint trains exactly as a run that
never met the corruption. (Activation offload: tests/test_activations.py.)
"""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import flip_stored_byte
from test_streaming import batch, config, make_pair

import nvoffload
from nvoffload.io import ChecksumError
from nvoffload.optim.offload import OffloadIOError


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
        flip_stored_byte(store, name)
    opt.session.streamer.cache.close()  # nothing left in host memory: the next reads come from disk
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
