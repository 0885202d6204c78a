"""benchmarks/_acceptance_moe.py, gpu_acceptance.py's moe section: its --smoke run on CPU
(the Triton kernels under the interpreter) reports every row ok, and its checks fail when
the experts get the wrong rows."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import _acceptance_moe as moe_section  # noqa: E402


def test_smoke_moe_section_is_ok_with_every_row(tmp_path):
    """~20 s on 2 cores: the section in its own process, as gpu_acceptance.py runs it."""
    out = tmp_path / "acceptance.md"
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_acceptance.py"), "--smoke", "--sections",
                           "moe", "--budget-scale", "3", "--work-dir", str(tmp_path / "work"), "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    text = out.read_text()
    assert "| moe | ok |" in text, text
    header, *rows = [[c.strip() for c in line.split("|")[1:-1]]
                     for line in text.split("## moe", 1)[1].splitlines() if line.startswith("| ")]
    rows = [dict(zip(header, cells)) for cells in rows]
    sides = [(r["part"], r["side"]) for r in rows]
    for backend in ("grouped_mm", "triton"):
        assert sides.count(("GEMM correctness", backend)) == 2, sides  # gate/up and down
    assert [s for p, s in sides if p.startswith("experts at ep 2")] == ["loop", "grouped_mm", "triton"], sides
    assert sum(p == "GEMM speed" for p, _ in sides) == 2 and sum(p == "auto picks" for p, _ in sides) == 2
    assert all(r["check"].startswith("ok") for r in rows), rows

def _ep2_rows() -> list[dict]:
    rows = []
    moe_section.ep2_layout(True, rows.append, backends=("loop", "grouped_mm"))
    return rows


def test_ep2_layout_matches_ep1_and_catches_rows_at_the_wrong_expert(monkeypatch):
    """In this process (no Triton: the loop and torch._grouped_mm's CPU fallback), fp32:
    both within 1e-5 of float64 at ep 1. Then a grouped SwiGLU that hands each expert the
    counts of the reversed order (rows run through another expert's weights) fails every
    row, the loop's too: the loop's bar is fixed, so a dispatch error cannot widen it."""
    rows = _ep2_rows()
    assert [r["check"] for r in rows] == ["ok", "ok"], rows
    swiglu = moe_section.grouped_swiglu
    monkeypatch.setattr(moe_section, "grouped_swiglu",
                        lambda x, counts, *w: swiglu(x, counts[::-1], *w) if len(set(counts)) > 1 else swiglu(x, counts, *w))
    rows = _ep2_rows()
    assert all(r["check"].startswith("FAIL") for r in rows), rows


def test_gemm_errors_flag_an_empty_expert_given_a_gradient(monkeypatch):
    """The empty expert's dW must be exactly zero: a wgrad that writes anything there fails."""
    from parallel3d.kernels import grouped_linear as GL

    counts = moe_section._skewed_counts(4, 48)
    assert counts[1] == 0 and sum(counts) == 48
    assert max(moe_section.gemm_errors("loop", counts, 24, 32, torch.float32, "cpu").values()) < 1e-5
    gemm = GL.run_grouped_gemm

    def leaky(kind, a, b, counts_, backend):
        out = gemm(kind, a, b, counts_, backend)
        return out + 1e-3 if kind == "wgrad" else out
    monkeypatch.setattr(GL, "run_grouped_gemm", leaky)
    assert moe_section.gemm_errors("loop", counts, 24, 32, torch.float32, "cpu")["wgrad"] == float("inf")
