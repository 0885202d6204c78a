"""benchmarks/compare.py: the table's arithmetic, and one real row end to end."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCH))

import _common  # noqa: E402


def _run(times: list[float], losses: list[float], peak: int) -> _common.Run:
    return _common.Run(times=times, losses=losses, peak=peak)


def test_summary_takes_slowest_rank_skips_warmup_and_table_gives_ratio():
    # two rounds of two ranks; step 0 is warm-up. Per step the slowest rank counts:
    # round 0 -> 0.2, 0.4; round 1 -> 0.3, 0.1; median of (0.1, 0.2, 0.3, 0.4) = 0.25 s
    losses = [3.0, 2.0, 1.0]
    runs = [[_run([9.0, 0.2, 0.1], losses, 5 * 2**20), _run([9.0, 0.1, 0.4], losses, 7 * 2**20)],
            [_run([9.0, 0.3, 0.1], losses, 1), _run([9.0, 0.2, 0.0], losses, 1)]]
    ours = _common.summarize("parallel3d", runs, warmup=1, tokens_per_step=1000)
    assert ours.step_ms == pytest.approx(250.0)
    assert ours.tokens_per_s == pytest.approx(4000.0)
    assert ours.peak_mib == pytest.approx(7.0)  # the largest rank
    assert ours.final_loss == 1.0
    # a separate memory run replaces the timed runs' peaks
    assert _common.summarize("x", runs, 1, 1000, [_run([], [], 3 * 2**20)]).peak_mib == pytest.approx(3.0)

    peer = _common.Side("peer", 500.0, 2000.0, 10.0, 1.0001, [3.0, 2.0, 1.0001])
    broken = _common.failed("broken peer", "RuntimeError: no such thing")
    text = _common.table([("row", ours, peer), ("row", ours, broken)])
    cells = [c.strip() for c in text.splitlines()[2].split("|")[1:-1]]
    assert cells[:5] == ["row", "peer", "250", "500", "0.50"]
    assert float(cells[-1]) == pytest.approx(1e-4, rel=1e-2)  # max relative loss difference
    assert "fails: RuntimeError: no such thing" in text.splitlines()[3]
    assert math.isnan(_common.loss_diff(ours, broken))


def test_rank_micro_batches_match_the_trainer_sampler(corpus_dir):
    """Peers get the trainer's own data: rank r's micro-batches of the global batch are
    exactly what GlobalBatchSampler gives dp rank r."""
    from parallel3d.train.data import GlobalBatchSampler, TokenWindows, prepare_corpus

    cfg = _common.job({"dp": 2}, steps=3, global_batch=8, micro_batch=2, seq_len=32,
                      corpus_dir=corpus_dir)
    cfg.data.vocab_size = 512  # the session corpus
    batches = _common.GlobalBatches(cfg)
    windows = TokenWindows(prepare_corpus(cfg.data).split("train"), 32)
    for dp_rank in range(2):
        sampler = GlobalBatchSampler(windows.num_samples, 8, 2, 2, dp_rank, cfg.train.seed)
        for step in (0, 2):
            ours = [windows.batch(idx) for idx in sampler.step_indices(step)]
            theirs = _common.rank_micro_batches(*batches(step), 2, dp_rank, 2)
            assert len(ours) == len(theirs) == 2
            for (xa, ya), (xb, yb) in zip(ours, theirs):
                assert (xa == xb).all() and (ya == yb).all()


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("P3D_BENCH_SMOKE"),
                    reason="runs DeepSpeed on 2 ranks (~30 s): set P3D_BENCH_SMOKE=1")
def test_compare_runs_a_row_end_to_end(tmp_path):
    out = tmp_path / "table.md"
    proc = subprocess.run([sys.executable, str(BENCH / "compare.py"), "--rows", "dp-zero2",
                           "--steps", "2", "--rounds", "1", "--warmup", "1", "--out", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    row = [ln for ln in out.read_text().splitlines() if ln.startswith("| dp-zero2")]
    cells = [c.strip() for c in row[0].split("|")[1:-1]]
    # same weights, data and optimizer: losses agree to fp32 reduction-order noise
    assert float(cells[-1]) < 1e-5, row


def _peer_losses(module: str, fn_name: str, layout: dict, steps: int, kw: dict) -> list[float]:
    import importlib

    return getattr(importlib.import_module(module), fn_name)(layout, steps, **kw).losses


def test_torch_zero_bubble_peers_train_our_chunks_to_our_losses(pools, corpus_dir):
    """The zero-bubble rows' peers run: torch's ScheduleZBVZeroBubble on the chunks our
    split rule cuts for zb-v's V (and ScheduleInterleavedZeroBubble on the interleaved
    ones) give parallel3d's zb-v losses, from the same weights and batches (fp32:
    reduction-order noise), and every rank reports the same loss."""
    kw = {"global_batch": 8, "micro_batch": 2, "seq_len": 32, "corpus_dir": corpus_dir,
          "model": {"n_layers": 4, "vocab_size": 512}}
    zbv = {"pp": 2, "schedule": "zb-v", "virtual_stages": 2}
    ours = pools(2).run(_peer_losses, "peers", "run_ours", zbv, 3, kw)
    theirs = pools(2).run(_peer_losses, "peers_torch", "run_torch_pipelining", zbv, 3,
                          {**kw, "schedule": "ScheduleZBVZeroBubble"})
    interleaved = pools(2).run(_peer_losses, "peers_torch", "run_torch_pipelining", zbv, 3,
                               {**kw, "schedule": "ScheduleInterleavedZeroBubble",
                                "stage_layout": {"pp": 2, "schedule": "interleaved", "virtual_stages": 2}})
    for run in (theirs, interleaved):
        assert run[0] == run[1]
        assert _common.loss_diff(_common.Side("a", 0, 0, 0, 0, run[0]), _common.Side("b", 0, 0, 0, 0, ours[0])) < 1e-5


def test_timeline_step_breakdown_sums_spans_per_category():
    import time

    from parallel3d.pipeline.timeline import Timeline

    tl = Timeline()
    assert tl.step_breakdown() == {}
    tl.start_step(1)
    for cat, lane in (("forward", "compute"), ("forward", "compute"), ("wait", "comm")):
        with tl.span("x", cat, lane=lane):
            time.sleep(0.002)
    b = tl.step_breakdown()
    assert set(b) == {"forward", "wait"}
    assert b["forward"] >= 0.004 and b["wait"] >= 0.002
    tl.close_window()
    assert tl.step_breakdown() == b  # still the last step after its window closed
