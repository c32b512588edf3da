"""The planner's model of a training step: what nvoffload moves and computes, and how long each engine takes.

A step of ``G`` micro-batches of ``B`` sequences of ``S`` tokens does, per engine:

- **compute** (the device): ``6 * P * B * S`` FLOPs for the matrices (forward and backward) plus
  ``12 * L * B * S**2 * d`` for attention, per micro-batch, at the profile's block throughput for the width;
- **CPU Adam**: every parameter once, at the kernel's rate for the gradients' dtype;
- **NVMe**: the optimizer state (fp32 master and two moments: 12 bytes a parameter; compact state, as
  ``state_precision`` asks: 8 with bf16 moments, and without an fp32 master 4 read and 6 written, the moments
  and a bf16 copy of the weights, or with 8-bit moments 2 read and 4 written) read and written once a step; with accumulation and released gradients, the fp32 gradient kept between micro-batches; with
  streaming, every block the host cache cannot hold read in forward and again in backward and every block
  written back once it changed; with activation offload, every saved activation written and read once; by the
  vertical schedule with the stash, the block inputs the host budget does not hold beside every cached block
  written and read once;
- **copies** (PCIe): streamed blocks to the device, gradients from it, activations (or the stash's block inputs)
  both ways.

The host budget beyond the optimizer's staging (``optimizer_memory_fraction``) caches the parameter blocks
first, streaming, and what it holds beyond them keeps optimizer state resident in host memory
(:func:`nvoffload.memory.resident_state_share`, the rule :func:`nvoffload.initialize` and ``finetune`` follow): that state's 12 bytes
a parameter are neither read nor written on NVMe.

With LoRA (``PlanRequest.lora_rank``, as ``finetune --lora-rank``) the adapters are the trained parameters, in
the blocks: only they have gradients, optimizer state (so the NVMe traffic is their state and, streaming, the
evicted blocks' reads and the adapters' write-back: frozen weights are never written) and CPU Adam work, and a
frozen weight's backward is its input's gradient alone (4 FLOPs a parameter a token, not 6). The activations
are full training's (an upper bound: a frozen layer does not save its input for its weight's gradient).

The step has two phases that cannot overlap: forward (compute, the reads of the blocks it needs and the
writes of the activations it offloads) and backward with the optimizer (compute, the Adam updates that run
as gradients are final, and the rest of the I/O); within a phase the engines overlap, so a phase lasts as
long as its busiest engine, except that on the CPU standing in for a GPU, compute and Adam share the host's
cores and add up, and that compute beside NVMe I/O runs at the profile's measured fractions of its speed
(``compute_with_io``, ``io_with_compute``: see :func:`~nvoffload.planner.contention.overlapped_s`; 1 on a
GPU, where the overlap is free). The updates of the parameters outside the blocks (embeddings, a tied LM
head), whose gradients are final only as backward ends, run after it: a tail of the backward phase. With
``max_grad_norm`` and the model on the device (gradients held), the updates wait for ``step()``: a third
phase.

Over ``N`` data-parallel ranks (:mod:`nvoffload.distributed`: one GPU and one process each, with its own swap
directories) every figure is one rank's. A rank computes ``B / N`` of each micro-batch's sequences, keeps and
updates ``1 / N`` of the parameters' optimizer state (its NVMe bytes, their traffic and the Adam work are
``1 / N`` of one process's), and, streaming, still reads the whole model's weights from its own store (they
are replicated). One more engine, the **interconnect** (``MachineProfile.interconnect_gbps``, the bus
bandwidth NCCL reports, so a collective's time is its ring bytes per rank over it), carries per step:

- gradients held on the device: their all-reduce, ``2 (N-1)/N`` of their bytes, in buckets during the last
  micro-batch's backward (it overlaps that backward only; the updates start from each averaged bucket);
- streaming: each backward's reduce-scatter of the released gradients to their owners, ``(N-1)/N`` of their
  bytes, overlapped with backward as the NVMe traffic is;
- in both: the all-gather of the owners' new weights after the update, ``(N-1)/N`` of their bytes.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, field, replace

from nvoffload.activations.config import ActivationOffloadConfig
from nvoffload.io.config import IOConfig
from nvoffload.memory import resident_state_share
from nvoffload.optim import STATE_PRECISIONS
from nvoffload.optim.kernels import FP8_BLOCK
from nvoffload.planner.contention import overlapped_s
from nvoffload.planner.profile import MachineProfile

__all__ = [
    "CheckpointCost", "ModelShape", "Plan", "PlanRequest", "SwapBytes", "block_flops", "checkpoint_cost", "checkpoint_line",
    "human_count", "human_size", "plan", "swap_bytes",
]  # fmt: skip

# Bytes of the optimizer state a parameter, (store read, store written, host memory a resident generation takes) per
# step, by state precision: exact (fp32 master and two moments), bf16 moments beside the fp32 master, and for bf16
# weights no master (the moments read; the moments and a bf16 copy of the weights written; resident, the copy takes
# an fp32 row's room), with bf16 or 8-bit moments (their scales, 2 bytes a block of 256, not modelled). An fp32
# model's master is its weights, so it reads 4 bytes less (not modelled).
_STATE_BYTES = {"fp32": (12, 12, 12), "bf16-moments": (8, 8, 8), "bf16": (4, 6, 8), "8bit": (2, 4, 8)}
# The masterless forms on other weights keep an fp32 master: bf16 is then bf16-moments; 8bit reads and writes its
# moments' 2 bytes and the master's 4.
_WITH_MASTER = {"bf16": _STATE_BYTES["bf16-moments"], "8bit": (2 + 4, 2 + 4, 8)}
# The 8-bit moments' kernel: the exact update's arithmetic plus decoding, rounding and drawing bits for two moments.
# It moves 10 bytes a parameter with bf16 weights (14 with an fp32 master) against the exact update's 28, which the
# profile's rate is (memory-bound on a server), and updates 0.4e9 parameters a second a core when compute binds
# it, which it does on fewer than about 40 cores (AVX-512, 200M parameters: 0.39-0.45e9 on one thread, 0.75-0.93e9
# on two; bench/results/adam_compact_state/ and bench/README.md).
_FP8_BYTES_VS_EXACT = {"bfloat16": 10 / 28, "float32": 14 / 28}
_FP8_PARAMS_PER_CORE_S = 0.4e9


# What each state precision keeps, as the plan's placement and finetune's header say it.
STATE_WORDS = {
    "fp32": "fp32 master and moments",
    "bf16-moments": "fp32 master, bf16 moments: not exact AdamW",
    "bf16": "bf16 moments, no fp32 master for bfloat16 weights (stochastic rounding): not exact AdamW",
    "8bit": "8-bit moments, no fp32 master for bfloat16 weights (stochastic rounding): not exact AdamW",
}


def state_bytes_per_param(state_precision: str, dtype: str) -> tuple[int, int, int]:
    """Bytes of one parameter's optimizer state a step: (store read, store written, host bytes of one resident
    generation)."""
    if state_precision in _WITH_MASTER and dtype != "bfloat16":  # other weights keep a master (fp32: the weights)
        return _WITH_MASTER[state_precision]
    return _STATE_BYTES[state_precision]

_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
_HOST_OVERHEAD_BYTES = 1 << 30  # the interpreter, torch and the I/O threads' buffers, besides the budgets
# bench/bench_plan.py finds the plan within 15% of finetune from a 25M-parameter GPT (d_model 512, 8 layers) up to
# GPT-2 124M, and on the small preset (3.3M) with the model on the device, activations kept (1.0x, with the
# optimizer's calibrated time per tensor). Streamed with activation offload the small preset's steps took 1.3x the
# plan's before the plan counted each saved tensor's round trip and the transfers its staging cannot overlap; with
# them 1.04x (0.441 s planned, 0.425 s measured: the median of 3 x 6 steps, repetitions 0.40-0.48 s). Other choices
# below 20M (streamed with activations kept, recomputed) are not checked.
# Below this size a plan that streams or does not keep its activations says so.
_CHECKED_FROM_PARAMS = 20_000_000


def human_size(nbytes: int) -> str:
    """``170917888`` -> ``"163M"``: a byte count as a person reads it and the command line takes it (K, M, G, T of
    1024), three significant digits at most, rounded up (a size said to be needed is then enough)."""
    for suffix, unit in (("T", 1 << 40), ("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if nbytes >= unit:
            break
    else:
        return f"{nbytes}B"
    value = nbytes / unit
    decimals = 0 if value >= 100 else 1 if value >= 10 else 2
    text = f"{math.ceil(round(value * 10**decimals, 6)) / 10**decimals:.{decimals}f}"
    return (text.rstrip("0").rstrip(".") if decimals else text) + suffix


def human_count(n: int) -> str:
    """``181248`` -> ``"181K"``, ``69e9`` -> ``"69B"``: a count (of parameters) in thousands, millions, billions,
    three significant digits."""
    for suffix, unit in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= unit:
            return f"{n / unit:.3g}{suffix}"
    return str(n)


def block_flops(d_model: int, mlp_ratio: float, batch: int, seq: int, *, ffn: int | None = None, gated: bool = False) -> tuple[float, float]:
    """FLOPs of one transformer block's forward and backward on ``batch`` sequences of ``seq`` tokens: its
    matrices' (6 per parameter per token) and its attention's (12 * seq * d_model per token)."""
    f = ffn if ffn is not None else int(mlp_ratio * d_model)
    matrices = 4 * d_model * d_model + (3 if gated else 2) * d_model * f
    return 6 * matrices * batch * seq, 12 * batch * seq * seq * d_model


@dataclass(frozen=True)
class ModelShape:
    """A decoder-only transformer's sizes, as the planner needs them."""

    name: str
    n_layer: int
    d_model: int
    n_head: int
    ffn: int
    vocab_size: int
    max_seq_len: int
    tied_embeddings: bool = True
    gated_mlp: bool = False  # three MLP matrices and RMS norms, no biases (Llama), else two, LayerNorms, biases (GPT)
    kv_heads: int | None = None
    learned_positions: bool = True  # a position embedding of max_seq_len rows (GPT-2), else rotary
    family: str = ""  # the Hugging Face model_type, whose module names LoRA targets ("": not known, a preset)

    @property
    def block_params(self) -> int:
        d, f = self.d_model, self.ffn
        kv = d * (self.kv_heads or self.n_head) // self.n_head
        matrices = d * d + 2 * d * kv + d * d + (3 if self.gated_mlp else 2) * d * f
        if self.gated_mlp:
            return matrices + 2 * d  # two RMS norms
        return matrices + 4 * d + (d + 2 * kv + d + f + d)  # two LayerNorms; the biases

    def block_linears(self) -> list[tuple[str, int, int]]:
        """A block's linear layers as its family names them in Hugging Face transformers: (path in the block,
        in features, out features). ValueError for a family whose names the planner does not know."""
        d, f = self.d_model, self.ffn
        kv = d * (self.kv_heads or self.n_head) // self.n_head
        if self.family in _LLAMA_LIKE:
            return [("self_attn.q_proj", d, d), ("self_attn.k_proj", d, kv), ("self_attn.v_proj", d, kv), ("self_attn.o_proj", d, d),
                    ("mlp.gate_proj", d, f), ("mlp.up_proj", d, f), ("mlp.down_proj", f, d)]  # fmt: skip
        if self.family == "gpt2":
            return [("attn.c_attn", d, d + 2 * kv), ("attn.c_proj", d, d), ("mlp.c_fc", d, f), ("mlp.c_proj", f, d)]
        if self.family == "gpt_neox":
            return [("attention.query_key_value", d, 3 * d), ("attention.dense", d, d), ("mlp.dense_h_to_4h", d, f), ("mlp.dense_4h_to_h", f, d)]
        if self.family == "opt":
            return [("self_attn.q_proj", d, d), ("self_attn.k_proj", d, d), ("self_attn.v_proj", d, d), ("self_attn.out_proj", d, d),
                    ("fc1", d, f), ("fc2", f, d)]  # fmt: skip
        known = ", ".join(sorted({*_LLAMA_LIKE, "gpt2", "gpt_neox", "opt"}))
        raise ValueError(
            f"lora_rank: the planner knows the module names of {known} models, not of {self.name!r}"
            f" ({f'model_type {self.family}' if self.family else 'a preset, not a Hugging Face model'})"
        )

    def lora_block_params(self, rank: int, targets: tuple[str, ...] | None = None) -> int:
        """The LoRA adapter parameters of one block: ``rank * (in + out)`` for each linear layer that a name or
        suffix in ``targets`` matches as PEFT's ``target_modules`` does (None: PEFT's default for the family,
        what ``finetune --lora-rank`` without ``--lora-targets`` adapts)."""
        return sum(rank * (i + o) for _, i, o in self.lora_linears(targets))

    def lora_linears(self, targets: tuple[str, ...] | None = None) -> list[tuple[str, int, int]]:
        """The block's linear layers that ``targets`` adapt (see :meth:`lora_block_params`)."""
        linears = self.block_linears()
        wanted = _LORA_DEFAULT_TARGETS.get(self.family, ("q_proj", "v_proj")) if targets is None else targets
        unmatched = [t for t in wanted if not any(path == t or path.endswith("." + t) for path, _, _ in linears)]
        if unmatched:
            names = ", ".join(path.rsplit(".", 1)[-1] for path, _, _ in linears)
            raise ValueError(f"lora_targets {', '.join(unmatched)} name no linear layer of a {self.family} block ({names})")
        return [(path, i, o) for path, i, o in linears if any(path == t or path.endswith("." + t) for t in wanted)]

    @property
    def resident_params(self) -> int:
        """Outside the blocks: embeddings (and an untied head), the final norm."""
        d = self.d_model
        positions = self.max_seq_len * d if self.learned_positions else 0
        return self.vocab_size * d * (1 if self.tied_embeddings else 2) + positions + (d if self.gated_mlp else 2 * d)

    @property
    def params(self) -> int:
        return self.n_layer * self.block_params + self.resident_params

    @property
    def tensors(self) -> int:
        """Parameter tensors: a block's matrices, norms and (GPT) biases; the embeddings, an untied head, the
        final norm."""
        block = 9 if self.gated_mlp else 12
        resident = (1 if self.tied_embeddings else 2) + (1 if self.learned_positions else 0) + (1 if self.gated_mlp else 2)
        return self.n_layer * block + resident

    def saved_tensor_bytes(self, batch: int, seq: int, dtype_bytes: int) -> tuple[list[int], list[int]]:
        """The sizes of the tensors autograd saves for backward in one micro-batch of ``batch`` sequences that
        activation offload moves (those of at least its ``min_bytes``): one block's, and those outside the blocks.
        As counted on nvoffload's GPT: a block saves its two norms' inputs and outputs, q, k and v, and
        attention's output (d_model elements a token each, its heads merged in place: one tensor; k and v fewer
        with grouped queries), and its MLP's hidden before and after the activation (ffn a token; a gated MLP is
        taken to save four: the gate's, the up projection's, the activation's and their product); outside the
        blocks, the final norm's input and output and the loss's log-probabilities (vocab_size a token)."""
        d = self.d_model
        kv = d * (self.kv_heads or self.n_head) // self.n_head
        block = [d] * 6 + [kv] * 2 + [self.ffn] * (4 if self.gated_mlp else 2)
        sizes = ([w * batch * seq * dtype_bytes for w in widths] for widths in (block, [d, d, self.vocab_size]))
        return tuple([size for size in group if size >= ActivationOffloadConfig.min_bytes] for group in sizes)

    def flops(self, batch: int, seq: int) -> tuple[float, float]:
        """Forward and backward FLOPs of one micro-batch: the matrices' (the LM head's included) and attention's."""
        matrices, attention = block_flops(self.d_model, 0, batch, seq, ffn=self.ffn, gated=self.gated_mlp)
        head = 6 * self.vocab_size * self.d_model * batch * seq
        return self.n_layer * matrices + head, self.n_layer * attention

    def activation_bytes(self, batch: int, seq: int, dtype_bytes: int) -> int:
        """Bytes autograd saves for backward in one micro-batch (measured on nvoffload's GPT block: 7 d + 2 f
        elements per token per block; gated MLPs save a third f)."""
        per_token = 7 * self.d_model + (3 if self.gated_mlp else 2) * self.ffn
        return self.n_layer * batch * seq * per_token * dtype_bytes

    @classmethod
    def from_preset(cls, name: str) -> ModelShape:
        from nvoffload.models import GPTConfig

        c = GPTConfig.preset(name)
        return cls(name, c.n_layer, c.d_model, c.n_head, c.mlp_ratio * c.d_model, c.vocab_size, c.seq_len)

    @classmethod
    def named(cls, name: str) -> ModelShape:
        """A public architecture by name (see :data:`NAMED_SHAPES`)."""
        try:
            return NAMED_SHAPES[name]
        except KeyError:
            raise ValueError(f"unknown model shape {name!r}; choose one of {sorted(NAMED_SHAPES)}") from None

    @classmethod
    def from_hf_config(cls, path: str | os.PathLike) -> ModelShape:
        """From a Hugging Face ``config.json`` (a file or its directory): GPT-2, GPT-NeoX, OPT, Llama-style."""
        path = os.fspath(path)
        if os.path.isdir(path):
            path = os.path.join(path, "config.json")
        with open(path, encoding="utf-8") as f:
            c = json.load(f)
        c = c.get("text_config", c)

        def get(*names, default=None):
            return next((c[n] for n in names if c.get(n) is not None), default)

        d = get("hidden_size", "n_embd", "d_model")
        layers = get("num_hidden_layers", "n_layer", "num_layers")
        heads = get("num_attention_heads", "n_head")
        if None in (d, layers, heads) or get("vocab_size") is None:
            raise ValueError(f"{path}: not a decoder-only transformer configuration the planner knows")
        gated = c.get("model_type") in ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "phi3") or "gate_proj" in json.dumps(c)
        ffn = get("intermediate_size", "n_inner", "ffn_dim", default=4 * d)
        return cls(
            name=c.get("_name_or_path") or c.get("model_type", "model"), n_layer=layers, d_model=d, n_head=heads,
            ffn=ffn, vocab_size=get("vocab_size"), max_seq_len=get("max_position_embeddings", "n_positions", default=2048),
            tied_embeddings=bool(c.get("tie_word_embeddings", True)), gated_mlp=gated, kv_heads=get("num_key_value_heads"),
            learned_positions=c.get("model_type") in ("gpt2", "opt", "gpt_bigcode", "biogpt"), family=c.get("model_type", ""),
        )  # fmt: skip


# Families with Llama's module names (q_proj, ..., gate_proj, up_proj, down_proj), and PEFT's default LoRA targets
# (peft.utils.constants.TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING: q_proj and v_proj for those and OPT).
_LLAMA_LIKE = frozenset({"llama", "mistral", "mixtral", "qwen2", "qwen3", "gemma", "gemma2"})
_LORA_DEFAULT_TARGETS = {"gpt2": ("c_attn",), "gpt_neox": ("query_key_value",)}


# Public architectures, from their configurations (Llama: the config.json files Meta published; GPT-3: Brown et
# al. 2020, table 2.1, and a 100B model of the same shape, 80 layers of width 10240).
NAMED_SHAPES = {
    "llama2-70b": ModelShape("llama2-70b", 80, 8192, 64, 28672, 32000, 4096, tied_embeddings=False, gated_mlp=True,
                             kv_heads=8, learned_positions=False, family="llama"),
    "llama3-8b": ModelShape("llama3-8b", 32, 4096, 32, 14336, 128256, 8192, tied_embeddings=False, gated_mlp=True,
                            kv_heads=8, learned_positions=False, family="llama"),
    "gpt3-13b": ModelShape("gpt3-13b", 40, 5120, 40, 20480, 50257, 2048, family="gpt2"),
    "gpt3-100b": ModelShape("gpt3-100b", 80, 10240, 80, 40960, 50257, 2048, family="gpt2"),
    "gpt3-175b": ModelShape("gpt3-175b", 96, 12288, 96, 49152, 50257, 2048, family="gpt2"),
}  # fmt: skip


# Where a step keeps what backward needs: on the device, offloaded (activation offload), recomputed from each
# block's input, or (the vertical schedule only) every micro-batch's block inputs in the stash (host memory, NVMe
# beyond: OffloadConfig.stash_host_bytes), the rest recomputed.
ACTIVATION_KINDS = ("keep", "offload", "recompute", "stash")


def vertical_schedule_applies(*, vertical: bool, stream: bool, grad_accum_steps: int, ranks: int, lora: bool) -> bool:
    """Whether a step runs by the vertical schedule, as ``finetune`` runs it and the planner plans it: asked for
    (``vertical``), streamed, several micro-batches, one rank and no LoRA."""
    return vertical and stream and grad_accum_steps > 1 and ranks == 1 and not lora


@dataclass(frozen=True)
class PlanRequest:
    """What ``nvoffload finetune`` would be asked for (None for ``stream`` and ``activations``: the planner
    chooses).

    ``batch_size`` is the micro-batch of all ``ranks`` together (each computes ``batch_size / ranks`` of its
    sequences, as ``finetune`` under ``torchrun`` splits it); ``cpu_memory_bytes``, ``device_memory_bytes``
    and ``swap_dirs`` (the swap directories, one drive each) are every rank's own.

    ``lora_rank``: train LoRA adapters of that rank on ``lora_targets`` (names or suffixes of a block's linear
    layers, as PEFT's ``target_modules``; None: PEFT's default for the family) over the frozen model, as
    ``finetune --lora-rank`` does: the adapters alone get gradients and optimizer state.

    ``vertical``: a streamed step of several micro-batches on one rank without LoRA runs by the vertical schedule
    (:func:`nvoffload.vertical_step`, as ``finetune`` does): each block over every micro-batch while it is on the
    device, its weights moved once a step, each block's input kept per micro-batch (on the device, offloaded, or
    with ``activations="stash"`` in the stash: host memory as far as the host budget holds them beyond every
    block, NVMe beyond, none left on the device but the stash's transfers in flight) and its activations
    recomputed in backward.

    ``delayed_update``: each step's optimizer updates run during the next step's forward and backward
    (:class:`~nvoffload.optim.OffloadOptimizerConfig`'s ``delayed_update``), with a second copy of the trained
    weights (the new ones, until they land): on the device for the model there; streamed, a twin of each block
    in the host cache beside the block (so the cache holds half as many blocks) and each gradient kept in the
    store for the next step's update (4 bytes a parameter written and read), and the parameters outside the
    blocks twice on the device."""

    model: ModelShape
    batch_size: int
    seq_len: int
    grad_accum_steps: int = 1
    dtype: str = "bfloat16"
    cpu_memory_bytes: int = 64 << 20
    device_memory_bytes: int = 1 << 30
    swap_dirs: int = 1
    stream: bool | None = None
    activations: str | None = None  # "keep" (on the device), "offload", "recompute", "stash"; None: the planner chooses
    max_grad_norm: bool = False
    checksum: bool = True  # the store's CRC-32C (the default), computed on the thread that moves the bytes
    optimizer_memory_fraction: float = 0.5
    ranks: int = 1  # data-parallel processes, one GPU each
    lora_rank: int | None = None
    lora_targets: tuple[str, ...] | None = None
    vertical: bool = True
    state_precision: str = "fp32"  # the optimizer's (see nvoffload.optim.OffloadOptimizerConfig)
    delayed_update: bool = False

    def __post_init__(self):
        for name in ("batch_size", "seq_len", "grad_accum_steps", "cpu_memory_bytes", "device_memory_bytes", "swap_dirs", "ranks"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.dtype not in _DTYPE_BYTES:
            raise ValueError(f"dtype must be one of {sorted(_DTYPE_BYTES)}, got {self.dtype!r}")
        if self.state_precision not in STATE_PRECISIONS:
            raise ValueError(f"state_precision must be one of {', '.join(STATE_PRECISIONS)}; got {self.state_precision!r}")
        if not isinstance(self.delayed_update, bool):
            raise ValueError(f"delayed_update must be a bool, got {self.delayed_update!r}")
        if self.activations not in (None, *ACTIVATION_KINDS):
            raise ValueError(f"activations must be keep, offload, recompute, stash or None, got {self.activations!r}")
        if self.lora_targets is not None:
            object.__setattr__(self, "lora_targets", tuple(self.lora_targets))
            if self.lora_rank is None:
                raise ValueError("lora_targets needs lora_rank")
        if self.lora_rank is not None:
            if isinstance(self.lora_rank, bool) or not isinstance(self.lora_rank, int) or self.lora_rank < 1:
                raise ValueError(f"lora_rank must be a positive int, got {self.lora_rank!r}")
            self.model.lora_block_params(self.lora_rank, self.lora_targets)  # targets the model has

    def by_vertical_schedule(self, stream: bool) -> bool:
        """Whether a step (streamed or not: ``stream``) runs by the vertical schedule (see the class docstring)."""
        return vertical_schedule_applies(
            vertical=self.vertical, stream=stream, grad_accum_steps=self.grad_accum_steps, ranks=self.ranks,
            lora=self.lora_rank is not None,
        )  # fmt: skip

    @property
    def trainable_tensors(self) -> int:
        """The parameter tensors trained: the model's, or with ``lora_rank`` two a adapted layer (A and B)."""
        if self.lora_rank is None:
            return self.model.tensors
        return self.model.n_layer * 2 * len(self.model.lora_linears(self.lora_targets))

    @property
    def trainable_params(self) -> int:
        """The parameters trained: the model's, or with ``lora_rank`` its adapters' (all in the blocks)."""
        if self.lora_rank is None:
            return self.model.params
        return self.model.n_layer * self.model.lora_block_params(self.lora_rank, self.lora_targets)


@dataclass(frozen=True)
class Plan:
    """The planner's answer: where everything lives, the predicted step, and whether it fits. Over several
    ranks, the times, memory and bytes are one rank's; ``tokens_per_s`` is all ranks'."""

    request: PlanRequest
    stream: bool
    activations: str  # "keep", "offload", "recompute" or "stash"
    fits: bool
    reasons: list[str]  # why it does not fit, and what would make it fit
    placement: dict[str, str]
    cached_blocks: int
    resident_state_bytes: int  # host memory holding optimizer state resident (two generations of it), not on NVMe
    activation_memory_bytes: int | None  # activation offload's host memory (None: not offloaded)
    activation_host_bytes: int  # of the offloaded activations, those kept in host memory, not on NVMe (the vertical schedule's)
    step_s: float
    tokens_per_s: float
    tflops: float  # achieved by each rank (GPU), counting 6 FLOPs per parameter per token plus attention
    bottleneck: str  # the busiest engine: "compute", "cpu adam", "checksums", "nvme", "copies", "interconnect"
    engine_s: dict[str, float]  # each engine's busy time in the step, seconds
    phases_s: dict[str, float]  # forward, backward, step (with several ranks, the weights' all-gather in it)
    memory_bytes: dict[str, int]  # device, host, nvme
    nvme_read_bytes: int
    nvme_written_bytes: int
    communication_bytes: dict[str, int]  # sent by each rank a step, by collective ("all-reduce" or "reduce-scatter", "all-gather"); {} with one rank
    profile: str = ""
    notes: list[str] = field(default_factory=list)
    stash_host_bytes: int | None = None  # the stash's block inputs kept in host memory, the rest on NVMe (None: no stash)
    stash_staging_bytes: int | None = None  # the stash's transfers in flight, host and device (None: no stash)

    @property
    def offload_activations(self) -> bool:
        return self.activations == "offload"

    def to_dict(self) -> dict:
        d = asdict(self)
        d["request"]["model"] = asdict(self.request.model)
        return d

    def offload_config(self, swap_dirs, **overrides):
        """The :class:`nvoffload.OffloadConfig` this plan chose (with ``stream``; the model on the device
        otherwise needs only an :class:`~nvoffload.optim.NVMeAdamW`)."""
        from nvoffload.training import OffloadConfig

        r = self.request
        return OffloadConfig(
            swap_dirs=list(swap_dirs), cpu_memory_bytes=r.cpu_memory_bytes, device_memory_bytes=r.device_memory_bytes,
            offload_activations=self.offload_activations, activation_memory_bytes=self.activation_memory_bytes,
            activation_host_bytes=self.activation_host_bytes, gradient_accumulation_steps=r.grad_accum_steps,
            optimizer_memory_fraction=r.optimizer_memory_fraction, stash_host_bytes=self.stash_host_bytes,
            stash_staging_bytes=self.stash_staging_bytes, **overrides,
        )  # fmt: skip


def plan(request: PlanRequest, profile: MachineProfile, *, recompute: bool = True) -> Plan:
    """Predict a step of ``request`` on ``profile``'s machine. With ``stream`` or ``activations`` None, every
    choice (the model on the device or streamed; activations kept, offloaded, or, with ``recompute``,
    recomputed in backward from each block's input; by the vertical schedule also the block inputs in the stash)
    is planned and the fastest that fits is returned (when none fits: the most frugal, whose reasons say what
    would make it fit)."""
    streams = [request.stream] if request.stream is not None else [False, True]
    if request.activations is not None:
        kinds = [request.activations]
    else:
        kinds = ["keep", "offload"] + (["recompute"] if recompute else []) + ["stash"]
    plans = [
        _plan(request, profile, stream, kind) for stream in streams for kind in kinds
        if kind != "stash" or request.activations == "stash" or request.by_vertical_schedule(stream)
    ]  # fmt: skip
    fitting = [p for p in plans if p.fits]
    if fitting:
        return min(fitting, key=lambda p: p.step_s)
    return plans[-1]  # streamed if planned, its last kind the most frugal


def state_precision_options(chosen: Plan, profile: MachineProfile) -> dict[str, Plan]:
    """``chosen``'s step with each other optimizer state precision (same placement, batch and micro-batches):
    what a compact state would gain (or, from a compact plan, what exact AdamW costs)."""
    r = chosen.request
    return {
        p: _plan(replace(r, stream=chosen.stream, activations=chosen.activations, state_precision=p), profile,
                 chosen.stream, chosen.activations)
        for p in STATE_PRECISIONS if p != r.state_precision
    }  # fmt: skip


def delayed_update_option(chosen: Plan, profile: MachineProfile) -> Plan | None:
    """``chosen``'s step with the delayed update switched (on, or from a delayed plan off; same placement, batch
    and micro-batches); None over several ranks, where the delayed update does not run."""
    if chosen.request.ranks > 1:
        return None
    r = replace(chosen.request, stream=chosen.stream, activations=chosen.activations, delayed_update=not chosen.request.delayed_update)
    return _plan(r, profile, chosen.stream, chosen.activations)


def plan_batch(request: PlanRequest, profile: MachineProfile, *, max_tokens_per_step: int = 1 << 20,
               recompute: bool = True) -> Plan:  # fmt: skip
    """The plan of the micro-batch and number of micro-batches a step that make it bound by compute, if any does.

    Tries micro-batches of 1, 2, 4, ... sequences up to ``request.batch_size`` (each
    a multiple of its ranks) and 1, 2, 4, ... micro-batches a step, at most
    ``max_tokens_per_step`` tokens a step in all, every other field as
    ``request`` gives it, each planned by :func:`plan`. Of those that fit, returns
    the one with the fewest tokens a step whose busiest engine is compute (more
    tokens a step only cost convergence), else the one with the most tokens/s;
    when none fits, ``plan(request)``, whose reasons say why.
    """
    if max_tokens_per_step < request.seq_len:
        raise ValueError(f"max_tokens_per_step {max_tokens_per_step} is less than one sequence of {request.seq_len}")
    sizes = sorted({1 << i for i in range(request.batch_size.bit_length()) if 1 << i <= request.batch_size} | {request.batch_size})
    fitting = []
    for rows in (b for b in sizes if b % request.ranks == 0):
        accum = 1
        while rows * accum * request.seq_len <= max_tokens_per_step:
            chosen = plan(replace(request, batch_size=rows, grad_accum_steps=accum), profile, recompute=recompute)
            if chosen.fits:
                fitting.append(chosen)
            accum *= 2
    if not fitting:
        return plan(request, profile, recompute=recompute)
    bound = [p for p in fitting if p.bottleneck == "compute"]
    if bound:
        return min(bound, key=lambda p: (_tokens_per_step(p.request), -p.tokens_per_s))
    return max(fitting, key=lambda p: p.tokens_per_s)


def _stash_place(kind: str, in_host_bytes: int, offloaded_bytes: int) -> str:
    """Where the vertical schedule keeps its block inputs (activations ``kind``)."""
    if kind == "stash" and in_host_bytes >= offloaded_bytes:
        return f"in the stash: host memory, {human_size(in_host_bytes)}"
    if kind == "stash":
        return f"in the stash: {human_size(in_host_bytes)} in host memory, the rest on NVMe"
    if kind != "offload":
        return "on the device"
    if not in_host_bytes:
        return "offloaded to NVMe"
    if in_host_bytes >= offloaded_bytes:
        return f"offloaded to host memory, {human_size(in_host_bytes)}"
    return f"offloaded: {human_size(in_host_bytes)} in host memory, the rest to NVMe"


@dataclass(frozen=True)
class SwapBytes:
    """What one rank's swap directories hold at the most in a step, in bytes, by what holds them
    (:func:`swap_bytes`); the store's 4 KiB alignment of each tensor comes on top."""

    weights: int  # streamed, the parameters (with the delayed update, each block's twin too); else 0
    state: int  # one generation of the optimizer state in the store; two coexist until a step commits
    state_params: int  # the parameters whose state is in the store (not kept resident in host memory)
    kept_gradients: int  # one set of fp32 gradient sums kept in the store; the delayed update keeps two
    kept_gradient_sets: int
    activations: int  # a micro-batch's offloaded activations
    stashed: int = 0  # by the vertical schedule, the stash's block inputs beyond its host memory

    @property
    def total(self) -> int:
        return (self.weights + 2 * self.state + self.kept_gradient_sets * self.kept_gradients + self.activations
                + self.stashed)  # fmt: skip

    def parts(self) -> str:
        """What needs the space, each part's bytes named (for the free-space check's message)."""
        parts = [f"the weights ({self.weights} bytes)"] if self.weights else []
        parts.append(f"the optimizer state (two generations of {self.state} bytes)")
        if self.kept_gradients:
            parts.append(f"the kept gradients ({self.kept_gradient_sets * self.kept_gradients} bytes)")
        if self.activations:
            parts.append(f"a micro-batch's offloaded activations ({self.activations} bytes)")
        if self.stashed:
            parts.append(f"the stash's block inputs beyond its host memory ({self.stashed} bytes)")
        return ", ".join(parts[:-1]) + " and " + parts[-1] if len(parts) > 1 else parts[0]


def swap_bytes(r: PlanRequest, *, stream: bool, offload: bool, resident_state_bytes: int = 0,
               stash_host_bytes: int | None = None) -> SwapBytes:  # fmt: skip
    """The bytes one rank of ``r`` keeps in its swap directories (``stream``: the parameters streamed; ``offload``:
    the activations offloaded; ``stash_host_bytes``, by the vertical schedule: the block inputs of every
    micro-batch in the stash, those beyond it on NVMe): what the plan's NVMe memory is, and what ``finetune`` checks the free space for
    before anything is written. ``resident_state_bytes`` of host memory keep two generations of some parameters'
    state out of the store (the plan's share; the check counts none, the most the store can hold).

    The optimizer state is two generations of :func:`state_bytes_per_param`'s written bytes a trained parameter
    (with 8-bit moments and 2 bytes more a block of 256 for their scales); with LoRA only the adapters have state.
    Streamed, the store holds every weight (and the adapters), with the delayed update each block's twin too (all
    the weights twice, an upper bound), and with accumulation, the delayed update or clipping by the vertical
    schedule, each trained parameter's fp32 gradient sum."""
    shard = -(-r.trainable_params // r.ranks)  # the parameters whose optimizer state one rank keeps
    _, written, home = state_bytes_per_param(r.state_precision, r.dtype)
    on_nvme = max(0, shard - resident_state_bytes // (2 * home))
    scales = 2 * -(-on_nvme // FP8_BLOCK) if r.state_precision == "8bit" else 0  # an int8 exponent a moment a block
    dtype_bytes = _DTYPE_BYTES[r.dtype]
    adapters = r.trainable_params if r.lora_rank is not None else 0
    weights = (r.model.params + adapters) * dtype_bytes * (2 if r.delayed_update else 1) if stream else 0
    # fp32 gradient sums kept between micro-batches; by the vertical schedule none, but with clipping each gradient
    # once, for the redo of a step whose norm clips; delayed: two (one step's read by its updates while the next
    # step's is written)
    vertical = r.by_vertical_schedule(stream)
    g = r.grad_accum_steps
    kept = shard * 4 if stream and (r.delayed_update or g > 1 and (not vertical or r.max_grad_norm)) else 0
    rows = -(-r.batch_size // r.ranks)
    activations = r.model.activation_bytes(rows, r.seq_len, dtype_bytes) if offload else 0
    stashed = 0
    if stash_host_bytes is not None and vertical:
        stashed = max(0, g * r.model.n_layer * rows * r.seq_len * r.model.d_model * dtype_bytes - stash_host_bytes)
    return SwapBytes(weights=weights, state=on_nvme * written + scales, state_params=on_nvme, kept_gradients=kept,
                     kept_gradient_sets=2 if r.delayed_update else 1, activations=activations, stashed=stashed)  # fmt: skip


def _tokens_per_step(r: PlanRequest) -> int:
    return r.batch_size * r.grad_accum_steps * r.seq_len


@dataclass(frozen=True)
class _Sizes:
    """One choice's sizes, one rank's (:func:`_sizes`): bytes, or parameters where named."""

    stream: bool
    kind: str  # activations: "keep", "offload" or "recompute"
    offload: bool
    vertical: bool  # by the vertical schedule: kind "keep", "offload" or "stash" the blocks' inputs, the rest recomputed
    stash: bool  # by the vertical schedule, the blocks' inputs in the stash (host memory, NVMe beyond)
    delayed: bool  # a second copy of the trained weights: on the device, or streamed the blocks' twins
    lora: bool
    n: int  # ranks
    g: int  # micro-batches a step
    passes: int  # how often a step moves each block's weights and gradients
    rows: int  # a rank's sequences of each micro-batch
    trainable: int  # parameters: with LoRA the adapters
    adapters: int  # parameters besides the model's own
    shard: int  # the parameters whose optimizer state one rank keeps and updates
    resident_trainable: int  # parameters outside the blocks that are trained
    dtype_bytes: int
    activations: int  # a micro-batch's saved activations
    block_bytes: int
    changed_block_bytes: int  # what an update writes of a block
    block_inputs: int  # a micro-batch's
    device_needs: int  # the weights (streamed: the blocks on the device) and gradients
    activation_host: int  # activation offload's host memory
    stash_staging: int  # the stash's transfers in flight: host memory, and as much device memory
    kept_activations: int  # on the device


def _sizes(r: PlanRequest, stream: bool, kind: str) -> _Sizes:
    """What one choice's weights, gradients and activations weigh, and what the device keeps of them."""
    m = r.model
    n = r.ranks
    rows = -(-r.batch_size // n)  # a rank's sequences of each micro-batch (the busiest rank's when they do not split)
    lora = r.lora_rank is not None
    trainable = r.trainable_params  # with LoRA the adapters, in the blocks; the rest frozen: no gradients, no state
    adapters = trainable if lora else 0  # besides the model's own parameters
    shard = -(-trainable // n)  # the parameters whose optimizer state one rank keeps and updates
    dtype_bytes = _DTYPE_BYTES[r.dtype]
    weights = (m.params + adapters) * dtype_bytes
    activations = m.activation_bytes(rows, r.seq_len, dtype_bytes)  # full training's: LoRA's frozen layers save less
    block_bytes = (m.block_params + adapters // m.n_layer) * dtype_bytes
    changed_block_bytes = (adapters // m.n_layer if lora else m.block_params) * dtype_bytes  # what an update writes
    resident = m.resident_params * dtype_bytes
    resident_trainable = 0 if lora else m.resident_params
    delayed = r.delayed_update  # a second copy of the trained weights: on the device, or streamed the blocks' twins
    copies_of_trained = 2 if delayed else 1  # the weights (and the staged new ones) on the device besides gradients
    device_needs = (resident + copies_of_trained * resident_trainable * dtype_bytes + 3 * block_bytes) if stream else weights + copies_of_trained * trainable * dtype_bytes
    offload = kind == "offload"
    vertical = r.by_vertical_schedule(stream)  # kind: "keep" or "offload" the blocks' inputs, the rest recomputed
    g = r.grad_accum_steps
    passes = 1 if vertical else g  # how often a step moves each block's weights and gradients
    # Activation offload's host memory, which also bounds what it keeps on the device (up to half of it in
    # writes in flight, half in reads ahead, a third in the latest tensors): what the device has left, at
    # most an eighth of the host budget, at least twice the largest saved tensor.
    largest_saved = rows * r.seq_len * max(m.ffn, m.d_model) * dtype_bytes
    activation_host = 0
    if offload:
        room = int(0.75 * max(0, r.device_memory_bytes - device_needs))
        activation_host = max(2 * largest_saved, min(r.cpu_memory_bytes // 8, room))
    block_inputs = m.n_layer * rows * r.seq_len * m.d_model * dtype_bytes  # a micro-batch's
    stash = vertical and kind == "stash"
    # the stash's staging: one block's inputs over every micro-batch written behind, one block's read ahead
    stash_staging = 2 * g * (block_inputs // m.n_layer) if stash else 0
    if stash:  # its transfers in flight, one block's inputs and outputs over the micro-batches, one block's activations
        kept_activations = 2 * stash_staging + activations // m.n_layer
    elif vertical:  # every micro-batch's block inputs (offloaded: what the staging keeps), one block's activations
        inputs = g * block_inputs
        kept_activations = (min(inputs, activation_host * 4 // 3) if offload else inputs) + activations // m.n_layer
    elif kind == "recompute":  # each block's input, and one block's activations while it is recomputed
        kept_activations = block_inputs + activations // m.n_layer
    else:
        kept_activations = min(activations, activation_host * 4 // 3) if offload else activations
    return _Sizes(
        stream=stream, kind=kind, offload=offload, vertical=vertical, stash=stash, delayed=delayed, lora=lora, n=n, g=g, passes=passes,
        rows=rows, trainable=trainable, adapters=adapters, shard=shard, resident_trainable=resident_trainable,
        dtype_bytes=dtype_bytes, activations=activations, block_bytes=block_bytes, changed_block_bytes=changed_block_bytes,
        block_inputs=block_inputs, device_needs=device_needs, activation_host=activation_host,
        stash_staging=stash_staging, kept_activations=kept_activations,
    )  # fmt: skip


@dataclass(frozen=True)
class _HostSplit:
    """How one choice's host budget is shared (:func:`_host_split`), bytes."""

    stream_host: int  # left for parameter blocks (less the vertical schedule's block inputs kept in host memory)
    aligned_block: int  # a block in the store's 4 KiB alignment
    cached: int  # blocks the host cache holds
    block_saved: list[int]  # the tensors a block saves for backward, offloaded
    outside_saved: list[int]  # the tensors saved outside the blocks (the loss's log-probabilities), offloaded
    act_io: int  # the offloaded activations a step moves between device and host
    activations_in_host: int  # of them, those kept in host memory, not on NVMe
    resident_host: int  # host memory holding optimizer state resident (two generations of it), not on NVMe


def _host_split(r: PlanRequest, s: _Sizes) -> _HostSplit:
    """The host budget between the optimizer's staging, the cached blocks, the offloaded block inputs kept there
    and the optimizer state kept resident."""
    m = r.model
    optimizer_host = int(r.cpu_memory_bytes * r.optimizer_memory_fraction)
    stream_host = r.cpu_memory_bytes - optimizer_host - (s.activation_host + s.stash_staging if s.stream else 0)
    aligned_block = -(-s.block_bytes // 4096) * 4096
    # delayed: each cached block beside its twin (the new weights its update writes while the block is read)
    cached = min(m.n_layer, stream_host // ((2 if s.delayed else 1) * aligned_block)) if s.stream else m.n_layer
    # Streaming: what caching every block leaves, with OffloadConfig's default prefetch_blocks (1), which the plan's
    # offload_config keeps; the model on the device: what the optimizer's staging leaves (as finetune gives it).
    leftover = resident_state_share(stream_host, [s.block_bytes] * m.n_layer if s.stream else [], 1, delayed_update=s.delayed)
    # The vertical schedule's offloaded block inputs (and what the head saves) stay in host memory as far as that
    # leftover holds them, NVMe beyond (OffloadConfig.activation_host_bytes, or the stash's stash_host_bytes): each
    # byte kept there saves a byte written and a byte read a step, more than a byte of resident optimizer state
    # saves; the rest is for that. The stash moves the block inputs alone.
    block_saved, outside_saved = m.saved_tensor_bytes(s.rows, r.seq_len, s.dtype_bytes) if s.offload else ([], [])
    if s.vertical and (s.offload or s.stash):  # what a checkpointed block saves: its input
        block_saved = [s.block_inputs // m.n_layer]
    act_io = s.g * ((s.block_inputs if s.vertical else s.activations) + sum(outside_saved)) if s.offload or s.stash else 0
    in_host = s.vertical and (s.offload or s.stash) and s.stream
    activations_in_host = min(act_io, leftover) // 4096 * 4096 if in_host else 0
    stream_host -= activations_in_host
    resident_host = resident_state_share(stream_host, [s.block_bytes] * m.n_layer if s.stream else [], 1, delayed_update=s.delayed)
    return _HostSplit(
        stream_host=stream_host, aligned_block=aligned_block, cached=cached, block_saved=block_saved,
        outside_saved=outside_saved, act_io=act_io, activations_in_host=activations_in_host, resident_host=resident_host,
    )  # fmt: skip


@dataclass(frozen=True)
class _Memory:
    """What one choice needs of each tier, bytes, and why it does not fit (:func:`_memory`)."""

    device_used: int
    host_used: int
    space: SwapBytes  # what the swap directories hold
    reasons: list[str]  # why it does not fit, and what would make it fit


def _memory(r: PlanRequest, profile: MachineProfile, s: _Sizes, host: _HostSplit) -> _Memory:
    """Each tier's bytes, and the refusals: what the choice cannot do or does not fit, and what would make it fit."""
    m, n, delayed, stream_host, aligned_block = r.model, s.n, s.delayed, host.stream_host, host.aligned_block
    reasons: list[str] = []
    if delayed and n > 1:
        reasons.append("delayed_update runs on one process: not over several ranks")
    if r.seq_len > m.max_seq_len:
        reasons.append(f"seq_len {r.seq_len} exceeds the model's context of {m.max_seq_len}")
    if r.batch_size % n:
        reasons.append(
            f"batch_size {r.batch_size} does not split evenly between {n} ranks (each computes batch_size / ranks"
            f" of every micro-batch's sequences): take a multiple of {n}"
        )
    if s.kind == "stash" and not s.stash:
        reasons.append("the stash keeps the vertical schedule's block inputs: it needs a streamed step of several"
                       " micro-batches on one rank without LoRA")  # fmt: skip
    in_host = 5 if delayed else 3  # one block computing, one arriving, one read ahead; a twin and its block
    if s.stream and stream_host < in_host * aligned_block:
        need = int((in_host * aligned_block + s.activation_host + s.stash_staging) / (1 - r.optimizer_memory_fraction)) + 1
        reasons.append(
            f"the host budget left for parameter blocks ({human_size(max(0, stream_host))}) holds fewer than"
            f" {'five' if delayed else 'three'} blocks of {human_size(s.block_bytes)}: raise cpu_memory_bytes to at"
            f" least {human_size(need)}"
        )
    device_used = s.device_needs + s.kept_activations
    if device_used > r.device_memory_bytes:
        ways = [w for w, done in (("stream the parameters", s.stream), ("offload or recompute activations", s.kind != "keep")) if not done]
        ways += [f"give device_memory_bytes {human_size(device_used)}", "take a smaller batch or sequence"]
        reasons.append(
            f"the device needs {human_size(device_used)} ({'streamed blocks and resident parameters' if s.stream else 'weights and gradients'}"
            f" {human_size(s.device_needs)}, activations {human_size(s.kept_activations)}), more than device_memory_bytes"
            f" {human_size(r.device_memory_bytes)}: {', or '.join(ways)}"
        )
    # what the swap directories hold
    space = swap_bytes(r, stream=s.stream, offload=s.offload, resident_state_bytes=host.resident_host,
                       stash_host_bytes=host.activations_in_host if s.stash else None)  # fmt: skip
    host_used = r.cpu_memory_bytes + _HOST_OVERHEAD_BYTES + (0 if profile.device == "cuda" else device_used)
    if host_used > profile.host_memory_bytes:
        each = " per rank" if n > 1 else ""
        reasons.append(f"host memory{each}: {human_size(host_used)} needed, {human_size(profile.host_memory_bytes)} free: lower cpu_memory_bytes")
    return _Memory(device_used=device_used, host_used=host_used, space=space, reasons=reasons)


@dataclass(frozen=True)
class _Traffic:
    """The bytes a step of one choice moves, one rank's (:func:`_traffic`)."""

    evicted: int  # blocks the host cache does not hold
    state: int  # of the optimizer state in the store, written
    state_in: int  # and read
    act_nvme: int  # offloaded activations written to NVMe, and read back
    read: int  # from NVMe
    written: int  # to NVMe
    h2d: int  # copied host to device
    d2h: int  # and device to host
    communication: dict[str, float]  # sent to the other ranks, by collective; {} with one rank


def _traffic(r: PlanRequest, s: _Sizes, host: _HostSplit, space: SwapBytes) -> _Traffic:
    """What a step reads and writes on NVMe, copies between host and device, and sends to the other ranks."""
    m, n, g, passes, stream, delayed = r.model, s.n, s.g, s.passes, s.stream, s.delayed
    block_bytes, shard, dtype_bytes, act_io = s.block_bytes, s.shard, s.dtype_bytes, host.act_io
    # a step reads and writes one generation of the state in the store (the 8-bit moments' scales, 1/128 byte a
    # parameter, not counted as traffic)
    state_read, state_written, _ = state_bytes_per_param(r.state_precision, r.dtype)
    state, state_in = space.state_params * state_written, space.state_params * state_read
    kept_grads = space.kept_gradients
    evicted = m.n_layer - host.cached
    # delayed: an evicted block is read once more, to start its twin
    weight_reads = (2 * passes + (1 if delayed else 0)) * evicted * block_bytes if stream else 0
    weight_writes = m.n_layer * s.changed_block_bytes if (stream and evicted > 0) else 0
    # activation offload moves the blocks' activations and the tensors saved outside them (the loss's log-probabilities):
    # all of them between device and host, to NVMe those not kept in host memory
    act_nvme = act_io - host.activations_in_host
    if delayed:  # every micro-batch keeps its gradient (its pass's sum), the next step's update reads the sum
        kept_io = kept_read = passes * kept_grads
    else:  # the micro-batches before the last keep theirs, read back by the next
        kept_io = kept_grads if s.vertical else (g - 1) * kept_grads
        kept_read = 0 if s.vertical else kept_io
    read = state_in + weight_reads + act_nvme + kept_read
    written = state + weight_writes + act_nvme + kept_io
    h2d = (passes * 2 * m.n_layer * block_bytes if stream else shard * dtype_bytes) + act_io  # a rank's updated weights
    d2h = passes * shard * dtype_bytes + act_io  # the gradients of a rank's parameters
    wire = (n - 1) / n * s.trainable * dtype_bytes  # one rank's bytes in a ring collective over all the trained parameters
    communication: dict[str, float] = {}
    if n > 1:  # the gradients to their owners (streaming: each backward's), then the owners' new weights to all
        communication = {"reduce-scatter": g * wire} if stream else {"all-reduce": 2 * wire}
        communication["all-gather"] = wire
    return _Traffic(
        evicted=evicted, state=state, state_in=state_in, act_nvme=act_nvme, read=read, written=written, h2d=h2d,
        d2h=d2h, communication=communication,
    )  # fmt: skip


@dataclass(frozen=True)
class _EngineTimes:
    """Each engine's busy time in a step of one choice, seconds, and what the phases take of them
    (:func:`_engine_times`)."""

    flops: float  # the step's
    compute: float
    fwd_share: float  # of compute, forward's
    adam: float
    saved_s: float  # activation offload's fixed work per saved tensor, on the training thread
    serial: float  # the share of the offloaded activations' bytes that compute waits for
    nvme_read_s: float
    nvme_write_s: float
    copies: float
    crc_rate: float  # bytes/s, of all the I/O threads
    checksums: float
    reduce_s: float
    gather_s: float

    def busy_s(self) -> dict[str, float]:
        """Each engine's busy time, as :attr:`Plan.engine_s` names them."""
        return {"compute": self.compute, "cpu adam": self.adam, "checksums": self.checksums,
                "nvme": self.nvme_read_s + self.nvme_write_s, "copies": self.copies,
                "interconnect": self.reduce_s + self.gather_s}  # fmt: skip


def _engine_times(r: PlanRequest, profile: MachineProfile, s: _Sizes, host: _HostSplit, moved: _Traffic) -> _EngineTimes:
    """The time of each engine's work in a step: compute, CPU Adam, checksums, NVMe, copies and the interconnect."""
    m, g, rows, adapters, shard, n = r.model, s.g, s.rows, s.adapters, s.shard, s.n
    matrices, attention = m.flops(rows, r.seq_len)
    # 2 FLOPs a parameter a token forward, 4 backward, of which frozen weights need only the 2 for their input's gradient
    forward_matrices = matrices / 3 + 2 * adapters * rows * r.seq_len
    if s.lora:
        matrices = 2 * forward_matrices + 2 * adapters * rows * r.seq_len
    flops = g * (matrices + attention)
    matrix_rate, attention_rate, overhead = profile.block_rates(m.d_model)
    per_micro_batch = matrices / matrix_rate + attention / attention_rate + m.n_layer * overhead
    fwd_share = (forward_matrices / matrix_rate + (attention / attention_rate + m.n_layer * overhead) / 3) / per_micro_batch
    compute = g * per_micro_batch * (4 / 3 if s.kind == "recompute" or s.vertical else 1)
    # the updates' work, and each of a rank's tensors' fixed time (its requests to the store, the worker's hand-offs)
    adam = shard / profile.adam_params_per_s["float32" if r.dtype == "float32" else "bfloat16"]
    if r.state_precision == "8bit":  # fewer bytes than the exact update's, more arithmetic
        bytes_share = _FP8_BYTES_VS_EXACT["bfloat16" if r.dtype == "bfloat16" else "float32"]
        adam = max(adam * bytes_share, shard / (profile.cpu_cores * _FP8_PARAMS_PER_CORE_S))
    adam += -(-r.trainable_tensors // n) * profile.optimizer_tensor_s
    # Activation offload: each saved tensor's fixed work (its pack and unpack on the training thread, its store
    # requests), half in forward and half in backward; and the share of its bytes that compute waits for. Its staging
    # holds half of activation_host in writes in flight and half in reads ahead: a tensor's transfer overlaps compute
    # only as far as that half leaves room beside it (one that fills it is written, or read back, while compute waits).
    saved = host.block_saved * m.n_layer + host.outside_saved
    saved_s = g * len(saved) * profile.saved_tensor_s
    # The stash writes a block's inputs behind the next block's compute and reads them back a block ahead: none waited for.
    serial = sum(b * min(1.0, 2 * b / s.activation_host) for b in saved) / sum(saved) if saved and not s.stash else 0.0
    drives = profile.nvme(r.swap_dirs)
    nvme_read_s, nvme_write_s = moved.read / (drives.read_gbps * 1e9), moved.written / (drives.write_gbps * 1e9)
    copies = moved.h2d / (profile.h2d_gbps * 1e9) + moved.d2h / (profile.d2h_gbps * 1e9)
    # CRC-32C, computed by each I/O thread over the blocks it moves: as many threads at once as the cores allow
    crc_rate = profile.crc32c_gbps * 1e9 * min(IOConfig().num_threads, profile.cpu_cores)
    checksums = (moved.read + moved.written) / crc_rate if r.checksum else 0.0
    link = profile.interconnect_gbps * 1e9
    reduce_s = (moved.communication.get("all-reduce", 0) + moved.communication.get("reduce-scatter", 0)) / link
    gather_s = moved.communication.get("all-gather", 0) / link
    return _EngineTimes(
        flops=flops, compute=compute, fwd_share=fwd_share, adam=adam, saved_s=saved_s, serial=serial,
        nvme_read_s=nvme_read_s, nvme_write_s=nvme_write_s, copies=copies, crc_rate=crc_rate, checksums=checksums,
        reduce_s=reduce_s, gather_s=gather_s,
    )  # fmt: skip


@dataclass(frozen=True)
class _Phases:
    """A step's phases, seconds (:func:`_phases`)."""

    forward: float
    backward: float
    step_call: float  # optimizer.step()'s: the held updates, with several ranks the weights' all-gather
    held: bool  # gradients held for clipping: the updates run in step()

    @property
    def step_s(self) -> float:
        return self.forward + self.backward + self.step_call


def _phases(r: PlanRequest, profile: MachineProfile, s: _Sizes, moved: _Traffic, t: _EngineTimes) -> _Phases:
    """The engines' times as the step's phases, forward, backward and the step call, each as long as its busiest
    engine (see the module's docstring)."""
    stream, delayed, g, drives = s.stream, s.delayed, s.g, profile.nvme(r.swap_dirs)
    compute, fwd_share, adam, checksums, copies, serial, saved_s = t.compute, t.fwd_share, t.adam, t.checksums, t.copies, t.serial, t.saved_s
    nvme_read_s, nvme_write_s, crc_rate, reduce_s, gather_s = t.nvme_read_s, t.nvme_write_s, t.crc_rate, t.reduce_s, t.gather_s
    state, state_in, act_nvme = moved.state, moved.state_in, moved.act_nvme
    on_cpu = profile.device == "cpu"

    def beside_io(compute_s: float, io_s: float) -> float:  # both at once, each slowed by the other as measured
        return overlapped_s(compute_s, io_s, profile.compute_with_io, profile.io_with_compute)

    # forward reads the blocks the cache lacks and writes the offloaded activations; backward does the rest
    act_write_s, act_read_s = act_nvme / (drives.write_gbps * 1e9), act_nvme / (drives.read_gbps * 1e9)
    fwd_io = (moved.evicted * s.block_bytes * s.passes if stream else 0) / (drives.read_gbps * 1e9) + act_write_s

    def with_thread(device_s: float, thread_s: float) -> float:  # the training thread's own work beside the device's
        return device_s + thread_s if on_cpu else max(device_s, thread_s)  # a GPU's thread runs ahead of it

    forward_io = fwd_io - serial * act_write_s
    forward = with_thread(beside_io(compute * fwd_share + (copies / 2 if on_cpu else 0), forward_io) + serial * act_write_s, saved_s / 2)
    held = r.max_grad_norm and not stream and not delayed  # gradients held for clipping: the updates run in step()
    # The parameters outside the blocks (embeddings, a tied LM head) have their last gradient only as backward
    # ends: their updates and their optimizer state's traffic run after it, a tail the step waits for.
    last = 0.0 if held else s.resident_trainable / s.trainable
    state_io = state_in / (drives.read_gbps * 1e9) + state / (drives.write_gbps * 1e9)
    state_checksums = (state_in + state) / crc_rate if r.checksum else 0.0
    tail = beside_io(last * (adam + state_checksums), last * state_io)
    nvme_rest = nvme_read_s + nvme_write_s - fwd_io - last * state_io - serial * act_read_s
    cpu_backward = (compute * (1 - fwd_share) if on_cpu else 0) + (0 if held else adam + checksums - last * (adam + state_checksums)) + (copies / 2 if on_cpu else 0)
    # streaming reduces each backward's gradients; held ones are all-reduced in the last micro-batch's backward
    reducing = reduce_s if stream else (g - 1) / g * compute * (1 - fwd_share) + reduce_s
    backward = max(beside_io(max(compute * (1 - fwd_share), cpu_backward), 0 if held else nvme_rest), reducing, 0 if on_cpu else copies)
    backward = with_thread(backward + serial * act_read_s, saved_s / 2) + tail
    step_call = (beside_io(adam + checksums, nvme_rest) if held else 0.0) + gather_s
    if delayed:  # the step before's updates and their state's traffic run beside this step's forward and backward
        host = adam + checksums + (compute + copies if on_cpu else 0)
        whole = with_thread(beside_io(max(compute, host, 0 if on_cpu else copies), nvme_read_s + nvme_write_s), saved_s)
        forward, backward, step_call = whole * fwd_share, whole * (1 - fwd_share), gather_s
    return _Phases(forward=forward, backward=backward, step_call=step_call, held=held)


def _bottleneck(engines: dict[str, float], t: _EngineTimes, held: bool, on_cpu: bool) -> str:
    """The busiest engine of ``engines`` (:meth:`_EngineTimes.busy_s`), the host's work counted together where it
    shares the host's cores or is the thread the step waits for."""
    compute, adam, checksums = t.compute, t.adam, t.checksums
    busiest = max(engines, key=engines.get)
    cpu_thread = adam + checksums  # the host's work beside the device: the updates, and the I/O threads' checksums
    if (held and cpu_thread >= engines["interconnect"]) or (not on_cpu and cpu_thread > max(engines.values())):
        busiest = "cpu adam" if adam >= checksums else "checksums"
    if on_cpu and compute + adam + checksums > max(engines.values()):  # compute shares the host's cores
        busiest = max(("compute", compute), ("cpu adam", adam), ("checksums", checksums), key=lambda kv: kv[1])[0]
    return busiest


def _placement(r: PlanRequest, s: _Sizes, host: _HostSplit, held: bool) -> dict[str, str]:
    """Where one choice keeps the parameters, the optimizer state, the activations and the gradients, in words."""
    stream, delayed, n, g, kind = s.stream, s.delayed, s.n, s.g, s.kind
    if delayed:
        grads = "kept in the store for the next step's updates (the delayed update)" if stream else (
            "device until the next forward and backward copy them out (the delayed update)")
    elif n == 1:
        grads = "consumed during backward" if stream or not held else "device until step()"
    else:
        grads = "reduced to their owners during backward" if stream else (
            "device, all-reduced during the last backward" + (", until step()" if held else ", then consumed"))
    return {
        "parameters": ("NVMe, streamed block by block through host memory" if stream else "device")
        + ("; every rank its copy" if n > 1 else "")
        + (f"; {'a twin of each block' if stream else 'a second copy'} holds the delayed update's new weights" if delayed else ""),
        "optimizer state": f"NVMe ({STATE_WORDS[r.state_precision]}), updated by the CPU" + (f"; each rank 1/{n} of it" if n > 1 else "")
        + (f"; {human_size(host.resident_host // 2)} of it resident in host memory" if host.resident_host else ""),
        **({"trainable": f"LoRA adapters of rank {r.lora_rank}, {human_count(s.trainable)} parameters; the model frozen:"
                         " no gradients, no optimizer state, never written back"} if s.lora else {}),
        "activations": (f"each block's input kept for the {g} micro-batches ({_stash_place(s.kind, host.activations_in_host, host.act_io)}), the rest"
                        " recomputed in backward (vertical schedule: each block over every micro-batch while on the device)"
                        if s.vertical else {"keep": "device", "offload": "NVMe (offloaded)", "stash": "the stash (not this schedule)",
                                            "recompute": "recomputed in backward (each block's input kept)"}[kind]),
        "gradients": grads,
    }


def _plan(r: PlanRequest, profile: MachineProfile, stream: bool, kind: str) -> Plan:
    """One choice: ``stream`` or not, activations ``kind`` ("keep", "offload" or "recompute"). Its sizes; how the
    host budget is shared; what each tier needs and why it does not fit; the bytes a step moves; each engine's time;
    the phases, their bottleneck; and where everything lives."""
    s = _sizes(r, stream, kind)
    host = _host_split(r, s)
    memory = _memory(r, profile, s, host)
    moved = _traffic(r, s, host, memory.space)
    times = _engine_times(r, profile, s, host, moved)
    phases = _phases(r, profile, s, moved, times)
    engines = times.busy_s()
    step = phases.step_s
    tokens = _tokens_per_step(r)
    return Plan(
        request=r, stream=stream, activations=kind, fits=not memory.reasons, reasons=memory.reasons,
        placement=_placement(r, s, host, phases.held), cached_blocks=host.cached, resident_state_bytes=host.resident_host,
        activation_memory_bytes=s.activation_host or None, activation_host_bytes=0 if s.stash else host.activations_in_host,
        stash_host_bytes=host.activations_in_host if s.stash else None, stash_staging_bytes=s.stash_staging or None, step_s=step,
        tokens_per_s=tokens / step, tflops=times.flops / step / 1e12,
        bottleneck=_bottleneck(engines, times, phases.held, on_cpu=profile.device == "cpu"), engine_s=engines,
        phases_s={"forward": phases.forward, "backward": phases.backward, "step": phases.step_call},
        memory_bytes={"device": int(memory.device_used), "host": int(memory.host_used), "nvme": int(memory.space.total)},
        nvme_read_bytes=int(moved.read), nvme_written_bytes=int(moved.written), profile=profile.name,
        communication_bytes={k: int(v) for k, v in moved.communication.items()}, notes=_accuracy_notes(r.model, stream, kind, profile),
    )  # fmt: skip


def _accuracy_notes(m: ModelShape, stream: bool, kind: str, profile: MachineProfile) -> list[str]:
    """Where the plan is not known to be accurate (see ``_CHECKED_FROM_PARAMS``), and a profile calibrated on a busy
    machine."""
    notes = []
    if profile.busy:
        notes.append(
            f"the profile was calibrated on a busy machine ({profile.busy}): its compute as if on one core, its drives"
            " and copies as that load slowed them; calibrate again when it is quiet"
        )
    if m.params >= _CHECKED_FROM_PARAMS or (not stream and kind == "keep"):
        return notes
    return notes + [
        f"checked within 15% of measured steps from {human_count(_CHECKED_FROM_PARAMS)} parameters up, and below"
        " with the model on the device and activations kept, and on the small preset (3.26M) streamed with activation"
        " offload (1.04x); other choices below that size are not checked: take its tokens/s as an estimate"
    ]


@dataclass(frozen=True)
class CheckpointCost:
    """What a training checkpoint of a plan's run costs (:func:`checkpoint_cost`), one rank's.

    ``model_bytes`` (the weights) and ``state_bytes`` (the optimizer's state files, fp32 per element: two moments
    and, for 16-bit weights with a master, the master) are the checkpoint's, all written beside the steps;
    ``stall_s``, what it stops training: at its start, the weights outside the streamed blocks (all of a model on
    the device) copied into host memory, the rest held where it is; then the next step's updates of the blocks
    held in the host cache wait for them to be written (first) where that outlasts the forward; ``read_bytes``, one generation of the state read from the swap drives (the resident
    state's part from host memory). ``seconds``: all of it alone on the drives, the state's copy read and
    written through the same drives (a checkpoint directory on them). ``idle_s``: the drives' time free in each
    step of the plan, which the copy fills beside the steps."""

    model_bytes: int
    state_bytes: int
    read_bytes: int
    seconds: float
    stall_s: float
    idle_s: float
    step_s: float

    @property
    def nbytes(self) -> int:
        return self.model_bytes + self.state_bytes

    def run_overhead(self, save_every: int) -> float:
        """The fraction of a run's time ``--save-every save_every`` adds: training's stop at the checkpoint's
        start, and what its copy does not fit in the drives' idle time of the steps until the next."""
        background = self.seconds - self.stall_s
        added = self.stall_s + max(0.0, background - save_every * self.idle_s)
        return added / (save_every * self.step_s)


def checkpoint_cost(chosen: Plan, profile: MachineProfile) -> CheckpointCost:
    """The time and bytes of a checkpoint of ``chosen``'s run (:func:`nvoffload.start_training_checkpoint`), and
    through :meth:`CheckpointCost.run_overhead` what ``--save-every N`` costs the run."""
    r = chosen.request
    trainable = r.trainable_params // r.ranks
    master = r.dtype != "float32" and not (r.dtype == "bfloat16" and r.state_precision in _WITH_MASTER)
    state_bytes = trainable * 4 * (3 if master else 2)
    stored = trainable * state_bytes_per_param(r.state_precision, r.dtype)[1]
    read_bytes = max(0, stored - chosen.resident_state_bytes // 2)
    model_bytes = r.model.params * _DTYPE_BYTES[r.dtype]  # rank 0 writes the model
    drives = profile.nvme(r.swap_dirs)
    write_s = (model_bytes + state_bytes) / (drives.write_gbps * 1e9)
    copied = (r.model.resident_params if chosen.stream else r.model.params) * _DTYPE_BYTES[r.dtype]
    held = chosen.cached_blocks * r.model.block_params * _DTYPE_BYTES[r.dtype] if chosen.stream else 0
    held_s = held / (drives.write_gbps * 1e9)  # written first; the next step's updates of them wait until then
    stall_s = copied / (profile.d2h_gbps * 1e9) + max(0.0, held_s - chosen.phases_s.get("forward", 0.0))
    seconds = write_s + read_bytes / (drives.read_gbps * 1e9)
    idle_s = max(0.0, chosen.step_s - chosen.engine_s.get("nvme", 0.0))
    return CheckpointCost(model_bytes, state_bytes, read_bytes, seconds, stall_s, idle_s, chosen.step_s)


def checkpoint_line(chosen: Plan, profile: MachineProfile) -> str:
    """What ``nvoffload plan`` says of a checkpoint of ``chosen``'s run."""
    c = checkpoint_cost(chosen, profile)
    every = ", ".join(f"{100 * c.run_overhead(n):.2g}% every {n} steps" for n in (10, 100, 1000))
    return (
        f"checkpoint: {human_size(c.nbytes)} (model {human_size(c.model_bytes)}, optimizer state"
        f" {human_size(c.state_bytes)}), {c.seconds:.3g} s on the drives beside the steps, training stopped"
        f" {c.stall_s:.3g} s by it (the weights held); --save-every adds {every}"
    )
