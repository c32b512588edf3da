"""The streamed parameters' current weights, for the optimizer, state dicts and checkpoints.

The host copy of a block is its current weights (the device copy is a
read-only image of it, dropped when the block leaves), so everything that
reads or writes weights outside forward and backward goes through the host
cache, one block at a time.
"""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Callable, Iterable

import torch
from torch import nn

from nvoffload.checkpoint import SafetensorsWriter
from nvoffload.core.buffers import round_up
from nvoffload.streaming._blocks import Block, state_tensors
from nvoffload.streaming._host_cache import HostCache
from nvoffload.streaming._residency import DeviceResidency
from nvoffload.transfer import Future, relay

__all__ = ["StreamedWeights", "WeightsSnapshot"]


class StreamedWeights:
    """Reads and writes of the streamed parameters' weights through the host cache.

    It is the optimizer's :class:`~nvoffload.optim.WeightHome` (``streamer.weights``,
    handed to the optimizer as it is) and the state-dict hooks the streamer installs
    on every module that holds streamed parameters, so that ``state_dict()`` of the
    model or of any sub-module gives the current weights and ``load_state_dict()`` of
    any of them writes them.
    """

    def __init__(self, model: nn.Module, blocks: list[Block], cache: HostCache, residency: DeviceResidency):
        self.model = model
        self._cache = cache
        self._residency = residency
        self._where = {p: (block, j) for block in blocks for j, p in enumerate(block.params)}
        # the model's modules that hold streamed parameters themselves (not their children's), each with those
        # parameters by attribute name: the modules the state-dict hooks go on
        self.owners = [(module, owned) for module in model.modules() if (owned := self._owned(module))]

    def holds(self, param: torch.Tensor) -> bool:
        return param in self._where

    def _owned(self, module: nn.Module) -> list[tuple[str, nn.Parameter]]:
        return [(key, p) for key, p in module._parameters.items() if p is not None and p in self._where]

    def block_of(self, param: torch.Tensor) -> Block:
        return self._where[param][0]

    # ------------------------------------------------------------------ WeightHome
    def acquire(self, param: torch.Tensor, *, staged: bool = False) -> torch.Tensor:
        """The parameter's weights in host memory, flat and writable; its block stays cached until :meth:`release`.
        ``staged``: its next weights instead (a delayed update's, in its block's twin; until :meth:`install_staged`
        the current ones are what forward and backward read)."""
        block, j = self._where[param]
        host = self._cache.pin_next(block) if staged else self._cache.pin(block, writing=True)
        return block.view(host, j).view(-1)

    def release(self, param: torch.Tensor, *, modified: bool, staged: bool = False) -> None:
        """Let the parameter's block (``staged``: its twin) go; ``modified``: the parameter's part of it is written
        back (a LoRA adapter's update leaves the frozen base weights beside it unwritten)."""
        block, j = self._where[param]
        self._cache.unpin(self._cache.next_of(block) if staged else block, modified=modified, part=block.part_of(j))

    def staging(self, param: torch.Tensor) -> None:
        """A delayed update will write the parameter's next weights (``acquire(staged=True)``) until
        :meth:`install_staged` or :meth:`drop_staged`: loading weights into its block is refused meanwhile."""
        self._cache.expect_next(self._where[param][0])

    def install_staged(self) -> None:
        """The delayed updates landed: every block's next weights become its weights (a block brought to the
        device ahead of use, with the old ones, is let go first). Refused, changing nothing, while a forward or
        backward holds a block (its device copy has the old weights)."""
        self._check_between_passes()
        self._residency.stage(None)
        self._cache.promote()

    def drop_staged(self) -> None:
        """The delayed updates were undone: forget every block's next weights (the staged block lets go of its
        host copy first)."""
        self._residency.stage(None)
        self._cache.drop_next()

    def updating(self, param: torch.Tensor, done: Future) -> None:
        """The optimizer rewrites the parameter's weights in host memory until the future ``done`` (an update
        deferred past ``step()``): its block's next copy to the device, and reads of its weights, wait for it."""
        self._residency.updating(self._where[param][0], done)

    def settled(self) -> None:
        """Every update given to :meth:`updating` landed or was undone."""
        self._residency.settled()

    def _check_between_passes(self) -> None:
        held = self._residency.held()
        if held:
            raise RuntimeError(
                f"nvoffload: the delayed updates cannot land while {held[0]} is held on the device (a forward or"
                " backward is running): land them between steps (optimizer.step() or synchronize())"
            )

    # ------------------------------------------------------------------ reads
    @contextlib.contextmanager
    def held(self, param: torch.Tensor):
        """A streamed parameter's current weights in host memory, shaped like it, while its block stays cached."""
        block, j = self._where[param]
        self._residency.wait_updated(block)
        with self._cache.pinned(block) as host:
            yield block.view(host, j)

    def gather(self, param: torch.Tensor) -> torch.Tensor:
        """A copy of a streamed parameter's current weights (on the CPU)."""
        with self.held(param) as weights:
            return weights.clone()

    @contextlib.contextmanager
    def current(self, tensor: torch.Tensor):
        """The current weights of a parameter or buffer of the model: a streamed parameter's host copy (its
        block cached while the context lasts), anything else as it is."""
        if not self.holds(tensor):
            yield tensor.detach()
            return
        with self.held(tensor) as weights:
            yield weights

    @contextlib.contextmanager
    def writable(self, tensor: torch.Tensor):
        """A parameter's or buffer's weights to overwrite in place (loading a checkpoint between steps): a
        streamed parameter's host copy, marked changed (written back before it leaves the cache; a block
        brought to the device ahead of use is let go first, so no device copy keeps the old weights), anything
        else as it is."""
        if not self.holds(tensor):
            yield tensor.detach()
            return
        self._residency.stage(None)
        block, j = self._where[tensor]
        self._check_landed(block)
        self._residency.wait_updated(block)
        with self._cache.pinned(block, modified=True) as host:
            yield block.view(host, j)

    def snapshot(self, params: Iterable[torch.Tensor]) -> WeightsSnapshot:
        """The current weights of the streamed ``params``, held as they are now for :meth:`WeightsSnapshot.stream`
        (from any thread) while the next steps change them: the blocks whose weights the store does not have yet
        stay in the host cache (:meth:`HostCache.hold`: their writers wait until the snapshot let them go), the
        others' store entries are pinned (:meth:`TensorStore.pin`). Nothing is copied or read here. Call it
        between steps, every update landed (``optimizer.synchronize()``)."""
        self._check_between_passes()
        wanted: dict[Block, list[int]] = {}
        for p in params:
            block, j = self._where[p]
            wanted.setdefault(block, []).append(j)
        for block in wanted:
            self._residency.wait_updated(block)
        held = self._cache.hold(wanted)
        in_cache = {block for block, _, _ in held}
        stored = [block for block in wanted if block not in in_cache]
        pin = self._cache.store.pin([name for block in stored for name, _, _ in block.parts])
        return WeightsSnapshot(wanted, held, stored, pin)

    def save_checkpoint(self, path, metadata: dict[str, str] | None) -> None:
        """The model's state, as ``state_dict()`` names it, to a safetensors file, one tensor in memory at a time."""
        tensors = state_tensors(self.model)
        shapes = {name: (t.dtype, tuple(t.shape)) for name, t in tensors.items()}
        with SafetensorsWriter(path, shapes, metadata) as writer:
            for name, t in tensors.items():
                if not self.holds(t):
                    writer.write(name, t.detach())
                    continue
                with self.held(t) as weights:  # written from the cache, no copy
                    writer.write(name, weights)

    def _check_landed(self, block: Block) -> None:
        """Refuse to overwrite the weights of a block whose delayed update has not landed (it would undo them)."""
        if self._cache.expects_next(block):
            raise RuntimeError(
                f"nvoffload: the delayed update of {block} has not landed, and would replace the weights loaded now:"
                " call optimizer.synchronize() before loading weights"
            )

    # ------------------------------------------------------------------ state-dict hooks of one module (their arguments)
    def after_state_dict(self, owned: list[tuple[str, nn.Parameter]], module, state_dict: dict, prefix: str, _) -> None:
        """Replace the entries of ``owned`` (placeholders: the parameters are off the device) by their weights;
        ``state_dict(keep_vars=True)`` entries, the parameters themselves, stay."""
        for key, p in owned:
            name = prefix + key
            if name in state_dict and state_dict[name] is not p:
                state_dict[name] = self.gather(p)

    def before_load(self, owned: list[tuple[str, nn.Parameter]], module, state_dict, prefix, local_metadata: dict,
                    *_) -> None:  # fmt: skip
        """Bring the block of ``owned`` to the device, where ``load_state_dict`` copies into the parameters."""
        if local_metadata.get("assign_to_params_buffers"):
            raise ValueError(
                "load_state_dict(assign=True) would replace streamed parameters (their weights live in the "
                "streamer's store): load without assign="
            )
        self._check_landed(self.block_of(owned[0][1]))
        self._residency.hold(self.block_of(owned[0][1]), "load_state_dict")

    def after_load(self, owned: list[tuple[str, nn.Parameter]], module, incompatible_keys) -> None:
        """Write what ``load_state_dict`` copied into ``owned`` to their block's host copy, and let the block go."""
        block = self.block_of(owned[0][1])
        with torch.no_grad(), self._cache.pinned(block, modified=True) as host:
            for _, p in owned:
                block.view(host, self._where[p][1]).copy_(p)
        self._residency.unhold(block, "load_state_dict")


WeightSink = Callable[[torch.Tensor, torch.Tensor], Future]
"""``sink(param, weights)``: ``weights`` (host memory, the parameter's dtype and shape) handed to a writer; the future
of its writes, until which ``weights`` stays valid."""


class WeightsSnapshot:
    """Streamed parameters' weights of one step (:meth:`StreamedWeights.snapshot`), held while the next steps run,
    streamed from any thread by :meth:`stream` until :meth:`release`."""

    def __init__(self, wanted: dict[Block, list[int]], held: list, stored: list[Block], pin):
        self._wanted, self._held, self._stored, self._pin = wanted, held, stored, pin

    @property
    def nbytes(self) -> int:
        """Bytes of the parameters' weights."""
        return sum(block.param_bytes[j] for block, js in self._wanted.items() for j in js)

    def stream(self, sink: WeightSink, *, max_bytes_in_flight: int) -> None:
        """Call ``sink`` for every parameter: first those of the blocks held in the host cache, from there (each
        block let go once the writes ``sink`` returned for it are done: its writers wait until then), then the
        others, read from the pinned store entries ahead into buffers of their own, at most ``max_bytes_in_flight``
        bytes in all (at least two blocks'): a buffer is read into again once its writes are done."""
        writes: collections.deque[tuple[list[Future], Callable[[], None]]] = collections.deque()
        for block, host, let_go in self._held:
            while writes and all(f.done() for f in writes[0][0]):
                self._let_go(writes)
            writes.append(([sink(block.params[j], block.view(host, j)) for j in self._wanted[block]], let_go))
        while writes:
            self._let_go(writes)
        self._held = []
        self._stream_stored(sink, max_bytes_in_flight)

    @staticmethod
    def _let_go(writes: collections.deque) -> None:
        futures, let_go = writes[0]
        try:
            Future.all_of(futures).result()
        finally:
            writes.popleft()
            let_go()

    def _stream_stored(self, sink: WeightSink, max_bytes_in_flight: int) -> None:
        def read(block: Block, buffer: torch.Tensor) -> Future:
            return Future.all_of([self._pin.get(name, out=buffer[a:b]) for name, a, b in block.parts])

        def write(block: Block, buffer: torch.Tensor) -> Future:
            return Future.all_of([sink(block.params[j], block.view(buffer, j)) for j in self._wanted[block]])

        if self._stored:
            largest = round_up(max(block.nbytes for block in self._stored))
            relay(self._stored, largest, max_bytes_in_flight, read, write)

    def release(self) -> None:
        """Let go of whatever it still holds (the blocks in the host cache, the store's entries). Idempotent."""
        for _, _, let_go in self._held:
            let_go()
        self._held = []
        self._pin.release()
