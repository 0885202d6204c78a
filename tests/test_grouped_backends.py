"""``backend="auto"`` for the experts' grouped GEMMs: the measured winner per GPU model,
kind, dtype and expert stack (G, N, K), the same on every rank.

No GPU here: the dispatch rule is checked on a stand-in CUDA tensor, the measurement with
an injected timer and GPU name, and the agreement on gloo ranks."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from parallel3d.kernels import grouped_linear as GL


@pytest.fixture(autouse=True)
def empty_table():
    GL.clear_grouped_backend_choices()
    yield
    GL.clear_grouped_backend_choices()


def _cuda_like(dtype=torch.bfloat16):
    return SimpleNamespace(is_cuda=True, device=torch.device("cuda", 0), dtype=dtype)


def test_auto_runs_the_measured_winner_and_torch_when_unmeasured(monkeypatch):
    monkeypatch.setattr(GL, "gpu_name", lambda device: "FakeGPU")
    a = _cuda_like()
    assert GL.auto_backend("fwd", a, 8, 64, 32) == "grouped_mm", "unmeasured bf16: torch._grouped_mm"
    assert GL.auto_backend("fwd", _cuda_like(torch.float32), 8, 64, 32) == "loop", "_grouped_mm: bf16 only"
    assert GL.auto_backend("fwd", a, 8, 63, 32) == "loop", "_grouped_mm: 16-byte rows only"
    GL.load_grouped_backend_choices({GL.choice_key("FakeGPU", "fwd", torch.bfloat16, 8, 64, 32): "triton"})
    assert GL.auto_backend("fwd", a, 8, 64, 32) == "triton"
    assert GL.auto_backend("dgrad", a, 8, 64, 32) == "grouped_mm", "another kind is unmeasured"
    assert GL.auto_backend("fwd", a, 16, 64, 32) == "grouped_mm", "another stack is unmeasured"
    monkeypatch.setattr(GL, "gpu_name", lambda device: "OtherGPU")
    assert GL.auto_backend("fwd", a, 8, 64, 32) == "grouped_mm", "another GPU model is unmeasured"
    assert GL.auto_backend("fwd", torch.zeros(1, dtype=torch.bfloat16), 8, 64, 32) == "loop", "CPU: the loop"


def check_agreement(fail_on_rank0: bool) -> dict:
    from parallel3d.expert_parallel.grouped_backends import agree_on_grouped_backends

    rank = dist.get_rank()
    GL.clear_grouped_backend_choices()
    if rank == 1:  # a stale local table that disagrees: it must be replaced
        GL.load_grouped_backend_choices({GL.choice_key("FakeGPU", "fwd", torch.bfloat16, 4, 32, 16): "loop"})
    measured = []

    def measure(groups, rows, n, k, dtype, device, device_name):
        if fail_on_rank0:
            raise RuntimeError("triton failed to compile\nsecond line")
        measured.append((groups, n, k))
        calls = []

        def timer(fn):  # Triton, torch side, Triton, ...: on rank 0 Triton wins iff 32 | N
            calls.append(fn)
            triton_wins = rank == 0 and n % 32 == 0
            return 1.0 if (len(calls) % 2 == 1) == triton_wins else 2.0
        return GL.measure_grouped_backends(groups, rows, n, k, dtype, device, timer=timer, device_name=device_name)

    shapes = [(4, 64, 16 * (rank + 1), 16)]  # ranks hold different layers' experts
    agreed = agree_on_grouped_backends(shapes, torch.bfloat16, "cpu", measure=measure, device_name="FakeGPU")
    return {"table": GL.grouped_backend_choices(), "returned": agreed, "measured": len(measured)}


def test_every_rank_adopts_rank_0s_measurements(pools):
    results = pools(2).run(check_agreement, False)
    table = results[0]["table"]
    assert all(r["table"] == table and r["returned"] == table for r in results), results
    assert [r["measured"] for r in results] == [2, 0]  # rank 0 measured the union, rank 1 nothing
    assert table == {f"FakeGPU|{kind}:bfloat16:4x{n}x16": "triton" if n == 32 else "grouped_mm"
                     for kind in GL.KINDS for n in (16, 32)}, table


def test_a_failed_measurement_leaves_the_default_and_hangs_nobody(pools):
    for rank, r in enumerate(pools(2).run(check_agreement, True)):
        assert r["table"] == {} and r["measured"] == 0, (rank, r)  # rank 1's stale entry replaced too
