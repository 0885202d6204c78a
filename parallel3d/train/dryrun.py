"""``parallel3d train RECIPE --dry-run [--gpu NAME]``: check a whole job without starting it.

Runs every check the workers would run, at the recipe's own world size
(``launch.nnodes * launch.nproc``, or torchrun's ``WORLD_SIZE``), and prints the layout,
the stage split and, per pipeline stage, what one rank holds. It creates no process group
and starts no worker, so a 512-rank job checks in seconds.

The parameters of a stage are counted on the rank's own modules: the plain model is
built on the meta device (shapes only, no memory) and parallelized with that rank's
coordinates (a :class:`~parallel3d.topology.Topology` without process groups), exactly as
training builds it. The first, a middle and the last stage are built (and the fullest,
if another), at tp rank 0 and dp rank 0: every tp rank of a stage holds as many
parameters, and the dp ranks are copies. What a rank holds counts its real memory:
vocabulary rows padding the embedding and the head to a multiple of tp, the norms every
tp rank keeps whole, and with tied embeddings under pp > 1 the last stage's copy of the
embedding. Over one tp x pp slice, leaving those out, the counts add up to the model's
own (:func:`count_params`; ``tests/test_recipes_dryrun.py`` builds every rank of small
models and checks it).

A Mixture-of-Experts model under expert parallelism holds ``E / ep`` routed experts of
each sparse layer on a rank (``models/moe/parallelize.py``; the rank built is ep rank 0):
its parameters whose name contains ``.experts.`` are counted apart, as expert parameters,
and printed per stage beside the dense ones.

Bytes per parameter held (the trainer's storage):

    weights     2 (bf16) when train.dtype is bf16 (or auto on CUDA), else 4 (fp32)
    gradients   4 (fp32 accumulation); divided by dp x cp at ZeRO 2
    optimizer   8 (Adam's two fp32 moments) + 4 (fp32 master weights, bf16 only);
                divided by dp x cp at ZeRO 1 and 2 (cp ranks hold the same weights)

Routed experts' gradients and optimizer state divide by edp x cp instead (edp = dp / ep:
the ranks holding the same experts, ``parallel3d/zero/split.py``).

Activations and step buffers are the planner's estimate (:mod:`parallel3d.planner.memory`)
at its peak; ``--gpu NAME`` (or ``--gpu-spec``) then says, per stage, whether that fits
the GPU with the planner's fragmentation margin, and by how much.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch.overrides import TorchFunctionMode

from parallel3d.config import JobConfig
from parallel3d.launch import job_nodes
from parallel3d.lora.apply import apply_lora
from parallel3d.models import model_family
from parallel3d.planner.hardware import FRAGMENTATION, GPU, memory_terms, usable_bytes
from parallel3d.planner.lora import lora_states
from parallel3d.planner.memory import StageMemory, memory_per_stage
from parallel3d.planner.spec import Layout, LoraSpec, Workload, layer_split, rank_chunks
from parallel3d.topology import RankGrid, Topology
from parallel3d.train.setup import check_job, resolve_model_config
from parallel3d.zero.split import is_expert

GiB = 2**30
VOCAB_PARAMS = ("embed_tokens.weight", "lm_head.weight")
EXPERT_MARK = ".experts."  # in the name of a routed expert's parameter


def runs_on_cuda(cfg: JobConfig, gpu_target: bool = False) -> bool:
    """A named GPU, ``launch.backend = "nccl"``, or ``auto`` with CUDA here; else CPU (gloo)."""
    return gpu_target or cfg.launch.backend == "nccl" or (cfg.launch.backend == "auto" and torch.cuda.is_available())


def memory_dtype(cfg: JobConfig, gpu_target: bool = False) -> str:
    """``train.dtype``, ``auto`` resolved as the trainer does: bf16 on CUDA, fp32 on CPU."""
    if cfg.train.dtype != "auto":
        return cfg.train.dtype
    return "bf16" if runs_on_cuda(cfg, gpu_target) else "fp32"


@dataclass(frozen=True)
class ParamCount:
    """Parameters of one rank's modules (elements)."""

    held: int  # every element the rank stores: its memory
    padding: int  # of those, rows padding the vocabulary to a multiple of tp
    copies: int  # of those, elements another rank of the slice counts (p3d_norm_owner False)
    experts: int = 0  # of those, routed experts' (names containing ".experts.")

    @property
    def dense(self) -> int:
        """Held elements that are not routed experts' (attention, norms, router, shared
        experts, embedding and head)."""
        return self.held - self.experts

    @property
    def owned(self) -> int:
        """Elements of the unsplit model this rank accounts for: summed over one tp x pp
        slice, the model's parameter count."""
        return self.held - self.padding - self.copies


def count_params(module: torch.nn.Module, vocab_size: int) -> ParamCount:
    """Count ``module``'s parameters (each tensor once, as ``named_parameters`` gives them).

    A parameter several ranks hold (a norm on every tp rank, a kv-head replicated over tp
    ranks, the tied embedding on the first and the last stage) is marked
    ``p3d_norm_owner = False`` on all holders but one; those are the copies. Padding: the
    rows of the vocabulary-parallel embedding and head at or past ``vocab_size``."""
    held = padding = copies = experts = 0
    for name, p in module.named_parameters():
        n = p.numel()
        held += n
        experts += n if EXPERT_MARK in name else 0
        row_padding = 0
        if name.endswith(VOCAB_PARAMS):
            start, stop = getattr(p, "p3d_tp_range", None) or (0, p.shape[0])
            row_padding = max(0, stop - max(start, vocab_size)) * p.shape[1]
        padding += row_padding
        if getattr(p, "p3d_norm_owner", True) is False:
            copies += n - row_padding
    return ParamCount(held, padding, copies, experts)


class _NoMetaFill(TorchFunctionMode):
    """In-place fills of meta tensors (the modules' random initialisation, ``from_dense``'s
    copies) return at once: a meta tensor has no values to fill, and torch's meta path of
    ``normal_`` costs about 2 ms a call (a 128-expert model's 37,000 of them: 70 s)."""

    FILLS = {torch.Tensor.normal_, torch.Tensor.uniform_, torch.Tensor.fill_, torch.Tensor.zero_,
             torch.Tensor.copy_}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in self.FILLS and args and isinstance(args[0], torch.Tensor) and args[0].is_meta:
            return args[0]
        return func(*args, **(kwargs or {}))


@contextmanager
def shapes_only():
    """Build modules on the meta device without running their initialisation."""
    with _NoMetaFill(), torch.device("meta"):
        yield


def rank_modules(cfg: JobConfig, model_cfg, world_size: int, pp_rank: int, tp_rank: int = 0):
    """This rank's model as training builds it (its family's ``build_meta``: its pipeline chunks,
    tensor-parallel shards and, at dp rank 0, ep rank 0's experts), on the meta device."""
    par = cfg.parallel
    grid = RankGrid(tp=par.tp, pp=par.pp, dp=par.dp, cp=par.cp, ep=par.ep)
    topo = Topology.of(par, rank=grid.rank_of(tp_rank, pp_rank, 0), world_size=world_size,
                       create_groups=False)
    with shapes_only():
        module, _ = model_family(cfg.model.family).build_meta(model_cfg, topo, par)
        apply_lora(module, cfg, topo)  # [lora]: the adapters, every other weight frozen (rank 0: no change)
    return module


def lora_state_bytes(module: torch.nn.Module, dtype: str, zero: int, dp: int, expert_dp: int | None = None) -> StateBytes:
    """LoRA: the planner's :func:`~parallel3d.planner.lora.lora_states` with the elements of
    the rank's modules; the routed experts' (``p3d_expert``: their adapters, and at ZeRO 3
    their frozen weights' shards) over their own replicas, ``expert_dp`` (default ``dp``)."""
    def count(trains: bool, expert: bool) -> int:
        return sum(p.numel() for p in module.parameters() if p.requires_grad == trains and is_expert(p) == expert)
    s = lora_states(count(True, False), count(False, False), dtype, zero, dp)
    e = lora_states(count(True, True), count(False, True), dtype, zero, expert_dp or dp)
    return StateBytes(s.weights + e.weights, s.grads + e.grads, s.master + s.optimizer + e.master + e.optimizer)


@dataclass(frozen=True)
class StateBytes:
    weights: int
    grads: int
    optimizer: int

    @property
    def total(self) -> int:
        return self.weights + self.grads + self.optimizer


def state_bytes(held: int, dtype: str, zero: int, dp: int, experts: int = 0,
                expert_dp: int = 1) -> StateBytes:
    """Bytes of weights, gradients and optimizer state for ``held`` parameters, of which
    ``experts`` are routed experts sharded over ``expert_dp`` ranks (edp x cp) and the rest
    over ``dp`` (dp x cp) (the table in the module docstring)."""
    bf16 = dtype == "bf16"
    weights = grads = optimizer = 0
    for n, ranks in ((held - experts, dp), (experts, expert_dp)):
        shard = -(-n // ranks)  # ceil: the flat buffers are padded to a multiple of the ranks
        weights += (2 if bf16 else 4) * (shard if zero >= 3 else n)  # zero 3: + the buckets in flight
        grads += 4 * (shard if zero >= 2 else n)
        optimizer += (8 + (4 if bf16 else 0)) * (shard if zero >= 1 else n)
    return StateBytes(weights, grads, optimizer)


@dataclass
class StageReport:
    stage: int
    params: ParamCount
    states: StateBytes
    planned: StageMemory  # the planner's stage: activations and buffers
    module: torch.nn.Module | None = None  # the rank's modules, on the meta device

    @property
    def transient(self) -> tuple[int, int]:
        """(activations, buffers) at the larger of the planner's two moments: the start of
        a backward pass (saved activations, the loss's or a recomputed layer's buffers) and
        the optimizer step (its temporaries, no activations)."""
        p = self.planned
        if p.activations + p.backward_transient >= p.step_transient:
            return p.activations, p.backward_transient
        return 0, p.step_transient

    @property
    def peak(self) -> int:
        """Model states (from the modules, gradients all held) plus :attr:`transient`."""
        return self.states.total + sum(self.transient)


def built_stages(pp: int, planned: list[StageMemory]) -> list[int]:
    """First, middle and last pipeline stage, and the planner's fullest if another."""
    fullest = max(planned, key=lambda s: s.peak).stage
    return sorted({0, pp // 2, pp - 1, fullest})


def stage_reports(cfg: JobConfig, model_cfg, world_size: int, planned: list[StageMemory],
                  dtype: str) -> list[StageReport]:
    par = cfg.parallel
    out = []
    for stage in built_stages(par.pp, planned):
        module = rank_modules(cfg, model_cfg, world_size, stage)
        params = count_params(module, model_cfg.vocab_size)
        # weights are replicated over dp x cp: ZeRO shards over both; experts over edp x cp
        states = state_bytes(params.held, dtype, par.zero, par.dp * par.cp, params.experts,
                             par.dp // par.ep * par.cp)
        if cfg.lora.rank:
            states = lora_state_bytes(module, dtype, par.zero, par.dp * par.cp, par.dp // par.ep * par.cp)
        out.append(StageReport(stage, params, states, planned[stage], module))
    return out


def _fit(peak: int, gpu: GPU) -> str:
    need, budget = int(peak * (1 + FRAGMENTATION)), usable_bytes(gpu)
    if need <= budget:
        return f"fits, {(budget - need) / GiB:.1f} GiB to spare"
    return f"DOES NOT FIT, {(need - budget) / GiB:.1f} GiB over"


def stage_table(reports: list[StageReport], pp: int, gpu: GPU | None) -> tuple[str, list[str]]:
    """(the unit, the table's lines): GiB, or MiB when every stage is under 1 GiB."""
    unit, scale = ("GiB", GiB) if max(r.peak for r in reports) >= GiB else ("MiB", 2**20)
    size = lambda n: f"{n / scale:.2f}"  # noqa: E731
    names = {0: "first", pp - 1: "last"}
    head = (f"  {'stage':12s} {'params':>13s} {'weights':>8s} {'grads':>8s} {'optim.':>8s} |"
            f" {'activ.':>8s} {'buffers':>8s} | {'peak':>8s}")
    if gpu is not None:
        head += f"  {gpu.name} ({memory_terms(gpu)}; {FRAGMENTATION:.0%} margin)"
    lines = [head]
    for r in reports:
        label = f"{r.stage} ({names.get(r.stage, 'middle')})" if pp > 1 else "0 (all)"
        s, (acts, buffers) = r.states, r.transient
        line = (f"  {label:12s} {r.params.held:13,d} {size(s.weights):>8s} {size(s.grads):>8s} "
                f"{size(s.optimizer):>8s} | {size(acts):>8s} {size(buffers):>8s} | {size(r.peak):>8s}")
        if gpu is not None:
            line += "  " + _fit(r.peak, gpu)
        lines.append(line)
    return unit, lines


def _bytes_legend(dtype: str, zero: int, dp: int, cp: int = 1, ep: int = 1) -> str:
    bf16 = dtype == "bf16"
    shard = f" / dp {dp}" + (f" x cp {cp}" if cp > 1 else "")
    if ep > 1:  # routed experts shard over the ranks holding the same experts
        shard += f" (experts / edp {dp // ep}" + (f" x cp {cp}" if cp > 1 else "") + ")"
    return (f"weights {2 if bf16 else 4} B/param ({dtype}){shard if zero >= 3 else ''}, grads 4 B (fp32){shard if zero >= 2 else ''}, "
            f"optimizer {'8 B Adam + 4 B fp32 master' if bf16 else '8 B Adam'}{shard if zero >= 1 else ''} "
            f"(zero {zero})")


def active_params(model_cfg) -> int:
    """Parameters one token passes through: all of a dense model's; a Mixture-of-Experts
    model's without the routed experts it is not sent to (``top_k`` of ``n_experts``)."""
    moe = model_cfg.moe
    n = model_cfg.num_params()
    if moe is None:
        return n
    sparse = sum(model_cfg.is_sparse(i) for i in range(model_cfg.n_layers))
    return n - sparse * (moe.num_params(model_cfg.dim) - moe.active_params(model_cfg.dim))


def expert_lines(reports: list[StageReport], model_cfg, par) -> list[str]:
    """Per built stage, the rank's expert and dense parameters read from its modules."""
    moe = model_cfg.moe
    out = [f"parameters by kind (the rank's modules; experts: names containing '{EXPERT_MARK}', "
           f"{moe.n_experts // par.ep} of {moe.n_experts} experts a sparse layer at ep {par.ep}):"]
    for r in reports:
        out.append(f"  stage {r.stage}: {r.params.experts:,d} expert + {r.params.dense:,d} dense = "
                   f"{r.params.held:,d}")
    return out


def _print_split(cfg: JobConfig, split: list[int], out) -> None:
    par = cfg.parallel
    grid = RankGrid(tp=par.tp, pp=par.pp, dp=par.dp, cp=par.cp, ep=par.ep)
    chunks_total = par.pp * par.virtual_stages
    out("stage split" + (" (parallel.pp_layers)" if par.pp_layers else " (balanced rule)") + ":")
    first = 0
    bounds = []
    for n in split:
        bounds.append((first, first + n - 1))
        first += n
    for r in range(par.pp):
        chunks = rank_chunks(r, par.pp, par.virtual_stages, par.schedule)
        spans = ", ".join(f"layer {lo}" if lo == hi else f"layers {lo}-{hi}"
                          for lo, hi in (bounds[c] for c in chunks))
        ranks = grid.group_ranks("dp", grid.rank_of(0, r, 0))
        extra = (" + embedding" if 0 in chunks else "") + (" + head" if chunks_total - 1 in chunks else "")
        out(f"  stage {r} (ranks {ranks[0]}..{ranks[-1] + par.tp * par.cp - 1}): {spans}{extra}")


def param_count(n: int) -> str:
    """8.030B, 124.439M, 202.5K: a small model is not "0.000B"."""
    for unit, size, digits in (("B", 1e9, 3), ("M", 1e6, 3), ("K", 1e3, 1)):
        if n >= size:
            return f"{n / size:.{digits}f}{unit}"
    return str(n)


def dry_run(cfg: JobConfig, world_size: int, out=print, gpu: GPU | None = None) -> dict:
    """Check ``cfg`` at ``world_size`` and report; returns what it found (for tests)."""
    model_cfg = resolve_model_config(cfg.model)
    check_job(cfg, model_cfg, world_size)
    par, train = cfg.parallel, cfg.train
    n_params = model_cfg.num_params()  # the unsplit model (a tied matrix once)

    layout = Layout.from_config(cfg)
    dtype = memory_dtype(cfg, gpu_target=gpu is not None)
    work = Workload(model_cfg, train.seq_len, train.global_batch, dtype, LoraSpec.from_config(cfg.lora))
    # The stage split training will use: parallel.pp_layers, else the pipeline's rule.
    split = layer_split(model_cfg, par.pp, par.virtual_stages, par.pp_layers, par.schedule)
    on_cpu = not runs_on_cuda(cfg, gpu is not None)  # + the loss reference's row block, gloo's buffers
    planned = memory_per_stage(work, layout, split, gloo=on_cpu)

    nodes = job_nodes(world_size, cfg.launch.nnodes)
    active = f", {param_count(active_params(model_cfg))} active per token" if model_cfg.moe is not None else ""
    out(f"dry run: {world_size} ranks ({nodes} node{'s' if nodes > 1 else ''} x {world_size // nodes}), "
        f"model {param_count(n_params)} parameters{active} (each rank's modules built on the meta device, "
        "nothing allocated)")
    cp = f" x cp {par.cp} ({layout.cp_mode(model_cfg)})" if par.cp > 1 else ""
    ep = f" (ep {par.ep} x edp {par.dp // par.ep})" if par.ep > 1 else ""
    out(f"layout: tp {par.tp}{cp} x pp {par.pp} x dp {par.dp}{ep}; schedule {par.schedule}"
        f"{f' x{par.virtual_stages} virtual stages' if par.virtual_stages > 1 else ''}; zero {par.zero}; "
        f"recompute {train.recompute}; sequence parallel {'on' if par.sequence_parallel else 'off'}")
    out(f"batch: {train.global_batch} sequences of {train.seq_len} tokens per step = "
        f"{layout.n_micro(work)} micro-batches of {train.micro_batch} per dp rank; precision {work.dtype}"
        + (f"; {train.seq_len // par.cp} tokens of each sequence per cp rank (2 head-tail chunks)"
           if par.cp > 1 else ""))
    _print_split(cfg, split, out)
    reports = stage_reports(cfg, model_cfg, world_size, planned, dtype)
    unit, table = stage_table(reports, par.pp, gpu)
    out(f"memory per rank ({unit}): parameters held by the rank's modules (built on the meta device at tp "
        f"rank 0; vocabulary padding and replicated norms included), {_bytes_legend(dtype, par.zero, par.dp, par.cp, par.ep)}; "
        f"activations and buffers from the planner{' (on CPU over gloo)' if on_cpu else ''}:")
    for line in table:
        out(line)
    if cfg.lora.rank:
        trained = sum(p.numel() for r in reports for p in r.module.parameters() if p.requires_grad)
        out(f"lora rank {cfg.lora.rank}: the frozen weights without gradients or optimizer state; "
            f"gradients and optimizer state for the {param_count(trained)} trained parameters of the stages shown")
    if model_cfg.moe is not None:
        for line in expert_lines(reports, model_cfg, par):
            out(line)
    return {"world_size": world_size, "model_cfg": model_cfg, "split": split,
            "stages": planned, "reports": reports}


def check_start(cfg: JobConfig, model_cfg, out=print):
    """The checks the run makes between :func:`check_job` and its first step, in the order
    it makes them, with its messages: the directories it writes, the checkpoint options,
    then the data (the dataset opens, its vocabulary and tokenizer match the model, the
    training split holds a sequence, the validation split eval.batches global batches).
    Returns the data's :class:`~parallel3d.train.data.DataFacts`, or None when the stdlib
    corpus is not built yet (building it takes a minute; the run does it, once)."""
    from parallel3d.checkpoint.checkpointer import check_checkpoint_options
    from parallel3d.data.stdlib import INDEX, cache_path
    from parallel3d.train.data import check_data
    from parallel3d.train.setup import check_paths

    check_paths(cfg)
    check_checkpoint_options(cfg.checkpoint)
    if not cfg.data.path and not cfg.data.blend and not (cache_path(cfg.data) / INDEX).is_file():
        out(f"data: the stdlib corpus is not built yet ({cache_path(cfg.data)}): the run builds it "
            "and checks its splits then")
        return None
    facts = check_data(cfg, model_cfg.vocab_size)
    out(f"data: checked: {facts.train_tokens:,} training tokens ({facts.train_samples:,} sequences), "
        f"{facts.val_tokens:,} held out; {epochs_phrase(facts.epochs(cfg))}")
    return facts


def epochs_phrase(epochs: float) -> str:
    """How many passes over the training split the run's steps make."""
    if epochs <= 1:
        return f"the run reads {epochs:.0%} of the training split"
    return f"the run passes over the training split {epochs:.1f} times (data repeats)"
