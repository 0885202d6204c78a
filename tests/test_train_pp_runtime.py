"""The pipeline runtime's timing and memory: the measured bubble of 1F1B, interleaved,
zb-h1 and zb-v against theory and the simulator (sleeping stages), the trace's placement
of a rank's steps, and a first stage that drops its outputs once handed on. Parity with
one process and the trace's contents are tests/test_train_pp.py's."""

from __future__ import annotations

import statistics

import pytest
import torch

from parallel3d.config import config_from_dict
from parallel3d.pipeline.partition import rank_chunks
from parallel3d.pipeline.runtime import PipelineSchedule
from parallel3d.pipeline.simulate import simulate, theoretical_bubble
from parallel3d.pipeline.synthetic import FixedCostChunk, mean_loss
from parallel3d.topology import Topology
from parallel3d.train.trainer import Trainer

from test_train_pp import _job


def test_trace_places_a_ranks_step_after_its_previous_one():
    """Steps are placed at rank 0's offsets, except where a rank's previous step ran past
    that offset (it left the closing collective later): by hand, rank 0's steps start at
    0 and 1.0 s; rank 1's step 1 ends 1.2 s after its start, so its step 2 (whose data
    span starts 0.1 s before its window) begins at 1.2 s, not 0.9 s."""
    from parallel3d.pipeline.timeline import chrome_trace

    def rec(step, offset, spans):
        return {"step": step, "offset_s": offset, "spans": [(n, c, "compute", t0, t1, {}) for n, c, t0, t1 in spans]}
    ranks = [[rec(1, 0.0, [("F0.0", "forward", 0.0, 0.9)]), rec(2, 1.0, [("F0.0", "forward", 0.0, 0.5)])],
             [rec(1, 5.0, [("F1.0", "forward", 0.1, 1.2)]),
              rec(2, 6.3, [("data", "data", -0.1, 0.0), ("F1.0", "forward", 0.0, 0.4)])]]
    events = [e for e in chrome_trace(ranks, ["a", "b"])["traceEvents"] if e["ph"] == "X"]
    starts = {(e["pid"], e["args"]["step"], e["name"]): e["ts"] for e in events}
    assert starts[(0, 2, "F0.0")] == 1.0e6  # rank 0 defines the offsets
    assert starts[(1, 1, "F1.0")] == 0.1e6
    assert starts[(1, 2, "data")] == pytest.approx(1.2e6) and starts[(1, 2, "F1.0")] == pytest.approx(1.3e6)


def _bubbles_side_by_side(m: int, t_fwd: float, steps: int,
                          schedules=(("1f1b", 1), ("interleaved", 2))) -> dict[str, list[float]]:
    """Schedules on the same two ranks, their steps alternating (the order swapped every
    step), so that a change in the machine's load falls on all alike. Every stage does
    the same work: forward ``t_fwd``, backward ``2 t_fwd`` (split: B ``t_fwd`` + W
    ``t_fwd``), a chunk 1/v of it. Returns each schedule's bubble fraction per step."""
    topo = Topology(1, 2, 1)
    built = {}
    for name, v in schedules:
        split = name in ("zb-h1", "zb-v")
        b, w = (t_fwd / v, t_fwd / v) if split else (2 * t_fwd / v, 0.0)
        chunks = [FixedCostChunk(t_fwd / v, b, 4, first=c == 0, t_w=w)
                  for c in rank_chunks(topo.pp_rank, 2, v, name)]
        built[name] = PipelineSchedule(chunks, mean_loss, topo, name=name, virtual_stages=v,
                                       activation_shape=(1, 2, 4), activation_dtype=torch.float32,
                                       device=torch.device("cpu"))
    tokens = torch.zeros(1, 2, dtype=torch.long)
    out: dict[str, list[float]] = {name: [] for name in built}
    for step in range(steps):
        for name in (list(built) if step % 2 == 0 else list(built)[::-1]):
            built[name].run([(tokens, tokens)] * m)
            out[name].append(built[name].step_metrics()["bubble_fraction"])
    return out


def test_measured_bubble_follows_theory(pools):
    """Balanced sleeping stages (so core contention cannot distort them): 1F1B's measured
    bubble is near (p-1)/(m+p-1); interleaving 2 chunks measures smaller.

    A loaded machine wakes each rank late after every sleep and every receive, and
    interleaving has twice the hand-offs, so both schedules run in one process pair, step
    by step alternately, compared by their medians; and the stages are long (100 ms
    forward, 200 ms backward) against those wake-up delays. Held 5 runs in a row with two
    busy processes beside the machine's own load (load average 13-26 on 2 cores).
    benchmarks/bench_pipeline.py is the measurement."""
    m, t_fwd, steps = 4, 0.1, 5
    measured = pools(2).run(_bubbles_side_by_side, m, t_fwd, steps)[0]
    one_f = statistics.median(measured["1f1b"][1:])
    inter = statistics.median(measured["interleaved"][1:])
    theory = theoretical_bubble("1f1b", 2, 1, m)  # 1/5
    assert 0.8 * theory < one_f < 1.5 * theory, measured
    assert 0.8 * theoretical_bubble("interleaved", 2, 2, m) < inter < one_f, measured


def test_measured_zero_bubble_is_under_half_of_1f1b_and_follows_the_simulator(pools):
    """pp 2, m = 2 pp = 4, the same sleeping work per stage: zb-h1's measured bubble is at
    most half of 1F1B's (theory 1/13 against 1/5) and zb-v's less (1/25), each near the
    simulator's prediction for its plan at these costs. The runs alternate step by step in
    one process pair, compared by medians. Bounds: nothing runs faster than its plan (0.9:
    clock and window rounding); a loaded machine wakes a rank late after each receive, a
    delay the small zero-bubble idle time feels most (zb-h1 measured 1.48x its plan at
    load 10 with these 100 ms stages, 1.02-1.04x with 200 ms stages at load 8: the
    benchmark, benchmarks/bench_pipeline.py, makes the 10% comparison), so 1.6 here."""
    m, t_fwd, steps = 4, 0.1, 5
    schedules = (("1f1b", 1), ("zb-h1", 1), ("zb-v", 2))
    measured = pools(2).run(_bubbles_side_by_side, m, t_fwd, steps, schedules)[0]
    median = {name: statistics.median(measured[name][1:]) for name, _ in schedules}
    assert median["zb-h1"] <= 0.5 * median["1f1b"] and median["zb-v"] <= median["zb-h1"], measured
    for name, v in schedules[1:]:
        plan = simulate(name, 2, v, m, t_fwd / v, t_fwd / v, t_fwd / v).mean_bubble()
        assert 0.9 * plan < median[name] < 1.6 * plan, (name, plan, measured)


def _first_stage_step_peak(job: dict, keep_outputs: bool) -> dict:
    """Rank 0's high-water mark of tensor bytes created during its second step (1F1B,
    pp 2), with the chunk outputs dropped once handed on, or kept (the runtime before)."""
    from parallel3d.pipeline import runtime
    from parallel3d.zero.memory import AllocationMeter

    cfg = config_from_dict(job)
    trainer = Trainer(cfg, Topology(cfg.parallel.tp, cfg.parallel.pp, cfg.parallel.dp))
    drop = runtime._drop_values
    if keep_outputs:
        runtime._drop_values = lambda out: None
    try:
        trainer.train_step()
        with AllocationMeter() as meter:
            trainer.train_step()
    finally:
        runtime._drop_values = drop
    t = cfg.train
    return {"peak": meter.peak, "alive": trainer.schedule.peak_alive,
            "activation": t.micro_batch * t.seq_len * cfg.model.dim * 4}


def test_a_stage_drops_its_outputs_once_handed_on(pools, corpus_dir, tmp_path):
    """The first stage keeps up to pp micro-batches of activations for their backward,
    but not their outputs: those are the next stage's (the send holds one until it is
    done). Its peak is lower than with the outputs kept by about one output per
    micro-batch alive (fp32, (micro_batch, seq, dim) each): at least all but the one
    still in the send."""
    job = _job(corpus_dir, str(tmp_path), 4, schedule="1f1b", pp=2)
    dropped, kept = (pools(2).run(_first_stage_step_peak, job, keep)[0] for keep in (False, True))
    assert dropped["alive"] == kept["alive"] == 2
    saved = kept["peak"] - dropped["peak"]
    assert saved >= (kept["alive"] - 1) * kept["activation"], (saved, kept, dropped)
