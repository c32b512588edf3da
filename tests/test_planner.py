"""The planner: calibrate writes a profile measured through nvoffload's engines; plan takes finetune's options and
answers in the documented JSON, refuses what cannot fit with the reason, and finetune --plan auto follows it.
(How close its predictions come to measured steps is bench/bench_plan.py's business: timings are not tested.)"""

from __future__ import annotations

import json
import os

import pytest

from nvoffload.cli import main
from nvoffload.planner import (
    BUILTIN_PROFILES,
    MachineProfile,
    ModelShape,
    PlanRequest,
    load_profile,
    plan,
)
from nvoffload.planner.calibrate import calibrate


@pytest.fixture(scope="module")
def profile_path(tmp_path_factory):
    """A quick calibration of this machine, once for the module."""
    d = tmp_path_factory.mktemp("calibrate")
    (d / "swap").mkdir()
    path = d / "profile.json"
    assert main(["calibrate", "--quick", "--swap-dir", str(d / "swap"), "--device", "cpu", "--out", str(path)]) == 0
    assert os.listdir(d / "swap") == []  # the measurement's swap file is gone
    return path


def test_calibrate_measures_every_engine(profile_path):
    profile = load_profile(str(profile_path))
    assert profile.device == "cpu" and len(profile.drives) == 1 and profile.cpu_cores >= 1
    assert profile.drives[0].read_gbps > 0.01 and profile.drives[0].write_gbps > 0.01
    assert all(rate > 1e6 for rate in profile.adam_params_per_s.values())
    assert profile.h2d_gbps > 0.1 and profile.d2h_gbps > 0.1 and profile.matmul_tflops > 0
    assert [w for w, _, _, _ in profile.block_tflops] == [256, 512]
    assert all(m > 0 and a > 0 and o >= 0 for _, m, a, o in profile.block_tflops)
    assert MachineProfile(**json.loads(profile_path.read_text())) == profile  # the JSON round-trips
    assert "measured by nvoffload calibrate --quick" in profile.source


def test_plan_json_has_the_documented_shape(profile_path, capsys):
    args = ["plan", "--preset", "small", "--batch-size", "4", "--cpu-memory", "64M", "--device-memory", "1G"]
    assert main([*args, "--profile", str(profile_path), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["step_s"] > 0 and result["tokens_per_s"] == pytest.approx(4 * 128 / result["step_s"])
    assert result["bottleneck"] in ("compute", "cpu adam", "checksums", "nvme", "copies")
    assert set(result["memory_bytes"]) == {"device", "host", "nvme"} and result["fits"] is True
    assert result["stream"] is False  # 3M parameters fit the device budget
    assert main([*args, "--profile", str(profile_path)]) == 0
    assert "bottleneck" in capsys.readouterr().out


def test_an_impossible_request_is_refused_with_the_reason(capsys):
    rc = main(["plan", "--preset", "gpt2-1.3b", "--profile", "rtx4090-256g-2xgen4", "--cpu-memory", "64M", "--json"])
    result = json.loads(capsys.readouterr().out)
    assert rc == 2 and not result["fits"]
    assert any("raise cpu_memory_bytes to at least" in reason for reason in result["reasons"])
    rc = main(["plan", "--preset", "tiny", "--seq-len", "100000", "--profile", "rtx4090-256g-2xgen4"])
    assert rc == 2 and "exceeds the model's context of 64" in capsys.readouterr().out
    assert main(["plan", "--profile", "no-such-machine"]) == 2
    assert "give a JSON file from 'nvoffload calibrate'" in capsys.readouterr().err


def test_the_planner_chooses_streaming_and_activation_offload_by_the_budgets():
    profile = BUILTIN_PROFILES["h100-sxm-512g-4xgen4"]
    shape = ModelShape.from_preset("gpt2-1.3b")
    roomy = plan(PlanRequest(shape, 4, 1024, dtype="bfloat16", cpu_memory_bytes=64 << 30, device_memory_bytes=70 << 30), profile)
    assert (roomy.stream, roomy.offload_activations, roomy.fits) == (False, False, True)
    tight_request = PlanRequest(shape, 4, 1024, dtype="bfloat16", cpu_memory_bytes=64 << 30, device_memory_bytes=2 << 30)
    tight = plan(tight_request, profile, recompute=False)  # as finetune --plan auto
    assert (tight.stream, tight.activations, tight.fits) == (True, "offload", True)
    assert tight.nvme_read_bytes > roomy.nvme_read_bytes  # the activations
    config = tight.offload_config(["/tmp"])
    assert config.offload_activations and config.device_memory_bytes == 2 << 30
    assert config.activation_memory_bytes == tight.activation_memory_bytes < 2 << 30
    recomputed = plan(tight_request, profile)  # recomputing costs a third more compute, no NVMe traffic
    assert recomputed.activations == "recompute" and recomputed.step_s < tight.step_s
    assert recomputed.engine_s["compute"] == pytest.approx(4 / 3 * tight.engine_s["compute"])


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_model_shapes_from_hugging_face_configs_count_the_parameters(tmp_path, kind):
    transformers = pytest.importorskip("transformers")
    if kind == "gpt2":
        config = transformers.GPT2Config(n_layer=3, n_embd=64, n_head=4, vocab_size=500, n_positions=128)
    else:
        config = transformers.LlamaConfig(num_hidden_layers=3, hidden_size=64, intermediate_size=172, num_attention_heads=4,
                                          num_key_value_heads=2, vocab_size=500, tie_word_embeddings=False)  # fmt: skip
    model = transformers.AutoModelForCausalLM.from_config(config)
    config.save_pretrained(tmp_path)
    shape = ModelShape.from_hf_config(tmp_path)
    assert (shape.n_layer, shape.d_model, shape.gated_mlp) == (3, 64, kind == "llama")
    assert shape.params == pytest.approx(model.num_parameters(), rel=0.03)


def test_finetune_plan_auto_follows_the_plan(profile_path, tmp_path, capsys):
    swap = tmp_path / "swap"
    swap.mkdir()
    base = ["finetune", "--preset", "tiny", "--steps", "2", "--batch-size", "2", "--swap-dir", str(swap), "--no-progress",
            "--plan", "auto", "--profile", str(profile_path)]  # fmt: skip
    assert main([*base, "--device-memory", "1150K", "--cpu-memory", "8M"]) == 0  # below weights + gradients
    out = capsys.readouterr().out
    assert "plan: stream True, offload activations True" in out and "step 2:" in out
    assert main([*base, "--device-memory", "4K"]) == 2
    assert "the plan does not fit" in capsys.readouterr().err


def test_profiles_are_checked():
    with pytest.raises(ValueError, match="device must be 'cuda' or 'cpu'"):
        MachineProfile(**{**json.loads(BUILTIN_PROFILES["h200-1t-4xgen5"].to_json()), "device": "tpu"})
    with pytest.raises(ValueError, match="positive number of GB/s"):
        MachineProfile(**{**json.loads(BUILTIN_PROFILES["h200-1t-4xgen5"].to_json()), "drives": [{"read_gbps": 0, "write_gbps": 1}]})
    with pytest.raises(ValueError, match="needs at least one swap directory|give at least one swap directory"):
        calibrate([])
