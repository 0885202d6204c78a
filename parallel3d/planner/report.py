"""The planner's table, the reasons behind its choice, and the recipe it writes."""

from __future__ import annotations

from dataclasses import fields

from parallel3d.planner.hardware import FRAGMENTATION, GPU, memory_terms
from parallel3d.planner.search import Candidate
from parallel3d.planner.spec import Layout, Workload

GiB = 2**30
ZERO_BUBBLE = ("zb-h1", "zb-v")


def table(candidates: list[Candidate], top: int) -> str:
    head = (f"{'#':>3}  {'layout':54s} {'mem/GPU':>8s} {'step s':>8s} {'tokens/s':>11s} {'MFU':>6s} "
            f"{'bubble':>7s} {'exp.comm':>8s} {'hid.comm':>8s}  fits")
    lines = [head]
    for i, c in enumerate(candidates[:top], 1):
        t = c.time
        lines.append(f"{i:>3}  {c.layout.describe():54s} {c.required / GiB:7.1f}G {t.step_s:8.3f} "
                     f"{t.tokens_per_s:11,.0f} {t.mfu:6.1%} {t.bubble_s / t.step_s:7.1%} "
                     f"{t.exposed_comm_s / t.step_s:8.1%} {t.hidden_comm_s / t.step_s:8.1%}  "
                     f"{'yes' if c.fits else 'NO'}")
    return "\n".join(lines)


def _shares(c: Candidate) -> dict[str, float]:
    t = c.time
    return {"compute": t.compute_s, "pipeline bubble": t.bubble_s, "tensor-parallel comm": t.tp_comm_s,
            "context-parallel comm": t.cp_comm_s, "expert all-to-all": t.ep_comm_s, "pipeline p2p": t.pp_comm_s,
            "data-parallel comm": t.dp_comm_s, "optimizer step": t.optimizer_s}


def why_slower(c: Candidate, best: Candidate) -> str:
    a, b = _shares(c), _shares(best)
    part = max(a, key=lambda k: a[k] - b[k])
    slower = c.time.step_s / best.time.step_s - 1
    return (f"{slower:.0%} slower: {part} {a[part]:.3g} s vs {b[part]:.3g} s"
            + (" (recomputation re-runs the forward)" if part == "compute" and c.layout.recompute != best.layout.recompute else ""))


def _best_of(candidates: list[Candidate], pick) -> Candidate | None:
    group = [c for c in candidates if pick(c.layout)]
    return next((c for c in group if c.fits), group[0] if group else None)


def reasons(candidates: list[Candidate], best: Candidate, gpus_per_node: int,
            fixed: dict | None = None) -> list[str]:
    """Why ``best`` wins, and why the obvious alternatives lose (one line each); where an
    alternative has no valid layout, the pinned degrees (``fixed``: --tp, --cp, --pp, --dp,
    --ep) it was searched under are named."""
    pins = " ".join(f"--{k} {v}" for k, v in (fixed or {}).items())
    t, lay = best.time, best.layout
    total = t.step_s
    parts = ", ".join(f"{k} {v / total:.0%}" for k, v in _shares(best).items() if v / total >= 0.005)
    out = [f"recommended: {lay.describe()} -- {total:.3f} s/step, MFU {t.mfu:.1%}, "
           f"{best.required / GiB:.1f} GiB of {best.budget / GiB:.1f} GiB on its fullest stage "
           f"({parts})",
           f"communication: {t.exposed_comm_s:.3g} s exposed (data-parallel {t.dp_comm_s:.3g} s), "
           f"{t.hidden_comm_s:.3g} s hidden under the compute (data-parallel)"]
    alternatives = [
        ("pure data parallel (tp1 pp1)", lambda L: L.tp == 1 and L.pp == 1 and L.cp == 1),
        (f"tensor parallel across the node (tp{gpus_per_node} pp1)", lambda L: L.tp == gpus_per_node and L.pp == 1),
        ("no pipeline (pp1)" if lay.pp > 1 else "a pipeline (pp>1)",
         (lambda L: L.pp == 1) if lay.pp > 1 else (lambda L: L.pp > 1)),
    ]
    if lay.cp > 1:
        alternatives.append(("no context parallelism (cp1)", lambda L: L.cp == 1))
    if lay.ep > 1:
        alternatives.append(("no expert parallelism (ep1)", lambda L: L.ep == 1))
    if lay.recompute != "none":
        alternatives.append(("the same layout without recomputation",
                             lambda L: L == _with(lay, recompute="none")))
    else:
        alternatives.append(("the same layout with full recomputation", lambda L: L == _with(lay, recompute="full")))
    if lay.zero > 0:
        alternatives.append(("the same layout without ZeRO", lambda L: L == _with(lay, zero=0)))
    if lay.pp > 1 and lay.schedule in ZERO_BUBBLE:
        alternatives.append(("the same layout with 1f1b",
                             lambda L: L == _with(lay, schedule="1f1b", virtual_stages=1)))
    elif lay.pp > 1:
        alternatives.append(("a zero-bubble schedule on the same degrees",
                             lambda L: L.schedule in ZERO_BUBBLE
                             and (L.tp, L.cp, L.pp, L.dp) == (lay.tp, lay.cp, lay.pp, lay.dp)))
    seen = {lay}
    for label, pick in alternatives:
        alt = _best_of(candidates, pick)
        if alt is None:
            out.append(f"{label}: no valid layout for this job" + (f" with {pins}" if pins else ""))
        elif alt.layout in seen:
            continue
        elif not alt.fits:
            out.append(f"{label}: best is {alt.layout.describe()}, which {alt.verdict()}")
        else:
            out.append(f"{label}: best is {alt.layout.describe()}, {why_slower(alt, best)}")
        if alt is not None:
            seen.add(alt.layout)
    return out


def _with(layout: Layout, **changes) -> Layout:
    return Layout(**{f.name: changes.get(f.name, getattr(layout, f.name)) for f in fields(Layout)})


def assumptions(gpu: GPU, eff, n_gpus: int, gpus_per_node: int) -> str:
    return (f"{n_gpus} x {gpu.name} ({gpus_per_node} per node), peak {gpu.peak_flops / 1e12:,.0f} TFLOP/s bf16 "
            f"dense, {gpu.memory_bytes / GiB:.1f} GiB, "
            f"compute efficiency {eff.compute:.3f}, link efficiency {eff.link:.2f}, intra-node "
            f"{gpu.nvlink_bytes_per_s / 1e9:.0f} GB/s, inter-node {gpu.internode_bytes_per_s * 8 / 1e9:.0f} "
            f"Gbit/s per GPU; memory: {memory_terms(gpu)}, and a {FRAGMENTATION:.0%} fragmentation margin "
            "on the fullest stage")


def lora_lines(work: Workload, best: Candidate, n_gpus: int, gpus_per_node: int, gpu: GPU, eff,
               fixed: dict | None = None) -> list[str]:
    """Under LoRA: the same job trained in full on these GPUs, and the fewest GPUs (halving
    ``n_gpus``, the degrees left free) on which the LoRA job still fits."""
    from dataclasses import replace

    from parallel3d.planner.search import recommend, search

    lora = work.lora
    free = {k: v for k, v in (fixed or {}).items() if k not in ("tp", "cp", "pp", "dp", "ep")}
    out = [f"lora rank {lora.rank} on {','.join(lora.targets)}: the base frozen in {work.dtype} with no "
           "gradients, masters or Adam state; those for the adapters only (ZeRO shards them); no weight "
           "gradients for the base"]
    full = search(replace(work, lora=None), n_gpus, gpus_per_node, gpu, eff, fixed)
    full_best = recommend(full)
    if full_best is None:
        out.append(f"full fine-tuning on {n_gpus} x {gpu.name}: no layout fits; the closest, "
                   f"{full[0].layout.describe()}, {full[0].verdict()}")
    else:
        out.append(f"full fine-tuning on {n_gpus} x {gpu.name}: {full_best.layout.describe()}, "
                   f"{full_best.time.step_s:.3f} s/step, {full_best.required / GiB:.1f} GiB")
    fewest, n = (n_gpus, best), n_gpus
    while n % 2 == 0 and work.global_batch % (n // 2) == 0:
        n //= 2
        fit = recommend(search(work, n, min(gpus_per_node, n), gpu, eff, free))
        if fit is None:
            break
        fewest = (n, fit)
    n, c = fewest
    out.append(f"fewest GPUs for this LoRA job (halving --gpus): {n} x {gpu.name}, {c.layout.describe()}, "
               f"{c.time.step_s:.3f} s/step, {c.required / GiB:.1f} GiB of {c.budget / GiB:.1f} GiB")
    return out


def lora_section(work: Workload) -> str:
    """The recipe's ``[lora]`` section (with a blank line after it), or "" without LoRA."""
    if work.lora is None:
        return ""
    targets = ", ".join(f'"{t}"' for t in work.lora.targets)
    dropout = f"dropout = {work.lora.dropout}\n" if work.lora.dropout else ""
    return (f"[lora]\nrank = {work.lora.rank}\nalpha = {2.0 * work.lora.rank}\n{dropout}targets = [{targets}]\n"
            "# start from a Hugging Face base: set model.hf_checkpoint\n\n")


def recipe_text(best: Candidate, work: Workload, model_keys: dict, n_gpus: int, gpus_per_node: int,
                gpu: GPU, steps: int = 1000) -> str:
    """A runnable TOML recipe for ``best`` (``parallel3d train FILE --dry-run`` accepts it)."""
    lay, t = best.layout, best.time
    nnodes = max(1, n_gpus // gpus_per_node)
    nproc = n_gpus // nnodes

    def toml(v):
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, str):
            return f'"{v}"'
        return repr(v)

    model_lines = "\n".join(f"{k} = {toml(v)}" for k, v in model_keys.items())
    return f"""# Written by `parallel3d plan`: the fastest layout that fits {n_gpus} x {gpu.name}.
# Predicted: {t.step_s:.3f} s/step, {t.tokens_per_s:,.0f} tokens/s, MFU {t.mfu:.1%},
# {best.required / 2**30:.1f} GiB on the fullest stage (stage {best.worst.stage}).
# Set the data keys for your corpus before training.

[model]
{model_lines}

[parallel]
tp = {lay.tp}
cp = {lay.cp}
cp_comm = "{lay.cp_comm}"
pp = {lay.pp}
dp = {lay.dp}
ep = {lay.ep}
schedule = "{lay.schedule}"
virtual_stages = {lay.virtual_stages}
zero = {lay.zero}
reduce_dtype = "{lay.reduce_dtype}"
bucket_mb = {lay.bucket_mb:g}
sequence_parallel = {toml(lay.sequence_parallel)}

[train]
steps = {steps}
global_batch = {work.global_batch}
micro_batch = {lay.micro_batch}
seq_len = {work.seq_len}
dtype = "{work.dtype}"
recompute = "{lay.recompute}"

{lora_section(work)}[launch]
nnodes = {nnodes}
nproc = {nproc}
backend = "nccl"

[run]
dir = "runs/planned"
"""
