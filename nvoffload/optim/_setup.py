"""What an offloaded optimizer checks and opens when it is built: its parameters refused or accepted, its share
over several ranks, its host memory and its store."""

from __future__ import annotations

import sys
from typing import NamedTuple

import torch

from nvoffload.distributed import Ranks, Sharding
from nvoffload.optim._config import OffloadOptimizerConfig
from nvoffload.optim._layout import ALIGN_NUMEL, Layout
from nvoffload.optim._updates import Update
from nvoffload.transfer import TransferEngine

_PARAM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def check_groups(all_groups: list[dict], groups: list[dict], update: Update) -> torch.device:
    """Refuse parameters or ``groups`` that cannot be offloaded; returns the parameters' device (of ``all_groups``)."""
    devices = {p.device for g in all_groups for p in g["params"]}
    if len(devices) > 1:
        raise ValueError(f"all parameters must be on one device, found {sorted(str(d) for d in devices)}")
    for g in groups:
        for p in g["params"]:
            if p.is_sparse or p.layout != torch.strided:
                raise ValueError(f"parameter of layout {p.layout} cannot be offloaded (dense parameters only)")
            if p.dtype not in _PARAM_DTYPES:
                raise ValueError(
                    f"parameter of dtype {p.dtype} cannot be offloaded (float32, bfloat16 or float16: the"
                    " master weights are float32)"
                )
        update.check_group(g)
    return next(iter(devices)) if devices else torch.device("cpu")


def shard(process_group, device: torch.device, param_groups: list[dict], update: Update, inner: torch.optim.Optimizer,
          config: OffloadOptimizerConfig) -> Sharding | None:  # fmt: skip
    """This rank's share of the state over ``process_group``'s ranks (None: one process)."""
    ranks = Ranks.resolve(process_group, timeout_s=config.collective_timeout_s)
    if ranks is None:
        return None
    if not update.adam:
        raise ValueError(
            f"{type(inner).__name__} cannot be sharded over ranks: only Adam and AdamW (and nvoffload's"
            " CPUAdam/CPUAdamW) split their state between ranks"
        )
    if device.type != ranks.device.type:
        raise ValueError(
            f"the parameters are on {device} but the process group communicates on {ranks.device.type}:"
            " use the nccl backend for CUDA parameters, gloo for CPU ones"
        )
    params = [p for g in param_groups for p in g["params"]]
    summary = [(tuple(p.shape), str(p.dtype), p.requires_grad) for p in params]
    ranks.same(summary, "the optimizer's parameters (shapes, dtypes, requires_grad, in group order)")
    sharding = Sharding(ranks, params, ALIGN_NUMEL, config.bucket_bytes)
    if config.delayed_update:
        raise ValueError("delayed_update trains on one process; over several ranks, leave it off")
    if config.defer_updates:
        raise ValueError("defer_updates=True defers on one process; over several ranks, leave it None or False")
    return sharding


def planned_layout(update: Update, param_groups: list[dict], prefix: str, config: OffloadOptimizerConfig,
                   sharding: Sharding | None) -> Layout:  # fmt: skip
    """The chunks of ``param_groups``' state (this rank's share over several ranks), sized for ``config``'s slots."""
    layout = Layout(
        adam=update.adam, elementwise=update.elementwise, param_groups=param_groups, prefix=prefix,
        kept_grads=config.keeps_grads, owned=sharding.owned if sharding is not None else None,
        state_precision=config.state_precision,
    )  # fmt: skip
    layout.plan(chunk_bytes=config.chunk_bytes, cpu_memory_bytes=config.cpu_memory_bytes, num_slots=config.num_slots)
    return layout


class Storage(NamedTuple):
    """The optimizer's host memory and store, open."""

    transfer: TransferEngine  # the engine that moves its gradients and weights
    slab: object  # its host memory (a HostSlab or a carve of one)
    close_transfer: object  # gives that memory back (and closes an engine of its own)
    store: object  # its TensorStore
    owns_store: bool  # it opened the store (and closes it)


def open_storage(swap_dir, layout: Layout, config: OffloadOptimizerConfig, host_bytes: int, device: torch.device,
                 transfer: TransferEngine | None, sharding: Sharding | None) -> Storage:  # fmt: skip
    """Carve ``host_bytes`` from ``transfer``'s slab (or make an engine of its own) and open the store; over
    several ranks, every rank raises when one could not open its swap directories. Nothing stays open on an error."""
    if transfer is None:
        transfer = TransferEngine(host_bytes, device, what="the optimizer's host memory")
        slab, close_transfer = transfer.slab, transfer.close
    else:
        slab = transfer.slab.carve(host_bytes, "the optimizer's slots")
        close_transfer = slab.close
    opened = None
    try:
        try:
            opened = _open_store(swap_dir, layout, config)
        finally:  # every rank raises when one could not open its swap directories
            if sharding is not None:
                sharding.ranks.agree(sys.exc_info()[1], "opening the swap directories")
    except BaseException:
        if opened is not None and opened[1]:
            opened[0].close()
        close_transfer()
        raise
    return Storage(transfer, slab, close_transfer, *opened)


def _open_store(swap_dir, layout: Layout, config: OffloadOptimizerConfig):
    """The store to use, and whether the optimizer opened it (and closes it)."""
    from nvoffload.io import TensorStore, swap_directories

    if isinstance(swap_dir, TensorStore):
        return swap_dir, False
    state = layout.store_state_bytes(config.resident_state_bytes)  # two generations until a commit
    kept = layout.kept_grad_bytes()
    what = f"the optimizer state (two generations of {state} bytes" + (f", and {kept} of gradients)" if kept else ")")
    dirs = swap_directories(swap_dir, needed_bytes=2 * state + kept, what=what)
    return TensorStore(dirs if len(dirs) > 1 else dirs[0], checksum=config.checksum), True
