"""The dry run plans the runtime the job trains on. On CPU (gloo) the loss's torch
reference (``kernels.cross_entropy``) holds one fp32 block of whole logit rows while its
backward starts, on top of the saved logits; a GPU's fused kernel writes the gradient over
the logits and allocates nothing of their size. (Measured: ``benchmarks/README.md``,
bench_lora_memory, whose last stage holds 20-21 MiB in the step against 20.1 planned for
CPU and 12.3 for a GPU.)"""

from __future__ import annotations

from parallel3d.config import config_from_dict
from parallel3d.kernels.cross_entropy import REF_BLOCK_BYTES
from parallel3d.planner.hardware import gpu_named
from parallel3d.train.dryrun import dry_run

from helpers import tiny_job


def _peaks(job: dict, **kw) -> tuple[list[int], list[str]]:
    lines = []
    found = dry_run(config_from_dict(job), 4, out=lines.append, **kw)
    return [s.activations + s.backward_transient for s in found["stages"]], lines


def test_a_cpu_dry_run_adds_the_loss_row_block_to_the_last_stage_only(tmp_path):
    vocab, tp, tokens = 4096, 2, 2 * 32  # micro_batch x seq_len
    job = tiny_job("", str(tmp_path), model={"vocab_size": vocab}, parallel={"tp": tp, "pp": 2, "dp": 1},
                   train={"dtype": "fp32"}, launch={"backend": "gloo"})
    cpu, cpu_lines = _peaks(job)
    gpu, gpu_lines = _peaks(job, gpu=gpu_named("h100-80g"))
    v = vocab // tp  # this rank's logit columns
    block = min(tokens, REF_BLOCK_BYTES // (4 * v)) * 4 * v  # whole fp32 rows, at most REF_BLOCK_BYTES
    assert block == tokens * 4 * v  # this small job's rows fit one block
    assert cpu[0] == gpu[0] and cpu[1] - gpu[1] == block
    assert any("from the planner (on CPU over gloo):" in line for line in cpu_lines)
    assert not any("on CPU over gloo" in line for line in gpu_lines)
