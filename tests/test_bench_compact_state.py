"""Smoke run of bench/bench_compact_state.py: it runs end to end and writes the bytes each state form moves."""

import importlib.util
import json
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench" / "bench_compact_state.py"


def test_bench_compact_state_quick(tmp_path):
    pytest.importorskip("transformers")
    spec = importlib.util.spec_from_file_location("bench_compact_state", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    record = json.loads(module.main(["--quick", "--swap-dir", str(tmp_path), "--results-dir", str(tmp_path / "out")]).read_text())
    moved = {r["case"]: (r["read_bytes_per_param"], r["written_bytes_per_param"]) for r in record["rows"]}
    eight_read, eight_written = moved.pop("8bit")  # the codes, and their blocks' scales: 2 bytes a block of 256
    assert moved == {"fp32": (12, 12), "bf16-moments": (8, 8), "bf16": (4, 6)}  # bf16 weights: the optimizer's counters
    assert 2 < eight_read < 2.05 and eight_written == eight_read + 2
    assert [r["bytes_vs_exact"] for r in record["rows"][:3]] == [1.0, 16 / 24, 10 / 24]
    assert {r["model"] for r in record["convergence"]} == {"tiny, 4 steps", "small Llama, 4 steps"}
    for row in record["convergence"]:
        assert row["final_loss"] > 0
        assert row["largest_gap"] >= 0 and (row["case"] != "fp32" or row["largest_gap"] == 0)
    assert all(len(losses) == 4 for curves in record["curves"].values() for losses in curves.values())
    for curves in record["curves"].values():  # the delayed update: the first step's loss is exact AdamW's, then not
        assert set(curves) == {"fp32", "bf16-moments", "bf16", "8bit", "delayed", "delayed after 30"}
        assert curves["delayed after 30"] == curves["fp32"]  # 4 steps: all of them before the delay starts
        assert curves["delayed"][0] == curves["fp32"][0] and curves["delayed"][1:] != curves["fp32"][1:]
    assert (tmp_path / "out" / "bench_compact_state.png").exists()
