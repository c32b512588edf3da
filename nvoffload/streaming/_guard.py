"""Streamed parameters off the device: no bytes behind them, and every read refused with a clear error.

While its block is off the device, a streamed parameter's storage is resized to
zero bytes (autograd's saved views of it see the weights again once the block is
back). Reading such a tensor would read freed memory, so the parameter's class is
switched to :class:`OffDeviceParameter` meanwhile: still an ``nn.Parameter``, the
same object with the same shape, dtype, device, ``requires_grad``, ``grad`` and
hooks, but its ``__torch_function__`` lets through only what reads no weights
and raises :class:`StreamedParameterError` for the rest. Back on the device it
is a plain ``nn.Parameter`` again, so forward and backward pay nothing for this.

What passes: metadata (shape, dtype, device, strides, ``untyped_storage()``...),
``grad`` and ``requires_grad``, hook registration, the ``*_like``/``new_*``
factories (they read no values), conversions that change nothing
(``model.to(device)`` where it already is), ``repr()`` (a description), and
``detach()``/``.data``, which give a tensor guarded the same way (so that
``state_dict()`` can collect the parameter before the streamer's hook replaces
the entry with the weights). Interception covers Python-level torch calls;
autograd's own C++ code never sees the class, which is why the streamer brings a
block back before backward reaches it.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

__all__ = [
    "StreamedParameterError", "Placement", "attach", "attach_all", "closed_error", "guard", "guard_all", "unguard",
    "unguard_all",
]

_ALLOWED_GET = frozenset({
    "shape", "dtype", "device", "layout", "ndim", "itemsize", "nbytes", "name", "names", "output_nr",
    "requires_grad", "grad", "_grad", "grad_fn", "_grad_fn", "is_leaf", "retains_grad", "_version", "_base",
    "_backward_hooks", "_post_accumulate_grad_hooks", "_cdata", "_python_dispatch", "_has_symbolic_sizes_strides",
    "is_cpu", "is_cuda", "is_meta", "is_mkldnn", "is_mps", "is_nested", "is_quantized", "is_sparse", "is_sparse_csr",
    "is_xla", "is_xpu",
})  # fmt: skip
_ALLOWED_SET = frozenset({"grad", "requires_grad", "_backward_hooks", "_post_accumulate_grad_hooks"})
_T = torch.Tensor
_ALLOWED_CALLS = frozenset({
    _T.size, _T.dim, _T.ndimension, _T.numel, _T.nelement, _T.element_size, _T.stride, _T.storage_offset,
    _T.is_contiguous, _T.is_floating_point, _T.is_complex, _T.is_signed, _T.get_device, _T.untyped_storage,
    _T.data_ptr, _T.is_pinned, _T.is_shared, _T._is_view, _T.__len__, _T.__hash__, _T.requires_grad_,
    _T.register_hook, _T.register_post_accumulate_grad_hook, _T.retain_grad,
    _T.new_empty, _T.new_zeros, _T.new_ones, _T.new_full, _T.new_tensor,
    torch.empty_like, torch.zeros_like, torch.ones_like, torch.full_like, torch.rand_like, torch.randn_like,
    torch.is_floating_point, torch.is_complex, torch.numel, torch._has_compatible_shallow_copy_type,
})  # fmt: skip
_CONVERSIONS = frozenset({_T.to, _T.cuda, _T.cpu, _T.float, _T.double, _T.half, _T.bfloat16, _T.type})
_DESCRIBE = frozenset({_T.__repr__, _T.__format__})


class StreamedParameterError(RuntimeError):
    """A streamed parameter's weights were read while its block was off the device (or after the streamer closed)."""


class Placement:
    """What a guarded tensor stands for: a parameter's name and block, and whether its streamer is still open.

    One per parameter; the streamer sets ``closed`` (on all of them) when it closes.
    """

    __slots__ = ("name", "block", "home_class", "closed")

    def __init__(self, name: str, block: int, home_class: type):
        self.name = name
        self.block = block
        self.home_class = home_class  # the parameter's own class, given back on the device
        self.closed = False

    def describe(self) -> str:
        return f"parameter {self.name} (parameter block {self.block})"

    def error(self, what: str) -> StreamedParameterError:
        if self.closed:
            return closed_error(f"{what} {self.describe()}, but")
        return StreamedParameterError(
            f"{what} {self.describe()} while its block is off the device (its storage holds no bytes): read the "
            "weights with streamer.weights.gather(param) (the ParameterStreamer's) or the module's state_dict(), or inside the block's forward"
        )


def closed_error(what: str) -> StreamedParameterError:
    """``what`` needs streamed weights that went with a closed streamer."""
    return StreamedParameterError(
        f"{what} the ParameterStreamer that held its weights is closed and they went with it: save them "
        "before close() with save_checkpoint() or state_dict()"
    )


def _placement(tensor: torch.Tensor) -> Placement:
    return tensor.__dict__["_nvoffload_placement"]


def _guarded_torch_function(cls, func, types, args=(), kwargs=None):
    kwargs = kwargs or {}
    if args and isinstance(args[0], _GUARDED):  # a method or attribute of the guarded tensor: most calls
        guarded = args[0]
    else:
        guarded = next((t for t in tree_leaves((args, kwargs)) if isinstance(t, _GUARDED)), None)
    if guarded is None:
        if args and isinstance(args[0], torch.Tensor) and "_nvoffload_placement" in args[0].__dict__:
            # Its block came back to the device (unguard(), on another thread: the optimizer's worker reads the
            # parameter's metadata) between this call's dispatch to the guard and now: a plain parameter again.
            return _plain(func, args, kwargs)
        # inside a structure pytree does not open
        raise StreamedParameterError(f"{getattr(func, '__name__', func)}() read a streamed parameter that is off the device")
    placement = _placement(guarded)
    descriptor = getattr(func, "__self__", None)
    if type(descriptor).__name__ == "getset_descriptor":  # an attribute of torch.Tensor
        name = descriptor.__name__
        if func.__name__ == "__get__" and name in _ALLOWED_GET:
            return _plain(func, args, kwargs)
        if func.__name__ == "__set__" and name in _ALLOWED_SET:
            return _plain(func, args, kwargs)
        if name == "data" and func.__name__ == "__get__":
            return _detached(args[0], placement)
        if name == "data" and args[1] is args[0]:  # model.to() that changes nothing sets param.data = param
            return None
        raise placement.error(f"{'setting' if func.__name__ == '__set__' else 'reading'} .{name} of")
    if func in _ALLOWED_CALLS:
        return _plain(func, args, kwargs)
    if func is _T.detach:
        return _detached(args[0], placement)
    if func in _DESCRIBE:
        return f"<{placement.describe()}: off the device, shape {tuple(args[0].shape)}, {args[0].dtype}>"
    if func in _CONVERSIONS and args and args[0] is guarded:
        proxy = _plain(torch.empty, (0,), {"dtype": guarded.dtype, "device": guarded.device})
        try:
            converted = func(proxy, *args[1:], **kwargs)
        except Exception as e:
            raise placement.error(f"{func.__name__}() of") from e
        if converted is proxy:  # nothing to move or convert
            return guarded
        if isinstance(converted, str):  # .type() with no arguments
            return converted
        raise placement.error(f"{func.__name__}() (moving or converting, as model.to() does) of")
    raise placement.error(f"{getattr(func, '__name__', func)}() read")


def _plain(func, args, kwargs):
    with torch._C.DisableTorchFunctionSubclass():
        return func(*args, **kwargs)


def _detached(tensor: torch.Tensor, placement: Placement) -> torch.Tensor:
    with torch._C.DisableTorchFunctionSubclass():
        alias = tensor.detach().as_subclass(OffDeviceTensor)
    alias.__dict__["_nvoffload_placement"] = placement
    return alias


class OffDeviceParameter(nn.Parameter):
    """The class of a streamed parameter while its block is off the device (see the module docstring)."""

    __torch_function__ = classmethod(_guarded_torch_function)


class OffDeviceTensor(torch.Tensor):
    """``detach()`` or ``.data`` of an :class:`OffDeviceParameter`: guarded the same way, for good."""

    __torch_function__ = classmethod(_guarded_torch_function)


_GUARDED = (OffDeviceParameter, OffDeviceTensor)


def attach(param: nn.Parameter, name: str, block: int) -> Placement:
    """``param``'s :class:`Placement`, attached to it (its class is remembered for :func:`unguard`)."""
    place = Placement(name, block, type(param))
    param.__dict__["_nvoffload_placement"] = place
    return place


def guard(param: nn.Parameter) -> None:
    """Refuse reads of ``param`` from now on (its storage is about to hold no bytes); needs :func:`attach` first."""
    param.__class__ = OffDeviceParameter


def unguard(param: nn.Parameter) -> None:
    """``param`` holds its weights again: its own class back."""
    param.__class__ = _placement(param).home_class


def attach_all(
    params: list[nn.Parameter], names: list[str], block: int
) -> tuple[list[Placement], list[tuple[nn.Parameter, type]]]:
    """:func:`attach` each of ``params`` (named ``names``, of block ``block``) and :func:`guard_all` them: their
    placements, and each with its own class, for :func:`unguard_all` (found once, not per call)."""
    placements = [attach(p, name, block) for p, name in zip(params, names)]
    homes = [(p, place.home_class) for p, place in zip(params, placements)]
    guard_all(params)
    return placements, homes


def guard_all(params: list[nn.Parameter]) -> None:
    """:func:`guard` each of ``params`` (one call for a block's parameters: it runs in every block's hooks)."""
    for p in params:
        p.__class__ = OffDeviceParameter


def unguard_all(homes: list[tuple[nn.Parameter, type]]) -> None:
    """:func:`unguard` each parameter of ``homes`` (from :func:`attach_all`)."""
    for p, home in homes:
        p.__class__ = home
