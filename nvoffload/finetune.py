"""``nvoffload finetune``: fine-tune a GPT-style model with its optimizer state on NVMe.

The model is built from a configuration in the package
(:class:`nvoffload.models.GPTConfig` presets, no download), the text is the
shipped corpus or a user's file, tokenized as bytes, and the optimizer is
:class:`nvoffload.optim.NVMeAdamW` with a swap directory under the user's cache
directory (``$XDG_CACHE_HOME/nvoffload`` or ``~/.cache/nvoffload``), removed at
the end. Each step reports loss, tokens/s, memory per tier and I/O GB/s.

Example::

    from nvoffload.finetune import FinetuneConfig, finetune
    result = finetune(FinetuneConfig(steps=50))
    print(result.losses[0], "->", result.losses[-1])
"""

from __future__ import annotations

import math
import os
import resource
import shutil
import tempfile
import time
from dataclasses import dataclass, field

import torch

from nvoffload.data import ByteTokenizer, TokenDataset, load_text
from nvoffload.models import GPT, GPTConfig
from nvoffload.optim.offload import NVMeAdamW

__all__ = ["FinetuneConfig", "FinetuneResult", "StepStats", "default_swap_root", "finetune"]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def default_swap_root() -> str:
    """``$XDG_CACHE_HOME/nvoffload``, or ``~/.cache/nvoffload``."""
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(cache, "nvoffload")


@dataclass(frozen=True)
class FinetuneConfig:
    """One fine-tuning run. Defaults finish in a few minutes on a 2-core CPU."""

    preset: str = "small"
    text_path: str | None = None  # None: the shipped corpus
    steps: int = 150
    batch_size: int = 8
    seq_len: int | None = None  # None: the preset's
    grad_accum_steps: int = 1
    lr: float = 1e-3
    warmup_steps: int = 10
    weight_decay: float = 0.1
    max_grad_norm: float | None = None
    dtype: str = "float32"  # parameters on the device: float32, bfloat16 or float16 (fp32 master on NVMe)
    device: str = "cpu"
    swap_dir: str | None = None  # None: a fresh directory under default_swap_root(), removed at the end
    cpu_memory_bytes: int = 64 << 20
    seed: int = 0

    def __post_init__(self):
        GPTConfig.preset(self.preset)  # raises for an unknown preset
        for name in ("steps", "batch_size", "grad_accum_steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.seq_len is not None and self.seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, got {self.seq_len}")
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise ValueError(f"lr must be positive and finite, got {self.lr}")
        if self.warmup_steps < 0 or self.weight_decay < 0:
            raise ValueError("warmup_steps and weight_decay must be >= 0")
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {self.dtype!r}")

    @property
    def model_config(self) -> GPTConfig:
        base = GPTConfig.preset(self.preset)
        if self.seq_len is None:
            return base
        return GPTConfig(**{**base.__dict__, "seq_len": self.seq_len})


@dataclass(frozen=True)
class StepStats:
    """What one optimizer step did."""

    step: int
    loss: float
    tokens_per_s: float
    step_s: float
    host_rss_bytes: int  # the process's resident memory
    host_staging_bytes: int  # the optimizer's pinned/staging buffers
    device_bytes: int  # GPU memory allocated (0 on the CPU)
    nvme_bytes: int  # optimizer state in the swap directory
    io_gb_per_s: float  # optimizer state read + written per second of step


@dataclass(frozen=True)
class FinetuneResult:
    config: FinetuneConfig
    num_parameters: int
    steps: list[StepStats] = field(default_factory=list)

    @property
    def losses(self) -> list[float]:
        return [s.loss for s in self.steps]


def _rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def finetune(config: FinetuneConfig, *, progress: bool = True) -> FinetuneResult:
    """Train ``config.steps`` optimizer steps; returns the per-step statistics.

    Raises ValueError for a bad configuration or a text too short for one
    sequence, and the optimizer's errors for a bad swap directory.
    """
    torch.manual_seed(config.seed)
    dev = torch.device(config.device)
    mcfg = config.model_config
    tokens = ByteTokenizer().encode(load_text(config.text_path))
    data = TokenDataset(tokens, mcfg.seq_len, seed=config.seed)
    model = GPT(mcfg).to(device=dev, dtype=_DTYPES[config.dtype])
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": config.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]

    owned_dir = None
    if config.swap_dir is None:
        root = default_swap_root()
        os.makedirs(root, exist_ok=True)
        owned_dir = tempfile.mkdtemp(prefix="finetune-", dir=root)
    swap_dir = owned_dir or config.swap_dir
    result = FinetuneResult(config, sum(p.numel() for p in model.parameters()))
    bar = None
    try:
        with NVMeAdamW(
            groups, lr=config.lr, betas=(0.9, 0.95), swap_dir=swap_dir,
            cpu_memory_bytes=config.cpu_memory_bytes, max_grad_norm=config.max_grad_norm,
        ) as opt:  # fmt: skip
            sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / (config.warmup_steps + 1)))
            if progress:
                from tqdm import tqdm

                bar = tqdm(total=config.steps, desc="finetune", unit="step", dynamic_ncols=True)
            tokens_per_step = config.batch_size * config.grad_accum_steps * mcfg.seq_len
            for step in range(1, config.steps + 1):
                opt.reset_io_stats()
                t0 = time.perf_counter()
                total = 0.0
                for _ in range(config.grad_accum_steps):
                    x, y = data.batch(config.batch_size)
                    loss = model(x.to(dev), y.to(dev)) / config.grad_accum_steps
                    loss.backward()
                    total += loss.detach().item()
                opt.step()
                sched.step()
                opt.zero_grad()
                dt = time.perf_counter() - t0
                mem = opt.memory_stats()
                stats = StepStats(
                    step=step,
                    loss=total,
                    tokens_per_s=tokens_per_step / dt,
                    step_s=dt,
                    host_rss_bytes=_rss_bytes(),
                    host_staging_bytes=mem.host_bytes,
                    device_bytes=torch.cuda.memory_allocated(dev) if dev.type == "cuda" else 0,
                    nvme_bytes=mem.nvme_bytes,
                    io_gb_per_s=(mem.read_bytes + mem.written_bytes) / dt / 1e9,
                )
                result.steps.append(stats)
                if bar is not None:
                    bar.set_postfix_str(_postfix(stats, dev), refresh=False)
                    bar.update()
    finally:
        if bar is not None:
            bar.close()
        if owned_dir is not None:
            shutil.rmtree(owned_dir, ignore_errors=True)
    return result


def _postfix(s: StepStats, dev: torch.device) -> str:
    mib = 1 << 20
    gpu = f" gpu {s.device_bytes / mib:.0f}M" if dev.type == "cuda" else ""
    return (
        f"loss {s.loss:.3f} | {s.tokens_per_s:,.0f} tok/s |{gpu} cpu {s.host_rss_bytes / mib:.0f}M"
        f" (staging {s.host_staging_bytes / mib:.0f}M) nvme {s.nvme_bytes / mib:.0f}M | io {s.io_gb_per_s:.2f} GB/s"
    )
