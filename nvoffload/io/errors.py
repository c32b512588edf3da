"""Errors raised by the I/O engine and the tensor store."""

from __future__ import annotations

import errno as errno_codes
import os

__all__ = ["StoreIOError", "ChecksumError"]


class StoreIOError(OSError):
    """An I/O call failed: carries the call, the file, the offset and the tensor.

    ``errno``/``strerror``/``filename`` are those of :class:`OSError`;
    ``call`` names the failing operation (``pwrite``, ``pread (short read)``,
    ``allocate``...), ``offset`` is the byte offset in the file (-1 where the
    failure is not at one offset), ``tensor`` the store name (or None).
    """

    def __init__(
        self, err: int, call: str, path: str, offset: int, tensor: str | None = None, detail: str | None = None
    ):
        what = f"tensor {tensor!r}" if tensor is not None else "request"
        where = f"at offset {offset} of {path}" if offset >= 0 else f"in {path}"
        reason = detail or (os.strerror(err) if err else "failed")
        super().__init__(err, f"{call} of {what} failed {where}: {reason}", path)
        self.call = call
        self.offset = offset
        self.tensor = tensor


class ChecksumError(StoreIOError):
    """The data read back does not match the checksum taken when it was written."""

    def __init__(self, path: str, offset: int, tensor: str, expected: int, actual: int):
        super().__init__(errno_codes.EIO, "checksum verification", path, offset, tensor)
        self.strerror = (
            f"checksum mismatch for tensor {tensor!r} at offset {offset} of {path}: expected crc32c {expected:#010x},"
            f" read {actual:#010x}. The bytes changed after they were written (the drive, the file system or"
            " memory): the state that held them cannot be trusted. Resume from the last training checkpoint"
            " (nvoffload.load_training_checkpoint, or nvoffload finetune --resume)"
        )
        self.args = (self.errno, self.strerror)

    def __str__(self) -> str:
        return self.strerror
