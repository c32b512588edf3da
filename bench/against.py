"""Benchmarks beside another checkout, in one sitting: is a change's ratio beyond the machine's noise?

Each command (a script of ``bench/`` and its flags, one quoted string) runs in the other checkout (``before``)
and in this one (``after``) in turn, ``--rounds`` times: round after round, each command before then after, so
that a machine's load drifting over the sitting falls on both. Each run is the checkout's own script
(``DIR/bench/X.py``) in a process of its own, its working directory the checkout, ``PYTHONPATH`` the checkout, and
``--results-dir`` a temporary directory (a script without that flag is refused: it would write into the
checkout's ``bench/results``). From every report a run writes (:func:`report.save_report`'s JSON) it takes:

- the ratios: the record's ``ratios`` and every numeric column whose name holds ``/``, ``ratio``, ``x of``,
  ``vs_`` or ``overlap``;
- the main time columns: ``seconds``, ``step_s``, ``tokens_per_s``.

For each (benchmark, case, column): the median of the rounds before and after, after / before, and each side's
range over the rounds (min-max). ``beyond spread`` says when the two ranges do not overlap, and which way is
worse: higher for times and ratios of times, lower for throughputs (``per_s`` and the ``vs_`` ratios of a row
with ``tokens_per_s``). The report (``<name>.json``, ``.md``, ``.png``: each metric's rounds before and after
over the before median) is rewritten after every round, so a sitting cut short keeps its complete rounds.

    python bench/against.py --against /tmp/wt-old [--rounds 3] [--name against_old] \\
        "bench_overlap.py --device cpu" "bench_streaming.py --preset small --steps 3"
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from report import RESULTS_DIR, save_report  # noqa: E402

HERE = Path(__file__).resolve().parents[1]
SIDES = ("before", "after")
RATIO_MARKS = ("/", "ratio", "x of", "vs_", "overlap")
TIME_COLUMNS = ("seconds", "step_s", "tokens_per_s")


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("commands", nargs="*", help='a bench script and its flags, quoted: "bench_overlap.py --device cpu"')
    p.add_argument("--against", type=Path, help="the other checkout (before), e.g. git worktree add DIR COMMIT")
    p.add_argument("--rounds", type=int, default=3, help="runs of each command in each checkout")
    p.add_argument("--name", default=None, help="the report's file name (default: against_<the other checkout's commit>)")
    p.add_argument("--results-dir", type=Path, default=RESULTS_DIR)
    p.add_argument("--timeout-s", type=float, default=1800, help="one run's limit")
    p.add_argument("--replot", type=Path, help="rewrite an earlier sitting's report (its JSON) from its values, running nothing")
    args = p.parse_args(argv)
    if args.replot:
        if not args.replot.is_file():
            p.error(f"--replot {args.replot}: no such file")
        return args
    if not args.commands or args.against is None:
        p.error("give --against DIR and at least one command (or --replot JSON)")
    args.against = args.against.resolve()
    if args.rounds < 1:
        p.error(f"--rounds {args.rounds}: at least 1")
    if not (args.against / "nvoffload").is_dir():
        p.error(f"--against {args.against}: not a checkout of nvoffload (no nvoffload/ in it)")
    args.commands = [shlex.split(c) for c in args.commands]
    for command in args.commands:
        for tree in (args.against, HERE):
            script = tree / "bench" / command[0]
            if not script.is_file():
                p.error(f"{command[0]}: no {script}")
            if '"--results-dir"' not in script.read_text():
                p.error(f"{script} takes no --results-dir: it would write into {tree / 'bench' / 'results'}")
    args.name = args.name or f"against_{commit(args.against).rstrip('+')}"
    return args


def commit(tree: Path) -> str:
    """The short commit of a checkout, with ``+`` when its tracked files differ from it."""
    git = ["git", "-C", str(tree)]
    head = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    changed = subprocess.run([*git, "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True, check=True)
    return head + ("+" if changed.stdout.strip() else "")


def results_state(tree: Path) -> str:
    """``git status`` of a checkout's ``bench/results``: a run must leave it as it found it."""
    done = subprocess.run(["git", "-C", str(tree), "status", "--porcelain", "--", "bench/results"],
                          capture_output=True, text=True, check=True)  # fmt: skip
    return done.stdout


def run_once(tree: Path, command: list[str], timeout_s: float) -> tuple[list[dict], float, str]:
    """``command`` with ``tree``'s script and package: the reports it wrote, its wall seconds, and what failed ('')."""
    with tempfile.TemporaryDirectory(prefix="nvoffload-against-") as out:
        argv = [sys.executable, str(tree / "bench" / command[0]), *command[1:], "--results-dir", out]
        env = {**os.environ, "PYTHONPATH": str(tree)}
        start = time.perf_counter()
        try:
            done = subprocess.run(argv, cwd=tree, env=env, capture_output=True, text=True, timeout=timeout_s, check=False)
        except subprocess.TimeoutExpired:
            return [], time.perf_counter() - start, f"ran past --timeout-s {timeout_s:g}"
        wall_s = time.perf_counter() - start
        if done.returncode != 0:
            return [], wall_s, f"exit status {done.returncode}: {done.stderr.strip()[-1500:]}"
        records = [json.loads(path.read_text()) for path in sorted(Path(out).glob("*.json"))]
    records = [r for r in records if isinstance(r, dict) and "rows" in r]
    return records, wall_s, "" if records else "no report (a JSON with rows) written"


def metrics(record: dict) -> dict[tuple[str, str, str], float]:
    """A report's ratios and main times: (benchmark, case, column) -> value."""
    found = {}
    bench = record.get("benchmark", "?")
    for key, value in (record.get("ratios") or {}).items():
        if _number(value):
            found[(bench, "ratios", key)] = float(value)
    for row in record["rows"]:
        case = str(row.get("case", next((v for v in row.values() if isinstance(v, str)), "?")))
        for column, value in row.items():
            if _number(value) and (column in TIME_COLUMNS or any(mark in column for mark in RATIO_MARKS)):
                found[(bench, case, column)] = float(value)
    return found


def worse_up(key: tuple[str, str, str], keys) -> bool:
    """Whether higher is worse: not for a throughput (``per_s``) nor a ``vs_`` ratio of a row with tokens/s."""
    bench, case, column = key
    return not ("per_s" in column or (column.startswith("vs_") and (bench, case, "tokens_per_s") in keys))


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def summarize(values: dict) -> list[dict]:
    """One row per metric with values on both sides: medians, after / before, ranges, and a verdict."""
    rows = []
    for key in sorted(values, key=lambda k: (k[0], k[2] not in TIME_COLUMNS, k[1], k[2])):
        before, after = values[key]["before"], values[key]["after"]
        if not before or not after or not any(before + after):  # a column that is 0 where it does not apply
            continue
        b, a = statistics.median(before), statistics.median(after)
        rows.append({
            "benchmark": key[0], "case": key[1], "metric": key[2],
            "before": b, "before range": f"{min(before):.3g}-{max(before):.3g}",
            "after": a, "after range": f"{min(after):.3g}-{max(after):.3g}",
            "after/before": a / b if b else None,
            "beyond spread": verdict(before, after, worse_up(key, values)),
        })  # fmt: skip
    return rows


def verdict(before: list[float], after: list[float], higher_worse: bool) -> str:
    """``worse`` or ``better`` when the rounds' ranges do not overlap, else ''."""
    if min(after) > max(before):
        return "worse" if higher_worse else "better"
    if max(after) < min(before):
        return "better" if higher_worse else "worse"
    return ""


def plot(plt, rows: list[dict], values: dict, title: str):
    """Each ratio's rounds before and after, over its before median (log scale): a change beyond noise is where
    the after points sit clear of the before points. Ratios that never move (a case over itself) are left out."""
    rows = [r for r in rows if r["metric"] not in TIME_COLUMNS and r["before"] and len({*_rounds(values, r)}) > 1]
    fig, ax = plt.subplots(figsize=(10, 0.3 * len(rows) + 1.5))
    for y, row in enumerate(rows):
        got = values[(row["benchmark"], row["case"], row["metric"])]
        for side, color, dy in (("before", "tab:gray", 0.15), ("after", "tab:blue", -0.15)):
            scaled = [v / row["before"] for v in got[side]]
            ax.plot([min(scaled), max(scaled)], [y + dy] * 2, color=color, lw=1)
            ax.plot(scaled, [y + dy] * len(scaled), "o", color=color, ms=3, label=side if y == 0 else None)
    ax.axvline(1.0, color="black", lw=0.5)
    ax.set_xscale("log")
    ax.set_yticks(range(len(rows)), [f"{r['benchmark']}: {r['case']}: {r['metric']}"[:80] for r in rows], fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("ratio / its before median (each round a point, its range a line)")
    ax.set_title(title, fontsize=9)
    if rows:
        ax.legend(loc="lower right")
    fig.tight_layout()
    return fig


def _rounds(values: dict, row: dict) -> list[float]:
    got = values[(row["benchmark"], row["case"], row["metric"])]
    return got["before"] + got["after"]


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.replot:
        return replot(args.replot)
    trees = {"before": args.against, "after": HERE}
    commits = {side: commit(tree) for side, tree in trees.items()}
    values, runs = {}, []
    for round_ in range(args.rounds):
        for command in args.commands:
            for side in SIDES:
                load, state = os.getloadavg()[0], results_state(trees[side])
                records, wall_s, failed = run_once(trees[side], command, args.timeout_s)
                runs.append({"round": round_, "command": shlex.join(command), "side": side, "wall_s": wall_s,
                             "load_before": load, "load_after": os.getloadavg()[0], "failed": failed})  # fmt: skip
                print(f"round {round_ + 1}/{args.rounds} {side} ({commits[side]}): {shlex.join(command)}: "
                      f"{wall_s:.1f} s, load {load:.1f}{' FAILED: ' + failed if failed else ''}", flush=True)  # fmt: skip
                for record in records:
                    for key, value in metrics(record).items():
                        values.setdefault(key, {s: [] for s in SIDES})[side].append(value)
                if results_state(trees[side]) != state:
                    raise SystemExit(f"{shlex.join(command)} changed {trees[side] / 'bench' / 'results'}: see git status there")
        save(args, commits, values, runs, round_ + 1)
    return 1 if any(run["failed"] for run in runs) else 0


def replot(path: Path) -> int:
    """An earlier sitting's report rewritten from its JSON's values, rounds and runs."""
    record = json.loads(path.read_text())
    settings = record["settings"]
    args = argparse.Namespace(against=Path(settings["against"]), commands=[shlex.split(c) for c in settings["commands"]],
                              name=path.stem, results_dir=path.parent)  # fmt: skip
    values = {(v["benchmark"], v["case"], v["metric"]): {s: v[s] for s in SIDES} for v in record["values"]}
    save(args, settings["commits"], values, record["runs"], settings["rounds"])
    return 0


def save(args, commits: dict, values: dict, runs: list[dict], rounds: int) -> None:
    """The report so far (``rounds`` complete)."""
    rows = summarize(values)
    failures = [f"{r['side']} {r['command']} round {r['round'] + 1}: {r['failed']}" for r in runs if r["failed"]]
    loads = [run[k] for run in runs for k in ("load_before", "load_after")]
    worse = [f"{r['benchmark']}: {r['case']}: {r['metric']}" for r in rows if r["beyond spread"] == "worse"]
    notes = (
        f"before: {args.against} at {commits['before']}; after: {HERE} at {commits['after']}; {rounds} round(s), "
        f"each command before then after. Load average (1 min) at the runs' starts and ends: "
        f"{min(loads):.1f}-{max(loads):.1f} on {os.cpu_count()} cores. "
        + (f"Worse beyond the rounds' spread: {'; '.join(worse)}." if worse else "Nothing worse beyond the rounds' spread.")
        + "".join(f"\n\nFAILED: {f}" for f in failures)
    )
    settings = {"against": str(args.against), "commits": commits, "rounds": rounds, "commands": [shlex.join(c) for c in args.commands]}
    extra = {"values": [{"benchmark": k[0], "case": k[1], "metric": k[2], **v} for k, v in values.items()], "runs": runs}
    title = f"{commits['before']} (before, gray) against {commits['after']} (after, blue), {rounds} round(s)"
    save_report(args.name, rows, settings=settings, plot_column="after/before", notes=notes, results_dir=args.results_dir,
                extra=extra, plot=lambda plt: plot(plt, rows, values, title))  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
