"""Context parallelism on CPU against DeepSpeed's Ulysses sequence parallelism: the
attention (forward + backward) and the whole training step at cp 2 / sp 2, and cp 2's
step against cp 1's (issue 32, acceptance 5).

    python benchmarks/bench_cp_speed.py [--seq-len 4096] [--rounds 10] [--json FILE]
    python benchmarks/bench_cp_speed.py --smoke          # tiny, seconds: the code path
    python benchmarks/bench_cp_speed.py --tables-from A.json B.json   # saved runs together

Two gloo ranks (one thread each) of one pool; every round runs each side once, the
order rotating from round to round (the machine is shared: a side never always follows
the same one; 10 rounds put each of the 5 sides in each place twice); a side's wall
time is the slower rank's (the job waits for it), its CPU time both ranks' process time
together (the work, which other jobs preempting it do not add to); its figures the
medians over rounds, its ratios the medians of the per-round ratios. Before the rounds
every side's attention output and q, k, v gradients are checked against causal SDPA on
the whole sequence (S 256, fp32, 1e-5): every side computes the same thing on the same
shapes. What each side runs:

- attention: q (1, H, S/2, D) and k, v (1, Hkv, S/2, D) per rank, fp32, forward and
  backward of the whole sequence's causal attention from the local queries.
  ``cp 2 allgather`` / ``cp 2 ring``: ``context_parallel_attention`` on this rank's
  head-tail chunks. ``ulysses``: ``deepspeed.sequence.layer.DistributedAttention(local,
  group, scatter_idx=2, gather_idx=0)`` on this rank's contiguous half, sequence-first
  (S/2, 1, H, D); ``local`` is causal SDPA on the H/2 heads of the whole sequence.
  ``cp 1``: rank 0 alone, SDPA over the whole sequence (rank 1 waits), once with one
  thread and once with two.
- step: one hand-written training step of the same Llama (parallel3d's model: embedding,
  2 decoder layers, lm head; the same initial weights on every side), the same tokens:
  forward of this rank's tokens, cross-entropy summed over them / S, backward, one
  all-reduce (sum) of all gradients flattened, AdamW. The sides differ only in
  ``Llama.attention_fn`` and in which tokens a rank holds: cp 2 (``apply_context_parallel``,
  head-tail tokens with their global positions), Ulysses (the DistributedAttention
  above as the attention, contiguous tokens with their global positions), cp 1 (rank 0,
  the whole sequence, plain SDPA; no all-reduce). Every side's first loss is checked
  against cp 1's (fp32, 1e-5).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from _cp_rounds import combined, confidence  # noqa: E402

MODEL = {"vocab_size": 512, "dim": 256, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "ffn_dim": 688}
ATTN_SIDES = ("cp 1 (1 thread)", "cp 1 (2 threads)", "cp 2 allgather", "cp 2 ring", "ulysses")
STEP_SIDES = ("cp 1 (1 thread)", "cp 1 (2 threads)", "cp 2 allgather", "cp 2 ring", "ulysses")


def _local_sdpa(q, k, v, *args, **kwargs):
    """Ulysses' local attention: (S, B, h, D) sequence-first -> causal SDPA -> (S, B, h, D)."""
    q, k, v = (x.permute(1, 2, 0, 3) for x in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=q.shape[1] != k.shape[1])
    return out.permute(2, 0, 1, 3)


class UlyssesAttention:
    """``Llama.attention_fn`` through DeepSpeed's DistributedAttention: q (B, H, S/sp, D),
    k / v (B, Hkv, S/sp, D) of this rank's contiguous tokens -> (B, H, S/sp, D). The
    positions are not read: contiguous shards of one unpacked sequence."""

    def __init__(self, group):
        import deepspeed
        from deepspeed.sequence.layer import DistributedAttention

        deepspeed.init_distributed(dist_backend="gloo")  # adopts torch's group (already initialised)
        self.attn = DistributedAttention(_local_sdpa, group, scatter_idx=2, gather_idx=0)

    def __call__(self, q, k, v, positions=None):
        q, k, v = (x.permute(2, 0, 1, 3) for x in (q, k, v))  # (S/sp, B, h, D)
        return self.attn(q, k, v, 1).permute(1, 2, 0, 3)


def _contiguous(x: torch.Tensor, sp: int, rank: int, dim: int) -> torch.Tensor:
    n = x.shape[dim] // sp
    return x.narrow(dim, rank * n, n).contiguous()


def _timed(fn) -> tuple[float, float]:
    """(wall seconds of the slower rank, CPU seconds of both ranks together): the job
    waits for its slower rank; the CPU time is the work done, which other processes on
    the shared cores do not inflate by preempting this one (they do by sharing caches)."""
    dist.barrier()
    t0, c0 = time.perf_counter(), time.process_time()
    fn()
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    walls, cpus = torch.tensor([wall]), torch.tensor([cpu])
    dist.all_reduce(walls, op=dist.ReduceOp.MAX)
    dist.all_reduce(cpus)
    return float(walls), float(cpus)


def _threads(side: str) -> int:
    return 2 if side == "cp 1 (2 threads)" else 1


# -- attention ---------------------------------------------------------------------------------

def _attention_inputs(seq: int, heads: int, kv_heads: int, head_dim: int):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(1, h, seq, head_dim, generator=g) for h in (heads, kv_heads, kv_heads, heads)]


def _attention_side(side: str, q, k, v, d_out):
    """(attention fn, this rank's q, k, v, its upstream gradient, its rows of the whole
    sequence), or None where this rank sits out. Every side's ranks hold all S queries
    between them, each rank S/2 of them (cp 1: one rank, all S)."""
    from parallel3d.context_parallel import context_parallel_attention, shard_positions, shard_sequence

    r = dist.get_rank()
    seq = q.shape[2]
    if side.startswith("cp 1"):
        if r:
            return None
        fn = lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)  # noqa: E731
        return fn, (q, k, v), d_out, torch.arange(seq)
    if side == "ulysses":
        rows = _contiguous(torch.arange(seq), 2, r, 0)
        return UlyssesAttention(dist.group.WORLD), [x[:, :, rows] for x in (q, k, v)], d_out[:, :, rows], rows
    comm = side.split()[-1]
    fn = lambda q, k, v: context_parallel_attention(q, k, v, dist.group.WORLD, comm=comm)  # noqa: E731
    rows = shard_positions(seq, 2, r)
    return fn, [shard_sequence(x, 2, r, dim=2) for x in (q, k, v)], shard_sequence(d_out, 2, r, dim=2), rows


def _attention_call(side: str, q, k, v, d_out):
    """fn() running forward + backward, or None where this rank sits out."""
    made = _attention_side(side, q, k, v, d_out)
    if made is None:
        return None
    fn, xs, d, _ = made

    def run():
        leaves = [x.detach().requires_grad_() for x in xs]
        fn(*leaves).backward(d)
    return run


def attention_errors(seq: int, shape: tuple) -> dict[str, float]:
    """Each side's output and q, k, v gradients against causal SDPA on the whole sequence
    (fp32; the largest error of the four over the reference's largest entry, max over
    the ranks): every side computes the same attention."""
    q, k, v, d_out = _attention_inputs(seq, *shape)
    ref = [x.clone().requires_grad_() for x in (q, k, v)]
    out = F.scaled_dot_product_attention(*ref, is_causal=True, enable_gqa=True)
    out.backward(d_out)
    errors = {}
    for side in ATTN_SIDES:
        made = _attention_side(side, q, k, v, d_out)
        err = torch.zeros(())
        if made is not None:
            fn, xs, d, rows = made
            leaves = [x.detach().clone().requires_grad_() for x in xs]
            got = fn(*leaves)
            got.backward(d)
            # the K/V gradients of a rank's rows are complete only on their owner: every
            # side returns each rank's own rows' dk, dv (summed over the group in backward)
            pairs = [(got, out[:, :, rows])] + [(x.grad, r.grad[:, :, rows]) for x, r in zip(leaves, ref)]
            err = torch.tensor(max(float((a - b).abs().max() / b.abs().max()) for a, b in pairs))
        dist.all_reduce(err, op=dist.ReduceOp.MAX)
        errors[side] = float(err)
    return errors


def attention_round(seq: int, shape: tuple, order: list[str]) -> dict[str, tuple[float, float]]:
    q, k, v, d_out = _attention_inputs(seq, *shape)
    out = {}
    for side in order:
        torch.set_num_threads(_threads(side))
        run = _attention_call(side, q, k, v, d_out)
        out[side] = _timed(run or (lambda: None))
    torch.set_num_threads(1)
    return out


# -- the whole step ----------------------------------------------------------------------------

def _build(side: str, model_kw: dict, seq: int):
    """This rank's model, optimizer and (inputs, labels, positions), or None (sits out)."""
    from parallel3d.models.llama import Llama, LlamaConfig
    from parallel3d.models.llama.parallelize import apply_context_parallel
    from parallel3d.context_parallel import shard_positions, shard_sequence

    r = dist.get_rank()
    if side.startswith("cp 1") and r:
        return None
    torch.manual_seed(0)
    model = Llama(LlamaConfig(**model_kw, max_seq_len=max(seq, 8192)))
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, model_kw["vocab_size"], (1, seq + 1), generator=g)
    x, y = tokens[:, :-1], tokens[:, 1:]
    positions = None
    if side == "ulysses":
        model.attention_fn = UlyssesAttention(dist.group.WORLD)
        model.sequence_shards = 2
        x, y = _contiguous(x, 2, r, 1), _contiguous(y, 2, r, 1)
        positions = _contiguous(torch.arange(seq), 2, r, 0).unsqueeze(0)
    elif side.startswith("cp 2"):
        apply_context_parallel(model, dist.group.WORLD, side.split()[-1])
        x, y = shard_sequence(x, 2, r, dim=1), shard_sequence(y, 2, r, dim=1)
        positions = shard_positions(seq, 2, r).unsqueeze(0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return model, opt, (x, y, positions, seq, not side.startswith("cp 1"))


def _step(model, opt, batch) -> float:
    x, y, positions, seq, reduce = batch
    logits = model(x, positions)  # (1, S_local, vocab)
    loss = F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="sum") / seq
    loss.backward()
    total = loss.detach().clone()
    if reduce:
        grads = [p.grad for p in model.parameters()]
        flat = torch.cat([g.flatten() for g in grads])
        dist.all_reduce(flat)
        torch._foreach_copy_(grads, [t.view_as(g) for t, g in zip(flat.split([g.numel() for g in grads]), grads)])
        dist.all_reduce(total)
    opt.step()
    opt.zero_grad(set_to_none=False)
    return float(total)


_BUILT: dict = {}


def step_round(seq: int, model_kw: dict, order: list[str]) -> dict[str, tuple[float, float]]:
    """((wall, CPU seconds), the step's loss) per side; the first call of a side builds it and runs a
    warm-up step (its loss the one reported: the same initial weights on every side)."""
    out = {}
    for side in order:
        torch.set_num_threads(_threads(side))
        key = (side, seq)
        if key not in _BUILT:
            built = _build(side, model_kw, seq)
            first = _step(*built) if built else float("nan")
            _BUILT[key] = (built, first)
        built, first = _BUILT[key]
        out[side] = (_timed(lambda: _step(*built) if built else None), first)
    torch.set_num_threads(1)
    return out


def forget() -> None:
    _BUILT.clear()


# -- the run -----------------------------------------------------------------------------------

def _median_ms(values: list[float]) -> float:
    return statistics.median(values) * 1e3


def build_deepspeed_ops() -> None:
    """DeepSpeed's init_distributed on CPU loads its shared-memory comm op, JIT-built on
    first use: built here once, in one process, into a directory of this benchmark's
    own (two ranks building it at once, or another user's half-built copy, fail)."""
    import os

    os.environ.setdefault("TORCH_EXTENSIONS_DIR", "/tmp/p3d-bench-torch-extensions")
    from deepspeed.accelerator import get_accelerator

    builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
    if builder is not None:
        builder.load(verbose=False)


def run(seq: int, rounds: int, model_kw: dict, log=print) -> dict:
    """Alternating rounds of both comparisons on one pool of 2 ranks: every side's wall
    and CPU seconds per round, the first losses, the attention's errors."""
    from parallel3d.testing import ProcessGroupPool

    build_deepspeed_ops()

    shape = (model_kw["n_heads"], model_kw["n_kv_heads"], model_kw["dim"] // model_kw["n_heads"])
    attn = {s: [] for s in ATTN_SIDES}
    step = {s: [] for s in STEP_SIDES}
    losses: dict[str, float] = {}
    pool = ProcessGroupPool(2, timeout=3600, start_method="forkserver")
    try:
        errors = pool.run(attention_errors, 256, shape)[0]  # first calls too: DeepSpeed's imports
        for i in range(rounds):
            k = i % len(ATTN_SIDES)
            a_order = list(ATTN_SIDES[k:] + ATTN_SIDES[:k])
            s_order = list(STEP_SIDES[k:] + STEP_SIDES[:k])
            for side, t in pool.run(attention_round, seq, shape, a_order)[0].items():
                attn[side].append(t)
            for side, (t, loss) in pool.run(step_round, seq, model_kw, s_order)[0].items():
                step[side].append(t)
                losses[side] = loss
            log(f"  round {i + 1}/{rounds} (wall/CPU ms): attention "
                + ", ".join(f"{s} {attn[s][-1][0] * 1e3:.0f}/{attn[s][-1][1] * 1e3:.0f}" for s in ATTN_SIDES)
                + "; step " + ", ".join(f"{s} {step[s][-1][0] * 1e3:.0f}/{step[s][-1][1] * 1e3:.0f}"
                                        for s in STEP_SIDES))
        pool.run(forget)
    finally:
        pool.close()
    return {"attention": attn, "step": step, "losses": losses, "errors": errors}


def paired(raw: list[float], ref: list[float]) -> str:
    """The median of the per-round ratios (each against the reference measured in the
    same round) and their range: steadier than a ratio of medians on a shared machine."""
    ratios = sorted(a / b for a, b in zip(raw, ref))
    return f"{statistics.median(ratios):.2f} ({ratios[0]:.2f}-{ratios[-1]:.2f})"


def _column(times: list[tuple[float, float]], which: int) -> list[float]:
    return [t[which] for t in times]


def table(res: dict, seq: int, rounds: int, model_kw: dict) -> str:
    attn, step, losses = res["attention"], res["step"], res["losses"]
    ref_loss = losses["cp 1 (1 thread)"]
    lines = [f"S = {seq} tokens, micro-batch 1, model {model_kw}, fp32, 2 gloo ranks x 1 thread; "
             f"{rounds} alternating rounds. Wall: the slower rank's, median over rounds; CPU: both ranks' "
             "process time together, median. Ratios: median of the per-round ratios (range)", "",
             "| side | attention fwd+bwd wall ms | vs Ulysses | CPU ms | vs Ulysses | error vs SDPA |",
             "|---|---|---|---|---|---|"]
    for side in ATTN_SIDES:
        wall, cpu = _column(attn[side], 0), _column(attn[side], 1)
        u_wall, u_cpu = _column(attn["ulysses"], 0), _column(attn["ulysses"], 1)
        lines.append(f"| {side} | {_median_ms(wall):.0f} | {paired(wall, u_wall)} | {_median_ms(cpu):.0f} | "
                     f"{paired(cpu, u_cpu)} | {res['errors'][side]:.1e} |")
    lines += ["", "| side | step wall ms | vs Ulysses | vs cp 1 (1 thread) | CPU ms | vs Ulysses | first loss |",
              "|---|---|---|---|---|---|---|"]
    for side in STEP_SIDES:
        wall, cpu = _column(step[side], 0), _column(step[side], 1)
        u_wall, u_cpu = _column(step["ulysses"], 0), _column(step["ulysses"], 1)
        lines.append(f"| {side} | {_median_ms(wall):.0f} | {paired(wall, u_wall)} | "
                     f"{paired(wall, _column(step['cp 1 (1 thread)'], 0))} | {_median_ms(cpu):.0f} | "
                     f"{paired(cpu, u_cpu)} | {losses[side]:.6f} |")
    worst = max(abs(v - ref_loss) / abs(ref_loss) for v in losses.values())
    lines += ["", f"first losses agree to {worst:.1e} (relative; every side the same model, weights and tokens); "
              f"attention at S = 256 against SDPA: largest error {max(res['errors'].values()):.1e}"]
    for side in ("cp 2 allgather", "cp 2 ring"):
        for what, times in (("step", step), ("attention", attn)):
            for which, name in ((0, "wall"), (1, "CPU")):
                lines.append(f"{side} {what} {name} vs Ulysses: "
                             + confidence(_column(times[side], which), _column(times["ulysses"], which)))
        for which, name in ((0, "wall"), (1, "CPU")):
            lines.append(f"{side} step {name} vs cp 1 (1 thread): "
                         + confidence(_column(step[side], which), _column(step["cp 1 (1 thread)"], which)))
    return "\n".join(lines)



def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--json", help="also write every round's times here")
    parser.add_argument("--smoke", action="store_true", help="tiny model and sequence, 1 round: the code path")
    parser.add_argument("--tables-from", nargs="+", metavar="JSON",
                        help="no run: the tables of saved runs (--json) taken together")
    args = parser.parse_args()
    model_kw = dict(MODEL)
    if args.tables_from:
        res, rounds = combined(args.tables_from)
        print(table(res, args.seq_len, rounds, model_kw))
        return 0
    if args.smoke:
        args.seq_len, args.rounds = 64, 1
        model_kw.update(dim=32, ffn_dim=64)
    res = run(args.seq_len, args.rounds, model_kw)
    now = datetime.datetime.now(datetime.timezone.utc)
    print(f"\n{now:%Y-%m-%d %H:%M} UTC, {platform.processor() or platform.machine()}, torch {torch.__version__}, "
          f"load average {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    print(table(res, args.seq_len, args.rounds, model_kw))
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))
    ref = res["losses"]["cp 1 (1 thread)"]
    bad = [s for s, v in res["losses"].items() if abs(v - ref) > 1e-5 * abs(ref)]
    bad += [s for s, e in res["errors"].items() if e > 1e-5]
    if bad:
        print(f"FAIL: {bad}: first loss off cp 1's, or attention off SDPA's, by more than 1e-5", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
