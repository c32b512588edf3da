"""Smoke run of bench/bench_adam.py: it runs end to end and writes sane figures."""

import importlib.util
import json
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench" / "bench_adam.py"


def load_bench():
    spec = importlib.util.spec_from_file_location("bench_adam", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_bench_adam_quick(tmp_path):
    path = load_bench().main(["--quick", "--repeats", "1", "--no-deepspeed", "--results-dir", str(tmp_path)])
    record = json.loads(path.read_text())
    rows = record["rows"]
    cases = {r["case"].split(" [")[0] for r in rows}
    assert {"bandwidth probe", "nvoffload kernel", "torch AdamW fused", "torch AdamW foreach",
            "torch convert+fused+copy"} <= cases
    assert {r["grads"] for r in rows} == {"fp32", "bf16+out", "bf16 moments", "bf16 weights", "8bit moments"}
    assert len({r["layout"] for r in rows}) == 2
    bytes_per_param = {"fp32": 28, "bf16+out": 28, "bf16 moments": 20, "bf16 weights": 14, "8bit moments": 10}
    for r in rows:
        assert r["params"] == 4 << 20
        assert r["ms"] > 0 and r["Mparams_per_s"] > 0
        assert abs(r["GB_per_s"] - bytes_per_param[r["grads"]] * r["Mparams_per_s"] / 1e3) < 1e-6 * r["GB_per_s"]
        assert 0 < r["of_bandwidth"] and 0 < r["vs_pytorch"]
        assert (r["vs_exact_kernel"] is not None) == (r["grads"] in ("bf16 moments", "bf16 weights", "8bit moments"))
    assert (tmp_path / "adam_quick.md").exists()
