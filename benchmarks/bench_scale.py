"""Real scale on CPU: a 500 M-parameter model trains at tp 2 x pp 2 with every rank
holding only its share, measured (resident high-water mark) against the planner and the bound.

    python benchmarks/bench_scale.py                 # tp2 pp2 from random init and from an HF folder
    python benchmarks/bench_scale.py --layouts all   # and four more layouts
    python benchmarks/bench_scale.py --host-memory fast   # at the trainer's default allocator setting

The model (an HF-style config: hidden 1536, 16 layers, 12 heads, 4 kv-heads, MLP 4096,
vocabulary 32000, untied) has 501 M parameters: 2.0 GB in fp32. Each layout runs
``parallel3d train`` for 2 steps in fresh processes (the resident high-water mark of a
process never goes down, so every measurement needs its own), reading per rank:

The runs use ``launch.host_memory = "tight"`` unless ``--host-memory`` says otherwise:
resident memory then follows what the tensors hold. At the trainer's default (``fast``)
glibc keeps freed buffers under 4 MiB for reuse, which no bound of tensors counts
(measured: rank 0 at tp 2 x pp 2, 2724 MiB fast against 2639 tight and a bound of 2682).

* measured: the process's peak resident set (``ru_maxrss``, gathered at the straggler
  check of step 2 into ``RUN_DIR/ranks.jsonl``);
* own: the bytes of parameters, gradients and optimizer state the rank holds, read from
  its tensors' storages (``RUN_DIR/memory.json``);
* base: what a rank holds besides its share, imports and runtime: the same measurement
  for the same layout with a model of a few MB (``TINY``), run just before;
* bound = base + own + the largest single full tensor of the model (fp32);
* predicted = base + the planner's peak for the rank's pipeline stage, start-up
  included (``parallel3d.planner.memory``, fp32, gloo's temporaries included).

The run from a Hugging Face folder writes the model once (``/tmp/p3d-bench-scale/hf``,
the same counter-based initial weights, streamed tensor by tensor) and starts training
from it with ``model.hf_checkpoint``: each rank reads only its slices. Its losses equal
the random-init run's (the same weights), which the benchmark checks.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WORK = Path("/tmp/p3d-bench-scale")
MODEL = {"preset": "debug", "vocab_size": 32000, "dim": 1536, "n_layers": 16, "n_heads": 12,
         "n_kv_heads": 4, "ffn_dim": 4096, "tie_embeddings": False}
TINY = {"preset": "debug", "vocab_size": 512, "dim": 64, "n_layers": 4, "n_heads": 4,
        "n_kv_heads": 2, "ffn_dim": 128, "tie_embeddings": False}
TRAIN = {"steps": 2, "seq_len": 64, "micro_batch": 1, "global_batch": 4, "seed": 1234,
         "lr": 1e-4, "warmup_steps": 0, "log_interval": 1}
# name -> parallel keys (4 processes each, 8 for tp2 pp4)
_PLAIN = {"zero": 0, "sequence_parallel": False, "schedule": "1f1b"}
LAYOUTS = {
    "tp2 pp2": {"tp": 2, "pp": 2, "dp": 1, **_PLAIN},
    "tp2 pp2 sp zero1": {"tp": 2, "pp": 2, "dp": 1, **_PLAIN, "zero": 1, "sequence_parallel": True},
    "pp4": {"tp": 1, "pp": 4, "dp": 1, **_PLAIN},
    "tp2 dp2 zero2": {"tp": 2, "pp": 1, "dp": 2, **_PLAIN, "zero": 2},
    "tp4": {"tp": 4, "pp": 1, "dp": 1, **_PLAIN},
    "tp2 pp4": {"tp": 2, "pp": 4, "dp": 1, **_PLAIN},  # 8 processes
}


def overrides(model: dict, parallel: dict, run_dir: Path, extra: dict | None = None) -> list[str]:
    job = {"model": dict(model), "parallel": dict(parallel), "train": dict(TRAIN),
           "data": {"max_bytes": 1_000_000, "vocab_size": 512, "cache_dir": str(WORK / "corpus")},
           "launch": {"nproc": math.prod(parallel[k] for k in ("tp", "pp", "dp"))},
           "observability": {"straggler_interval": 2, "progress": "off"},
           "eval": {"interval": 0}, "run": {"dir": str(run_dir)}}
    for section, keys in (extra or {}).items():
        job.setdefault(section, {}).update(keys)
    return [f"--{s}.{k}={json.dumps(v)}" for s, keys in job.items() for k, v in keys.items()]


def train(model: dict, parallel: dict, run_dir: Path, extra: dict | None = None) -> dict:
    """Run ``parallel3d train`` in fresh processes; per rank: peak RSS, own bytes, coords."""
    cmd = [sys.executable, "-m", "parallel3d.cli", "train", *overrides(model, parallel, run_dir, extra)]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"training failed ({done.returncode}):\n{done.stderr[-3000:]}")
    ranks = json.loads((run_dir / "ranks.jsonl").read_text().splitlines()[-1])["ranks"]
    own = json.loads((run_dir / "memory.json").read_text())
    losses = [json.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {"ranks": ranks, "own": own, "losses": losses}


def predicted_stage_peaks(parallel: dict) -> list[int]:
    from parallel3d.config import config_from_dict
    from parallel3d.planner.memory import memory_per_stage
    from parallel3d.planner.spec import Layout, Workload
    from parallel3d.train.setup import resolve_model_config

    cfg = config_from_dict({"model": MODEL, "parallel": parallel, "train": TRAIN})
    work = Workload(resolve_model_config(cfg.model), TRAIN["seq_len"], TRAIN["global_batch"], "fp32")
    return [s.peak for s in memory_per_stage(work, Layout.from_config(cfg), gloo=True)]


def write_hf_model(folder: Path, shard_bytes: int = 512 * 2**20) -> None:
    """The model's counter-initialised weights (what the trainer's seeded init gives) as a
    Hugging Face folder: generated one full tensor at a time and written in safetensors
    shards of at most ``shard_bytes`` (this setup process holds one shard, not the model)."""
    if (folder / "config.json").exists():
        return
    import torch
    from safetensors.torch import save_file

    from parallel3d.config import config_from_dict
    from parallel3d.models.llama import Llama
    from parallel3d.models.llama.hf import config_to_hf, name_to_hf
    from parallel3d.models.llama.sharded_init import init_parameter_
    from parallel3d.train.setup import resolve_model_config

    cfg = resolve_model_config(config_from_dict({"model": MODEL}).model)
    with torch.device("meta"):
        shapes = {n: tuple(p.shape) for n, p in Llama(cfg).named_parameters()}
    tmp = folder.with_name(folder.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    weight_map, shard, size, files = {}, {}, 0, []

    def flush():
        nonlocal shard, size
        if shard:
            files.append(f"model-{len(files) + 1:05d}.safetensors")
            save_file(shard, str(tmp / files[-1]), metadata={"format": "pt"})
            weight_map.update({key: files[-1] for key in shard})
            shard, size = {}, 0

    for name, shape in shapes.items():
        tensor = init_parameter_(torch.empty(shape), name, cfg, TRAIN["seed"])
        if size and size + tensor.nbytes > shard_bytes:
            flush()
        shard[name_to_hf(name)] = tensor
        size += tensor.nbytes
    flush()
    total = sum(4 * math.prod(s) for s in shapes.values())
    (tmp / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    (tmp / "config.json").write_text(json.dumps(config_to_hf(cfg), indent=2))
    tmp.rename(folder)


def _largest(model: dict) -> int:
    from parallel3d.config import config_from_dict
    from parallel3d.train.setup import resolve_model_config

    cfg = resolve_model_config(config_from_dict({"model": model}).model)
    return 4 * max(cfg.vocab_size * cfg.dim, cfg.dim * cfg.ffn_dim)


def report(name: str, got: dict, base: dict, parallel: dict, out=print) -> tuple[float, bool]:
    """Print every rank's line; returns (worst |predicted / measured - 1|, all within bound)."""
    largest = _largest(MODEL)
    stages = predicted_stage_peaks(parallel)
    base_of = {r["rank"]: r["peak_mem_bytes"] for r in base["ranks"]}
    worst, ok = 0.0, True
    for r, own in zip(got["ranks"], got["own"]):
        held = own["params"] + own["grads"] + own["optimizer_state"]
        b = base_of[r["rank"]]
        bound = b + held + largest
        pred = b + stages[r["pp"]]
        m = r["peak_mem_bytes"]
        worst = max(worst, abs(pred / m - 1))
        ok = ok and m <= bound
        verdict = "within" if m <= bound else f"over by {(m - bound) / 2**20:.0f}"
        out(f"{name:24s} rank {r['rank']} (tp {r['tp']} pp {r['pp']} dp {r['dp']}): measured {m / 2**20:6.0f} MiB"
            f"  predicted {pred / 2**20:6.0f} ({pred / m:5.3f})  bound {bound / 2**20:6.0f} {verdict}"
            f"  [own {held / 2**20:.0f}, base {b / 2**20:.0f}, largest {largest / 2**20:.0f}]")
    return worst, ok


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layouts", default="tp2 pp2", help="comma-separated names, or 'all'")
    ap.add_argument("--no-hf", action="store_true", help="skip the run from a Hugging Face folder")
    ap.add_argument("--host-memory", default="tight", choices=("tight", "fast", "libc"),
                    help="launch.host_memory of the runs (default tight: resident memory follows the tensors)")
    args = ap.parse_args(argv)
    # "tight" (the default here) makes a rank's resident memory follow what its tensors
    # hold; the trainer's default, "fast", lets glibc keep freed buffers under 4 MiB in its
    # heap (parallel3d/distributed.py), which the bound does not count
    launch = {"launch": {"host_memory": args.host_memory}}
    print(f"launch.host_memory = {args.host_memory}")
    names = list(LAYOUTS) if args.layouts == "all" else [n.strip() for n in args.layouts.split(",")]
    WORK.mkdir(parents=True, exist_ok=True)
    worst, within = 0.0, {}
    for name in names:
        parallel = LAYOUTS[name]
        tag = name.replace(" ", "_")
        base = train(TINY, parallel, WORK / f"tiny-{tag}", launch)
        got = train(MODEL, parallel, WORK / f"run-{tag}", launch)
        w, within[name] = report(name, got, base, parallel)
        worst = max(worst, w)
        if name == "tp2 pp2" and not args.no_hf:
            hf = WORK / "hf"
            write_hf_model(hf)
            size = sum(f.stat().st_size for f in hf.glob("*.safetensors"))
            from_hf = train(MODEL, parallel, WORK / "run-hf", {**launch, "model": {"hf_checkpoint": str(hf)}})
            w, within[f"{name} from HF"] = report(f"{name} from HF {size / 1e9:.2f} GB", from_hf, base, parallel)
            worst = max(worst, w)
            same = from_hf["losses"] == got["losses"]
            print(f"losses from the HF folder {'equal' if same else 'DIFFER FROM'} the random-init run's: "
                  f"{from_hf['losses']} vs {got['losses']}")
    # The bound is the acceptance's for the tp 2 x pp 2 runs; at other layouts a rank also
    # holds what the planner counts beyond it (activations of more micro-batches in flight,
    # stage 2's buckets and gloo's receive buffers), which the prediction includes.
    print("within own + largest + base: " + ", ".join(f"{k}: {'yes' if v else 'no'}" for k, v in within.items()))
    print(f"worst |predicted / measured - 1| = {worst:.1%} (acceptance: <= 15%)")
    return 0 if all(v for k, v in within.items() if k.startswith("tp2 pp2")) and worst <= 0.15 else 1


if __name__ == "__main__":
    sys.exit(main())
