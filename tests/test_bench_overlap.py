"""Smoke run of bench/bench_overlap.py: the three cases run, and the timeline holds every block's compute and copy."""

import importlib
import json
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench"


def test_bench_overlap_quick(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    bench = importlib.import_module("bench_overlap")
    out = bench.main(["--quick", "--device", "cpu", "--results-dir", str(tmp_path)])
    record = json.loads((tmp_path / "bench_overlap.json").read_text())
    seconds = {row["case"]: row["seconds"] for row in record["rows"]}
    assert all(s > 0 for s in seconds.values())
    assert seconds["max(compute, copies)"] == max(seconds["compute"], seconds["copies"])
    assert seconds["compute + copies"] == seconds["compute"] + seconds["copies"]
    assert seconds["streamed: compute waiting for copies"] < seconds["streamed"]
    bound = seconds["per phase: max(compute, copies) forward + backward"]
    assert seconds["max(compute, copies)"] <= bound <= seconds["compute + copies"]
    assert record["ratios"]["streamed/sum"] < record["ratios"]["streamed/max"]
    layers = 3
    # the traced step: every block computed forward and backward, and was copied to the device for each
    computed = [name for track, name, *_ in out["spans"] if track == "compute" and not name.startswith("wait")]
    assert sorted(computed) == sorted(f"{what} {i}" for what in ("forward", "backward") for i in range(layers))
    h2d = [span for span in out["spans"] if span[0] == "h2d"]
    assert len(h2d) == 2 * layers - 1 and all(end >= start for _, _, start, end, _ in h2d)  # the last block stays
    assert (tmp_path / "bench_overlap.png").stat().st_size > 0 and (tmp_path / "bench_overlap.md").exists()
