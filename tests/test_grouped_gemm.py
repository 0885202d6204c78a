"""kernels/grouped_gemm.py and kernels/grouped_linear.py: the experts' grouped GEMMs
(forward, dX, dW) against the pure-torch reference and the per-expert F.linear loop, with
uneven groups, empty groups (first, middle, last) and masked tails in every dimension.

Where the Triton kernels run: compiled on a CUDA device, otherwise on CPU tensors under the
Triton interpreter, which triton fixes when the kernel module is first imported. As in
tests/test_kernels_linear.py, run ``TRITON_INTERPRET=1 python -m pytest tests/test_grouped_gemm.py``
and the Triton cases run in-process; in any other CPU-only session they are skipped here
and `test_triton_tests_in_interpreter_subprocess` runs this file again in a child with
TRITON_INTERPRET=1, failing if anything fails there. The offline sm_90 compile runs in the
parent (it needs the compiled, not the interpreted, kernel objects).
"""
import json
import os
import re
import subprocess
import sys
import tempfile

import pytest
import torch
import torch.nn.functional as F

from parallel3d.kernels import _matmul_common as common
from parallel3d.kernels import grouped_gemm as G
from parallel3d.kernels import grouped_linear as GL
from parallel3d.kernels.grouped_linear import grouped_linear, grouped_mm

ON_GPU = torch.cuda.is_available() and not G._INTERPRETED
DEVICE = "cuda" if ON_GPU else "cpu"
TRITON_RUNS_HERE = ON_GPU or G._INTERPRETED
needs_triton = pytest.mark.skipif(
    not TRITON_RUNS_HERE, reason="triton kernels compiled for GPU on a CPU host: the subprocess test runs these")
GPU_ONLY = "needs CUDA with compiled kernels (the interpreter's bf16/fp16 tl.dot is wrong)"
needs_compiled_gpu = pytest.mark.skipif(not ON_GPU, reason=GPU_ONLY)

# Bound on max|ours - reference| / max|reference| per input dtype; the reference computes
# in fp32 from the same inputs and rounds once, as in tests/test_kernels_linear.py:
TOL = {
    # fp32 products summed in another order: worst case ~K eps, K <= 71 rows or features
    # here gives 8.5e-6 (the interpreter shows ~3e-7).
    torch.float32: 1e-5,
    # each side rounds its fp32 sum once to 8 significant bits; sums that straddle a
    # rounding boundary land one ulp (2^-7 of the element) apart, at most 2 * 2^-8 of
    # max |reference|; twice that as margin.
    torch.bfloat16: 4 * 2**-8,
    torch.float16: 4 * 2**-11,  # the same with 11 significant bits
}

# (counts, N out, K in): odd sizes so every tile has a masked tail in rows, N and K; empty
# groups first, in the middle and last; a group of one row; a group larger than two tiles.
CASES = [([5, 0, 37, 1, 20], 53, 71), ([0, 19, 0, 0, 70, 3, 0], 33, 40), ([64], 64, 64), ([2, 3, 0], 17, 129)]


def rel_err(actual, expected):
    return ((actual.float() - expected.float()).abs().max() / expected.float().abs().max().clamp_min(1e-30)).item()


def assert_matches(actual, expected, tol, what):
    assert actual.shape == expected.shape and actual.dtype == expected.dtype, (
        f"{what}: got {actual.dtype} {tuple(actual.shape)}, expected {expected.dtype} {tuple(expected.shape)}")
    err = rel_err(actual, expected)
    assert err <= tol, f"{what}: max error {err:.3g} of max |reference| > tolerance {tol:.3g}"


def make_inputs(counts, n, k, dtype, seed=0, device=DEVICE):
    """x (R, K), w (G, N, K) scaled by K**-0.5, dy (R, N)."""
    gen = torch.Generator().manual_seed(seed)
    rows = sum(counts)
    x = torch.randn(rows, k, generator=gen)
    w = torch.randn(len(counts), n, k, generator=gen) * k**-0.5
    dy = torch.randn(rows, n, generator=gen)
    return x.to(device, dtype), w.to(device, dtype), dy.to(device, dtype)


def reference(x, w, dy, counts):
    """y, dx, dw of grouped_mm_ref by autograd (dw through the per-group slices)."""
    x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = G.grouped_mm_ref(x, w, counts)
    y.backward(dy)
    return y.detach(), x.grad, w.grad


def per_expert_loop(x, weights, dy, counts):
    """What models/moe/experts.py ran: F.linear per expert on its rows; y, dx, [dW_e]."""
    x, weights = x.clone().requires_grad_(), [w.clone().requires_grad_() for w in weights]
    y = torch.cat([F.linear(rows, w) for rows, w in zip(x.split(counts), weights)])
    y.backward(dy)
    return y.detach(), x.grad, [w.grad for w in weights]


def run_grouped_linear(x, weights, dy, counts, backend):
    x, weights = x.clone().requires_grad_(), [w.clone().requires_grad_() for w in weights]
    y = grouped_linear(x, counts, weights, backend=backend)
    y.backward(dy)
    return y.detach(), x.grad, [w.grad for w in weights]


# -------------------------------------------------------- Triton: interpreter parity
@needs_triton
@pytest.mark.parametrize("counts,n,k", CASES, ids=lambda v: str(v))
def test_triton_fp32_launchers_match_reference(counts, n, k):
    x, w, dy = make_inputs(counts, n, k, torch.float32)
    y, dx, dw = reference(x, w, dy, counts)
    assert_matches(G.grouped_forward(x, w, counts), y, TOL[torch.float32], "y")
    assert_matches(G.grouped_grad_input(dy, w, counts), dx, TOL[torch.float32], "dx")
    got_dw = G.grouped_grad_weight(dy, x, counts)
    assert_matches(got_dw, dw, TOL[torch.float32], "dw")
    for g, c in enumerate(counts):
        if c == 0:  # an empty group's dW is stored as exact zeros, not left uninitialised
            assert torch.count_nonzero(got_dw[g]) == 0


# Small tiles: many programs, partial GROUP_M groups, several tiles per group, ragged edges.
FORCED = [common.TileConfig(16, 16, 16, 1, 4, 1), common.TileConfig(16, 32, 16, 3, 4, 1),
          common.TileConfig(32, 16, 64, 2, 4, 2)]


@needs_triton
@pytest.mark.parametrize("config", FORCED, ids=lambda c: f"{c.block_m}x{c.block_n}x{c.block_k}g{c.group_m}")
def test_triton_forced_tiles(config):
    counts, n, k = CASES[0]
    x, w, dy = make_inputs(counts, n, k, torch.float32, seed=1)
    y, dx, dw = reference(x, w, dy, counts)
    assert_matches(G.grouped_forward(x, w, counts, config=config), y, TOL[torch.float32], "y")
    assert_matches(G.grouped_grad_input(dy, w, counts, config=config), dx, TOL[torch.float32], "dx")
    assert_matches(G.grouped_grad_weight(dy, x, counts, config=config), dw, TOL[torch.float32], "dw")


@needs_triton
def test_triton_64bit_indexing_path(monkeypatch):
    """Tensors past 2**31 elements switch the kernels to int64 offsets; force that branch."""
    monkeypatch.setattr(G, "_needs_int64", lambda *tensors: True)
    test_triton_fp32_launchers_match_reference(*CASES[0])


@needs_triton
def test_triton_grouped_linear_matches_per_expert_loop():
    """Autograd through grouped_linear (stack, custom ops, the Function's backward) against
    the per-expert F.linear loop: y, dx and every expert's own weight gradient."""
    counts, n, k = CASES[1]
    x, w, dy = make_inputs(counts, n, k, torch.float32, seed=2)
    weights = list(w.unbind())
    ours = run_grouped_linear(x, weights, dy, counts, "triton")
    ref = per_expert_loop(x, weights, dy, counts)
    assert_matches(ours[0], ref[0], TOL[torch.float32], "y")
    assert_matches(ours[1], ref[1], TOL[torch.float32], "dx")
    for e, (got, want) in enumerate(zip(ours[2], ref[2])):
        assert_matches(got, want, TOL[torch.float32] if counts[e] else 0.0, f"dW of expert {e}")


@needs_triton
def test_custom_ops_opcheck_and_registered_autograd():
    counts, n, k = [3, 0, 5], 16, 24
    x, w, dy = make_inputs(counts, n, k, torch.float32, seed=3)
    ops = torch.ops.parallel3d
    for op, args in ((ops.grouped_mm_fwd, (x, w, counts)), (ops.grouped_mm_dgrad, (dy, w, counts)),
                     (ops.grouped_mm_wgrad, (dy, x, counts))):
        torch.library.opcheck(op, args, test_utils=("test_schema", "test_faketensor"))
    xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
    ops.grouped_mm_fwd(xg, wg, counts).backward(dy)
    _, dx, dw = reference(x, w, dy, counts)
    assert_matches(xg.grad, dx, TOL[torch.float32], "dx via the op's autograd")
    assert_matches(wg.grad, dw, TOL[torch.float32], "dw via the op's autograd")


@needs_triton
def test_comparison_catches_wrong_kernels(monkeypatch):
    """The parity checks can fail: a tile table that loses each group's last tile, a wgrad
    that skips a group's last rows, and a kernel reading the wrong expert are flagged (as
    assert_matches would: by ``<=``, so rows never written, NaN, fail too)."""
    counts, n, k = [5, 0, 37, 1, 20], 53, 71
    x, w, dy = make_inputs(counts, n, k, torch.float32)
    y, _, dw = reference(x, w, dy, counts)
    cfg = common.TileConfig(16, 16, 16, 1, 4, 1)
    assert rel_err(G.grouped_forward(x, w, counts, config=cfg), y) <= TOL[torch.float32]
    tiles = G._row_tiles

    def last_tile_lost(counts_, block_m):  # the table without its final entry
        table, n_tiles = tiles(counts_, block_m)
        m = n_tiles - 1
        return torch.cat([table[:m], table[n_tiles:n_tiles + m], table[2 * n_tiles:2 * n_tiles + m]]), m
    monkeypatch.setattr(G, "_row_tiles", last_tile_lost)
    assert not rel_err(G.grouped_forward(x, w, counts, config=cfg), y) <= TOL[torch.float32]  # NaN (unwritten rows) too
    monkeypatch.setattr(G, "_row_tiles", tiles)
    assert not rel_err(G.grouped_forward(x, w.flip(0).contiguous(), counts), y) <= TOL[torch.float32]
    offsets = G.row_offsets  # every group but the first loses its last row
    monkeypatch.setattr(G, "row_offsets", lambda c, d, first=True: (offsets(c, d, first=first) - 1).clamp_min(0))
    assert not rel_err(G.grouped_grad_weight(dy, x, counts), dw) <= TOL[torch.float32]


# ---------------------------------------------------------------- CPU reference paths
def test_auto_on_cpu_is_the_per_expert_loop_and_launches_no_triton(monkeypatch):
    def no_triton(*args, **kwargs):
        raise AssertionError("backend='auto' launched a Triton kernel for CPU tensors")
    monkeypatch.setattr(G, "_launch_rows", no_triton)
    monkeypatch.setattr(G, "_wgrad_kernel", None)
    counts, n, k = CASES[0]
    x, w, dy = make_inputs(counts, n, k, torch.float32, device="cpu")
    weights = list(w.unbind())
    ours, ref = run_grouped_linear(x, weights, dy, counts, "auto"), per_expert_loop(x, weights, dy, counts)
    assert torch.equal(ours[0], ref[0]) and torch.equal(ours[1], ref[1])
    assert all(torch.equal(a, b) for a, b in zip(ours[2], ref[2]))
    assert GL.pick_grouped_backend([(len(counts), sum(counts), n, k)], "cpu") == {
        (len(counts), sum(counts), n, k): {kind: "loop" for kind in GL.KINDS}}


@pytest.mark.parametrize("backend", ["grouped_mm", "loop"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_torch_backends_on_cpu_match_reference(backend, dtype):
    """torch._grouped_mm's CPU fallback and the loop, through grouped_mm's Function (the
    stacked path: fwd, dgrad and wgrad as separate GEMMs), against the fp32 reference
    rounded once: bf16 within the derived TOL (each output is one GEMM rounded once)."""
    counts, n, k = [5, 0, 37, 1, 20], 56, 72  # _grouped_mm wants 16-byte row strides
    x, w, dy = make_inputs(counts, n, k, dtype, seed=4, device="cpu")
    xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = grouped_mm(xg, wg, counts, backend=backend)
    y.backward(dy)
    ref = reference(x, w, dy, counts)
    for name, got, want in zip(("y", "dx", "dw"), (y, xg.grad, wg.grad), ref):
        assert_matches(got, want, TOL[dtype], f"{backend} {name} {dtype}")
    assert torch.count_nonzero(wg.grad[1]) == 0


def test_bf16_grouped_linear_on_cpu_within_derived_tolerance():
    counts, n, k = CASES[1]
    x, w, dy = make_inputs(counts, n, k, torch.bfloat16, seed=5, device="cpu")
    ours = run_grouped_linear(x, list(w.unbind()), dy, counts, "auto")
    y, dx, dw = reference(x, w, dy, counts)
    assert_matches(ours[0], y, TOL[torch.bfloat16], "y bf16")
    assert_matches(ours[1], dx, TOL[torch.bfloat16], "dx bf16")
    assert_matches(torch.stack(ours[2]), dw, TOL[torch.bfloat16], "dW bf16")


@pytest.mark.parametrize("backend", ["grouped_mm", "loop"])
def test_autocast_casts_like_f_linear(backend):
    """Under bf16 autocast the stacked path computes in bf16 from fp32 weights, as the
    per-expert F.linear loop does there, and hands fp32 gradients to the fp32 weights."""
    counts, n, k = [5, 0, 37, 1, 20], 56, 72
    x, w, dy = make_inputs(counts, n, k, torch.float32, seed=6, device="cpu")
    weights = list(w.unbind())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ours = run_grouped_linear(x, weights, dy.bfloat16(), counts, backend)
        ref = per_expert_loop(x, weights, dy.bfloat16(), counts)
    assert ours[0].dtype == torch.bfloat16 and ours[1].dtype == torch.float32
    assert_matches(ours[0], ref[0], TOL[torch.bfloat16], "y under autocast")
    assert_matches(ours[1], ref[1], TOL[torch.bfloat16], "dx under autocast")
    for got, want in zip(ours[2], ref[2]):
        assert got.dtype == torch.float32
        assert_matches(got, want, TOL[torch.bfloat16], "dW under autocast")


def _raises_one_line(fn):
    with pytest.raises(ValueError) as info:
        fn()
    assert "\n" not in str(info.value)
    return str(info.value)


def test_bad_inputs_raise_value_error():
    x, w = torch.randn(6, 8), [torch.randn(5, 8), torch.randn(5, 8)]
    assert "summing to the 6 rows" in _raises_one_line(lambda: grouped_linear(x, [2, 3], w))
    _raises_one_line(lambda: grouped_linear(x, [7, -1], w))
    _raises_one_line(lambda: grouped_linear(x, [6], w))
    _raises_one_line(lambda: grouped_linear(x, [3, 3], []))
    _raises_one_line(lambda: grouped_linear(x, [3, 3], [w[0], torch.randn(4, 8)]))
    _raises_one_line(lambda: grouped_linear(torch.randn(6, 7), [3, 3], w))
    _raises_one_line(lambda: grouped_linear(x, [3, 3], w, backend="cuda"))
    _raises_one_line(lambda: grouped_mm(x.double(), torch.stack(w).double(), [3, 3]))
    _raises_one_line(lambda: grouped_mm(x.bfloat16(), torch.stack(w), [3, 3]))
    _raises_one_line(lambda: grouped_mm(x, torch.stack(w), [3, 3], backend="grouped_mm"))  # 5 x 8 fp32: not 16 B
    _raises_one_line(lambda: grouped_mm(x, torch.randn(2, 8, 5).transpose(1, 2), [3, 3]))
    if not TRITON_RUNS_HERE:
        assert "TRITON_INTERPRET" in _raises_one_line(lambda: grouped_mm(x, torch.stack(w), [3, 3], backend="triton"))
    _raises_one_line(lambda: GL.load_grouped_backend_choices({"H200|fwd:bfloat16:8x16": "triton"}))
    _raises_one_line(lambda: GL.load_grouped_backend_choices({"H200|fwd:bfloat16:8x16x32": "cublas"}))


def test_chooser_records_the_faster_backend_per_kind_and_ships_the_table():
    """An injected timer (triton's time, then the torch side's, per kind): Triton wins only
    where at least as fast; the table survives JSON and drives the choice afterwards."""
    times = iter([1.0, 2.0, 3.0, 2.0, 2.0, 2.0])  # fwd: triton faster; dgrad: slower; wgrad: tie
    GL.clear_grouped_backend_choices()
    try:
        shape = (4, 64, 32, 48)
        picked = GL.pick_grouped_backend([shape], "cpu", timer=lambda fn: next(times), device_name="Test GPU")
        assert picked == {shape: {"fwd": "triton", "dgrad": "grouped_mm", "wgrad": "triton"}}
        # measured once per (G, N, K): a second pick times nothing (the iterator is empty)
        again = GL.pick_grouped_backend([(4, 999, 32, 48)], "cpu", timer=lambda fn: next(times), device_name="Test GPU")
        assert again[(4, 999, 32, 48)] == picked[shape]
        table = json.loads(json.dumps(GL.grouped_backend_choices()))
        GL.clear_grouped_backend_choices()
        GL.load_grouped_backend_choices(table)
        assert GL._CHOICES[GL.choice_key("Test GPU", "dgrad", torch.bfloat16, 4, 32, 48)] == "grouped_mm"
        assert GL._torch_side(torch.float32, 32, 48) == "loop"  # torch._grouped_mm takes bf16 only on CUDA
        assert GL._torch_side(torch.bfloat16, 33, 48) == "loop"  # nor rows of 66 bytes
    finally:
        GL.clear_grouped_backend_choices()


# ------------------------------------------------------------------- offline sm_90
def _compile_sm90(fn, dtype: str, cfg, unit_strides, extra_const):
    """triton.compile for sm_90a without a GPU (bench_linear.py --compile-sm90's recipe) and
    the bundled ptxas: (shared KiB, uses wgmma, spill bytes)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import get_ptxas
    from triton.compiler import ASTSource

    const = dict(FP32_IEEE=dtype == "fp32", INT64=False, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
                 BLOCK_K=cfg.block_k, **extra_const)
    const.update({name: 1 for name in unit_strides})  # triton specialises unit strides at runtime
    sig = {name: "constexpr" if name in const else "*i32" if name in ("tiles_ptr", "offs_ptr")
           else f"*{dtype}" if name.endswith("_ptr") else "i32" for name in fn.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(fn.arg_names) if sig[name] != "constexpr"}
    kernel = triton.compile(ASTSource(fn, sig, const, attrs), target=GPUTarget("cuda", 90, 32),
                            options=dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages))
    with tempfile.TemporaryDirectory() as tmp:
        with open(f"{tmp}/k.ptx", "w") as f:
            f.write(kernel.asm["ptx"])
        log = subprocess.run([get_ptxas(90).path, "--gpu-name", "sm_90a", "-v", f"{tmp}/k.ptx", "-o", f"{tmp}/k.cubin"],
                             capture_output=True, text=True, check=True).stderr
    spills = re.search(r"(\d+) bytes spill stores", log)
    return kernel.metadata.shared / 1024, "warp_group_dot" in kernel.asm["ttgir"], int(spills.group(1)) if spills else -1


@pytest.mark.skipif(G.triton is None or G._INTERPRETED, reason="needs triton's compiled (not interpreted) kernels")
def test_every_kernel_compiles_offline_for_sm90():
    """fwd, dgrad (the rows kernel with each operand layout) and wgrad, with the heuristic
    tiles of an MoE shape (8 experts x 512 rows, 1536 x 4096): in bf16 each compiles to
    wgmma within the 227 KiB of shared memory and spills nothing; fp32 (CUDA cores) too."""
    rows = dict(GROUP_M=8)
    variants = [  # (name, kernel, dtype, (M, N, K) for the heuristic, unit strides, extra constexprs)
        ("fwd", G._rows_kernel, "bf16", (512, 1536, 4096), ("stride_ak", "stride_bk", "stride_cn"), rows),
        ("dgrad", G._rows_kernel, "bf16", (512, 4096, 1536), ("stride_ak", "stride_bn", "stride_cn"), rows),
        ("wgrad", G._wgrad_kernel, "bf16", (1536, 4096, 512), ("stride_am", "stride_bn", "stride_cn"), {}),
        ("fwd", G._rows_kernel, "fp32", (512, 1536, 4096), ("stride_ak", "stride_bk", "stride_cn"), rows),
        ("wgrad", G._wgrad_kernel, "fp32", (1536, 4096, 512), ("stride_am", "stride_bn", "stride_cn"), {}),
    ]
    for name, fn, dtype, mnk, unit, extra in variants:
        torch_dtype = torch.bfloat16 if dtype == "bf16" else torch.float32
        cfg = common.heuristic_config(torch_dtype, *mnk, interpreted=False)
        smem, wgmma, spills = _compile_sm90(fn, dtype, cfg, unit, extra)
        assert smem <= 227 and spills == 0, f"{name} {dtype} {cfg}: {smem:.0f} KiB shared, {spills} bytes spilled"
        assert wgmma == (dtype == "bf16"), f"{name} {dtype}: wgmma {wgmma}"


# ------------------------------------------------------------------------- GPU only
@pytest.mark.gpu
@needs_compiled_gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("counts,n,k", CASES + [([300, 0, 1000, 77], 384, 1000)], ids=lambda v: str(v))
def test_triton_low_precision_on_gpu(counts, n, k, dtype):
    x, w, dy = make_inputs(counts, n, k, dtype)
    y, dx, dw = reference(x, w, dy, counts)
    assert_matches(G.grouped_forward(x, w, counts), y, TOL[dtype], "y")
    assert_matches(G.grouped_grad_input(dy, w, counts), dx, TOL[dtype], "dx")
    assert_matches(G.grouped_grad_weight(dy, x, counts), dw, TOL[dtype], "dw")


@pytest.mark.gpu
@needs_compiled_gpu
def test_grouped_mm_and_triton_agree_on_gpu():
    """torch._grouped_mm (CUTLASS, bf16) and the Triton kernels on the same operands, both
    against the fp32 reference; an empty group gives dW = 0 on both."""
    counts, n, k = [200, 0, 1000, 56], 384, 1024
    x, w, dy = make_inputs(counts, n, k, torch.bfloat16, seed=6)
    ref = reference(x, w, dy, counts)
    for backend in ("grouped_mm", "triton"):
        xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
        grouped_mm(xg, wg, counts, backend=backend).backward(dy)
        assert_matches(xg.grad, ref[1], TOL[torch.bfloat16], f"{backend} dx")
        assert_matches(wg.grad, ref[2], TOL[torch.bfloat16], f"{backend} dw")
        assert torch.count_nonzero(wg.grad[1]) == 0


@pytest.mark.skipif(TRITON_RUNS_HERE, reason="the Triton tests already ran in this process")
def test_triton_tests_in_interpreter_subprocess():
    """The child runs every Triton case under the interpreter: the only skips allowed there
    are the GPU-only cases and the offline compile (it ran here). A child where the
    interpreter did not take fails here instead of passing with nothing tested."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    cmd = [sys.executable, "-m", "pytest", __file__, "-q", "-rs", "-p", "no:cacheprovider",
           "-k", "not test_triton_tests_in_interpreter_subprocess"]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"interpreter run failed:\n{done.stdout[-6000:]}\n{done.stderr[-3000:]}"
    skips = [line.split(": ", 1)[1] for line in done.stdout.splitlines() if line.startswith("SKIPPED [")]
    allowed = (GPU_ONLY, "needs triton's compiled (not interpreted) kernels")
    assert not [reason for reason in skips if reason not in allowed], skips
    assert " passed" in done.stdout.strip().splitlines()[-1], done.stdout[-3000:]
