"""The planner's Mixture-of-Experts terms: expert parameters per rank, what a sparse layer
saves for its backward, and the all-to-all traffic of expert parallelism.

The layout (``models/moe/parallelize.py``, ``parallel3d/topology.py``): the routed experts
of each sparse layer are split over ``ep`` ranks carved from dp (consecutive dp ranks,
``tp * cp`` ranks apart) and replicated over ``edp = dp / ep``; each expert is whole at
every tp rank (expert tp 1), and so are the router and the shared experts. A rank routes
the tokens it holds: a micro-batch's ``S / cp`` of each sequence, and ``S / (cp tp)``
under sequence parallelism (without it every tp rank routes the same tokens). Per sparse
layer a rank holds (elements; ``E`` experts, ``f_e`` an expert's width, ``f_s`` the
shared experts')::

    router    E d
    shared    3 d f_s (+ d, Qwen2-MoE's shared gate)
    experts   (E / ep) 3 d f_e            marked p3d_expert

ZeRO shards the experts' fp32 masters and moments (and their gradients at stage 2) over
the ranks holding the same experts, ``edp x cp`` (``parallel3d/zero/split.py``); every
other parameter over ``dp x cp`` as in a dense model.

Saved for the backward per routed token of a sparse layer (``a`` activation bytes, ``k``
experts a token; what autograd keeps for ``models/moe/block.py``'s loop over experts at
ep 1, measured byte for byte in ``tests/test_planner_moe.py``)::

    4 E              the router's fp32 softmax (its output, for its backward)
    k (3 a d)        three rows of d per assignment: the permuted input the expert GEMMs
                     read, the experts' output the routing weight multiplies, and the
                     weighted row the combine adds back
    k (4 a f_e)      gate, silu(gate), up and their product (the down projection's input)
    k (a + 24)       the routing weight of each row, three int64 indices (the top-k
                     choice, the expert-major order, each row's token)
    k 4 + 4          with norm_topk_prob: the fp32 weights chosen and their sum
    k 16             at ep > 1: the received rows' permutation to local-expert-major
                     order and its inverse (int64; a rank's received rows are, summed
                     over the expert group, the rows it sent: measured on 2 gloo ranks)
    4 a f_s          the shared experts' SwiGLU, likewise (+ a (d + 1) for its gate)

The normed input of the block is counted with the layer (``memory.layer_activation_bytes``).

All-to-all (``parallel3d.expert_parallel``): per sparse layer and micro-batch the rank's
``tokens x k`` rows of ``d`` travel four times, dispatch and combine in the forward and
their gradients in the backward; ``(ep - 1) / ep`` of them leave the rank (the expert is
elsewhere), in a pairwise exchange of ``ep - 1`` steps after a counts exchange::

    bytes leaving a rank = 4 tokens k d a (ep - 1) / ep
    seconds per exchange = tokens k d a (ep - 1) / ep / bw + 2 (ep - 1) latency

on NVLink when the expert group (``tp * cp * ep`` consecutive ranks) fits in a node, and
not overlapped with compute (the experts wait for their rows). Full recomputation runs the
forward's two again.
"""

from __future__ import annotations

from functools import lru_cache

from parallel3d.planner.spec import Layout

INDEX_BYTES = 8  # int64 indices


def is_moe(model) -> bool:
    return getattr(model, "moe", None) is not None


def layer_ranges(split: list[int]) -> list[range]:
    """The decoder layers of each global pipeline chunk, in order."""
    out, first = [], 0
    for n in split:
        out.append(range(first, first + n))
        first += n
    return out


def sparse_layers_of(model, split: list[int], chunks: list[int]) -> int:
    """Sparse (Mixture-of-Experts) layers among the layers of ``chunks``."""
    if not is_moe(model):
        return 0
    return _sparse_layers_of(model.moe.dense_layers, tuple(split), tuple(chunks))


@lru_cache(maxsize=4096)  # the search asks for the same stages of every micro-batch, ZeRO, ...
def _sparse_layers_of(dense_layers: tuple[int, ...], split: tuple[int, ...], chunks: tuple[int, ...]) -> int:
    ranges = layer_ranges(list(split))
    return sum(i not in dense_layers for c in chunks for i in ranges[c])


def moe_replicated_params(model) -> int:
    """Parameters of one sparse layer's MoE block that every tp rank holds whole and every
    ep rank alike: the router and the shared experts (with their gate)."""
    moe, d = model.moe, model.dim
    return moe.n_experts * d + 3 * d * moe.shared_ffn_dim + d * moe.shared_gate


def expert_params(model, ep: int) -> int:
    """Routed-expert parameters of one sparse layer on one rank: ``E / ep`` whole experts."""
    moe = model.moe
    return moe.n_experts // ep * 3 * model.dim * moe.ffn_dim


def moe_token_bytes(model, act: int, ep: int = 1) -> int:
    """Bytes a sparse layer's MoE block saves per routed token (module docstring)."""
    moe, d = model.moe, model.dim
    renorm = 4 if moe.norm_topk_prob else 0
    indices = 3 + (2 if ep > 1 else 0)
    per_assignment = act * (3 * d + 4 * moe.ffn_dim + 1) + indices * INDEX_BYTES + renorm
    shared = 4 * act * moe.shared_ffn_dim + (act * (d + 1) if moe.shared_gate else 0)
    return 4 * moe.n_experts + moe.top_k * per_assignment + renorm + shared


def moe_selective_bytes(model, act: int) -> int:
    """What selective recomputation keeps of a sparse layer's MoE block per routed token:
    the matmul outputs (router logits; each assignment's gate, up and expert output; the
    shared experts' gate, up and output) and the routing."""
    moe, d = model.moe, model.dim
    shared = act * (2 * moe.shared_ffn_dim + d) if moe.shared_ffn_dim else 0
    return (act * moe.n_experts + moe.top_k * (act * (2 * moe.ffn_dim + d + 1) + 2 * INDEX_BYTES)
            + shared)


def routed_tokens(layout: Layout, tokens: int) -> int:
    """Tokens a rank routes of ``tokens`` (its S / cp share of a micro-batch): all of them,
    or its sequence shard of them under sequence parallelism."""
    return tokens // layout.tp if layout.sequence_parallel else tokens


def a2a_bytes(model, layout: Layout, tokens: int, act: int) -> int:
    """Bytes one sparse layer's four all-to-alls send off a rank for one micro-batch of
    ``tokens`` tokens (its S / cp share): 4 x tokens x k x d x a x (ep - 1) / ep."""
    if not is_moe(model) or layout.ep == 1:
        return 0
    rows = routed_tokens(layout, tokens) * model.moe.top_k
    return 4 * rows * model.dim * act * (layout.ep - 1) // layout.ep


def a2a_seconds(model, layout: Layout, tokens: int, act: int, bw: float, latency: float) -> float:
    """Seconds of one all-to-all exchange (dispatch or combine, or either's gradient) of
    one sparse layer for one micro-batch: a quarter of :func:`a2a_bytes` over the link,
    plus the counts' and the rows' ``ep - 1`` pairwise steps."""
    if not is_moe(model) or layout.ep == 1:
        return 0.0
    return a2a_bytes(model, layout, tokens, act) / 4 / bw + 2 * (layout.ep - 1) * latency


def a2a_transient_bytes(model, layout: Layout, tokens: int, act: int) -> int:
    """A sparse layer's all-to-all buffers while it runs at ep > 1: the rows it sends and
    the rows it receives (about as many), ``tokens x k`` rows of ``d`` each."""
    if not is_moe(model) or layout.ep == 1:
        return 0
    return 2 * routed_tokens(layout, tokens) * model.moe.top_k * model.dim * act
