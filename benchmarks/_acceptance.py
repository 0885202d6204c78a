"""The sections of gpu_acceptance.py. Each ``section(smoke, work, emit)`` runs in a process
of its own (its time budget is enforced from outside) and calls ``emit(row)`` with one
dict per table row as soon as the row is known, so a section cut short still reports
what it measured. ``smoke`` runs the same code on CPU with tiny shapes (figures
meaningless); the parent sets TRITON_INTERPRET=1 for the sections with kernels in them.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

ROOT = Path(__file__).resolve().parents[1]
DATA = {"max_bytes": 1_000_000, "vocab_size": 512}  # the corpus every section trains on
BF16_LOSS_TOL = 2e-2  # bf16 keeps 8 bits (2^-8 = 0.4 % a rounding): more than a few roundings' drift is other math
FP32_LOSS_TOL_GPU = 1e-4  # fp32; Triton tiles, cuBLAS and collectives sum in different orders, a few steps
FP32_LOSS_TOL_CPU = 1e-5  # fp32 with the same kernels on both sides: the CPU suite's bar


def _device(smoke: bool) -> torch.device:
    return torch.device("cpu") if smoke else torch.device("cuda", 0)


# -- 1. the kernel tests ---------------------------------------------------------------------

# Our Triton kernels, and torch's variable-length flash attention as the model calls it
# for packed documents (its gpu-marked case compares it with the masked SDPA in bf16).
KERNEL_FILES = ("tests/test_kernels_linear.py", "tests/test_kernels_cross_entropy.py",
                "tests/test_attention_varlen.py")
# On CPU the interpreter runs a few fp32 cases: its bf16/fp16 tl.dot is wrong.
SMOKE_SELECTION = {"tests/test_kernels_linear.py": "fp32_matches_reference and 37 and nobias",
                   "tests/test_kernels_cross_entropy.py": "triton_matches_the_reference and dtype0",
                   "tests/test_attention_varlen.py": "spans_by_hand"}


def _pytest(args: list[str]) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "pytest", *args, "-p", "no:cacheprovider"]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)


def kernels(smoke: bool, work: Path, emit) -> None:
    """The kernel test files under pytest (on a GPU: compiled fp32 cases and the
    ``gpu``-marked bf16 / fp16 ones); per file the counts, gpu-marked ones apart."""
    for path in KERNEL_FILES:
        select = ["-k", SMOKE_SELECTION[path]] if smoke else []
        gpu_ids = set()
        if not smoke:  # the interpreter runs no gpu-marked case: do not start pytest for them
            marked = _pytest([path, "-m", "gpu", "--collect-only", "-q"]).stdout.splitlines()
            gpu_ids = {ln.strip() for ln in marked if "::" in ln}
        done = _pytest([path, "-q", "-rA", *select])
        lines = done.stdout.splitlines()
        passed = [ln.split(" ", 1)[1] for ln in lines if ln.startswith("PASSED ")]
        failed = [ln.split(" ", 1)[1].split(" - ")[0] for ln in lines if ln.startswith(("FAILED ", "ERROR "))]
        skipped = sum(int(m.group(1)) for ln in lines if (m := re.match(r"SKIPPED \[(\d+)\]", ln)))
        emit({"file": path, "passed": len(passed), "failed": len(failed), "skipped": skipped,
              "gpu-marked (bf16/fp16) passed": f"{len(gpu_ids & set(passed))} of {len(gpu_ids)}",
              "failures": ", ".join(failed)[:300] or "-",
              "check": "ok" if done.returncode == 0 and passed and not failed else f"FAIL (pytest exit {done.returncode})"})


# -- 2. Triton linear against cuBLAS ---------------------------------------------------------

def _ms_cpu(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def linear(smoke: bool, work: Path, emit) -> None:
    """bench_linear.bench_shape on every shard of the 8B and 70B presets at tp 2/4/8
    (M = 8192 tokens, bf16); ratio = Triton / cuBLAS TFLOP/s, >= 1 where "auto" could
    pick Triton. Smoke: four shards scaled down 64x, fp32 in the interpreter."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import bench_linear
    from parallel3d.kernels import linear as L

    if smoke:
        jobs = [("llama3-8b/64", 2, "qkv", 64, 48, 64), ("llama3-8b/64", 2, "down", 64, 64, 112)]
        dtype, device, timer = torch.float32, "cpu", _ms_cpu
    else:
        jobs = [(preset, tp, layer, 8192, n, k) for preset in bench_linear.PRESETS for tp in (2, 4, 8)
                for layer, n, k in bench_linear.shard_shapes(preset, tp)]
        dtype, device = torch.bfloat16, "cuda"
        timer = lambda fn: bench_linear.cuda_ms(fn, warmup=10, rep=40)  # noqa: E731
    tol = 2e-5 if dtype == torch.float32 else 2e-2  # fp32: order only; bf16: 1-2 output roundings
    for preset, tp, layer, m, n, k in jobs:
        res, tiles = bench_linear.bench_shape(L, m, n, k, False, device=device, dtype=dtype, timer=timer)
        row = {"model": preset, "tp": tp, "layer": layer, "M x N x K": f"{m}x{n}x{k}"}
        for gemm, (ours, cublas, _) in res.items():
            row[f"{gemm} Triton/cuBLAS TFLOP/s"] = f"{ours:.0f}/{cublas:.0f}" if not smoke else f"{ours:.3f}/{cublas:.3f}"
            row[f"{gemm} ratio"] = f"{ours / cublas:.2f}"
        worst = max(err for _, _, err in res.values())
        row["max rel. err"] = f"{worst:.1e}"
        row["tiles"] = tiles
        row["check"] = "ok" if worst < tol else "FAIL"
        emit(row)


# -- 3. the 1B preset in bf16 ----------------------------------------------------------------

def train(smoke: bool, work: Path, emit) -> None:
    """gpu_mfu.py's comparison: Trainer(cfg, topo, device).fit() beside a plain PyTorch
    loop, same model, weights and batches, bf16 autocast. Smoke: debug preset on CPU."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import gpu_mfu

    args = SimpleNamespace(preset="debug" if smoke else "1b", steps=2 if smoke else 6, warmup=1 if smoke else 2,
                           rounds=1, micro_batch=2 if smoke else 4, accum=1 if smoke else 2,
                           seq_len=64 if smoke else 2048, peak_tflops=989.0, corpus_dir=str(work / "corpus"),
                           data_vocab=DATA["vocab_size"], run_dir=str(work / f"run-train-{os.getpid()}"))
    measured = gpu_mfu.measure(args, _device(smoke))
    for r in gpu_mfu.summary_rows(measured, args.peak_tflops):
        emit({"side": r["side"], "step ms": f"{r['step_ms']:.0f}", "tokens/s": f"{r['tokens_per_s']:.0f}",
              "MFU": f"{r['mfu']:.1%}", "peak GiB": f"{r['peak_gib']:.2f}",
              "first / last loss": f"{r['first_loss']:.4f} / {r['last_loss']:.4f}",
              "max loss rel. diff vs plain": f"{r['loss_rel_diff']:.1e}",
              "check": "ok" if r["loss_rel_diff"] <= BF16_LOSS_TOL else f"FAIL (> {BF16_LOSS_TOL})"})


# -- 4. 2x2x2 on one device ------------------------------------------------------------------

def _layout_job(layout: dict, smoke: bool, work: Path, backend: str, name: str) -> dict:
    return {"model": {"preset": "debug"},
            "parallel": {**layout, "linear_backend": backend},
            "train": {"steps": 2 if smoke else 4, "seed": 1234, "global_batch": 8, "micro_batch": 2,
                      "seq_len": 32 if smoke else 128, "lr": 1e-3, "warmup_steps": 0, "min_lr_ratio": 1.0,
                      "dtype": "fp32", "log_interval": 10**9},
            "data": {**DATA, "cache_dir": str(work / "corpus")},
            "run": {"dir": str(work / f"run-{name}-{os.getpid()}")},
            "observability": {"progress": "off"}}


def _train_rank(job: dict, device: str) -> list[float]:
    """One rank of the world (run by ProcessGroupPool): losses of the job's steps."""
    from parallel3d.config import config_from_dict
    from parallel3d.topology import Topology
    from parallel3d.train.trainer import Trainer

    cfg = config_from_dict(job)
    p = cfg.parallel
    topo = Topology(p.tp, p.pp, p.dp) if (p.tp * p.pp * p.dp) > 1 else Topology.single()
    return [r["loss"] for r in Trainer(cfg, topo, torch.device(device), log=False).fit()]


def layout3d(smoke: bool, work: Path, emit, budget_s: float = 100.0) -> None:
    """tp 2 x pp 2 x dp 2 (sequence parallelism, ZeRO-1) as 8 processes on one device
    (gloo; on a GPU every rank's tensors on cuda:0 and the Triton GEMMs forced) against
    1x1x1 on the same device: fp32 losses step by step, once with 1F1B and once with zb-v
    (two chunks per rank, each backward split into B and a deferred W: on a GPU the Triton
    linear's dgrad in B and its wgrad in W)."""
    from parallel3d.testing import ProcessGroupPool

    device = str(_device(smoke))
    backend = "auto" if smoke else "triton"  # CPU: torch's GEMM; GPU: the kernels inside the step
    base = {"tp": 2, "pp": 2, "dp": 2, "sequence_parallel": True, "zero": 1}
    layouts = {"1f1b": {**base, "schedule": "1f1b"},
               "zb-v": {**base, "schedule": "zb-v", "virtual_stages": 2}}
    from parallel3d.data.stdlib import prepare_stdlib  # one writer before eight readers
    from parallel3d.config import DataConfig
    prepare_stdlib(DataConfig(**DATA, cache_dir=str(work / "corpus")))
    reference = _train_rank(_layout_job({}, smoke, work, "auto", "1x1x1"), device)
    # --smoke forks the 8 CPU ranks from one server that imported torch once: spawning 8
    # interpreters was most of the smoke section's time (start-up only; a GPU run spawns).
    pool = ProcessGroupPool(8, timeout=budget_s, start_method="forkserver" if smoke else "spawn")
    try:
        for schedule, layout in layouts.items():
            ranks = pool.run(_train_rank, _layout_job(layout, smoke, work, backend, f"2x2x2-{schedule}"), device)
            losses = ranks[0]
            same = all(r == losses for r in ranks)
            diff = max(abs(a - b) / abs(b) for a, b in zip(losses, reference))
            tol = FP32_LOSS_TOL_CPU if smoke else FP32_LOSS_TOL_GPU
            emit({"layout": f"tp2 pp2 dp2 +SP zero1 {schedule}", "ranks": 8, "device": device,
                  "linear backend": backend, "steps": len(losses),
                  "losses 2x2x2": " ".join(f"{v:.5f}" for v in losses),
                  "losses 1x1x1": " ".join(f"{v:.5f}" for v in reference), "max rel. diff": f"{diff:.1e}",
                  "check": "ok" if same and diff <= tol and len(losses) == len(reference) else
                           f"FAIL (tolerance {tol:g}{'' if same else ', ranks disagree'})"})
    finally:
        pool.close()


SECTIONS = {"kernels": kernels, "linear": linear, "train": train, "layout3d": layout3d}
