"""The MoE layer at expert parallelism 2 against DeepSpeed's and torchtitan's, on CPU, side
by side in one run (issue 31, point 6).

    python benchmarks/bench_moe_vs_deepspeed.py [--batch 4] [--seq 256] [--dim 256]
        [--experts 8] [--top-k 2] [--ffn 512] [--rounds 15] [--no-torchtitan]

Two gloo processes, one thread each, each with its own ``batch x seq`` tokens, run
forward + backward (input gradient included) of three layers built from the same
weights: parallel3d's ``MoEBlock`` under ``apply_expert_parallel`` (dropless, expert-major
rows, all-to-all of counts then rows), DeepSpeed's ``deepspeed.moe.layer.MoE`` with
``ep_size 2`` and parallel3d's ``SwiGLU`` as its expert (so each expert does the same
FLOPs per row), and torchtitan's ``MoE`` with its ``AllToAllTokenDispatcher`` on a
2-rank CPU mesh. Rounds alternate the sides (ABC, CBA, ...); a side's time in a round is
its slowest rank's; best and median over ``--rounds``, and the median (with the range) of
the per-round ratios ours / theirs, the two measured seconds apart.

Routing is made equal where the options allow: softmax over the experts, top-2, the two
weights renormalised to sum to 1 (``norm_topk_prob``; DeepSpeed's top-2 gate always does
it, torchtitan's ``route_norm``), no noise (DeepSpeed ``noisy_gate_policy=None``,
``top2_2nd_expert_sampling=False``), dropless (DeepSpeed ``drop_tokens=False``). What
stays different, printed as the outputs' largest difference against ours:

* DeepSpeed's dropless mode pads: every expert gets a buffer of C rows, C the largest
  count of any expert on any rank (an all-reduce MAX), so its all-to-alls carry E x C
  rows and its experts compute E x C rows where ours carry and compute the T k routed
  ones (its zero rows give zero outputs: the same numbers, more work).
* torchtitan runs its experts in bf16 (``GroupedExperts`` casts to bf16 for
  ``torch._grouped_mm``) whatever the input dtype; ours and DeepSpeed's stay fp32. Its
  SPMD backend is set to "full_dtensor" (the default "spmd_types" needs its trainer's
  mesh stack: without it ``dispatch`` fails on ``current_spmd_mesh()`` being None).

The all-to-all share: the time a rank's step spends inside the token exchanges (counts,
dispatch and combine, forward and backward) over its step time. Ours is read from the
dispatcher's own timeline spans (what the trainer reports); DeepSpeed's by timing the
``deepspeed.comm`` calls of its MoE layer (both all-to-alls, forward and backward, and
the dropless capacity's all-reduce). torchtitan's functional collectives complete
asynchronously, so no share is given for it.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import tempfile
import time
import warnings

import torch

from parallel3d.models.moe import MoEBlock, MoEConfig
from parallel3d.models.moe.experts import SwiGLU

EP = 2


class _CommClock:
    """Seconds spent in communication since the last ``reset``: a timeline for our
    dispatcher (``span``) and a wrapper for DeepSpeed's comm functions (``wrap``)."""

    def __init__(self):
        self.seconds = 0.0

    def reset(self):
        self.seconds = 0.0

    @contextlib.contextmanager
    def span(self, name, category, lane=None):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.seconds += time.perf_counter() - t0

    def wrap(self, fn):
        def timed(*args, **kwargs):
            with self.span(fn.__name__, "comm"):
                return fn(*args, **kwargs)
        return timed


class _TimedComm:
    """Stands in for ``deepspeed.comm`` inside ``deepspeed.moe.sharded_moe``: its
    collectives timed, everything else passed through."""

    def __init__(self, comm, clock: _CommClock):
        self._comm = comm
        self.all_to_all_single = clock.wrap(comm.all_to_all_single)
        self.all_reduce = clock.wrap(comm.all_reduce)

    def __getattr__(self, name):
        return getattr(self._comm, name)


def _config(args) -> MoEConfig:
    return MoEConfig(n_experts=args.experts, top_k=args.top_k, ffn_dim=args.ffn, norm_topk_prob=True)


def _deepspeed_layer(args, ours: MoEBlock, rank: int, clock: _CommClock):
    from deepspeed.moe import sharded_moe
    from deepspeed.moe.layer import MoE

    sharded_moe.dist = _TimedComm(sharded_moe.dist, clock)
    layer = MoE(hidden_size=args.dim, expert=SwiGLU(args.dim, args.ffn), num_experts=args.experts,
                ep_size=EP, k=args.top_k, min_capacity=0, noisy_gate_policy=None, drop_tokens=False,
                use_rts=False, top2_2nd_expert_sampling=False)
    layer.set_deepspeed_parallelism()
    per_rank = args.experts // EP
    with torch.no_grad():
        layer.deepspeed_moe.gate.wg.weight.copy_(ours.gate.weight)
        for i, expert in enumerate(layer.deepspeed_moe.experts.deepspeed_experts):
            expert.load_state_dict(ours.experts[str(rank * per_rank + i)].state_dict())
    return layer


def _torchtitan_layer(args, ours: MoEBlock, rank: int):
    from torch.distributed.device_mesh import init_device_mesh
    from torchtitan.distributed.utils import set_spmd_backend
    from torchtitan.models.common.linear import Linear
    from torchtitan.models.common.moe import GroupedExperts, MoE, RoutedExperts, TokenChoiceTopKRouter
    from torchtitan.models.common.token_dispatcher import AllToAllTokenDispatcher

    set_spmd_backend("full_dtensor")
    per_rank = args.experts // EP
    cfg = MoE.Config(
        num_experts=args.experts, load_balance_coeff=None,
        routed_experts=RoutedExperts.Config(
            inner_experts=GroupedExperts.Config(dim=args.dim, hidden_dim=args.ffn, num_experts=per_rank),
            token_dispatcher=AllToAllTokenDispatcher.Config(num_experts=args.experts, top_k=args.top_k)),
        router=TokenChoiceTopKRouter.Config(num_experts=args.experts, top_k=args.top_k, score_func="softmax",
                                            route_norm=True,
                                            gate=Linear.Config(in_features=args.dim, out_features=args.experts)))
    layer = cfg.build()
    held = [ours.experts[str(rank * per_rank + i)] for i in range(per_rank)]
    with torch.no_grad():
        layer.router.gate.weight.copy_(ours.gate.weight)
        inner = layer.routed_experts.inner_experts
        inner.w1_EFD.copy_(torch.stack([e.gate_proj.weight for e in held]))
        inner.w3_EFD.copy_(torch.stack([e.up_proj.weight for e in held]))
        inner.w2_EDF.copy_(torch.stack([e.down_proj.weight for e in held]))
    layer.routed_experts.token_dispatcher.wire_meshes(ep_mesh=init_device_mesh("cpu", (EP,)))
    return layer


def _expert_rows(counts: torch.Tensor) -> tuple[int, int]:
    """Rows the experts of the busiest rank compute: ours, the routed ones arriving there;
    DeepSpeed's dropless buffer, E x C with C the largest count of any expert on any rank."""
    import torch.distributed as dist

    routed = counts.clone()
    dist.all_reduce(routed)  # (E,) assignments per expert over both ranks
    ours = torch.tensor(max(int(part.sum()) for part in routed.chunk(EP)))
    capacity = counts.max().clone()
    dist.all_reduce(capacity, op=dist.ReduceOp.MAX)
    return int(ours), counts.numel() * int(capacity)


def _run(layer, x, g) -> torch.Tensor:
    """One forward + backward; the layer's output (DeepSpeed returns a tuple)."""
    layer.zero_grad(set_to_none=True)
    x.grad = None
    out = layer(x)
    out = out[0] if isinstance(out, tuple) else out
    out.backward(g)
    return out.detach()


def _worker(rank: int, store: str, args, queue) -> None:
    import deepspeed
    import torch.distributed as dist

    from parallel3d.models.moe.parallelize import apply_expert_parallel

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=EP)
    # DeepSpeed's JIT-built shared-memory op serves only its inference all-reduce, never the
    # MoE layer (its all-to-alls and the capacity all-reduce are torch.distributed's); not
    # loading it keeps a stale build lock in ~/.cache/torch_extensions from hanging the run.
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False, dist_init_required=False,
                               verbose=False)
    torch.manual_seed(0)  # the same full layer on both ranks; each keeps its half of the experts
    ours = MoEBlock(_config(args), args.dim)
    clocks = {"parallel3d": _CommClock(), "DeepSpeed": _CommClock()}
    sides = {"DeepSpeed": _deepspeed_layer(args, ours, rank, clocks["DeepSpeed"])}
    if args.torchtitan:
        sides["torchtitan"] = _torchtitan_layer(args, ours, rank)
    apply_expert_parallel(ours, dist.group.WORLD)
    ours.experts.timeline = clocks["parallel3d"]
    sides = {"parallel3d": ours, **sides}

    gen = torch.Generator().manual_seed(rank + 1)
    x = torch.randn(args.batch, args.seq, args.dim, generator=gen).requires_grad_()
    g = torch.randn(x.shape, generator=gen)
    reference, reference_grad = _run(ours, x, g), x.grad.clone()
    diffs = {}
    for name, layer in sides.items():
        out = _run(layer, x, g)
        diffs[name] = [(out - reference).abs().max().item(), (x.grad - reference_grad).abs().max().item()]
    diffs = torch.tensor(list(diffs.values()))
    dist.all_reduce(diffs, op=dist.ReduceOp.MAX)
    expert_rows = _expert_rows(ours.last_stats.tokens_per_expert)

    names = list(sides)
    times = {n: [] for n in names}
    shares = {n: [] for n in names}
    for round_ in range(args.warmup + args.rounds):
        order = names if round_ % 2 == 0 else names[::-1]
        for name in order:
            clock = clocks.get(name)
            dist.barrier()
            if clock:
                clock.reset()
            t0 = time.perf_counter()
            _run(sides[name], x, g)
            step = time.perf_counter() - t0
            row = torch.tensor([[step, clock.seconds if clock else float("nan")]])
            gathered = [torch.empty_like(row) for _ in range(EP)]
            dist.all_gather(gathered, row)
            slowest = max(gathered, key=lambda r: r[0, 0].item())[0]
            if round_ >= args.warmup:
                times[name].append(slowest[0].item())
                shares[name].append(slowest[1].item() / slowest[0].item())
    if rank == 0:
        queue.put((names, diffs.tolist(), times, shares, expert_rows))
    dist.barrier()
    dist.destroy_process_group()


def _report(args, names, diffs, times, shares, rows) -> None:
    tokens = args.batch * args.seq
    print(f"ep {EP} over gloo, one thread per rank, {torch.__version__}: {tokens} tokens a rank "
          f"({args.batch} x {args.seq}), dim {args.dim}, {args.experts} SwiGLU experts of {args.ffn}, "
          f"top-{args.top_k}; forward + backward, {args.rounds} alternating rounds, slowest rank")
    ours_best, ours_median = min(times["parallel3d"]), statistics.median(times["parallel3d"])
    print(f"  {'layer':12s} {'best ms':>8s} {'median ms':>10s} {'ours/this best':>15s} {'ours/this median':>17s} "
          f"{'per round: median [min, max]':>29s} {'all-to-all share':>17s} {'max |out diff|':>15s} "
          f"{'max |dx diff|':>14s}")
    for name, (d_out, d_dx) in zip(names, diffs):
        best, median = min(times[name]), statistics.median(times[name])
        # ours / this within each round (the two ran seconds apart): robust to the load drifting
        per_round = [o / t for o, t in zip(times["parallel3d"], times[name])]
        rounds_text = f"{statistics.median(per_round):.2f} [{min(per_round):.2f}, {max(per_round):.2f}]"
        share = statistics.median(shares[name])
        share_text = "n/a" if share != share else f"{share:.0%}"
        print(f"  {name:12s} {best * 1e3:8.1f} {median * 1e3:10.1f} {ours_best / best:15.2f} "
              f"{ours_median / median:17.2f} {rounds_text:>29s} {share_text:>17s} {d_out:15.1e} {d_dx:14.1e}")
    print(f"  rows through one rank's experts: parallel3d {rows[0]} (the routed ones, busier rank), "
          f"DeepSpeed {rows[1]} (E x C, its dropless padding), of {args.batch * args.seq * args.top_k} "
          f"assignments a rank")


def _wait(queue, procs):
    """Rank 0's result; exits with the workers' failure instead of waiting forever."""
    import queue as queues

    while True:
        try:
            return queue.get(timeout=2)
        except queues.Empty:
            failed = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
            if failed:
                for p in procs:
                    p.kill()
                raise SystemExit(f"a worker failed (exit codes {failed}); its traceback is above")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--ffn", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--no-torchtitan", dest="torchtitan", action="store_false")
    args = parser.parse_args()
    if args.experts % EP:
        raise SystemExit(f"--experts {args.experts} must be divisible by the expert-parallel degree {EP}")

    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        procs = [ctx.Process(target=_worker, args=(r, store, args, queue)) for r in range(EP)]
        for p in procs:
            p.start()
        result = _wait(queue, procs)
        for p in procs:
            p.join()
    _report(args, *result)


if __name__ == "__main__":
    main()
