"""The MoE block's forward + backward on CPU against transformers' Qwen3-MoE block on the
same weights and tokens, in the same run; and, with ``--ep 2``, the block at expert
parallelism 2 over gloo with the all-to-all share of its step.

    python benchmarks/bench_moe.py [--tokens 4096] [--dim 256] [--experts 16] [--top-k 4]
                                   [--ffn 128] [--rounds 5] [--ep 2]

Single process: ``MoEBlock`` (tokens sorted expert-major, one slice per expert) against
``Qwen3MoeSparseMoeBlock`` (a one-hot mask per expert, ``torch.where`` for its tokens,
``index_add_`` back), best of ``--rounds`` alternating rounds; the outputs' largest
difference is printed beside the times (fp32, reassociation only).

``--ep 2``: two gloo processes, each with ``--tokens`` tokens of its own and half of the
experts; the step's time (the slower rank, best round) and the share spent in the
row all-to-alls (dispatch and combine, forward and backward; the counts exchange
included), against the same block at ep 1 on one process's tokens.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import torch

from parallel3d.models.moe import MoEBlock, MoEConfig


def _config(args) -> MoEConfig:
    return MoEConfig(n_experts=args.experts, top_k=args.top_k, ffn_dim=args.ffn, norm_topk_prob=True)


def _step(block, x, g):
    out = block(x)
    out.backward(g)
    return out


def _hf_block(cfg: MoEConfig, dim: int, ours: MoEBlock):
    import transformers
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    hf_cfg = transformers.Qwen3MoeConfig(hidden_size=dim, moe_intermediate_size=cfg.ffn_dim,
                                         num_experts=cfg.n_experts, num_experts_per_tok=cfg.top_k,
                                         norm_topk_prob=True)
    hf = Qwen3MoeSparseMoeBlock(hf_cfg)
    with torch.no_grad():
        hf.gate.weight.copy_(ours.gate.weight)
        for e, expert in enumerate(ours.experts.values()):
            hf.experts.gate_up_proj[e].copy_(torch.cat([expert.gate_proj.weight, expert.up_proj.weight]))
            hf.experts.down_proj[e].copy_(expert.down_proj.weight)
    return hf


def single_process(args) -> None:
    torch.manual_seed(0)
    cfg = _config(args)
    ours = MoEBlock(cfg, args.dim)
    hf = _hf_block(cfg, args.dim, ours)
    x = torch.randn(1, args.tokens, args.dim)
    g = torch.randn_like(x)
    diff = (_step(ours, x, g) - _step(hf, x, g)).abs().max().item()
    sides = {"parallel3d MoEBlock": ours, "transformers Qwen3MoeSparseMoeBlock": hf}
    times = dict.fromkeys(sides, float("inf"))
    for _ in range(args.rounds):  # alternating, so a load change hits both sides
        for name, block in sides.items():
            t0 = time.perf_counter()
            _step(block, x, g)
            times[name] = min(times[name], time.perf_counter() - t0)
    print(f"one process, {torch.get_num_threads()} threads: {args.tokens} tokens x dim {args.dim}, "
          f"{cfg.n_experts} experts of {cfg.ffn_dim}, top-{cfg.top_k}; outputs differ by {diff:.1e}")
    for name, t in times.items():
        print(f"  {name:38s} {t * 1e3:8.1f} ms forward + backward")
    ours_s, hf_s = times.values()
    print(f"  ratio parallel3d / transformers: {ours_s / hf_s:.2f}")


def _ep_worker(rank: int, ep: int, store: str, args, out) -> None:
    import torch.distributed as dist

    from parallel3d.expert_parallel import dispatch as dispatch_module
    from parallel3d.models.moe.parallelize import apply_expert_parallel

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=ep)
    comm = [0.0]
    raw = dispatch_module._all_to_all_rows
    exchange = dispatch_module.exchange_counts

    def timed(fn):
        def run(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                comm[0] += time.perf_counter() - t0
        return run

    dispatch_module._all_to_all_rows = timed(raw)
    dispatch_module.exchange_counts = timed(exchange)
    torch.manual_seed(0)
    block = MoEBlock(_config(args), args.dim)
    apply_expert_parallel(block, dist.group.WORLD)
    gen = torch.Generator().manual_seed(rank + 1)
    x = torch.randn(1, args.tokens, args.dim, generator=gen)
    g = torch.randn(x.shape, generator=gen)
    _step(block, x, g)
    best, share = float("inf"), 0.0
    for _ in range(args.rounds):
        dist.barrier()
        comm[0] = 0.0
        t0 = time.perf_counter()
        _step(block, x, g)
        step = torch.tensor([time.perf_counter() - t0, comm[0]])
        dist.all_reduce(step, op=dist.ReduceOp.MAX)
        if step[0] < best:
            best, share = step[0].item(), step[1].item() / step[0].item()
    if rank == 0:
        out.put((best, share))
    dist.destroy_process_group()


def expert_parallel(args) -> None:
    import torch.multiprocessing as mp

    torch.manual_seed(0)
    block = MoEBlock(_config(args), args.dim)
    x = torch.randn(1, args.tokens, args.dim)
    g = torch.randn_like(x)
    torch.set_num_threads(1)
    _step(block, x, g)
    alone = min(_timed_step(block, x, g) for _ in range(args.rounds))
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        procs = [ctx.Process(target=_ep_worker, args=(r, args.ep, store, args, out)) for r in range(args.ep)]
        for p in procs:
            p.start()
        step, share = out.get()
        for p in procs:
            p.join()
    print(f"ep {args.ep} over gloo, one thread per rank, {args.tokens} tokens per rank:")
    print(f"  ep 1, one process, its own tokens   {alone * 1e3:8.1f} ms forward + backward")
    print(f"  ep {args.ep}, slowest rank                  {step * 1e3:8.1f} ms; all-to-alls {share:.0%} of it")


def _timed_step(block, x, g) -> float:
    t0 = time.perf_counter()
    _step(block, x, g)
    return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--top-k", type=int, default=4)
    parser.add_argument("--ffn", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--ep", type=int, default=1)
    args = parser.parse_args()
    if args.ep > 1:
        expert_parallel(args)
    else:
        single_process(args)


if __name__ == "__main__":
    main()
