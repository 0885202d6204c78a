"""Tensor parallelism: parallel3d's layers vs torch's DTensor tensor parallelism.

Both split the same Llama the same way over 2 gloo ranks on CPU (q/k/v/gate/up
column-parallel, o/down row-parallel, vocab-parallel embedding, lm_head and loss): ours
with ``parallelize_llama``, torch's with ``parallelize_module`` + ``ColwiseParallel`` /
``RowwiseParallel`` and ``loss_parallel`` (the torchtitan plan). Before timing, both
losses and the q_proj gradient of layer 0 are checked against each other. Then rounds
alternate the two (forward + backward of one batch each), and the median step times and
their ratio are printed; on a shared 2-core machine single figures move by +-20%, the
ratio of alternating runs much less.

    python benchmarks/bench_tensor_parallel.py [--rounds 20] [--sequence-parallel]

It measures CPU/gloo overheads of the two implementations (autograd functions and
collectives vs DTensor dispatch); it says nothing about NVLink bandwidth on GPUs.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

SHAPE = dict(vocab_size=1024, dim=256, n_layers=4, n_heads=8, n_kv_heads=4, ffn_dim=688)
BATCH, SEQ = 8, 128


def _dtensor_model(model, sequence_parallel: bool):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput,
                                                   RowwiseParallel, SequenceParallel,
                                                   parallelize_module)

    mesh = init_device_mesh("cpu", (2,))
    sp = sequence_parallel
    seq_out = Shard(1) if sp else Replicate()
    parallelize_module(model, mesh, {
        "embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=seq_out),
        "norm": SequenceParallel() if sp else None,
        "lm_head": ColwiseParallel(input_layouts=seq_out, output_layouts=Shard(-1),
                                   use_local_output=False),
    } if sp else {
        "embed_tokens": RowwiseParallel(input_layouts=Replicate()),
        "lm_head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False),
    })
    for layer in model.layers.values():
        plan = {"self_attn.q_proj": ColwiseParallel(), "self_attn.k_proj": ColwiseParallel(),
                "self_attn.v_proj": ColwiseParallel(), "mlp.gate_proj": ColwiseParallel(),
                "mlp.up_proj": ColwiseParallel(),
                "self_attn.o_proj": RowwiseParallel(output_layouts=seq_out),
                "mlp.down_proj": RowwiseParallel(output_layouts=seq_out)}
        if sp:
            plan.update({
                "input_layernorm": SequenceParallel(),
                "post_attention_layernorm": SequenceParallel(),
                "self_attn": PrepareModuleInput(input_layouts=(Shard(1), None, None),
                                                desired_input_layouts=(Replicate(), None, None)),
                "mlp": PrepareModuleInput(input_layouts=(Shard(1),),
                                          desired_input_layouts=(Replicate(),)),
            })
        parallelize_module(layer, mesh, plan)
    if sp:
        model.sequence_shards = 2
    return model


def _step(model, loss_fn, tokens, targets, dtensor: bool) -> tuple[float, float]:
    model.zero_grad(set_to_none=True)
    t0 = time.perf_counter()
    if dtensor:
        from torch.distributed.tensor.parallel import loss_parallel

        with loss_parallel():
            loss = F.cross_entropy(model(tokens).flatten(0, 1), targets.flatten())
            loss.backward()
    else:
        loss = loss_fn(model(tokens), targets)
        loss.backward()
    dt = time.perf_counter() - t0
    loss = loss.detach()
    return dt, float(loss.full_tensor() if hasattr(loss, "full_tensor") else loss)


def run(rounds: int, sequence_parallel: bool) -> dict:
    from parallel3d.config import ParallelConfig
    from parallel3d.models.llama import Llama, LlamaConfig
    from parallel3d.models.llama.parallelize import parallelize_llama
    from parallel3d.topology import Topology

    cfg = LlamaConfig(**SHAPE)
    torch.manual_seed(0)
    ours, loss_fn = parallelize_llama(Llama(cfg), Topology(2, 1, 1),
                                      ParallelConfig(tp=2, sequence_parallel=sequence_parallel))
    torch.manual_seed(0)
    theirs = _dtensor_model(Llama(cfg), sequence_parallel)
    tokens = torch.randint(0, cfg.vocab_size, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    targets = torch.roll(tokens, -1, dims=1)

    _, loss_ours = _step(ours, loss_fn, tokens, targets, dtensor=False)
    _, loss_theirs = _step(theirs, None, tokens, targets, dtensor=True)
    g_ours = ours.layers["0"].self_attn.q_proj.weight.grad
    g_theirs = theirs.layers["0"].self_attn.q_proj.weight.grad.to_local()
    check = {"loss_rel": abs(loss_ours - loss_theirs) / loss_theirs,
             "grad_rel": float((g_ours - g_theirs).norm() / g_theirs.norm())}
    times = {"ours": [], "dtensor": []}
    for _ in range(rounds):
        times["ours"].append(_step(ours, loss_fn, tokens, targets, dtensor=False)[0])
        times["dtensor"].append(_step(theirs, None, tokens, targets, dtensor=True)[0])
    return {"check": check, "times": times}


def main() -> None:
    from parallel3d.testing import ProcessGroupPool

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--sequence-parallel", action="store_true")
    args = parser.parse_args()
    pool = ProcessGroupPool(2, timeout=900)
    try:
        out = pool.run(run, args.rounds, args.sequence_parallel)[0]
    finally:
        pool.close()
    check = out["check"]
    if check["loss_rel"] > 1e-5 or check["grad_rel"] > 1e-4:
        raise SystemExit(f"ours and DTensor disagree: {check}")
    ours = statistics.median(out["times"]["ours"]) * 1e3
    theirs = statistics.median(out["times"]["dtensor"]) * 1e3
    ratios = [a / b for a, b in zip(out["times"]["ours"], out["times"]["dtensor"])]
    sp = " + sequence parallel" if args.sequence_parallel else ""
    print(f"tp=2{sp}, Llama {SHAPE}, batch {BATCH}x{SEQ}, gloo on CPU, 1 thread per rank")
    print(f"agreement: loss rel {check['loss_rel']:.1e}, layer-0 q_proj grad rel {check['grad_rel']:.1e}")
    print(f"forward+backward median: ours {ours:.1f} ms, DTensor {theirs:.1f} ms, "
          f"ratio ours/DTensor {statistics.median(ratios):.2f} (median of {args.rounds} alternating rounds)")


if __name__ == "__main__":
    main()
