"""What a fine-tuning run records per step: JSON lines, a PNG of the loss curves, TensorBoard when installed.

:class:`MetricsLog` appends one JSON object per optimizer step to
``<directory>/metrics.jsonl`` (``step`` and whatever the run measured: loss,
eval_loss and eval_perplexity when it evaluated, lr, grad_norm, tokens_per_s,
bytes_read, bytes_written, ...), flushed as each step ends, and
:meth:`MetricsLog.plot` draws the training and evaluation losses against the
step into ``<directory>/loss.png`` (replaced atomically) when ``matplotlib`` is
importable (the ``[bench]`` extra). With the ``tensorboard`` package installed,
the same scalars go to ``<directory>/tensorboard`` too. A resumed run
(``resume_step``) drops the records past the step it resumes from (a killed run
may have logged steps after its last checkpoint) and goes on appending, so the
file and the picture cover the whole run.

Example::

    from nvoffload.metrics import MetricsLog

    with MetricsLog("runs/chat") as log:
        for step in range(1, 101):
            ...
            log.record(step, loss=loss, lr=lr)
        log.plot()
"""

from __future__ import annotations

import importlib.util
import json
import math
import os

from nvoffload.core.atomic import replace_file

__all__ = ["METRICS_NAME", "PLOT_NAME", "MetricsLog", "plotting_available"]

METRICS_NAME = "metrics.jsonl"
PLOT_NAME = "loss.png"


def plotting_available() -> bool:
    """Whether :meth:`MetricsLog.plot` can draw (``matplotlib`` is importable)."""
    try:
        import matplotlib.figure  # noqa: F401
    except ImportError:
        return False
    return True


def _read(path: str) -> list[dict]:
    """The complete records of ``path`` (a line cut short by a kill is left out)."""
    records = []
    try:
        with open(path, encoding="utf-8") as f:
            for line in f:
                try:
                    record = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if isinstance(record, dict) and isinstance(record.get("step"), int):
                    records.append(record)
    except FileNotFoundError:
        pass
    return records


class MetricsLog:
    """Per-step metrics of a run in ``directory``; see the module docstring.

    ``resume_step``: keep the records up to this step of the file already
    there (None: start a new file).
    """

    def __init__(self, directory: str | os.PathLike, *, resume_step: int | None = None):
        self.directory = os.fspath(directory)
        os.makedirs(self.directory, exist_ok=True)
        self.path = os.path.join(self.directory, METRICS_NAME)
        kept = [r for r in _read(self.path) if r["step"] <= resume_step] if resume_step is not None else []
        with replace_file(self.path) as f:
            f.write("".join(json.dumps(r) + "\n" for r in kept).encode())
        self._file = open(self.path, "a", encoding="utf-8")
        self._tensorboard = None
        if importlib.util.find_spec("tensorboard") is not None:
            from torch.utils.tensorboard import SummaryWriter

            purge = resume_step + 1 if resume_step is not None else None
            self._tensorboard = SummaryWriter(os.path.join(self.directory, "tensorboard"), purge_step=purge)

    def record(self, step: int, **values: float | int | None) -> None:
        """Append step ``step``'s values (None values are left out)."""
        record = {"step": step, **{k: v for k, v in values.items() if v is not None}}
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        if self._tensorboard is not None:
            for name, value in record.items():
                if name != "step" and isinstance(value, (int, float)) and math.isfinite(value):
                    self._tensorboard.add_scalar(name, value, step)
            self._tensorboard.flush()

    def records(self) -> list[dict]:
        """Every record of the file, the resumed run's earlier ones included."""
        return _read(self.path)

    def plot(self, path: str | os.PathLike | None = None) -> str | None:
        """Draw the loss (and evaluation loss) curves into ``path`` (default ``<directory>/loss.png``), replaced
        atomically; the path written, or None without ``matplotlib``."""
        if not plotting_available():
            return None
        from matplotlib.figure import (
            Figure,  # no pyplot: no GUI backend, no global state
        )

        path = os.fspath(path) if path is not None else os.path.join(self.directory, PLOT_NAME)
        records = self.records()
        fig = Figure(figsize=(7, 4), dpi=100, layout="constrained")
        ax = fig.add_subplot()
        for key, label, style in (("loss", "training loss", "-"), ("eval_loss", "evaluation loss", "o-")):
            points = [(r["step"], r[key]) for r in records if key in r]
            if points:
                ax.plot(*zip(*points), style, label=label)
        ax.set_xlabel("optimizer step")
        ax.set_ylabel("cross-entropy (nats per target token)")
        ax.grid(alpha=0.3)
        if records:
            ax.legend()
        with replace_file(path) as f:
            fig.savefig(f, format="png")
        return path

    def close(self) -> None:
        self._file.close()
        if self._tensorboard is not None:
            self._tensorboard.close()

    def __enter__(self) -> MetricsLog:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
