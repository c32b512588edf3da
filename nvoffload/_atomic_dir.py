"""Directories that appear complete or not at all: written under a hidden sibling name, fsynced, then renamed
(or exchanged) into place. Shared by :mod:`nvoffload.pretrained` and :mod:`nvoffload.training_checkpoint`."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import secrets
import shutil
from collections.abc import Iterator

__all__ = ["fsync_path", "naming", "new_sibling", "put_in_place"]


@contextlib.contextmanager
def naming(path: str) -> Iterator[None]:
    """Give the OSError of a call that names no file (a write, an ftruncate, an fsync on a descriptor: "No space
    left on device") the file ``path`` it was about, as its ``filename``."""
    try:
        yield
    except OSError as exc:
        if exc.filename is None and exc.errno is not None:
            exc.filename = path
        raise


def fsync_path(path: str) -> None:
    """fsync a file or a directory (a directory's entries: the names created or renamed in it)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        with naming(path):
            os.fsync(fd)
    finally:
        os.close(fd)


def new_sibling(target: str, what: str) -> str:
    """A new empty hidden directory ``.<name>.<what>-<random>`` beside ``target``, with the permissions
    ``os.makedirs`` gives (umask applied, unlike ``tempfile.mkdtemp``'s 0700)."""
    parent, base = os.path.split(target)
    for _ in range(100):
        path = os.path.join(parent, f".{base}.{what}-{secrets.token_hex(4)}")
        try:
            os.mkdir(path, 0o777)
        except FileExistsError:
            continue
        return path
    raise FileExistsError(errno.EEXIST, f"cannot find a free name for a directory beside {target}")


_AT_FDCWD = -100
_RENAME_EXCHANGE = 2


def _exchange(a: str, b: str) -> bool:
    """Swap two paths atomically (Linux ``renameat2(RENAME_EXCHANGE)``); False where not supported."""
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError):
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):  # the file system cannot exchange
        return False
    raise OSError(err, f"cannot put {a} in place of {b}: {os.strerror(err)}")


def put_in_place(tmp: str, target: str) -> None:
    """Rename the complete directory ``tmp`` to ``target``, replacing (then removing) an existing one; the parent
    directory is fsynced, so the new name is on disk when this returns."""
    parent = os.path.dirname(target)
    if not os.path.lexists(target):
        os.rename(tmp, target)
    elif _exchange(tmp, target):  # target now holds the new files, tmp the old ones
        shutil.rmtree(tmp, ignore_errors=True)
    else:  # two renames: a crash between them leaves the old directory under a hidden sibling name
        old = new_sibling(target, "old")
        os.rename(target, old)  # onto the empty directory just made
        try:
            os.rename(tmp, target)
        except BaseException:
            os.rename(old, target)
            raise
        shutil.rmtree(old, ignore_errors=True)
    fsync_path(parent)
