"""The training loop of ``nvoffload finetune``: the model and its optimizer built in the configured mode, the
steps, evaluation, metrics, checkpoints and what each step reports."""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import math
import os
import resource
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from nvoffload import trace
from nvoffload.activations import offload_activations
from nvoffload.checkpoint import open_checkpoint, save_file
from nvoffload.data import ByteTokenizer, TokenDataset, load_text
from nvoffload.data.sft import SFTBatch, SFTDataset
from nvoffload.distributed import DEFAULT_TIMEOUT_S, rank_swap_dirs
from nvoffload.finetune.checkpoints import Checkpoints
from nvoffload.finetune.checks import (
    _check_batch_memory,
    _check_init_from,
    _check_save_to,
    _check_saveable,
    _check_swap_space,
    _check_writable,
    _host_budgets_named,
    _model_shape,
    _rank,
    named_in_errors,
)
from nvoffload.finetune.config import (
    _DTYPES,
    FinetuneConfig,
    default_swap_root,
    max_text_bytes,
)
from nvoffload.finetune.lora import adapters_seeded, with_lora
from nvoffload.io.ownership import SwapDirectoryInUse, claim
from nvoffload.memory import resident_state_share
from nvoffload.metrics import MetricsLog
from nvoffload.models import GPT
from nvoffload.optim import LossScaling
from nvoffload.optim.offload import NVMeAdamW, OffloadOptimizer
from nvoffload.planner.cost import STATE_WORDS, human_count, human_size, vertical_schedule_applies
from nvoffload.pretrained import (
    dtype_kwargs,
    build_meta_model,
    import_transformers,
    save_pretrained,
)
from nvoffload.sft import causal_lm_loss, causal_lm_vertical_step, evaluate
from nvoffload.training import OffloadConfig, initialize
from nvoffload.training_checkpoint import (
    check_checkpoint_directory,
    claim_checkpoint_directory,
    latest_training_checkpoint,
    load_training_checkpoint,
)

__all__ = ["FinetuneResult", "StepStats", "finetune", "header"]


_HF_SEQ_LEN = 128  # default tokens per sequence for a Hugging Face model (at most its context)
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt")


class _HFModel:
    """A Hugging Face model directory: its configuration, tokenizer and the model in either mode."""

    def __init__(self, config: FinetuneConfig):
        self.tf = import_transformers()
        self.dir = config.model_dir
        self.config = self.tf.AutoConfig.from_pretrained(self.dir)
        text = self.config.get_text_config() if hasattr(self.config, "get_text_config") else self.config
        self.vocab_size = int(text.vocab_size)
        context = getattr(text, "max_position_embeddings", None) or getattr(text, "n_positions", None)
        self.seq_len = config.seq_len if config.seq_len is not None else min(_HF_SEQ_LEN, context or _HF_SEQ_LEN)
        if context is not None and self.seq_len > context:
            raise ValueError(f"seq_len {self.seq_len} exceeds the model's context of {context} positions")
        has_tokenizer = any(os.path.exists(os.path.join(self.dir, f)) for f in _TOKENIZER_FILES)
        self.tokenizer = self.tf.AutoTokenizer.from_pretrained(self.dir) if has_tokenizer else None

    def text_tokenizer(self):
        """The directory's tokenizer, or bytes (refused for a vocabulary under 256)."""
        if self.tokenizer is None:
            if self.vocab_size < ByteTokenizer.vocab_size:
                raise ValueError(
                    f"{self.dir} has no tokenizer, and its vocabulary of {self.vocab_size} is too small for the"
                    f" byte-level fallback ({ByteTokenizer.vocab_size} ids): add the model's tokenizer files"
                )
            return ByteTokenizer()
        return self.tokenizer

    def encode(self, text: str) -> torch.Tensor:
        if self.tokenizer is None:
            return self.text_tokenizer().encode(text)
        ids = self.tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]
        ids = torch.tensor(ids, dtype=torch.int64)
        if ids.numel() and int(ids.max()) >= self.vocab_size:
            raise ValueError(
                f"the tokenizer of {self.dir} produced id {int(ids.max())},"
                f" beyond the model's vocabulary of {self.vocab_size}"
            )
        return ids

    def load(self, dtype: torch.dtype, device: str) -> nn.Module:
        """The model with its weights, on ``device`` (``from_pretrained``)."""
        model = self.tf.AutoModelForCausalLM.from_pretrained(self.dir, **dtype_kwargs(self.tf, dtype))
        return model.to(device).train()

    def build_on_meta(self, dtype: torch.dtype) -> nn.Module:
        """The model built on the meta device, to fill from the directory's checkpoint."""
        return build_meta_model(self.config, dtype=dtype)


def _data(
    config: FinetuneConfig, hf: _HFModel | None, seq_len: int
) -> tuple[TokenDataset | SFTDataset, SFTDataset | None]:
    """The training data (random windows of a text, or examples of ``data_path``) and the evaluation data."""
    if config.data_path is None:
        text = load_text(config.text_path, encoding=config.text_encoding, max_bytes=max_text_bytes())
        tokens = hf.encode(text) if hf is not None else ByteTokenizer().encode(text)
        return TokenDataset(tokens, seq_len, seed=config.seed), None
    tokenizer = hf.text_tokenizer() if hf is not None else ByteTokenizer()
    vocab = hf.vocab_size if hf is not None else config.model_config.vocab_size
    common = dict(tokenizer=tokenizer, seq_len=seq_len, packing=config.packing, loss_on=config.loss_on,
                  seed=config.seed, vocab_size=vocab, eval_fraction=config.eval_fraction or 0.0,
                  max_record_bytes=config.max_record_bytes)  # fmt: skip
    train = SFTDataset(config.data_path, **common)
    if config.eval_data_path is not None:
        return train, SFTDataset(config.eval_data_path, **{**common, "eval_fraction": 0.0}, evaluation=True)
    return train, SFTDataset(config.data_path, **common, evaluation=True) if config.eval_fraction else None


def _batch(data: TokenDataset | SFTDataset, batch_size: int) -> SFTBatch:
    drawn = data.batch(batch_size)
    return drawn if isinstance(drawn, SFTBatch) else SFTBatch(*drawn)


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
    read_bytes: int = 0  # read from NVMe during the step
    written_bytes: int = 0
    lr: float | None = None  # the learning rate of the step
    # The global gradient norm (before clipping; inf or nan: a skipped fp16 step). A model not streamed: only
    # when the run records metrics (its norm waits for the device).
    grad_norm: float | None = None
    eval_loss: float | None = None  # after this step, when it evaluated
    eval_perplexity: float | None = None
    # offloaded activations, without ``stream``: written to NVMe during the step (not those kept in host memory),
    # and the peak kept in device memory
    activation_written_bytes: int | None = None
    activation_held_bytes: int | None = None


@dataclass(frozen=True)
class FinetuneResult:
    config: FinetuneConfig
    num_parameters: int
    steps: list[StepStats] = field(default_factory=list)
    metrics_path: str | None = None  # the metrics of every step (JSON lines), with ``metrics_dir``, once a step ran
    plot_path: str | None = None  # the loss curves (PNG); None without matplotlib or ``metrics_dir``

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


def _build(config: FinetuneConfig, swap_dir: str, hf: _HFModel | None) -> tuple[nn.Module, OffloadOptimizer]:
    """The model and its NVMe optimizer, in the configured mode."""
    mcfg, dtype = config.model_config, _DTYPES[config.dtype]
    if not config.stream:
        if hf is not None:
            model = hf.load(dtype, config.device)
            model = with_lora(model, config) if config.lora_rank is not None else model
        else:
            model = GPT(mcfg).to(device=config.device, dtype=dtype)
        if config.init_from is not None:
            with open_checkpoint(config.init_from) as ckpt:
                try:
                    model.load_state_dict({name: ckpt.read(name) for name in ckpt.keys()})
                except RuntimeError as exc:  # missing, unexpected or misshapen tensors
                    raise ValueError(f"{config.init_from} does not fit the {config.preset!r} model: {exc}") from None
        # the optimizer's staging share of the host budget, as initialize() takes it; the rest keeps state resident
        staging = int(config.cpu_memory_bytes * OffloadConfig.optimizer_memory_fraction)
        opt = NVMeAdamW(
            _param_groups(model, config.weight_decay), lr=config.lr, betas=(0.9, 0.95), swap_dir=swap_dir,
            cpu_memory_bytes=staging, max_grad_norm=config.max_grad_norm, state_precision=config.state_precision,
            delayed_update=config.delayed_update, delayed_update_after=config.delayed_update_after,
            resident_state_bytes=resident_state_share(config.cpu_memory_bytes - staging, [], 0),
        )  # fmt: skip
        return model, opt
    if hf is not None:
        model = hf.build_on_meta(dtype)
        model = with_lora(model, config) if config.lora_rank is not None else model
    else:
        with torch.device("meta"):
            model = GPT(mcfg).to(dtype=dtype)
    opt = torch.optim.AdamW(_param_groups(model, config.weight_decay), lr=config.lr, betas=(0.9, 0.95))
    offload = OffloadConfig(
        swap_dirs=[swap_dir], cpu_memory_bytes=config.cpu_memory_bytes, device_memory_bytes=config.device_memory_bytes,
        device=config.device, offload_activations=config.offload_activations,
        activation_memory_bytes=config.activation_memory_bytes, activation_host_bytes=config.activation_host_bytes,
        stash_host_bytes=config.stash_host_bytes, stash_staging_bytes=config.stash_staging_bytes,
        max_grad_norm=config.max_grad_norm,
        gradient_accumulation_steps=config.grad_accum_steps, state_precision=config.state_precision,
        loss_scaling=LossScaling() if dtype == torch.float16 else None,
        delayed_update=config.delayed_update, delayed_update_after=config.delayed_update_after,
    )  # fmt: skip
    start = config.model_dir if hf is not None else config.init_from
    if start is None:
        return initialize(model, opt, offload, param_init_fn=model.init_weights)
    # the adapters (which the base's checkpoint does not hold) are drawn as they are filled, block by block
    seeded = adapters_seeded(config.seed) if config.lora_rank is not None else contextlib.nullcontext()
    with open_checkpoint(start) as ckpt, seeded:
        return initialize(model, opt, offload, checkpoint=ckpt)


def _save(model: nn.Module, opt: OffloadOptimizer, path: str, hf: _HFModel | None) -> None:
    if hf is not None:
        extra = hf.tokenizer.save_pretrained if hf.tokenizer is not None else None
        if opt.session is not None:
            opt.session.save_pretrained(path, extra=extra)
        else:
            save_pretrained(model, path, extra=extra)
    elif opt.session is not None:
        opt.session.save_checkpoint(path)
    else:
        save_file(model.state_dict(), path)


def finetune(
    config: FinetuneConfig, *, progress: bool = True, on_step: Callable[[StepStats], None] | None = None,
    on_message: Callable[[str], None] | None = None,
) -> FinetuneResult:
    """Train ``config.steps`` optimizer steps; returns the per-step statistics.

    ``progress`` shows a progress bar; ``on_step`` is called with each step's
    :class:`StepStats` as soon as the step finishes; ``on_message`` (rank 0's)
    with each line the run has to say: before step 1 the model, its
    parameters, where each part lives, the budgets and the swap directory
    (:func:`header`), what ``resume`` found, and when a checkpoint or
    ``save_to`` is written (sizes as :func:`~nvoffload.planner.cost.human_size`
    writes them, budgets by their field names).

    Raises ValueError for a bad configuration or a text too short for one
    sequence, :class:`~nvoffload.memory.MemoryBudgetError` for budgets too
    small to stream the model (naming the smallest that works), OSError for a
    missing text file or swap directory or a ``save_to`` that cannot be
    written (before any step), ImportError for ``model_dir`` without
    ``transformers``, and the optimizer's errors.
    """
    torch.manual_seed(config.seed)
    joined = _join_ranks(config)
    try:
        return _finetune(config, progress, on_step, on_message or (lambda line: None))
    finally:
        if joined:
            dist.destroy_process_group()


def _join_ranks(config: FinetuneConfig) -> bool:
    """Join the process group a launcher (torchrun) describes in the environment; True if this call did."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1 or dist.is_initialized():
        return False
    if torch.device(config.device).type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    backend = "nccl" if torch.device(config.device).type == "cuda" else "gloo"
    # the backend's own timeout as the optimizer's collectives': a rank that hangs ends every rank's run
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=DEFAULT_TIMEOUT_S))
    return True


def _finetune(
    config: FinetuneConfig, progress: bool, on_step: Callable[[StepStats], None] | None, on_message: Callable[[str], None]
) -> FinetuneResult:
    """The recipe: every check before anything is created, the swap directory, the model and its optimizer, the
    loop (steps, evaluation, checkpoints), the weights saved."""
    setup = _checked_setup(config, on_message)
    swap_dir, owned_dir, release = _run_swap_dir(config, setup.rank, setup.world)
    checkpoint_release = None
    try:
        _check_swap_space(config, setup.shape, setup.seq_len, swap_dir)
        if config.checkpoint_dir is not None:  # held until the run ends: a second run on it is refused
            # once every check passed
            checkpoint_release = _claim_checkpoint_directory(config.checkpoint_dir, setup.rank, setup.world)
        with _host_budgets_named(config):
            model, opt = _build(config, swap_dir, setup.hf)
        with opt, contextlib.ExitStack() as cleanup:
            _check_saveable(model, config)
            result = _Loop.started(config, setup, model, opt, swap_dir, progress, on_step, cleanup).run()
            if config.save_to is not None and setup.rank == 0:  # every rank holds the same weights
                _save(model, opt, config.save_to, setup.hf)
                setup.say(f"weights written to {config.save_to}")
    finally:
        if owned_dir is not None:
            shutil.rmtree(owned_dir, ignore_errors=True)
        if release is not None:
            release()
        if checkpoint_release is not None:
            checkpoint_release()
    return result


@dataclass
class _Setup:
    """What the checks before anything is created found: this rank's rows of each batch, the device, the model
    directory, the data."""

    rank: int
    world: int
    say: Callable[[str], None]  # rank 0's messages
    rows: slice
    dev: torch.device
    hf: _HFModel | None
    seq_len: int
    data: TokenDataset | SFTDataset
    eval_data: SFTDataset | None
    shape: object  # the planner's ModelShape, or None


def _checked_setup(config: FinetuneConfig, on_message: Callable[[str], None]) -> _Setup:
    """Every check before anything is created (the checkpoint directory, the default swap directory, swap files)."""
    rank, world = _rank()
    if config.batch_size % world:
        raise ValueError(f"batch_size {config.batch_size} does not split evenly between {world} ranks")
    rows = slice(rank * config.batch_size // world, (rank + 1) * config.batch_size // world)  # this rank's part
    dev = torch.device(config.device)
    if dev.type == "cuda" and world > 1:
        dev = torch.device("cuda", torch.cuda.current_device())
    if rank == 0:
        _check_save_to(config)
    if config.checkpoint_dir is not None:
        with named_in_errors("checkpoint_dir"):
            check_checkpoint_directory(config.checkpoint_dir)
    if config.trace_path is not None:
        _check_writable(config.trace_path, "trace_path", "a trace file")
    hf = _HFModel(config) if config.model_dir is not None else None
    if hf is not None:
        with open_checkpoint(config.model_dir):  # a damaged or truncated file, named before from_pretrained reads it
            pass
        if config.lora_rank is not None:  # the targets, on the model built on the meta device
            with_lora(hf.build_on_meta(_DTYPES[config.dtype]), config)
    if config.init_from is not None:
        _check_init_from(config)
    seq_len = hf.seq_len if hf is not None else config.model_config.seq_len
    data, eval_data = _data(config, hf, seq_len)
    shape = _model_shape(config)
    if shape is not None:
        _check_batch_memory(config, shape, rows.stop - rows.start, seq_len, dev)
    say = on_message if rank == 0 else lambda line: None
    return _Setup(rank, world, say, rows, dev, hf, seq_len, data, eval_data, shape)


def _run_swap_dir(config: FinetuneConfig, rank: int, world: int) -> tuple[str, str | None, Callable[[], None] | None]:
    """This run's swap directory, the one it made for itself (removed at the end) and its claim (released then)."""
    owned_dir = release = None
    swap_dir = config.swap_dir
    if swap_dir is not None and world > 1:
        swap_dir = rank_swap_dirs(swap_dir, rank)[0]  # a missing swap directory is reported by every rank
    if swap_dir is None:
        # The cache directory itself, reused run after run, so that what a killed run left there is cleaned up
        # (nvoffload.io.ownership); a fresh subdirectory while another run holds it.
        swap_dir = default_swap_root() if world == 1 else rank_swap_dirs(default_swap_root(), rank)[0]
        os.makedirs(swap_dir, exist_ok=True)
        try:
            release = claim(swap_dir)
        except SwapDirectoryInUse:
            owned_dir = swap_dir = tempfile.mkdtemp(prefix=_RUN_DIR_PREFIX, dir=swap_dir)
        else:
            _remove_abandoned_run_dirs(swap_dir)
    return swap_dir, owned_dir, release


@dataclass
class _Loop:
    """The training loop of one run: its steps (:meth:`train`), then what each step reports (:meth:`after`):
    evaluation, the metrics, the progress bar and the checkpoints."""

    config: FinetuneConfig
    setup: _Setup
    model: nn.Module
    opt: OffloadOptimizer
    sched: torch.optim.lr_scheduler.LambdaLR
    scaler: torch.amp.GradScaler | None  # float16 without streaming: dynamic loss scaling by a GradScaler
    offloaded: offload_activations | None  # activation offload of a run that does not stream
    result: FinetuneResult
    on_step: Callable[[StepStats], None] | None
    vertical: bool
    cleanup: contextlib.ExitStack | None = None  # closes the loop's parts
    bar: object = None
    checkpoints: Checkpoints | None = None
    log: MetricsLog | None = None  # opened by the first step's record: a run stopped before it leaves no metrics
    first: int = 1
    drawn: float = -math.inf

    @classmethod
    def started(cls, config, setup: _Setup, model, opt, swap_dir: str, progress: bool, on_step, cleanup) -> _Loop:
        """The loop's parts made, the header said, a checkpoint resumed; ``cleanup`` closes them."""
        session = opt.session
        offloaded = None
        if config.offload_activations and session is None:  # streaming sends them through the session
            with _host_budgets_named(config):
                given = config.activation_memory_bytes
                offloaded = cleanup.enter_context(contextlib.closing(offload_activations(
                    swap_dir, host_memory_bytes=None if given is None else given + config.activation_host_bytes,
                    host_resident_bytes=config.activation_host_bytes,
                )))  # fmt: skip
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / (config.warmup_steps + 1)))
        scaler = torch.amp.GradScaler(setup.dev.type) if config.dtype == "float16" and session is None else None
        result = FinetuneResult(config, sum(p.numel() for p in model.parameters()))
        loop = cls(config, setup, model, opt, sched, scaler, offloaded, result, on_step,
                   uses_vertical_schedule(config, setup.world), cleanup)  # fmt: skip
        if progress and setup.rank == 0:
            from tqdm import tqdm

            loop.bar = tqdm(total=config.steps, desc="finetune", unit="step", dynamic_ncols=True)
            cleanup.callback(loop.bar.close)  # last: after the checkpoints' messages
        state = {"model": model, "optimizer": opt, "scheduler": sched, "grad_scaler": scaler}
        if config.checkpoint_dir is not None:  # written beside the next steps; waited for before opt closes
            loop.checkpoints = Checkpoints(config.checkpoint_dir, config.keep_last, setup.say, state)
            cleanup.callback(loop.checkpoints.close)
        staging = (
            session.config.activation_staging_bytes if session is not None
            else offloaded.config.host_bytes() - config.activation_host_bytes if offloaded else 0
        )  # fmt: skip
        for line in header(config, loop.result.num_parameters, setup.seq_len, swap_dir, setup.world,
                           activation_staging_bytes=staging):  # fmt: skip
            setup.say(line)
        if config.resume:
            loop.first = loop._resumed(state)
        return loop

    @property
    def recording(self) -> bool:
        """Whether this rank records the run's metrics (rank 0, with ``metrics_dir``)."""
        return self.config.metrics_dir is not None and self.setup.rank == 0

    def _record(self, step: int, stats: StepStats) -> None:
        """Record ``stats`` in the metrics; the first step's record opens them (a resumed run's: its earlier records
        kept, those past the checkpoint dropped)."""
        if self.log is None:
            resume_step = self.first - 1 if self.first > 1 else None
            self.log = self.cleanup.enter_context(MetricsLog(self.config.metrics_dir, resume_step=resume_step))
        self.log.record(step, **{k: v for k, v in dataclasses.asdict(stats).items() if k in _RECORDED})

    def _resumed(self, state: dict) -> int:
        """The first step to run: after the newest checkpoint that loads into ``state``, or 1 when there is none."""
        config, say = self.config, self.setup.say
        if latest_training_checkpoint(config.checkpoint_dir) is None:
            say(f"no checkpoint in {config.checkpoint_dir} to resume from: starting at step 1")
            return 1
        # the newest that loads
        done = load_training_checkpoint(config.checkpoint_dir, keep_last=config.keep_last, **state)
        try:
            self.setup.data.load_state_dict(done.extra["data"])
        except KeyError:  # a --text run's generator state for --data, or the other way round
            raise ValueError(
                f"{done.path} holds a position in other data than {config.data_path or 'the text'}"
                " (--text and --data take different positions): resume with the data it was trained on"
            ) from None
        say(f"resumed from {done.path}: step {done.step} of {config.steps} done")
        if self.bar is not None:
            self.bar.update(done.step)
        return done.step + 1

    def run(self) -> FinetuneResult:
        config = self.config
        traced = min(self.first + 1, config.steps) if config.trace_path is not None else None
        with contextlib.ExitStack() as tracing:
            for step in range(self.first, config.steps + 1):
                if step == traced:
                    tracing.callback(trace.stop)  # an error in the step ends the trace too (stop() again: no-op)
                    trace.start()
                stats = self.train(step)
                if step == traced:
                    trace.stop(config.trace_path)
                self.after(step, stats)
        if self.log is not None:
            self.result = dataclasses.replace(self.result, metrics_path=self.log.path, plot_path=self.log.plot())
        return self.result

    def train(self, step: int) -> StepStats:
        """One optimizer step over ``grad_accum_steps`` micro-batches; its statistics."""
        config, opt, dev, world = self.config, self.opt, self.setup.dev, self.setup.world
        if opt.session is not None:
            opt.session.reset_stats()
        else:
            opt.reset_io_stats()
        t0 = time.perf_counter()
        if self.offloaded is not None:
            self.offloaded.reset_peaks()
            offloaded_before = _to_nvme(self.offloaded.stats())
        lr = self.sched.get_last_lr()[0]
        # Every micro-batch of the step first: the loss is the mean over all their targets (every row holds some:
        # the data left out the examples without any). The batches are the same on every rank: each takes its rows.
        batches = [_batch(self.setup.data, config.batch_size) for _ in range(config.grad_accum_steps)]
        per_rank_items = sum(b.num_items for b in batches) / world  # the ranks' gradients are averaged
        total, norm = self._forward_backward_step(batches, per_rank_items)
        self.sched.step()
        opt.zero_grad()
        if step == config.steps:
            opt.synchronize()  # a delayed update lands: the run ends with every update applied
        total = total.item()  # the step's one wait for the device
        if world > 1:  # the global batch's loss: the sum of the ranks' parts
            total = opt.ranks.sum(total, "the step's loss") / world
        if not math.isfinite(total):  # every rank sees the same sum: all stop here
            raise self._not_finite(step, total)
        tokens = sum(b.input_ids.numel() for b in batches)
        stats = _step_stats(step, total, tokens, time.perf_counter() - t0, opt, dev, lr=lr, grad_norm=norm)
        if self.offloaded is not None:
            done_offloading = self.offloaded.stats()
            stats = dataclasses.replace(stats, activation_written_bytes=_to_nvme(done_offloading) - offloaded_before,
                                        activation_held_bytes=done_offloading.peak_resident_bytes)  # fmt: skip
        return stats

    def _not_finite(self, step: int, loss: float) -> FloatingPointError:
        """What stops a run whose loss is not finite: at step 1 the weights it starts from (nothing is written yet,
        and a checkpoint directory the run made is removed); later the updates (the checkpoints written, if any,
        are of the steps before)."""
        config = self.config
        if step == 1:
            start = config.init_from or config.model_dir or f"the {config.preset} preset's initialization"
            return FloatingPointError(
                f"the loss is {loss} at step 1, before any update: the weights the run starts from ({start}) give it"
            )
        has = config.checkpoint_dir is not None and latest_training_checkpoint(config.checkpoint_dir) is not None
        kept = f"; the checkpoints in {config.checkpoint_dir} are of the steps before" if has else ""
        return FloatingPointError(
            f"the loss is {loss} at step {step}: training stopped, nothing of this step saved{kept} (lower the learning"
            " rate, or clip with max_grad_norm)"
        )

    def _forward_backward_step(
        self, batches: list[SFTBatch], per_rank_items: float
    ) -> tuple[torch.Tensor, float | None]:  # fmt: skip
        """Forward and backward of the step's micro-batches and the optimizer's step: their summed loss (on the
        device) and the gradients' norm (None where it is not known)."""
        opt, scaler, rows, dev = self.opt, self.scaler, self.setup.rows, self.setup.dev
        total = torch.zeros((), device=dev)
        norm = None
        if self.vertical:  # every block over all the micro-batches while it is on the device; steps the optimizer
            parts = [b.select(rows).to(dev) for b in batches]
            total += causal_lm_vertical_step(opt, parts, per_rank_items).float().sum()
        else:
            activations = self.offloaded or contextlib.nullcontext()
            for b in batches:
                with activations:
                    loss = causal_lm_loss(self.model, b.select(rows).to(dev), per_rank_items)
                total += loss.detach().float()
                if scaler is not None:
                    loss = scaler.scale(loss)
                elif opt.session is not None:
                    loss = opt.scale_loss(loss)  # the loss itself without loss_scaling
                loss.backward()
            if opt.session is None and self.recording:  # from the gradients, there until zero_grad(): a host wait
                norm = opt.grad_norm()
                norm = norm / scaler.get_scale() if scaler is not None and norm is not None else norm
            if scaler is not None:
                scaler.step(opt)
                scaler.update()
            else:
                opt.step()
        if opt.session is not None:
            norm = opt.grad_norm()  # measured as backward consumed them: the norm the step clipped against
        return total, norm

    def after(self, step: int, stats: StepStats) -> None:
        """What a step reports: its evaluation when due, its metrics, the progress bar, and a checkpoint when due."""
        config = self.config
        due = step == config.steps or (config.eval_every and step % config.eval_every == 0)
        if self.setup.eval_data is not None and due:  # on every rank, all of it
            ev = evaluate(self.model, self.setup.eval_data.batches(config.batch_size), self.setup.dev)
            stats = dataclasses.replace(stats, eval_loss=ev.loss, eval_perplexity=ev.perplexity)
        if self.recording:
            self._record(step, stats)
        self.result.steps.append(stats)
        if self.bar is not None:
            self.bar.set_postfix_str(step_postfix(stats, self.setup.dev), refresh=False)
            self.bar.update()
        if self.on_step is not None:
            self.on_step(stats)
        if self.checkpoints is None:
            return
        self.checkpoints.after_step()
        if step == config.steps or (config.save_every is not None and step % config.save_every == 0):
            self.checkpoints.save(step, {"data": self.setup.data.state_dict()}, last=step == config.steps)
            if self.log is not None and time.monotonic() - self.drawn >= _REDRAW_AFTER_S:
                self.log.plot()
                self.drawn = time.monotonic()


def uses_vertical_schedule(config: FinetuneConfig, world: int = 1) -> bool:
    """Whether a run of ``config`` on ``world`` ranks takes each step by the vertical schedule (``config.vertical``'s
    conditions)."""
    return vertical_schedule_applies(
        vertical=config.vertical, stream=config.stream, grad_accum_steps=config.grad_accum_steps, ranks=world,
        lora=config.lora_rank is not None,
    )  # fmt: skip


def header(
    config: FinetuneConfig, num_parameters: int, seq_len: int, swap_dir: str, world: int = 1, *,
    activation_staging_bytes: int = 0,
) -> list[str]:  # fmt: skip
    """What a run says before step 1: the model and its parameters, where parameters, optimizer state,
    activations and gradients live, the budgets (by their field names; ``activation_staging_bytes``: the host
    memory activation offload stages through) and the swap directory."""
    ranks = f" over {world} ranks" if world > 1 else ""
    what = config.model_dir if config.model_dir is not None else f"the {config.preset} preset"
    dev = config.device
    if config.stream:
        placed = f"parameters on NVMe, streamed block by block through host memory to {dev}; gradients consumed during backward"
        budgets = [f"cpu_memory_bytes {human_size(config.cpu_memory_bytes)} (optimizer staging, the block cache and resident state)",
                   f"device_memory_bytes {human_size(config.device_memory_bytes)}"]  # fmt: skip
    else:
        placed = f"parameters and gradients on {dev}"
        budgets = [f"cpu_memory_bytes {human_size(config.cpu_memory_bytes)} (optimizer staging and resident state)"]
    if config.offload_activations:
        budgets.append(f"activation_memory_bytes {human_size(activation_staging_bytes)}")
    if config.activation_host_bytes:
        budgets.append(f"activation_host_bytes {human_size(config.activation_host_bytes)}")
        activations = f"offloaded: up to {human_size(config.activation_host_bytes)} kept in host memory, the rest to NVMe"
    else:
        activations = "offloaded to NVMe" if config.offload_activations else f"on {dev}"
    if uses_vertical_schedule(config, world):
        kept = "kept" if config.stash_host_bytes is None else (
            f"kept in the stash (up to {human_size(config.stash_host_bytes)} in host memory, the rest on NVMe)")
        steps = (f"; each block runs over the {config.grad_accum_steps} micro-batches while on {dev} (vertical schedule:"
                 f" its weights move once a step, its inputs are {kept} and the rest recomputed)")  # fmt: skip
    elif config.grad_accum_steps > 1:
        steps = "; micro-batch after micro-batch"
    else:
        steps = ""
    each = " (each rank its rank<r> subdirectory)" if world > 1 else ""
    return [
        f"model: {what}, {human_count(num_parameters)} parameters, {config.dtype}; {config.batch_size} x {seq_len}"
        f" tokens x {config.grad_accum_steps} micro-batches a step{ranks}{steps}",
        f"placement: {placed}; optimizer state ({STATE_WORDS[config.state_precision]}) on NVMe where the host budget"
        " cannot keep it,"
        f" updated by the CPU{' during the next step (--delayed-update: weights one step behind, not exact AdamW)' if config.delayed_update else ''};"
        " activations"
        f" {activations}",
        "budgets: " + ", ".join(budgets),
        f"swap directory: {swap_dir}{each}",
    ]


def _claim_checkpoint_directory(directory: str, rank: int, world: int) -> Callable[[], None] | None:
    """Rank 0 claims ``directory`` for the run (:func:`~nvoffload.training_checkpoint.claim_checkpoint_directory`),
    and returns its release (None on the other ranks); over several ranks every rank learns at once whether the
    claim was refused, and all raise the same error (the others waited in the next collective until its timeout)."""
    release = refusal = None
    if rank == 0:
        try:
            release = claim_checkpoint_directory(directory)
        except OSError as exc:
            if world == 1:
                raise
            refusal = exc
    if world > 1:
        said = [None if refusal is None else (refusal.errno, refusal.strerror or str(refusal))]
        dist.broadcast_object_list(said, src=0)
        if refusal is not None:
            raise refusal
        if said[0] is not None:
            raise OSError(*said[0])
    return release


_REDRAW_AFTER_S = 10.0  # a checkpoint redraws loss.png when it was drawn longer ago (drawing takes ~0.3 s)
_RUN_DIR_PREFIX = "finetune-"  # a run's own swap subdirectory while another run holds the cache directory
_ABANDONED_AFTER_S = 60.0  # an unheld run directory younger than this may be about to be claimed by its run


def _remove_abandoned_run_dirs(root: str) -> None:
    """Remove the run subdirectories of ``root`` that killed runs left: those no live process holds."""
    for entry in os.scandir(root):
        if not (entry.name.startswith(_RUN_DIR_PREFIX) and entry.is_dir(follow_symlinks=False)):
            continue
        if time.time() - entry.stat().st_mtime < _ABANDONED_AFTER_S:
            continue
        try:
            release = claim(entry.path)  # removes a dead run's lock and swap files, with a warning
        except SwapDirectoryInUse:
            continue
        release()
        shutil.rmtree(entry.path, ignore_errors=True)


_RECORDED = ("loss", "eval_loss", "eval_perplexity", "lr", "grad_norm", "tokens_per_s", "step_s", "read_bytes", "written_bytes")


def _to_nvme(stats) -> int:
    """The bytes an activation offload has written to NVMe (its :class:`~nvoffload.activations.OffloadStats`)."""
    return stats.bytes_written - stats.host_bytes_written


def _step_stats(
    step: int, loss: float, tokens: int, step_s: float, opt: OffloadOptimizer, dev: torch.device, *,
    lr: float | None = None, grad_norm: float | None = None,
) -> StepStats:  # fmt: skip
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
        read_bytes=read,
        written_bytes=written,
        lr=lr,
        grad_norm=grad_norm,
    )


def step_postfix(s: StepStats, dev: torch.device) -> str:
    mib = 1 << 20
    device = f" device {s.device_bytes / mib:.0f}M" if s.device_bytes else ""
    evaluated = f" | eval {s.eval_loss:.3f}" if s.eval_loss is not None else ""
    offloaded = ""
    if s.activation_written_bytes is not None:
        offloaded = f" | activations {human_size(s.activation_written_bytes)} to NVMe, {human_size(s.activation_held_bytes)} held"
    return (
        f"loss {s.loss:.3f}{evaluated} | {s.tokens_per_s:,.0f} tok/s |{device} cpu {s.host_rss_bytes / mib:.0f}M"
        f" (held {s.host_held_bytes / mib:.0f}M) nvme {s.nvme_bytes / mib:.0f}M | io {s.io_gb_per_s:.2f} GB/s{offloaded}"
    )
