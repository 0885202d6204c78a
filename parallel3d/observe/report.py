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

Legends sit beside their panels, never over the curves. :func:`build_figure` returns the
``matplotlib`` figure itself (no pyplot state), so tests read its axes. Needs matplotlib:
``pip install -e ".[report]"`` in the checkout, or ``pip install matplotlib``.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from parallel3d.data.stalls import DATA_BOUND_SHARE
from parallel3d.errors import UserError
from parallel3d.observe.stats import BREAKDOWN

_LABELS = {"data_wait_s": "data wait", "forward_s": "forward", "backward_s": "backward",
           "optimizer_s": "optimizer", "comm_exposed_s": "exposed comm", "bubble_s": "pipeline bubble",
           "other_s": "other"}
INSTALL_HINT = 'pip install -e ".[report]" in the checkout, or pip install matplotlib'

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
            f"{_LABELS[k]} {med(k) / total * 100:.0f}%" for k in BREAKDOWN))
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


def smooth(values: list[float], window: int) -> list[float]:
    """Trailing mean over the last ``window`` values (fewer at the start)."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def smoothing_window(n: int) -> int:
    """Steps in a trailing mean: about a twentieth of the run, at least 1."""
    return max(1, round(n / 20))


def _busy_rows(rank_tables: list[dict]) -> list[list[float]]:
    """Per rank, its mean busy seconds per step at each straggler check (``ranks.jsonl``)."""
    if not rank_tables:
        return []
    n = len(rank_tables[0]["ranks"])
    return [[t["ranks"][i]["busy_s"] for t in rank_tables if len(t["ranks"]) == n] for i in range(n)]


def rank_labels(n: int, job: dict | None) -> list[str]:
    """``"3\\ntp1 pp0\\ndp1"`` per rank, from the job's layout (plain numbers without one)."""
    from parallel3d.topology import RankGrid

    par = (job or {}).get("parallel", {})
    tp, pp, dp = par.get("tp", 0), par.get("pp", 0), par.get("dp", 0)
    if not (tp and pp and dp) or tp * pp * dp != n:
        return [str(r) for r in range(n)]
    grid = RankGrid(tp=tp, pp=pp, dp=dp)
    return [f"{r}\ntp{c['tp']} pp{c['pp']}\ndp{c['dp']}" for r, c in ((r, grid.coords(r)) for r in range(n))]


def title(records: list[dict], job: dict | None, name: str, events: list[dict] = ()) -> str:
    last = records[-1]
    head = f"{name}: {len(records)} steps (to step {last['step']}), final loss {last['loss']:.4f}"
    evals = [r["val_loss"] for r in records if "val_loss" in r]
    if evals:
        head += f", held-out {evals[-1]:.4f} (best {min(evals):.4f})"
    if not job:
        return head
    par, model, train = job["parallel"], job.get("model", {}), job.get("train", {})
    shape = ", ".join(f"{v} {k}" for k, v in (("layers", model.get("n_layers")), ("dim", model.get("dim")),
                                                ("vocab", model.get("vocab_size"))) if v)
    source = model.get("hf_checkpoint") or f"preset {model.get('preset', '?')}"
    layout = (f"tp {par['tp']} x pp {par['pp']} x dp {par['dp']} ({par['tp'] * par['pp'] * par['dp']} ranks"
              f"{', ' + par['schedule'] if par.get('pp', 1) > 1 else ''}, zero {par.get('zero', 0)})")
    batch = f"{train.get('global_batch')} x {train.get('seq_len')} tokens a step, {train.get('dtype', '')}"
    moved = moves(list(events))
    where = f" since step {moved[-1][0]} (moved by the autopilot)" if moved else ""
    return f"{head}\nLlama {source} ({shape}) on {layout}{where}; {batch}"


def _legend_beside(ax) -> None:
    ax.legend(loc="upper left", bbox_to_anchor=(1.02, 1.0), fontsize=8, frameon=False, borderaxespad=0)


def _raw_and_smoothed(ax, steps: list[int], values: list[float], window: int, color: str, label: str) -> None:
    """The raw series thin and faint under its trailing mean; with a window of 1 step
    (short runs) the raw series alone."""
    if window == 1:
        ax.plot(steps, values, color=color, linewidth=1.5, label=label)
        return
    ax.plot(steps, values, color=color, alpha=0.3, linewidth=0.8, label=f"{label}, per step")
    ax.plot(steps, smooth(values, window), color=color, linewidth=1.8, label=f"{label}, mean of {window} steps")


def _loss_panel(ax, records: list[dict], window: int) -> None:
    steps = [r["step"] for r in records]
    _raw_and_smoothed(ax, steps, [r["loss"] for r in records], window, "tab:blue", "training loss")
    evals = [(r["step"], r["val_loss"]) for r in records if "val_loss" in r]
    if evals:
        ax.plot([s for s, _ in evals], [v for _, v in evals], "o-", color="tab:red", markersize=4,
                label="held-out loss")
    _source_losses(ax, records, window)
    ax.set(title="loss", xlabel="step", ylabel="cross-entropy (nats)")
    handles, labels = ax.get_legend_handles_labels()
    experts = all("expert_imbalance" in r for r in records)
    if experts:  # a Mixture-of-Experts run
        twin = ax.twinx()
        (line,) = twin.plot(steps, [r["expert_imbalance"] for r in records], color="tab:orange",
                            linewidth=1.0, label="experts max / mean (worst layer)")
        twin.axhline(1.0, color="tab:orange", linestyle=":", linewidth=0.8)
        twin.set_ylabel("tokens per expert, max / mean")
        handles.append(line)
        labels.append(line.get_label())
    ax.legend(handles, labels, loc="upper left", bbox_to_anchor=(1.12 if experts else 1.02, 1.0),  # past the twin's axis
              fontsize=8, frameon=False, borderaxespad=0)


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


def source_names(records: list[dict]) -> list[str]:
    """The data.blend sources with per-source figures (``loss/<name>``, ``val_loss/<name>``)."""
    names: dict[str, None] = {}
    for r in records:
        for key in r:
            if key.startswith(("loss/", "val_loss/")):
                names.setdefault(key.split("/", 1)[1], None)
    return list(names)


_SOURCE_COLORS = ("tab:green", "tab:orange", "tab:purple", "tab:brown", "tab:pink", "tab:olive", "tab:cyan")


def _source_losses(ax, records: list[dict], window: int) -> None:
    """Each blend source's training loss (smoothed; its steps only) and held-out loss."""
    for i, name in enumerate(source_names(records)):
        color = _SOURCE_COLORS[i % len(_SOURCE_COLORS)]
        own = [(r["step"], r[f"loss/{name}"]) for r in records if f"loss/{name}" in r]
        if own:
            values = smooth([v for _, v in own], window) if window > 1 else [v for _, v in own]
            ax.plot([s for s, _ in own], values, color=color, linewidth=1.2, label=f"{name} (training)")
        evals = [(r["step"], r[f"val_loss/{name}"]) for r in records if f"val_loss/{name}" in r]
        if evals:
            ax.plot([s for s, _ in evals], [v for _, v in evals], "s--", color=color, markersize=3,
                    label=f"{name} (held out)")


def _throughput_panel(ax, records: list[dict], window: int) -> None:
    steps = [r["step"] for r in records]
    _raw_and_smoothed(ax, steps, [r["tokens_per_s"] for r in records], window, "tab:green", "tokens/s")
    ax.set(title="throughput", xlabel="step", ylabel="tokens/s")
    handles, labels = ax.get_legend_handles_labels()
    if all("mfu" in r for r in records):
        twin = ax.twinx()
        (line,) = twin.plot(steps, [r["mfu"] * 100 for r in records], color="tab:purple", linewidth=1.0,
                            label="MFU (%)")
        twin.set_ylabel("MFU (%)")
        handles.append(line)
        labels.append(line.get_label())
        ax.legend(handles, labels, loc="upper left", bbox_to_anchor=(1.12, 1.0), fontsize=8, frameon=False,
                  borderaxespad=0)
    else:
        _legend_beside(ax)


def _breakdown_panel(ax, records: list[dict]) -> None:
    if all(k in records[0] for k in BREAKDOWN):
        ax.stackplot([r["step"] for r in records], *[[r[k] * 1e3 for r in records] for k in BREAKDOWN],
                     labels=[_LABELS[k] for k in BREAKDOWN])
        _legend_beside(ax)
    ax.set(title="step-time breakdown (mean over ranks)", xlabel="step", ylabel="ms")


def _ranks_panel(ax, rank_tables: list[dict], job: dict | None) -> None:
    busy = _busy_rows(rank_tables)
    ax.set(title="busy time per rank (mean per step between straggler checks, waits left out)",
           xlabel="rank", ylabel="ms")
    if not busy:
        ax.text(0.5, 0.5, "no per-rank rows (ranks.jsonl, written at straggler checks)", ha="center",
                va="center", transform=ax.transAxes)
        return
    labels = rank_labels(len(busy), job)
    ax.boxplot([[v * 1e3 for v in col] for col in busy], positions=list(range(len(busy))), widths=0.6)
    step = max(1, len(busy) // 16)  # at most about 16 labels
    ax.set_xticks(list(range(0, len(busy), step)), [labels[i] for i in range(0, len(busy), step)], fontsize=7)


def moves(events: list[dict]) -> list[tuple[int, str]]:
    """(step, layout) of each move the autopilot made."""
    return [(e["step"], e["to"]) for e in events
            if e.get("event") == "autopilot" and e.get("action") in ("move done", "move back done")]


def _mark_moves(axes, events: list[dict]) -> None:
    for step, layout in moves(events):
        for ax in axes:
            ax.axvline(step, color="black", linestyle="--", linewidth=0.9)
        top = axes[0]
        top.annotate(f"moved to\n{layout}", xy=(step, 1.0), xycoords=("data", "axes fraction"),
                     xytext=(3, -3), textcoords="offset points", fontsize=7, va="top")


def build_figure(records: list[dict], job: dict | None = None, name: str = "run", rank_tables: list[dict] = (),
                 events: list[dict] = ()):
    """The report as a ``matplotlib.figure.Figure`` (see the module docstring)."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise UserError(f"parallel3d report needs matplotlib: {INSTALL_HINT}") from None
    window = smoothing_window(len(records))
    fig = Figure(figsize=(15, 9), dpi=100, layout="constrained")
    ax = fig.subplots(2, 2)
    fig.suptitle(title(records, job, name, events), fontsize=11)
    _loss_panel(ax[0, 0], records, window)
    _throughput_panel(ax[0, 1], records, window)
    _breakdown_panel(ax[1, 0], records)
    _ranks_panel(ax[1, 1], list(rank_tables), job)
    _mark_moves([ax[0, 0], ax[0, 1], ax[1, 0]], list(events))
    return fig


def plot(records: list[dict], out: Path, job: dict | None = None, name: str = "run",
         rank_tables: list[dict] = (), events: list[dict] = ()) -> None:
    build_figure(records, job, name, rank_tables, events).savefig(out)


def write_report(run_dir: str | Path, out=print) -> Path:
    run_dir = Path(run_dir)
    records, events = _load_lines(run_dir)
    png = run_dir / "report.png"
    plot(records, png, load_job(run_dir), run_dir.name or str(run_dir), load_rank_tables(run_dir), events)
    out(summary(records, events))
    out(f"wrote {png}")
    return png
