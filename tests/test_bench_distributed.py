"""bench/bench_distributed.py --quick: every case runs, on 1 and 2 ranks, and the report holds what it says."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))


def test_quick_run_reports_every_case_and_halved_optimizer_bytes(tmp_path):
    import bench_distributed

    path = bench_distributed.main(["--quick", "--results-dir", str(tmp_path)])
    record = json.loads(path.read_text())
    rows = {row["case"]: row for row in record["rows"]}
    assert set(rows) == {f"{case} x{ranks}" for case, ranks in bench_distributed.CASES}
    for engine in ("optimizer", "streaming"):  # each of 2 ranks moves half of the optimizer's bytes
        one, two = rows[f"{engine} x1"], rows[f"{engine} x2"]
        assert one["optimizer_nvme_GB_per_rank_step"] > 0
        assert abs(two["optimizer_nvme_GB_per_rank_step"] / one["optimizer_nvme_GB_per_rank_step"] - 0.5) < 0.02
        assert two["vs_1_rank"] == one["step_s"] / two["step_s"]
    assert rows["ddp x2"]["optimizer_nvme_GB_per_rank_step"] == 0
    assert all(len(spans) == 2 for name, spans in record["spans"].items() if name.endswith("x2"))  # both ranks' steps
    assert record["eight_gpu_plan"]["fits"] and record["eight_gpu_plan"]["step_s"] > 0
    assert (tmp_path / "bench_distributed.png").stat().st_size > 0
