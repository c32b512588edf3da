import importlib.util
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
HAS_KVIKIO = HAS_CUDA and importlib.util.find_spec("kvikio") is not None

# Devices found at import: tests parametrized over DEVICES run on the CPU
# everywhere and on the GPU where there is one.
DEVICES = ["cpu"] + (["cuda"] if HAS_CUDA else [])


def mapping_size(address: int) -> int:
    """Size of the /proc/self/maps mapping that contains ``address`` (a host slab's real footprint)."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            if lo <= address < hi:
                return hi - lo
    raise LookupError(f"no mapping holds {address:#x}")


def pytest_collection_modifyitems(config, items):
    skip_cuda = pytest.mark.skip(reason="needs a CUDA GPU")
    skip_gds = pytest.mark.skip(reason="needs CUDA and kvikio")
    for item in items:
        if "cuda" in item.keywords and not HAS_CUDA:
            item.add_marker(skip_cuda)
        if "gds" in item.keywords and not HAS_KVIKIO:
            item.add_marker(skip_gds)


def flip_stored_byte(store, name: str, at: int = 100) -> None:
    """Flip one bit of the bytes stored under ``name``, on disk."""
    extent = store._records[name].extents[0]
    fd = os.open(extent.swap.file.path, os.O_RDWR)
    try:
        byte = os.pread(fd, 1, extent.offset + at)
        os.pwrite(fd, bytes([byte[0] ^ 0x04]), extent.offset + at)
        os.fsync(fd)
    finally:
        os.close(fd)


# What run_forked's scripts import (torch._dynamo: torch.optim imports it at its first optimizer, about 800 modules).
SCRIPT_PRELOAD = "import torch, torch._dynamo, nvoffload, nvoffload.optim, nvoffload.streaming"


def run_forked(runs: dict) -> dict:
    """Each of ``runs`` (name -> (script, argv, cwd)) as ``python -c script *argv`` in ``cwd`` would run it, in a
    process of its own forked from the session's server that imported torch and nvoffload once (seconds of imports
    a run otherwise); the runs one after the other. Returns name -> CompletedProcess (a negative returncode: killed
    by that signal). Worth it where a run's imports outweigh its work."""
    server = fork_server(SCRIPT_PRELOAD)
    return {name: server.run(f"-c {script}", argv, cwd, timeout=600) for name, (script, argv, cwd) in runs.items()}


# The server of ForkServer: it runs its preload (imports: seconds a run otherwise), then for each request line forks
# a child that runs a script (``path``), a module (``module``) or code (``code``) as ``python PATH ARGV``,
# ``python -m MODULE ARGV`` or ``python -c CODE ARGV`` would, in the request's cwd and environment, its output to the
# request's files, and ends as a script does (atexit handlers, finalizers); each child's exit is reported as it
# ends. Single threaded (a fork copies only the forking thread): it waits on its requests and on SIGCHLD in one
# select.
_FORK_SERVER = """
import gc, json, os, runpy, select, signal, sys
exec(sys.argv[1])
gc.freeze()  # what the preload made is never collected: a child's collections and exit copy none of its pages
woken, wake = os.pipe()
os.set_blocking(wake, False)
signal.set_wakeup_fd(wake)
signal.signal(signal.SIGCHLD, lambda *_: None)
child = None
while child is None:
    ready = select.select([0, woken], [], [])[0]
    if woken in ready:
        os.read(woken, 4096)
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:  # none left
                break
            if not pid:
                break
            print("exit", pid, os.waitstatus_to_exitcode(status), flush=True)
    if 0 in ready:
        line = sys.stdin.readline()
        if not line:
            break
        child = json.loads(line)
        pid = os.fork()
        if pid:
            print("pid", pid, flush=True)
            child = None
if child is not None:  # the child
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    os.close(woken)
    os.close(wake)
    os.chdir(child["cwd"])
    if child["env"] is not None:  # as subprocess.Popen's env: the whole environment
        os.environ.clear()
        os.environ.update(child["env"])
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    for fd, path in ((1, child["stdout"]), (2, child["stderr"])):
        os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND), fd)
    if "path" in child:
        sys.argv, sys.path[0] = [child["path"], *child["argv"]], os.path.dirname(child["path"])
        runpy.run_path(child["path"], run_name="__main__")
    elif "module" in child:
        sys.argv = [child["module"], *child["argv"]]
        runpy.run_module(child["module"], run_name="__main__", alter_sys=True)
    else:
        sys.argv = ["-c", *child["argv"]]
        exec(compile(child["code"], "<string>", "exec"), {"__name__": "__main__"})
"""

# What `nvoffload finetune` imports: torch, torch._dynamo (torch.optim's first optimizer imports it), datasets
# (--data), matplotlib (the loss PNG) and nvoffload's modules.
CLI_PRELOAD = """
import datasets, matplotlib.backends.backend_agg, matplotlib.figure, torch, torch._dynamo
import nvoffload.cli, nvoffload.finetune, nvoffload.finetune.run, nvoffload.sft
"""


def cli_server() -> "ForkServer":
    """The session's server of ``python -m nvoffload`` runs (unbuffered output: read as it is written)."""
    return fork_server(CLI_PRELOAD, PYTHONUNBUFFERED="1")


def run_cli(argv: list, cwd=".", env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    """``python -m nvoffload ARGV`` as ``subprocess.run(..., capture_output=True, text=True, cwd=cwd, env=env)``
    runs it, forked from :func:`cli_server`."""
    return cli_server().run("-m nvoffload", argv, cwd, env, timeout)


_FORK_SERVERS: dict[tuple, "ForkServer"] = {}
_SESSION_ENV = dict(os.environ)  # before any test changed it


def fork_server(preload: str, **env: str) -> "ForkServer":
    """The session's server for ``preload`` with ``env`` added to the session's environment (what it read when it
    started: what modules read at import), started at its first use."""
    key = (preload, *sorted(env.items()))
    if key not in _FORK_SERVERS:
        _FORK_SERVERS[key] = ForkServer(preload, {**_SESSION_ENV, **env})
    return _FORK_SERVERS[key]


@pytest.fixture(scope="session", autouse=True)
def _close_fork_servers():
    yield
    while _FORK_SERVERS:
        _FORK_SERVERS.popitem()[1].close()


class ForkServer:
    """Scripts and ``python -m`` runs, each a process of its own forked from one server that ran ``preload`` (its
    imports) once, with the server's environment (``env``, read when it started) or each run's own: :meth:`start`
    gives a :class:`ForkedRun` to signal and wait for, as a ``subprocess.Popen``."""

    def __init__(self, preload: str, env: dict | None = None):
        self._server = subprocess.Popen([sys.executable, "-c", _FORK_SERVER, preload], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, text=True, env=env)  # fmt: skip
        self._lock = threading.Condition()
        self._exits: dict[int, int] = {}
        self._started: list[int] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        self._outputs = tempfile.TemporaryDirectory(prefix="nvoffload-forked-")  # run's

    def _read(self) -> None:
        for line in self._server.stdout:  # "pid PID" as a run starts, "exit PID STATUS" as it ends
            words = line.split()
            with self._lock:
                if words[:1] == ["pid"]:
                    self._started.append(int(words[1]))
                elif words[:1] == ["exit"]:
                    self._exits[int(words[1])] = int(words[2])
                self._lock.notify_all()
        with self._lock:
            self._lock.notify_all()

    def start(self, target: str, argv: list, stdout, stderr, cwd=".", env: dict | None = None) -> "ForkedRun":
        """Runs ``target`` (a script's path, ``-m MODULE`` or ``-c CODE``) with ``argv`` and ``env`` as its
        environment (None: the server's), its output written to the files ``stdout`` and ``stderr`` (a FIFO: read
        as it is written)."""
        request = {"argv": [str(a) for a in argv], "cwd": str(cwd), "stdout": str(stdout), "stderr": str(stderr),
                   "env": env}  # fmt: skip
        kind = {"-m ": "module", "-c ": "code"}.get(str(target)[:3])
        request.update({kind: target[3:]} if kind else {"path": str(target)})
        with self._lock:
            self._server.stdin.write(json.dumps(request) + "\n")
            self._server.stdin.flush()
            assert self._lock.wait_for(lambda: self._started or self._server.poll() is not None, 120), "no fork"
            assert self._started, "the fork server ended"
            return ForkedRun(self, self._started.pop(0))

    def start_saying(self, target: str, argv: list, line: str) -> "ForkedRun":
        """:meth:`start`, returning once the run printed ``line`` first (a FIFO as its output); its stderr
        dropped."""
        with tempfile.TemporaryDirectory(prefix="nvoffload-said-") as fifo_dir:
            said = os.path.join(fifo_dir, "said")
            os.mkfifo(said)
            child = self.start(target, argv, said, os.devnull)
            with open(said) as f:
                assert f.readline() == line + "\n", f"{target[:200]} did not say {line!r}"
        return child

    def run(self, target: str, argv: list, cwd=".", env=None, timeout: float = 300) -> subprocess.CompletedProcess:
        """``target`` with ``argv`` to its end, as ``subprocess.run(..., capture_output=True, text=True)`` with
        ``cwd`` and ``env`` (None: the server's environment)."""
        out, err = (Path(self._outputs.name) / f"{n}.{time.monotonic_ns()}" for n in ("out", "err"))
        code = self.start(target, argv, out, err, cwd, env).wait(timeout)
        done = subprocess.CompletedProcess(argv, code, out.read_text(), err.read_text())
        out.unlink()
        err.unlink()
        return done

    def exit_status(self, pid: int, timeout: float | None) -> int | None:
        """The run's exit status once it ended, None if it runs ``timeout`` seconds on."""
        with self._lock:
            self._lock.wait_for(lambda: pid in self._exits or self._server.poll() is not None, timeout)
            assert pid in self._exits or self._server.poll() is None, "the fork server ended"
            return self._exits.get(pid)

    def close(self) -> None:
        self._server.stdin.close()
        self._server.wait(60)
        self._reader.join(60)
        self._server.stdout.close()
        self._outputs.cleanup()


class ForkedRun:
    """One run of :class:`ForkServer`: its ``pid``, ``send_signal``, ``kill``, ``terminate``, ``poll`` and ``wait``
    as ``subprocess.Popen``'s (``returncode`` negative when a signal ended it)."""

    def __init__(self, server: ForkServer, pid: int):
        self._server, self.pid, self.returncode = server, pid, None

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:  # not yet reaped by the server: the pid is still this run's
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def poll(self) -> int | None:
        return self.wait(0)

    def wait(self, timeout: float | None = None) -> int | None:
        if self.returncode is None:
            self.returncode = self._server.exit_status(self.pid, timeout)
            if self.returncode is None and timeout:
                raise subprocess.TimeoutExpired(str(self.pid), timeout)
        return self.returncode
