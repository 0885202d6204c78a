"""Data-parallel traffic against the compute it hides behind: exposed and hidden seconds.

A stage's parameters come as *units* in forward order (the embedding, each decoder layer,
the final norm and head), each with its forward and backward seconds of one micro-batch
and its parameters. What crosses the data-parallel link, per ZeRO stage::

    ZeRO 0     all-reduce of the gradients, bucket by bucket in the last micro-batch's
               backward (a bucket is issued once its last gradient is in)
    ZeRO 1     reduce-scatter likewise; all-gather of the updated weights after the step
    ZeRO 2     reduce-scatter in every micro-batch's backward (the step waits for each
               backward's reductions before the next micro-batch); all-gather after the step
    ZeRO 3     per micro-batch: each unit's weights all-gathered before its forward, again
               before its backward (the last unit's stay gathered from its forward), its
               gradients reduce-scattered after its backward; the next unit's gather is
               prefetched while this one computes (one ahead, as FSDP2 does). A unit's
               traffic is its buckets' collectives (``parallel.bucket_mb``; FSDP's unit,
               a transformer block, is one bucket as large as the layer)

Every bucket is its own collective, so it pays the ring's latency once: the bucket size
the planner writes is Megatron-Core's default for the dp degree
(:func:`~parallel3d.planner.spec.bucket_mb_for`).

The link is one FIFO channel: a collective starts when it is issued and the one before it
is done. Overlap is with compute only: what does not fit under it is *exposed*:

* gradient reductions (:func:`reduce_tail`): bucket ``k`` of a unit computing for ``c``
  seconds in ``p`` buckets is ready ``(k + 1) c / p`` into it; the last bucket's reduction
  always outlasts the backward, and a link slower than the compute queues up;
* the all-gather after the step (:func:`gather_wait`), with ``parallel.overlap_param_gather``:
  every bucket issued at once in forward order, each module waiting for its own, so the
  first bucket is always waited for; without it the whole all-gather is exposed;
* ZeRO 3 (:func:`prefetch_pass`): simulated unit by unit.

The closed forms: with ``T_j`` the compute before unit ``j``, ``R_j`` the reductions after
unit ``j`` and ``G_j`` the gathers before it, the last reduction ends at
``max_j max(T_j + c_j / p_j + r_j + R_j, T_j + c_j + r_j / p_j + R_j)`` and the last
forward unit at ``max_j max(G_j + g_j / p_j + c_j + C_j, G_j + g_j + c_j / p_j + C_j)``
(``C_j`` the compute after unit ``j``): both are the largest of piecewise-linear sums, so
each unit's first and last bucket suffice. Exposed is that end less the compute.

Bandwidth (:func:`group_link`): a ring collective over a group with ``k`` members in each
node crosses each node once per ring, and NCCL runs one ring per NIC, splitting the data
over the node's NVLink (NVIDIA/nccl issue 601: "use NVLink to split the operations in N
parts then balance the traffic onto the N NICs"; nccl-tests issue 152 and NVIDIA/nccl
issue 1048: an all-reduce over two A100 nodes with four 200 Gb/s NICs each peaks at 4 x
25 GB/s bus bandwidth). So its bus bandwidth is ``min(NVLink, k x NIC)``, not one NIC's.
Not modelled: the compute a collective slows down while it runs beside it (NCCL's kernels
take SMs), and links shared with tensor- or pipeline-parallel traffic.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from parallel3d.planner.hardware import GPU, Efficiency


@dataclass(frozen=True)
class Unit:
    """One stage's group of parameters: its seconds of one micro-batch and its traffic."""

    fwd_s: float
    bwd_s: float
    params: float  # parameters held (elements), before ZeRO's sharding
    expert_params: float = 0.0  # of those, routed experts' (their own group)
    count: int = 1  # units alike in a row (a stage's decoder layers)
    trained: float | None = None  # of those, what has gradients (None: all; LoRA at ZeRO 3: the adapters)
    trained_expert: float = 0.0  # of ``trained``, routed experts' adapters (reduced over the experts' replicas)


@dataclass(frozen=True)
class DpTime:
    exposed_s: float  # what the step waits for
    total_s: float  # link seconds of every data-parallel collective of the step

    @property
    def hidden_s(self) -> float:
        return max(0.0, self.total_s - self.exposed_s)


def group_link(gpu: GPU, eff: Efficiency, members: int, stride: int, gpus_per_node: int) -> tuple[float, float]:
    """(bytes/s, seconds a ring step) of a ring over ``members`` ranks ``stride`` apart:
    NVLink inside a node; across nodes, one NIC per member in a node (module docstring)."""
    if members * stride <= gpus_per_node:
        return gpu.nvlink_bytes_per_s * eff.link, eff.nvlink_latency_s
    per_node = max(1, min(members, gpus_per_node // stride))
    bw = min(gpu.nvlink_bytes_per_s, per_node * gpu.internode_bytes_per_s)
    return bw * eff.link, eff.internode_latency_s


def ring_seconds(kind: str, nbytes: float, n: int, bw: float, latency: float, pieces: int = 1) -> float:
    """Seconds of ``pieces`` ring collectives over ``n`` ranks moving ``nbytes`` per rank
    in all (an all-reduce twice a reduce-scatter's or all-gather's steps)."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    steps = 2 * (n - 1) if kind == "all_reduce" else n - 1
    return steps / n * nbytes / bw + pieces * steps * latency


def reduce_tail(units: list[tuple[float, float, int, int]]) -> float:
    """Seconds the last reduction ends after the backward does: ``units`` in backward
    order as runs of (compute s, reduction s, buckets, how many alike), each bucket ready
    as its share of the unit's compute is done (module docstring; within a run the
    candidates are linear in the unit's index, so its first and last unit suffice)."""
    after = [0.0] * (len(units) + 1)  # reductions after each run
    for j in range(len(units) - 1, -1, -1):
        after[j] = after[j + 1] + units[j][1] * units[j][3]
    t = end = 0.0
    for j, (c, r, p, n) in enumerate(units):
        if r > 0:
            for i in {0, n - 1}:
                start, rest = t + i * c, after[j + 1] + (n - 1 - i) * r
                end = max(end, start + c / p + r + rest, start + c + r / p + rest)
        t += n * c
    return max(0.0, end - t)


def gather_wait(units: list[tuple[float, float, int, int]]) -> float:
    """Seconds the forward waits for gathers issued all at once before it: ``units`` in
    forward order as runs of (compute s, gather s, buckets, how many alike), a bucket's
    compute waiting for its own gather (module docstring)."""
    after = [0.0] * (len(units) + 1)  # compute after each run
    for j in range(len(units) - 1, -1, -1):
        after[j] = after[j + 1] + units[j][0] * units[j][3]
    g_before = 0.0
    end = after[0]
    for j, (c, g, p, n) in enumerate(units):
        if g > 0:
            for i in {0, n - 1}:
                gathered, rest = g_before + i * g, after[j + 1] + (n - 1 - i) * c
                end = max(end, gathered + g / p + c + rest, gathered + g + c / p + rest)
        g_before += n * g
    return end - after[0]


def prefetch_pass(units: list[tuple[float, float, float]]) -> float:
    """Seconds a pass waits beyond its compute, ``units`` in execution order as (gather s,
    compute s, reduction s): gather ``j + 1`` is issued when unit ``j`` starts (the
    first at once), reduction ``j`` when it ends, on one FIFO link; the pass ends when its
    compute and its last reduction do."""
    link = 0.0

    def send(issued: float, seconds: float) -> float:
        nonlocal link
        link = max(issued, link) + seconds
        return link

    ready = send(0.0, units[0][0]) if units else 0.0
    t = 0.0
    for j, (_, c, r) in enumerate(units):
        start = max(t, ready)
        if j + 1 < len(units):
            ready = send(start, units[j + 1][0])
        t = start + c
        if r > 0:
            send(t, r)
    return max(t, link) - sum(c for _, c, _ in units)


def dp_time(units: list[Unit], zero: int, m: int, replicas: int, expert_replicas: int, tp: int,
            grad_bytes: int, weight_bytes: int, overlap_param_gather: bool, bucket_bytes: int,
            gpu: GPU, eff: Efficiency, gpus_per_node: int) -> DpTime:
    """Exposed and total seconds of a step's data-parallel traffic (module docstring) for
    a stage of ``units`` (forward order; ``count`` alike in a row) with ``m`` micro-batches;
    dense parameters reduce over ``replicas`` ranks ``tp`` apart, routed experts over
    ``expert_replicas``."""
    links = {"dense": (replicas, group_link(gpu, eff, replicas, tp, gpus_per_node)),
             "expert": (expert_replicas, group_link(gpu, eff, expert_replicas, tp * max(1, replicas // max(
                 1, expert_replicas)), gpus_per_node))}

    def seconds(kind: str, u: Unit, nbytes: int, pieces: int) -> float:
        total = 0.0
        for part, n in (("dense", u.params - u.expert_params), ("expert", u.expert_params)):
            group, (bw, lat) = links[part]
            total += ring_seconds(kind, n * nbytes, group, bw, lat, pieces)
        return total

    buckets = [max(1, math.ceil(4 * u.params / bucket_bytes)) for u in units]  # fp32 buckets
    if zero == 3:  # a unit's buckets gathered around its compute, one collective each
        # (LoRA: the frozen weights are gathered too, only what trains is reduced)
        traffic = [(seconds("all_gather", u, weight_bytes, p),
                    seconds("reduce_scatter", u if u.trained is None else Unit(0, 0, u.trained, u.trained_expert),
                            grad_bytes, p))
                   for u, p in zip(units, buckets)]
        flat = [(u, g, r) for u, (g, r) in zip(units, traffic) for _ in range(u.count)]
        fwd = [(g, u.fwd_s, 0.0) for u, g, _ in flat]
        bwd = [(0.0 if j == 0 else g, u.bwd_s, r) for j, (u, g, r) in enumerate(reversed(flat))]
        total = m * sum(g + r for g, _, r in fwd + bwd)
        return DpTime(m * (prefetch_pass(fwd) + prefetch_pass(bwd)), total)
    kind = "all_reduce" if zero == 0 else "reduce_scatter"
    bwd = [(u.bwd_s, seconds(kind, u, grad_bytes, p), p, u.count) for u, p in zip(reversed(units), reversed(buckets))]
    reductions = m if zero == 2 else 1
    exposed = reductions * reduce_tail(bwd)
    total = reductions * sum(r * n for _, r, _, n in bwd)
    if zero >= 1:
        fwd = [(u.fwd_s, seconds("all_gather", u, weight_bytes, p), p, u.count) for u, p in zip(units, buckets)]
        gathers = sum(g * n for _, g, _, n in fwd)
        exposed += gather_wait(fwd) if overlap_param_gather else gathers
        total += gathers
    return DpTime(exposed, total)
