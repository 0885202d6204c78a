"""prepare-data at corpus scale against ``datasets``' map (issue 34, acceptance 3).

Run through ``bench_prepare_data.py --corpus-gb GB [--workers 2]``.

The corpus: GB of JSON lines in 8 files (``part-*.jsonl``, read through a glob), each line
a ~4 KB piece of this machine's Python standard library (32 MB of it, repeated with a line
number in front, so no two documents are the same). The tokenizer: a byte-level BPE of
4096 trained on 1 MB of the same text, one ``tokenizer.json`` for both sides.

Side by side, each in a child process, in one run (ABBA: prepare-data, datasets,
datasets, prepare-data when --repeat 2):

  prepare-data  ``prepare_data(GLOB, workers=W)``: reading, parsing, tokenizing in W worker
                processes, EOS after each document, shards with sha256, index;
  datasets      ``load_dataset("json", data_files=FILES)`` (the Arrow cache, timed apart)
                then ``map(batched=True, num_proc=W)`` calling the same tokenizer's
                ``encode_batch`` (one thread per process, as prepare-data's workers) and
                appending the EOS id; its Arrow output is its result.

Each side reports wall seconds, input MB/s, CPU-seconds (user + system of the child and
every descendant it reaped, from getrusage) and per wall second (1.9 = both cores busy), and the
peak resident memory of the whole process tree (the sum of VmRSS over the child and its
descendants, sampled every 50 ms). Then prepare-data is killed (SIGKILL) half-way through
the input and run again: the rerun keeps the finished shards (counted) and its dataset is
compared byte for byte with the uninterrupted one.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))


def make_corpus(out: Path, gb: float, files: int = 8) -> int:
    from parallel3d.data.stdlib import read_stdlib

    text = "".join(read_stdlib(32_000_000))
    pieces = [text[i: i + 4000] for i in range(0, len(text), 4000)]
    target, written, n = int(gb * 1e9), 0, 0
    out.mkdir(parents=True, exist_ok=True)
    per_file = target // files + 1
    for k in range(files):
        with open(out / f"part-{k:02d}.jsonl", "w", encoding="utf-8") as f:
            size = 0
            while size < per_file and written < target:
                line = json.dumps({"text": f"{n}\n{pieces[n % len(pieces)]}"}) + "\n"
                f.write(line)
                size += len(line)
                written += len(line)
                n += 1
    return written


def tree_rss(pid: int) -> int:
    """Resident bytes of ``pid`` and all its descendants."""
    children: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
                children.setdefault(ppid, []).append(int(d))
            except (OSError, ValueError, IndexError):
                pass
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        todo += children.get(p, [])
        try:
            with open(f"/proc/{p}/status") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        total += int(line.split()[1]) * 1024
        except OSError:
            pass
    return total


def run_child(code: str, args: dict, kill_when=None) -> dict:
    """Run ``code`` in a child Python; its wall time, CPU time (it and its reaped
    descendants), peak tree RSS; ``kill_when()`` polled: SIGKILL when true."""
    c0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    child = subprocess.Popen([sys.executable, "-c", code, json.dumps(args)], cwd=ROOT,
                             env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
    peak, killed = 0, False
    while child.poll() is None:
        peak = max(peak, tree_rss(child.pid))
        if kill_when is not None and kill_when():
            child.send_signal(signal.SIGKILL)
            killed = True
            break
        time.sleep(0.05)
    child.wait()
    wall = time.perf_counter() - t0
    c1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (c1.ru_utime - c0.ru_utime) + (c1.ru_stime - c0.ru_stime)
    if child.returncode != 0 and not killed:
        raise SystemExit(f"child failed ({child.returncode})")
    return {"wall": wall, "cpu": cpu, "peak": peak, "killed": killed}


PREPARE = """
import json, sys
from parallel3d.data.prepare import prepare_data
a = json.loads(sys.argv[1])
r = prepare_data([a["glob"]], a["tok"], a["out"], workers=a["workers"], val_fraction=0.001, progress=False,
                 shard_tokens=a["shard_tokens"])
print(json.dumps({"tokens": sum(r.tokens.values()), "resumed": r.resumed_bytes}), file=open(a["report"], "w"))
"""

DATASETS = """
import json, sys, time
from datasets import load_dataset
from tokenizers import Tokenizer
a = json.loads(sys.argv[1])
t0 = time.perf_counter()
ds = load_dataset("json", data_files=a["files"], split="train", cache_dir=a["cache"])
t1 = time.perf_counter()
tok = Tokenizer.from_file(a["tok"] + "/tokenizer.json")
eos = a["eos"]
def encode(batch):
    return {"input_ids": [e.ids + [eos] for e in tok.encode_batch(batch["text"], add_special_tokens=False)]}
out = ds.map(encode, batched=True, num_proc=a["workers"], remove_columns=["text"])
tokens = sum(len(x) for x in out.data.column("input_ids").to_pylist()) if a["count"] else 0
print(json.dumps({"load_s": t1 - t0, "map_s": time.perf_counter() - t1, "tokens": tokens}),
      file=open(a["report"], "w"))
"""


def _line(name: str, r: dict, mb: float) -> str:
    return (f"{name:13s} {r['wall']:7.1f} s  {mb / r['wall']:6.2f} MB/s  {r['cpu']:7.1f} CPU-s "
            f"({r['cpu'] / r['wall']:4.2f} per s)  peak RSS {r['peak'] / 2**30:5.2f} GiB")


def corpus_main(gb: float, workers: int, where: str | None) -> None:
    from data_inputs import make_tokenizer
    from parallel3d.data.tokenizer import load_tokenizer

    tmp = Path(where or tempfile.mkdtemp(prefix="p3d-corpus-"))
    tok = make_tokenizer(tmp / "tok", vocab_size=4096)
    eos = load_tokenizer(tok).eos_id
    t0 = time.perf_counter()
    nbytes = make_corpus(tmp / "corpus", gb)
    files = sorted(str(p) for p in (tmp / "corpus").glob("part-*.jsonl"))
    mb = nbytes / 1e6
    print(f"corpus: {mb:,.0f} MB of JSON lines in {len(files)} files (written in {time.perf_counter() - t0:.0f} s); "
          f"{os.cpu_count()} cores; {workers} workers on each side")
    # ~40 shards (32 MiB ones from 2 GB up): killing half-way leaves some finished
    shard_tokens = min(1 << 24, max(1 << 16, nbytes // 3 // 40))
    prep_args = {"glob": str(tmp / "corpus" / "part-*.jsonl"), "tok": str(tok), "workers": workers,
                 "shard_tokens": shard_tokens, "report": str(tmp / "prep.json")}
    ds_args = {"files": files, "tok": str(tok), "eos": eos, "workers": workers, "report": str(tmp / "ds.json"),
               "count": False}
    results = {"prepare-data": [], "datasets": []}
    for side in ("prepare-data", "datasets", "datasets", "prepare-data")[: 4 if gb <= 0.5 else 2]:
        out, cache = tmp / "out", tmp / "hf-cache"
        shutil.rmtree(out, ignore_errors=True)
        shutil.rmtree(cache, ignore_errors=True)
        if side == "prepare-data":
            r = run_child(PREPARE, {**prep_args, "out": str(out)})
            r.update(json.loads((tmp / "prep.json").read_text()))
        else:
            r = run_child(DATASETS, {**ds_args, "cache": str(cache)})
            r.update(json.loads((tmp / "ds.json").read_text()))
        results[side].append(r)
        extra = (f"  (load_dataset {r['load_s']:.1f} s + map {r['map_s']:.1f} s)" if side == "datasets"
                 else f"  {r['tokens']:,} tokens")
        print(_line(side, r, mb) + extra, flush=True)
    best = {k: min(v, key=lambda r: r["wall"]) for k, v in results.items()}
    cpu = {k: min(r["cpu"] for r in v) for k, v in results.items()}
    print(f"ratio datasets / prepare-data: wall time {best['datasets']['wall'] / best['prepare-data']['wall']:.2f} "
          f"(fastest of each; map alone {best['datasets']['map_s'] / best['prepare-data']['wall']:.2f}), "
          f"CPU-seconds {cpu['datasets'] / cpu['prepare-data']:.2f} (least of each: what a loaded machine "
          "disturbs least)")
    _killed_and_rerun(tmp, prep_args, mb)
    if where is None:
        shutil.rmtree(tmp, ignore_errors=True)


def _killed_and_rerun(tmp: Path, prep_args: dict, mb: float) -> None:
    from parallel3d.data.resume import STATE

    whole, cut = tmp / "out", tmp / "cut"
    shutil.rmtree(whole, ignore_errors=True)
    run_child(PREPARE, {**prep_args, "out": str(whole)})
    shutil.rmtree(cut, ignore_errors=True)

    def half_way() -> bool:
        try:
            return json.loads((cut / STATE).read_text())["disk_done"] >= mb * 1e6 / 2
        except (OSError, ValueError, KeyError):
            return False

    first = run_child(PREPARE, {**prep_args, "out": str(cut)}, kill_when=half_way)
    assert first["killed"], "prepare-data finished before half-way"
    state = json.loads((cut / STATE).read_text())
    kept = {s["file"]: (cut / s["file"]).stat().st_mtime_ns for s in state["writers"]["train"]["tokens"]["shards"]}
    second = run_child(PREPARE, {**prep_args, "out": str(cut)})
    report = json.loads((tmp / "prep.json").read_text())
    untouched = sum((cut / f).stat().st_mtime_ns == t for f, t in kept.items())
    same = all((cut / f.name).read_bytes() == f.read_bytes() for f in whole.iterdir() if f.is_file())
    same &= sorted(f.name for f in cut.iterdir()) == sorted(f.name for f in whole.iterdir())
    print(f"killed at {state['disk_done'] / 1e6:,.0f} of {mb:,.0f} MB after {first['wall']:.1f} s with "
          f"{len(kept)} training shards finished; the rerun took {second['wall']:.1f} s, resumed after "
          f"{report['resumed'] / 1e6:,.0f} MB, left {untouched} of those {len(kept)} shards untouched; "
          f"result {'identical byte for byte to' if same else 'DIFFERENT from'} the uninterrupted run")
