"""``linear_backend = "auto"``: Triton only where measured at least as fast as cuBLAS.

There is no GPU here, so the measurement runs with an injected timer and GPU name; what
is checked is the mechanism: the choice rule, the table's key (GPU model, GEMM kind,
dtype, M, N, K), that nothing unmeasured (and nothing on CPU) runs Triton, and that every
rank adopts rank 0's measurements, whatever it measured or held before.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from parallel3d.kernels import _matmul_common as tables
from parallel3d.kernels import gemm
from parallel3d.kernels import linear as L


@pytest.fixture(autouse=True)
def empty_tables():
    tables.clear_backend_choices()
    yield
    tables.clear_backend_choices()
    tables.clear_tuned_configs()


def _cuda_like(dtype=torch.bfloat16):
    """Stands in for a CUDA tensor in the dispatch rule (there is no GPU here)."""
    return SimpleNamespace(is_cuda=True, device=torch.device("cuda", 0), dtype=dtype)


def test_auto_runs_triton_only_for_a_measured_win(monkeypatch):
    monkeypatch.setattr(gemm, "gpu_name", lambda device: "FakeGPU")
    monkeypatch.setattr(L, "triton", object())  # "installed", whatever this host has
    a = _cuda_like()
    assert not gemm._runs_triton("fwd", "auto", a, 64, 32, 16), "no table: torch"
    tables.record_backend_choice("FakeGPU", "fwd", torch.bfloat16, 64, 32, 16, triton_s=1.0, torch_s=1.0)
    tables.record_backend_choice("FakeGPU", "dgrad", torch.bfloat16, 64, 16, 32, triton_s=2.0, torch_s=1.0)
    assert gemm._runs_triton("fwd", "auto", a, 64, 32, 16), "a tie goes to Triton (at least as fast)"
    assert not gemm._runs_triton("dgrad", "auto", a, 64, 16, 32), "Triton measured slower"
    assert not gemm._runs_triton("fwd", "auto", a, 64, 32, 17), "another shape is unmeasured"
    assert not gemm._runs_triton("fwd", "auto", _cuda_like(torch.float16), 64, 32, 16), "another dtype"
    assert not gemm._runs_triton("wgrad", "auto", a, 64, 32, 16), "another kind"
    monkeypatch.setattr(gemm, "gpu_name", lambda device: "OtherGPU")
    assert not gemm._runs_triton("fwd", "auto", a, 64, 32, 16), "another GPU model"
    assert not gemm._runs_triton("fwd", "torch", a, 64, 32, 16)


def test_auto_on_cpu_is_torch_whatever_the_table_says(monkeypatch):
    tables.load_backend_choices({tables.choice_key(name, kind, torch.float32, 6, 5, 4): "triton"
                                 for name in ("cpu", "FakeGPU") for kind in ("fwd", "dgrad", "wgrad")})

    def no_triton(*args, **kwargs):
        raise AssertionError("auto launched a Triton kernel for CPU tensors")
    monkeypatch.setattr(L, "_gemm", no_triton)
    x, w = torch.randn(6, 4, requires_grad=True), torch.randn(5, 4, requires_grad=True)
    gemm.linear(x, w, backend="auto").sum().backward()
    assert x.grad is not None and w.grad is not None


def test_measurement_records_the_faster_backend_per_gemm():
    timings = {("fwd", True): 1.0, ("fwd", False): 2.0, ("dgrad", True): 3.0, ("dgrad", False): 2.0,
               ("wgrad", True): 1.0, ("wgrad", False): 1.0}
    calls = []

    def timer(fn):  # the order measure_linear_backends times them in: Triton, then torch, per kind
        kind = ("fwd", "dgrad", "wgrad")[len(calls) // 2]
        calls.append(fn)
        return timings[kind, len(calls) % 2 == 1]

    got = gemm.measure_linear_backends(64, 32, 16, torch.float32, "cpu", timer=timer, device_name="FakeGPU")
    assert {k: v[2] for k, v in got.items()} == {"fwd": "triton", "dgrad": "torch", "wgrad": "triton"}
    assert tables.backend_choices() == {  # keyed by the GEMM as launched: (M, N, K) of that product
        "FakeGPU|fwd:float32:64x32x16": "triton", "FakeGPU|dgrad:float32:64x16x32": "torch",
        "FakeGPU|wgrad:float32:32x16x64": "triton"}
    with pytest.raises(ValueError, match="needs a CUDA device"):
        gemm.measure_linear_backends(64, 32, 16, torch.float32, "cpu")  # no timer: no CPU timings


def test_bad_tables_are_refused_whole():
    tables.record_backend_choice("G", "fwd", torch.float32, 1, 2, 3, 1.0, 2.0)
    before = tables.backend_choices()
    for bad in ({"G|fwd:float32:1x2x3": "cuda"}, {"fwd:float32:1x2x3": "torch"},
                {"G|fwd:float64:1x2x3": "torch"}, {"G|fwd:float32:1x2": "torch"}):
        with pytest.raises(ValueError):
            tables.load_backend_choices(bad)
    assert tables.backend_choices() == before
    with pytest.raises(ValueError):
        tables.record_backend_choice("G", "fwd", torch.float32, 1, 2, 3, 0.0, 2.0)


# -- every rank picks the same ------------------------------------------------------------

def check_agreement(fail_on_rank0: bool) -> dict:
    from parallel3d.tensor_parallel.gemm_backends import agree_on_gemm_backends

    rank = dist.get_rank()
    tables.clear_backend_choices()
    if rank == 1:  # a stale local table that disagrees: it must be replaced
        tables.record_backend_choice("FakeGPU", "fwd", torch.bfloat16, 64, 32, 16, triton_s=1.0, torch_s=9.0)
    measured = []

    def measure(m, n, k, dtype, device, device_name):
        if fail_on_rank0:
            raise RuntimeError("triton failed to compile\nsecond line")
        measured.append((m, n, k))
        calls = []

        def timer(fn):  # called Triton, torch, Triton, torch, ...; on rank 0 Triton wins iff 64 | N
            calls.append(fn)
            triton_wins = rank == 0 and n % 64 == 0
            is_triton = len(calls) % 2 == 1
            return 1.0 if is_triton == triton_wins else 2.0
        return gemm.measure_linear_backends(m, n, k, dtype, device, timer=timer, device_name=device_name)

    shapes = [(64, 32 * (rank + 1), 16)]  # pipeline stages hold different layers
    agreed = agree_on_gemm_backends(shapes, torch.bfloat16, "cpu", measure=measure, device_name="FakeGPU")
    return {"table": tables.backend_choices(), "returned": agreed, "measured": len(measured)}


def test_every_rank_adopts_rank_0s_measurements(pools):
    results = pools(4).run(check_agreement, False)
    table = results[0]["table"]
    assert all(r["table"] == table and r["returned"] == table for r in results), results
    assert [r["measured"] > 0 for r in results] == [True, False, False, False]  # rank 0 only
    # the union of every rank's shapes, three GEMMs each; rank 0's rule: Triton iff N % 64 == 0
    fwd = {k: v for k, v in table.items() if "|fwd:" in k}
    assert fwd == {f"FakeGPU|fwd:bfloat16:64x{n}x16": "triton" if n % 64 == 0 else "torch"
                   for n in (32, 64, 96, 128)}, fwd
    assert len(table) == 12


def test_a_failed_measurement_leaves_torch_and_hangs_nobody(pools):
    for rank, r in enumerate(pools(4).run(check_agreement, True)):
        assert r["table"] == {} and r["measured"] == 0, (rank, r)  # rank 1's stale entry replaced too


def test_shapes_of_a_tensor_parallel_model_and_cpu_is_a_no_op():
    from parallel3d.config import ParallelConfig, TrainConfig
    from parallel3d.models.llama import Llama, LlamaConfig
    from parallel3d.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from parallel3d.tensor_parallel.gemm_backends import linear_gemm_shapes, prepare_linear_backends

    cfg = LlamaConfig(vocab_size=64, dim=32, n_layers=1, n_heads=4, n_kv_heads=2, ffn_dim=48)
    model = Llama(cfg)
    layer = model.layers["0"]
    layer.self_attn.q_proj = ColumnParallelLinear.from_dense(layer.self_attn.q_proj, None)
    layer.mlp.down_proj = RowParallelLinear.from_dense(layer.mlp.down_proj, None)
    layer.mlp.up_proj = ColumnParallelLinear.from_dense(layer.mlp.up_proj, None, backend="torch")  # forced: not measured
    assert linear_gemm_shapes(model, 256) == [(256, 32, 32), (256, 32, 48)]
    assert prepare_linear_backends(model, ParallelConfig(tp=2), TrainConfig(), 2, torch.device("cpu")) is None
    assert tables.backend_choices() == {}


def test_the_wgrad_is_timed_as_training_runs_it_and_before_the_optimizer_allocates(monkeypatch, tmp_path,
                                                                                    corpus_dir):
    """On CUDA rank 0 times the wgrad into an fp32 main_grad where training adds into one
    (bf16 weights at ZeRO 0 / 1), plain where it does not (ZeRO 2, fp32); and the trainer
    asks for the measurement while its model is still on the meta device, before the
    optimizer's buffers exist: the timing's temporaries never stack on the model state."""
    from helpers import tiny_job
    from parallel3d.config import ParallelConfig, TrainConfig, config_from_dict
    from parallel3d.tensor_parallel import gemm_backends
    from parallel3d.topology import Topology
    from parallel3d.train import trainer as trainer_module

    cuda = torch.device("cuda", 0)  # only its type is read: nothing is allocated on it
    seen = []
    monkeypatch.setattr(gemm_backends, "agree_on_gemm_backends",
                        lambda shapes, dtype, device, group, measure: seen.append((dtype, measure.keywords)))
    model = torch.nn.Sequential(gemm_backends.ColumnParallelLinear.from_dense(torch.nn.Linear(8, 16), None))
    for zero, dtype, fused in ((1, "bf16", True), (0, "auto", True), (2, "bf16", False), (1, "fp32", False)):
        seen.clear()
        gemm_backends.prepare_linear_backends(model, ParallelConfig(tp=2, zero=zero), TrainConfig(dtype=dtype), 2, cuda)
        assert seen == [(torch.float32 if dtype == "fp32" else torch.bfloat16, {"fuse_main_grad": fused})]

    states = []

    def spy(model, parallel_cfg, train_cfg, tp, device, group=None):
        states.append(({p.device.type for p in model.parameters()}, hasattr(trainer, "optimizer")))

    monkeypatch.setattr(trainer_module, "prepare_linear_backends", spy)
    cfg = config_from_dict(tiny_job(corpus_dir, str(tmp_path)))
    trainer = trainer_module.Trainer.__new__(trainer_module.Trainer)
    trainer.__init__(cfg, Topology.single(), log=False)
    assert states == [({"meta"}, False)]
