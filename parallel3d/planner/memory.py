"""Bytes a rank holds at its peak, per pipeline stage; the largest stage decides.

Three moments compete for the peak, and the model takes the largest:

* the start of a backward pass: model states (weights, master weights, optimizer
  moments, the gradient buffers) plus the saved activations of every in-flight
  micro-batch plus, on the last stage, the loss's backward buffers. Every backward of
  the rank's pipeline plan (the one the runtime runs) is evaluated and the largest
  counts;
* the optimizer step: model states with the full gradients plus the step's temporaries
  (none with the fused flat AdamW, kept as a term);
* start-up: the model states plus the initialisation's or the loading's transient.

Saved activations per decoder layer and token, read from what autograd keeps for this
repository's Llama (``models/llama/model.py``; measured on CPU by
``benchmarks/bench_planner_memory.py``), with ``d`` = dim, ``kv`` = n_kv_heads * head_dim,
``f`` = ffn_dim, ``a`` = activation bytes (4 fp32, 2 bf16: the parameters' dtype, which
the residual stream has too)::

    a * 2d / sp   the inputs of the two RMSNorms (the residual stream; each norm keeps
                  only its input and one fp32 per token, ``_RMSNormFn``)
    a * 2d / sp   the two normed inputs of the projections (q/k/v and gate/up); under
                  sequence parallelism this rank's shard (the backward gathers it again)
    a * (2d + 2kv)/tp   rotated q, rotated k, v and the attention output
    a * 3f / tp   gate, up (``_SwiGLUFn`` recomputes silu in the backward), silu(gate) * up

(``sp`` = tp under sequence parallelism, else 1.) RoPE multiplies by constant tables, so
its inputs are not kept; SDPA keeps its inputs, output and a (B, heads, S) log-sum-exp
(counted: small). ``full`` recomputation keeps only each layer's input and rebuilds one
layer at a time in the backward pass; ``selective`` (keep the matmul outputs) keeps the
input plus q, k, v, o, gate, up, down.

The last stage also holds, per in-flight micro-batch, the final norm (its input ``a*d/sp``,
the head's input ``a*d``) and what the loss saves for its backward: the logits shard
(``a*V/tp``, tp 1 included: the vocab-parallel cross-entropy never stores the softmax, and
its backward writes the gradient over the logits, so nothing more at the backward's
start). See :func:`head_activation_bytes`. With recomputation the
rebuilt layer and the loss's backward buffers are never alive together: the larger counts.

In-flight micro-batches on pipeline rank ``r`` of ``pp`` with ``m`` micro-batches: 1
without pipelining, ``m`` for GPipe, ``min(pp - r, m)`` for 1F1B, and for the
interleaved schedule with ``v`` chunks ``min(m v, 2 (pp - r - 1) + (v - 1) pp + 1)``
chunk-micro-batches (Megatron-LM's warm-up count plus one; all ``m v`` when ``m = pp``,
where the plan has no steady state). A chunk other than the model's last also keeps its
output (``r*d``) per in-flight micro-batch: the runtime stashes it for the backward.

Zero-bubble schedules free a micro-batch's activations in two steps: B (the input
gradient) frees all but what its W reads, the *W stash* (:func:`layer_stash_bytes`: each
GEMM's input and output gradient, each norm's input and output gradient; the head's input
and its logits' gradient, :func:`head_stash_bytes`), and W frees that; a W itself holds its computed gradients until it hands them to autograd,
in groups of up to 16 MiB (``kernels/deferred.py``). Counted alive until
their W: ``min(pp, m)`` on every rank for zb-h1 (``min(pp - r, m)`` of them before their
B, as 1F1B), ``min(2 pp, m + r + 1)`` chunk-micro-batches for zb-v. The plan's walk
(:func:`backward_moments`) gives, at each B, how many are before their B and how many
between B and W.

Context parallelism (cp > 1) gives a rank ``S / cp`` tokens of each sequence (two
head-tail chunks): every per-token term above counts those tokens only. What the
attention keeps changes with the comm mode (:func:`cp_attention_extra`): the all-gather
mode's SDPA keeps the whole sequence's K and V (its inputs) in place of the local k and
v, the ring keeps its output beside the o projection's input. Each layer's comm buffers
(:func:`cp_transient_bytes`) live while it runs. Measured on CPU in
``tests/test_planner_cp.py`` (the ring: the bytes autograd saves at cp 2 against cp 1). The
GPU path this assumes is a flash-style kernel (activations linear in tokens): SDPA with
the all-gather mode's (S_l, S) mask under grouped-query attention runs torch's math
kernel, which keeps the (B, H, S_l, S) probabilities, and the ring's blocks off CPU run
explicit math with (c, c) fp32 scores; neither is counted.

Model states per parameter held (bytes, see :data:`~parallel3d.planner.spec.PRECISION`):
weights, master weights (mixed precision only), gradients (fp32) and Adam (8), all
allocated by the flat-buffer optimizer at construction; cp changes none of them, but
ZeRO shards over the replicas dp x cp ("dp" below). ZeRO 1 shards master weights and
moments over dp and keeps the whole fp32 gradient buffer plus its reduced shard; ZeRO 2
keeps only the shard, and packs each bucket of a backward pass into a transient fp32
buffer, at most two in flight. ZeRO 3 also shards the weights: a rank holds its 1/dp of
them plus the largest unit (decoder layer, embedding, or norm and head) twice, the one
gathered for its forward or backward and the next one prefetched
(:func:`zero3_unit_params`; the runtime gathers buckets, 2-3 in flight, and a bucket holds
whole parameters, so with the embedding or head the largest this is close, otherwise an
upper bound); gradients as ZeRO 2. The step itself (clipping, the fused AdamW over flat
shards, the all-gathers into the parameter buffer) allocates nothing. The start-up peak
is the model states plus the initialisation's host chunk or one loaded slice.

LoRA (``work.lora``, :mod:`parallel3d.planner.lora`): the frozen weights in the storage
dtype with nothing else; gradients, masters and moments (and ZeRO's shards, buckets and
the gradient transients) for what trains only; each adapter's ``lora_B`` also keeps its
(tokens, r) input.

Mixture-of-Experts models (:mod:`parallel3d.planner.experts`): a sparse layer holds its
attention as above, its router and shared experts whole on every tp rank, and ``E / ep``
routed experts, whose masters, moments (and gradients at ZeRO 2) shard over edp x cp
instead of dp x cp (a second flat-buffer optimizer); its MoE block saves per routed token
what :func:`~parallel3d.planner.experts.moe_token_bytes` says in place of the dense MLP's
``a * 3f / tp``, and at ep > 1 its all-to-all buffers live while it runs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from parallel3d.planner.lora import dropout_rebuilt_elements, lora_states, trained_units
from parallel3d.planner.experts import (a2a_transient_bytes, moe_selective_bytes, moe_token_bytes,
                                       sparse_layers_of)
from parallel3d.planner.moments import (backward_moments, head_stash_bytes, in_flight,  # noqa: F401 - this module's API
                                       layer_stash_bytes, peak_moments)
from parallel3d.planner.params import stage_expert_params, stage_params, zero3_unit_params
from parallel3d.planner.spec import ADAM_BYTES, Layout, Workload, kv_width, layer_split, rank_chunks

BUCKET_BYTES = 25 * 2**20  # gradient buckets (parallel.bucket_mb)
FLUSH_BYTES = 16 * 2**20  # a W's weight gradients handed to autograd together (kernels/deferred.py)
MAX_INFLIGHT = 4  # bucket reductions in flight at once (parallel3d/zero/grads.py)
INIT_CHUNK_BYTES = 12 * 2**20  # the seeded initialisation's host temporaries (tensor_parallel/init.py)


@dataclass
class StageMemory:
    """One pipeline rank's peak, by component (bytes)."""

    stage: int
    layers: int
    params: int  # parameters held by this rank (elements)
    expert_params: int = 0  # of those, routed experts' (sharded by ZeRO over edp x cp)
    weights: int = 0
    master: int = 0
    optimizer: int = 0
    grads: int = 0  # held at the backward peak
    activations: int = 0  # saved activations of the in-flight micro-batches
    backward_transient: int = 0  # the larger of a recomputed layer and the loss's backward buffers
    step_transient: int = 0  # optimizer-step temporaries (none with the fused flat AdamW)
    startup_transient: int = 0  # building and filling the model (init chunk or one loaded slice)
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
    def startup_peak(self) -> int:
        return (self.weights + self.master + self.optimizer + self.full_grads
                + self.startup_transient)

    @property
    def training_peak(self) -> int:
        """The peak of a training step (what a measurement of one step sees)."""
        return max(self.backward_peak, self.step_peak)

    @property
    def peak(self) -> int:
        """The peak over the process's life, start-up included (``max_memory_allocated``)."""
        return max(self.training_peak, self.startup_peak)

    def breakdown(self) -> tuple[str, int, int, int]:
        """(phase, model states, activations, buffers) at the moment of the peak."""
        base = self.weights + self.master + self.optimizer
        if self.backward_peak >= self.step_peak:
            return ("backward", base + self.grads, self.activations, self.backward_transient)
        return ("optimizer step", base + self.full_grads, 0, self.step_transient)


def layer_activation_bytes(model, tokens: int, layout: Layout, act: int, recompute: str,
                           sparse: bool = False) -> int:
    """Saved bytes of one decoder layer for ``tokens`` tokens of one micro-batch
    (``sparse``: a Mixture-of-Experts layer, whose block saves per routed token
    :func:`~parallel3d.planner.experts.moe_token_bytes`)."""
    d, f, tp = model.dim, model.ffn_dim, layout.tp
    q, kv = model.n_heads * model.head_dim, model.n_kv_heads * model.head_dim
    seq_shard = tp if layout.sequence_parallel else 1
    layer_in = act * d // seq_shard
    small = 4 * (model.n_heads // tp + 2)  # log-sum-exp per head, one fp32 rstd per norm
    if recompute == "full":
        return tokens * layer_in
    if recompute == "selective":
        if sparse:
            return tokens * (layer_in + act * (d + (q + 2 * kv) // tp) + moe_selective_bytes(model, act) // seq_shard)
        return tokens * (layer_in + act * (2 * d + (q + 2 * kv + 2 * f) // tp))
    if sparse:
        full = 4 * layer_in + act * (2 * q + 2 * kv) // tp + moe_token_bytes(model, act, layout.ep) // seq_shard
    else:
        full = 4 * layer_in + act * (2 * q + 2 * kv + 3 * f) // tp
    return tokens * (full + small + cp_attention_extra(model, layout, act))


def cp_attention_extra(model, layout: Layout, act: int) -> int:
    """Bytes per local token a layer saves beyond the plain attention's, at cp > 1
    (without recomputation; recomputation keeps only matmul outputs, local as ever).
    ``allgather``: SDPA keeps its inputs, the whole sequence's K and V (cp times the
    rank's own), instead of the local rotated k and v. ``ring``: the ring keeps its output
    (B, H, S_l, D) besides the o projection's input (B, S_l, H D), a copy."""
    if layout.cp == 1:
        return 0
    if layout.cp_mode(model) == "allgather":
        return (layout.cp - 1) * 2 * kv_width(model, layout.tp) * act
    return act * model.n_heads * model.head_dim // layout.tp


def cp_transient_bytes(model, tokens: int, layout: Layout, act: int) -> int:
    """The context-parallel attention's buffers of one layer, alive while it runs, for
    ``tokens`` local tokens. ``allgather``: the whole sequence's K and V twice (forward:
    the gathered (cp, 2, B, Hkv, S_l, D) and its copy in global order; backward: their
    gradient and its reshuffle for the reduce-scatter). ``ring``: the K/V in flight and
    the one received, two fp32 dK/dV accumulators (the one computed, the one passing
    through) and the fp32 dq."""
    if layout.cp == 1:
        return 0
    kv = 2 * kv_width(model, layout.tp)  # K and V per token
    if layout.cp_mode(model) == "allgather":
        return 2 * tokens * layout.cp * kv * act
    return tokens * (kv * (2 * act + 2 * 4) + 4 * model.n_heads * model.head_dim // layout.tp)


def head_activation_bytes(model, tokens: int, layout: Layout, act: int, cpu: bool = False) -> tuple[int, int]:
    """(saved, backward-start extra) bytes of the final norm, head and loss.

    The loss, at every tp (``models/llama/parallelize.py``: tp 1 is one rank holding
    every column), is the vocab-parallel cross-entropy: it saves the logits (shard) and two
    N-vectors, never the softmax, and its backward writes the gradient over the logits
    (``inplace``), so the backward's start adds nothing on the fused kernel and, on CPU
    (``cpu``), the torch reference's one fp32 row block (``kernels.cross_entropy``: at most
    ``REF_BLOCK_BYTES``, whole rows). The head's matmul saves its input, not its output.
    """
    v = -(-model.vocab_size // layout.tp)  # the vocabulary padded to a multiple of tp, per rank
    seq_shard = layout.tp if layout.sequence_parallel else 1
    norm = act * model.dim // seq_shard + act * model.dim  # the final norm's input, the head's input
    block = 0
    if cpu:  # (the kernel's module imports torch: a GPU plan does not need it)
        from parallel3d.kernels.cross_entropy import REF_BLOCK_BYTES
        block = min(tokens, max(1, REF_BLOCK_BYTES // (4 * v))) * 4 * v
    return tokens * (norm + act * v + 8 + 8), block


def stage_activation_bytes(model, tokens: int, layout: Layout, act: int, recompute: str,
                           split: list[int], pp_rank: int) -> tuple[float, float, int]:
    """(saved bytes of one chunk of ``pp_rank``, its B-to-W stash, one rebuilt layer's
    saved bytes) for ``tokens`` tokens: the rank's dense and sparse layers, averaged over
    its chunks; the rebuilt layer is the larger kind it holds."""
    chunks = rank_chunks(pp_rank, layout.pp, layout.virtual_stages, layout.schedule)
    layers = sum(split[c] for c in chunks)
    sparse = sparse_layers_of(model, split, chunks)
    kinds = [(layers - sparse, False), (sparse, True)]
    v = layout.virtual_stages
    saved = sum(n * layer_activation_bytes(model, tokens, layout, act, recompute, s) for n, s in kinds if n) / v
    stash = sum(n * layer_stash_bytes(model, tokens, layout, act, s) for n, s in kinds if n) / v
    rebuilt = max((layer_activation_bytes(model, tokens, layout, act, "none", s) for n, s in kinds if n), default=0)
    return saved, stash, rebuilt


def stage_memory(work: Workload, layout: Layout, pp_rank: int, split: list[int] | None = None,
                 bucket_bytes: int | None = None, gloo: bool = False) -> StageMemory:
    """One pipeline rank's peak. ``gloo``: the CPU runtime, whose reduce-scatter receives
    every rank's copy of its slice into a buffer of the bucket's size per reduction in
    flight (NCCL reduces in place)."""
    model, b = work.model, work.bytes
    split = split or layer_split(model, layout.pp, layout.virtual_stages, schedule=layout.schedule)
    n, layers, largest = stage_params(model, layout, pp_rank, split)
    n_expert = stage_expert_params(model, layout, pp_rank, split)
    mem = StageMemory(stage=pp_rank, layers=layers, params=n, expert_params=n_expert)
    bucket_bytes = bucket_bytes or int(layout.bucket_mb * 2**20)
    trained, grad_largest = _model_states(mem, work, layout, pp_rank, split, bucket_bytes, largest)
    bucket = min(bucket_bytes, 4 * trained)
    # (never more buckets than the gradients fill)
    in_flight_buckets = min(MAX_INFLIGHT, -(-4 * trained // bucket)) * bucket if bucket else 0
    # Inside a backward: stage 2 packs each bucket into a fresh fp32 buffer, at most
    # MAX_INFLIGHT of them in flight; on gloo every reduce-scatter in flight also has its
    # receive buffer.
    # Every weight's gradient is computed into a tensor of its own (in the parameter's
    # dtype) before autograd adds it into the buffer, or the hook folds it: the largest
    # weight's is the transient.
    transient_grads = grad_largest * b["weight"]
    if layout.zero >= 2:
        transient_grads += in_flight_buckets
    if gloo and layout.zero >= 1 and layout.replicas > 1:
        transient_grads += in_flight_buckets
    # A W computes its chunk's weight gradients, handing them to autograd in groups of up
    # to FLUSH_BYTES (kernels/deferred.py): what exists at once besides the buffers.
    w_group = min(FLUSH_BYTES, trained * b["weight"] // layout.virtual_stages) + grad_largest * b["weight"]
    _activation_peak(mem, work, layout, pp_rank, split, transient_grads, w_group, gloo)
    mem.grads = mem.full_grads
    # The step: clipping and torch's fused AdamW work in place over the flat shards, and
    # the all-gathers of stages 1 and 2 land in the parameter buffer: no temporaries
    # beyond the norm's per-piece scalars.
    mem.step_transient = 0
    # Start-up: the buffers above, plus the seeded initialisation's host chunk
    # (tensor_parallel/init.py: 2^18 elements, ~48 bytes each in flight) or one slice of
    # one tensor read from a checkpoint (the largest, in fp32 at most).
    mem.startup_transient = max(INIT_CHUNK_BYTES, 4 * largest)
    return mem


def _model_states(mem: StageMemory, work: Workload, layout: Layout, pp_rank: int, split: list[int],
                  bucket_bytes: int, largest: int) -> tuple[int, int]:
    """``mem``'s weights, masters, moments and gradient buffers; returns the elements with
    a gradient and the largest of them (LoRA: the adapters and what stays trainable)."""
    model, b = work.model, work.bytes
    n, n_expert = mem.params, mem.expert_params
    # weights are replicated over dp x cp: ZeRO shards and gradients reduce over both;
    # routed experts over the ranks holding the same experts, edp x cp
    replicas, expert_replicas = layout.replicas, layout.expert_replicas
    zero = layout.zero >= 1
    # The flat-buffer optimizer (parallel3d/zero) allocates everything at construction:
    # the parameters (their dtype), fp32 masters when they are bf16, the moments, and the
    # fp32 gradient buffers, resident from the first step to the last; one such optimizer
    # for the dense parameters, one for the experts.
    parts = [(n - n_expert, replicas), (n_expert, expert_replicas)]
    if work.lora is not None:  # LoRA: the base frozen, only what trains has state (planner.lora)
        units = trained_units(model, layout, pp_rank, split, work.lora)
        trained = units.total
        mem.params = n = n + units.adapters  # the adapters beside the base's weights
        # the routed experts' adapters and (sharded at ZeRO 3) their frozen weights live on
        # the expert replicas, the rest on dp x cp
        states = lora_states(trained - units.experts, n - trained - n_expert, work.dtype, layout.zero, replicas)
        experts = lora_states(units.experts, n_expert, work.dtype, layout.zero, expert_replicas)
        mem.weights, mem.master, mem.optimizer, mem.full_grads = (
            states.weights + experts.weights, states.master + experts.master,
            states.optimizer + experts.optimizer, states.grads + experts.grads)
        if layout.zero == 3:  # the frozen base sharded too: a unit gathered and the next prefetched
            unit = max(zero3_unit_params(model, layout, pp_rank, split), bucket_bytes // b["weight"])
            mem.weights += min(n, 2 * unit) * b["weight"]
        return trained, units.largest
    mem.weights = n * b["weight"]
    if layout.zero == 3:  # this rank's shard, plus a unit gathered while it runs and the next prefetched
        # (a unit is whole buckets: one larger than a layer gathers more than the layer)
        unit = max(zero3_unit_params(model, layout, pp_rank, split), bucket_bytes // 4)
        mem.weights = sum(k * b["weight"] // r for k, r in parts) + min(n, 2 * unit) * b["weight"]
    mem.master = sum(k * b["master"] // (r if zero else 1) for k, r in parts)
    mem.optimizer = sum(k * ADAM_BYTES // (r if zero else 1) for k, r in parts)
    if layout.zero >= 2:  # gradients accumulate in the shard only
        mem.full_grads = sum(4 * k // r for k, r in parts)
    else:  # the whole fp32 buffer (stage 1 also keeps its reduced shard)
        mem.full_grads = 4 * n + (sum(4 * k // r for k, r in parts) if layout.zero == 1 else 0)
    return n, largest


def _activation_peak(mem: StageMemory, work: Workload, layout: Layout, pp_rank: int, split: list[int],
                     transient_grads: int, w_group: int, gloo: bool) -> None:
    """``mem``'s activations, backward transient and micro-batches in flight at the
    stage's peak moment (``peak_moments``: a forward, a backward or a W of the schedule)."""
    model, b = work.model, work.bytes
    tokens = layout.micro_batch * work.seq_len // layout.cp  # a cp rank's head-tail chunks
    chunk_act, chunk_stash, one_layer = stage_activation_bytes(model, tokens, layout, b["act"], layout.recompute,
                                                                split, pp_rank)
    dropped = 0  # LoRA's dropout: one adapter's dropped input, rebuilt in the backward (not kept)
    if work.lora is not None:  # each adapter's lora_B keeps its (tokens, r) input (lora_A's is the layer's)
        adapter_act = tokens * len(work.lora.targets) * work.lora.rank * b["act"]
        dropped = tokens * dropout_rebuilt_elements(model, layout.tp, work.lora, layout.sequence_parallel) * b["act"]
        one_layer += adapter_act
        if layout.recompute != "full":
            chunk_act += adapter_act * mem.layers / layout.virtual_stages
    # One layer's context-parallel and all-to-all buffers exist while it runs, and while
    # a rebuilt layer runs its backward.
    rebuilt = cp_transient_bytes(model, tokens, layout, b["act"]) + a2a_transient_bytes(model, layout, tokens,
                                                                                       b["act"]) + dropped
    if layout.recompute != "none":  # one layer rebuilt at a time in the backward pass
        rebuilt += one_layer
    # A chunk that is not the last keeps its output in the runtime's stash until its
    # backward (pipeline/runtime.py); autograd itself saves no layer's output.
    stashed = tokens * b["act"] * model.dim // (layout.tp if layout.sequence_parallel else 1)
    saved, extra = head_activation_bytes(model, tokens, layout, b["act"], cpu=gloo)
    head_stash = head_stash_bytes(model, tokens, layout, b["act"])
    best = None
    for alive, alive_last, waiting, waiting_last, is_last in peak_moments(layout, layout.n_micro(work), pp_rank):
        act = (alive * chunk_act + (alive - alive_last) * stashed + alive_last * saved
               + waiting * chunk_stash + waiting_last * head_stash)
        if is_last is None:  # a W: no recomputation, no loss buffers
            total = act + mem.full_grads + w_group
            if best is None or total > best[0]:
                best = (total, act, w_group, alive + waiting)
            continue
        # The loss's backward buffers and a rebuilt layer never coexist: the loss's
        # backward ends (freeing them and its micro-batch's saved head) before autograd
        # reaches the last decoder layer and recomputes it.
        transient = max(extra, rebuilt - saved) if is_last else rebuilt
        # Gradient transients appear as the backward frees the activations of the layers
        # that produce them: they count where they exceed them.
        transient = max(transient, transient_grads - act)
        total = act + mem.full_grads + transient
        if best is None or total > best[0]:
            best = (total, act, transient, alive + waiting)
    _, mem.activations, mem.backward_transient, mem.in_flight = best


def memory_per_stage(work: Workload, layout: Layout, split: list[int] | None = None,
                     gloo: bool = False) -> list[StageMemory]:
    return [stage_memory(work, layout, r, split, gloo=gloo) for r in range(layout.pp)]
