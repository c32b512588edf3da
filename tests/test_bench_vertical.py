import importlib
import json
from pathlib import Path

BENCH = Path(__file__).resolve().parent.parent / "bench"


def test_bench_vertical_quick(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    bench = importlib.import_module("bench_vertical")
    path = bench.main(["--quick", "--swap-dir", str(tmp_path), "--results-dir", str(tmp_path / "results")])
    record = json.loads(Path(path).read_text())
    rows = {r["case"]: r for r in record["rows"]}
    assert list(rows) == ["G = 1", "G = 4, vertical", "G = 4, micro-batch after micro-batch"]
    assert rows["G = 1"]["vs_g1"] == 1.0 and all(r["tokens_per_s"] > 0 for r in rows.values())
    assert [len(record["steps"][name]) for name in rows] == [3, 3, 3]
    # micro-batch after micro-batch keeps the fp32 gradient sums in the store: more bytes a step than vertical
    assert rows["G = 4, micro-batch after micro-batch"]["written_gb_per_step"] > rows["G = 4, vertical"]["written_gb_per_step"]
    assert (tmp_path / "results" / "bench_vertical.png").stat().st_size > 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["results"]  # the swap files are gone
