"""The pipeline plan's moments that decide a rank's activation peak (used by
:mod:`parallel3d.planner.memory`): at each backward (and each W) of a rank's plan, the
chunk-micro-batches alive before their B and those between their B and W, walked from
the plan the runtime runs (``pipeline/schedules.py``), and the closed form of the
largest count (:func:`in_flight`); and what a micro-batch keeps between its B and its W
under the zero-bubble schedules (:func:`layer_stash_bytes`, :func:`head_stash_bytes`)."""

from __future__ import annotations

from functools import lru_cache

from parallel3d.planner.spec import Layout


def backward_moments(layout: Layout, n_micro: int, pp_rank: int) -> list[tuple[int, int, int, int, int, bool]]:
    """At the start of each backward (and each W) of ``pp_rank``'s plan (the one the
    pipeline runtime runs, ``pipeline/schedules.py``), without repeats: (chunk-micro-
    batches alive before their B, those of the model's last chunk, between their B and W
    (zero-bubble), those of the last chunk, this rank's chunks that already ran a backward
    this step, whether this backward is the last chunk's: True / False, None for a W)."""
    schedule = layout.schedule if layout.pp > 1 else "1f1b"  # pp = 1: forward, backward per micro-batch
    return _moments(schedule, layout.pp, layout.virtual_stages, n_micro, pp_rank)


@lru_cache(maxsize=4096)  # the search evaluates many layouts with the same pipeline shape
def _moments(schedule: str, pp: int, v: int, n_micro: int, pp_rank: int) -> list:
    from parallel3d.pipeline.schedules import plan

    last = pp * v - 1
    alive: dict[int, int] = {}
    stashed: dict[int, int] = {}
    done: set[int] = set()
    out = set()
    for step in plan(schedule, pp, v, n_micro, pp_rank):
        for a in step:
            if a.op == "F":
                alive[a.chunk] = alive.get(a.chunk, 0) + 1
            elif a.op == "W":
                # a W's moment: its gradients computed (up to FLUSH_BYTES) beside every stash
                out.add((sum(alive.values()), alive.get(last, 0), sum(stashed.values()),
                         stashed.get(last, 0), len(done), None))
                stashed[a.chunk] -= 1
            else:
                out.add((sum(alive.values()), alive.get(last, 0), sum(stashed.values()),
                         stashed.get(last, 0), len(done), a.chunk == last))
                alive[a.chunk] -= 1
                done.add(a.chunk)
                if schedule in ("zb-h1", "zb-v"):
                    stashed[a.chunk] = stashed.get(a.chunk, 0) + 1
    return sorted(out)


def peak_moments(layout: Layout, n_micro: int, pp_rank: int) -> list[tuple[int, int, int, int, bool | None]]:
    """The moments of :func:`backward_moments` that can hold the rank's peak: (alive, alive
    of the last chunk, waiting for their W, of those the last chunk's, is_last), without
    ``done`` (no byte depends on it) and without a moment another of the same kind
    (``is_last``) dominates, i.e. has at least as many micro-batches in every class (the
    bytes of a moment grow with each class, ``memory.stage_memory``). The search asks this
    for every layout it evaluates; the walk gives dozens of moments a rank, this a few.
    The peak is the walk's; where moments tie, its split into activations and buffers may
    be another tied moment's.

    From 2 pp micro-batches on, more of them only repeat a schedule's steady state: the
    undominated moments are those at 2 pp (``tests/test_planner_moments.py`` checks it against the
    whole walk), so the walk stops there. Not for gpipe, whose every forward runs first:
    its count grows with the micro-batches."""
    schedule = layout.schedule if layout.pp > 1 else "1f1b"
    if schedule != "gpipe":
        n_micro = min(n_micro, 2 * layout.pp)
    return _peak_moments(schedule, layout.pp, layout.virtual_stages, n_micro, pp_rank)


@lru_cache(maxsize=4096)
def _peak_moments(schedule: str, pp: int, v: int, n_micro: int, pp_rank: int) -> list:
    classes = {}
    for alive, alive_last, waiting, waiting_last, _, is_last in _moments(schedule, pp, v, n_micro, pp_rank):
        # the four classes, each counted once: other chunks' alive, the last chunk's alive,
        # other chunks' waiting, the last chunk's waiting
        classes.setdefault(is_last, set()).add((alive - alive_last, alive_last, waiting - waiting_last,
                                                waiting_last))
    out = []
    for is_last, points in classes.items():
        for p in points:
            if not any(q != p and all(a <= b for a, b in zip(p, q)) for q in points):
                out.append((p[0] + p[1], p[1], p[2] + p[3], p[3], is_last))
    return sorted(out, key=lambda m: (m[:4], {True: 1, False: 0, None: -1}[m[4]]))


def in_flight(layout: Layout, n_micro: int, pp_rank: int) -> int:
    """Micro-batches (chunk-micro-batches when interleaved or zb-v) alive on ``pp_rank``,
    until their W with a zero-bubble schedule: the closed form of the largest count the
    plan's walk gives (:func:`backward_moments`)."""
    if layout.pp == 1:
        return 1
    if layout.schedule == "gpipe":
        return n_micro
    if layout.schedule == "interleaved":
        v = layout.virtual_stages
        if n_micro == layout.pp:  # no steady state: the plan runs every forward first
            return n_micro * v
        return min(n_micro * v, 2 * (layout.pp - pp_rank - 1) + (v - 1) * layout.pp + 1)
    if layout.schedule == "zb-h1":
        return min(layout.pp, n_micro)
    if layout.schedule == "zb-v":
        return min(2 * layout.pp, n_micro + pp_rank + 1)
    return min(layout.pp - pp_rank, n_micro)


def layer_stash_bytes(model, tokens: int, layout: Layout, act: int, sparse: bool = False) -> int:
    """What a decoder layer keeps from its B to its W (zero-bubble schedules) for
    ``tokens`` tokens: each GEMM's input and the gradient of its output, each norm's
    input and output gradient (and its fp32 rstd). Under sequence parallelism the column-
    parallel inputs are kept as this rank's shard (the W gathers them again), while the
    row-parallel GEMMs' output gradients are whole (B, S, d). A sparse layer's experts
    keep, per assignment of a routed token, their input row and product (``d + f_e``) and
    the gradients of gate, up and their output (``2 f_e + d``); the router its output's
    gradient (``E``); shared experts as a dense MLP on every tp rank."""
    d, f, tp = model.dim, model.ffn_dim, layout.tp
    q, kv = model.n_heads * model.head_dim, model.n_kv_heads * model.head_dim
    sp = tp if layout.sequence_parallel else 1
    norms = 4 * d // sp  # two norms: input and output gradient
    if sparse:
        moe = model.moe
        shared = 4 * moe.shared_ffn_dim + d if moe.shared_ffn_dim else 0
        routed = moe.top_k * (2 * d + 3 * moe.ffn_dim) + moe.n_experts + shared
        inputs, out_grads = 2 * d // sp + q // tp, (q + 2 * kv) // tp + d
        return tokens * (act * (inputs + out_grads + norms + routed // sp) + 2 * 4)
    inputs = 2 * d // sp + (q + f) // tp  # qkv and gate/up read the normed x; o, down
    out_grads = (q + 2 * kv + 2 * f) // tp + 2 * d  # q, k, v, gate, up; o and down whole
    return tokens * (act * (inputs + out_grads + norms) + 2 * 4)


def head_stash_bytes(model, tokens: int, layout: Layout, act: int) -> int:
    """What the last chunk keeps from B to W: the head's input and its logits' gradient
    (``V/tp`` per token: the W's GEMM reads it), the final norm's input and gradient."""
    v = -(-model.vocab_size // layout.tp)
    sp = layout.tp if layout.sequence_parallel else 1
    return tokens * (act * (model.dim + v + 2 * model.dim // sp) + 4)
