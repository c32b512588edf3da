"""Smoke run of bench/bench_activations.py: every case runs and reports sane numbers."""

import importlib
import json
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"
HAS_STORE = hasattr(importlib.import_module("nvoffload.io"), "TensorStore")


def test_bench_activations_quick(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    bench = importlib.import_module("bench_activations")
    cases = bench.CASES if HAS_STORE else [c for c in bench.CASES if c not in ("nvme", "spill")]
    path = bench.main(["--quick", "--cases", ",".join(cases), "--results-dir", str(tmp_path), "--swap-dir", str(tmp_path)])
    record = json.loads(Path(path).read_text())
    rows = {row["case"]: row for row in record["rows"]}
    assert list(rows) == cases
    none = rows["none"]
    for row in rows.values():
        assert row["step_s"] > 0 and row["peak_rss_mib"] > 0
        assert row["loss"] == pytest.approx(none["loss"], rel=1e-6)  # same model, same data
    assert none["saved_peak_mib"] > 0 and none["moved_mib_per_step"] == 0
    for case in ("cpu", "nvme"):
        if case in rows:
            assert rows[case]["moved_mib_per_step"] > 0
            assert rows[case]["saved_peak_mib"] < 0.5 * none["saved_peak_mib"]
    if "spill" in rows:  # 1 MiB of the tensors kept in host memory, the rest to NVMe, the same tensors moved
        nvme, spill = rows["nvme"], rows["spill"]
        assert spill["moved_mib_per_step"] == nvme["moved_mib_per_step"] == nvme["nvme_mib_per_step"]
        assert 0 < spill["nvme_mib_per_step"] <= spill["moved_mib_per_step"] - 0.5
    assert rows["cpu"]["nvme_mib_per_step"] == 0
    assert rows["checkpoint"]["saved_peak_mib"] < none["saved_peak_mib"]
    assert (tmp_path / "bench_activations.md").exists()
