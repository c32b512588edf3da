"""Smoke run of bench/bench_io.py: every case runs on one and two directories and reports sane numbers."""

import importlib
import json
import shutil
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench"


def test_bench_io_quick(tmp_path, monkeypatch, capsys):
    monkeypatch.syspath_prepend(str(BENCH))
    bench = importlib.import_module("bench_io")
    dirs = [tmp_path / "a", tmp_path / "b"]
    for d in dirs:
        d.mkdir()
    path = bench.main(["--quick", "--dirs", ",".join(map(str, dirs)), "--thread-sweep", "1",
                       "--results-dir", str(tmp_path / "results")])  # fmt: skip
    record = json.loads(Path(path).read_text())
    rows = {row["case"]: row for row in record["rows"]}
    expected = {"TensorStore x1", "TensorStore unaligned x1", "torch.save/load x1", "numpy tofile/fromfile x1"}
    expected |= {"TensorStore x2", "TensorStore unaligned x2", "TensorStore crc32c x1", "TensorStore crc32c x2"}
    expected |= {f"TensorStore{crc} {n} threads x1" for crc in ("", " crc32c") for n in (1,)}  # first directory only
    have_fio = shutil.which("fio") is not None
    if have_fio:
        expected |= {"fio x1", "fio x2"}
    else:
        assert "fio peer skipped" in capsys.readouterr().out
    assert set(rows) == expected
    for row in rows.values():
        assert 0.01 < row["write_GBps"] < 1000 and 0.01 < row["read_GBps"] < 1000, row
        if have_fio:
            assert row["write_vs_fio"] > 0 and row["read_vs_fio"] > 0
    if have_fio:
        assert rows["fio x1"]["write_vs_fio"] == 1.0
    assert record["settings"]["total_bytes"] == 256 << 20
    hashes = {row["case"]: row for row in record["checksums"]}
    assert set(hashes) == {"crc32c native (SSE4.2)", "crc32c native (table)", "zlib.crc32", "memory read (limit)"}
    assert all(row["GBps"] > 0.01 for row in hashes.values()) and hashes["zlib.crc32"]["vs_zlib"] == 1.0
    scaling = {row["threads"]: row for row in record["thread_scaling"]}
    assert set(scaling) == {1}
    for n, row in scaling.items():
        assert row["write_crc_ratio"] == rows[f"TensorStore crc32c {n} threads x1"]["write_GBps"] / row["write_GBps"]
        assert row["read_crc_ratio"] == rows[f"TensorStore crc32c {n} threads x1"]["read_GBps"] / row["read_GBps"]
    assert (tmp_path / "results" / "bench_io.md").exists()
    assert sorted(p.name for d in dirs for p in d.iterdir()) == []  # every scratch file removed
