"""Data-parallel communication hidden behind compute, measured (issue 38, acceptance 2).

Two hosts (network namespaces, ``tests/hosts.py``) joined by a link that ``tc``'s
token-bucket filter limits to ``--rate-mbit`` each way, one gloo rank on each (dp 2
across the hosts, one CPU thread each), the same Llama, batches and AdamW for every case,
cases alternated round by round so machine noise hits them alike:

- ``compute``: forward, backward and the update with no communication (a one-rank
  optimizer on each host);
- ``comm``: ZeRO 2's traffic of a step alone: every bucket's fp32 reduce-scatter and the
  parameters' all-gather, issued together and waited for;
- ``zero2-off``: ZeRO 2, gradients reduced after the backward, the all-gather waited for
  in the step (nothing overlapped);
- ``zero2-on``: ZeRO 2, buckets reduced as the backward fills them, the all-gather waited
  for by each module in the next forward (``parallel.overlap_param_gather``);
- ``zero3``: ZeRO 3, each module's buckets gathered before its forward and backward,
  the next prefetched (1.5x ZeRO 2's traffic: parameters cross the wire twice);
- ``fsdp2-zero2`` / ``fsdp2-zero3``: torch's ``fully_shard`` on each layer and the root,
  ``reshard_after_forward`` False / True, torch's AdamW.

A case's step time is the wall time of ``--steps`` steps over their number (the overlapped
all-gather of one step runs under the next; the last is waited for). Printed: the table,
each case against max(compute, comm) and against compute + comm, and ours / FSDP2.

    sudo python benchmarks/bench_dp_overlap.py [--rate-mbit 200] [--steps 6] [--rounds 2]

Needs root (namespaces, tc). The rate is chosen so that ``comm`` takes about as long as
``compute``: the figures say how far that held.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
MODEL = dict(vocab_size=1024, dim=256, n_layers=4, n_heads=8, n_kv_heads=8, ffn_dim=688)  # 3.7 M params
SEQ, MICRO = 128, 4  # one micro-batch of 4 sequences per rank and step
CASES = ("compute", "comm", "zero2-off", "zero2-on", "zero3", "fsdp2-zero2", "fsdp2-zero3")


def _model():
    from parallel3d.models.llama import Llama, LlamaConfig

    torch.manual_seed(0)
    return Llama(LlamaConfig(**MODEL))


def _batch(step: int, rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + 2 * step + rank)
    return torch.randint(0, MODEL["vocab_size"], (MICRO, SEQ + 1), generator=g)


def _loss(model, tokens):
    from parallel3d.models.llama.parallelize import cross_entropy_loss

    return cross_entropy_loss(model(tokens[:, :-1]), tokens[:, 1:])


def _timed(steps: int, one_step, finish=lambda: None) -> float:
    one_step(0)  # warm-up (allocations, the first gathers)
    finish()
    dist.barrier()
    t0 = time.perf_counter()
    for step in range(1, steps + 1):
        one_step(step)
    finish()
    dist.barrier()
    return (time.perf_counter() - t0) / steps


def _ours(case: str, steps: int, bucket_mb: float) -> float:
    from parallel3d.config import TrainConfig
    from parallel3d.topology import Topology
    from parallel3d.zero import ZeroOptimizer

    train = TrainConfig(lr=1e-3, grad_clip=0.0)
    model = _model()
    rank = dist.get_rank()
    topo = Topology.single() if case == "compute" else Topology(1, 1, 2)
    stage = {"compute": 0, "zero2-off": 2, "zero2-on": 2, "zero3": 3}[case]
    opt = ZeroOptimizer(model.parameters(), train, topo, stage=stage, bucket_mb=bucket_mb, model=model,
                        overlap_param_gather=case != "zero2-off")

    def step(s):
        opt.begin_step(None if case == "zero2-off" else 1)  # None: reduce after the backward
        _loss(model, _batch(s, rank)).backward()
        opt.step(train.lr)

    out = _timed(steps, step, opt.finish_param_gather if stage < 3 else lambda: None)
    opt.release()
    return out


def _comm(steps: int, bucket_mb: float) -> float:
    from parallel3d.config import TrainConfig
    from parallel3d.distributed import all_gather_flat, reduce_scatter_flat
    from parallel3d.topology import Topology
    from parallel3d.zero import ZeroOptimizer

    model = _model()
    opt = ZeroOptimizer(model.parameters(), TrainConfig(), Topology(1, 1, 2), stage=2, bucket_mb=bucket_mb)
    group = opt.dp_group
    grads = [torch.randn(b.numel) for b in opt.layout.buckets]
    outs = [torch.empty(b.shard_numel) for b in opt.layout.buckets]

    def step(_):
        works = [reduce_scatter_flat(o, g, group, async_op=True) for o, g in zip(outs, grads)]
        for b, bucket in enumerate(opt.layout.buckets):
            full = opt.param_buffer[bucket.offset:bucket.offset + bucket.numel]
            works.append(all_gather_flat(full, opt.param_shards[b], group=group, async_op=True))
        for w in works:
            w.wait()

    out = _timed(steps, step)
    opt.release()
    return out


def _fsdp2(case: str, steps: int) -> float:
    from torch.distributed.fsdp import fully_shard

    model = _model()
    reshard = case == "fsdp2-zero3"
    for layer in model.layers.values():
        fully_shard(layer, reshard_after_forward=reshard)
    fully_shard(model, reshard_after_forward=reshard)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    rank = dist.get_rank()

    def step(s):
        _loss(model, _batch(s, rank)).backward()
        opt.step()
        opt.zero_grad()

    return _timed(steps, step)


def worker(args) -> None:
    torch.set_num_threads(1)
    rank = args.rank
    dist.init_process_group("gloo", init_method=f"tcp://{args.addr}:{args.port}", rank=rank, world_size=2)
    times: dict[str, list[float]] = {c: [] for c in args.cases}
    for _ in range(args.rounds):
        for case in args.cases:
            if case == "comm":
                t = _comm(args.steps, args.bucket_mb)
            elif case.startswith("fsdp2"):
                t = _fsdp2(case, args.steps)
            else:
                t = _ours(case, args.steps, args.bucket_mb)
            times[case].append(t)
            if rank == 0:
                print(f"{case}: {t:.3f} s/step", flush=True)
    if rank == 0:
        Path(args.out).write_text(json.dumps(times))
    dist.destroy_process_group()


def report(times: dict[str, list[float]], rate: float) -> None:
    med = {c: statistics.median(v) for c, v in times.items()}
    compute, comm = med.get("compute"), med.get("comm")
    print(f"\ndp 2 across two hosts, link {rate:g} Mbit/s each way (tc tbf), median of "
          f"{len(next(iter(times.values())))} rounds")
    print("| case | s/step | / max(compute, comm) | / (compute + comm) |")
    print("|---|---|---|---|")
    for case, t in med.items():
        a = f"{t / max(compute, comm):.2f}" if compute and comm else "-"
        b = f"{t / (compute + comm):.2f}" if compute and comm else "-"
        print(f"| {case} | {t:.3f} | {a} | {b} |")
    for ours, theirs in (("zero2-on", "fsdp2-zero2"), ("zero3", "fsdp2-zero3")):
        if ours in med and theirs in med:
            print(f"{ours} / {theirs}: {med[ours] / med[theirs]:.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rate-mbit", type=float, default=200.0)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--bucket-mb", type=float, default=2.0)
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--addr", default="", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=29631, help=argparse.SUPPRESS)
    parser.add_argument("--out", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.cases = args.cases.split(",")
    if args.worker:
        worker(args)
        return
    sys.path.insert(0, str(ROOT / "tests"))
    from hosts import IFNAME, Hosts, why_no_hosts

    reason = why_no_hosts()
    if reason:
        sys.exit(f"bench_dp_overlap: {reason}")
    with Hosts(2) as hosts, tempfile.TemporaryDirectory() as tmp:
        for ns in hosts.names:  # each host's egress: both directions of the link limited
            subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", IFNAME, "root", "tbf",
                            "rate", f"{args.rate_mbit}mbit", "burst", "64kb", "latency", "200ms"], check=True)
        out = Path(tmp) / "times.json"
        procs = [hosts.popen(i, [sys.executable, __file__, "--worker", "--rank", str(i), "--addr", hosts.addr(0),
                                 "--port", str(args.port), "--out", str(out), "--steps", str(args.steps),
                                 "--rounds", str(args.rounds), "--bucket-mb", str(args.bucket_mb),
                                 "--cases", ",".join(args.cases)], Path(tmp) / f"rank{i}.log",
                             env={"PYTHONPATH": str(ROOT)})
                 for i in range(2)]
        codes = [p.wait() for p in procs]
        if any(codes):
            for i in range(2):
                print((Path(tmp) / f"rank{i}.log").read_text()[-3000:])
            sys.exit(f"bench_dp_overlap: workers exited {codes}")
        print((Path(tmp) / "rank0.log").read_text())
        report(json.loads(out.read_text()), args.rate_mbit)


if __name__ == "__main__":
    main()
