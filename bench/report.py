"""Shared reporting for the benchmarks in ``bench/``.

Every benchmark ends with :func:`save_report`, which writes
``bench/results/<name>.json`` (the machine, the settings and every row),
``<name>.md`` (a markdown table) and ``<name>.png`` (a bar chart of one column).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def machine_info() -> dict:
    """What the figures were measured on."""
    import torch

    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    info = {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
    }
    return info


def markdown_table(rows: list[dict]) -> str:
    """Rows of equal keys as a markdown table; floats get 3 significant digits."""
    if not rows:
        return ""
    keys = list(rows[0])

    def fmt(v):
        return f"{v:.3g}" if isinstance(v, float) else str(v)

    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    lines += ["| " + " | ".join(fmt(r.get(k, "")) for k in keys) + " |" for r in rows]
    return "\n".join(lines)


def save_report(
    name: str,
    rows: list[dict],
    *,
    settings: dict,
    plot_column: str,
    label_column: str = "case",
    notes: str = "",
    results_dir: Path = RESULTS_DIR,
    extra: dict | None = None,
    plot=None,
) -> Path:
    """Write the JSON, markdown and plot for one benchmark run; print the table.

    Returns the path of the JSON file. ``plot_column`` names the numeric column
    drawn as bars, one per row, labelled by ``label_column``; ``extra`` adds
    keys to the JSON record (e.g. a contention probe's figures); ``plot``, a
    function of ``matplotlib.pyplot`` returning a figure, draws the PNG instead
    of the bars.
    """
    results_dir.mkdir(parents=True, exist_ok=True)
    record = {"benchmark": name, "machine": machine_info(), "settings": settings, "rows": rows, "notes": notes}
    record.update(extra or {})
    json_path = results_dir / f"{name}.json"
    json_path.write_text(json.dumps(record, indent=2) + "\n")

    table = markdown_table(rows)
    md = [f"# {name}", "", f"Machine: {record['machine']}", "", f"Settings: `{json.dumps(settings)}`", "", table]
    if notes:
        md += ["", notes]
    (results_dir / f"{name}.md").write_text("\n".join(md) + "\n")
    print(table)
    if notes:
        print(notes)

    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot written (pip install -e '.[bench]')")
        return json_path
    if plot is not None:
        fig = plot(plt)
        fig.savefig(results_dir / f"{name}.png", dpi=100)
        plt.close(fig)
        return json_path
    plotted = [r for r in rows if isinstance(r.get(plot_column), (int, float))]
    fig, ax = plt.subplots(figsize=(max(6, 0.9 * len(plotted)), 4))
    ax.bar([str(r[label_column]) for r in plotted], [r[plot_column] for r in plotted])
    ax.set_ylabel(plot_column)
    ax.set_title(name)
    ax.tick_params(axis="x", rotation=30)
    fig.tight_layout()
    fig.savefig(results_dir / f"{name}.png", dpi=100)
    plt.close(fig)
    return json_path


def plot_trace(plt, spans, title: str, ax=None):
    """A timeline of a :class:`nvoffload.trace.Trace`'s ``spans()``: one row per track, a bar per span (on ``ax``,
    one of the caller's axes, or a figure of its own)."""
    from nvoffload.trace import TRACKS

    tracks = [t for t in TRACKS if any(s[0] == t for s in spans)] + sorted({s[0] for s in spans} - set(TRACKS))
    colors = {"compute": "tab:blue", "h2d": "tab:green", "d2h": "tab:olive", "nvme read": "tab:orange",
              "nvme write": "tab:red", "adam": "tab:purple"}  # fmt: skip
    if ax is None:
        fig, ax = plt.subplots(figsize=(12, 0.6 * len(tracks) + 1.5))
    else:
        fig = ax.figure
    for row, track in enumerate(tracks):
        bars = [(start, max(end - start, 1e-5)) for t, name, start, end, _ in spans if t == track]
        waits = [(start, max(end - start, 1e-5)) for t, name, start, end, _ in spans if t == track and name.startswith("wait")]
        ax.broken_barh([b for b in bars if b not in waits], (row - 0.35, 0.7), color=colors.get(track, "tab:gray"))
        if waits:
            ax.broken_barh(waits, (row - 0.35, 0.7), color="lightgray")
    ax.set_yticks(range(len(tracks)), tracks)
    ax.invert_yaxis()
    ax.set_xlabel("seconds (compute: blue, waits for weights: gray)")
    ax.set_title(title)
    fig.tight_layout()
    return fig


def nvoffload_command(argv: list[str], fresh_process: bool = False) -> tuple[int, str, str]:
    """``nvoffload`` with ``argv``: its exit status, stdout and stderr. Through its own entry point in this
    process (torch imported once for all of them), or with ``fresh_process`` as a user runs it: in a process of
    its own, with nothing of the cases before it (threads, allocator, memory) in it."""
    if fresh_process:
        ran = subprocess.run([sys.executable, "-m", "nvoffload", *argv], capture_output=True, text=True, check=False)
        return ran.returncode, ran.stdout, ran.stderr
    from nvoffload.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        status = main(argv)
    return status, out.getvalue(), err.getvalue()
