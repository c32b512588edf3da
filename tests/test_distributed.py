"""Data parallel training over torch.distributed ranks (gloo, CPU), launched with torchrun as users launch it
(``nvoffload finetune``) or as torchrun starts them (plain processes given its environment variables).

Each run is ``tests/dist_worker.py``: a small GPT trained 10 steps with clipping (every step clips) and two
micro-batches per step, by one process on the whole batches (in the tests' own process) or by N ranks each on
its part of every batch.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import ForkedRun, fork_server

WORKER = Path(__file__).with_name("dist_worker.py")
MODES = ["optimizer", "streaming"]


def torchrun(ranks: int, log_dir: Path) -> list[str]:
    """torchrun with its logs under ``log_dir`` (by default it leaves a ``/tmp/torchelastic_*`` directory
    behind for each run)."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}", "--log-dir", str(log_dir)]


class Run:
    """A run of ``tests/dist_worker.py`` by ``ranks`` processes, started at once: plain processes as torchrun
    starts them (:func:`launch`), without torchrun's seconds of start-up; :meth:`results` waits for them. One
    rank runs in :meth:`results`, in this process (:func:`in_process`)."""

    def __init__(self, mode: str, out: Path, swap_root: Path, ranks: int, *args: str):
        self.argv = [mode, str(out), str(swap_root), *args]
        self.out, self.ranks = out, ranks
        out.mkdir(parents=True, exist_ok=True)
        self.procs = launch(ranks, out, *self.argv) if ranks > 1 else []

    def results(self, timeout_s: float = 300) -> list[dict]:
        """Each rank's results, once every rank exited 0: at most ``timeout_s``; a rank that fails stops the
        others (as torchrun does)."""
        if not self.procs:
            in_process(self.argv)
        else:
            deadline = time.monotonic() + timeout_s
            try:
                while any(p.poll() is None for p in self.procs) and all(p.poll() in (None, 0) for p in self.procs):
                    assert time.monotonic() < deadline, f"the ranks ran over {timeout_s} s"
                    time.sleep(0.05)
            finally:
                for p in self.procs:
                    p.kill()
                    p.wait()
            logs = "".join((self.out / f"rank{r}.log").read_text()[-4000:] for r in range(self.ranks))
            assert all(p.returncode == 0 for p in self.procs), ([p.returncode for p in self.procs], logs)
        return [torch.load(self.out / f"rank{r}.pt", weights_only=True) for r in range(self.ranks)]


def in_process(argv: list[str]) -> None:
    """``tests/dist_worker.py`` alone, in this process (not seconds of imports in another): one thread, as
    the ranks run, and this process's RNG left as it was."""
    import dist_worker

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.random.fork_rng():
            dist_worker.main(argv)
    finally:
        torch.set_num_threads(threads)


def run(mode: str, out: Path, swap_root: Path, ranks: int, *args: str) -> list[dict]:
    """Train with ``ranks`` processes (1: in this process); each rank's results."""
    return Run(mode, out, swap_root, ranks, *args).results()


def alone_and_two_ranks(mode: str, root: Path, *args: str, rank_args: tuple[str, ...] = ()) -> tuple[dict, list[dict]]:
    """The same run by one process on the whole batches (in this process) and, meanwhile, by 2 ranks (with
    ``rank_args`` too): the one process's results and the ranks'."""
    two = Run(mode, root / "two", root / "swap-two", 2, *args, *rank_args)
    try:
        one = run(mode, root / "one", root / "swap-one", 1, *args)[0]
    finally:
        ranks = two.results()
    return one, ranks


def relative_difference(a: dict, b: dict) -> float:
    """|a - b| / |b| over all the model's parameters as one vector."""
    num = math.fsum(float((a[k] - b[k]).double().norm()) ** 2 for k in b)
    return math.sqrt(num / math.fsum(float(v.double().norm()) ** 2 for v in b.values()))


def assert_trained_alike(got: dict, expected: dict, rel: float = 1e-6, per_tensor: float = 1e-4) -> None:
    """Parameters equal up to fp32 sums in another order (half batches): ``rel`` over all of them as one
    vector, ``per_tensor`` per tensor. Plain torch AdamW (fused) on the mean of two half batches' gradients
    ends this run 2.6e-7 to 3.2e-7 from the whole batches' (per tensor: 1.5e-5 to 1.7e-5, a zero-initialized
    bias); without clipping 1.2e-6 (per tensor 1.2e-4)."""
    assert relative_difference(got, expected) < rel
    for name, value in expected.items():
        assert float((got[name] - value).norm() / value.norm()) < per_tensor, name


@pytest.fixture(scope="module", params=MODES)
def trained(request, tmp_path_factory):
    """One process on the whole batches, and 2 ranks."""
    mode = request.param
    root = tmp_path_factory.mktemp(mode)
    one, two = alone_and_two_ranks(mode, root)
    return mode, root, one, two


@pytest.fixture(scope="module")
def saved(trained):
    """The 2 ranks' run again, saving a training checkpoint after step 5."""
    mode, root, _, two = trained
    again = run(mode, root / "saved", root / "swap-saved", 2, "--ckpt", str(root / "ckpt"), "--save-at", "5")
    for name, value in two[0]["weights"].items():  # saving changes nothing
        assert torch.equal(again[0]["weights"][name], value), name
    return root / "ckpt"


def test_two_ranks_train_as_one_process_on_the_whole_batches(trained):
    mode, _, one, two = trained
    for rank in two:  # every rank holds the same model
        for name, value in two[0]["weights"].items():
            assert torch.equal(rank["weights"][name], value), name
    assert_trained_alike(two[0]["weights"], one["weights"])
    # state_dict() gathers the shards: the moments of one process, on every rank
    for idx, st in one["state"]["state"].items():
        for key in ("exp_avg", "exp_avg_sq"):
            for rank in two:
                torch.testing.assert_close(rank["state"]["state"][idx][key], st[key], rtol=1e-3, atol=1e-8)
        assert all(int(rank["state"]["state"][idx]["step"]) == 10 for rank in two)
    # each rank's loss is of its half of the batch: their mean is the one process's loss
    losses = [sum(pair) / 2 for pair in zip(two[0]["losses"], two[1]["losses"])]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(one["losses"]), rtol=1e-5, atol=0)


def test_each_rank_moves_half_of_the_optimizer_nvme_bytes(trained):
    _, _, one, two = trained
    for counter in ("read_bytes", "written_bytes"):
        assert sum(rank[counter] for rank in two) == one[counter] > 0
        for rank in two:  # equal shares, cut on 4 KiB of fp32 elements
            assert abs(rank[counter] - one[counter] / 2) <= 0.01 * one[counter], (counter, rank[counter], one[counter])


@pytest.mark.parametrize("ranks", [1, 3])
def test_a_checkpoint_of_two_ranks_resumes_on_another_number_of_ranks(trained, saved, ranks):
    mode, root, _, two = trained
    resumed = run(mode, root / f"resumed{ranks}", root / f"swap-resumed{ranks}", ranks, "--ckpt", str(saved), "--resume")
    assert len(resumed[0]["losses"]) == 5  # steps 6 to 10
    # the global batch's loss (the ranks' mean: equal parts) of each step goes on as before
    mean = [torch.stack([torch.tensor(r["losses"][-5:]) for r in run_]).mean(0) for run_ in (resumed, two)]
    torch.testing.assert_close(mean[0], mean[1], rtol=1e-5, atol=0)
    assert_trained_alike(resumed[0]["weights"], two[0]["weights"])


@pytest.mark.parametrize("trained", ["optimizer"], indirect=True)
def test_one_ranks_damaged_piece_makes_every_rank_resume_from_the_checkpoint_before(trained, saved, tmp_path):
    """The latest checkpoint's optimizer state fails its checksum in rank 1's piece only: rank 0 hears of it from
    rank 1, the ranks agree to skip it, and both resume from the one before, as a resume from it does."""
    import shutil

    mode, _, _, two = trained
    ckpt = tmp_path / "ckpt"
    shutil.copytree(saved / "checkpoint-5", ckpt / "checkpoint-5")
    shutil.copytree(saved / "checkpoint-5", ckpt / "checkpoint-6")
    piece = ckpt / "checkpoint-6" / "optimizer-rank00001-of-00002.safetensors"
    with open(piece, "r+b") as f:
        f.seek(piece.stat().st_size - 100)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x01]))
    resumed = run(mode, tmp_path / "out", tmp_path / "swap", 2, "--ckpt", str(ckpt), "--resume")
    assert [len(r["losses"]) for r in resumed] == [5, 5]  # steps 6 to 10: from checkpoint-5
    for rank, expected in zip(resumed, two):
        assert rank["losses"] == expected["losses"][-5:]
        assert all(torch.equal(rank["weights"][k], v) for k, v in expected["weights"].items())


# TORCH_GLOO_EXIT: a process that exits right after a gloo collective (here: just after the ranks agreed on an
# error) can abort (SIGABRT, "terminate called without an active exception") instead of exiting 1: gloo's
# thread releases the finished collective during interpreter finalization, takes the GIL, and is ended inside
# a C++ destructor (torch 2.13; gdb on a core dump). Plain torch does it in 6 of 30 such exits; under
# nvoffload about 1 in 40, as torch._dynamo, imported by the first optimizer, keeps the group alive past
# destroy_process_group(). Importing it first lets the group be destroyed, but then its destructor can
# deadlock with that same thread (seen with DDP), so the tests accept either non-zero status.


# The ranks' processes are forked from one server that imported torch and nvoffload once (seconds a rank
# otherwise); not torch._dynamo, which each rank imports after joining its group (dist_worker, TORCH_GLOO_EXIT).
RANK_PRELOAD = "import torch, torch.distributed, nvoffload.optim, nvoffload.training"


def launch(ranks: int, logs: Path, *args: str) -> list[ForkedRun]:
    """The ranks as plain processes (no torchrun, which would stop the others when one dies): what each
    does about a rank that died or hangs is then its own. Rank ``r`` writes ``logs / f"rank{r}.log"``."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).parents[1]),
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": str(ranks)}  # fmt: skip
    server = fork_server(RANK_PRELOAD, OMP_NUM_THREADS="1", PYTHONPATH=env["PYTHONPATH"])
    return [
        server.start(str(WORKER), args, log, log, env={**env, "RANK": str(r), "LOCAL_RANK": str(r)})
        for r, log in enumerate(logs / f"rank{r}.log" for r in range(ranks))
    ]


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("stall", [False, True], ids=["dies", "hangs"])
def test_a_rank_that_dies_or_hangs_stops_the_others_with_a_message(tmp_path, mode, stall):
    procs = launch(2, tmp_path, mode, str(tmp_path / "out"), str(tmp_path / "swap"), "--timeout", "4",
                   "--fail-rank", "1", *(["--stall"] if stall else []))  # fmt: skip
    try:
        procs[0].wait(timeout=120)  # rank 0 must not wait for ever
    finally:
        for p in procs:
            p.kill()
            p.wait()
    out = (tmp_path / "rank0.log").read_text()
    assert procs[0].returncode != 0, out[-3000:]  # 1, or SIGABRT from gloo at exit (TORCH_GLOO_EXIT below)
    assert "RankTimeoutError" in out and "rank 0 of 2 waited in vain" in out, out[-3000:]
    assert not any(os.scandir(tmp_path / "swap" / "rank0")), "rank 0 left swap files"


def test_a_rank_without_its_swap_directory_stops_every_rank(tmp_path):
    procs = launch(2, tmp_path, "optimizer", str(tmp_path / "out"), str(tmp_path / "swap"), "--missing-swap-rank", "1")
    for p in procs:
        p.wait(timeout=120)
    outs = [(tmp_path / f"rank{r}.log").read_text() for r in range(2)]
    assert all(p.returncode != 0 for p in procs), (procs[0].returncode, procs[1].returncode)  # see TORCH_GLOO_EXIT
    assert "FileNotFoundError" in outs[1] and "does not exist" in outs[1], outs[1][-3000:]
    assert "opening the swap directories failed on another rank (rank 1: FileNotFoundError" in outs[0], outs[0][-3000:]


def test_a_model_wrapped_in_ddp_is_refused(tmp_path):
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    import nvoffload
    from nvoffload.models import GPT, GPTConfig

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/rendezvous", rank=0, world_size=1)
    try:
        model = DistributedDataParallel(GPT(GPTConfig.preset("tiny")))
        config = nvoffload.OffloadConfig(swap_dirs=[tmp_path])
        with pytest.raises(ValueError, match="wrapped in DistributedDataParallel.*pass the unwrapped model"):
            nvoffload.initialize(model, torch.optim.AdamW(model.parameters()), config)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("stream", [False, True], ids=["optimizer", "streaming"])
def test_finetune_under_torchrun_trains_as_one_process(tmp_path, stream):
    from nvoffload.checkpoint import load_file

    args = ["finetune", "--steps", "3", "--batch-size", "4", "--grad-accum", "2", "--max-grad-norm", "0.05",
            "--no-progress", *(["--stream"] if stream else [])]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).parents[1])}
    procs = {}  # one process and torchrun's 2 ranks, at once
    for ranks in (1, 2):
        swap = tmp_path / f"swap{ranks}"
        swap.mkdir()
        launcher = [sys.executable] if ranks == 1 else torchrun(ranks, tmp_path / "torchrun")
        procs[ranks] = subprocess.Popen(
            [*launcher, "-m", "nvoffload", *args, "--swap-dir", str(swap), "--save-to", str(tmp_path / f"{ranks}.safetensors")],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
        )  # fmt: skip
    weights, outputs = {}, {}
    try:
        for ranks, proc in procs.items():
            stdout, stderr = proc.communicate(timeout=300)
            assert proc.returncode == 0, stdout[-3000:] + stderr[-3000:]
            weights[ranks] = load_file(tmp_path / f"{ranks}.safetensors")
            outputs[ranks] = [line for line in stdout.splitlines() if line.startswith("step ")]
    finally:
        for proc in procs.values():
            proc.kill()
            proc.wait()
    swap = tmp_path / "swap2"  # each rank in its own subdirectory, left empty
    assert sorted(p.name for p in swap.iterdir()) == ["rank0", "rank1"]
    assert not any(os.scandir(swap / "rank0")) and not any(os.scandir(swap / "rank1"))
    assert len(outputs[2]) == 3  # rank 0 reports, once per step
    losses = [[float(line.split("loss ")[1].split()[0]) for line in outputs[r]] for r in (1, 2)]
    assert losses[0] == losses[1]  # the global batch's loss, to the 3 decimals printed
    assert_trained_alike(weights[2], weights[1])


def test_a_checkpoint_missing_a_piece_of_a_tensor_is_refused(trained, saved, tmp_path):
    """A manifest edited (consistently: its checksums redone) so that one tensor lacks rank 1's piece."""
    import json
    import shutil

    from nvoffload.checkpoint import CheckpointError
    from nvoffload.training_checkpoint import MANIFEST, STATE_FILE, _file_crc32c

    mode, *_ = trained
    ckpt = tmp_path / "ckpt" / "checkpoint-5"
    shutil.copytree(saved / "checkpoint-5", ckpt)
    state = torch.load(ckpt / STATE_FILE, weights_only=True)
    entry = next(v for st in state["optimizer"]["state"].values() for v in st.values()
                 if isinstance(v, dict) and len(v.get("__pieces__", [])) == 2)  # fmt: skip
    entry["__pieces__"] = entry["__pieces__"][:1]
    torch.save(state, ckpt / STATE_FILE)
    manifest = json.loads((ckpt / MANIFEST).read_text())
    manifest["files"][STATE_FILE] = (ckpt / STATE_FILE).stat().st_size
    manifest["trainer_state_crc32c"] = _file_crc32c(str(ckpt / STATE_FILE))
    (ckpt / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match="are not all in the pieces the ranks saved"):
        in_process([mode, str(tmp_path / "out"), str(tmp_path / "swap"), "--ckpt", str(ckpt.parent), "--resume"])


@pytest.mark.parametrize("trained", ["optimizer"], indirect=True)  # streaming releases them during backward
def test_held_gradients_are_averaged_during_the_last_backward(trained):
    """From the second step on (the first learns the micro-batches and the gradients' order), ``.grad`` is the
    global batch's mean on every rank when the last micro-batch's ``backward()`` returns, before ``step()``."""
    _, _, one, two = trained
    first, second = two[0]["grad_sums"], two[1]["grad_sums"]
    assert first[0] != second[0]  # the first step averages in step(): each rank's own gradients before it
    assert first[1:] == second[1:]
    # and that mean is the one process's gradient (of the same weights at step 2)
    assert abs(first[1] - one["grad_sums"][1]) <= 1e-5 * abs(one["grad_sums"][1])


@pytest.mark.parametrize("case", ["no-clip", "accums"])
def test_held_gradients_with_updates_in_backward_or_changing_micro_batches(tmp_path, case):
    """Without clipping the updates run during backward from each averaged bucket, as in one process; with
    2, 3, then 1 micro-batches per step, a step with more than the last one's averages again in step() and one
    with fewer completes the average there: both train as one process does."""
    args = ["--no-clip"] if case == "no-clip" else ["--accums", "2,3,1", "--steps", "6"]
    one, two = alone_and_two_ranks("optimizer", tmp_path, *args)
    for rank in two:
        for name, value in two[0]["weights"].items():
            assert torch.equal(rank["weights"][name], value), name
    assert_trained_alike(two[0]["weights"], one["weights"], *((2e-6, 4e-4) if case == "no-clip" else ()))
    if case == "no-clip":  # queued during backward from the second step on, on both ranks as in one process
        assert one["queued"] == two[0]["queued"] == two[1]["queued"] == [False] + [True] * 9
