"""Issue 37 point 8: the small things the console, the report and the README say, each
checked against what is true: a small model's size, one evaluation, a "slowest" rank
only when it is meaningfully slower, one median step in the summary and the report, the
progress bar's held-out loss and memory fields, the README's convert default."""

from __future__ import annotations

import re
from pathlib import Path

from parallel3d.config import load_config
from parallel3d.observe.console import summary as console_summary
from parallel3d.observe.progress import ProgressBar
from parallel3d.observe.report import summary as report_summary
from parallel3d.train.dryrun import dry_run, param_count

ROOT = Path(__file__).resolve().parents[1]


def _records(step_times, **extra):
    return [{"step": i + 1, "loss": 3.0 - 0.1 * i, "tokens_per_s": 1000.0, "step_time_s": t, **extra}
            for i, t in enumerate(step_times)]


def test_a_small_model_is_counted_in_k_or_m_not_0_000b():
    assert [param_count(n) for n in (202_496, 124_439_808, 8_030_261_248)] == ["202.5K", "124.440M", "8.030B"]
    lines = []
    cfg = load_config(str(ROOT / "recipes" / "debug_cpu.toml"), ["--model.dim=32", "--model.n_layers=2",
                                                                  "--model.vocab_size=256"])
    dry_run(cfg, 8, out=lines.append)
    assert re.search(r"model \d+\.\dK parameters", lines[0]), lines[0]


def test_one_evaluation_is_singular():
    records = _records([0.5, 0.4, 0.4])
    records[2]["val_loss"] = 2.5
    assert "1 evaluation)" in report_summary(records)


def test_a_rank_is_named_slowest_only_when_it_is_meaningfully_slower():
    rank = {"rank": 3, "tp": 1, "pp": 1, "dp": 1}
    close = _records([0.05] * 4, max_busy_s=0.0403, min_busy_s=0.0400, max_busy_rank=rank)
    text = report_summary(close)
    assert "slowest rank" not in text and "ranks evenly busy: median busy 40.0-40.3 ms (within 5%)" in text
    apart = _records([0.05] * 4, max_busy_s=0.050, min_busy_s=0.040, max_busy_rank=rank)
    assert "slowest rank 3 (tp 1, pp 1, dp 1)" in report_summary(apart)


def test_the_summary_and_the_report_give_one_median_step(tmp_path):
    records = _records([5.0, 4.0, 4.5, 4.6, 4.7])  # the first step's one-off work left out of both
    done = console_summary(records, 1000, 30.0, [], tmp_path)[0]
    assert done.endswith("median step 4550.0 ms"), done
    assert "median step 4550.0 ms" in report_summary(records)


class _Sink:
    def write(self, text):
        pass

    def flush(self):
        pass


def test_the_progress_bar_says_the_held_out_loss_step_and_what_memory_it_shows():
    bar = ProgressBar(10, stream=_Sink(), hold_streams=False)
    bar.line({"step": 2, "loss": 3.0, "tokens_per_s": 10.0, "val_loss": 2.9, "peak_mem_bytes": 2**30,
              "mem_source": "cpu_max_rss"})
    line = bar.line({"step": 3, "loss": 2.8, "tokens_per_s": 10.0})
    assert "val_loss 2.9000 (step 2)" in line and "peak rss 1.00 GiB (max rank)" in line, line
    line = bar.line({"step": 4, "loss": 2.8, "tokens_per_s": 10.0, "peak_mem_bytes": 2**31,
                     "mem_source": "cuda_max_allocated"})
    assert "peak alloc 2.00 GiB (max rank)" in line, line


def test_the_readme_gives_convert_s_real_memory_default():
    from parallel3d.cli import build_parser

    sub = next(a for a in build_parser()._actions if a.dest == "command")
    conv = sub.choices["convert"]
    default = next(a.default for a in conv._actions if a.dest == "memory_gb")
    readme = (ROOT / "README.md").read_text()
    (quoted,) = re.findall(r"`--memory-gb` \(default ([\d.]+)\)", readme)
    assert float(quoted) == float(default)
    assert f"(default {default})" in conv.format_help().replace("\n", " ")
