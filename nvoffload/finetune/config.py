"""The configuration of one ``nvoffload finetune`` run (:class:`FinetuneConfig`), validated when it is built."""

from __future__ import annotations

import codecs
import math
import os
from dataclasses import dataclass

import torch

from nvoffload.data.sft import LOSS_ON, MAX_RECORD_BYTES, resolve_data_path
from nvoffload.device import cuda_available
from nvoffload.io.config import default_swap_root
from nvoffload.models import GPTConfig
from nvoffload.optim import STATE_PRECISIONS, OffloadOptimizerConfig
from nvoffload.planner.cost import human_size
from nvoffload.training import check_activation_host_bytes, check_stash_bytes

__all__ = ["FinetuneConfig", "default_swap_root", "max_text_bytes"]


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class FinetuneConfig:
    """One fine-tuning run. Defaults finish in a few minutes on a 2-core CPU.

    Attributes (besides the usual training hyperparameters):
        preset: the built-in GPT to train (ignored with ``model_dir``).
        model_dir: a Hugging Face causal-LM directory (``config.json`` and
            ``*.safetensors``, as ``save_pretrained`` writes it) to fine-tune
            instead of a preset; needs ``transformers``. With ``stream`` it is
            built on the meta device and filled from the directory one block at
            a time, else loaded with ``from_pretrained``. The text is tokenized
            by the directory's tokenizer (``AutoTokenizer``) when it has one;
            without one, as UTF-8 bytes (ids 0-255), which only makes sense for
            a model trained on bytes, and is refused for a vocabulary under 256.
            ``seq_len`` defaults to 128 tokens (at most the model's context).
        text_path: the text to train on (None: the shipped corpus), a regular file of at most
            1/32 of this machine's memory (:func:`max_text_bytes`), decoded as ``text_encoding``
            (a byte not valid in it is refused, naming its offset).
        dtype: parameters on the device: float32, bfloat16 or float16 (fp32
            master on NVMe; float16 with dynamic loss scaling: a
            ``torch.amp.GradScaler``, or with ``stream`` the optimizer's).
        grad_accum_steps: micro-batches per optimizer step.
        max_grad_norm: clip the global gradient norm (the updates then run in ``step()``).
        state_precision: how the optimizer keeps AdamW's state: ``"fp32"`` (exact, the default),
            ``"bf16-moments"`` (bf16 moments beside the fp32 master: 8 bytes a parameter), ``"bf16"``
            (with ``dtype`` bfloat16 also no fp32 master: the weights are updated by stochastic rounding,
            4 bytes a parameter) or ``"8bit"`` (as ``"bf16"`` with 8-bit moments: 2 bytes a parameter); see
            :class:`~nvoffload.optim.OffloadOptimizerConfig`.
        delayed_update: each step's updates run during the next step's forward and backward (the weights one
            step behind, as PipeDream-2BW's and ZeRO-Offload's delayed update; not exact AdamW; see
            :class:`~nvoffload.optim.OffloadOptimizerConfig`). With ``stream``, each block's new weights wait
            in a twin of it in the host cache (and the store) until the next step.
        delayed_update_after: with ``delayed_update``, the steps that update exactly first.
        swap_dir: directory on NVMe; None: :func:`default_swap_root`, reused run
            after run so that what a killed run left there is cleaned up (a fresh
            subdirectory, removed at the end, while another run holds it).
        cpu_memory_bytes: host memory for the optimizer's staging buffers (with
            ``stream``, also the cache of parameter blocks).
        stream: stream the parameters from NVMe too (see the module docstring).
        vertical: with ``stream`` and ``grad_accum_steps`` > 1 on one process
            without LoRA, the vertical schedule (:func:`nvoffload.vertical_step`):
            each block runs over every micro-batch of the step while it is on
            the device, so its weights move once a step, not once a micro-batch,
            and no gradient is written to be accumulated; False: micro-batch after
            micro-batch, as a ``torch.optim`` loop runs.
        device_memory_bytes: with ``stream``, device memory for streamed blocks,
            the other parameters and gradients in flight.
        offload_activations: send the activations saved for backward to NVMe.
        activation_memory_bytes: with ``offload_activations``, the host memory
            staging their transfers (a saved tensor larger than half of it
            moves through it in pieces); None: with ``stream`` an eighth of
            ``cpu_memory_bytes`` (taken from it), otherwise the offload's own
            default.
        activation_host_bytes: with ``offload_activations``, the offloaded
            activations (by the vertical schedule, the blocks' inputs) kept in
            host memory up to this many bytes, besides the staging; only the
            rest go to NVMe (with ``stream`` taken from ``cpu_memory_bytes``:
            :class:`~nvoffload.OffloadConfig`'s ``activation_host_bytes``). 0:
            all to NVMe. ``--plan auto`` sets it from what the host budget
            holds beyond every parameter block.
        stash_host_bytes, stash_staging_bytes: with ``stream`` and the vertical
            schedule, the stash: each block's inputs kept in host memory up to
            ``stash_host_bytes`` and on NVMe beyond, staged through
            ``stash_staging_bytes`` (both taken from ``cpu_memory_bytes``; see
            :class:`~nvoffload.OffloadConfig`). None: the inputs stay on the
            device. ``--plan auto`` sets both where it chooses the stash.
        init_from: a safetensors checkpoint (file, directory of shards or
            ``*.index.json``) of the preset's model to start from.
        save_to: write the fine-tuned weights there: a safetensors file for a
            preset; for ``model_dir`` a Hugging Face directory (weights,
            ``config.json``, the tokenizer), replaced atomically. Checked for
            writing before the model is built.
        checkpoint_dir: write training checkpoints there
            (:func:`nvoffload.save_training_checkpoint`: weights, optimizer
            state, scheduler, loss scaler, RNG and the position in the data),
            every ``save_every`` steps and after the last; the last
            ``keep_last`` are kept. Checked for writing before the model is built.
        trace_path: write a :mod:`nvoffload.trace` of one step (the second this run takes, or its only one)
            there: Chrome trace-event JSON for Perfetto, a track each for compute per block, copies, NVMe
            reads and writes and Adam chunks.
        resume: go on from the latest complete checkpoint in ``checkpoint_dir``
            (from the start when there is none yet): the run ends as if it had
            never stopped, bit for bit.
        data_path: instruction or chat data instead of ``text_path``: a JSONL, Parquet or ``datasets``
            directory, or ``chat`` (the shipped chat data); see :class:`nvoffload.data.sft.SFTDataset`.
        loss_on: with ``data_path``, ``completion`` (the completion's or the assistant's tokens) or ``all``.
        packing: with ``data_path``, pack examples into rows of ``seq_len`` (else one a row, padded).
        max_record_bytes: with ``data_path``, the longest record read (a JSON line; the strings of a Parquet or
            ``datasets`` record): a longer one is refused naming its line (or row) before the run creates anything.
        eval_data_path, eval_fraction: the evaluation data: another file, or this fraction of
            ``data_path``'s examples held out from training.
        eval_every: evaluate every this many steps (and after the last; None: after the last only).
        log_dir: write the metrics of every step there (``metrics.jsonl``, ``loss.png``; TensorBoard when
            installed); None: ``checkpoint_dir`` when given, else none.
        lora_rank: with ``model_dir``, train LoRA adapters of this rank (``peft.get_peft_model``; needs peft)
            over the frozen model instead of the whole model; ``save_to`` then writes the adapter as PEFT
            does (``adapter_model.safetensors``, ``adapter_config.json``).
        lora_targets: with ``lora_rank``, the modules to adapt (names or suffixes, as PEFT's ``target_modules``);
            None: PEFT's default for the model's family.
    """

    preset: str = "small"
    model_dir: str | None = None
    text_path: str | None = None  # None: the shipped corpus
    text_encoding: str = "utf-8"
    steps: int = 150
    batch_size: int = 8
    seq_len: int | None = None  # None: the preset's
    grad_accum_steps: int = 1
    lr: float = 1e-3
    warmup_steps: int = 10
    weight_decay: float = 0.1
    max_grad_norm: float | None = None
    state_precision: str = "fp32"
    delayed_update: bool = False
    delayed_update_after: int = 0
    dtype: str = "float32"
    device: str = "cpu"
    swap_dir: str | None = None
    cpu_memory_bytes: int = 64 << 20
    stream: bool = False
    vertical: bool = True
    device_memory_bytes: int = 1 << 30
    offload_activations: bool = False
    activation_memory_bytes: int | None = None
    activation_host_bytes: int = 0
    stash_host_bytes: int | None = None
    stash_staging_bytes: int | None = None
    init_from: str | None = None
    save_to: str | None = None
    checkpoint_dir: str | None = None
    save_every: int | None = None  # None: after the last step only
    keep_last: int = 2
    resume: bool = False
    trace_path: str | None = None
    seed: int = 0
    data_path: str | None = None
    loss_on: str = "completion"
    packing: bool = True
    max_record_bytes: int = MAX_RECORD_BYTES
    eval_data_path: str | None = None
    eval_fraction: float | None = None
    eval_every: int | None = None
    log_dir: str | None = None
    lora_rank: int | None = None
    lora_targets: tuple[str, ...] | None = None

    def __post_init__(self):
        GPTConfig.preset(self.preset)  # raises for an unknown preset
        for name in ("steps", "batch_size", "grad_accum_steps", "cpu_memory_bytes", "device_memory_bytes", "keep_last"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.save_every is not None and self.save_every < 1:
            raise ValueError(f"save_every must be >= 1, got {self.save_every}")
        for name in ("save_every", "resume"):
            if getattr(self, name) not in (None, False) and self.checkpoint_dir is None:
                raise ValueError(f"{name} needs a checkpoint_dir")
        if self.trace_path is not None and not os.path.isdir(os.path.dirname(os.path.abspath(self.trace_path))):
            raise ValueError(f"trace_path: the directory of {self.trace_path} does not exist")
        if self.activation_memory_bytes is not None and self.activation_memory_bytes < 1:
            raise ValueError(f"activation_memory_bytes must be >= 1, got {self.activation_memory_bytes}")
        check_activation_host_bytes(self.activation_host_bytes, self.offload_activations)
        check_stash_bytes(self.stash_host_bytes, self.stash_staging_bytes)
        if self.stash_host_bytes is not None and not self.stream:
            raise ValueError("stash_host_bytes keeps the vertical schedule's block inputs of a streamed model: set stream")
        if self.seq_len is not None and self.seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, got {self.seq_len}")
        context = GPTConfig.preset(self.preset).seq_len
        if self.model_dir is None and self.seq_len is not None and self.seq_len > context:
            raise ValueError(f"seq_len {self.seq_len} exceeds the {self.preset} preset's context of {context} positions")
        try:
            device = torch.device(self.device)
        except RuntimeError as exc:
            raise ValueError(f"device: {exc}") from None
        if device.type not in ("cpu", "cuda"):
            raise ValueError(f"device must be cpu or cuda, got {self.device!r}")
        if device.type == "cuda" and not cuda_available():
            raise ValueError(f"device {self.device}: no CUDA GPU is usable here (torch {torch.__version__}); use --device cpu")
        if not -(1 << 63) <= self.seed < 1 << 64:
            raise ValueError(f"seed must be in [-2**63, 2**64) (torch's range), got {self.seed}")
        try:
            codecs.lookup(self.text_encoding)
        except LookupError:
            raise ValueError(f"text_encoding: unknown encoding {self.text_encoding!r}") from None
        _check_memory_sizes(self, device)
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise ValueError(f"lr must be positive and finite, got {self.lr}")
        if self.warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {self.warmup_steps}")
        if not (self.weight_decay >= 0 and math.isfinite(self.weight_decay)):
            raise ValueError(f"weight_decay must be finite and >= 0, got {self.weight_decay}")
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {self.dtype!r}")
        if self.max_grad_norm is not None and not (self.max_grad_norm > 0 and math.isfinite(self.max_grad_norm)):
            raise ValueError(f"max_grad_norm must be positive and finite, got {self.max_grad_norm}")
        if self.state_precision not in STATE_PRECISIONS:
            raise ValueError(f"state_precision must be one of {', '.join(STATE_PRECISIONS)}; got {self.state_precision!r}")
        if self.state_precision == "bf16" and self.dtype == "float16":
            raise ValueError("state_precision bf16 updates bfloat16 weights; float16 needs an fp32 master (bf16-moments)")
        # the optimizer's own checks of its fields, at this boundary
        OffloadOptimizerConfig(delayed_update=self.delayed_update, delayed_update_after=self.delayed_update_after)
        if self.model_dir is not None:
            if not os.path.isfile(os.path.join(self.model_dir, "config.json")):
                raise ValueError(f"model_dir: {self.model_dir} is not a Hugging Face model directory (no config.json)")
            if self.init_from is not None:
                raise ValueError("init_from is for presets: a Hugging Face model starts from its directory's weights")
        if self.init_from is not None and not os.path.exists(self.init_from):
            raise ValueError(f"init_from: no such file or directory: {self.init_from}")
        self._check_data()
        if self.lora_rank is not None and (self.lora_rank < 1 or self.model_dir is None):
            raise ValueError(f"lora_rank must be >= 1 and needs a model_dir (adapters over a Hugging Face model), got {self.lora_rank}")
        if self.lora_targets is not None and self.lora_rank is None:
            raise ValueError("lora_targets needs lora_rank")
        parent = os.path.dirname(os.path.abspath(self.save_to)) if self.save_to is not None else None
        if parent is not None and not os.path.isdir(parent):
            what = "is not a directory" if os.path.exists(parent) else "does not exist"
            raise ValueError(f"save_to: the directory of {self.save_to} {what}")

    def _check_data(self) -> None:
        if self.data_path is not None and self.text_path is not None:
            raise ValueError("data_path and text_path: one or the other")
        if self.loss_on not in LOSS_ON:
            raise ValueError(f"loss_on must be one of {', '.join(LOSS_ON)}, got {self.loss_on!r}")
        if self.max_record_bytes < 1:
            raise ValueError(f"max_record_bytes must be >= 1, got {self.max_record_bytes}")
        for name in ("data_path", "eval_data_path"):
            path = getattr(self, name)
            if path is not None and not os.path.exists(resolve_data_path(path)):
                raise ValueError(f"{name}: no such file or directory: {path}")
        evaluated = self.eval_data_path is not None or self.eval_fraction is not None
        if evaluated and self.data_path is None:
            raise ValueError("eval_data_path and eval_fraction need a data_path")
        if self.eval_data_path is not None and self.eval_fraction is not None:
            raise ValueError("eval_data_path and eval_fraction: one or the other")
        if self.eval_fraction is not None and not 0 < self.eval_fraction < 1:
            raise ValueError(f"eval_fraction must be in (0, 1), got {self.eval_fraction}")
        if self.eval_every is not None and (self.eval_every < 1 or not evaluated):
            raise ValueError(f"eval_every must be >= 1 and needs eval_data_path or eval_fraction, got {self.eval_every}")

    @property
    def metrics_dir(self) -> str | None:
        """Where the metrics go: ``log_dir``, else ``checkpoint_dir``."""
        return self.log_dir if self.log_dir is not None else self.checkpoint_dir

    @property
    def model_config(self) -> GPTConfig:
        base = GPTConfig.preset(self.preset)
        if self.seq_len is None:
            return base
        return GPTConfig(**{**base.__dict__, "seq_len": self.seq_len})


def _host_memory_bytes() -> int:
    """This machine's physical memory."""
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def max_text_bytes() -> int:
    """The largest text ``finetune`` reads: 1/32 of this machine's memory (its tokens are held in memory, as int64
    ids: 8 bytes a byte for a preset's byte tokenizer)."""
    return _host_memory_bytes() // 32


def _check_memory_sizes(config: FinetuneConfig, device: torch.device) -> None:
    """Raise ValueError for a memory budget larger than what this machine has (host memory; with ``stream``, the
    device budget against the device's memory), naming the field, the size asked and the machine's."""
    host = _host_memory_bytes()
    sizes = [("cpu_memory_bytes", config.cpu_memory_bytes, host, "this machine's memory")]
    if config.activation_memory_bytes is not None:
        sizes.append(("activation_memory_bytes", config.activation_memory_bytes, host, "this machine's memory"))
    if config.activation_host_bytes:
        sizes.append(("activation_host_bytes", config.activation_host_bytes, host, "this machine's memory"))
    if config.stream:
        on_device = torch.cuda.mem_get_info(device)[1] if device.type == "cuda" else host
        sizes.append(("device_memory_bytes", config.device_memory_bytes, on_device, f"the memory of {device}"))
    for name, asked, has, what in sizes:
        if asked > has:
            raise ValueError(f"{name} {asked} ({human_size(asked)}) is more than {what}, {has} ({human_size(has)})")
