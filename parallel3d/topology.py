"""The process-group manager: one object that carves the ranks into tp/pp/dp groups.

Rank order (tensor parallel innermost, so a tp group sits on one node's NVLink; then data
parallel; pipeline parallel outermost)::

    rank = pp_rank * (dp * tp) + dp_rank * tp + tp_rank

For 8 ranks at tp=2, pp=2, dp=2::

    pp_rank 0:  dp_rank 0 -> ranks [0, 1]   dp_rank 1 -> ranks [2, 3]
    pp_rank 1:  dp_rank 0 -> ranks [4, 5]   dp_rank 1 -> ranks [6, 7]

    tp groups: [0,1] [2,3] [4,5] [6,7]
    dp groups: [0,2] [1,3] [4,6] [5,7]
    pp groups: [0,4] [1,5] [2,6] [3,7]
    model-parallel (tp x pp) groups: [0,1,4,5] [2,3,6,7]
    embedding groups (first + last stage, only when pp > 1): [0,4] [1,5] [2,6] [3,7]

The grid arithmetic (:class:`RankGrid`) is pure and needs no processes, so layouts of
thousands of ranks can be checked (dry runs, the planner, tests). :class:`Topology` adds
the ``torch.distributed`` groups for the calling rank. Nothing is stored in module
globals: the topology is passed to whatever needs it.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from parallel3d.errors import UserError

AXES = ("pp", "dp", "tp")  # outermost to innermost


def validate_layout(tp: int, pp: int, dp: int, world_size: int) -> None:
    """Raise :class:`UserError` naming the numbers if the layout cannot be built."""
    for name, value in (("parallel.tp", tp), ("parallel.pp", pp), ("parallel.dp", dp)):
        if not isinstance(value, int) or value < 1:
            raise UserError(f"{name} must be a positive integer, got {value!r}")
    if tp * pp * dp != world_size:
        raise UserError(
            f"world size {world_size} != tp*pp*dp = {tp}*{pp}*{dp} = {tp * pp * dp}: "
            f"change parallel.tp/pp/dp or the number of processes (launch.nproc)"
        )


@dataclass(frozen=True)
class RankGrid:
    """Pure rank arithmetic for a (tp, pp, dp) layout; no process groups."""

    tp: int
    pp: int
    dp: int

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp

    def rank_of(self, tp_rank: int, pp_rank: int, dp_rank: int) -> int:
        return pp_rank * (self.dp * self.tp) + dp_rank * self.tp + tp_rank

    def coords(self, rank: int) -> dict[str, int]:
        """``{"tp": tp_rank, "pp": pp_rank, "dp": dp_rank}`` of a global rank."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside world of {self.world_size}")
        return {
            "tp": rank % self.tp,
            "dp": (rank // self.tp) % self.dp,
            "pp": rank // (self.tp * self.dp),
        }

    def group_ranks(self, axis: str, rank: int) -> list[int]:
        """The ranks sharing every coordinate of ``rank`` except ``axis`` (ordered)."""
        c = self.coords(rank)
        size = getattr(self, axis)
        return [self.rank_of(**{**_kw(c), f"{axis}_rank": i}) for i in range(size)]

    def all_groups(self, axis: str) -> list[list[int]]:
        """Every group along ``axis`` ("tp", "pp", "dp" or "mp"), in a fixed order."""
        seen: dict[tuple[int, ...], None] = {}
        for rank in range(self.world_size):
            seen.setdefault(tuple(self.group_ranks_any(axis, rank)), None)
        return [list(g) for g in seen]

    def group_ranks_any(self, axis: str, rank: int) -> list[int]:
        if axis == "mp":
            return self.model_parallel_ranks(rank)
        if axis == "embed":
            return self.embedding_ranks(rank)
        return self.group_ranks(axis, rank)

    def embedding_ranks(self, rank: int) -> list[int]:
        """The first and last pipeline stage of ``rank``'s pipeline (same tp/dp
        coordinates): the holders of a tied input embedding and output head."""
        pp_ranks = self.group_ranks("pp", rank)
        return sorted({pp_ranks[0], pp_ranks[-1]})

    def model_parallel_ranks(self, rank: int) -> list[int]:
        """Ranks holding one full model replica with ``rank`` (same dp_rank): tp x pp."""
        dp_rank = self.coords(rank)["dp"]
        return sorted(
            self.rank_of(t, p, dp_rank) for p in range(self.pp) for t in range(self.tp)
        )


def _kw(c: dict[str, int]) -> dict[str, int]:
    return {"tp_rank": c["tp"], "pp_rank": c["pp"], "dp_rank": c["dp"]}


class Topology:
    """This rank's place in the tp x pp x dp grid, with its process groups.

    Build it once, after ``torch.distributed.init_process_group``, on every rank (group
    creation is collective)::

        topo = Topology(tp=2, pp=2, dp=2)          # world size read from torch.distributed
        topo.tp_rank, topo.pp_rank, topo.dp_rank
        topo.tp_group, topo.pp_group, topo.dp_group, topo.mp_group
        topo.embed_group                            # first + last stage, for tied embeddings
        topo.world_group                            # every rank (None with one)
        topo.prev_rank, topo.next_rank              # pipeline neighbours (None at the ends)

    An axis that is off has no group: the group is None for tp, pp or dp of degree 1, mp
    at tp = pp = 1, embed at pp = 1 (and on the middle stages, which hold no embedding),
    world with one rank. Every user treats None as "nothing to communicate"
    (``parallel3d.distributed.all_reduce``, the ``tensor_parallel.comm`` pairs, ZeRO's
    reductions); never hand a group to a ``torch.distributed`` call without that check,
    where ``group=None`` means the whole world. So 1x1x8 creates one group (dp), not the
    25 that a group per rank for each axis of degree 1 would make.

    ``Topology.single()`` gives a 1x1x1 topology without any process group (tests and
    single-process use).
    """

    def __init__(self, tp: int = 1, pp: int = 1, dp: int = 1, *, rank: int | None = None,
                 world_size: int | None = None, create_groups: bool = True,
                 timeout_s: float | None = None):
        import torch.distributed as dist

        initialized = dist.is_available() and dist.is_initialized()
        if world_size is None:
            world_size = dist.get_world_size() if initialized else 1
        if rank is None:
            rank = dist.get_rank() if initialized else 0
        validate_layout(tp, pp, dp, world_size)  # before any group exists
        self.grid = RankGrid(tp=tp, pp=pp, dp=dp)
        self.rank = rank
        self.world_size = world_size
        c = self.grid.coords(rank)
        self.tp_rank, self.pp_rank, self.dp_rank = c["tp"], c["pp"], c["dp"]
        self.tp_ranks = self.grid.group_ranks("tp", rank)
        self.pp_ranks = self.grid.group_ranks("pp", rank)
        self.dp_ranks = self.grid.group_ranks("dp", rank)
        self.mp_ranks = self.grid.model_parallel_ranks(rank)
        self.embed_ranks = self.grid.embedding_ranks(rank)
        self.tp_group = self.pp_group = self.dp_group = self.mp_group = None
        self.embed_group = None  # first + last pipeline stage (tied embeddings), pp > 1
        self.world_group = None  # every rank (the default group), when there are several
        # Sub-groups do not inherit the world group's timeout (torch gives them its own
        # default of 30 minutes): pass it on, so every collective obeys one limit.
        self.timeout_s = timeout_s
        if create_groups and initialized and world_size > 1:
            self._create_groups(dist)

    @classmethod
    def single(cls) -> "Topology":
        return cls(1, 1, 1, rank=0, world_size=1, create_groups=False)

    def _create_groups(self, dist) -> None:
        # Every rank must create every group in the same order (new_group is collective
        # over the whole world); each rank keeps the one that contains it. The sequence
        # depends on the degrees alone, so every rank makes the same calls.
        from datetime import timedelta

        timeout = timedelta(seconds=self.timeout_s) if self.timeout_s else None
        self.world_group = dist.group.WORLD
        for axis in self.grouped_axes():
            for ranks in self.grid.all_groups(axis):
                group = dist.new_group(ranks, timeout=timeout)
                if self.rank in ranks:
                    setattr(self, f"{axis}_group", group)

    def grouped_axes(self) -> tuple[str, ...]:
        """The axes whose groups have more than one rank, in creation order."""
        sizes = {"tp": self.tp, "dp": self.dp, "pp": self.pp, "mp": self.tp * self.pp,
                 "embed": 2 if self.pp > 1 else 1}
        return tuple(axis for axis, size in sizes.items() if size > 1)

    # -- degrees -------------------------------------------------------------------------
    @property
    def tp(self) -> int:
        return self.grid.tp

    @property
    def pp(self) -> int:
        return self.grid.pp

    @property
    def dp(self) -> int:
        return self.grid.dp

    # -- pipeline neighbours ---------------------------------------------------------------
    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp - 1

    @property
    def prev_rank(self) -> int | None:
        """Global rank of the previous pipeline stage (same tp/dp coordinates)."""
        return None if self.is_first_stage else self.pp_ranks[self.pp_rank - 1]

    @property
    def next_rank(self) -> int | None:
        return None if self.is_last_stage else self.pp_ranks[self.pp_rank + 1]

    @cached_property
    def device_mesh(self):
        """A ``DeviceMesh`` over the same grid (axes "pp", "dp", "tp"), for DTensor interop.

        Built on first use (it creates its own groups, collectively on every rank).
        """
        import torch
        from torch.distributed.device_mesh import DeviceMesh

        device_type = "cuda" if torch.cuda.is_available() else "cpu"
        mesh = torch.arange(self.world_size).reshape(self.pp, self.dp, self.tp)
        return DeviceMesh(device_type, mesh, mesh_dim_names=AXES)

    def coords(self) -> dict[str, int]:
        return {"tp": self.tp_rank, "pp": self.pp_rank, "dp": self.dp_rank}

    def describe(self) -> str:
        return (f"rank {self.rank}/{self.world_size} (tp {self.tp_rank}/{self.tp}, "
                f"pp {self.pp_rank}/{self.pp}, dp {self.dp_rank}/{self.dp})")

    def __repr__(self) -> str:
        return f"Topology(tp={self.tp}, pp={self.pp}, dp={self.dp}, rank={self.rank})"
