"""The delayed update with parameter streaming (issue 34): each streamed block's new weights wait in its twin.

Each step's updates run during the next step's forward and backward, which read the weights of before them;
the next ``step()`` lands them (the twins become the blocks). The weights a step trains on must be exactly
torch's fused AdamW applied one step late, with the blocks evicted from the host cache, and also when the
updates are slowed down so that the next forward runs beside them.
"""

from __future__ import annotations

import functools
import math

import pytest
import torch
from test_streaming import batch
from test_vertical import torch_spread
from test_streaming_recipe import (
    LR, WD, assert_same_runs, micro_batches, outcome, pair, run_streamed, slowly, streamed, updates_and_forwards,
)

import nvoffload
from nvoffload import trace
from nvoffload.checkpoint import open_checkpoint
from nvoffload.optim import OffloadIOError

STEPS = 6


class LateAdamW:
    """The reference: torch's fused AdamW on ``model``, each step's gradients (the mean over its micro-batches,
    clipped by ``clip_grad_norm_``) applied at the next step; ``reverse``: the micro-batches summed in reverse."""

    def __init__(self, model, max_grad_norm=None, fused=True, exact_steps=0, loss=lambda model, x, y: model(x, y),
                 reverse=False):  # fmt: skip
        self.model, self.max_grad_norm, self.exact_steps, self.steps = model, max_grad_norm, exact_steps, 0
        self.loss, self.reverse = loss, reverse
        way = {"fused": True} if fused else {"foreach": True}
        self.opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD, **way)
        self.pending = None  # the last step's gradients, not applied yet

    def step(self, batches):
        for b in batches[::-1] if self.reverse else batches:
            (self.loss(self.model, *b) / len(batches)).backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.max_grad_norm or math.inf)
        grads = [p.grad for p in self.model.parameters()]
        self.flush()
        self.pending = grads
        self.steps += 1
        if self.steps <= self.exact_steps:  # delayed_update_after: applied in its own step
            self.flush()

    def flush(self):
        """Apply the pending gradients now (what ``synchronize()`` does)."""
        if self.pending is not None:
            for p, g in zip(self.model.parameters(), self.pending):
                p.grad = g
            self.opt.step()
        self.opt.zero_grad()
        self.pending = None


def assert_weights(model, ref, what, others=()):
    """``model``'s weights equal ``ref``'s bit for bit; with ``others`` (for the vertical schedule, which sums the
    micro-batches' gradients in another order: the references by torch's foreach AdamW and summing in reverse)
    within twice torch's spread (test_vertical.torch_spread)."""
    state, expected = model.state_dict(), ref.state_dict()
    if not others:
        for name, p in expected.items():
            assert torch.equal(state[name], p), (what, name)
        return
    torch_diff = torch_spread(ref, *others)
    assert torch_diff < 1e-4  # a tolerance that still tells a wrong step (~lr) from rounding
    assert max(float((state[k] - p).abs().max()) for k, p in expected.items()) <= 2 * torch_diff, what


@pytest.mark.parametrize(
    "accum, max_grad_norm, vertical, after",
    [(1, None, False, 0), (2, 1.0, False, 0), (1, 1e6, False, 0), (4, 1.0, True, 0), (1, 1.0, False, 2)],
    ids=["plain", "accum2-clip1", "clip-never-bites", "vertical4-clip1", "after2-clip1"],
)
def test_streamed_weights_are_adamw_applied_one_step_late(tmp_path, accum, max_grad_norm, vertical, after):
    """``after``: delayed_update_after, the steps that update exactly first (speculating, or deferred by the
    rule after a step whose clipping bit)."""
    cfg, ref, model = pair()
    others = (pair()[1], pair()[1]) if vertical else ()
    late = LateAdamW(ref, max_grad_norm, exact_steps=after)
    late_others = [LateAdamW(m, max_grad_norm, fused=not i, reverse=bool(i)) for i, m in enumerate(others)]
    model, opt = streamed(
        tmp_path, model, max_grad_norm=max_grad_norm, gradient_accumulation_steps=accum, delayed_update=True,
        delayed_update_after=after,
    )
    try:
        assert opt.session.memory.limit_bytes("device") < sum(p.numel() * 4 for p in model.parameters())
        start = {k: v.clone() for k, v in model.state_dict().items()}
        for step in range(STEPS):
            assert opt.defers_updates == (step >= after or step > 0 and opt.grad_norm() > max_grad_norm)
            batches = micro_batches(cfg, step, accum)
            if vertical:
                nvoffload.vertical_step(opt, batches)
            else:
                run_streamed(model, opt, batches)
            late.step(batches)
            if vertical:  # compared at the end: one step's rounding is far below the tolerance's own
                for other in late_others:
                    other.step(batches)
            else:
                assert_weights(model, ref, step)
            if step == after:  # the first delayed step lands nothing: its update runs during the next step
                assert all(torch.equal(model.state_dict()[k], v) for k, v in start.items()) == (after == 0)
        opt.synchronize()  # lands the last step's update
        late.flush()
        if vertical:
            for other in late_others:
                other.flush()
        assert_weights(model, ref, "synchronized", others)
        steps = {int(s["step"]) for s in opt.state_dict()["state"].values()}
        assert steps == {STEPS}
    finally:
        opt.close()


def test_the_next_forward_runs_beside_the_updates_on_the_old_weights(tmp_path):
    """Step 2's updates are slowed down (a 5 ms sleep around the real kernel): step 3's forward overtakes them, and
    still trains on the weights of before them (the twins hold the new ones), bit for bit as the reference. After
    two steps the weights are exact AdamW's after one: not a relabelled exact run."""
    cfg, ref, model = pair()
    exact_ref = pair()[1]
    late, exact = LateAdamW(ref), torch.optim.AdamW(exact_ref.parameters(), lr=LR, weight_decay=WD, fused=True)
    model, opt = streamed(tmp_path, model, delayed_update=True)
    try:
        for step in range(5):
            x, y = batch(cfg, step)
            model(x, y).backward()
            if step == 2:
                pipeline, adam = opt._pipeline, opt._pipeline._update
                pipeline._update = functools.partial(slowly, adam)
                trace.start()  # before step 2's updates are queued: a loaded machine may run the first before step 3
            opt.step()  # step 3's lands step 2's updates
            if step == 3:
                recorded = trace.stop()
                pipeline._update = adam
            opt.zero_grad()
            late.step([(x, y)])
            assert_weights(model, ref, step)
            if step == 0:
                exact_ref(x, y).backward()
                exact.step()
            if step == 1:
                assert_weights(model, exact_ref, "one exact step")
        opt.synchronize()
    finally:
        opt.close()
    updated, began = updates_and_forwards(recorded, model)  # of step 2's updates, and of step 3's forward
    assert any(began[b] < updated[b] for b in began)  # the forward did not wait for the block's update
    # the worker took step 3's gradients ahead of step 2's updates still queued (backward did not wait for them)
    kept = [start for track, name, start, _, _ in recorded.spans() if track == "d2h" and "gradient" in name]
    assert kept and min(kept) < max(updated.values())  # the forward did not wait for the block's update


def test_an_io_error_of_an_update_in_flight_is_raised_by_the_next_step_and_training_goes_on(tmp_path):
    """An EIO in step 2's updates (running beside step 3): step 3's step() raises it, the weights are those of
    before step 2's update (its gradients and step 3's are dropped), and training goes on exactly as a run that
    landed step 1's update and skipped steps 2 and 3. Every block and its twin fit the host cache, so only the
    updates touch the store."""
    runs = {}
    for name in ("faulty", "skipped"):
        cfg, _, model = pair()
        (tmp_path / name).mkdir()
        model, opt = streamed(tmp_path / name, model, delayed_update=True, cpu_memory_bytes=64 << 20)
        losses = []
        try:
            for step in range(6):
                x, y = batch(cfg, step)
                if step in (2, 3) and name == "skipped":
                    opt.synchronize()
                    continue
                loss = model(x, y)
                loss.backward()
                if step == 3:
                    before = {k: v.clone() for k, v in model.state_dict().items()}
                    with pytest.raises(OffloadIOError, match="Errno"):
                        opt.step()
                    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
                    opt.synchronize()  # nothing more to raise
                    opt.zero_grad()
                    continue
                opt.step()
                opt.zero_grad()
                if step == 2:  # the updates it queued fail (or, had they all been done, step 3's kept gradients)
                    opt.session.store.inject_fault("eio", after_ops=0)
                else:
                    losses.append(loss.item())
            runs[name] = outcome(model, opt, losses)
        finally:
            opt.close()
    assert_same_runs(runs["faulty"], runs["skipped"])


def test_loading_weights_waits_for_the_update_in_flight_to_land(tmp_path):
    """A delayed update in flight would replace weights loaded into its block: loading is refused, saying what to
    do, until synchronize() lands it; then the loaded weights are the model's."""
    cfg, _, model = pair()
    model, opt = streamed(tmp_path, model, delayed_update=True)
    try:
        x, y = batch(cfg, 0)
        model(x, y).backward()
        opt.step()
        saved = {k: v.clone() for k, v in model.state_dict().items()}
        with pytest.raises(RuntimeError, match="call optimizer.synchronize"):
            model.load_state_dict(saved)
        opt.synchronize()
        assert any(not torch.equal(v, saved[k]) for k, v in model.state_dict().items())  # the update landed
        model.load_state_dict(saved)
        assert all(torch.equal(v, saved[k]) for k, v in model.state_dict().items())
    finally:
        opt.close()


@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")  # peft asks transformers 5
def test_lora_adapters_are_delayed_and_the_frozen_base_is_never_written(tmp_path):
    """A PEFT LoRA model over a streamed Llama base: each block's twin versions only its adapters' part (the frozen
    base weights stay in the block's own store entry), so the streamer writes adapters only, never a base weight,
    and the adapters are torch's fused AdamW applied one step late."""
    lora = pytest.importorskip("test_lora")
    lora.base_model("llama", meta=False).save_pretrained(tmp_path / "base")
    model = lora.peft.get_peft_model(lora.base_model("llama", meta=True), lora.lora_config("llama"))
    base = lora.transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base")
    ref = lora.peft.get_peft_model(base, lora.lora_config("llama"))
    block = lora.block_bytes(model)
    config = nvoffload.OffloadConfig(  # five blocks: three in flight, a twin and the block it is made from
        swap_dirs=[tmp_path], cpu_memory_bytes=2 * (5 * block + 64 * lora.KiB), device_memory_bytes=64 * lora.MiB,
        delayed_update=True,
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    with open_checkpoint(tmp_path / "base") as ckpt:
        model, opt = nvoffload.initialize(model, optimizer, config, checkpoint=ckpt)
    with opt:
        ref.load_state_dict(lora.adapters(model.state_dict()), strict=False)
        late = LateAdamW(ref, loss=lambda m, x: lora.loss_of(m, x))
        layer = [p for p in nvoffload.streaming.find_blocks(model)[0].parameters() if p.requires_grad]
        layer_bytes = sum(-(-p.numel() * 4 // 64) * 64 for p in layer)  # one layer's adapters in its block
        written = []
        for step in range(lora.STEPS):
            x = lora.batch(step)
            opt.session.reset_stats()
            lora.loss_of(model, x).backward()
            opt.step()
            opt.zero_grad()
            late.step([(x,)])
            streamed = opt.session.streamer.stats().bytes_written
            written.append(streamed)
            assert streamed % layer_bytes == 0  # adapters' parts only, never a base weight
            state = model.state_dict()
            for name, value in lora.adapters(ref.state_dict()).items():
                assert torch.equal(state[name], value), (step, name)
        assert sum(written) > 0  # twins were evicted: their adapter parts went to their own store entries


def test_a_training_checkpoint_lands_the_update_in_flight_and_resumes_exactly(tmp_path):
    """save_training_checkpoint lands the update in flight (the twins become the blocks) before it saves the model
    and the state; a streamed run resumed from it ends bit-identical to the uninterrupted one."""
    cfg = pair()[0]
    data = [batch(cfg, step) for step in range(6)]

    def train(model, opt, part):
        for x, y in part:
            model(x, y).backward()
            opt.step()
            opt.zero_grad()

    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    first, opt = streamed(tmp_path / "a", pair()[2], delayed_update=True)
    with opt:
        train(first, opt, data[:3])
        nvoffload.save_training_checkpoint(tmp_path / "ckpt", step=3, model=first, optimizer=opt)
        saved = {k: v.clone() for k, v in first.state_dict().items()}
        train(first, opt, data[3:])
        ended = outcome(first, opt, [])
    resumed, opt = streamed(tmp_path / "b", pair(seed=1)[2], delayed_update=True)
    with opt:
        nvoffload.load_training_checkpoint(tmp_path / "ckpt", model=resumed, optimizer=opt)
        assert all(torch.equal(v, saved[k]) for k, v in resumed.state_dict().items())
        train(resumed, opt, data[3:])
        assert_same_runs(outcome(resumed, opt, []), ended)


def test_landing_inside_a_forward_is_refused_and_the_update_lands_at_the_next_step(tmp_path):
    """synchronize() called while a forward holds a block (from a forward hook) would leave that block's device copy
    with the old weights: it raises, commits nothing and keeps the update in flight; the next step() lands it, and
    the weights stay torch's AdamW one step late, bit for bit."""
    cfg, ref, model = pair()
    late = LateAdamW(ref)
    model, opt = streamed(tmp_path, model, delayed_update=True)
    refused = []

    def land_inside(module, args):
        if not refused:
            with pytest.raises(RuntimeError, match="held on the device") as raised:
                opt.synchronize()
            refused.append(raised.value)

    try:
        for step in range(4):
            x, y = batch(cfg, step)
            if step == 1:  # step 0's update is in flight
                handle = model.blocks[3].register_forward_pre_hook(land_inside)
            model(x, y).backward()
            if step == 1:
                handle.remove()
                assert refused and {int(s["step"]) for s in opt.state_dict()["state"].values()} == {1}
            opt.step()
            opt.zero_grad()
            late.step([(x, y)])
            assert_weights(model, ref, step)
        opt.synchronize()
    finally:
        opt.close()


def cuda_late_run(tmp_path, device):
    """Five delayed steps of the streamed model on ``device``, clipped, beside torch's fused AdamW one step late
    (on a GPU it rounds a little differently from the host kernel: compared within 1e-5)."""
    cfg, ref, model = pair()
    ref, model = ref.to(device), model.to(device)
    late = LateAdamW(ref, max_grad_norm=1.0)
    model, opt = streamed(tmp_path, model, max_grad_norm=1.0, delayed_update=True)
    try:
        assert opt.session.memory.limit_bytes("device") < sum(p.numel() * 4 for p in model.parameters())
        for step in range(5):
            batches = [tuple(t.to(device) for t in b) for b in micro_batches(cfg, step, 1)]
            run_streamed(model, opt, batches)
            late.step(batches)
            for (name, p), q in zip(model.state_dict().items(), ref.state_dict().values()):
                torch.testing.assert_close(p.to(q.device), q, rtol=1e-5, atol=1e-6, msg=f"step {step}: {name}")
        opt.synchronize()
        late.flush()
        for (name, p), q in zip(model.state_dict().items(), ref.state_dict().values()):
            torch.testing.assert_close(p.to(q.device), q, rtol=1e-5, atol=1e-6, msg=f"synchronized: {name}")
    finally:
        opt.close()


@pytest.mark.cuda
def test_cuda_streamed_weights_are_adamw_applied_one_step_late(tmp_path):
    """On a GPU: the blocks' twins (host) are copied in on the copy stream once installed, and the parameters outside
    the blocks take their staged device copy; the weights are torch's fused CUDA AdamW one step late."""
    cuda_late_run(tmp_path, "cuda")
