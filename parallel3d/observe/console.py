"""What a person reads on the console around a run: the banner before it, the summary after.

The banner says what is about to run: the model and its size, the world and the layout
grid (which ranks form which pipeline stage, holding which layers), the batch and
precision, where the data comes from, and the run directory. The summary says how it
went: wall time and training time, tokens per second, the final and best held-out loss
and where each output is. Both are plain functions of the config and ``metrics.jsonl``,
called once by the command line (rank 0 or the launching process), never per step.
"""

from __future__ import annotations

import statistics
import textwrap
from pathlib import Path

from parallel3d.observe.progress import duration
from parallel3d.observe.report import steady_records
from parallel3d.pipeline.partition import rank_chunks


def _count(n: float) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= size:
            return f"{n / size:.2f}{unit}"
    return f"{n:.0f}"


def _ranks(lo: int, hi: int) -> str:
    return f"rank {lo}" if lo == hi else f"ranks {lo}-{hi}"


def stage_lines(tp: int, pp: int, dp: int, split: list[int], virtual_stages: int,
                schedule: str = "1f1b", cp: int = 1) -> list[str]:
    """One phrase per pipeline stage: its ranks (pp outermost, then dp, cp, tp innermost:
    stage s is ranks [s dp cp tp, (s+1) dp cp tp)) and its layers. Long pipelines show
    their first two and last stage."""
    width = dp * cp * tp
    starts, first = [], 0
    for n in split:
        starts.append((first, first + n - 1))
        first += n
    chunks_total = pp * virtual_stages
    out = []
    for s in range(pp):
        chunks = rank_chunks(s, pp, virtual_stages, schedule)
        spans = [starts[c] for c in chunks]
        layers = ", ".join(f"{lo}" if lo == hi else f"{lo}-{hi}" for lo, hi in spans)
        noun = "layer" if len(spans) == 1 and spans[0][0] == spans[0][1] else "layers"
        extra = (" + embedding" if 0 in chunks else "") + (" + head" if chunks_total - 1 in chunks else "")
        out.append(f"stage {s}: {_ranks(s * width, (s + 1) * width - 1)}, {noun} {layers}{extra}")
    if pp > 4:
        out = out[:2] + [f"... ({pp - 3} more)"] + out[-1:]
    return out


def banner(cfg, model, world: int, split: list[int], backend: str, dtype: str, data: str,
           nodes: int | None = None) -> list[str]:
    """The lines printed before training. ``cfg`` is the job (:class:`JobConfig`),
    ``model`` its resolved :class:`LlamaConfig`, ``split`` the layers of each pipeline
    chunk, ``backend`` / ``dtype`` as resolved for this machine, ``data`` one line on the
    data source, ``nodes`` the hosts the launcher gave (default ``launch.nnodes``)."""
    par, train, launch = cfg.parallel, cfg.train, cfg.launch
    source = f"from {cfg.model.hf_checkpoint}" if cfg.model.hf_checkpoint else f"preset {cfg.model.preset}"
    kv = f" / {model.n_kv_heads} kv-heads" if model.n_kv_heads != model.n_heads else ""
    lines = [f"parallel3d: Llama, {_count(model.num_params())} parameters ({source}: {model.n_layers} layers, "
             f"dim {model.dim}, {model.n_heads} heads{kv}, ffn {model.ffn_dim}, vocab {model.vocab_size}"
             f"{', tied embeddings' if model.tie_embeddings else ''})"]
    nodes = nodes or launch.nnodes
    cp = f" x cp {par.cp} ({par.cp_comm})" if par.cp > 1 else ""
    ep = f" (ep {par.ep} of dp)" if par.ep > 1 else ""
    lines.append(f"  world     {world} ranks = tp {par.tp}{cp} x pp {par.pp} x dp {par.dp}{ep}, {nodes} node"
                 f"{'s' if nodes > 1 else ''} x {world // nodes} processes, {backend}, {dtype}")
    if par.cp > 1:
        grid = (f"rank = pp_rank * {par.dp * par.cp * par.tp} + dp_rank * {par.cp * par.tp} + cp_rank * {par.tp} "
                "+ tp_rank (tp innermost, then cp, dp, pp outermost)")
    else:
        grid = f"rank = pp_rank * {par.dp * par.tp} + dp_rank * {par.tp} + tp_rank (tp innermost, pp outermost)"
    lines.append(f"  grid      {grid}")
    for phrase in stage_lines(par.tp, par.pp, par.dp, split, par.virtual_stages, par.schedule, par.cp):
        lines.append(f"            {phrase}")
    n_micro = train.global_batch // (train.micro_batch * par.dp)
    extras = [f"ZeRO-{par.zero}" if par.zero else "no ZeRO"]
    if par.sequence_parallel:
        extras.append("sequence parallel")
    if train.recompute != "none":
        extras.append(f"recompute {train.recompute}")
    schedule = par.schedule + (f" x{par.virtual_stages}" if par.virtual_stages > 1 else "")
    lines.append(f"  schedule  {schedule if par.pp > 1 else 'no pipeline'}, {n_micro} micro-batches of "
                 f"{train.micro_batch} per dp rank; {', '.join(extras)}")
    tokens = train.global_batch * train.seq_len
    evals = (f"; held-out loss every {cfg.eval.interval} steps" if cfg.eval.interval else "; no held-out loss")
    lines.append(f"  steps     {train.steps} x {train.global_batch} sequences x {train.seq_len} tokens = "
                 f"{tokens:,} tokens a step; lr {train.lr:g}, warm-up {train.warmup_steps}{evals}")
    lines += wrap_field("data", data)
    lines.append(f"  run dir   {cfg.run.dir} (metrics.jsonl, config.json; then `parallel3d report {cfg.run.dir}`)")
    return lines


WIDTH = 120  # the banner's lines: a long data source or path wraps under its field


def wrap_field(name: str, text: str) -> list[str]:
    """``  name      text`` wrapped at :data:`WIDTH` columns, continuation lines indented
    under the text (a path longer than a line stays whole)."""
    indent = " " * 12
    return textwrap.wrap(text, WIDTH, initial_indent=f"  {name:10s}", subsequent_indent=indent,
                         break_long_words=False, break_on_hyphens=False)


def outputs(run_dir: Path, checkpoint_dir: Path | None, export_dir: Path | None) -> list[str]:
    """What a finished run left, each as ``name (what)``."""
    found = []
    for name, what in (("metrics.jsonl", "a record per step"), ("config.json", "the resolved job"),
                       ("memory.json", "bytes per rank"), ("trace.json", "timeline, ui.perfetto.dev")):
        if (run_dir / name).is_file():
            found.append(f"{run_dir / name} ({what})")
    if checkpoint_dir is not None and (checkpoint_dir / "latest").is_file():
        latest = (checkpoint_dir / "latest").read_text().strip()
        found.append(f"{checkpoint_dir / latest} (latest checkpoint)")
    if export_dir is not None and (export_dir / "config.json").is_file():
        found.append(f"{export_dir} (Hugging Face folder)")
    return found


def summary(records: list[dict], tokens_per_step: int, wall_s: float, outputs_found: list[str],
            run_dir: Path) -> list[str]:
    """The lines printed after a run, from its ``metrics.jsonl`` records."""
    trained = sum(r["step_time_s"] for r in records)
    steps = [r["step"] for r in records]
    rate = tokens_per_step * len(records) / trained if trained > 0 else 0.0
    median = statistics.median(r["step_time_s"] for r in steady_records(records))  # as the report's
    lines = [f"done: steps {steps[0]}-{steps[-1]} in {duration(wall_s)} ({duration(trained)} in the steps, "
             f"the rest start-up, data and evaluation); {rate:,.0f} tokens/s, median step "
             f"{median * 1e3:.1f} ms"]
    loss = f"loss {records[0]['loss']:.4f} at step {steps[0]} -> {records[-1]['loss']:.4f} at step {steps[-1]}"
    evals = [(r["step"], r["val_loss"]) for r in records if "val_loss" in r]
    if evals:
        best = min(evals, key=lambda e: e[1])
        loss += (f"; held-out loss {evals[-1][1]:.4f} at step {evals[-1][0]} "
                 f"(best {best[1]:.4f} at step {best[0]})")
    else:
        loss += "; no held-out loss (set eval.interval)"
    lines.append(loss)
    lines.append("outputs:")
    lines += [f"  {o}" for o in outputs_found]
    lines.append(f"plot it: parallel3d report {run_dir}")
    return lines
