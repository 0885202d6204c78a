"""LoRA (``parallel3d/lora``): adapters from a PEFT folder made by ``peft`` itself give
peft's logits at tp and merge into peft's weights; LoRA trains with one process's per-step
losses at every layout (fp32, 1e-5, the parity bar of every layout test), the base weights
untouched bit for bit; the optimizer holds state for the adapters only; the export gathers
every rank. PEFT folders in one process and the settings' checks: tests/test_lora_peft.py."""

from __future__ import annotations

import pytest
import torch

from parallel3d.config import config_from_dict
from parallel3d.topology import Topology
from parallel3d.train.trainer import Trainer
from parallel3d.zero.buckets import SHARD_ALIGN

from helpers import relative_diff, tiny_job, torch_threads

STEPS = 8
RANK = 4
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# tiny_job's model: dim 64, 4 heads of 16, 2 kv-heads, ffn 160, 2 layers
DIM, HEADS, KV_HEADS, HEAD_DIM, FFN, LAYERS = 64, 4, 2, 16, 160, 2


def _job(corpus_dir, run_dir, **parallel) -> dict:
    # grad_clip below every step's norm (0.16-0.24 measured): Adam's update does not see a
    # gradient's scale, the clip does, so a factor summed over tp twice (or left
    # unsummed) moves the losses (measured: 1.4e-4 for the column A marked a partial sum)
    return tiny_job(corpus_dir, run_dir, train={"steps": STEPS, "lr": 2e-2, "grad_clip": 0.05}, parallel=parallel,
                    lora={"rank": RANK, "alpha": 8.0, "targets": TARGETS})


def _train(job: dict) -> dict:
    from parallel3d.zero.memory import memory_report

    cfg = config_from_dict(job)
    trainer = Trainer(cfg, Topology.of(cfg.parallel))
    frozen = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if not p.requires_grad}
    history = trainer.fit()
    opt = trainer.optimizer
    parts = getattr(opt, "parts", (opt,))
    params = dict(trainer.model.named_parameters())
    return {"losses": [h["loss"] for h in history],
            "frozen_unchanged": all(torch.equal(params[n], t) for n, t in frozen.items()),
            "frozen": len(frozen),
            "frozen_dtypes": sorted({str(t.dtype) for t in frozen.values()}),
            "frozen_with_grad": sum(params[n].grad is not None for n in frozen),
            "trainable": sorted(n for n, p in params.items() if p.requires_grad),
            "adapter_numel": sum(p.numel() for p in params.values() if p.requires_grad),
            "state_numel": sum(t.numel() for part in parts for t in part.memory_tensors()["optimizer_state"]),
            "report": memory_report(trainer.model, opt),
            "frozen_bytes": sum(t.numel() * t.element_size() for t in frozen.values()),
            "layers": sorted({n.split(".")[1] for n in params if n.startswith("layers.")})}


def _adapter_numel(tp: int, layers: int) -> int:
    """This rank's adapter elements, from the split rule: column-parallel layers (q k v
    gate up) hold A (r, in) whole and rows of B; row-parallel ones (o down) columns of A
    and B (out, r) whole."""
    q, kv = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    kv_rows = max(kv // tp, HEAD_DIM)  # tp > kv-heads: one whole kv-head per rank
    column = sum(RANK * DIM + rows * RANK for rows in (q // tp, kv_rows, kv_rows, FFN // tp, FFN // tp))
    row = RANK * q // tp + DIM * RANK + RANK * FFN // tp + DIM * RANK  # o, down
    return layers * (column + row)


@pytest.fixture(scope="module")
def reference(corpus_dir, tmp_path_factory):
    with torch_threads(1):
        return _train(_job(corpus_dir, str(tmp_path_factory.mktemp("ref"))))


def test_lora_trains_only_the_adapters(reference, corpus_dir, tmp_path):
    """Every weight but the adapters frozen, untouched and without gradients; Adam's two
    moments for the adapters only; the losses move (B starts at zero, so step 1 is the
    base model's loss, and the adapters learn)."""
    got = reference
    assert got["frozen_unchanged"] and got["frozen"] > 0 and got["frozen_with_grad"] == 0
    assert all(n.endswith(("lora_A.weight", "lora_B.weight")) for n in got["trainable"])
    assert len(got["trainable"]) == 2 * len(TARGETS) * LAYERS
    assert got["adapter_numel"] == _adapter_numel(1, LAYERS)
    assert got["state_numel"] == 2 * SHARD_ALIGN * -(-got["adapter_numel"] // SHARD_ALIGN)
    assert got["losses"][-1] < got["losses"][0] - 0.05, got["losses"]
    # the same job without LoRA trains every weight: a different run
    job = _job(corpus_dir, str(tmp_path))
    job["lora"]["rank"] = 0
    full = _train(job)
    assert full["losses"][0] == pytest.approx(got["losses"][0], rel=1e-6)  # B = 0: the base model
    assert relative_diff(full["losses"], got["losses"]) > 1e-3


@pytest.mark.parametrize("parallel", [
    {"tp": 2},
    {"tp": 4},  # each kv-head's k/v rows (and their B rows) on 2 ranks: partial gradients summed
    {"pp": 2, "schedule": "1f1b"},
    {"pp": 2, "schedule": "zb-h1"},
    {"dp": 2, "zero": 2},
    {"tp": 2, "pp": 2, "dp": 2, "zero": 2, "schedule": "zb-h1"},
    {"tp": 2, "pp": 2, "dp": 2, "zero": 1, "schedule": "1f1b"},
], ids=lambda p: "-".join(f"{k}{v}" for k, v in p.items()))
def test_lora_trains_as_one_process(pools, corpus_dir, tmp_path, reference, parallel):
    parallel = {"tp": 1, "pp": 1, "dp": 1, **parallel}
    world = parallel["tp"] * parallel["pp"] * parallel["dp"]
    ranks = pools(world).run(_train, _job(corpus_dir, str(tmp_path), **parallel))
    for got in ranks:
        assert relative_diff(got["losses"], reference["losses"]) < 1e-5, (got["losses"], reference["losses"])
        assert got["frozen_unchanged"] and got["frozen_with_grad"] == 0
        layers = len(got["layers"])
        assert layers == LAYERS // parallel["pp"]
        assert got["adapter_numel"] == _adapter_numel(parallel["tp"], layers)
        # Adam's two moments of this rank's adapters, one bucket sharded over dp under ZeRO
        shards = parallel["dp"] if parallel.get("zero", 0) else 1
        assert got["state_numel"] == 2 * SHARD_ALIGN * -(-got["adapter_numel"] // (shards * SHARD_ALIGN))
        # bytes (fp32): parameters = the frozen base + the adapters' bucket (padded to
        # shards x SHARD_ALIGN); gradients only for the adapters: the whole bucket
        # (ZeRO 0), the bucket and this rank's reduced shard (1), the shard (2)
        bucket = shards * SHARD_ALIGN * -(-got["adapter_numel"] // (shards * SHARD_ALIGN))
        grads = {0: bucket, 1: bucket + bucket // shards, 2: bucket // shards}[parallel.get("zero", 0)]
        report = got["report"]
        assert report["params"] == got["frozen_bytes"] + 4 * bucket
        assert report["grads"] == 4 * grads, (report, bucket)
        assert report["optimizer_state"] == 4 * 2 * bucket // shards


def _make_peft_adapter(folder, model_cfg):
    """A transformers Llama (seeded) and a peft LoRA on it with non-zero B, saved under
    ``folder`` (``base/`` and ``adapter/``); returns peft's model, in eval mode."""
    import peft
    import transformers

    from parallel3d.models.llama.hf import config_to_hf

    hf_cfg = transformers.LlamaConfig(**config_to_hf(model_cfg))
    hf_cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    base = transformers.LlamaForCausalLM(hf_cfg)
    base.save_pretrained(str(folder / "base"))
    wrapped = peft.get_peft_model(base, peft.LoraConfig(r=RANK, lora_alpha=8, target_modules=TARGETS,
                                                        lora_dropout=0.0, init_lora_weights=False))
    wrapped.save_pretrained(str(folder / "adapter"))
    return wrapped.eval()


def _lora_model(job: dict, base_folder: str):
    """(this rank's model, its topology): the base weights of ``base_folder`` split by
    ``parallelize_llama``, ``lora.adapter`` read by slices."""
    from safetensors.torch import load_file

    from parallel3d.lora import apply_lora, start_adapters_
    from parallel3d.models.llama.hf import name_from_hf
    from parallel3d.models.llama.model import Llama
    from parallel3d.models.llama.parallelize import parallelize_llama
    from parallel3d.train.setup import resolve_model_config

    cfg = config_from_dict(job)
    topo = Topology.of(cfg.parallel)
    model = Llama(resolve_model_config(cfg.model))
    state = load_file(f"{base_folder}/model.safetensors")
    model.load_state_dict({name_from_hf(k): v for k, v in state.items()}, strict=True)
    model, _ = parallelize_llama(model, topo, cfg.parallel)
    apply_lora(model, cfg, topo)
    start_adapters_(model, cfg.lora, seed=1)
    return model, topo


def _lora_logits(job: dict, base_folder: str, tokens: torch.Tensor) -> tuple[torch.Tensor, int]:
    """This rank's logits (its vocabulary columns) and their first column."""
    model, topo = _lora_model(job, base_folder)
    with torch.no_grad():
        logits = model(tokens)
    return logits, topo.tp_rank * logits.shape[-1]


def _merged(job: dict, base_folder: str, tokens: torch.Tensor) -> dict:
    """This rank's projection weights after ``merge_and_unload_`` (with their tp split),
    the logits before and after, and what parameters are left."""
    from parallel3d.lora import merge_and_unload_

    model, _ = _lora_model(job, base_folder)
    with torch.no_grad():
        before = model(tokens)
        merge_and_unload_(model)
        after = model(tokens)
    weights = {n: (p.detach().clone(), getattr(p, "p3d_tp_dim", None), getattr(p, "p3d_tp_range", None))
               for n, p in model.named_parameters() if n.split(".")[-2] in TARGETS}
    return {"before": before, "after": after, "weights": weights,
            "names": [n for n, _ in model.named_parameters()]}


@pytest.mark.parametrize("tp", [1, 2])
def test_merge_and_unload_equals_peft(pools, tmp_path, tp):
    """Each rank folds its adapters into its own block of the weights: the blocks equal
    the slices of peft's ``merge_and_unload()`` (fp32, 1e-6: the same fp32 product and
    sum), the adapters are gone and the logits are the adapted model's (1e-5)."""
    pytest.importorskip("peft")
    from parallel3d.models.llama.hf import name_to_hf
    from parallel3d.train.setup import resolve_model_config

    job = tiny_job("", str(tmp_path), parallel={"tp": tp},
                   lora={"rank": RANK, "alpha": 8.0, "targets": TARGETS, "adapter": str(tmp_path / "adapter")})
    wrapped = _make_peft_adapter(tmp_path, resolve_model_config(config_from_dict(job).model))
    merged = wrapped.merge_and_unload().state_dict()
    tokens = torch.randint(0, 512, (2, 24), generator=torch.Generator().manual_seed(3))
    for got in pools(tp).run(_merged, job, str(tmp_path / "base"), tokens):
        torch.testing.assert_close(got["after"], got["before"], rtol=1e-5, atol=1e-5)
        assert not any("lora" in n for n in got["names"])
        assert len(got["weights"]) == len(TARGETS) * LAYERS
        for name, (w, dim, rows) in got["weights"].items():
            want = merged[name_to_hf(name)]
            if dim is not None:
                want = want.narrow(dim, rows[0], rows[1] - rows[0])
            torch.testing.assert_close(w, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("tp", [2, 4])
def test_peft_adapter_loads_by_slices_at_tp(pools, tmp_path, tp):
    """At tp 2 (kv-heads split) and tp 4 (each of the 2 kv-heads replicated on 2 ranks),
    every rank's vocabulary columns of the logits equal peft's (fp32, 1e-5)."""
    pytest.importorskip("peft")
    from parallel3d.train.setup import resolve_model_config

    job = tiny_job("", str(tmp_path), parallel={"tp": tp},
                   lora={"rank": RANK, "alpha": 8.0, "targets": TARGETS, "adapter": str(tmp_path / "adapter")})
    wrapped = _make_peft_adapter(tmp_path, resolve_model_config(config_from_dict(job).model))
    tokens = torch.randint(0, 512, (2, 24), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = wrapped(input_ids=tokens).logits
    for logits, start in pools(tp).run(_lora_logits, job, str(tmp_path / "base"), tokens):
        torch.testing.assert_close(logits, want[..., start:start + logits.shape[-1]], rtol=1e-5, atol=1e-5)


def _train_and_export(job: dict, folder: str, spy: bool = False):
    """The run's losses; with ``spy``, also what the export moved: ``(losses, {"sent": [the
    blocks' names and shapes of each object this rank sent], "received": [...], "bytes": [its
    pickled size, per object received], "gathered": [world x the largest object, per
    gather_object]})``. Objects are compared by their blocks, not their pickled bytes: a
    re-pickled received object may frame a few bytes differently."""
    import pickle

    import torch.distributed as dist

    from parallel3d.checkpoint.foreign.peft import export_peft

    cfg = config_from_dict(job)
    trainer = Trainer(cfg, Topology.of(cfg.parallel))
    losses = [h["loss"] for h in trainer.fit()]
    moved = {"sent": [], "received": [], "bytes": [], "gathered": []}

    def blocks(obj):
        return sorted((name, dim, tuple(rows or ()), size, tuple(t.shape)) for name, dim, rows, size, t in obj)
    real = dist.send_object_list, dist.recv_object_list, dist.gather_object

    def send(objs, *a, **k):
        moved["sent"].append(blocks(objs[0]))
        return real[0](objs, *a, **k)

    def recv(objs, *a, **k):
        out = real[1](objs, *a, **k)
        moved["received"].append(blocks(objs[0]))
        moved["bytes"].append(len(pickle.dumps(objs[0])))
        return out

    def gather(obj, *a, **k):
        sizes = [None] * dist.get_world_size()
        dist.all_gather_object(sizes, len(pickle.dumps(obj)))
        moved["gathered"].append(len(sizes) * max(sizes))  # what torch allocates on the receiver
        return real[2](obj, *a, **k)

    if spy:
        dist.send_object_list, dist.recv_object_list, dist.gather_object = send, recv, gather
    try:
        export_peft(trainer.model, cfg.lora, folder, trainer.topo, optimizer=trainer.optimizer)
    finally:
        dist.send_object_list, dist.recv_object_list, dist.gather_object = real
    return (losses, moved) if spy else losses


def test_export_gathers_every_rank_at_2x2x2(pools, corpus_dir, tmp_path):
    """tp 2 x pp 2 x dp 2 (ZeRO 2, zb-h1): rank 0 assembles every stage's and tp rank's
    blocks; the folder holds the one-process run's adapters (per tensor within
    WEIGHT_RTOL: AdamW's amplification of ulp-level gradient differences) and its losses.
    The blocks travel one sender at a time: the 3 ranks of dp rank 0 other than rank 0
    send one object each, rank 0 receives those 3 and nothing else of that size (a
    gather_object would have sized its buffer 8 x the largest sender's)."""
    from safetensors.torch import load_file

    from helpers import WEIGHT_RTOL

    par = {"tp": 2, "pp": 2, "dp": 2, "zero": 2, "schedule": "zb-h1"}
    one = _train_and_export(_job(corpus_dir, str(tmp_path / "one")), str(tmp_path / "one_adapter"))
    ranks = pools(8).run(_train_and_export, _job(corpus_dir, str(tmp_path / "many"), **par),
                         str(tmp_path / "many_adapter"), spy=True)
    assert relative_diff(ranks[0][0], one) < 1e-5
    moved = [m for _, m in ranks]
    senders = [r for r in range(1, 8) if moved[r]["sent"]]
    assert len(senders) == 3 and all(len(moved[r]["sent"]) == 1 for r in senders)
    assert sorted(moved[0]["received"]) == sorted(moved[r]["sent"][0] for r in senders)
    # the one gather is of a flag a rank, far below one sender's blocks
    assert all(g < min(moved[0]["bytes"]) / 100 for m in moved for g in m["gathered"])
    want = load_file(str(tmp_path / "one_adapter" / "adapter_model.safetensors"))
    got = load_file(str(tmp_path / "many_adapter" / "adapter_model.safetensors"))
    assert sorted(got) == sorted(want) and len(got) == 2 * len(TARGETS) * LAYERS
    for key, t in want.items():
        assert got[key].shape == t.shape, key
        assert float((got[key] - t).norm() / t.norm()) < WEIGHT_RTOL, key


def _bf16(job: dict) -> dict:
    job["train"]["dtype"] = "bf16"
    return job


@pytest.mark.parametrize("parallel", [{"dp": 2, "zero": 1}, {"tp": 2}], ids=["dp2-zero1", "tp2"])
def test_lora_in_bf16(pools, corpus_dir, tmp_path, parallel):
    """bf16 storage: the frozen base stays bf16 with no master; the adapters' GEMMs add
    their weight gradients into the fp32 ``main_grad`` (ZeRO 0/1), their optimizer state
    is the fp32 masters and Adam's two moments (3 x their elements, sharded over dp under
    ZeRO); the losses equal one bf16 process's to BF16_U (helpers.py: what differently
    ordered bf16 sums give; tp 2 measured 1.3e-3, dp 2 4.6e-7)."""
    from helpers import BF16_U

    one = _train(_bf16(_job(corpus_dir, str(tmp_path / "one"))))
    assert one["frozen_unchanged"] and one["frozen_with_grad"] == 0
    ranks = pools(2).run(_train, _bf16(_job(corpus_dir, str(tmp_path / "two"), **parallel)))
    shards = parallel.get("dp", 1)
    for got in ranks:
        assert relative_diff(got["losses"], one["losses"]) < BF16_U, (got["losses"], one["losses"])
        assert got["frozen_unchanged"] and got["frozen_with_grad"] == 0
        assert got["frozen_dtypes"] == ["torch.bfloat16"]
        assert got["state_numel"] == 3 * SHARD_ALIGN * -(-got["adapter_numel"] // (shards * SHARD_ALIGN))


@pytest.mark.parametrize("recompute", ["selective", "full"])
def test_lora_with_recomputation_at_tp2(pools, corpus_dir, tmp_path, reference, recompute):
    """Activation recomputation re-runs the adapters with the layers (selective keeps the
    GEMM outputs, the adapters' included: the row-parallel adapter then reduces a copy,
    as the layer does): one process's losses (1e-5)."""
    job = _job(corpus_dir, str(tmp_path), tp=2)
    job["train"]["recompute"] = recompute
    for got in pools(2).run(_train, job):
        assert relative_diff(got["losses"], reference["losses"]) < 1e-5, (got["losses"], reference["losses"])
        assert got["frozen_unchanged"]


def test_trainable_weights_train_with_the_adapters(pools, corpus_dir, tmp_path, reference):
    """``lora.trainable = ["norm", "lm_head"]``: the final norm (replicated over tp) and
    the head (split by vocabulary) train with the adapters at tp 2 x pp 2 as in one
    process (1e-5); the other weights stay frozen and untouched."""
    def job(name, **parallel):
        j = _job(corpus_dir, str(tmp_path / name), **parallel)
        j["lora"]["trainable"] = ["norm", "lm_head"]
        return j

    one = _train(job("one"))
    assert sorted(n for n in one["trainable"] if ".lora_" not in n) == ["lm_head.weight", "norm.weight"]
    assert relative_diff(one["losses"], reference["losses"]) > 1e-4  # they train: not the adapters-only run
    ranks = pools(4).run(_train, job("four", tp=2, pp=2))
    for got in ranks:
        assert relative_diff(got["losses"], one["losses"]) < 1e-5, (got["losses"], one["losses"])
        assert got["frozen_unchanged"] and got["frozen_with_grad"] == 0
    last_stage = [n for got in ranks for n in got["trainable"] if ".lora_" not in n]
    assert sorted(last_stage) == ["lm_head.weight"] * 2 + ["norm.weight"] * 2  # the 2 tp ranks of stage 2
