"""Which rank owns which elements of the optimizer state: equal shares of the parameters laid end to end.

The parameters, in the optimizer's group order, form one flat range of
elements; rank ``r`` owns the ``r``-th of ``world_size`` equal shares of it
(share boundaries on multiples of ``align_numel`` elements, which the optimizer
gives: its chunks' alignment, so that every share starts a chunk).
A parameter may so be split between ranks; each rank keeps the fp32 master
weights and moments of its elements only, and updates only them.
"""

from __future__ import annotations

from collections.abc import Sequence


class Partition:
    """The shares of ``numels`` (the parameters' element counts, in order) among ``world_size`` ranks, each
    share starting on a multiple of ``align_numel`` elements of the flat range."""

    def __init__(self, numels: Sequence[int], world_size: int, align_numel: int):
        self.world_size = world_size
        self.offsets = [0]
        for n in numels:
            self.offsets.append(self.offsets[-1] + n)
        total = self.offsets[-1]
        bounds = [min(total, -(-total * r // world_size // align_numel) * align_numel) for r in range(world_size)]
        self.bounds = [*bounds, total]  # rank r owns flat elements [bounds[r], bounds[r + 1])

    def owned(self, index: int, rank: int) -> tuple[int, int]:
        """The elements ``[lo, hi)`` of parameter ``index`` that ``rank`` owns (``lo == hi``: none)."""
        start, end = self.offsets[index], self.offsets[index + 1]
        lo = min(max(self.bounds[rank], start), end)
        hi = max(min(self.bounds[rank + 1], end), lo)
        return lo - start, hi - start

    def owners(self, index: int) -> list[tuple[int, int, int]]:
        """``(rank, lo, hi)`` for every rank owning some elements of parameter ``index``, in element order."""
        shares = ((r, *self.owned(index, r)) for r in range(self.world_size))
        return [(r, lo, hi) for r, lo, hi in shares if hi > lo]

    def runs(self, placed: Sequence[tuple[int, int]]) -> list[list[int]]:
        """``[owner, start, end]`` of a flat buffer holding parameters ``(index, offset in the buffer)`` end to
        end: one run per owner's stretch of elements, adjacent stretches of one owner merged."""
        runs: list[list[int]] = []
        for index, at in placed:
            for owner, lo, hi in self.owners(index):
                if runs and runs[-1][0] == owner and runs[-1][2] == at + lo:
                    runs[-1][2] = at + hi
                else:
                    runs.append([owner, at + lo, at + hi])
        return runs
