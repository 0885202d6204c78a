"""Expert parallelism on 2 and 4 gloo ranks: each rank routes its own tokens, keeps 1/ep of
the experts and reaches the others by all-to-all; outputs and gradients equal one process
running the same block on every rank's tokens."""

from __future__ import annotations

import pytest
import torch

from parallel3d.models.moe import MoEBlock, MoEConfig

pytestmark = pytest.mark.usefixtures("one_thread")
DIM = 16
CFG = dict(n_experts=8, top_k=2, ffn_dim=12, norm_topk_prob=True, shared_ffn_dim=10, shared_gate=True)


def _ep_rank(cfg: dict, state: dict, x_all: torch.Tensor, g_all: torch.Tensor):
    """On each rank: the block with this rank's experts, this rank's tokens x_all[rank]."""
    import torch.distributed as dist

    from parallel3d.models.moe.parallelize import apply_expert_parallel

    rank = dist.get_rank()
    block = MoEBlock(MoEConfig(**cfg), DIM)
    block.load_state_dict(state)
    apply_expert_parallel(block, dist.group.WORLD)
    x = x_all[rank].clone().requires_grad_()
    out = block(x)
    (out * g_all[rank]).sum().backward()
    counts = block.last_stats.tokens_per_expert
    return out.detach(), x.grad, {n: p.grad for n, p in block.named_parameters()}, counts


@pytest.mark.parametrize("ep", [2, 4])
def test_expert_parallel_equals_one_process(pools, ep):
    torch.manual_seed(ep)
    cfg = MoEConfig(**CFG)
    ref = MoEBlock(cfg, DIM)
    # a few tokens per rank: some experts get no rows from some ranks (empty splits)
    x_all = torch.randn(ep, 2, 5, DIM)
    g_all = torch.randn(ep, 2, 5, DIM)
    x = x_all.flatten(0, 1).requires_grad_()
    out = ref(x)
    (out * g_all.flatten(0, 1)).sum().backward()
    results = pools(ep).run(_ep_rank, CFG, ref.state_dict(), x_all, g_all)
    want_out, want_dx = out.detach().view_as(x_all), x.grad.view_as(x_all)
    per_rank = cfg.n_experts // ep
    replicated = {}
    for rank, (got_out, got_dx, grads, _) in enumerate(results):
        # fp32, the same products; an expert's weight gradient sums the rows of every rank in
        # another order: reassociation only
        assert (got_out - want_out[rank]).abs().max() < 1e-5
        assert (got_dx - want_dx[rank]).abs().max() < 1e-5
        experts = {n for n in grads if n.startswith("experts.")}
        assert {int(n.split(".")[1]) for n in experts} == set(range(rank * per_rank, (rank + 1) * per_rank))
        for name in experts:
            assert (grads[name] - ref.get_parameter(name).grad).abs().max() < 1e-5, name
        for name in set(grads) - experts:
            replicated[name] = replicated.get(name, 0) + grads[name]
    # router and shared expert: each rank's gradient is its own tokens'; their sum is the whole's
    for name, total in replicated.items():
        assert (total - ref.get_parameter(name).grad).abs().max() < 1e-5, name
    counts = sum(r[3] for r in results)
    assert torch.equal(counts, ref.last_stats.tokens_per_expert)
    assert (ref.last_stats.tokens_per_expert == 0).any() or any((r[3] == 0).any() for r in results)


def _ep_model_rank(cfg, state: dict, tokens_all: torch.Tensor):
    """A whole MoE decoder with this rank's experts, on this rank's sequences."""
    import torch.distributed as dist

    from parallel3d.models.llama import Llama
    from parallel3d.models.moe.parallelize import apply_expert_parallel

    model = Llama(cfg)
    model.load_state_dict(state)
    apply_expert_parallel(model, dist.group.WORLD)
    logits = model(tokens_all[dist.get_rank()])
    logits.logsumexp(-1).sum().backward()
    return logits.detach(), {n: p.grad for n, p in model.named_parameters() if ".experts." in n}


def test_moe_decoder_at_ep2_equals_one_process(pools):
    """Qwen3-MoE-shaped (q/k norms, a dense first layer): every layer's experts split over 2
    ranks; logits of each rank's sequences and the experts' gradients equal one process."""
    from parallel3d.models.llama import Llama, LlamaConfig

    moe = MoEConfig(n_experts=4, top_k=2, ffn_dim=12, norm_topk_prob=True, dense_layers=(0,))
    cfg = LlamaConfig(vocab_size=53, dim=DIM, n_layers=3, n_heads=4, n_kv_heads=2, ffn_dim=24,
                      qk_norm=True, moe=moe)
    torch.manual_seed(7)
    ref = Llama(cfg)
    tokens_all = torch.randint(0, 53, (2, 2, 9))
    logits = ref(tokens_all.flatten(0, 1))
    logits.logsumexp(-1).sum().backward()
    results = pools(2).run(_ep_model_rank, cfg, ref.state_dict(), tokens_all)
    want = logits.detach().view(2, 2, 9, -1)
    for rank, (got, grads) in enumerate(results):
        assert (got - want[rank]).abs().max() < 1e-5  # fp32, reassociation only (as above)
        assert len(grads) == 2 * 2 * 3  # 2 sparse layers x 2 experts x 3 matrices
        for name, grad in grads.items():
            assert (grad - ref.get_parameter(name).grad).abs().max() < 1e-5, name


def _ranks_topology(group):
    """What :func:`finish_moe_step` reads of a topology: the tokens' data-parallel group."""
    from types import SimpleNamespace

    return SimpleNamespace(dp_cp_group=group, tp=1, tp_rank=0)


def _bias_update_rank(cfg: dict, state: dict, x_all: torch.Tensor):
    import torch.distributed as dist

    from parallel3d.models.moe.parallelize import finish_moe_step

    block = MoEBlock(MoEConfig(**cfg), DIM)
    block.load_state_dict(state)
    for micro in x_all[dist.get_rank()]:  # two micro-batches of this rank's tokens
        block(micro[None])
    parts = finish_moe_step(block, _ranks_topology(dist.group.WORLD), sequence_parallel=False)
    return block.gate.expert_bias, float(parts["imbalance"]), block.step_counts


def test_expert_bias_update_from_global_counts(pools):
    """2 ranks, 2 micro-batches each: both ranks move their bias as one process would
    from all 4 micro-batches' counts (the trainer's step end, ``finish_moe_step``), and
    the counts start again from nothing."""
    from parallel3d.models.moe.parallelize import finish_moe_step

    cfg = dict(n_experts=8, top_k=2, ffn_dim=8, score_func="sigmoid", expert_bias=True, bias_update_rate=0.01)
    torch.manual_seed(9)
    ref = MoEBlock(MoEConfig(**cfg), DIM)
    x_all = torch.randn(2, 2, 6, DIM)
    for micro in x_all.flatten(0, 1):
        ref(micro[None])
    counts = ref.step_counts.clone().double()
    want = float(finish_moe_step(ref, _ranks_topology(None), sequence_parallel=False)["imbalance"])
    # The rule by hand from the counts: +rate below the mean, -rate above, 0 at it.
    assert torch.equal(ref.gate.expert_bias, (0.01 * torch.sign(counts.mean() - counts)).float())
    assert want == float(counts.max() / counts.mean()) and want > 1.0 and ref.step_counts is None
    for bias, imbalance, step_counts in pools(2).run(_bias_update_rank, cfg, ref.state_dict() | {
            "gate.expert_bias": torch.zeros(8)}, x_all):
        assert torch.equal(bias, ref.gate.expert_bias) and imbalance == want and step_counts is None
    assert ref.gate.expert_bias.abs().sum() > 0


def _tp_ep_rank(cfg, state: dict, tokens: torch.Tensor, targets: torch.Tensor, sp: bool):
    """tp 2 x dp 2 with ep 2 (the experts split over the two dp ranks of each tp rank):
    this dp rank's sequences; gradients as the step would reduce them."""
    from parallel3d.config import ParallelConfig
    from parallel3d.distributed import all_reduce
    from parallel3d.models.llama import Llama
    from parallel3d.models.llama.parallelize import parallelize_llama
    from parallel3d.models.moe.parallelize import apply_expert_parallel
    from parallel3d.tensor_parallel import sync_tensor_parallel_grads
    from parallel3d.topology import Topology

    topo = Topology(2, 1, 2, ep=2)
    model = Llama(cfg)
    model.load_state_dict(state)
    model, loss_fn = parallelize_llama(model, topo, ParallelConfig(tp=2, dp=2, sequence_parallel=sp))
    apply_expert_parallel(model, topo.ep_group)
    loss = loss_fn(model(tokens[topo.dp_rank]), targets[topo.dp_rank])
    loss.backward()
    sync_tensor_parallel_grads(model.parameters(), topo)
    grads = {}
    for name, p in model.named_parameters():
        if ".experts." in name:  # summed over the ep group's tokens already; edp = 1
            grads[name] = p.grad / topo.dp
        else:
            grads[name] = all_reduce(p.grad.clone(), topo.dp_group) / topo.dp
        if getattr(p, "p3d_tp_dim", None) is not None:
            grads[name] = (grads[name], p.p3d_tp_dim, p.p3d_tp_range)
    return float(all_reduce(loss.detach().clone(), topo.dp_group)) / topo.dp, grads


@pytest.mark.parametrize("sp", [False, True])
def test_tensor_parallel_with_expert_parallel_equals_one_process(pools, sp):
    """Attention and dense MLPs split over tp 2, MoE blocks whole per tp rank and their
    experts over ep 2: the loss and every gradient equal one process's (fp32 1e-5)."""
    from parallel3d.models.llama import Llama, LlamaConfig
    from parallel3d.models.llama.parallelize import cross_entropy_loss

    moe = MoEConfig(n_experts=4, top_k=2, ffn_dim=12, shared_ffn_dim=8, shared_gate=True, dense_layers=(0,))
    cfg = LlamaConfig(vocab_size=53, dim=DIM, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=24, moe=moe)
    torch.manual_seed(11)
    ref = Llama(cfg)
    tokens = torch.randint(0, 53, (2, 2, 8))  # (dp, B, S)
    targets = torch.randint(0, 53, (2, 2, 8))
    loss = sum(cross_entropy_loss(ref(tokens[d]), targets[d]) for d in range(2)) / 2
    loss.backward()
    for got_loss, grads in pools(4).run(_tp_ep_rank, cfg, ref.state_dict(), tokens, targets, sp):
        assert abs(got_loss - loss.item()) < 1e-5
        assert any(".experts." in n for n in grads) and len(grads) < len(dict(ref.named_parameters()))
        for name, grad in grads.items():
            want = ref.get_parameter(name).grad
            if isinstance(grad, tuple):  # a tensor-parallel shard: its rows of the whole
                grad, dim, (start, stop) = grad
                want = torch.nn.functional.pad(want, [0, 0] * (want.dim() - 1 - dim) + [0, max(0, stop - want.shape[dim])])
                want = want.narrow(dim, start, stop - start)
            # fp32, partial sums reduced in another order: a few ulps of the largest entry
            assert (grad - want).abs().max() < 1e-5 * max(1.0, want.abs().max().item()), name
