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
    t0 = time.perf_counter()
    found = dry_run(cfg, world, out=lines.append)
    seconds = time.perf_counter() - t0
    assert seconds < 20, f"{recipe.name}: dry run took {seconds:.1f} s"  # 2 loaded cores: slack
    assert found["world_size"] == world == cfg.parallel.tp * cfg.parallel.pp * cfg.parallel.dp
    assert f"{world} ranks" in lines[0]
    params = list(found["model"].parameters())
    assert params and all(p.is_meta for p in params), "a weight was allocated"
    assert sum(found["split"]) == found["model"].cfg.n_layers
    if cfg.launch.backend == "nccl":
        # recipes for GPUs name H100 80GB: the fullest stage must fit one, margin included
        worst = max(s.peak for s in found["stages"])
        assert worst * (1 + FRAGMENTATION) <= usable_bytes(gpu_named("h100-80g")), recipe.name


def test_the_70b_recipe_is_512_ranks_and_the_cli_allocates_no_weights():
    recipe = RECIPES[[p.stem for p in RECIPES].index("llama3_70b")]
    # The child reports its own peak RSS as it exits (RUSAGE_CHILDREN would be the
    # largest of every child this pytest process ever waited for, training runs included).
    probe = ("import resource, runpy, sys\n"
             "sys.argv = ['parallel3d'] + sys.argv[1:]\n"
             "try:\n"
             "    runpy.run_module('parallel3d.cli', run_name='__main__')\n"
             "finally:\n"
             "    print(f'PEAK_RSS_KIB={resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}', file=sys.stderr)\n")
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
