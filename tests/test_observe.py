"""Observability: the FLOP count against a hand count, the step breakdown of a 2x2x2 run,
a straggler named by its coordinates, the run report, the progress line."""

from __future__ import annotations

import io
import socket
import time

import pytest
import torch

from parallel3d.config import config_from_dict
from parallel3d.errors import UserError
from parallel3d.observe.stats import BREAKDOWN, find_stragglers, gpu_of, step_breakdown
from parallel3d.topology import Topology
from parallel3d.train.trainer import Trainer

from helpers import tiny_job


def _job(corpus_dir, run_dir, steps, **observability) -> dict:
    # 2x2x2 on 8 ranks: global 16 / (micro 2 * dp 2) = 4 micro-batches per pipeline.
    return tiny_job(corpus_dir, run_dir, train={"steps": steps, "global_batch": 16, "micro_batch": 2},
                    parallel={"tp": 2, "pp": 2, "dp": 2, "schedule": "1f1b"},
                    observability={"progress": "off", **observability})


def _train(job: dict, slow_rank: int | None = None, sleep_s: float = 0.0) -> dict:
    import contextlib

    cfg = config_from_dict(job)
    topo = Topology(cfg.parallel.tp, cfg.parallel.pp, cfg.parallel.dp)
    trainer = Trainer(cfg, topo)
    if topo.rank == slow_rank:
        trainer.step_hooks.append(lambda t: time.sleep(sleep_s))
    err = io.StringIO()
    with contextlib.redirect_stderr(err) if topo.rank == 0 else contextlib.nullcontext():
        history = trainer.fit()
    return {"history": history, "stderr": err.getvalue(), "coords": topo.coords()}


# -- FLOPs and MFU ---------------------------------------------------------------------------

def test_flops_per_step_match_a_hand_count_and_mfu_is_absent_on_cpu(corpus_dir, tmp_path):
    job = tiny_job(corpus_dir, str(tmp_path), train={"steps": 2}, observability={"progress": "off"})
    cfg = config_from_dict(job)
    trainer = Trainer(cfg, Topology.single())
    # By hand for dim 64, 2 layers, 4 heads of 16 (q width 64), 2 kv-heads (kv width 32),
    # ffn 160, vocab 512, seq 32, global batch 8 (Megatron/PaLM convention: matmuls only,
    # full S x S attention, head counted, embedding lookup not):
    #   weights in products per layer  2*64*64 + 2*64*32 + 3*64*160          =  43,008
    #   forward per token per layer    2*43,008 + 4*32*64                    =  94,208
    #   forward per token              2*94,208 + 2*512*64 (head)            = 253,952
    #   training per token             3 * 253,952                           = 761,856
    #   per step                       761,856 * 8 * 32 tokens               = 195,035,136
    assert trainer.observer.flops_per_step == 195_035_136
    history = trainer.fit()
    for rec in history:
        assert "mfu" not in rec  # no peak to divide by on a CPU: left out, not invented
        assert rec["tflops_per_device"] == pytest.approx(195_035_136 / rec["step_time_s"] / 1e12)
        assert rec["mem_source"] == "cpu_max_rss" and rec["peak_mem_bytes"] > 10 * 2**20


def test_gpu_names_map_to_the_table_and_unknown_ones_to_none(monkeypatch):
    cuda = torch.device("cuda", 0)
    for name, key in [("NVIDIA H100 80GB HBM3", "h100-80g"), ("NVIDIA H200", "h200"),
                      ("NVIDIA A100-SXM4-80GB", "a100-80g"), ("NVIDIA H100 PCIe", None),
                      ("NVIDIA GeForce RTX 4090", None)]:
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda d, n=name: n)
        gpu = gpu_of(cuda)
        assert (gpu.name if gpu else None) == key, name
    assert gpu_of(torch.device("cpu")) is None


def test_breakdown_of_spans_counts_nested_collectives_once():
    spans = [("data", 0.0, 0.1), ("comm", 0.1, 0.2), ("forward", 0.2, 0.5), ("wait", 0.5, 0.6),
             ("backward", 0.6, 1.0), ("optimizer", 1.0, 1.5), ("comm", 1.1, 1.3)]
    out = step_breakdown(spans, 1.6)
    assert out == pytest.approx({"data_wait_s": 0.1, "forward_s": 0.3, "backward_s": 0.4,
                                 "optimizer_s": 0.3, "comm_exposed_s": 0.3, "bubble_s": 0.1,
                                 "other_s": 0.1})
    assert find_stragglers([1.0, 1.1, 0.9, 2.0], 1.2) == [(3, pytest.approx(1.05))]
    # per stage: ranks 0-1 one stage, 2-3 the other (twice the work, not a straggler)
    assert find_stragglers([1.0, 1.0, 2.0, 3.5], 1.2, [[0, 1], [2, 3]]) == [(3, pytest.approx(2.75))]


# -- 2x2x2 runs ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def run_2x2x2(pools, corpus_dir, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("run2x2x2")
    ranks = pools(8).run(_train, _job(corpus_dir, str(run_dir), steps=5))
    return ranks, run_dir


def test_breakdown_of_a_2x2x2_run_accounts_for_the_step(run_2x2x2):
    history = run_2x2x2[0][0]["history"]
    for rec in history:
        step = rec["step_time_s"]
        fields = {k: rec[k] for k in BREAKDOWN}
        for k, v in fields.items():
            assert 0 <= v <= step, (rec["step"], k, v, step)
        # The fields are means over ranks; they sum to the mean rank step time, which is
        # within 10% of rank 0's (every rank leaves each step's last collective together).
        assert sum(fields.values()) == pytest.approx(step, rel=0.10), (rec["step"], fields, step)
        # The spans themselves explain the step: what no span covers stays under 10%.
        assert fields["other_s"] < 0.10 * step, (rec["step"], fields)
        assert fields["bubble_s"] > 0 and fields["forward_s"] > 0 and fields["backward_s"] > 0
        assert len(rec["rank_step_time_s"]) == len(rec["rank_peak_mem_bytes"]) == 8
        assert rec["peak_mem_bytes"] == max(rec["rank_peak_mem_bytes"])
        assert "mfu" not in rec


def test_a_slowed_rank_is_named_with_its_coordinates(pools, corpus_dir, tmp_path):
    slow = 5
    # 1 s of sleep per step against a busy time of tens of ms per rank; factor 3 so that
    # the scheduling noise of 8 ranks on 2 loaded cores cannot name a second rank.
    job = _job(corpus_dir, str(tmp_path), steps=4, straggler_interval=2, straggler_factor=3.0)
    ranks = pools(8).run(_train, job, slow, 1.0)
    checks = [rec["stragglers"] for rec in ranks[0]["history"] if "stragglers" in rec]
    assert len(checks) == 2  # steps 2 and 4
    c = ranks[slow]["coords"]
    for found in checks:
        assert [s["rank"] for s in found] == [slow], found
        s = found[0]
        assert (s["tp"], s["pp"], s["dp"]) == (c["tp"], c["pp"], c["dp"])
        assert s["host"] == socket.gethostname()
        assert s["busy_s"] >= 1.0  # the sleep counts in its own busy time (not as waiting)
    warnings = [line for line in ranks[0]["stderr"].splitlines() if "straggler" in line]
    assert len(warnings) == 2
    assert all(f"straggler rank {slow} (tp {c['tp']}, pp {c['pp']}, dp {c['dp']}, host" in w for w in warnings)


def test_bad_observability_keys_are_refused(corpus_dir, tmp_path):
    import importlib.util

    cases = [("straggler_factor", 0.9, "must be above 1"), ("progress", "sometimes", "use auto, on or off")]
    if importlib.util.find_spec("tensorboard") is None:
        cases.append(("tensorboard", True, "needs the tensorboard package: pip install tensorboard"))
    for key, value, message in cases:
        job = tiny_job(corpus_dir, str(tmp_path), observability={key: value})
        with pytest.raises(UserError, match=message):
            Trainer(config_from_dict(job), Topology.single())


def test_report_writes_a_png_with_content_and_a_summary(run_2x2x2, capsys):
    import matplotlib.image

    from parallel3d.cli import main

    run_dir = run_2x2x2[1]
    assert main(["report", str(run_dir)]) == 0
    text = capsys.readouterr().out
    assert "steps 5  final loss" in text and "breakdown (median, share): data wait" in text
    assert "slowest rank" in text and "no MFU" in text
    png = run_dir / "report.png"
    assert png.stat().st_size > 20_000
    img = matplotlib.image.imread(png)  # (H, W, 4) floats in [0, 1]
    assert img.shape[:2] == (800, 1200)
    ink = (img[..., :3].mean(axis=-1) < 0.9).mean()  # share of pixels that are not near-white
    assert ink > 0.02, ink  # axes, curves, the stacked areas and boxes
    assert main(["report", str(run_dir / "nothing")]) == 2  # a one-line error, not a traceback


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
