import importlib
import json
from pathlib import Path

BENCH = Path(__file__).resolve().parent.parent / "bench"


def quick_record(tmp_path, monkeypatch, name: str) -> dict:
    """``bench/<name>.py --quick``'s JSON record, its swap files and results under ``tmp_path``."""
    monkeypatch.syspath_prepend(str(BENCH))
    bench = importlib.import_module(name)
    path = bench.main(["--quick", "--swap-dir", str(tmp_path), "--results-dir", str(tmp_path / "results")])
    return json.loads(Path(path).read_text())


def test_bench_vertical_quick(tmp_path, monkeypatch):
    record = quick_record(tmp_path, monkeypatch, "bench_vertical")
    rows = {r["case"]: r for r in record["rows"]}
    assert list(rows) == ["G = 1", "G = 4, vertical", "G = 4, micro-batch after micro-batch"]
    assert rows["G = 1"]["vs_g1"] == 1.0 and all(r["tokens_per_s"] > 0 for r in rows.values())
    assert [len(record["steps"][name]) for name in rows] == [3, 3, 3]
    # micro-batch after micro-batch keeps the fp32 gradient sums in the store: more bytes a step than vertical
    assert rows["G = 4, micro-batch after micro-batch"]["written_gb_per_step"] > rows["G = 4, vertical"]["written_gb_per_step"]
    assert (tmp_path / "results" / "bench_vertical.png").stat().st_size > 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["results"]  # the swap files are gone


def test_bench_stash_quick(tmp_path, monkeypatch):
    """bench/bench_stash.py --quick: its two cases, the budgets as issue 51 states them, the plot, nothing left."""
    record = quick_record(tmp_path, monkeypatch, "bench_stash")
    rows = {r["case"]: r for r in record["rows"]}
    assert list(rows) == ["G = 2, inputs on the device", "G = 8, inputs in the stash"]
    assert rows["G = 2, inputs on the device"]["vs_g2"] == 1.0 and all(r["tokens_per_s"] > 0 for r in rows.values())
    assert [len(record["steps"][name]) for name in rows] == [3, 3]
    settings = record["settings"]  # the device budget holds two micro-batches' block inputs, the stash eight
    inputs = settings["block_inputs_per_micro_batch_bytes"]
    assert settings["device_memory_bytes"] >= settings["streaming_needs_bytes"] + 2 * inputs
    assert settings["stash_host_bytes"] == 8 * inputs
    assert (tmp_path / "results" / "bench_stash.png").stat().st_size > 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["results"]  # the swap files are gone
