"""LoRA at ZeRO 3 (``parallel3d/zero/frozen.py``): the frozen base is sharded over the
data-parallel replicas too and gathered around each module's forward and backward, as
FSDP-LoRA does. The per-step losses at dp 2, dp 4 and tp 2 x pp 2 x dp 2 (1F1B and
zb-h1, full recomputation) equal one process's (fp32, 1e-5), the base weights
bit-identical after training; a rank holds 1/dp of the frozen weights between uses, the
bytes ``train --dry-run`` states. A tp 2 x dp 2 run exports the one-process adapters, and
on a Hugging Face base resumes at ZeRO 3 and 2 and exports the merged model."""

from __future__ import annotations

import pytest
import torch

from parallel3d.config import config_from_dict
from parallel3d.topology import Topology
from parallel3d.train.trainer import Trainer

from helpers import relative_diff
from test_lora import _job

MiB = 2**20


def _train(job: dict) -> dict:
    cfg = config_from_dict(job)
    trainer = Trainer(cfg, Topology.of(cfg.parallel))
    if trainer.optimizer.frozen is not None:  # ZeRO 3: every frozen bucket whole, to copy (freed by the first update)
        trainer.optimizer.frozen.gather_all()
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if not p.requires_grad}
    history = trainer.run_steps(cfg.train.steps)
    frozen = trainer.optimizer.frozen
    between = sum(t.untyped_storage().nbytes() for t in frozen.sharded.full) if frozen else None
    shard = frozen.sharded.shard_flat.numel() if frozen else None
    from parallel3d.train.dryrun import lora_state_bytes
    from parallel3d.zero.memory import memory_report

    held = memory_report(trainer.model, trainer.optimizer)["params"]  # the shards' bytes
    stated = lora_state_bytes(trainer.model, "fp32", cfg.parallel.zero, cfg.parallel.dp).weights
    trainer.close()
    if trainer.optimizer.frozen is not None:  # whole again: the weights to compare
        trainer.optimizer.frozen.gather_all()
    params = dict(trainer.model.named_parameters())
    return {"losses": [h["loss"] for h in history],
            "frozen_unchanged": all(torch.equal(params[n], t) for n, t in before.items()),
            "frozen": before,
            "frozen_numel": sum(t.numel() for t in before.values()),
            "gathered_between_steps": between, "shard_numel": shard, "held": held, "stated": stated}


@pytest.fixture(scope="module")
def reference(one_thread, corpus_dir, tmp_path_factory):
    return _train(_job(corpus_dir, str(tmp_path_factory.mktemp("ref"))))


@pytest.mark.parametrize("parallel", [
    {"dp": 2, "zero": 3},
    {"dp": 4, "zero": 3},
    {"tp": 2, "pp": 2, "dp": 2, "zero": 3, "schedule": "1f1b"},
    {"tp": 2, "pp": 2, "dp": 2, "zero": 3, "schedule": "zb-h1"},
], ids=lambda p: "-".join(f"{k}{v}" for k, v in p.items()))
def test_lora_at_zero3_trains_as_one_process(pools, corpus_dir, tmp_path, reference, parallel):
    parallel = {"tp": 1, "pp": 1, **parallel}
    world = parallel["tp"] * parallel["pp"] * parallel["dp"]
    ranks = pools(world).run(_train, _job(corpus_dir, str(tmp_path), **parallel))
    for got in ranks:
        assert relative_diff(got["losses"], reference["losses"]) < 1e-5, (got["losses"], reference["losses"])
        assert got["frozen_unchanged"]  # the base untouched by training, bit for bit
        if parallel["tp"] == parallel["pp"] == 1:  # whole tensors: the one process's seeded base
            assert all(torch.equal(t, reference["frozen"][n]) for n, t in got["frozen"].items())
        # between steps no frozen bucket is whole; each rank keeps its 1/dp of every
        # bucket (padded to a multiple of dp x SHARD_ALIGN elements)
        assert got["gathered_between_steps"] == 0
        assert got["frozen_numel"] / parallel["dp"] <= got["shard_numel"] < got["frozen_numel"] / parallel["dp"] + 4096
        # the dry run states the shards' bytes (train --dry-run, planner.lora.lora_states);
        # the runtime pads each bucket to a multiple of dp x SHARD_ALIGN (measured: equal)
        assert got["stated"] <= got["held"] <= got["stated"] + 64 * 1024, (got["held"], got["stated"])


def test_zero3_exports_the_one_process_adapters(pools, corpus_dir, tmp_path):
    """tp 2 x dp 2 at ZeRO 3: its ``export_peft`` folder holds the one-process run's
    adapters (per tensor within WEIGHT_RTOL, helpers.py) after its losses."""
    from safetensors.torch import load_file

    from helpers import WEIGHT_RTOL
    from test_lora import LAYERS, TARGETS, _train_and_export

    one = _train_and_export(_job(corpus_dir, str(tmp_path / "one")), str(tmp_path / "one_adapter"))
    many = pools(4).run(_train_and_export, _job(corpus_dir, str(tmp_path / "z3"), tp=2, dp=2, zero=3),
                        str(tmp_path / "adapter"))[0]
    assert relative_diff(many, one) < 1e-5
    want = load_file(str(tmp_path / "one_adapter" / "adapter_model.safetensors"))
    got = load_file(str(tmp_path / "adapter" / "adapter_model.safetensors"))
    assert sorted(got) == sorted(want) and len(got) == 2 * len(TARGETS) * LAYERS
    for key, t in want.items():
        assert float((got[key] - t).norm() / t.norm()) < WEIGHT_RTOL, key


def test_zero3_on_a_hf_base_resumes_and_exports(pools, corpus_dir, tmp_path):
    """A Hugging Face base read by slices into the shards: tp 2 x dp 2 at ZeRO 3 stopped
    at step 4 continues at dp 4 (ZeRO 3) and at dp 2 (ZeRO 2) with the one-process run's
    losses and logits (1e-5); the dp 4 run's merged ``export_hf`` folder in transformers
    gives its logits (1e-5)."""
    transformers = pytest.importorskip("transformers")
    from parallel3d.checkpoint.reader import find_checkpoint
    from test_checkpoint_hf import make_hf_model
    from test_lora_checkpoint import STEPS, STOP, TOKENS
    from test_lora_checkpoint import _job as hf_job
    from test_lora_checkpoint import _run

    hf_dir = make_hf_model("llama", tmp_path / "hf")
    straight = _run(hf_job(corpus_dir, tmp_path / "one", hf_dir))
    first = pools(4).run(_run, hf_job(corpus_dir, tmp_path / "z3", hf_dir, tp=2, dp=2, zero=3), STOP)[0]
    assert relative_diff(first["losses"], straight["losses"][:STOP]) < 1e-5
    stopped = str(find_checkpoint(tmp_path / "z3" / "checkpoints"))
    for par in ({"dp": 4, "zero": 3}, {"dp": 2, "zero": 2}):
        job = hf_job(corpus_dir, tmp_path / f"dp{par['dp']}", hf_dir, **par)
        job["checkpoint"].update(resume=stopped, export_hf="merged" if par["zero"] == 3 else "")
        again = pools(par["dp"]).run(_run, job)[0]
        assert again["resumed"] and len(again["losses"]) == STEPS - STOP
        assert relative_diff(again["losses"], straight["losses"][STOP:]) < 1e-5, (par, again["losses"])
        assert float((again["logits"] - straight["logits"]).abs().max() / straight["logits"].abs().max()) < 1e-5
    merged = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "dp4" / "merged"),
                                                               dtype=torch.float32).eval()
    with torch.no_grad():
        logits = merged(TOKENS).logits
    assert float((logits - straight["logits"]).abs().max() / straight["logits"].abs().max()) < 1e-5


def _losses(job: dict, stop_at: int | None = None) -> list[float]:
    cfg = config_from_dict(job)
    return [r["loss"] for r in Trainer(cfg, Topology.of(cfg.parallel)).fit(stop_at=stop_at)]


def test_zero3_on_a_seeded_base_resumes(pools, corpus_dir, tmp_path):
    """With no Hugging Face base to refer to, a ZeRO 3 checkpoint holds the frozen
    weights too, each dp rank its shard (nothing gathered): dp 2 stopped at step 4
    continues at dp 2 (ZeRO 3) and in one process with the straight run's losses (1e-5)."""
    def job(name, **par):
        j = _job(corpus_dir, str(tmp_path / name), **par)
        j["checkpoint"] = {"interval": 4, "keep": 0}
        return j

    straight = _losses(job("one"))
    pools(2).run(_losses, job("z3", dp=2, zero=3), 4)
    stopped = str(tmp_path / "z3" / "checkpoints" / "step_00000004")
    for par, world in (({"dp": 2, "zero": 3}, 2), ({}, 1)):
        other = job("again-" + "-".join(map(str, par.values())), **par)
        other["checkpoint"]["resume"] = stopped
        continued = pools(world).run(_losses, other) if world > 1 else [_losses(other)]
        for got in continued:
            assert relative_diff(got, straight[4:]) < 1e-5, (par, got, straight[4:])


def _gathered_at_most(job: dict) -> tuple[int, int]:
    """(most frozen buckets gathered at once over two steps, buckets)."""
    cfg = config_from_dict(job)
    trainer = Trainer(cfg, Topology.of(cfg.parallel), log=False)
    frozen = trainer.optimizer.frozen.sharded
    most = [0]
    frozen.on_change = lambda: most.__setitem__(0, max(most[0], sum(frozen.gathered) + len(frozen._work)))
    trainer.run_steps(2)
    trainer.close()
    return most[0], len(frozen.full)


def test_recomputation_holds_a_few_buckets_whatever_the_depth(pools, corpus_dir, tmp_path):
    """Under full recomputation each layer's forward re-runs inside the backward: it
    gathers its own buckets, and prefetches nothing (the next layer's backward is done; a
    prefetch nobody waited for held its storage to the end of the pass, one bucket per
    layer: 11 of the 34 here before). 8 layers at dp 2: at most 4 buckets at once."""
    job = _job(corpus_dir, str(tmp_path), dp=2, zero=3)
    job["model"]["n_layers"] = 8
    job["train"].update(recompute="full", steps=2)
    job["parallel"]["bucket_mb"] = 0.05  # about a bucket a layer (a layer's frozen weights: 0.16 MiB)
    most, buckets = pools(2).run(_gathered_at_most, job)[0]
    assert buckets >= 10 and most <= 4, (most, buckets)
