"""AdamW on flat fp32 shards: our own (torch ops) and DeepSpeed's CPU Adam (offload).

Both apply, to every element x of the shard with gradient g, at step t (from 1)::

    x <- x * (1 - lr * wd)                  only where the parameter decays (>= 2-D)
    m <- b1 * m + (1 - b1) * g
    v <- b2 * v + (1 - b2) * g^2
    x <- x - lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)

which is ``torch.optim.AdamW`` (decoupled decay, eps added after the bias-corrected
square root). :class:`FlatAdamW` runs torch's own fused AdamW kernel (the one
``torch.optim.AdamW(fused=True)`` calls, which the zero=0 optimizer uses too) over views of
the flat shards, so both paths apply the same arithmetic element by element: one pass over
the shard instead of the ten of a foreach implementation. DeepSpeed's CPU Adam computes
the same formula with float32 bias corrections (``1 - b1^t`` and ``1/sqrt(1 - b2^t)``
kept in float32 and updated by multiplication) and fused multiply-adds, so it agrees to a
few ulps per step, not bit for bit.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from parallel3d.config import TrainConfig
from parallel3d.errors import UserError


class FlatAdamW:
    """AdamW over per-bucket master shards ``masters[b]`` and one flat gradient ``grad``
    (the buckets' shards back to back, ``masters[b]`` matching ``grad[offsets[b]:]``).

    ``runs`` lists ``(bucket, lo, hi, decays)`` in shard coordinates: the stretches of a
    bucket's shard whose parameters do or do not take weight decay. Each becomes one view
    of the masters, the gradient and the two moments; the fused kernel steps the decayed
    views with ``weight_decay`` and the others without, in two calls."""

    def __init__(self, masters: list[torch.Tensor], grad: torch.Tensor, offsets: list[int],
                 runs: list[tuple[int, int, int, bool]], cfg: TrainConfig):
        self.cfg = cfg
        self.exp_avg = torch.zeros_like(grad)
        self.exp_avg_sq = torch.zeros_like(grad)
        self._groups: dict[bool, tuple[list, list, list, list]] = {True: ([], [], [], []),
                                                                  False: ([], [], [], [])}
        for b, lo, hi, decays in runs:
            a, z = offsets[b] + lo, offsets[b] + hi
            for views, t in zip(self._groups[decays],
                                (masters[b][lo:hi], grad[a:z], self.exp_avg[a:z], self.exp_avg_sq[a:z])):
                views.append(t)
        self._t = torch.zeros((), dtype=torch.float32, device=grad.device)  # the step, as the kernel reads it

    @torch.no_grad()
    def step(self, t: int, lr: float) -> None:
        cfg = self.cfg
        self._t.fill_(t)
        for decays, (params, grads, exp_avgs, exp_avg_sqs) in self._groups.items():
            if params:
                torch._fused_adamw_(params, grads, exp_avgs, exp_avg_sqs, [], [self._t] * len(params),
                                    lr=lr, beta1=cfg.beta1, beta2=cfg.beta2,
                                    weight_decay=cfg.weight_decay if decays else 0.0, eps=cfg.eps,
                                    amsgrad=False, maximize=False)

    def state_tensors(self) -> list[torch.Tensor]:
        return [self.exp_avg, self.exp_avg_sq]

    def state_dict(self) -> dict:
        return {"exp_avg": self.exp_avg, "exp_avg_sq": self.exp_avg_sq}

    def load_state_dict(self, state: dict) -> None:
        self.exp_avg.copy_(state["exp_avg"])
        self.exp_avg_sq.copy_(state["exp_avg_sq"])


def extensions_dir() -> Path:
    """Where torch JIT-builds C++ extensions (DeepSpeed's CPU Adam): kept under our cache
    so the ~1 minute build happens once per machine. An explicit TORCH_EXTENSIONS_DIR wins."""
    return Path(os.environ.get("TORCH_EXTENSIONS_DIR")
                or Path.home() / ".cache" / "parallel3d" / "torch_extensions")


def load_cpu_adam():
    """DeepSpeed's ``DeepSpeedCPUAdam`` class, its native op built (or loaded) first.

    Raises :class:`UserError` saying what failed if DeepSpeed is missing or the op does
    not build (it needs a C++ compiler and ninja)."""
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(extensions_dir()))
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam
        from deepspeed.ops.op_builder import CPUAdamBuilder
    except Exception as e:  # noqa: BLE001 - any import failure means the same to the user
        raise UserError(f"parallel.offload_optimizer needs DeepSpeed's CPU Adam, but importing "
                        f"deepspeed failed ({type(e).__name__}: {e}): install deepspeed "
                        '(pip install deepspeed, or pip install -e ".[deepspeed]" in the checkout) '
                        "or set parallel.offload_optimizer=false") from None
    try:
        CPUAdamBuilder().load(verbose=False)
    except Exception as e:  # noqa: BLE001
        raise UserError(f"parallel.offload_optimizer: DeepSpeed's cpu_adam op failed to build in "
                        f"{os.environ['TORCH_EXTENSIONS_DIR']} ({type(e).__name__}: {str(e)[:300]}): it needs "
                        "g++ and ninja; install them or set parallel.offload_optimizer=false") from None
    return DeepSpeedCPUAdam


class CpuOffloadAdamW:
    """AdamW on CPU through DeepSpeed's ``DeepSpeedCPUAdam`` (its AVX kernel).

    DeepSpeedCPUAdam takes one weight decay per parameter group, and a shard mixes
    decayed and undecayed parameters, so every run of equal decay becomes one CPU
    "parameter" aliasing that range of the master shard (no copy), with its ``.grad``
    aliasing the same range of the CPU gradient shard. ``runs`` lists ``(bucket, lo, hi,
    decays)`` in shard coordinates.
    """

    def __init__(self, masters: list[torch.Tensor], grad_views: list[torch.Tensor],
                 runs: list[tuple[int, int, int, bool]], cfg: TrainConfig):
        cpu_adam = load_cpu_adam()
        groups = {True: [], False: []}
        for b, lo, hi, decays in runs:
            p = torch.nn.Parameter(masters[b][lo:hi])
            p.grad = grad_views[b][lo:hi]
            groups[decays].append(p)
        param_groups = [{"params": ps, "weight_decay": cfg.weight_decay if d else 0.0}
                        for d, ps in groups.items() if ps]
        self.inner = cpu_adam(param_groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps,
                              weight_decay=cfg.weight_decay, adamw_mode=True)

    @torch.no_grad()
    def step(self, t: int, lr: float) -> None:
        for group in self.inner.param_groups:
            group["lr"] = lr
        self.inner.step()

    def state_tensors(self) -> list[torch.Tensor]:
        return [v for s in self.inner.state.values() for v in s.values() if torch.is_tensor(v)]

    def state_dict(self) -> dict:
        return self.inner.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.inner.load_state_dict(state)
