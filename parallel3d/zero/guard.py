"""A parameter whose values are not there yet, guarded against reads.

Between an optimizer step and the next forward, a parameter's bucket may be sharded
(ZeRO 3: the tensor is a view of 0 bytes of storage, and a kernel reading it crashes the
process) or all-gathered asynchronously (ZeRO 1/2 with the overlap: the other ranks' part
of the values is still arriving, and a read sees a torn mix of old and new weights). The
forward's own hooks wait for or gather what a module reads; this guards every other read.

:func:`guard` gives a parameter a subclass of its own class (made once per class) whose
``__torch_function__`` lets metadata through (shape, dtype, device, ``.grad``, hooks, the
storage's size) and, for anything else, first calls the parameter's ``on_read``: which
waits for its bucket and calls :func:`unguard` (ZeRO 1/2), or raises a one-line error
naming the way to gather (ZeRO 3, where gathering is a collective every rank must
join). :func:`unguard` restores the plain class, so the forward and backward pay nothing,
and autograd's own reads, in C++, never see the subclass.
"""

from __future__ import annotations

import torch
from torch.utils._pytree import tree_leaves

# Tensor methods and properties that read no element: a guarded parameter allows them.
_METADATA = {torch.Tensor.size, torch.Tensor.dim, torch.Tensor.numel, torch.Tensor.element_size,
             torch.Tensor.stride, torch.Tensor.storage_offset, torch.Tensor.is_contiguous,
             torch.Tensor.is_floating_point, torch.Tensor.is_complex, torch.Tensor.data_ptr,
             torch.Tensor.untyped_storage, torch.Tensor.register_hook,
             torch.Tensor.register_post_accumulate_grad_hook, torch.Tensor.requires_grad_,
             torch.Tensor.__hash__}
_METADATA |= {getattr(torch.Tensor, name).__get__ for name in (
    "shape", "ndim", "dtype", "device", "layout", "grad", "requires_grad", "is_leaf", "grad_fn",
    "is_meta", "is_cuda", "is_cpu", "nbytes", "itemsize", "_version")}
_METADATA |= {torch.Tensor.grad.__set__, torch.Tensor.grad.__delete__, torch.Tensor.requires_grad.__set__}
_GUARDED: dict[type, type] = {}


def _torch_function(cls, func, types, args=(), kwargs=None):
    kwargs = kwargs or {}
    if func in _METADATA:
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)
    for t in tree_leaves((args, kwargs)):
        if isinstance(t, torch.Tensor) and "_p3d_plain_class" in type(t).__dict__:
            t.__dict__["_p3d_on_read"](t, getattr(func, "__name__", str(func)))  # raises or unguards
    return func(*args, **kwargs)


def _guarded_class(cls: type) -> type:
    if cls not in _GUARDED:
        _GUARDED[cls] = type(f"Guarded{cls.__name__}", (cls,), {
            "__torch_function__": classmethod(_torch_function), "_p3d_plain_class": cls})
    return _GUARDED[cls]


def guard(p: torch.Tensor, on_read) -> None:
    """Until :func:`unguard`, a read of ``p``'s elements first calls ``on_read(p, what)``
    (``what``: the operation's name), which must raise or unguard ``p``."""
    p.__dict__["_p3d_on_read"] = on_read
    p.__class__ = _guarded_class(plain_class(p))


def unguard(p: torch.Tensor) -> None:
    p.__class__ = plain_class(p)


def plain_class(p: torch.Tensor) -> type:
    return type(p).__dict__.get("_p3d_plain_class", type(p))
