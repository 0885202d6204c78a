"""Context parallelism on CPU: peak resident memory per process against cp 1, and the
longest sequence that fits under a per-process limit (issue 32, acceptance 3).

    python benchmarks/bench_cp_memory.py [--comm ring,allgather] [--seq-len 16384]
    python benchmarks/bench_cp_memory.py --smoke          # tiny, seconds: the code path

The trainer (``Trainer(cfg, Topology.of(cfg.parallel)).fit()``, 2 steps, micro_batch 1,
fp32, ``launch.host_memory = "tight"`` so resident memory follows the tensors) on a small
model whose long sequence dominates: dim 128, 2 layers, 4 heads on 2 kv-heads, ffn 352,
vocab 512. Every configuration (cp, comm, S) runs as its own cp fresh processes (gloo,
spawned, one thread each), and each reports its peak resident memory (``VmHWM`` of
/proc/self/status, the kernel's high-water mark of the process's RSS, start-up included).
Reported per configuration: the largest peak over its ranks, and that peak above the same
layout's peak at a short sequence (512 tokens), which takes out the interpreter, torch,
the model and the optimizer.

The longest sequence under a limit: a measured-peak threshold (a configuration fits when
every rank's peak stays under the limit; no RLIMIT_AS, which counts address space that
torch and glibc reserve without touching), over multiples of 1024 tokens at cp 4 and of
256 at cp 1 (the same ~6 MiB of a rank's memory): a straight line through a layout's two
measured peaks predicts where it meets the limit (``--limit-mib``, 480 MiB: cp 1 then fits a few thousand
tokens), and probes from there, one step at a time, find a length that fits next to one
that does not.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from _trainer_memory import in_fresh_processes, peak_rss, train  # noqa: E402

MODEL = {"preset": "debug", "vocab_size": 512, "n_layers": 2, "dim": 128, "n_heads": 4, "n_kv_heads": 2,
         "ffn_dim": 352}
DATA = {"vocab_size": 512}
CORPUS_DIR = "/tmp/p3d-bench-corpus-cp"
SHORT = 512
MiB = 2**20


def _job(cp: int, comm: str, seq_len: int, run_dir: str, max_bytes: int, model: dict) -> dict:
    return {"model": model,
            "parallel": {"cp": cp, "cp_comm": comm},
            "train": {"steps": 2, "seed": 1, "global_batch": 1, "micro_batch": 1, "seq_len": seq_len,
                      "lr": 1e-3, "warmup_steps": 0, "dtype": "fp32", "log_interval": 10**9},
            "data": {**DATA, "max_bytes": max_bytes, "cache_dir": CORPUS_DIR},
            "eval": {"interval": 0},
            "launch": {"host_memory": "tight"},
            "run": {"dir": run_dir},
            "observability": {"progress": "off"}}


def _rank(job: dict) -> dict:
    """One rank: the trainer's steps, then this process's peak RSS."""
    _, losses, seconds = train(job, prepare=lambda cfg: _allow_seq_len(cfg.train.seq_len))
    return {"peak": peak_rss(), "seconds": seconds, "losses": losses}


def _allow_seq_len(seq_len: int) -> None:
    """The presets stop at max_seq_len 8192 and the job config cannot raise it: the
    trainer resolves the model with a bound of at least ``seq_len`` here (the bound only
    checks; the rotary tables are built for the sequence at hand)."""
    from dataclasses import replace

    import parallel3d.train.trainer as trainer_module
    from parallel3d.model_config import resolve_model_config

    def resolve(cfg):
        model = resolve_model_config(cfg)
        return replace(model, max_seq_len=max(model.max_seq_len, seq_len))
    trainer_module.resolve_model_config = resolve


def measure(cp: int, comm: str, seq_len: int, max_bytes: int, model: dict = MODEL,
            timeout: float = 1800) -> dict:
    """One configuration in cp fresh processes: the largest peak RSS over its ranks."""
    with tempfile.TemporaryDirectory(prefix="p3d-cp-mem-") as run_dir:
        ranks = in_fresh_processes(_rank, _job(cp, comm, seq_len, run_dir, max_bytes, model), cp, timeout)
    return {"cp": cp, "comm": comm, "seq_len": seq_len, "peak": max(r["peak"] for r in ranks),
            "peaks": [r["peak"] for r in ranks], "seconds": max(r["seconds"] for r in ranks),
            "loss": ranks[0]["losses"][-1]}


def prepare_corpus(max_bytes: int) -> None:
    """One writer before the ranks read it."""
    from parallel3d.config import DataConfig
    from parallel3d.data.stdlib import prepare_stdlib

    prepare_stdlib(DataConfig(**DATA, max_bytes=max_bytes, cache_dir=CORPUS_DIR))


def longest_fitting(measure_at, limit: int, guess: int, step: int, log=print,
                    max_probes: int = 8) -> tuple[int, list]:
    """The longest multiple of ``step`` tokens whose peak (``measure_at(S)``) stays under
    ``limit`` bytes, searched from ``guess`` (the linear fit's prediction) one ``step`` at
    a time: up while it fits, down while it does not, until a fitting S and S + step that
    does not are both measured (or ``max_probes`` are spent: then the last fitting S seen,
    0 if none). Returns it and the probes ``(S, peak)``."""
    probes, fits = [], {}

    def fits_at(s: int) -> bool:
        if s not in fits and len(probes) >= max_probes:
            return False
        if s not in fits:
            peak = measure_at(s)
            probes.append((s, peak))
            fits[s] = peak <= limit
            log(f"    S {s}: peak {peak / MiB:.0f} MiB, {'fits' if fits[s] else 'over'}")
        return fits[s]

    s = max(step, guess // step * step)
    if fits_at(s):
        while fits_at(s + step):
            s += step
        return s, probes
    while s > step and not fits_at(s - step):
        s -= step
    return (s - step if fits.get(s - step) else 0), probes


def predict(short: dict, long: dict, limit: int) -> int:
    """The sequence length where the line through two measured (S, peak) meets ``limit``."""
    slope = (long["peak"] - short["peak"]) / (long["seq_len"] - short["seq_len"])
    if slope <= 0:
        return 8 * long["seq_len"]
    return int(short["seq_len"] + (limit - short["peak"]) / slope)


def run(seq_len: int, comms: list[str], limit_mib: float, max_bytes: int, smoke: bool, log=print) -> dict:
    """The peaks at ``SHORT`` and ``seq_len`` tokens for cp 1 and cp 4 (each comm), then
    the longest sequence under ``limit_mib`` for cp 1 and cp 4 (each comm)."""
    model = dict(MODEL, dim=32, ffn_dim=64) if smoke else MODEL
    short = 64 if smoke else SHORT
    step = 64 if smoke else 1024
    prepare_corpus(max_bytes)
    layouts = [(1, comms[0])] + [(4, c) for c in comms]
    peaks = {}
    for cp, comm in layouts:
        for s in (short, seq_len):
            m = measure(cp, comm, s, max_bytes, model)
            peaks[(cp, comm, s)] = m
            log(f"  cp {cp} {comm:<9} S {s:>6}: peak {m['peak'] / MiB:7.1f} MiB (ranks "
                f"{', '.join(f'{p / MiB:.0f}' for p in m['peaks'])}), {m['seconds']:.0f} s, loss {m['loss']:.4f}")
    limit = int(limit_mib * MiB)
    max_probes = 8
    if smoke:  # a limit just above cp 1's longer run; two probes each (the slope is noise-sized)
        limit, max_probes = peaks[(1, comms[0], seq_len)]["peak"] + MiB, 2
    longest = {}
    for cp, comm in layouts:
        guess = max(step, min(predict(peaks[(cp, comm, short)], peaks[(cp, comm, seq_len)], limit), 8 * seq_len))
        log(f"  longest under {limit / MiB:.0f} MiB, cp {cp} {comm}: the fit predicts {guess}")
        # steps of equal memory: a rank at cp holds 1/cp of the sequence, so 1024 tokens
        # at cp 4 weigh about what 256 do at cp 1 (~6 MiB here)
        longest[(cp, comm)] = longest_fitting(lambda s: measure(cp, comm, s, max_bytes, model)["peak"],
                                              limit, guess, max(2 * cp, step * cp // 4), log, max_probes)
    return {"peaks": peaks, "longest": longest, "limit": limit, "short": short, "seq_len": seq_len,
            "comms": comms, "model": model}


def table(res: dict) -> str:
    peaks, short, seq = res["peaks"], res["short"], res["seq_len"]
    cp1 = res["comms"][0]
    base1 = peaks[(1, cp1, seq)]["peak"] - peaks[(1, cp1, short)]["peak"]
    lines = [f"| layout | peak at S = {short}, MiB | peak at S = {seq}, MiB | above the short run, MiB | vs cp 1 |",
             "|---|---|---|---|---|"]
    for (cp, comm) in [(1, cp1)] + [(4, c) for c in res["comms"]]:
        lo, hi = peaks[(cp, comm, short)]["peak"], peaks[(cp, comm, seq)]["peak"]
        lines.append(f"| cp {cp}{'' if cp == 1 else ' ' + comm} | {lo / MiB:.0f} | {hi / MiB:.0f} | "
                     f"{(hi - lo) / MiB:.0f} | {(hi - lo) / base1:.2f}x |")
    lines += ["", f"| layout | longest S under {res['limit'] / MiB:.0f} MiB per process | vs cp 1 | probes (S: peak MiB) |",
              "|---|---|---|---|"]
    l1 = res["longest"][(1, cp1)][0]
    for (cp, comm), (s, probes) in res["longest"].items():
        lines.append(f"| cp {cp}{'' if cp == 1 else ' ' + comm} | {s} | {s / max(l1, 1):.2f}x | "
                     + ", ".join(f"{p}: {v / MiB:.0f}" for p, v in probes) + " |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-len", type=int, default=16384)
    parser.add_argument("--comm", default="ring,allgather", help="cp 4's comm modes, comma-separated")
    parser.add_argument("--limit-mib", type=float, default=480.0, help="the per-process limit of the search")
    parser.add_argument("--max-bytes", type=int, default=2_000_000, help="corpus size (enough windows of S)")
    parser.add_argument("--smoke", action="store_true", help="tiny model, 512 tokens: the code path")
    args = parser.parse_args()
    if args.smoke:
        args.seq_len, args.comm, args.max_bytes = 512, "ring", 1_000_000
    comms = [c.strip() for c in args.comm.split(",") if c.strip()]
    t0 = time.time()
    res = run(args.seq_len, comms, args.limit_mib, args.max_bytes, args.smoke)
    print(f"\n{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, {platform.machine()}, "
          f"{os.cpu_count()} CPUs, torch {__import__('torch').__version__}, model {res['model']}, "
          f"{time.time() - t0:.0f} s")
    print(table(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
