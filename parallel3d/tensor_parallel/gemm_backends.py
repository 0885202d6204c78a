"""``parallel.linear_backend = "auto"``: one measured table of Triton-or-cuBLAS for all ranks.

Under "auto" a GEMM runs Triton only if ``parallel3d.kernels.gemm`` finds it in the
process's backend table as measured at least as fast as cuBLAS for that GPU model, kind
(fwd / dgrad / wgrad), dtype and (M, N, K); anything else runs torch. Ranks that measured
on their own could disagree (noise) and then sum in different orders. So:

1. every rank lists the (M, N, K) of its tensor-parallel layers (:func:`linear_gemm_shapes`)
   and the lists are gathered, so rank 0 knows the shapes of every pipeline stage;
2. rank 0 measures the shapes its table lacks (``measure_linear_backends``: CUDA-event
   medians of both backends on the same operands);
3. rank 0 broadcasts its backend table and its Triton tile table; every rank replaces its
   own with them. A measurement that fails on rank 0 is reported by every rank and leaves
   those shapes on torch; nobody waits forever.

On CPU nothing is measured and "auto" is torch. :func:`prepare_linear_backends` is what
the trainer calls once, after the model is on its device.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.distributed as dist

from parallel3d.kernels import _matmul_common as tables
from parallel3d.kernels.gemm import measure_linear_backends

from .layers import ColumnParallelLinear, RowParallelLinear


def linear_gemm_shapes(model: torch.nn.Module, tokens: int) -> list[tuple[int, int, int]]:
    """(M, N, K) of each distinct tensor-parallel linear layer with backend "auto" in
    ``model``: M = ``tokens`` per micro-batch (the whole sequence: column-parallel layers
    gather it, row-parallel ones reduce-scatter after their GEMM), W (N, K)."""
    shapes = set()
    for module in model.modules():
        if isinstance(module, (ColumnParallelLinear, RowParallelLinear)) and module.backend == "auto":
            n, k = module.weight.shape
            shapes.add((tokens, n, k))
    return sorted(shapes)


def _measure_missing(shapes, dtype, device, measure, device_name) -> str:
    """Measure on this rank every shape its table lacks; '' or the error, in one line."""
    name = device_name or torch.cuda.get_device_name(device)
    try:
        for m, n, k in shapes:
            if not tables.choice_key(name, "fwd", dtype, m, n, k) in tables.backend_choices():
                measure(m, n, k, dtype, device, device_name=name)
    except Exception as err:  # noqa: BLE001 - reported on every rank, never a hang
        return f"{type(err).__name__}: {err}".splitlines()[0]
    return ""


def agree_on_gemm_backends(shapes, dtype: torch.dtype, device, group=None, *,
                           measure=measure_linear_backends, device_name: str | None = None) -> dict:
    """Rank 0 of ``group`` (the world by default) measures the union of every rank's
    ``shapes`` and every rank adopts its tables. Returns the backend table.

    ``measure(m, n, k, dtype, device, device_name=...)`` records its choices in
    ``parallel3d.kernels._matmul_common`` (tests inject a fake timer through it)."""
    distributed = dist.is_initialized() and dist.get_world_size(group) > 1
    all_shapes = [list(shapes)]
    if distributed:
        all_shapes = [None] * dist.get_world_size(group)
        dist.all_gather_object(all_shapes, list(shapes), group=group)
    union = sorted({tuple(s) for rank_shapes in all_shapes for s in rank_shapes})
    first = dist.get_global_rank(group, 0) if distributed and group is not None else 0
    is_first = not distributed or dist.get_rank() == first
    error = _measure_missing(union, dtype, device, measure, device_name) if is_first else ""
    payload = [(tables.backend_choices(), tables.tuned_configs(), error)]
    if distributed:
        dist.broadcast_object_list(payload, src=first, group=group)
    choices, tiles, error = payload[0]
    tables.load_backend_choices(choices)
    tables.load_tuned_configs(tiles)
    if error:
        print(f"parallel3d: warning: measuring Triton against cuBLAS failed on rank {first} "
              f"({error}); the GEMMs it did not measure run torch's", flush=True)
    return choices


def prepare_linear_backends(model: torch.nn.Module, parallel_cfg, train_cfg, tp: int,
                            device: torch.device, group=None) -> dict | None:
    """Measure and agree on the GEMM backends of ``model`` if "auto" can pick Triton here:
    tp > 1 (only the tensor-parallel layers use these GEMMs), linear_backend "auto", a
    CUDA device. Every rank must call it (it is collective). The GEMMs run in bf16 under
    ``train.dtype`` bf16 or auto on CUDA, else in fp32; the weight gradient is timed as
    training runs it: added into an fp32 ``main_grad`` where the gradient buffer gives the
    layers one (low-precision weights at ZeRO 0 and 1, ``zero/grads.py``).

    Call it before the optimizer allocates (the model may still be on the meta device:
    only the weights' shapes are read), so that rank 0's timing temporaries (the head's
    output at M tokens is GBs) do not add to the model state's peak."""
    if tp == 1 or parallel_cfg.linear_backend != "auto" or device.type != "cuda":
        return None
    dtype = torch.bfloat16 if train_cfg.dtype in ("bf16", "auto") else torch.float32
    fuse = dtype != torch.float32 and parallel_cfg.zero in (0, 1)
    shapes = linear_gemm_shapes(model, train_cfg.micro_batch * train_cfg.seq_len)
    return agree_on_gemm_backends(shapes, dtype, device, group,
                                  measure=partial(measure_linear_backends, fuse_main_grad=fuse))
