"""prepare-data throughput on ~30 MB of mixed text and JSON lines, against the tokenizer alone;
with --corpus-gb, a generated JSONL corpus against ``datasets``' map (issue 34).

    python benchmarks/bench_prepare_data.py [--mb 40] [--workers N]
    python benchmarks/bench_prepare_data.py --corpus-gb 2 [--workers 2] [--dir DIR]

--corpus-gb: see :mod:`bench_prepare_corpus` (the same tokenizer on both sides, each in a
child process, side by side in one run: wall time, MB/s, CPU-seconds per wall second, peak
resident memory of the whole process tree; then prepare-data killed half-way and rerun,
checked byte for byte against the uninterrupted result).

Input: this machine's Python standard library sources (about 31 MB of .py files; --mb
caps it), written as one .txt file per document for the first quarter of the documents,
the rest as JSON lines (two plain .jsonl, one gzipped). Tokenizer: a byte-level BPE of 4096 trained
on 1 MB of the same text.

Measured in the same run:
  reference   the tokenizer alone: ``encode_batch`` over the documents already in memory,
              in this process with the tokenizers library's own threads off (one core),
              no reading, no writing;
  prepare-data with 1 worker and with N workers (default: all cores): reading, JSON
              parsing, tokenizing, the validation split (1%), shards and index.

The ratio prepare-data(1 worker) / reference is what the pipeline costs over the bare
tokenizer on one core; prepare-data(N) / prepare-data(1) is the parallel speed-up (wall
clock). Each run also reports tokens per CPU-second (this process and its finished
children, from getrusage), which a loaded machine disturbs much less than the wall clock:
on a shared machine read the CPU-time ratio against the reference.
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from data_inputs import make_mixed_inputs, make_tokenizer  # noqa: E402

from parallel3d.data.prepare import prepare_data  # noqa: E402


def cpu_seconds() -> float:
    """User + system CPU time of this process and of its children that have exited."""
    total = 0.0
    for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN):
        r = resource.getrusage(who)
        total += r.ru_utime + r.ru_stime
    return total


def reference_rate(tok_dir: Path, docs: list[str]) -> tuple[float, float, float]:
    from tokenizers import Tokenizer

    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # read at each call: one core, like a worker
    tok = Tokenizer.from_file(str(tok_dir / "tokenizer.json"))
    nbytes = sum(len(d.encode("utf-8")) for d in docs)
    t0, c0 = time.perf_counter(), cpu_seconds()
    encode = getattr(tok, "encode_batch_fast", tok.encode_batch)  # what the workers call
    tokens = 0
    for i in range(0, len(docs), 64):
        tokens += sum(len(e.ids) for e in encode(docs[i: i + 64], add_special_tokens=False))
    dt, cpu = time.perf_counter() - t0, cpu_seconds() - c0
    return nbytes / 1e6 / dt, tokens / dt, tokens / cpu


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mb", type=float, default=40.0, help="cap on the input size (default 40)")
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--corpus-gb", type=float, default=0.0,
                    help="generate a JSONL corpus of this many GB and race datasets' map (issue 34)")
    ap.add_argument("--dir", default=None, help="--corpus-gb: where to write (default: a temp dir)")
    args = ap.parse_args()
    if args.corpus_gb:
        from bench_prepare_corpus import corpus_main

        corpus_main(args.corpus_gb, args.workers, args.dir)
        return
    with tempfile.TemporaryDirectory(prefix="p3d-bench-") as tmp:
        tmp = Path(tmp)
        tok_dir = make_tokenizer(tmp / "tok", vocab_size=4096)
        docs = make_mixed_inputs(tmp / "in", int(args.mb * 1e6))
        disk = sum(f.stat().st_size for f in (tmp / "in").iterdir()) / 1e6
        print(f"input: {len(docs):,} documents, {disk:.1f} MB on disk in {len(list((tmp / 'in').iterdir()))} "
              f"files; {os.cpu_count()} cores")
        ref_mb, ref_tok, ref_cpu = reference_rate(tok_dir, docs)
        print(f"reference (tokenizer alone, 1 core): {ref_mb:.2f} MB/s of text, {ref_tok:,.0f} tokens/s, "
              f"{ref_cpu:,.0f} tokens per CPU-second")
        rates, cpu_rates = {}, {}
        for workers in sorted({1, args.workers}):
            c0 = cpu_seconds()
            report = prepare_data([str(tmp / "in")], tok_dir, tmp / f"out{workers}", workers=workers,
                                  val_fraction=0.01, progress=False)
            rates[workers] = report.tokens_per_s
            cpu_rates[workers] = sum(report.tokens.values()) / (cpu_seconds() - c0)
            print(report.summary())
            print(f"  {cpu_rates[workers]:,.0f} tokens per CPU-second")
        print(f"ratio prepare-data(1 worker) / reference: {rates[1] / ref_tok:.2f} wall clock, "
              f"{cpu_rates[1] / ref_cpu:.2f} CPU time (tokens/s)")
        if args.workers > 1:
            print(f"ratio prepare-data({args.workers} workers) / prepare-data(1 worker): "
                  f"{rates[args.workers] / rates[1]:.2f} wall clock")


if __name__ == "__main__":
    main()
