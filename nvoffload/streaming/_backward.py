"""When a backward pass is done with a block: the rule that lets streamed blocks leave the device during backward."""

from __future__ import annotations

import threading
import weakref

import torch
from torch import nn
from torch.autograd.graph import get_gradient_edge
from torch.utils.hooks import BackwardHook

from nvoffload.streaming._blocks import Block
from nvoffload.streaming._residency import DeviceResidency

__all__ = ["BackwardPasses", "CallHooks"]


def _current_pass() -> int:
    """The running backward pass (autograd's graph task), or -1 outside backward."""
    return torch._C._current_graph_task_id()


def _will_get_grad(param: nn.Parameter) -> bool:
    """Whether the running backward pass will accumulate a gradient into ``param``."""
    return torch._C._will_engine_execute_node(get_gradient_edge(param).node)


class _Hold:
    """One block in one backward pass."""

    __slots__ = ("calls", "pending", "held")

    def __init__(self, pending: set[int]):
        self.calls = 0  # calls of the block whose input gradients are not computed yet
        self.pending = pending  # ids of the parameters whose gradient the pass has not accumulated yet
        self.held = True  # on the device for this pass

    def done(self) -> bool:
        return self.held and not self.calls and not self.pending


class BackwardPasses:
    """The streamed blocks each running backward pass holds on the device.

    A pass holds a block from its first backward pre-hook (the gradient of a
    call's output is ready) until both: every call of the block in the pass has
    the gradients of its inputs (the full backward hook), and every parameter of
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
                hold = holds[block] = _Hold({id(p) for p in block.trainable if _will_get_grad(p)})
            hold.held = True
            hold.calls += 1

    def inputs_done(self, block: Block) -> None:
        """A call of ``block`` has the gradients of its inputs (its full backward hook)."""
        with self._lock:
            hold = self._hold(block)
            if hold is not None:
                hold.calls -= 1
                self._let_go_if_done(block, hold)

    def grad_done(self, block: Block, param: nn.Parameter) -> None:
        """The pass accumulated ``param``'s gradient (its post-accumulate-grad hook)."""
        with self._lock:
            hold = self._hold(block)
            if hold is not None:
                hold.pending.discard(id(param))
                self._let_go_if_done(block, hold)

    def finish(self, task: int) -> None:
        """Let go of every block the pass ``task`` still holds (it ended)."""
        with self._lock:
            for block, hold in self._passes.pop(task, {}).items():
                if hold.held:
                    hold.held = False
                    self._residency.unhold(block, "backward")

    def unfinished(self) -> bool:
        """Outside backward: whether a pass never ended (its backward raised)."""
        return bool(self._passes) and _current_pass() == -1

    def release_unfinished(self) -> None:
        """Outside backward: let go of what passes that never ended (backward raised) still hold."""
        if self._passes and _current_pass() == -1:
            with self._lock:
                for task in list(self._passes):
                    self.finish(task)

    def _hold(self, block: Block) -> _Hold | None:
        return self._passes.get(_current_pass(), {}).get(block)

    def _let_go_if_done(self, block: Block, hold: _Hold) -> None:
        if hold.done():
            hold.held = False
            self._residency.unhold(block, "backward")


class CallHooks:
    """The backward hooks of each call of a block: what ``register_full_backward_pre_hook`` and
    ``register_full_backward_hook`` give, set up per call from its forward hooks, so that a call whose inputs need
    no gradient (the first block of a model with frozen embeddings: LoRA) gets the backward pre-hook alone, from
    its outputs' gradients, without torch's warning that a full backward hook fires early.

    ``before(module, grad_output)`` runs when the gradient of a call's output is ready, ``inputs_done(module,
    grad_input, grad_output)`` when the gradients of its inputs are (right after ``before`` when none needs one).
    """

    def __init__(self, before, inputs_done):
        self._before = before
        self._inputs_done = inputs_done
        self._calls: list[BackwardHook | None] = []  # the calls whose forward is running, innermost last

    def forward_began(self, module: nn.Module, args: tuple) -> tuple:
        """From the call's forward pre-hook: its arguments, those needing gradients wrapped to report them."""
        hook = None
        if torch.is_grad_enabled() and any(isinstance(a, torch.Tensor) and a.requires_grad for a in args):
            hook = BackwardHook(module, [self._inputs_done], [self._before])
            args = hook.setup_input_hook(args)
        self._calls.append(hook)
        return args

    def forward_ended(self, module: nn.Module, output):
        """From the call's forward hook: its output, wrapped to report its gradient (as it is when the call's
        forward pre-hook raised before :meth:`forward_began`)."""
        if not self._calls:
            return output
        hook = self._calls.pop()
        if hook is not None:
            return hook.setup_output_hook(output)
        outputs = output if isinstance(output, tuple) else (output,)
        needing = [t for t in outputs if isinstance(t, torch.Tensor) and t.requires_grad]
        if needing and torch.is_grad_enabled():
            fired = []

            def first_gradient(grad: torch.Tensor) -> None:
                if not fired:
                    fired.append(True)
                    self._before(module, (grad,))
                    self._inputs_done(module, (), (grad,))

            for t in needing:
                t.register_hook(first_gradient)
        return output


def _final_callback(passes: BackwardPasses, task: int):
    ref = weakref.ref(passes)

    def callback() -> None:
        live = ref()
        if live is not None:
            live.finish(task)

    return callback
