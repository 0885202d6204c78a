"""``parallel3d report RUN_DIR``: a PNG of a finished (or running) run and a text summary.

Reads ``RUN_DIR/metrics.jsonl`` and writes ``RUN_DIR/report.png`` with four panels: the
loss curve, throughput over time, the step-time breakdown per step (stacked, the mean over
ranks) and the per-rank spread of busy time (the part of each step a rank was not waiting
on another one; see :mod:`parallel3d.observe.stats`). Needs matplotlib
(``pip install parallel3d[report]``).
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from parallel3d.errors import UserError
from parallel3d.observe.stats import BREAKDOWN

_LABELS = {"data_wait_s": "data wait", "forward_s": "forward", "backward_s": "backward",
           "optimizer_s": "optimizer", "comm_exposed_s": "exposed comm", "bubble_s": "pipeline bubble",
           "other_s": "other"}


_REQUIRED = ("step", "loss", "tokens_per_s", "step_time_s")  # what the summary and plots read


def load_metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if run_dir.exists() and not run_dir.is_dir():
        raise UserError(f"'{run_dir}' is a file: give the run directory of a training run (run.dir)")
    if not path.is_file():
        raise UserError(f"{path} does not exist: give the run directory of a training run (run.dir)")
    try:
        lines = [(n, line) for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
                 if line.strip()]
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"{path} cannot be read: {e}") from None
    records = []
    for i, (n, line) in enumerate(lines):
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            if i == len(lines) - 1:
                break  # the last line of a run killed while writing it
            raise UserError(f"{path} line {n} is not JSON: is this a parallel3d metrics file?") from None
        if not isinstance(record, dict) or not all(k in record for k in _REQUIRED):
            raise UserError(f"{path} line {n} is not a parallel3d step record (needs "
                            f"{', '.join(_REQUIRED)})")
        records.append(record)
    if not records:
        raise UserError(f"{path} holds no steps yet")
    return records


def summary(records: list[dict]) -> str:
    """A few lines: steps, final loss, median throughput and step time, the median
    breakdown's shares, and the slowest rank."""
    last = records[-1]
    # Step 1 includes one-off work (allocations, first collectives): medians leave it out.
    steady = records[1:] or records
    med = lambda key: statistics.median(r[key] for r in steady)  # noqa: E731
    step = med("step_time_s")
    lines = [f"steps {last['step']}  final loss {last['loss']:.4f}  median {med('tokens_per_s'):,.0f} tok/s  "
             f"median step {step * 1e3:.1f} ms"]
    if "mfu" in last:
        lines.append(f"median MFU {med('mfu') * 100:.1f}%  ({med('tflops_per_device'):.1f} TFLOP/s per device)")
    elif "tflops_per_device" in last:
        lines.append(f"{med('tflops_per_device'):.3f} TFLOP/s per device (no MFU: peak unknown for this device)")
    if all(k in last for k in BREAKDOWN):
        total = sum(med(k) for k in BREAKDOWN) or 1.0
        lines.append("breakdown (median, share): " + ", ".join(
            f"{_LABELS[k]} {med(k) / total * 100:.0f}%" for k in BREAKDOWN))
    if "rank_busy_s" in last:
        per_rank = [statistics.median(r["rank_busy_s"][i] for r in steady) for i in range(len(last["rank_busy_s"]))]
        slow = max(range(len(per_rank)), key=per_rank.__getitem__)
        lines.append(f"slowest rank {slow}: median busy {per_rank[slow] * 1e3:.1f} ms vs median rank "
                     f"{statistics.median(per_rank) * 1e3:.1f} ms")
    flagged = sorted({s["rank"] for r in records for s in r.get("stragglers", [])})
    if flagged:
        lines.append(f"stragglers flagged: ranks {', '.join(map(str, flagged))}")
    if "peak_mem_bytes" in last:
        lines.append(f"peak memory {max(r['peak_mem_bytes'] for r in records) / 2**30:.2f} GiB "
                     f"({last.get('mem_source', '')}, max over ranks)")
    return "\n".join(lines)


def plot(records: list[dict], out: Path) -> None:
    try:
        import matplotlib
    except ImportError:
        raise UserError("parallel3d report needs matplotlib: pip install matplotlib "
                        "(or pip install parallel3d[report])") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in records]
    fig, ax = plt.subplots(2, 2, figsize=(12, 8), dpi=100)
    ax[0, 0].plot(steps, [r["loss"] for r in records], color="tab:blue")
    ax[0, 0].set(title="loss", xlabel="step")
    elapsed = []
    t = 0.0
    for r in records:
        t += r["step_time_s"]
        elapsed.append(t)
    ax[0, 1].plot(elapsed, [r["tokens_per_s"] for r in records], color="tab:green")
    ax[0, 1].set(title="throughput (tokens/s)", xlabel="training time (s, sum of step times)")
    if all(k in records[0] for k in BREAKDOWN):
        ax[1, 0].stackplot(steps, *[[r[k] * 1e3 for r in records] for k in BREAKDOWN],
                           labels=[_LABELS[k] for k in BREAKDOWN])
        ax[1, 0].legend(loc="upper right", fontsize=8)
    ax[1, 0].set(title="step-time breakdown (mean over ranks, ms)", xlabel="step")
    if "rank_busy_s" in records[0]:
        n = len(records[0]["rank_busy_s"])
        data = [[r["rank_busy_s"][i] * 1e3 for r in records[1:] or records] for i in range(n)]
        ax[1, 1].boxplot(data, positions=list(range(n)))
    ax[1, 1].set(title="per-rank busy time per step (ms, step 1 left out)", xlabel="rank")
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)


def write_report(run_dir: str | Path, out=print) -> Path:
    run_dir = Path(run_dir)
    records = load_metrics(run_dir)
    png = run_dir / "report.png"
    plot(records, png)
    out(summary(records))
    out(f"wrote {png}")
    return png
