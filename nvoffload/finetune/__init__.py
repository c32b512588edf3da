"""``nvoffload finetune``: fine-tune a GPT-style model with its training state on NVMe.

The model is built from a configuration in the package
(:class:`nvoffload.models.GPTConfig` presets, no download) or loaded from a
safetensors checkpoint, or it is a Hugging Face causal LM read from a local
model directory (``model_dir``: ``config.json`` and safetensors weights; needs
``transformers``, the ``[hf]`` extra). The text is the shipped corpus or a
user's file, tokenized as bytes for a preset and by the directory's tokenizer
for a Hugging Face model (as bytes when the directory has none, see
:class:`FinetuneConfig`), and the swap directory lies under the user's cache
directory (``$XDG_CACHE_HOME/nvoffload`` or ``~/.cache/nvoffload``), removed at
the end. Two modes:

- default: the model stays on the device, AdamW's state (fp32 master weights
  and moments) is on NVMe (:class:`nvoffload.optim.NVMeAdamW`);
- ``stream=True``: the parameters are on NVMe too, streamed block by block
  through host memory to the device within ``cpu_memory_bytes`` and
  ``device_memory_bytes`` (:func:`nvoffload.initialize`); the model is built on
  the meta device, so it never is in memory at once. Gradients are consumed
  during backward; accumulation, clipping and fp16 loss scaling are the
  optimizer's (:class:`nvoffload.OffloadConfig`'s ``gradient_accumulation_steps``,
  ``max_grad_norm`` and ``loss_scaling``).

Under ``torchrun --nproc-per-node N`` (or any launcher that sets ``WORLD_SIZE``,
``RANK`` and ``MASTER_ADDR``) the run is data parallel (:mod:`nvoffload.distributed`,
NCCL on CUDA, gloo on the CPU): every micro-batch of ``batch_size`` sequences is
split between the ranks, each keeps its share of the optimizer state in its own
``rank<r>`` subdirectory of the swap directory, and rank 0 reports and writes
``save_to``; checkpoints are written by all ranks together and resume on any
number of ranks.

Instruction and chat data (``data_path``: JSONL of ``{"text"}``,
``{"prompt", "completion"}`` or ``{"messages"}``, Parquet, or a ``datasets``
directory; :mod:`nvoffload.data.sft`) train with the loss on the completion's
or assistant's tokens, packed to ``seq_len``; each step's loss is the mean over
every target of its micro-batches (:func:`nvoffload.sft.causal_lm_loss`). An
evaluation split (``eval_data_path`` or ``eval_fraction``) is evaluated every
``eval_every`` steps and after the last, on the same model, its weights where
they live (:func:`nvoffload.sft.evaluate`). The metrics of every step go to
``log_dir`` (:class:`nvoffload.metrics.MetricsLog`: ``metrics.jsonl``, and
``loss.png`` at the end and at each checkpoint, at most one drawing every 10 s).

A Hugging Face model is written back as a Hugging Face directory
(:func:`nvoffload.pretrained.save_pretrained`, with the tokenizer); a preset's
as one safetensors file.

Each step reports loss, tokens/s, memory per tier and I/O GB/s.

Example::

    from nvoffload.finetune import FinetuneConfig, finetune
    result = finetune(FinetuneConfig(steps=50))
    print(result.losses[0], "->", result.losses[-1])
"""

from nvoffload.finetune.config import FinetuneConfig, default_swap_root, max_text_bytes
from nvoffload.finetune.run import FinetuneResult, StepStats, finetune, header

__all__ = ["FinetuneConfig", "FinetuneResult", "StepStats", "default_swap_root", "finetune", "header", "max_text_bytes"]
