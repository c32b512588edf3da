"""Resident optimizer state (issue 34): chunks whose state stays in host memory, never in the store."""

import copy
import dataclasses

import pytest
import torch
from test_offload_optim import CHUNK, MLP, assert_params_equal, batches, groups, train
from test_streaming import config

import nvoffload
from nvoffload.models import GPT, GPTConfig
from nvoffload.optim.offload import NVMeAdamW, OffloadOptimizer, OffloadOptimizerConfig
from nvoffload.planner import BUILTIN_PROFILES, ModelShape, PlanRequest, plan
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


def _pages(nbytes):
    return -(-nbytes // 4096) * 4096


def test_initialize_gives_resident_state_what_the_blocks_cache_leaves_as_the_planner_does(tmp_path):
    blocks = GPT(GPTConfig.preset("small")).blocks
    cache = sum(_pages(sum(p.numel() * 4 for p in b.parameters())) for b in blocks)
    extra = 24 << 20  # host bytes beyond caching every block, in the share left for them
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    runs = {}
    for name, cpu in (("all_on_nvme", 2 * cache), ("resident", 2 * (cache + extra))):
        torch.manual_seed(3)
        model = GPT(GPTConfig.preset("small"))
        cfg = nvoffload.OffloadConfig(
            swap_dirs=[tmp_path / ("a" if name == "all_on_nvme" else "b")], cpu_memory_bytes=cpu,
            device_memory_bytes=config(tmp_path, model).device_memory_bytes,
        )  # fmt: skip
        runs[name] = nvoffload.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1), cfg)
    (m_nvme, o_nvme), (m_res, o_res) = runs["all_on_nvme"], runs["resident"]
    assert o_nvme.config.resident_state_bytes == 0
    assert o_res.config.resident_state_bytes == extra
    request = PlanRequest(ModelShape.from_preset("small"), 4, 32, dtype="float32", cpu_memory_bytes=2 * (cache + extra),
                          device_memory_bytes=1 << 30, stream=True, activations="keep")  # fmt: skip
    predicted = plan(request, BUILTIN_PROFILES["h100-sxm-512g-4xgen4"])
    assert predicted.resident_state_bytes == o_res.config.resident_state_bytes
    assert predicted.cached_blocks == len(blocks)
    all_on_nvme = plan(dataclasses.replace(request, cpu_memory_bytes=2 * cache), BUILTIN_PROFILES["h100-sxm-512g-4xgen4"])
    assert all_on_nvme.resident_state_bytes == 0
    saved = extra // 24 * 12  # the planner's one generation of the state kept resident, per step each way
    assert (all_on_nvme.nvme_read_bytes - predicted.nvme_read_bytes, all_on_nvme.nvme_written_bytes - predicted.nvme_written_bytes) == (saved, saved)
    kept = o_res.memory_stats().resident_state_bytes
    assert 0 < kept <= extra // 2
    try:
        for step in range(3):
            g = torch.Generator().manual_seed(step)
            x = torch.randint(0, GPTConfig.preset("small").vocab_size, (4, 32), generator=g)
            io = []
            for model, opt in ((m_nvme, o_nvme), (m_res, o_res)):
                opt.reset_io_stats()
                loss = model(x, x.roll(-1, dims=1))
                loss.backward()
                opt.step()
                opt.zero_grad()
                io.append((opt.memory_stats().read_bytes, opt.memory_stats().written_bytes, loss.detach()))
            assert torch.equal(io[0][2], io[1][2])
            if step:  # fp32 parameters: 8 B an element read (the master is the model's), 12 written
                assert (io[0][0] - io[1][0], io[0][1] - io[1][1]) == (kept * 2 // 3, kept)
        with torch.no_grad():
            for a, b in zip(o_nvme.state_dict()["state"].values(), o_res.state_dict()["state"].values()):
                assert all(torch.equal(a[k], b[k]) for k in a)
    finally:
        o_nvme.close()
        o_res.close()


def test_finetune_without_streaming_keeps_resident_what_the_planner_predicts(tmp_path):
    """The model on the device: the host budget beyond the optimizer's staging keeps state resident, in the plan
    and in finetune's optimizer alike."""
    from nvoffload.finetune.config import FinetuneConfig
    from nvoffload.finetune.run import _build

    cpu = 16 << 20
    _, opt = _build(FinetuneConfig(preset="small", cpu_memory_bytes=cpu), str(tmp_path), None)
    try:
        request = PlanRequest(ModelShape.from_preset("small"), 4, 32, dtype="float32", cpu_memory_bytes=cpu, stream=False,
                              activations="keep")  # fmt: skip
        predicted = plan(request, BUILTIN_PROFILES["h100-sxm-512g-4xgen4"])
        assert opt.config.resident_state_bytes == predicted.resident_state_bytes == cpu // 2
        assert opt.config.cpu_memory_bytes == cpu // 2
        assert predicted.nvme_read_bytes == (ModelShape.from_preset("small").params - cpu // 2 // 24) * 12
    finally:
        opt.close()


def test_the_vertical_schedules_offloaded_block_inputs_stay_in_host_memory_as_far_as_it_holds_them():
    """Offloaded by the vertical schedule, the block inputs are kept in what the host budget holds beyond every
    parameter block (before resident optimizer state), NVMe beyond: each byte more kept there is a byte less
    read and written, the copies stay, and the plan's OffloadConfig carries it."""
    profile = BUILTIN_PROFILES["h100-sxm-512g-4xgen4"]
    shape = ModelShape.from_preset("gpt2-1.3b")
    common = dict(batch_size=1, seq_len=1024, grad_accum_steps=4, dtype="bfloat16", device_memory_bytes=8 << 30,
                  stream=True, activations="offload")  # fmt: skip
    short, some, more, ample = (plan(PlanRequest(shape, cpu_memory_bytes=gib << 30, **common), profile) for gib in (1, 7, 8, 32))
    assert short.activation_host_bytes == 0 and short.cached_blocks < shape.n_layer  # no room beyond the blocks
    assert "offloaded to NVMe" in short.placement["activations"]
    assert 0 < some.activation_host_bytes < more.activation_host_bytes and some.resident_state_bytes == more.resident_state_bytes == 0
    assert some.cached_blocks == more.cached_blocks == shape.n_layer  # the inputs come after the blocks
    kept = more.activation_host_bytes - some.activation_host_bytes
    assert some.nvme_read_bytes - more.nvme_read_bytes == some.nvme_written_bytes - more.nvme_written_bytes == kept
    assert some.engine_s["copies"] == more.engine_s["copies"]  # every input still leaves the device and comes back
    assert "in host memory, the rest to NVMe" in some.placement["activations"]
    # every input kept: the rest of the leftover keeps optimizer state resident
    inputs = 4 * shape.n_layer * 1024 * shape.d_model * 2
    assert ample.activation_host_bytes >= inputs and ample.resident_state_bytes > 0
    assert "offloaded to host memory" in ample.placement["activations"]
    assert some.offload_config(["/tmp"]).activation_host_bytes == some.activation_host_bytes
    assert short.offload_config(["/tmp"]).activation_host_bytes == 0
