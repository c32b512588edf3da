"""bench/gpu_scale.py, the prepared scale run, in its dry mode on the CPU stand-in: every case runs at a tiny shape
and records real figures (checked here against what they are computed from), a case that fails leaves the others'
results, and a case the budget cannot hold is skipped with its reason; so the script cannot rot between the GPUs
it is lent."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from nvoffload.planner import BUILTIN_PROFILES

transformers = pytest.importorskip("transformers")

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "bench" / "gpu_scale.py"


def tiny_llama() -> torch.nn.Module:
    """The dry run's model, built here from its numbers (not from the script's table)."""
    config = transformers.LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=172, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=4, tie_word_embeddings=False,
    )  # fmt: skip
    with torch.device("meta"):
        return transformers.LlamaForCausalLM(config)


def dry_run(tmp_path, *args) -> tuple[subprocess.CompletedProcess, Path]:
    out = tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--dry", "--results-dir", str(out), "--swap-dir", str(tmp_path), *args],
        env=env, capture_output=True, text=True, check=False, timeout=400,
    )  # fmt: skip
    return done, out


@pytest.mark.slow
def test_the_dry_run_measures_every_case_and_records_its_figures(tmp_path):
    done, out = dry_run(tmp_path)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    record = json.loads((out / "gpu_scale.json").read_text())
    cases = record["cases"]
    assert list(cases) == ["calibrate", "ram", "overlap", "gds", "nvme"]
    assert {name: case["status"] for name, case in cases.items()} == dict.fromkeys(cases, "passed")
    assert record["profile"]["device"] == "cpu" and record["profile"]["h2d_gbps"] > 0  # calibrated in the run

    model = tiny_llama()
    params = sum(p.numel() for p in model.parameters())
    matmul = params - model.get_input_embeddings().weight.numel()  # the input embedding is a lookup
    flops_per_token = 6 * matmul + 12 * 4 * 64 * 32  # + attention: layers x d_model x seq_len
    for name in ("ram", "nvme"):
        case = cases[name]
        assert case["params"] == params and case["layers"] == 4
        timed = [s for s in case["steps"] if not s["warmup"]]
        assert len(timed) == 3 and all(s["step_s"] > 0 and s["loss"] > 0 for s in timed)
        assert case["tokens_per_step"] == 2 * 32 and case["tokens_per_s"] == pytest.approx(64 / case["step_s"])
        assert case["model_tflops"] == pytest.approx(flops_per_token * 64 / case["step_s"] / 1e12)
        parts = case["bound_parts_s"]
        assert {"compute alone", "CPU Adam", "copies"} <= set(parts) and min(parts.values()) > 0
        assert case["bound_s"] == max(parts.values()) and parts[case["bound_by"]] == case["bound_s"]
        assert case["step_vs_bound"] == pytest.approx(case["step_s"] / case["bound_s"])
        assert case["planned"]["shape_params"] == params  # the planner's shape, from the model's config.json
        assert case["planned_step_s"] > 0 and case["planned_vs_measured"] == pytest.approx(case["planned_step_s"] / case["step_s"])
    formula = record["flops_formula"]  # stated with its figures
    assert f"6 x {matmul} parameters" in formula and "12 x 4 layers x 64 d_model x 32 tokens" in formula
    assert f"{flops_per_token:.4g} FLOPs" in formula

    ram, nvme = cases["ram"], cases["nvme"]
    # RAM: the whole exact AdamW state resident (12 bytes a parameter), every block cached: nothing moves on NVMe
    assert ram["resident_state_bytes"] == 12 * params and ram["state_in_store_bytes"] == 0
    assert all(s["nvme_read_bytes"] == s["nvme_written_bytes"] == 0 for s in ram["steps"] if not s["warmup"])
    # NVMe: at least --nvme-state (2 MiB in the dry run) of state in the store at a step's peak, and each step reads
    # and writes exactly the generation that is not resident (the weights stay cached)
    assert 2 * nvme["state_in_store_bytes"] >= 2 << 20 and nvme["resident_state_bytes"] > 0
    for step in (s for s in nvme["steps"] if not s["warmup"]):
        assert step["nvme_read_bytes"] == step["nvme_written_bytes"] == nvme["state_in_store_bytes"]
    nvme_parts = nvme["bound_parts_s"]
    drive = record["profile"]["drives"][0]
    assert nvme_parts["NVMe (reads then writes, one drive)"] == pytest.approx(
        nvme["state_in_store_bytes"] * (1 / drive["read_gbps"] + 1 / drive["write_gbps"]) / 1e9
    )

    # one streamed step's timeline: every engine's lane, as Perfetto JSON and drawn
    events = json.loads((out / "gpu_scale_trace.json").read_text())["traceEvents"]
    lanes = {e["tid"]: e["args"]["name"] for e in events if e.get("name") == "thread_name"}
    assert {"compute", "h2d", "d2h", "adam"} <= {lanes[e["tid"]] for e in events if e.get("ph") == "X"}
    busy = ram["traced_busy_s"]  # each engine's time in that step, from the same spans
    assert {"compute", "h2d", "d2h", "adam"} <= set(busy) and 0 < busy["compute"] <= ram["traced_step_s"]
    assert (out / "gpu_scale.png").stat().st_size > 0 and (out / "gpu_scale_overlap.png").stat().st_size > 0

    overlap = cases["overlap"]
    assert overlap["settings"]["quick"] and overlap["seconds"]["compute"] > 0
    assert overlap["step_vs_bound"] == pytest.approx(overlap["seconds"]["streamed"] / overlap["seconds"]["compute"])

    gds = cases["gds"]
    tests = gds["tests"]  # collected and skipped here, each with its reason; none failed
    assert tests["collected"] >= 4 and tests["skipped"] == tests["collected"] and tests["failed"] == 0
    assert tests["skip_reasons"] and (out / "gds_tests.xml").exists()
    bounce = gds["paths"]["bounce buffer"]
    assert bounce["equal"] and bounce["write_gbps"] > 0 and bounce["read_gbps"] > 0 and bounce["bytes"] == 8 << 20
    assert "needs CUDA" in gds["paths"]["GPUDirect Storage"]["skipped"]

    table = (out / "gpu_scale.md").read_text()
    assert all(f"| {name} | passed |" in table for name in cases) and "Model FLOPs: tokens x (6 x" in table


def test_a_failing_case_keeps_the_others_results_and_fails_the_run(tmp_path, monkeypatch):
    """The RAM case cannot fit a 1 KiB host budget: it fails with the reason, the overlap case after it still runs
    and is recorded, and the run exits 1. A profile given (a built-in one) replaces the calibration."""
    monkeypatch.syspath_prepend(str(REPO / "bench"))
    gpu_scale = importlib.import_module("gpu_scale")
    profile = tmp_path / "profile.json"
    BUILTIN_PROFILES["h200-1t-4xgen5"].save(profile)
    threads = torch.get_num_threads()
    status = gpu_scale.main([
        "--dry", "--cases", "ram,overlap", "--host-memory", "1K", "--profile", str(profile),
        "--results-dir", str(tmp_path / "out"), "--swap-dir", str(tmp_path),
    ])  # fmt: skip
    assert status == 1 and torch.get_num_threads() == threads  # the dry run's one thread is given back
    record = json.loads((tmp_path / "out" / "gpu_scale.json").read_text())
    assert list(record["cases"]) == ["ram", "overlap"]  # no calibration: the profile was given
    assert record["profile"]["name"] == BUILTIN_PROFILES["h200-1t-4xgen5"].name
    ram, overlap = record["cases"]["ram"], record["cases"]["overlap"]
    assert ram["status"] == "failed" and "--host-memory 1024" in ram["error"]
    assert [r["layers"] for r in ram["refused"]] == [4, 3, 2, 1]  # each count tried, from the model's 4 down
    assert overlap["status"] == "passed" and overlap["seconds"]["streamed"] > 0


def test_a_case_the_budget_cannot_hold_is_skipped_with_its_reason(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(REPO / "bench"))
    gpu_scale = importlib.import_module("gpu_scale")
    results = gpu_scale.Results(tmp_path, {"dry": True, "machine": {"date": "now"}, "environment": {}, "settings": {"budget_s": 5}, "cases": {}})
    ran = []
    case = results.run_case("nvme", 10.0, gpu_scale.Budget(5.0), ran.append)
    assert ran == [] and case["status"] == "skipped" and "the case needs about 10 s" in case["reason"]
    assert json.loads((tmp_path / "gpu_scale.json").read_text())["cases"]["nvme"]["status"] == "skipped"


@pytest.mark.parametrize("args, message", [
    (["--cases", "ram,bogus"], "unknown bogus"), (["--layers", "0"], "--layers must be at least 1"),
    (["--swap-dir", "/no/such/dir"], "not a directory"), (["--nvme-state", "lots"], "not a size"),
])  # fmt: skip
def test_bad_arguments_are_refused_with_status_2_and_nothing_written(tmp_path, monkeypatch, capsys, args, message):
    monkeypatch.syspath_prepend(str(REPO / "bench"))
    gpu_scale = importlib.import_module("gpu_scale")
    with pytest.raises(SystemExit) as exited:
        gpu_scale.main(["--dry", "--results-dir", str(tmp_path / "out"), *args])
    assert exited.value.code == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
    if not torch.cuda.is_available():  # the GPU run without a GPU points at the dry run
        with pytest.raises(SystemExit) as exited:
            gpu_scale.main(["--results-dir", str(tmp_path / "out")])
        assert exited.value.code == 2 and "--dry" in capsys.readouterr().err
