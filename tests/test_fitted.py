"""The fitted step-time model (planner/fitted.py) and the autopilot's decision
(autopilot/decide.py) on hand-worked numbers: no processes, no clocks."""

from __future__ import annotations

from dataclasses import replace

import pytest

from parallel3d.autopilot.decide import decide, options
from parallel3d.models.llama import LlamaConfig
from parallel3d.models.moe import MoEConfig
from parallel3d.planner.fitted import ChunkCost, FittedTerms, Measured, fit_terms, predict, rank_work
from parallel3d.planner.hardware import FRAGMENTATION
from parallel3d.planner.memory import memory_per_stage
from parallel3d.planner.spec import Layout, Workload

MODEL = LlamaConfig(vocab_size=512, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=160)
WORK = Workload(MODEL, seq_len=32, global_batch=8, dtype="fp32")
ACT = 2 * 32 * 64 * 4  # one micro-batch's activation: micro_batch 2 x 32 tokens x dim 64, fp32
MS = 1e-3
COMPUTE = {1: ChunkCost(base=1 * MS, layer=4 * MS, head=3 * MS), 2: ChunkCost(base=1 * MS, layer=2.5 * MS, head=2 * MS)}


def terms(**kw) -> FittedTerms:
    base = dict(compute=COMPUTE, beta=1 * MS, psi=0.0, phi=2 * MS, adam=0.0, background=0.0, shared=True,
                cores=2, threads=1)
    return FittedTerms(**{**base, **kw})


def test_collectives_of_a_tp2_dp2_step_counted_by_hand():
    # 2 micro-batches per dp rank (8 / (2 * 2)); each: 2 layers x 8 sequence-parallel
    # gathers/reduce-scatters, the embedding's 2, the loss's 2 all-reduces and the
    # head input's 2 -> 22 ops of (2 - 1) steps; data parallel at ZeRO 1: one bucket's
    # reduce-scatter and all-gather
    (stage,) = rank_work(WORK, Layout(tp=2, pp=1, dp=2, micro_batch=2, zero=1, sequence_parallel=True), COMPUTE)
    assert stage.counts == {"tp": 44, "dp": 2}
    # bytes: a gather or reduce-scatter over 2 moves half the full activation, an
    # all-reduce twice that; the loss's all-reduces carry 4 and 8 bytes a token
    per_mb = 16 * ACT / 2 + 2 * ACT / 2 + (4 + 8) * 64 + 2 * ACT / 2
    assert stage.kind_bytes["tp"] == pytest.approx(2 * per_mb)
    # compute: per micro-batch base + 2 layers + head at tp 2 = 1 + 5 + 2 ms
    assert stage.compute_s == pytest.approx(2 * 8 * MS)


def test_pipeline_sends_and_zero0_all_reduce_counted_by_hand():
    first, last = rank_work(WORK, Layout(tp=1, pp=2, dp=2, micro_batch=2, zero=0), COMPUTE)
    # each stage: 2 micro-batches x (send + receive) across its one boundary; one
    # all-reduce of the gradient bucket over dp 2
    assert first.counts == last.counts == {"pp": 4, "dp": 1}
    assert first.kind_bytes["pp"] == 4 * ACT
    # stage 0: base + 1 layer; stage 1: base + 1 layer + head (tp 1), 2 micro-batches
    assert first.compute_s == pytest.approx(2 * 5 * MS) and last.compute_s == pytest.approx(2 * 8 * MS)


def test_context_parallel_work_counted_by_hand():
    # cp 2 x dp 2, 2 micro-batches of 2 x 32 tokens a rank (8 / 2 / 2), 16 tokens of each
    # sequence on a rank: the compute is half the probe's whole-sequence cost, (1 + 2 x 4 +
    # 3) / 2 ms a micro-batch; the gradient buckets go over dp x cp = 4 (ZeRO 1: one
    # reduce-scatter and one all-gather, 3 steps each)
    layout = Layout(tp=1, pp=1, dp=2, cp=2, micro_batch=2, zero=1)
    (stage,) = rank_work(WORK, layout, COMPUTE)
    assert stage.compute_s == pytest.approx(2 * 12 / 2 * MS)
    kv = 2 * 2 * 32 * (2 * 16) * 4  # K and V of the whole sequences: 2 x mb x S x (2 kv-heads x 16) fp32
    # grouped-query attention: the all-gather mode, per layer and micro-batch one
    # all-gather and one reduce-scatter over cp 2, each moving half of it
    assert layout.cp_mode(MODEL) == "allgather"
    assert stage.counts == {"cp": 2 * 2 * 2, "dp": 6}
    assert stage.kind_bytes["cp"] == pytest.approx(2 * 2 * 2 * kv / 2)
    # the ring: per layer and micro-batch one K/V send forward, one backward and one fp32
    # dK/dV send, each a shard (half) of the K/V
    (ring,) = rank_work(WORK, replace(layout, cp_comm="ring"), COMPUTE)
    assert ring.counts["cp"] == 2 * 2 * (1 + 1 + 1)
    assert ring.kind_bytes["cp"] == pytest.approx(2 * 2 * (1 + 1 + 1) * kv / 2)
    # full recomputation runs the forward's all-gather again
    (full,) = rank_work(WORK, replace(layout, recompute="full"), COMPUTE)
    assert full.counts["cp"] == 2 * 2 * 3
    # tensor parallelism inside a cp rank: its collectives carry the rank's 16 tokens
    (tp_cp,) = rank_work(WORK, Layout(tp=2, pp=1, dp=1, cp=2, micro_batch=2, zero=1), COMPUTE)
    (tp_only,) = rank_work(WORK, Layout(tp=2, pp=1, dp=1, cp=1, micro_batch=2, zero=1), COMPUTE)
    assert tp_cp.kind_bytes["tp"] == pytest.approx(tp_only.kind_bytes["tp"] / 2)


def test_expert_parallel_work_counted_by_hand():
    # 2 layers, the second sparse (8 experts of ffn 48, top 2); dp 4 x ep 2, one
    # micro-batch of 2 x 32 tokens a rank (8 / 4 / 2): the sparse layer's 4 all-to-alls
    # (dispatch, combine, both gradients), each a count exchange and one of 64 x 2 rows of
    # dim 64 fp32, of which half leave the rank: (2 - 1) steps each
    moe = MoEConfig(n_experts=8, top_k=2, ffn_dim=48, dense_layers=(0,))
    work = Workload(LlamaConfig(vocab_size=512, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=160, moe=moe),
                    seq_len=32, global_batch=8, dtype="fp32")
    layout = Layout(tp=1, pp=1, dp=4, ep=2, micro_batch=2, zero=1)
    (stage,) = rank_work(work, layout, COMPUTE)
    assert stage.counts["ep"] == 4 * 2
    assert stage.kind_bytes["ep"] == pytest.approx(4 * 64 * 2 * 64 * 4 / 2)
    # the rank's 4 of 8 experts (3 x 64 x 48 each) reduce over dp / ep = 2 ranks, the rest
    # over 4: ZeRO 1, a reduce-scatter and an all-gather in each group
    experts = 4 * 3 * 64 * 48
    assert stage.counts["dp"] == 2 * (4 - 1) + 2 * (2 - 1)
    dense = rank_work(work, replace(layout, ep=1), COMPUTE)[0]
    total = dense.opt_elements * 4  # every parameter of the ep 1 rank, stepped over 4
    assert stage.opt_elements == pytest.approx((total - 8 * 3 * 64 * 48) / 4 + experts / 2)
    assert "ep" not in dense.counts


def test_a_context_parallel_job_is_ranked_against_other_cp_degrees():
    """The autopilot's candidates for a cp job include other cp degrees (cp 1, 2 and 4 of
    4 ranks: 32 tokens split into 2 cp chunks), and for a job without cp on short
    sequences only cp 1."""
    budget = 10**12
    current = Layout(tp=1, pp=1, dp=2, cp=2, micro_batch=2, zero=1)
    cps = {o.layout.cp for o in options(WORK, current, terms(), 4, budget, 0.1)}
    assert cps == {1, 2, 4}
    plain = Layout(tp=1, pp=1, dp=4, micro_batch=2, zero=1)
    assert {o.layout.cp for o in options(WORK, plain, terms(), 4, budget, 0.1)} == {1}


def test_a_shared_host_divides_the_work_by_the_cores_the_job_gets():
    layout = Layout(tp=1, pp=1, dp=4, micro_batch=2, zero=0)
    # a rank: 1 micro-batch of 1 + 2 x 4 + 3 = 12 ms, an all-reduce over 4 (3 steps of
    # 1 ms), 2 ms other: 17 ms. Four ranks on 2 idle cores: 4 x 17 / 2.
    assert predict(WORK, layout, terms(), 4).step_s == pytest.approx(34 * MS)
    # 4 runnable threads of other processes: the kernel shares the 2 cores among 8
    # threads, the job gets 1 of them
    assert predict(WORK, layout, terms(background=4.0), 4).step_s == pytest.approx(68 * MS)
    # dedicated devices (a GPU each): the busiest rank alone
    assert predict(WORK, layout, terms(shared=False), 4).step_s == pytest.approx(17 * MS)


def test_fit_inverts_a_measurement_worked_by_hand():
    layout = Layout(tp=1, pp=1, dp=4, micro_batch=2, zero=0)
    # true terms: 1 ms a collective step, 2 ms other, 4 background threads -> CPU in
    # forward/backward 12 + 3 = 15 ms, in the step 17 ms, step 68 ms (see above)
    measured = Measured(layout, step_s=68 * MS, cpu_s=17 * MS, cpu_fwd_bwd_s=15 * MS, busy_max_s=0.0,
                        comm_exposed_s=0.0, bubble_s=0.0, steps=20)
    got = fit_terms(WORK, measured, COMPUTE, shared=True, cores=2, threads=1, ranks_per_host=4, psi=0.0,
                    adam=0.0, beta_prior=2 * MS)  # its 3 steps: 6 ms at the prior, a visible share: fitted
    assert got.beta == pytest.approx(1 * MS) and got.phi == pytest.approx(2 * MS)
    assert got.background == pytest.approx(4.0)
    # and tp 2 x dp 2 from it: compute 2 x (1 + 5 + 2) = 16 ms, 46 steps (above) = 46 ms,
    # 2 ms other: 64 ms a rank; 4 ranks on the 1 core they get
    other = Layout(tp=2, pp=1, dp=2, micro_batch=2, zero=1, sequence_parallel=True)
    assert predict(WORK, other, got, 4).step_s == pytest.approx(4 * 64 * MS)


def _measured_at(layout: Layout, t: FittedTerms) -> Measured:
    """What the model says ``layout`` measures under ``t`` (CPU per rank, step)."""
    p = predict(WORK, layout, t, 4)
    work = sum(s.compute_s + t.beta * s.steps for s in p.stages) / len(p.stages)
    return Measured(layout, p.step_s, work + t.phi, work, 0.0, 0.0, 0.0, 20)


def test_a_job_at_its_best_layout_stays():
    best = Layout(tp=1, pp=1, dp=4, micro_batch=2, zero=0)
    t = terms()
    ranked = options(WORK, best, t, 4, 2**40, 0.1)
    assert ranked[0].layout == best  # the layout the model and this measurement agree on
    d = decide(WORK, _measured_at(best, t), t, ranks_per_host=4, budget_bytes=2**40, margin=0.1, min_gain=0.1,
               steps_left=1000, switch_cost_s=1.0)
    assert d.action == "stay" and d.target == best and "predicted fastest" in d.reason


def test_a_slow_layout_moves_unless_the_gain_or_the_remaining_steps_are_too_small():
    slow = Layout(tp=2, pp=1, dp=2, micro_batch=2, zero=1, sequence_parallel=True)  # 256 ms, above
    t = terms()
    measured = _measured_at(slow, t)
    d = decide(WORK, measured, t, ranks_per_host=4, budget_bytes=2**40, margin=0.1, min_gain=0.1,
               steps_left=1000, switch_cost_s=1.0)
    assert d.action == "move" and d.target == Layout(tp=1, pp=1, dp=4, micro_batch=2, zero=0)
    assert d.predicted_s == pytest.approx(34 * MS)
    # 222 ms saved a step: 4 steps do not pay a 1 s move, and a 90% bar is not met
    assert decide(WORK, measured, t, ranks_per_host=4, budget_bytes=2**40, margin=0.1, min_gain=0.1,
                  steps_left=4, switch_cost_s=1.0).action == "stay"
    assert decide(WORK, measured, t, ranks_per_host=4, budget_bytes=2**40, margin=0.1, min_gain=0.9,
                  steps_left=1000, switch_cost_s=1.0).action == "stay"


def test_a_layout_that_does_not_fit_is_never_chosen():
    slow = Layout(tp=2, pp=1, dp=2, micro_batch=2, zero=1, sequence_parallel=True)
    fastest = Layout(tp=1, pp=1, dp=4, micro_batch=2, zero=0)  # replicated Adam state
    sharded = Layout(tp=1, pp=1, dp=4, micro_batch=2, zero=1)

    def need(layout):
        return max(s.peak for s in memory_per_stage(WORK, layout, gloo=True)) * (1 + FRAGMENTATION)

    assert need(sharded) < need(fastest)
    margin = 0.1
    budget = int((need(sharded) + need(fastest)) / 2 / (1 - margin))  # the sharded one fits, zero 0 not
    t = terms()
    d = decide(WORK, _measured_at(slow, t), t, ranks_per_host=4, budget_bytes=budget, margin=margin,
               min_gain=0.1, steps_left=1000, switch_cost_s=1.0)
    assert d.action == "move" and d.target.zero >= 1 and (d.target.tp, d.target.dp) == (1, 4)
    chosen = next(o for o in d.options if o.layout == d.target)
    assert chosen.fits and chosen.required_bytes <= budget * (1 - margin)
    over = [o for o in d.options if o.layout.zero == 0 and o.layout.dp == 4]
    assert over and all(not o.fits and o.why.startswith("does not fit") for o in over)
    # the zero-0 layouts are faster by the model: they lost on memory alone
    assert min(o.step_s for o in over) < chosen.step_s


def test_calibrating_from_a_moved_run_counts_the_steps_after_its_last_move(tmp_path):
    import json

    from parallel3d.planner.calibrate import read_metrics

    lines = [{"step": s, "tokens_per_s": 100.0} for s in range(1, 26)]
    lines.append({"step": 25, "event": "autopilot", "action": "move done", "to": "tp1 pp1 dp8"})
    lines += [{"step": s, "tokens_per_s": 200.0 + s} for s in range(26, 41)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    (tmp_path / "config.json").write_text("{}")
    _, rate = read_metrics(tmp_path)
    # steps 27-40 (the first counted step left out): 227 ... 240, median (233 + 234) / 2
    assert rate == 233.5


def test_a_move_is_judged_at_the_load_the_machine_has_now():
    from parallel3d.autopilot.decide import judge_move

    # predicted 300 ms with 1.6 cores; the machine got busier (1.2 cores): 400 ms is the
    # prediction at that load, 390 ms measured is within it
    back, error, raw = judge_move(0.300, 0.390, 0.15, cores_before=1.6, cores_now=1.2)
    assert not back and error == pytest.approx(0.390 / 0.400 - 1) and raw == pytest.approx(0.3)
    # the same step with the cores unchanged: 30% slower than predicted, back it goes
    assert judge_move(0.300, 0.390, 0.15, cores_before=1.6, cores_now=1.6)[0]
    # dedicated devices: no load to scale by
    assert judge_move(0.300, 0.390, 0.15) == (True, pytest.approx(0.3), pytest.approx(0.3))


def test_a_layout_with_few_collectives_keeps_the_prior_collective_cost():
    # dp 4 at ZeRO 0: one all-reduce, 3 steps; at a 0.4 ms prior that is 1.2 ms of 15 ms
    # of forward/backward CPU, under the 10% a fit needs: whatever compute leaves over
    # (here 3 ms) is not taken as the collectives' cost
    layout = Layout(tp=1, pp=1, dp=4, micro_batch=2, zero=0)
    measured = Measured(layout, step_s=68 * MS, cpu_s=17 * MS, cpu_fwd_bwd_s=15 * MS, busy_max_s=0.0,
                        comm_exposed_s=0.0, bubble_s=0.0, steps=20)
    got = fit_terms(WORK, measured, COMPUTE, shared=True, cores=2, threads=1, ranks_per_host=4, psi=0.0,
                    adam=0.0, beta_prior=0.4 * MS)
    assert got.beta == 0.4 * MS
