"""``parallel3d train RECIPE --dry-run``: check a whole job without starting it.

Runs every check the workers would run, at the recipe's own world size
(``launch.nnodes * launch.nproc``, or torchrun's ``WORLD_SIZE``), builds the model on the
meta device (shapes only: no weight is allocated), and prints the layout, the stage split
and the planner's per-rank memory estimate. It creates no process group and starts no
worker, so a 512-rank job checks in about a second.
"""

from __future__ import annotations

import torch

from parallel3d.config import JobConfig
from parallel3d.models.llama import Llama
from parallel3d.planner.memory import memory_per_stage
from parallel3d.planner.spec import Layout, Workload, layer_split, rank_chunks
from parallel3d.topology import RankGrid
from parallel3d.train.setup import check_job, resolve_model_config

GiB = 2**30


def memory_dtype(cfg: JobConfig) -> str:
    """The precision the job will train in: ``train.dtype``, with ``auto`` resolved as the
    trainer does (bf16 on CUDA, which ``launch.backend = "nccl"`` implies; fp32 on CPU)."""
    if cfg.train.dtype != "auto":
        return cfg.train.dtype
    on_cuda = cfg.launch.backend == "nccl" or (cfg.launch.backend == "auto" and torch.cuda.is_available())
    return "bf16" if on_cuda else "fp32"


def dry_run(cfg: JobConfig, world_size: int, out=print) -> dict:
    """Check ``cfg`` at ``world_size`` and report; returns what it found (for tests)."""
    model_cfg = resolve_model_config(cfg.model)
    check_job(cfg, model_cfg, world_size)
    par, train = cfg.parallel, cfg.train
    grid = RankGrid(tp=par.tp, pp=par.pp, dp=par.dp)
    with torch.device("meta"):
        model = Llama(model_cfg)
    n_params = sum(p.numel() for p in model.parameters())

    layout = Layout.from_config(cfg)
    work = Workload(model_cfg, train.seq_len, train.global_batch, memory_dtype(cfg))
    # The stage split training will use: parallel.pp_layers, else the pipeline's rule.
    split = layer_split(model_cfg, par.pp, par.virtual_stages, par.pp_layers)
    stages = memory_per_stage(work, layout, split)

    nodes = cfg.launch.nnodes
    out(f"dry run: {world_size} ranks ({nodes} node{'s' if nodes > 1 else ''} x {world_size // nodes}), "
        f"model {n_params / 1e9:.3f}B parameters (built on the meta device, nothing allocated)")
    out(f"layout: tp {par.tp} x pp {par.pp} x dp {par.dp}; schedule {par.schedule}"
        f"{f' x{par.virtual_stages} virtual stages' if par.virtual_stages > 1 else ''}; zero {par.zero}; "
        f"recompute {train.recompute}; sequence parallel {'on' if par.sequence_parallel else 'off'}")
    out(f"batch: {train.global_batch} sequences of {train.seq_len} tokens per step = "
        f"{layout.n_micro(work)} micro-batches of {train.micro_batch} per dp rank; precision {work.dtype}")
    out("stage split" + (" (parallel.pp_layers)" if par.pp_layers else " (balanced rule)") + ":")
    first = 0
    bounds = []
    for n in split:
        bounds.append((first, first + n - 1))
        first += n
    for r in range(par.pp):
        chunks = rank_chunks(r, par.pp, par.virtual_stages)
        spans = ", ".join(f"layer {lo}" if lo == hi else f"layers {lo}-{hi}"
                          for lo, hi in (bounds[c] for c in chunks))
        ranks = grid.group_ranks("dp", grid.rank_of(0, r, 0))
        extra = (" + embedding" if 0 in chunks else "") + (" + head" if layout.chunks - 1 in chunks else "")
        out(f"  stage {r} (ranks {ranks[0]}..{ranks[-1] + par.tp - 1}): {spans}{extra}")
    out("memory per rank (planner estimate, before the GPU fragmentation margin):")
    for s in stages:
        phase, states, acts, buffers = s.breakdown()
        out(f"  stage {s.stage}: peak {s.peak / GiB:.2f} GiB in the {phase} = model states {states / GiB:.2f} GiB "
            f"({s.params / 1e6:,.1f}M params) + activations {acts / GiB:.2f} GiB "
            f"({s.in_flight:g} in flight) + buffers {buffers / GiB:.2f} GiB")
    return {"world_size": world_size, "model": model, "split": split, "stages": stages}
