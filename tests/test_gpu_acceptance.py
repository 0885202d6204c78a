"""benchmarks/gpu_acceptance.py: its CPU smoke mode runs every section's code (what CI can
check of the GPU command), and a section that fails or runs out of time is reported in
the table while the others still run."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu_acceptance.py"
SECTIONS = ("kernels", "linear", "train", "layout3d")


def _run(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout)


def _status(markdown: str) -> dict[str, str]:
    rows = [ln.split("|") for ln in markdown.splitlines() if ln.startswith("| ") and ln.count("|") == 5]
    return {cells[1].strip(): cells[2].strip() for cells in rows if cells[1].strip() in SECTIONS}


@pytest.mark.slow
def test_smoke_mode_runs_every_section(tmp_path, corpus_dir):
    """~1 min on 2 idle cores (8 gloo ranks of the debug model dominate). The corpus of
    conftest (1 MB, BPE 512) is the one the sections train on, so it is not rebuilt."""
    out = tmp_path / "acceptance.md"
    # The smoke budgets catch a hang, not slowness: tripled here, since 8 ranks of the
    # layout3d section took 151 s of their 150 on a machine at load 23 (60 s when idle).
    done = _run("--smoke", "--budget-scale", "3", "--work-dir", str(tmp_path / "work"),
                "--out", str(out), timeout=1500)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    text = out.read_text()
    assert _status(text) == {name: "ok" for name in SECTIONS}, text
    for heading in ("## kernels", "## linear", "## train", "## layout3d"):
        assert heading in text
    layout = text.split("## layout3d", 1)[1]
    for schedule in ("1f1b", "zb-v"):  # the zero-bubble path too: B and W split, two chunks a rank
        row = [ln for ln in layout.splitlines() if ln.startswith(f"| tp2 pp2 dp2 +SP zero1 {schedule} | 8 | cpu |")]
        assert len(row) == 1 and row[0].rstrip().endswith("| ok |"), layout
    train = text.split("## train", 1)[1].split("## layout3d")[0]
    assert "| parallel3d Trainer |" in train and "| plain PyTorch loop |" in train, train


def test_a_section_out_of_time_is_reported_and_the_next_still_runs(tmp_path):
    out = tmp_path / "acceptance.md"
    done = _run("--smoke", "--sections", "layout3d,linear", "--budget-scale", "0.01",
                "--work-dir", str(tmp_path / "work"), "--out", str(out), timeout=120)
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-2000:]
    assert _status(out.read_text()) == {"layout3d": "TIMEOUT", "linear": "TIMEOUT"}, out.read_text()


def test_failures_become_table_rows_not_exits():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import gpu_acceptance as acc

    assert acc._section_status(1, {"rows": [], "error": "RuntimeError: boom"}, False) == "FAILED: RuntimeError: boom"
    assert acc._section_status(-9, None, False).startswith("CRASHED")
    rows = [{"check": "ok"}, {"check": "FAIL (tolerance 1e-05)"}]
    assert acc._section_status(0, {"rows": rows, "error": None}, False) == "FAILED: 1 of 2 rows"
    assert acc._section_status(0, {"rows": rows[:1], "error": None}, False) == "ok"
    assert acc._section_status(None, None, True) == "TIMEOUT"


def test_unknown_section_and_no_gpu_are_refused():
    assert _run("--sections", "kernels,bogus", timeout=60).returncode == 2
    import torch

    if not torch.cuda.is_available():
        done = _run("--sections", "kernels", timeout=60)
        assert done.returncode == 2 and "needs a CUDA GPU" in done.stderr
