"""Small builders shared by the training tests."""

from __future__ import annotations

import json
import os
import resource
import subprocess
from contextlib import contextmanager
from pathlib import Path

# How every gloo pool of the suite starts its workers: forked from one server process that
# imported torch and the trainer once (parallel3d/testing.py). 8 spawned workers took
# 16-20 s to start and 7-9 s to close on 2 loaded cores; 8 forked ones under 1 s each way.
POOL_START = "forkserver"


def tiny_job(corpus_dir: str, run_dir: str, **sections) -> dict:
    """Overrides for a fast debug-model run on the session corpus (fp32, CPU).

    ``sections`` maps a section name to a dict of its keys, merged over the defaults."""
    job = {
        "model": {"preset": "debug", "vocab_size": 512, "n_layers": 2, "dim": 64,
                  "n_heads": 4, "n_kv_heads": 2, "ffn_dim": 160},
        "train": {"steps": 10, "seed": 7, "global_batch": 8, "micro_batch": 2,
                  "seq_len": 32, "lr": 3e-3, "warmup_steps": 2, "grad_clip": 1.0,
                  "log_interval": 1000},
        "data": {"max_bytes": 1_000_000, "vocab_size": 512, "cache_dir": corpus_dir},
        # The default recipe validates every 50 steps; 1 MB of the stdlib holds no
        # validation document at its 2%: tests that validate say so (eval=..., val_fraction).
        "eval": {"interval": 0},
        "run": {"dir": run_dir},
    }
    for name, keys in sections.items():
        job.setdefault(name, {}).update(keys)
    return job


def tiny_job_on(prepared_dir: str, run_dir: str, **sections) -> dict:
    """:func:`tiny_job` reading a prepare-data dataset (vocabulary 700) instead of the
    stdlib corpus."""
    job = tiny_job("", run_dir, **sections)
    job["data"] = {"path": prepared_dir, **sections.get("data", {})}
    job["model"]["vocab_size"] = 768
    return job


def job_args(job: dict) -> list[str]:
    """The job as command-line overrides (``--section.key=value``, TOML literals)."""
    return [f"--{section}.{key}={json.dumps(value)}"
            for section, keys in job.items() for key, value in keys.items()]


# The bound on ||w - w_ref|| / ||w_ref|| per tensor after 10 fp32 steps at another layout.
# The losses agree to 1e-5 (the parity bar); the weights carry AdamW's amplification of
# ulp-level gradient differences (1/sqrt(v) on near-cancelling elements), which depends on
# the draw of initial weights: the 2x2x2 test's worst tensor measured 2.5e-6, 6.7e-6,
# 3.6e-6, 1.7e-5 and 1.3e-5 for five different initial draws of the same model (the same
# code). A real layout bug is orders of magnitude away (a tied embedding's gradient left
# unsummed moves the loss by 5e-3, the weights by more).
WEIGHT_RTOL = 5e-5


# Two bf16 runs of the same job that differ only in how a kernel orders its sums (oneDNN's
# bf16 GEMMs block and accumulate differently with AVX2, AVX512-BF16 and AMX; a split
# backward's separate weight-gradient GEMM; a gradient summed in fp32 rather than in bf16)
# round some of the same values to neighbouring bf16 numbers. Every value of the forward
# carries one bf16 rounding, a relative error of at most BF16_U = 2^-8 (8 significant
# bits), so the loss those values give is resolved to BF16_U and no better: two such runs
# agree to within one BF16_U on each step's loss. The fp32 master weights keep the drift
# from compounding past it over tens of steps (each step's update is lr-sized, the same
# up to that resolution in both runs). Measured after 20 steps of tp 1 x pp 2, ZeRO 1/2:
# 8.7e-5 with AVX2, 1.43e-3 on an AMX-BF16 machine; a real defect (the tied embedding's
# gradient left unsummed) 5.6e-3, above the bound. Bit-for-bit claims are kept for what
# no kernel choice changes (two ranks' copies of one tensor, updated from one sum).
BF16_U = 2.0 ** -8


def relative_diff(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b), (len(a), len(b))
    return max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b))


# Llama 3.1 8B's published config.json, the model the recipe's layout is sized for.
LLAMA31_8B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
    "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256,
    "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
    "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                     "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    "tie_word_embeddings": False, "torch_dtype": "bfloat16",
}


def write_llama31_8b_config(folder: Path) -> Path:
    """A folder with only config.json: all the dry run reads (no weight is allocated)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(LLAMA31_8B))
    return folder


def stall_rank_at(trainer, stall_rank: int, stall_step: int, stall_s: float) -> None:
    """Make rank ``stall_rank`` of ``trainer`` sleep ``stall_s`` seconds at the start of
    step ``stall_step`` (before its forward): the others wait in their collectives."""
    import time

    run = trainer.schedule.run

    def stalling(micro_batches, **kw):
        if trainer.topo.rank == stall_rank and trainer.step + 1 == stall_step:
            time.sleep(stall_s)
        return run(micro_batches, **kw)

    trainer.schedule.run = stalling


def run_counting_cpu(cmd: list[str], **kwargs) -> tuple[subprocess.CompletedProcess, float]:
    """``subprocess.run(cmd, **kwargs)`` and the CPU seconds (user + system) the command
    and the children it waited for used. A bound on "fails fast" in CPU seconds holds on
    a loaded machine, where the same process can take ten times as long by the clock (a
    bad-input CLI run took 27 s by the clock, about 2.5 s of CPU, beside two busy loops)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    proc = subprocess.run(cmd, **kwargs)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return proc, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def spawned_children(parent: int) -> list[int]:
    """The multiprocessing spawn children of process ``parent`` (launched workers, pool
    workers; not its resource tracker), in start order."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmd = f.read()
        except OSError:
            continue
        if ppid == parent and b"spawn_main" in cmd:
            out.append(int(entry))
    return sorted(out)


@contextmanager
def torch_threads(n: int = 1):
    """torch computes on ``n`` threads inside, as each pool rank does (a reference run in
    the test process: two OpenMP threads spin-waiting for each other on a loaded 2-core
    machine took 7-55 s for what one does in 0.6 s)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)
