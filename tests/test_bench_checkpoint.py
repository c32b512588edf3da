"""Smoke run of bench/bench_checkpoint.py: both cases save and load, with sane figures, a background checkpoint
beside steps and killed twice resumes bit-identical, and everything is cleaned up."""

import importlib
import json
import os
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench"


def test_bench_checkpoint_quick(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    bench = importlib.import_module("bench_checkpoint")
    (tmp_path / "work").mkdir()
    path = bench.main(["--quick", "--dir", str(tmp_path / "work"), "--results-dir", str(tmp_path / "results")])
    record = json.loads(Path(path).read_text())
    rows = {row["case"]: row for row in record["rows"]}
    assert {"nvoffload", "torch.save"} <= set(rows)
    for name in ("nvoffload", "torch.save"):
        row = rows[name]
        assert 0 < row["GB"] < 0.1 and row["save_GBps"] > 0 and row["load_GBps"] > 0, row
    assert set(record["timelines"]) == {"nvoffload", "torch.save"}
    background = record["background"]  # a streamed model's background checkpoint, and kills during two
    assert background["steps_beside"] >= 1 and background["checkpoint_GBps"] > 0 and background["copy_GBps"] > 0
    assert 0 <= background["steps_rate_while_written"] <= 1, background  # a rate; the checkpoint may outlast a step
    assert background["kills"] == 2 and background["resume_bit_identical"], background
    if os.path.isdir("/sys/dev/block"):  # the drive's counters over each phase: the copy read and wrote its bytes
        copy = background["drive"]["copy"]
        assert copy["read_GB"] > 0 and copy["written_GB"] > 0 and 0 <= copy["busy"] <= 1.5, background["drive"]
        assert background["drive_demand"]["step_GB"] > 0, background["drive_demand"]
    assert (tmp_path / "results" / "bench_checkpoint.png").exists()
    assert os.listdir(tmp_path / "work") == []  # swap file, checkpoints and fio's file removed
