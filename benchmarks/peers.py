"""One training run of each side, executed on every rank of a gloo/NCCL pool.

Each ``run_*`` builds its side from ``_common.initial_model`` (the trainer's weights),
feeds it ``_common.GlobalBatches`` and returns a :class:`_common.Run` for this rank:
the time of every optimizer step (forward, backward, gradient sync, clipping, update),
the step's loss (mean over the global batch, the same on every rank) and peak memory.
"""

from __future__ import annotations

import logging
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from _common import (GlobalBatches, PeakMemory, Run, adamw, clip_global_norm, initial_model, job,
                     rank_micro_batches, step_peak, timed)
from parallel3d.models.llama.parallelize import cross_entropy_loss

DEVICE = torch.device("cpu")


def _device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return DEVICE


def _time_steps(run: Run, step, steps: int, device: torch.device, mem=None) -> None:
    """Run ``step(s)`` (a whole optimizer step returning the step's loss) for every step,
    recording its time and loss in ``run`` (and, metered, each step's peak above what was
    allocated at its start: ``run.extra["step_peak"]``)."""
    for s in range(steps):
        with step_peak(run, mem):
            dt, loss = timed(lambda: step(s), device)
        run.times.append(dt)
        run.losses.append(float(loss))


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


# -- parallel3d ------------------------------------------------------------------------------

def run_ours(layout: dict, steps: int, memory_run: bool = False, **job_kw) -> Run:
    """Our Trainer, end to end (its own sampler, schedule and optimizer)."""
    from parallel3d.observe.stats import step_breakdown
    from parallel3d.topology import Topology
    from parallel3d.train.trainer import Trainer

    cfg = job(layout, steps, **job_kw)
    device = _device()
    run = Run()
    with PeakMemory(device, tensors=memory_run) as mem:
        trainer = Trainer(cfg, Topology(cfg.parallel.tp, cfg.parallel.pp, cfg.parallel.dp),
                          device, log=False)
        records = []
        for _ in range(steps):
            with step_peak(run, mem):
                dt, record = timed(trainer.train_step, device)
            records.append(record)
            run.times.append(dt)
            run.losses.append(record["loss"])
            spans = trainer.schedule.timeline.step_spans()
            run.extra.setdefault("breakdown", []).append({**step_breakdown(spans, dt), "step": dt})
            if cfg.parallel.pp > 1:  # from the end of this rank's last backward (B or W)
                run.extra.setdefault("tail", []).append(
                    dt - max(t1 for cat, _, t1 in spans if cat in ("backward", "weight")))
        trainer.finish_records()  # the last step's per-rank figures (the bubble), untimed
        run.extra["bubble_fraction"] = [r["bubble_fraction"] for r in records]
    run.peak = mem.peak
    return run


def run_ours_as(layout: dict, steps: int, as_layout: dict, memory_run: bool = False, **job_kw) -> Run:
    """Our Trainer at ``as_layout`` instead of the row's layout: a row's own reference
    (the zero-bubble rows' 1F1B on the same stages and batches)."""
    return run_ours(as_layout, steps, memory_run=memory_run, **job_kw)


# -- DeepSpeed -------------------------------------------------------------------------------

def _deepspeed():
    import deepspeed

    logging.getLogger("DeepSpeed").setLevel(logging.ERROR)
    deepspeed.utils.logger.setLevel(logging.ERROR)
    deepspeed.init_distributed(dist_backend=dist.get_backend())
    return deepspeed


def _ds_config(cfg, micro: int, accum: int, zero: int, dp: int) -> dict:
    bucket = int(cfg.parallel.bucket_mb * 2**20) // 4
    return {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": accum,
            "train_batch_size": micro * accum * dp,
            "gradient_clipping": cfg.train.grad_clip,
            # buckets of parallel.bucket_mb (ours, 25 MiB of fp32) instead of DeepSpeed's
            # 5e8 elements, which it allocates whole (1.9 GiB) whatever the model size
            "zero_optimization": {"stage": zero, "reduce_bucket_size": bucket,
                                  "allgather_bucket_size": bucket},
            "zero_allow_untested_optimizer": True, "steps_per_print": 10**9,
            "bf16": {"enabled": cfg.train.dtype == "bf16"}}


def run_deepspeed_zero(layout: dict, steps: int, memory_run: bool = False, **job_kw) -> Run:
    """DeepSpeed's engine with ZeRO ``layout['zero']`` over dp = world size."""
    deepspeed = _deepspeed()
    cfg = job(layout, steps, **job_kw)
    dp, rank, micro = dist.get_world_size(), dist.get_rank(), cfg.train.micro_batch
    data = GlobalBatches(cfg)
    accum = cfg.train.global_batch // (micro * dp)
    device = _device()
    run = Run()
    with PeakMemory(device, tensors=memory_run) as mem:
        model = initial_model(cfg).to(device)
        engine, _, _, _ = deepspeed.initialize(
            model=model, optimizer=adamw(model.parameters(), cfg),
            config=_ds_config(cfg, micro, accum, layout["zero"], dp))

        def step(s: int) -> torch.Tensor:
            total = torch.zeros((), device=device)
            for x, y in rank_micro_batches(*data(s), dp, rank, micro):
                loss = cross_entropy_loss(engine(x.to(device)), y.to(device))
                engine.backward(loss)  # DeepSpeed divides by gradient_accumulation_steps
                engine.step()  # updates only at the accumulation boundary
                total += loss.detach() / accum
            dist.all_reduce(total)
            return total / dp

        _time_steps(run, step, steps, device)
        engine.destroy()
    run.peak = mem.peak
    return run


class _EmbedPipe(nn.Module):
    def __init__(self, embed: nn.Embedding):
        super().__init__()
        self.embed_tokens = embed

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(tokens)


class DecoderPipe(nn.Module):
    """One decoder layer taking only the hidden states (DeepSpeed's pipeline passes one
    tensor between layers); the rotary tables are rebuilt per call, as our chunks do."""

    def __init__(self, layer: nn.Module, model):
        super().__init__()
        self.layer = layer
        self.rope = model.rope

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        cos, sin = self.rope(h.shape[1], h.device)
        return self.layer(h, cos.to(h.dtype), sin.to(h.dtype))


class _HeadPipe(nn.Module):
    def __init__(self, norm: nn.Module, lm_head: nn.Module):
        super().__init__()
        self.norm, self.lm_head = norm, lm_head

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(h))


def run_deepspeed_pipe(layout: dict, steps: int, ds_pp: int, ds_zero: int = 0,
                       memory_run: bool = False, **job_kw) -> Run:
    """DeepSpeed's PipelineEngine (its 1F1B 'TrainSchedule') with ``ds_pp`` stages and
    dp = world / ds_pp, decoder layers balanced over the stages, ZeRO ``ds_zero``."""
    deepspeed = _deepspeed()
    from deepspeed.pipe import PipelineModule

    cfg = job(layout, steps, **job_kw)
    dp, micro = dist.get_world_size() // ds_pp, cfg.train.micro_batch
    accum = cfg.train.global_batch // (micro * dp)
    data = GlobalBatches(cfg)
    device = _device()
    run = Run()
    with PeakMemory(device, tensors=memory_run) as mem:
        full = initial_model(cfg)
        layers = [_EmbedPipe(full.embed_tokens),
                  *[DecoderPipe(layer, full) for layer in full.layers.values()],
                  _HeadPipe(full.norm, full.lm_head)]
        module = PipelineModule(layers, num_stages=ds_pp, loss_fn=cross_entropy_loss,
                                partition_method="type:DecoderPipe")
        module.to(device)
        engine, _, _, _ = deepspeed.initialize(
            model=module, optimizer=adamw(module.parameters(), cfg),
            config=_ds_config(cfg, micro, accum, ds_zero, dp))
        dp_rank = engine.grid.get_data_parallel_rank()

        for s in range(steps):
            batches = [(x.to(device), y.to(device))
                       for x, y in rank_micro_batches(*data(s), dp, dp_rank, micro)]
            dt, loss = timed(lambda: engine.train_batch(iter(batches)), device)
            run.times.append(dt)
            run.losses.append(float(loss))
        engine.destroy()
    run.peak = mem.peak
    return run


# -- torch -----------------------------------------------------------------------------------

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
