"""Context parallelism through the model: Llama with ``apply_context_parallel`` (and
recomputation) on each rank's head-tail chunks, and tp 2 x cp 2 through
``parallelize_llama`` with sequence parallelism, against the plain model on whole
sequences (logits or loss, every parameter's gradient); both comm modes, with and without
packed documents. The attention alone against SDPA: ``test_context_parallel.py``, whose
cp groups and packed positions these tests share.

Tolerance fp32 1e-5 (``test_context_parallel.FP32_TOL``: blocks merged by their
log-sum-exp and gradients summed over ranks add the same products in another order).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from parallel3d.context_parallel import shard_sequence
from parallel3d.models.llama import Llama, LlamaConfig
from parallel3d.models.llama.parallelize import apply_context_parallel, apply_recompute
from test_context_parallel import FP32_TOL, _cp_group, _packed_positions

TINY = LlamaConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=48)


def _model_errors(cp: int, comm: str, docs: bool, recompute: str = "none") -> list[float]:
    """The model at cp (``apply_context_parallel``, then ``apply_recompute``) on this
    rank's chunks against the plain model on whole sequences: logits of the rank's
    tokens, and every parameter's gradient of the token-summed loss, summed over the cp
    group (each rank's loss covers its tokens; the trainer reduces over dp x cp)."""
    group = _cp_group(cp)
    r = dist.get_rank(group)
    torch.manual_seed(0)
    full = Llama(TINY)
    model = Llama(TINY)
    model.load_state_dict(full.state_dict())
    apply_recompute(apply_context_parallel(model, group, comm), recompute)
    B, S = 2, 24
    tokens, targets = torch.randint(0, 64, (2, B, S))
    positions = _packed_positions(S) if docs else torch.arange(S).expand(B, S)

    logits = full(tokens, positions if docs else None)
    F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum").backward()

    def mine(t):
        return shard_sequence(t, cp, r, dim=1)

    local = model(mine(tokens), mine(positions))
    F.cross_entropy(local.flatten(0, 1), mine(targets).flatten(), reduction="sum").backward()
    local, logits = local.detach(), logits.detach()
    errs = [float((local - mine(logits)).abs().max() / mine(logits).abs().max())]
    for (name, p), ref in zip(model.named_parameters(), full.parameters()):
        grad = p.grad.clone()
        dist.all_reduce(grad, group=group)
        errs.append(float((grad - ref.grad).abs().max() / ref.grad.abs().max()))
    return errs


def _model_cases(cp: int) -> dict:
    cases = {(comm, docs, "none"): _model_errors(cp, comm, docs) for comm in ("allgather", "ring")
             for docs in (False, True)}
    if cp == 2:  # the recomputed forward runs the attention's communication again, in step
        cases.update({(comm, True, mode): _model_errors(cp, comm, True, mode)
                      for comm in ("allgather", "ring") for mode in ("full", "selective")})
    return cases


@pytest.mark.parametrize("cp", [2, 4])
def test_llama_with_context_parallel_attention_equals_the_plain_model(pools, cp):
    """fp32, 1e-5 of each tensor's largest entry (as the attention test: sums in another
    order; the gradients are summed over cp ranks, a few ulps more)."""
    for rank, cases in enumerate(pools(4).run(_model_cases, cp)):
        for (comm, docs, recompute), errs in cases.items():
            assert max(errs) < FP32_TOL, (f"rank {rank} {comm} docs={docs} recompute={recompute}: "
                                          f"logits, grads off by {errs}")


# -- composed: tensor x context parallelism through parallelize_llama ---------------------

_TOPOLOGIES: dict = {}


def _rows(t: torch.Tensor, p) -> torch.Tensor:
    """The slice of the dense tensor ``t`` the tensor-parallel parameter ``p`` holds
    (``p3d_tp_dim`` / ``p3d_tp_range``), zero-padded past the end (padded vocabulary)."""
    if getattr(p, "p3d_tp_dim", None) is None:
        return t
    dim, (start, stop) = p.p3d_tp_dim, p.p3d_tp_range
    piece = t.narrow(dim, start, max(0, min(stop, t.shape[dim]) - start))
    return F.pad(piece, [0, 0] * (t.dim() - 1 - dim) + [0, (stop - start) - piece.shape[dim]])


def _tp_cp_errors(comm: str, docs: bool) -> dict[str, float]:
    """tp 2 x cp 2 (ranks 0,1 | 2,3 hold the tp pairs; cp groups {0,2}, {1,3}) with
    sequence parallelism against the plain model: the step's loss (each rank's mean over
    its tokens / cp, summed over cp) and every parameter's gradient (tp partial sums
    synced, then summed over cp, as the gradient reduction over dp x cp will)."""
    from parallel3d.config import ParallelConfig
    from parallel3d.models.llama.parallelize import cross_entropy_loss, parallelize_llama
    from parallel3d.tensor_parallel import sync_tensor_parallel_grads
    from parallel3d.topology import Topology

    if "tp2cp2" not in _TOPOLOGIES:
        _TOPOLOGIES["tp2cp2"] = Topology(2, 1, 1, cp=2)
    topo = _TOPOLOGIES["tp2cp2"]
    cfg = LlamaConfig(vocab_size=61, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=48)
    torch.manual_seed(3)
    dense = Llama(cfg)
    torch.manual_seed(3)
    model, loss_fn = parallelize_llama(Llama(cfg), topo, ParallelConfig(
        tp=2, cp=2, sequence_parallel=True, cp_comm=comm))
    B, S = 2, 24
    tokens, targets = torch.randint(0, 61, (2, B, S))
    positions = _packed_positions(S) if docs else torch.arange(S).expand(B, S)
    ref = cross_entropy_loss(dense(tokens, positions if docs else None), targets)
    ref.backward()

    def mine(t):
        return shard_sequence(t, 2, topo.cp_rank, dim=1)

    loss = loss_fn(model(mine(tokens), mine(positions)), mine(targets)) / 2  # equal tokens per rank
    loss.backward()
    sync_tensor_parallel_grads(model.parameters(), topo)
    loss = loss.detach().clone()
    dist.all_reduce(loss, group=topo.cp_group)
    errs = {"loss": float((loss - ref).abs() / ref.abs())}
    dense_grads = {n: p.grad for n, p in dense.named_parameters()}
    for name, p in model.named_parameters():
        grad = p.grad.clone()
        dist.all_reduce(grad, group=topo.cp_group)
        want = _rows(dense_grads[name], p)
        errs[name] = float((grad - want).abs().max() / want.abs().max())
    return errs


@pytest.mark.parametrize("comm", ["allgather", "ring"])
def test_tensor_x_context_parallel_llama_equals_the_plain_model(pools, comm):
    """fp32, 1e-5 (as above)."""
    for docs in (False, True):
        for rank, errs in enumerate(pools(4).run(_tp_cp_errors, comm, docs)):
            bad = {k: e for k, e in errs.items() if not e < FP32_TOL}
            assert not bad, f"rank {rank} docs={docs}: {bad}"
            assert len(errs) == 1 + 2 * 9 + 3  # loss, 9 per layer, embedding, norm, head
