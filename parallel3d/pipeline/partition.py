"""Cutting a model's layers into pipeline chunks.

``pp`` stages times ``v`` virtual stages give ``n_chunks = pp * v`` chunks, each a
contiguous run of layers. Chunk 0 also holds the embedding; the last chunk holds the
final norm, the head and the loss. Where the chunks live (:func:`chunk_owners`):

* loop (every schedule but zb-v): chunk ``c`` on ``pp_rank = c % pp``; with ``v = 1``
  chunk ``c`` is stage ``c``; interleaved, rank ``r`` holds ``r, r + pp, r + 2 pp, ...``
  and the last chunk is on the last rank;
* V (``zb-v``, two chunks per rank): chunk ``c`` on rank ``c`` for ``c < pp`` and on rank
  ``2 pp - 1 - c`` after, so the model goes down the ranks and comes back up: rank ``r``
  holds ``r`` and ``2 pp - 1 - r``, rank ``pp - 1`` the two middle chunks (their hand-over
  stays on the rank), rank 0 the embedding and the head.

The split rule (used when ``parallel.pp_layers`` does not set it by hand)
-------------------------------------------------------------------------
Costs are counted in units of one decoder layer's GEMM FLOPs per token (forward and
backward scale alike, so one number serves both):

* a decoder layer costs 1;
* the embedding costs ``embed_cost`` (for Llama 0: its forward gathers rows and its
  backward scatter-adds them, O(dim) per token and no GEMM);
* the head costs ``head_cost`` (for Llama ``vocab * dim / layer GEMM parameters``: the
  output projection is one GEMM as wide as the vocabulary; the final norm and the
  cross-entropy are O(dim + vocab) per token and left out).

The split (1) minimises the cost of the most expensive chunk, which sets the pace of the
whole pipeline; (2) under that bound makes the chunk costs as even as it can (least sum
of squared costs), so that a mis-estimated cost hurts least; (3) between splits still
tied, puts fewer layers on earlier chunks: under 1F1B stage ``r`` keeps ``pp - r``
micro-batches of activations alive, so early stages have the least memory to spare.
Every chunk gets at least one layer. So with a heavy head the last stage takes fewer
layers.

Examples (``head_cost = 1.5``): 8 layers on 2 stages -> [5, 3] (costs 5 and 4.5);
16 layers on 4 stages with ``head_cost = 2.4`` -> [4, 5, 5, 2] (costs 4, 5, 5, 4.4).

Under zb-v's V a rank's two chunks run on one device, and rank 0 holds both the embedding
and the head: the rule is applied to the ranks (rank 0 carrying both extras, at least two
layers each), then each rank's layers are shared between its two chunks as evenly as their
costs allow (fewer on the earlier chunk on a tie). 8 layers, pp 2, ``head_cost = 1.42``:
ranks [3, 5] (costs 4.42, 5), chunks [2, 2, 3, 1] (rank 0: 2 + (1 + 1.42), rank 1: 2 + 3).
"""

from __future__ import annotations

import math
from fractions import Fraction

from parallel3d.errors import UserError


V_SHAPED_SCHEDULES = ("zb-v",)  # schedules whose chunks go down the ranks and back up


def chunk_owners(pp: int, virtual_stages: int, schedule: str = "1f1b") -> list[int]:
    """The pipeline rank holding each global chunk (module docstring): ``c % pp``, or the
    V of ``zb-v`` (``virtual_stages`` 2)."""
    n = pp * virtual_stages
    if schedule in V_SHAPED_SCHEDULES:
        assert virtual_stages == 2, virtual_stages
        return [c if c < pp else 2 * pp - 1 - c for c in range(n)]
    return [c % pp for c in range(n)]


def rank_chunks(pp_rank: int, pp: int, virtual_stages: int, schedule: str = "1f1b") -> list[int]:
    """The global chunks held by ``pp_rank``, in order: ``pp_rank + j * pp`` (loop), or
    ``pp_rank, 2 pp - 1 - pp_rank`` (V)."""
    return [c for c, r in enumerate(chunk_owners(pp, virtual_stages, schedule)) if r == pp_rank]


def _caps(bound: Fraction, extras: list[Fraction]) -> list[int]:
    """Most layers each chunk can take without its cost exceeding ``bound``."""
    return [math.floor(bound - e) for e in extras]


def balanced_split(n_layers: int, n_chunks: int, embed_cost: float = 0.0,
                   head_cost: float = 0.0) -> list[int]:
    """Layers per chunk under the rule in the module docstring (costs in layer units)."""
    if n_chunks < 1 or n_layers < n_chunks:
        raise UserError(f"cannot split {n_layers} layers into {n_chunks} chunks of at "
                        "least one layer each")
    # Fractions keep the comparisons exact (a float head cost of 1.5 must not become
    # 1.4999999 and change a split).
    extras = [Fraction(0)] * n_chunks
    extras[0] += Fraction(embed_cost).limit_denominator(10**6)
    extras[-1] += Fraction(head_cost).limit_denominator(10**6)
    return _balanced(n_layers, extras, [1] * n_chunks)


def _balanced(n_layers: int, extras: list[Fraction], least: list[int]) -> list[int]:
    """At least ``least[i]`` layers each: the smallest bound on a part's cost (layers +
    extra) that fits every layer, then the most even costs under it, then fewer layers on
    earlier parts."""
    n = len(extras)
    # The best bound is the cost of some part: k layers plus that part's extra.
    candidates = sorted({k + e for e in extras for k in range(1, n_layers + 1)})
    for bound in candidates:
        caps = _caps(bound, extras)
        if all(c >= lo for c, lo in zip(caps, least)) and sum(caps) >= n_layers:
            break
    # Most even under the caps: start from the least each and give each further layer to
    # the cheapest part with room (optimal for a sum of squares, a separable convex
    # cost); among equally cheap parts the last, so earlier parts end with fewer.
    counts = list(least)
    for _ in range(n_layers - sum(least)):
        room = [i for i in range(n) if counts[i] < caps[i]]
        cheapest = min(counts[i] + extras[i] for i in room)
        counts[max(i for i in room if counts[i] + extras[i] == cheapest)] += 1
    return counts


def v_split(n_layers: int, pp: int, embed_cost: float = 0.0, head_cost: float = 0.0) -> list[int]:
    """Layers per chunk of zb-v's V (module docstring): the ranks balanced, rank 0 with the
    embedding and the head; each rank's layers shared between its chunks ``r`` and
    ``2 pp - 1 - r`` so that their costs are closest (fewer on ``r`` on a tie)."""
    if n_layers < 2 * pp:
        raise UserError(f"cannot split {n_layers} layers into {2 * pp} chunks of at least one layer each")
    embed = Fraction(embed_cost).limit_denominator(10**6)
    head = Fraction(head_cost).limit_denominator(10**6)
    per_rank = _balanced(n_layers, [embed + head] + [Fraction(0)] * (pp - 1), [2] * pp)
    counts = [0] * (2 * pp)
    for r, layers in enumerate(per_rank):
        ea, eb = (embed, head) if r == 0 else (Fraction(0), Fraction(0))
        # chunk r gets a layers, chunk 2pp-1-r the rest: least |cost difference|, then fewer on r
        a = min(range(1, layers), key=lambda k: (abs((k + ea) - (layers - k + eb)), k))
        counts[r], counts[2 * pp - 1 - r] = a, layers - a
    return counts


def resolve_split(n_layers: int, pp: int, virtual_stages: int, pp_layers: list[int] | None,
                  embed_cost: float = 0.0, head_cost: float = 0.0, schedule: str = "1f1b") -> list[int]:
    """Layers per global chunk: ``parallel.pp_layers`` if given (checked), else the rule
    (balancing zb-v's ranks rather than its chunks)."""
    n_chunks = pp * virtual_stages
    check_split(n_layers, pp, virtual_stages, pp_layers)
    if pp_layers is not None:
        return list(pp_layers)
    if schedule in V_SHAPED_SCHEDULES:
        return v_split(n_layers, pp, embed_cost, head_cost)
    return balanced_split(n_layers, n_chunks, embed_cost, head_cost)


def check_split(n_layers: int, pp: int, virtual_stages: int, pp_layers: list[int] | None) -> None:
    """Raise :class:`UserError` naming the numbers if the layers cannot be cut this way."""
    n_chunks = pp * virtual_stages
    if n_layers < n_chunks:
        what = (f"parallel.pp {pp}" if virtual_stages == 1 else
                f"parallel.pp {pp} * parallel.virtual_stages {virtual_stages} = {n_chunks}")
        raise UserError(f"model.n_layers {n_layers} is fewer than {what}: every pipeline "
                        "chunk needs at least one layer")
    if pp_layers is None:
        return
    if len(pp_layers) != n_chunks:
        raise UserError(f"parallel.pp_layers has {len(pp_layers)} entries but the pipeline has "
                        f"pp * virtual_stages = {pp} * {virtual_stages} = {n_chunks} chunks: "
                        "give one layer count per chunk")
    if min(pp_layers) < 1:
        raise UserError(f"parallel.pp_layers {pp_layers} has an empty chunk: every chunk "
                        "needs at least one layer")
    if sum(pp_layers) != n_layers:
        raise UserError(f"parallel.pp_layers {pp_layers} adds up to {sum(pp_layers)}, not "
                        f"model.n_layers {n_layers}")


def layer_ranges(counts: list[int]) -> list[range]:
    """Global layer indices of each chunk, from the per-chunk counts."""
    out, start = [], 0
    for n in counts:
        out.append(range(start, start + n))
        start += n
    return out
