"""``nvoffload finetune``: fine-tune a GPT-style model with its training state on NVMe.

The model is built from a configuration in the package
(:class:`nvoffload.models.GPTConfig` presets, no download) or loaded from a
safetensors checkpoint, the text is the shipped corpus or a user's file,
tokenized as bytes, and the swap directory lies under the user's cache
directory (``$XDG_CACHE_HOME/nvoffload`` or ``~/.cache/nvoffload``), removed at
the end. Two modes:

- default: the model stays on the device, AdamW's state (fp32 master weights
  and moments) is on NVMe (:class:`nvoffload.optim.NVMeAdamW`);
- ``stream=True``: the parameters are on NVMe too, streamed block by block
  through host memory to the device within ``cpu_memory_bytes`` and
  ``device_memory_bytes`` (:func:`nvoffload.initialize`); the model is built on
  the meta device, so it never is in memory at once. Gradients are consumed
  during backward, so this mode has no gradient accumulation, clipping or fp16.

Each step reports loss, tokens/s, memory per tier and I/O GB/s.

Example::

    from nvoffload.finetune import FinetuneConfig, finetune
    result = finetune(FinetuneConfig(steps=50))
    print(result.losses[0], "->", result.losses[-1])
"""

from __future__ import annotations

import contextlib
import math
import os
import resource
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from nvoffload.activations import offload_activations
from nvoffload.checkpoint import open_checkpoint, save_file
from nvoffload.data import ByteTokenizer, TokenDataset, load_text
from nvoffload.models import GPT, GPTConfig
from nvoffload.optim.offload import NVMeAdamW, OffloadOptimizer
from nvoffload.training import OffloadConfig, initialize

__all__ = ["FinetuneConfig", "FinetuneResult", "StepStats", "default_swap_root", "finetune"]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def default_swap_root() -> str:
    """``$XDG_CACHE_HOME/nvoffload``, or ``~/.cache/nvoffload``."""
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(cache, "nvoffload")


@dataclass(frozen=True)
class FinetuneConfig:
    """One fine-tuning run. Defaults finish in a few minutes on a 2-core CPU.

    Attributes (besides the usual training hyperparameters):
        dtype: parameters on the device: float32, bfloat16 or float16 (fp32 master on NVMe).
        swap_dir: directory on NVMe; None makes a fresh one under
            :func:`default_swap_root`, removed at the end.
        cpu_memory_bytes: host memory for the optimizer's staging buffers (with
            ``stream``, also the cache of parameter blocks).
        stream: stream the parameters from NVMe too (see the module docstring).
        device_memory_bytes: with ``stream``, device memory for streamed blocks,
            the other parameters and gradients in flight.
        offload_activations: send the activations saved for backward to NVMe.
        activation_memory_bytes: with ``offload_activations``, the host memory
            staging their transfers (at least twice the largest saved tensor);
            None: with ``stream`` an eighth of ``cpu_memory_bytes`` (taken from
            it), otherwise the offload's own default.
        init_from: a safetensors checkpoint (file, directory of shards or
            ``*.index.json``) of the preset's model to start from.
        save_to: write the fine-tuned weights to this safetensors file.
    """

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
    dtype: str = "float32"
    device: str = "cpu"
    swap_dir: str | None = None
    cpu_memory_bytes: int = 64 << 20
    stream: bool = False
    device_memory_bytes: int = 1 << 30
    offload_activations: bool = False
    activation_memory_bytes: int | None = None
    init_from: str | None = None
    save_to: str | None = None
    seed: int = 0

    def __post_init__(self):
        GPTConfig.preset(self.preset)  # raises for an unknown preset
        for name in ("steps", "batch_size", "grad_accum_steps", "cpu_memory_bytes", "device_memory_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.activation_memory_bytes is not None and self.activation_memory_bytes < 1:
            raise ValueError(f"activation_memory_bytes must be >= 1, got {self.activation_memory_bytes}")
        if self.seq_len is not None and self.seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, got {self.seq_len}")
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise ValueError(f"lr must be positive and finite, got {self.lr}")
        if self.warmup_steps < 0 or self.weight_decay < 0:
            raise ValueError("warmup_steps and weight_decay must be >= 0")
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {self.dtype!r}")
        if self.stream:
            refused = {
                "grad_accum_steps > 1": self.grad_accum_steps > 1,
                "max_grad_norm": self.max_grad_norm is not None,
                "dtype float16 (it needs loss scaling)": self.dtype == "float16",
            }
            named = [what for what, bad in refused.items() if bad]
            if named:
                raise ValueError(
                    "stream consumes each gradient as soon as backward produces it, so it cannot use "
                    + ", ".join(named)
                )
        if self.init_from is not None and not os.path.exists(self.init_from):
            raise ValueError(f"init_from: no such file or directory: {self.init_from}")
        if self.save_to is not None and not os.path.isdir(os.path.dirname(os.path.abspath(self.save_to))):
            raise ValueError(f"save_to: the directory of {self.save_to} does not exist")

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
    host_held_bytes: int  # peak host memory nvoffload held: staging buffers (and, streaming, the block cache)
    device_bytes: int  # streaming: peak of the device budget in use; else GPU memory allocated (0 on the CPU)
    nvme_bytes: int  # bytes in the swap directory
    io_gb_per_s: float  # bytes read + written per second of step


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


def _param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Weight decay on matrices and embeddings, not on biases and norms."""
    params = list(model.parameters())
    return [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]


def _build(config: FinetuneConfig, swap_dir: str) -> tuple[nn.Module, OffloadOptimizer]:
    """The model and its NVMe optimizer, in the configured mode."""
    mcfg, dtype = config.model_config, _DTYPES[config.dtype]
    if not config.stream:
        model = GPT(mcfg).to(device=config.device, dtype=dtype)
        if config.init_from is not None:
            with open_checkpoint(config.init_from) as ckpt:
                try:
                    model.load_state_dict({name: ckpt.read(name) for name in ckpt.keys()})
                except RuntimeError as exc:  # missing, unexpected or misshapen tensors
                    raise ValueError(f"{config.init_from} does not fit the {config.preset!r} model: {exc}") from None
        opt = NVMeAdamW(
            _param_groups(model, config.weight_decay), lr=config.lr, betas=(0.9, 0.95), swap_dir=swap_dir,
            cpu_memory_bytes=config.cpu_memory_bytes, max_grad_norm=config.max_grad_norm,
        )  # fmt: skip
        return model, opt
    with torch.device("meta"):
        model = GPT(mcfg).to(dtype=dtype)
    opt = torch.optim.AdamW(_param_groups(model, config.weight_decay), lr=config.lr, betas=(0.9, 0.95))
    offload = OffloadConfig(
        swap_dirs=[swap_dir], cpu_memory_bytes=config.cpu_memory_bytes, device_memory_bytes=config.device_memory_bytes,
        device=config.device, offload_activations=config.offload_activations,
        activation_memory_bytes=config.activation_memory_bytes,
    )  # fmt: skip
    if config.init_from is None:
        return initialize(model, opt, offload, param_init_fn=model.init_weights)
    with open_checkpoint(config.init_from) as ckpt:
        return initialize(model, opt, offload, checkpoint=ckpt)


def _save(model: nn.Module, opt: OffloadOptimizer, path: str) -> None:
    if opt.session is not None:
        opt.session.save_checkpoint(path)
    else:
        save_file(model.state_dict(), path)


def finetune(
    config: FinetuneConfig, *, progress: bool = True, on_step: Callable[[StepStats], None] | None = None
) -> FinetuneResult:
    """Train ``config.steps`` optimizer steps; returns the per-step statistics.

    ``progress`` shows a progress bar; ``on_step`` is called with each step's
    :class:`StepStats` as soon as the step finishes.

    Raises ValueError for a bad configuration or a text too short for one
    sequence, :class:`~nvoffload.memory.MemoryBudgetError` for budgets too
    small to stream the model (naming the smallest that works), OSError for a
    missing text file or swap directory, and the optimizer's errors.
    """
    torch.manual_seed(config.seed)
    dev = torch.device(config.device)
    mcfg = config.model_config
    data = TokenDataset(ByteTokenizer().encode(load_text(config.text_path)), mcfg.seq_len, seed=config.seed)

    owned_dir = None
    if config.swap_dir is None:
        root = default_swap_root()
        os.makedirs(root, exist_ok=True)
        owned_dir = tempfile.mkdtemp(prefix="finetune-", dir=root)
    swap_dir = owned_dir or config.swap_dir
    bar = None
    try:
        model, opt = _build(config, swap_dir)
        with opt, contextlib.ExitStack() as cleanup:
            result = FinetuneResult(config, sum(p.numel() for p in model.parameters()))
            session = opt.session
            activations = contextlib.nullcontext()
            if config.offload_activations and session is None:  # streaming sends them through the session
                activations = cleanup.enter_context(contextlib.closing(offload_activations(swap_dir, host_memory_bytes=config.activation_memory_bytes)))
            sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / (config.warmup_steps + 1)))
            if progress:
                from tqdm import tqdm

                bar = tqdm(total=config.steps, desc="finetune", unit="step", dynamic_ncols=True)
            tokens_per_step = config.batch_size * config.grad_accum_steps * mcfg.seq_len
            for step in range(1, config.steps + 1):
                if session is not None:
                    session.reset_stats()
                else:
                    opt.reset_io_stats()
                t0 = time.perf_counter()
                total = 0.0
                for _ in range(config.grad_accum_steps):
                    x, y = data.batch(config.batch_size)
                    with activations:
                        loss = model(x.to(dev), y.to(dev)) / config.grad_accum_steps
                    loss.backward()
                    total += loss.detach().item()
                opt.step()
                sched.step()
                opt.zero_grad()
                stats = _step_stats(step, total, tokens_per_step, time.perf_counter() - t0, opt, dev)
                result.steps.append(stats)
                if bar is not None:
                    bar.set_postfix_str(_postfix(stats, dev), refresh=False)
                    bar.update()
                if on_step is not None:
                    on_step(stats)
            if config.save_to is not None:
                _save(model, opt, config.save_to)
    finally:
        if bar is not None:
            bar.close()
        if owned_dir is not None:
            shutil.rmtree(owned_dir, ignore_errors=True)
    return result


def _step_stats(step: int, loss: float, tokens: int, step_s: float, opt: OffloadOptimizer, dev: torch.device) -> StepStats:
    if opt.session is not None:
        tiers = opt.session.memory_stats()
        read, written = opt.session.io_bytes()
        host, device, nvme = tiers["host"].peak_bytes, tiers["device"].peak_bytes, tiers["nvme"].used_bytes
    else:
        mem = opt.memory_stats()
        read, written = mem.read_bytes, mem.written_bytes
        host, nvme = mem.host_peak_bytes, mem.nvme_bytes
        device = torch.cuda.memory_allocated(dev) if dev.type == "cuda" else 0
    return StepStats(
        step=step,
        loss=loss,
        tokens_per_s=tokens / step_s,
        step_s=step_s,
        host_rss_bytes=_rss_bytes(),
        host_held_bytes=host,
        device_bytes=device,
        nvme_bytes=nvme,
        io_gb_per_s=(read + written) / step_s / 1e9,
    )


def _postfix(s: StepStats, dev: torch.device) -> str:
    mib = 1 << 20
    device = f" device {s.device_bytes / mib:.0f}M" if s.device_bytes else ""
    return (
        f"loss {s.loss:.3f} | {s.tokens_per_s:,.0f} tok/s |{device} cpu {s.host_rss_bytes / mib:.0f}M"
        f" (held {s.host_held_bytes / mib:.0f}M) nvme {s.nvme_bytes / mib:.0f}M | io {s.io_gb_per_s:.2f} GB/s"
    )
