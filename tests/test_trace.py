"""Traces of where the time went: valid Chrome trace-event JSON (what Perfetto opens), a track per engine, and
spans that match what the step did."""

from __future__ import annotations

import json
import os

import pytest
import torch
from test_streaming import batch, config

import nvoffload
from nvoffload import trace
from nvoffload.cli import main
from nvoffload.models import GPT, GPTConfig


def check_trace_events(path) -> dict[str, list[dict]]:
    """Check ``path`` against the trace-event format (JSON object form, complete "X" and metadata "M" events);
    returns the complete events by track name."""
    with open(path) as f:
        record = json.load(f)
    assert set(record) == {"traceEvents", "displayTimeUnit"} and record["displayTimeUnit"] in ("ms", "ns")
    names: dict[int, str] = {}
    spans: dict[str, list[dict]] = {}
    for event in record["traceEvents"]:
        assert event["ph"] in ("X", "M") and isinstance(event["name"], str)
        assert isinstance(event["pid"], int) and isinstance(event["tid"], int)
        if event["ph"] == "M":
            assert event["name"] in ("process_name", "thread_name", "thread_sort_index") and "args" in event
            if event["name"] == "thread_name":
                names[event["tid"]] = event["args"]["name"]
            continue
        assert isinstance(event["ts"], (int, float)) and isinstance(event["dur"], (int, float)) and event["dur"] >= 0
        spans.setdefault(event["tid"], []).append(event)
    assert set(spans) <= set(names)  # every span is on a named track
    return {names[tid]: events for tid, events in spans.items()}


def test_a_streamed_step_on_every_track(tmp_path):
    cfg = GPTConfig.preset("small")
    torch.manual_seed(0)
    model = GPT(cfg)
    model, opt = nvoffload.initialize(
        model, torch.optim.AdamW(model.parameters()), config(tmp_path, model, offload_activations=True)
    )  # fmt: skip
    x, y = batch(cfg, 0)
    model(x, y).backward()
    opt.step()
    opt.zero_grad()
    with trace.tracing(tmp_path / "step.json") as recording:
        model(x, y).backward()
        opt.step()
        opt.zero_grad()
    opt.close()
    tracks = check_trace_events(tmp_path / "step.json")
    assert set(tracks) == set(trace.TRACKS)
    compute = [e["name"] for e in tracks["compute"]]
    blocks = range(cfg.n_layer)
    assert {f"forward {i}" for i in blocks} | {f"backward {i}" for i in blocks} <= set(compute)
    assert compute.index("forward 0") < compute.index(f"forward {cfg.n_layer - 1}") < compute.index("backward 0")
    updated = {int(e["name"].split()[1]) for e in tracks["adam"]}  # "parameter <index> chunk <index>"
    assert updated == set(range(sum(1 for p in model.parameters() if p.requires_grad)))  # every parameter
    assert all(e["args"]["bytes"] > 0 for name in ("nvme read", "nvme write", "h2d", "d2h") for e in tracks[name])
    end_us = max(e["ts"] + e["dur"] for events in tracks.values() for e in events)
    assert min(e["ts"] for events in tracks.values() for e in events) >= 0
    assert end_us / 1e6 < (recording.spans()[-1][3] + 60)
    with pytest.raises(RuntimeError, match="already being recorded"):
        with trace.tracing(), trace.tracing():
            pass
    assert trace.active() is None


def test_offload_config_traces_the_session_until_close(tmp_path):
    cfg = GPTConfig.preset("tiny")
    model = GPT(cfg)
    path = tmp_path / "session.json"
    model, opt = nvoffload.initialize(model, torch.optim.AdamW(model.parameters()), config(tmp_path, model, trace_path=str(path)))
    model(*batch(cfg, 0)).backward()
    opt.step()
    assert trace.active() is not None and not path.exists()
    opt.close()
    assert trace.active() is None
    tracks = check_trace_events(path)
    assert {"compute", "adam", "nvme write"} <= set(tracks)  # the blocks written when built; all cached since
    with pytest.raises(ValueError, match="trace_path: the directory"):
        nvoffload.OffloadConfig(swap_dirs=[tmp_path], trace_path=str(tmp_path / "absent" / "t.json"))


def test_finetune_traces_its_second_step(tmp_path, capsys):
    swap = tmp_path / "swap"
    swap.mkdir()
    path = tmp_path / "finetune.json"
    # 2M: too little host memory to keep any optimizer state resident, so the state moves through NVMe
    rc = main(["finetune", "--preset", "tiny", "--steps", "3", "--batch-size", "2", "--stream", "--swap-dir", str(swap),
               "--cpu-memory", "2M", "--trace", str(path), "--no-progress"])  # fmt: skip
    assert rc == 0
    tracks = check_trace_events(path)
    assert {"compute", "adam", "nvme read", "nvme write", "h2d"} <= set(tracks)
    assert sum(e["name"].startswith("forward") for e in tracks["compute"]) == GPTConfig.preset("tiny").n_layer
    assert trace.active() is None and os.listdir(swap) == []


def test_work_under_way_when_the_recording_starts_is_recorded_from_its_start():
    """An update or a read ahead that began before ``start()`` (a worker thread, a busy machine) is clipped to
    the recording; one that ended before it is left out (a span at a negative time failed a busy run)."""
    recording = trace.Trace()
    t0 = recording.start_ns
    recording.add("adam", "under way", t0 - 3_000_000, t0 + 1_000_000)
    recording.add("adam", "done before", t0 - 3_000_000, t0 - 1_000_000)
    recording.add("adam", "after", t0 + 2_000_000, t0 + 4_000_000)
    spans = recording.spans()
    assert [(name, start, end) for _, name, start, end, _ in spans] == [("under way", 0.0, 0.001), ("after", 0.002, 0.004)]
