"""The fine-tuning recipe under parameter streaming: clipping, accumulation and fp16 loss scaling, against torch."""

from __future__ import annotations

import copy
import functools
import math
import time

import pytest
import torch
from test_streaming import batch, config

import nvoffload
from nvoffload import trace
from nvoffload.models import GPT, GPTConfig
from nvoffload.optim import OffloadIOError

LR, WD, STEPS = 3e-3, 0.1, 10


def pair(dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    # Streamed in budgets below its size, with every parameter in one optimizer chunk (a parameter cut into
    # chunks has its norm summed from theirs, which can differ from clip_grad_norm_'s in the last bit).
    cfg = GPTConfig(seq_len=32, n_layer=12, n_head=4, d_model=64)
    ref = GPT(cfg).to(dtype)
    return cfg, ref, copy.deepcopy(ref)


def streamed(tmp_path, model, **kw):
    return nvoffload.initialize(
        model, torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD), config(tmp_path, model, **kw)
    )


def micro_batches(cfg, step, accum):
    return [batch(cfg, 100 * step + i) for i in range(accum)]


class MasterLoop:
    """The reference: fused torch AdamW on fp32 master copies of a (16-bit) model, gradients summed in
    fp32 over the micro-batches, clipped by clip_grad_norm_, fp16 through a real torch.amp.GradScaler."""

    def __init__(self, model, max_grad_norm, scaler=None, loss=lambda model, x, y: model(x, y)):
        self.model, self.max_grad_norm, self.scaler, self.loss = model, max_grad_norm, scaler, loss
        self.params = list(model.parameters())
        self.master = [p.detach().float().clone().requires_grad_() for p in self.params]
        self.opt = torch.optim.AdamW(self.master, lr=LR, weight_decay=WD, fused=True)

    def step(self, batches):
        self.accumulate(batches)
        return self.update()

    def accumulate(self, batches):
        for x, y in batches:
            loss = self.loss(self.model, x, y) / len(batches)
            (self.scaler.scale(loss) if self.scaler else loss).backward()
            for p, m in zip(self.params, self.master):
                m.grad = p.grad.float() if m.grad is None else m.grad + p.grad.float()
                p.grad = None

    def update(self):
        if self.scaler:
            self.scaler.unscale_(self.opt)
        norm = torch.nn.utils.clip_grad_norm_(self.master, self.max_grad_norm or math.inf)
        if self.scaler:
            self.scaler.step(self.opt)
            self.scaler.update()
        else:
            self.opt.step()
        self.opt.zero_grad()
        with torch.no_grad():
            for p, m in zip(self.params, self.master):
                p.copy_(m)
        return float(norm)


def run_streamed(model, opt, batches):
    for x, y in batches:
        opt.scale_loss(model(x, y) / len(batches)).backward()
    norm = opt.grad_norm()  # what clip_grad_norm_ returns, measured as the gradients went by
    opt.step()
    opt.zero_grad()
    return norm


@pytest.mark.parametrize(
    "accum, max_grad_norm, defer",
    [(2, 1.0, None), (1, 1.0, None), (3, None, None), (2, 1e6, None), (1, None, True)],
    ids=["accum2-clip1", "clip1", "accum3", "accum2-clip-never-bites", "deferred"],
)
def test_fp32_equals_fused_adamw_with_clipping_and_accumulation(tmp_path, accum, max_grad_norm, defer):
    """Speculative updates (redone when clipping bites), deferred ones (queued by step() with the norm known, landing
    during the next forward) and the rule between them (defer the step after one that clipped) all equal torch."""
    cfg, ref, model = pair()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=WD, fused=True)
    model, opt = streamed(
        tmp_path, model, max_grad_norm=max_grad_norm, gradient_accumulation_steps=accum, defer_updates=defer
    )
    try:
        assert opt.session.memory.limit_bytes("device") < sum(p.numel() * 4 for p in model.parameters())
        clipped, deferred, clipped_steps = 0, [], []
        for step in range(STEPS):
            deferred.append(opt.defers_updates)
            batches = micro_batches(cfg, step, accum)
            for x, y in batches:
                (ref(x, y) / accum).backward()
            ref_norm = float(torch.nn.utils.clip_grad_norm_(ref.parameters(), max_grad_norm or math.inf))
            ref_opt.step()
            ref_opt.zero_grad()
            norm = run_streamed(model, opt, batches)
            assert norm == pytest.approx(ref_norm, rel=1e-5)
            assert opt.grad_norm() == norm  # after step(): the norm it clipped against
            clipped += max_grad_norm is not None and ref_norm > max_grad_norm
            clipped_steps.append(max_grad_norm is not None and ref_norm > max_grad_norm)
        if max_grad_norm == 1.0:
            assert 0 < clipped < STEPS  # both paths ran: updates kept, and redone clipped (or deferred)
        if defer is None:  # the rule: a step defers exactly when the one before clipped
            assert deferred == [False] + clipped_steps[:-1]
        else:
            assert deferred == [defer] * STEPS
        state = model.state_dict()
        for name, p in ref.state_dict().items():
            torch.testing.assert_close(state[name], p, rtol=1e-5, atol=1e-6, msg=name)
        steps = {int(s["step"]) for s in opt.state_dict()["state"].values()}
        assert steps == {STEPS}
    finally:
        opt.close()


@pytest.mark.parametrize("defer", [None, True], ids=["rule", "deferred"])
def test_bf16_equals_the_fp32_master_reference_loop(tmp_path, defer):
    cfg, ref, model = pair(torch.bfloat16)
    loop = MasterLoop(ref, 1.0)
    model, opt = streamed(tmp_path, model, max_grad_norm=1.0, gradient_accumulation_steps=2, defer_updates=defer)
    try:
        for step in range(STEPS):
            batches = micro_batches(cfg, step, 2)
            assert run_streamed(model, opt, batches) == pytest.approx(loop.step(batches), rel=1e-4)
        master = {i: s["master_param"] for i, s in opt.state_dict()["state"].items()}
        for i, m in enumerate(loop.master):
            torch.testing.assert_close(master[i], m.detach(), rtol=1e-5, atol=1e-6)
        state = model.state_dict()
        for name, p in ref.state_dict().items():
            torch.testing.assert_close(state[name], p, rtol=0, atol=0, msg=name)  # rounded from equal masters
    finally:
        opt.close()


@pytest.mark.parametrize("defer", [None, True], ids=["rule", "deferred"])
def test_fp16_loss_scaling_equals_grad_scaler_and_skips_overflowing_steps(tmp_path, defer):
    cfg, ref, model = pair(torch.float16)
    scaling = nvoffload.LossScaling(init_scale=2.0**16, growth_interval=3)
    scaler = torch.amp.GradScaler("cpu", init_scale=scaling.init_scale, growth_interval=scaling.growth_interval)
    loop = MasterLoop(ref, 1.0, scaler)
    model, opt = streamed(
        tmp_path, model, max_grad_norm=1.0, gradient_accumulation_steps=2, loss_scaling=scaling, defer_updates=defer
    )
    try:
        skipped = 0
        for step in range(STEPS):
            batches = micro_batches(cfg, step, 2)
            assert opt.loss_scale == scaler.get_scale()
            ref_norm = loop.step(batches)
            norm = run_streamed(model, opt, batches)
            if math.isfinite(ref_norm):
                assert norm == pytest.approx(ref_norm, rel=1e-4)
            else:
                assert not math.isfinite(norm)
                skipped += 1
        assert skipped >= 1 and opt.loss_scale == scaler.get_scale()
        saved = opt.state_dict()  # the scale and its growth tracker resume with the state
        assert saved["loss_scale"] == {"scale": scaler.get_scale(), "growth_tracker": scaler._get_growth_tracker()}
        opt.load_state_dict({**saved, "loss_scale": {"scale": 8.0, "growth_tracker": 1}})
        assert opt.loss_scale == 8.0
        adam_steps = {int(s["step"]) for s in opt.state_dict()["state"].values()}
        assert adam_steps == {STEPS - skipped}
        master = {i: s["master_param"] for i, s in opt.state_dict()["state"].items()}
        for i, m in enumerate(loop.master):
            torch.testing.assert_close(master[i], m.detach(), rtol=1e-5, atol=1e-6)
    finally:
        opt.close()


def test_fewer_backward_passes_than_accumulated_update_from_the_kept_gradients(tmp_path):
    """A last, short accumulation (the end of an epoch) updates in step() from the gradients kept so far."""
    cfg, ref, model = pair()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=WD, fused=True)
    model, opt = streamed(tmp_path, model, max_grad_norm=1.0, gradient_accumulation_steps=3)
    try:
        for step, n in enumerate([3, 2, 3]):
            batches = micro_batches(cfg, step, n)
            for x, y in batches:
                (ref(x, y) / 3).backward()
            torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
            ref_opt.step()
            ref_opt.zero_grad()
            for x, y in batches:
                (model(x, y) / 3).backward()
            opt.step()
            opt.zero_grad()
        state = model.state_dict()
        for name, p in ref.state_dict().items():
            torch.testing.assert_close(state[name], p, rtol=1e-5, atol=1e-6, msg=name)
    finally:
        opt.close()


def test_a_clipped_step_reads_the_same_bytes_every_step(tmp_path):
    """Speculation reads the moments, the redo the state and the kept gradient: the same every step (it grew by a
    whole redo per step when step() never learned the gradient order)."""
    cfg, _, model = pair()
    model, opt = streamed(tmp_path, model, max_grad_norm=1e-3, defer_updates=False)
    try:
        reads = []
        for step in range(4):
            opt.reset_io_stats()
            x, y = batch(cfg, step)
            model(x, y).backward()
            opt.step()
            opt.zero_grad()
            reads.append(opt.memory_stats().read_bytes)
        n_params = sum(p.numel() for p in model.parameters())
        assert reads[1] == reads[2] == reads[3] <= 24 * n_params * 1.1  # 8 + 12 + 4 bytes per parameter
        assert len(opt._protocol.gens.step_order()) == len(list(model.parameters()))
    finally:
        opt.close()


def test_a_deferred_step_costs_the_kept_gradient_and_its_block_waits_for_its_update(tmp_path):
    """Deferred: each step reads and writes 4 bytes a parameter more than speculation without clipping (the kept
    gradient), no more, and trains the same weights; the next forward computes each block only after the updates
    of its parameters ran (step 2's are slowed down so that the forward would overtake them without the wait)."""
    per_step, weights = {}, {}
    for defer in (False, True):
        cfg, _, model = pair()
        (tmp_path / str(defer)).mkdir()
        model, opt = streamed(tmp_path / str(defer), model, defer_updates=defer)
        try:
            for step in range(4):
                if step == 2:  # count steps 2 and 3, their updates landed
                    opt.synchronize()
                    opt.reset_io_stats()
                x, y = batch(cfg, step)
                model(x, y).backward()
                if step == 3:
                    recorded = trace.stop()
                    pipeline._update = adam
                if step == 2:
                    trace.start()
                    pipeline, adam = opt._pipeline, opt._pipeline._update
                    pipeline._update = functools.partial(slowly, adam)
                opt.step()
                opt.zero_grad()
            opt.synchronize()
            stats = opt.memory_stats()
            per_step[defer] = (stats.read_bytes / 2, stats.written_bytes / 2)
            weights[defer] = model.state_dict()
        finally:
            opt.close()
        if defer:  # the updates of step 2 ran beside step 3's forward, each block's before that block
            updated, began = updates_and_forwards(recorded, model)
            assert all(updated[b] <= began[b] for b in began)
    kept = 4 * sum(p.numel() for p in model.parameters())
    assert per_step[True] == (per_step[False][0] + kept, per_step[False][1] + kept)
    for name, w in weights[False].items():
        assert torch.equal(weights[True][name], w), name


@pytest.mark.parametrize("after_ops", [0, 200], ids=["in-step", "in-forward"])
def test_an_io_error_of_a_deferred_update_is_raised_where_it_is_needed_and_training_goes_on(tmp_path, after_ops):
    """An EIO in step 2's updates: step() raises it for the updates it waits for (the parameters outside the blocks),
    else the next forward, at the block whose weights it left unwritten, saying what to do; synchronize() raises it
    (once) and restores the weights of before step 2, and training goes on exactly as a run that skipped step 2."""
    runs = {}
    for name in ("faulty", "skipped"):
        cfg, _, model = pair()
        (tmp_path / name).mkdir()
        model, opt = streamed(tmp_path / name, model, defer_updates=True)
        losses = []
        try:
            for step in range(5):
                x, y = batch(cfg, step)
                if step == 2:
                    if name == "faulty":
                        model(x, y).backward()
                        opt.session.store.inject_fault("eio", after_ops=after_ops)
                        with pytest.raises(OffloadIOError, match="Errno") as raised:
                            opt.step()
                            model(*batch(cfg, 3))  # needs every block's new weights
                        if after_ops:
                            assert "call optimizer.synchronize()" in str(raised.value).lower()
                            with pytest.raises(OffloadIOError, match="Errno"):
                                opt.synchronize()
                        opt.synchronize()  # nothing more to raise
                        opt.zero_grad()
                    continue
                loss = model(x, y)
                loss.backward()
                opt.step()
                opt.zero_grad()
                losses.append(loss.item())
            runs[name] = outcome(model, opt, losses)
        finally:
            opt.close()
    assert_same_runs(runs["faulty"], runs["skipped"])


def updates_and_forwards(recorded, model):
    """From a trace of a step: when each block's parameters' first updates in it (the step before's) ended, and
    when each block's forward began (every block has both)."""
    index = {id(p): i for i, p in enumerate(model.parameters())}
    block_of = {index[id(p)]: b for b, blk in enumerate(model.blocks) for p in blk.parameters()}
    updated, began, seen = {}, {}, set()
    for track, name, start, end, _ in recorded.spans():  # by start: a chunk's first update comes first
        if track == "adam" and int(name.split()[1]) in block_of and name not in seen:
            seen.add(name)
            b = block_of[int(name.split()[1])]
            updated[b] = max(updated.get(b, 0.0), end)
        elif track == "compute" and name.startswith("forward "):
            began[int(name.split()[1])] = start
    assert set(updated) == set(began) == set(range(len(model.blocks)))
    return updated, began


def outcome(model, opt, losses):
    """A run's losses and its weights once every update landed."""
    opt.synchronize()
    return losses, {k: v.clone() for k, v in model.state_dict().items()}


def assert_same_runs(run, ref):
    """Two :func:`outcome` results equal bit for bit."""
    assert run[0] == ref[0]
    for k, v in ref[1].items():
        assert torch.equal(run[1][k], v), k


def slowly(update, *args):
    time.sleep(0.005)
    return update(*args)


def test_grad_scaler_is_refused_with_the_way_to_scale(tmp_path):
    cfg, _, model = pair()
    model, opt = streamed(tmp_path, model)
    scaler = torch.amp.GradScaler("cpu")
    try:
        x, y = batch(cfg, 0)
        scaler.scale(model(x, y)).backward()
        with pytest.raises(ValueError, match=r"loss_scaling .* optimizer.scale_loss"):
            scaler.step(opt)
    finally:
        opt.close()


def test_recipe_options_are_checked_at_the_boundary(tmp_path):
    for bad in (0, True, 1.5):
        with pytest.raises(ValueError, match="gradient_accumulation_steps"):
            nvoffload.OffloadConfig(swap_dirs=[tmp_path], gradient_accumulation_steps=bad)
    for bad in (-1.0, True, math.inf):
        with pytest.raises(ValueError, match="max_grad_norm"):
            nvoffload.OffloadConfig(swap_dirs=[tmp_path], max_grad_norm=bad)
    with pytest.raises(ValueError, match="defer_updates must be True, False or None"):
        nvoffload.OffloadConfig(swap_dirs=[tmp_path], defer_updates=1)
    with pytest.raises(ValueError, match="defer_updates is for release_grads"):
        nvoffload.optim.OffloadOptimizerConfig(defer_updates=True)
    with pytest.raises(ValueError, match="growth_interval"):
        nvoffload.LossScaling(growth_interval=0)
    with pytest.raises(TypeError, match="LossScaling"):
        nvoffload.OffloadConfig(swap_dirs=[tmp_path], loss_scaling=2.0**16)
