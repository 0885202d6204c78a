"""Observability: the FLOP count against a hand count, the step breakdown of a 2x2x2 run,
a straggler named by its coordinates, the report of a 2x2x2 run (the report's figure from
synthetic records and the progress line: tests/test_observe_report.py)."""

from __future__ import annotations

import io
import json
import socket
import statistics
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


def _sleep_at_least(floor_s: float, times: float):
    """A step hook that sleeps ``floor_s`` seconds, or ``times`` the seconds of the step
    so far (its data, forward and backward) if that is longer: a slowdown relative to the
    rank's own work, which a loaded machine stretches for every rank alike."""
    def hook(trainer):
        so_far = max((t1 for _, _, t1 in trainer.timeline.step_spans()), default=0.0)
        time.sleep(max(floor_s, times * so_far))
    return hook


def _train(job: dict, slow_rank: int | None = None, sleep_s: float = 0.0) -> dict:
    import contextlib

    cfg = config_from_dict(job)
    topo = Topology(cfg.parallel.tp, cfg.parallel.pp, cfg.parallel.dp)
    trainer = Trainer(cfg, topo)
    if topo.rank == slow_rank:
        trainer.step_hooks.append(_sleep_at_least(sleep_s, 10.0))
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
    # straggler checks at steps 2 and 4 write ranks.jsonl (the report's per-rank panel)
    ranks = pools(8).run(_train, _job(corpus_dir, str(run_dir), steps=5, straggler_interval=2,
                                      straggler_factor=100.0))
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
        # the slowest and the fastest rank's step times bracket rank 0's, and the record
        # names the rank with the most memory by its coordinates
        assert rec["min_step_time_s"] <= rec["max_step_time_s"]
        assert rec["min_peak_mem_bytes"] <= rec["peak_mem_bytes"]
        assert set(rec["max_peak_mem_rank"]) == {"rank", "tp", "cp", "pp", "dp"}
        assert "mfu" not in rec


def test_a_slowed_rank_is_named_with_its_coordinates(pools, corpus_dir, tmp_path):
    slow = 5
    # 1 s of sleep per step against a busy time of tens of ms per rank, or 10 times the
    # step's work so far where a loaded machine stretches that (with a fixed 1 s, beside
    # two busy loops, the other ranks' busy time reached a third of the slow one's and no
    # rank was named); factor 3 so that the scheduling noise of 8 ranks on 2 loaded cores
    # cannot name a second rank.
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

    cases = [("straggler_factor", 0.9, "must be above 1"), ("progress", "sometimes", "use auto, on, off")]
    if importlib.util.find_spec("tensorboard") is None:
        cases.append(("tensorboard", True, "needs the tensorboard package: pip install tensorboard"))
    for key, value, message in cases:
        job = tiny_job(corpus_dir, str(tmp_path), observability={key: value})
        with pytest.raises(UserError, match=message):
            Trainer(config_from_dict(job), Topology.single())


def test_report_of_a_2x2x2_run_writes_the_png_and_a_summary(run_2x2x2, capsys):
    import matplotlib.image

    from parallel3d.cli import main
    from parallel3d.observe.report import build_figure, load_job, load_metrics, load_rank_tables

    run_dir = run_2x2x2[1]
    assert main(["report", str(run_dir)]) == 0
    text = capsys.readouterr().out
    assert "steps 5  final loss" in text and "breakdown (median, share): data wait" in text
    assert "slowest rank" in text and "no MFU" in text
    img = matplotlib.image.imread(run_dir / "report.png")  # (H, W, 4) floats in [0, 1]
    assert img.shape[:2] == (900, 1500)
    # the figure the PNG was drawn from: the run's 8 ranks with their coordinates
    fig = build_figure(load_metrics(run_dir), load_job(run_dir), run_dir.name, load_rank_tables(run_dir))
    ranks = fig.axes[3]
    labels = [t.get_text() for t in ranks.get_xticklabels()]
    assert labels[5] == "5\ntp1 pp1\ndp0" and len(labels) == 8  # rank 5 = pp 1, dp 0, tp 1
    assert main(["report", str(run_dir / "nothing")]) == 2  # a one-line error, not a traceback


# -- nothing per step grows with the world ------------------------------------------------------

def _payload_and_records(job: dict) -> dict:
    """Train; the numels this rank handed to the step's closing collective, and (rank 0)
    the records' structure with every number replaced by its type."""
    import parallel3d.train.trainer as trainer_module

    sizes = []
    inner = trainer_module.all_reduce_sum_max

    def counting(sums, maxes, group):
        sizes.append((sums.numel(), maxes.numel()))
        return inner(sums, maxes, group)

    trainer_module.all_reduce_sum_max = counting
    try:
        cfg = config_from_dict(job)
        history = Trainer(cfg, Topology(cfg.parallel.tp, cfg.parallel.pp, cfg.parallel.dp)).fit()
    finally:
        trainer_module.all_reduce_sum_max = inner

    def shape(x):
        if isinstance(x, dict):
            return {k: shape(v) for k, v in x.items()}
        if isinstance(x, list):
            return [shape(v) for v in x]
        return type(x).__name__

    return {"sizes": sizes, "records": [shape(r) for r in history]}


@pytest.mark.parametrize("layout", [(1, 1, 2), (2, 2, 1), (2, 2, 2)])
def test_the_step_payload_and_a_record_do_not_grow_with_the_world(pools, corpus_dir, tmp_path, layout):
    """At 2, 4 and 8 ranks: the step's one collective carries the same number of slots,
    and every metrics.jsonl record has the same fields with the same list lengths (the
    per-rank rows go to ranks.jsonl at straggler checks only)."""
    tp, pp, dp = layout
    job = tiny_job(corpus_dir, str(tmp_path), train={"steps": 3, "global_batch": 8, "micro_batch": 2},
                   parallel={"tp": tp, "pp": pp, "dp": dp},
                   observability={"progress": "off", "straggler_interval": 2, "straggler_factor": 1000.0})
    got = pools(tp * pp * dp).run(_payload_and_records, job)
    for rank in got:
        # the first step carries no previous figures, but the same slots (zeros)
        assert set(rank["sizes"]) == {EXPECTED_PAYLOAD}, rank["sizes"]
    records = got[0]["records"]
    assert records[0] == EXPECTED_RECORD_1, records[0]
    assert records[1] == EXPECTED_RECORD_2, records[1]  # a straggler check: the stragglers list
    table = [json.loads(line) for line in (tmp_path / "ranks.jsonl").read_text().splitlines()]
    assert [t["step"] for t in table] == [2] and len(table[0]["ranks"]) == tp * pp * dp


# (sums, maxes): norm + loss + 7 breakdown fields + bubble + CPU of the step and of its
# forward/backward; max and -min of step time, busy time and peak memory
EXPECTED_PAYLOAD = (2 + len(BREAKDOWN) + 3, 6)
_FIGURES = {k: "float" for k in BREAKDOWN} | {
    "bubble_fraction": "float", "cpu_s": "float", "cpu_fwd_bwd_s": "float",
    "max_step_time_s": "float", "min_step_time_s": "float",
    "max_busy_s": "float", "min_busy_s": "float", "peak_mem_bytes": "int", "min_peak_mem_bytes": "int",
    "max_step_time_rank": {"rank": "int", "tp": "int", "cp": "int", "pp": "int", "dp": "int"},
    "max_busy_rank": {"rank": "int", "tp": "int", "cp": "int", "pp": "int", "dp": "int"},
    "max_peak_mem_rank": {"rank": "int", "tp": "int", "cp": "int", "pp": "int", "dp": "int"},
    "mem_source": "str"}
EXPECTED_RECORD_1 = {"step": "int", "loss": "float", "lr": "float", "grad_norm": "float",
                     "tokens_per_s": "float", "step_time_s": "float", "tflops_per_device": "float",
                     "skipped": "bool", "skipped_steps": "int", "loss_spike": "bool", **_FIGURES}
EXPECTED_RECORD_2 = {**EXPECTED_RECORD_1, "stragglers": []}


def test_cpu_seconds_count_work_outside_the_schedule_and_not_waiting(corpus_dir, tmp_path, one_thread):
    """cpu_s is the process's CPU time in the step: a hook that spins 30 ms of CPU after the
    backward adds 30 ms to it (and nothing to cpu_fwd_bwd_s); one that sleeps 30 ms adds to
    the step time, not to the CPU."""
    import time

    def hook(trainer):
        if trainer.step % 2 == 0:  # trainer.step: the steps done before this one
            t0 = time.thread_time()  # this thread's CPU: one compute thread (one_thread)
            while time.thread_time() - t0 < 0.03:
                pass
        else:
            time.sleep(0.03)

    job = tiny_job(corpus_dir, str(tmp_path), train={"steps": 12})
    trainer = Trainer(config_from_dict(job), Topology.single(), log=False)
    trainer.step_hooks.append(hook)
    records = trainer.fit()[2:]  # after warm-up
    spin = [r for r in records if r["step"] % 2 == 1]
    sleep = [r for r in records if r["step"] % 2 == 0]
    med = lambda rs, f: statistics.median(f(r) for r in rs)  # noqa: E731
    outside = lambda r: r["cpu_s"] - r["cpu_fwd_bwd_s"]  # noqa: E731
    # the spin's 30 ms of CPU, less what a step's own CPU varies (a few ms here)
    assert 0.025 < med(spin, outside) - med(sleep, outside) < 0.045
    assert abs(med(spin, lambda r: r["cpu_fwd_bwd_s"]) - med(sleep, lambda r: r["cpu_fwd_bwd_s"])) < 0.01
    # sleeping: 30 ms of step without this process's CPU (less what its loader thread may
    # compute meanwhile); a busy machine only adds to the idle time of both kinds of step,
    # so the bound is on the sleeping steps alone (a spinning step waiting for a core
    # shows idle time too: 42 ms once in CI)
    idle = lambda r: r["step_time_s"] - r["cpu_s"]  # noqa: E731
    assert med(sleep, idle) > 0.02


def test_the_step_time_includes_an_optimizer_update_the_device_runs_late(corpus_dir, tmp_path):
    """Issue 30, point 5: on CUDA ``apply()`` only queues the update. A fake asynchronous
    device: ``apply()`` returns at once and its 1.5 s of work runs in a thread, done when
    the trainer waits for the step's issued work (on CUDA an event recorded after apply).
    The step's time must hold the update: before, step_time_s was taken when apply()
    returned (under 1.5 s here) and tokens/s was inflated by as much."""
    import threading

    job = tiny_job(corpus_dir, str(tmp_path), train={"steps": 2}, observability={"progress": "off"})
    trainer = Trainer(config_from_dict(job), Topology.single(), log=False)
    apply, queued = trainer.optimizer.apply, []

    def queued_apply(*args, **kwargs):
        apply(*args, **kwargs)
        work = threading.Thread(target=time.sleep, args=(1.5,))
        work.start()
        queued.append(work)  # the device's queue: the update is not done yet

    def queued_apply_timed(*args, **kwargs):
        queued_apply(*args, **kwargs)
        marks["applied"] = time.perf_counter()

    begin, marks = trainer.timeline.begin_step, {}

    def begin_timed(step):  # called right after the step's clock starts
        marks["start"] = time.perf_counter()
        begin(step)

    trainer.timeline.begin_step = begin_timed
    trainer.optimizer.apply = queued_apply_timed
    trainer.wait_for_issued_work = lambda: [w.join() for w in queued]  # Event.synchronize()
    record = trainer.train_step()
    trainer.release()
    # the step's end, by its own clock, is after the update's work (load-independent:
    # before, it came right after apply() returned, 1.5 s short)
    end = marks["start"] + record["step_time_s"]
    assert end >= marks["applied"] + 1.5 - 0.01, (end - marks["applied"])
