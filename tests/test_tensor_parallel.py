"""Tensor-parallel layers and loss against single-device twins (the parallelized Llama:
tests/test_tensor_parallel_llama.py, with these helpers and tolerance).

Every check builds the unsharded module from a seed on every rank, shards it, runs the
same input through both and compares the output and every gradient (the sharded
gradients against the matching slice of the dense ones). Runs on a pool of 4 gloo ranks:
tp=4, and tp=2 as two tp groups side by side (dp=2).

Tolerance: fp32, relative error of the whole tensor ||a - b|| / ||b|| < 1e-5. The sharded
layers sum the same products in a different order (partial sums, then an all-reduce), so
they differ from the dense ones by a few fp32 ulps (measured ~1e-7); an element-wise
relative bound would be meaningless on entries near zero.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from parallel3d.tensor_parallel import (ColumnParallelLinear, RowParallelLinear,
                                        VocabParallelEmbedding, gather_from_sequence,
                                        padded_size, scatter_to_sequence, scatter_to_tp_region,
                                        sync_tensor_parallel_grads,
                                        vocab_parallel_cross_entropy)
from parallel3d.topology import Topology

RTOL = 1e-5  # see the module docstring


_TOPOLOGIES: dict[tuple[int, int], Topology] = {}


def _topology(tp: int, dp: int) -> Topology:
    """One Topology per layout and worker process: every new one creates its process
    groups, and tearing hundreds of gloo groups down at the end costs seconds."""
    if (tp, dp) not in _TOPOLOGIES:
        _TOPOLOGIES[tp, dp] = Topology(tp, 1, dp)
    return _TOPOLOGIES[tp, dp]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach(), b.detach()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def tokens_of(t: torch.Tensor, p: int, r: int) -> torch.Tensor:
    """Rank r's run of the B*S tokens of (B, S, ...), viewed (B, S/p, ...): the sequence-
    parallel shard (parallel3d/tensor_parallel/comm.py), worked out here from the layout."""
    n = t.numel() // p
    return t.contiguous().view(-1)[r * n:(r + 1) * n].view(t.shape[0], t.shape[1] // p, *t.shape[2:])


def _seq(t: torch.Tensor, topo, sp: bool) -> torch.Tensor:
    """This rank's sequence-parallel shard under sequence parallelism, else ``t``."""
    return tokens_of(t, topo.tp, topo.tp_rank) if sp else t


def _rows(t: torch.Tensor, p: nn.Parameter) -> torch.Tensor:
    """The slice of the dense tensor ``t`` that the sharded parameter ``p`` holds, zero-
    padded where ``p`` covers padding rows past the end of ``t``."""
    if getattr(p, "p3d_tp_dim", None) is None:
        return t
    dim, (start, stop) = p.p3d_tp_dim, p.p3d_tp_range
    piece = t.narrow(dim, start, max(0, min(stop, t.shape[dim]) - start))
    pad = [0, 0] * (t.dim() - 1 - dim) + [0, (stop - start) - piece.shape[dim]]
    return F.pad(piece, pad)


# -- layers ------------------------------------------------------------------------------

def _linear_case(kind: str, sp: bool, bias: bool, topo, backend: str = "auto") -> dict[str, float]:
    """Dense nn.Linear(37 -> 52) vs its column- or row-parallel twin; errors by name."""
    group = topo.tp_group
    torch.manual_seed(1)
    in_f, out_f = (37, 52) if kind == "column" else (52, 37)  # odd and not a power of 2
    dense = nn.Linear(in_f, out_f, bias=bias)
    x = torch.randn(3, 8, in_f, requires_grad=True)  # (B, S, in), S divisible by 4
    w_out = torch.randn(3, 8, out_f)  # a random upstream gradient dL/dY
    (dense(x) * w_out).sum().backward()

    if kind == "column":
        layer = ColumnParallelLinear.from_dense(dense, group, sequence_parallel=sp, backend=backend)
        x_in = _seq(x.detach(), topo, sp).requires_grad_()
        y = layer(x_in)  # (B, S, out/p)
        y_ref = _rows(dense(x).detach().transpose(0, 2), layer.weight).transpose(0, 2)
        dy = _rows(w_out.transpose(0, 2), layer.weight).transpose(0, 2)
        dx_ref = _seq(x.grad, topo, sp)
    else:
        layer = RowParallelLinear.from_dense(dense, group, sequence_parallel=sp, backend=backend)
        start, stop = layer.weight.p3d_tp_range
        x_in = x.detach()[..., start:stop].clone().requires_grad_()  # (B, S, in/p)
        y = layer(x_in)  # (B, S, out) or (B, S/p, out)
        y_ref = _seq(dense(x).detach(), topo, sp)
        dy = _seq(w_out, topo, sp)
        dx_ref = x.grad[..., start:stop]
    (y * dy).sum().backward()
    sync_tensor_parallel_grads(layer.parameters(), topo)  # the row bias under SP
    errs = {"y": rel(y, y_ref), "dx": rel(x_in.grad, dx_ref),
            "dw": rel(layer.weight.grad, _rows(dense.weight.grad, layer.weight))}
    if bias:
        errs["db"] = rel(layer.bias.grad, _rows(dense.bias.grad, layer.bias))
    return errs


def _gather_output_case(topo) -> dict[str, float]:
    torch.manual_seed(2)
    dense = nn.Linear(21, 12, bias=True)
    x = torch.randn(2, 5, 21, requires_grad=True)
    w_out = torch.randn(2, 5, 12)
    (dense(x) * w_out).sum().backward()
    layer = ColumnParallelLinear.from_dense(dense, topo.tp_group, gather_output=True)
    x_in = x.detach().clone().requires_grad_()
    y = layer(x_in)  # (B, S, out): gathered
    (y * w_out).sum().backward()
    return {"y": rel(y, dense(x)), "dx": rel(x_in.grad, x.grad),
            "dw": rel(layer.weight.grad, _rows(dense.weight.grad, layer.weight)),
            "db": rel(layer.bias.grad, _rows(dense.bias.grad, layer.bias))}


def _comm_case(topo) -> dict[str, float]:
    """The pairs the layers above do not use as built: each rank's loss is its piece of
    <y, W>, so the summed loss is <x, W> and the gradient of the replicated x is W."""
    torch.manual_seed(8)
    x, w = torch.randn(2, 8, 12), torch.randn(2, 8, 12)
    p, r, errs = topo.tp, topo.tp_rank, {}
    for name, fn, mine in (("scatter_to_tp_region", scatter_to_tp_region, lambda t: t.chunk(p, -1)[r]),
                           ("scatter_to_sequence", scatter_to_sequence, lambda t: tokens_of(t, p, r))):
        xi = x.clone().requires_grad_()
        y = fn(xi, topo.tp_group)
        (y * mine(w)).sum().backward()
        errs[f"{name} y"] = rel(y, mine(x))
        errs[f"{name} dx"] = rel(xi.grad, w)
    # gather without partial gradients: every rank's dY is the whole gradient; keep mine.
    xi = tokens_of(x, p, r).clone().requires_grad_()
    y = gather_from_sequence(xi, topo.tp_group, grad_is_partial=False)
    (y * w).sum().backward()
    errs["gather_from_sequence y"] = rel(y, x)
    errs["gather_from_sequence dx"] = rel(xi.grad, tokens_of(w, p, r))
    return errs


def _autocast_case(topo) -> dict[str, float]:
    """Under bf16 autocast the parallel layers compute in bf16 like ``nn.Linear`` does."""
    torch.manual_seed(7)
    dense = nn.Linear(40, 24)
    x = torch.randn(2, 4, 40)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y_ref = dense(x)
        layer = ColumnParallelLinear.from_dense(dense, topo.tp_group)
        y = layer(x)
        y.float().sum().backward()
    assert y.dtype == y_ref.dtype == torch.bfloat16 and layer.weight.grad.dtype == torch.float32
    # bf16 keeps 8 significant bits: one rounding of inputs and output is ~4e-3 relative.
    return {"y": rel(y.float(), _rows(y_ref.float().transpose(0, 2), layer.weight).transpose(0, 2))}


def _embedding_case(sp: bool, topo) -> dict[str, float]:
    torch.manual_seed(3)
    dense = nn.Embedding(101, 24)  # odd vocab: padded to 102 (tp=2) or 104 (tp=4)
    tokens = torch.randint(0, 101, (3, 8))
    tokens[0, :2] = torch.tensor([0, 100])  # first and last rows
    w_out = torch.randn(3, 8, 24)
    (dense(tokens) * w_out).sum().backward()
    layer = VocabParallelEmbedding.from_dense(dense, topo.tp_group, sequence_parallel=sp)
    y = layer(tokens)
    (y * _seq(w_out, topo, sp)).sum().backward()
    return {"y": rel(y, _seq(dense(tokens).detach(), topo, sp)),
            "dw": rel(layer.weight.grad, _rows(dense.weight.grad, layer.weight))}


def _cross_entropy_case(topo, vocab: int, backend: str = "auto") -> dict[str, float]:
    torch.manual_seed(4)
    padded = padded_size(vocab, topo.tp)  # vocab 5 at tp=4: rank 3 holds only padding
    logits = torch.randn(3, 7, vocab) * 3  # (B, S, V), odd S
    targets = torch.randint(0, vocab, (3, 7))
    targets[0, :2] = torch.tensor([0, vocab - 1])
    weights = torch.rand(3, 7)  # a non-uniform upstream gradient per token
    full = logits.clone().requires_grad_()
    ref = F.cross_entropy(full.flatten(0, 1), targets.flatten(), reduction="none").view(3, 7)
    (ref * weights).sum().backward()
    # Padding columns get a huge logit: if they leaked into the softmax the loss would move.
    padded_logits = torch.cat([logits, torch.full((3, 7, padded - vocab), 50.0)], dim=-1)
    v = padded // topo.tp
    mine = padded_logits[..., topo.tp_rank * v:(topo.tp_rank + 1) * v].clone().requires_grad_()
    loss = vocab_parallel_cross_entropy(mine, targets, vocab_start=topo.tp_rank * v,
                                        vocab_size=vocab, group=topo.tp_group, backend=backend)
    (loss * weights).sum().backward()
    grad_ref = F.pad(full.grad, (0, padded - vocab))[..., topo.tp_rank * v:(topo.tp_rank + 1) * v]
    errs = {"loss": rel(loss, ref)}
    if grad_ref.norm() > 0:  # a rank holding only padding has all-zero gradients
        errs["dlogits"] = rel(mine.grad, grad_ref)
    else:
        errs["dlogits"] = float(mine.grad.abs().max())
    return errs


# bf16 under autocast: on CPU both paths round x and W to bf16 and accumulate in fp32, so
# they agree exactly (measured 0); another accumulation order (a GPU GEMM) may move the
# bf16 output by an ulp, 2^-8 = 4e-3 relative, hence a bound of a few ulps.
RTOL_BF16 = 2e-2


def check_layers(tp: int, dp: int) -> dict[str, tuple[float, float]]:
    """{case: (relative error, tolerance)} on this rank."""
    topo = _topology(tp, dp)
    errs = {}
    for kind in ("column", "row"):
        for sp in (False, True):
            for bias in (False, True):
                for name, e in _linear_case(kind, sp, bias, topo).items():
                    errs[f"{kind} sp={sp} bias={bias} {name}"] = e
    for name, e in _gather_output_case(topo).items():
        errs[f"column gather_output {name}"] = e
    for sp in (False, True):
        for name, e in _embedding_case(sp, topo).items():
            errs[f"embedding sp={sp} {name}"] = e
    errs.update(_comm_case(topo))
    for vocab in (101, 5):
        for name, e in _cross_entropy_case(topo, vocab).items():
            errs[f"cross_entropy vocab={vocab} {name}"] = e
    out = {k: (e, RTOL) for k, e in errs.items()}
    out["column autocast bf16 y"] = (_autocast_case(topo)["y"], RTOL_BF16)
    return out


@pytest.mark.parametrize("tp", [2, 4])
def test_layers_equal_their_single_device_twins(pools, tp):
    for rank, errs in enumerate(pools(4).run(check_layers, tp, 4 // tp)):
        bad = {k: e for k, (e, tol) in errs.items() if not e < tol}
        assert not bad, f"rank {rank}, tp={tp}: {bad}"
        assert len(errs) == 47  # 28 linear, 4 gather_output, 4 embedding, 6 comm, 4 loss, 1 bf16


def check_triton_path(tp: int, dp: int) -> dict[str, float]:
    """The layers and the loss with backend="triton" (in a pool under TRITON_INTERPRET=1)."""
    topo = _topology(tp, dp)
    errs = {}
    for kind in ("column", "row"):
        for name, e in _linear_case(kind, True, True, topo, backend="triton").items():
            errs[f"{kind} {name}"] = e
    for vocab in (101, 5):
        for name, e in _cross_entropy_case(topo, vocab, backend="triton").items():
            errs[f"cross_entropy vocab={vocab} {name}"] = e
    return errs


def test_triton_kernels_inside_the_parallel_layers_under_the_interpreter():
    """The Triton GEMM and cross-entropy kernels as the parallel layers call them, at
    tp=4, on the CPU interpreter (a pool of its own, spawned: triton reads TRITON_INTERPRET
    once, at import, and the suite's forkserver has imported it). tp=2 runs the same code
    on the torch path above."""
    from parallel3d.testing import ProcessGroupPool

    pool = ProcessGroupPool(4, env={"TRITON_INTERPRET": "1"})  # spawned, not forked
    try:
        for rank, errs in enumerate(pool.run(check_triton_path, 4, 1)):
            bad = {k: e for k, e in errs.items() if not e < RTOL}
            assert not bad and len(errs) == 12, f"rank {rank}: {bad or errs}"
    finally:
        pool.close()
