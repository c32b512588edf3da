"""What a machine's engines can do: a :class:`MachineProfile`, measured (:mod:`nvoffload.planner.calibrate`) or
built in for common GPU servers, saved as JSON.

Every rate is one engine alone, as nvoffload drives it: the device's throughput on a transformer block's
forward and backward (by model width), host<->device copies, each swap directory's reads and writes (and all
of them at once), the CPU Adam kernel, and the link between GPUs for collectives. The planner
(:mod:`nvoffload.planner.cost`) combines them.

A profile is what one training process (one rank, one GPU) has. On a machine with several GPUs, each
training as a rank of :mod:`nvoffload.distributed`, that is its share: its GPU, its own swap directories
(drives), and the machine's host memory, cores and CPU Adam throughput divided between the GPUs (as the
built-in multi-GPU profiles are; :mod:`~nvoffload.planner.calibrate` measures the whole host as one process
sees it).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, field

from nvoffload.core.atomic import replace_file

__all__ = ["BUILTIN_PROFILES", "Drive", "MachineProfile", "builtin_profile", "load_profile"]

_GB = 1e9


@dataclass(frozen=True)
class Drive:
    """Sequential bandwidth of one swap directory (or of several at once), GB/s (1e9 bytes)."""

    read_gbps: float
    write_gbps: float

    def __post_init__(self):
        for name in ("read_gbps", "write_gbps"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0 or not math.isfinite(value):
                raise ValueError(f"Drive.{name} must be a positive number of GB/s, got {value!r}")


@dataclass(frozen=True)
class MachineProfile:
    """One machine, as the planner sees it.

    Attributes:
        name: what it is (e.g. ``"1x H100 SXM + 4x Gen4 NVMe"``, or the host measured).
        device: ``"cuda"`` or ``"cpu"`` (the CPU standing in for the GPU: compute shares the host's cores
            with the Adam kernel and the I/O threads).
        device_name: the GPU's name (or the CPU's).
        device_memory_bytes, host_memory_bytes: free memory of each tier.
        block_tflops: ``((d_model, matrices TFLOP/s, attention TFLOP/s, overhead s), ...)``: one transformer
            block's forward and backward at that width, split in three (from four shapes): its matrices
            (6 FLOPs per parameter per token, with the block's norms and activations counted in their time),
            its attention (12 * seq * d_model FLOPs per token) and a fixed time per pass (launching its
            operations, whatever the batch; at least what a pass of one short sequence leaves beside the
            rates); widths between are interpolated, beyond are clamped.
        matmul_tflops: a large matmul's throughput in the training dtype (the device's dense peak, as
            reached); for reference.
        h2d_gbps, d2h_gbps: copies between page-locked host memory and the device.
        drives: each swap directory alone.
        drives_together: all of ``drives`` at once (striped, as the store writes).
        adam_params_per_s: the CPU Adam kernel's updates per second with fp32 and with bf16 gradients
            (``{"float32": ..., "bfloat16": ...}``), all cores (of the rank's share).
        cpu_cores: the host's cores (the rank's share).
        source: how the figures were obtained (measured where and when, or the public sources).
        interconnect_gbps: each GPU's bandwidth for collectives with the others, GB/s, as NCCL reports it (bus
            bandwidth: a ring collective moving ``x`` bytes per rank takes ``x / interconnect_gbps``): NVLink
            where the GPUs have it, else PCIe. None (a profile saved before this field, or from ``calibrate``,
            which measures one process) becomes the host link, ``min(h2d_gbps, d2h_gbps)``: what collectives
            between GPUs without NVLink run over.
        compute_with_io, io_with_compute: the fraction of its speed alone that the device's compute keeps
            while the store streams at full speed, and the store's while compute runs
            (:mod:`nvoffload.planner.contention`, which the planner applies to every stretch of compute beside
            I/O). ``calibrate`` measures them; on a GPU server (the built-in profiles) the kernels do not run
            on the host's cores and both are 1, so compute and I/O overlap for free; with the CPU standing in
            for the GPU they share the cores (on a VM, with the disk emulation too), and both are below 1.
        optimizer_tensor_s: the NVMe optimizer's fixed time per parameter tensor a step, besides its bytes and
            its Adam work (the tensor's requests to the store and the worker thread's hand-offs: what makes a model
            of many small tensors slower than its bytes say). ``calibrate`` measures it (steps over 16 and 64
            tiny tensors); 0 in the built-in profiles and in profiles saved before the field (not measured).
        saved_tensor_s: activation offload's fixed time per saved tensor a step, there and back, besides its bytes
            (its pack and unpack on the training thread, the store's write and read requests, the transfer engine's
            hand-offs: what makes many small activations slower than their bytes say). ``calibrate`` measures it
            (forward and backward over 32 and 128 small saved tensors through
            :class:`~nvoffload.activations.offload_activations`); 0 in the built-in profiles and in profiles saved
            before the field (not measured).
        crc32c_gbps: one thread's CRC-32C rate, GB/s (the store's checksums, computed by each I/O thread over the
            blocks it moves: the planner counts ``min(IOConfig.num_threads, cpu_cores)`` of them). ``calibrate``
            measures it; 15 in the built-in profiles (SSE4.2's crc32 on three streams: ``bench/results/bench_io.md``)
            and in profiles saved before the field.
        busy: how busy the machine was while ``calibrate`` timed its compute, when others' work kept it waiting for
            the cores (:func:`~nvoffload.planner.calibrate.busy_machine`: the CPU time a thread got a second, the
            load average); ``""`` when it was quiet, and in the built-in profiles. Compute on the host is then timed
            by one thread's CPU time, not the clock (:class:`~nvoffload.planner.calibrate.Clock`: at most the threads'
            count slower than the machine alone), but the drives, copies and contention as that load slowed them:
            ``plan`` says so in a note.
    """

    name: str
    device: str
    device_name: str
    device_memory_bytes: int
    host_memory_bytes: int
    block_tflops: tuple[tuple[int, float, float, float], ...]
    matmul_tflops: float
    h2d_gbps: float
    d2h_gbps: float
    drives: tuple[Drive, ...]
    drives_together: Drive
    adam_params_per_s: dict[str, float] = field(default_factory=dict)
    cpu_cores: int = 1
    source: str = ""
    interconnect_gbps: float | None = None
    compute_with_io: float = 1.0
    io_with_compute: float = 1.0
    optimizer_tensor_s: float = 0.0
    saved_tensor_s: float = 0.0
    crc32c_gbps: float = 15.0
    busy: str = ""

    def __post_init__(self):
        if self.device not in ("cuda", "cpu"):
            raise ValueError(f"MachineProfile.device must be 'cuda' or 'cpu', got {self.device!r}")
        for name in ("device_memory_bytes", "host_memory_bytes", "cpu_cores"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"MachineProfile.{name} must be a positive int, got {value!r}")
        for name in ("matmul_tflops", "h2d_gbps", "d2h_gbps"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and value > 0 and math.isfinite(value)):
                raise ValueError(f"MachineProfile.{name} must be positive, got {value!r}")
        object.__setattr__(self, "block_tflops", tuple(sorted((int(w), float(m), float(a), float(o)) for w, m, a, o in self.block_tflops)))
        if not self.block_tflops or any(min(m, a) <= 0 or o < 0 for _, m, a, o in self.block_tflops):
            raise ValueError("MachineProfile.block_tflops needs at least one (d_model, matrices, attention TFLOP/s, overhead s)")
        object.__setattr__(self, "drives", tuple(d if isinstance(d, Drive) else Drive(**d) for d in self.drives))
        if not self.drives:
            raise ValueError("MachineProfile.drives needs at least one drive")
        if not isinstance(self.drives_together, Drive):
            object.__setattr__(self, "drives_together", Drive(**self.drives_together))
        if set(self.adam_params_per_s) != {"float32", "bfloat16"} or min(self.adam_params_per_s.values()) <= 0:
            raise ValueError(f"MachineProfile.adam_params_per_s needs positive float32 and bfloat16 rates, got {self.adam_params_per_s}")
        if self.interconnect_gbps is None:
            object.__setattr__(self, "interconnect_gbps", min(self.h2d_gbps, self.d2h_gbps))
        value = self.interconnect_gbps
        if isinstance(value, bool) or not (isinstance(value, (int, float)) and value > 0 and math.isfinite(value)):
            raise ValueError(f"MachineProfile.interconnect_gbps must be a positive number of GB/s, got {value!r}")
        for name in ("compute_with_io", "io_with_compute"):
            value = getattr(self, name)
            if isinstance(value, bool) or not (isinstance(value, (int, float)) and 0 < value <= 1):
                raise ValueError(f"MachineProfile.{name} must be a fraction in (0, 1], got {value!r}")
        for name in ("optimizer_tensor_s", "saved_tensor_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not (isinstance(value, (int, float)) and value >= 0 and math.isfinite(value)):
                raise ValueError(f"MachineProfile.{name} must be a non-negative number of seconds, got {value!r}")
        value = self.crc32c_gbps
        if isinstance(value, bool) or not (isinstance(value, (int, float)) and value > 0 and math.isfinite(value)):
            raise ValueError(f"MachineProfile.crc32c_gbps must be a positive number of GB/s, got {value!r}")
        if not isinstance(self.busy, str):
            raise ValueError(f"MachineProfile.busy must be a description (a str; '' when quiet), got {self.busy!r}")

    def block_rates(self, d_model: int) -> tuple[float, float, float]:
        """A block's matrices FLOP/s, attention FLOP/s and fixed seconds per pass at width ``d_model``
        (log-linear between the measured widths, clamped beyond)."""
        points = self.block_tflops
        if d_model <= points[0][0]:
            w, m, a, o = points[0]
        elif d_model >= points[-1][0]:
            w, m, a, o = points[-1]
        else:
            (w0, *low), (w1, *high) = next((p, q) for p, q in zip(points, points[1:]) if p[0] <= d_model <= q[0])
            f = math.log(d_model / w0) / math.log(w1 / w0)
            m, a, o = (math.exp(math.log(max(x0, 1e-12)) + f * (math.log(max(x1, 1e-12)) - math.log(max(x0, 1e-12))))
                       for x0, x1 in zip(low, high))  # fmt: skip
        return m * 1e12, a * 1e12, o

    def nvme(self, directories: int) -> Drive:
        """The bandwidth of the first ``directories`` swap directories at once."""
        if directories >= len(self.drives):
            return self.drives_together
        share = directories / len(self.drives)
        return Drive(self.drives_together.read_gbps * share, self.drives_together.write_gbps * share)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1) + "\n"

    def save(self, path: str | os.PathLike) -> None:
        """Write the profile as JSON (atomically)."""
        path = os.fspath(path)
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with replace_file(path, "w", encoding="utf-8") as f:
            f.write(self.to_json())


def load_profile(name_or_path: str) -> MachineProfile:
    """A built-in profile by name (see :data:`BUILTIN_PROFILES`), or a JSON file that ``calibrate`` wrote."""
    if name_or_path in BUILTIN_PROFILES:
        return BUILTIN_PROFILES[name_or_path]
    try:
        with open(name_or_path, encoding="utf-8") as f:
            raw = json.load(f)
    except FileNotFoundError:
        raise FileNotFoundError(
            f"no profile {name_or_path!r}: give a JSON file from 'nvoffload calibrate' or one of"
            f" {', '.join(sorted(BUILTIN_PROFILES))}"
        ) from None
    except ValueError as exc:
        raise ValueError(f"{name_or_path} is not a profile: {exc}") from None
    try:
        return MachineProfile(**raw)
    except TypeError as exc:
        raise ValueError(f"{name_or_path} is not a profile: {exc}") from None


# -- built-in profiles --------------------------------------------------------------
#
# GPUs: dense (non-sparse) BF16 tensor throughput with FP32 accumulation, from the vendors' datasheets:
#   H100 SXM5 989 TFLOPS, H100 PCIe 756, H200 SXM 989 (NVIDIA H100 and H200 datasheets, 2023-2024);
#   A100 80GB 312 (NVIDIA A100 datasheet); RTX 4090 165.2 (NVIDIA Ada Lovelace architecture whitepaper,
#   "Peak FP16/BF16 Tensor TFLOPS with FP32 Accumulate").
# Achieved on a transformer block's forward and backward: 55% of that on its matrices (MFU of large-model
#   training as Megatron-LM reports it on H100/A100, ~50-60%), 45% at width 1024, where kernels are smaller;
#   40% (30%) on attention (FlashAttention-2's forward+backward reaches 35-50% of the H100's peak); 0.2 ms a
#   block pass for launching its ~40 kernels forward and backward (~5 us each).
# Host<->device: PCIe Gen5 x16 ~55 GB/s and Gen4 x16 ~25 GB/s measured with page-locked memory (64 and
#   32 GB/s nominal; NVIDIA's bandwidthTest typically reaches 85%).
# NVMe: a PCIe Gen4 x4 drive 7.0 GB/s read, 6.5 GB/s write sequential (Samsung 990 PRO datasheet: 7.45 /
#   6.9); Gen5 x4 14.0 / 12.0 (Crucial T705: 14.5 / 12.7); several drives striped add up (separate lanes).
# CPU Adam: memory-bound at ~28 bytes per parameter (fp32 master and moments read and written, a 16-bit
#   gradient and weight), at half of a server's STREAM bandwidth (~300 GB/s for 2x 8-12 channel DDR5;
#   ~80 GB/s for a 2-channel DDR5 desktop): an estimate, calibrate to replace it.
# Between GPUs (collectives, NCCL's bus bandwidth): NVLink 4 through NVSwitch (H100 SXM, H200) is 450 GB/s a
#   direction, of which NCCL gets ~370 GB/s as bus bandwidth with ring algorithms (its maintainer in
#   NVIDIA/nccl-tests#212; the all-reduce reaches ~480 with NVLink SHARP, not modelled); NVLink 3 (A100 SXM4,
#   assumed for the 80 GB part) 300 GB/s a direction, 230-250 GB/s in nccl-tests on 8x A100 SXM4; 8x H100 PCIe
#   without NVLink bridges 35-45 GB/s, PCIe Gen5 bound (the last two: the reference table of "NCCL-tests in
#   practice", docs.alayanew.com); a GeForce RTX 4090 has no NVLink and no peer-to-peer: through host memory
#   over PCIe Gen4 x16 (~25 GB/s above), ~25 GB/s measured on 5 of them (tinygrad/open-gpu-kernel-modules#17),
#   20 assumed.
# Several GPUs in one machine (``gpus``): each rank gets its GPU, its drives, and an equal share of the host
#   memory, cores and CPU Adam throughput (one host's memory bandwidth serves all the ranks' Adam kernels).
#   The one-GPU profiles, planned with several ranks, give each rank the whole host they describe.
# Compute beside NVMe I/O: the GPU's kernels do not run on the host's cores, so the defaults (1 and 1: no
#   slowdown either way) stand; an assumption, not measured here (no GPU machine yet): calibrate to replace it.

_NVLINK4 = "NVLink 4 through NVSwitch: ~370 GB/s NCCL bus bandwidth, ring (NVIDIA/nccl-tests#212)"
_GPU = {  # name: (device memory bytes, BF16 dense TFLOPS, host<->device GB/s, between GPUs GB/s, its source)
    "H100-SXM": (80 * 10**9, 989.0, 55.0, 370.0, _NVLINK4),
    "H100-PCIe": (80 * 10**9, 756.0, 55.0, 40.0, "PCIe Gen5, no NVLink: 35-45 GB/s in nccl-tests on 8 (docs.alayanew.com)"),
    "H200": (141 * 10**9, 989.0, 55.0, 370.0, _NVLINK4),
    "A100-80GB": (80 * 10**9, 312.0, 25.0, 240.0, "NVLink 3 (SXM4): 230-250 GB/s in nccl-tests on 8 (docs.alayanew.com)"),
    "RTX-4090": (24 * 10**9, 165.2, 25.0, 20.0, "PCIe Gen4 through host memory, no NVLink or peer-to-peer: ~25 GB/s"
                 " measured on 5 (tinygrad/open-gpu-kernel-modules#17), 20 assumed"),
}  # fmt: skip
_DRIVE = {"gen4": Drive(7.0, 6.5), "gen5": Drive(14.0, 12.0)}


def builtin_profile(
    gpu: str, host_memory_gb: int, drives: int, drive: str = "gen4", *, desktop: bool = False, gpus: int = 1
) -> MachineProfile:
    """A profile from the public figures above: ``gpu`` (``H100-SXM``, ``H100-PCIe``, ``H200``, ``A100-80GB``,
    ``RTX-4090``), host memory in GB, ``drives`` NVMe drives of kind ``drive`` (``gen4``, ``gen5``), of a
    machine with ``gpus`` of them: with several, one rank's share (``drives / gpus`` drives, the host memory,
    cores and CPU Adam throughput divided by ``gpus``)."""
    if gpu not in _GPU or drive not in _DRIVE:
        raise ValueError(f"unknown GPU {gpu!r} or drive {drive!r}: choose from {sorted(_GPU)} and {sorted(_DRIVE)}")
    if gpus < 1 or drives % gpus:
        raise ValueError(f"{drives} drives do not split evenly between {gpus} GPUs")
    memory, tflops, pcie, link, link_source = _GPU[gpu]
    one = _DRIVE[drive]
    own = drives // gpus
    adam = (80e9 if desktop else 300e9) / 2 / 28 / gpus  # params/s, see above
    name = f"{gpus}x {gpu} + {host_memory_gb} GB RAM + {drives}x {drive} NVMe"
    if gpus > 1:
        name += f" (a rank: 1 GPU, {host_memory_gb // gpus} GB RAM, {own} drives)"
    return MachineProfile(
        name=name, device="cuda", device_name=gpu, device_memory_bytes=memory,
        host_memory_bytes=host_memory_gb * 10**9 // gpus,
        block_tflops=((1024, 0.45 * tflops, 0.3 * tflops, 2e-4), (8192, 0.55 * tflops, 0.4 * tflops, 2e-4)),
        matmul_tflops=0.8 * tflops,
        h2d_gbps=pcie, d2h_gbps=pcie, drives=tuple([one] * own),
        drives_together=Drive(one.read_gbps * own, one.write_gbps * own),
        adam_params_per_s={"float32": adam, "bfloat16": adam}, cpu_cores=(16 if desktop else 64) // gpus,
        source="built in: vendors' datasheets and published utilization (nvoffload/planner/profile.py);"
        f" between GPUs {link:g} GB/s: {link_source}",
        interconnect_gbps=link,
    )  # fmt: skip


BUILTIN_PROFILES: dict[str, MachineProfile] = {
    "h100-sxm-512g-4xgen4": builtin_profile("H100-SXM", 512, 4, "gen4"),
    "h100-pcie-512g-4xgen4": builtin_profile("H100-PCIe", 512, 4, "gen4"),
    "h200-1t-4xgen5": builtin_profile("H200", 1024, 4, "gen5"),
    "a100-80g-512g-4xgen4": builtin_profile("A100-80GB", 512, 4, "gen4"),
    "rtx4090-256g-2xgen4": builtin_profile("RTX-4090", 256, 2, "gen4", desktop=True),
    # an HGX/DGX H100 class server (8 SXM GPUs on NVSwitch, 2 TB of host memory) with 4 Gen4 drives per GPU
    "8x-h100-sxm-2t-32xgen4": builtin_profile("H100-SXM", 2048, 32, "gen4", gpus=8),
}
