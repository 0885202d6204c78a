"""Predicted step time of a layout, split into where the time goes.

Per pipeline slot (one micro-batch through one stage, forward and backward)::

    compute   hardware FLOPs of the stage's layers (and head) / (peak * efficiency.compute)
    tp comm   per layer 4 all-reduces of the (tokens, dim) activation (2 forward, 2 backward;
              6 with full recomputation), on NVLink when the tp group fits in a node.
              Sequence parallelism swaps each for a reduce-scatter + all-gather pair, the
              same bytes. Not overlapped with compute.

    cp comm   context parallelism (a rank computes its S / cp tokens: the head-tail chunks
              balance the causal attention, so the FLOPs per token stay the whole
              sequence's), per layer the K/V of the whole sequence at the rank's kv-heads:
              "allgather" all-gathers it in F and reduce-scatters dK/dV in B, each under
              the attention of the rank's own chunks (1 / cp of its attention, twice that
              in B): exposed only where the collective outlasts it;
              "ring" sends cp - 1 K/V shards in F and cp - 1 K/V shards plus cp - 1 fp32
              dK/dV shards in B, each step overlapped with that step's block attention (1 /
              cp of the rank's, twice that in B): exposed only where the message outlasts
              it; the last dK/dV message under the own chunks' last block. Recomputation
              re-runs the forward's. On NVLink when tp * cp fits in a node (cp sits between
              tp and dp in rank order).

    ep comm   expert parallelism: per sparse layer four all-to-alls of the rank's routed
              rows (dispatch and combine, forward and backward; six with full
              recomputation), exposed (:mod:`parallel3d.planner.experts`). A sparse layer's
              experts, router and shared experts run whole on every tp rank: their FLOPs
              per rank divide by tp only under sequence parallelism (each tp rank then
              routes S / tp tokens; without it every tp rank computes all of them).

A slot splits into F (the forward: GEMMs and attention), B (the input gradient: dgrad
GEMMs, the attention backward, what recomputation re-runs, the backward's tp collectives)
and W (the weight gradient: wgrad GEMMs). The pipeline idles, per stage and step
(:func:`bubble_seconds`; F, B, W of the slowest stage, all its chunks)::

    gpipe, 1f1b    (pp - 1) (F + B + W)
    interleaved    (pp - 1) (F + B + W) / v
    zb-h1          (pp - 1) max(F + B - W, F, B)    the W's fill the cool-down
    zb-v           the simulator's idle time of the plan (pipeline/simulate.py) at
                   min(m, 2 pp - 1) micro-batches, which m does not change beyond that
                   while W <= B (at m itself when W > B: the first chunk's backward
                   runs whole in its B, which posts a batch a W later, every step of the
                   steady state); (pp - 1) max(F + B - W, F, B) / 2 past pp 16 (exact at
                   F = B = W)

The first three are exact for the simulator's plans at any costs (``tests/test_planner.py``
checks them against it); zb-v's idle under unequal costs depends on pp in no simple way,
so it is simulated (cached by pp and the cost ratios, 0.1 s at pp 16). Each slot also sends the stage's output activation forward
and its gradient back (point-to-point, on the inter-node link when pipeline neighbours
sit on different nodes), once per chunk of the rank; these are not overlapped either.

Data parallelism over the replicas dp x cp (cp ranks hold the same weights; routed
experts over edp x cp, dp / ep x cp, in a collective of their own) overlaps the compute
(:mod:`parallel3d.planner.overlap`): the gradients are all-reduced (ZeRO 0) or
reduce-scattered (ZeRO 1, 2) bucket by bucket as the backward fills them, ZeRO 1 and 2
all-gather the updated weights under the next forward (``parallel.overlap_param_gather``),
ZeRO 3 gathers each layer's weights before its forward and backward with the next one
prefetched; each stage's exposed part (what its compute does not hide) counts, the
largest of the stages'. Gradients cross the wire in fp32, or bf16 with
``parallel.reduce_dtype``. The ring collectives use the alpha-beta model::

    all-reduce      2 (n-1)/n * bytes / bw + 2 (n-1) * latency
    reduce-scatter    (n-1)/n * bytes / bw +   (n-1) * latency   (all-gather alike)

with ``bw = link peak * efficiency.link`` of the slowest link the group spans (a data-
parallel ring across nodes: one NIC per member in a node, up to NVLink's figure).
Finally the optimizer step streams master weights, gradients and moments through HBM.

LoRA (``work.lora``, :mod:`parallel3d.planner.lora`): the frozen weights have no weight
gradient, so W holds only the adapters' GEMMs (and those of ``lora.trainable``'s
weights), which F and B gain as well; the data-parallel traffic and the optimizer step
carry only what trains.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from parallel3d.flops import (head_forward_flops_per_token, layer_forward_flops_per_token,
                              mlp_matmul_params, model_flops_per_token)
from parallel3d.planner.experts import a2a_seconds, sparse_layers_of
from parallel3d.planner.hardware import GPU, Efficiency
from parallel3d.planner.lora import adapter_params, sparse_adapter_params, trained_units
from parallel3d.planner.params import stage_expert_params, stage_params
from parallel3d.planner.overlap import DpTime, Unit, dp_time
from parallel3d.planner.spec import Layout, Workload, kv_width, layer_split, rank_chunks


@dataclass
class StepTime:
    step_s: float
    compute_s: float  # the slowest stage's compute over all its micro-batches
    bubble_s: float
    tp_comm_s: float
    pp_comm_s: float
    dp_comm_s: float  # exposed (what the compute does not hide)
    optimizer_s: float
    tokens_per_s: float
    mfu: float
    cp_comm_s: float = 0.0  # context parallelism's exposed K/V traffic
    ep_comm_s: float = 0.0  # expert parallelism's all-to-alls, exposed
    dp_hidden_s: float = 0.0  # data-parallel link seconds under the compute

    @property
    def exposed_comm_s(self) -> float:
        return self.tp_comm_s + self.cp_comm_s + self.ep_comm_s + self.pp_comm_s + self.dp_comm_s

    @property
    def hidden_comm_s(self) -> float:
        """Communication the compute hides (the data-parallel collectives')."""
        return self.dp_hidden_s


def ring_time(kind: str, nbytes: float, n: int, bw: float, latency: float) -> float:
    """Seconds of a ring collective over ``n`` ranks moving ``nbytes`` per rank."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    steps = 2 * (n - 1) if kind == "all_reduce" else n - 1
    return steps / n * nbytes / bw + steps * latency


def _links(gpu: GPU, eff: Efficiency, within_node: bool) -> tuple[float, float]:
    if within_node:
        return gpu.nvlink_bytes_per_s * eff.link, eff.nvlink_latency_s
    return gpu.internode_bytes_per_s * eff.link, eff.internode_latency_s


def stage_flops_per_token(work: Workload, layout: Layout, pp_rank: int, split: list[int]) -> float:
    """Hardware training FLOPs per token of one tensor-parallel rank of ``pp_rank``."""
    return sum(stage_phase_flops(work, layout, pp_rank, split))


def stage_phase_flops(work: Workload, layout: Layout, pp_rank: int,
                      split: list[int]) -> tuple[float, float, float]:
    """(F, B, W) FLOPs per token of one tensor-parallel rank of ``pp_rank``: the forward;
    the input gradient (the dgrad GEMMs, twice the attention products, what recomputation
    re-runs); the weight gradient (the wgrad GEMMs). A layer's backward is its forward's
    GEMMs twice plus its attention twice: B + W = 2 F."""
    model, seq = work.model, work.seq_len
    chunks = rank_chunks(pp_rank, layout.pp, layout.virtual_stages, layout.schedule)
    layers = sum(split[c] for c in chunks)
    sparse = sparse_layers_of(model, split, chunks)
    attention_fwd = 4 * seq * model.n_heads * model.head_dim
    f = b = w = 0.0
    for n, is_sparse in ((layers - sparse, False), (sparse, True)):
        if not n:
            continue
        layer_fwd = layer_forward_flops_per_token(model, seq, is_sparse)
        gemm_fwd = layer_fwd - attention_fwd
        redo = {"none": 0, "full": layer_fwd, "selective": attention_fwd}[layout.recompute]
        # An MoE block runs whole on each tp rank: on its S / tp tokens under sequence
        # parallelism (a tp-th of the block's FLOPs, as the division below gives), on all
        # of them without (tp - 1 more per rank, added before the division).
        moe_share = 0
        if is_sparse and not layout.sequence_parallel:
            moe_share = 2 * mlp_matmul_params(model, sparse=True) * (layout.tp - 1)
        f += n * (layer_fwd + moe_share)
        b += n * (gemm_fwd + 2 * attention_fwd + redo + moe_share * (2 if layout.recompute == "full" else 1))
        w += n * (gemm_fwd + moe_share)
    head_w = head = head_forward_flops_per_token(model) if (layout.chunks - 1) in chunks else 0
    if work.lora is not None:
        # LoRA: the frozen weights need no wgrad GEMMs (W keeps only the trained weights'),
        # the adapters add 2 FLOPs per element and token to F, B and W (planner.lora)
        units = trained_units(model, layout, pp_rank, split, work.lora)
        dense, sparse = layers - units.sparse_layers, units.sparse_layers
        whole = units.per_layer - adapter_params(model, layout.tp, work.lora)  # lora.trainable's
        adapters = 2 * dense * adapter_params(model, layout.tp, work.lora) * layout.tp
        if sparse:  # an MoE layer's: the attention's and shared expert's, and k experts' a token
            replicated, _, per_expert = sparse_adapter_params(model, layout, work.lora)
            whole_sparse = units.per_sparse_layer - replicated
            adapters += 2 * sparse * (replicated + model.moe.top_k * per_expert) * layout.tp
            whole = (dense * whole + sparse * whole_sparse) / layers
        w = 2 * layers * whole * layout.tp + adapters  # per rank below: / tp
        f, b = f + adapters, b + adapters
        head_w = 2 * units.head * layout.tp if units.head > model.dim else 0
    return (f + head) / layout.tp, (b + head) / layout.tp, (w + head_w) / layout.tp


def cp_layer_seconds(work: Workload, layout: Layout, gpu: GPU, gpus_per_node: int,
                     eff: Efficiency) -> tuple[float, float]:
    """(forward, backward) exposed seconds of one layer's context-parallel K/V traffic
    for one micro-batch (module docstring): the all-gather of the whole sequence's K/V
    and the reduce-scatter of dK/dV where they outlast the own chunks' attention, or the
    ring's steps where they outlast the block attention they overlap. (0, 0) at cp 1."""
    cp = layout.cp
    if cp == 1:
        return 0.0, 0.0
    model, act = work.model, work.bytes["act"]
    bw, lat = _links(gpu, eff, layout.tp * cp <= gpus_per_node)
    # K and V of the whole sequence at this rank's kv-heads (elements)
    kv = 2 * layout.micro_batch * work.seq_len * kv_width(model, layout.tp)
    # the attention of the K/V at hand, 1 / cp of the rank's (head-tail: its own two
    # chunks, the ring's every step); the backward's blocks cost twice the forward's
    tokens = layout.micro_batch * work.seq_len // cp
    attention = 4 * work.seq_len * model.n_heads * model.head_dim * tokens / layout.tp
    step_f = attention / (gpu.peak_flops * eff.compute) / cp
    if layout.cp_mode(model) == "allgather":  # each collective under the own chunks' blocks
        return (max(0.0, ring_time("all_gather", kv * act, cp, bw, lat) - step_f),
                max(0.0, ring_time("reduce_scatter", kv * act, cp, bw, lat) - 2 * step_f))
    # ring: step t's blocks hide the messages in flight then; backward: the K/V of step 0
    # under 3/4 of the own chunks' blocks, at each step t >= 1 the next K/V (t < cp-1) and
    # the dK/dV accumulator sent at step t-1 (t >= 2), the last accumulator (to its owner)
    # under the own chunks' last block, kept for the end (a quarter of them)
    kv_msg = kv / cp * act / bw + lat
    dkv_msg = kv / cp * 4 / bw + lat  # fp32 accumulators
    forward = (cp - 1) * max(0.0, kv_msg - step_f)
    step_b = 2 * step_f
    backward = max(0.0, kv_msg - 0.75 * step_b) + max(0.0, dkv_msg - 0.25 * step_b)
    for t in range(1, cp):
        backward += max(0.0, kv_msg * (t < cp - 1) + dkv_msg * (t >= 2) - step_b)
    return forward, backward


def bubble_seconds(schedule: str, pp: int, v: int, m: int, f: float, b: float, w: float) -> float:
    """Idle seconds of a stage per step (module docstring); ``f``, ``b``, ``w``: one
    micro-batch's forward, input-gradient and weight-gradient seconds on the slowest
    stage, over all its chunks."""
    if pp == 1:
        return 0.0
    if schedule == "zb-h1":
        return (pp - 1) * max(f + b - w, f, b)
    if schedule == "zb-v":
        if pp > SIMULATED_ZB_V_UP_TO:
            return (pp - 1) * max(f + b - w, f, b) / 2
        m_sim = m if w > b else min(m, 2 * pp - 1)
        return f * _zb_v_idle(pp, m_sim, round(b / f, 3), round(w / f, 3))
    return (pp - 1) * (f + b + w) / (v if schedule == "interleaved" else 1)


SIMULATED_ZB_V_UP_TO = 16  # pipeline depth up to which zb-v's bubble is simulated


@lru_cache(maxsize=4096)
def _zb_v_idle(pp: int, m: int, b: float, w: float) -> float:
    """Idle time of zb-v's plan per stage at forward cost 1 (per stage; each chunk half)."""
    from parallel3d.pipeline.simulate import simulate

    run = simulate("zb-v", pp, 2, m, 0.5, b / 2, w / 2)
    return run.makespan - m * (1 + b + w)


def bubble_fraction(schedule: str, pp: int, v: int, m: int, f: float, b: float, w: float) -> float:
    """The idle share of the step window :func:`bubble_seconds` predicts (what the
    timeline measures as ``bubble_fraction``)."""
    idle = bubble_seconds(schedule, pp, v, m, f, b, w)
    return idle / (idle + m * (f + b + w))


def step_time(work: Workload, layout: Layout, gpu: GPU, gpus_per_node: int,
              eff: Efficiency, split: list[int] | None = None) -> StepTime:
    """The step of ``layout``, with the efficiencies ``eff`` (the planner's default:
    ``parallel3d.planner.calibrate.default_efficiency()``)."""
    model = work.model
    split = split or layer_split(model, layout.pp, layout.virtual_stages, schedule=layout.schedule)
    m = layout.n_micro(work)
    tokens = layout.micro_batch * work.seq_len // layout.cp  # a cp rank's head-tail chunks
    flop_rate = gpu.peak_flops * eff.compute
    phases = [stage_phase_flops(work, layout, r, split) for r in range(layout.pp)]
    slowest = max(phases, key=sum)
    f, bwd, w, parts, max_layers, act_bytes = _slot(work, layout, gpu, gpus_per_node, eff, split, tokens, slowest)
    compute_s, tp_comm_s, cp_comm_s, ep_comm_s = (m * x for x in parts)  # the slot's parts, m times
    bubble_s = bubble_seconds(layout.schedule, layout.pp, layout.virtual_stages, m, f, bwd, w)

    # -- pipeline point-to-point ------------------------------------------------------
    pp_comm_s = _pp_seconds(layout, act_bytes, m + bubble_s / sum(parts), gpu, gpus_per_node, eff)

    # -- data parallelism and the optimizer step ----------------------------------------
    # Each stage's collectives against its own compute (the slot's communication spread
    # over the slowest stage's layers); the stage exposing most counts.
    f_comm = (f - slowest[0] * tokens / flop_rate) / max_layers
    b_comm = (bwd - slowest[1] * tokens / flop_rate) / max_layers
    dp = max((stage_dp_time(work, layout, r, split, phases[r], tokens, flop_rate, f_comm, b_comm, gpu,
                            gpus_per_node, eff) for r in range(layout.pp)), key=lambda d: d.exposed_s)
    dp_comm_s = dp.exposed_s
    optimizer_s = _optimizer_seconds(work, layout, split, gpu, eff)

    step_s = compute_s + bubble_s + tp_comm_s + cp_comm_s + ep_comm_s + pp_comm_s + dp_comm_s + optimizer_s
    tokens_per_s = work.tokens_per_step / step_s
    # LoRA: the model's FLOPs less the weight gradients it does not compute (a third of
    # the 6 N per token; the adapters' own are negligible)
    achieved = tokens_per_s * model_flops_per_token(model, work.seq_len) * (2 / 3 if work.lora else 1)
    return StepTime(step_s=step_s, compute_s=compute_s, bubble_s=bubble_s, tp_comm_s=tp_comm_s,
                    pp_comm_s=pp_comm_s, dp_comm_s=dp_comm_s, optimizer_s=optimizer_s,
                    tokens_per_s=tokens_per_s, mfu=achieved / (layout.world_size * gpu.peak_flops),
                    cp_comm_s=cp_comm_s, ep_comm_s=ep_comm_s, dp_hidden_s=dp.hidden_s)


def _slot(work: Workload, layout: Layout, gpu: GPU, gpus_per_node: int, eff: Efficiency, split: list[int],
          tokens: int, slowest) -> tuple:
    """One pipeline slot of the slowest stage: its forward, input-gradient and weight-gradient
    seconds with their communication, the slot's (compute, tp, cp, ep) seconds, the most
    layers a rank holds and a micro-batch's activation bytes."""
    model, b = work.model, work.bytes
    flop_rate = gpu.peak_flops * eff.compute
    tp_bw, tp_lat = _links(gpu, eff, layout.tp <= gpus_per_node)
    act_bytes = tokens * model.dim * b["act"]
    max_layers = max(sum(split[c] for c in rank_chunks(r, layout.pp, layout.virtual_stages, layout.schedule))
                     for r in range(layout.pp))
    ring = max_layers * ring_time("all_reduce", act_bytes, layout.tp, tp_bw, tp_lat)
    # per layer 2 all-reduces forward, 2 in B (4 with full recomputation), none in W
    f, bwd, w = (x * tokens / flop_rate for x in slowest)
    f, bwd = f + 2 * ring, bwd + (4 if layout.recompute == "full" else 2) * ring
    compute_slot, tp_slot = sum(slowest) * tokens / flop_rate, (6 if layout.recompute == "full" else 4) * ring
    # context parallelism: per layer the K/V traffic of the forward, and of the backward
    # (plus the forward's again where recomputation re-runs the attention)
    cp_f, cp_b = cp_layer_seconds(work, layout, gpu, gpus_per_node, eff)
    cp_f, cp_b = max_layers * cp_f, max_layers * (cp_b + (cp_f if layout.recompute != "none" else 0.0))
    f, bwd = f + cp_f, bwd + cp_b
    cp_slot = cp_f + cp_b
    # expert parallelism: per sparse layer dispatch and combine in F, their gradients in B
    # (and the forward's again under full recomputation)
    max_sparse = max(sparse_layers_of(model, split, rank_chunks(r, layout.pp, layout.virtual_stages,
                                                                 layout.schedule)) for r in range(layout.pp))
    a2a = max_sparse * a2a_seconds(model, layout, tokens, b["act"],
                                   *_links(gpu, eff, layout.tp * layout.cp * layout.ep <= gpus_per_node))
    ep_f, ep_b = 2 * a2a, (4 if layout.recompute == "full" else 2) * a2a
    f, bwd = f + ep_f, bwd + ep_b
    ep_slot = ep_f + ep_b
    return f, bwd, w, (compute_slot, tp_slot, cp_slot, ep_slot), max_layers, act_bytes


def _pp_seconds(layout: Layout, act_bytes: float, slots: float, gpu: GPU, gpus_per_node: int,
                eff: Efficiency) -> float:
    """The pipeline's point-to-point seconds: a send and a receive of a micro-batch's
    activations per chunk and per slot of the slowest stage (``slots``: the micro-batches
    plus the bubble, in slots)."""
    if layout.pp == 1:
        return 0.0
    # pipeline neighbours are tp*dp ranks apart: on NVLink only if the whole pipeline
    # fits in one node, otherwise the slowest hop crosses nodes
    bw, lat = _links(gpu, eff, layout.world_size <= gpus_per_node)
    shard = layout.tp if layout.sequence_parallel else 1
    msg = act_bytes / shard / bw + lat
    return 2 * slots * layout.virtual_stages * msg


def _optimizer_seconds(work: Workload, layout: Layout, split: list[int], gpu: GPU, eff: Efficiency) -> float:
    """The optimizer step of the fullest stage. Adam reads and writes master weights (or
    fp32 weights) and both moments, reads the gradient, and writes the bf16 weights back:
    about 32 bytes per element held (LoRA: only what trains is stepped)."""
    model = work.model
    fullest = max(range(layout.pp), key=lambda r: stage_params(model, layout, r, split)[0])
    n_expert = stage_expert_params(model, layout, fullest, split)
    parts = [(stage_params(model, layout, fullest, split)[0] - n_expert, layout.replicas),
             (n_expert, layout.expert_replicas)]
    if work.lora is not None:
        units = max((trained_units(model, layout, r, split, work.lora) for r in range(layout.pp)),
                    key=lambda u: u.total)
        parts = [(units.total - units.experts, layout.replicas), (units.experts, layout.expert_replicas)]
    held = sum(n / (replicas if layout.zero >= 1 else 1) for n, replicas in parts)
    return 32 * held / (gpu.hbm_bytes_per_s * eff.memory)


def stage_units(work: Workload, layout: Layout, pp_rank: int, split: list[int], phase: tuple[float, float, float],
                tokens: int, flop_rate: float, f_comm: float, b_comm: float) -> list[Unit]:
    """``pp_rank``'s parameters as :class:`~parallel3d.planner.overlap.Unit` s in forward
    order: the embedding (no compute), its decoder layers (the stage's compute less the
    head's, in equal shares, each with ``f_comm`` / ``b_comm`` seconds of the layer's own
    collectives), the final norm and head."""
    model = work.model
    chunks = rank_chunks(pp_rank, layout.pp, layout.virtual_stages, layout.schedule)
    layers = sum(split[c] for c in chunks)
    n = stage_params(model, layout, pp_rank, split)[0]
    n_expert = stage_expert_params(model, layout, pp_rank, split)
    first, last = 0 in chunks, (layout.chunks - 1) in chunks
    embed = model.vocab_size * model.dim // layout.tp
    head_params = (model.dim + (0 if model.tie_embeddings and first else embed)) if last else 0
    head_s = head_forward_flops_per_token(model) / layout.tp * tokens / flop_rate if last else 0.0
    f_s, b_s = phase[0] * tokens / flop_rate, (phase[1] + phase[2]) * tokens / flop_rate
    per_layer = (n - (embed if first else 0) - head_params) / max(1, layers)
    trained = [None, None, None]  # of the embedding's, a layer's and the head's: what reduces (None: all)
    trained_expert = 0.0  # of a layer's, the routed experts' adapters (reduced over edp)
    if work.lora is not None:  # LoRA: only what trains reduces its gradients ...
        lora = trained_units(model, layout, pp_rank, split, work.lora)
        lora_layer = (lora.total - lora.embed - lora.head - lora.experts) / max(1, layers)
        if layout.zero == 3:  # ... and ZeRO 3 gathers the frozen weights too (zero/frozen.py)
            trained = [lora.embed, lora_layer + lora.experts / max(1, layers), lora.head]
            trained_expert = lora.experts / max(1, layers)
            per_layer += lora.adapters / max(1, layers)
        else:  # ... and ZeRO 1/2 gather only what they updated
            embed, head_params, per_layer, n_expert = lora.embed, lora.head, lora_layer, lora.experts
    units = [Unit(0.0, 0.0, embed, trained=trained[0])] if first else []
    units.append(Unit((f_s - head_s) / layers + f_comm, (b_s - 2 * head_s) / layers + b_comm, per_layer,
                      n_expert / layers, count=layers, trained=trained[1], trained_expert=trained_expert))
    if last:
        units.append(Unit(head_s, 2 * head_s, head_params, trained=trained[2]))
    return units


def stage_dp_time(work: Workload, layout: Layout, pp_rank: int, split: list[int], phase: tuple[float, float, float],
                  tokens: int, flop_rate: float, f_comm: float, b_comm: float, gpu: GPU, gpus_per_node: int,
                  eff: Efficiency) -> DpTime:
    """The data-parallel traffic of ``pp_rank`` against its compute (:func:`~parallel3d.planner.overlap.dp_time`)."""
    units = stage_units(work, layout, pp_rank, split, phase, tokens, flop_rate, f_comm, b_comm)
    grad_bytes = 2 if layout.reduce_dtype == "bf16" else work.bytes["grad"]
    return dp_time(units, layout.zero, layout.n_micro(work), layout.replicas, layout.expert_replicas, layout.tp,
                   grad_bytes, work.bytes["weight"], layout.overlap_param_gather, int(layout.bucket_mb * 2**20),
                   gpu, eff, gpus_per_node)
