"""The Triton kernels as torch custom ops: what recomputation policies and torch.compile see.

* Selective recomputation keeps the Triton GEMMs' outputs: counting kernel launches in a
  model whose decoder layers run the Triton GEMM, the forward GEMMs run once per layer
  under ``selective`` (as under ``none``) and twice under ``full``. Before the GEMM was a
  custom op the policy could not see it and ``selective`` re-ran every forward GEMM.
* ``torch.library.opcheck`` on every op (schema, fake implementation, registered autograd).
* ``torch.compile`` traces through the layer with the op in its graph, not a graph break.

The kernels run on CPU only under the Triton interpreter, which triton fixes at its first
import: as in test_kernels_linear.py, run this file with ``TRITON_INTERPRET=1`` or let
``test_custom_op_tests_in_interpreter_subprocess`` run it so (fp32: the interpreter's
bf16 tl.dot is wrong).
"""
from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys

import pytest
import torch
from torch import nn

from parallel3d.kernels import cross_entropy as CE
from parallel3d.kernels import linear as L
from parallel3d.kernels.gemm import linear

INTERPRETED = L._INTERPRETED
needs_interpreter = pytest.mark.skipif(not INTERPRETED, reason="needs TRITON_INTERPRET=1 (the subprocess test runs these)")

CFG = dict(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=48)
GEMMS_PER_LAYER = 7  # q, k, v, o, gate, up, down


def _triton_llama(recompute: str):
    """A Llama whose decoder-layer projections are the tensor-parallel layers (a group of
    one: no communication) running the Triton GEMM; lm_head stays torch's."""
    from parallel3d.models.llama import Llama, LlamaConfig
    from parallel3d.models.llama.parallelize import apply_recompute
    from parallel3d.tensor_parallel import ColumnParallelLinear, RowParallelLinear, share_input

    torch.manual_seed(0)
    model = Llama(LlamaConfig(**CFG))
    col = lambda lin: ColumnParallelLinear.from_dense(lin, None, backend="triton")  # noqa: E731
    row = lambda lin: RowParallelLinear.from_dense(lin, None, backend="triton")  # noqa: E731
    for layer in model.layers.values():
        attn, mlp = layer.self_attn, layer.mlp
        attn.q_proj, attn.k_proj, attn.v_proj = col(attn.q_proj), col(attn.k_proj), col(attn.v_proj)
        attn.o_proj = row(attn.o_proj)
        mlp.gate_proj, mlp.up_proj, mlp.down_proj = col(mlp.gate_proj), col(mlp.up_proj), row(mlp.down_proj)
        share_input(attn, attn.q_proj, attn.k_proj, attn.v_proj)
        share_input(mlp, mlp.gate_proj, mlp.up_proj)
    return apply_recompute(model, recompute)


@contextlib.contextmanager
def _counting_launches(monkeypatch):
    """Counts the Triton GEMM launches of each kind made inside the block."""
    counts = {"fwd": 0, "dgrad": 0, "wgrad": 0}
    launch = L._gemm

    def counting(kind, *args, **kwargs):
        counts[kind] += 1
        return launch(kind, *args, **kwargs)
    monkeypatch.setattr(L, "_gemm", counting)
    try:
        yield counts
    finally:
        monkeypatch.setattr(L, "_gemm", launch)


def _launches_and_grads(recompute: str, monkeypatch) -> tuple[dict, list[torch.Tensor]]:
    from parallel3d.models.llama.parallelize import cross_entropy_loss

    model = _triton_llama(recompute)
    tokens = torch.randint(0, CFG["vocab_size"], (2, 8), generator=torch.Generator().manual_seed(1))
    with _counting_launches(monkeypatch) as counts:
        cross_entropy_loss(model(tokens), tokens).backward()
    return counts, [p.grad for p in model.parameters()]


@needs_interpreter
def test_selective_recompute_keeps_the_triton_gemm_outputs(monkeypatch):
    runs = {mode: _launches_and_grads(mode, monkeypatch) for mode in ("none", "selective", "full")}
    layer_gemms = GEMMS_PER_LAYER * CFG["n_layers"]
    assert runs["none"][0] == {"fwd": layer_gemms, "dgrad": layer_gemms, "wgrad": layer_gemms}, runs["none"][0]
    # full re-runs every forward GEMM in the backward pass; selective must not
    assert runs["full"][0]["fwd"] == 2 * layer_gemms, runs["full"][0]
    assert runs["selective"][0] == runs["none"][0], (
        f"selective recomputation re-ran Triton GEMMs: {runs['selective'][0]} vs none {runs['none'][0]}")
    for mode in ("selective", "full"):  # the same kernels on the same inputs: the same bits
        for got, want in zip(runs[mode][1], runs["none"][1]):
            assert torch.equal(got, want), mode


@needs_interpreter
def test_a_split_backward_runs_the_triton_dgrads_in_b_and_the_wgrads_in_w(monkeypatch):
    """Zero-bubble schedules on the Triton path: under ``deferring`` the backward (B)
    launches every dgrad and no wgrad, the W launches every wgrad and no dgrad, and the
    gradients are the undivided backward's bit for bit (the same kernels on the same
    operands, only later)."""
    from parallel3d.kernels.deferred import DeferredWeightGrads, deferring
    from parallel3d.models.llama.parallelize import cross_entropy_loss, split_llama_weight_grads

    tokens = torch.randint(0, CFG["vocab_size"], (2, 8), generator=torch.Generator().manual_seed(1))
    undivided = _triton_llama("none")
    cross_entropy_loss(undivided(tokens), tokens).backward()
    model = split_llama_weight_grads(_triton_llama("none"))
    loss = cross_entropy_loss(model(tokens), tokens)
    work = DeferredWeightGrads()
    with _counting_launches(monkeypatch) as in_b, deferring(work):
        loss.backward()
    assert all(p.grad is None for p in model.parameters())
    with _counting_launches(monkeypatch) as counts:
        work.run()
    layer_gemms = GEMMS_PER_LAYER * CFG["n_layers"]
    assert in_b == {"fwd": 0, "dgrad": layer_gemms, "wgrad": 0}, in_b
    assert counts == {"fwd": 0, "dgrad": 0, "wgrad": layer_gemms}, counts
    for (name, got), want in zip(model.named_parameters(), undivided.parameters()):
        assert torch.equal(got.grad, want.grad), name


def _fp32(*shape, seed=0, scale=1.0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


@needs_interpreter
def test_opcheck_every_custom_op():
    x, w, b, dy = _fp32(37, 71), _fp32(53, 71, seed=1, scale=71**-0.5), _fp32(53, seed=2), _fp32(37, 53, seed=3)
    ops = torch.ops.parallel3d
    torch.library.opcheck(ops.linear_fwd.default, (x.requires_grad_(), w.requires_grad_(), b.requires_grad_()))
    torch.library.opcheck(ops.linear_fwd.default, (x.detach(), w.detach(), None))
    torch.library.opcheck(ops.linear_dgrad.default, (dy, w.detach()))
    torch.library.opcheck(ops.linear_wgrad.default, (dy, x.detach(), True))
    torch.library.opcheck(ops.linear_wgrad.default, (dy, x.detach(), False))
    torch.library.opcheck(ops.linear_wgrad_into.default, (dy, x.detach(), torch.zeros(53, 71), True))
    z, target = _fp32(19, 40, seed=4) * 3, torch.randint(-5, 45, (19,), generator=torch.Generator().manual_seed(5))
    m, s, _ = CE.ce_local_stats_ref(z, target, 33)
    torch.library.opcheck(ops.ce_local_stats.default, (z, target, 33))
    torch.library.opcheck(ops.ce_local_grad.default, (z, target, 33, m, s, _fp32(19, seed=6)))


@needs_interpreter
def test_registered_autograd_of_the_forward_op_matches_the_reference():
    x, w, b = (t.requires_grad_() for t in (_fp32(9, 17), _fp32(5, 17, seed=1), _fp32(5, seed=2)))
    dy = _fp32(9, 5, seed=3)
    torch.ops.parallel3d.linear_fwd(x, w, b).backward(dy)
    ours = [t.grad.clone() for t in (x, w, b)]
    for t in (x, w, b):
        t.grad = None
    L.linear_ref(x, w, b).backward(dy)
    for got, want in zip(ours, (x.grad, w.grad, b.grad)):
        torch.testing.assert_close(got, want, rtol=0, atol=2e-5)  # fp32, summation order only


@needs_interpreter
def test_torch_compile_sees_the_gemm_op():
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    seen = []

    def record(gm, example_inputs):
        seen.extend(str(node.target) for node in gm.graph.nodes if node.op == "call_function")
        return make_boxed_func(gm.forward)

    torch._dynamo.reset()
    w = nn.Parameter(_fp32(5, 17, seed=1))
    x = _fp32(9, 17).requires_grad_()
    compiled = torch.compile(lambda x: linear(x, w, None, backend="triton").relu(), fullgraph=True,
                             backend=aot_autograd(fw_compiler=record, bw_compiler=record))
    compiled(x).sum().backward()
    eager_w, eager_x = w.grad.clone(), x.grad.clone()
    w.grad = x.grad = None
    linear(x, w, None, backend="triton").relu().sum().backward()
    assert "parallel3d.linear_fwd.default" in seen, seen
    assert {"parallel3d.linear_dgrad.default", "parallel3d.linear_wgrad.default"} <= set(seen), seen
    assert torch.equal(eager_w, w.grad) and torch.equal(eager_x, x.grad)


@pytest.mark.skipif(INTERPRETED, reason="the tests above already ran in this process")
def test_custom_op_tests_in_interpreter_subprocess():
    env = dict(os.environ, TRITON_INTERPRET="1")
    cmd = [sys.executable, "-m", "pytest", __file__, "-q", "-p", "no:cacheprovider"]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    tail = done.stdout[-4000:]
    assert done.returncode == 0, f"interpreter run failed:\n{tail}\n{done.stderr[-3000:]}"
    assert re.search(r"\b5 passed, 1 skipped\b", tail), (
        f"expected 5 passed and only the subprocess test skipped in the interpreter run:\n{tail}")
