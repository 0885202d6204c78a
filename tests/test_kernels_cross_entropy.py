"""kernels/cross_entropy.py: the reference against F.cross_entropy, and the Triton
kernels against the reference on odd shapes, padding, targets owned elsewhere, bf16.

As in test_kernels_linear.py: triton decides between compiled and interpreted kernels
when the file is imported, so on a CPU host the Triton tests skip here and
`test_triton_tests_in_interpreter_subprocess` reruns this file with TRITON_INTERPRET=1.
"""

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from parallel3d.kernels import cross_entropy as K
from parallel3d.kernels.cross_entropy import (ce_local_grad, ce_local_grad_ref, ce_local_stats,
                                              ce_local_stats_ref)

ON_GPU = torch.cuda.is_available() and not K._INTERPRETED
DEVICE = "cuda" if ON_GPU else "cpu"
needs_triton = pytest.mark.skipif(not (ON_GPU or K._INTERPRETED),
                                  reason="triton on a CPU host: the subprocess test runs these")

# max |ours - ref| / max |ref|. fp32: the same exps summed in another order (online, by
# lanes), a few ulps of a sum of <= 130 terms. bf16 logits are loaded exactly and all
# arithmetic is fp32; the fp32 gradients differ by ulps, so their bf16 roundings can land
# one bf16 ulp apart: 2^-7 relative at most.
TOL = {torch.float32: 1e-5, torch.bfloat16: 2**-7}

# (rows N, columns v, real columns n_valid): odd, a row crossing block edges, padding,
# a rank holding only padding.
SHAPES = [(37, 53, 53), (1, 130, 129), (9, 71, 50), (5, 8, 0)]


def _inputs(n, v, n_valid, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    z = (torch.randn(n, v, generator=gen) * 4).to(dtype)
    t = torch.randint(-v, 2 * v, (n,), generator=gen)  # mine, a lower rank's, a higher's
    t[0] = max(n_valid - 1, 0)
    return z.to(DEVICE), t.to(DEVICE)


def _rel(a, b):
    a, b = a.detach().float(), b.detach().float()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def test_reference_is_the_cross_entropy_on_one_rank():
    z, _ = _inputs(37, 53, 53, torch.float32)
    t = torch.randint(0, 53, (37,), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    m, s, zt = ce_local_stats_ref(z, t, 53)
    full = z.clone().requires_grad_()
    ref = F.cross_entropy(full, t, reduction="none")
    c = torch.rand(37, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    (ref * c).sum().backward()
    assert _rel(torch.log(s) + m - zt, ref) < 1e-6
    assert _rel(ce_local_grad_ref(z, t, 53, m, s, c), full.grad) < 1e-6


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,v,n_valid", SHAPES)
def test_triton_matches_the_reference(n, v, n_valid, dtype):
    z, t = _inputs(n, v, n_valid, dtype)
    stats = ce_local_stats(z, t, n_valid, backend="triton")
    expect = ce_local_stats_ref(z, t, n_valid)
    for name, got, ref in zip("msz", stats, expect):
        if n_valid == 0:  # -inf max, zero sum and target logit
            assert torch.equal(got, ref), name
        else:
            assert _rel(got, ref) < TOL[torch.float32], name
    if n_valid == 0:
        return
    m, s = stats[0] + 0.5, stats[1] * 1.7  # as if other ranks raised the max and the sum
    c = torch.rand(n, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    got = ce_local_grad(z, t, n_valid, m, s, c, backend="triton")
    ref = ce_local_grad_ref(z, t, n_valid, m, s, c)
    assert got.dtype == dtype and got.shape == z.shape
    assert _rel(got, ref) < TOL[dtype]
    assert torch.all(got[:, n_valid:] == 0), "padding columns got a gradient"


@needs_triton
def test_triton_reads_strided_rows_and_an_expanded_scale():
    big, t = _inputs(7, 80, 80, torch.float32)
    z = big[:, 5:58]  # rows 80 apart, 53 columns
    stats = ce_local_stats(z, t.clamp(0, 52), 53, backend="triton")
    assert _rel(stats[1], ce_local_stats_ref(z, t.clamp(0, 52), 53)[1]) < TOL[torch.float32]
    c = torch.tensor(0.25, device=DEVICE).expand(7)  # the gradient of a mean
    got = ce_local_grad(z, t, 53, *stats[:2], c, backend="triton")
    assert _rel(got, ce_local_grad_ref(z, t, 53, *stats[:2], c)) < TOL[torch.float32]


def test_reference_rows_with_zero_scale_are_zero():
    """An ignored target (ignore_index) reaches the gradient pass as a row whose upstream
    gradient is 0: the reference writes exact zeros there (the rest as with any scale)."""
    z, t = _inputs(37, 53, 53, torch.float32)
    m, s, _ = ce_local_stats_ref(z, t, 53)
    c = torch.rand(37, generator=torch.Generator().manual_seed(5)).to(DEVICE)
    c[::3] = 0.0
    g = ce_local_grad_ref(z, t, 53, m, s, c)
    assert torch.all(g[::3] == 0) and torch.all(g[1::3].abs().sum(1) > 0)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_rows_with_zero_scale_read_nothing_and_are_zero(dtype):
    """The kernel skips the logits of a row with c = 0 (loads masked off): the row is zero,
    and every other row equals the reference."""
    z, t = _inputs(37, 53, 53, dtype)
    m, s, _ = ce_local_stats_ref(z, t, 53)
    c = torch.rand(37, generator=torch.Generator().manual_seed(5)).to(DEVICE)
    c[::3] = 0.0
    z_poisoned = z.clone()
    z_poisoned[::3] = float("nan")  # were these rows read, nan would reach the gradient
    got = ce_local_grad(z_poisoned, t, 53, m, s, c, backend="triton")
    assert torch.all(got[::3] == 0)
    keep = c != 0
    assert _rel(got[keep], ce_local_grad_ref(z, t, 53, m, s, c)[keep]) < TOL[dtype]


@pytest.mark.parametrize("backend", [pytest.param("triton", marks=needs_triton), "torch"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_gradient_written_over_the_logits_equals_a_new_one(backend, dtype, monkeypatch):
    """``inplace``: the gradient takes the logits' storage and has the same bits as the one
    written to a new tensor (each block of a row is read before it is written). The
    reference runs here in row blocks of 5 rows (its block size shrunk), so the blocks'
    seams are crossed too."""
    monkeypatch.setattr(K, "REF_BLOCK_BYTES", 5 * 4 * 53)
    z, t = _inputs(37, 53, 50, dtype)
    m, s, _ = ce_local_stats(z, t, 50, backend=backend)
    assert torch.equal(torch.stack(ce_local_stats_ref(z, t, 50)[:2]), torch.stack([m, s])) or backend != "torch"
    c = torch.rand(37, generator=torch.Generator().manual_seed(4)).to(DEVICE)
    new = ce_local_grad(z, t, 50, m, s, c, backend=backend)
    logits = z.clone()
    got = ce_local_grad(logits, t, 50, m, s, c, backend=backend, inplace=True)
    assert got.data_ptr() == logits.data_ptr() and torch.equal(got, new)


def test_triton_tests_in_interpreter_subprocess():
    if ON_GPU or K._INTERPRETED:
        pytest.skip("the Triton tests ran in this process")
    env = dict(os.environ, TRITON_INTERPRET="1")
    # The child never runs this test: where the interpreter did not take, it would start a
    # child of its own, and so on.
    cmd = [sys.executable, "-m", "pytest", __file__, "-q", "-p", "no:cacheprovider",
           "-k", "not test_triton_tests_in_interpreter_subprocess"]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"interpreter run failed:\n{done.stdout[-6000:]}\n{done.stderr[-3000:]}"
    summary = done.stdout.strip().splitlines()[-1]
    assert "skipped" not in summary and " passed" in summary, f"Triton tests skipped under the interpreter: {summary}"
