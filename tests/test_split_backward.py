"""The backward split into B (input gradients) and W (weight gradients): every layer's
deferred W gives exactly the gradients of an undivided backward, B computes none of
them, autograd's accumulation and hooks see each W once, and ZeRO's bucket counting
waits for the W's (not the B's that gave no gradient)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from parallel3d.kernels.deferred import DeferredWeightGrads, deferring
from parallel3d.models.llama.model import Llama, LlamaConfig
from parallel3d.models.llama.parallelize import apply_recompute, split_llama_weight_grads
from parallel3d.tensor_parallel.split_backward import add_bias, embedding, split_weight_grads

CFG = LlamaConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=48,
                  qkv_bias=True, o_bias=True, qk_norm=True)


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_each_weight_op_defers_exactly_its_weight_gradient():
    """B leaves every weight without a gradient and gives the input gradient an
    undivided backward gives; W then gives the weight gradients, bit for bit."""
    torch.manual_seed(0)
    x = torch.randn(3, 5, 8)
    ids = torch.randint(0, 11, (3, 5))
    cases = {
        "linear": (nn.Linear(8, 6), lambda m, x: m(x)),
        "embedding": (nn.Embedding(11, 8), lambda m, x: m(ids) * x),
    }
    for name, (module, fn) in cases.items():
        plain, split = module, split_weight_grads(copy.deepcopy(module))
        xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
        fn(plain, xa).pow(2).sum().backward()
        work = DeferredWeightGrads()
        with deferring(work):
            fn(split, xb).pow(2).sum().backward()
        assert all(p.grad is None for p in split.parameters()), name
        assert torch.equal(xa.grad, xb.grad), name
        work.run()
        for (n, a), (_, b) in zip(plain.named_parameters(), split.named_parameters()):
            assert torch.equal(a.grad, b.grad), (name, n)
    w, b = nn.Parameter(torch.randn(11, 8)), nn.Parameter(torch.randn(8))
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    (embedding(ids, w) * xa + b).pow(2).sum().backward()
    ref = (w.grad.clone(), b.grad.clone())
    w.grad = b.grad = None
    work = DeferredWeightGrads()
    with deferring(work):
        add_bias(embedding(ids, w) * xb, b).pow(2).sum().backward()
    assert w.grad is None and b.grad is None and torch.equal(xa.grad, xb.grad)
    work.run()
    assert torch.equal(w.grad, ref[0]) and torch.equal(b.grad, ref[1])


def _micro_batches(n: int) -> list[torch.Tensor]:
    return [torch.randint(0, CFG.vocab_size, (2, 8), generator=torch.Generator().manual_seed(i))
            for i in range(n)]


def _plain(model: nn.Module, mbs) -> dict:
    for ids in mbs:
        model(ids).float().pow(2).mean().backward()
    return _grads(model)


def _pipelined(model: nn.Module, mbs, order) -> tuple[dict, dict]:
    """F, B, W of the micro-batches in ``order`` (a zero-bubble stage's interleaving);
    returns the gradients and how many times each parameter's post-accumulate hook saw a
    gradient arrive."""
    arrived: dict[str, int] = {}
    for n, p in model.named_parameters():
        p.grad = torch.zeros_like(p)  # preassigned, as the flat-buffer optimizer does
        flag = [False]
        p.register_hook(lambda g, flag=flag: flag.__setitem__(0, g is not None))
        p.register_post_accumulate_grad_hook(
            lambda _, n=n, flag=flag: arrived.__setitem__(n, arrived.get(n, 0) + flag[0]))
    outs, works = {}, {}
    for op, i in order:
        if op == "F":
            outs[i] = model(mbs[i]).float().pow(2).mean()
        elif op == "B":
            works[i] = DeferredWeightGrads()
            with deferring(works[i]):
                outs.pop(i).backward()
        else:
            works.pop(i).run()
    return _grads(model), arrived


@pytest.mark.parametrize("recompute", ["none", "full", "selective"])
def test_llama_w_after_later_forwards_equals_plain_backward(recompute):
    """A whole Llama (q/k norms, biases, RMSNorms, embedding, head) split into B and W and
    run in a zero-bubble stage's order (a W after the next micro-batch's forward and B),
    with ``.grad`` buffers given beforehand: the same gradients as plain backwards, each
    parameter's gradient arriving once per micro-batch, in its W. (A W that handed its
    gradients to the recomputation's copies of the weights, which ``ctx.saved_tensors``
    returns under recomputation, passes here but lost one micro-batch of eight of the
    last layer's down_proj in a pipeline run: ``test_train_pp.py``'s zero-bubble parity
    with recomputation is the test that catches that.)"""
    torch.manual_seed(0)
    base = Llama(CFG)
    mbs = _micro_batches(3)
    plain = apply_recompute(copy.deepcopy(base), recompute)
    split = apply_recompute(split_llama_weight_grads(copy.deepcopy(base)), recompute)
    ref = _plain(plain, mbs)
    order = [("F", 0), ("F", 1), ("B", 0), ("F", 2), ("B", 1), ("W", 0), ("B", 2), ("W", 2), ("W", 1)]
    got, arrived = _pipelined(split, mbs, order)
    assert set(got) == set(ref)
    for n in ref:
        # fp32 sums of the same terms in the same order per micro-batch; micro-batch 2's W
        # is added before micro-batch 1's here, which reorders one sum: a few ulps
        torch.testing.assert_close(got[n], ref[n], rtol=1e-6, atol=1e-7, msg=n)
    assert arrived == {n: 3 for n in ref}


def test_zero_counts_the_w_not_the_b_and_reduces_after_the_last_w():
    """The flat-buffer optimizer (one rank, ZeRO 0) told of 2 micro-batches: a B that
    deferred every weight gradient counts nothing (autograd runs the hooks with no
    gradient, which an fp32 .grad view alone cannot tell), the bucket is issued in the
    second W, and the reduced gradient is the sum of both micro-batches'."""
    from parallel3d.config import TrainConfig
    from parallel3d.topology import Topology
    from parallel3d.zero.optimizer import ZeroOptimizer

    torch.manual_seed(0)
    model = split_weight_grads(nn.Sequential(nn.Linear(6, 5), nn.Linear(5, 3)))
    reference = copy.deepcopy(model)
    opt = ZeroOptimizer(model.parameters(), TrainConfig(), Topology.single(), stage=0)
    opt.reducer.trace = []
    xs = [torch.randn(4, 6) for _ in range(2)]
    opt.begin_step(2)
    works = []
    for x in xs:
        works.append(DeferredWeightGrads())
        with deferring(works[-1]):
            model(x).pow(2).sum().backward()
    assert opt.reducer.trace == []  # the B's gave no gradient
    works[0].run()
    assert ("issue", 0) not in opt.reducer.trace
    works[1].run()
    assert opt.reducer.trace[-1] == ("issue", 0)
    grads = [e[1] for e in opt.reducer.trace if e[0] == "grad"]
    assert sorted(grads[:4]) == sorted(grads[4:]) == [0, 1, 2, 3]  # each parameter once a W
    for x in xs:
        reference(x).pow(2).sum().backward()
    opt.reducer.reduced()
    for i, ref in enumerate(reference.parameters()):  # each parameter's piece of the flat buffer
        assert torch.equal(opt.reducer._param_view(opt.reducer.shard, i), ref.grad), i
