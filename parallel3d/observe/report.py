"""``parallel3d report RUN_DIR``: a PNG of a finished (or running) run and a text summary.

Reads ``RUN_DIR/metrics.jsonl`` (and ``config.json`` beside it, for the title and the
ranks' coordinates) and writes ``RUN_DIR/report.png``: a title naming the run, its layout
and its model, and four panels, every x-axis in steps:

* loss: the training loss raw (thin) and smoothed (a trailing mean), and the held-out
  loss at each evaluation; for a Mixture-of-Experts run, the experts' imbalance (max /
  mean tokens per expert, the worst layer) on a second axis;
* throughput: tokens/s raw and smoothed, and MFU on a second axis when the run had a
  known GPU peak;
* the step-time breakdown per step, stacked (means over ranks, see
  :mod:`parallel3d.observe.stats`);
* busy time per rank (the part of each step a rank was not waiting on another), one box
  per rank labelled with its tp/pp/dp coordinates.

A run the autopilot moved (``train.autopilot``) has its moves drawn as vertical lines on
the step panels, labelled with the new layout, and its decisions (measured and predicted
step times, why it moved or stayed) in the summary.

Legends sit beside their panels, never over the curves. The figure is drawn by
:mod:`parallel3d.observe.figure` (``build_figure`` returns the ``matplotlib`` figure
itself, no pyplot state, so tests read its axes); this module loads the run and writes
the summary. Needs matplotlib:
``pip install -e ".[report]"`` in the checkout, or ``pip install matplotlib``.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from parallel3d.data.stalls import DATA_BOUND_SHARE
from parallel3d.errors import UserError
from parallel3d.observe.figure import (INSTALL_HINT, LABELS, build_figure, moves, plot,  # noqa: F401 - re-exported
                                       smooth, source_names)
from parallel3d.observe.stats import BREAKDOWN


_REQUIRED = ("step", "loss", "tokens_per_s", "step_time_s")  # what the summary and plots read


def load_metrics(run_dir: Path) -> list[dict]:
    """The step records of ``RUN_DIR/metrics.jsonl`` (event lines, such as the autopilot's
    decisions, are left out: :func:`load_events`)."""
    return _load_lines(run_dir)[0]


def load_events(run_dir: Path) -> list[dict]:
    """The lines of ``RUN_DIR/metrics.jsonl`` that are events (``"event": ...``), in order."""
    return _load_lines(run_dir)[1]


def _load_lines(run_dir: Path) -> tuple[list[dict], list[dict]]:
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
    records, events = [], []
    for i, (n, line) in enumerate(lines):
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            if i == len(lines) - 1:
                break  # the last line of a run killed while writing it
            raise UserError(f"{path} line {n} is not JSON: is this a parallel3d metrics file?") from None
        if isinstance(record, dict) and "event" in record and "step" in record:
            events.append(record)
            continue
        if not isinstance(record, dict) or not all(k in record for k in _REQUIRED):
            raise UserError(f"{path} line {n} is not a parallel3d step record (needs "
                            f"{', '.join(_REQUIRED)})")
        records.append(record)
    if not records:
        raise UserError(f"{path} holds no steps yet")
    return records, events


def load_job(run_dir: Path) -> dict | None:
    """``RUN_DIR/config.json`` as a dict, or None when absent or unreadable (the report
    then names ranks by number only)."""
    try:
        job = json.loads((run_dir / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return job if isinstance(job, dict) and isinstance(job.get("parallel"), dict) else None


def autopilot_lines(events: list[dict]) -> list[str]:
    """One line per decision of the autopilot (metrics.jsonl events)."""
    out = []
    for e in events:
        if e.get("event") != "autopilot" or e.get("action", "").endswith("done"):
            continue
        if "predicted_current_s" in e:  # a decision to move or stay
            out.append(f"autopilot, step {e['step']}: {e['action']} {e['from']} ({e['measured_step_s'] * 1e3:.0f} ms "
                       f"measured) -> {e['to']} ({e['predicted_step_s'] * 1e3:.0f} ms predicted): {e['reason']}")
        else:  # the check of a move
            out.append(f"autopilot, step {e['step']}: {e['action']}: {e['reason']}")
    return out


def resize_lines(events: list[dict]) -> list[str]:
    """One line per change of world size (elastic runs: parallel3d/reliability/elastic.py)."""
    out = []
    for e in events:
        if e.get("event") == "resize":
            parts = ", ".join(f"{k.replace('_', ' ')} {v:.1f} s" for k, v in e["phases_s"].items())
            out.append(f"resize, step {e['step']}: {e['from_world']} -> {e['to_world']} ranks, "
                       f"{e['recovery_s']:.1f} s from the last step logged to the first forward ({parts})")
    return out


# A rank is named the slowest only when its median busy time exceeds the fastest's by this
# share: below it, which rank is "slowest" is noise (0.3 ms in 40 ms).
SLOWEST_GAP = 0.05


def steady_records(records: list[dict]) -> list[dict]:
    """The records medians are taken over: the first step of a run (or of a resumed one)
    includes one-off work (allocations, first collectives) and is left out, unless it is
    the only one. The console's summary and the report share it, so their median step is
    one number."""
    return records[1:] or records


def summary(records: list[dict], events: list[dict] = ()) -> str:
    """A few lines: steps, final loss, held-out loss, median throughput and step time, the
    median breakdown's shares, the slowest rank, the autopilot's decisions and the changes
    of world size."""
    last = records[-1]
    steady = steady_records(records)
    med = lambda key: statistics.median(r[key] for r in steady)  # noqa: E731
    step = med("step_time_s")
    lines = [f"steps {last['step']}  final loss {last['loss']:.4f}  median {med('tokens_per_s'):,.0f} tok/s  "
             f"median step {step * 1e3:.1f} ms"]
    evals = [(r["step"], r["val_loss"]) for r in records if "val_loss" in r]
    if evals:
        best = min(evals, key=lambda e: e[1])
        lines.append(f"held-out loss {evals[-1][1]:.4f} at step {evals[-1][0]} (best {best[1]:.4f} at step "
                     f"{best[0]}, {len(evals)} evaluation{'s' if len(evals) != 1 else ''})")
    if "mfu" in last:
        lines.append(f"median MFU {med('mfu') * 100:.1f}%  ({med('tflops_per_device'):.1f} TFLOP/s per device)")
    elif "tflops_per_device" in last:
        lines.append(f"{med('tflops_per_device'):.3f} TFLOP/s per device (no MFU: peak unknown for this device)")
    if all(k in last for k in BREAKDOWN):
        total = sum(med(k) for k in BREAKDOWN) or 1.0
        lines.append("breakdown (median, share): " + ", ".join(
            f"{LABELS[k]} {med(k) / total * 100:.0f}%" for k in BREAKDOWN))
    lines += data_bound_lines(steady)
    lines += experts_lines(records)
    for name in source_names(records):
        parts = [f"{key.split('/')[0].replace('_', '-')} {r[key]:.4f} at step {r['step']}"
                 for key in (f"loss/{name}", f"val_loss/{name}")
                 for r in [next((r for r in reversed(records) if key in r), None)] if r is not None]
        lines.append(f"source {name}: " + ", ".join(parts))
    if "max_busy_s" in last:
        most, least = med("max_busy_s"), med("min_busy_s")
        if most > least * (1 + SLOWEST_GAP):
            slow = statistics.mode(r["max_busy_rank"]["rank"] for r in steady)
            c = next(r["max_busy_rank"] for r in steady if r["max_busy_rank"]["rank"] == slow)
            lines.append(f"slowest rank {slow} (tp {c['tp']}, pp {c['pp']}, dp {c['dp']}), most often: "
                         f"median busy of the slowest rank {most * 1e3:.1f} ms, of the "
                         f"fastest {least * 1e3:.1f} ms")
        else:
            lines.append(f"ranks evenly busy: median busy {least * 1e3:.1f}-{most * 1e3:.1f} ms "
                         f"(within {SLOWEST_GAP:.0%})")
    flagged = sorted({s["rank"] for r in records for s in r.get("stragglers", [])})
    if flagged:
        lines.append(f"stragglers flagged: ranks {', '.join(map(str, flagged))}")
    if "peak_mem_bytes" in last:
        lines.append(f"peak memory {max(r.get('peak_mem_bytes', 0) for r in records) / 2**30:.2f} GiB "
                     f"({last.get('mem_source', '')}, max over ranks)")
    lines += autopilot_lines(list(events))
    lines += resize_lines(list(events))
    return "\n".join(lines)


def data_bound_lines(records: list[dict]) -> list[str]:
    """One line when the steps waited for data for at least DATA_BOUND_SHARE of their time
    (the ranks' mean ``data_wait_s`` summed over the steps, over their summed step time)."""
    if not records or "data_wait_s" not in records[-1]:
        return []
    wait = sum(r.get("data_wait_s", 0.0) for r in records)
    total = sum(r["step_time_s"] for r in records)
    if total <= 0 or wait / total < DATA_BOUND_SHARE:
        return []
    n = len(records)
    return [f"data-bound: {wait / total:.0%} of the step time waited for data ({wait / n * 1e3:.0f} ms of "
            f"{total / n * 1e3:.0f} ms a step, mean over {n} steps): raise data.prefetch, or make the reads "
            "faster (the console's data-bound line says which)"]


def load_rank_tables(run_dir: Path) -> list[dict]:
    """The per-rank rows of each straggler check (``ranks.jsonl``), if the run wrote any."""
    path = run_dir / "ranks.jsonl"
    if not path.is_file():
        return []
    tables = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            tables.append(json.loads(line))
        except json.JSONDecodeError:
            break  # cut short by a kill
    return tables


def experts_lines(records: list[dict]) -> list[str]:
    """A Mixture-of-Experts run's balance: the imbalance at the start and the end, the aux
    loss, dropped tokens and the all-to-all share."""
    moe = [r for r in records if "expert_imbalance" in r]
    if not moe:
        return []
    steady = steady_records(moe) or moe
    med = lambda key: statistics.median(r.get(key, 0.0) for r in steady)  # noqa: E731
    tail = moe[-min(len(moe), 10):]
    line = (f"experts: max / mean tokens {moe[0]['expert_imbalance']:.2f} at step {moe[0]['step']}, "
            f"{statistics.mean(r['expert_imbalance'] for r in tail):.2f} over the last {len(tail)} steps; "
            f"aux loss {moe[-1]['aux_loss']:.4f}")
    dropped = sum(r.get("dropped_tokens", 0) for r in moe)
    if dropped:
        line += f"; {dropped} assignments dropped"
    if med("all_to_all_s"):
        line += f"; all-to-all {med('all_to_all_share') * 100:.0f}% of the step (median)"
    return [line]


def write_report(run_dir: str | Path, out=print) -> Path:
    run_dir = Path(run_dir)
    records, events = _load_lines(run_dir)
    png = run_dir / "report.png"
    plot(records, png, load_job(run_dir), run_dir.name or str(run_dir), load_rank_tables(run_dir), events)
    out(summary(records, events))
    out(f"wrote {png}")
    return png
