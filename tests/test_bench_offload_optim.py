"""Smoke run of bench/bench_offload_optim.py: every case runs and reports sane numbers."""

import importlib
import json
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"
HAS_STORE = hasattr(importlib.import_module("nvoffload.io"), "TensorStore")


@pytest.mark.skipif(not HAS_STORE, reason="nvoffload.io.TensorStore not available")
def test_bench_offload_optim_quick(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    bench = importlib.import_module("bench_offload_optim")
    path = bench.main(["--quick", "--results-dir", str(tmp_path), "--swap-dir", str(tmp_path)])
    record = json.loads(Path(path).read_text())
    rows = {row["case"]: row for row in record["rows"]}
    assert list(rows) == bench.CASES
    for row in rows.values():
        assert row["step_s"] > 0 and row["peak_rss_mib"] > 0 and row["params_m"] == rows["full"]["params_m"]
    assert rows["optim"]["io_gb_per_s"] > 0 and rows["full"]["io_gb_per_s"] > 0
    assert 0 < rows["optim"]["host_staging_mib"] <= 16
    assert rows["full"]["overlap"] > 0 and "overlap =" in record["notes"]
    assert rows["full_delayed"]["overlap"] > 0 and "full_delayed / full =" in record["notes"]
    for case in ("full", "full_delayed"):  # each traced: its compute, its updates and its store traffic
        tracks = {span[0] for span in record["timelines"][case]}
        assert {"compute", "adam", "nvme write"} <= tracks, (case, tracks)
    assert (tmp_path / "bench_offload_optim.png").exists()
