"""Triton linear (kernels/linear.py) vs. torch.matmul (cuBLAS) on tensor-parallel shards.

For the Llama 3 8B and 70B presets, every tp in {1, 2, 4, 8} and M tokens in
{4096, 8192, 16384}, times in bf16 the three GEMMs of each sharded projection:

    fwd    Y  = X W^T    (M, N)      vs torch.matmul(x, w.t())
    dgrad  dX = dY W     (M, K)      vs torch.matmul(dy, w)
    wgrad  dW = dY^T X   (N, K)      vs torch.matmul(dy.t(), x)

Shards: column-parallel QKV (N = (H + 2 KVH) hd / tp, K = hidden) and gate/up
(N = ffn / tp, K = hidden); row-parallel O (N = hidden, K = H hd / tp) and down
(N = hidden, K = ffn / tp). Each row reports TFLOP/s (2 M N K / time, median of CUDA-event
timings by triton.testing.do_bench) of ours and cuBLAS measured in the same run, and
their ratio; ours is checked against cuBLAS before it is timed. A ratio >= 1 is where
``parallel.linear_backend = "auto"`` would run Triton (kernels/gemm.py). The GPU
acceptance command (gpu_acceptance.py) runs :func:`bench_shape` on the tp 2/4/8 shards.

Without CUDA it cannot time anything meaningful: it re-runs itself under
TRITON_INTERPRET=1, checks a few small shapes through the Triton kernels against the
torch reference, and says that timing needs a GPU.

    python benchmarks/bench_linear.py [--quick] [--autotune] [--out benchmarks/linear_h200.md]
    python benchmarks/bench_linear.py --compile-sm90 [--quick]   # Hopper codegen report, no GPU needed
"""
from __future__ import annotations

import argparse
import datetime
import os
import sys

import torch

PRESETS = {  # hidden, ffn, heads, kv heads, head_dim
    "llama3-8b": (4096, 14336, 32, 8, 128),
    "llama3-70b": (8192, 28672, 64, 8, 128),
}
TOKENS = (4096, 8192, 16384)
TPS = (1, 2, 4, 8)
GEMMS = ("fwd", "dgrad", "wgrad")


def shard_shapes(preset: str, tp: int) -> list[tuple[str, int, int]]:
    """(layer, N, K) of each weight shard W (N, K) on one tensor-parallel rank."""
    hidden, ffn, heads, kv_heads, head_dim = PRESETS[preset]
    if heads % tp or kv_heads % tp or ffn % tp:
        raise ValueError(f"{preset}: heads {heads}, kv heads {kv_heads}, ffn {ffn} must divide by tp={tp}")
    return [("qkv", (heads + 2 * kv_heads) * head_dim // tp, hidden),
            ("gate/up", ffn // tp, hidden),
            ("o", hidden, heads * head_dim // tp),
            ("down", hidden, ffn // tp)]


def _rel_err(actual, expected):
    return ((actual.float() - expected.float()).abs().max() / expected.float().abs().max()).item()


def cuda_ms(fn, warmup: int = 25, rep: int = 100) -> float:
    """Median of CUDA-event timings of ``fn`` in ms (triton.testing.do_bench)."""
    import triton.testing

    return triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median")


def bench_shape(L, m, n, k, autotune, *, device="cuda", dtype=torch.bfloat16, timer=cuda_ms):
    """({gemm: (ours TFLOP/s, torch TFLOP/s, max rel err)}, tiles used) for one (M, N, K).

    ``timer(fn) -> ms``; on a GPU the CUDA-event median, torch's side is cuBLAS."""
    x, w, dy = L.example_operands(m, n, k, dtype, device)
    if autotune:
        L.autotune_linear(m, n, k, dtype, device)
    interpreted = L._INTERPRETED
    tiles = "/".join(f"{c.block_m}x{c.block_n}x{c.block_k}" for c in (  # as _gemm keys them
        L.select_config("fwd", dtype, m, n, k, interpreted=interpreted),
        L.select_config("dgrad", dtype, m, k, n, interpreted=interpreted),
        L.select_config("wgrad", dtype, n, k, m, interpreted=interpreted)))
    pairs = {
        "fwd": (lambda: L.linear_forward(x, w), lambda: torch.matmul(x, w.t())),
        "dgrad": (lambda: L.linear_grad_input(dy, w), lambda: torch.matmul(dy, w)),
        "wgrad": (lambda: L.linear_grad_weight(dy, x)[0], lambda: torch.matmul(dy.t(), x)),
    }
    flops = 2.0 * m * n * k
    results = {}
    for gemm, (ours, cublas) in pairs.items():
        err = _rel_err(ours(), cublas())
        t_ours, t_cublas = timer(ours), timer(cublas)
        results[gemm] = (flops / t_ours / 1e9, flops / t_cublas / 1e9, err)  # ms -> TFLOP/s
    del x, w, dy
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return results, tiles


def run_gpu(args) -> int:
    from parallel3d.kernels import linear as L

    if L._INTERPRETED:
        print("TRITON_INTERPRET=1 is set: unset it to time the compiled kernels on the GPU.")
        return 2
    tokens, tps = ((8192,), (1, 8)) if args.quick else (TOKENS, TPS)
    header = ["model", "tp", "layer", "M", "N", "K"]
    for gemm in GEMMS:
        header += [f"{gemm} ours", f"{gemm} cuBLAS", f"{gemm} ratio"]
    header.append("tiles fwd/dgrad/wgrad")
    rows, worst_err = [], 0.0
    print(" | ".join(header), flush=True)
    for preset in PRESETS:
        for tp in tps:
            for layer, n, k in shard_shapes(preset, tp):
                for m in tokens:
                    res, tiles = bench_shape(L, m, n, k, args.autotune)
                    row = [preset, str(tp), layer, str(m), str(n), str(k)]
                    for gemm in GEMMS:
                        ours, cublas, err = res[gemm]
                        worst_err = max(worst_err, err)
                        row += [f"{ours:.0f}", f"{cublas:.0f}", f"{ours / cublas:.2f}"]
                    row.append(tiles)
                    rows.append(row)
                    print(" | ".join(row), flush=True)
    # bf16 outputs of two fp32-accumulating GEMMs differ by ~1-2 output roundings (2^-8).
    ok = worst_err < 2e-2
    print(f"max relative difference ours vs cuBLAS over all GEMMs: {worst_err:.2e} ({'ok' if ok else 'TOO LARGE'})")
    if args.out:
        write_markdown(args.out, header, rows, args.autotune, worst_err)
    return 0 if ok else 1


def write_markdown(path, header, rows, autotuned, worst_err):
    props = torch.cuda.get_device_properties(0)
    import triton
    lines = [
        "# Triton linear vs cuBLAS (bf16, TFLOP/s = 2MNK / median time)",
        "",
        f"- date: {datetime.date.today().isoformat()}",
        f"- GPU: {props.name} ({props.multi_processor_count} SMs)",
        f"- torch {torch.__version__}, triton {triton.__version__}, CUDA {torch.version.cuda}",
        f"- tile configs: {'autotuned per shape' if autotuned else 'deterministic heuristic (no autotune)'}",
        f"- max relative difference ours vs cuBLAS: {worst_err:.2e}",
        "- ratio = ours / cuBLAS, both measured in this run",
        "",
        "| " + " | ".join(header) + " |",
        "|" + "---|" * len(header),
    ]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    print(f"wrote {path}")


def run_cpu_check(args) -> int:
    """Small fp32 shapes through the Triton kernels (interpreter) vs the torch reference."""
    from parallel3d.kernels import linear as L

    print("No CUDA device: timing needs a GPU, so no TFLOP/s are reported.")
    print("Checking the Triton path under TRITON_INTERPRET=1 against the torch reference (fp32):")
    failed = 0
    gen = torch.Generator().manual_seed(0)
    # Shard shapes of the presets scaled down by 64 (tp = 1 and 8), plus an odd one.
    shapes = [(64, 96, 64), (64, 224, 64), (128, 12, 128), (37, 53, 71)]
    for m, n, k in shapes[:2] if args.quick else shapes:
        x, w, dy = (torch.randn(*s, generator=gen) for s in ((m, k), (n, k), (m, n)))
        b = torch.randn(n, generator=gen)
        y = L.linear_forward(x, w, b)
        dx = L.linear_grad_input(dy, w)
        dw, db = L.linear_grad_weight(dy, x, bias_grad=True)
        errs = {"y": _rel_err(y, L.linear_ref(x, w, b)), "dx": _rel_err(dx, dy @ w),
                "dw": _rel_err(dw, dy.t() @ x), "db": _rel_err(db, dy.sum(0))}
        bad = max(errs.values()) > 2e-5  # fp32: summation order only, ~K * eps
        failed += bad
        print(f"  M={m} N={n} K={k}: " + ", ".join(f"{k_}={v:.1e}" for k_, v in errs.items())
              + ("  FAIL" if bad else "  ok"))
    if args.out:
        print(f"--out {args.out} ignored: there is no GPU table to write.")
    return 1 if failed else 0


# Launch variants as _gemm specialises them: (kind, unit-stride args, constexpr flags).
_VARIANTS = {
    "fwd": ("fwd", ("stride_ak", "stride_bk", "stride_cn"), {}),
    "fwd+bias": ("fwd", ("stride_ak", "stride_bk", "stride_cn"), dict(HAS_BIAS=True)),
    "dgrad": ("dgrad", ("stride_ak", "stride_bn", "stride_cn"), {}),
    "wgrad": ("wgrad", ("stride_am", "stride_bn", "stride_cn"), {}),
    "wgrad+db+main_grad": ("wgrad", ("stride_am", "stride_bn", "stride_cn"),
                           dict(ROW_SUM_A=True, ACCUMULATE=True)),
}


def compile_check_sm90(quick: bool) -> int:
    """Compile every kernel variant for sm_90a without a GPU and report registers, spills,
    shared memory and whether the K loop became async-copy + wgmma. Uses triton internals
    (ASTSource, the bundled ptxas), so it may need updating with triton."""
    import re
    import subprocess
    import tempfile
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import get_ptxas
    from triton.compiler import ASTSource

    from parallel3d.kernels import _matmul_common as common
    from parallel3d.kernels import linear as L

    fn, names = L._gemm_kernel, L._gemm_kernel.arg_names
    configs = {("bf16", common.heuristic_config(torch.bfloat16, 8192, 8192, 8192, interpreted=False)),
               ("bf16", common.heuristic_config(torch.bfloat16, 8192, 4096, 8192, interpreted=False,
                                                fused_extras=True)),
               ("fp32", common.heuristic_config(torch.float32, 8192, 8192, 8192, interpreted=False))}
    if not quick:
        configs |= {("bf16", c) for c in common.HOPPER_16BIT} | {("fp32", c) for c in common.HOPPER_FP32}
    failures = 0
    print("dtype | tile (MxNxK/warps/stages) | variant | registers | spill bytes | smem KiB | wgmma | serialised")
    for dtype, cfg in sorted(configs, key=lambda dc: (dc[0], dc[1].as_dict().__repr__())):
        for variant, (kind, unit, flags) in _VARIANTS.items():
            const = dict(HAS_BIAS=False, ACCUMULATE=False,
                         ROW_SUM_A=False, FP32_IEEE=dtype == "fp32", INT64=False, BLOCK_M=cfg.block_m,
                         BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m)
            const.update(flags)
            const.update({name: 1 for name in unit})  # triton specialises unit strides at runtime
            sig = {name: ("constexpr" if name in const else ("i32" if i >= 5 else f"*{dtype}"))
                   for i, name in enumerate(names)}
            if const["ACCUMULATE"]:
                sig["c_ptr"] = "*fp32"
            # ...and 16-divisible pointers and sizes, as torch allocations and TP shards are
            attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(names) if sig[name] != "constexpr"}
            try:
                kernel = triton.compile(ASTSource(fn, sig, const, attrs), target=GPUTarget("cuda", 90, 32),
                                        options=dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages))
                with tempfile.TemporaryDirectory() as tmp:
                    with open(f"{tmp}/k.ptx", "w") as f:
                        f.write(kernel.asm["ptx"])
                    log = subprocess.run([get_ptxas(90).path, "--gpu-name", "sm_90a", "-v", f"{tmp}/k.ptx",
                                          "-o", f"{tmp}/k.cubin"], capture_output=True, text=True).stderr
            except Exception as err:  # report every variant, then fail
                failures += 1
                print(f"{dtype} | {cfg} | {variant} | FAILED: {type(err).__name__}: {str(err)[:200]}")
                continue
            regs = re.search(r"Used (\d+) registers", log)
            spills = re.search(r"(\d+) bytes spill stores", log)
            smem = kernel.metadata.shared / 1024
            failures += smem > 227
            print(f"{dtype} | {cfg.block_m}x{cfg.block_n}x{cfg.block_k}/{cfg.num_warps}/{cfg.num_stages} | {variant}"
                  f" | {regs.group(1) if regs else '?'} | {spills.group(1) if spills else '?'} | {smem:.0f}"
                  f" | {'warp_group_dot' in kernel.asm['ttgir']} | {'serialized' in log}")
    print("all variants compiled within sm_90 shared memory" if not failures else f"{failures} problem(s)")
    return 1 if failures else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="M=8192 and tp in {1, 8} only")
    parser.add_argument("--autotune", action="store_true", help="tune tiles per shape before timing")
    parser.add_argument("--out", help="write the table as markdown to this file (GPU only)")
    parser.add_argument("--compile-sm90", action="store_true",
                        help="no timing: compile all kernel variants for Hopper offline (works on CPU)")
    args = parser.parse_args()
    if args.compile_sm90:
        return compile_check_sm90(args.quick)
    if torch.cuda.is_available():
        return run_gpu(args)
    if os.environ.get("TRITON_INTERPRET") != "1":  # triton must see it before its first import
        os.execve(sys.executable, [sys.executable, os.path.abspath(__file__), *sys.argv[1:]],
                  dict(os.environ, TRITON_INTERPRET="1"))
    return run_cpu_check(args)


if __name__ == "__main__":
    sys.exit(main())
