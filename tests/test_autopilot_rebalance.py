"""The autopilot moves layers off a slow pipeline stage (autopilot/balance.py,
train/rebalance.py): the decision on hand-worked stage timings; a running pp 2 job whose
second stage is made slow per layer (a sleep in each of its layers' forward) rebalances
once, does not flap, and keeps one process's losses; and, as root, the same with the
stage's process under a CPU quota of half a core (the throttling the straggler benchmark,
benchmarks/bench_straggler.py, times)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from parallel3d.autopilot.balance import decide_rebalance, pipeline_step, split_for_speeds, stage_busy
from parallel3d.config import config_from_dict
from parallel3d.pipeline.partition import balanced_split
from parallel3d.topology import Topology
from parallel3d.train.trainer import Trainer

from helpers import relative_diff, tiny_job
from throttle import HOST_SHARES, can_throttle, cpu_quota, join, leave, throttled_seconds

pytestmark = pytest.mark.usefixtures("one_thread")


# --- the decision, on hand-worked numbers ---------------------------------------------

def _decide(busy, split, **kw):
    args = {"embed_cost": 0.0, "head_cost": 0.5, "microbatches": 4, "measured_s": 1.0, "min_gain": 0.1,
            "steps_left": 100, "switch_cost_s": 5.0, **kw}
    return decide_rebalance(busy, split, **args)


def test_equal_speeds_give_the_pipelines_own_balanced_split():
    for n_layers, pp, head in [(8, 2, 0.5), (8, 2, 1.5), (16, 4, 2.4), (7, 3, 0.0), (5, 5, 3.0)]:
        assert split_for_speeds(n_layers, [2.0] * pp, 0.0, head) == balanced_split(n_layers, pp, 0.0, head)


def test_a_stage_at_half_speed_gets_fewer_layers_and_the_step_is_predicted_from_the_pipeline_shape():
    # 8 layers [4, 4], the head 0.5 layer on stage 1, which runs at half speed: busy 4 and
    # 2 * 4.5 = 9 s per step. Stage speeds 1 and 2 s per layer unit; the best whole-layer
    # split is [6, 2] (busy 6 and 2 * 2.5 = 5; [5, 3] gives 7, [7, 1] gives 7).
    d = _decide([4.0, 9.0], [4, 4])
    assert d.speeds == [1.0, 2.0] and d.slow_stage == 1
    assert d.target == [6, 2] and d.action == "rebalance", d.reason
    # 1F1B, 4 micro-batches: T = (3 max + sum) / 4: 10 before, (18 + 11) / 4 = 7.25 after
    assert d.predicted_s == pytest.approx(0.725) and d.gain == pytest.approx(0.275)
    assert pipeline_step([4.0, 9.0], 4) == pytest.approx(10.0)
    event = d.event(20)
    assert event["event"] == "autopilot" and event["kind"] == "rebalance" and event["to"] == "pp_layers [6, 2]"


def test_after_the_move_the_same_speeds_keep_the_split_no_flapping():
    # at [6, 2] the slow stage is no longer the busier one (5 s against 6 s), but per layer
    # it still is: the split computed from the speeds is the one running
    d = _decide([6.0, 5.0], [6, 2])
    assert d.speeds == [1.0, 2.0] and d.target == [6, 2] and d.action == "stay", d.reason


def test_a_small_gain_or_one_the_remaining_steps_cannot_pay_stays():
    # stage 1 ten per cent slower per unit: [4, 4] -> busy 4, 4.95; [5, 3] -> 5, 3.85:
    # T = (3 * 4.95 + 8.95) / 4 = 5.95 against (15 + 8.85) / 4 = 5.96: no gain at all
    assert _decide([4.0, 4.95], [4, 4]).action == "stay"
    # the half-speed stage again, 27.5% of 1 s saved per step: 20 steps save 5.5 s
    assert _decide([4.0, 9.0], [4, 4], steps_left=20, switch_cost_s=5.0).action == "rebalance"
    assert _decide([4.0, 9.0], [4, 4], steps_left=18, switch_cost_s=5.0).action == "stay"  # 4.95 s
    assert _decide([4.0, 9.0], [4, 4], min_gain=0.3).action == "stay"


def test_stage_busy_takes_each_stages_slowest_rank_and_the_median_over_checks():
    row = lambda pp, busy: {"pp": pp, "busy_s": busy}  # noqa: E731
    tables = [{"step": 10, "ranks": [row(0, 1.0), row(0, 1.2), row(1, 3.0), row(1, 2.0)]},
              {"step": 20, "ranks": [row(0, 1.1), row(0, 1.0), row(1, 2.5), row(1, 2.0)]},
              {"step": 30, "ranks": [row(0, 9.0), row(0, 1.0), row(1, 2.8), row(1, 2.0)]}]
    assert stage_busy(tables, 2) == [1.2, 2.8]


# --- a running job -----------------------------------------------------------------------

STEPS = 34
SLEEP_S = 0.02  # per decoder layer forward on the slow stage


def _job(corpus_dir, run_dir, seq_len=32, **model) -> dict:
    # 4 layers at pp 2; decide every 5 + 5 steps on the straggler checks of every 5th step:
    # named at step 5, rebalanced at 10, the move checked at 20, stay at 30
    return tiny_job(corpus_dir, str(run_dir), model={"n_layers": 4, **model},
                    train={"steps": STEPS, "autopilot": True, "seq_len": seq_len},
                    parallel={"tp": 1, "pp": 2, "dp": 1, "schedule": "1f1b"},
                    autopilot={"layouts": False, "skip_steps": 5, "measure_steps": 5, "move_cost_s": 1e-3},
                    observability={"progress": "off", "straggler_interval": 5})


def _slow_layers(trainer, seconds: float) -> None:
    """Stage 1's decoder layers each sleep ``seconds`` in every forward."""
    from parallel3d.models.llama.model import DecoderLayer

    if trainer.topo.pp_rank == 1:
        for module in trainer.model.modules():
            if isinstance(module, DecoderLayer):
                module.register_forward_hook(lambda *args: time.sleep(seconds))


def _run(job: dict, sleep_s: float = 0.0, hosts: list[str] | None = None) -> list[float]:
    from parallel3d.train.pilot import fit_with_autopilot, timed_trainer

    def make(c, topo):
        trainer = Trainer(c, topo)
        _slow_layers(trainer, sleep_s)
        return trainer
    cfg = config_from_dict(job)
    trainer, build_s = timed_trainer(lambda: make(cfg, Topology(1, 2, 1)))
    if hosts:  # this rank's process into its "host" (a cgroup; tests/throttle.py)
        join(Path(hosts[trainer.topo.rank]))
    try:
        return [r["loss"] for r in fit_with_autopilot(trainer, make, build_s)]
    finally:
        if hosts:
            leave(Path(hosts[trainer.topo.rank]))


def _reference(job: dict) -> list[float]:
    one = json.loads(json.dumps(job))
    one["parallel"] = {"tp": 1, "pp": 1, "dp": 1}
    one["train"]["autopilot"] = False
    one["run"]["dir"] += "-reference"
    return [r["loss"] for r in Trainer(config_from_dict(one), Topology.single(), log=False).fit()]


def _lines(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _check(run_dir: Path, job: dict, losses: list[float], move_steps=(10,)) -> list[dict]:
    """``move_steps``: the decisions at which the move may come (the first, step 10, for
    layers slowed by sleeping; a CPU quota's slowdown is read through the machine's load,
    which a busy machine can blur past min_gain at the first decision: then the second)."""
    lines = _lines(run_dir)
    steps = [r for r in lines if "event" not in r]
    events = [r for r in lines if r.get("event") == "autopilot"]
    # stage 1 (rank 1) named as the straggler at the first check, step 5
    named = [r["step"] for r in steps for s in r.get("stragglers", []) if s["rank"] == 1]
    assert named and named[0] <= 20, named
    moves = [e for e in events if e["action"] == "rebalance"]
    assert len(moves) == 1 and moves[0]["step"] in move_steps and moves[0]["slow_stage"] == 1, events
    moved = moves[0]["step"]
    assert moves[0]["split"] == [2, 2] and moves[0]["target_split"] == [3, 1], moves[0]
    assert all(e["action"] == "stay" for e in events if e["step"] < moved), events
    # checked, then judged again on the same per-layer speeds: it stays (no flapping); a
    # decision every 10 steps of 34
    after = [e["action"] for e in events if e["step"] > moved and not e["action"].endswith("done")]
    assert after == ["confirmed", "stay"][: (STEPS - moved) // 10], events
    assert [r["step"] for r in steps] == list(range(1, STEPS + 1))
    # `parallel3d report` says it, and draws the move
    from parallel3d.observe.report import autopilot_lines, moves as drawn

    assert any("rebalance: stage 1" in line and "pp_layers [2, 2] -> [3, 1]" in line
               for line in autopilot_lines(events)), autopilot_lines(events)
    assert drawn(events) == [(moved, "pp_layers [3, 1]")]
    index = json.loads((run_dir / "checkpoints" / f"step_{moved:08d}" / "index.json").read_text())
    assert index["layout"]["pp"] == 2
    # fp32: another split adds the same products in another order; 1e-5 is the parity bar
    assert relative_diff(losses, _reference(job)) < 1e-5
    return events


def test_a_stage_slow_per_layer_is_rebalanced_once_and_keeps_the_losses(pools, corpus_dir, tmp_path):
    job = _job(corpus_dir, tmp_path / "run")
    losses = pools(2).run(_run, job, SLEEP_S, timeout=600)[0]
    _check(tmp_path / "run", job, losses)


@pytest.mark.skipif(bool(can_throttle()), reason=can_throttle() or "root")
def test_a_stage_throttled_to_half_a_core_is_named_and_rebalanced(pools, corpus_dir, tmp_path):
    # compute-bound stages (a 128-token sequence, dim 256): a rank that waits most of its
    # step would not feel a quota; each rank a "host" of one core (HOST_SHARES), the
    # second one throttled to half of it
    job = _job(corpus_dir, tmp_path / "run", seq_len=128, dim=256, ffn_dim=640)
    with cpu_quota(None, "p3d-host0", HOST_SHARES) as host0, cpu_quota(0.5, "p3d-host1", HOST_SHARES) as host1:
        losses = pools(2).run(_run, job, 0.0, [str(host0), str(host1)], timeout=600)[0]
        held_back = throttled_seconds(host1)
    assert held_back > 0  # the quota bound
    _check(tmp_path / "run", job, losses, move_steps=(10, 20))
