"""Measure a recipe's model at several world sizes, each at the planner's best layout.

Sizes run in increasing order, each as its own ``parallel3d train`` (a fresh set of local
processes, as a separate run would be) with the autopilot measuring and fitting but not
moving (``autopilot.act = false``): ``skip`` warm-up steps, ``measure`` measured steps,
one more. Each run leaves its measured medians and its fitted terms in its metrics.jsonl.
The layout of a size is the fastest fitting one by the terms fitted at the size before
(for the first size, which has nothing before it: pure data parallelism), so each
measured point after the first was also *predicted* before it ran: those predictions,
out of sample, are what the extrapolation's error bars rest on (:mod:`.curve`).

Each rank computes on one thread (``launch.threads_per_proc = 1`` unless the recipe sets
it): a rank is one core, as it would be one GPU, and OpenMP threads of one rank spinning
against other ranks on a loaded machine would measure the spinning.

Strong scaling keeps the recipe's global batch; weak scaling keeps its per-rank batch
(the recipe's global batch over its world size) and multiplies it by the size.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from parallel3d.autopilot.decide import GiB, layout_overrides, rank_layouts
from parallel3d.autopilot.measure import host_cores
from parallel3d.errors import UserError
from parallel3d.planner.fitted import FittedTerms
from parallel3d.planner.spec import Layout, Workload

SKIP, MEASURE = 5, 20  # steps of warm-up and of measurement at each size
BREAKDOWN = {"forward + backward": ("forward_s", "backward_s"), "optimizer + other": ("optimizer_s", "other_s"),
             "exposed comm": ("comm_exposed_s",), "bubble": ("bubble_s",), "data": ("data_wait_s",)}


@dataclass
class Point:
    ranks: int
    layout: Layout
    global_batch: int
    step_s: float  # median over the measured steps
    tokens_per_s: float
    breakdown: dict[str, float]  # seconds per step, medians (see BREAKDOWN)
    terms: FittedTerms
    predicted_s: float | None = None  # before it ran, from the size before
    its_best: str = ""  # the layout its own fit ranks first
    run_dir: str = ""
    extra: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {"ranks": self.ranks, "layout": self.layout.describe(), "global_batch": self.global_batch,
                "step_s": self.step_s, "tokens_per_s": self.tokens_per_s, "breakdown": self.breakdown,
                "predicted_s": self.predicted_s, "its_best": self.its_best, "run_dir": self.run_dir,
                "terms": self.terms.to_dict()}


def batch_at(cfg, ranks: int, weak: bool) -> int:
    """The global batch at ``ranks``: the recipe's (strong), or its per-rank batch times
    ``ranks`` (weak; at least one micro-batch per rank)."""
    if not weak:
        return cfg.train.global_batch
    world = cfg.launch.nnodes * cfg.launch.nproc
    per_rank = max(cfg.train.micro_batch, cfg.train.global_batch // world)
    return per_rank * ranks


def terms_at(terms: FittedTerms, threads: int, tps) -> FittedTerms:
    """``terms`` fitted at another size, for ranks of ``threads`` threads each, compute
    extended to every degree in ``tps``."""
    from dataclasses import replace

    return replace(terms.with_tps(tps), threads=threads)


def choose(work: Workload, ranks: int, micro_batch: int, terms: FittedTerms | None, ranks_per_host: int,
           budget: int, valid) -> tuple[Layout, float | None]:
    """(the layout to run at ``ranks``, its predicted step or None without terms)."""
    if terms is None:
        return Layout(tp=1, pp=1, dp=ranks, micro_batch=micro_batch, zero=1 if ranks > 1 else 0), None
    from parallel3d.planner.search import valid_layouts

    tps = {layout.tp for layout in valid_layouts(work, ranks, ranks_per_host, {"micro_batch": micro_batch})}
    ranked = rank_layouts(work, ranks, micro_batch, terms_at(terms, terms.threads, tps or {1}),
                          ranks_per_host, budget, 0.1, valid)
    best = next((o for o in ranked if o.fits), None)
    if best is None:
        raise UserError(f"no layout of {ranks} ranks fits (global batch {work.global_batch}, micro-batch "
                        f"{micro_batch}): leave {ranks} out of --ranks")
    return best.layout, best.step_s


def _overrides(layout: Layout, ranks: int, global_batch: int, run_dir: Path, threads: int) -> list[str]:
    keys = layout_overrides(layout)
    keys["train"].update(global_batch=global_batch, steps=SKIP + MEASURE + 1, autopilot=True)
    keys["launch"] = {"nproc": ranks, "nnodes": 1, "threads_per_proc": threads}
    keys["autopilot"] = {"act": False, "skip_steps": SKIP, "measure_steps": MEASURE}
    keys["eval"] = {"interval": 0}
    keys["checkpoint"] = {"interval": 0, "resume": "never", "export_hf": ""}
    keys["observability"] = {"progress": "off"}
    keys["run"] = {"dir": str(run_dir), "trace_steps": 0}
    # None (pp_layers: the balanced rule) is the default and has no TOML spelling
    return [f"--{s}.{k}={json.dumps(v)}" for s, kv in keys.items() for k, v in kv.items() if v is not None]


def run_size(recipe: str, overrides: list[str], ranks: int, layout: Layout, global_batch: int, seq_len: int,
             run_dir: Path, log, threads: int = 1) -> Point:
    """One size as its own ``parallel3d train``; its measurement read back."""
    from parallel3d.observe.report import load_events, load_metrics

    cmd = [sys.executable, "-m", "parallel3d.cli", "train", recipe, *overrides,
           *_overrides(layout, ranks, global_batch, run_dir, threads)]
    with open(run_dir.parent / f"{run_dir.name}.log", "w") as out:
        code = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT).returncode
    if code != 0:
        tail = (run_dir.parent / f"{run_dir.name}.log").read_text().splitlines()[-5:]
        raise UserError(f"the run at {ranks} ranks failed (exit {code}): " + " | ".join(tail))
    records, events = load_metrics(run_dir), load_events(run_dir)
    decision = next(e for e in events if e.get("event") == "autopilot" and "terms" in e)
    window = [r for r in records if SKIP < r["step"] <= SKIP + MEASURE]
    med = lambda k: statistics.median(r[k] for r in window)  # noqa: E731
    step_s = decision["measured_step_s"]
    point = Point(ranks, layout, global_batch, step_s, global_batch * seq_len / step_s,
                  {name: sum(med(k) for k in keys) for name, keys in BREAKDOWN.items()},
                  FittedTerms.from_dict(decision["terms"]), its_best=decision["ranked"][0]["layout"],
                  run_dir=str(run_dir))
    log(f"  {ranks} ranks at {layout.describe()}: {point.tokens_per_s:,.0f} tokens/s, step "
        f"{step_s * 1e3:.0f} ms")
    return point


def layout_check(cfg, model, ranks: int, global_batch: int):
    """A predicate: whether a layout of ``ranks`` ranks passes the job's checks
    (``check_job``) for ``cfg`` at ``global_batch``."""
    from parallel3d.autopilot.decide import with_layout
    from parallel3d.train.setup import check_job

    def valid(layout: Layout) -> bool:
        job = with_layout(cfg, layout)
        job.train.global_batch = global_batch
        try:
            check_job(job, model, ranks)
        except UserError:
            return False
        return True
    return valid


def sweep(recipe: str, overrides: list[str], ranks: list[int], weak: bool, out: Path, log=print) -> list[Point]:
    from parallel3d.config import load_config
    from parallel3d.model_config import resolve_model_config

    cfg = load_config(recipe, overrides)
    model = resolve_model_config(cfg.model)
    dtype = "bf16" if cfg.train.dtype == "bf16" else "fp32"
    cores = host_cores()
    points: list[Point] = []
    for n in sorted(ranks):
        work = Workload(model, cfg.train.seq_len, batch_at(cfg, n, weak), dtype)

        valid = layout_check(cfg, model, n, work.global_batch)
        prior = points[-1].terms if points else None
        budget = int(cfg.autopilot.memory_gib * GiB) if cfg.autopilot.memory_gib else 2**62
        layout, predicted = choose(work, n, cfg.train.micro_batch, prior, n, budget, valid)
        log(f"size {n}: {layout.describe()}" + (f" (predicted {predicted * 1e3:.0f} ms a step)" if predicted else
                                                 " (first size: nothing fitted yet, data parallel)"))
        point = run_size(recipe, overrides, n, layout, work.global_batch, cfg.train.seq_len, out / f"ranks{n}", log,
                         threads=cfg.launch.threads_per_proc or 1)
        point.predicted_s = predicted
        point.extra["cores"] = cores
        points.append(point)
    return points
