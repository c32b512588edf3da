"""bench/gpu_check.sh, the prepared GPU check, in its dry run on the CPU stand-in: every step runs (each
benchmark's command line parsed by its own parser), every step has its row and status in the summary, and
the files it names exist; so the script cannot rot between the GPUs it is lent."""

import json
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "bench" / "gpu_check.sh"
BENCHMARKS = sorted(p.stem for p in (REPO / "bench").glob("bench_*.py"))


def check(tmp_path, *args, script=SCRIPT, **env) -> subprocess.CompletedProcess:
    """``bash script args...`` with this interpreter as its python and ``env`` added to the environment."""
    environ = {**os.environ, "PYTHON": sys.executable, "TMPDIR": str(tmp_path), **env}
    return subprocess.run(["bash", str(script), *args], env=environ, capture_output=True, text=True, check=False, timeout=540)


def summary_rows(summary: Path) -> dict[str, dict[str, str]]:
    """The summary's table: step -> its columns."""
    lines = [line for line in summary.read_text().splitlines() if line.startswith("| ")]
    keys = [cell.strip() for cell in lines[0].strip("|").split("|")]
    rows = [dict(zip(keys, (cell.strip() for cell in line.strip("|").split("|")))) for line in lines[1:]]
    return {row["step"]: row for row in rows}


@pytest.mark.slow
def test_the_dry_run_runs_every_step_and_the_summary_names_each_with_its_status_and_files(tmp_path):
    out = tmp_path / "out"
    done = check(tmp_path, "--dry-run", GPU_CHECK_OUT=str(out))
    assert done.returncode == 0, done.stdout + done.stderr
    rows = summary_rows(out / "summary.md")
    # every benchmark in bench/ has its step: a new one must be added to the script
    assert sorted(rows) == sorted(["build", "environment", "cuda_tests", "finetune_trace", "overlap_profiler", *BENCHMARKS])
    for step, row in rows.items():
        assert row["status"] == ("arguments ok" if step.startswith("bench_") else "passed"), row
        assert 0 <= int(row["seconds"]) <= int(row["limit (s)"]) + 5
        for name in row["files"].split():
            path = out / name
            assert path.exists() and (path.is_dir() or path.stat().st_size > 0), name
    assert "cpu-stand-in-dry-run" in (out / "summary.md").read_text().splitlines()[0]  # the device is named
    assert "Finished after" in (out / "summary.md").read_text()
    assert "native core imports" in (out / "build.log").read_text()  # built here: nothing rebuilt

    # the CUDA tests were selected and skip here, each with its reason, none failed
    suite = ET.parse(out / "cuda_tests.xml").getroot().find("testsuite")
    assert int(suite.get("tests")) >= 20 and int(suite.get("failures")) == int(suite.get("errors")) == 0
    assert int(suite.get("skipped")) >= 20
    # the streamed finetune wrote its trace; the profiler its Chrome trace and table; bench_overlap its results
    trace = json.loads((out / "finetune_trace.json").read_text())
    names = {e["tid"]: e["args"]["name"] for e in trace["traceEvents"] if e.get("name") == "thread_name"}
    timed = {names[e["tid"]] for e in trace["traceEvents"] if e.get("ph") == "X"}
    assert {"compute", "h2d", "nvme read", "nvme write", "adam"} <= timed, timed
    profile = json.loads((out / "overlap_profile.json").read_text())
    assert any(e.get("name", "").startswith("aten::") for e in profile["traceEvents"])
    assert "Self CPU" in (out / "overlap_profile_top.txt").read_text()
    assert (out / "overlap_profiled" / "bench_overlap.json").exists()
    # each benchmark's command line was its GPU run's: --quick, results into its own folder under the output
    for name in BENCHMARKS:
        parsed = (out / f"{name}.log").read_text()
        assert "quick=True" in parsed and str(out / name) in parsed, parsed
    assert "device='cpu'" in (out / "bench_overlap.log").read_text()


def two_benchmarks(tmp_path, failures: int) -> Path:
    """A copy of the script's setup that checks bench_x (given a flag it does not take) and bench_y, then exits
    with 0 when ``failures`` steps did not pass."""
    bench = tmp_path / "repo" / "bench"
    bench.mkdir(parents=True)
    script = SCRIPT.read_text().split("# build:", 1)[0]
    script += "benchmark bench_x 30 --quick --no-such-flag\nbenchmark bench_y 30 --quick\ncheck_arguments 30\n"
    (bench / "gpu_check.sh").write_text(script + f"((failures == {failures}))\n")
    (bench / "bench_x.py").write_text(
        "import argparse\np = argparse.ArgumentParser()\np.add_argument('--quick', action='store_true')\n"
        "p.add_argument('--results-dir')\np.parse_args()\nraise SystemExit('ran')\n"
    )
    (bench / "bench_y.py").write_text((bench / "bench_x.py").read_text())
    return bench / "gpu_check.sh"


def test_a_benchmark_command_line_its_parser_refuses_fails_its_step(tmp_path):
    """The dry run's argument check is a real one: a flag a benchmark does not take fails that step, and the
    next benchmark's is still checked."""
    script = two_benchmarks(tmp_path, failures=1)
    done = check(tmp_path, "--dry-run", script=script, GPU_CHECK_OUT=str(tmp_path / "out"))
    assert done.returncode == 0, done.stdout + done.stderr
    rows = summary_rows(tmp_path / "out" / "summary.md")
    assert (rows["bench_x"]["status"], rows["bench_y"]["status"]) == ("failed (exit 2)", "arguments ok")
    assert "unrecognized arguments: --no-such-flag" in (tmp_path / "out" / "bench_x.log").read_text()
    assert "quick=True" in (tmp_path / "out" / "bench_y.log").read_text()


def test_gpu_check_steps_runs_only_the_steps_it_names_and_the_others_neither_run_nor_fail(tmp_path):
    """A rerun of the steps that failed (GPU_CHECK_STEPS): bench_x, whose command line would fail, is not
    selected, so it has its row without running and the check passes."""
    script = two_benchmarks(tmp_path, failures=0)
    done = check(tmp_path, "--dry-run", script=script, GPU_CHECK_OUT=str(tmp_path / "out"), GPU_CHECK_STEPS="bench_y")
    assert done.returncode == 0, done.stdout + done.stderr
    rows = summary_rows(tmp_path / "out" / "summary.md")
    assert (rows["bench_x"]["status"], rows["bench_y"]["status"]) == ("not selected", "arguments ok")
    assert not (tmp_path / "out" / "bench_x.log").exists()


def test_an_unknown_argument_is_refused_and_without_a_gpu_the_gpu_run_says_to_use_the_dry_run(tmp_path):
    done = check(tmp_path, "--bogus")
    assert done.returncode == 2 and "unknown argument --bogus" in done.stderr
    if not __import__("torch").cuda.is_available():
        done = check(tmp_path, GPU_CHECK_OUT=str(tmp_path / "out"))
        assert done.returncode == 2 and "--dry-run" in done.stderr and not (tmp_path / "out").exists()
