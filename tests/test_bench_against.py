"""bench/against.py: a benchmark run in two checkouts (here the same one) reports each ratio before and after with
its spread, and a script that would write into a checkout's bench/results is refused before anything runs."""

import importlib
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def against(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    return importlib.import_module("against")


def test_against_reports_each_ratio_before_and_after(tmp_path, against):
    status = against.main(["--against", str(ROOT), "--rounds", "1", "--name", "smoke", "--results-dir", str(tmp_path),
                           "bench_overlap.py --quick --device cpu"])  # fmt: skip
    assert status == 0
    record = json.loads((tmp_path / "smoke.json").read_text())
    assert [(run["side"], run["failed"]) for run in record["runs"]] == [("before", ""), ("after", "")]
    rows = {(row["case"], row["metric"]): row for row in record["rows"]}
    assert {("ratios", "streamed/max"), ("ratios", "streamed/sum"), ("streamed", "seconds"), ("compute", "seconds")} <= set(rows)
    for row in rows.values():  # one round: each side's range is its one value
        assert row["before"] > 0 and row["after"] > 0
        assert row["after/before"] == pytest.approx(row["after"] / row["before"])
        assert row["before range"] == f"{row['before']:.3g}-{row['before']:.3g}"
        assert row["beyond spread"] in ("", "worse", "better")
    values = {(v["case"], v["metric"]): v for v in record["values"]}
    assert values[("ratios", "streamed/max")]["before"] == [rows[("ratios", "streamed/max")]["before"]]
    assert record["settings"]["commits"]["before"] == record["settings"]["commits"]["after"]
    assert (tmp_path / "smoke.md").read_text().count("\n| bench_overlap |") == len(rows)
    assert (tmp_path / "smoke.png").stat().st_size > 0
    # the report rewritten from its JSON, running nothing, is the same report
    (tmp_path / "smoke.png").unlink()
    assert against.main(["--replot", str(tmp_path / "smoke.json")]) == 0
    replotted = json.loads((tmp_path / "smoke.json").read_text())
    assert replotted["rows"] == record["rows"] and replotted["values"] == record["values"]
    assert replotted["notes"] == record["notes"] and (tmp_path / "smoke.png").stat().st_size > 0


def test_against_refuses_a_script_without_results_dir(tmp_path, against, capsys):
    with pytest.raises(SystemExit) as refused:
        against.main(["--against", str(ROOT), "--results-dir", str(tmp_path / "out"), "report.py"])
    assert refused.value.code == 2
    assert "takes no --results-dir" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_verdict_takes_the_direction_that_is_worse(against):
    assert against.verdict([1.0, 1.1], [1.2, 1.3], higher_worse=True) == "worse"
    assert against.verdict([1.0, 1.1], [1.2, 1.3], higher_worse=False) == "better"
    assert against.verdict([1.0, 1.2], [1.1, 1.3], higher_worse=True) == ""
