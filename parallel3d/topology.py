"""The process-group manager: one object that carves the ranks into tp/cp/pp/dp groups,
and the expert-parallel groups carved from dp.

Rank order (tensor parallel innermost, so a tp group sits on one node's NVLink; then
context parallel, whose per-layer K/V traffic wants the next-fastest links; then data
parallel; pipeline parallel outermost: the order of Megatron-Core and of the Llama 3
paper)::

    rank = ((pp_rank * dp + dp_rank) * cp + cp_rank) * tp + tp_rank

For 8 ranks at tp=2, pp=2, dp=2 (cp=1)::

    pp_rank 0:  dp_rank 0 -> ranks [0, 1]   dp_rank 1 -> ranks [2, 3]
    pp_rank 1:  dp_rank 0 -> ranks [4, 5]   dp_rank 1 -> ranks [6, 7]

    tp groups: [0,1] [2,3] [4,5] [6,7]
    dp groups: [0,2] [1,3] [4,6] [5,7]
    pp groups: [0,4] [1,5] [2,6] [3,7]
    model-parallel (tp x pp) groups: [0,1,4,5] [2,3,6,7]
    embedding groups (first + last stage, only when pp > 1): [0,4] [1,5] [2,6] [3,7]

For 8 ranks at tp=2, cp=2, pp=2 (dp=1): cp groups [0,2] [1,3] [4,6] [5,7].

Derived groups, named for what they carry (every rank of one holds the same weights):

- ``dp_cp``: dp x cp, where dense gradients are reduced and ZeRO shards (context-parallel
  ranks hold the same weights and different tokens, as data-parallel ranks do);
- ``ep``: expert parallelism carved from the data-parallel ranks, ``dp_rank = edp_rank *
  ep + ep_rank`` (consecutive dp ranks share their experts' tokens by all-to-all; ep
  divides dp). Expert weights are split over ep and replicated over ``edp`` (dp / ep);
- ``edp_cp``: edp x cp, where expert gradients are reduced and expert ZeRO shards.

The grid arithmetic (:class:`RankGrid`) is pure and needs no processes, so layouts of
thousands of ranks can be checked (dry runs, the planner, tests). :class:`Topology` adds
the ``torch.distributed`` groups for the calling rank. Nothing is stored in module
globals: the topology is passed to whatever needs it.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from parallel3d.errors import UserError

AXES = ("pp", "dp", "cp", "tp")  # outermost to innermost


def layout_problems(tp: int, pp: int, dp: int, world_size: int, cp: int = 1, ep: int = 1) -> list[str]:
    """Every reason the degrees cannot form a grid of ``world_size`` ranks, each naming what
    to change (empty when they can)."""
    bad = [f"{name} must be a positive integer, got {value!r}"
           for name, value in (("parallel.tp", tp), ("parallel.pp", pp), ("parallel.dp", dp),
                               ("parallel.cp", cp), ("parallel.ep", ep))
           if not isinstance(value, int) or isinstance(value, bool) or value < 1]
    if bad:
        return bad
    problems = []
    if tp * cp * pp * dp != world_size:
        problems.append(f"world size {world_size} != tp*cp*pp*dp = {tp}*{cp}*{pp}*{dp} = "
                        f"{tp * cp * pp * dp}: change parallel.tp/cp/pp/dp or the number of "
                        f"processes (launch.nproc)")
    if dp % ep:
        problems.append(f"parallel.ep {ep} must divide parallel.dp {dp} (expert groups are carved "
                        f"from the data-parallel ranks): change parallel.ep or parallel.dp")
    return problems


def validate_layout(tp: int, pp: int, dp: int, world_size: int, cp: int = 1, ep: int = 1) -> None:
    """Raise :class:`UserError` naming the numbers if the layout cannot be built."""
    problems = layout_problems(tp, pp, dp, world_size, cp, ep)
    if problems:
        raise UserError("; ".join(problems))


@dataclass(frozen=True)
class RankGrid:
    """Pure rank arithmetic for a (tp, cp, pp, dp) layout with ep carved from dp; no
    process groups."""

    tp: int
    pp: int
    dp: int
    cp: int = 1
    ep: int = 1

    @property
    def world_size(self) -> int:
        return self.tp * self.cp * self.pp * self.dp

    @property
    def edp(self) -> int:
        """Data-parallel replicas of each expert: dp / ep."""
        return self.dp // self.ep

    def rank_of(self, tp_rank: int, pp_rank: int, dp_rank: int, cp_rank: int = 0) -> int:
        return ((pp_rank * self.dp + dp_rank) * self.cp + cp_rank) * self.tp + tp_rank

    def coords(self, rank: int) -> dict[str, int]:
        """``{"tp": tp_rank, "cp": cp_rank, "dp": dp_rank, "pp": pp_rank}`` of a global rank."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside world of {self.world_size}")
        return {
            "tp": rank % self.tp,
            "cp": (rank // self.tp) % self.cp,
            "dp": (rank // (self.tp * self.cp)) % self.dp,
            "pp": rank // (self.tp * self.cp * self.dp),
        }

    def group_ranks(self, axis: str, rank: int) -> list[int]:
        """The ranks sharing every coordinate of ``rank`` except ``axis`` (ordered)."""
        c = self.coords(rank)
        size = getattr(self, axis)
        return [self.rank_of(**{**_kw(c), f"{axis}_rank": i}) for i in range(size)]

    def all_groups(self, axis: str) -> list[list[int]]:
        """Every group along ``axis`` (a grid axis, or a derived one: "mp", "embed",
        "dp_cp", "ep", "edp_cp"), in a fixed order."""
        seen: dict[tuple[int, ...], None] = {}
        for rank in range(self.world_size):
            seen.setdefault(tuple(self.group_ranks_any(axis, rank)), None)
        return [list(g) for g in seen]

    def group_ranks_any(self, axis: str, rank: int) -> list[int]:
        derived = {"mp": self.model_parallel_ranks, "embed": self.embedding_ranks,
                   "dp_cp": self.dp_cp_ranks, "ep": self.ep_ranks, "edp_cp": self.edp_cp_ranks}
        if axis in derived:
            return derived[axis](rank)
        return self.group_ranks(axis, rank)

    def embedding_ranks(self, rank: int) -> list[int]:
        """The first and last pipeline stage of ``rank``'s pipeline (same tp/cp/dp
        coordinates): the holders of a tied input embedding and output head."""
        pp_ranks = self.group_ranks("pp", rank)
        return sorted({pp_ranks[0], pp_ranks[-1]})

    def model_parallel_ranks(self, rank: int) -> list[int]:
        """Ranks holding one full model replica with ``rank`` (same dp and cp rank): tp x pp."""
        c = self.coords(rank)
        return sorted(self.rank_of(t, p, c["dp"], c["cp"]) for p in range(self.pp) for t in range(self.tp))

    def dp_cp_ranks(self, rank: int) -> list[int]:
        """Ranks holding the same dense weights as ``rank`` (same tp and pp rank): dp x cp,
        where dense gradients are reduced and ZeRO shards."""
        c = self.coords(rank)
        return sorted(self.rank_of(c["tp"], c["pp"], d, k) for d in range(self.dp) for k in range(self.cp))

    def ep_rank(self, rank: int) -> int:
        return self.coords(rank)["dp"] % self.ep

    def ep_ranks(self, rank: int) -> list[int]:
        """The expert-parallel group of ``rank``: the ep consecutive dp ranks of its block
        (same tp, cp, pp rank), which split the experts and exchange tokens."""
        c = self.coords(rank)
        first = c["dp"] - c["dp"] % self.ep
        return [self.rank_of(c["tp"], c["pp"], first + e, c["cp"]) for e in range(self.ep)]

    def edp_cp_ranks(self, rank: int) -> list[int]:
        """Ranks holding the same experts as ``rank`` (same tp, pp and ep rank): edp x cp,
        where expert gradients are reduced and expert ZeRO shards."""
        c = self.coords(rank)
        e = c["dp"] % self.ep
        return sorted(self.rank_of(c["tp"], c["pp"], b * self.ep + e, k)
                      for b in range(self.edp) for k in range(self.cp))


def _kw(c: dict[str, int]) -> dict[str, int]:
    return {"tp_rank": c["tp"], "pp_rank": c["pp"], "dp_rank": c["dp"], "cp_rank": c["cp"]}


@dataclass(frozen=True)
class Replicas:
    """A set of ranks holding the same weights: ``size`` of them, this rank ``rank`` among
    them, their ``group`` (None when ``size`` is 1). Gradients average over it and the
    ZeRO optimizer shards over it."""

    size: int
    rank: int
    group: object = None


class Topology:
    """This rank's place in the tp x cp x pp x dp grid (ep carved from dp), with its
    process groups.

    Build it once, after ``torch.distributed.init_process_group``, on every rank (group
    creation is collective)::

        topo = Topology(tp=2, pp=2, dp=2, cp=1, ep=1)  # world size from torch.distributed
        topo.tp_rank, topo.cp_rank, topo.pp_rank, topo.dp_rank, topo.ep_rank
        topo.tp_group, topo.cp_group, topo.pp_group, topo.dp_group, topo.mp_group
        topo.dp_cp_group                            # dense gradients, ZeRO (dp x cp)
        topo.ep_group, topo.edp_cp_group            # token exchange; expert gradients
        topo.embed_group                            # first + last stage, for tied embeddings
        topo.world_group                            # every rank (None with one)
        topo.prev_rank, topo.next_rank              # pipeline neighbours (None at the ends)

    An axis that is off has no group: the group is None for tp, cp, pp, dp or ep of degree
    1, mp at tp = pp = 1, embed at pp = 1 (and on the middle stages, which hold no embedding),
    world with one rank. Every user treats None as "nothing to communicate"
    (``parallel3d.distributed.all_reduce``, the ``tensor_parallel.comm`` pairs, ZeRO's
    reductions); never hand a group to a ``torch.distributed`` call without that check,
    where ``group=None`` means the whole world. So 1x1x8 creates one group (dp), not the
    25 that a group per rank for each axis of degree 1 would make.

    ``Topology.single()`` gives a 1x1x1 topology without any process group (tests and
    single-process use).
    """

    def __init__(self, tp: int = 1, pp: int = 1, dp: int = 1, *, cp: int = 1, ep: int = 1,
                 rank: int | None = None, world_size: int | None = None,
                 create_groups: bool = True, timeout_s: float | None = None):
        import torch.distributed as dist

        initialized = dist.is_available() and dist.is_initialized()
        if world_size is None:
            world_size = dist.get_world_size() if initialized else 1
        if rank is None:
            rank = dist.get_rank() if initialized else 0
        validate_layout(tp, pp, dp, world_size, cp, ep)  # before any group exists
        self.grid = RankGrid(tp=tp, pp=pp, dp=dp, cp=cp, ep=ep)
        self.rank = rank
        self.world_size = world_size
        c = self.grid.coords(rank)
        self.tp_rank, self.cp_rank, self.pp_rank, self.dp_rank = c["tp"], c["cp"], c["pp"], c["dp"]
        self.ep_rank = self.grid.ep_rank(rank)
        self.edp_rank = self.dp_rank // ep
        for axis in self._ALL_AXES:
            setattr(self, f"{axis}_ranks", self.grid.group_ranks_any(axis, rank))
            setattr(self, f"{axis}_group", None)
        self.embed_group = None  # first + last pipeline stage (tied embeddings), pp > 1
        self.world_group = None  # every rank (the default group), when there are several
        # Sub-groups do not inherit the world group's timeout (torch gives them its own
        # default of 30 minutes): pass it on, so every collective obeys one limit.
        self.timeout_s = timeout_s
        if create_groups and initialized and world_size > 1:
            self._create_groups(dist)

    @classmethod
    def of(cls, layout, **kwargs) -> "Topology":
        """The topology of a ``[parallel]`` section or a planner ``Layout`` (anything with
        tp, pp, dp, cp and ep), keyword arguments as for the constructor."""
        return cls(layout.tp, layout.pp, layout.dp, cp=layout.cp, ep=layout.ep, **kwargs)

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
        self._alias_groups()

    def grouped_axes(self) -> tuple[str, ...]:
        """The axes whose groups have more than one rank, in creation order."""
        sizes = {"tp": self.tp, "cp": self.cp, "dp": self.dp, "pp": self.pp, "mp": self.tp * self.pp,
                 "embed": 2 if self.pp > 1 else 1, "dp_cp": self.dp * self.cp, "ep": self.ep,
                 "edp_cp": self.edp * self.cp}
        return tuple(axis for axis, size in sizes.items() if size > 1 and not self._same_as(axis))

    _ALL_AXES = ("tp", "cp", "dp", "pp", "mp", "embed", "dp_cp", "ep", "edp_cp")

    def _same_as(self, axis: str) -> str | None:
        """The axis whose group a derived axis equals at these degrees (dp x cp at cp 1 is
        dp): one group, not two over the same ranks."""
        return {"dp_cp": "dp" if self.cp == 1 else "cp" if self.dp == 1 else None,
                "ep": "dp" if self.ep == self.dp else None,
                "edp_cp": "dp_cp" if self.ep == 1 else "cp" if self.edp == 1 else None}.get(axis)

    def _alias_groups(self) -> None:
        for axis in ("dp_cp", "ep", "edp_cp"):  # each after the one it may equal
            same = self._same_as(axis)
            if same is not None:
                setattr(self, f"{axis}_group", getattr(self, f"{same}_group"))

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

    @property
    def cp(self) -> int:
        return self.grid.cp

    @property
    def ep(self) -> int:
        return self.grid.ep

    @property
    def edp(self) -> int:
        return self.grid.edp

    @property
    def dp_cp(self) -> int:
        """Ranks holding the same dense weights (dp x cp): what gradients average over."""
        return self.dp * self.cp

    @property
    def dp_cp_rank(self) -> int:
        """This rank's place in ``dp_cp_ranks`` (ordered by dp rank, then cp rank)."""
        return self.dp_rank * self.cp + self.cp_rank

    def replicas(self) -> "Replicas":
        """The ranks holding this rank's dense weights: where their gradients are averaged
        and ZeRO shards them (dp x cp)."""
        return Replicas(self.dp_cp, self.dp_cp_rank, self.dp_cp_group)

    def expert_replicas(self) -> "Replicas":
        """The ranks holding this rank's experts (same tp, pp and ep rank): edp x cp, where
        expert gradients are averaged and the experts' ZeRO shards live. At ep 1 the same
        ranks as :meth:`replicas`."""
        return Replicas(self.edp * self.cp, self.edp_rank * self.cp + self.cp_rank, self.edp_cp_group)

    # -- pipeline neighbours ---------------------------------------------------------------
    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp - 1

    @property
    def prev_rank(self) -> int | None:
        """Global rank of the previous pipeline stage (same tp/cp/dp coordinates)."""
        return None if self.is_first_stage else self.pp_ranks[self.pp_rank - 1]

    @property
    def next_rank(self) -> int | None:
        return None if self.is_last_stage else self.pp_ranks[self.pp_rank + 1]

    @cached_property
    def device_mesh(self):
        """A ``DeviceMesh`` over the same grid (axes "pp", "dp", "cp", "tp"), for DTensor interop.

        Built on first use (it creates its own groups, collectively on every rank).
        """
        import torch
        from torch.distributed.device_mesh import DeviceMesh

        device_type = "cuda" if torch.cuda.is_available() else "cpu"
        mesh = torch.arange(self.world_size).reshape(self.pp, self.dp, self.cp, self.tp)
        return DeviceMesh(device_type, mesh, mesh_dim_names=AXES)

    def coords(self) -> dict[str, int]:
        return {"tp": self.tp_rank, "cp": self.cp_rank, "dp": self.dp_rank, "pp": self.pp_rank}

    def describe(self) -> str:
        cp = f"cp {self.cp_rank}/{self.cp}, " if self.cp > 1 else ""
        ep = f", ep {self.ep_rank}/{self.ep}" if self.ep > 1 else ""
        return (f"rank {self.rank}/{self.world_size} (tp {self.tp_rank}/{self.tp}, {cp}"
                f"pp {self.pp_rank}/{self.pp}, dp {self.dp_rank}/{self.dp}{ep})")

    def __repr__(self) -> str:
        return (f"Topology(tp={self.tp}, cp={self.cp}, pp={self.pp}, dp={self.dp}, ep={self.ep}, "
                f"rank={self.rank})")
