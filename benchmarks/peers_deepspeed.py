"""DeepSpeed's side: its engine with ZeRO over data parallelism, and its PipelineEngine
(1F1B) over our decoder layers, optionally with ZeRO over the pipeline's data-parallel
replicas. Each runner is executed on every rank of a pool and returns a
:class:`_common.Run`, as ``peers`` describes.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist
import torch.nn as nn

from _common import GlobalBatches, PeakMemory, Run, adamw, initial_model, job, rank_micro_batches, timed
from parallel3d.models.llama.parallelize import cross_entropy_loss
from peers import _device, _time_steps


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
