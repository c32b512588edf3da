"""Smoke run of bench/bench_plan.py: calibrate, plan and measure each configuration, report the ratios."""

import importlib
import json
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[1] / "bench"


def test_bench_plan_quick(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    bench = importlib.import_module("bench_plan")
    path = bench.main(["--quick", "--swap-dir", str(tmp_path), "--results-dir", str(tmp_path / "results")])
    record = json.loads(Path(path).read_text())
    cases = [r["case"] for r in record["rows"]]
    assert cases[:3] == ["optimizer only", "streaming", "streaming, 4 micro-batches"]
    assert cases[3].startswith("finetune tiny: stream False")
    for row in record["rows"]:
        assert row["predicted_s"] > 0 and row["measured_s"] > 0
        assert row["ratio"] == row["predicted_s"] / row["measured_s"]
        assert row["tokens_per_s_predicted"] * row["predicted_s"] == pytest.approx(row["tokens_per_s_measured"] * row["measured_s"])
    assert "nvoffload finetune --preset tiny" in record["notes"]  # the command the plan was checked against
    assert "worst_ratio" in record and json.loads(record["profile"])["device"] == ("cuda" if torch.cuda.is_available() else "cpu")
    assert list(tmp_path.iterdir()) == [tmp_path / "results"]  # the swap files are gone
