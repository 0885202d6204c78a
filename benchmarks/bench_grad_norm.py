"""Host time of the gradient norm's squared sum (parallel3d/grad_norm.py) against the
former 16k-element pieces, in the same run.

    python benchmarks/bench_grad_norm.py [--elements 100000000] [--rounds 3]

Two measurements, best of ``--rounds`` (alternating on CPU):

* CPU, ``--elements`` fp32 gradient elements in 16 flat buckets (a ZeRO shard's layout),
  the pieces built once as ``ZeroOptimizer`` does: the whole call, compute included;
  relative error of each against float64.
* meta device, 2^30 elements (1B parameters on a rank): tensors without data, so the
  time is what the host spends making and handing over views and scalars, the part a
  GPU step waits for before the kernels run.
"""

from __future__ import annotations

import argparse
import time

import torch

from parallel3d.grad_norm import norm_pieces, squared_norm

OLD_PIECE = 1 << 14


def old_squared_norm(pieces: list[torch.Tensor]) -> torch.Tensor:
    """The former implementation: a fused fp32 norm per 16k-element piece, the norms
    stacked and their squares summed in fp64."""
    norms = torch.stack(torch._foreach_norm(pieces, 2, dtype=torch.float32))
    return norms.double().square().sum().float()


def best_s(fn, rounds: int) -> float:
    fn()
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--elements", type=int, default=100_000_000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    torch.manual_seed(0)
    flat = torch.randn(args.elements) * 1e-3
    buckets = list(flat.split(-(-args.elements // 16)))
    exact = flat.double().square().sum().item()
    old_pieces = [p for b in buckets for p in b.split(OLD_PIECE)]
    new_pieces = norm_pieces(buckets)
    print(f"CPU, {args.elements / 1e6:.0f}M fp32 elements, {torch.get_num_threads()} threads:")
    rows = {"16k pieces (before)": (old_pieces, lambda: old_squared_norm(old_pieces)),
            "rows of 1024 (now)": (new_pieces, lambda: squared_norm(new_pieces, flat.device, pieces=True))}
    times = {name: float("inf") for name in rows}
    for fn in (fn for _, fn in rows.values()):
        fn()  # warm-up
    for _ in range(args.rounds):  # alternating, so a load change hits both sides
        for name, (_, fn) in rows.items():
            t0 = time.perf_counter()
            fn()
            times[name] = min(times[name], time.perf_counter() - t0)
    for name, (pieces, fn) in rows.items():
        err = abs(float(fn()) - exact) / exact
        print(f"  {name:20s} {len(pieces):7d} pieces  {times[name] * 1e3:8.1f} ms  rel. error {err:.1e}")
    before, now = times.values()
    print(f"  ratio before / now: {before / now:.2f}")

    n = 1 << 30
    meta = list(torch.empty(n, device="meta").split(n // 16))
    old_meta = [p for b in meta for p in b.split(OLD_PIECE)]
    new_meta = norm_pieces(meta)
    old_s = best_s(lambda: old_squared_norm(old_meta), args.rounds)
    new_s = best_s(lambda: squared_norm(new_meta, torch.device("meta"), pieces=True), args.rounds)
    print(f"host only (meta device), 2^30 elements: before {len(old_meta)} pieces {old_s * 1e3:.1f} ms, "
          f"now {len(new_meta)} pieces {new_s * 1e3:.2f} ms: {old_s / new_s:.0f}x less")


if __name__ == "__main__":
    main()
