#!/usr/bin/env bash
# The prepared GPU check (issue 32): what whoever is lent a GPU runs first, in at most 8 minutes.
#
#   bash bench/gpu_check.sh              # on a CUDA machine: every step below on the GPU
#   bash bench/gpu_check.sh --dry-run    # (or GPU_CHECK_DRY=1) the same steps on the CPU stand-in, tiny sizes
#   GPU_CHECK_SWAP=/mnt/nvme0 bash bench/gpu_check.sh   # swap files there (default: TMPDIR or /tmp)
#   GPU_CHECK_STEPS="cuda_tests bench_plan" bash bench/gpu_check.sh  # only these steps (a rerun of those that failed)
#
# Steps, in this order (the most telling first: a step that finds no time left is skipped):
#   build               the native core built in place when it does not import (the checkout is on PYTHONPATH)
#   environment         torch, CUDA, the device, kvikio's compatibility mode, nvidia-smi
#   cuda_tests          pytest -k "cuda or gds": the tests marked cuda or gds and the CUDA cases of the
#                       tests parametrized over devices (junit XML beside the log)
#   finetune_trace      a streamed `nvoffload finetune` with --trace (Perfetto JSON)
#   overlap_profiler    bench/bench_overlap.py under torch.profiler (a Chrome trace and the top operators)
#   bench_*             each benchmark's --quick run (with --device where it takes one), results in a folder
#                       of its own; in the dry run each command line is only parsed by the benchmark's own
#                       parser, all in one process (their quick runs on the CPU are in the suite:
#                       tests/test_bench_*.py)
#
# Everything goes to bench/results/gpu_check/<device>/ (GPU_CHECK_OUT overrides it): a log per step, each
# step's files, and summary.md, a table of every step with its status (passed, failed (exit N), timed out
# after N s, skipped: no time left; "arguments ok" for a benchmark in the dry run), a row written as each
# step ends, so a run cut short still says how far it got. Each step runs under `timeout`, within what is
# left of GPU_CHECK_BUDGET_S (480 s). Installs nothing, needs no network.
# Steps are given more time than they take on a 16-core H200 machine (2026-11-27: bench_plan --quick 60-100 s,
# most of it starting a torch process per case). Exit status: 0 when every step passed, 1 otherwise, 2 without a GPU (and without --dry-run).
set -uo pipefail

repo="$(cd "$(dirname "$0")/.." && pwd)"
cd "$repo"
dry="${GPU_CHECK_DRY:-0}"
for arg in "$@"; do
  case "$arg" in
    --dry-run) dry=1 ;;
    *) echo "gpu_check.sh: unknown argument $arg (use --dry-run, or nothing)" >&2; exit 2 ;;
  esac
done
python="${PYTHON:-python}"
budget_s="${GPU_CHECK_BUDGET_S:-480}"
selected=" ${GPU_CHECK_STEPS:-} "
start_s=$SECONDS

if [[ "$dry" == 1 ]]; then
  device=cpu
  device_name="cpu-stand-in-dry-run"
else
  device=cuda
  if ! device_name="$("$python" -c 'import torch; assert torch.cuda.is_available(); print(torch.cuda.get_device_name())' 2>/dev/null)"; then
    echo "gpu_check.sh: torch sees no CUDA device here; --dry-run checks the script on the CPU" >&2
    exit 2
  fi
fi
slug="$(echo "$device_name" | tr '[:upper:]' '[:lower:]' | tr -cs 'a-z0-9.' '-' | sed 's/^-//; s/-$//')"
out="${GPU_CHECK_OUT:-bench/results/gpu_check/$slug}"
mkdir -p "$out"
out="$(cd "$out" && pwd)"
# Swap directories under GPU_CHECK_SWAP (put it on an NVMe drive; default: TMPDIR or /tmp), removed at exit.
swap="$(mktemp -d "${GPU_CHECK_SWAP:-${TMPDIR:-/tmp}}/gpu_check.XXXXXX")"
trap 'rm -rf "$swap"' EXIT
mkdir "$swap/finetune" "$swap/bench"
summary="$out/summary.md"
failures=0

commit="$(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
[[ -n "$(git status --porcelain --untracked-files=no 2>/dev/null)" ]] && commit="$commit (working tree changed)"
{
  echo "# GPU check on $device_name"
  echo
  echo "Started $(date -u '+%Y-%m-%d %H:%M:%S UTC') at commit $commit with \`--device $device\`"
  echo "$([[ "$dry" == 1 ]] && echo '(a dry run on the CPU stand-in) ')within ${budget_s} s; logs and files beside this summary."
  echo
  echo "| step | status | seconds | limit (s) | files |"
  echo "|---|---|---|---|---|"
} > "$summary"

# row STEP STATUS SECONDS LIMIT_S FILES: the step's row in the summary (a step that did not pass counts).
row() {
  [[ "$2" == passed || "$2" == "arguments ok" || "$2" == "not selected" ]] || failures=$((failures + 1))
  echo "| $1 | $2 | $3 | $4 | $5 |" >> "$summary"
  echo "gpu_check: $1: $2 ($3 s)"
}

# run STEP LIMIT_S FILES -- COMMAND...: COMMAND under timeout (LIMIT_S, or what is left of the budget), its
# output in STEP.log, then its row with those of FILES (under the output folder) that it left.
run() {
  local step="$1" limit="$2" files="$3"
  shift 4
  if ! chosen "$step"; then
    row "$step" "not selected" 0 0 ""
    return
  fi
  local left=$((budget_s - (SECONDS - start_s)))
  if ((left < 5)); then
    row "$step" "skipped: no time left" 0 0 ""
    return
  fi
  ((limit > left)) && limit=$left
  local began=$SECONDS rc listed="$step.log" file
  timeout --kill-after=5 "$limit" "$@" > "$out/$step.log" 2>&1
  rc=$?
  for file in $files; do
    [[ -e "$out/$file" ]] && listed+=" $file"  # what the step left
  done
  row "$step" "$(status "$rc" "$limit")" $((SECONDS - began)) "$limit" "$listed"
}

chosen() {  # chosen STEP: whether GPU_CHECK_STEPS (when set) names STEP
  [[ "$selected" == "  " || "$selected" == *" $1 "* ]]
}

status() {  # status RC LIMIT_S: the words for a command's exit status
  if (($1 == 0)); then echo passed
  elif (($1 == 124 || $1 == 137)); then echo "timed out after $2 s"
  else echo "failed (exit $1)"
  fi
}

# benchmark NAME LIMIT_S ARGS...: the benchmark's run with its results in a folder of its own. In the dry run
# the same command line is kept for check_arguments, which parses them all in one process.
parse_only=()
benchmark() {
  local name="$1" limit="$2"
  shift 2
  local command=("bench/$name.py" "$@" --results-dir "$out/$name")
  if [[ "$dry" == 1 ]] && chosen "$name"; then
    mkdir -p "$out/.arguments"
    printf '%s\0' "${command[@]}" > "$out/.arguments/$name"
    parse_only+=("$name")
  else
    run "$name" "$limit" "$name/" -- "$python" "${command[@]}"
  fi
}

# check_arguments LIMIT_S: the dry run's benchmark steps, in one process (torch imported once): each command
# line kept by `benchmark` parsed by the benchmark's own parser (its module run up to parse_args), nothing
# run; NAME.log holds the parsed arguments or the parser's error.
check_arguments() {
  local limit="$1" began=$SECONDS name rc seconds
  declare -A parsed
  while read -r name rc seconds; do
    parsed[$name]=1
    row "$name" "$([[ "$rc" == 0 ]] && echo "arguments ok" || status "$rc" "$limit")" "$seconds" "$limit" "$name.log"
  done < <(timeout --kill-after=5 "$limit" "$python" - "$out" "${parse_only[@]}" <<'PY'
import argparse
import os
import runpy
import sys
import time
import traceback


class Parsed(Exception):
    pass


parse = argparse.ArgumentParser.parse_args


def parse_only(self, *args, **kwargs):
    print(parse(self, *args, **kwargs))
    raise Parsed


argparse.ArgumentParser.parse_args = parse_only
out, names = sys.argv[1], sys.argv[2:]
for name in names:
    with open(f"{out}/.arguments/{name}", "rb") as f:
        argv = f.read().decode().split("\0")[:-1]
    began = time.monotonic()
    with open(f"{out}/{name}.log", "w") as log:
        sys.stdout = sys.stderr = log
        sys.argv = argv
        sys.path.insert(0, os.path.dirname(os.path.abspath(argv[0])))
        try:
            runpy.run_path(argv[0], run_name="__main__")
            print(f"{argv[0]} ran without parsing its arguments")
            rc = 1
        except Parsed:
            rc = 0
        except SystemExit as exc:  # the parser's refusal: exit 2
            rc = exc.code if isinstance(exc.code, int) else 1
        except BaseException:  # noqa: BLE001 - the step fails, its log says why
            traceback.print_exc()
            rc = 1
        finally:
            sys.stdout, sys.stderr = sys.__stdout__, sys.__stderr__
            del sys.path[0]
    print(name, rc, round(time.monotonic() - began), flush=True)
PY
  )
  for name in "${parse_only[@]}"; do
    [[ -n "${parsed[$name]:-}" ]] || row "$name" "timed out after $limit s" $((SECONDS - began)) "$limit" "$name.log"
  done
}

# build: the package is imported from this checkout (PYTHONPATH), so a fresh machine needs no install; its
# native core is built in place (setup.py build_ext --inplace: a compiler, torch and pybind11, no network)
# when it does not import for this Python.
export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}"
run build 240 "" -- bash -c '"$1" -c "import nvoffload.io._aio, nvoffload.optim._adam" 2>/dev/null && echo "native core imports" || "$1" setup.py build_ext --inplace' build "$python"

run environment 30 "" -- "$python" - <<'PY'
import importlib.util
import shutil
import subprocess

import torch

print("torch", torch.__version__, "CUDA", torch.version.cuda, "available:", torch.cuda.is_available())
if torch.cuda.is_available():
    props = torch.cuda.get_device_properties(0)
    print("device", props.name, props.total_memory, "bytes")
if importlib.util.find_spec("kvikio") is None:
    print("kvikio: not installed")
else:
    import kvikio.defaults

    print("kvikio", kvikio.__version__, "compatibility mode:", kvikio.defaults.compat_mode())
if shutil.which("nvidia-smi"):
    subprocess.run(["nvidia-smi"], check=False)
else:
    print("nvidia-smi: not found")
PY

# Only the test files that name CUDA, kvikio or the devices (DEVICES) are collected: collecting the whole suite
# costs more than the CUDA tests on the CPU.
mapfile -t cuda_files < <(grep -l -E "cuda|gds|DEVICES" tests/test_*.py)
run cuda_tests 150 "cuda_tests.xml" -- "$python" -m pytest -q -p no:cacheprovider -rs -k "cuda or gds" \
  --junitxml="$out/cuda_tests.xml" "${cuda_files[@]}"

# Host budgets small enough that the blocks and the optimizer state move through NVMe (initialize keeps the
# state in host memory where the budget holds it beside every block).
if [[ "$dry" == 1 ]]; then
  finetune_size=(--preset tiny --steps 2 --batch-size 2 --seq-len 32 --cpu-memory 4M)
  overlap_size=(--layers 2 --d-model 32 --seq-len 16 --batch 1 --repeats 1)
else
  finetune_size=(--preset small --steps 4 --batch-size 4 --offload-activations --cpu-memory 32M)
  overlap_size=()  # the sizes of bench/results/bench_overlap_h100.*
fi
run finetune_trace 60 "finetune_trace.json" -- "$python" -m nvoffload finetune "${finetune_size[@]}" --stream \
  --device "$device" --swap-dir "$swap/finetune" --trace "$out/finetune_trace.json" --no-progress

run overlap_profiler 60 "overlap_profile.json overlap_profile_top.txt overlap_profiled/" -- \
  "$python" - "$device" "$out" "${overlap_size[@]}" <<'PY'
import sys

from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, "bench")
import bench_overlap  # noqa: E402

device, out, *sizes = sys.argv[1:]
activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
with profile(activities=activities) as prof:
    bench_overlap.main([*sizes, "--device", device, "--results-dir", f"{out}/overlap_profiled"])
prof.export_chrome_trace(f"{out}/overlap_profile.json")
with open(f"{out}/overlap_profile_top.txt", "w") as f:
    f.write(prof.key_averages().table(sort_by=f"{'cuda' if device == 'cuda' else 'cpu'}_time_total", row_limit=40))
PY

benchmark bench_overlap 30 --quick --device "$device"
benchmark bench_streaming 60 --quick --device "$device" --swap-dir "$swap/bench"
benchmark bench_activations 60 --quick --swap-dir "$swap/bench"
benchmark bench_offload_optim 90 --quick --swap-dir "$swap/bench"
benchmark bench_memory 90 --quick --swap-dir "$swap/bench"
benchmark bench_plan 150 --quick --device "$device" --swap-dir "$swap/bench"
benchmark bench_checkpoint 30 --quick --dir "$swap/bench"
benchmark bench_distributed 90 --quick --swap-dir "$swap/bench"
benchmark bench_adam 20 --quick --no-deepspeed
benchmark bench_io 30 --quick --dirs "$swap/bench"
benchmark bench_vertical 60 --quick --device "$device" --swap-dir "$swap/bench"
benchmark bench_stash 60 --quick --device "$device" --swap-dir "$swap/bench"
benchmark bench_compact_state 60 --quick --device "$device" --swap-dir "$swap/bench"
if [[ "$dry" == 1 ]]; then
  check_arguments 60
fi

{
  echo
  echo "Finished after $((SECONDS - start_s)) s: $failures step(s) did not pass."
} >> "$summary"
cat "$summary"
((failures == 0))
