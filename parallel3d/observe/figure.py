"""The figure of ``parallel3d report`` (:mod:`parallel3d.observe.report`): a title naming
the run, its layout and its model, and four panels, every x-axis in steps (loss, with the
held-out loss, each data source's and the experts' imbalance; throughput and MFU; the
step-time breakdown; busy time per rank), the autopilot's moves drawn as vertical lines.
:func:`build_figure` returns the ``matplotlib`` figure itself (no pyplot state), so tests
read its axes."""

from __future__ import annotations

from pathlib import Path

from parallel3d.errors import UserError
from parallel3d.observe.stats import BREAKDOWN

INSTALL_HINT = 'pip install -e ".[report]" in the checkout, or pip install matplotlib'
LABELS = {"data_wait_s": "data wait", "forward_s": "forward", "backward_s": "backward",  # the breakdown's parts
          "optimizer_s": "optimizer", "comm_exposed_s": "exposed comm", "bubble_s": "pipeline bubble",
          "other_s": "other"}


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
                     labels=[LABELS[k] for k in BREAKDOWN])
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
