"""The device tier of parameter streaming: which blocks are on the device, who holds them, and gradients' bytes."""

from __future__ import annotations

import collections
import threading
import time
import weakref

import torch
from torch import nn

from nvoffload.memory import MemoryBudgetError, MemoryManager
from nvoffload.streaming import _guard
from nvoffload.streaming._blocks import Block
from nvoffload.streaming._host_cache import HostCache

__all__ = ["DeviceResidency", "GradientLedger"]

_POLL_S = 0.5  # how often a wait for device memory checks that it can still end
_GRAD_STALL_S = 60.0  # longest wait for device memory while no gradient is freed


def _alias(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor over ``tensor``'s storage with its own version counter (writes do not bump autograd's)."""
    return torch.empty(0, dtype=tensor.dtype, device=tensor.device).set_(
        tensor.untyped_storage(), tensor.storage_offset(), tensor.shape, tensor.stride()
    )


class GradientLedger:
    """Gradients counted in the device tier from the moment autograd accumulates them until they are freed.

    :meth:`track` is called from post-accumulate-grad hooks that run before the
    optimizer's, so it sees each gradient while its parameter still holds it.
    Gradients whose parameter no longer holds them are *queued*: the optimizer
    took them and frees them as its updates finish.
    """

    def __init__(self, memory: MemoryManager, model: nn.Module):
        self.memory = memory
        self._model = model  # names the parameters in messages
        self._lock = threading.Lock()
        self._counted: dict[int, tuple[nn.Parameter, weakref.ref, int]] = {}  # id(grad) -> param, grad, bytes

    def track(self, param: nn.Parameter) -> None:
        grad = param.grad
        if grad is None:
            return
        with self._lock:
            if id(grad) in self._counted:  # accumulated into the same tensor again
                return
            nbytes = grad.numel() * grad.element_size()
            self._counted[id(grad)] = (param, weakref.ref(grad), nbytes)
        self.memory.track("device", nbytes)
        weakref.finalize(grad, self._freed, id(grad), nbytes)

    def _freed(self, key: int, nbytes: int) -> None:
        with self._lock:
            del self._counted[key]
        self.memory.untrack("device", nbytes)

    def _split(self) -> tuple[list[tuple[str, int]], int]:
        """(parameter, bytes) of the gradients their parameters still hold, and the bytes of the others."""
        held, queued = [], 0
        with self._lock:
            entries = list(self._counted.values())
        for param, grad, nbytes in entries:
            if param.grad is not None and param.grad is grad():
                held.append((param, nbytes))
            else:
                queued += nbytes
        return held, queued

    def queued_bytes(self) -> int:
        return self._split()[1]

    def describe(self) -> str:
        held, queued = self._split()
        names = {p: n for n, p in self._model.named_parameters()}
        names = ", ".join(names.get(p, "?") for p, _ in held[:5]) + (", ..." if len(held) > 5 else "")
        attached = f" ({names}; freed when the optimizer takes them or at zero_grad())" if held else ""
        return f"{sum(b for _, b in held)} bytes of gradients held by their parameters{attached}, {queued} queued for the optimizer"


class DeviceResidency:
    """Which streamed blocks are on the device, who holds each there, and the device bytes they take.

    A block comes to the device on its first :meth:`hold` and leaves at its last
    :meth:`unhold`; each hold names its reason (``"forward"``, ``"backward"``,
    ``"load_state_dict"``), and blocks are counted per reason, so a block called
    twice or held by a forward and a backward at once stays until both let go.
    Off the device a block's parameters keep their identity, but their storage
    holds no bytes and they refuse reads (:mod:`~nvoffload.streaming._guard`).

    When a block does not fit, :meth:`hold` waits only while gradients queued for
    the optimizer could free enough and keep being freed; otherwise it raises
    :class:`~nvoffload.memory.MemoryBudgetError` at once, naming what holds the device memory.
    """

    def __init__(self, memory: MemoryManager, cache: HostCache, device: torch.device, gradients: GradientLedger,
                 resident_bytes: int):  # fmt: skip
        self.memory = memory
        self.cache = cache
        self.device = device
        self.gradients = gradients
        self._resident_bytes = resident_bytes
        self._lock = threading.RLock()
        self._holds: dict[Block, collections.Counter[str]] = {}  # blocks on the device
        self._placements: list[_guard.Placement] = []
        self.grad_wait_s = 0.0  # time spent waiting for the optimizer to free gradients' device memory

    def park(self, block: Block) -> None:
        """Take a new block's parameters off the device (its weights are in the store): each gets its own
        storage on the device, zero bytes until the block arrives."""
        for name, p in zip(block.param_names, block.params):
            p.data = torch.empty(p.shape, dtype=p.dtype, device=self.device)
            p.untyped_storage().resize_(0)
            self._placements.append(_guard.attach(p, name, block.index))
            _guard.guard(p)

    def hold(self, block: Block, why: str, *, headroom_bytes: int = 0) -> None:
        """Keep ``block`` on the device for ``why`` (bringing it there), with ``headroom_bytes`` more to follow."""
        with self._lock:
            if block not in self._holds:
                self._arrive(block, headroom_bytes)
                self._holds[block] = collections.Counter()
            self._holds[block][why] += 1

    def unhold(self, block: Block, why: str) -> None:
        """Drop one hold of ``block`` for ``why``; the last one takes the block off the device."""
        with self._lock:
            holds = self._holds[block]
            if holds[why] <= 0:
                raise RuntimeError(f"{block} is not held on the device for {why}")
            holds[why] -= 1
            if not +holds:
                del self._holds[block]
                self._leave(block)

    def holds(self, block: Block, why: str) -> int:
        with self._lock:
            return self._holds[block][why] if block in self._holds else 0

    def close(self) -> None:
        """Take every block off the device; the parameters' reads say the weights are gone from now on."""
        with self._lock:
            for block in list(self._holds):
                del self._holds[block]
                self._leave(block)
            for placement in self._placements:
                placement.closed = True

    def describe(self) -> str:
        """What holds the device memory, for error messages."""
        with self._lock:
            blocks = ", ".join(f"{b.index} ({', '.join(sorted(+h))})" for b, h in self._holds.items()) or "none"
        return (
            f"device memory in use: {self._resident_bytes} bytes of parameters outside the blocks; "
            f"parameter blocks on the device: {blocks}; {self.gradients.describe()}"
        )

    # ------------------------------------------------------------------ internals (caller holds the lock)
    def _arrive(self, block: Block, headroom_bytes: int) -> None:
        self._reserve(block, headroom_bytes)
        try:
            with self.cache.pinned(block) as host:
                for j, p in enumerate(block.params):
                    _guard.unguard(p)
                    p.untyped_storage().resize_(p.numel() * p.element_size())
                    _alias(p).copy_(block.view(host, j))
        except BaseException:
            self._leave(block)
            raise

    def _leave(self, block: Block) -> None:
        for p in block.params:
            _guard.unguard(p)  # (when it arrived only in part)
            p.untyped_storage().resize_(0)
            _guard.guard(p)
        self.memory.free("device", block.nbytes)

    def _reserve(self, block: Block, headroom_bytes: int) -> None:
        needed = block.nbytes + headroom_bytes
        start = last_progress = time.perf_counter()
        queued = None
        while True:
            try:
                self.memory.allocate("device", block.nbytes, str(block), wait_s=_POLL_S, headroom_bytes=headroom_bytes)
                break
            except MemoryBudgetError as e:
                now, before, queued = time.perf_counter(), queued, self.gradients.queued_bytes()
                if before is not None and queued < before:
                    last_progress = now
                short = needed - self.memory.available_bytes("device")
                if queued < short or now - last_progress > _GRAD_STALL_S:
                    why = "nothing that could free it is pending" if queued < short else "no gradient was freed for a minute"
                    raise MemoryBudgetError(f"{e} ({why}); {self.describe()}") from None
        self.grad_wait_s += time.perf_counter() - start
