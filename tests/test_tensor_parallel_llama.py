"""The parallelized Llama against the dense model: loss, every parameter's gradient and
the global grad norm at tp 2 and 4 (with sequence parallelism, tied embeddings, padded
vocabulary), a middle pipeline stage without embedding and head, no tensor with the full
vocabulary on the vocab-parallel path, shards initialised directly equal to slices of the
full model; the checks before any process group. Built and compared as in
tests/test_tensor_parallel.py (the layers'), on a pool of 4 gloo ranks, with its
tolerance (RTOL: fp32, ||a - b|| / ||b|| < 1e-5)."""

from __future__ import annotations

import pytest
import torch

from parallel3d.errors import UserError
from parallel3d.models.llama import Llama, LlamaConfig
from parallel3d.models.llama.parallelize import (apply_tensor_parallel, check_tensor_parallel,
                                                 cross_entropy_loss, parallelize_llama)
from parallel3d.config import ParallelConfig
from parallel3d.tensor_parallel import padded_size, sync_tensor_parallel_grads
from parallel3d.topology import Topology
from parallel3d.grad_norm import global_grad_norm

from test_tensor_parallel import RTOL, _rows, _seq, _topology, rel


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
