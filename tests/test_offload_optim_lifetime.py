"""The NVMe optimizer's lifetime: after close(), when dropped without close(), at exit, and when its worker dies."""

import ctypes
import gc
import subprocess
import sys
import textwrap
import threading
import weakref

import torch
from torch import nn

from nvoffload.io import TensorStore
from nvoffload.optim import NVMeAdamW, OffloadOptimizer

WORKER = "nvoffload-optimizer"  # the worker thread's name
BOUND_S = 30.0  # a call that has not returned by then hangs


def workers() -> set:
    return {t for t in threading.enumerate() if t.name == WORKER}


def call_bounded(fn):
    """Run ``fn`` on a helper thread; returns the exception it raised (None if it returned); fails the
    test if it has not returned within BOUND_S (a hang)."""
    outcome = {}

    def run():
        try:
            fn()
        except BaseException as exc:  # noqa: BLE001
            outcome["error"] = exc
        outcome["done"] = True

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(BOUND_S)
    assert outcome.get("done"), f"{getattr(fn, '__name__', fn)} did not return within {BOUND_S} s"
    return outcome.get("error")


def train_step(model, opt):
    model(torch.randn(4, 32)).square().mean().backward()
    opt.step()
    opt.zero_grad()


def small_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 8))


def test_methods_after_close_raise_instead_of_hanging(tmp_path):
    model = small_model()
    opt = NVMeAdamW(model.parameters(), lr=1e-3, swap_dir=tmp_path)
    train_step(model, opt)
    opt.close()
    opt.close()  # idempotent

    def lend():
        with opt._pipeline.lend():
            pass

    calls = {
        "zero_grad": opt.zero_grad,
        "set_weight_home": lambda: opt.set_weight_home(None),
        "lend": lend,
        "step": opt.step,
        "synchronize": opt.synchronize,
        "state_dict": opt.state_dict,
        "add_param_group": lambda: opt.add_param_group({"params": [nn.Parameter(torch.zeros(4))]}),
    }
    for name, fn in calls.items():
        error = call_bounded(fn)
        assert isinstance(error, RuntimeError) and "the OffloadOptimizer is closed" in str(error), (name, error)
    assert not list(tmp_path.glob("*.swap"))


def test_dropped_optimizer_is_collected_and_cleans_up(tmp_path):
    model = small_model()
    before = workers()
    opt = NVMeAdamW(model.parameters(), lr=1e-3, swap_dir=tmp_path)
    mine = workers() - before
    assert len(mine) == 1 and list(tmp_path.glob("*.swap"))
    train_step(model, opt)
    train_step(model, opt)  # a step with read-ahead of the next one in flight
    ref = weakref.ref(opt)
    del opt
    gc.collect()
    assert ref() is None, "an optimizer that was never closed cannot be garbage-collected"
    for t in mine:
        t.join(BOUND_S)
        assert not t.is_alive(), "the worker thread of a collected optimizer still runs"
    assert not list(tmp_path.glob("*.swap"))
    # The model's parameters no longer carry the optimizer's hooks: training on without it works.
    model(torch.randn(4, 32)).square().mean().backward()
    assert all(p.grad is not None for p in model.parameters())


def test_dropped_optimizer_deletes_its_entries_from_a_shared_store(tmp_path):
    model = small_model()
    with TensorStore(tmp_path) as store:
        store.put("mine", torch.ones(1024)).result()
        before = workers()
        opt = OffloadOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3), swap_dir=store)
        mine = workers() - before
        train_step(model, opt)
        assert len(store) > 1
        del opt
        gc.collect()
        for t in mine:
            t.join(BOUND_S)
            assert not t.is_alive()
        assert len(store) == 1 and torch.equal(store.get("mine").result(), torch.ones(1024))


def test_waits_raise_when_the_worker_died(tmp_path):
    model = small_model()
    before = workers()
    opt = NVMeAdamW(model.parameters(), lr=1e-3, swap_dir=tmp_path, prefetch_chunks=0)
    (worker,) = workers() - before
    # Kill the worker thread (as an unexpected error would): SystemExit raised in it when it next runs.
    assert ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(worker.ident), ctypes.py_object(SystemExit)) == 1
    error = call_bounded(opt.synchronize)  # wakes the worker, which dies
    assert isinstance(error, RuntimeError) and "worker thread died" in str(error), error
    worker.join(BOUND_S)
    assert not worker.is_alive()
    model(torch.randn(4, 32)).square().mean().backward()
    error = call_bounded(opt.step)
    assert isinstance(error, RuntimeError) and "worker thread died" in str(error), error
    assert call_bounded(opt.close) is None
    assert not list(tmp_path.glob("*.swap"))


class StuckHome:
    """A WeightHome whose weights cannot be had until ``free`` is set (a worker stuck in I/O)."""

    def __init__(self):
        self.free = threading.Event()

    def holds(self, param):
        return True

    def acquire(self, param):
        self.free.wait()
        return param.detach().view(-1)

    def release(self, param, *, modified):
        pass


def test_wait_on_a_stuck_worker_is_bounded(tmp_path, monkeypatch):
    import nvoffload.optim._pipeline as pipeline

    monkeypatch.setattr(pipeline, "WAIT_LIMIT_S", 0.5)
    model = small_model()
    opt = NVMeAdamW(model.parameters(), lr=1e-3, swap_dir=tmp_path)
    home = StuckHome()
    opt.set_weight_home(home)
    try:
        model(torch.randn(4, 32)).square().mean().backward()
        error = call_bounded(opt.step)  # the first step's updates run in step(); the worker gets stuck
        assert isinstance(error, RuntimeError) and "made no progress for 0.5 s" in str(error), error
        assert "queued updates" in str(error), error
    finally:
        home.free.set()
    opt.close()
    assert not list(tmp_path.glob("*.swap"))


EXIT_SCRIPT = """
import atexit, glob, sys, threading, torch
from nvoffload.optim import OffloadOptimizer

swap = sys.argv[1]

def check():  # registered first, so it runs after every hook registered later (the optimizer's)
    alive = [t for t in threading.enumerate() if t.name == "nvoffload-optimizer" and t.is_alive()]
    print(f"workers={len(alive)} swaps={len(glob.glob(swap + '/*.swap'))}", flush=True)

atexit.register(check)
torch.manual_seed(3)
m = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Linear(64, 16))
opt = OffloadOptimizer(torch.optim.AdamW(m.parameters(), lr=1e-3), swap_dir=swap, max_grad_norm=1.0)
for _ in range(3):
    x = torch.randn(8, 16)
    (m(x) - x).pow(2).mean().backward(); opt.step(); opt.zero_grad(set_to_none=True)
"""


def test_exit_without_close_stops_the_worker_first(tmp_path):
    """A daemon worker still in native I/O when the interpreter finalizes aborts the process
    ("terminate called without an active exception"): the optimizer joins it at exit."""
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(EXIT_SCRIPT))
    swap = tmp_path / "swap"
    swap.mkdir()
    out = subprocess.run([sys.executable, str(script), str(swap)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "workers=0 swaps=0", out.stdout + out.stderr[-2000:]
    assert not list(swap.glob("*.swap"))
