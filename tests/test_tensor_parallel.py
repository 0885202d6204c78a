"""Tensor-parallel layers, loss and the parallelized Llama against single-device twins.

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

from parallel3d.errors import UserError
from parallel3d.models.llama import Llama, LlamaConfig
from parallel3d.models.llama.parallelize import (apply_tensor_parallel, check_tensor_parallel,
                                                 cross_entropy_loss, parallelize_llama)
from parallel3d.config import ParallelConfig
from parallel3d.tensor_parallel import (ColumnParallelLinear, RowParallelLinear,
                                        VocabParallelEmbedding, gather_from_sequence,
                                        padded_size, scatter_to_sequence, scatter_to_tp_region,
                                        sync_tensor_parallel_grads,
                                        vocab_parallel_cross_entropy)
from parallel3d.topology import Topology
from parallel3d.grad_norm import global_grad_norm

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


# -- the parallelized Llama --------------------------------------------------------------

SMALL = LlamaConfig(vocab_size=101, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=48)


def check_llama(tp: int, dp: int, sp: bool, tied: bool) -> dict[str, float]:
    """Forward + backward of the sharded model vs the dense one; loss, every parameter's
    gradient (after the tp gradient sync) and the global grad norm."""
    topo = _topology(tp, dp)
    cfg = LlamaConfig(**{**SMALL.__dict__, "tie_embeddings": tied})
    torch.manual_seed(5)
    dense = Llama(cfg)
    torch.manual_seed(5)
    model, loss_fn = parallelize_llama(Llama(cfg), topo, ParallelConfig(
        tp=tp, dp=dp, sequence_parallel=sp))
    tokens = torch.randint(0, cfg.vocab_size, (2, 8))
    targets = torch.randint(0, cfg.vocab_size, (2, 8))

    ref = cross_entropy_loss(dense(tokens), targets)
    ref.backward()
    loss = loss_fn(model(tokens), targets)
    loss.backward()
    sync_tensor_parallel_grads(model.parameters(), topo)

    errs = {"loss": rel(loss.detach(), ref.detach())}
    dense_params = dict(dense.named_parameters())
    for name, p in model.named_parameters():
        errs[name] = rel(p.grad, _rows(dense_params[name].grad, p))
    norm = global_grad_norm(((p.grad, p) for p in model.parameters()), topo)
    norm_ref = global_grad_norm(((p.grad, p) for p in dense.parameters()), Topology.single())
    errs["grad_norm"] = rel(norm, norm_ref)
    return errs


@pytest.mark.parametrize("tp,sp,tied", [(2, False, False), (2, True, True),
                                        (4, False, True), (4, True, False)])
def test_llama_gradients_equal_the_dense_model(pools, tp, sp, tied):
    """tp=4 with 2 kv-heads replicates each kv-head on 2 ranks; vocab 101 is padded."""
    for rank, errs in enumerate(pools(4).run(check_llama, tp, 4 // tp, sp, tied)):
        bad = {k: e for k, e in errs.items() if not e < RTOL}
        assert not bad, f"rank {rank}: {bad}"
        n_params = 2 * 9 + 2 - tied + 1  # 9 per layer, embed + lm_head (unless tied), norm
        assert len(errs) == n_params + 2


def check_stage_without_ends(tp: int, dp: int, sp: bool) -> dict[str, float]:
    """A middle pipeline stage (no embedding, final norm or head) maps hidden states to
    hidden states; under sequence parallelism both are this rank's sequence shard."""
    topo = _topology(tp, dp)
    torch.manual_seed(9)
    dense = Llama(SMALL)
    torch.manual_seed(9)
    stage = Llama(SMALL)
    stage.embed_tokens = stage.norm = stage.lm_head = None
    apply_tensor_parallel(stage, topo, sequence_parallel=sp)
    h = torch.randn(2, 8, SMALL.dim)
    ref = h
    for layer in dense.layers.values():
        ref = layer(ref, *dense.rope(8, h.device))
    h_in = _seq(h, topo, sp).clone().requires_grad_()
    out = stage(h_in)
    return {"hidden": rel(out, _seq(ref.detach(), topo, sp))}


@pytest.mark.parametrize("sp", [False, True])
def test_a_stage_without_embedding_and_head_is_split_too(pools, sp):
    for rank, errs in enumerate(pools(4).run(check_stage_without_ends, 4, 1, sp)):
        assert errs["hidden"] < RTOL, (rank, errs)


# -- acceptance 4: no tensor with the full vocabulary ------------------------------------

def _recorded_shapes(fn) -> list[tuple[str, tuple[int, ...]]]:
    """Every tensor an op returns while ``fn`` runs (forward and backward), with its phase."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    seen: list[tuple[str, tuple[int, ...]]] = []

    class Recorder(TorchDispatchMode):
        phase = "forward"

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    seen.append((self.phase, tuple(t.shape)))
            return out

    with Recorder() as rec:
        fn(rec)
    return seen


def check_no_full_vocab_tensor(tp: int, dp: int) -> dict:
    topo = _topology(tp, dp)
    cfg = SMALL  # vocab 101, padded 102 / 104; no other size in the model is near it
    full_sizes = {101, 102, 104}
    torch.manual_seed(6)
    model, loss_fn = parallelize_llama(Llama(cfg), topo, ParallelConfig(tp=tp, dp=dp))
    dense = Llama(cfg)
    tokens = torch.randint(0, cfg.vocab_size, (2, 8))
    targets = torch.randint(0, cfg.vocab_size, (2, 8))

    def step(m, lf):
        def run(rec):
            loss = lf(m(tokens), targets)
            rec.phase = "backward"
            loss.backward()
        return run

    sharded = _recorded_shapes(step(model, loss_fn))
    control = _recorded_shapes(step(dense, cross_entropy_loss))
    local = padded_size(cfg.vocab_size, tp) // tp  # this rank's logit columns
    return {
        "full_vocab_shapes": sorted({s for _, s in sharded if full_sizes & set(s)}),
        "backward_ops": sum(phase == "backward" for phase, _ in sharded),
        "local_logits_seen": any(local in s for _, s in sharded),
        "control_sees_full_vocab": any(101 in s for _, s in control),
    }


@pytest.mark.parametrize("tp", [2, 4])
def test_vocab_parallel_path_allocates_no_full_vocab_tensor(pools, tp):
    """Forward + backward of the embedding, the lm_head and the loss on every rank: no
    op returns a tensor with a dimension of the full (or padded) vocabulary. The control
    run (dense model, same recorder) does see it, so the recorder can tell."""
    for rank, r in enumerate(pools(4).run(check_no_full_vocab_tensor, tp, 4 // tp)):
        assert r["control_sees_full_vocab"], "the recorder missed the dense model's logits"
        assert r["backward_ops"] > 50, "the recorder did not see the backward"
        assert r["local_logits_seen"], "the recorder did not see the sharded logits"
        assert r["full_vocab_shapes"] == [], f"rank {rank}: {r['full_vocab_shapes']}"


# -- checks before any process group -----------------------------------------------------

@pytest.mark.parametrize("heads,kv,ffn,tp,message", [
    (4, 2, 48, 3, "model.n_heads 4 is not divisible by parallel.tp 3"),
    (6, 3, 48, 2, "model.n_kv_heads 3 and parallel.tp 2: one must divide the other"),
    (8, 2, 50, 4, "model.ffn_dim 50 is not divisible by parallel.tp 4"),
])
def test_unsplittable_models_are_refused_with_the_numbers(heads, kv, ffn, tp, message):
    cfg = LlamaConfig(vocab_size=101, dim=48, n_layers=1, n_heads=heads, n_kv_heads=kv, ffn_dim=ffn)
    with pytest.raises(UserError, match=message):
        check_tensor_parallel(cfg, tp)


def test_job_checks_for_sequence_parallel_and_backend():
    from parallel3d.config import load_config
    from parallel3d.train.setup import check_job, resolve_model_config

    def check(*overrides):
        cfg = load_config(None, list(overrides))
        check_job(cfg, resolve_model_config(cfg.model), cfg.parallel.tp * cfg.parallel.dp)

    check("--parallel.tp=4", "--parallel.sequence_parallel=true")  # 4 heads, 2 kv: replicated
    with pytest.raises(UserError, match="train.seq_len 130 is not divisible by parallel.tp 4"):
        check("--parallel.tp=4", "--parallel.sequence_parallel=true", "--train.seq_len=130")
    with pytest.raises(UserError, match="parallel.linear_backend 'cuda' is not supported"):
        check("--parallel.linear_backend=cuda")


# -- initialising shards directly --------------------------------------------------------

def check_sharded_init(tp: int, dp: int, tied: bool) -> dict[str, float]:
    """Meta build + per-shard counter init vs the slices of the full model given the
    same init: they must be equal exactly (the same float64 formula per element)."""
    from parallel3d.models.llama.sharded_init import build_sharded_llama, init_llama_

    topo = _topology(tp, dp)
    cfg = LlamaConfig(**{**SMALL.__dict__, "tie_embeddings": tied})
    dense = init_llama_(Llama(cfg), seed=11)
    model, loss_fn = build_sharded_llama(cfg, topo, ParallelConfig(tp=tp, dp=dp), seed=11)
    dense_params = dict(dense.named_parameters())
    diffs = {name: float((p.detach() - _rows(dense_params[name].detach(), p)).abs().max())
             for name, p in model.named_parameters()}
    torch.manual_seed(12)  # the same tokens on every rank
    tokens = torch.randint(0, cfg.vocab_size, (2, 8))
    diffs["loss"] = rel(loss_fn(model(tokens), tokens), cross_entropy_loss(dense(tokens), tokens))
    diffs["tied"] = float(tied and model.lm_head.weight is not model.embed_tokens.weight)
    return diffs


@pytest.mark.parametrize("tp,tied", [(2, True), (4, False)])
def test_shards_initialised_directly_equal_slices_of_the_full_model(pools, tp, tied):
    for rank, diffs in enumerate(pools(4).run(check_sharded_init, tp, 4 // tp, tied)):
        loss = diffs.pop("loss")
        assert loss < RTOL, (rank, loss)
        assert all(d == 0.0 for d in diffs.values()), (rank, diffs)


def test_counter_init_has_the_requested_distribution():
    from parallel3d.models.llama.sharded_init import init_llama_

    cfg = LlamaConfig(vocab_size=1000, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=256)
    model = init_llama_(Llama(cfg), seed=3).requires_grad_(False)
    emb = model.embed_tokens.weight  # 64k samples: the std is within ~0.3% (1 sigma)
    assert abs(float(emb.std()) / cfg.init_std - 1) < 0.02 and abs(float(emb.mean())) < 3e-4
    down = model.layers["0"].mlp.down_proj.weight
    assert abs(float(down.std()) / (cfg.init_std / 2) - 1) < 0.03  # 1/sqrt(2 * n_layers)
    q0, q1 = model.layers["0"].self_attn.q_proj.weight, model.layers["1"].self_attn.q_proj.weight
    assert abs(float(torch.corrcoef(torch.stack([q0.flatten(), q1.flatten()]))[0, 1])) < 0.02
    again = init_llama_(Llama(cfg), seed=3).embed_tokens.weight
    other = init_llama_(Llama(cfg), seed=4).embed_tokens.weight
    assert torch.equal(emb, again) and not torch.equal(emb, other)


def test_counter_init_in_parallel_chunks_equals_one_chunk_at_a_time(monkeypatch):
    """Chunks generated on several threads, in any order, give the values of one thread
    generating them in turn, bit for bit, whole and for a row-parallel block; and a value
    does not depend on the chunk it was computed in."""
    from parallel3d.tensor_parallel import init

    def fill(workers: int, chunk: int) -> list[torch.Tensor]:
        monkeypatch.setattr(init, "_workers", lambda: workers)
        monkeypatch.setattr(init, "_CHUNK", chunk)
        whole = init.counter_normal_(torch.empty(5 * 4096 + 37), 0.02, seed=9, name="w")
        rows = init.counter_normal_(torch.empty(50, 300, dtype=torch.bfloat16), 0.5, seed=9, name="r",
                                    full_shape=(50, 600), dim=1, start=300)
        return [whole, rows]
    one = fill(1, 4096)
    for got in (fill(4, 4096), fill(3, 1000)):
        assert all(torch.equal(a, b) for a, b in zip(one, got))
