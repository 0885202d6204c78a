"""Pipeline plans without processes: the split rule, every schedule played on simulated
ranks (deadlock, message order, ideal bubble, activations alive), and the job checks."""

from __future__ import annotations

import pytest

from parallel3d.config import config_from_dict
from parallel3d.errors import UserError
from parallel3d.models.llama import config_from_preset
from parallel3d.models.llama.parallelize import stage_costs
from parallel3d.pipeline import schedules
from parallel3d.pipeline.partition import balanced_split, rank_chunks, resolve_split
from parallel3d.pipeline.simulate import ScheduleError, simulate, theoretical_bubble
from parallel3d.train.setup import check_job, resolve_model_config


# -- the split rule --------------------------------------------------------------------------

@pytest.mark.parametrize("n_layers,n_chunks,embed,head,expected", [
    # Worked by hand: the smallest bound on a chunk's cost (layers + embed/head) that fits
    # every layer; under it the most even costs; then fewer layers on earlier chunks.
    (8, 2, 0.0, 0.0, [4, 4]),            # even: bound 4
    (8, 2, 0.0, 1.5, [5, 3]),            # head 1.5 layers: costs 5 | 3 + 1.5 = 4.5
    (16, 4, 0.0, 2.4, [4, 5, 5, 2]),     # bound 5: caps 5,5,5,2 = 17 >= 16; first takes 16-12 = 4
    (7, 3, 1.0, 1.0, [2, 3, 2]),         # costs 3 | 3 | 3
    (6, 4, 0.0, 1.42, [1, 2, 2, 1]),     # bound 2.42: the last chunk must hold a layer
    (5, 5, 0.0, 9.0, [1, 1, 1, 1, 1]),   # one layer each whatever the head costs
    (10, 4, 0.0, 0.0, [2, 2, 3, 3]),     # bound 3; [1, 3, 3, 3] has it too but is less even
])
def test_split_rule_hand_worked(n_layers, n_chunks, embed, head, expected):
    assert balanced_split(n_layers, n_chunks, embed, head) == expected


def test_split_of_real_presets():
    # Llama 3.1 8B: head = 128256*4096 / 218.1M layer GEMM params = 2.41 layers.
    cfg = config_from_preset("8b")
    embed, head = stage_costs(cfg)
    assert embed == 0.0 and 2.40 < head < 2.42
    counts = resolve_split(cfg.n_layers, 4, 1, None, embed, head)
    assert counts == [8, 9, 9, 6] and sum(counts) == 32  # costs 8, 9, 9, 8.41
    # The debug preset's head (2048*128 / 184320 = 1.42 layers) on 2 stages of 4 layers.
    assert resolve_split(4, 2, 1, None, *stage_costs(config_from_preset("debug"))) == [3, 1]
    assert resolve_split(8, 2, 2, [1, 3, 3, 1], 0.0, 5.0) == [1, 3, 3, 1]  # by hand wins


def test_interleaved_chunks_go_round_the_ring():
    assert [rank_chunks(r, 4, 2) for r in range(4)] == [[0, 4], [1, 5], [2, 6], [3, 7]]


# -- schedules on simulated ranks -------------------------------------------------------------

def _cases():
    for pp in (2, 3, 4, 8):
        for m in range(pp, 3 * pp + 1):
            yield "gpipe", pp, 1, m
            yield "1f1b", pp, 1, m
        for v in (2, 3):
            for m in (pp, 2 * pp, 3 * pp):
                yield "interleaved", pp, v, m


def test_every_plan_is_deadlock_free_matched_and_ideal():
    """Each schedule, played under rendezvous sends and in-order matching, finishes, every
    message meets the receive that expects it, and with equal stages (B = 2F, chunks 1/v
    of a stage) the bubble is exactly the textbook one."""
    n = 0
    for name, pp, v, m in _cases():
        result = simulate(name, pp, v, m, t_fwd=1.0 / v, t_bwd=2.0 / v)
        assert result.mean_bubble() == pytest.approx(theoretical_bubble(name, pp, v, m), abs=1e-12), \
            (name, pp, v, m)
        n += 1
    assert n == 100  # 4 pp x (2 schedules x (2pp+1) m + 2 v x 3 m)


def test_simulator_catches_deadlock_and_mismatch(monkeypatch):
    # One exchange per action in interleaved's steady state closes a cycle on the ring.
    def one_per_step(fwd, bwd, warmup):
        return [s for i in range(len(fwd) - warmup) for s in ((fwd[warmup + i],), (bwd[i],))]
    with monkeypatch.context() as mp:
        mp.setattr(schedules, "_interleaved_steady", one_per_step)
        with pytest.raises(ScheduleError, match="deadlocks"):
            simulate("interleaved", 4, 2, 8)
    # Backwards in reverse micro-batch order on one stage only: messages cross.
    real = schedules.one_f_one_b

    def reversed_cooldown(pp, v, m, pp_rank):
        steps = real(pp, v, m, pp_rank)
        return steps[:-2] + steps[-2:][::-1] if pp_rank == 1 else steps
    monkeypatch.setitem(schedules.SCHEDULES, "1f1b", reversed_cooldown)
    with pytest.raises(ScheduleError, match="sends|deadlocks"):
        simulate("1f1b", 3, 1, 6)


@pytest.mark.parametrize("pp,m", [(2, 6), (4, 8), (4, 4), (8, 20)])
def test_activations_alive_1f1b_at_most_pp_gpipe_all(pp, m):
    one_f = simulate("1f1b", pp, 1, m).peak_alive
    assert one_f == [min(pp - r, m) for r in range(pp)]  # first stage: pp, not m
    assert simulate("gpipe", pp, 1, m).peak_alive == [m] * pp


# -- checks of the job ---------------------------------------------------------------------

def _job(**parallel) -> tuple:
    train = parallel.pop("train", {})
    model = parallel.pop("model", {})
    cfg = config_from_dict({"model": {"preset": "debug", **model}, "parallel": parallel,
                            "train": {"global_batch": 16, "micro_batch": 2, **train}})
    return cfg, resolve_model_config(cfg.model), cfg.parallel.tp * cfg.parallel.pp * cfg.parallel.dp


@pytest.mark.parametrize("parallel,message", [
    ({"pp": 4, "dp": 2, "train": {"global_batch": 8}},
     "2 micro-batches per step (train.global_batch 8 / (micro_batch 2 * dp 2)) is fewer than parallel.pp 4"),
    ({"pp": 8, "model": {"n_layers": 4}}, "model.n_layers 4 is fewer than parallel.pp 8"),
    ({"pp": 4, "schedule": "interleaved", "virtual_stages": 2},
     "model.n_layers 4 is fewer than parallel.pp 4 * parallel.virtual_stages 2 = 8"),
    ({"pp": 2, "pp_layers": [1, 2]}, "parallel.pp_layers [1, 2] adds up to 3, not model.n_layers 4"),
    ({"pp": 2, "pp_layers": [4]}, "parallel.pp_layers has 1 entries but the pipeline has pp * "
                                  "virtual_stages = 2 * 1 = 2 chunks"),
    ({"pp": 2, "pp_layers": [4, 0]}, "parallel.pp_layers [4, 0] has an empty chunk"),
    ({"pp": 2, "schedule": "1f1f"}, "parallel.schedule '1f1f' is unknown (did you mean '1f1b'?)"),
    ({"pp": 2, "schedule": "interleaved"}, "'interleaved' needs parallel.pp >= 2 and "
                                           "parallel.virtual_stages >= 2, got pp 2 and virtual_stages 1"),
    ({"pp": 2, "virtual_stages": 2}, "parallel.virtual_stages 2 needs parallel.schedule 'interleaved'"),
    ({"pp": 2, "schedule": "interleaved", "virtual_stages": 2, "train": {"global_batch": 6}},
     "micro-batches per step (3 = train.global_batch 6 / (micro_batch 2 * dp 1)) to be a multiple "
     "of parallel.pp 2"),
])
def test_bad_pipeline_jobs_name_the_numbers(parallel, message):
    cfg, model, world = _job(**parallel)
    with pytest.raises(UserError) as e:
        check_job(cfg, model, world)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_good_pipeline_jobs_pass():
    for parallel in ({"pp": 2, "pp_layers": [3, 1]}, {"pp": 2, "schedule": "gpipe"},
                     {"pp": 2, "schedule": "interleaved", "virtual_stages": 2}):
        check_job(*_job(**parallel))
