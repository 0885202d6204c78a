"""The compute efficiency: its default, and refreshing it from a run's ``metrics.jsonl``.

The predicted step falls as ``efficiency.compute`` grows: the compute shrinks as
``1 / efficiency``, and the communication it hides (:mod:`parallel3d.planner.overlap`) can
only show more of itself, never more than the compute saved. Given a measured step time
``T``, the efficiency is the one whose predicted step is ``T``, found by bisection. The
default is this inversion applied to one published anchor run
(:data:`~parallel3d.planner.published.ANCHOR`) and then used for every GPU: one figure,
not fitted to the runs the planner is tested on.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import replace
from functools import lru_cache
from pathlib import Path

from parallel3d.errors import UserError
from parallel3d.flops import model_flops_per_token
from parallel3d.planner.hardware import GPU, Efficiency, gpu_named
from parallel3d.planner.spec import Layout, Workload


def solve_compute_efficiency(work: Workload, layout: Layout, gpu: GPU, gpus_per_node: int,
                             tokens_per_s: float, eff: Efficiency | None = None) -> float:
    """The ``efficiency.compute`` at which the time model gives ``tokens_per_s``."""
    from parallel3d.planner.timing import step_time

    base = eff or Efficiency(compute=1.0)  # compute is what is being solved for

    def step(e: float) -> float:
        return step_time(work, layout, gpu, gpus_per_node, replace(base, compute=e)).step_s

    measured = work.tokens_per_step / tokens_per_s
    floor = step(1e9)  # the communication and the optimizer step alone
    if measured <= floor:
        raise UserError(f"the measured step ({measured:.3g} s) is shorter than the modelled communication "
                        f"alone ({floor:.3g} s): the link figures are too pessimistic for this run")
    lo, hi = 1e-6, 1.0
    while step(hi) > measured:  # faster than the peak: an efficiency above 1 says so
        lo, hi = hi, hi * 2
    for _ in range(200):  # the step is non-increasing in the efficiency
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if step(mid) > measured else (lo, mid)
        if hi - lo <= 1e-13 * hi:
            break
    return (lo + hi) / 2


@lru_cache(maxsize=1)
def default_efficiency() -> Efficiency:
    """:class:`Efficiency` with ``compute`` inverted from the published anchor run."""
    from parallel3d.planner.published import ANCHOR, anchor_layout

    gpu = gpu_named(ANCHOR.gpu)
    tokens_per_s = ANCHOR.mfu * ANCHOR.n_gpus * gpu.peak_flops / model_flops_per_token(
        ANCHOR.work.model, ANCHOR.work.seq_len)
    e = solve_compute_efficiency(ANCHOR.work, anchor_layout(ANCHOR), gpu, ANCHOR.gpus_per_node, tokens_per_s)
    return Efficiency(compute=e)


def read_metrics(path: str | Path) -> tuple[dict, float]:
    """(config dict, median tokens/s) of a run: ``RUN_DIR/metrics.jsonl`` beside ``config.json``.

    The first step (compilation, allocator warm-up) and any step before the tenth when the
    run has more than ten are left out of the median. A run the autopilot moved counts
    from its last move on (config.json holds the layout it moved to)."""
    path = Path(path)
    metrics = path if path.name.endswith(".jsonl") else path / "metrics.jsonl"
    config = metrics.parent / "config.json"
    for p in (metrics, config):
        if not p.is_file():
            raise UserError(f"calibration needs {p}: give a run directory holding metrics.jsonl and config.json")
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    moved = [r["step"] for r in rows if r.get("event") == "autopilot" and r.get("action", "").endswith("done")]
    rates = [r["tokens_per_s"] for r in rows if "tokens_per_s" in r and r["step"] > max(moved, default=0)]
    if len(rates) < 2:
        raise UserError(f"{metrics} has {len(rates)} steps: calibration needs at least 2 (the first is skipped)")
    skip = 10 if len(rates) > 20 else 1
    return json.loads(config.read_text()), statistics.median(rates[skip:])


def calibrate_from_run(path: str | Path, gpu: GPU, gpus_per_node: int) -> tuple[Efficiency, str]:
    """(efficiency refreshed from the run, a one-line account of how)."""
    from parallel3d.config import config_from_dict
    from parallel3d.model_config import resolve_model_config

    data, tokens_per_s = read_metrics(path)
    cfg = config_from_dict(data)
    dtype = "fp32" if cfg.train.dtype == "fp32" else "bf16"
    work = Workload(resolve_model_config(cfg.model), cfg.train.seq_len, cfg.train.global_batch, dtype)
    layout = Layout.from_config(cfg)
    e = solve_compute_efficiency(work, layout, gpu, gpus_per_node, tokens_per_s, default_efficiency())
    how = (f"compute efficiency {e:.3f} from {tokens_per_s:,.0f} tokens/s measured with "
           f"{layout.describe()} (default {default_efficiency().compute:.3f})")
    return replace(default_efficiency(), compute=e), how
