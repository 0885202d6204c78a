"""What a rank holds of each logical tensor, and the small per-rank states (RNG).

:func:`param_placements` reads the attributes ``parallelize`` leaves on each parameter
(``p3d_tp_dim``, ``p3d_tp_range``: the tensor-parallel split, the vocabulary padding
included; ``p3d_norm_owner``: one holder among replicas) and says, for every parameter of
this rank, which block of which logical tensor it is and whether this rank writes it.
The optimizer adapters (:mod:`parallel3d.checkpoint.optim_state`) describe their state in
the same terms, flat ranges included, so saving and loading never ask which parallelism
is on.
"""

from __future__ import annotations

import base64
import math
import random
from dataclasses import dataclass

import numpy as np
import torch

from .errors import CheckpointError


@dataclass(frozen=True)
class Placement:
    """Parameter ``name`` (unsplit-model name) of logical ``shape``: this rank holds the
    block ``[offsets, offsets + block)`` (which may reach past ``shape``: padding)."""

    name: str
    shape: tuple[int, ...]
    offsets: tuple[int, ...]
    block: tuple[int, ...]
    writer: bool  # the one holder among all replicas (dp, shared tp shards, tied stages) that saves it
    owner: bool = True  # the one holder among the model-parallel replicas (dp aside): saves
    # its flat (ZeRO) shards, which differ over dp and are equal over those replicas

    def clipped(self) -> tuple[int, ...]:
        """The part of the block inside the logical tensor."""
        return tuple(max(0, min(b, s - o)) for o, b, s in zip(self.offsets, self.block, self.shape))


@dataclass
class Slot:
    """A local tensor to save: all of ``placement``'s block, or with ``flat`` the
    elements ``[lo, hi)`` of the flattened block (``tensor`` is then 1-D)."""

    name: str  # logical tensor name, e.g. "optim/exp_avg/layers.0.mlp.up_proj.weight"
    placement: Placement
    tensor: torch.Tensor
    flat: tuple[int, int] | None = None


def logical_shapes(model_cfg) -> dict[str, tuple[int, ...]]:
    """Parameter name -> shape in the unsplit model (built on the meta device: no memory)."""
    from parallel3d.models.llama import Llama

    with torch.device("meta"), _NoInit():
        model = Llama(model_cfg)
    return {n: tuple(p.shape) for n, p in model.named_parameters()}


class _NoInit(torch.overrides.TorchFunctionMode):
    """Skips in-place initialisation while building on the meta device for shapes: a meta
    ``normal_`` goes through torch's reference implementations, whose first use imports
    torch._dynamo (seconds, for values nobody reads)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        target = args[0] if args else kwargs.get("tensor", kwargs.get("self"))
        if getattr(func, "__name__", "") in _INIT_OPS and isinstance(target, torch.Tensor) and target.is_meta:
            return target
        return func(*args, **kwargs)


_INIT_OPS = {"normal_", "uniform_", "fill_", "zero_", "kaiming_uniform_", "trunc_normal_", "ones_", "zeros_"}


def logical_param_name(name: str, model_cfg) -> str:
    """A pipeline stage that holds the tied output head names it ``lm_head.weight``; the
    unsplit model (and Hugging Face) stores that tensor once, as the embedding."""
    if model_cfg.tie_embeddings and name == "lm_head.weight":
        return "embed_tokens.weight"
    return name


def param_placements(model: torch.nn.Module, model_cfg, dp_rank: int = 0, dp: int = 1,
                     expert_replicas: tuple[int, int] | None = None) -> dict[int, Placement]:
    """``id(param) -> Placement`` for every parameter of this rank's model part.

    A parameter held by several tensor- or pipeline-parallel ranks (a replicated norm,
    kv-heads shared when tp > n_kv_heads, the tied embedding on the last stage) is saved
    by the holder ``parallelize`` marks as its owner (``p3d_norm_owner``); replicated over
    the data-parallel ranks, by one of them in turn (parameter i by dp rank i mod dp), so
    writing is spread over all ranks. A routed expert under expert parallelism
    (``p3d_expert``) is replicated over its expert-data-parallel ranks only:
    ``expert_replicas`` = (rank, size) among them (default: as the dense weights). A LoRA
    factor (``p3d_lora``, not in the base model) is its own logical tensor, its shape read
    from its block and split (``p3d_tp_full`` along ``p3d_tp_dim``)."""
    shapes = logical_shapes(model_cfg)
    out: dict[int, Placement] = {}
    for i, (name, p) in enumerate(model.named_parameters()):
        logical = logical_param_name(name, model_cfg)
        dim = getattr(p, "p3d_tp_dim", None)
        if getattr(p, "p3d_lora", False):  # a LoRA factor: whole, or split as its layer's in or out side
            shape = tuple(p.p3d_tp_full if d == dim else n for d, n in enumerate(p.shape))
        elif logical not in shapes:
            raise CheckpointError(f"parameter {name} is not part of the model {model_cfg}")
        else:
            shape = shapes[logical]
        offsets = [0] * p.ndim
        if dim is not None:
            offsets[dim] = int(p.p3d_tp_range[0])
        block = tuple(p.shape)
        for d, (b, s) in enumerate(zip(block, shape)):
            if d != dim and b != s:
                raise CheckpointError(f"parameter {name} has shape {block}, the model's is {shape}")
        owner = bool(getattr(p, "p3d_norm_owner", True))
        rank, size = (dp_rank, dp)
        if expert_replicas is not None and getattr(p, "p3d_expert", False):
            rank, size = expert_replicas
        out[id(p)] = Placement(logical, shape, tuple(offsets), block, owner and i % size == rank, owner)
    return out


def clip_to_shape(t: torch.Tensor, pl: Placement) -> torch.Tensor:
    """The in-bounds part of a block-shaped tensor (drops vocabulary padding rows)."""
    c = pl.clipped()
    if c == tuple(t.shape):
        return t
    return t[tuple(slice(0, n) for n in c)]


def read_block(source, name: str, pl: Placement, dtype: torch.dtype, device,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """A block-shaped tensor of logical ``name`` for placement ``pl``: the in-bounds part
    read from ``source`` (anything with ``read_region``), padding zero. With ``out`` (the
    parameter itself, say) it is filled in place: the only transient is the part read."""
    c = pl.clipped()
    if out is None:
        out = torch.zeros(pl.block, dtype=dtype, device=device)
    elif tuple(c) != tuple(out.shape):
        out.zero_()  # padding rows (a vocabulary padded to a multiple of tp)
    if math.prod(c):
        part = source.read_region(name, pl.offsets, c)
        out[tuple(slice(0, n) for n in c)] = part.to(device=device, dtype=out.dtype)
    return out


# -- RNG states (per rank, JSON) -------------------------------------------------------------
def _b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.numpy().tobytes()).decode("ascii")


def _unb64(s: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8).clone()


def rng_state() -> dict:
    """Python, NumPy (legacy global), torch CPU and CUDA generator states, JSON-able."""
    version, state, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    out = {"python": [version, list(state), gauss],
           "numpy": {"kind": kind, "keys": keys.tolist(), "pos": int(pos),
                     "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
           "torch_cpu": _b64(torch.get_rng_state())}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["torch_cuda"] = [_b64(s) for s in torch.cuda.get_rng_state_all()]
    return out


def set_rng_state(state: dict) -> None:
    version, values, gauss = state["python"]
    random.setstate((version, tuple(values), gauss))
    n = state["numpy"]
    np.random.set_state((n["kind"], np.asarray(n["keys"], dtype=np.uint32), n["pos"],
                         n["has_gauss"], n["cached_gaussian"]))
    torch.set_rng_state(_unb64(state["torch_cpu"]))
    cuda = state.get("torch_cuda")
    if cuda and torch.cuda.is_available():
        states = [_unb64(s) for s in cuda]
        if len(states) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(states)
