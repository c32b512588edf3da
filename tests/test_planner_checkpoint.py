"""The planner's checkpoint: its bytes and time for a plan, and what ``--save-every N`` adds to a run; ``nvoffload
plan`` prints it (the 70B plan on one H100 with four Gen4 drives)."""

from __future__ import annotations

import pytest

from nvoffload.cli import main
from nvoffload.planner import plan
from nvoffload.planner.cost import ModelShape, PlanRequest, checkpoint_cost
from nvoffload.planner.profile import BUILTIN_PROFILES

H100 = ["--profile", "h100-sxm-512g-4xgen4", "--cpu-memory", "448G", "--device-memory", "78G", "--swap-dirs", "4"]


def _70b(**kw) -> PlanRequest:
    return PlanRequest(ModelShape.named("llama2-70b"), 8, 2048, grad_accum_steps=2, dtype="bfloat16",
                       cpu_memory_bytes=448 << 30, device_memory_bytes=78 << 30, **{"swap_dirs": 4, **kw})  # fmt: skip


def test_a_checkpoint_costs_its_bytes_on_the_drives_and_training_the_copy_of_the_weights_outside_the_blocks():
    profile = BUILTIN_PROFILES["h100-sxm-512g-4xgen4"]
    chosen = plan(_70b(), profile)
    cost = checkpoint_cost(chosen, profile)
    params = chosen.request.model.params
    assert cost.model_bytes == 2 * params and cost.state_bytes == 12 * params  # bf16 weights; fp32 master, moments
    assert cost.read_bytes == 12 * params - chosen.resident_state_bytes // 2  # one generation, less the resident
    drives = profile.nvme(4)
    # the embeddings and the head copied to the host; the cached blocks (written first) before the backward's updates
    held_s = chosen.cached_blocks * 2 * chosen.request.model.block_params / (drives.write_gbps * 1e9)
    assert chosen.stream and 0 < held_s < chosen.phases_s["forward"]
    assert cost.stall_s == pytest.approx(2 * chosen.request.model.resident_params / (profile.d2h_gbps * 1e9))
    assert cost.seconds == pytest.approx(
        cost.nbytes / (drives.write_gbps * 1e9) + cost.read_bytes / (drives.read_gbps * 1e9)
    )  # fmt: skip
    # the copy fits in the idle time of the drives of a few steps: --save-every 10 costs the stop only
    assert cost.idle_s > 0 and 10 * cost.idle_s > cost.seconds - cost.stall_s
    assert cost.run_overhead(10) == pytest.approx(cost.stall_s / (10 * chosen.step_s))
    assert cost.run_overhead(1) > cost.stall_s / chosen.step_s  # every step: the copy no longer fits beside it
    one_drive = plan(_70b(swap_dirs=1), profile)  # the held blocks' write outlasts the forward: the updates wait
    assert checkpoint_cost(one_drive, profile).stall_s == pytest.approx(
        cost.stall_s + one_drive.cached_blocks * 2 * chosen.request.model.block_params / (profile.nvme(1).write_gbps * 1e9)
        - one_drive.phases_s["forward"]
    )  # fmt: skip
    masterless = checkpoint_cost(plan(_70b(state_precision="8bit"), profile), profile)
    assert masterless.state_bytes == 8 * params  # the moments, widened to fp32; no master


def test_plan_prints_the_checkpoint_of_the_70b_plan(capsys):
    assert main(["plan", "--model", "llama2-70b", "--batch-size", "8", "--seq-len", "2048", "--dtype", "bfloat16",
                 "--grad-accum", "2", *H100]) == 0  # fmt: skip
    line = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("checkpoint: "))
    assert line.startswith("checkpoint: 900G (model 129G, optimizer state 771G), 64.9 s on the drives beside the steps,"
                           " training stopped 0.0191 s by it")  # fmt: skip
    assert line.endswith("% every 1000 steps")
