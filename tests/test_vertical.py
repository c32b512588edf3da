"""The vertical schedule (issue 33): every micro-batch of a block before the next block, on the real autograd engine."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from test_streaming import batch, config
from test_streaming_recipe import MasterLoop

import nvoffload
from nvoffload.models import GPT, GPTConfig
from nvoffload.vertical import vertical_step

LR, WD, STEPS = 3e-3, 0.1, 6


def micro_batches(cfg, step, count):
    return [batch(cfg, 100 * step + i) for i in range(count)]


def streamed(tmp_path, model, **kw):
    return nvoffload.initialize(
        model, torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD), config(tmp_path, model, **kw)
    )


def tiny(n_layer=2):
    torch.manual_seed(0)
    cfg = GPTConfig(**{**GPTConfig.preset("tiny").__dict__, "n_layer": n_layer})
    return cfg, GPT(cfg)


def test_each_block_runs_every_micro_batch_before_the_block_below_and_its_hooks_fire_once(tmp_path):
    cfg, model = tiny(n_layer=3)
    names = list(model.state_dict())
    model, opt = streamed(tmp_path, model)
    session = opt.session
    order, calls, recomputed = [], [], []
    fires = {name: 0 for name, _ in model.named_parameters()}

    def count(name):
        def hook(param):
            fires[name] += 1
            if name.endswith(".fc.weight"):  # a block's gradient is final: its update is queued now
                order.append(("update", int(name.split(".")[1])))

        return hook

    for name, p in model.named_parameters():
        p.register_post_accumulate_grad_hook(count(name))

    def recompute(k):
        def hook(module, args):
            if torch._C._current_graph_task_id() != -1:  # checkpoint's recompute, inside backward
                recomputed.append(k)

        return hook

    def watch(k):
        def hook(module, args, output):
            if torch._C._current_graph_task_id() != -1:
                return
            i = sum(1 for j in calls if j == k)
            calls.append(k)
            output.register_hook(lambda g: order.append((k, i)))  # this call's backward starts

        return hook

    for k, block in enumerate(model.blocks):
        block.register_forward_hook(watch(k))
        block.register_forward_pre_hook(recompute(k))  # a recompute stops early (its forward hooks do not run)
    G = 3
    try:
        losses = vertical_step(opt, micro_batches(cfg, 0, G))
        assert losses.shape == (G,) and torch.isfinite(losses).all()
        assert calls == [k for k in range(3) for _ in range(G)]  # forward: each block over every micro-batch
        assert sorted(recomputed) == calls  # backward recomputed each call once
        backward = [e for e in order if e[0] != "update"]
        # backward: block 2 over every micro-batch (the last first), then block 1, then block 0
        assert [k for k, _ in backward] == [2] * G + [1] * G + [0] * G
        assert all(sorted(i for k, i in backward if k == b) == list(range(G)) for b in range(3))
        # each block's update is queued once its micro-batches are done, before the block below starts: the
        # optimizer works on it while backward goes on
        for b in range(3):
            queued = order.index(("update", b))
            assert max(order.index((b, i)) for i in range(G)) < queued
            assert b == 0 or queued < min(order.index((b - 1, i)) for i in range(G))
        # each parameter's hook fired once for the step, summed over the micro-batches
        assert set(fires.values()) == {1}, fires
        assert all(p.grad is None for p in model.parameters())
        assert list(model.state_dict()) == names  # the blocks are back in their list
        assert all(type(b).__name__ == "Block" for b in model.blocks)
        assert int(opt.state_dict()["state"][0]["step"]) == 1
    finally:
        opt.close()


def _max_diff(a: dict, b: dict) -> float:
    return max(float((a[n] - b[n]).abs().max()) for n in a)


def torch_spread(fused: torch.nn.Module, *others: torch.nn.Module) -> float:
    """How far apart torch's equally valid ways of taking the same steps end: ``fused`` (fused AdamW, the micro-batches
    in order) beside ``others`` (its foreach AdamW; the micro-batches' gradients summed in reverse). A vertical step
    sums them in yet another order (and runs the embedding over all of them at once), so its weights are compared
    within twice this spread: it is this machine's rounding, where a fixed tolerance would be a guess (the spread
    of the two AdamWs alone is 3 to 5 times smaller on some CPUs than that of the summation order)."""
    state = fused.state_dict()
    return max(_max_diff(state, other.state_dict()) for other in others)


@pytest.mark.parametrize("G", [1, 2, 4])
@pytest.mark.parametrize("max_grad_norm", [None, 0.5], ids=["no-clip", "clip-bites"])
def test_equals_torch_accumulating_the_same_micro_batches(tmp_path, G, max_grad_norm):
    check_equals_torch(tmp_path, G, max_grad_norm)


def test_with_activation_offload_the_block_inputs_move_through_it_and_the_step_is_the_same(tmp_path):
    session = check_equals_torch(tmp_path, 4, 0.5, offload_activations=True, activation_memory_bytes=192 << 10)
    stats = session.activation_offload.stats()
    assert stats.bytes_written > 0 and stats.bytes_read == stats.bytes_written  # written in forward, read back
    assert stats.offloaded_bytes == 0  # all released by backward


def test_with_activation_host_bytes_the_block_inputs_stay_in_host_memory_as_far_as_they_fit(tmp_path):
    """OffloadConfig.activation_host_bytes: the same steps as with every block input offloaded to NVMe (bit for bit),
    the same tensors offloaded, but as many as fit in it kept in host memory (from the session's slab) and only
    the rest written to NVMe. The small preset: each micro-batch's block input (512 KiB) is offloaded."""
    torch.manual_seed(0)
    cfg = GPTConfig.preset("small")
    base, kept_bytes, runs = GPT(cfg), 3 << 20, {}
    for name, host in (("nvme", 0), ("spill", kept_bytes)):
        (tmp_path / name).mkdir()
        model, opt = streamed(tmp_path / name, copy.deepcopy(base), offload_activations=True, activation_host_bytes=host,
                              activation_memory_bytes=2 << 20, cpu_memory_bytes=64 << 20, max_grad_norm=0.5)  # fmt: skip
        try:
            losses = [vertical_step(opt, micro_batches(cfg, step, 4)) for step in range(2)]
            runs[name] = (losses, {k: v.clone() for k, v in model.state_dict().items()}, opt.session.activation_offload.stats())
        finally:
            opt.close()
    (losses, weights, to_nvme), (spill_losses, spill_weights, spilled) = runs["nvme"], runs["spill"]
    assert all(torch.equal(a, b) for a, b in zip(losses, spill_losses))
    assert all(torch.equal(weights[k], spill_weights[k]) for k in weights)
    assert spilled.bytes_written == to_nvme.bytes_written >= 2 * 16 * (512 << 10)  # 4 blocks x 4 micro-batches
    assert to_nvme.host_bytes_written == 0
    # each step keeps the first 3 MiB of its inputs in host memory (six of 512 KiB); the rest go to NVMe
    assert spilled.host_bytes_written == 2 * kept_bytes and spilled.bytes_read == spilled.bytes_written
    assert spilled.offloaded_bytes == 0


@pytest.mark.parametrize("host_inputs", [8, 3], ids=["in-host-memory", "nvme-spill"])
def test_with_the_stash_the_block_inputs_go_through_host_memory_and_the_step_is_torchs(tmp_path, host_inputs):
    """OffloadConfig.stash_host_bytes: each block's input for each micro-batch (64 KiB here: 4 x 64 x 64 fp32) is
    copied off the device as forward makes it and kept in host memory up to ``host_inputs`` of them, the rest
    written to NVMe, and read back ahead of backward; the staging holds one input each way (its writes and reads
    wait for each other). The steps equal torch's within its own spread; every input is stashed and read back
    once (or, where its copy out was still running when the read ahead reached it, kept on the device instead),
    none outlives the step."""
    block_input = 4 * 64 * 64 * 4
    session = check_equals_torch(
        tmp_path, 4, 0.5, stash_host_bytes=host_inputs * block_input, stash_staging_bytes=2 * block_input,
        cpu_memory_bytes=8 << 20,
    )  # fmt: skip
    stats = session.stash.stats()
    assert session.activation_offload is None
    assert stats.bytes_written == STEPS * 2 * 4 * block_input  # 2 blocks x 4 micro-batches
    assert stats.bytes_read + stats.reads_avoided * block_input == stats.bytes_written
    # each read back from where it was kept: NVMe only for those written there
    assert 0 <= stats.bytes_read - stats.host_bytes_read <= stats.bytes_written - stats.host_bytes_written
    assert (stats.host_bytes_read == stats.bytes_read) == (host_inputs >= 8)
    assert stats.host_bytes_written == STEPS * min(host_inputs, 8) * block_input  # the rest went to NVMe
    assert stats.offloaded_bytes == 0 and stats.live_records == 0


def test_the_stash_holds_on_the_device_a_block_or_two_of_inputs_whatever_the_depth(tmp_path):
    """Six blocks, four micro-batches: the 24 block inputs of a step (64 KiB each) are all stashed, while the device
    holds at most those of two blocks (the one whose copies out are in flight, over every micro-batch: they share
    one storage, the concatenated output of the block below; and in backward those read back ahead) and the
    staging's: not the 24 a step keeps on the device without the stash."""
    cfg, model = tiny(n_layer=6)
    block_input, G = 4 * 64 * 64 * 4, 4
    model, opt = streamed(tmp_path, model, stash_host_bytes=24 * block_input, stash_staging_bytes=2 * block_input,
                          cpu_memory_bytes=16 << 20)  # fmt: skip
    try:
        for step in range(2):
            vertical_step(opt, micro_batches(cfg, step, G))
        stats = opt.session.stash.stats()
    finally:
        opt.close()
    assert stats.bytes_written == 2 * 6 * G * block_input and stats.host_bytes_written == stats.bytes_written
    assert 0 < stats.peak_resident_bytes <= 2 * G * block_input + 2 * block_input < 6 * G * block_input


@pytest.mark.parametrize("fields, message", [
    ({"stash_host_bytes": -1}, "stash_host_bytes must be None or an int number of bytes >= 0, got -1"),
    ({"stash_host_bytes": 1 << 20, "stash_staging_bytes": 0}, "stash_staging_bytes must be None or a positive int"),
    ({"stash_staging_bytes": 1 << 20}, "stash_staging_bytes stages the vertical schedule's stash: set stash_host_bytes"),
])
def test_the_stash_settings_are_refused_at_the_boundary(tmp_path, fields, message):
    with pytest.raises(ValueError, match=message):
        nvoffload.OffloadConfig(swap_dirs=[tmp_path], **fields)


def check_equals_torch(tmp_path, G, max_grad_norm, **offload):
    """STEPS steps of G micro-batches streamed, against fused torch AdamW accumulating the same micro-batches:
    weights within twice torch's own spread (:func:`torch_spread`); returns the (closed) session."""
    cfg, model = tiny()
    fused, foreach, backwards = (copy.deepcopy(model) for _ in range(3))
    refs = {  # (model, optimizer, the micro-batches in reverse)
        "fused": (fused, torch.optim.AdamW(fused.parameters(), lr=LR, weight_decay=WD, fused=True), False),
        "foreach": (foreach, torch.optim.AdamW(foreach.parameters(), lr=LR, weight_decay=WD, foreach=True), False),
        "reversed": (backwards, torch.optim.AdamW(backwards.parameters(), lr=LR, weight_decay=WD, fused=True), True),
    }
    # gradient_accumulation_steps is the ordinary loop's: a vertical step takes its G micro-batches in one backward
    model, opt = streamed(tmp_path, model, max_grad_norm=max_grad_norm, gradient_accumulation_steps=3, **offload)
    ref_losses = {k: [] for k in refs}
    losses, clipped = [], 0
    try:
        for step in range(STEPS):
            batches = micro_batches(cfg, step, G)
            for key, (ref, ref_opt, reverse) in refs.items():
                step_losses = []
                for x, y in batches[::-1] if reverse else batches:
                    loss = ref(x, y)
                    (loss / G).backward()
                    step_losses.append(float(loss.detach()))
                ref_losses[key] += step_losses[::-1] if reverse else step_losses  # in the micro-batches' order
                norm = float(torch.nn.utils.clip_grad_norm_(ref.parameters(), max_grad_norm or math.inf))
                ref_opt.step()
                ref_opt.zero_grad()
            clipped += max_grad_norm is not None and norm > max_grad_norm
            losses += vertical_step(opt, batches).tolist()
            assert all(p.untyped_storage().nbytes() == 0 for p in model.blocks.parameters())  # streamed
            if max_grad_norm is not None:
                assert opt.grad_norm() == pytest.approx(norm, rel=1e-5)
        if max_grad_norm is not None:
            assert 0 < clipped  # the redo from the kept gradients ran
        torch_diff = torch_spread(fused, foreach, backwards)
        assert 0 < torch_diff < 1e-4  # a tolerance that still tells a wrong step (~lr) from rounding
        assert _max_diff(model.state_dict(), fused.state_dict()) <= 2 * torch_diff  # G = 1: 0 (bit-exact); 2, 4: ~1x
        loss_tol = 2 * max(
            abs(a - b) for key in ("foreach", "reversed") for a, b in zip(ref_losses["fused"], ref_losses[key])
        )
        assert max(abs(a - b) for a, b in zip(losses, ref_losses["fused"])) <= max(loss_tol, 2 * torch_diff)
        assert {int(s["step"]) for s in opt.state_dict()["state"].values()} == {STEPS}
    finally:
        opt.close()
    return opt.session


def test_four_micro_batches_move_no_more_weight_or_state_bytes_than_one(tmp_path):
    """The engines' own counters, with the blocks evicted from the host cache (read from the store each pass):
    a vertical step of 4 micro-batches reads and writes the store and copies weights to the device exactly as
    one of 1 (the block inputs stay on the device here), and writes no gradient to be accumulated; the
    ordinary loop's 4 micro-batches copy the weights 4 times and keep gradients in the store."""
    cfg, model = tiny(n_layer=6)
    block = max(sum(p.numel() * 4 for p in b.parameters()) for b in model.blocks)
    resident = sum(p.numel() * 4 for n, p in model.named_parameters() if not n.startswith("blocks."))
    model, opt = nvoffload.initialize(
        model, torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD),
        nvoffload.OffloadConfig(
            swap_dirs=[tmp_path], device_memory_bytes=2 * resident + 3 * block + (1 << 20),
            cpu_memory_bytes=2 * 4 * (block + 4096), gradient_accumulation_steps=4,
        ),
    )  # fmt: skip
    session = opt.session
    copied = [0]
    to_device = session.streamer.transfer.to_device

    def counting(dst, src, *args, **kwargs):
        copied[0] += dst.numel() * dst.element_size()
        return to_device(dst, src, *args, **kwargs)

    session.streamer.transfer.to_device = counting

    def step(G, vertical, seed):
        batches = micro_batches(cfg, seed, G)
        if vertical:
            vertical_step(opt, batches)
        else:
            for x, y in batches:
                (model(x, y) / G).backward()
            opt.step()
        opt.synchronize()
        session.streamer.cache.flush()

    def measured(G, vertical, seed):
        step(G, vertical, seed)  # the host cache as such steps leave it
        session.reset_stats()
        copied[0] = 0
        step(G, vertical, seed)
        streamed = session.streamer.stats()
        return {
            "store read (weights)": streamed.bytes_read, "store written (weights)": streamed.bytes_written,
            "optimizer read": session.io_bytes()[0] - streamed.bytes_read,
            "optimizer written": session.io_bytes()[1] - streamed.bytes_written, "to device": copied[0],
        }  # fmt: skip

    try:
        step(1, True, 0)  # the first step writes the state's first generation
        one = measured(1, True, 1)
        four = measured(4, True, 3)
        ordinary = measured(4, False, 5)
        assert one["store read (weights)"] >= 3 * block  # the blocks come from the store, not all from the host cache
        assert one["to device"] >= 2 * 5 * block  # each block copied to the device in forward and in backward
        exact = ("to device", "optimizer read", "optimizer written")
        assert {k: four[k] for k in exact} == {k: one[k] for k in exact}, (one, four)
        # The weights' store traffic moves by a block or two from step to step: whether the optimizer's update
        # of a block lands before the host cache evicts it is a race (measured: G = 1 reads 10 blocks and writes
        # 6, G = 4 reads 8 to 10 and writes 6 or 7; the ordinary loop's G = 4 reads 22). Whatever G, a block is
        # read at most for the forward, the backward and its update, and written at most twice.
        for G, got in ((1, one), (4, four)):
            assert got["store read (weights)"] <= 3 * 6 * block, (G, got)
            assert got["store written (weights)"] <= 2 * 6 * block, (G, got)
        # the ordinary loop: the weights copied once per micro-batch and pass, gradients kept in the store
        assert ordinary["to device"] >= 3 * one["to device"]
        params = sum(p.numel() * 4 for p in model.parameters())
        assert ordinary["optimizer written"] >= one["optimizer written"] + 3 * params  # 3 fp32 sums kept
    finally:
        opt.close()


@pytest.mark.parametrize("family, stash", [("llama", None), ("gpt2", None), ("llama", 0)], ids=["llama", "gpt2", "llama-stash-nvme"])
def test_hugging_face_causal_lms_equal_torch_accumulating_the_same_micro_batches(tmp_path, family, stash):
    """Rotary embeddings (Llama) and learned positions (GPT-2), each family's own masks, the model's own loss,
    with no hidden() or loss() named: four micro-batches of two rows in one step, clipping that bites. With a stash
    of no host memory, every block input (and each call's rotary embeddings) goes to NVMe and back."""
    pytest.importorskip("transformers")
    from test_hf_recipe import budgets, build, hf_loss

    model = build(family, meta=False)
    fused, foreach, backwards = (copy.deepcopy(model) for _ in range(3))
    refs = [  # (model, optimizer, the micro-batches in reverse): see torch_spread
        (fused, torch.optim.AdamW(fused.parameters(), lr=LR, weight_decay=WD, fused=True), False),
        (foreach, torch.optim.AdamW(foreach.parameters(), lr=LR, weight_decay=WD, foreach=True), False),
        (backwards, torch.optim.AdamW(backwards.parameters(), lr=LR, weight_decay=WD, fused=True), True),
    ]
    model, opt = nvoffload.initialize(
        model, torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD),
        budgets(tmp_path, model, max_grad_norm=1.0, stash_host_bytes=stash, stash_staging_bytes=None if stash is None else 64 << 10),
    )  # fmt: skip
    names, G, clipped = list(model.state_dict()), 4, 0
    try:
        for step in range(4):
            g = torch.Generator().manual_seed(step)
            batches = [(x, x) for x in torch.randint(0, 128, (G, 2, 16), generator=g)]
            ref_losses = []
            for ref, ref_opt, reverse in refs:
                ref_losses.append([])
                for x, y in batches[::-1] if reverse else batches:
                    loss = hf_loss(ref, x, y)
                    (loss / G).backward()
                    ref_losses[-1].append(float(loss.detach()))
                if reverse:
                    ref_losses[-1].reverse()  # in the micro-batches' order
                norm = float(torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0))
                ref_opt.step()
                ref_opt.zero_grad()
            clipped += norm > 1.0
            losses = vertical_step(opt, batches).tolist()
            assert opt.grad_norm() == pytest.approx(norm, rel=1e-5)
            torch_loss_diff = max(abs(a - b) for other in ref_losses[1:] for a, b in zip(ref_losses[0], other))
            assert max(abs(a - b) for a, b in zip(losses, ref_losses[0])) <= max(2 * torch_loss_diff, 1e-6)
        assert clipped > 0
        fused_state = fused.state_dict()
        torch_diff = torch_spread(fused, foreach, backwards)
        assert 0 < torch_diff < 1e-4
        state = model.state_dict()
        assert list(state) == names
        assert _max_diff({n: state[n] for n in fused_state}, fused_state) <= 2 * torch_diff
        if stash is not None:
            stats = opt.session.stash.stats()
            assert stats.bytes_written > 0 and stats.host_bytes_written == 0 and stats.live_records == 0
    finally:
        opt.close()


def test_the_ordinary_loop_between_vertical_steps_is_unchanged(tmp_path):
    """gradient_accumulation_steps=3 stays the ordinary loop's: vertical steps of 2 micro-batches and ordinary
    steps of 3 alternate, equal to torch; a vertical step while an ordinary one is in progress is refused."""
    cfg, model = tiny()
    fused, foreach, backwards = (copy.deepcopy(model) for _ in range(3))
    refs = [(m, torch.optim.AdamW(m.parameters(), lr=LR, weight_decay=WD, **kw), reverse) for m, kw, reverse in
            ((fused, {"fused": True}, False), (foreach, {"foreach": True}, False), (backwards, {"fused": True}, True))]  # fmt: skip
    model, opt = streamed(tmp_path, model, max_grad_norm=0.5, gradient_accumulation_steps=3)
    try:
        for step in range(4):
            G = 2 if step % 2 == 0 else 3
            batches = micro_batches(cfg, step, G)
            for ref, ref_opt, reverse in refs:
                for x, y in batches[::-1] if reverse else batches:
                    (ref(x, y) / G).backward()
                torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
                ref_opt.step()
                ref_opt.zero_grad()
            if G == 2:
                nvoffload.vertical_step(opt, batches)
                continue
            (model(*batches[0]) / G).backward()
            with pytest.raises(RuntimeError, match="a step is in progress"):
                nvoffload.vertical_step(opt, batches)
            for x, y in batches[1:]:
                (model(x, y) / G).backward()
            opt.step()
            opt.zero_grad()
        assert _max_diff(model.state_dict(), fused.state_dict()) <= 2 * torch_spread(fused, foreach, backwards)
        assert {int(s["step"]) for s in opt.state_dict()["state"].values()} == {4}
    finally:
        opt.close()


class TorchLoop(MasterLoop):
    """torch's own loop on 16-bit parameters: ``(loss / G).backward()`` sums the G gradients in ``.grad``, in the
    parameters' dtype (as the vertical step's autograd sums them); then :class:`MasterLoop`'s update (fp32 master
    weights, ``clip_grad_norm_``, fused AdamW, a real ``GradScaler`` in fp16)."""

    def accumulate(self, batches):
        for x, y in batches:
            loss = self.loss(self.model, x, y) / len(batches)
            (self.scaler.scale(loss) if self.scaler else loss).backward()
        for p, m in zip(self.params, self.master):
            m.grad, p.grad = p.grad.float(), None


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_sixteen_bit_steps_are_torchs_loop_with_its_loss_scaling(tmp_path, dtype):
    """16-bit rounding makes the weights drift apart from step to step whichever way the gradients are summed, so
    the bound is torch's own: the master weights are within twice the distance between torch's two ways (16-bit
    sums, fp32 sums) of torch's loop. In fp16 the scale follows GradScaler's schedule exactly, and the steps
    whose gradients overflow are the ones GradScaler skips."""
    cfg, model = tiny()
    model = model.to(dtype)
    scaling = nvoffload.LossScaling(init_scale=2.0**16, growth_interval=3) if dtype == torch.float16 else None

    def scaler():
        if scaling is None:
            return None
        return torch.amp.GradScaler("cpu", init_scale=scaling.init_scale, growth_interval=scaling.growth_interval)

    torch_loop = TorchLoop(copy.deepcopy(model), 1.0, scaler())
    fp32_sums = MasterLoop(copy.deepcopy(model), 1.0, scaler())  # the G gradients summed in fp32
    model, opt = streamed(tmp_path, model, max_grad_norm=1.0, loss_scaling=scaling)
    G, skipped = 4, 0
    try:
        for step in range(8):
            batches = micro_batches(cfg, step, G)
            norm = torch_loop.step(batches)
            fp32_sums.step(batches)
            vertical_step(opt, batches)
            if math.isfinite(norm):
                assert opt.grad_norm() == pytest.approx(norm, rel=5e-3)  # 16-bit drift: measured up to 1.1e-3
            else:
                assert not math.isfinite(opt.grad_norm())
                skipped += 1
            if scaling is not None:
                assert opt.loss_scale == torch_loop.scaler.get_scale()
        assert (skipped > 0) == (scaling is not None)
        assert {int(s["step"]) for s in opt.state_dict()["state"].values()} == {8 - skipped}
        master = [s["master_param"] for _, s in sorted(opt.state_dict()["state"].items())]

        def distance(a, b):
            return max(float((x.detach() - y.detach()).abs().max()) for x, y in zip(a, b))

        torchs_own = distance(torch_loop.master, fp32_sums.master)
        assert 0 < torchs_own < 0.05
        assert distance(master, torch_loop.master) <= 2 * torchs_own
    finally:
        opt.close()


def test_a_model_that_transforms_its_logits_after_the_output_embeddings_needs_its_own_loss():
    """The default head is the output embeddings: Gemma 2's soft-capped logits are refused, naming the field; without
    it, the hidden states and the head give the model's own logits."""
    transformers = pytest.importorskip("transformers")
    from nvoffload.sft import causal_lm_hidden, causal_lm_logits

    torch.manual_seed(0)
    config = transformers.Gemma2Config(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                       num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                                       final_logit_softcapping=30.0)  # fmt: skip
    model = transformers.Gemma2ForCausalLM(config).eval()
    ids = torch.randint(0, 64, (2, 5))
    with pytest.raises(ValueError, match=r"Gemma2ForCausalLM transforms its logits .*final_logit_softcapping.*own loss"):
        causal_lm_logits(model, causal_lm_hidden(model, ids))
    model.config.final_logit_softcapping = None
    with torch.no_grad():
        torch.testing.assert_close(causal_lm_logits(model, causal_lm_hidden(model, ids)), model(input_ids=ids).logits)
