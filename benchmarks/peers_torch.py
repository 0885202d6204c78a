"""torch's own side: ``torch.distributed.pipelining`` schedules over the chunks our
planner cuts, DTensor tensor parallelism, and the two composed in 3D with data
parallelism (as torchtitan builds it). Each runner is executed on every rank of a pool
and returns a :class:`_common.Run`, as ``peers`` describes.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from _common import GlobalBatches, PeakMemory, Run, adamw, clip_global_norm, initial_model, job
from parallel3d.models.llama.parallelize import cross_entropy_loss
from peers import _device, _time_steps


def _adamw_per_kind(params, cfg) -> list:
    """AdamW over a DTensor-parallel module: foreach kernels do not mix DTensors and plain
    tensors, so one optimizer for each kind present."""
    from torch.distributed.tensor import DTensor

    kinds = ([p for p in params if isinstance(p, DTensor)], [p for p in params if not isinstance(p, DTensor)])
    return [adamw(group, cfg) for group in kinds if group]


@torch.no_grad()
def _clip_dtensor_grads(params, max_norm: float, tp_group, pp_group=None) -> None:
    """Global-norm clipping of a DTensor-parallel module: squares of tensor-sharded
    gradients summed over ``tp_group``, replicated ones counted once, then the stages of
    ``pp_group`` summed; every gradient scaled by ``min(1, max_norm / (norm + 1e-6))``."""
    from torch.distributed.tensor import DTensor, Shard

    local = [p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad for p in params]
    sharded = torch.zeros((), device=local[0].device)
    replicated = torch.zeros((), device=local[0].device)
    for p, g in zip(params, local):
        sq = g.float().pow(2).sum()
        if isinstance(p.grad, DTensor) and any(isinstance(pl, Shard) for pl in p.grad.placements):
            sharded += sq
        else:
            replicated += sq
    dist.all_reduce(sharded, group=tp_group)
    total = sharded + replicated
    if pp_group is not None:
        dist.all_reduce(total, group=pp_group)
    torch._foreach_mul_(local, float(torch.clamp(max_norm / (total.sqrt() + 1e-6), max=1.0)))



def run_torch_pipelining(layout: dict, steps: int, schedule: str = "Schedule1F1B",
                         stage_layout: dict | None = None, memory_run: bool = False, **job_kw) -> Run:
    """A ``torch.distributed.pipelining`` schedule (``schedule``: Schedule1F1B,
    ScheduleZBVZeroBubble, ScheduleInterleavedZeroBubble, ...) over the chunks our planner
    cuts for ``stage_layout`` (default ``layout``: the same layers per stage; zb-v's V
    placement for ScheduleZBVZeroBubble, the interleaved loop for the interleaved ones),
    AdamW on each rank's chunks, clipping by the norm over all stages."""
    import torch.distributed.pipelining as pipelining
    from torch.distributed.pipelining import PipelineStage

    from parallel3d.models.llama.parallelize import cut_pipeline_stages
    from parallel3d.pipeline.partition import rank_chunks
    from parallel3d.topology import Topology

    cfg = job(layout, steps, **job_kw)
    cut = job(stage_layout or layout, steps, **job_kw).parallel
    pp, rank = dist.get_world_size(), dist.get_rank()
    n_micro = cfg.train.global_batch // cfg.train.micro_batch
    data = GlobalBatches(cfg)
    device = _device()
    run = Run()
    with PeakMemory(device, tensors=memory_run) as mem:
        chunks = cut_pipeline_stages(initial_model(cfg), Topology(1, pp, 1), cut)
        ids = rank_chunks(rank, pp, cut.virtual_stages, cut.schedule)
        n_stages = pp * cut.virtual_stages
        stages = [PipelineStage(chunk.to(device), c, n_stages, device) for c, chunk in zip(ids, chunks)]
        cls = getattr(pipelining, schedule)
        # grads scaled by 1/n_micro
        sched = cls(stages if len(stages) > 1 else stages[0], n_micro, loss_fn=cross_entropy_loss)
        params = [p for chunk in chunks for p in chunk.parameters()]
        opt = adamw(params, cfg)
        first, last = 0 in ids, n_stages - 1 in ids

        def step(s: int) -> torch.Tensor:
            x, y = data(s)
            for p in params:
                p.grad = None
            losses: list[torch.Tensor] = []
            args = (x.to(device),) if first else ()
            kwargs = {"target": y.to(device), "losses": losses} if last else {}
            sched.step(*args, **kwargs)
            # The tail is timed from schedule.step's return, which leaves out its own work
            # after the last backward (scaling the gradients by 1/n_micro): in torch's favour.
            pipeline_done = time.perf_counter()
            clip_global_norm(params, cfg.train.grad_clip, group=dist.group.WORLD)
            opt.step()
            loss = torch.stack(losses).mean() if losses else torch.zeros((), device=device)
            owner = next(r for r in range(pp) if n_stages - 1 in rank_chunks(r, pp, cut.virtual_stages, cut.schedule))
            dist.broadcast(loss, src=owner)  # the loss lives on the last chunk's rank
            run.extra.setdefault("tail", []).append(time.perf_counter() - pipeline_done)
            return loss

        _time_steps(run, step, steps, device, mem)
    run.peak = mem.peak
    return run


def run_dtensor_tp(layout: dict, steps: int, memory_run: bool = False, **job_kw) -> Run:
    """torch's DTensor tensor parallelism (``parallelize_module`` with Colwise/Rowwise,
    vocab-parallel loss), tp = world size, gradient accumulation over the micro-batches."""
    from torch.distributed.tensor.parallel import loss_parallel

    from bench_tensor_parallel import _dtensor_model

    cfg = job(layout, steps, **job_kw)
    micro = cfg.train.micro_batch
    n_micro = cfg.train.global_batch // micro
    data = GlobalBatches(cfg)
    device = _device()
    run = Run()
    with PeakMemory(device, tensors=memory_run) as mem:
        model = _dtensor_model(initial_model(cfg).to(device), sequence_parallel=False)
        params = list(model.parameters())
        opts = _adamw_per_kind(params, cfg)

        def step(s: int) -> torch.Tensor:
            model.zero_grad(set_to_none=True)
            total = torch.zeros((), device=device)
            x, y = data(s)
            with loss_parallel():
                for i in range(0, x.shape[0], micro):
                    xb, yb = x[i:i + micro].to(device), y[i:i + micro].to(device)
                    loss = F.cross_entropy(model(xb).flatten(0, 1), yb.flatten()) / n_micro
                    loss.backward()
                    total += loss.detach().full_tensor()
            _clip_dtensor_grads(params, cfg.train.grad_clip, tp_group=dist.group.WORLD)
            for opt in opts:
                opt.step()
            return total

        _time_steps(run, step, steps, device)
    run.peak = mem.peak
    return run


def _tp_plan(chunk, tp_mesh) -> None:
    """torchtitan's tensor-parallel plan (no sequence parallelism) on a pipeline chunk:
    whichever of embedding / layers / head the chunk holds; the head's logits stay
    vocab-sharded for ``loss_parallel``."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    top = {}
    if chunk.embed_tokens is not None:
        top["embed_tokens"] = RowwiseParallel(input_layouts=Replicate())
    if chunk.lm_head is not None:
        top["lm_head"] = ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)
    if top:
        parallelize_module(chunk, tp_mesh, top)
    for layer in chunk.layers.values():
        parallelize_module(layer, tp_mesh, {
            "self_attn.q_proj": ColwiseParallel(), "self_attn.k_proj": ColwiseParallel(),
            "self_attn.v_proj": ColwiseParallel(), "mlp.gate_proj": ColwiseParallel(),
            "mlp.up_proj": ColwiseParallel(), "self_attn.o_proj": RowwiseParallel(),
            "mlp.down_proj": RowwiseParallel()})


def run_torch_3d(layout: dict, steps: int, memory_run: bool = False, **job_kw) -> Run:
    """torch's own 3D composition, as torchtitan builds it: a (pp, dp, tp) DeviceMesh in our
    rank order, DTensor tensor parallelism on each stage, ``Schedule1F1B`` over the stages
    our planner cuts, gradients all-reduced over dp (DDP's arithmetic, one flat buffer)
    and clipped by the norm over all shards and stages, AdamW."""
    from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import loss_parallel

    from parallel3d.models.llama.parallelize import cut_pipeline_stages

    cfg = job(layout, steps, **job_kw)
    tp, pp, dp = layout.get("tp", 1), layout.get("pp", 1), layout.get("dp", 1)
    mesh = init_device_mesh(_device().type, (pp, dp, tp), mesh_dim_names=("pp", "dp", "tp"))
    pp_rank, dp_rank, tp_rank = (mesh.get_local_rank(d) for d in ("pp", "dp", "tp"))
    pp_group, dp_group, tp_group = (mesh.get_group(d) for d in ("pp", "dp", "tp"))
    micro = cfg.train.micro_batch
    n_micro = cfg.train.global_batch // (micro * dp)
    data = GlobalBatches(cfg)
    device = _device()
    run = Run()

    class _Where:  # what cut_pipeline_stages reads of a topology
        pass
    where = _Where()
    where.pp_rank, where.pp = pp_rank, pp

    def loss_fn(logits, targets):
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())

    with PeakMemory(device, tensors=memory_run) as mem:
        (chunk,) = cut_pipeline_stages(initial_model(cfg), where, cfg.parallel)
        chunk.to(device)
        _tp_plan(chunk, mesh["tp"])
        stage = PipelineStage(chunk, pp_rank, pp, device, group=pp_group)
        schedule = Schedule1F1B(stage, n_micro, loss_fn=loss_fn)  # grads scaled by 1/n_micro
        params = list(chunk.parameters())
        opts = _adamw_per_kind(params, cfg)
        last = pp_rank == pp - 1

        @torch.no_grad()
        def sync_and_clip() -> None:
            if dp > 1:  # DDP's arithmetic: the mean over dp, in one flat all-reduce
                local = [p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad for p in params]
                flat = _flatten_dense_tensors(local)
                dist.all_reduce(flat, group=dp_group)
                flat.div_(dp)
                torch._foreach_copy_(local, _unflatten_dense_tensors(flat, local))
            _clip_dtensor_grads(params, cfg.train.grad_clip, tp_group, pp_group if pp > 1 else None)

        def step(s: int) -> torch.Tensor:
            x, y = data(s)
            per = x.shape[0] // dp
            x, y = x[dp_rank * per:(dp_rank + 1) * per], y[dp_rank * per:(dp_rank + 1) * per]
            for p in params:
                p.grad = None
            losses: list = []
            with loss_parallel():
                if pp_rank == 0:
                    schedule.step(x.to(device))
                elif last:
                    schedule.step(target=y.to(device), losses=losses)
                else:
                    schedule.step()
            sync_and_clip()
            for opt in opts:
                opt.step()
            loss = torch.zeros((), device=device)
            if last and tp_rank == 0:
                loss += torch.stack([v.full_tensor() if isinstance(v, DTensor) else v
                                     for v in losses]).mean().detach() / dp
            dist.all_reduce(loss)  # one contribution per dp replica: the mean over the batch
            return loss

        _time_steps(run, step, steps, device)
    run.peak = mem.peak
    return run
