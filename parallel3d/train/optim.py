"""AdamW, the learning-rate schedule, and global-norm gradient clipping.

The optimizer interface the trainer sees (:class:`DataParallelOptimizer`)::

    opt.zero_grad()
    ... forward / backward over the micro-batches ...
    grad_norm = opt.step(lr)   # sync gradients, clip by the global norm, update

or, as the trainer does it, the step's two halves around the trainer's one collective
(:class:`GlobalNormOptimizer`). A step whose global norm is not finite (or called with
``skip=True``) still does every collective, so the ranks stay in step, but changes no
weight and no optimizer state. The sharded (ZeRO) optimizer has the same interface, so
it replaces this one without the loop knowing.
"""

from __future__ import annotations

import math

import torch

from parallel3d.config import TrainConfig
from parallel3d.data_parallel import all_reduce_gradients
from parallel3d.distributed import all_reduce
from parallel3d.pipeline.timeline import comm_span
from parallel3d.tensor_parallel.grad_sync import sync_tensor_parallel_grads
from parallel3d.topology import Topology


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warm-up over ``warmup_steps`` to ``lr``, then cosine to ``lr*min_lr_ratio``
    at the last step. ``step`` counts from 0."""
    if cfg.warmup_steps > 0 and step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    decay_steps = max(1, cfg.steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / decay_steps)
    floor = cfg.lr * cfg.min_lr_ratio
    return floor + (cfg.lr - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


def applies_weight_decay(p: torch.nn.Parameter) -> bool:
    """Weight decay on matrices and embeddings, none on vectors (norm weights, biases)."""
    return p.ndim >= 2


def param_groups(params: list[torch.nn.Parameter], weight_decay: float) -> list[dict]:
    decay = [p for p in params if applies_weight_decay(p)]
    no_decay = [p for p in params if not applies_weight_decay(p)]
    return [{"params": decay, "weight_decay": weight_decay},
            {"params": no_decay, "weight_decay": 0.0}]


def counts_in_norm(p: torch.nn.Parameter) -> bool:
    """A parameter replicated over a model-parallel group (a norm weight under tensor
    parallelism, a tied embedding held by two pipeline stages) is marked by
    ``parallelize`` with ``p.p3d_norm_owner = False`` on all but one holder, so the
    global norm counts it once."""
    return getattr(p, "p3d_norm_owner", True)


def squared_norm(grads: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """Sum of squares of ``grads`` in fp32 (one fused kernel for every gradient's norm,
    whatever the gradient dtype); a zero scalar on ``device`` when there are none."""
    if not grads:
        return torch.zeros((), dtype=torch.float32, device=device)
    return torch.stack(torch._foreach_norm(grads, 2, dtype=torch.float32)).square().sum()


@torch.no_grad()
def global_grad_norm(grads_and_params, topo: Topology) -> torch.Tensor:
    """L2 norm of all gradients of the model, each parameter counted once across the
    tensor- and pipeline-parallel groups (fp32, same value on every rank)."""
    grads = [g for g, p in grads_and_params if g is not None and counts_in_norm(p)]
    sq = squared_norm(grads, torch.device("cpu"))
    all_reduce(sq, topo.mp_group)
    return sq.sqrt()


@torch.no_grad()
def clip_coefficient(norm: torch.Tensor, max_norm: float) -> torch.Tensor:
    """``min(1, max_norm / (norm + 1e-6))``, as ``torch.nn.utils.clip_grad_norm_``."""
    return torch.clamp(max_norm / (norm + 1e-6), max=1.0)


def clip_factor(norm: torch.Tensor, max_norm: float) -> torch.Tensor | None:
    """The factor to scale gradients by, or None when clipping is off or would multiply
    by exactly 1 (the norm is within ``max_norm``: a pass over every gradient saved)."""
    if max_norm <= 0:
        return None
    coef = clip_coefficient(norm, max_norm)
    return coef if float(coef) < 1.0 else None


class GlobalNormOptimizer:
    """An optimizer step in two halves around one all-reduce over the world::

        share = opt.reduce_gradients()   # gradient sync; this rank's share of |g|^2
        ... sum share over every rank of the world (the trainer's one collective) ...
        opt.apply(lr, norm, skip)        # clip by the global norm, update

    The shares of all ranks add up to the squared global norm, each gradient element
    counted once: model-parallel ranks hold different parameters (a parameter replicated
    over them is counted by its ``p3d_norm_owner`` only), and data-parallel copies of
    the same gradient count on one of them. So the trainer can sum the norm together
    with the step's loss and metrics in a single collective. :meth:`step` does the
    three parts itself."""

    timeline = None  # the trainer's Timeline: collective waits recorded as "comm" spans

    def reduce_gradients(self) -> torch.Tensor:
        raise NotImplementedError

    def apply(self, lr: float, norm: torch.Tensor, skip: bool = False) -> None:
        raise NotImplementedError

    @torch.no_grad()
    def step(self, lr: float, skip: bool = False) -> float:
        """Sync, clip and update; returns the global gradient norm. A step whose norm is
        not finite, or called with ``skip``, changes no weight."""
        sq = self.reduce_gradients()
        with comm_span(self.timeline, "grad norm"):
            all_reduce(sq, self.topo.world_group)
        norm = sq.sqrt()
        self.apply(lr, norm, skip)
        return float(norm)


class DataParallelOptimizer(GlobalNormOptimizer):
    """AdamW over replicated parameters, gradients averaged over the dp group (zero=0)."""

    def __init__(self, params: list[torch.nn.Parameter], cfg: TrainConfig, topo: Topology):
        self.params = [p for p in params if p.requires_grad]
        self.cfg = cfg
        self.topo = topo
        # torch's fused kernel: one pass over each tensor (CPU and CUDA), the arithmetic
        # of the ZeRO optimizer's FlatAdamW element by element
        self.inner = torch.optim.AdamW(
            param_groups(self.params, cfg.weight_decay), lr=cfg.lr,
            betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, fused=True)

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    @torch.no_grad()
    def reduce_gradients(self) -> torch.Tensor:
        # Partial gradients of parameters several tp ranks hold (norms under sequence
        # parallelism, replicated kv-heads) are summed over them; then the dp mean.
        with comm_span(self.timeline, "grad sync"):
            sync_tensor_parallel_grads(self.params, self.topo)
            all_reduce_gradients(self.params, self.topo.dp_group, self.topo.dp)
        # After the dp mean every dp rank holds the same gradients: dp rank 0 counts them.
        counted = [p.grad for p in self.params if p.grad is not None and counts_in_norm(p)]
        return squared_norm(counted if self.topo.dp_rank == 0 else [], self.params[0].device)

    @torch.no_grad()
    def apply(self, lr: float, norm: torch.Tensor, skip: bool = False) -> None:
        if skip or not math.isfinite(float(norm)):  # the same norm on every rank
            return
        coef = clip_factor(norm, self.cfg.grad_clip)
        if coef is not None:
            grads = [p.grad for p in self.params if p.grad is not None]
            torch._foreach_mul_(grads, coef.to(grads[0].device))
        for group in self.inner.param_groups:
            group["lr"] = lr
        self.inner.step()

    def state_dict(self) -> dict:
        return self.inner.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.inner.load_state_dict(state)


def build_optimizer(params, train_cfg: TrainConfig, parallel_cfg, topo: Topology, model=None):
    """The optimizer for ``parallel.zero``: 0 gives :class:`DataParallelOptimizer`, 1 and 2
    the sharded :class:`~parallel3d.zero.ZeroOptimizer`. With ``model`` given, the sharded
    optimizer overlaps its post-step all-gather with the next forward pass.

    Mixed precision under ZeRO: with bf16 (``train.dtype`` bf16, or auto on CUDA) the
    parameters are stored in bf16 and the optimizer keeps fp32 master weights; zero=0
    keeps fp32 parameters under bf16 autocast."""
    params = list(params)
    if parallel_cfg.zero == 0:
        return DataParallelOptimizer(params, train_cfg, topo)
    from parallel3d.zero import ZeroOptimizer

    device = params[0].device
    bf16 = train_cfg.dtype == "bf16" or (train_cfg.dtype == "auto" and device.type == "cuda")
    return ZeroOptimizer(params, train_cfg, topo, stage=parallel_cfg.zero,
                         bucket_mb=parallel_cfg.bucket_mb, offload=parallel_cfg.offload_optimizer,
                         param_dtype=torch.bfloat16 if bf16 else torch.float32, model=model)
