"""Every shipped recipe passes ``parallel3d train RECIPE --dry-run`` at its own world size,
in seconds, without allocating a weight."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from parallel3d.config import load_config
from parallel3d.planner.hardware import FRAGMENTATION, gpu_named, usable_bytes
from parallel3d.train.dryrun import dry_run
from parallel3d.train.setup import job_world_size

from helpers import write_llama31_8b_config

RECIPES = sorted((Path(__file__).resolve().parents[1] / "recipes").glob("*.toml"))


def user_inputs(recipe: Path, tmp_path: Path) -> list[str]:
    """What the user must give on the command line to a recipe that names no model or data
    of its own (finetune_hf): a model folder for model.preset "hf" (the dry run reads only
    its config.json; here Llama 3.1 8B's, the largest model such a one-node recipe is sized
    for) and a dataset path for data.source "prepared" (a dry run does not read it)."""
    cfg = load_config(recipe)
    args = []
    if cfg.model.preset == "hf" and not cfg.model.hf_checkpoint:
        args.append(f"--model.hf_checkpoint={write_llama31_8b_config(tmp_path / 'model')}")
    if cfg.data.source == "prepared" and not cfg.data.path:
        args.append(f"--data.path={tmp_path / 'data'}")
    return args


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.stem)
def test_recipe_dry_runs_at_its_world_size(recipe, tmp_path):
    cfg = load_config(recipe, user_inputs(recipe, tmp_path))
    world = job_world_size(cfg)
    lines = []
    cpu0 = time.process_time()
    found = dry_run(cfg, world, out=lines.append)
    cpu_s = time.process_time() - cpu0
    # In seconds of this process's CPU (2.2 s for llama3_70b, the largest), not of the
    # clock: the same dry run took 25.6 s by the clock while other runs loaded the machine.
    assert cpu_s < 20, f"{recipe.name}: dry run took {cpu_s:.1f} s of CPU"
    par = cfg.parallel
    assert found["world_size"] == world == par.tp * par.cp * par.pp * par.dp
    assert f"{world} ranks" in lines[0]
    params = [p for r in found["reports"] for p in r.module.parameters()]
    assert params and all(p.is_meta for p in params), "a weight was allocated"
    assert sum(found["split"]) == found["model_cfg"].n_layers
    if cfg.launch.backend == "nccl":
        # recipes for GPUs name H100 80GB: the fullest stage must fit one, margin included
        worst = max(s.peak for s in found["stages"])
        assert worst * (1 + FRAGMENTATION) <= usable_bytes(gpu_named("h100-80g")), recipe.name


def test_the_70b_recipe_is_512_ranks_and_the_cli_allocates_no_weights():
    recipe = RECIPES[[p.stem for p in RECIPES].index("llama3_70b")]
    # The child reports its own peak RSS as it exits: VmHWM, the high-water mark of its own
    # address space. Not getrusage: RUSAGE_CHILDREN is the largest of every child this
    # pytest process ever waited for, and even RUSAGE_SELF's ru_maxrss keeps the pre-exec
    # high-water mark of the forked copy of this pytest process (Linux carries it across
    # execve), which is whatever the suite's earlier in-process tests left resident.
    probe = ("import runpy, sys\n"
             "sys.argv = ['parallel3d'] + sys.argv[1:]\n"
             "try:\n"
             "    runpy.run_module('parallel3d.cli', run_name='__main__')\n"
             "finally:\n"
             "    hwm = [l.split()[1] for l in open('/proc/self/status') if l.startswith('VmHWM:')][0]\n"
             "    print(f'PEAK_RSS_KIB={hwm}', file=sys.stderr)\n")
    proc = subprocess.run([sys.executable, "-c", probe, "train", str(recipe), "--dry-run"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "512 ranks (64 nodes x 8)" in proc.stdout and "stage 1" in proc.stdout
    peak_kib = int(proc.stderr.rsplit("PEAK_RSS_KIB=", 1)[1].split()[0])
    # 70B fp32 weights would be 282 GB; one decoder layer alone 3.5 GB. The process stays
    # at what importing torch costs (about 0.4 GB).
    assert peak_kib < 1.5 * 2**20, f"peak RSS {peak_kib / 2**20:.2f} GiB"


def test_dry_run_refuses_a_bad_layout_with_one_line():
    recipe = RECIPES[[p.stem for p in RECIPES].index("llama3_8b")]
    proc = subprocess.run([sys.executable, "-m", "parallel3d.cli", "train", str(recipe), "--dry-run",
                           "--parallel.tp=3", "--parallel.dp=21", "--launch.nproc=9", "--launch.nnodes=7"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "model.n_heads 32 is not divisible by parallel.tp 3" in lines[0]


def test_multi_node_recipe_outside_torchrun_says_how_to_start_it():
    recipe = RECIPES[[p.stem for p in RECIPES].index("llama3_8b")]
    proc = subprocess.run([sys.executable, "-m", "parallel3d.cli", "train", str(recipe)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "launch.nnodes 8 > 1: start the job with torchrun" in proc.stderr


# -- per-stage parameters from the rank's own modules ------------------------------------------

def _job(tp, pp, virtual_stages=1, **model):
    from parallel3d.config import config_from_dict

    schedule = "interleaved" if virtual_stages > 1 else "1f1b"
    return config_from_dict({
        "model": {"preset": "debug", **model},
        "parallel": {"tp": tp, "pp": pp, "dp": 2, "schedule": schedule, "virtual_stages": virtual_stages},
        "train": {"global_batch": 8 * pp, "micro_batch": 1}, "launch": {"nproc": 2 * tp * pp}})


@pytest.mark.parametrize("tp,pp,v,model", [
    # kv-heads replicated (tp 4 > 2 kv-heads), vocabulary 1001 padded to 1004, tied
    # embedding held by the first and the last stage, interleaved chunks
    (4, 2, 2, {"vocab_size": 1001, "n_layers": 8, "n_heads": 8, "n_kv_heads": 2, "dim": 128,
               "ffn_dim": 256, "tie_embeddings": True}),
    # tied under pp 1: embedding and head are one parameter on every tp rank
    (2, 1, 1, {"vocab_size": 1001, "tie_embeddings": True}),
    (1, 3, 1, {"n_layers": 6}),  # untied, no tensor parallelism: the plain split
])
def test_stage_parameters_from_the_modules_add_up_to_the_model_over_a_slice(tp, pp, v, model):
    from parallel3d.models.llama import Llama
    from parallel3d.train.dryrun import count_params, rank_modules
    from parallel3d.train.setup import resolve_model_config

    cfg = _job(tp, pp, v, **model)
    mc = resolve_model_config(cfg.model)
    counts = [count_params(rank_modules(cfg, mc, 2 * tp * pp, pp_rank, tp_rank), mc.vocab_size)
              for pp_rank in range(pp) for tp_rank in range(tp)]
    import torch
    with torch.device("meta"):
        unsplit = sum(p.numel() for p in Llama(mc).parameters())  # a tied matrix once
    assert unsplit == mc.num_params()
    # Leaving out vocabulary padding and the copies another rank counts, one tp x pp slice
    # holds exactly the model.
    assert sum(c.owned for c in counts) == unsplit
    # What the ranks hold, by hand: the model, plus the norms on every tp rank but one,
    # plus kv-heads replicated past their number, plus padded rows of each vocabulary
    # matrix held apart (embedding; untied head or, pp > 1, the tied copy), plus that copy.
    d, hd, L, V = mc.dim, mc.head_dim, mc.n_layers, mc.vocab_size
    padded = -(-V // tp) * tp
    norms = (tp - 1) * (2 * d * L + d)
    kv_copies = 2 * L * max(0, tp - mc.n_kv_heads) * hd * d
    vocab_matrices = 1 if (mc.tie_embeddings and pp == 1) else 2
    tied_copy = V * d if (mc.tie_embeddings and pp > 1) else 0
    assert sum(c.held for c in counts) == (unsplit + norms + kv_copies + vocab_matrices * (padded - V) * d
                                           + tied_copy)
    assert sum(c.padding for c in counts) == vocab_matrices * (padded - V) * d
    # every tp rank of a stage holds as many parameters (the dry run shows tp rank 0)
    for s in range(pp):
        assert len({c.held for c in counts[s * tp:(s + 1) * tp]}) == 1


def test_dry_run_bytes_follow_the_storage_table_and_the_gpu_fit_is_per_stage():
    from parallel3d.planner.hardware import gpu_named
    from parallel3d.train.dryrun import StateBytes, state_bytes

    # by hand, 1000 parameters over dp 4
    assert state_bytes(1000, "bf16", 0, 4) == StateBytes(2000, 4000, 12000)
    assert state_bytes(1000, "bf16", 1, 4) == StateBytes(2000, 4000, 3000)
    assert state_bytes(1000, "bf16", 2, 4) == StateBytes(2000, 1000, 3000)
    assert state_bytes(1000, "fp32", 1, 4) == StateBytes(4000, 4000, 2000)
    assert state_bytes(1001, "fp32", 2, 4) == StateBytes(4004, 4 * 251, 8 * 251)  # padded to dp

    recipe = RECIPES[[p.stem for p in RECIPES].index("llama3_70b")]
    cfg = load_config(recipe)
    lines = []
    found = dry_run(cfg, job_world_size(cfg), out=lines.append, gpu=gpu_named("h100-80g"))
    from parallel3d.train.dryrun import built_stages

    reports, par = found["reports"], cfg.parallel
    # first, middle, last and the planner's fullest stage (as many as the pipeline has)
    assert [r.stage for r in reports] == built_stages(par.pp, found["stages"]) and len(reports) >= min(3, par.pp)
    for r in reports:
        assert r.states == state_bytes(r.params.held, "bf16", par.zero, par.dp * par.cp)
        row = next(line for line in lines if line.strip().startswith(f"{r.stage} ("))
        assert f"{r.params.held:,d}" in row and "fits, " in row
        acts, buffers = r.transient
        assert r.peak == r.states.total + acts + buffers
    # the modules' counts against the formula the planner uses: the same parameters
    for r in reports:
        planned = found["stages"][r.stage]
        assert r.params.held == planned.params, (r.params, planned.params)
    small = gpu_named("a100-40g")
    lines = []
    dry_run(cfg, job_world_size(cfg), out=lines.append, gpu=small)
    assert sum("DOES NOT FIT" in line for line in lines) == len(reports)


def test_the_default_recipe_says_the_split_it_runs():
    recipe = RECIPES[[p.stem for p in RECIPES].index("debug_cpu")]
    said = next(line for line in recipe.read_text().splitlines() if line.startswith("pp = "))
    lines = []
    dry_run(load_config(recipe), 8, out=lines.append)
    stages = [line.split("): ", 1)[1] for line in lines if line.startswith("  stage ") and "(ranks" in line]
    assert said.split("# ", 1)[1].startswith(" | ".join(stages)), (said, stages)


def test_the_128k_recipe_dry_runs_with_context_parallelism_and_fits_an_h100():
    """recipes/llama3_8b_128k.toml (the planner's choice for 8B at 128K tokens on 64 H100s,
    tests/test_planner_cp.py checks it is): the CLI's dry run names cp in the layout, gives
    each cp rank its share of a sequence, and the stage fits an H100 80GB."""
    recipe = RECIPES[[p.stem for p in RECIPES].index("llama3_8b_128k")]
    proc = subprocess.run([sys.executable, "-m", "parallel3d.cli", "train", str(recipe), "--dry-run",
                           "--gpu", "h100-80g"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    layout = next(line for line in lines if line.startswith("layout: "))
    cfg = load_config(recipe)
    assert cfg.parallel.cp > 1 and f"x cp {cfg.parallel.cp} ({cfg.parallel.cp_comm}) x" in layout, layout
    assert f"{131072 // cfg.parallel.cp} tokens of each sequence per cp rank" in proc.stdout
    assert "64 ranks (8 nodes x 8)" in lines[0] and "stage 0 (ranks 0..63)" in proc.stdout
    row = next(line for line in lines if line.strip().startswith("0 (all)"))
    assert "fits, " in row and "DOES NOT FIT" not in proc.stdout
    # activations from the planner at S / cp tokens: a cp 1 job of the same layout does not fit
    replicas = cfg.parallel.cp * cfg.parallel.dp
    over = subprocess.run([sys.executable, "-m", "parallel3d.cli", "train", str(recipe), "--dry-run",
                           "--gpu", "h100-80g", "--parallel.cp=1", f"--parallel.dp={replicas}"],
                          capture_output=True, text=True, timeout=300)
    assert over.returncode == 0 and "DOES NOT FIT" in over.stdout, over.stdout + over.stderr


def test_the_moe_recipe_prints_each_ranks_expert_and_dense_parameters_as_the_formula_says():
    """recipes/qwen3_moe_30b_a3b.toml (Qwen3-30B-A3B, ep 8 on 64 ranks): the CLI's dry run
    reads, from the rank's meta modules, 16 of each layer's 128 experts and the dense
    parameters, and they equal the model's shape worked out by hand; it fits an H100."""
    recipe = RECIPES[[p.stem for p in RECIPES].index("qwen3_moe_30b_a3b")]
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run([sys.executable, "-m", "parallel3d.cli", "train", str(recipe), "--dry-run",
                           "--gpu", "h100-80g"], capture_output=True, text=True, timeout=300, cwd=root)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "model 30.532B parameters, 3.353B active per token" in out
    assert "tp 1 x pp 1 x dp 64 (ep 8 x edp 8)" in out and "DOES NOT FIT" not in out
    # Qwen3-30B-A3B by hand: 48 sparse layers of 128 experts (3 x 2048 x 768 each), 8 per
    # rank at ep 8 -> 16 experts a layer; attention q (2048 x 32 x 128), o, k and v (4 kv
    # heads of 128), two norms, q/k norms of 128, the router (128 x 2048); untied embedding
    # and head of 151936 x 2048, the final norm
    d, layers = 2048, 48
    experts = layers * (128 // 8) * 3 * d * 768
    attention = 2 * d * 32 * 128 + 2 * d * 4 * 128
    dense = layers * (attention + 2 * d + 2 * 128 + 128 * d) + 2 * 151936 * d + d
    line = next(line for line in out.splitlines() if line.strip().startswith("stage 0:"))
    assert line.strip() == f"stage 0: {experts:,d} expert + {dense:,d} dense = {experts + dense:,d}", line
    # the rank holds 1/8 of the experts: the whole model's experts are 8 times the rank's
    assert experts * 8 + dense == 30_532_122_624
