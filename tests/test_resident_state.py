"""Resident optimizer state (issue 34): chunks whose state stays in host memory, never in the store."""

import copy

import pytest
import torch
from test_offload_optim import CHUNK, MLP, assert_params_equal, batches, groups, train

from nvoffload.optim.offload import NVMeAdamW, OffloadOptimizer, OffloadOptimizerConfig
from nvoffload.training_checkpoint import (
    load_training_checkpoint,
    save_training_checkpoint,
)

ELEMS = CHUNK // 4  # elements per chunk
# Two generations of one full chunk of AdamW state (3 fp32 rows), then one of a 64-element chunk (one page each).
FC1_AND_FC2_FIRST_CHUNK = 2 * (2 * 3 * ELEMS * 4)
UNUSED_WEIGHT = 2 * 4096


def _optimizer(model, swap_dir, resident_state_bytes):
    swap_dir.mkdir()
    inner = torch.optim.AdamW(groups(model), lr=1e-2)
    return OffloadOptimizer(inner, swap_dir=swap_dir, chunk_bytes=CHUNK, resident_state_bytes=resident_state_bytes)


def _io_per_step(model, opt, data):
    """(read, written) store bytes of each step, from the optimizer's counters."""
    out = []
    for x, y in data:
        opt.reset_io_stats()
        train(model, opt, [(x, y)])
        stats = opt.memory_stats()
        out.append((stats.read_bytes, stats.written_bytes))
    return out


def test_resident_chunks_leave_the_store_traffic_and_change_no_result(tmp_path):
    torch.manual_seed(0)
    base = MLP()
    fused, nvme, resident = copy.deepcopy(base), copy.deepcopy(base), copy.deepcopy(base)
    opt_fused = torch.optim.AdamW(groups(fused), lr=1e-2, fused=True)
    opt_nvme = _optimizer(nvme, tmp_path / "a", 0)
    # fc1.weight (one chunk), fc2.weight's first chunk, then unused.weight (64 elements, no gradient) fit.
    opt_res = _optimizer(resident, tmp_path / "b", FC1_AND_FC2_FIRST_CHUNK + UNUSED_WEIGHT)
    data = batches(5)
    train(fused, opt_fused, data[:1])
    train(nvme, opt_nvme, data[:1])  # the first step initializes the state
    train(resident, opt_res, data[:1])
    assert opt_res.memory_stats().resident_bytes == FC1_AND_FC2_FIRST_CHUNK + UNUSED_WEIGHT
    assert opt_res.memory_stats().resident_state_bytes == (2 * ELEMS + 64) * 12
    nvme_io = _io_per_step(nvme, opt_nvme, data[1:])
    res_io = _io_per_step(resident, opt_res, data[1:])
    train(fused, opt_fused, data[1:])
    # fp32 parameters: an update reads the moments (8 B an element; the master is the model's) and writes 12 B.
    for (r_nvme, w_nvme), (r_res, w_res) in zip(nvme_io, res_io):
        assert (r_nvme - r_res, w_nvme - w_res) == (2 * ELEMS * 8, 2 * ELEMS * 12)
        assert r_res > 0 and w_res > 0
    assert_params_equal(resident, nvme)
    assert_params_equal(resident, fused)
    sd_res, sd_nvme = opt_res.state_dict(), opt_nvme.state_dict()
    in_order = [p for g in opt_fused.param_groups for p in g["params"]]
    assert sd_res["state"].keys() == sd_nvme["state"].keys()
    for idx, st in sd_res["state"].items():
        for key, value in st.items():
            assert torch.equal(value, sd_nvme["state"][idx][key]), (idx, key)
            if key != "step":
                assert torch.equal(value, opt_fused.state[in_order[idx]][key]), (idx, key)
    # The store holds no generation of a resident chunk.
    resident_chunks = [c for r in opt_res._records for c in r.chunks if c.home is not None]
    assert len(resident_chunks) == 3
    assert not any(n in opt_res._store for c in resident_chunks for g in range(6) for n in opt_res._layout.names(c, g))
    opt_nvme.close()
    opt_res.close()


def test_resident_state_loads_and_keeps_its_meaning_under_speculation(tmp_path):
    """A state dict loaded into resident chunks, then steps whose gradients change after backward (clipping:
    every update is redone in step()) and a GradScaler-free lr change: equal to the all-in-store optimizer."""
    torch.manual_seed(1)
    base = MLP()
    nvme, resident = copy.deepcopy(base), copy.deepcopy(base)
    opt_nvme = _optimizer(nvme, tmp_path / "a", 0)
    opt_res = _optimizer(resident, tmp_path / "b", 1 << 20)  # every chunk
    data = batches(6, seed=3)
    train(nvme, opt_nvme, data[:2])
    opt_res.load_state_dict(opt_nvme.state_dict())
    resident.load_state_dict(nvme.state_dict())
    assert opt_res.memory_stats().resident_state_bytes == sum(p.numel() * 12 for p in base.parameters() if p.requires_grad)
    for opt in (opt_nvme, opt_res):
        opt.param_groups[0]["lr"] = 5e-3
    train(nvme, opt_nvme, data[2:4], clip=0.5)
    train(resident, opt_res, data[2:4], clip=0.5)
    train(nvme, opt_nvme, data[4:])
    opt_res.reset_io_stats()
    train(resident, opt_res, data[4:])
    assert (opt_res.memory_stats().read_bytes, opt_res.memory_stats().written_bytes) == (0, 0)
    assert_params_equal(resident, nvme)
    for (ka, a), (kb, b) in zip(sorted(opt_res.state_dict()["state"].items()), sorted(opt_nvme.state_dict()["state"].items())):
        assert ka == kb and all(torch.equal(a[k], b[k]) for k in a)
    opt_nvme.close()
    opt_res.close()


def test_a_checkpoint_of_resident_state_resumes_as_the_uninterrupted_run(tmp_path):
    torch.manual_seed(2)
    base = MLP()
    straight, first = copy.deepcopy(base), copy.deepcopy(base)
    data = batches(6, seed=5)
    with _optimizer(straight, tmp_path / "s", 1 << 17) as opt:
        train(straight, opt, data)
    with _optimizer(first, tmp_path / "f", 1 << 17) as opt:
        train(first, opt, data[:3])
        save_training_checkpoint(tmp_path / "ckpt", step=3, model=first, optimizer=opt)
    # A killed run: the resident state is gone with its process; the resumed one starts from a fresh model.
    resumed = MLP()
    with _optimizer(resumed, tmp_path / "r", 1 << 17) as opt:
        load_training_checkpoint(tmp_path / "ckpt", model=resumed, optimizer=opt)
        assert opt.memory_stats().resident_state_bytes > 0
        train(resumed, opt, data[3:])
    assert_params_equal(resumed, straight)


def test_resident_state_bytes_is_validated():
    with pytest.raises(ValueError, match="resident_state_bytes must be an int >= 0"):
        OffloadOptimizerConfig(resident_state_bytes=-1)
    with pytest.raises(ValueError, match="resident_state_bytes must be an int >= 0"):
        OffloadOptimizerConfig(resident_state_bytes=True)


def test_nvme_adamw_takes_the_field(tmp_path):
    model = MLP()
    with NVMeAdamW(model.parameters(), swap_dir=tmp_path, chunk_bytes=CHUNK, resident_state_bytes=1 << 20) as opt:
        assert opt.memory_stats().host_limit_bytes == opt.config.cpu_memory_bytes + (1 << 20)
