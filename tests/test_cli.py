"""The command line: the launcher path, and bad layouts failing fast with one line."""

from __future__ import annotations

import json
import sys

import pytest

from helpers import run_counting_cpu


def _cli(*args, timeout=120):
    """The CLI's result and the CPU seconds it used (see run_counting_cpu)."""
    return run_counting_cpu([sys.executable, "-m", "parallel3d.cli", *args], capture_output=True,
                            text=True, timeout=timeout)


@pytest.mark.parametrize("args,needle", [
    (["--parallel.tp=2", "--parallel.pp=1", "--parallel.dp=2", "--launch.nproc=2"],
     "world size 2 != tp*cp*pp*dp = 2*1*1*2 = 4"),
    (["--parallel.tp=3", "--parallel.pp=1", "--parallel.dp=1", "--launch.nproc=3"],
     "model.n_heads 4 is not divisible by parallel.tp 3"),
    (["--parallel.tp=1", "--parallel.pp=8", "--parallel.dp=1", "--launch.nproc=8"],
     "model.n_layers 4 is fewer than parallel.pp 8"),
    (["--train.global_batch=10", "--train.micro_batch=4"],
     "train.global_batch 10 is not divisible by train.micro_batch 4 * parallel.dp 2 = 8"),
    (["--train.lrr=1"], "did you mean 'train.lr'"),
    # every layout problem in the one line: the world size and the heads tp 3 cannot split
    (["--parallel.tp=3"], "world size 8 != tp*cp*pp*dp = 3*1*2*2 = 12: change parallel.tp/cp/pp/dp "
     "or the number of processes (launch.nproc); model.n_heads 4 is not divisible by parallel.tp 3"),
    (["--parallel.cp=2", "--parallel.dp=1", "--train.seq_len=30"],
     "train.seq_len 30 does not split into 2 x parallel.cp = 4 equal chunks"),
])
def test_bad_input_exits_2_with_one_line(args, needle, tmp_path):
    proc, cpu_s = _cli("train", f"--run.dir={tmp_path}", *args)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout
    # fast: importing torch and checking the job is ~2.5 s of CPU, well under the bound;
    # CPU seconds, not the clock's (27 s by the clock beside two busy loops)
    assert cpu_s < 20, cpu_s


def test_an_override_takes_its_value_after_a_space(tmp_path):
    """``--parallel.tp 2`` as argparse accepts options everywhere else (the value was taken
    for the recipe's path)."""
    proc, _ = _cli("train", "--parallel.tp", "1", "--parallel.dp", "4", "--run.dir", str(tmp_path),
                   "--dry-run")
    assert proc.returncode == 0, proc.stderr
    assert "layout: tp 1 x pp 2 x dp 4;" in proc.stdout, proc.stdout[-2000:]


def test_launches_local_workers_and_logs_every_step(corpus_dir, tmp_path):
    run = tmp_path / "run"
    proc, _ = _cli("train", "--launch.nproc=2", "--parallel.tp=1", "--parallel.pp=1",
                   "--parallel.dp=2", "--train.steps=4",
                   "--train.log_interval=2", "--train.seq_len=32", f"--run.dir={run}",
                   "--data.max_bytes=1000000", "--data.vocab_size=512",
                   f"--data.cache_dir={corpus_dir}", "--eval.interval=0", timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "step     4" in proc.stdout
    records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert json.loads((run / "config.json").read_text())["parallel"]["dp"] == 2


@pytest.mark.parametrize("command", [[], ["train"], ["plan"], ["report"], ["convert"], ["prepare-data"]])
def test_help_is_plain_text(command, capsys):
    from parallel3d.cli import build_parser

    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args([*command, "--help"])
    text = capsys.readouterr().out
    assert exit_.value.code == 0 and text.startswith("usage: parallel3d")
    assert "``" not in text and ":func:" not in text and ":class:" not in text, text  # no reST markup


_NO_TORCH = """
import sys
sys.argv = ["parallel3d", "plan", *sys.argv[1:]]
from parallel3d.cli import main
try:
    main()
finally:
    print("torch imported:", "torch" in sys.modules, file=sys.stderr)
"""


@pytest.mark.parametrize("args", [
    ["--model", "8b", "--gpus", "16", "--gpu", "h100-80g"],
    ["--model", "1b", "--gpus", "8", "--gpu", "h100-80g", "--lora", "--seq-len", "65536"],  # LoRA, cp
    ["--model", "debug-moe", "--gpus", "8", "--gpu", "h100-80g", "--ep", "2"],
], ids=["dense", "lora-cp", "moe"])
def test_plan_imports_no_torch(args):
    """``parallel3d plan`` is arithmetic over a config: it imports no torch (1.2 of its 4 s
    before), whatever the model, LoRA, context or expert parallelism."""
    import subprocess

    proc = subprocess.run([sys.executable, "-c", _NO_TORCH, *args], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "recommended:" in proc.stdout
    assert "torch imported: False" in proc.stderr, proc.stderr


def _exit_with(code: int) -> None:
    """A worker for :func:`parallel3d.launch.launch_local`: exits with ``code``."""
    if code:
        sys.exit(code)


@pytest.mark.parametrize("code", [0, 3])
def test_the_local_launcher_leaves_no_folder_in_tmp(tmp_path, monkeypatch, code):
    """launch_local gives torch's elastic agent a log folder of its own and removes it:
    nothing is left in the temporary directory, whether the workers succeed or fail (the
    failure still reported as a non-zero exit)."""
    import tempfile

    from parallel3d.launch import launch_local

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    status = launch_local(_exit_with, (code,), 2)
    assert (status == 0) == (code == 0), status
    assert list(tmp_path.iterdir()) == []
