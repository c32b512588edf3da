"""One optimizer's share of the state and the collectives of its step, as :mod:`nvoffload.optim` uses them."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from nvoffload.distributed._buckets import DEFAULT_BUCKET_BYTES, BackwardAverage, GradientBuckets, buckets_budget, gather_weights
from nvoffload.distributed._partition import Partition
from nvoffload.distributed._ranks import Ranks


class Sharding:
    """This rank's share of the state of ``params`` (the optimizer's parameters in group order, the same on
    every rank), shares starting on multiples of ``align_numel`` elements (the optimizer's chunk alignment),
    with the buckets its gradients and weights travel in."""

    def __init__(self, ranks: Ranks, params: Sequence[torch.Tensor], align_numel: int, bucket_bytes: int = DEFAULT_BUCKET_BYTES):
        self.ranks = ranks
        self.partition = Partition([p.numel() for p in params], ranks.world_size, align_numel)
        self.bucket_bytes = bucket_bytes
        self.budget_bytes = buckets_budget(params, bucket_bytes)  # as reserve_buckets counts them
        self.gradients = GradientBuckets(ranks, self.partition, bucket_bytes, self.budget_bytes)

    def backward_average(self, on_averaged) -> BackwardAverage:
        """Held gradients averaged during backward, in buckets (see :class:`BackwardAverage`)."""
        return BackwardAverage(self.ranks, self.bucket_bytes, self.budget_bytes, on_averaged)

    @property
    def mean(self) -> float:
        """The factor that turns a sum over the ranks into their mean."""
        return 1.0 / self.ranks.world_size

    def owned(self, index: int, numel: int) -> tuple[int, int]:
        """The elements of parameter ``index`` this rank keeps the state of (``Layout``'s ``owned``)."""
        return self.partition.owned(index, self.ranks.rank)

    def gather_weights(self, indexed: Sequence[tuple[int, torch.Tensor]], weights) -> None:
        """After a step: every rank gets the owners' new weights of ``indexed`` (see :func:`gather_weights`)."""
        gather_weights(self.ranks, self.partition, indexed, weights, self.bucket_bytes)
