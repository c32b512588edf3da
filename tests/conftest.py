import importlib.util
import json
import os
import subprocess
import sys
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


# The driver of run_forked: it imports torch and nvoffload once, with what torch.optim imports at its first optimizer
# (torch._dynamo: about 800 modules), then forks a child for each run; the child runs the script as `python -c`
# would and ends as the script does (atexit handlers, finalizers), its exit status its own. Worth it where a run's
# imports outweigh its work: three runs of seconds of copies each (test_transfer's exit) took longer forked.
_FORKING_DRIVER = """
import json, os, sys
import torch, torch._dynamo
import nvoffload, nvoffload.optim, nvoffload.streaming

runs, statuses = json.loads(sys.argv[1]), {}
for name, run in runs.items():
    pid = os.fork()
    if pid == 0:
        os.chdir(run["cwd"])
        for fd, path in ((1, run["stdout"]), (2, run["stderr"])):
            os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
        sys.argv = ["-c", *run["argv"]]
        exec(compile(run["script"], name, "exec"), {"__name__": "__main__"})
        break  # the child ends here, as the script would
    statuses[name] = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
else:
    print(json.dumps(statuses))
"""


def run_forked(root, runs: dict) -> dict:
    """Each of ``runs`` (name -> (script, argv, cwd)) as ``python -c script *argv`` in ``cwd`` would run it, in a
    process of its own forked from one driver that imported torch and nvoffload once (seconds of imports a run
    otherwise); the runs one after the other, their output in files under ``root``. Returns name ->
    CompletedProcess (a negative returncode: killed by that signal)."""
    root = Path(root)
    spec = {
        name: {"script": script, "argv": [str(a) for a in argv], "cwd": str(cwd), "stdout": str(root / f"{name}.out"),
               "stderr": str(root / f"{name}.err")}
        for name, (script, argv, cwd) in runs.items()
    }  # fmt: skip
    done = subprocess.run([sys.executable, "-c", _FORKING_DRIVER, json.dumps(spec)], capture_output=True, text=True,
                          timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    statuses = json.loads(done.stdout)
    return {
        name: subprocess.CompletedProcess(spec[name]["argv"], statuses[name], Path(spec[name]["stdout"]).read_text(),
                                          Path(spec[name]["stderr"]).read_text())
        for name in runs
    }  # fmt: skip
