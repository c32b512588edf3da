"""The planner's model of the vertical schedule's stash (issue 51): every micro-batch's block inputs in host memory
(NVMe beyond), so that the micro-batches a step are bound by host memory and the drives, not device memory."""

from __future__ import annotations

import json

from nvoffload.cli import main
from nvoffload.planner import BUILTIN_PROFILES, ModelShape, PlanRequest, plan
from nvoffload.planner.cost import swap_bytes

H100_70B = ["plan", "--model", "llama2-70b", "--profile", "h100-sxm-512g-4xgen4", "--batch-size", "8", "--seq-len",
            "2048", "--dtype", "bfloat16", "--cpu-memory", "448G", "--device-memory", "78G", "--swap-dirs", "4"]  # fmt: skip


def test_grad_accum_auto_takes_the_exact_70b_step_to_compute_with_the_stash(capsys):
    """Exact AdamW, Llama-2 70B on one H100 with 448G of host memory for nvoffload: the block inputs of 2 micro-batches
    of 8 x 2048 on the device left it bound by the drives (225 TFLOP/s, the 100B page before the stash); in the stash,
    4 micro-batches' inputs (21.5G each) stay in host memory beside every cached block, and compute binds."""
    assert main([*H100_70B, "--grad-accum", "auto", "--json"]) == 0
    chosen = json.loads(capsys.readouterr().out)
    g = chosen["request"]["grad_accum_steps"]
    inputs = 80 * 8 * 2048 * 8192 * 2  # a micro-batch's block inputs: a layer's 8 x 2048 x 8192 in bf16, 80 layers
    assert chosen["activations"] == "stash" and chosen["request"]["batch_size"] == 8 and g >= 4
    assert chosen["bottleneck"] == "compute" and chosen["tflops"] >= 300
    assert chosen["stash_host_bytes"] == g * inputs  # all of them in host memory: nothing to NVMe
    assert chosen["memory_bytes"]["device"] < 78e9 < g * inputs  # the device could not hold them
    assert main([*H100_70B, "--grad-accum", str(g), "--no-offload-activations"]) == 2  # kept on the device
    assert "does not fit:\n  - the device needs" in capsys.readouterr().out
    assert main([*H100_70B, "--grad-accum", "4"]) == 0
    assert "each block's input kept for the 4 micro-batches (in the stash: host memory, 80G)" in capsys.readouterr().out


def test_the_stash_spills_to_nvme_what_the_host_budget_does_not_hold():
    """Beyond what the host budget holds after every cached block, the stash writes the block inputs to NVMe and
    reads them back once a step: each byte more on both sides of the drives' traffic (and the host memory it takes
    from resident optimizer state puts that state's bytes back on them); its staging is one block's inputs each
    way, whatever the number of layers. The plan's OffloadConfig carries the stash, not activation offload."""
    shape, profile = ModelShape.named("llama2-70b"), BUILTIN_PROFILES["h100-sxm-512g-4xgen4"]
    request = PlanRequest(shape, 8, 2048, dtype="bfloat16", cpu_memory_bytes=448 << 30, device_memory_bytes=78 << 30,
                          swap_dirs=4, stream=True, activations="stash")  # fmt: skip
    four, eight = (plan(PlanRequest(**{**request.__dict__, "grad_accum_steps": g}), profile) for g in (4, 8))
    inputs = 80 * 8 * 2048 * 8192 * 2
    spilled = 8 * inputs - eight.stash_host_bytes
    assert four.fits and eight.fits and 0 < spilled
    # the host memory the stash takes from resident optimizer state (two generations of 12 bytes a parameter)
    # puts that state's bytes back on the drives
    unresident = (four.resident_state_bytes - eight.resident_state_bytes) // 2
    more = spilled - (4 * inputs - four.stash_host_bytes) + unresident
    assert abs(eight.nvme_written_bytes - four.nvme_written_bytes - more) <= 24
    assert eight.nvme_read_bytes - eight.nvme_written_bytes == four.nvme_read_bytes - four.nvme_written_bytes
    layer = inputs // 80
    assert eight.stash_staging_bytes == 2 * 8 * layer  # one block's inputs written behind, one read ahead
    config = eight.offload_config(["/tmp"])
    assert (config.stash_host_bytes, config.stash_staging_bytes) == (eight.stash_host_bytes, 2 * 8 * layer)
    assert not config.offload_activations and config.activation_host_bytes == 0
    # what the swap directories must hold (finetune's free-space check): the spilled inputs besides the rest
    space = swap_bytes(eight.request, stream=True, offload=False, stash_host_bytes=eight.stash_host_bytes)
    assert space.stashed == spilled and eight.memory_bytes["nvme"] >= spilled
    assert f"the stash's block inputs beyond its host memory ({spilled} bytes)" in space.parts()
    assert swap_bytes(eight.request, stream=True, offload=False).total == space.total - spilled


def test_the_stash_is_only_the_vertical_schedules():
    """Without the vertical schedule (one micro-batch, or --no-vertical) there is no stash: asked for, it is refused
    with the reason; left to the planner, it is not among the choices."""
    shape, profile = ModelShape.from_preset("small"), BUILTIN_PROFILES["h100-sxm-512g-4xgen4"]
    one = plan(PlanRequest(shape, 8, 128, stream=True, activations="stash"), profile)
    assert not one.fits and any("the stash keeps the vertical schedule's block inputs" in r for r in one.reasons)
    chosen = plan(PlanRequest(shape, 8, 128, grad_accum_steps=4, vertical=False), profile)
    assert chosen.activations != "stash" and chosen.stash_host_bytes is None
