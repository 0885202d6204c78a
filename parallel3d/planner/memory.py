"""Bytes a rank holds at its peak, per pipeline stage; the largest stage decides.

Two moments compete for the peak, and the model takes the larger:

* the start of a backward pass: model states (weights, master weights, optimizer
  moments, the gradients accumulated so far) plus the saved activations of every
  in-flight micro-batch plus, on the last stage, the loss's backward buffers. Every
  backward of the rank's pipeline plan (the one the runtime runs) is evaluated and the
  largest counts: the one with the most micro-batches alive may come before any gradient
  exists, a later one with as many alive after;
* the optimizer step: model states with the full gradients plus the step's temporaries
  (the flat all-reduce bucket, or Adam's ``sqrt(v)`` buffer).

Saved activations per decoder layer and token, read from what autograd keeps for this
repository's Llama (``models/llama/model.py``; measured on CPU by
``benchmarks/bench_planner_memory.py``), with ``d`` = dim, ``kv`` = n_kv_heads * head_dim,
``f`` = ffn_dim, ``a`` = activation bytes (4 fp32, 2 bf16), ``r`` = 4 (fp32 residual)::

    r * 4d        layer input x, RMSNorm's normalized x, residual h, its normalized h
    a * 2d        the two normed inputs of the projections (q/k/v and gate/up)
    a * (2d + 2kv)/tp   rotated q, rotated k, v and the attention output
    a * 4f / tp   gate, up, silu(gate), silu(gate) * up

RoPE multiplies by constant tables, so its inputs are not kept; SDPA keeps its inputs,
output and a (B, heads, S) log-sum-exp (counted: small). Under tensor parallelism the
first group is divided by tp only with sequence parallelism. ``full`` recomputation keeps
only each layer's input and rebuilds one layer at a time in the backward pass;
``selective`` (keep the matmul outputs) keeps the input plus q, k, v, o, gate, up, down.

The last stage also holds, per in-flight micro-batch, the final norm (``r*2d + a*d``)
and what the loss saves for its backward: with tp = 1 the fp32 log-softmax output
(``4*V``; the logits are freed once the loss is computed), with tp > 1 the logits shard
(``a*V/tp``, the vocab-parallel cross-entropy never stores the softmax). At the start of
the loss's backward: two more fp32 ``V`` buffers (tp = 1), or one ``V/tp`` gradient buffer
(tp > 1). See :func:`head_activation_bytes`. With recomputation the rebuilt layer and the
loss's backward buffers are never alive together: the larger counts.

In-flight micro-batches on pipeline rank ``r`` of ``pp`` with ``m`` micro-batches: 1
without pipelining, ``m`` for GPipe, ``min(pp - r, m)`` for 1F1B, and for the
interleaved schedule with ``v`` chunks ``min(m v, 2 (pp - r - 1) + (v - 1) pp + 1)``
chunk-micro-batches (Megatron-LM's warm-up count plus one; all ``m v`` when ``m = pp``,
where the plan has no steady state). A chunk other than the model's last also keeps its
output (``r*d``) per in-flight micro-batch: the runtime stashes it for the backward.

Model states per parameter held (bytes, see :data:`~parallel3d.planner.spec.PRECISION`):
weights, master weights (mixed precision only), gradients (fp32) and Adam (8). ZeRO 1
shards master weights and moments over dp; ZeRO 2 also the gradients, which then pass
through two fp32 buckets of ``bucket_bytes`` (one being filled, one being reduced). With
ZeRO 0 the data-parallel all-reduce bucket (at most ``bucket_bytes``) exists only during
the optimizer step, before Adam's temporaries: it is a step temporary, not resident.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache

from parallel3d.planner.spec import (ADAM_BYTES, RESIDUAL_BYTES, Layout, Workload,
                                     layer_split, rank_chunks)

BUCKET_BYTES = 25 * 2**20  # data-parallel gradient buckets (data_parallel.py, ZeRO's bucket_mb)


@dataclass
class StageMemory:
    """One pipeline rank's peak, by component (bytes)."""

    stage: int
    layers: int
    params: int  # parameters held by this rank (elements)
    weights: int = 0
    master: int = 0
    optimizer: int = 0
    grads: int = 0  # held at the backward peak
    activations: int = 0  # saved activations of the in-flight micro-batches
    backward_transient: int = 0  # the larger of a recomputed layer and the loss's backward buffers
    step_transient: int = 0  # optimizer-step temporaries (all-reduce bucket, Adam's sqrt(v))
    full_grads: int = 0
    in_flight: float = 0.0
    notes: list[str] = field(default_factory=list)

    @property
    def backward_peak(self) -> int:
        return (self.weights + self.master + self.optimizer + self.grads
                + self.activations + self.backward_transient)

    @property
    def step_peak(self) -> int:
        return (self.weights + self.master + self.optimizer + self.full_grads
                + self.step_transient)

    @property
    def peak(self) -> int:
        return max(self.backward_peak, self.step_peak)

    def breakdown(self) -> tuple[str, int, int, int]:
        """(phase, model states, activations, buffers) at the moment of the peak."""
        base = self.weights + self.master + self.optimizer
        if self.backward_peak >= self.step_peak:
            return ("backward", base + self.grads, self.activations, self.backward_transient)
        return ("optimizer step", base + self.full_grads, 0, self.step_transient)


def layer_params(model, tp: int) -> int:
    """Parameters of one decoder layer on one tensor-parallel rank."""
    hd = model.head_dim
    q, kv = model.n_heads * hd, model.n_kv_heads * hd
    matmul = 2 * model.dim * q + 2 * model.dim * kv + 3 * model.dim * model.ffn_dim
    return matmul // tp + 2 * model.dim  # the two RMSNorm weights are replicated


def layer_activation_bytes(model, tokens: int, layout: Layout, act: int, recompute: str) -> int:
    """Saved bytes of one decoder layer for ``tokens`` tokens of one micro-batch."""
    d, f, tp = model.dim, model.ffn_dim, layout.tp
    kv = model.n_kv_heads * model.head_dim
    seq_shard = tp if layout.sequence_parallel else 1
    residual_in = RESIDUAL_BYTES * d // seq_shard
    small = 4 * (model.n_heads // tp + 2)  # log-sum-exp per head, two RMSNorm rsqrt
    if recompute == "full":
        return tokens * residual_in
    if recompute == "selective":
        return tokens * (residual_in + act * (2 * d + (d + 2 * kv + 2 * f) // tp))
    full = RESIDUAL_BYTES * 4 * d // seq_shard + act * (2 * d + (2 * d + 2 * kv + 4 * f) // tp)
    return tokens * (full + small)


def head_activation_bytes(model, tokens: int, layout: Layout, act: int) -> tuple[int, int]:
    """(saved, backward-start extra) bytes of the final norm, head and loss.

    The logits themselves are saved only where the loss's backward reads them. With
    tp = 1 the loss is ``F.cross_entropy`` (``models/llama/parallelize.py``): its
    log-softmax saves its fp32 output, and the head's matmul saves its input, not its
    output; the pipeline runtime drops its own reference to the logits as soon as the
    loss is computed (``runtime._forward`` keeps only the loss), so the logits (and their
    fp32 copy under bf16) are freed at the end of the forward. At the backward's start
    two more fp32 buffers exist: the gradient of the log-softmax output (from NLL's
    backward) and that of its input (log-softmax's backward), while the saved output is
    still alive. With tp > 1 the vocab-parallel cross-entropy saves the logits shard and
    two N-vectors, never the softmax, and its backward writes one gradient buffer of the
    shard's size (in the logits dtype on the fused kernel; the CPU reference computes
    it in fp32, which differs only under bf16).
    """
    v = -(-model.vocab_size // layout.tp)  # the vocabulary padded to a multiple of tp, per rank
    seq_shard = layout.tp if layout.sequence_parallel else 1
    norm = RESIDUAL_BYTES * 2 * model.dim // seq_shard + act * model.dim
    if layout.tp == 1:
        return tokens * (norm + 4 * v + 4), tokens * 8 * v
    return tokens * (norm + act * v + 8 + 8), tokens * act * v


def backward_moments(layout: Layout, n_micro: int, pp_rank: int) -> list[tuple[int, int, int, bool]]:
    """At the start of each backward of ``pp_rank``'s plan (the one the pipeline runtime
    runs, ``pipeline/schedules.py``), without repeats: (chunk-micro-batches alive, those of
    the model's last chunk, this rank's chunks that already ran a backward this step,
    whether this backward is the last chunk's)."""
    schedule = layout.schedule if layout.pp > 1 else "1f1b"  # pp = 1: forward, backward per micro-batch
    return _moments(schedule, layout.pp, layout.virtual_stages, n_micro, pp_rank)


@lru_cache(maxsize=4096)  # the search evaluates many layouts with the same pipeline shape
def _moments(schedule: str, pp: int, v: int, n_micro: int, pp_rank: int) -> list:
    from parallel3d.pipeline.schedules import plan

    last = pp * v - 1
    alive: dict[int, int] = {}
    done: set[int] = set()
    out = set()
    for step in plan(schedule, pp, v, n_micro, pp_rank):
        for a in step:
            if a.op == "F":
                alive[a.chunk] = alive.get(a.chunk, 0) + 1
                continue
            out.add((sum(alive.values()), alive.get(last, 0), len(done), a.chunk == last))
            alive[a.chunk] -= 1
            done.add(a.chunk)
    return sorted(out)


def in_flight(layout: Layout, n_micro: int, pp_rank: int) -> int:
    """Micro-batches (chunk-micro-batches when interleaved) alive on ``pp_rank``: the
    closed form of the largest count :func:`backward_moments` walks."""
    if layout.pp == 1:
        return 1
    if layout.schedule == "gpipe":
        return n_micro
    if layout.schedule == "interleaved":
        v = layout.virtual_stages
        if n_micro == layout.pp:  # no steady state: the plan runs every forward first
            return n_micro * v
        return min(n_micro * v, 2 * (layout.pp - pp_rank - 1) + (v - 1) * layout.pp + 1)
    return min(layout.pp - pp_rank, n_micro)


def stage_params(model, layout: Layout, pp_rank: int, split: list[int]) -> tuple[int, int, int]:
    """(parameters held, layers held, largest single parameter) on ``pp_rank``."""
    chunks = rank_chunks(pp_rank, layout.pp, layout.virtual_stages)
    layers = sum(split[c] for c in chunks)
    n = layers * layer_params(model, layout.tp)
    embed = model.vocab_size * model.dim // layout.tp
    largest = max(model.dim * model.ffn_dim // layout.tp, embed)
    first, last = 0 in chunks, (layout.chunks - 1) in chunks
    if first:
        n += embed
    if last:
        n += model.dim  # final norm
        if not (model.tie_embeddings and first):
            n += embed  # the head (a tied head on another stage holds its own copy)
    return n, layers, largest


def stage_memory(work: Workload, layout: Layout, pp_rank: int, split: list[int] | None = None,
                 bucket_bytes: int = BUCKET_BYTES) -> StageMemory:
    model, b = work.model, work.bytes
    split = split or layer_split(model, layout.pp, layout.virtual_stages)
    n, layers, largest = stage_params(model, layout, pp_rank, split)
    m = layout.n_micro(work)
    mem = StageMemory(stage=pp_rank, layers=layers, params=n)
    shard = layout.dp if layout.zero >= 1 else 1
    mem.weights = n * b["weight"]
    mem.master = n * b["master"] // shard
    mem.optimizer = n * ADAM_BYTES // shard
    mem.full_grads = n * b["grad"]
    buckets = 0
    if layout.zero == 1:  # the full fp32 buffer, plus the reduced shard GradReducer keeps
        mem.full_grads += 4 * n // layout.dp
    if layout.zero >= 2:  # gradients accumulate in the shard; buckets live only in the backward
        mem.full_grads = n * b["grad"] // layout.dp
        buckets = 2 * min(bucket_bytes, n * b["grad"])

    tokens = layout.micro_batch * work.seq_len
    own = rank_chunks(pp_rank, layout.pp, layout.virtual_stages)
    per_chunk_layers = layers / layout.virtual_stages
    chunk_act = per_chunk_layers * layer_activation_bytes(model, tokens, layout, b["act"], layout.recompute)
    rebuilt = 0
    if layout.recompute != "none":  # one layer rebuilt at a time in the backward pass
        rebuilt = layer_activation_bytes(model, tokens, layout, b["act"], "none")
    # A chunk that is not the last keeps its output in the runtime's stash until its
    # backward (pipeline/runtime.py); autograd itself saves no layer's output.
    stashed = tokens * RESIDUAL_BYTES * model.dim // (layout.tp if layout.sequence_parallel else 1)
    saved, extra = head_activation_bytes(model, tokens, layout, b["act"])
    # The gradients held at a backward's start: ZeRO 1 keeps its full fp32 buffer all
    # along; otherwise a chunk's gradients exist once it has run one backward this step.
    # ZeRO 2 accumulates into the shard; its two buckets (one filling in .grad, one
    # packed and being reduced, zero/grads.py) exist only inside a backward.
    best = None
    for alive, alive_last, done, is_last in backward_moments(layout, m, pp_rank):
        act = alive * chunk_act + (alive - alive_last) * stashed + alive_last * saved
        # The loss's backward buffers and a rebuilt layer never coexist: the loss's
        # backward ends (freeing them and its micro-batch's saved head) before autograd
        # reaches the last decoder layer and recomputes it.
        transient = max(extra, rebuilt - saved) if is_last else rebuilt
        if layout.zero >= 1:
            grads = mem.full_grads
        else:
            grads = mem.full_grads * done // len(own)
        growing = buckets if layout.zero >= 2 else mem.full_grads - grads
        # Gradients (or buckets) still to come grow only as the backward frees the
        # activations of the layers that produce them: they count where they exceed them.
        transient = max(transient, growing - act)
        total = act + grads + transient
        if best is None or total > best[0]:
            best = (total, act, grads, transient, alive)
    _, mem.activations, mem.grads, mem.backward_transient, mem.in_flight = best
    if mem.grads < mem.full_grads and layout.zero == 0:
        mem.notes.append("peak in a backward before every gradient exists")

    if layout.zero >= 1:
        mem.step_transient = 4 * n // layout.dp  # Adam's sqrt(v) over this rank's shard
    else:
        # Adam (foreach) adds a sqrt(v) temporary per parameter group. The flat
        # all-reduce bucket (data_parallel.py) lives only while its gradients are being
        # reduced, before Adam runs: a step-phase temporary, not resident. (A caching
        # allocator may keep its block reserved; that is the fragmentation margin's part,
        # not allocated bytes.)
        bucket = min(bucket_bytes, mem.full_grads) if layout.dp > 1 else 0
        mem.step_transient = max(4 * n, 4 * largest, bucket)
    return mem


def memory_per_stage(work: Workload, layout: Layout, split: list[int] | None = None) -> list[StageMemory]:
    return [stage_memory(work, layout, r, split) for r in range(layout.pp)]
