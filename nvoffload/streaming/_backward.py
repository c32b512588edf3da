"""When a backward pass is done with a block: the rule that lets streamed blocks leave the device during backward."""

from __future__ import annotations

import functools
import threading
import weakref

import torch
from torch import nn
from torch.autograd.graph import get_gradient_edge

from nvoffload.streaming._blocks import Block
from nvoffload.streaming._residency import DeviceResidency

__all__ = ["BackwardPasses", "CallHooks"]


_current_pass = torch._C._current_graph_task_id  # the running backward pass (autograd's graph task), or -1 outside
_will_execute = torch._C._will_engine_execute_node
_NO_HOLDS: dict = {}


class _Hold:
    """One block in one backward pass."""

    __slots__ = ("calls", "pending", "held")

    def __init__(self, pending: set[int]):
        self.calls = 0  # calls of the block whose input gradients are not computed yet
        self.pending = pending  # ids of the parameters whose gradient the pass has not accumulated yet
        self.held = True  # on the device for this pass



class BackwardPasses:
    """The streamed blocks each running backward pass holds on the device.

    A pass holds a block from its first backward pre-hook (the gradient of a
    call's output is ready) until both: every call of the block in the pass has
    the gradients of its inputs (:class:`CallHooks`), and every parameter of
    the block that the pass will give a gradient (autograd's engine says which, at
    that first pre-hook) has it. So a parameter left out of a step (a skipped
    branch, an unrouted expert) does not keep its block, and a block called twice
    is held until its first call's backward is done (a later pre-hook takes it
    back if it left in between). Whatever a pass still holds when it ends is let
    go by the engine's final callback; a pass that never ended (backward raised)
    is let go by :meth:`release_unfinished`, from the next forward.
    """

    def __init__(self, residency: DeviceResidency):
        self._residency = residency
        self._lock = threading.RLock()
        self._passes: dict[int, dict[Block, _Hold]] = {}
        # each block's parameters with their ids and gradient nodes (kept from their first pass, so every graph
        # accumulates through the same node): found once
        self._nodes: dict[Block, list[list]] = {}
        self.closed = False  # the streamer closed: the gradient hooks do nothing

    def enter(self, block: Block, headroom_bytes: int) -> None:
        """Backward reached a call of ``block`` (its backward pre-hook); ``headroom_bytes``: its gradients to come."""
        task = _current_pass()
        with self._lock:
            holds = self._passes.get(task)
            if holds is None:
                holds = self._passes[task] = {}
                torch.autograd.Variable._execution_engine.queue_callback(_final_callback(self, task))
            hold = holds.get(block)
            if hold is None or not hold.held:
                self._residency.hold(block, "backward", headroom_bytes=headroom_bytes)
            if hold is None:
                hold = holds[block] = _Hold(self._will_get_grads(block))
            hold.held = True
            hold.calls += 1

    def inputs_done(self, block: Block) -> None:
        """A call of ``block`` has the gradients of its inputs (:class:`CallHooks`)."""
        with self._lock:
            hold = self._passes.get(_current_pass(), _NO_HOLDS).get(block)
            if hold is not None:
                hold.calls -= 1
                if not hold.calls and not hold.pending and hold.held:
                    self._let_go(block, hold)

    def grad_hook(self, param_id: int, block: Block | None = None):
        """The post-accumulate-grad hook of the parameter whose ``id()`` is ``param_id``, a parameter of ``block``
        (None: outside the blocks): its gradient counted in the device tier (the residency's
        :class:`~nvoffload.streaming._residency.GradientLedger`), and the pass told that it has it, in one call
        (it runs for every parameter, and takes the lock only to let the block go); nothing once :attr:`closed`
        or gone (it does not keep the passes alive)."""
        ref = weakref.ref(self)

        def hook(param: nn.Parameter) -> None:
            passes = ref()
            if passes is None or passes.closed:
                return
            if param.grad is not None:  # None when a hook before this one took it
                passes._residency.gradients.track(param)
            if block is None:
                return
            try:
                hold = passes._passes[_current_pass()][block]
            except KeyError:  # a block this pass does not hold (it was not entered in it)
                return
            pending = hold.pending
            pending.discard(param_id)
            if not pending:
                passes._grads_done(block, hold)

        return hook

    def _grads_done(self, block: Block, hold: _Hold) -> None:
        """The pass accumulated every gradient of ``block`` it will give: let it go if its calls are done too."""
        with self._lock:
            if hold.held and not hold.calls and not hold.pending:
                self._let_go(block, hold)

    def finish(self, task: int) -> None:
        """Let go of every block the pass ``task`` still holds (it ended)."""
        with self._lock:
            for block, hold in self._passes.pop(task, {}).items():
                if hold.held:
                    hold.held = False
                    self._residency.unhold(block, "backward")

    @property
    def failed(self) -> bool:
        """Outside backward: whether a pass never ended (its backward raised)."""
        return bool(self._passes) and _current_pass() == -1

    def release_unfinished(self) -> None:
        """Outside backward: let go of what passes that never ended (backward raised) still hold."""
        if self._passes and _current_pass() == -1:
            with self._lock:
                for task in list(self._passes):
                    self.finish(task)

    def _will_get_grads(self, block: Block) -> set[int]:
        """The ids of ``block``'s parameters the running backward pass will accumulate a gradient into (its
        parameters are on the device: plain ones)."""
        nodes = self._nodes.get(block)
        if nodes is None:
            nodes = self._nodes[block] = [[p, id(p), None] for p in block.params]
        return {e[1] for e in nodes if e[0].requires_grad and _will_execute(e[2] if e[2] is not None else _node(e))}

    def _let_go(self, block: Block, hold: _Hold) -> None:
        """``block`` is done in this pass: every call has its inputs' gradients and every parameter its own."""
        hold.held = False
        self._residency.unhold(block, "backward")


class CallHooks:
    """The backward hooks of each call of a block, set up per call from its forward hooks on the call's own
    tensors, without the autograd functions around its inputs and outputs that ``register_full_backward_hook``
    adds (two per call, each a Python function in forward and in backward).

    ``before(module)`` runs when the gradient of a call's output is ready (a pre-hook of the node that made the
    output: the first of them in a pass when there are several), ``inputs_done(module, *grads)`` when the
    gradients of all its inputs that need one are (``grads``: what autograd gives the hook, ignored; hooks on
    the inputs, set before the call runs, so an input the call changes in place reports its own gradient; right after ``before`` when none needs one: the first block of a
    model with frozen embeddings, LoRA). An input's hook is a tensor hook of the node that made the input, and
    autograd runs those before the node's pre-hooks: the block whose input is the previous block's output lets
    go before the previous block is held.
    """

    def __init__(self, before, inputs_done):
        self._before = before
        self._inputs_done = inputs_done
        self._calls: list[list[torch.Tensor]] = []  # the inputs needing gradients of each running call, innermost last

    def forward_began(self, module: nn.Module, args: tuple) -> None:
        """From the call's forward pre-hook: note its arguments that need gradients."""
        needing = []
        if torch.is_grad_enabled():
            needing = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
        self._calls.append(needing)

    def forward_ended(self, module: nn.Module, output) -> None:
        """From the call's forward hook: hook its output and inputs (none when the call's forward pre-hook raised
        before :meth:`forward_began`)."""
        if not self._calls:
            return
        inputs = self._calls.pop()
        outputs = output if isinstance(output, tuple) else (output,)
        needing = [t for t in outputs if isinstance(t, torch.Tensor) and t.requires_grad]
        if not needing or not torch.is_grad_enabled():
            return
        fired: set[int] = set()  # the passes that reached the call
        # Not the inputs themselves: the hook lives as long as the graph, which the caller's loss keeps after
        # backward, and the inputs (activations on the device) would live with it.
        no_inputs = not inputs

        def output_ready(*_) -> None:
            task = _current_pass()
            if task not in fired:
                fired.add(task)
                self._before(module)
                if no_inputs:
                    self._inputs_done(module)

        for t in needing:
            if t.grad_fn is None:  # an input or a parameter returned as it is
                t.register_hook(output_ready)
            else:
                t.grad_fn.register_prehook(output_ready)
        if len(inputs) == 1:
            inputs[0].register_hook(functools.partial(self._inputs_done, module))  # called with the gradient
        elif inputs:
            torch.autograd.graph.register_multi_grad_hook(inputs, functools.partial(self._inputs_done, module))


def _node(entry: list):
    """The gradient node of the parameter of ``entry`` (``[param, id, node]``), found at its first pass and kept."""
    entry[2] = get_gradient_edge(entry[0]).node
    return entry[2]


def _final_callback(passes: BackwardPasses, task: int):
    ref = weakref.ref(passes)

    def callback() -> None:
        live = ref()
        if live is not None:
            live.finish(task)

    return callback
