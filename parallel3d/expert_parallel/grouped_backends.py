"""``backend="auto"`` for the experts' grouped GEMMs: one measured table for all ranks.

Under "auto" on CUDA a grouped GEMM runs what ``kernels/grouped_linear.py``'s table says
was measured faster for that GPU model, kind (fwd / dgrad / wgrad), dtype and expert stack
(G, N, K): Triton or the torch side (``torch._grouped_mm`` in bf16). Ranks that measured
on their own could disagree (noise) and sum in different orders, so, as
``parallel3d.tensor_parallel.gemm_backends`` does for the linear layers:

1. every rank lists the (G, R, N, K) of its experts' GEMMs and the lists are gathered;
2. rank 0 of the group measures the stacks its table lacks (``measure_grouped_backends``,
   R rows split evenly over the G experts);
3. rank 0 broadcasts its table and every rank replaces its own with it. A measurement
   that fails on rank 0 is reported by every rank and leaves those stacks on the
   unmeasured default; nobody waits forever.

On CPU "auto" is the per-expert loop and nothing is measured. Shapes come from the model
side (``models/moe``: G held experts, R = tokens x top-k arriving rows on average, N and K
of gate/up (ffn, dim) and down (dim, ffn)); this module imports no model.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from parallel3d.kernels import grouped_linear as grouped

__all__ = ["agree_on_grouped_backends"]


def _measure_missing(shapes, dtype, device, measure, device_name) -> str:
    """Measure on this rank every (G, R, N, K) whose stack its table lacks; '' or the error."""
    name = device_name or torch.cuda.get_device_name(device)
    try:
        for groups, rows, n, k in shapes:
            known = grouped.grouped_backend_choices()
            if any(grouped.choice_key(name, kind, dtype, groups, n, k) not in known for kind in grouped.KINDS):
                measure(groups, rows, n, k, dtype, device, device_name=name)
    except Exception as err:  # noqa: BLE001 - reported on every rank, never a hang
        return f"{type(err).__name__}: {err}".splitlines()[0]
    return ""


def agree_on_grouped_backends(shapes, dtype: torch.dtype, device, group=None, *,
                              measure=grouped.measure_grouped_backends, device_name: str | None = None) -> dict:
    """Rank 0 of ``group`` (the world by default) measures the union of every rank's
    ``shapes`` ((G, R, N, K) each) and every rank adopts its table; returns the table.
    Collective: every rank of ``group`` calls it. ``measure(G, R, N, K, dtype, device,
    device_name=...)`` records its choices in kernels/grouped_linear.py's table (tests
    inject a fake timer through it)."""
    distributed = dist.is_initialized() and dist.get_world_size(group) > 1
    all_shapes = [list(shapes)]
    if distributed:
        all_shapes = [None] * dist.get_world_size(group)
        dist.all_gather_object(all_shapes, list(shapes), group=group)
    union = sorted({tuple(int(v) for v in s) for rank_shapes in all_shapes for s in rank_shapes})
    first = dist.get_global_rank(group, 0) if distributed and group is not None else 0
    is_first = not distributed or dist.get_rank() == first
    error = _measure_missing(union, dtype, device, measure, device_name) if is_first else ""
    payload = [(grouped.grouped_backend_choices(), error)]
    if distributed:
        dist.broadcast_object_list(payload, src=first, group=group)
    choices, error = payload[0]
    grouped.load_grouped_backend_choices(choices)
    if error:
        print(f"parallel3d: warning: measuring the Triton grouped GEMM against torch failed on rank {first} "
              f"({error}); the expert GEMMs it did not measure run the unmeasured default", flush=True)
    return choices
