"""Observability without a run: the report's figure and summary drawn from synthetic
records (a 2x2x2 run's, a short run's, an MoE run's) and the progress line. The report of
a real 2x2x2 run is tests/test_observe.py's."""

from __future__ import annotations

import io

import pytest

from parallel3d.observe.stats import BREAKDOWN


def _synthetic_run(steps: int = 60, eval_every: int = 10) -> tuple[list[dict], dict]:
    """Records as the trainer writes them for a 2x2x2 run (values made up, shapes real)."""
    import math

    from parallel3d.config import JobConfig

    records = []
    for s in range(1, steps + 1):
        r = {"step": s, "loss": 7.0 * math.exp(-s / 40) + 0.3 * math.sin(s), "tokens_per_s": 5000.0 + 37 * (s % 7),
             "step_time_s": 0.4, "mfu": 0.40 + 0.001 * (s % 5), "tflops_per_device": 100.0,
             **{k: 0.4 / len(BREAKDOWN) for k in BREAKDOWN}}
        if s % eval_every == 0:
            r["val_loss"] = 7.2 * math.exp(-s / 45)
        records.append(r)
    job = JobConfig().to_dict()
    job["parallel"].update(tp=2, pp=2, dp=2, schedule="1f1b")
    job["model"].update(n_layers=4, dim=128, vocab_size=2048)
    return records, job


def _synthetic_rank_tables(checks: int = 6) -> list[dict]:
    """ranks.jsonl's rows for the 8 ranks of ``_synthetic_run`` (values made up)."""
    from parallel3d.topology import RankGrid

    grid = RankGrid(tp=2, pp=2, dp=2)
    return [{"step": 10 * (c + 1), "ranks": [{"rank": r, **grid.coords(r), "host": "h", "busy_s": 0.30 + 0.01 * r,
                                              "step_time_s": 0.4, "peak_mem_bytes": 2**20} for r in range(8)]}
            for c in range(checks)]


def test_report_figure_shows_held_out_loss_smoothing_coordinates_and_a_title():
    from parallel3d.observe.report import build_figure, smooth

    records, job = _synthetic_run()
    fig = build_figure(records, job, "debug_cpu", _synthetic_rank_tables())
    loss, rate, breakdown, ranks = fig.axes[:4]
    title = fig.get_suptitle()
    assert title.startswith("debug_cpu: 60 steps") and "tp 2 x pp 2 x dp 2 (8 ranks" in title
    assert "Llama preset debug (4 layers, 128 dim, 2048 vocab)" in title
    assert f"held-out {records[-1]['val_loss']:.4f}" in title
    assert [a.get_title() for a in (loss, rate, breakdown)] == ["loss", "throughput",
                                                               "step-time breakdown (mean over ranks)"]
    assert all(a.get_xlabel() == "step" for a in (loss, rate, breakdown))  # one x-axis: steps
    # loss: raw, its mean over 3 steps (60 / 20), and the held-out loss at each evaluation
    lines = {line.get_label(): line for line in loss.get_lines()}
    assert sorted(lines) == ["held-out loss", "training loss, mean of 3 steps", "training loss, per step"]
    raw = [r["loss"] for r in records]
    assert list(lines["training loss, per step"].get_ydata()) == raw
    assert lines["training loss, mean of 3 steps"].get_ydata()[5] == pytest.approx(sum(raw[3:6]) / 3)
    assert smooth([1.0, 2.0, 3.0, 4.0], 2) == [1.0, 1.5, 2.5, 3.5]
    held = lines["held-out loss"]
    assert list(held.get_xdata()) == [10, 20, 30, 40, 50, 60]
    assert list(held.get_ydata()) == [r["val_loss"] for r in records if "val_loss" in r]
    # throughput with MFU on a second axis, and every legend beside its panel, not over it
    assert len(rate.get_lines()) == 2 and fig.axes[4].get_ylabel() == "MFU (%)"
    assert [t.get_text() for t in rate.get_legend().get_texts()][-1] == "MFU (%)"
    fig.canvas.draw()
    for ax in (loss, rate, breakdown):
        legend, box = ax.get_legend().get_window_extent(), ax.get_window_extent()
        assert legend.x0 >= box.x1, ax.get_title()  # entirely to the right of the plot area
    assert len(breakdown.collections) == len(BREAKDOWN)  # one stacked area per field
    # busy time: one box per rank, each labelled with its coordinates (tp innermost)
    labels = [t.get_text() for t in ranks.get_xticklabels()]
    assert labels == [f"{r}\ntp{r % 2} pp{r // 4}\ndp{(r // 2) % 2}" for r in range(8)]
    assert ranks.get_xlabel() == "rank"


def test_report_of_a_short_run_without_evaluations_or_per_rank_rows():
    from parallel3d.observe.report import build_figure, summary

    records, _ = _synthetic_run(steps=5, eval_every=100)
    for r in records:
        del r["mfu"]
    fig = build_figure(records, None, "short")
    loss = fig.axes[0]
    assert [line.get_label() for line in loss.get_lines()] == ["training loss"]  # 5 steps: no smoothing
    assert "no per-rank rows" in fig.axes[3].texts[0].get_text()
    assert "held-out" not in fig.get_suptitle() and "held-out" not in summary(records)


def test_progress_bar_redraws_one_line_with_eta():
    from parallel3d.observe.progress import ProgressBar, wants_bar

    class Tty(io.StringIO):
        def isatty(self):
            return True

    assert wants_bar("auto", Tty()) and not wants_bar("auto", io.StringIO())
    assert wants_bar("on", io.StringIO()) and not wants_bar("off", Tty())
    out = Tty()
    bar = ProgressBar(10, stream=out)
    rec = {"loss": 5.0, "tokens_per_s": 12345.0, "peak_mem_bytes": 3 * 2**30, "mfu": 0.412}
    bar.update({"step": 1, **rec})
    bar.update({"step": 5, **rec})
    bar.close()
    text = out.getvalue()
    assert text.count("\r") == 2 and text.endswith("\n") and "\n" not in text[:-1]
    last = text.split("\r")[-1]
    assert "step 5/10 [##########..........]" in last and "12,345 tok/s" in last
    assert "MFU 41.2%" in last and "mem 3.00 GiB" in last and "ETA " in last


def test_report_of_an_moe_run_draws_the_experts_imbalance_and_summarises_it():
    from parallel3d.observe.report import build_figure, summary

    records, _ = _synthetic_run(steps=30, eval_every=100)
    for i, r in enumerate(records):
        r.update(aux_loss=0.02, expert_imbalance=3.0 - i * 0.04, dropped_tokens=0, all_to_all_s=0.01,
                 all_to_all_share=0.25)
    fig = build_figure(records, None, "moe")
    twins = [a for a in fig.axes[4:] if a.get_ylabel() == "tokens per expert, max / mean"]
    assert len(twins) == 1
    drawn = [line for line in twins[0].get_lines() if line.get_label().startswith("experts")]
    assert list(drawn[0].get_ydata()) == [r["expert_imbalance"] for r in records]
    text = summary(records)
    # the last 10 steps: 3 - 0.04 x mean(20..29) = 3 - 0.04 x 24.5 = 2.02
    assert "experts: max / mean tokens 3.00 at step 1, 2.02 over the last 10 steps; aux loss 0.0200" in text
    assert "all-to-all 25% of the step" in text
