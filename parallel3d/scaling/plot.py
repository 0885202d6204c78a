"""``scaling.png``: tokens/s against ranks (measured, linear, extended with error bars, the
flattening point) and where the time goes at each measured size."""

from __future__ import annotations

from pathlib import Path

from parallel3d.errors import UserError
from parallel3d.observe.report import INSTALL_HINT
from parallel3d.scaling.sweep import BREAKDOWN


def build_figure(points, extended, flat: int, title: str):
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise UserError(f"parallel3d scaling draws its curve with matplotlib: {INSTALL_HINT}") from None
    fig = Figure(figsize=(13, 5), dpi=100, layout="constrained")
    curve, bars = fig.subplots(1, 2)
    fig.suptitle(title, fontsize=11)
    ranks = [p.ranks for p in points]
    base = points[0]
    shown = [e for e in extended if e.layout is not None]
    top = max(ranks + [e.ranks for e in shown])
    line = [n for n in sorted(set(ranks + [e.ranks for e in shown])) if n <= top]
    curve.plot(line, [base.tokens_per_s * n / base.ranks for n in line], ":", color="gray", label="linear")
    curve.plot(ranks, [p.tokens_per_s for p in points], "o-", color="tab:blue", label="measured")
    if shown:
        xs = [points[-1].ranks] + [e.ranks for e in shown]
        ys = [points[-1].tokens_per_s] + [e.tokens_per_s for e in shown]
        errs = [0.0] + [e.tokens_per_s * e.error if e.error == e.error else 0.0 for e in shown]
        curve.errorbar(xs, ys, yerr=errs, fmt="s--", color="tab:orange", capsize=4,
                       label="extended (fitted model, hosts like this one)")
    curve.axvline(flat, color="tab:red", linewidth=1, label=f"flattens at {flat}")
    curve.set_xscale("log", base=2)
    curve.set_yscale("log")
    curve.set_xticks(line, [str(n) for n in line])
    curve.set(title="throughput", xlabel="ranks", ylabel="tokens/s")
    curve.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.02, 1.0), frameon=False)
    bottom = [0.0] * len(points)
    for name in BREAKDOWN:
        heights = [p.breakdown[name] * 1e3 for p in points]
        bars.bar([str(n) for n in ranks], heights, bottom=bottom, label=name)
        bottom = [b + h for b, h in zip(bottom, heights)]
    bars.set(title="where a step goes (medians, mean over ranks)", xlabel="ranks", ylabel="ms")
    bars.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.02, 1.0), frameon=False)
    return fig


def plot(points, extended, flat: int, title: str, out: Path) -> None:
    build_figure(points, extended, flat, title).savefig(out)
