"""A device that is not the CPU, for CPU-only tests: ``fakegpu``, torch's PrivateUse1 key
registered from Python (``torch.utils.backend_registration``), its tensors wrapping a
host tensor. It has the few operations a pipeline exchange needs (allocate, copy to and
from the host); no process-group backend is registered for it, so a collective or a
send/receive handed a ``fakegpu`` tensor fails, as gloo's transport fails on a CUDA pointer.

Registration is once per process and cannot be undone: call :func:`install` in worker
processes, not in the test process."""

from __future__ import annotations

import torch

NAME = "fakegpu"


class FakeGpuTensor(torch.Tensor):
    """A ``fakegpu`` tensor; its values live in ``self.host`` (a CPU tensor)."""

    __torch_function__ = torch._C._disabled_torch_function_impl  # results keep their own type

    @staticmethod
    def __new__(cls, host: torch.Tensor):
        out = torch._C._acc.create_empty_tensor(host.shape, host.dtype)
        out.__class__ = cls
        return out

    def __init__(self, host: torch.Tensor):
        self.host = host


def _host(t: torch.Tensor) -> torch.Tensor:
    return t.host if isinstance(t, FakeGpuTensor) else t


def _empty(size, *, dtype=None, layout=None, device=None, pin_memory=None, memory_format=None):
    return FakeGpuTensor(torch.empty(size, dtype=dtype or torch.get_default_dtype()))


def _empty_strided(size, stride, *, dtype=None, layout=None, device=None, pin_memory=None):
    return FakeGpuTensor(torch.empty_strided(size, stride, dtype=dtype or torch.get_default_dtype()))


def _copy_from(src, dst, non_blocking=False):
    _host(dst).copy_(_host(src))
    return dst


_installed = []


def install() -> str:
    """Register ``fakegpu`` in this process (again: a no-op); returns the device name."""
    if not _installed:
        from torch.utils.backend_registration import _setup_privateuseone_for_python_backend

        _setup_privateuseone_for_python_backend(NAME)
        lib = torch.library.Library("aten", "IMPL")
        lib.impl("empty.memory_format", _empty, "PrivateUse1")
        lib.impl("empty_strided", _empty_strided, "PrivateUse1")
        lib.impl("_copy_from", _copy_from, "PrivateUse1")
        _installed.append(lib)  # the registrations live as long as the library object
    return NAME
