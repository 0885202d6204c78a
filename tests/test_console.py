"""The console as a person sees it: ``parallel3d train`` under a pseudo-terminal (banner,
data-build line, progress bar with the held-out loss, nothing glued to the bar, the
summary), the banner and summary from their inputs, and config.json read back as the job."""

from __future__ import annotations

import json
import os
import pty
import re
import select
import subprocess
import sys
import time

from helpers import job_args, tiny_job


def _run_on_a_terminal(args: list[str], timeout: float = 300) -> str:
    """Run ``args`` with stdin, stdout and stderr on a new pseudo-terminal; its output."""
    master, slave = pty.openpty()
    proc = subprocess.Popen(args, stdin=slave, stdout=slave, stderr=slave, close_fds=True)
    os.close(slave)
    chunks, deadline = [], time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 1.0)
            if ready:
                try:
                    data = os.read(master, 65536)
                except OSError:  # EIO: every writer closed the terminal
                    break
                if not data:
                    break
                chunks.append(data)
            elif proc.poll() is not None:
                break
    finally:
        os.close(master)
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=30)
    assert proc.returncode == 0, b"".join(chunks).decode(errors="replace")[-3000:]
    return b"".join(chunks).decode()


def test_train_on_a_terminal_shows_banner_build_line_val_loss_and_summary(tmp_path):
    run = tmp_path / "run"
    # A fresh corpus cache, so the stdlib corpus is built (and says so) during this run.
    job = tiny_job(str(tmp_path / "cache"), str(run),
                   train={"steps": 6, "global_batch": 8, "micro_batch": 2},
                   parallel={"tp": 1, "pp": 1, "dp": 2}, launch={"nproc": 2},
                   data={"max_bytes": 300_000, "val_fraction": 0.2},
                   eval={"interval": 2, "batches": 1}, observability={"progress": "auto"})
    text = _run_on_a_terminal([sys.executable, "-m", "parallel3d.cli", "train", *job_args(job)])
    text = text.replace("\r\n", "\n")  # the terminal's own line ends; a lone \r is the bar's
    lines = text.split("\n")
    # the banner, in order, before anything else
    start = next(i for i, line in enumerate(lines) if line.startswith("parallel3d: Llama, "))
    for key in ("world     2 ranks = tp 1 x pp 1 x dp 2", "grid      rank = ", "schedule  ",
                "steps     6 x 8 sequences x 32 tokens", "data      stdlib corpus", f"run dir   {run}"):
        assert any(line.strip().startswith(key.strip()) for line in lines[start:start + 12]), key
    building = next(i for i, line in enumerate(lines) if line.startswith("building the stdlib corpus"))
    assert building > start and lines[building + 1].startswith("stdlib corpus built in ")
    # the bar: one segment per step, each starting at the line's start, nothing after it
    segments = [s for line in lines for s in line.split("\r") if s.strip()]
    bar = [s for s in segments if re.search(r"step \d+/6 \[", s)]
    fields = (r"step \d+/6 \[[#.]{20}\]  loss [\d.]+(  val_loss [\d.]+ \(step \d+\))?  [\d,]+ tok/s"
              r"(  peak (rss|alloc|mem) [\d.]+ GiB \(max rank\))?(  ETA \w+)? *")
    assert len(bar) >= 6 and all(re.fullmatch(fields, s) for s in bar), bar
    others = [s for s in segments if s not in bar]
    assert all("tok/s" not in s or s.startswith("step ") for s in others), others  # no bar text in a line
    memory = [s for s in segments if "memory rank 0" in s]
    assert len(memory) == 1 and memory[0].startswith("memory rank 0 (MiB)"), memory
    # the held-out loss on the bar is the one metrics.jsonl recorded
    records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    vals = {r["step"]: r["val_loss"] for r in records if "val_loss" in r}
    assert sorted(vals) == [2, 4, 6]
    for step, val in vals.items():
        shown = next(s for s in bar if s.startswith(f"step {step}/6 "))
        assert f"val_loss {val:.4f}" in shown, (shown, val)
    # the summary, after the bar, each on its own line
    done = next(i for i, line in enumerate(lines) if line.startswith("done: steps 1-6 in "))
    best = min(vals.values())
    assert lines[done + 1].startswith(f"loss {records[0]['loss']:.4f} at step 1 -> {records[-1]['loss']:.4f}")
    assert f"held-out loss {vals[6]:.4f} at step 6 (best {best:.4f} at step " in lines[done + 1]
    assert lines[done + 2] == "outputs:" and str(run / "metrics.jsonl") in lines[done + 3]
    assert lines[-2] == f"plot it: parallel3d report {run}" and lines[-1] == ""


def test_config_json_holds_the_resolved_job_and_loads_back_as_the_same_job(tmp_path):
    from parallel3d.config import ModelConfig, config_from_dict, load_config
    from parallel3d.train.dryrun import dry_run
    from parallel3d.train.metrics import MetricsLogger, resolved_config
    from parallel3d.train.setup import job_world_size, resolve_model_config

    from test_recipes_dryrun import RECIPES, user_inputs

    for name in ("debug_cpu", "llama3_8b", "finetune_hf"):  # a preset, a GPU recipe, an HF folder
        recipe = RECIPES[[p.stem for p in RECIPES].index(name)]
        cfg = load_config(recipe, user_inputs(recipe, tmp_path / name))
        run = tmp_path / name / "run"
        MetricsLogger(run, cfg.to_dict()).close()  # what the trainer writes
        saved = json.loads((run / "config.json").read_text())
        loaded = config_from_dict(saved)
        # every field there, the model's shape included, equal to the model the job trains
        assert None not in saved["model"].values(), saved["model"]
        model = resolve_model_config(cfg.model)
        for field in ModelConfig.__dataclass_fields__:
            if field == "moe":  # the table of the model's MoEConfig; these three are dense
                assert saved["model"][field] == {} and model.moe is None, (name, saved["model"][field])
            elif field not in ("family", "preset", "hf_checkpoint"):
                assert saved["model"][field] == getattr(model, field), (name, field)
        assert saved["launch"]["backend"] in ("gloo", "nccl") and saved["train"]["dtype"] in ("fp32", "bf16")
        # read back: the same model, the same resolved job, the same dry run
        assert resolve_model_config(loaded.model) == model
        assert resolved_config(loaded) == loaded == resolved_config(cfg)
        world = job_world_size(cfg)
        a, b = [], []
        dry_run(cfg, world, out=a.append)
        dry_run(loaded, world, out=b.append)
        assert a == b, name


def test_a_print_while_the_bar_is_up_lands_on_its_own_line_and_the_streams_come_back():
    import contextlib
    import io

    from parallel3d.observe.progress import ProgressBar

    out, err = io.StringIO(), io.StringIO()
    rec = {"loss": 5.0, "tokens_per_s": 100.0}
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        bar = ProgressBar(4)  # draws on stdout and holds stdout and stderr
        bar.update({"step": 1, **rec})
        print("memory line")
        print("a warning", file=sys.stderr)
        bar.update({"step": 2, "val_loss": 4.5, **rec})
        print("partial", end="")
        bar.update({"step": 3, **rec})
        bar.close()
        assert sys.stdout is out and sys.stderr is err  # given back
    visible = out.getvalue().split("\n")
    # each bar draw starts at the line's start; the memory line follows a blanked bar
    assert visible[0].startswith("\rstep 1/4 [") and visible[0].endswith("\rmemory line")
    assert visible[0].split("\r")[2].strip() == ""  # the bar's text was overwritten by spaces
    assert visible[1].startswith("\r") and "partial" in visible[1]
    assert visible[2].startswith("\rstep 3/4 [") and "val_loss 4.5000" in visible[2]  # the last value stays
    assert err.getvalue() == "a warning\n"
