"""Data-parallel communication hidden behind compute, measured (issue 38, acceptance 2).

Two hosts (network namespaces, ``tests/hosts.py``) joined by a link that ``tc``'s
token-bucket filter limits to ``--rate-mbit`` each way, one gloo rank on each (dp 2
across the hosts, one CPU thread each), the same Llama, batches and AdamW for every case,
cases alternated round by round so machine noise hits them alike:

- ``compute``: forward, backward and the update with no communication (a one-rank
  optimizer on each host); its forward, backward and update are also timed apart;
- ``comm``: ZeRO 2's traffic of a step alone: every bucket's fp32 reduce-scatter and the
  parameters' all-gather, issued together and waited for (and each kind alone: ``rs``,
  ``ag``);
- ``zero2-off``: ZeRO 2's traffic with nothing overlapped: every bucket reduce-scattered
  after the backward, the all-gather waited for in the step. Stage 2 itself reduces as
  the backward fills its buckets whatever it is told (it holds no full gradient to reduce
  later), so this case runs stage 1, whose reduce-scatter and all-gather are the same;
- ``zero2-on``: ZeRO 2, buckets reduced as the backward fills them, the all-gather waited
  for by each module in the next forward (``parallel.overlap_param_gather``);
- ``zero3``: ZeRO 3, each module's buckets gathered before its forward and backward,
  the next prefetched (1.5x ZeRO 2's traffic: parameters cross the wire twice);
- ``fsdp2-zero2`` / ``fsdp2-zero3``: torch's ``fully_shard`` on each layer and the root,
  ``reshard_after_forward`` False / True, torch's AdamW.

A case's step time is the wall time of ``--steps`` steps of the steady state over their
number (each timed step waits for the previous step's all-gathers in its forward and
leaves its own in flight, as in a long run; the warm-up and one more step come first, and
the last step's gathers are waited for after the clock stops); beside it the
process's CPU seconds per step (all its threads: compute, gloo's, the kernel's TCP work)
and the bytes its host sent per step (the link's counter). Each ratio is taken within a
round (the compute and comm of the same round, minutes apart at most), then the median
and the range over rounds are printed, with the load average at each round's start.

The schedule bounds what overlap can give: the all-gather after the update can only run
under the next forward, the reduce-scatters under the backward, the update under neither,
so ``bound = max(ag, fwd) + max(rs, bwd) + update`` (from ``comm``'s and ``compute``'s
parts of the same round) is the best a step with the overlap can take; printed beside
max(compute, comm).

    sudo python benchmarks/bench_dp_overlap.py [--rate-mbit 200] [--steps 6] [--rounds 5] [--seq 128] [--pin]

``--seq`` sets the tokens of each of a rank's 4 sequences: the compute grows with it, the
bytes on the link do not (the gradients are the model's), so it sets comm / compute at a
given rate. On this CPU the link's bytes cost CPU too (the kernel's TCP work through veth,
bridge and tbf, gloo's threads): a rank's CPU seconds per step, ``cpu``, bound the step
from below on a rank's one core; ``zero2-on``'s CPU per step over max(compute, comm) is
printed beside the schedule's bound.

``--mtu 9000`` gives the link jumbo frames, as cluster fabrics use (RoCE 4096, data-centre
Ethernet 9000): the simulated network's per-packet kernel work runs on the ranks' own two
cores here (charged to them), where two real hosts have NICs; fewer, larger packets halve
that CPU.

``--dtype bf16`` stores the parameters in bf16 (fp32 master weights in the optimizer,
gradients reduced in fp32, as ``train.dtype = "bf16"`` trains; FSDP2 with the same
``MixedPrecisionPolicy``): the all-gathers move half the reduce-scatters' bytes, a third
of the traffic, as the forward is a third of the compute.

Needs root (namespaces, tc). ``--pin`` runs host i's process on CPU i only (``taskset``),
closer to two machines than two processes the scheduler moves between the same cores.
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
TX = "/sys/class/net/p3d0/statistics/tx_bytes"  # this host's link (tests/hosts.IFNAME)


DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _model(dtype: str = "fp32"):
    """The Llama, its parameters stored in ``dtype`` (bf16: the optimizer keeps fp32
    master weights and reduces fp32 gradients, as the trainer does with ``train.dtype =
    "bf16"``)."""
    from parallel3d.models.llama import Llama, LlamaConfig

    torch.manual_seed(0)
    return Llama(LlamaConfig(**MODEL)).to(DTYPES[dtype])


def _batch(step: int, rank: int, seq: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + 2 * step + rank)
    return torch.randint(0, MODEL["vocab_size"], (MICRO, seq + 1), generator=g)


def _loss(model, tokens):
    from parallel3d.models.llama.parallelize import cross_entropy_loss

    return cross_entropy_loss(model(tokens[:, :-1]), tokens[:, 1:])


def _tx() -> int:
    try:
        return int(Path(TX).read_text())
    except OSError:
        return 0


def _timed(steps: int, one_step, finish=lambda: None) -> dict:
    """Wall and CPU seconds and bytes sent per step, over ``steps`` steps of the steady
    state: after a warm-up (allocations, the first gathers: waited for, then a barrier)
    and one more step, so that every timed step starts with the previous step's
    all-gathers in flight and ends with its own issued, as in a long run; the last one's
    are waited for after the clock stops (counting them would add one whole all-gather,
    not overlapped with anything, to every ``steps`` steps)."""
    one_step(0)  # warm-up
    finish()
    dist.barrier()
    one_step(1)  # leaves its all-gathers in flight, as every step does for the next
    t0, c0, b0 = time.perf_counter(), time.process_time(), _tx()
    for step in range(2, steps + 2):
        one_step(step)
    t1, c1, b1 = time.perf_counter(), time.process_time(), _tx()
    finish()
    dist.barrier()
    return {"step": (t1 - t0) / steps, "cpu": (c1 - c0) / steps, "tx": (b1 - b0) / steps}


def _ours(case: str, steps: int, bucket_mb: float, seq: int, dtype: str) -> dict:
    from parallel3d.config import TrainConfig
    from parallel3d.topology import Topology
    from parallel3d.zero import ZeroOptimizer

    train = TrainConfig(lr=1e-3, grad_clip=0.0)
    model = _model(dtype)
    rank = dist.get_rank()
    topo = Topology.single() if case == "compute" else Topology(1, 1, 2)
    stage = {"compute": 0, "zero2-off": 1, "zero2-on": 2, "zero3": 3}[case]
    opt = ZeroOptimizer(model.parameters(), train, topo, stage=stage, bucket_mb=bucket_mb, model=model,
                        overlap_param_gather=case != "zero2-off")
    parts = {"fwd": 0.0, "bwd": 0.0, "update": 0.0}

    def step(s):
        t0 = time.perf_counter()
        opt.begin_step(None if case == "zero2-off" else 1)  # None: reduce after the backward
        loss = _loss(model, _batch(s, rank, seq))
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        opt.step(train.lr)
        if s >= 2:  # the timed steps (_timed)
            parts["fwd"] += t1 - t0
            parts["bwd"] += t2 - t1
            parts["update"] += time.perf_counter() - t2

    out = _timed(steps, step, opt.finish_param_gather if stage < 3 else lambda: None)
    opt.release()
    if case == "compute":  # its parts: what the overlap can hide communication under
        out.update({k: v / steps for k, v in parts.items()})
    return out


def _comm(steps: int, bucket_mb: float, dtype: str) -> dict:
    from parallel3d.config import TrainConfig
    from parallel3d.distributed import all_gather_flat, reduce_scatter_flat
    from parallel3d.topology import Topology
    from parallel3d.zero import ZeroOptimizer

    model = _model(dtype)  # the all-gather moves the parameters' dtype, the reduce-scatter fp32
    opt = ZeroOptimizer(model.parameters(), TrainConfig(), Topology(1, 1, 2), stage=2, bucket_mb=bucket_mb)
    group = opt.dp_group
    grads = [torch.randn(b.numel) for b in opt.layout.buckets]
    outs = [torch.empty(b.shard_numel) for b in opt.layout.buckets]

    def issue(rs: bool, ag: bool):
        works = [reduce_scatter_flat(o, g, group, async_op=True) for o, g in zip(outs, grads)] if rs else []
        for b, bucket in enumerate(opt.layout.buckets if ag else ()):
            full = opt.param_buffer[bucket.offset:bucket.offset + bucket.numel]
            works.append(all_gather_flat(full, opt.param_shards[b], group=group, async_op=True))
        for w in works:
            w.wait()

    out = _timed(steps, lambda _: issue(True, True))
    out["rs"] = _timed(steps, lambda _: issue(True, False))["step"]
    out["ag"] = _timed(steps, lambda _: issue(False, True))["step"]
    opt.release()
    return out


def _fsdp2(case: str, steps: int, seq: int, dtype: str) -> dict:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    model = _model()  # fp32 shards: FSDP2's master weights
    reshard = case == "fsdp2-zero3"
    # bf16: FSDP2's mixed precision, the same bytes as ours: bf16 all-gathers, fp32 reductions
    mp = MixedPrecisionPolicy(param_dtype=DTYPES[dtype], reduce_dtype=torch.float32)
    for layer in model.layers.values():
        fully_shard(layer, reshard_after_forward=reshard, mp_policy=mp)
    fully_shard(model, reshard_after_forward=reshard, mp_policy=mp)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    rank = dist.get_rank()

    def step(s):
        _loss(model, _batch(s, rank, seq)).backward()
        opt.step()
        opt.zero_grad()

    return _timed(steps, step)


def worker(args) -> None:
    torch.set_num_threads(1)
    rank = args.rank
    dist.init_process_group("gloo", init_method=f"tcp://{args.addr}:{args.port}", rank=rank, world_size=2)
    rounds = []
    for r in range(args.rounds):
        row = {"load": os.getloadavg()[0]}
        for case in args.cases:
            kind, _, mb = case.partition("@")  # "zero2-on@0.5": that case with 0.5 MiB buckets
            bucket_mb = float(mb) if mb else args.bucket_mb
            if kind == "comm":
                row[case] = _comm(args.steps, bucket_mb, args.dtype)
            elif kind.startswith("fsdp2"):
                row[case] = _fsdp2(kind, args.steps, args.seq, args.dtype)
            else:
                row[case] = _ours(kind, args.steps, bucket_mb, args.seq, args.dtype)
            if rank == 0:
                print(f"round {r} {case}: {row[case]['step']:.3f} s/step, cpu {row[case]['cpu']:.3f} s/step",
                      flush=True)
        rounds.append(row)
    Path(f"{args.out}.{rank}").write_text(json.dumps(rounds))
    dist.destroy_process_group()


def _spread(values: list[float], fmt: str = "{:.3f}") -> str:
    med = statistics.median(values)
    if len(values) == 1:
        return fmt.format(med)
    return f"{fmt.format(med)} ({fmt.format(min(values))}-{fmt.format(max(values))})"


def report(ranks: list[list[dict]], rate: float, seq: int = SEQ, dtype: str = "fp32") -> None:
    """Per round, a case's time is the slower rank's; ratios are taken within the round."""
    rounds = []
    for rows in zip(*ranks):
        merged = {"load": rows[0]["load"]}
        for case in rows[0]:
            if case != "load":
                merged[case] = {k: max(r[case][k] for r in rows) for k in rows[0][case]}
        rounds.append(merged)
    cases = [c for c in rounds[0] if c != "load"]
    col = lambda case, key: [r[case][key] for r in rounds]  # noqa: E731
    has = {"compute", "comm"} <= set(cases)
    print(f"\ndp 2 across two hosts, link {rate:g} Mbit/s each way (tc tbf), {MICRO} x {seq} tokens a rank, {dtype} parameters; "
          f"{len(rounds)} rounds: median "
          f"(min-max); load average at the rounds' starts {_spread([r['load'] for r in rounds], '{:.1f}')}")
    print("| case | s/step | CPU s/step | MB sent/step | / max(compute, comm) | / (compute + comm) |")
    print("|---|---|---|---|---|---|")
    for case in cases:
        a = b = "-"
        if has:
            a = _spread([r[case]["step"] / max(r["compute"]["step"], r["comm"]["step"]) for r in rounds], "{:.2f}")
            b = _spread([r[case]["step"] / (r["compute"]["step"] + r["comm"]["step"]) for r in rounds], "{:.2f}")
        print(f"| {case} | {_spread(col(case, 'step'))} | {_spread(col(case, 'cpu'))} | "
              f"{statistics.median(col(case, 'tx')) / 1e6:.2f} | {a} | {b} |")
    if has:
        parts = ", ".join(f"{k} {_spread(col('compute', k))}" for k in ("fwd", "bwd", "update"))
        print(f"\ncompute's parts: {parts} s; comm's: rs {_spread(col('comm', 'rs'))}, ag {_spread(col('comm', 'ag'))} s")
        print(f"comm / compute: {_spread([r['comm']['step'] / r['compute']['step'] for r in rounds], '{:.2f}')}")
        bounds = [max(r["comm"]["ag"], r["compute"]["fwd"]) + max(r["comm"]["rs"], r["compute"]["bwd"])
                  + r["compute"]["update"] for r in rounds]
        print(f"bound = max(ag, fwd) + max(rs, bwd) + update: {_spread(bounds)} s/step = "
              f"{_spread([b / max(r['compute']['step'], r['comm']['step']) for b, r in zip(bounds, rounds)], '{:.2f}')}"
              " x max(compute, comm)")
        for case in cases:
            if case.startswith("zero2-on"):
                print(f"{case} / bound: {_spread([r[case]['step'] / b for b, r in zip(bounds, rounds)], '{:.2f}')}")
                cpu = [r[case]["cpu"] / max(r["compute"]["step"], r["comm"]["step"]) for r in rounds]
                print(f"{case}'s CPU seconds per step / max(compute, comm): {_spread(cpu, '{:.2f}')} "
                      "(a rank has one core: the step is at least this)")
    for ours, theirs in (("zero2-on", "fsdp2-zero2"), ("zero3", "fsdp2-zero3")):
        if ours in cases and theirs in cases:
            print(f"{ours} / {theirs}: {_spread([r[ours]['step'] / r[theirs]['step'] for r in rounds], '{:.2f}')}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rate-mbit", type=float, default=200.0)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--bucket-mb", type=float, default=2.0)
    parser.add_argument("--seq", type=int, default=SEQ, help="tokens per sequence (compute per byte sent)")
    parser.add_argument("--dtype", default="fp32", choices=sorted(DTYPES),
                        help="the parameters' dtype (bf16: fp32 masters and reductions, bf16 all-gathers; "
                             "FSDP2 with the same MixedPrecisionPolicy)")
    parser.add_argument("--cases", default=",".join(CASES),
                        help="comma-separated; CASE@MB runs CASE with MB MiB buckets instead of --bucket-mb")
    parser.add_argument("--mtu", type=int, default=0,
                        help="the link's MTU (both ends of each host's veth; 0: the veth default, 1500)")
    parser.add_argument("--pin", action="store_true", help="host i's process on CPU i only (taskset)")
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
    print(f"start: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, "
          f"uptime: {subprocess.run(['uptime'], capture_output=True, text=True).stdout.strip()}")
    with Hosts(2) as hosts, tempfile.TemporaryDirectory() as tmp:
        for ns in hosts.names:  # each host's egress: both directions of the link limited
            subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", IFNAME, "root", "tbf",
                            "rate", f"{args.rate_mbit}mbit", "burst", "64kb", "latency", "200ms"], check=True)
        for i, ns in enumerate(hosts.names if args.mtu else ()):  # e.g. 9000: a cluster's jumbo frames
            subprocess.run(["ip", "netns", "exec", ns, "ip", "link", "set", "dev", IFNAME, "mtu", str(args.mtu)],
                           check=True)
            subprocess.run(["ip", "netns", "exec", hosts.switch, "ip", "link", "set", "dev", f"port{i}",
                            "mtu", str(args.mtu)], check=True)
        out = Path(tmp) / "times.json"
        ncpu = os.cpu_count() or 1
        procs = [hosts.popen(i, [*(["taskset", "-c", str(i % ncpu)] if args.pin else []),
                                 sys.executable, __file__, "--worker", "--rank", str(i), "--addr", hosts.addr(0),
                                 "--port", str(args.port), "--out", str(out), "--steps", str(args.steps),
                                 "--rounds", str(args.rounds), "--bucket-mb", str(args.bucket_mb), "--seq", str(args.seq),
                                 "--dtype", args.dtype, "--cases", ",".join(args.cases)], Path(tmp) / f"rank{i}.log",
                             env={"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"})
                 for i in range(2)]
        codes = [p.wait() for p in procs]
        if any(codes):
            for i in range(2):
                print((Path(tmp) / f"rank{i}.log").read_text()[-3000:])
            sys.exit(f"bench_dp_overlap: workers exited {codes}")
        print((Path(tmp) / "rank0.log").read_text())
        ranks = [json.loads(Path(f"{out}.{i}").read_text()) for i in range(2)]
    print(f"end: uptime: {subprocess.run(['uptime'], capture_output=True, text=True).stdout.strip()}"
          f"{', pinned: host i on CPU i' if args.pin else ''}{f', MTU {args.mtu}' if args.mtu else ''}")
    report(ranks, args.rate_mbit, args.seq, args.dtype)
    print("\nraw: " + json.dumps(ranks))


if __name__ == "__main__":
    main()
