"""The MoE block's parts: routing (top-k, renormalisation, DeepSeek-V3's group-limited sigmoid
routing against transformers' router), the expert-major dropless computation against a
token-by-token loop, capacity drops counted, the load-balancing loss, the aux-loss-free bias
update, and the choice of dense layers."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from parallel3d.models.llama import Llama, LlamaConfig
from parallel3d.models.moe import (MoEBlock, MoEConfig, RouterStats, dense_layers_from, load_balancing_loss,
                                   route, update_expert_bias_)

DIM = 24


def test_softmax_top_k_and_renormalisation():
    logits = torch.randn(37, 6, generator=torch.Generator().manual_seed(0))
    probs = logits.softmax(-1)
    plain = route(logits, MoEConfig(n_experts=6, top_k=3))
    assert torch.equal(plain.indices, logits.topk(3).indices)  # softmax keeps the order
    assert torch.equal(plain.weights, probs.gather(1, plain.indices))
    normed = route(logits, MoEConfig(n_experts=6, top_k=3, norm_topk_prob=True, routed_scaling=2.5))
    assert torch.equal(normed.indices, plain.indices)
    # fp32: one division and one product, a few ulps
    torch.testing.assert_close(normed.weights.sum(-1), torch.full((37,), 2.5), rtol=1e-6, atol=0)
    assert torch.equal(plain.probs, probs)


def test_group_limited_sigmoid_routing_equals_deepseek_v3():
    transformers = pytest.importorskip("transformers")
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    hf_cfg = transformers.DeepseekV3Config(hidden_size=DIM, n_routed_experts=16, num_experts_per_tok=4,
                                           n_group=4, topk_group=2, norm_topk_prob=True,
                                           routed_scaling_factor=2.5)
    ref = DeepseekV3TopkRouter(hf_cfg)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        ref.weight.copy_(torch.randn(16, DIM, generator=gen))
        ref.e_score_correction_bias.copy_(0.3 * torch.randn(16, generator=gen))
    x = torch.randn(53, DIM, generator=gen)
    _, want_w, want_idx = ref(x)
    cfg = MoEConfig(n_experts=16, top_k=4, score_func="sigmoid", n_group=4, topk_group=2, norm_topk_prob=True,
                    routed_scaling=2.5, expert_bias=True)
    got = route(F.linear(x, ref.weight), cfg, ref.e_score_correction_bias)
    # transformers returns the k experts unsorted: compare as sets, weights in the same order
    order_got, order_want = got.indices.sort(-1), want_idx.sort(-1)
    assert torch.equal(order_got.values, order_want.values)
    # the same fp32 ops but for transformers' + 1e-20 in the denominator (below an ulp of ~1)
    torch.testing.assert_close(got.weights.gather(1, order_got.indices),
                               want_w.gather(1, order_want.indices), rtol=1e-6, atol=1e-7)
    groups = (got.indices // 4).tolist()
    assert all(len(set(row)) <= 2 for row in groups)  # inside topk_group = 2 groups of 4
    # the bias moves the choice but not the weights: the unbiased sigmoid of the chosen
    scores = F.linear(x, ref.weight).sigmoid()
    chosen = scores.gather(1, got.indices)
    torch.testing.assert_close(got.weights, 2.5 * chosen / chosen.sum(-1, keepdim=True), rtol=1e-6, atol=1e-7)


def _token_by_token(block: MoEBlock, x: torch.Tensor) -> torch.Tensor:
    """Each token through its chosen experts one at a time: sum_j w_j E_j(x) + shared."""
    flat = x.reshape(-1, x.shape[-1])
    routing = block.gate(flat)
    rows = []
    for t in range(flat.shape[0]):
        y = sum(w * block.experts[str(int(e))](flat[t]) for w, e in zip(routing.weights[t], routing.indices[t]))
        if block.shared_expert is not None:
            y = y + torch.sigmoid(block.shared_expert_gate(flat[t])) * block.shared_expert(flat[t])
        rows.append(y)
    return torch.stack(rows).view_as(x)


@pytest.mark.parametrize("cfg", [
    MoEConfig(n_experts=5, top_k=2, ffn_dim=16, norm_topk_prob=True),
    MoEConfig(n_experts=8, top_k=3, ffn_dim=12, score_func="sigmoid", n_group=4, topk_group=2,
              routed_scaling=1.7, shared_ffn_dim=20, shared_gate=True, expert_bias=True),
], ids=["softmax", "grouped-sigmoid-shared"])
def test_expert_major_block_equals_token_by_token(cfg):
    torch.manual_seed(2)
    block = MoEBlock(cfg, DIM)
    if cfg.expert_bias:
        block.gate.expert_bias.normal_(0.0, 0.2)
    x = torch.randn(3, 11, DIM, requires_grad=True)
    got = block(x)
    want = _token_by_token(block, x)
    # fp32, the same products summed in another order
    assert (got - want).abs().max() < 1e-6
    g = torch.randn_like(got)
    params = [x, *block.parameters()]
    grads = torch.autograd.grad(got, params, g, allow_unused=True)
    want_grads = torch.autograd.grad(want, params, g, allow_unused=True)  # None: an expert no token chose
    for p, a, b in zip(params, grads, want_grads):
        a, b = (torch.zeros_like(p) if t is None else t for t in (a, b))
        assert (a - b).abs().max() < 1e-5
    stats = block.last_stats
    assert int(stats.tokens_per_expert.sum()) == 33 * cfg.top_k and int(stats.dropped) == 0


def test_capacity_drops_the_latest_assignments_and_counts_them():
    cfg = MoEConfig(n_experts=4, top_k=2, ffn_dim=8, capacity_factor=1.0)
    torch.manual_seed(3)
    block = MoEBlock(cfg, DIM)
    with torch.no_grad():  # every token prefers experts 0 and 1
        block.gate.weight.zero_()
        block.gate.weight[:2, 0] = torch.tensor([2.0, 1.0])
    x = torch.randn(1, 8, DIM)
    x[..., 0] = x[..., 0].abs() + 1.0
    out = block(x)[0]
    # capacity = ceil(1.0 * 8 tokens * 2 / 4 experts) = 4 per expert: tokens 0-3 kept by both
    # experts, tokens 4-7 dropped by both (8 assignments), their output 0 (the residual carries them)
    stats = block.last_stats
    assert stats.tokens_per_expert.tolist() == [8, 8, 0, 0] and int(stats.dropped) == 8
    dropless = MoEBlock(replace(cfg, capacity_factor=0.0), DIM)
    dropless.load_state_dict(block.state_dict())
    assert torch.equal(out[:4], dropless(x)[0, :4])
    assert torch.equal(out[4:], torch.zeros(4, DIM))
    assert stats.imbalance().item() == 2.0  # max 8 / mean 4


def test_load_balancing_loss_pooled_and_per_layer():
    E, k, T = 4, 2, 8
    uniform = RouterStats(torch.full((E,), T * k // E), torch.full((E,), T / E), T, torch.tensor(0))
    # perfectly balanced: E * sum_i (k / E) (1 / E) = k, in either form
    assert load_balancing_loss([uniform, uniform], E).item() == pytest.approx(k)
    skewed = RouterStats(torch.tensor([16, 0, 0, 0]), torch.tensor([8.0, 0, 0, 0]), T, torch.tensor(0))
    # one layer: E * (16/8) * (8/8) = 8; pooled with the uniform layer:
    # f = [16 + 4, 4, 4, 4] / 16, P = [8 + 2, 2, 2, 2] / 16 -> 4 * (200 + 3 * 8) / 256 = 3.5
    assert load_balancing_loss([skewed], E).item() == pytest.approx(8.0)
    assert load_balancing_loss([skewed, uniform], E).item() == pytest.approx(3.5)
    assert load_balancing_loss([skewed, uniform], E, pooled=False).item() == pytest.approx((8.0 + k) / 2)


def test_expert_bias_update_direction_and_balance():
    bias = torch.zeros(4)
    update_expert_bias_(bias, torch.tensor([10, 2, 4, 0]), rate=0.1)  # mean 4
    assert bias.tolist() == pytest.approx([-0.1, 0.1, 0.0, 0.1])
    # on skewed tokens, the bias alone (no gradient) balances the routing
    cfg = MoEConfig(n_experts=8, top_k=2, score_func="sigmoid", expert_bias=True)
    gen = torch.Generator().manual_seed(4)
    w = torch.randn(8, DIM, generator=gen) / DIM ** 0.5
    x = torch.randn(256, DIM, generator=gen) + 0.3 * DIM ** 0.5 * w[0]  # every token leans to expert 0
    bias = torch.zeros(8)

    def imbalance():
        counts = torch.bincount(route(F.linear(x, w), cfg, bias).indices.flatten(), minlength=8)
        return counts, (counts.max() / counts.float().mean()).item()

    counts, before = imbalance()
    for _ in range(300):
        update_expert_bias_(bias, counts, rate=0.01)
        counts, after = imbalance()
    assert before > 2.0 and after < 1.3, (before, after)


def test_dense_layers_and_the_decoder_choice():
    assert dense_layers_from(6, mlp_only_layers=[0]) == (0,)
    assert dense_layers_from(6, decoder_sparse_step=2) == (0, 2, 4)  # Qwen: (i + 1) % step
    assert dense_layers_from(6, first_k_dense_replace=3) == (0, 1, 2)  # DeepSeek
    moe = MoEConfig(n_experts=4, top_k=2, ffn_dim=8, dense_layers=(1,), shared_ffn_dim=8, shared_gate=True)
    cfg = LlamaConfig(vocab_size=61, dim=DIM, n_layers=3, n_heads=4, n_kv_heads=2, ffn_dim=40, moe=moe)
    model = Llama(cfg)
    kinds = [type(layer.mlp).__name__ for layer in model.layers.values()]
    assert kinds == ["MoEBlock", "MLP", "MoEBlock"]
    assert sum(p.numel() for p in model.parameters()) == cfg.num_params()
    model(torch.randint(0, 61, (2, 7)))
    assert len(model.moe_stats()) == 2 and model.aux_loss().requires_grad
    assert LlamaConfig(**{**cfg.__dict__, "moe": moe.__dict__}) == cfg  # the section read back from JSON
    with pytest.raises(ValueError, match=r"moe.dense_layers \[5\] are not layers"):
        replace(cfg, moe=replace(moe, dense_layers=(5,))).validate()
    with pytest.raises(ValueError, match="moe.topk_group 3 must be between 1 and moe.n_group 2"):
        MoEConfig(n_experts=4, n_group=2, topk_group=3).validate()


def test_meta_build_materializes_and_zeroes_the_expert_bias():
    from parallel3d.models.llama.sharded_init import init_llama_
    from parallel3d.tensor_parallel.init import materialize_

    moe = MoEConfig(n_experts=4, top_k=2, ffn_dim=8, score_func="sigmoid", expert_bias=True)
    cfg = LlamaConfig(vocab_size=61, dim=DIM, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=40, moe=moe)
    with torch.device("meta"):
        model = Llama(cfg)
    materialize_(model, "cpu")
    init_llama_(model, seed=3)
    biases = [b for n, b in model.named_buffers() if n.endswith("expert_bias")]
    assert len(biases) == 2 and all(torch.equal(b, torch.zeros(4)) for b in biases)
    assert torch.isfinite(model(torch.randint(0, 61, (1, 5)))).all()


def test_the_attached_auxiliary_loss_gradient_is_that_of_the_loss_plus_scale_times_aux():
    """Training attaches each layer's auxiliary loss to the block's output (its gradient
    weight ``aux_scale``, no loss value to carry through pipeline stages): every gradient
    equals the plain autograd gradient of ``loss + aux_scale * aux`` with ``aux`` the
    layer's own (per-layer) Switch loss; and the logged part is ``aux_log_weight * aux``."""
    cfg = MoEConfig(n_experts=6, top_k=2, ffn_dim=24, norm_topk_prob=True, shared_ffn_dim=16, shared_gate=True)
    torch.manual_seed(0)
    block = MoEBlock(cfg, 32)
    x, g = torch.randn(3, 10, 32), torch.randn(3, 10, 32)

    def grads(attach: bool, add: bool = True):
        block.zero_grad()
        block.aux_scale, block.aux_log_weight, block.step_aux = (0.37 if attach else None), 0.5, None
        out = block(x)
        loss = (out * g).sum()
        if not attach and add:
            loss = loss + 0.37 * load_balancing_loss([block.last_stats], cfg.n_experts, pooled=False)
        loss.backward()
        return [p.grad.clone() for p in block.parameters()], block.step_aux

    attached, logged = grads(True)
    reference, _ = grads(False)
    without, _ = grads(False, add=False)
    assert (attached[0] - without[0]).abs().max() > 1e-3 * without[0].abs().max()  # the router's
    for a, r in zip(attached, reference):
        torch.testing.assert_close(a, r, rtol=1e-6, atol=1e-7)  # the same sums, one extra add
    aux = load_balancing_loss([block.last_stats], cfg.n_experts, pooled=False)
    torch.testing.assert_close(logged, 0.5 * aux.detach())
