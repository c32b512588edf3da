"""Data parallel training over ``torch.distributed`` ranks, each with its share of the state on its own NVMe.

Launched as any ``torch.distributed`` program (``torchrun --nproc-per-node N``;
NCCL on GPUs, gloo on CPUs), with the model *not* wrapped in
``DistributedDataParallel``: :class:`~nvoffload.optim.OffloadOptimizer` (and
:func:`nvoffload.initialize`) under an initialized process group average the
gradients themselves, ZeRO-style:

* each rank keeps the fp32 master weights and moments of one equal share of
  the parameters' elements (:class:`Partition`) in its own swap directories,
  and updates only them;
* gradients held in ``.grad`` are all-reduced in buckets during the last
  micro-batch's backward, each as soon as its gradients are final
  (:class:`BackwardAverage`): when ``backward()`` returns, every rank holds the
  global batch's mean, so ``max_grad_norm``, ``clip_grad_norm_`` and
  ``GradScaler`` behave as in one process, and the updates start from each
  averaged bucket as in one process; released gradients (parameter
  streaming) are reduced to their owners in buckets during backward, beside
  the NVMe traffic, and the norm for clipping is summed over the ranks;
* after the update, each owner broadcasts its new weights, in buckets.

Each rank runs on its part of every batch; the result is that of one process
on the whole batches (up to the order of floating-point sums). Every rank must
compute gradients for the same parameters in each backward pass, as with
``DistributedDataParallel`` without ``find_unused_parameters``. No wait is
unbounded: where the host waits for a collective (every one on the CPU; on a
GPU those whose result the host reads: a sum, a flag, the step's checks), one
that does not complete within ``collective_timeout_s`` raises
:class:`RankTimeoutError`. On a GPU the gradients' collectives are waited for
by streams, not by the host (see :mod:`nvoffload.distributed._ranks`): there
NCCL's own timeout bounds them. Give ``init_process_group`` the same
``timeout``: gloo's collectives still in flight end only at the group's own
timeout, and the process cannot exit before they do (``nvoffload finetune``
does so).
"""

from torch import nn

from nvoffload.distributed._buckets import DEFAULT_BUCKET_BYTES, BackwardAverage, GradientBuckets, buckets_budget, reserve_buckets
from nvoffload.distributed._partition import Partition
from nvoffload.distributed._ranks import DEFAULT_TIMEOUT_S, Ranks, RankTimeoutError
from nvoffload.distributed._sharding import Sharding

__all__ = [
    "check_not_ddp", "rank_swap_dirs", "DEFAULT_BUCKET_BYTES", "DEFAULT_TIMEOUT_S", "BackwardAverage", "GradientBuckets", "buckets_budget", "Partition", "Ranks", "RankTimeoutError", "Sharding", "reserve_buckets",
]  # fmt: skip


def check_not_ddp(model: nn.Module) -> None:
    """Refuse a model wrapped in ``DistributedDataParallel`` (or FSDP): nvoffload averages the gradients itself,
    and DDP would average them a second time."""
    from torch.nn.parallel import DistributedDataParallel

    if isinstance(model, DistributedDataParallel) or type(model).__name__ in ("FullyShardedDataParallel", "FSDPModule"):
        raise ValueError(
            f"the model is wrapped in {type(model).__name__}: nvoffload averages the gradients over the ranks itself"
            " (ZeRO-style, see nvoffload.distributed), so pass the unwrapped model (ddp_model.module)"
        )


def rank_swap_dirs(swap_dirs, rank: int) -> list[str]:
    """Each of ``swap_dirs`` with a subdirectory ``rank<rank>`` (created), for ranks that share directories."""
    import os

    paths = [swap_dirs] if isinstance(swap_dirs, (str, os.PathLike)) else list(swap_dirs)
    out = []
    for d in paths:
        sub = os.path.join(os.fspath(d), f"rank{rank}")
        if os.path.isdir(d):
            os.makedirs(sub, exist_ok=True)
        out.append(sub)
    return out
