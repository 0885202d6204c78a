"""kernels/linear.py (through kernels/gemm.py's dispatch) against its pure-torch
reference: forward, dX, dW, db and the fp32 main-grad accumulation, on odd, aligned and
3-D shapes.

Where the Triton kernels run: compiled on a CUDA device when there is one, otherwise on
CPU tensors under the Triton interpreter. triton fixes that choice when a kernel is
defined, i.e. when kernels/linear.py is first imported, and this file does not change
the environment of the pytest process (that would silently switch every later kernel
in the session to the interpreter). So: run it as
``TRITON_INTERPRET=1 python -m pytest tests/test_kernels_linear.py`` and the Triton tests
run in-process; in any other CPU-only session they are skipped here and
`test_triton_tests_in_interpreter_subprocess` runs this file again in a child process
with TRITON_INTERPRET=1, failing if anything fails there.
"""
import json
import os
import subprocess
import sys

import pytest
import torch

from parallel3d.kernels import _matmul_common as common
from parallel3d.kernels import linear as L
from parallel3d.kernels.gemm import linear
from parallel3d.kernels.linear import TileConfig, linear_ref

ON_GPU = torch.cuda.is_available() and not L._INTERPRETED
DEVICE = "cuda" if ON_GPU else "cpu"
TRITON_RUNS_HERE = ON_GPU or L._INTERPRETED
needs_triton = pytest.mark.skipif(
    not TRITON_RUNS_HERE, reason="triton kernels compiled for GPU on a CPU host: the subprocess test runs these")
GPU_ONLY = "needs CUDA with compiled kernels (the interpreter's bf16/fp16 tl.dot is wrong)"
needs_compiled_gpu = pytest.mark.skipif(not ON_GPU, reason=GPU_ONLY)

# Bound on max|ours - reference| / max|reference|, per input dtype. The reference
# (linear_ref, differentiated by autograd) computes in fp32 from the same inputs and
# rounds once at the end.
TOL = {
    # Same fp32 products summed in a different order: worst case ~K * eps, K <= 129 here
    # gives 1.5e-5 (typical is ~sqrt(K) * eps; the interpreter shows ~4e-7).
    torch.float32: 2e-5,
    # Products of bf16 inputs are exact in fp32 and sums are fp32; each side rounds its
    # fp32 result once to 8 significant bits, so where the two fp32 sums (different
    # order) straddle a rounding boundary they land one ulp apart: 2^-7 of the element,
    # at most 2 * 2^-8 of max |reference|. Twice that as margin.
    torch.bfloat16: 4 * 2**-8,
    # As bf16 with 11 significant bits (ulp 2^-10 relative).
    torch.float16: 4 * 2**-11,
}

# (x shape, out_features N): odd 37x53x71, a single row, aligned 64^3, 3-D (B, S, K).
SHAPES = [((37, 71), 53), ((1, 65), 129), ((64, 64), 64), ((3, 11, 71), 53)]


@pytest.fixture(autouse=True)
def exact_fp32_reference():
    """The fp32 reference must not run in TF32 on a GPU, whatever another test set.

    Saved and restored by hand: ``torch.backends.cuda.matmul`` answers attributes through
    ``__getattr__``, which newer pytest's monkeypatch records as absent and then fails to
    delete at teardown."""
    matmul = torch.backends.cuda.matmul
    before = matmul.allow_tf32
    matmul.allow_tf32 = False
    yield
    matmul.allow_tf32 = before


def rel_err(actual, expected):
    return ((actual.float() - expected.float()).abs().max() / expected.float().abs().max().clamp_min(1e-30)).item()


def assert_matches(actual, expected, tol, what):
    assert actual.shape == expected.shape and actual.dtype == expected.dtype, (
        f"{what}: got {actual.dtype} {tuple(actual.shape)}, expected {expected.dtype} {tuple(expected.shape)}")
    err = rel_err(actual, expected)
    assert err <= tol, f"{what}: max error {err:.3g} of max |reference| > tolerance {tol:.3g}"


def make_inputs(x_shape, n, dtype, bias, seed=0):
    gen = torch.Generator().manual_seed(seed)
    k = x_shape[-1]

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(DEVICE, dtype)
    return (rand(*x_shape), rand(n, k, scale=k**-0.5), rand(n) if bias else None, rand(*x_shape[:-1], n))


def run_fwd_bwd(fn, x, w, b, dy, **kwargs):
    """y and (dx, dw, db) of fn(x, w, b) for the upstream gradient dy."""
    x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
    b = None if b is None else b.clone().requires_grad_()
    y = fn(x, w, b, **kwargs)
    y.backward(dy)
    return y.detach(), x.grad, w.grad, None if b is None else b.grad


def check_against_reference(x_shape, n, dtype, bias, backend="triton"):
    x, w, b, dy = make_inputs(x_shape, n, dtype, bias)
    ours = run_fwd_bwd(linear, x, w, b, dy, backend=backend)
    ref = run_fwd_bwd(linear_ref, x, w, b, dy)
    for name, got, want in zip(("y", "dx", "dw", "db"), ours, ref):
        if want is not None:
            assert_matches(got, want, TOL[dtype], f"{name} {dtype} {x_shape}x{n}")
    assert (ours[3] is None) == (b is None)


@needs_triton
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("x_shape,n", SHAPES, ids=lambda v: str(v))
def test_triton_fp32_matches_reference(x_shape, n, bias):
    check_against_reference(x_shape, n, torch.float32, bias)


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_main_grad_accumulates_over_microbatches(backend):
    if backend == "triton" and not TRITON_RUNS_HERE:
        pytest.skip("triton kernels compiled for GPU on a CPU host: the subprocess test runs this")
    n, k = 53, 71
    main_grad = torch.randn(n, k, generator=torch.Generator().manual_seed(1)).to(DEVICE)  # not zero: += not =
    expected_main, expected_db = main_grad.clone(), 0
    w = (torch.randn(n, k) * k**-0.5).to(DEVICE).requires_grad_()
    b = torch.randn(n).to(DEVICE).requires_grad_()
    for micro in range(2):
        x, _, _, dy = make_inputs((2, 19, k), n, torch.float32, bias=False, seed=10 + micro)
        linear(x, w, b, main_grad=main_grad, backend=backend).backward(dy)
        _, _, ref_dw, ref_db = run_fwd_bwd(linear_ref, x, w.detach(), b.detach(), dy)
        expected_main += ref_dw
        expected_db = expected_db + ref_db
    assert w.grad is None, "with main_grad the weight grad goes to main_grad only"
    assert_matches(main_grad, expected_main, TOL[torch.float32], "main_grad after 2 micro-batches")
    assert_matches(b.grad, expected_db, TOL[torch.float32], "bias grad after 2 micro-batches")


@needs_triton
def test_raw_launchers():
    x, w, b, dy = make_inputs((37, 71), 53, torch.float32, bias=True)
    y = L.linear_forward(x, w, b)
    dx = L.linear_grad_input(dy, w)
    dw, db = L.linear_grad_weight(dy, x, bias_grad=True)
    for name, got, want in (("y", y, x @ w.t() + b), ("dx", dx, dy @ w), ("dw", dw, dy.t() @ x),
                            ("db", db, dy.sum(0))):
        assert_matches(got, want, TOL[torch.float32], name)


# Small tiles give a grid of many programs with partial GROUP_M groups and ragged edges.
FORCED = [TileConfig(16, 16, 16, 1, 4, 1), TileConfig(16, 32, 16, 2, 4, 1), TileConfig(32, 16, 64, 3, 4, 2)]


@needs_triton
@pytest.mark.parametrize("config", FORCED, ids=lambda c: f"{c.block_m}x{c.block_n}x{c.block_k}g{c.group_m}")
def test_loaded_tile_configs_are_used_and_correct(config):
    m, n, k = 37, 53, 71
    table = {common.config_key(kind, torch.float32, *mnk): config.as_dict()
             for kind, mnk in (("fwd", (m, n, k)), ("dgrad", (m, k, n)), ("wgrad", (n, k, m)))}
    try:
        L.load_tuned_configs(json.loads(json.dumps(table)))  # as if broadcast from rank 0
        assert L.tuned_configs() == table
        assert common.select_config("wgrad", torch.float32, n, k, m, interpreted=L._INTERPRETED) == config
        check_against_reference((m, k), n, torch.float32, bias=True)
    finally:
        L.clear_tuned_configs()


@needs_triton
def test_64bit_indexing_path(monkeypatch):
    """Tensors past 2**31 elements switch the kernel to int64 offsets; force that branch."""
    monkeypatch.setattr(L, "_max_offset", lambda t: 2**40)
    check_against_reference((37, 71), 53, torch.float32, bias=True)


@needs_triton
def test_comparison_catches_wrong_kernels(monkeypatch):
    """The checks above can fail: a corrupted last element (the masked tile edge), a
    dropped bias or a K loop that misses its last column are all flagged."""
    x, w, b, _ = make_inputs((37, 71), 53, torch.float32, bias=True)
    want = linear_ref(x, w, b)
    good = linear(x, w, b, backend="triton")
    assert rel_err(good, want) <= TOL[torch.float32]
    corrupted = good.clone()
    corrupted[-1, -1] += 1e-3 * want.abs().max()
    assert rel_err(corrupted, want) > TOL[torch.float32]
    assert rel_err(linear(x, w, None, backend="triton"), want) > TOL[torch.float32]
    launch = L._gemm
    monkeypatch.setattr(L, "_gemm", lambda kind, a, b_, c, **kw: launch(kind, a[:, :-1], b_[:-1], c, **kw))
    assert rel_err(linear(x, w, b, backend="triton"), want) > TOL[torch.float32]


def test_auto_backend_on_cpu_is_the_reference(monkeypatch):
    def no_triton(*args, **kwargs):
        raise AssertionError("backend='auto' launched a Triton kernel for CPU tensors")
    monkeypatch.setattr(L, "_gemm", no_triton)
    gen = torch.Generator().manual_seed(3)
    x, w, b, dy = (torch.randn(*s, generator=gen) for s in ((2, 5, 33), (17, 33), (17,), (2, 5, 17)))
    auto = run_fwd_bwd(linear, x, w, b, dy, backend="auto")
    torch_ = run_fwd_bwd(linear, x, w, b, dy, backend="torch")
    ref = run_fwd_bwd(linear_ref, x, w, b, dy)
    for got, same, want in zip(auto, torch_, ref):
        assert torch.equal(got, same)
        assert_matches(got, want, TOL[torch.float32], "auto backend on CPU")


def _raises_one_line(fn):
    with pytest.raises(ValueError) as info:
        fn()
    assert "\n" not in str(info.value)
    return str(info.value)


def test_bad_inputs_raise_value_error():
    x, w, b = torch.randn(4, 8), torch.randn(5, 8), torch.randn(5)
    assert "expects 8" in _raises_one_line(lambda: linear(torch.randn(4, 7), w))
    assert "bfloat16" in _raises_one_line(lambda: linear(x.bfloat16(), w))
    _raises_one_line(lambda: linear(x.double(), w.double()))
    _raises_one_line(lambda: linear(x, w, torch.randn(4)))
    _raises_one_line(lambda: linear(x, w, b.half()))
    _raises_one_line(lambda: linear(x, w, main_grad=torch.zeros(5, 8, dtype=torch.bfloat16)))
    _raises_one_line(lambda: linear(x, w, main_grad=torch.zeros(8, 5)))
    _raises_one_line(lambda: linear(x, w, main_grad=torch.zeros(8, 5).t()))  # not contiguous
    _raises_one_line(lambda: linear(x, w, backend="cuda"))
    _raises_one_line(lambda: L.linear_forward(x, torch.randn(8, 5).t()))  # strided weight
    _raises_one_line(lambda: L.linear_grad_input(torch.randn(4, 6), w))  # dy has 6 columns, W 5 rows
    _raises_one_line(lambda: L.linear_grad_weight(torch.randn(3, 5), x))  # rows differ
    _raises_one_line(lambda: L.load_tuned_configs({"fwd:float32:1x2": FORCED[0].as_dict()}))
    _raises_one_line(lambda: L.load_tuned_configs({"fwd:float32:1x2x3": dict(FORCED[0].as_dict(), block_m=24)}))


def test_heuristic_is_deterministic_and_autotune_skips_cpu():
    for dtype in (torch.float32, torch.bfloat16):
        for mnk in ((1, 129, 65), (4096, 1536, 4096), (16384, 28672, 8192)):
            chosen = common.heuristic_config(dtype, *mnk, interpreted=False)
            assert chosen == common.heuristic_config(dtype, *mnk, interpreted=False)
            assert chosen.as_dict() == TileConfig.from_dict(json.loads(json.dumps(chosen.as_dict()))).as_dict()
    L.clear_tuned_configs()
    chosen = L.autotune_linear(37, 53, 71, torch.float32, "cpu")
    assert set(chosen) == {"fwd", "dgrad", "wgrad"} and L.tuned_configs() == {}


@pytest.mark.gpu
@needs_compiled_gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("x_shape,n", SHAPES + [((2, 128, 1000), 384)], ids=lambda v: str(v))
def test_triton_low_precision_on_gpu(x_shape, n, dtype):
    for bias in (True, False):
        check_against_reference(x_shape, n, dtype, bias)


@pytest.mark.gpu
@needs_compiled_gpu
def test_main_grad_from_bf16_operands_is_not_rounded_to_bf16_on_gpu():
    """The fused wgrad adds its fp32 accumulator: against dW of the same bf16 operands
    computed in fp32 it differs by summation order only (~K eps = 1e-5 at K = 300),
    where a dW rounded to bf16 first would be off by up to 2^-9 = 2e-3 relative."""
    n, k = 384, 512
    w = (torch.randn(n, k) * k**-0.5).to(DEVICE, torch.bfloat16).requires_grad_()
    main_grad = torch.zeros(n, k, device=DEVICE)
    x, _, _, dy = make_inputs((3, 100, k), n, torch.bfloat16, bias=False, seed=7)
    linear(x, w, main_grad=main_grad, backend="triton").backward(dy)
    want = dy.reshape(-1, n).float().t() @ x.reshape(-1, k).float()
    assert w.grad is None
    assert_matches(main_grad, want, 1e-4, "main_grad from bf16 operands")


@pytest.mark.gpu
@needs_compiled_gpu
def test_autotune_on_gpu_records_and_stays_correct():
    L.clear_tuned_configs()
    try:
        L.autotune_linear(256, 384, 512, torch.bfloat16, "cuda", bias=True)
        assert len(L.tuned_configs()) == 3
        check_against_reference((256, 512), 384, torch.bfloat16, bias=True)
    finally:
        L.clear_tuned_configs()


@pytest.mark.skipif(TRITON_RUNS_HERE, reason="the Triton tests already ran in this process")
def test_triton_tests_in_interpreter_subprocess():
    """The child runs every Triton case under the interpreter: the only skips allowed
    there are the GPU-only cases (``-rs`` lists each skip's reason). A child where the
    interpreter did not take (every Triton case skipped as "compiled for GPU") fails here
    instead of passing with nothing tested. The child never runs this test itself: where
    the interpreter did not take, it would start a child of its own, and so on."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    cmd = [sys.executable, "-m", "pytest", __file__, "-q", "-rs", "-p", "no:cacheprovider",
           "-k", "not test_triton_tests_in_interpreter_subprocess"]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"interpreter run failed:\n{done.stdout[-6000:]}\n{done.stderr[-3000:]}"
    skips = [line.split(": ", 1)[1] for line in done.stdout.splitlines() if line.startswith("SKIPPED [")]
    unexpected = [reason for reason in skips if reason != GPU_ONLY]
    assert not unexpected, f"Triton cases skipped under the interpreter: {unexpected}"
    assert " passed" in done.stdout.strip().splitlines()[-1], done.stdout[-3000:]
