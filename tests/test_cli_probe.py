"""The command line's boundary: bad ``nvoffload finetune`` command lines are refused with one line, before
anything is created.

A table of bad command lines (sizes, counts, numbers that are nan, inf, negative or huge, strings, missing,
unwritable or file-as-directory paths, damaged model directories, binary, empty or huge texts, devices, dtypes,
flags that conflict), each run through :func:`nvoffload.cli.main` in this process (what ``python -m nvoffload``
calls; a few also as a real subprocess, to show both give the same): exit status 2, exactly one line on stderr,
``nvoffload finetune: error: ...``, naming the flag (or, for what is wrong inside a file, the file), nothing on
stdout (no step ran), and nothing created: no checkpoint directory, no ``--save-to``, no trace, no swap file.
"""

import os

import pytest
from conftest import run_cli

from nvoffload.cli import main
from nvoffload.finetune import max_text_bytes

ROOT = "{root}"  # replaced by the case's directory


def _cases():
    r = ROOT
    sizes = []
    for flag, extra in (("--cpu-memory", []), ("--activation-memory", ["--offload-activations"]),
                        ("--device-memory", ["--stream"])):  # fmt: skip
        for bad in ("infG", "-infM", "nanM", "inf", "1e400", "-1", "0", "0.4", "lots", "", "1.5.5G", "100T"):
            sizes.append((f"{flag}={bad}", [*extra, flag, bad], flag))
    counts = []
    for flag in ("--steps", "--batch-size", "--grad-accum", "--seq-len", "--keep-last", "--save-every"):
        for bad in ("0", "-3", "1.5", "nan", "x"):
            counts.append((f"{flag}={bad}", [flag, bad], flag))
    numbers = []
    for flag in ("--lr", "--max-grad-norm", "--weight-decay"):
        for bad in ("nan", "inf", "-1", "1e400", "x"):
            numbers.append((f"{flag}={bad}", [flag, bad], flag))
    return sizes + counts + numbers + [
        ("lr-zero", ["--lr", "0"], "--lr"),
        ("max-grad-norm-zero", ["--max-grad-norm", "0"], "--max-grad-norm"),
        ("warmup-negative", ["--warmup-steps", "-1"], "--warmup-steps"),
        ("batch-huge", ["--batch-size", "10000000"], "--batch-size"),
        ("batch-huge-offloaded", ["--batch-size", str(10**12), "--offload-activations"], "--batch-size"),
        ("seq-len-past-context", ["--preset", "tiny", "--seq-len", "100000"], "--seq-len"),
        ("seed-huge", ["--seed", str(2**70)], "--seed"),
        ("seed-very-negative", ["--seed", str(-(2**70))], "--seed"),
        ("seed-not-a-number", ["--seed", "x"], "--seed"),
        ("dtype", ["--dtype", "int8"], "--dtype"),
        ("dtype-empty", ["--dtype", ""], "--dtype"),
        ("preset", ["--preset", "huge"], "--preset"),
        ("device-name", ["--device", "gpu0"], "--device"),
        ("device-kind", ["--device", "mps"], "--device"),
        ("device-index", ["--device", "cuda:99"], "--device"),
        ("plan", ["--plan", "manual"], "--plan"),
        ("profile-without-plan", ["--profile", "h100-sxm-512g-4xgen4"], "--profile"),
        ("plan-profile-missing", ["--plan", "auto", "--profile", f"{r}/absent.json"], f"{r}/absent.json"),
        ("text-encoding", ["--text-encoding", "no-such-codec"], "--text-encoding"),
        ("text-missing", ["--text", f"{r}/absent.txt"], f"{r}/absent.txt"),
        ("text-directory", ["--text", f"{r}/notes"], f"{r}/notes"),
        ("text-under-a-file", ["--text", f"{r}/file/t.txt"], f"{r}/file/t.txt"),
        ("text-dev-zero", ["--text", "/dev/zero"], "/dev/zero"),
        ("text-binary", ["--text", f"{r}/binary.bin"], f"{r}/binary.bin"),
        ("text-latin-1", ["--text", f"{r}/latin1.txt"], f"{r}/latin1.txt"),
        ("text-not-ascii", ["--text", f"{r}/utf8.txt", "--text-encoding", "ascii"], f"{r}/utf8.txt"),
        ("text-empty", ["--text", f"{r}/empty.txt"], f"{r}/empty.txt"),
        ("text-huge", ["--text", f"{r}/huge.txt"], f"{r}/huge.txt"),
        ("swap-dir-missing", ["--swap-dir", f"{r}/absent"], f"{r}/absent"),
        ("swap-dir-a-file", ["--swap-dir", f"{r}/file"], f"{r}/file"),
        ("swap-dir-under-a-file", ["--swap-dir", f"{r}/file/swap"], f"{r}/file/swap"),
        ("checkpoint-dir-under-a-file", ["--checkpoint-dir", f"{r}/file/ckpt"], f"{r}/file/ckpt"),
        ("checkpoint-dir-read-only", ["--checkpoint-dir", "/proc/nvoffload-ckpt"], "/proc/nvoffload-ckpt"),
        ("save-to-under-a-file", ["--save-to", f"{r}/file/out.safetensors"], "--save-to"),
        ("save-to-missing-directory", ["--save-to", f"{r}/absent/out.safetensors"], "--save-to"),
        ("save-to-a-directory", ["--save-to", f"{r}/notes"], "--save-to"),
        ("save-to-read-only", ["--save-to", "/proc/out.safetensors"], "--save-to"),
        ("trace-missing-directory", ["--trace", f"{r}/absent/trace.json"], "--trace"),
        ("trace-read-only", ["--trace", "/proc/trace.json"], "--trace"),
        ("trace-a-directory", ["--trace", f"{r}/notes"], "--trace"),
        ("init-from-missing", ["--init-from", f"{r}/absent.safetensors"], "--init-from"),
        ("init-from-garbage", ["--init-from", f"{r}/binary.bin"], f"{r}/binary.bin"),
        ("init-from-another-model", ["--preset", "tiny", "--init-from", f"{r}/small.safetensors"], "--init-from"),
        ("resume-without-checkpoint-dir", ["--resume", "--checkpoint-dir", None], "--resume"),
        ("save-every-without-checkpoint-dir", ["--save-every", "2", "--checkpoint-dir", None], "--save-every"),
        ("model-missing", ["--model", f"{r}/absent"], "--model"),
        ("model-without-config", ["--model", f"{r}/notes"], "--model"),
        ("model-and-preset", ["--model", f"{r}/notes", "--preset", "tiny"], "--model"),
        ("model-and-init-from", ["--model", "{hf}/gpt2", "--init-from", f"{r}/small.safetensors"], "--init-from"),
        ("model-truncated", ["--model", "{hf}/truncated"], "{hf}/truncated/model.safetensors"),
        ("model-truncated-streamed", ["--model", "{hf}/truncated", "--stream"], "{hf}/truncated/model.safetensors"),
        ("model-bad-header", ["--model", "{hf}/bad-header"], "{hf}/bad-header/model.safetensors"),
        ("model-bad-header-streamed", ["--model", "{hf}/bad-header", "--stream"], "{hf}/bad-header/model.safetensors"),
        ("model-no-weights", ["--model", "{hf}/no-weights"], "{hf}/no-weights"),
        ("model-seq-len-past-context", ["--model", "{hf}/gpt2", "--seq-len", "100000"], "--seq-len"),
        ("unknown-flag", ["--batchsize", "8"], "--batchsize"),
    ]  # fmt: skip


CASES = _cases()


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """The files the table names: texts, a file where a directory is wanted, checkpoints, damaged model directories."""
    from nvoffload.checkpoint import save_file
    from nvoffload.models import GPT, GPTConfig

    root = tmp_path_factory.mktemp("probe")
    (root / "file").write_text("x")
    (root / "notes").mkdir()
    (root / "binary.bin").write_bytes(bytes(range(256)) * 64)
    (root / "latin1.txt").write_bytes("the café is open. ".encode("latin-1") * 20)
    (root / "utf8.txt").write_text("the café is open. " * 20, encoding="utf-8")
    (root / "empty.txt").write_bytes(b"")
    with open(root / "huge.txt", "wb") as f:  # sparse: no disk space taken
        f.truncate(max_text_bytes() + 1)
    save_file(GPT(GPTConfig.preset("small")).state_dict(), root / "small.safetensors")
    hf = root / "hf"
    hf.mkdir()
    _hf_dirs(hf)
    return root, hf


def _hf_dirs(hf):
    """A tiny GPT-2 directory, and copies of it with the weights truncated, with a damaged header, and without them."""
    import shutil

    transformers = pytest.importorskip("transformers")
    from nvoffload.pretrained import save_pretrained

    config = transformers.GPT2Config(n_embd=32, n_layer=2, n_head=4, n_positions=64, vocab_size=300,
                                     bos_token_id=0, eos_token_id=0)
    save_pretrained(transformers.AutoModelForCausalLM.from_config(config), hf / "gpt2")
    for name in ("truncated", "bad-header", "no-weights"):
        shutil.copytree(hf / "gpt2", hf / name)
    weights = hf / "truncated" / "model.safetensors"
    os.truncate(weights, os.path.getsize(weights) // 2)
    with open(hf / "bad-header" / "model.safetensors", "r+b") as f:
        f.seek(8)
        f.write(b"#not json")
    os.remove(hf / "no-weights" / "model.safetensors")


def _argv(args, root, hf):
    """``finetune`` with the table's arguments after defaults that would be created if the run started: a swap
    directory (empty), a checkpoint directory (absent); None drops a default."""
    base = {"--steps": "1", "--swap-dir": str(root / "swap"), "--checkpoint-dir": str(root / "ckpt")}
    rest = []
    for i, a in enumerate(args):
        if i > 0 and args[i - 1] in base:
            continue
        if a in base:
            base[a] = args[i + 1]
        else:
            rest.append(a)
    argv = ["finetune", "--no-progress"]
    for flag, value in base.items():
        if value is not None:
            argv += [flag, value]
    return [a.replace(ROOT, str(root)).replace("{hf}", str(hf)) for a in argv + rest]


def _tree(root) -> set[str]:
    return {os.path.join(d, n) for d, dirs, names in os.walk(root) for n in dirs + names}


def _refusal(argv, capsys) -> tuple[int, str, str]:
    try:
        rc = main(argv)
    except SystemExit as exc:  # argparse
        rc = exc.code
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


def test_every_bad_command_line_is_one_line_exit_2_and_creates_nothing(files, tmp_path, monkeypatch, capsys):
    root, hf = files
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # the default swap directory would go there
    (root / "swap").mkdir(exist_ok=True)
    before = _tree(root)
    bad = []
    for name, args, named in CASES:
        argv = _argv(args, root, hf)
        rc, out, err = _refusal(argv, capsys)
        named = named.replace(ROOT, str(root)).replace("{hf}", str(hf))
        ok = (
            rc == 2 and out == "" and err.count("\n") == 1 and err.endswith("\n")
            and err.startswith("nvoffload finetune: error: ") and named in err
        )  # fmt: skip
        if not ok:
            bad.append(f"{name}: rc {rc}, stdout {out[-200:]!r}, stderr {err[-600:]!r}")
        created = _tree(root) - before
        if created or os.listdir(tmp_path):
            bad.append(f"{name}: created {sorted(created)} {os.listdir(tmp_path)}")
            before = _tree(root)
    assert len(CASES) >= 90
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize(
    "args,named",
    [(["--cpu-memory", "infG"], "--cpu-memory"), (["--seed", str(2**70)], "--seed"), (["--text", "/dev/zero"], "/dev/zero")],
    ids=["cpu-memory-inf", "seed-huge", "text-dev-zero"],
)  # fmt: skip
def test_python_m_nvoffload_refuses_as_main_does(tmp_path, args, named):
    """The same refusals from a real ``python -m nvoffload finetune``: one line, exit 2, nothing created."""
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache")}
    (tmp_path / "swap").mkdir()
    argv = ["finetune", "--no-progress", "--swap-dir", str(tmp_path / "swap"), "--checkpoint-dir", str(tmp_path / "ckpt"), *args]
    done = run_cli(argv, env=env, timeout=120)  # forked from a server that imported torch once
    assert done.returncode == 2 and done.stdout == "", done
    assert done.stderr.startswith("nvoffload finetune: error: ") and done.stderr.count("\n") == 1 and named in done.stderr
    assert os.listdir(tmp_path) == ["swap"] and os.listdir(tmp_path / "swap") == []


@pytest.mark.parametrize(
    "args,said",
    [
        (["--stream", "--cpu-memory", "1M"], r"--cpu-memory must be at least \d+(\.\d+)?M: "),
        (["--stream", "--device-memory", "64K"], r"--device-memory must be at least \d+(\.\d+)?[KM] \(resident "),
        (["--cpu-memory", "100T"], r"--cpu-memory 100T is more than this machine's memory, \d+(\.\d+)?[GT]\n$"),
        (["--offload-activations", "--activation-host-memory", "100T"],
         r"--activation-host-memory 100T is more than this machine's memory, \d+(\.\d+)?[GT]\n$"),
    ],
    ids=["cpu-memory-below-streaming", "device-memory-below-streaming", "cpu-memory-above-the-machine",
         "activation-host-memory-above-the-machine"],
)  # fmt: skip
def test_a_budget_refused_is_named_by_its_flag_with_a_size_it_takes(tmp_path, capsys, args, said):
    """A budget too small or too large is said as the command line writes it (``--cpu-memory must be at least
    163M``): it said ``cpu_memory_bytes must be at least 170917888 (163 MiB)``, or raw bytes after the flag."""
    import re

    (tmp_path / "swap").mkdir()
    rc, out, err = _refusal(["finetune", "--preset", "tiny", "--steps", "1", "--no-progress", "--swap-dir",
                             str(tmp_path / "swap"), *args], capsys)  # fmt: skip
    assert rc == 2 and err.count("\n") == 1 and re.search(said, err), err
    assert not re.search(r"_bytes|MiB|GiB", err), err  # no field name, no size but as the flags take it


PLAN_CASES = [
    ("batch-size", ["--batch-size", "0"], "--batch-size"),
    ("grad-accum", ["--grad-accum", "0"], "--grad-accum"),
    ("seq-len", ["--seq-len", "0"], "--seq-len"),
    ("swap-dirs", ["--swap-dirs", "0"], "--swap-dirs"),
    ("ranks", ["--ranks", "0"], "--ranks"),
    ("cpu-memory", ["--cpu-memory", "lots"], "--cpu-memory"),
    ("sizes", ["--sizes", "1,2"], "--sizes"),
    ("dtype", ["--dtype", "int8"], "--dtype"),
    ("unknown-flag", ["--batchsize", "8"], "--batchsize"),
    ("profile-missing", ["--profile", "{root}/absent.json"], "{root}/absent.json"),
    ("model-missing", ["--model", "{root}/absent"], "{root}/absent"),
]


@pytest.mark.parametrize("args,named", [c[1:] for c in PLAN_CASES], ids=[c[0] for c in PLAN_CASES])
def test_a_bad_plan_command_line_is_one_line_naming_the_flag(tmp_path, capsys, args, named):
    args = [a.replace(ROOT, str(tmp_path)) for a in args]
    profile = [] if "--profile" in args else ["--profile", "h100-sxm-512g-4xgen4"]
    rc, out, err = _refusal(["plan", *profile, *args], capsys)
    assert rc == 2 and out == "" and err.count("\n") == 1 and err.startswith("nvoffload plan: error: "), err
    assert named.replace(ROOT, str(tmp_path)) in err and "_" not in err.replace(str(tmp_path), ""), err
