"""parallel3d against DeepSpeed and torch, end to end, one table.

    python benchmarks/compare.py [--rows dp-zero1,dp-zero2,pp2,pp4,tp2,pp2-dp2-zero1,pp2-dp4-zero1,3d,
                                         pp2-zb-h1,pp2-zb-v,pp4-zb-h1,pp4-zb-v]
                                 [--steps 6] [--rounds 2] [--warmup 2] [--zb-layers 8] [--out table.md]

Every row trains the same Llama (the ``debug`` preset: 4 layers, dim 128, vocab 2048,
from the trainer's seed) for ``--steps`` optimizer steps of 8 sequences x 128 tokens
(micro-batches of 2 unless the row says otherwise) with AdamW (lr 1e-3 constant, betas
0.9/0.95, eps 1e-8, weight decay 0.1 on >= 2-D parameters) and global-norm clipping at 1.0, on the same global
batches (the trainer's sampler), once with parallel3d's Trainer and once with each peer
that runs the same layout; rounds alternate parallel3d, peer 1, peer 2, parallel3d, ...
so that load from other processes on the machine hits every side alike. Reported per
side: the median step time (a step lasts as long as its slowest rank; the first
``--warmup`` steps of each run are left out), tokens/s from it, the peak memory of the
largest rank (see ``_common.PeakMemory``), the final loss, and parallel3d / peer.

The zero-bubble rows (``pp*-zb-*``) run m = 2 pp micro-batches (of 2 sequences at pp 2,
of 1 at pp 4) of the debug model with ``--zb-layers`` layers (default 8; with 4, zb-v's 4
chunks at pp 2 have one layer each and rank 0, holding the embedding's and the head's,
carries 3.4 layers' work against rank 1's 2). The head weighs about 1.1 layers on this
CPU (1.42 by GEMM FLOPs, which the split rule counts), so with 8 layers at pp 2 one rank
carries about a fifth more than the other in every schedule (1F1B's stages 5 and 3 + the
head; zb-v's ranks 2 + 1 + the head and 5), and with 9 they balance (5 and 4 + the head;
3 + 1 + the head and 5); at pp 4 each of zb-v's 8 chunks has one layer either way) against torch's
``Schedule1F1B`` (pp stages), ``ScheduleZBVZeroBubble`` (2 pp chunks in zb-v's V) and
``ScheduleInterleavedZeroBubble`` (2 pp chunks, interleaved), all cut by our split rule,
and against our own 1F1B on the same stages and batches (what the schedule gains, apart
from the runtime's own lead or lag against torch's), and print below the table each
side's peak per stage in its metered run (the last step's
high-water mark above what was allocated at its start: activations, gradient and
communication buffers, temporaries).

Below the table each row also gives, per peer, the lowest and highest ratio of one round's
medians (parallel3d's run and the peer's run of the same round): the spread that the
machine's drift from round to round leaves on the table's ratio.

On CPU the ranks are gloo processes with one thread each; on GPUs (one per rank) the
same script uses NCCL. Peers that cannot run a row say why in the table.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass, field

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _common  # noqa: E402
import peers  # noqa: E402
import peers_deepspeed  # noqa: E402
import peers_torch  # noqa: E402


@dataclass
class Row:
    world: int
    layout: dict
    peers: list = field(default_factory=list)  # (name, runner, kwargs, world or None)
    what: str = ""
    job: dict = field(default_factory=dict)  # job() arguments of both sides (micro_batch)


ROWS = {
    "dp-zero1": Row(2, {"dp": 2, "zero": 1},
                    [("DeepSpeed ZeRO-1", peers_deepspeed.run_deepspeed_zero, {}, None)], "dp=2, ZeRO-1"),
    "dp-zero2": Row(2, {"dp": 2, "zero": 2},
                    [("DeepSpeed ZeRO-2", peers_deepspeed.run_deepspeed_zero, {}, None)], "dp=2, ZeRO-2"),
    "pp2": Row(2, {"pp": 2, "schedule": "1f1b"},
               [("torch Schedule1F1B", peers_torch.run_torch_pipelining, {}, None),
                ("DeepSpeed PipelineEngine", peers_deepspeed.run_deepspeed_pipe, {"ds_pp": 2}, None)],
               "pp=2, 1F1B, 4 micro-batches"),
    "pp4": Row(4, {"pp": 4, "schedule": "1f1b"},
               [("torch Schedule1F1B", peers_torch.run_torch_pipelining, {}, None),
                ("DeepSpeed PipelineEngine", peers_deepspeed.run_deepspeed_pipe, {"ds_pp": 4}, None)],
               "pp=4, 1F1B, 4 micro-batches"),
    "tp2": Row(2, {"tp": 2}, [("torch DTensor TP", peers_torch.run_dtensor_tp, {}, None)],
               "tp=2, 4 micro-batches"),
    "pp2-dp2-zero1": Row(4, {"pp": 2, "dp": 2, "zero": 1, "schedule": "1f1b"},
                         [("DeepSpeed pipe+ZeRO-1", peers_deepspeed.run_deepspeed_pipe,
                           {"ds_pp": 2, "ds_zero": 1}, None)],
                         "pp=2 x dp=2, ZeRO-1: the 3d row's peer layout, run by both"),
    "pp2-dp4-zero1": Row(8, {"pp": 2, "dp": 4, "zero": 1, "schedule": "1f1b"},
                         [("DeepSpeed pipe+ZeRO-1", peers_deepspeed.run_deepspeed_pipe,
                           {"ds_pp": 2, "ds_zero": 1}, None)],
                         "pp=2 x dp=4, ZeRO-1, micro-batches of 1: DeepSpeed's 8-rank layout, run by both",
                         {"micro_batch": 1}),
    **{f"pp{pp}-{zb}": Row(pp, {"pp": pp, "schedule": zb, "virtual_stages": 2 if zb == "zb-v" else 1},
                           [(f"torch {cls}", peers_torch.run_torch_pipelining,
                             {"schedule": cls, "stage_layout": {"pp": pp, **cut}}, None)
                            for cls, cut in (("Schedule1F1B", {"schedule": "1f1b"}),
                                             ("ScheduleZBVZeroBubble", {"schedule": "zb-v", "virtual_stages": 2}),
                                             ("ScheduleInterleavedZeroBubble",
                                              {"schedule": "interleaved", "virtual_stages": 2}))]
                           + [("parallel3d 1f1b", peers.run_ours_as,
                               {"as_layout": {"pp": pp, "schedule": "1f1b"}}, None)],
                           f"pp={pp}, {zb}, {2 * pp} micro-batches",
                           {"micro_batch": 2 if pp == 2 else 1})  # layers: --zb-layers
       for pp in (2, 4) for zb in ("zb-h1", "zb-v")},
    "3d": Row(8, {"tp": 2, "pp": 2, "dp": 2, "zero": 1, "schedule": "1f1b"},
              [("torch 3D: DTensor TP x Schedule1F1B x dp all-reduce", peers_torch.run_torch_3d, {}, None)],
              "tp=2 x pp=2 x dp=2, ZeRO-1, 1F1B (DeepSpeed has no tensor parallelism)"),
}


class Pools:
    """One process-group pool per world size, started on first use; a pool whose run
    failed is dropped (its processes are killed) and restarted on next use."""

    def __init__(self):
        from parallel3d.testing import ProcessGroupPool

        self._cls = ProcessGroupPool
        self.pools = {}

    def run(self, world: int, fn, *args, **kwargs):
        if world not in self.pools:
            env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(29600 + world),
                   "OMP_NUM_THREADS": "1"}
            self.pools[world] = self._cls(world, timeout=1800, env=env)
        try:
            return self.pools[world].run(fn, *args, **kwargs)
        except Exception:
            self.pools.pop(world)
            raise

    def close(self):
        for pool in self.pools.values():
            pool.close()


def measure_row(pools: Pools, name: str, row: Row, args) -> list[tuple[str, _common.Side, _common.Side]]:
    job_kw = {"seq_len": args.seq_len, **row.job}
    if "-zb-" in name:
        job_kw["model"] = {**job_kw.get("model", {}), "n_layers": args.zb_layers}
    tokens = 8 * args.seq_len
    ours_runs, peer_runs, errors = [], {p[0]: [] for p in row.peers}, {}
    for _ in range(args.rounds):
        ours_runs.append(pools.run(row.world, peers.run_ours, row.layout, args.steps, **job_kw))
        for peer_name, fn, kw, world in row.peers:
            if peer_name in errors:
                continue
            try:
                peer_runs[peer_name].append(pools.run(world or row.world, fn, row.layout,
                                                      args.steps, **kw, **job_kw))
            except Exception as e:  # noqa: BLE001 - reported in the table
                errors[peer_name] = _first_error_line(str(e))
    # Memory: one more, untimed run per side with every tensor allocation metered (CPU);
    # on GPUs the timed runs' max_memory_allocated serves.
    mem = {}
    if not args.gpu:
        mem["parallel3d"] = pools.run(row.world, peers.run_ours, row.layout, 2, memory_run=True, **job_kw)
        for peer_name, fn, kw, world in row.peers:
            if peer_name not in errors:
                mem[peer_name] = pools.run(world or row.world, fn, row.layout, 2, memory_run=True,
                                           **kw, **job_kw)
    ours = _common.summarize("parallel3d", ours_runs, args.warmup, tokens, mem.get("parallel3d"))
    ours.error = breakdown(ours_runs, args.warmup, row.layout.get("pp", 1) > 1)
    stage_peaks = {side: [r.extra["step_peak"][-1] / 2**20 for r in runs]
                   for side, runs in mem.items() if runs and "step_peak" in runs[0].extra}
    if row.layout.get("pp", 1) > 1 and len(stage_peaks) > 1:
        ours.error += "; peak per stage above rest, MiB: " + ", ".join(
            f"{side} [{' '.join(f'{x:.1f}' for x in peaks)}]" for side, peaks in stage_peaks.items())
    tails = {"parallel3d": first_stage_tail(ours_runs, args.warmup)}
    tails.update({p: first_stage_tail(runs, args.warmup) for p, runs in peer_runs.items() if p not in errors})
    tails = {k: v for k, v in tails.items() if v is not None}
    if len(tails) > 1:
        ours.error += "; first stage's tail (end of its last backward to the end of the step), median ms: " + \
            ", ".join(f"{k} {v * 1e3:.1f}" for k, v in tails.items())
    spreads = []  # the machine's drift between rounds, seen in each round's own ratio
    for peer_name, runs in peer_runs.items():
        if peer_name not in errors and len(runs) == len(ours_runs) > 1:
            per_round = [_common.summarize("", [a], args.warmup, tokens).step_ms
                         / _common.summarize("", [b], args.warmup, tokens).step_ms
                         for a, b in zip(ours_runs, runs)]
            spreads.append(f"{peer_name} {min(per_round):.2f}-{max(per_round):.2f}")
    if spreads:
        ours.error += "; ratio of each round's medians, lowest-highest: " + ", ".join(spreads)
    out = []
    for peer_name, *_ in row.peers:
        if peer_name in errors:
            out.append((name, ours, _common.failed(peer_name, errors[peer_name])))
        else:
            out.append((name, ours, _common.summarize(peer_name, peer_runs[peer_name],
                                                      args.warmup, tokens, mem.get(peer_name))))
    return out


_SHORT = {"forward_s": "forward", "backward_s": "backward", "bubble_s": "wait", "optimizer_s": "optimizer",
          "comm_exposed_s": "comm", "data_wait_s": "data", "other_s": "other"}


def breakdown(runs, warmup: int, pipeline: bool) -> str:
    """Where parallel3d's step time goes, from the trainer's timeline (the fields of
    ``parallel3d.observe.stats.step_breakdown``): forward, backward, wait for a peer stage,
    optimizer (its collectives left out), exposed collectives (gradient sync, the step's
    closing all-reduce), data, and what no span covers; milliseconds, median over steps
    after warm-up of the mean over ranks."""
    cats: dict[str, list[float]] = {}
    for ranks in runs:
        n = len(ranks[0].extra["breakdown"])
        for s in range(warmup, n):
            per_rank = [r.extra["breakdown"][s] for r in ranks]
            for k in _SHORT:
                cats.setdefault(k, []).append(statistics.mean(b[k] for b in per_rank))
    parts = [f"{name} {statistics.median(cats[k]) * 1e3:.0f}" for k, name in _SHORT.items()
             if pipeline or k != "bubble_s"]
    text = "ms per step: " + ", ".join(parts)
    bubbles = [b for ranks in runs for b in ranks[0].extra.get("bubble_fraction", [])[warmup:]]
    if pipeline and bubbles:
        text += f"; pipeline bubble {statistics.median(bubbles):.2f} (idle share of the step window)"
    return text


def first_stage_tail(runs, warmup: int) -> float | None:
    """Median over steps after warm-up of rank 0's ``extra["tail"]`` (seconds from the end
    of the pipeline's work on the first stage to the end of the step: gradient sync,
    norm, clipping, the update, closing collectives), or None if the side records none."""
    tails = [t for ranks in runs for t in ranks[0].extra.get("tail", [])[warmup:]]
    return statistics.median(tails) if tails else None


def _first_error_line(text: str) -> str:
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    last = lines[-1] if lines else text
    return last.replace("|", "/")[:160]


def header(args) -> str:
    import torch

    try:
        import deepspeed
        ds = deepspeed.__version__
    except Exception:  # noqa: BLE001
        ds = "not installed"
    dev = (torch.cuda.get_device_name() if torch.cuda.is_available()
           else f"{os.cpu_count()}-core CPU ({platform.processor() or platform.machine()}), gloo, 1 thread per rank")
    return (f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; {dev}; torch {torch.__version__}, "
            f"deepspeed {ds}; debug preset ({args.zb_layers} layers in the zero-bubble rows), "
            f"8 x {args.seq_len} tokens per step, {args.steps} steps, "
            f"{args.rounds} alternating rounds, median over steps after the first {args.warmup}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated, from {list(ROWS)}")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--zb-layers", type=int, default=8,
                        help="layers of the zero-bubble rows' model (9: its two stages balance at pp 2)")
    parser.add_argument("--out", help="also write the markdown table here")
    args = parser.parse_args()
    import torch

    args.gpu = torch.cuda.is_available()
    names = args.rows.split(",")
    unknown = [n for n in names if n not in ROWS]
    if unknown:
        raise SystemExit(f"unknown rows {unknown}: choose from {list(ROWS)}")
    if args.steps <= args.warmup:
        raise SystemExit(f"--steps {args.steps} must exceed --warmup {args.warmup}")
    from parallel3d.config import DataConfig
    from parallel3d.train.data import prepare_corpus

    prepare_corpus(DataConfig(max_bytes=1_000_000, vocab_size=2048, cache_dir=_common.CORPUS_DIR))
    pools = Pools()
    results = []
    try:
        for name in names:
            t0 = time.perf_counter()
            results += measure_row(pools, name, ROWS[name], args)
            print(f"[{name}: {time.perf_counter() - t0:.0f} s]", file=sys.stderr, flush=True)
            # Fresh processes for the next row: DeepSpeed's pipeline engine leaves
            # process-global state (its model-parallel unit) that breaks a later ZeRO engine.
            pools.close()
            pools = Pools()
    finally:
        pools.close()
    text = header(args) + "\n\n" + _common.table(results) + "\n"
    notes = [f"- {row}: parallel3d {ours.error}" for row, ours, _ in results if ours.error]
    text += "\n".join(dict.fromkeys(notes)) + ("\n" if notes else "")
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
