"""Smoke run of bench/bench_memory.py (structure and sane values, not timings), and the chunked LM-head loss
that keeps the GPT's logits out of memory."""

import importlib
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from nvoffload.models.gpt import lm_head_loss

BENCH = Path(__file__).resolve().parents[1] / "bench"
MiB = 1 << 20


def test_bench_memory_quick(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    bench = importlib.import_module("bench_memory")
    path = bench.main(["--quick", "--cases", "torch,nvoffload", "--results-dir", str(tmp_path), "--swap-dir", str(tmp_path)])
    record = json.loads(Path(path).read_text())
    rows = {row["case"]: row for row in record["rows"]}
    assert list(rows) == ["torch", "nvoffload"]
    assert record["settings"]["cpu_memory_bytes"] == 8 * MiB and record["settings"]["n_params"] > 0

    for case, row in rows.items():
        assert 50 < row["imports_mib"] <= row["after_init_mib"] <= row["peak_rss_mib"] < 16 * 1024, row
        assert row["steady_peak_mib"] <= row["peak_rss_mib"]
        assert row["loss_last"] == pytest.approx(5.5, abs=0.5)  # ln(256): a freshly initialized byte-level model
        run = record["runs"][case]
        names = [p["phase"] for p in run["phases"]]
        built = "initialize" if case == "nvoffload" else "optimizer built"
        assert names == ["imports", "model built", built, "forward 1", "backward 1", "step 1",
                         "forward 2", "backward 2", "step 2"]  # fmt: skip
        for p in run["phases"]:
            assert p["phase_peak"] >= p["rss"] > 0
            assert p["file"] > 0 and p["heap"] >= 0 and p["anon_large"] >= 0
            assert p["file"] + p["heap"] + p["arenas"] + p["anon_large"] + p["stack"] <= 1.1 * p["phase_peak"] + 8 * MiB
        census = next(p for p in run["phases"] if p["phase"] == "step 1")
        assert census["t_params"] > 0
    step1 = next(p for p in record["runs"]["torch"]["phases"] if p["phase"] == "step 1")
    assert 2 * step1["t_params"] <= step1["t_optim"] <= 2 * step1["t_params"] + 4096  # AdamW's two moments, its steps
    nv = next(p for p in record["runs"]["nvoffload"]["phases"] if p["phase"] == "step 1")
    assert nv["host_tier_peak"] <= 8 * MiB and nv["device_tier_peak"] <= 8 * MiB and nv["t_optim"] == 0
    assert rows["nvoffload"]["vs_torch"] > 0 and rows["torch"]["vs_torch"] == 1
    assert rows["nvoffload"]["over_budgets_mib"] == pytest.approx(rows["nvoffload"]["peak_rss_mib"] - 16, abs=0.2)

    timeline = json.loads((tmp_path / "bench_memory_timeline.json").read_text())
    for samples in timeline.values():
        times = [t for t, _ in samples]
        assert len(samples) > 10 and times == sorted(times) and all(rss > 0 for _, rss in samples)
    assert (tmp_path / "bench_memory.md").exists()
    assert "## Phases" in (tmp_path / "bench_memory.md").read_text()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_lm_head_loss_chunked_equals_full_logits(dtype):
    torch.manual_seed(0)
    vocab = 300
    h = torch.randn(3, 50, 16, dtype=dtype, requires_grad=True)
    w = torch.randn(vocab, 16, dtype=dtype, requires_grad=True)
    t = torch.randint(0, vocab, (3, 50))
    t[0, :7] = -100  # ignored, as F.cross_entropy's default
    ref = F.cross_entropy(F.linear(h, w).view(-1, vocab), t.reshape(-1))
    ref_h, ref_w = torch.autograd.grad(ref * 3.0, (h, w))
    tol = dict(rtol=2e-2, atol=1e-3) if dtype == torch.bfloat16 else {}

    loss = lm_head_loss(h, w, t, chunk_elements=vocab * 16)  # 10 chunks of 16 rows
    assert loss.grad_fn is not None and "Chunked" in type(loss.grad_fn).__name__
    (loss * 3.0).backward(retain_graph=True)
    torch.testing.assert_close(loss, ref, **tol)
    torch.testing.assert_close(h.grad, ref_h, **tol)
    torch.testing.assert_close(w.grad, ref_w, **tol)
    h.grad = w.grad = None
    (loss * 3.0).backward()  # a retained graph's second backward recomputes the gradients
    torch.testing.assert_close(h.grad, ref_h, **tol)
    torch.testing.assert_close(w.grad, ref_w, **tol)
    with torch.no_grad():
        torch.testing.assert_close(lm_head_loss(h, w, t, chunk_elements=vocab * 16), ref.detach(), **tol)


def test_lm_head_loss_small_logits_are_the_plain_expression():
    torch.manual_seed(0)
    h = torch.randn(4, 64, 32, requires_grad=True)
    w = torch.randn(256, 32, requires_grad=True)
    t = torch.randint(0, 256, (4, 64))
    ref = F.cross_entropy(F.linear(h, w).view(-1, 256), t.reshape(-1))
    assert torch.equal(lm_head_loss(h, w, t), ref)  # one chunk: bit for bit what the model computed before
