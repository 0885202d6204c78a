"""Step time of any layout from terms fitted to one measured run (the autopilot's model).

The planner's :mod:`~parallel3d.planner.timing` predicts a step from datasheet peaks and
link figures. A running job knows better: it measures what its own micro-batches cost and
where its step goes. This module predicts a layout's step from such fitted terms:

``compute``  seconds of one micro-batch through one pipeline chunk, per tensor-parallel
             degree: ``base + layers * layer + head`` (the head and loss on the model's
             last chunk), measured on this rank's device by a probe of the dense shard
             shapes (``parallel3d.autopilot.probe``); recomputation scales ``layer`` by
             its hardware FLOPs (:mod:`parallel3d.flops`)
``beta``     seconds per collective step: one send-and-combine of a ring or all-to-all
             collective; an all-reduce over ``g`` ranks is ``g - 1`` of them in this
             count (gloo's small all-reduce is one all-to-all), a gather or a
             reduce-scatter ``g - 1``, a pipeline send 1
``psi``      seconds per byte a rank moves in collectives (gloo's copies and loopback
             sockets on CPU, the wire on a GPU's link), probed with an all-reduce
``adam``     seconds per optimizer element a rank steps (its parameters over dp under
             ZeRO 1 and 2), probed with the fused AdamW kernel
``phi``      the rest of a step outside forward and backward (data, the closing
             collective, bookkeeping), taken as the same for every layout of the world
``background`` the runnable threads of other processes on a host (CPU ranks only): the
             kernel shares the cores among runnable threads, so a job of ``n`` threads on
             ``C`` cores gets ``min(n, C, C n / (n + background))`` of them
``bubble``   scale on the pipeline fill-and-drain of the critical path (1: as modelled)

A rank's *work* per step is its compute, ``beta`` times its collective steps, ``psi`` times
the bytes it moves, ``adam`` times the elements it steps, and ``phi``. Two bounds make the step: the critical path (the busiest
rank's work, spread over its threads, plus the pipeline's fill and drain) and, when ranks
share CPU cores (``shared``), the host's whole work over the cores it delivers::

    step = max(max_r work_r / (threads * speed) + bubble,  sum_host work_r / delivered)

with ``delivered`` the cores the host's ranks get and ``speed = delivered / (their threads)``
the share of a core each thread gets.

On a host with more ranks than cores the second bound rules: a rank waiting in a
collective or a pipeline bubble frees its core for another, so a bubble costs little and
every collective costs the CPU time it takes. On dedicated devices (GPUs) only the first
applies. The collective counts per layout are those of this repository's layers
(:func:`rank_work`, context parallelism included: a cp rank's S / cp tokens, its comm
mode's K/V traffic); they are what a measured step is fitted against, so a layout's
prediction shares the measured layout's errors only through the fitted terms. Expert
parallelism: each sparse layer's all-to-alls of routed rows, and the experts' gradients
reduced over the dp x cp ranks that hold the same experts; the compute probe measures
dense layers (a rank computes its own tokens' share of the experts at any ep), so an MoE
model's compute is as good as that stand-in.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from parallel3d.flops import layer_forward_flops_per_token
from parallel3d.planner.experts import routed_tokens, sparse_layers_of
from parallel3d.planner.memory import BUCKET_BYTES
from parallel3d.planner.params import stage_expert_params, stage_params
from parallel3d.planner.overlap import gather_wait, reduce_tail
from parallel3d.planner.spec import Layout, Workload, kv_width, layer_split, rank_chunks


VISIBLE = 0.1  # share of forward/backward the collectives must take for their cost to be fitted


@dataclass(frozen=True)
class ChunkCost:
    """Seconds of one micro-batch (forward and backward) through a chunk at one tp degree."""

    base: float  # a chunk with no layer: embedding (or receiving), call overhead
    layer: float  # each decoder layer
    head: float  # final norm, output head and loss (the model's last chunk)


@dataclass(frozen=True)
class FittedTerms:
    compute: dict[int, ChunkCost]  # by tensor-parallel degree
    beta: float
    psi: float
    phi: float
    adam: float = 0.0
    background: float = 0.0
    bubble: float = 1.0
    shared: bool = False  # ranks share CPU cores (the host bound applies)
    cores: int = 1  # cores of a host
    threads: int = 1  # compute threads of a rank
    wire: float = 0.0  # seconds per byte on the link between hosts (0: one host); not fitted

    def describe(self) -> str:
        parts = [f"collective step {self.beta * 1e3:.3f} ms", f"{self.psi * 1e9:.3f} ns/byte",
                 f"Adam {self.adam * 1e9:.2f} ns/element", f"other {self.phi * 1e3:.1f} ms"]
        for tp, c in sorted(self.compute.items()):
            parts.append(f"tp{tp}: layer {c.layer * 1e3:.2f} ms, head {c.head * 1e3:.2f} ms, "
                         f"chunk {c.base * 1e3:.2f} ms per micro-batch")
        if self.shared:
            parts.append(f"{self.cores} cores shared with {self.background:.1f} runnable threads of "
                         "other processes")
        parts.append(f"pipeline waits x{self.bubble:.2f}")
        return "; ".join(parts)

    def to_dict(self) -> dict:
        return {"compute": {str(tp): vars(c) for tp, c in self.compute.items()}, "beta_s": self.beta,
                "psi_s_per_byte": self.psi, "adam_s_per_element": self.adam, "phi_s": self.phi,
                "background": self.background, "bubble": self.bubble, "shared": self.shared, "cores": self.cores,
                "threads": self.threads, "wire_s_per_byte": self.wire}

    @classmethod
    def from_dict(cls, d: dict) -> "FittedTerms":
        """The inverse of :meth:`to_dict` (a decision's ``terms`` in metrics.jsonl)."""
        return cls({int(tp): ChunkCost(**c) for tp, c in d["compute"].items()}, d["beta_s"],
                   d["psi_s_per_byte"], d["phi_s"], d.get("adam_s_per_element", 0.0), d["background"],
                   d["bubble"], d["shared"], d["cores"], d["threads"], d.get("wire_s_per_byte", 0.0))

    def with_tps(self, tps) -> "FittedTerms":
        """These terms with a compute entry for every degree in ``tps``: one not probed is
        scaled from the nearest probed below it by its FLOPs (layer and head over the
        ratio of degrees; a chunk's base unchanged)."""
        table = dict(self.compute)
        for tp in sorted(set(tps)):
            if tp not in table:
                known = max((k for k in table if k < tp), default=min(table))
                c, r = table[known], tp / known
                table[tp] = ChunkCost(base=c.base, layer=c.layer / r, head=c.head / r)
        return replace(self, compute=table)

    def delivered(self, threads: int) -> float:
        """Cores that ``threads`` runnable threads of the job get on one host."""
        if not self.shared:
            return float(threads)
        fair = self.cores * threads / (threads + self.background)
        return max(1e-9, min(threads, self.cores, fair))


@dataclass
class StageWork:
    """One pipeline rank's step: what it computes and communicates."""

    pp_rank: int
    compute_s: float = 0.0
    steps: float = 0.0  # collective steps (see the module docstring)
    bytes: float = 0.0  # bytes moved in collectives
    opt_elements: float = 0.0  # optimizer elements stepped
    counts: dict[str, float] = field(default_factory=dict)  # steps by kind: tp, pp, dp
    kind_bytes: dict[str, float] = field(default_factory=dict)  # bytes by kind
    dp_buckets: int = 0  # gradient buckets (each its own collective)
    gather_steps: float = 0.0  # of the dp steps and bytes, the post-step all-gather's
    gather_bytes: float = 0.0
    hidden_s: float = 0.0  # dp seconds under the compute on dedicated devices (predict)


def _recompute_scale(model, seq: int, recompute: str) -> float:
    """Layer cost with recomputation over without: its hardware FLOPs over its FLOPs."""
    fwd = layer_forward_flops_per_token(model, seq)
    redo = {"none": 0, "full": fwd, "selective": 4 * seq * model.n_heads * model.head_dim}[recompute]
    return (3 * fwd + redo) / (3 * fwd)


def _add(work: StageWork, kind: str, ops: float, group: int, nbytes: float, all_reduce: bool = False):
    if group <= 1 or ops <= 0:
        return
    steps = ops * (group - 1)
    moved = ops * nbytes * (group - 1) / group * (2 if all_reduce else 1)
    work.steps += steps
    work.bytes += moved
    work.counts[kind] = work.counts.get(kind, 0.0) + steps
    work.kind_bytes[kind] = work.kind_bytes.get(kind, 0.0) + moved


def _cp_traffic(w: StageWork, work: Workload, layout: Layout, layer_passes: int) -> None:
    """``layer_passes`` (micro-batches x layers) of context-parallel K/V traffic: K and V
    of the whole sequence at the rank's kv-heads; "allgather": an all-gather forward and a
    reduce-scatter of dK/dV backward; "ring": cp - 1 sends of a rank's K/V forward, cp - 1
    more and cp - 1 fp32 dK/dV sends backward. Full recomputation runs the forward's again."""
    cp = layout.cp
    if cp == 1:
        return
    kv = 2 * layout.micro_batch * work.seq_len * kv_width(work.model, layout.tp) * work.bytes["act"]
    forwards = 2 if layout.recompute == "full" else 1
    if layout.cp_mode(work.model) == "allgather":
        _add(w, "cp", layer_passes * (forwards + 1), cp, kv)
        return
    shard = kv / cp
    _add(w, "cp", layer_passes * (cp - 1) * (forwards + 1), 2, 2 * shard)  # a send moves it whole
    _add(w, "cp", layer_passes * (cp - 1), 2, 2 * shard / work.bytes["act"] * 4)


def _ep_traffic(w: StageWork, work: Workload, layout: Layout, sparse_passes: int) -> None:
    """``sparse_passes`` (micro-batches x sparse layers) of expert-parallel all-to-alls:
    dispatch and combine forward and backward (and the forward's again under full
    recomputation), each the routed-row counts then ``tokens x top_k`` rows of ``dim``,
    of which (ep - 1) / ep leave the rank."""
    if layout.ep == 1 or sparse_passes == 0:
        return
    model = work.model
    tokens = routed_tokens(layout, layout.micro_batch * work.seq_len // layout.cp)
    exchanges = sparse_passes * (6 if layout.recompute == "full" else 4)
    _add(w, "ep", exchanges, layout.ep, 0.0)  # the counts
    _add(w, "ep", exchanges, layout.ep, tokens * model.moe.top_k * model.dim * work.bytes["act"])


def _dp_traffic(w: StageWork, work: Workload, layout: Layout, r: int, split: list[int], bucket_bytes: int) -> None:
    """Add pipeline rank ``r``'s optimizer elements and data-parallel collectives to ``w``."""
    n_params = stage_params(work.model, layout, r, split)[0]
    experts = stage_expert_params(work.model, layout, r, split)
    groups = [(n_params - experts, layout.replicas), (experts, layout.replicas // layout.ep)]  # the reductions' groups
    w.opt_elements = sum(n / (g if layout.zero >= 1 else 1) for n, g in groups)
    for n, group in [(n, g) for n, g in groups if n != 0]:
        grad_bytes = 4 * n
        buckets = max(1, math.ceil(grad_bytes / bucket_bytes))
        w.dp_buckets += buckets
        _add(w, "dp", buckets, group, grad_bytes / buckets, all_reduce=layout.zero == 0)
        if layout.zero != 0:  # a reduce-scatter, then the parameters' all-gather
            steps, moved = w.steps, w.bytes
            _add(w, "dp", 1, group, n * work.bytes["weight"])
            w.gather_steps += w.steps - steps
            w.gather_bytes += w.bytes - moved
    if layout.pp > 1 and work.model.tie_embeddings and (r == 0 or r == layout.pp - 1):
        _add(w, "dp", 1, 2, work.model.vocab_size * work.model.dim // layout.tp * 4, all_reduce=True)


def rank_work(work: Workload, layout: Layout, compute: dict[int, ChunkCost] | None,
              bucket_bytes: int = BUCKET_BYTES) -> list[StageWork]:
    """Per pipeline rank: compute seconds (from ``compute``, None: zero) and collectives.

    Collectives per micro-batch and chunk at tp > 1: each layer 8 gathers / reduce-scatters
    under sequence parallelism (4 forward, 4 backward), else 4 all-reduces; the embedding
    1 (2 under sequence parallelism); the head 2 all-reduces of the loss and 1 (2) for its
    input. Pipeline: a send and a receive each way across every chunk boundary. Data
    parallel, per bucket: ZeRO 0 an all-reduce, 1 and 2 a reduce-scatter and the
    parameters' all-gather; a tied embedding at pp > 1 one all-reduce of its gradient.

    Context parallelism: a rank holds S / cp tokens of each sequence, so its activations,
    tp collectives and pipeline sends carry S / cp tokens, and its compute is 1 / cp of the
    whole sequence's (the probe's, at S: head-tail chunks give every rank the same share of
    the causal attention, and the rest is per token); each layer adds the K/V traffic of
    its comm mode (:func:`_cp_traffic`); gradients and ZeRO go over dp x cp.

    Expert parallelism: per sparse layer and micro-batch 4 all-to-alls (6 with full
    recomputation), each a count exchange and one of ``tokens x top_k`` rows of ``dim``;
    the routed experts' gradients reduce over dp x cp / ep (the ranks holding the same
    experts), the rest over dp x cp."""
    model, seq, cp = work.model, work.seq_len, layout.cp
    split = layer_split(model, layout.pp, layout.virtual_stages)
    m, tp, sp = layout.n_micro(work), layout.tp, layout.sequence_parallel
    act = layout.micro_batch * seq // cp * model.dim * work.bytes["act"]
    scale = _recompute_scale(model, seq, layout.recompute)
    cost = (compute or {}).get(tp)
    out = []
    for r in range(layout.pp):
        w = StageWork(r)
        for c in rank_chunks(r, layout.pp, layout.virtual_stages):
            first, last, layers = c == 0, c == layout.chunks - 1, split[c]
            if cost is not None:
                w.compute_s += m * (cost.base + layers * scale * cost.layer + (cost.head if last else 0.0)) / cp
            # under sequence parallelism each gather / reduce-scatter moves (g-1)/g of the
            # full activation, twice as many of them as the all-reduces (2 (g-1)/g) without
            _add(w, "tp", m * layers * (8 if sp else 4), tp, act, all_reduce=not sp)
            if first:
                _add(w, "tp", m * (2 if sp else 1), tp, act, all_reduce=not sp)
            if last:  # the loss: the row maxima, then the sums of exponentials and target logits
                _add(w, "tp", m, tp, 4.0 * layout.micro_batch * seq / cp, all_reduce=True)
                _add(w, "tp", m, tp, 8.0 * layout.micro_batch * seq / cp, all_reduce=True)
                _add(w, "tp", m * (2 if sp else 1), tp, act, all_reduce=not sp)
            boundaries = (not first) + (not last)
            _add(w, "pp", m * 2 * boundaries, 2, act / (tp if sp else 1) * 2)  # a send moves it whole
            _cp_traffic(w, work, layout, m * layers)
            _ep_traffic(w, work, layout, m * sparse_layers_of(model, split, [c]))
        _dp_traffic(w, work, layout, r, split, bucket_bytes)
        out.append(w)
    return out


@dataclass
class Prediction:
    step_s: float
    path_s: float  # the critical-path bound
    host_s: float  # the shared-host bound (0 on dedicated devices)
    stages: list[StageWork]

    @property
    def bound(self) -> str:
        return "host cores" if self.host_s >= self.path_s else "critical path"


def stage_work_s(stage: StageWork, terms: FittedTerms) -> float:
    return (stage.compute_s + terms.beta * stage.steps + terms.psi * stage.bytes
            + terms.adam * stage.opt_elements + terms.phi)


def dp_hidden_s(stage: StageWork, layout: Layout, terms: FittedTerms, m: int) -> float:
    """Seconds of ``stage``'s data-parallel collectives its compute hides on a dedicated
    device (:mod:`parallel3d.planner.overlap`): the gradient buckets under the last
    micro-batch's backward (two thirds of its compute), the post-step all-gather under
    the first forward when ``parallel.overlap_param_gather``. None on a shared host, where
    a collective takes the CPU time it takes whenever it runs."""
    dp_s = terms.beta * stage.counts.get("dp", 0.0) + terms.psi * stage.kind_bytes.get("dp", 0.0)
    if terms.shared or dp_s <= 0 or not stage.dp_buckets:
        return 0.0
    n = stage.dp_buckets
    gather = terms.beta * stage.gather_steps + terms.psi * stage.gather_bytes
    micro = stage.compute_s / m
    exposed = reduce_tail([(2 / 3 * micro / n, (dp_s - gather) / n, 1, n)])
    if gather > 0:
        exposed += gather_wait([(micro / 3 / n, gather / n, 1, n)]) if layout.overlap_param_gather else gather
    return max(0.0, dp_s - exposed)


def predict(work: Workload, layout: Layout, terms: FittedTerms, ranks_per_host: int) -> Prediction:
    """The step of ``layout`` under ``terms`` (every stage has tp * cp * dp ranks alike); on
    dedicated devices the data-parallel traffic the compute hides is off the critical path
    (:func:`dp_hidden_s`)."""
    stages = rank_work(work, layout, terms.compute)
    for s in stages:
        s.hidden_s = dp_hidden_s(s, layout, terms, layout.n_micro(work))
    works = [stage_work_s(s, terms) - s.hidden_s for s in stages]
    per_host = min(ranks_per_host, layout.world_size)
    delivered = terms.delivered(per_host * terms.threads)
    speed = delivered / (per_host * terms.threads) * terms.threads  # cores a rank's threads get
    path = max(works) / speed
    if terms.wire > 0 and layout.world_size > ranks_per_host:
        # ranks are laid out tp innermost, then cp, pp outermost: a cp group leaves the
        # host when tp * cp exceeds it, a dp group when tp * cp * dp does, pipeline
        # neighbours when a host holds less than a pipeline's ranks; those bytes cross the
        # wire on the critical path
        inner = layout.tp * layout.cp
        crossing = [k for k, spans in (("cp", inner > ranks_per_host), ("dp", inner * layout.dp > ranks_per_host),
                                        ("pp", layout.pp > 1)) if spans]
        path += terms.wire * max(sum(s.kind_bytes.get(k, 0.0) for k in crossing) for s in stages)
    if layout.pp > 1:  # fill and drain: (pp - 1) / v slots of the slowest stage
        m = layout.n_micro(work)
        path += terms.bubble * (layout.pp - 1) / layout.virtual_stages * max(works) / speed / m
    host = 0.0
    if terms.shared:
        # a host holds ranks_per_host ranks; stages alternate over hosts (pp outermost), so
        # a host's mix is the mean over stages when it holds several, else its own stage
        stage_ranks = layout.tp * layout.cp * layout.dp
        mean = sum(works) / len(works) if per_host >= stage_ranks else max(works)
        host = per_host * mean / delivered
    return Prediction(step_s=max(path, host), path_s=path, host_s=host, stages=stages)


@dataclass(frozen=True)
class Measured:
    """A layout's step as measured (medians over a window of steps, means over ranks)."""

    layout: Layout
    step_s: float
    cpu_s: float  # process CPU seconds per step (CPU ranks)
    cpu_fwd_bwd_s: float  # of which inside forward and backward
    busy_max_s: float  # the busiest rank's step less its waits
    comm_exposed_s: float
    bubble_s: float
    steps: int  # how many steps the medians cover


def fit_terms(work: Workload, measured: Measured, compute: dict[int, ChunkCost], *, shared: bool,
              cores: int, threads: int, ranks_per_host: int, psi: float, adam: float,
              beta_prior: float) -> FittedTerms:
    """The terms that reproduce ``measured`` given the probed ``compute``, ``psi`` and
    ``adam``.

    Shared host (CPU): ``beta`` is the CPU time inside forward and backward (where the
    collectives' work lands, gloo's threads included) that compute and bytes do not
    explain, per collective step; when the layout's collectives would take less than
    :data:`VISIBLE` of that time at ``beta_prior``, what is left over is mostly the
    compute probe's own error, and the prior stands; ``phi`` the CPU
    time outside them less the optimizer's; ``background`` from the cores the job got (its
    ranks' CPU seconds over the step). Dedicated devices: the busiest rank's busy time gives
    ``beta`` the same way and the measured waits give ``bubble``."""
    layout = measured.layout
    stages = rank_work(work, layout, compute)
    n = len(stages)
    mean = lambda f: sum(f(s) for s in stages) / n  # noqa: E731 - mean over pipeline ranks
    if shared:
        unexplained = measured.cpu_fwd_bwd_s - mean(lambda s: s.compute_s) - psi * mean(lambda s: s.bytes)
        steps = mean(lambda s: s.steps)
        visible = beta_prior * steps >= VISIBLE * measured.cpu_fwd_bwd_s
        beta = max(0.0, unexplained / steps) if visible else beta_prior
        phi = max(0.0, measured.cpu_s - measured.cpu_fwd_bwd_s - adam * mean(lambda s: s.opt_elements))
        per_host = min(ranks_per_host, layout.world_size)
        n = per_host * threads
        got = per_host * measured.cpu_s / measured.step_s
        background = n * (cores - got) / got if got < min(n, cores) * 0.999 else 0.0
        return FittedTerms(compute, beta, psi, phi, adam, background=max(0.0, background), shared=True,
                           cores=cores, threads=threads)
    slow = max(stages, key=lambda s: s.compute_s)
    phi = 0.0
    unexplained = measured.busy_max_s - slow.compute_s - psi * slow.bytes - adam * slow.opt_elements
    visible = beta_prior * slow.steps >= VISIBLE * measured.busy_max_s
    beta = max(0.0, unexplained / slow.steps) if visible else beta_prior
    terms = FittedTerms(compute, beta, psi, phi, adam, shared=False, cores=cores, threads=1)
    bubble = 1.0
    if layout.pp > 1:
        modelled = predict(work, layout, replace(terms, bubble=1.0), ranks_per_host)
        fill = modelled.path_s - max(stage_work_s(s, terms) - s.hidden_s for s in modelled.stages)
        waits = measured.step_s - measured.busy_max_s - measured.comm_exposed_s
        bubble = max(0.0, waits / fill) if fill > 0 else 1.0
    return replace(terms, phi=measured.comm_exposed_s, bubble=bubble)
