"""The fixed choices of the job config (its ``Literal`` fields) and their one check.

:func:`choice` refuses a value outside a choice in one line, naming the key and the
allowed values, with a did-you-mean for a string; ``config.py`` calls it while a config
loads, and :func:`checks_choices` makes every section's dataclass call it as an instance
is built.
"""

from __future__ import annotations

import dataclasses
import functools
import typing
from typing import Any, Literal

from parallel3d.errors import UserError, did_you_mean

# Fixed choices. Loading a config, and building a section in code, refuse any other value
# in one line with the allowed ones (and a did-you-mean), so the code dispatching on a
# choice needs no check of its own; the tables it dispatches through must hold exactly
# these values (tests/test_config.py).
Schedule = Literal["gpipe", "1f1b", "interleaved", "zb-h1", "zb-v"]  # pipeline.schedules.SCHEDULES
LinearBackend = Literal["auto", "triton", "torch"]  # kernels.gemm.BACKENDS
CpComm = Literal["auto", "allgather", "ring"]  # context_parallel attention modes
ZeroStage = Literal[0, 1, 2, 3]
ReduceDtype = Literal["fp32", "bf16"]  # zero.grads.REDUCE_DTYPES
Dtype = Literal["auto", "fp32", "bf16"]  # train.optim.STORAGE_DTYPES
Recompute = Literal["none", "full", "selective"]  # parallelize.RECOMPUTE, flops.RECOMPUTE_FLOPS
DataSource = Literal["stdlib", "prepared"]
Packing = Literal["auto", "concat", "documents", "whole"]  # data.packing.PACKINGS
Backend = Literal["auto", "nccl", "gloo"]
HostMemory = Literal["fast", "tight", "libc"]  # distributed.HOST_MEMORY
AutoOnOff = Literal["auto", "on", "off"]
OnNonfinite = Literal["skip", "stop"]


def checks_choices(cls):
    """Class decorator (under ``@dataclass``, which then calls the check from its
    ``__init__``): the section's ``Literal`` fields are checked when an instance is
    built, so a config assembled in code (or by ``dataclasses.replace``) fails in one line
    as a loaded one does, naming ``<section>.<key>`` (the section: the class name less
    ``Config``, lower case). A ``__post_init__`` of the section's own (deriving a value
    left unset from the checked choices) runs after them."""
    section = cls.__name__.removesuffix("Config").lower()
    derive = cls.__dict__.get("__post_init__")  # the section's own, run after the checks

    def __post_init__(self) -> None:
        for name, choices in _literal_fields(cls):
            choice(getattr(self, name), choices, f"{section}.{name}")
        if derive is not None:
            derive(self)

    cls.__post_init__ = __post_init__
    return cls


@functools.cache
def _literal_fields(cls) -> tuple[tuple[str, tuple], ...]:
    """(name, choices) of each ``Literal`` field of the dataclass ``cls``."""
    hints = typing.get_type_hints(cls)
    return tuple((f.name, typing.get_args(hints[f.name])) for f in dataclasses.fields(cls)
                 if typing.get_origin(hints[f.name]) is Literal)


def choice(value: Any, choices: tuple, where: str) -> Any:
    """``value`` if it is one of ``choices`` (of the same type: ``true`` is not 1), else a
    :class:`UserError` naming the key and the choices, with a did-you-mean for a string."""
    if any(type(value) is type(c) and value == c for c in choices):
        return value
    names = [str(c) for c in choices]
    strings = isinstance(value, str) and all(isinstance(c, str) for c in choices)
    hint = did_you_mean(value, names) if strings else ""
    raise UserError(f"{where} {value!r} is not supported{hint}: use {', '.join(names)}")
