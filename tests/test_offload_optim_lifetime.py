"""The NVMe optimizer's lifetime: after close(), when dropped without close(), at exit, and when its worker dies."""

import copy
import ctypes
import gc
import textwrap
import threading
import weakref

import pytest
import torch
from conftest import SCRIPT_PRELOAD, fork_server
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


@pytest.mark.parametrize("delayed", [False, True])  # delayed: the last step's update is still in flight when dropped
def test_dropped_optimizer_is_collected_and_cleans_up(tmp_path, delayed):
    model = small_model()
    before = workers()
    opt = NVMeAdamW(model.parameters(), lr=1e-3, swap_dir=tmp_path, delayed_update=delayed)
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

    def acquire(self, param, *, staged=False):
        self.free.wait()
        return param.detach().view(-1)

    def release(self, param, *, modified, staged=False):
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

swap, delayed = sys.argv[1], sys.argv[2] == "delayed"

def check():  # registered first, so it runs after every hook registered later (the optimizer's)
    alive = [t for t in threading.enumerate() if t.name == "nvoffload-optimizer" and t.is_alive()]
    print(f"workers={len(alive)} swaps={len(glob.glob(swap + '/*.swap'))}", flush=True)

atexit.register(check)
torch.manual_seed(3)
m = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Linear(64, 16))
opt = OffloadOptimizer(torch.optim.AdamW(m.parameters(), lr=1e-3), swap_dir=swap, max_grad_norm=1.0, delayed_update=delayed)
for _ in range(3):
    x = torch.randn(8, 16)
    (m(x) - x).pow(2).mean().backward(); opt.step(); opt.zero_grad(set_to_none=True)
"""


@pytest.mark.parametrize("delayed", ["exact", "delayed"])  # delayed: the last step's update still in flight at exit
def test_exit_without_close_stops_the_worker_first(tmp_path, delayed):
    """A daemon worker still in native I/O when the interpreter finalizes aborts the process
    ("terminate called without an active exception"): the optimizer joins it at exit."""
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(EXIT_SCRIPT))
    swap = tmp_path / "swap"
    swap.mkdir()
    out = fork_server(SCRIPT_PRELOAD).run(script, [swap, delayed], timeout=120)  # as python SCRIPT would
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "workers=0 swaps=0", out.stdout + out.stderr[-2000:]
    assert not list(swap.glob("*.swap"))


def train_both(model, opt, ref, ref_opt, steps=2):
    """``steps`` steps of ``model``/``opt`` and of ``ref``/``ref_opt`` on the same batches."""
    gen = torch.Generator().manual_seed(7)
    for _ in range(steps):
        x = torch.randn(4, 32, generator=gen)
        for m, o in ((model, opt), (ref, ref_opt)):
            m(x).square().mean().backward()
            o.step()
            o.zero_grad()


def assert_trains_as_torch(model, swap_dir):
    """A new NVMeAdamW over ``model`` trains exactly as torch's fused AdamW from the same weights."""
    ref = copy.deepcopy(model)
    with NVMeAdamW(model.parameters(), lr=1e-2, swap_dir=swap_dir) as opt:
        train_both(model, opt, ref, torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=True))
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.equal(p, q)


def test_a_second_optimizer_over_parameters_an_open_one_holds_is_refused(tmp_path):
    # The first optimizer, referenced by its LR scheduler only, would go on updating the weights from its
    # hooks in every backward of the second: a second one over any of its parameters is refused until the
    # first is closed, and add_param_group of such a parameter too (the group is not added).
    model = small_model()
    (tmp_path / "a").mkdir()
    first = NVMeAdamW(model.parameters(), lr=1e-2, swap_dir=tmp_path / "a")
    sched = torch.optim.lr_scheduler.LambdaLR(first, lambda step: 1.0)
    train_step(model, first)
    del first
    weights = [p.detach().clone() for p in model.parameters()]
    (tmp_path / "b").mkdir()
    held = r"held by another OffloadOptimizer that is still open.*Close that one first \(opt\.close\(\)"
    with pytest.raises(ValueError, match=held):
        NVMeAdamW(model.parameters(), lr=1e-2, swap_dir=tmp_path / "b")
    with pytest.raises(ValueError, match=held):
        OffloadOptimizer(torch.optim.AdamW([model[2].bias], lr=1e-2), swap_dir=tmp_path / "b")
    other = nn.Linear(4, 4)
    with NVMeAdamW(other.parameters(), lr=1e-2, swap_dir=tmp_path / "b") as second:
        with pytest.raises(ValueError, match=held):
            second.add_param_group({"params": [model[0].weight]})
        assert len(second.param_groups) == 1 and len(second.inner.param_groups) == 1
    assert not list((tmp_path / "b").glob("*.swap"))  # nothing was written for the refused ones
    assert all(torch.equal(p, w) for p, w in zip(model.parameters(), weights))
    sched.optimizer.close()
    assert_trains_as_torch(model, tmp_path / "b")


@pytest.mark.parametrize("cycle", [False, True], ids=["dropped", "dropped-in-a-reference-cycle"])
def test_a_dropped_optimizer_does_not_hold_its_parameters(tmp_path, cycle):
    # Garbage does not block: dropped (collected at once) or unreachable in a reference cycle (collected
    # when the second optimizer finds it), its hooks are gone and the new optimizer trains as torch does.
    model = small_model()
    first = NVMeAdamW(model.parameters(), lr=1e-2, swap_dir=tmp_path)
    train_step(model, first)
    if cycle:
        first.cycle = first
    ref = weakref.ref(first)
    del first
    assert (ref() is None) != cycle
    assert_trains_as_torch(model, tmp_path)
    assert ref() is None


def test_a_closed_optimizer_does_not_hold_its_parameters(tmp_path):
    # The pattern of scripts that rebuild their optimizer: close, then build another over the same model.
    model = small_model()
    for _ in range(2):
        with NVMeAdamW(model.parameters(), lr=1e-2, swap_dir=tmp_path) as opt:
            train_step(model, opt)
    assert_trains_as_torch(model, tmp_path)


def test_an_optimizer_refused_while_built_holds_nothing(tmp_path):
    # Refused after its hooks were in place (state that does not fit): it is closed before the error
    # leaves, even while the error (and so the half-built optimizer in its traceback) is still referenced.
    model = small_model()
    inner = torch.optim.AdamW(model.parameters(), lr=1e-2)
    train_step(model, inner)
    inner.state[model[0].weight]["exp_avg"] = torch.zeros(3)
    (tmp_path / "a").mkdir()
    with pytest.raises(ValueError, match=r"state tensor of shape \(3,\) does not fit parameter 0") as refused:
        OffloadOptimizer(inner, swap_dir=tmp_path / "a")
    assert refused.value.__traceback__ is not None and not list((tmp_path / "a").glob("*.swap"))
    assert_trains_as_torch(model, tmp_path)
