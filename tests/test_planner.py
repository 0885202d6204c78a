"""The layout planner: FLOP count, memory and time models, search, report, calibration.

Pure arithmetic except two small checks that run torch (FLOPs counted by torch's own
counter, and the CLI's recipe round trip)."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from parallel3d.cli import main
from parallel3d.config import load_config
from parallel3d.errors import UserError
from parallel3d.flops import hardware_flops_per_token, mfu, model_flops_per_token
from parallel3d.models.llama import PRESETS, Llama, LlamaConfig
from parallel3d.planner.calibrate import calibrate_from_run, default_efficiency
from parallel3d.planner.hardware import GiB, gpu_named
from parallel3d.planner.memory import backward_moments, in_flight, stage_memory
from parallel3d.planner.published import ANCHOR, PUBLISHED, gpt
from parallel3d.planner.search import evaluate, recommend, search
from parallel3d.models.llama import config_from_preset as _preset
from parallel3d.planner.spec import Layout, Workload, layer_split
from parallel3d.planner.timing import bubble_fraction, ring_time, stage_phase_flops, step_time

SMALL = LlamaConfig(vocab_size=512, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=160)


# -- FLOPs -------------------------------------------------------------------------------

def test_flops_per_token_by_hand():
    d, kv, f, L, V, S = 64, 32, 160, 2, 512, 32  # kv = 2 kv-heads x head dim 16
    projections = d * d + d * kv + d * kv + d * d + d * f + d * f + f * d  # q k v o gate up down
    forward = L * (2 * projections + 2 * S * d + 2 * S * d) + 2 * d * V  # + Q K^T, P V, head
    assert model_flops_per_token(SMALL, S) == 3 * forward
    assert hardware_flops_per_token(SMALL, S, "full") == 3 * forward + L * (2 * projections + 4 * S * d)
    assert hardware_flops_per_token(SMALL, S, "selective") == 3 * forward + L * 4 * S * d


def test_flops_match_torch_counter_and_megatron_formula():
    # torch's FlopCounterMode counts the matmuls of a real forward + backward (it has no
    # formula for CPU attention, so the attention products are compared by hand above)
    from torch.utils.flop_counter import FlopCounterMode

    model, tokens = Llama(SMALL), torch.randint(0, 512, (2, 32))
    with FlopCounterMode(display=False) as counter:
        model(tokens).float().sum().backward()
    attention = 3 * SMALL.n_layers * 4 * 32 * SMALL.dim
    assert counter.get_total_flops() == (model_flops_per_token(SMALL, 32) - attention) * 64
    # Narayanan et al. 2021, eq. 3 without recomputation: 72 B s l h^2 (1 + s/6h + V/12lh)
    h, l, v, s = 12288, 96, 51200, 2048
    megatron = 72 * s * l * h * h * (1 + s / (6 * h) + v / (12 * l * h)) / s
    assert model_flops_per_token(gpt(h, l, 96), s) == pytest.approx(megatron, rel=1e-12)
    assert mfu(1000.0, 1e12, 4, 1e15) == pytest.approx(0.25)


# -- memory ------------------------------------------------------------------------------

@pytest.mark.parametrize("zero", [0, 1, 2])
def test_model_states_by_hand_under_each_zero_stage(zero):
    # bf16 mixed precision, dp 4, one stage: 2 B weights, 4 B fp32 master, 4 B fp32 grads,
    # 8 B Adam; ZeRO 1 shards master + Adam by 4 and keeps the reduced fp32 gradient shard
    # beside the full buffer; ZeRO 2 keeps only that shard (the packed buckets of its
    # reductions in flight live only inside a backward, counted there against the
    # activations they outlive)
    layer = 2 * 64 * 64 + 2 * 64 * 32 + 3 * 64 * 160 + 2 * 64
    n = 2 * layer + 512 * 64 + 64 + 512 * 64  # layers, embedding, final norm, untied head
    work = Workload(SMALL, 32, 16, "bf16")
    mem = stage_memory(work, Layout(dp=4, micro_batch=1, zero=zero), 0, bucket_bytes=1024)
    assert mem.params == n
    assert mem.weights == 2 * n
    assert mem.master == 4 * n // (4 if zero else 1)
    assert mem.optimizer == 8 * n // (4 if zero else 1)
    assert mem.full_grads == {0: 4 * n, 1: 4 * n + 4 * n // 4, 2: 4 * n // 4}[zero]


def test_activations_by_hand_and_schedules_in_flight():
    # fp32, one micro-batch of 2 x 32 tokens: per layer 6 d-wide (the two norms' inputs,
    # the two projections' inputs, rotated q, the attention output) + 2 kv-wide (rotated k,
    # v) + 3 ffn-wide (gate, up, their SwiGLU product) tensors plus the log-sum-exp (heads)
    # and two rsqrt per token; head: the final norm's input and the head's input + the
    # logits the vocab-parallel loss saves (at tp 1 too) and its two per-token fp32
    # vectors (max, sum) with the targets' int64; its backward writes the gradient over
    # the logits: nothing more at its start on a GPU, one fp32 row block of the torch
    # reference on CPU (here all 64 rows: 64 x 512 x 4 bytes < 8 MiB). The fp32 gradient
    # buffer exists from the start: no gradient grows during the backward.
    work = Workload(SMALL, 32, 2, "fp32")
    mem = stage_memory(work, Layout(micro_batch=2), 0)
    tokens = 64
    layer = tokens * 4 * (6 * 64 + 2 * 32 + 3 * 160 + 4 + 2)
    head = tokens * (4 * (2 * 64 + 512) + 16)
    assert mem.activations == 2 * layer + head
    assert mem.backward_transient == 0
    assert stage_memory(work, Layout(micro_batch=2), 0, gloo=True).backward_transient == tokens * 4 * 512
    assert mem.grads == mem.full_grads
    lay = Layout(pp=4, micro_batch=1)
    assert [in_flight(lay, 8, r) for r in range(4)] == [4, 3, 2, 1]
    assert in_flight(replace(lay, schedule="gpipe"), 8, 0) == 8
    # Megatron's interleaved warm-up + 1: 2 (pp - r - 1) + (v - 1) pp + 1 chunk-micro-batches
    assert in_flight(replace(lay, schedule="interleaved", virtual_stages=2), 8, 0) == 2 * 3 + 4 + 1
    # the closed forms are the most chunk-micro-batches alive in the plans the runtime runs
    for schedule, v in (("1f1b", 1), ("gpipe", 1), ("interleaved", 2), ("interleaved", 3)):
        for pp in (2, 4):
            for m in (pp, 2 * pp, 3 * pp):
                layout = Layout(pp=pp, schedule=schedule, virtual_stages=v)
                for r in range(pp):
                    walked = max(alive for alive, *_ in backward_moments(layout, m, r))
                    assert in_flight(layout, m, r) == walked, (schedule, v, pp, m, r)
    # The planner uses the pipeline's split rule: the 8B head (vocab 128256 x 4096) costs
    # about 2.4 layers of GEMMs, so the last of 4 stages takes fewer of the 32 layers.
    split = layer_split(_preset("8b"), 4, 1)
    assert sum(split) == 32 and split[-1] < split[0], split


def test_memory_model_matches_a_measured_training_step(corpus_dir, tmp_path):
    # the benchmark's measurement (PyTorch's CPU allocator events replayed) on one layout,
    # one process: 2 micro-batches of 4 x 128 tokens, fp32. What the model leaves out is
    # small (RoPE tables, token ids, scalars: ~0.1%); 5% leaves room for a torch release
    # that changes what SDPA saves, and still fails if a component is missed (the smallest,
    # the gradients, is about 9% of the peak).
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from bench_planner_memory import job_for, measure_rank, predict

    job = job_for(corpus_dir, str(tmp_path), {}, {"micro_batch": 4, "global_batch": 8})
    measured = measure_rank(job, 1, 1, 1)["peak"]
    assert predict(job)[0] / measured == pytest.approx(1.0, abs=0.05)


# -- time --------------------------------------------------------------------------------

def test_ring_collectives_and_bubble():
    assert ring_time("all_reduce", 8e9, 8, 1e9, 1e-5) == pytest.approx(2 * 7 / 8 * 8 + 14e-5)
    assert ring_time("all_gather", 8e9, 8, 1e9, 0.0) == pytest.approx(7 / 8 * 8)
    assert ring_time("all_reduce", 8e9, 1, 1e9, 1e-5) == 0.0
    work = Workload(PRESETS["8b"], 4096, 64)
    gpu = gpu_named("h100-80g")
    t = step_time(work, Layout(tp=1, pp=4, dp=1, micro_batch=8), gpu, 8, default_efficiency())  # m = 8
    assert t.bubble_s == pytest.approx(3 / 8 * (t.compute_s + t.tp_comm_s))  # (pp-1)/m slots
    tv = step_time(work, Layout(pp=4, micro_batch=8, schedule="interleaved", virtual_stages=2), gpu, 8,
                   default_efficiency())
    assert tv.bubble_s == pytest.approx(t.bubble_s / 2)
    assert tv.pp_comm_s == pytest.approx(2 * t.pp_comm_s * (8 + 1.5) / (8 + 3))


@pytest.mark.parametrize("schedule,v", [("1f1b", 1), ("gpipe", 1), ("interleaved", 2), ("zb-h1", 1), ("zb-v", 2)])
def test_bubble_model_equals_the_simulated_plans_at_unequal_costs(schedule, v):
    """The planner's bubble (closed forms; zb-v's from the simulator at 2 pp - 1 micro-
    batches, its idle being the same for any m beyond) against the simulator playing the
    plan itself at each m, for costs from the model's FLOPs (the 8B's F, B, W at 4k and
    8k tokens, with and without recomputation) and a W heavier than its B."""
    from parallel3d.pipeline.simulate import simulate

    costs = [(1.0, 1.0, 1.0), (1.0, 1.6, 0.9), (1.0, 0.8, 1.2), (0.5, 1.0, 1.0), (1.0, 1.0, 2.0)]
    for seq, recompute in ((4096, "none"), (8192, "none"), (8192, "full")):
        f, b, w = stage_phase_flops(Workload(PRESETS["8b"], seq, 64), Layout(recompute=recompute), 0, [32])
        costs.append((1.0, b / f, w / f))
    for pp in (2, 4, 8):
        for m in (pp, 2 * pp, 3 * pp):
            for f, b, w in costs:
                sim = simulate(schedule, pp, v, m, f / v, b / v, w / v).mean_bubble()
                # zb-v's model rounds the cost ratios to 3 decimals (its cache key)
                tol = 2e-3 if schedule == "zb-v" else 1e-12
                assert bubble_fraction(schedule, pp, v, m, f, b, w) == pytest.approx(sim, rel=tol), \
                    (schedule, pp, m, (f, b, w))


def test_phase_flops_by_hand():
    # one layer of SMALL at 32 tokens: GEMMs 2 x (2*64*64 + 2*64*32 + 3*64*160) = 86016,
    # attention 4 * 32 * 4 * 16 = 8192 per token; B = GEMMs + 2 attention, W = GEMMs
    work = Workload(SMALL, 32, 2, "fp32")
    f, b, w = stage_phase_flops(work, Layout(pp=2), 0, [1, 1])
    assert (f, b, w) == (86016 + 8192, 86016 + 2 * 8192, 86016)
    head = 2 * 512 * 64  # the last stage adds the head's GEMM to each
    assert stage_phase_flops(work, Layout(pp=2), 1, [1, 1]) == (f + head, b + head, w + head)
    # full recomputation re-runs the layer's forward in B
    assert stage_phase_flops(work, Layout(pp=2, recompute="full"), 0, [1, 1])[1] == b + f


def test_zero_bubble_memory_counts_the_w_stash_by_hand():
    """zb-h1 at pp 2, m 4, rank 1 (one layer, the head): its steps F0 B0 F1 B1 (W0 F2) B2
    (W1 F3) B3 (W2 W3) leave, at each W, no micro-batch before its B and two waiting for
    their W, which is its peak. A micro-batch waiting keeps per layer each GEMM's input
    (the two normed inputs, the attention output, the SwiGLU product: 3d + f) and output
    gradient (q, k, v, o, gate, up, down: 3d + 2kv + 2f), each norm's input and gradient
    (4d) and two fp32 rstd; per token at the head its input, its logits' gradient and the
    final norm's input and gradient. The W holds its computed gradients (the rank's
    parameters: under 16 MiB, one group) and, as every backward, the largest one's."""
    work = Workload(SMALL, 32, 8, "fp32")
    zb = stage_memory(work, Layout(pp=2, micro_batch=2, schedule="zb-h1"), 1, [1, 1])
    tokens, d, kv, f, V = 64, 64, 32, 160, 512
    layer = tokens * (4 * ((3 * d + f) + (3 * d + 2 * kv + 2 * f) + 4 * d) + 8)
    head = tokens * (4 * (d + V + 2 * d) + 4)
    assert zb.activations == 2 * (layer + head)
    params = (2 * d * d + 2 * d * kv + 3 * d * f + 2 * d) + d + V * d  # layer 1, norm, head
    assert zb.backward_transient == 4 * params + 4 * V * d  # the group, the largest (the head)
    assert [max(a + s for a, _, s, *_ in backward_moments(Layout(pp=2, schedule="zb-h1"), 4, r))
            for r in range(2)] == [2, 2]


def test_plan_recommends_a_zero_bubble_schedule_where_it_wins(capsys):
    """Llama 3.1 8B on 64 H100s with a 2-stage pipeline (unpinned, data parallelism with its
    traffic hidden under the compute wins, tests/test_planner_overlap.py): the fastest
    layout uses a zero-bubble schedule, and the report gives 1F1B's bubble on the same
    layout beside it."""
    assert main(["plan", "--model", "8b", "--gpus", "64", "--gpu", "h100-80g", "--pp", "2"]) == 0
    out = capsys.readouterr().out
    recommended = next(line for line in out.splitlines() if line.startswith("recommended:"))
    assert " zb-h1 " in recommended or " zb-vx2 " in recommended, recommended
    assert "the same layout with 1f1b: best is" in out and "pipeline bubble" in out


# -- search and report ---------------------------------------------------------------------

def test_a_layout_that_does_not_fit_is_reported_and_never_recommended():
    work = Workload(PRESETS["70b"], 8192, 64)
    gpu = gpu_named("h100-80g")
    too_big = evaluate(work, Layout(tp=8, pp=1, dp=1, micro_batch=1), gpu, 8)
    assert not too_big.fits and too_big.over_bytes > 0
    # 70B on 8 GPUs: 2 + 4 + 4 + 8 bytes per parameter alone is ~150 GiB per GPU
    assert too_big.worst.weights + too_big.worst.master + too_big.worst.optimizer > 100 * GiB
    assert too_big.verdict().startswith(f"does not fit: stage {too_big.worst.stage} needs ")
    assert f"{too_big.over_bytes / GiB:.1f} GiB over" in too_big.verdict()
    candidates = search(work, 8, 8, gpu)
    assert not any(c.fits for c in candidates) and recommend(candidates) is None
    # on 64 GPUs some layouts fit: the recommended one fits and nothing faster does
    candidates = search(Workload(PRESETS["70b"], 4096, 64), 64, 8, gpu)
    best = recommend(candidates)
    assert best is not None and best.fits
    assert all(c.time.step_s >= best.time.step_s - 1e-4 for c in candidates if c.fits)
    assert any(not c.fits and c.time.step_s < best.time.step_s for c in candidates), \
        "a faster layout that does not fit exists, and was rightly passed over"


def test_cli_reports_no_fit_with_stage_and_bytes(capsys):
    code = main(["plan", "--model", "70b", "--gpus", "8", "--gpus-per-node", "8", "--gpu", "a100-80g",
                 "--seq-len", "4096", "--global-batch", "8"])
    out = capsys.readouterr().out
    assert code == 1 and "no layout fits" in out and "GiB over the" in out and "stage " in out


@pytest.mark.parametrize("run", PUBLISHED, ids=lambda r: r.name.split(",")[0])
def test_published_runs_are_feasible_and_mfu_within_10_points(run):
    fixed = {"tp": run.tp, "pp": run.pp, "dp": run.dp}
    if run.recompute:
        fixed["recompute"] = run.recompute
    best = recommend(search(run.work, run.n_gpus, run.gpus_per_node, gpu_named(run.gpu), fixed=fixed))
    assert best is not None, f"{run.name}: no variant of the published layout fits"
    assert abs(best.time.mfu - run.mfu) <= 0.10, (run.name, best.layout.describe(), best.time.mfu, run.mfu)


def test_default_efficiency_inverts_the_anchor():
    gpu = gpu_named(ANCHOR.gpu)
    layout = Layout(tp=ANCHOR.tp, pp=ANCHOR.pp, dp=ANCHOR.dp, micro_batch=1, recompute="full")
    t = step_time(ANCHOR.work, layout, gpu, 8, default_efficiency())
    assert t.mfu == pytest.approx(ANCHOR.mfu, rel=1e-9)
    assert 0.3 < default_efficiency().compute < 0.9


def test_write_recipe_passes_dry_run(tmp_path, capsys):
    recipe = tmp_path / "planned.toml"
    assert main(["plan", "--model", "8b", "--gpus", "16", "--gpus-per-node", "8", "--gpu", "h200",
                 "--seq-len", "4096", "--global-batch", "64", "--write-recipe", str(recipe)]) == 0
    out = capsys.readouterr().out
    recommended = next(line for line in out.splitlines() if line.startswith("recommended:"))
    assert "pure data parallel" in out or " tp1 pp1 " in f" {recommended.split(': ', 1)[1]}"
    assert main(["train", str(recipe), "--dry-run"]) == 0
    dry = capsys.readouterr().out
    cfg = load_config(recipe)
    assert f"tp {cfg.parallel.tp} x pp {cfg.parallel.pp} x dp {cfg.parallel.dp}" in dry
    assert cfg.launch.nnodes * cfg.launch.nproc == 16 and "16 ranks" in dry


def test_calibration_recovers_the_efficiency_of_a_synthetic_run(tmp_path):
    # a run directory as the trainer writes it, with tokens/s made by the time model at a
    # known efficiency (first step slow: skipped); calibration must give that efficiency back
    from parallel3d.cli import default_recipe

    cfg = load_config(default_recipe().replace("debug_cpu", "llama3_8b"))
    (tmp_path / "config.json").write_text(json.dumps(cfg.to_dict()))
    gpu = gpu_named("h100-80g")
    work = Workload(PRESETS["8b"], cfg.train.seq_len, cfg.train.global_batch)
    truth = replace(default_efficiency(), compute=0.41)
    rate = step_time(work, Layout.from_config(cfg), gpu, 8, truth).tokens_per_s
    rows = [{"step": 1, "tokens_per_s": rate / 5}] + [{"step": i, "tokens_per_s": rate} for i in range(2, 6)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    eff, how = calibrate_from_run(tmp_path, gpu, 8)
    assert eff.compute == pytest.approx(0.41, rel=1e-9) and "0.410" in how
    assert main(["plan", "--model", "8b", "--gpus", "64", "--gpus-per-node", "8", "--gpu", "h100-80g",
                 "--seq-len", "8192", "--global-batch", "512", "--top", "1",
                 "--calibrate", str(tmp_path / "metrics.jsonl")]) == 0
    with pytest.raises(UserError, match="calibration needs"):
        calibrate_from_run(tmp_path / "missing", gpu, 8)


# -- the GPU table, --gpu-spec and the defaults of `parallel3d plan` --------------------------

def test_every_gpu_of_the_table_names_its_source_and_dense_peaks_order_by_generation():
    import re

    import parallel3d.planner.hardware as hw

    for key, gpu in hw.GPUS.items():
        # a source paragraph each: "  key[, key] (product name): figures (source)"
        assert gpu.name == key and re.search(rf"^  [^(\n]*\b{re.escape(key)}\b[^(\n]* \(", hw.__doc__, re.M), key
        assert gpu.peak_flops > 0 and gpu.memory_bytes > 30 * GiB and gpu.nvlink_bytes_per_s > 0
    peak = {k: g.peak_flops for k, g in hw.GPUS.items()}
    # dense, not the datasheets' sparse figures: H100 SXM 989 (sparse 1,979), B200 2,250
    assert peak["a100-80g"] < peak["h100-pcie"] < peak["h100-nvl"] < peak["h100-80g"] == peak["h200"]
    assert peak["h200"] < peak["mi300x"] < peak["b200"] < peak["gb200"] < 2 * peak["h200"] * 1.3
    assert gpu_named("h100-sxm") == gpu_named("h100-80g")  # an alias, not a second entry
    assert hw.GPUS["gb200"].gpus_per_node == 72 and hw.GPUS["b200"].gpus_per_node == 8


def test_plan_needs_only_model_gpus_and_gpu(capsys):
    assert main(["plan", "--model", "8b", "--gpus", "64", "--gpu", "b200", "--top", "3"]) == 0
    out = capsys.readouterr().out
    # the defaults, worked out here: b200 nodes of 8; the 8b preset's context 8192; 4 Mi
    # tokens a step = 512 sequences of 8192, already a multiple of 64
    assert "8 GPUs a node" in out and "sequences of 8192 tokens" in out
    assert "a global batch of 512 sequences (4.0M tokens" in out
    assert "64 x b200 (8 per node), peak 2,250 TFLOP/s bf16" in out and "recommended: " in out
    # the same plan as with every default spelled out
    assert main(["plan", "--model", "8b", "--gpus", "64", "--gpu", "b200", "--top", "3", "--gpus-per-node", "8",
                 "--seq-len", "8192", "--global-batch", "512"]) == 0
    explicit = capsys.readouterr().out
    assert "assumed" not in explicit
    assert explicit.split("\n", 1)[0] == out.split("\n", 2)[1]  # the assumptions line
    assert explicit.split("recommended:")[1] == out.split("recommended:")[1]
    # an odd GPU count: the batch rounds up to a multiple of it (ceil(512 / 24) * 24)
    assert main(["plan", "--model", "1b", "--gpus", "24", "--gpu", "h100-80g", "--top", "1"]) == 0
    assert "a global batch of 528 sequences" in capsys.readouterr().out


def test_a_gpu_described_by_gpu_spec_plans_like_the_table_entry(capsys):
    h100 = gpu_named("h100-80g")
    spec = (f"name=h100-80g,tflops=989,memory_gib={h100.memory_bytes / GiB!r},intra_gbyte_s=450,"
            f"inter_gbit_s=400,hbm_tbyte_s=3.35")
    # 8B on one node of 8: memory binds there too (1029 layouts fit in 80 GiB, 244 in 40);
    # the search is a fifth of 70B on 64 GPUs' (17 s for the three plans on this machine)
    args = ["plan", "--model", "8b", "--gpus", "8", "--top", "5"]
    assert main([*args, "--gpu", "h100-80g"]) == 0
    named = capsys.readouterr().out
    assert main([*args, "--gpu-spec", spec]) == 0
    assert capsys.readouterr().out == named
    # keys over a known GPU: only memory changes, and a smaller GPU fits fewer layouts
    assert main([*args, "--gpu", "h100-80g", "--gpu-spec", "memory_gib=40"]) in (0, 1)
    smaller = capsys.readouterr().out
    fit = lambda text: int(text.split(" fit:")[0].rsplit(", ", 1)[1])  # noqa: E731
    assert "h100-80g-custom" in smaller and "40.0 GiB" in smaller and fit(smaller) < fit(named)


@pytest.mark.parametrize("spec,message", [
    ("tflops=500", "--gpu-spec needs memory_gib, intra_gbyte_s, inter_gbit_s"),
    ("tflops=500,memory=80", "--gpu-spec key 'memory' is not known"),
    ("tflops=fast", "--gpu-spec tflops=fast: expected a number"),
    ("tflops=-1", "--gpu-spec tflops must be positive"),
    ("tflops", "is not KEY=VALUE"),
])
def test_bad_gpu_spec_is_one_line(spec, message, capsys):
    assert main(["plan", "--model", "8b", "--gpus", "8", "--gpu-spec", spec]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1
