"""``parallel3d scaling``: the curve's arithmetic on hand-made points, and the command end to
end on a tiny model at 1 and 2 ranks (the default model at 1, 2, 4, 8 is measured in
benchmarks/bench_scaling.py)."""

from __future__ import annotations

import json
import math

import pytest

from parallel3d.cli import main
from parallel3d.planner.fitted import ChunkCost, FittedTerms
from parallel3d.planner.spec import Layout
from parallel3d.scaling.curve import Extended, efficiencies, flattens_at, out_of_sample_errors, table
from parallel3d.scaling.sweep import Point, batch_at

from helpers import job_args, tiny_job

TERMS = FittedTerms({1: ChunkCost(0.0, 0.0, 0.0)}, 0.0, 0.0, 0.0, shared=True, cores=2)
BREAK = {"forward + backward": 0.1, "optimizer + other": 0.0, "exposed comm": 0.0, "bubble": 0.0, "data": 0.0}


def _point(ranks, tokens_per_s, predicted_s=None, step_s=1.0):
    return Point(ranks, Layout(dp=ranks), 16, step_s, tokens_per_s, BREAK, TERMS, predicted_s)


def test_efficiency_errors_and_the_flattening_point_by_hand():
    points = [_point(1, 1000.0), _point(2, 1800.0, predicted_s=1.2), _point(4, 2000.0, predicted_s=0.9)]
    assert efficiencies(points) == pytest.approx([1.0, 0.9, 0.5])  # 1800 / 2000, 2000 / 4000
    assert out_of_sample_errors(points) == pytest.approx([0.2, -0.1])
    # best 2100 (extended); within 10% of it: 2000 at 4 ranks, 1800 at 2 is not (< 1890)
    extended = [Extended(8, 1, Layout(dp=8), 1.0, 2100.0, 0.2), Extended(16, 2, None, math.nan, math.nan, 0.2, "none")]
    assert flattens_at(points, extended) == 4
    lines = table(points, extended, weak=False, flat=4, inter_gbit=10)
    assert lines[-1].startswith("the curve flattens at 4 rank(s)")
    assert any(line.split()[:1] == ["8"] and "+- 20%" in line for line in lines)
    assert any("1200 ms (+20%)" in line for line in lines)


def test_weak_scaling_keeps_the_per_rank_batch():
    from parallel3d.config import load_config

    cfg = load_config(None, {"train": {"global_batch": 16, "micro_batch": 2}, "launch": {"nproc": 8}})
    assert [batch_at(cfg, n, weak=True) for n in (1, 2, 8)] == [2, 4, 16]
    assert [batch_at(cfg, n, weak=False) for n in (1, 2, 8)] == [16, 16, 16]


def test_scaling_runs_each_size_and_writes_the_table_json_and_png(corpus_dir, tmp_path, capsys):
    job = tiny_job(corpus_dir, str(tmp_path / "unused"))
    job.pop("run")
    out = tmp_path / "scaling"
    assert main(["scaling", "--ranks", "1,2", "--out", str(out), *job_args(job)]) == 0
    data = json.loads((out / "scaling.json").read_text())
    one, two = data["points"]
    assert (one["ranks"], two["ranks"]) == (1, 2) and one["layout"].startswith("tp1 pp1 dp1")
    assert one["predicted_s"] is None and two["predicted_s"] > 0  # the second was predicted first
    for p in data["points"]:  # tokens/s is the global batch over the measured step
        assert p["tokens_per_s"] == pytest.approx(8 * 32 / p["step_s"])
        assert (out / f"ranks{p['ranks']}" / "metrics.jsonl").is_file()
    # the recipe's world (8) and 2x, 4x of it, each a prediction or the reason there is none
    assert [e["ranks"] for e in data["extended"]] == [8, 16, 32]
    error = abs(two["predicted_s"] / two["step_s"] - 1)
    for e in data["extended"]:
        assert (e["layout"] and e["tokens_per_s"] > 0 and e["error"] == pytest.approx(error)) or e["note"]
    assert data["flattens_at"] in (1, 2, 8, 16, 32)
    assert (out / "scaling.png").stat().st_size > 10_000
    text = (out / "scaling.txt").read_text()
    assert text in capsys.readouterr().out and f"flattens at {data['flattens_at']} rank" in text
