"""Files and directories that appear complete or not at all: written under a hidden sibling name, fsynced, then
renamed (or exchanged) into place, and the parent directory fsynced. Every file nvoffload writes for a user
(checkpoints, saved models, traces, metrics, machine profiles) goes through here."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import secrets
import shutil
from collections.abc import Iterator
from typing import IO

__all__ = ["AtomicFile", "fsync_path", "naming", "new_sibling", "put_in_place", "replace_file"]


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


class AtomicFile:
    """A file that takes ``path``'s place only when :meth:`commit` says it is whole.

    The bytes go to the hidden sibling ``.<name>.tmp`` (``fd``, opened for writing; one name, so a killed
    writer leaves at most that file, which the next write replaces); :meth:`commit`
    fsyncs it, renames it over ``path`` and fsyncs the directory, so after a crash ``path`` holds the old file
    or the new one, never a part. :meth:`abort` (or a failed commit) removes the partial file. An OSError of a
    write through :meth:`naming` ("No space left on device") names the partial file.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = os.path.abspath(os.fspath(path))
        parent, base = os.path.split(self.path)
        self.tmp_path = os.path.join(parent, f".{base}.tmp")
        self.fd: int | None = os.open(self.tmp_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)

    def commit(self) -> None:
        """fsync the file, rename it to ``path`` and fsync the directory. Idempotent after success."""
        if self.fd is None:
            return
        try:
            with naming(self.tmp_path):
                os.fsync(self.fd)
            os.replace(self.tmp_path, self.path)
        except BaseException:
            self.abort()
            raise
        os.close(self.fd)
        self.fd = None
        fsync_path(os.path.dirname(self.path))

    def abort(self) -> None:
        """Close and remove the partial file, leaving ``path`` untouched; nothing once committed or aborted."""
        if self.fd is None:
            return
        os.close(self.fd)
        self.fd = None
        with contextlib.suppress(FileNotFoundError):
            os.remove(self.tmp_path)


@contextlib.contextmanager
def replace_file(path: str | os.PathLike, mode: str = "wb", encoding: str | None = None) -> Iterator[IO]:
    """``with replace_file(path) as f: f.write(...)``: ``path`` is replaced by what was written when the block
    ends normally (fsynced, see :class:`AtomicFile`), and left as it was when it raises."""
    atomic = AtomicFile(path)
    try:
        with naming(atomic.tmp_path), open(atomic.fd, mode, encoding=encoding, closefd=False) as f:
            yield f
            f.flush()
        atomic.commit()
    finally:
        atomic.abort()


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
