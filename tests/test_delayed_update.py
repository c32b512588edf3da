"""The delayed update (issue 34, opt-in): each step's updates run during the next forward and backward.

The weights a delayed run trains on must be exactly torch's AdamW applied one
step late: at step ``t`` the model holds AdamW's weights after the gradients of
steps ``1 .. t - 2`` (clipped, unscaled and skipped as in their own step, with
their own step's hyperparameters). torch's fused CPU AdamW rounds like the
native kernel, so fp32 runs are compared bit for bit.
"""

import copy

import pytest
import torch

from nvoffload.optim.offload import NVMeAdamW, OffloadIOError, OffloadOptimizerConfig
from nvoffload.training_checkpoint import load_training_checkpoint, save_training_checkpoint

from test_compact_state import CHUNK, LR, WD, Net, Reference, loss_of
from test_compact_state import batches as typed_batches


def batches(n):
    return typed_batches(n, torch.float32)


def twins():
    """Two copies of one seeded ``Net``: the reference's and the delayed optimizer's."""
    torch.manual_seed(0)
    base = Net()
    return copy.deepcopy(base), copy.deepcopy(base)


def assert_same(model, ref_model, step=None):
    for a, b in zip(model.parameters(), ref_model.parameters()):
        assert torch.equal(a, b), step


def snapshot(model):
    return [p.detach().clone() for p in model.parameters()]


def delayed(model, tmp_path, **kw):
    tmp_path.mkdir(exist_ok=True)
    return NVMeAdamW(model.parameters(), lr=LR, weight_decay=WD, swap_dir=tmp_path, chunk_bytes=CHUNK, delayed_update=True, **kw)


class LateAdamW:
    """torch's fused AdamW, each step's (clipped) gradients applied at the next step, with their own step's lr."""

    def __init__(self, model, max_grad_norm=None):
        self.params = list(model.parameters())
        self.opt = torch.optim.AdamW(self.params, lr=LR, weight_decay=WD, fused=True)
        self.max_grad_norm = max_grad_norm
        self.pending = None  # (gradients, lr) of the last step, or None: nothing to apply

    def step(self, lr=LR, skip=False):
        if self.max_grad_norm is not None and not skip:
            torch.nn.utils.clip_grad_norm_(self.params, self.max_grad_norm)
        grads = None if skip else [p.grad.clone() for p in self.params]
        self.flush()
        self.pending = None if grads is None else (grads, lr)

    def flush(self):
        """Apply the pending update now (what synchronize() does)."""
        if self.pending is not None:
            for p, g in zip(self.params, self.pending[0]):
                p.grad = g
            self.opt.param_groups[0]["lr"] = self.pending[1]
            self.opt.step()
            self.pending = None
        for p in self.params:
            p.grad = None


def test_weights_are_adamw_applied_one_step_late(tmp_path):
    ref_model, model = twins()
    ref, opt = LateAdamW(ref_model), delayed(model, tmp_path / "swap")
    for i, (x, y) in enumerate(batches(6)):
        assert loss_of(model, x, y).item() == loss_of(ref_model, x, y).item()
        loss_of(model, x, y).backward()
        loss_of(ref_model, x, y).backward()
        before = snapshot(model)
        opt.step()
        ref.step()
        opt.zero_grad()
        if i == 0:  # the first step lands nothing: its update runs during the next forward and backward
            assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
        assert_same(model, ref_model)
    opt.synchronize()  # lands the last step's update
    ref.flush()
    assert_same(model, ref_model)
    state = opt.state_dict()["state"]
    for i, p in enumerate(ref_model.parameters()):
        assert torch.equal(state[i]["exp_avg"], ref.opt.state[p]["exp_avg"])
        assert torch.equal(state[i]["exp_avg_sq"], ref.opt.state[p]["exp_avg_sq"])
        assert float(state[i]["step"]) == float(ref.opt.state[p]["step"]) == 6
    opt.close()


def test_delayed_differs_from_exact_adamw(tmp_path):
    """Not a relabelled exact run: after two steps the exact optimizer has moved the weights twice, the delayed one once."""
    torch.manual_seed(0)
    base = Net()
    exact_model, model = copy.deepcopy(base), copy.deepcopy(base)
    exact = torch.optim.AdamW(exact_model.parameters(), lr=LR, weight_decay=WD, fused=True)
    with delayed(model, tmp_path / "swap") as opt:
        for x, y in batches(2):
            for m, o in ((exact_model, exact), (model, opt)):
                loss_of(m, x, y).backward()
                o.step()
                o.zero_grad()
        assert not torch.equal(model.fc1.weight, exact_model.fc1.weight)
        one_step = copy.deepcopy(base)
        first = torch.optim.AdamW(one_step.parameters(), lr=LR, weight_decay=WD, fused=True)
        loss_of(one_step, *batches(1)[0]).backward()
        first.step()
        assert all(torch.equal(a, b) for a, b in zip(model.parameters(), one_step.parameters()))


@pytest.mark.parametrize("max_grad_norm", [0.05, 100.0])  # clipping that bites, and one that does not
def test_clipping_and_the_lr_schedule_are_those_of_the_step_that_computed_the_gradients(tmp_path, max_grad_norm):
    ref_model, model = twins()
    ref = LateAdamW(ref_model, max_grad_norm=max_grad_norm)
    with delayed(model, tmp_path / "swap", max_grad_norm=max_grad_norm) as opt:
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
        for x, y in batches(6):
            lr = sched.get_last_lr()[0]
            loss_of(model, x, y).backward()
            loss_of(ref_model, x, y).backward()
            opt.step()
            ref.step(lr=lr)
            sched.step()
            opt.zero_grad()
            assert_same(model, ref_model)


def test_the_first_steps_update_exactly_then_one_step_late(tmp_path):
    """delayed_update_after=2: steps 1 and 2 are torch's AdamW; step 3's update lands in step 4, and so on."""
    ref_model, model = twins()
    ref = LateAdamW(ref_model)
    with delayed(model, tmp_path / "swap", delayed_update_after=2) as opt:
        for i, (x, y) in enumerate(batches(6)):
            loss_of(model, x, y).backward()
            loss_of(ref_model, x, y).backward()
            opt.step()
            ref.step()
            if i < 2:
                ref.flush()  # exact: applied in its own step
            opt.zero_grad()
            assert_same(model, ref_model, i)
    with pytest.raises(ValueError, match="delayed_update_after counts the exact steps"):
        OffloadOptimizerConfig(delayed_update_after=3)
    with pytest.raises(ValueError, match="delayed_update_after must be an int >= 0"):
        OffloadOptimizerConfig(delayed_update=True, delayed_update_after=-1)


def test_micro_batches_accumulate_as_in_torch(tmp_path):
    """Two backward passes a step: their gradients summed in .grad, then the sum's update lands a step late."""
    ref_model, model = twins()
    ref = LateAdamW(ref_model)
    data = batches(8)
    with delayed(model, tmp_path / "swap") as opt:
        for i in range(0, len(data), 2):
            for m in (model, ref_model):
                for x, y in data[i : i + 2]:
                    loss_of(m, x, y).backward()
            opt.step()
            ref.step()
            opt.zero_grad()
            assert_same(model, ref_model)


def test_grad_scaler_overflow_skips_that_steps_update_only(tmp_path):
    ref_model, model = twins()
    ref = LateAdamW(ref_model)
    with delayed(model, tmp_path / "swap") as opt:
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
        for i, (x, y) in enumerate(batches(6)):
            scaler.scale(loss_of(model, x, y)).backward()
            loss_of(ref_model, x, y).backward()
            if i == 3:
                model.fc1.weight.grad[0, 0] = float("inf")
            scaler.step(opt)  # the overflow of step 4 is found here: its update is never queued
            scaler.update()
            ref.step(skip=i == 3)
            opt.zero_grad()
            assert_same(model, ref_model)  # the scale is a power of two: scaling and unscaling are exact
        assert scaler.get_scale() == 2.0**9  # the overflow halved it, as without delay


def test_bf16_parameters_with_an_fp32_master(tmp_path):
    """bf16 weights: the staged weights are the master rounded, landed one step late; the master is the state's."""
    torch.manual_seed(0)
    base = Net()
    model = base.to(torch.bfloat16)
    master_model = copy.deepcopy(model).float()  # the master starts as the bf16 weights
    ref = LateAdamW(master_model)  # the fp32 master: AdamW on it, one step late
    with delayed(model, tmp_path / "swap") as opt:
        for x, y in batches(4):
            loss_of(model, x.to(torch.bfloat16), y).backward()
            for p, q in zip(master_model.parameters(), model.parameters()):
                p.grad = q.grad.float()
            opt.step()
            ref.step()
            opt.zero_grad()
            for a, b in zip(model.parameters(), master_model.parameters()):
                assert torch.equal(a, b.detach().to(torch.bfloat16))  # the master, rounded to nearest
        state = opt.state_dict()["state"]  # lands step 4's update
        ref.flush()
        for i, (p, q) in enumerate(zip(master_model.parameters(), model.parameters())):
            assert torch.equal(state[i]["master_param"], p.detach())
            assert torch.equal(q, p.detach().to(torch.bfloat16))


@pytest.mark.parametrize("precision", ["bf16-moments", "bf16", "8bit"])
def test_a_compact_state_is_its_own_update_applied_one_step_late(tmp_path, precision):
    """With a compact state (bf16 weights) the delayed weights are that state's updates, the fused kernel on whole
    tensors, applied one step late, bit for bit: the same rounding from the same seeds (those of the step whose
    gradients they apply)."""
    torch.manual_seed(0)
    model = Net().to(torch.bfloat16)
    ref_model = copy.deepcopy(model)
    ref, pending = Reference(ref_model, precision), None

    def apply_late(grads):
        for p, g in zip(ref_model.parameters(), grads):
            p.grad = g
        ref.step()

    with delayed(model, tmp_path / "swap", state_precision=precision) as opt:
        for x, y in typed_batches(5, torch.bfloat16):
            loss_of(model, x, y).backward()
            grads = [p.grad.clone() for p in model.parameters()]
            opt.step()
            opt.zero_grad()
            if pending is not None:
                apply_late(pending)
            pending = grads
            assert_same(model, ref_model)
        opt.synchronize()
        apply_late(pending)
        assert_same(model, ref_model)
        state = opt.state_dict()["state"]
        for i in range(len(ref.params)):
            m, v = ref.moments(i)
            assert torch.equal(state[i]["exp_avg"].view(-1), m) and torch.equal(state[i]["exp_avg_sq"].view(-1), v)
            assert state[i]["state_precision"] == precision


def test_a_checkpoint_lands_the_update_in_flight_and_resumes_exactly(tmp_path):
    torch.manual_seed(0)
    base = Net()
    data = batches(6)

    def train(model, opt, part):
        for x, y in part:
            loss_of(model, x, y).backward()
            opt.step()
            opt.zero_grad()

    first = copy.deepcopy(base)
    with delayed(first, tmp_path / "a") as opt:
        train(first, opt, data[:3])
        save_training_checkpoint(tmp_path / "ckpt", step=3, model=first, optimizer=opt)  # lands step 3's update
        saved = snapshot(first)
        train(first, opt, data[3:])
        opt.synchronize()
    resumed = Net()
    with delayed(resumed, tmp_path / "b") as opt:
        load_training_checkpoint(tmp_path / "ckpt", model=resumed, optimizer=opt)
        assert all(torch.equal(a, b) for a, b in zip(saved, resumed.parameters()))
        train(resumed, opt, data[3:])
        opt.synchronize()
    for a, b in zip(first.parameters(), resumed.parameters()):
        assert torch.equal(a, b)


def test_an_io_error_of_the_update_in_flight_is_raised_by_the_next_step(tmp_path):
    torch.manual_seed(0)
    model = Net()
    data = batches(5)
    with delayed(model, tmp_path / "swap") as opt:
        for x, y in data[:2]:
            loss_of(model, x, y).backward()
            opt.step()
            opt.zero_grad()
        opt.synchronize()
        before = snapshot(model)
        state = opt.state_dict()["state"]
        opt._store.inject_fault("eio", after_ops=4)  # a real EIO from the native engine, in the update in flight
        loss_of(model, *data[2]).backward()
        opt.step()  # queues step 3's update and returns
        opt.zero_grad()
        loss_of(model, *data[3]).backward()
        with pytest.raises(OffloadIOError, match="Input/output error"):
            opt.step()
        assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))  # step 3's update never landed
        after = opt.state_dict()["state"]
        assert all(torch.equal(state[i]["exp_avg"], after[i]["exp_avg"]) for i in state)
        opt.step()  # training goes on: step 4's gradients are still there, queued now
        opt.synchronize()
        assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_zero_grad_in_place_waits_and_store_bytes_are_those_of_the_exact_step(tmp_path):
    ref_model, model = twins()
    ref = LateAdamW(ref_model)
    exact_model = copy.deepcopy(model)  # not trained yet: the same weights
    (tmp_path / "exact").mkdir()
    exact = NVMeAdamW(exact_model.parameters(), lr=LR, weight_decay=WD, swap_dir=tmp_path / "exact", chunk_bytes=CHUNK)
    with delayed(model, tmp_path / "swap") as opt:
        for i, (x, y) in enumerate(batches(4)):
            loss_of(model, x, y).backward()
            loss_of(ref_model, x, y).backward()
            loss_of(exact_model, x, y).backward()
            opt.step()
            exact.step()
            ref.step()
            opt.zero_grad(set_to_none=False)  # zeroes in place: only once the update in flight copied them
            exact.zero_grad()
            if i >= 2:  # both past the step that initializes the state
                opt.synchronize()
                ref.flush()
                assert opt.memory_stats().read_bytes == exact.memory_stats().read_bytes > 0
                assert opt.memory_stats().written_bytes == exact.memory_stats().written_bytes > 0
            opt.reset_io_stats()
            exact.reset_io_stats()
        assert_same(model, ref_model)
    exact.close()


def test_bad_input(tmp_path):
    with pytest.raises(ValueError, match="delayed_update must be a bool"):
        OffloadOptimizerConfig(delayed_update=1)
    assert OffloadOptimizerConfig(delayed_update=True, release_grads=True).keeps_grads  # streamed: kept for the next step


def test_finetune_delayed_update_lands_its_last_update(tmp_path, capsys):
    """One step delayed is one exact step (the last step's update lands before the weights are saved); two are not
    two exact steps; streamed (--stream) too."""
    from nvoffload.checkpoint import open_checkpoint
    from nvoffload.cli import main

    (tmp_path / "swap").mkdir()
    base = ["finetune", "--preset", "tiny", "--batch-size", "2", "--seq-len", "16", "--no-progress", "--lr", "1e-2",
            "--swap-dir", str(tmp_path / "swap")]  # fmt: skip

    def weights(name, *flags):
        assert main([*base, *flags, "--save-to", str(tmp_path / name)]) == 0
        with open_checkpoint(str(tmp_path / name)) as ckpt:
            return {k: ckpt.read(k) for k in ckpt.keys()}

    for stream in ([], ["--stream", "--cpu-memory", "80M"]):  # 80M: room for a block's twin beside those in flight
        start = weights("start.safetensors", "--steps", "1", "--lr", "1e-30", *stream)
        for steps in ("1", "2"):
            exact = weights(f"exact{steps}.safetensors", "--steps", steps, *stream)
            delayed = weights(f"delayed{steps}.safetensors", "--steps", steps, "--delayed-update", *stream)
            assert all(torch.equal(exact[k], delayed[k]) for k in exact) == (steps == "1"), (steps, stream)
            assert any(not torch.equal(start[k], delayed[k]) for k in start)
        assert "during the next step (--delayed-update: weights one step behind, not exact AdamW)" in capsys.readouterr().out
    assert main([*base, "--steps", "1", "--delayed-update-after", "3"]) == 2
    assert "--delayed-update-after counts the exact steps before delayed updates: set --delayed-update too" in capsys.readouterr().err


@pytest.mark.cuda
def test_weights_are_adamw_applied_one_step_late_on_cuda(tmp_path):
    """On a GPU: the staged copies are written on the copy stream behind the step()'s event and copied in on the
    compute stream once done; torch's fused CUDA AdamW rounds a little differently from the host kernel."""
    torch.manual_seed(0)
    base = Net()
    ref_model, model = copy.deepcopy(base).cuda(), copy.deepcopy(base).cuda()
    ref, opt = LateAdamW(ref_model), delayed(model, tmp_path / "swap")
    for x, y in batches(6):
        x, y = x.cuda(), y.cuda()
        loss_of(model, x, y).backward()
        loss_of(ref_model, x, y).backward()
        opt.step()
        ref.step()
        opt.zero_grad()
        for a, b in zip(model.parameters(), ref_model.parameters()):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    opt.synchronize()
    ref.flush()
    for a, b in zip(model.parameters(), ref_model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    opt.close()


def test_a_backward_into_gradients_not_zeroed_waits_for_the_update_reading_them(tmp_path):
    """A loop that never zeroes the gradients accumulates into last step's, which the update in flight reads: the
    backward waits for it, so the results are torch's (the gradients summed across steps, applied a step late)."""
    ref_model, model = twins()
    ref_opt = torch.optim.AdamW(ref_model.parameters(), lr=LR, weight_decay=WD, fused=True)
    pending = None
    with delayed(model, tmp_path / "swap", prefetch_chunks=0) as opt:
        for x, y in batches(4):
            loss_of(model, x, y).backward()  # into the last step's gradients: never zeroed
            opt.step()
            loss_of(ref_model, x, y).backward()
            grads = [p.grad.clone() for p in ref_model.parameters()]
            if pending is not None:
                kept = [p.grad for p in ref_model.parameters()]
                for p, g in zip(ref_model.parameters(), pending):
                    p.grad = g
                ref_opt.step()
                for p, g in zip(ref_model.parameters(), kept):
                    p.grad = g
            pending = grads
            assert_same(model, ref_model)
