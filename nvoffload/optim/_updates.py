"""The two ways a chunk is updated: the fused Adam kernel, or the wrapped optimizer's own ``step``.

Both take an update request (chunk, gradient slice, hyperparameters, step
number, gradient scale), the chunk's state (its rows' typed views) and its
gradient in host memory, update the state in place and return the new weights
in the parameter's dtype (the master row for fp32, the weights themselves
without an fp32 master; a 16-bit buffer otherwise), which the caller moves to
the model. They also say how their state maps to a torch state dict (the codec).
"""

from __future__ import annotations

from collections import defaultdict

import torch

from nvoffload.device import Event
from nvoffload.optim._chunk_state import MASTERLESS, MAX_GENERIC_ROWS, Chunk, ChunkState
from nvoffload.optim._layout import LOW_PRECISION, Record
from nvoffload.optim.kernels import adam_step

ADAM_KEYS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")
_ROWS_KEY = "__rows__"  # in a generic optimizer's chunk scalars: the state keys held in rows 1, 2, ...
# torch optimizers whose update is elementwise: their state can be split into chunks.
_ELEMENTWISE = ("SGD", "Adagrad", "Adadelta", "Adamax", "ASGD", "NAdam", "RAdam", "RMSprop", "Rprop")


class Request:
    """One chunk's work for the worker: its slice of the gradient (device memory, final at the compute
    stream's event ``ready``; None: the gradient kept in the store), the hyperparameters and step number
    to use, and the gradient scale. ``ready`` is recorded by the thread that queued the request (the
    hook's, or ``step()``'s); every copy the worker queues for the request waits for it.

    With released gradients (see :mod:`nvoffload.optim._released`) the gradient may also be summed with
    the one kept in the store (``add_kept``, the step's earlier micro-batches), kept in the store
    (``keep``, for the next micro-batch or a redone update), and ``update`` may be False (a micro-batch
    before the last: the gradient is only kept). Every request that reads a device gradient measures the
    norm of the resulting gradient into ``chunk.grad_norm``. A gradient reduced over ranks is read once
    ``comm.wait()`` returned (see :mod:`nvoffload.distributed`). ``kept``: which of the chunk's two kept
    gradients (:meth:`~nvoffload.optim._chunk_state.Chunk.kept_name`) it reads or writes.
    """

    __slots__ = ("chunk", "grad", "hparams", "step", "grad_scale", "ready", "add_kept", "keep", "update", "comm", "kept")

    def __init__(self, chunk: Chunk, grad: torch.Tensor | None, hparams: dict, step: int, grad_scale: float,
                 ready: Event | None, *, add_kept: bool = False, keep: bool = False, update: bool = True,
                 comm=None, kept: int = 0):  # fmt: skip
        self.chunk, self.grad, self.hparams, self.step, self.grad_scale = chunk, grad, hparams, step, grad_scale
        self.ready = ready
        self.add_kept, self.keep, self.update = add_kept, keep, update
        self.comm = comm
        self.kept = kept


def for_optimizer(optimizer: torch.optim.Optimizer, state_precision: str = "fp32") -> Update:
    """The update strategy for ``optimizer`` keeping Adam's state in ``state_precision`` (see
    :data:`~nvoffload.optim._layout.STATE_PRECISIONS`); raises ValueError for an optimizer whose state is not
    per element."""
    cls_names = {c.__name__ for c in type(optimizer).__mro__}
    if cls_names & {"LBFGS", "SparseAdam"}:
        raise ValueError(
            f"{type(optimizer).__name__} cannot be offloaded: its state is not per-parameter elementwise"
            " (LBFGS keeps a global history; SparseAdam needs sparse gradients)"
        )
    if cls_names & {"Adam", "AdamW"} and not cls_names & {"NAdam", "RAdam", "Adamax"}:
        return AdamUpdate(optimizer, state_precision)
    if state_precision != "fp32":
        raise ValueError(f"state_precision={state_precision!r} is for Adam and AdamW, not {type(optimizer).__name__}")
    return GenericUpdate(optimizer, elementwise=bool(cls_names & set(_ELEMENTWISE)))


class Update:
    """Updates one chunk in a slot; see the module docs."""

    adam = False
    elementwise = True

    def __init__(self, inner: torch.optim.Optimizer):
        self.inner = inner

    def __call__(self, req: Request, state: ChunkState, grad: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
        """Update ``state`` from ``req`` and the host gradient ``grad``; return the new weights:
        ``state.weights`` when they have the parameter's dtype (fp32, or bf16 without an fp32 master), else
        ``out`` (the chunk's size, the parameter's 16-bit dtype) filled."""
        self._step(req, state, grad, out)
        if state.weights.dtype == req.chunk.record.param.dtype:
            return state.weights
        return out

    def _step(self, req: Request, state: ChunkState, grad: torch.Tensor, out: torch.Tensor | None) -> None:
        """Update ``state``; a 16-bit parameter's new weights are written to ``out`` when they are not
        ``state.weights``."""
        raise NotImplementedError

    def check_group(self, group: dict) -> None:
        """Raise ValueError for a parameter group whose state cannot be offloaded."""

    def row_keys(self, rec: Record, nrows: int) -> tuple[str, ...]:
        """The state dict keys of rows 1, 2, ... of ``rec``'s committed state."""
        raise NotImplementedError

    def scalar_state(self, rec: Record) -> dict:
        """The non-row entries of ``rec``'s state dict entry (copies)."""
        raise NotImplementedError

    def parse(self, rec: Record, st: dict, nrows: int) -> tuple[list[torch.Tensor], dict, int]:
        """A state dict entry (without ``master_param``) as ``(row tensors, chunk scalars, step)``."""
        raise NotImplementedError


class AdamUpdate(Update):
    """Adam/AdamW on the fused native kernel: the master (or bf16 weights), ``exp_avg``, ``exp_avg_sq``
    (, ``max_exp_avg_sq``), fp32 or compact (``state_precision``).

    A compact state's entries in a state dict carry ``"state_precision"`` (its moments as fp32 tensors, as
    torch's); loading a state dict into an optimizer of another precision is refused."""

    adam = True

    def __init__(self, inner: torch.optim.Optimizer, state_precision: str = "fp32"):
        super().__init__(inner)
        self.state_precision = state_precision

    def check_group(self, group: dict) -> None:
        if group.get("differentiable", False):
            raise ValueError("differentiable=True cannot be offloaded")
        if self.state_precision != "fp32" and group.get("amsgrad", False):
            raise ValueError(f"amsgrad needs the fp32 state; state_precision={self.state_precision!r} keeps no fp32 maximum")
        if self.state_precision in MASTERLESS and any(p.dtype == torch.float16 for p in group["params"]):
            raise ValueError(
                f"state_precision={self.state_precision!r} updates bf16 weights by stochastic rounding; fp16"
                " parameters need an fp32 master: use state_precision='bf16-moments'"
            )

    def _step(self, req: Request, state: ChunkState, grad: torch.Tensor, out: torch.Tensor | None) -> None:
        hp = req.hparams
        rec = req.chunk.record
        b1, b2 = hp["betas"]
        adam_step(
            state.weights, grad, state.moments[0], state.moments[1],
            step=req.step, lr=hp["lr"], beta1=b1, beta2=b2, eps=hp["eps"],
            weight_decay=hp["weight_decay"],
            decoupled_weight_decay=bool(hp.get("decoupled_weight_decay", isinstance(self.inner, torch.optim.AdamW))),
            grad_scale=req.grad_scale, maximize=hp.get("maximize", False),
            param_out=out if state.weights.dtype != rec.param.dtype else None,
            max_exp_avg_sq=state.moments[2] if hp.get("amsgrad", False) else None,
            offset=req.chunk.start, tensor_numel=rec.param.numel(),
            sr_seed=rec.index << 32 | req.step,  # one per parameter and step: a redone update draws the same bits
            moment_exponents=None if state.exponents is None else state.exponents.view(-1),
        )  # fmt: skip

    def row_keys(self, rec: Record, nrows: int) -> tuple[str, ...]:
        return ADAM_KEYS[: 3 if rec.group.get("amsgrad", False) else 2]

    def scalar_state(self, rec: Record) -> dict:
        st = {"step": torch.tensor(float(rec.step))}
        if self.state_precision != "fp32":
            st["state_precision"] = self.state_precision
        return st

    def parse(self, rec: Record, st: dict, nrows: int) -> tuple[list[torch.Tensor], dict, int]:
        saved = st.get("state_precision", "fp32")
        if saved != self.state_precision:
            raise ValueError(
                f"the state of {rec.name} was saved with state_precision={saved!r}; this optimizer keeps"
                f" {self.state_precision!r}: load it into an optimizer made with state_precision={saved!r}"
            )
        keys = self.row_keys(rec, nrows)
        tensors = [st[k] for k in keys if k in st]
        if len(tensors) != len(keys):
            raise ValueError(f"state of {rec.name} lacks {keys}: has {sorted(st)}")
        return tensors, {}, int(float(st["step"]))


class GenericUpdate(Update):
    """Another torch optimizer: its own ``step`` on one chunk whose state tensors are views of the rows;
    its non-tensor state (and the keys of its rows) are the chunk's scalars."""

    def __init__(self, inner: torch.optim.Optimizer, *, elementwise: bool):
        super().__init__(inner)
        self.elementwise = elementwise

    def _step(self, req: Request, state: ChunkState, grad: torch.Tensor, out: torch.Tensor | None) -> None:
        rows = state.rows
        chunk, rec = req.chunk, req.chunk.record
        shape = rec.param.shape if chunk.numel == rec.param.numel() else (chunk.numel,)
        cp = rows[0].view(shape)
        cp.grad = (grad.float() * req.grad_scale if req.grad_scale != 1.0 else grad.float()).view(shape)
        state: dict = dict(chunk.scalars)
        for i, key in enumerate(state.pop(_ROWS_KEY, ())):
            state[key] = rows[1 + i].view(shape)
        row_items, scalars = self._split_state(self._inner_step(cp, dict(rec.group, **req.hparams), state), cp.shape)
        for i, (key, value) in enumerate(row_items):
            row = rows[1 + i]
            if value.data_ptr() != row.data_ptr():
                row.copy_(value.reshape(-1))
        scalars[_ROWS_KEY] = tuple(key for key, _ in row_items)
        chunk.pending_scalars = scalars
        if rec.param.dtype in LOW_PRECISION:
            out.copy_(rows[0])

    def _inner_step(self, cp: torch.Tensor, group: dict, state: dict) -> dict:
        """The wrapped optimizer's ``step`` on the single tensor ``cp`` (its ``grad`` set) with ``group``'s
        hyperparameters, starting from ``state``; returns the new state."""
        inner = self.inner
        saved_groups, saved_state = inner.param_groups, inner.state
        try:
            inner.param_groups = [dict(group, params=[cp])]
            inner.state = defaultdict(dict, {cp: state} if state else {})
            inner.step()
            return inner.state[cp]
        finally:
            inner.param_groups, inner.state = saved_groups, saved_state
            cp.grad = None

    def _split_state(self, state: dict, shape: torch.Size) -> tuple[list[tuple[str, torch.Tensor]], dict]:
        """A generic optimizer's state as (key, tensor) rows shaped like the parameter, and scalars;
        raises ValueError for state that cannot be split into chunks."""
        name = type(self.inner).__name__
        rows, scalars = [], {}
        for key, value in state.items():
            if not isinstance(value, torch.Tensor) or value.numel() <= 1:
                scalars[key] = value.clone() if isinstance(value, torch.Tensor) else value
            elif value.shape != shape:
                raise ValueError(
                    f"{name} state {key!r} of shape {tuple(value.shape)} cannot be offloaded:"
                    f" only tensors shaped like the parameter {tuple(shape)} and scalars are supported"
                )
            elif value.dtype != torch.float32:
                raise ValueError(f"{name} state {key!r} of dtype {value.dtype} cannot be offloaded (fp32 only)")
            elif len(rows) + 1 >= MAX_GENERIC_ROWS:
                raise ValueError(f"{name} keeps more than {MAX_GENERIC_ROWS - 1} tensors per parameter: cannot be offloaded")
            else:
                rows.append((key, value))
        return rows, scalars

    def check_group(self, group: dict) -> None:
        """Refuse state that cannot be split into chunks: two trial steps on a small fp32 stand-in of
        each parameter rank in the group, with the group's hyperparameters."""
        for ndim in sorted({p.dim() for p in group["params"]}):
            cp = torch.zeros(tuple(range(2, 2 + ndim)), requires_grad=True)
            state: dict = {}
            for _ in range(2):
                cp.grad = torch.full_like(cp, 0.1)
                state = self._inner_step(cp, group, state)
                self._split_state(state, cp.shape)

    def row_keys(self, rec: Record, nrows: int) -> tuple[str, ...]:
        return rec.chunks[0].scalars.get(_ROWS_KEY, ())

    def scalar_state(self, rec: Record) -> dict:
        return {
            k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in rec.chunks[0].scalars.items() if k != _ROWS_KEY
        }

    def parse(self, rec: Record, st: dict, nrows: int) -> tuple[list[torch.Tensor], dict, int]:
        tensors, keys, scalars = [], [], {}
        for k, v in st.items():
            if k == "master_param":
                continue
            if isinstance(v, torch.Tensor) and v.shape == rec.param.shape and v.numel() > 1:
                tensors.append(v)
                keys.append(k)
            else:
                scalars[k] = v
        scalars[_ROWS_KEY] = tuple(keys)
        step = st.get("step", 0)
        return tensors, scalars, int(float(step)) if isinstance(step, (int, float, torch.Tensor)) else 0
