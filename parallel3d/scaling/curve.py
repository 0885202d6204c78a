"""The scaling curve: efficiency against linear, the extension past this machine, the
size where it flattens, and the table.

Extension: the recipe's own world size ``G`` (``launch.nnodes * launch.nproc``) and ``2G``,
``4G`` (the sizes measured here are left out), on hosts like this one, each holding the
recipe's ``launch.nproc`` ranks, with the terms fitted at the largest measured size (the
cores the job got, the collective and compute costs) and hosts joined by a link of
``inter_gbit`` Gbit/s, whose bytes (data-parallel collectives leaving a host, pipeline
sends) add to the critical path. The link is an assumption, not a measurement: one host
cannot measure it. The error bar of an extended point is the largest relative error of the
predictions made here before a size ran (each from the size before it): what the
calibration has shown it can do out of sample, no more.

Where it flattens: the smallest size whose tokens/s is within ``FLAT`` of the best of the
whole curve, measured and extended: beyond it, ranks buy less than that.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from parallel3d.autopilot.decide import rank_layouts
from parallel3d.planner.search import valid_layouts
from parallel3d.planner.spec import Layout, Workload

FLAT = 0.10


@dataclass
class Extended:
    ranks: int
    hosts: int
    layout: Layout | None
    step_s: float
    tokens_per_s: float
    error: float  # relative, +-
    note: str = ""


def efficiencies(points) -> list[float]:
    """Tokens/s of each size over linear scaling from the smallest measured size."""
    base = points[0]
    return [p.tokens_per_s / (base.tokens_per_s * p.ranks / base.ranks) for p in points]


def out_of_sample_errors(points) -> list[float]:
    """predicted / measured - 1 of each size predicted before it ran."""
    return [p.predicted_s / p.step_s - 1 for p in points if p.predicted_s]


def extend(points, model, seq_len: int, dtype: str, batch_at, micro_batch: int, sizes: list[int],
           ranks_per_host: int, inter_gbit: float, valid_for) -> list[Extended]:
    """The curve at ``sizes`` on hosts like this one (see the module docstring).
    ``batch_at(n)``: the global batch at ``n`` ranks; ``valid_for(n, work)``: the
    trainer's checks of a layout at ``n`` ranks."""
    from parallel3d.scaling.sweep import terms_at

    last = points[-1]
    errors = out_of_sample_errors(points)
    error = max((abs(e) for e in errors), default=float("nan"))
    out = []
    for n in sizes:
        hosts = max(1, -(-n // ranks_per_host))
        per_host = min(n, ranks_per_host)
        work = Workload(model, seq_len, batch_at(n), dtype)
        tps = {layout.tp for layout in valid_layouts(work, n, per_host, {"micro_batch": micro_batch})}
        if not tps:
            out.append(Extended(n, hosts, None, float("nan"), float("nan"), error,
                                f"no valid layout of {n} ranks for a global batch of {work.global_batch}"))
            continue
        terms = replace(terms_at(last.terms, last.terms.threads, tps),
                        wire=8 / (inter_gbit * 1e9) if hosts > 1 else 0.0)
        ranked = rank_layouts(work, n, micro_batch, terms, per_host, 2**62, 0.0, valid_for(n, work))
        best = next((o for o in ranked if o.fits), None)
        if best is None:
            out.append(Extended(n, hosts, None, float("nan"), float("nan"), error, "no layout passes the checks"))
            continue
        out.append(Extended(n, hosts, best.layout, best.step_s, work.tokens_per_step / best.step_s, error))
    return out


def flattens_at(points, extended: list[Extended]) -> int:
    """The smallest size within :data:`FLAT` of the best tokens/s of the whole curve."""
    curve = sorted([(p.ranks, p.tokens_per_s) for p in points]
                   + [(e.ranks, e.tokens_per_s) for e in extended if e.layout is not None])
    best = max(t for _, t in curve)
    return next(n for n, t in curve if t >= (1 - FLAT) * best)


def table(points, extended: list[Extended], weak: bool, flat: int, inter_gbit: float) -> list[str]:
    kind = "weak (per-rank batch kept)" if weak else "strong (global batch kept)"
    lines = [f"scaling, {kind}; efficiency against linear from {points[0].ranks} rank(s)",
             f"{'ranks':>5}  {'layout':<34} {'tokens/s':>10} {'step ms':>8} {'eff':>5}  "
             f"{'fwd+bwd':>8} {'opt+oth':>8} {'exp.comm':>8} {'bubble':>7} {'data':>6}  predicted before run"]
    for p, eff in zip(points, efficiencies(points)):
        b = p.breakdown
        pred = (f"{p.predicted_s * 1e3:.0f} ms ({p.predicted_s / p.step_s - 1:+.0%})" if p.predicted_s
                else "-")
        lines.append(f"{p.ranks:>5}  {p.layout.describe():<34} {p.tokens_per_s:>10,.0f} {p.step_s * 1e3:>8.1f} "
                     f"{eff:>5.0%}  " + " ".join(f"{b[k] * 1e3:>{w}.1f}" for k, w in zip(
                         ("forward + backward", "optimizer + other", "exposed comm", "bubble", "data"),
                         (8, 8, 8, 7, 6))) + f"  {pred}")
    if extended:
        base = points[0]
        lines.append(f"extended (hosts like this one, {inter_gbit:g} Gbit/s between them, assumed):")
        for e in extended:
            if e.layout is None:
                lines.append(f"{e.ranks:>5}  {e.note}")
                continue
            eff = e.tokens_per_s / (base.tokens_per_s * e.ranks / base.ranks)
            err = f" +- {e.error:.0%}" if e.error == e.error else " (no out-of-sample error measured)"
            lines.append(f"{e.ranks:>5}  {e.layout.describe():<34} {e.tokens_per_s:>10,.0f} {e.step_s * 1e3:>8.1f} "
                         f"{eff:>5.0%}  on {e.hosts} host(s){err}")
    lines.append(f"the curve flattens at {flat} rank(s): no size gives {FLAT:.0%} more tokens/s than it")
    return lines
