"""Peak resident memory of ``parallel3d convert`` on a multi-GB sharded checkpoint.

Writes a synthetic parallel3d checkpoint (a Llama of about 580 M parameters in fp32,
2.3 GB, saved as by tp=2 x dp=2: column- and row-parallel blocks over 4 rank files), then
converts it to a Hugging Face folder in a child process and reads that child's peak
resident set size (``ru_maxrss`` from ``os.wait4``: the kernel's high-water mark of the
process, file-backed pages included). Measured in the same run:

* ``import``: a child that only imports torch and the converter (the fixed cost);
* ``naive``: a child that consolidates the way a one-off script would, loading every rank
  file with ``safetensors.torch.load_file`` and saving one file with ``save_file``.

The acceptance bound is ``largest tensor + 1 GiB`` for the streaming conversion (default
verification: sha256 while writing, headers re-read). ``bench_convert.py`` measures every
source format, with time beside a naive load-and-save and the ecosystem's converters.

The measuring parent imports neither torch nor parallel3d and writes the synthetic
checkpoint from a child too: a child's ``ru_maxrss`` counts the pages it shares with its
parent between fork and exec, so a big parent would inflate every figure.

    python benchmarks/bench_convert_memory.py [--dir /tmp/p3d-bench] [--keep] [--no-naive]
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zlib
from pathlib import Path

MODEL = dict(vocab_size=49152, dim=2048, n_layers=8, n_heads=16, n_kv_heads=8, ffn_dim=5632)
TP, DP = 2, 2
COLUMN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "embed_tokens", "lm_head")
ROW = ("o_proj", "down_proj")


def _split_dim(name: str) -> int | None:
    if any(f"{c}." in name for c in COLUMN):
        return 0
    if any(f"{r}." in name for r in ROW):
        return 1
    return None


def write_synthetic(folder: Path) -> None:
    """The tp=2 x dp=2 checkpoint (run in a child). Each rank generates only the blocks it
    writes (seeded by name and block); prints the total and largest tensor sizes."""
    import torch

    from parallel3d.checkpoint.format import model_identity
    from parallel3d.checkpoint.rank_files import RankPayload, build_index, write_rank_files
    from parallel3d.checkpoint.state import Placement, Slot, logical_shapes
    from parallel3d.models.llama import LlamaConfig

    model = LlamaConfig(**MODEL)
    shapes = logical_shapes(model)
    records = []
    for rank in range(TP * DP):
        tp_rank, dp_rank = rank % TP, rank // TP
        slots = []
        for i, (name, shape) in enumerate(shapes.items()):
            dim = _split_dim(name)
            if (dim is None and tp_rank != 0) or i % DP != dp_rank:
                continue  # replicas are written by one holder, in turn over dp
            offsets, block = [0] * len(shape), list(shape)
            if dim is not None:
                block[dim] = shape[dim] // TP
                offsets[dim] = tp_rank * block[dim]
            g = torch.Generator().manual_seed(zlib.crc32(f"{name}{offsets}".encode()))
            t = torch.randn(block, generator=g)
            pl = Placement(name, tuple(shape), tuple(offsets), tuple(block), True)
            slots.append(Slot("model/" + name, pl, t))
        records.append(write_rank_files(folder, RankPayload(0, rank, slots, {"rank": rank})))
        del slots
    index = build_index(0, records, {"model": model_identity(model),
                                     "layout": {"tp": TP, "pp": 1, "dp": DP, "world_size": TP * DP}})
    index.write(folder / "index.json")
    sizes = [torch.Size(s).numel() * 4 for s in shapes.values()]
    (folder.parent / "sizes.txt").write_text(f"{sum(sizes)} {max(sizes)}")


def peak_rss_of(cmd: list[str]) -> tuple[int, float]:
    """(peak RSS in bytes, seconds) of a child process running ``cmd``."""
    t0 = time.monotonic()
    child = subprocess.Popen(cmd)
    _, status, usage = os.wait4(child.pid, 0)
    seconds = time.monotonic() - t0
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"{' '.join(cmd[:4])} ... failed with status {os.waitstatus_to_exitcode(status)}")
    return usage.ru_maxrss * 1024, seconds  # Linux reports KiB


NAIVE = r"""
import sys
from pathlib import Path
from safetensors.torch import load_file, save_file
src, dst = Path(sys.argv[1]), Path(sys.argv[2])
tensors = {}
for f in sorted(src.glob("rank_*.safetensors")):
    tensors.update({f"{f.name}/{k}": v for k, v in load_file(f).items()})
save_file(tensors, str(dst))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dir", default=None, help="work folder (default: a temporary one)")
    ap.add_argument("--keep", action="store_true", help="keep the files")
    ap.add_argument("--no-naive", action="store_true", help="skip the load-everything reference")
    ap.add_argument("--write-synthetic", help=argparse.SUPPRESS)  # the child that writes
    args = ap.parse_args()
    if args.write_synthetic:
        write_synthetic(Path(args.write_synthetic))
        return
    work = Path(args.dir or tempfile.mkdtemp(prefix="p3d-bench-convert-"))
    ckpt = work / "checkpoint"
    shutil.rmtree(work, ignore_errors=True)
    ckpt.mkdir(parents=True)
    try:
        t0 = time.monotonic()
        peak_rss_of([sys.executable, __file__, "--write-synthetic", str(ckpt)])
        total, largest = (int(x) for x in (work / "sizes.txt").read_text().split())
        on_disk = sum(f.stat().st_size for f in ckpt.iterdir())
        print(f"synthetic checkpoint: {on_disk / 1e9:.2f} GB on disk in {len(list(ckpt.glob('*.safetensors')))} "
              f"rank files ({time.monotonic() - t0:.0f} s to write), largest tensor "
              f"{largest / 2**20:.0f} MiB", flush=True)
        base, _ = peak_rss_of([sys.executable, "-c", "import torch, parallel3d.checkpoint.convert"])
        peak, secs = peak_rss_of([sys.executable, "-m", "parallel3d.cli", "convert", str(ckpt),
                                  str(work / "hf"), "--to", "hf", "--max-shard-gb", "1"])
        bound = largest + 2**30
        print(f"import only         peak RSS {base / 2**20:8.0f} MiB")
        print(f"parallel3d convert  peak RSS {peak / 2**20:8.0f} MiB  ({secs:.0f} s, writes + verifies "
              f"{total / 1e9:.2f} GB)")
        print(f"bound (largest tensor + 1 GiB)   {bound / 2**20:8.0f} MiB: "
              f"{'within' if peak < bound else 'EXCEEDED'}")
        if not args.no_naive:
            naive, nsecs = peak_rss_of([sys.executable, "-c", NAIVE, str(ckpt), str(work / "naive.safetensors")])
            print(f"naive load_file + save_file peak RSS {naive / 2**20:8.0f} MiB ({nsecs:.0f} s)")
            print(f"ratio naive / streaming peak: {naive / peak:.1f}x (above the import cost: "
                  f"{(naive - base) / max(peak - base, 1):.1f}x)")
        if peak >= bound:
            raise SystemExit(1)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
