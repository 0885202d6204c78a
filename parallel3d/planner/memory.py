"""Bytes a rank holds at its peak, per pipeline stage; the largest stage decides.

Two moments compete for the peak, and the model takes the larger:

* the start of a backward pass with the most micro-batches in flight: model states
  (weights, master weights, optimizer moments, the gradients accumulated so far) plus the
  saved activations of every in-flight micro-batch plus, on the last stage, the loss's
  backward buffers;
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

The last stage also holds, per in-flight micro-batch, the final norm (``r*2d + a*d``),
the logits (``a*V/tp``) and log-softmax output (``4*V/tp``), and at the backward's start
two more fp32 ``V/tp`` buffers (the gradients of log-softmax and of the logits).

In-flight micro-batches on pipeline rank ``r`` of ``pp`` with ``m`` micro-batches: 1
without pipelining, ``m`` for GPipe, ``min(pp - r, m)`` for 1F1B, and for the
interleaved schedule with ``v`` chunks ``min(m v, 2 (pp - r - 1) + (v - 1) pp + 1)``
chunk-micro-batches (Megatron-LM's warm-up count plus one).

Model states per parameter held (bytes, see :data:`~parallel3d.planner.spec.PRECISION`):
weights, master weights (mixed precision only), gradients (fp32) and Adam (8). ZeRO 1
shards master weights and moments over dp; ZeRO 2 also the gradients, which then pass
through two fp32 buckets of ``bucket_bytes`` (one being filled, one being reduced). With
ZeRO 0 the data-parallel all-reduce bucket (at most ``bucket_bytes``) counts as resident.
"""

from __future__ import annotations

from dataclasses import dataclass, field

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
    comm_buffers: int = 0  # the data-parallel all-reduce bucket, resident (see below)
    backward_transient: int = 0  # recomputed layer, loss backward buffers, gradient buckets
    step_transient: int = 0  # optimizer-step temporaries
    full_grads: int = 0
    in_flight: float = 0.0
    notes: list[str] = field(default_factory=list)

    @property
    def backward_peak(self) -> int:
        return (self.weights + self.master + self.optimizer + self.comm_buffers + self.grads
                + self.activations + self.backward_transient)

    @property
    def step_peak(self) -> int:
        return (self.weights + self.master + self.optimizer + self.comm_buffers + self.full_grads
                + self.step_transient)

    @property
    def peak(self) -> int:
        return max(self.backward_peak, self.step_peak)

    def breakdown(self) -> tuple[str, int, int, int]:
        """(phase, model states, activations, buffers) at the moment of the peak."""
        base = self.weights + self.master + self.optimizer
        if self.backward_peak >= self.step_peak:
            return ("backward", base + self.grads, self.activations, self.comm_buffers + self.backward_transient)
        return ("optimizer step", base + self.full_grads, 0, self.comm_buffers + self.step_transient)


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
    """(saved, backward-start extra) bytes of the final norm, head and loss."""
    v = model.vocab_size // layout.tp
    seq_shard = layout.tp if layout.sequence_parallel else 1
    saved = tokens * (RESIDUAL_BYTES * 2 * model.dim // seq_shard + act * model.dim + act * v + 4 * v + 4)
    return saved, tokens * 8 * v


def in_flight(layout: Layout, n_micro: int, pp_rank: int) -> int:
    """Micro-batches (chunk-micro-batches when interleaved) alive on ``pp_rank``."""
    if layout.pp == 1:
        return 1
    if layout.schedule == "gpipe":
        return n_micro
    if layout.schedule == "interleaved":
        v = layout.virtual_stages
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
    if layout.zero >= 2:
        mem.full_grads = n * b["grad"] // layout.dp + 2 * min(bucket_bytes, n * b["grad"])

    tokens = layout.micro_batch * work.seq_len
    flight = in_flight(layout, m, pp_rank)
    per_chunk_layers = layers / layout.virtual_stages
    per_layer = layer_activation_bytes(model, tokens, layout, b["act"], layout.recompute)
    mem.in_flight = flight
    mem.activations = int(flight * per_chunk_layers * per_layer)
    if layout.recompute != "none":  # one layer rebuilt at a time in the backward pass
        mem.backward_transient += layer_activation_bytes(model, tokens, layout, b["act"], "none")
    if (layout.chunks - 1) in rank_chunks(pp_rank, layout.pp, layout.virtual_stages):
        head_flight = m if (layout.pp > 1 and layout.schedule == "gpipe") else 1
        saved, extra = head_activation_bytes(model, tokens, layout, b["act"])
        mem.activations += head_flight * saved
        mem.backward_transient += extra
    # Gradients at the backward peak: accumulated ones exist if this rank has finished a
    # backward pass before the one that starts with the most micro-batches in flight.
    accumulated = layout.zero >= 2 or (layout.schedule != "gpipe" or layout.pp == 1) and m > flight
    if accumulated:
        mem.grads = mem.full_grads
    else:  # first backward: gradients grow as activations are freed; take the larger
        mem.backward_transient = max(mem.backward_transient, mem.full_grads - mem.activations)
        mem.notes.append("peak in the first backward, before gradients exist")

    if layout.zero >= 1:
        mem.step_transient = 4 * n // layout.dp  # Adam's sqrt(v) over this rank's shard
    else:
        # The flat all-reduce bucket is counted as resident: gloo's worker threads keep
        # their last work (and its tensor) until they take the next one, so on some ranks,
        # in some runs, the last bucket outlives the step (measured, racy); with NCCL the
        # caching allocator keeps the block reserved. Adam (foreach) adds a sqrt(v)
        # temporary per parameter group.
        mem.comm_buffers = min(bucket_bytes, mem.full_grads) if layout.dp > 1 else 0
        mem.step_transient = max(4 * n, 4 * largest)
    return mem


def memory_per_stage(work: Workload, layout: Layout, split: list[int] | None = None) -> list[StageMemory]:
    return [stage_memory(work, layout, r, split) for r in range(layout.pp)]
