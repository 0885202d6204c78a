"""Topology: hand-worked rank grids, checked as pure arithmetic and with real groups."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from parallel3d.errors import UserError
from parallel3d.topology import RankGrid, Topology

# (tp, pp, dp) -> expected groups, worked out by hand from
# rank = pp_rank * (dp * tp) + dp_rank * tp + tp_rank.
GRIDS = {
    (1, 1, 8): {
        "tp": [[0], [1], [2], [3], [4], [5], [6], [7]],
        "dp": [[0, 1, 2, 3, 4, 5, 6, 7]],
        "pp": [[0], [1], [2], [3], [4], [5], [6], [7]],
        "mp": [[0], [1], [2], [3], [4], [5], [6], [7]],
    },
    (2, 2, 2): {
        "tp": [[0, 1], [2, 3], [4, 5], [6, 7]],
        "dp": [[0, 2], [1, 3], [4, 6], [5, 7]],
        "pp": [[0, 4], [1, 5], [2, 6], [3, 7]],
        "mp": [[0, 1, 4, 5], [2, 3, 6, 7]],
    },
    (8, 1, 1): {
        "tp": [[0, 1, 2, 3, 4, 5, 6, 7]],
        "dp": [[0], [1], [2], [3], [4], [5], [6], [7]],
        "pp": [[0], [1], [2], [3], [4], [5], [6], [7]],
        "mp": [[0, 1, 2, 3, 4, 5, 6, 7]],
    },
    (2, 4, 1): {
        "tp": [[0, 1], [2, 3], [4, 5], [6, 7]],
        "dp": [[0], [1], [2], [3], [4], [5], [6], [7]],
        "pp": [[0, 2, 4, 6], [1, 3, 5, 7]],
        "mp": [[0, 1, 2, 3, 4, 5, 6, 7]],
    },
    (4, 1, 2): {
        "tp": [[0, 1, 2, 3], [4, 5, 6, 7]],
        "dp": [[0, 4], [1, 5], [2, 6], [3, 7]],
        "pp": [[0], [1], [2], [3], [4], [5], [6], [7]],
        "mp": [[0, 1, 2, 3], [4, 5, 6, 7]],
    },
}

# (tp, pp, dp) -> {rank: (tp_rank, pp_rank, dp_rank)} for every rank, by hand.
COORDS = {
    (1, 1, 8): {r: (0, 0, r) for r in range(8)},
    (2, 2, 2): {0: (0, 0, 0), 1: (1, 0, 0), 2: (0, 0, 1), 3: (1, 0, 1),
                4: (0, 1, 0), 5: (1, 1, 0), 6: (0, 1, 1), 7: (1, 1, 1)},
    (8, 1, 1): {r: (r, 0, 0) for r in range(8)},
    (2, 4, 1): {0: (0, 0, 0), 1: (1, 0, 0), 2: (0, 1, 0), 3: (1, 1, 0),
                4: (0, 2, 0), 5: (1, 2, 0), 6: (0, 3, 0), 7: (1, 3, 0)},
    (4, 1, 2): {0: (0, 0, 0), 1: (1, 0, 0), 2: (2, 0, 0), 3: (3, 0, 0),
                4: (0, 0, 1), 5: (1, 0, 1), 6: (2, 0, 1), 7: (3, 0, 1)},
}


def _group_of(groups: list[list[int]], rank: int) -> list[int]:
    (g,) = [g for g in groups if rank in g]
    return g


@pytest.mark.parametrize("layout", list(GRIDS))
def test_grid_matches_hand_worked_layout(layout):
    tp, pp, dp = layout
    grid = RankGrid(tp=tp, pp=pp, dp=dp)
    for axis, expected in GRIDS[layout].items():
        assert grid.all_groups(axis) == expected, axis
    for rank, (t, p, d) in COORDS[layout].items():
        assert grid.coords(rank) == {"tp": t, "cp": 0, "pp": p, "dp": d}
        topo = Topology(tp, pp, dp, rank=rank, world_size=8, create_groups=False)
        assert (topo.tp_rank, topo.pp_rank, topo.dp_rank) == (t, p, d)
        assert topo.tp_ranks == _group_of(GRIDS[layout]["tp"], rank)
        assert topo.dp_ranks == _group_of(GRIDS[layout]["dp"], rank)
        assert topo.pp_ranks == _group_of(GRIDS[layout]["pp"], rank)
        assert topo.mp_ranks == _group_of(GRIDS[layout]["mp"], rank)
        assert topo.is_first_stage == (p == 0) and topo.is_last_stage == (p == pp - 1)
        pp_group = topo.pp_ranks
        assert topo.prev_rank == (pp_group[p - 1] if p > 0 else None)
        assert topo.next_rank == (pp_group[p + 1] if p < pp - 1 else None)


def test_large_grid_is_a_bijection():
    grid = RankGrid(tp=8, pp=8, dp=8)
    seen = {tuple(grid.coords(r).values()) for r in range(grid.world_size)}
    assert len(seen) == 512
    assert all(grid.rank_of(**{f"{k}_rank": v for k, v in grid.coords(r).items()}) == r
               for r in range(512))


@pytest.mark.parametrize("tp,pp,dp,world", [(2, 2, 2, 6), (3, 1, 1, 8), (1, 1, 0, 1)])
def test_bad_layout_is_rejected_before_any_group(tp, pp, dp, world):
    with pytest.raises(UserError, match=r"parallel|world size"):
        Topology(tp, pp, dp, rank=0, world_size=world)


def _members(group, my_rank: int) -> list[int]:
    """The ranks in ``group``, found by an all-gather over it (proves the group is real)."""
    if group is None:
        return [my_rank]
    size = dist.get_world_size(group)
    out = [torch.zeros(1, dtype=torch.int64) for _ in range(size)]
    dist.all_gather(out, torch.tensor([my_rank]), group=group)
    return [int(t) for t in out]


def _real_groups(tp: int, pp: int, dp: int) -> dict:
    topo = Topology(tp, pp, dp)
    rank = dist.get_rank()
    return {
        "coords": (topo.tp_rank, topo.pp_rank, topo.dp_rank),
        "tp": _members(topo.tp_group, rank), "dp": _members(topo.dp_group, rank),
        "pp": _members(topo.pp_group, rank), "mp": _members(topo.mp_group, rank),
    }


@pytest.mark.parametrize("layout", list(GRIDS))
def test_real_process_groups_on_8_gloo_ranks(pools, layout):
    results = pools(8).run(_real_groups, *layout)
    for rank, got in enumerate(results):
        assert got["coords"] == COORDS[layout][rank]
        for axis in ("tp", "dp", "pp", "mp"):
            assert got[axis] == _group_of(GRIDS[layout][axis], rank), (axis, rank)


# (tp, pp, dp) -> how many groups Topology creates (one per group of more than one rank,
# from GRIDS: tp, dp, pp, mp, and the embedding groups when pp > 1) and the axes with none.
GROUPS_MADE = {
    (1, 1, 8): (1, {"tp", "pp", "mp", "embed"}),  # dp [0..7]; it made 25 with singletons
    (2, 2, 2): (4 + 4 + 4 + 2 + 4, set()),
    (8, 1, 1): (1 + 1, {"dp", "pp", "embed"}),  # tp and mp, both [0..7]
    (2, 4, 1): (4 + 2 + 1 + 2, {"dp"}),
    (4, 1, 2): (2 + 4 + 2, {"pp", "embed"}),
}


def _groups_made(tp: int, pp: int, dp: int) -> dict:
    made, new_group = [], dist.new_group

    def counting(*args, **kwargs):
        made.append(args[0] if args else kwargs["ranks"])
        return new_group(*args, **kwargs)

    dist.new_group = counting
    try:
        topo = Topology(tp, pp, dp)
    finally:
        dist.new_group = new_group
    axes = ("tp", "dp", "pp", "mp", "embed")
    return {"made": made, "none": {a for a in axes if getattr(topo, f"{a}_group") is None}}


@pytest.mark.parametrize("layout", list(GROUPS_MADE))
def test_an_axis_of_degree_1_has_no_group_and_every_rank_makes_the_same_calls(pools, layout):
    count, none = GROUPS_MADE[layout]
    results = pools(8).run(_groups_made, *layout)
    assert all(len(r["made"]) == count and all(len(ranks) > 1 for ranks in r["made"]) for r in results)
    assert all(r["made"] == results[0]["made"] for r in results)  # new_group is collective
    for rank, r in enumerate(results):  # a middle stage holds no embedding either
        middle = 0 < COORDS[layout][rank][1] < layout[1] - 1
        assert r["none"] == none | ({"embed"} if middle else set()), (rank, r["none"])


# The two new axes, worked out by hand from
# rank = ((pp_rank * dp + dp_rank) * cp + cp_rank) * tp + tp_rank, ep carved from dp
# (dp_rank = edp_rank * ep + ep_rank).
CP_EP_GRIDS = {
    # tp 2 x cp 2 x pp 2: cp between tp and dp; dense gradients reduce over dp x cp
    (2, 2, 2, 1, 1): {
        "tp": [[0, 1], [2, 3], [4, 5], [6, 7]],
        "cp": [[0, 2], [1, 3], [4, 6], [5, 7]],
        "pp": [[0, 4], [1, 5], [2, 6], [3, 7]],
        "dp_cp": [[0, 2], [1, 3], [4, 6], [5, 7]],
        "mp": [[0, 1, 4, 5], [2, 3, 6, 7]],
    },
    # cp 2 x dp 4 with ep 2: experts split over consecutive dp ranks, replicated over the
    # other dp block and over cp
    (1, 2, 1, 4, 2): {
        "cp": [[0, 1], [2, 3], [4, 5], [6, 7]],
        "dp": [[0, 2, 4, 6], [1, 3, 5, 7]],
        "dp_cp": [[0, 1, 2, 3, 4, 5, 6, 7]],
        "ep": [[0, 2], [1, 3], [4, 6], [5, 7]],
        "edp_cp": [[0, 1, 4, 5], [2, 3, 6, 7]],
    },
}


@pytest.mark.parametrize("layout", list(CP_EP_GRIDS))
def test_cp_and_ep_groups_match_hand_worked_layouts(layout):
    tp, cp, pp, dp, ep = layout
    grid = RankGrid(tp=tp, pp=pp, dp=dp, cp=cp, ep=ep)
    for axis, expected in CP_EP_GRIDS[layout].items():
        assert grid.all_groups(axis) == expected, axis
    assert sorted(grid.rank_of(**{f"{k}_rank": v for k, v in grid.coords(r).items()})
                  for r in range(8)) == list(range(8))


def _cp_ep_groups(tp: int, cp: int, pp: int, dp: int, ep: int) -> dict:
    topo = Topology(tp, pp, dp, cp=cp, ep=ep)
    rank = dist.get_rank()
    return {a: _members(getattr(topo, f"{a}_group"), rank) for a in CP_EP_GRIDS[(tp, cp, pp, dp, ep)]}


@pytest.mark.parametrize("layout", list(CP_EP_GRIDS))
def test_cp_and_ep_process_groups_on_8_gloo_ranks(pools, layout):
    for rank, got in enumerate(pools(8).run(_cp_ep_groups, *layout)):
        for axis, members in got.items():
            assert members == _group_of(CP_EP_GRIDS[layout][axis], rank), (axis, rank)


def test_every_layout_problem_is_named_at_once():
    with pytest.raises(UserError) as err:
        Topology(2, 1, 3, cp=2, ep=2, rank=0, world_size=8)
    assert "tp*cp*pp*dp = 2*2*1*3 = 12" in str(err.value) and "parallel.ep 2 must divide parallel.dp 3" in str(err.value)


def test_the_banner_shows_cp_in_the_world_the_grid_and_the_stage_spans():
    """The banner's world line, rank formula and per-stage rank spans follow the grid with
    cp (ranks of a stage: dp x cp x tp of them)."""
    from parallel3d.config import load_config
    from parallel3d.observe.console import banner
    from parallel3d.train.setup import resolve_model_config

    cfg = load_config(None, ["--parallel.tp=2", "--parallel.cp=2", "--parallel.pp=2", "--parallel.dp=1",
                             "--parallel.cp_comm=ring"])
    lines = banner(cfg, resolve_model_config(cfg.model), 8, [2, 2], "gloo", "fp32", "stdlib")
    text = "\n".join(lines)
    assert "8 ranks = tp 2 x cp 2 (ring) x pp 2 x dp 1" in text, text
    assert "rank = pp_rank * 4 + dp_rank * 4 + cp_rank * 2 + tp_rank" in text, text
    assert "stage 0: ranks 0-3" in text and "stage 1: ranks 4-7" in text, text
