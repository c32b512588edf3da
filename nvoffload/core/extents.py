"""First-fit allocation of aligned byte ranges: the swap files' space and the host slab's."""

from __future__ import annotations

import bisect

__all__ = ["Extents"]


class Extents:
    """First-fit allocator of byte ranges in one space (a file, a slab), coalescing on free.

    ``end`` is the size of the space handed out so far; ranges given back with
    :meth:`give` are reused by :meth:`take` before the space grows.
    """

    def __init__(self):
        self.end = 0  # bytes of the space in use or reserved
        self._free: list[tuple[int, int]] = []  # sorted (offset, nbytes)

    def take(self, nbytes: int) -> int | None:
        """Offset of a free range of ``nbytes``, or None when the space must grow."""
        for i, (offset, size) in enumerate(self._free):
            if size >= nbytes:
                if size == nbytes:
                    del self._free[i]
                else:
                    self._free[i] = (offset + nbytes, size - nbytes)
                return offset
        return None

    def take_pieces(self, nbytes: int) -> list[tuple[int, int]]:
        """Free ranges, largest first, for up to ``nbytes``: ``(offset, nbytes)`` pieces whose sizes add up to
        ``nbytes``, or to less when the free ranges hold less (the space must grow by the rest)."""
        pieces, left = [], nbytes
        for offset, size in sorted(self._free, key=lambda r: -r[1]):
            if left == 0:
                break
            piece = min(size, left)
            pieces.append((offset, piece))
            left -= piece
        for offset, piece in pieces:
            i = bisect.bisect_left(self._free, (offset, 0))
            size = self._free[i][1]
            if size == piece:
                del self._free[i]
            else:
                self._free[i] = (offset + piece, size - piece)
        return pieces

    def give(self, offset: int, nbytes: int) -> None:
        i = bisect.bisect(self._free, (offset, nbytes))
        self._free.insert(i, (offset, nbytes))
        # Coalesce with the next and the previous ranges.
        if i + 1 < len(self._free) and offset + nbytes == self._free[i + 1][0]:
            self._free[i] = (offset, nbytes + self._free.pop(i + 1)[1])
        if i > 0 and self._free[i - 1][0] + self._free[i - 1][1] == offset:
            prev_offset, prev_size = self._free.pop(i - 1)
            self._free[i - 1] = (prev_offset, prev_size + self._free[i - 1][1])

    def fits(self, nbytes: int) -> bool:
        """True when one free range holds ``nbytes``."""
        return any(size >= nbytes for _, size in self._free)

    @property
    def free_bytes(self) -> int:
        return sum(size for _, size in self._free)

    @property
    def largest_free_bytes(self) -> int:
        return max((size for _, size in self._free), default=0)
