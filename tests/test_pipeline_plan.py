"""Pipeline plans without processes: the split rule, every schedule played on simulated
ranks (deadlock, message order, ideal bubble, activations alive), and the job checks."""

from __future__ import annotations

import pytest

from parallel3d.config import ParallelConfig, config_from_dict
from parallel3d.errors import UserError
from parallel3d.models.llama import config_from_preset
from parallel3d.models.llama.parallelize import stage_costs
from parallel3d.pipeline import schedules, zero_bubble
from parallel3d.pipeline.actions import Action, inputs_of, outputs_of, undivided_backwards
from parallel3d.pipeline.partition import balanced_split, chunk_owners, rank_chunks, resolve_split
from parallel3d.pipeline.simulate import ScheduleError, simulate, theoretical_bubble
from parallel3d.planner.memory import in_flight
from parallel3d.planner.spec import Layout
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


def test_zb_v_split_balances_the_ranks():
    """Worked by hand. Rank 0 holds the embedding's chunk and the head's, so the ranks are
    balanced first (rank 0's cost: its layers + the head), at least two layers each; then
    each rank's layers go to its chunks r and 2 pp - 1 - r with the closest costs (fewer
    on the earlier chunk on a tie)."""
    # 8 layers, pp 2, head 1.42: bound 5 (rank 0 fits 3 + 1.42), ranks [3, 5]; rank 0:
    # chunk 0 two layers, chunk 3 one (2 | 2.42); rank 1: 2 and 3
    assert resolve_split(8, 2, 2, None, 0.0, 1.42, schedule="zb-v") == [2, 2, 3, 1]
    # 16 layers, pp 2: bound 9 (8.42 leaves rank 0 7 and rank 1 8: 15 < 16), ranks
    # [7, 9]; rank 0: 4 | 3 + 1.42; rank 1: 4 | 5
    assert resolve_split(16, 2, 2, None, 0.0, 1.42, schedule="zb-v") == [4, 4, 5, 3]
    # 16 layers, pp 4, head 2.4: bound 5 (4.4 holds 2 + 4 + 4 + 4 = 14), ranks [2, 4, 5, 5]
    assert resolve_split(16, 4, 2, None, 0.0, 2.4, schedule="zb-v") == [1, 2, 2, 2, 3, 3, 2, 1]
    # one layer a chunk is all 8 layers allow at pp 4, whatever the costs
    assert resolve_split(8, 4, 2, None, 0.0, 1.42, schedule="zb-v") == [1] * 8


def test_interleaved_chunks_go_round_the_ring():
    assert [rank_chunks(r, 4, 2) for r in range(4)] == [[0, 4], [1, 5], [2, 6], [3, 7]]


def test_zb_v_chunks_go_down_and_back_up():
    # chunk c on rank c going down, on rank 2 pp - 1 - c coming back: rank 0 holds the
    # embedding's chunk and the head's, rank pp - 1 the two middle ones
    assert [rank_chunks(r, 4, 2, "zb-v") for r in range(4)] == [[0, 7], [1, 6], [2, 5], [3, 4]]
    assert chunk_owners(2, 2, "zb-v") == [0, 1, 1, 0]
    owners = chunk_owners(4, 2, "zb-v")
    # the turn stays on rank 3; the next hop goes back up to rank 2
    (turn,) = inputs_of(Action("F", 4, 0), owners)
    assert (turn.src, turn.dst, turn.local) == (3, 3, True)
    (grad,) = outputs_of(Action("B", 4, 0), owners)
    assert (grad.chunk, grad.src, grad.dst, grad.local) == (4, 3, 3, True)
    (up,) = outputs_of(Action("F", 4, 0), owners)
    assert (up.src, up.dst, up.local) == (3, 2, False)


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


def _steps(name: str, pp: int, m: int, rank: int) -> list[str]:
    return [" ".join(map(str, step)) for step in schedules.plan(name, pp, 2 if name == "zb-v" else 1, m, rank)]


def test_zb_h1_plan_worked_by_hand():
    # pp 2, m 4. Rank 0 (1F1B's one warm-up forward) keeps no W pending: each W joins the
    # step after its B, where it runs while that step's input travels. Rank 1 keeps one
    # W pending through the steady state and spends the last two at the end, where rank 0
    # finishes its cool-down.
    assert _steps("zb-h1", 2, 4, 0) == ["F0.0", "F0.1", "B0.0", "W0.0 F0.2", "B0.1", "W0.1 F0.3", "B0.2",
                                        "W0.2 B0.3", "W0.3"]
    assert _steps("zb-h1", 2, 4, 1) == ["F1.0", "B1.0", "F1.1", "B1.1", "W1.0 F1.2", "B1.2", "W1.1 F1.3",
                                        "B1.3", "W1.2 W1.3"]


def test_zb_v_order_worked_by_hand():
    # pp 2, m 3 (= 2 pp - 1, the warm-up's need). Rank 0: 2 (pp - 0) - 1 = 3 forwards of
    # chunk 0, then pp - 0 = 2 triples (F, B, W) of chunk 3, the steady state's (F3, B3, W3)
    # after (B0, W0) once chunk 0's forwards are done, then (B0, W0) twice. Rank 1: one
    # forward of chunk 1, one pair (F2, F1), one triple of chunk 2, then the steady state.
    assert " ".join(map(str, zero_bubble.zb_v_order(2, 3, 0))) == (
        "F0.0 F0.1 F0.2 F3.0 B3.0 W3.0 F3.1 B3.1 W3.1 B0.0 W0.0 F3.2 B3.2 W3.2 B0.1 W0.1 B0.2 W0.2")
    assert " ".join(map(str, zero_bubble.zb_v_order(2, 3, 1))) == (
        "F1.0 F2.0 F1.1 F2.1 B2.0 W2.0 F1.2 B1.0 W1.0 F2.2 B2.1 W2.1 B1.1 B2.2 B1.2 W1.1 W2.2 W1.2")
    # placed on the common clock: rank 1 idles at slot 0 (nothing has reached it)
    assert _steps("zb-v", 2, 3, 1)[:3] == ["", "F1.0", "F2.0"]


ZERO_BUBBLE_CASES = [(name, pp, m) for name in ("zb-h1", "zb-v") for pp in range(2, 9)
                     for m in range(pp, 4 * pp + 1)]


def test_zero_bubble_plans_pp2_to_8_deadlock_free_b_before_w_memory_as_planned():
    """pp 2-8, m = pp .. 4 pp, under rendezvous sends (a batch waits for its sends: the
    model NCCL's one handle per batch gives): every (chunk, micro-batch) forwarded, B'd and
    W'd once on its own rank, each W after its B and each B after its forward (checked by
    the simulator's coverage), every message meeting the receive that expects it, no
    deadlock; the activations alive peak as the schedules' docstrings say, which is what
    the planner's memory model counts; with F = B = W the bubble is the closed form."""
    for name, pp, m in ZERO_BUBBLE_CASES:
        v = 2 if name == "zb-v" else 1
        r = simulate(name, pp, v, m, t_fwd=1.0 / v, t_bwd=1.0 / v, t_w=1.0 / v)
        if name == "zb-h1":  # 1F1B's alive-to-B on rank r, pp until their W on every rank
            assert r.peak_to_b == [min(pp - k, m) for k in range(pp)], (pp, m)
            assert r.peak_alive == [min(pp, m)] * pp, (pp, m)
        else:  # zb-v: 2 pp chunk-micro-batches (half a stage each), fewer while m < 2 pp - 1
            assert r.peak_alive == r.peak_to_b == [min(2 * pp, m + k + 1) for k in range(pp)], (pp, m)
        assert r.peak_alive == [in_flight(Layout(pp=pp, schedule=name, virtual_stages=v), m, k)
                                for k in range(pp)], (name, pp, m)
        if name == "zb-h1" or m >= 2 * pp - 1:
            assert r.mean_bubble() == pytest.approx(theoretical_bubble(name, pp, v, m), abs=1e-12), (name, pp, m)
    assert len(ZERO_BUBBLE_CASES) == 2 * sum(3 * pp + 1 for pp in range(2, 9))


@pytest.mark.parametrize("sends_block", [True, False])
def test_undivided_first_chunk_backwards_change_no_timeline(monkeypatch, sends_block):
    """The first chunk's backward run whole in its B (B + W there, nothing in its W)
    leaves every other action's start, the end of each first-chunk W's work, the
    makespan and the memory peaks exactly as with the split, for both schedules at pp
    2, 3, 4 and 8 with m from pp to 4 pp (zb-v's warm-up edge 2 pp - 1 among them): under
    the runtime's rule on gloo (sends waited one batch later) at every cost; under NCCL's
    (a batch waits for its sends) wherever W costs at most B. It saves the split's own
    cost and moves no time anywhere."""
    import parallel3d.pipeline.simulate as sim_module

    costs = [(1.0, 1.0, 1.0), (1.0, 1.26, 0.69), (1.0, 2.0, 0.2), (1.0, 1.6, 0.9)]
    if not sends_block:
        costs += [(0.5, 1.0, 1.0), (1.0, 0.8, 1.2), (1.0, 1.0, 2.0)]
    cases = [(name, pp, m) for name in ("zb-h1", "zb-v") for pp in (2, 3, 4, 8)
             for m in sorted({pp, 2 * pp - 1, 2 * pp, 3 * pp, 4 * pp})]
    for name, pp, m in cases:
        v = 2 if name == "zb-v" else 1
        for f, b, w in costs:
            args = (name, pp, v, m, f / v, b / v, w / v)
            monkeypatch.setattr(sim_module, "undivided_backwards", undivided_backwards)
            whole = simulate(*args, sends_block=sends_block)
            monkeypatch.setattr(sim_module, "undivided_backwards", lambda steps: frozenset())
            split = simulate(*args, sends_block=sends_block)

            # when each action starts, and when the first chunk's W's work is done
            # (1e-12: B + W summed once instead of added in two steps)
            def marks(run):
                return [[(act, t1 if act.startswith("W0.") else t0) for act, t0, t1 in runs] for runs in run.runs]
            for mine, theirs in zip(marks(whole), marks(split)):
                assert [a for a, _ in mine] == [a for a, _ in theirs], args
                assert [t for _, t in mine] == pytest.approx([t for _, t in theirs], abs=1e-12), args
            assert whole.makespan == pytest.approx(split.makespan, abs=1e-12), args
            assert (whole.peak_alive, whole.peak_to_b) == (split.peak_alive, split.peak_to_b), args
            assert any(act.startswith("W0.") and t0 == t1 for act, t0, t1 in whole.runs[0]), args


@pytest.mark.parametrize("pp", [2, 4, 8])
def test_zero_bubble_bubbles_shrink_at_equal_work(pp):
    """The same work per stage (F = 1, backward 2: split B = W = 1) at m = 2 pp: zb-h1's
    bubble is at most half of 1F1B's and zb-v's at most zb-h1's; the runtime's own rule
    (sends waited one batch later) changes none of them."""
    m = 2 * pp
    one_f = simulate("1f1b", pp, 1, m, 1.0, 2.0).mean_bubble()
    h1 = simulate("zb-h1", pp, 1, m, 1.0, 1.0, 1.0).mean_bubble()
    zv = simulate("zb-v", pp, 2, m, 0.5, 0.5, 0.5).mean_bubble()
    assert h1 <= one_f / 2 and zv <= h1 / 1.5, (one_f, h1, zv)
    for name, v, c in (("zb-h1", 1, 1.0), ("zb-v", 2, 0.5)):
        relaxed = simulate(name, pp, v, m, c, c, c, sends_block=False).mean_bubble()
        assert relaxed == pytest.approx(simulate(name, pp, v, m, c, c, c).mean_bubble(), abs=1e-12)


def test_simulator_catches_w_before_its_b(monkeypatch):
    def early_w(pp, v, m, pp_rank):
        steps = zero_bubble.zb_h1(pp, v, m, pp_rank)
        return [(Action("W", pp_rank, 0),)] + [tuple(a for a in s if str(a) != f"W{pp_rank}.0") for s in steps]
    monkeypatch.setitem(schedules.SCHEDULES, "zb-h1", early_w)
    with pytest.raises(ScheduleError, match="before its B"):
        simulate("zb-h1", 2, 1, 4)


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
    ({"pp": 2, "schedule": "1f1f"}, "parallel.schedule '1f1f' is not supported (did you mean '1f1b'?)"),
    ({"pp": 2, "schedule": "interleaved"}, "'interleaved' needs parallel.pp >= 2 and "
                                           "parallel.virtual_stages >= 2, got pp 2 and virtual_stages 1"),
    ({"pp": 2, "virtual_stages": 2}, "parallel.virtual_stages 2 needs parallel.schedule 'interleaved'"),
    ({"pp": 2, "schedule": "zb-v", "virtual_stages": 1},
     "parallel.schedule 'zb-v' runs two chunks per pipeline rank (its V), got parallel.virtual_stages 1: "
     "leave virtual_stages out"),
    ({"pp": 2, "schedule": "zb-v", "virtual_stages": 3, "model": {"n_layers": 6}},
     "'zb-v' runs two chunks per pipeline rank (its V), got parallel.virtual_stages 3"),
    ({"pp": 1, "schedule": "zb-v"}, "parallel.schedule 'zb-v' needs parallel.pp >= 2, got pp 1"),
    ({"pp": 1, "schedule": "zb-h1"}, "parallel.schedule 'zb-h1' needs parallel.pp >= 2"),
    ({"pp": 2, "schedule": "zb-h2"}, "parallel.schedule 'zb-h2' is not supported (did you mean 'zb-h1'?)"),
    ({"pp": 2, "schedule": "interleaved", "virtual_stages": 2, "train": {"global_batch": 6}},
     "micro-batches per step (3 = train.global_batch 6 / (micro_batch 2 * dp 1)) to be a multiple "
     "of parallel.pp 2"),
])
def test_bad_pipeline_jobs_name_the_numbers(parallel, message):
    with pytest.raises(UserError) as e:  # a schedule's name as the config loads, the rest in check_job
        check_job(*_job(**parallel))
    assert message in str(e.value) and "\n" not in str(e.value)


def test_good_pipeline_jobs_pass():
    for parallel in ({"pp": 2, "pp_layers": [3, 1]}, {"pp": 2, "schedule": "gpipe"},
                     {"pp": 2, "schedule": "interleaved", "virtual_stages": 2},
                     {"pp": 2, "schedule": "zb-h1"}, {"pp": 2, "schedule": "zb-v", "virtual_stages": 2},
                     {"pp": 2, "schedule": "zb-v", "virtual_stages": 2, "train": {"global_batch": 6}}):
        check_job(*_job(**parallel))


def test_zb_v_sets_its_two_chunks_per_rank():
    """zb-v has no other value of virtual_stages, so leaving it out means 2 (1 for the
    other schedules); given, the value is kept, and checked by check_job."""
    cfg, model, world = _job(pp=2, schedule="zb-v")
    assert cfg.parallel.virtual_stages == 2
    check_job(cfg, model, world)
    assert _job(pp=2, schedule="zb-h1")[0].parallel.virtual_stages == 1
    assert _job(pp=2, schedule="interleaved", virtual_stages=3, model={"n_layers": 6})[0].parallel.virtual_stages == 3
    assert ParallelConfig(pp=2, schedule="zb-v").virtual_stages == 2  # built in code alike
    assert ParallelConfig(pp=2).virtual_stages == 1
