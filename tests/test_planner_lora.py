"""The planner knows LoRA (issue 35: "the planner and dry-run know it; `plan --lora`
shows the smallest layout that fits a 70B fine-tune").

The planner's LoRA model states (from its own count of the adapters) equal the dry run's
(from the rank's modules built on meta), stage by stage; a 70B LoRA fine-tune's states
equal a hand count of the adapters; full fine-tuning cannot fit 8 H100s by a hand lower
bound, LoRA fits 8 and 4; the frozen base has no weight-gradient GEMMs.
"""

from __future__ import annotations

import pytest

from parallel3d.config import config_from_dict
from parallel3d.errors import UserError
from parallel3d.models.llama import PRESETS
from parallel3d.planner.calibrate import default_efficiency
from parallel3d.planner.hardware import gpu_named, usable_bytes
from parallel3d.planner.memory import memory_per_stage
from parallel3d.planner.search import recommend, search
from parallel3d.planner.spec import LORA_TARGETS, Layout, LoraSpec, Workload, layer_split
from parallel3d.planner.timing import stage_phase_flops
from parallel3d.train.dryrun import dry_run

from helpers import tiny_job

GiB = 2**30


def test_the_planner_names_the_targets_lora_applies():
    from parallel3d.lora.apply import TARGETS

    assert LORA_TARGETS == TARGETS


@pytest.mark.parametrize("parallel, dtype, trainable", [
    ({"tp": 1, "pp": 1, "dp": 1, "zero": 0}, "fp32", []),
    ({"tp": 2, "pp": 2, "dp": 2, "zero": 1}, "bf16", ["norm", "lm_head"]),
    ({"tp": 2, "pp": 1, "dp": 2, "zero": 2}, "bf16", ["input_layernorm", "embed_tokens"]),
])
def test_planner_lora_states_equal_the_dry_runs(tmp_path, parallel, dtype, trainable):
    # the dry run counts the rank's modules (adapters attached on meta, requires_grad as
    # training sets it); the planner counts from the shapes: the same bytes on every stage
    job = tiny_job("", str(tmp_path), parallel={**parallel, "schedule": "1f1b"},
                   train={"dtype": dtype, "global_batch": 8, "micro_batch": 1},
                   lora={"rank": 4, "alpha": 8.0, "targets": list(LORA_TARGETS), "trainable": trainable})
    world = parallel["tp"] * parallel["pp"] * parallel["dp"]
    found = dry_run(config_from_dict(job), world, out=lambda line: None)
    assert len(found["reports"]) == parallel["pp"]
    for report in found["reports"]:
        states, planned = report.states, report.planned
        assert report.params.held == planned.params
        assert (states.weights, states.grads, states.optimizer) == (
            planned.weights, planned.full_grads, planned.master + planned.optimizer), report.stage


@pytest.mark.parametrize("parallel, dtype", [
    ({"tp": 1, "pp": 1, "dp": 2, "ep": 2, "zero": 1}, "fp32"),
    ({"tp": 2, "pp": 2, "dp": 4, "ep": 2, "zero": 2}, "bf16"),
    ({"tp": 2, "pp": 1, "dp": 2, "ep": 1, "zero": 0}, "bf16"),
    ({"tp": 1, "pp": 2, "dp": 4, "ep": 2, "zero": 3}, "bf16"),
])
def test_planner_lora_states_on_experts_equal_the_dry_runs(tmp_path, parallel, dtype):
    # adapters on every routed expert's and the shared expert's projections: the routed
    # ones' state sharded over edp, the rest over dp (the dry run counts the modules)
    job = tiny_job("", str(tmp_path), parallel={**parallel, "schedule": "1f1b"},
                   train={"dtype": dtype, "global_batch": 8, "micro_batch": 1},
                   lora={"rank": 4, "alpha": 8.0, "targets": list(LORA_TARGETS), "trainable": ["norm"]})
    job["model"].update(preset="debug-moe", n_layers=3,
                        moe={"n_experts": 8, "top_k": 2, "ffn_dim": 96, "dense_layers": [0], "shared_ffn_dim": 32})
    world = parallel["tp"] * parallel["pp"] * parallel["dp"]
    found = dry_run(config_from_dict(job), world, out=lambda line: None)
    assert len(found["reports"]) == parallel["pp"]
    for report in found["reports"]:
        states, planned = report.states, report.planned
        assert report.params.held == planned.params
        assert (states.grads, states.optimizer) == (planned.full_grads, planned.master + planned.optimizer)
        if parallel["zero"] < 3:
            assert states.weights == planned.weights, report.stage
        else:  # the shards (frozen experts over edp, the rest over dp) + the planner's units in
            # flight: two, or the whole stage when a bucket (25 MiB) outsizes this tiny one
            in_flight = planned.weights - states.weights
            assert 0 < in_flight <= 2 * report.params.held, (planned.weights, states.weights)  # bf16
            assert states.weights < 2 * report.params.held / 2  # sharded: under half the stage at dp 4


def _adapters_70b(rank: int) -> int:
    """Adapter elements of Llama 3 70B's 80 layers: r (in + out) per projection, by hand
    from its shape (dim 8192, 64 query heads and 8 kv-heads of 128, ffn 28672)."""
    d, kv, f = 8192, 8 * 128, 28672
    per_layer = (d + d) + (d + kv) + (d + kv) + (d + d) + 2 * (d + f) + (f + d)  # q k v o gate up down
    return 80 * rank * per_layer


def test_70b_lora_states_equal_a_hand_count():
    model = PRESETS["70b"]
    adapters = _adapters_70b(16)
    assert adapters == 207_093_760  # 80 x 16 x 161,792
    work = Workload(model, 8192, 64, "bf16", LoraSpec(16))
    stages = memory_per_stage(work, Layout(tp=1, pp=4, dp=1, micro_batch=1, zero=0, recompute="full"))
    # tp 1, untied: every weight is held once over the 4 stages, in bf16, frozen or not
    assert sum(s.weights for s in stages) == 2 * (model.num_params() + adapters)
    assert sum(s.master for s in stages) == 4 * adapters  # fp32 masters
    assert sum(s.full_grads for s in stages) == 4 * adapters  # fp32 gradients
    assert sum(s.optimizer for s in stages) == 8 * adapters  # Adam's two moments
    # ZeRO 2 over dp 2: the adapters' state halves, the frozen weights do not
    sharded = memory_per_stage(work, Layout(tp=1, pp=4, dp=2, micro_batch=1, zero=2, recompute="full"))
    assert sum(s.weights for s in sharded) == 2 * (model.num_params() + adapters)
    assert sum(s.optimizer for s in sharded) == pytest.approx(4 * adapters, abs=8 * 4)  # ceil per stage


def test_70b_lora_fits_fewer_gpus_than_full_fine_tuning():
    model, gpu, eff = PRESETS["70b"], gpu_named("h100"), default_efficiency()
    n = model.num_params()
    budget = usable_bytes(gpu)
    # By hand: full fine-tuning holds per parameter 2 (bf16 weight) + 4 (fp32 gradient) +
    # 4 (fp32 master) + 8 (Adam) bytes, at best spread over all 8 GPUs; LoRA's frozen
    # base holds 2.
    assert 18 * n / 8 > budget
    assert 2 * n / 4 < budget
    full = Workload(model, 4096, 64, "bf16")
    lora = Workload(model, 4096, 64, "bf16", LoraSpec(16))
    assert recommend(search(full, 8, 8, gpu, eff)) is None
    for gpus in (8, 4):
        best = recommend(search(lora, gpus, gpus, gpu, eff))
        assert best is not None, gpus
        held = best.worst.weights  # its frozen share and the adapters, bf16
        assert held >= 2 * n / gpus * 0.9  # no layout holds less than its share of the base


def test_the_frozen_base_has_no_weight_gradient_gemms():
    model = PRESETS["8b"]
    layout = Layout(tp=2, pp=2, dp=1)
    split = layer_split(model, 2, 1)
    full = stage_phase_flops(Workload(model, 4096, 8), layout, 0, split)
    lora = stage_phase_flops(Workload(model, 4096, 8, lora=LoraSpec(16)), layout, 0, split)
    assert lora[2] < 0.01 * full[2]  # W: only the adapters' GEMMs (rank 16 of 4096)
    assert full[0] < lora[0] < 1.01 * full[0]  # F: the adapters add about 2 r (in + out) per token
    assert full[1] < lora[1] < 1.01 * full[1]


def test_plan_lora_says_what_fits(capsys):
    import argparse

    from parallel3d.planner.cli import add_plan_parser, run_plan

    parser = argparse.ArgumentParser()
    add_plan_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["plan", "--model", "8b", "--gpus", "4", "--gpu", "h100", "--seq-len", "2048",
                              "--global-batch", "16", "--lora-rank", "8", "--lora-targets", "q_proj,v_proj"])
    assert run_plan(args) == 0
    out = capsys.readouterr().out
    assert "lora rank 8 on q_proj,v_proj" in out
    assert "full fine-tuning on 4 x h100-80g" in out and "fewest GPUs for this LoRA job" in out
    args.lora_targets = "q_proj,qv_proj"
    with pytest.raises(UserError, match="--lora-targets"):
        run_plan(args)


def test_plan_lora_dropout_counts_and_writes_it(tmp_path, capsys):
    """``--lora-dropout``: the adapters keep no dropped input (rebuilt in the backward,
    tests/test_lora_dropout.py), so the plan's peak grows by one adapter's rebuilt input
    at most; the written recipe carries ``lora.dropout`` and loads; a rate outside [0, 1)
    is refused."""
    import argparse

    from parallel3d.config import load_config
    from parallel3d.planner.cli import add_plan_parser, run_plan
    from parallel3d.planner.memory import stage_memory

    parser = argparse.ArgumentParser()
    add_plan_parser(parser.add_subparsers(dest="command"))
    recipe = tmp_path / "lora.toml"
    args = parser.parse_args(["plan", "--model", "8b", "--gpus", "8", "--gpu", "h100", "--lora-dropout", "0.05",
                              "--write-recipe", str(recipe)])
    assert run_plan(args) == 0
    cfg = load_config(recipe)
    assert cfg.lora.dropout == 0.05 and cfg.lora.rank == 16
    work = Workload(PRESETS["8b"], 4096, 64, lora=LoraSpec(16, LORA_TARGETS, dropout=0.05))
    plain = Workload(PRESETS["8b"], 4096, 64, lora=LoraSpec(16, LORA_TARGETS))
    layout = Layout(dp=8, zero=1)
    grown = stage_memory(work, layout, 0).training_peak - stage_memory(plain, layout, 0).training_peak
    assert 0 <= grown <= 4096 * 14336 * 2  # down_proj's input of one micro-batch, bf16
    args.lora_dropout = 1.0
    with pytest.raises(UserError, match=r"--lora-dropout 1.0 is outside \[0, 1\)"):
        run_plan(args)
