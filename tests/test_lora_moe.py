"""LoRA on a Mixture-of-Experts model (``parallel3d/lora/experts.py``): every routed
expert's projections and the shared expert's get adapters of their own; the model with
them computes what the model with every adapter merged into its weight computes (fp32,
1e-5); it trains with one process's per-step losses at dp 2 x ep 2 (ZeRO 1), at
tp 2 x pp 2 x dp 2 x ep 2 (ZeRO 2 and 3, zb-h1) and at dp 4 x ep 2 (ZeRO 3: the frozen
experts sharded over edp, the rest over dp), the frozen weights bit-identical after
training, each rank holding the adapters of its own experts only, its gradient and
optimizer bytes those the dry run states; a checkpoint resumes across ep."""

from __future__ import annotations

import copy

import pytest
import torch

from parallel3d.config import config_from_dict
from parallel3d.topology import Topology
from parallel3d.train.trainer import Trainer

from helpers import relative_diff, tiny_job

STEPS = 8
RANK = 4
TARGETS = ["q_proj", "v_proj", "gate_proj", "up_proj", "down_proj"]
# the debug-moe model's 3 layers: layer 0 dense, layers 1 and 2 with 8 experts (ffn 96), top 2
MOE = {"n_experts": 8, "top_k": 2, "ffn_dim": 96, "norm_topk_prob": True, "dense_layers": [0],
       "aux_loss_coef": 0.01, "shared_ffn_dim": 32}


def _job(corpus_dir, run_dir, **parallel) -> dict:
    # grad_clip below the steps' norms: a factor's gradient summed over the wrong ranks
    # (tp's, the experts' replicas) changes the clip coefficient, and so the losses
    job = tiny_job(corpus_dir, run_dir, train={"steps": STEPS, "lr": 2e-2, "grad_clip": 0.05},
                   parallel=parallel, lora={"rank": RANK, "alpha": 8.0, "targets": TARGETS})
    job["model"].update(preset="debug-moe", n_layers=3, moe=MOE)
    return job


def _train(job: dict, stop_at: int | None = None) -> dict:
    from parallel3d.train.dryrun import lora_state_bytes
    from parallel3d.zero.memory import memory_report

    cfg = config_from_dict(job)
    trainer = Trainer(cfg, Topology.of(cfg.parallel))
    opt = trainer.optimizer
    parts = getattr(opt, "parts", (opt,))
    sharded = [part.frozen for part in parts if getattr(part, "frozen", None) is not None]  # ZeRO 3
    holders = [m for f in sharded for m in getattr(f, "members", [f])]  # a FrozenGroups' members
    for f in sharded:  # whole, to copy (freed by the first update)
        f.gather_all()
    frozen = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if not p.requires_grad}
    history = trainer.fit(stop_at=stop_at)
    report = memory_report(trainer.model, opt)  # (before anything is gathered again)
    for f in sharded:
        f.gather_all()
    params = dict(trainer.model.named_parameters())
    trainable = sorted(n for n, p in params.items() if p.requires_grad)
    return {"losses": [h["loss"] for h in history],
            "frozen_unchanged": all(torch.equal(params[n], t) for n, t in frozen.items()),
            "frozen_with_grad": sum(params[n].grad is not None for n in frozen),
            "trainable": trainable,
            "expert_adapters": sorted({n.split(".experts.")[1].split(".")[0] for n in trainable
                                       if ".experts." in n}),
            "adapter_numel": sum(params[n].numel() for n in trainable),
            "report": report,
            "formula": lora_state_bytes(trainer.model, "fp32", cfg.parallel.zero, cfg.parallel.dp,
                                        cfg.parallel.dp // cfg.parallel.ep),
            "state_numel": sum(t.numel() for part in parts for t in part.memory_tensors()["optimizer_state"]),
            "frozen_replicas": [h.layout.dp for h in holders]}


@pytest.fixture(scope="module")
def reference(one_thread, corpus_dir, tmp_path_factory):
    return _train(_job(corpus_dir, str(tmp_path_factory.mktemp("ref"))))


def test_expert_adapters_compute_their_merged_weights(corpus_dir, tmp_path):
    """Random A and B on every target (B is zero at the start: the check would be empty)
    give the logits of the same model with each adapter merged into its weight, expert
    by expert; without the adapters' own computation in the experts (the experts' weights
    alone) they differ."""
    from parallel3d.lora.adapters import adapter_parameters
    from parallel3d.lora.merge import merge_and_unload_

    cfg = config_from_dict(_job(corpus_dir, str(tmp_path)))
    trainer = Trainer(cfg, Topology.of(cfg.parallel), log=False)
    model = trainer.model
    gen = torch.Generator().manual_seed(3)
    names = []
    with torch.no_grad():
        for name, p in adapter_parameters(model):
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
            names.append(name)
    # every held expert of both sparse layers, three projections, two factors; the shared
    # expert's three; q and v of all three layers; the dense layer's MLP
    assert sum(".experts." in n for n in names) == 2 * 8 * 3 * 2
    assert sum(".shared_expert." in n for n in names) == 2 * 3 * 2
    assert len(names) == 2 * 8 * 3 * 2 + 2 * 3 * 2 + 3 * 2 * 2 + 3 * 2
    tokens = torch.randint(0, 512, (2, 32), generator=gen)
    model.eval()
    with torch.no_grad():
        got = model(tokens)
        merged = merge_and_unload_(copy.deepcopy(model))
        assert not list(adapter_parameters(merged))
        want = merged(tokens)
        block = model.layers["1"].mlp
        block.experts.swiglu = type(block.experts).swiglu  # the weights alone, in the experts
        without = model(tokens)
    def diff(a, b):  # max error over the largest logit (fp32 rounding: ~1e-7)
        return float((a - b).abs().max() / b.abs().max())

    assert diff(got, want) < 1e-5, diff(got, want)
    assert diff(without, want) > 1e-3


def test_moe_lora_trains_only_adapters(reference):
    assert reference["frozen_unchanged"] and reference["frozen_with_grad"] == 0
    assert reference["expert_adapters"] == [str(e) for e in range(8)]
    assert all(".lora_" in n for n in reference["trainable"])
    assert reference["state_numel"] >= 2 * reference["adapter_numel"]  # Adam's two moments, padded
    assert reference["state_numel"] < 2 * reference["adapter_numel"] + 4096


@pytest.mark.parametrize("parallel", [
    {"dp": 2, "ep": 2, "zero": 1},
    {"tp": 2, "pp": 2, "dp": 2, "ep": 2, "zero": 2, "schedule": "zb-h1"},
    {"dp": 4, "ep": 2, "zero": 3},
    {"tp": 2, "pp": 2, "dp": 2, "ep": 2, "zero": 3, "schedule": "zb-h1"},
], ids=lambda p: "-".join(f"{k}{v}" for k, v in p.items()))
def test_moe_lora_trains_as_one_process(pools, corpus_dir, tmp_path, reference, parallel):
    parallel = {"tp": 1, "pp": 1, **parallel}
    world = parallel["tp"] * parallel["pp"] * parallel["dp"]
    ranks = pools(world).run(_train, _job(corpus_dir, str(tmp_path), **parallel))
    ep = parallel["ep"]
    for rank, got in enumerate(ranks):
        assert relative_diff(got["losses"], reference["losses"]) < 1e-5, (got["losses"], reference["losses"])
        assert got["frozen_unchanged"] and got["frozen_with_grad"] == 0
        topo = Topology.of(config_from_dict(_job("", "", **parallel)).parallel, rank=rank,
                           world_size=world, create_groups=False)
        # the dry run's bytes (the routed experts' adapters sharded over edp, the rest over
        # dp) are the optimizer's, buffer for buffer
        f, r = got["formula"], got["report"]
        assert (f.weights, f.grads, f.optimizer) == (r["params"], r["grads"], r["optimizer_state"]), (f, r)
        if got["expert_adapters"]:  # a stage with a sparse layer: its own experts' adapters only
            assert got["expert_adapters"] == [str(e) for e in range(topo.ep_rank * 8 // ep,
                                                                    (topo.ep_rank + 1) * 8 // ep)]


def test_attention_only_lora_at_zero3_ep2_shards_the_frozen_experts_and_trains_as_one_process(
        pools, one_thread, corpus_dir, tmp_path):
    """LoRA on the attention only of a Mixture-of-Experts model at dp 4 x ep 2, ZeRO 3: one
    optimizer for the adapters, the frozen dense weights sharded over dp (4) and the frozen
    experts over their own replicas (edp 2), beside it. Losses equal one process's (fp32,
    1e-5), the base is unchanged, the bytes are the dry run's, and a run stopped at step 4
    continues with the straight run's losses."""
    def job(name, **parallel):
        j = _job(corpus_dir, str(tmp_path / name), **parallel)
        j["lora"]["targets"] = ["q_proj", "v_proj"]
        return j

    one = _train(job("one"))
    layout = {"dp": 4, "ep": 2, "zero": 3}
    ranks = pools(4).run(_train, job("4", **layout))
    for got in ranks:
        assert relative_diff(got["losses"], one["losses"]) < 1e-5, (got["losses"], one["losses"])
        assert got["frozen_unchanged"] and got["frozen_with_grad"] == 0 and not got["expert_adapters"]
        f, r = got["formula"], got["report"]
        assert (f.weights, f.grads, f.optimizer) == (r["params"], r["grads"], r["optimizer_state"]), (f, r)
        assert got["frozen_replicas"] == [4, 2]  # the dense frozen weights over dp, the experts over edp
    first = job("first", **layout)
    first["checkpoint"] = {"interval": 4, "keep": 0}
    assert pools(4).run(_train, first, 4)[0]["losses"] == ranks[0]["losses"][:4]
    then = job("then", **layout)
    then["checkpoint"] = {"resume": str(tmp_path / "first" / "checkpoints" / "step_00000004")}
    for got in pools(4).run(_train, then):
        assert relative_diff(got["losses"], ranks[0]["losses"][4:]) < 1e-5, (got["losses"], ranks[0]["losses"])
        assert got["frozen_unchanged"]


def test_expert_adapters_resume_across_ep(pools, corpus_dir, tmp_path):
    """A LoRA checkpoint holds each expert's adapters under the expert's name (whoever
    holds it): a dp 2 x ep 2 run stopped at step 4 continues at ep 1 (dp 2) and at
    dp 4 x ep 4 with the straight run's losses (1e-5)."""
    def job(name, **par):
        j = _job(corpus_dir, str(tmp_path / name), zero=1, **par)
        j["checkpoint"] = {"interval": 4, "keep": 0}
        return j

    straight = pools(2).run(_train, job("straight", dp=2, ep=2))[0]["losses"]
    first = pools(2).run(_train, job("resumed", dp=2, ep=2), 4)[0]["losses"]
    assert first == straight[:4]
    stopped = str(tmp_path / "resumed" / "checkpoints" / "step_00000004")
    for par, world in (({"dp": 2, "ep": 1}, 2), ({"dp": 4, "ep": 4}, 4)):
        other = job("at-" + "-".join(map(str, par.values())), **par)
        other["checkpoint"]["resume"] = stopped
        continued = pools(world).run(_train, other)
        for got in continued:
            assert relative_diff(got["losses"], straight[4:]) < 1e-5, (par, got["losses"], straight[4:])
            assert got["frozen_unchanged"]


def test_merged_export_gives_transformers_the_trained_logits(corpus_dir, tmp_path):
    """``checkpoint.export_hf`` after LoRA training writes every expert with its adapter
    merged: transformers' Qwen2-MoE on that folder gives the trained model's logits (fp32,
    1e-5; measured 2.6e-7)."""
    import transformers

    from parallel3d.lora.adapters import adapter_parameters

    job = _job(corpus_dir, str(tmp_path))
    job["model"]["moe"] = {**MOE, "shared_gate": True}  # the shared expert as Qwen2-MoE writes it
    job["train"]["steps"] = 2
    job["checkpoint"] = {"export_hf": "hf"}
    cfg = config_from_dict(job)
    trainer = Trainer(cfg, Topology.of(cfg.parallel), log=False)
    trainer.fit()
    trainer.close()
    trained_b = [p for n, p in adapter_parameters(trainer.model) if ".experts." in n and n.endswith("lora_B.weight")]
    assert trained_b and all(float(p.detach().abs().max()) > 0 for p in trained_b)  # the experts' adapters moved
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32)
    tokens = torch.randint(0, 512, (2, 32), generator=torch.Generator().manual_seed(5))
    trainer.model.eval()
    with torch.no_grad():
        got, want = trainer.model(tokens), hf(tokens).logits
    assert float((got - want).abs().max() / want.abs().max()) < 1e-5
