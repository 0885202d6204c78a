"""``parallel3d convert`` beside a naive load-and-save and the ecosystem's own tools, on
multi-GB synthetic checkpoints of every format it reads (``bench_convert_formats.py``).

For each format, in one run and alternating (the machine is shared and noisy; repeats
give the median), each a child process whose peak resident set size (``ru_maxrss`` from
``os.wait4``) and wall time are measured:

- ``convert``: ``parallel3d convert SRC OUT --to hf`` (default verification: sha256 while
  writing, headers re-read), and ``--to dcp`` for the parallel3d source;
- ``naive``: the format's ordinary loader reads the whole checkpoint into memory
  (``safetensors.torch.load_file``, ``torch.load``, DCP's own ``_load_state_dict`` as
  ``dcp_to_torch_save`` uses it), ``safetensors.torch.save_file`` writes it and ``fsync``
  makes it durable (convert fsyncs its files before renaming them into place);
- the ecosystem's converter where there is one: DeepSpeed's ``zero_to_fp32`` (safetensors
  output) on ZeRO-2/3, torch's ``dcp_to_torch_save`` on DCP and Megatron torch_dist.

The claims checked: convert's time is at most 1.5x the naive one's (the median over the
repeats of each convert / naive pair run back to back; ``cpu`` is the same ratio of
user + system CPU seconds, which a loaded machine disturbs less; each row ends with the
load averages after its runs), and its peak RSS at
most ``import + max(memory budget, largest tensor) + 256 MiB`` (the read-ahead budget,
``--memory-gb``, bounds the tensors in flight; one larger tensor goes alone; the margin is
the allocator's and the files' buffers). The measuring parent imports neither torch nor
parallel3d (a child's ``ru_maxrss`` counts pages shared with its parent).

    python benchmarks/bench_convert.py [--dir D] [--formats parallel3d,zero3,...]
                                       [--repeats 2] [--memory-gb 0.5] [--keep]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
FORMATS = ("parallel3d", "hf", "dcp", "megatron_dist", "megatron_legacy", "zero2", "zero3")

NAIVE = r"""
import sys, torch
from pathlib import Path
from safetensors.torch import load_file, save_file
fmt, src, dst = sys.argv[1], Path(sys.argv[2]), sys.argv[3]
tensors = {}
def walk(obj, prefix):
    if torch.is_tensor(obj):
        tensors[prefix] = obj.contiguous()
    elif isinstance(obj, dict):
        for k, v in obj.items(): walk(v, f"{prefix}.{k}")
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj): walk(v, f"{prefix}.{i}")
if fmt in ("parallel3d", "hf"):
    for f in sorted(src.rglob("*.safetensors")):
        tensors.update({f"{f.name}/{k}": v for k, v in load_file(f).items()})
elif fmt in ("dcp", "megatron_dist"):
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict
    sd = {}
    _load_state_dict(sd, storage_reader=FileSystemReader(str(src)), planner=_EmptyStateDictLoadPlanner(), no_dist=True)
    walk(sd, "")
else:
    for f in sorted(src.rglob("*.pt")):
        walk(torch.load(f, map_location="cpu", weights_only=False), f.name)
save_file(tensors, dst)
import os
fd = os.open(dst, os.O_RDONLY)
os.fsync(fd)  # durable, as convert's output (else the process exits with dirty pages)
os.close(fd)
"""

ZERO_TO_FP32 = ("from deepspeed.utils.zero_to_fp32 import convert_zero_checkpoint_to_fp32_state_dict as c; "
                "import sys; c(sys.argv[1], sys.argv[2], safe_serialization=True)")
DCP_TO_TORCH = ("from torch.distributed.checkpoint.format_utils import dcp_to_torch_save as c; "
                "import sys; c(sys.argv[1], sys.argv[2] + '/model.pt')")


def measure(cmd: list[str], env=None) -> tuple[float, int, float]:
    """(seconds, peak RSS bytes, CPU seconds user + system) of a child running ``cmd``."""
    t0 = time.monotonic()
    child = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL)
    _, status, usage = os.wait4(child.pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"{' '.join(cmd[:6])} ... failed with status {os.waitstatus_to_exitcode(status)}")
    return time.monotonic() - t0, usage.ru_maxrss * 1024, usage.ru_utime + usage.ru_stime


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dir", default=None)
    ap.add_argument("--formats", default=",".join(FORMATS))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--memory-gb", default="0.5")
    ap.add_argument("--keep", action="store_true")
    args = ap.parse_args()
    work = Path(args.dir or tempfile.mkdtemp(prefix="p3d-bench-convert-"))
    work.mkdir(parents=True, exist_ok=True)
    py = sys.executable
    budget = float(args.memory_gb) * 2**30
    _, base, _ = measure([py, "-c", "import torch, parallel3d.checkpoint.convert"])
    print(f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, load average {_load()}, {args.repeats} repeats; "
          f"import only: peak RSS {base / 2**20:.0f} MiB; read-ahead budget {budget / 2**20:.0f} MiB", flush=True)
    print(f"{'format':16} {'GB':>5} {'largest':>8} | {'convert s':>9} {'MiB':>6} | {'naive s':>8} {'MiB':>6} | "
          f"{'ratio':>5} {'cpu':>5} | {'peer':>16} {'s':>6} {'MiB':>6} | memory bound | load", flush=True)
    failed = []
    try:
        for fmt in args.formats.split(","):
            failed += run_format(fmt, work, py, args, base, budget)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    print(f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, load average {_load()}", flush=True)
    if failed:
        raise SystemExit(f"claims not met: {failed}")


def run_format(fmt: str, work: Path, py: str, args, base: int, budget: float) -> list[str]:
    src = work / fmt
    if not src.exists():
        measure([py, str(HERE / "bench_convert_formats.py"), fmt, str(src)])
    size = sum(f.stat().st_size for f in src.rglob("*") if f.is_file())
    largest = _largest(fmt)
    out = work / "out"
    peer = {"zero2": ("zero_to_fp32", ZERO_TO_FP32), "zero3": ("zero_to_fp32", ZERO_TO_FP32),
            "dcp": ("dcp_to_torch_save", DCP_TO_TORCH),
            "megatron_dist": ("dcp_to_torch_save", DCP_TO_TORCH)}.get(fmt)
    targets = ["hf", "dcp"] if fmt == "parallel3d" else ["hf"]
    rows = {t: [] for t in targets}
    naive, peer_runs = [], []
    for _ in range(args.repeats):
        for to in targets:
            shutil.rmtree(out, ignore_errors=True)
            rows[to].append(measure([py, "-m", "parallel3d.cli", "convert", str(src), str(out), "--to", to,
                                     "--max-shard-gb", "1", "--memory-gb", args.memory_gb]))
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir()
        naive.append(measure([py, "-c", NAIVE, fmt, str(src), str(out / "all.safetensors")]))
        if peer is not None:
            shutil.rmtree(out, ignore_errors=True)
            out.mkdir()
            peer_runs.append(measure([py, "-c", peer[1], str(src), str(out)]))
    shutil.rmtree(out, ignore_errors=True)
    failed = []
    n_s = statistics.median(r[0] for r in naive)
    n_m = max(r[1] for r in naive)  # the pairs below: convert_i / naive_i, run back to back
    bound = base + max(budget, largest) + 256 * 2**20
    for to, runs in rows.items():
        c_s = statistics.median(r[0] for r in runs)
        c_m = max(r[1] for r in runs)
        ratio = statistics.median(c[0] / n[0] for c, n in zip(runs, naive))
        cpu = statistics.median(c[2] / n[2] for c, n in zip(runs, naive))
        p = (f"{peer[0]:>16} {statistics.median(r[0] for r in peer_runs):6.1f} "
             f"{max(r[1] for r in peer_runs) / 2**20:6.0f}") if peer else f"{'-':>16} {'':6} {'':6}"
        ok = c_m <= bound
        print(f"{fmt + ' -> ' + to:16} {size / 1e9:5.2f} {largest / 2**20:6.0f}Mi | {c_s:9.1f} {c_m / 2**20:6.0f} | "
              f"{n_s:8.1f} {n_m / 2**20:6.0f} | {ratio:5.2f} {cpu:5.2f} | {p} | "
              f"{bound / 2**20:.0f} MiB {'within' if ok else 'EXCEEDED'} | {_load()}", flush=True)
        if ratio > 1.5:
            failed.append(f"{fmt}->{to} time {ratio:.2f}x naive")
        if not ok:
            failed.append(f"{fmt}->{to} peak {c_m / 2**20:.0f} MiB")
    return failed


def _load() -> str:
    """The 1 / 5 / 15-minute load averages (other processes share the machine)."""
    return "/".join(f"{x:.1f}" for x in os.getloadavg())


def _largest(fmt: str) -> int:
    """Bytes of the largest tensor of the format's synthetic model (fp32)."""
    sys.path.insert(0, str(HERE))
    from bench_convert_formats import MODEL, ZERO_MODEL

    m = ZERO_MODEL if fmt.startswith("zero") else MODEL
    return max(m["vocab_size"] * m["dim"], m["ffn_dim"] * m["dim"]) * 4


if __name__ == "__main__":
    main()
