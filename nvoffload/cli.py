"""The ``nvoffload`` command line: ``nvoffload finetune`` (the main job).

Run ``nvoffload finetune --help`` for the options; with no arguments it
fine-tunes the ``small`` GPT preset on the shipped corpus for a few minutes on
a CPU, with the optimizer state in a swap directory under the user's cache
directory; ``--model DIR`` fine-tunes a Hugging Face model directory instead.
"""

from __future__ import annotations

import argparse
import functools
import os
import re
import sys
import warnings
from collections.abc import Sequence

__all__ = ["main", "build_parser"]


def _size(text: str) -> int:
    """``512M``, ``2G``, ``65536`` -> bytes (a finite number, at least 1)."""
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
    t = text.strip().upper().removesuffix("B").removesuffix("I")
    try:
        if t and t[-1] in units:
            value = int(float(t[:-1]) * units[t[-1]])
        else:
            value = int(t)
    except (ValueError, OverflowError):  # not a number, nan; inf
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 512M, 2G)") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"a size is at least 1 byte, got {text!r}")
    return value


class _Parser(argparse.ArgumentParser):
    """Reports a bad command line as one line on stderr (``nvoffload finetune: error: ...``), exit status 2."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="nvoffload", description="Train models larger than GPU and CPU memory, state on NVMe.")
    sub = parser.add_subparsers(dest="command", required=True)
    ft = sub.add_parser(
        "finetune",
        help="fine-tune a GPT-style model with its optimizer state on NVMe",
        description="Fine-tune a causal LM (a GPT built from a preset, no download, or a local Hugging Face model"
        " directory) on the shipped corpus or a text file, with the AdamW state (fp32 master weights and moments)"
        " on NVMe.",
    )
    _run_options(ft, plan=False)

    cal = sub.add_parser("calibrate", help="measure this machine's engines (NVMe, CPU Adam, copies, compute) into a profile for 'plan'",
                         description="Measure this machine's engines through nvoffload's own code (NVMe reads and writes, CPU"
                         " Adam, host-device copies, compute per block width) into a profile that 'nvoffload plan' and"
                         " 'finetune --plan auto' predict with.")  # fmt: skip
    cal.add_argument("--swap-dir", dest="swap_dirs", action="append", default=None, help="a swap directory to measure (repeat for several; default: a fresh one under the cache directory)")
    cal.add_argument("--device", default=None, help="cuda or cpu (default: cuda when present)")
    cal.add_argument("--quick", action="store_true", help="smaller sizes: seconds instead of a minute, rougher figures")
    cal.add_argument("--out", default=None, help="where to write the profile (default: <cache>/profiles/<host>.json)")

    pl = sub.add_parser(
        "plan",
        help="predict a finetune step: where everything lives, step time, tokens/s, the bottleneck",
        description="Predict a step of the run 'nvoffload finetune' starts with the same options: where the"
        " parameters, optimizer state, activations and gradients live, each tier's memory, the NVMe traffic, the"
        " step time, tokens/s and the busiest engine, on this machine's calibrated profile or a built-in one."
        " Takes finetune's command line as it is: the options that do not change a step (--steps, --lr, --text,"
        " --data, --save-to, --checkpoint-dir, --seed, ...) are accepted and ignored, and --swap-dir repeated"
        " counts the drives. Exit status 2 when the request does not fit.",
    )
    _run_options(pl, plan=True)
    pl.add_argument("--sizes", default=None, metavar="L,D,H,F,V", help="instead of --preset or --model: layers, d_model, heads, MLP width, vocabulary (a Llama-shaped model with 'gated': L,D,H,F,V,gated)")
    pl.add_argument("--recompute", action="store_true", help="recompute activations in backward (activation checkpointing of every block)")
    pl.add_argument("--swap-dirs", type=int, default=None, metavar="N", help="swap directories (drives) used, by each rank (default: the number of --swap-dir given, else 1)")
    pl.add_argument("--ranks", type=int, default=1, help="data-parallel ranks, one GPU each (torchrun --nproc-per-node):"
                    " --batch-size is split between them; memory budgets and --swap-dirs are each rank's (default %(default)s)")  # fmt: skip
    pl.add_argument("--no-checksum", dest="checksum", action="store_false", help="plan for checksum=False (the store's CRC-32C off)")
    pl.add_argument("--json", action="store_true", help="print the plan as JSON")
    return parser


def _run_options(p: argparse.ArgumentParser, *, plan: bool) -> None:
    """``finetune``'s options, on ``finetune`` (``plan=False``) or on ``plan``, which takes the same command line:
    there ``--stream`` and ``--offload-activations`` left out let the planner choose (as ``--plan auto`` does),
    and ``--swap-dir`` repeated counts the drives."""
    from nvoffload.finetune import FinetuneConfig, default_swap_root
    from nvoffload.models.gpt import PRESETS
    from nvoffload.optim import STATE_PRECISIONS
    from nvoffload.planner.cost import NAMED_SHAPES, human_size

    d = FinetuneConfig()
    which = p.add_mutually_exclusive_group()
    which.add_argument("--preset", default=d.preset, choices=sorted(PRESETS), help="built-in GPT size (default %(default)s)")
    named = f"; or a public architecture: {', '.join(sorted(NAMED_SHAPES))}" if plan else ""
    which.add_argument("--model", dest="model_dir", default=None, metavar="DIR",
                       help="a Hugging Face causal-LM directory (config.json + *.safetensors, tokenizer files if any) to"
                       " fine-tune instead of a preset, or its Hub name org/name found in the local Hugging Face cache"
                       " (never downloaded: 'hf download org/name' fetches it); needs transformers (pip install"
                       " 'nvoffload[hf]'). Without a"
                       f" tokenizer the text is tokenized as bytes (vocabulary of at least 256){named}")  # fmt: skip
    p.add_argument("--text", dest="text_path", default=None, help="text file to train on (default: the shipped corpus): a regular file of at most 1/32 of this machine's memory (its tokens are held in memory)")
    p.add_argument("--text-encoding", default=d.text_encoding, metavar="ENC", help="the encoding of --text (default %(default)s; a byte that is not valid in it is refused, naming its offset)")
    _add_data_options(p)
    p.add_argument("--steps", type=int, default=d.steps, help="optimizer steps (default %(default)s)")
    p.add_argument("--batch-size", type=int, default=d.batch_size, help="sequences per micro-batch (default %(default)s)")
    p.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (default: the preset's context; 128 for --model)")
    if plan:
        p.add_argument("--grad-accum", dest="grad_accum_steps", type=_accum, default=d.grad_accum_steps, help="micro-batches per optimizer step, or 'auto': the planner chooses them and the micro-batch (at most --batch-size sequences, at most --max-tokens-per-step tokens a step) that make the step bound by compute, with the fewest tokens a step (default %(default)s)")
        p.add_argument("--max-tokens-per-step", type=int, default=1 << 20, metavar="N", help="with --grad-accum auto: tokens a step at most (default %(default)s)")
    else:
        p.add_argument("--grad-accum", dest="grad_accum_steps", type=int, default=d.grad_accum_steps, help="micro-batches per optimizer step (default %(default)s)")
    p.add_argument("--lr", type=float, default=d.lr, help="peak learning rate (default %(default)s)")
    p.add_argument("--warmup-steps", type=int, default=d.warmup_steps, help="steps of linear warm-up to --lr (default %(default)s)")
    p.add_argument("--weight-decay", type=float, default=d.weight_decay, help="AdamW's decoupled weight decay, on matrices and embeddings, not on biases and norms (default %(default)s)")
    p.add_argument("--max-grad-norm", type=float, default=None, help="clip the global gradient norm to this (default: no clipping)")
    p.add_argument("--optimizer-state", dest="state_precision", default=d.state_precision, choices=STATE_PRECISIONS, help="how AdamW's state is kept: fp32 (exact, 12 bytes a parameter), bf16-moments (bf16 moments beside the fp32 master, 8 bytes), bf16 (with --dtype bfloat16 also no fp32 master: weights updated by stochastic rounding, 4 bytes), 8bit (as bf16 with 8-bit moments: 2 bytes); the compact forms are not exact AdamW (default %(default)s)")
    if not plan:
        p.add_argument("--delayed-update-after", type=int, default=d.delayed_update_after, metavar="N", help="with --delayed-update, the steps that update exactly first (default %(default)s)")
    p.add_argument("--delayed-update", action="store_true", help="run each step's optimizer updates during the next step's forward and backward (weights one step behind, as PipeDream-2BW and ZeRO-Offload's delayed update; not exact AdamW; a second copy of the trained weights holds the new ones: on the device, or with --stream a twin of each block in host memory and on NVMe)")
    p.add_argument("--dtype", default=d.dtype, choices=["float32", "bfloat16", "float16"], help="parameter dtype on the device (fp32 master weights on NVMe; float16 with dynamic loss scaling; default %(default)s)")
    p.add_argument("--device", default=d.device, help="cpu or cuda (default %(default)s)" + ("; plan: the profile's device counts" if plan else ""))
    if plan:
        p.add_argument("--swap-dir", action="append", default=None, metavar="DIR", help="a swap directory (drive), repeat for several: the plan counts them")
    else:
        p.add_argument("--swap-dir", default=None, metavar="DIR", help=f"directory on NVMe for the optimizer state (default: a fresh one under {default_swap_root()}, removed at the end)")
    p.add_argument("--cpu-memory", dest="cpu_memory_bytes", type=_size, default=d.cpu_memory_bytes, metavar="SIZE", help=f"host memory for the optimizer's staging (and with --stream the parameter cache), e.g. 256M (default {human_size(d.cpu_memory_bytes)})")
    if plan:
        p.add_argument("--stream", action=argparse.BooleanOptionalAction, default=None, help="stream the parameters (default: the planner decides, as finetune --plan auto does)")
    else:
        p.add_argument("--stream", action="store_true", help="stream the parameters from NVMe too, block by block, within --cpu-memory and --device-memory (a --model is built on the meta device and filled from its directory)")
    p.add_argument("--vertical", action=argparse.BooleanOptionalAction, default=d.vertical, help="with --stream and --grad-accum > 1 (one process, no --lora-rank): each block runs over every micro-batch of the step while it is on the device, so its weights move once a step; --no-vertical: micro-batch after micro-batch (default: vertical)")
    p.add_argument("--device-memory", dest="device_memory_bytes", type=_size, default=d.device_memory_bytes, metavar="SIZE", help=f"with --stream: device memory for parameters and gradients, e.g. 2G (default {human_size(d.device_memory_bytes)})")
    if plan:
        p.add_argument("--offload-activations", action=argparse.BooleanOptionalAction, default=None, help="offload activations (default: the planner decides between keeping, offloading and recomputing them)")
    else:
        p.add_argument("--offload-activations", action="store_true", help="send the activations saved for backward to NVMe")
        p.add_argument("--activation-host-memory", dest="activation_host_bytes", type=_size, default=0, metavar="SIZE", help="with --offload-activations: keep the offloaded activations in host memory up to SIZE, besides the staging, and write only the rest to NVMe (default 0: all to NVMe; --plan auto chooses it)")
        p.add_argument("--stash-host-memory", dest="stash_host_bytes", type=_size, default=None, metavar="SIZE", help="with --stream and the vertical schedule: keep each block's inputs (every micro-batch's, until its backward) in host memory up to SIZE, taken from --cpu-memory, and the rest on NVMe, so that --grad-accum is bound by host memory and the drives, not the device (default: on the device; --plan auto chooses it)")
        p.add_argument("--stash-staging", dest="stash_staging_bytes", type=_size, default=None, metavar="SIZE", help="with --stash-host-memory: host memory (from --cpu-memory) staging the stash's transfers, half each way; it also bounds the stash's device memory (default: an eighth of the smaller of --device-memory and --cpu-memory; --plan auto chooses it)")
    p.add_argument("--activation-memory", dest="activation_memory_bytes", type=_size, default=None, metavar="SIZE", help="with --offload-activations: host memory staging their transfers (a saved tensor larger than half of it moves in pieces) (default: with --stream an eighth of --cpu-memory, else 512M)")
    p.add_argument("--init-from", default=None, help="safetensors checkpoint (file, shard directory or index .json) of the preset's model to start from")
    p.add_argument("--lora-rank", type=int, default=None, metavar="R", help="with --model: train LoRA adapters of rank R (PEFT; pip install peft) over the frozen model; --save-to then writes the adapter (adapter_model.safetensors, adapter_config.json) (default: train the whole model)")
    p.add_argument("--lora-targets", nargs="+", default=None, metavar="NAME", help="with --lora-rank: the modules to adapt, e.g. q_proj v_proj (default: PEFT's for the model's family)")
    p.add_argument("--save-to", default=None, help="write the fine-tuned weights there: a safetensors file for a preset; for --model a Hugging Face directory (sharded safetensors, config.json, tokenizer), replaced atomically. Checked for writing before training")
    p.add_argument("--checkpoint-dir", default=None, help="write training checkpoints there (weights, optimizer state, scheduler, RNG, position in the data; atomic, the last --keep-last kept), after the last step and every --save-every steps. Checked for writing before training")
    p.add_argument("--save-every", type=int, default=None, metavar="N", help="with --checkpoint-dir: a checkpoint every N steps too (default: after the last step only)")
    p.add_argument("--keep-last", type=int, default=d.keep_last, metavar="K", help="with --checkpoint-dir: keep the last K checkpoints (default %(default)s)")
    p.add_argument("--resume", action="store_true", help="go on from the latest complete checkpoint in --checkpoint-dir (from the start when there is none): the run ends bit-identical to one never stopped")
    p.add_argument("--trace", dest="trace_path", default=None, metavar="FILE", help="write a trace of one step (the second) there: Chrome trace-event JSON, open it in https://ui.perfetto.dev (compute per block, every copy, NVMe read and write, Adam chunk)")
    p.add_argument("--seed", type=int, default=d.seed, help="seed of the initial weights and of the order of the data (default %(default)s)")
    p.add_argument("--no-progress", action="store_true", help="print one line per step, as it finishes, instead of a progress bar")
    p.add_argument("--plan", choices=["auto"], default=None, help="auto: let the planner choose --stream and --offload-activations for the budgets (from --profile); a request that cannot fit is refused with the reason")
    builtin = ", ".join(sorted(_builtin_profiles()))
    p.add_argument("--profile", default=None, help=f"{'' if plan else 'with --plan: '}a profile from 'nvoffload calibrate' or a built-in name ({builtin}; default: this host's calibrated profile)")


def _add_data_options(ft: argparse.ArgumentParser) -> None:
    """finetune's options for instruction and chat data (nvoffload.data.sft) and what a run records."""
    from nvoffload.finetune import FinetuneConfig
    from nvoffload.planner.cost import human_size

    ft.add_argument("--data", dest="data_path", default=None, metavar="PATH",
                    help="instruction or chat data instead of --text: JSONL of {\"text\"}, {\"prompt\", \"completion\"} or"
                    " {\"messages\"} records, Parquet, or a datasets save_to_disk directory (local, streamed; needs"
                    " pip install 'nvoffload[hf]'); 'chat': the small chat JSONL shipped with the package")
    ft.add_argument("--loss-on", choices=["completion", "all"], default="completion",
                    help="with --data: the loss on the completion's or assistant's tokens only (default), or on all")
    ft.add_argument("--no-packing", dest="packing", action="store_false",
                    help="with --data: one example a row, padded, instead of examples packed into --seq-len")
    ft.add_argument("--max-record-size", dest="max_record_bytes", type=_size, default=FinetuneConfig.max_record_bytes,
                    metavar="SIZE", help="with --data: the longest record (a JSON line; a Parquet or datasets record's"
                    f" text) read whole; a longer one is refused naming its line (default {human_size(FinetuneConfig.max_record_bytes)})")
    ft.add_argument("--eval-data", dest="eval_data_path", default=None, metavar="PATH", help="evaluation data, as --data")
    ft.add_argument("--eval-fraction", type=float, default=None, metavar="F",
                    help="hold out this fraction of --data's examples for evaluation (instead of --eval-data)")
    ft.add_argument("--eval-every", type=int, default=None, metavar="N",
                    help="evaluate every N steps (and after the last; default: after the last only)")
    ft.add_argument("--log-dir", default=None, metavar="DIR",
                    help="write each step's metrics there (metrics.jsonl; loss.png at each checkpoint and at the end,"
                    " with matplotlib; TensorBoard when installed; default: --checkpoint-dir)")  # fmt: skip


def _builtin_profiles() -> list[str]:
    from nvoffload.planner.profile import BUILTIN_PROFILES

    return list(BUILTIN_PROFILES)


def _message(exc: BaseException) -> str:
    """An error as one line: an OSError's text and path, else the error's message."""
    if isinstance(exc, OSError) and exc.strerror:
        text = exc.strerror
        if exc.filename is not None and str(exc.filename) not in text:
            text += f": {exc.filename}"
    else:
        text = str(exc.args[0]) if exc.args else str(exc)
    return " ".join(text.split())


def _error(command: str, exc: BaseException, flags: dict[str, str] | None = None) -> int:
    """Print ``exc`` as one line (``flags``: with the configuration's field names as those flags); returns 2."""
    print(f"nvoffload {command}: error: {_as_flags(_message(exc), flags or {})}", file=sys.stderr)
    return 2


def _subparser(parser: argparse.ArgumentParser, command: str) -> argparse.ArgumentParser:
    (sub,) = (a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[command]


def _flags(parser: argparse.ArgumentParser, command: str) -> dict[str, str]:
    """``command``'s options by the field each sets (``{"cpu_memory_bytes": "--cpu-memory", ...}``: the
    :class:`~nvoffload.finetune.FinetuneConfig` or :class:`~nvoffload.planner.PlanRequest` field)."""
    actions = _subparser(parser, command)._actions
    return {a.dest: a.option_strings[0] for a in actions if a.option_strings and a.dest != "help"}


_BYTES = re.compile(r"(?<![\w.])(\d+)(?: bytes)? \((?:\d+(?:\.\d+)? ?(?:[KMGT]i?B|[KMGT]|B))\)|(?<![\w.])(\d+) bytes\b")


def _as_flags(message: str, flags: dict[str, str]) -> str:
    """``message`` in the command line's words: a field name with an underscore (``cpu_memory_bytes``) wherever it
    stands outside a path, and any field name that leads the message, become the flag that sets it; a byte count
    (``170917888 (163 MiB)``, ``4096 bytes``, or the number a size's flag is given or must be at least) becomes a
    size as the flags take it (``163M``)."""
    from nvoffload.planner.cost import human_size

    message = _BYTES.sub(lambda m: human_size(int(m.group(1) or m.group(2))), message)
    words = [re.escape(name) for name in flags if "_" in name]
    if words:
        pattern = r"(?<![\w/.-])(" + "|".join(words) + r")(?![\w/.-])"
        message = re.sub(pattern, lambda m: flags[m.group(0)], message)
    lead = re.match(r"\w+", message)
    if lead is not None and lead.group(0) in flags:
        message = flags[lead.group(0)] + message[lead.end() :]
    sizes = [re.escape(flag) for name, flag in flags.items() if name.endswith("_bytes")]
    if sizes:
        pattern = r"(" + "|".join(sizes) + r")(=| must be at least | must be >= | )(\d+)(?![\w.])"
        message = re.sub(pattern, lambda m: f"{m.group(1)}{' ' if m.group(2) == '=' else m.group(2)}{human_size(int(m.group(3)))}", message)
    return message


def _accum(text: str) -> int | str:
    """``--grad-accum`` of ``plan``: a count, or ``auto``."""
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a count of micro-batches or 'auto', got {text!r}") from None


def _plan_request(args):
    """The :class:`~nvoffload.planner.PlanRequest` of ``nvoffload plan``'s (or ``finetune``'s) options; ``finetune``
    plans for the ranks its launcher sets (``WORLD_SIZE``)."""
    from nvoffload.planner import ModelShape, PlanRequest

    if getattr(args, "sizes", None):
        fields = args.sizes.split(",")
        if len(fields) not in (5, 6) or (len(fields) == 6 and fields[5] != "gated"):
            raise ValueError(f"--sizes: expected L,D,H,F,V[,gated], got {args.sizes!r}")
        layers, d, heads, ffn, vocab = (int(x) for x in fields[:5])
        gated = len(fields) == 6
        shape = ModelShape("sizes", layers, d, heads, ffn, vocab, args.seq_len or 4096, gated_mlp=gated,
                           tied_embeddings=not gated, learned_positions=not gated)  # fmt: skip
    elif args.model_dir is not None:
        from nvoffload.hub import resolve_model
        from nvoffload.planner.cost import NAMED_SHAPES

        shape = NAMED_SHAPES.get(args.model_dir) or ModelShape.from_hf_config(resolve_model(args.model_dir))
    else:
        shape = ModelShape.from_preset(args.preset)
    seq = args.seq_len if args.seq_len is not None else min(128, shape.max_seq_len) if args.model_dir else shape.max_seq_len
    return PlanRequest(
        shape, batch_size=args.batch_size, seq_len=seq, dtype=args.dtype,
        grad_accum_steps=1 if args.grad_accum_steps == "auto" else args.grad_accum_steps,
        cpu_memory_bytes=args.cpu_memory_bytes, device_memory_bytes=args.device_memory_bytes,
        swap_dirs=getattr(args, "swap_dirs_count", 1), stream=args.stream, max_grad_norm=args.max_grad_norm is not None,
        checksum=getattr(args, "checksum", True), ranks=args.ranks if "ranks" in args else int(os.environ.get("WORLD_SIZE", "1")),
        activations="recompute" if getattr(args, "recompute", False) else
        None if args.offload_activations is None else ("offload" if args.offload_activations else "keep"),
        lora_rank=args.lora_rank, lora_targets=args.lora_targets, vertical=args.vertical,
        state_precision=args.state_precision, delayed_update=args.delayed_update,
    )  # fmt: skip


def _profile(name: str | None):
    from nvoffload.planner.calibrate import default_profile_path
    from nvoffload.planner.profile import load_profile

    path = name or default_profile_path()
    if name is None and not os.path.exists(path):
        raise FileNotFoundError(f"no calibrated profile for this host ({path}): run 'nvoffload calibrate', or give --profile")
    return load_profile(path)


def _print_plan(result, flags: dict[str, str]) -> None:
    from nvoffload.planner.cost import human_count, human_size

    r = result.request
    ranks = ""
    if r.ranks > 1:
        split = f" ({r.batch_size // r.ranks} sequences each)" if r.batch_size % r.ranks == 0 else ""
        ranks = f" over {r.ranks} ranks{split}"
    print(f"{r.model.name}: {human_count(r.model.params)} parameters, {r.batch_size} x {r.seq_len} tokens x {r.grad_accum_steps} micro-batches{ranks}, {r.dtype}")
    print(f"profile: {result.profile}")
    for what, where in result.placement.items():
        print(f"  {what:16} {where}")
    if result.stream:
        print(f"  blocks cached    {result.cached_blocks} of {r.model.n_layer} in host memory")
    each = " per rank" if r.ranks > 1 else ""
    print(f"step {result.step_s:.3g} s   {result.tokens_per_s:,.0f} tokens/s   {result.tflops:.3g} TFLOP/s{each}   bottleneck: {result.bottleneck}")
    engines = {k: v for k, v in result.engine_s.items() if k != "interconnect" or r.ranks > 1}
    print("  engines: " + ", ".join(f"{k} {v:.3g} s" for k, v in engines.items()))
    print(f"  memory{each}:  " + ", ".join(f"{k} {human_size(v)}" for k, v in result.memory_bytes.items()))
    print(f"  NVMe per step{each}: {human_size(result.nvme_read_bytes)} read, {human_size(result.nvme_written_bytes)} written")
    if result.communication_bytes:
        sent = ", ".join(f"{k} {human_size(v)}" for k, v in result.communication_bytes.items())
        print(f"  interconnect per step per rank: {sent}, {result.engine_s['interconnect']:.3g} s")
    for note in result.notes:
        print(f"note: {_as_flags(note, flags)}")
    if not result.fits:
        print("does not fit:")
        for reason in result.reasons:
            print(f"  - {_as_flags(reason, flags)}")


def _print_options(result, options: dict) -> None:
    """What each other optimizer option would make of the step (predictions, like the plan): ``options`` maps
    the flags that ask for it to its plan."""
    print("optimizer options (predicted; the compact states and the delayed update are not exact AdamW):")
    for flags, o in options.items():
        if o.bottleneck == result.bottleneck:
            change = "same bottleneck"
        else:  # moved: lifted when the step is shorter, else the option binds elsewhere first
            change = "lifts the bottleneck" if o.step_s < result.step_s else "a new bottleneck"
        fits = "" if o.fits else ", does not fit"
        print(f"  {flags:34} step {o.step_s:.3g} s ({result.step_s / o.step_s:.2f}x the tokens/s),"
              f" {o.tflops:.3g} TFLOP/s, bottleneck {o.bottleneck} ({change}){fits}")


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``nvoffload`` command; returns the exit status (2 for a bad configuration, file or
    swap directory, with a one-line message on stderr; ``plan`` also for a request that cannot fit)."""
    args, formatwarning = None, warnings.formatwarning
    try:
        parser = build_parser()  # imports torch (``import nvoffload.cli`` does not): a Ctrl-C meanwhile is answered below
        args, unknown = parser.parse_known_args(argv)
        if unknown:  # said by the command's parser, as its other errors are
            _subparser(parser, args.command).error(f"unrecognized arguments: {' '.join(unknown)}")
        warnings.formatwarning = functools.partial(_warning_line, args.command, _flags(parser, args.command))
        return _run(parser, args)
    except KeyboardInterrupt:  # a run unwound: its swap files are gone, the checkpoints written stay
        print(_interrupted(args), file=sys.stderr)
        return 130
    finally:
        warnings.formatwarning = formatwarning


def _interrupted(args: argparse.Namespace | None) -> str:
    """What a Ctrl-C leaves, in one line: nothing before the command started; for ``finetune``, the checkpoint
    ``--resume`` goes on from, if one was written."""
    if args is None:
        return "nvoffload: interrupted (Ctrl-C) while starting: nothing was written"
    said = f"nvoffload {args.command}: interrupted (Ctrl-C)"
    if args.command != "finetune":
        return said
    if args.checkpoint_dir is None:
        return f"{said}; no --checkpoint-dir was given: nothing to --resume from"
    from nvoffload.training_checkpoint import latest_training_checkpoint

    latest = latest_training_checkpoint(args.checkpoint_dir) if os.path.isdir(args.checkpoint_dir) else None
    if latest is None:
        return f"{said} before any checkpoint was written in {args.checkpoint_dir}: --resume would start at step 1"
    return f"{said}; --resume goes on from {latest.path} (step {latest.step})"


def _warning_line(command: str, flags: dict[str, str], message, category, filename, lineno, line=None) -> str:
    """A warning as the command line says it: ``nvoffload <command>: warning: <text>``, one line, no source line."""
    return f"nvoffload {command}: warning: {_as_flags(' '.join(str(message).split()), flags)}\n"


def _run(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    if args.command == "calibrate":
        return _calibrate(args)
    if args.command == "plan":
        import json

        from nvoffload.planner import delayed_update_option, plan, plan_batch, state_precision_options
        from nvoffload.planner.cost import checkpoint_line

        args.swap_dirs_count = args.swap_dirs if args.swap_dirs is not None else len(args.swap_dir or ()) or 1
        flags = _flags(parser, "plan")
        try:
            if args.grad_accum_steps == "auto":
                result = plan_batch(_plan_request(args), _profile(args.profile), max_tokens_per_step=args.max_tokens_per_step)
            else:
                result = plan(_plan_request(args), _profile(args.profile))
            options = state_precision_options(result, _profile(args.profile))
            delayed = delayed_update_option(result, _profile(args.profile))
        except (ValueError, OSError) as exc:
            return _error("plan", exc, flags)
        keys = ("step_s", "tflops", "bottleneck", "nvme_read_bytes", "nvme_written_bytes", "fits")
        if args.json:
            summary = {p: {k: getattr(o, k) for k in keys} for p, o in options.items()}
            got = {**result.to_dict(), "state_precision_options": summary}
            if delayed is not None:
                got["delayed_update_option"] = {k: getattr(delayed, k) for k in keys}
            print(json.dumps(got, indent=1))
        else:
            _print_plan(result, flags)
            print(checkpoint_line(result, _profile(args.profile)))
            flagged = {f"--optimizer-state {p}": o for p, o in options.items()}
            if delayed is not None:
                flagged["--delayed-update" if delayed.request.delayed_update else "without --delayed-update"] = delayed
            _print_options(result, flagged)
        return 0 if result.fits else 2
    if args.command == "finetune":
        from nvoffload.finetune import FinetuneConfig, finetune
        from nvoffload.finetune.run import step_postfix
        from nvoffload.hub import resolve_model
        from nvoffload.planner.cost import human_count, human_size
        from nvoffload.memory import MemoryBudgetError
        from nvoffload.optim.offload import OffloadIOError

        flags = _flags(parser, "finetune")
        try:
            args.model_dir = args.model_dir and resolve_model(args.model_dir)  # org/name: from the Hugging Face cache
        except ValueError as exc:
            return _error("finetune", exc, flags)
        fields = {k: v for k, v in vars(args).items() if k not in ("command", "no_progress", "plan", "profile")}
        if args.profile is not None and args.plan is None:
            return _error("finetune", ValueError("--profile is for --plan auto: give both, or neither"))
        if args.plan == "auto":
            from nvoffload.planner import plan

            try:
                args.stream, args.offload_activations, args.sizes = None, None, None
                chosen = plan(_plan_request(args), _profile(args.profile), recompute=False)  # finetune cannot
            except (ValueError, OSError) as exc:
                return _error("finetune", exc, flags)
            if not chosen.fits:
                return _error("finetune", ValueError("the plan does not fit: " + "; ".join(chosen.reasons)), flags)
            fields.update(stream=chosen.stream, offload_activations=chosen.offload_activations,
                          activation_memory_bytes=chosen.activation_memory_bytes,
                          activation_host_bytes=chosen.activation_host_bytes, stash_host_bytes=chosen.stash_host_bytes,
                          stash_staging_bytes=chosen.stash_staging_bytes)  # fmt: skip
            stash = "" if chosen.stash_host_bytes is None else f", the block inputs in the stash ({human_size(chosen.stash_host_bytes)} in host memory)"
            print(f"plan: stream {chosen.stream}, offload activations {chosen.offload_activations}{stash};"
                  f" predicted {chosen.step_s:.3g} s a step, {chosen.tokens_per_s:,.0f} tokens/s ({chosen.bottleneck} bound)")  # fmt: skip
        try:
            config = FinetuneConfig(**fields)
        except ValueError as exc:
            return _error("finetune", exc, flags)
        import torch

        dev = torch.device(config.device)
        lead = int(os.environ.get("RANK", "0")) == 0  # under torchrun, rank 0 reports
        report = args.no_progress and lead
        on_step = (lambda s: print(f"step {s.step}: {step_postfix(s, dev)}", flush=True)) if report else None
        try:
            result = finetune(config, progress=not args.no_progress, on_step=on_step,
                              on_message=lambda line: print(_as_flags(line, flags), flush=True))  # fmt: skip
        # budgets too small, a checkpoint that does not fit the model, a missing file or swap directory, a --save-to
        # that cannot be written, I/O errors (a saved activation's write too), transformers missing for --model, a
        # loss that is not finite
        except (ValueError, KeyError, MemoryBudgetError, OSError, OffloadIOError, ImportError, FloatingPointError) as exc:
            return _error("finetune", exc, flags)
        if not lead:
            return 0
        if not result.steps:
            print(f"nothing to do: the checkpoint in {config.checkpoint_dir} is at step {config.steps} already")
            return 0
        tail = result.losses[-10:]
        print(
            f"{human_count(result.num_parameters)} parameters, {len(result.steps)} steps:"
            f" loss {result.losses[0]:.3f} -> {sum(tail) / len(tail):.3f} (mean of the last {len(tail)})"
        )
        _print_records(result)
    return 0


def _print_records(result) -> None:
    """The last evaluation, and where the metrics and the loss curves went."""
    last = next((s for s in reversed(result.steps) if s.eval_loss is not None), None)
    if last is not None:
        print(f"evaluation loss {last.eval_loss:.3f} (perplexity {last.eval_perplexity:.2f}) after step {last.step}")
    if result.metrics_path is not None:
        print(f"metrics: {result.metrics_path}")
        if result.plot_path is not None:
            print(f"loss curves: {result.plot_path}")
        else:
            print("no loss curves: matplotlib is not installed (pip install 'nvoffload[bench]')")


def _calibrate(args) -> int:
    import shutil
    import tempfile

    from nvoffload.finetune import default_swap_root
    from nvoffload.planner.calibrate import calibrate, default_profile_path

    scratch = None
    try:
        dirs = args.swap_dirs
        if not dirs:
            os.makedirs(default_swap_root(), exist_ok=True)
            scratch = tempfile.mkdtemp(prefix="calibrate-", dir=default_swap_root())
            dirs = [scratch]
        profile = calibrate(dirs, device=args.device, quick=args.quick)
        out = args.out or default_profile_path()
        profile.save(out)
    except (ValueError, OSError) as exc:
        return _error("calibrate", exc)
    finally:
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)
    print(f"profile written to {out}")
    if profile.busy:
        print(f"nvoffload calibrate: warning: this machine was busy while it measured ({profile.busy}): its compute"
              " is timed as if on one core, its drives and copies as that load slowed them; calibrate again when it is"
              " quiet", file=sys.stderr)  # fmt: skip
    return 0
