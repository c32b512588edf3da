"""Which process owns a swap directory: one lock file per directory, ``nvoffload.lock``, holding its pid and host.

Every :class:`~nvoffload.io.TensorStore` claims its directories (the stores of
one process share a claim). A directory another live process holds is refused
with :class:`SwapDirectoryInUse` -- give each run its own directory (a
subdirectory will do). A lock whose process no longer runs on this host is
stale: its swap files are removed, with a warning naming what was freed, and
the directory is taken over. A process killed with SIGKILL leaves its lock and
swap files behind; the next run on that directory cleans them up. Training
checkpoint directories take the same lock (``claim(d, "checkpoint directory")``).
"""

from __future__ import annotations

import errno
import functools
import os
import re
import socket
import threading
import time
import warnings
from collections.abc import Callable

from nvoffload.core.atomic import naming

__all__ = ["LOCK_NAME", "SwapDirectoryInUse", "claim"]

LOCK_NAME = "nvoffload.lock"
_UNWRITTEN_GRACE_S = 10.0  # an empty lock younger than this is being written by its creator
_claims: dict[str, int] = {}  # directories this process holds, and how many stores hold each
_lock = threading.Lock()


class SwapDirectoryInUse(OSError):
    """A swap directory held by another process (``errno.EBUSY``)."""


def claim(directory: str, what: str = "swap directory") -> Callable[[], None]:
    """Take ``directory`` (a ``what``, in the refusal) for this process (again, if it holds it already); returns
    the release.

    Raises:
        SwapDirectoryInUse: another live process, or a process on another host, holds it.
    """
    key = os.path.realpath(directory)
    with _lock:
        if key in _claims:
            _claims[key] += 1
            return functools.partial(_release, key)
        path = os.path.join(key, LOCK_NAME)
        for _ in range(3):
            try:
                fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                owner = _owner(path)
                if not _stale(path, owner):
                    raise _in_use(key, path, owner, what) from None
                _clean(key, path, owner)
                continue
            try:
                with naming(path), os.fdopen(fd, "w") as f:
                    f.write(f"{os.getpid()} {socket.gethostname()}\n")
            except BaseException:
                os.unlink(path)  # a full disk: no empty lock left behind
                raise
            _claims[key] = 1
            return functools.partial(_release, key)
        raise _in_use(key, path, _owner(path), what)


def _release(key: str) -> None:
    with _lock:
        count = _claims.get(key, 0) - 1
        if count > 0:
            _claims[key] = count
            return
        _claims.pop(key, None)
        path = os.path.join(key, LOCK_NAME)
        if _owner(path) == (os.getpid(), socket.gethostname()):
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass


def _owner(path: str) -> tuple[int, str] | None:
    """The lock's (pid, host), or None when it is empty or unreadable."""
    try:
        with open(path) as f:
            match = re.fullmatch(r"(\d+) (\S+)\n?", f.read())
    except (FileNotFoundError, UnicodeDecodeError):
        return None
    return (int(match.group(1)), match.group(2)) if match else None


def _stale(path: str, owner: tuple[int, str] | None) -> bool:
    if owner is None:  # empty or garbled: its writer was killed, unless it is writing it right now
        try:
            return time.time() - os.path.getmtime(path) > _UNWRITTEN_GRACE_S
        except FileNotFoundError:
            return True
    pid, host = owner
    if host != socket.gethostname():
        return False  # another machine's process: it cannot be checked from here
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False  # another user's live process
    return pid == os.getpid() and os.path.realpath(os.path.dirname(path)) not in _claims  # an earlier life of ours


def _clean(directory: str, path: str, owner: tuple[int, str] | None) -> None:
    """Remove a stale lock and the swap files of the process it names, saying what was freed."""
    freed, count = 0, 0
    if owner is not None:
        pattern = re.compile(rf"nvoffload-{owner[0]}-[0-9a-f]{{12}}\.swap")
        for entry in os.scandir(directory):
            if pattern.fullmatch(entry.name):
                freed += entry.stat().st_blocks * 512
                os.unlink(entry.path)
                count += 1
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    if count:
        warnings.warn(
            f"{directory}: removed {count} swap file(s) ({freed / 2**30:.2f} GiB) left by process {owner[0]}, which no"
            " longer runs (killed?)",
            stacklevel=4,
        )


def _in_use(directory: str, path: str, owner: tuple[int, str] | None, what: str) -> SwapDirectoryInUse:
    who = f"process {owner[0]} on {owner[1]}" if owner is not None else "a process that is writing its lock"
    return SwapDirectoryInUse(
        errno.EBUSY,
        f"{what} {directory} is in use by {who}: give each run its own directory (a subdirectory will do);"
        f" if that process is gone, delete {path}",
        directory,
    )
