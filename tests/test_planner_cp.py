"""The layout planner under context parallelism: activations and model states over cp
(measured against a ring-attention run), the K/V traffic, the search and the 128K recipe."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from parallel3d.cli import main
from parallel3d.config import load_config
from parallel3d.models.llama import PRESETS, Llama
from parallel3d.planner.calibrate import default_efficiency
from parallel3d.planner.hardware import gpu_named
from parallel3d.planner.memory import cp_transient_bytes, stage_memory
from parallel3d.planner.spec import Layout, Workload
from parallel3d.planner.timing import step_time

from test_planner import SMALL


def _saved_activation_bytes(cp: int, B: int = 2, S: int = 256) -> int:
    """Bytes autograd saves (each storage once, parameters left out) in one forward and
    loss of SMALL (fp32) on this rank's tokens: the whole sequence at cp 1, the rank's two
    head-tail chunks at cp > 1 (the ring attention over the gloo world)."""
    import torch.distributed as dist
    import torch.nn.functional as F

    from parallel3d.context_parallel import shard_sequence
    from parallel3d.models.llama.parallelize import apply_context_parallel

    torch.manual_seed(0)
    model = Llama(SMALL)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    tokens = torch.randint(0, SMALL.vocab_size, (B, S))
    positions = torch.arange(S).expand(B, S)
    if cp > 1:
        apply_context_parallel(model, dist.group.WORLD, "ring")
        rank = dist.get_rank()
        tokens, positions = (shard_sequence(t, cp, rank, dim=1) for t in (tokens, positions))
    saved = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logits = model(tokens, positions if cp > 1 else None)
        F.cross_entropy(logits.flatten(0, 1), tokens.flatten())
    return sum(saved.values())


def test_activations_at_cp_2_are_half_of_cp_1_measured(pools):
    """What autograd saves for one micro-batch of 2 x 256 tokens, measured: at cp 2 (the
    ring, 2 gloo ranks) each rank saves about half of what one process saves for the whole
    sequences (a little more: the ring keeps its output beside the o projection's input),
    and the planner's activations match both within 3%. A planner that ignored cp would
    predict cp 1's bytes for cp 2, about twice the measurement."""
    whole = _saved_activation_bytes(1)
    per_rank = pools(2).run(_saved_activation_bytes, 2)
    assert per_rank[0] == per_rank[1]
    assert 0.5 <= per_rank[0] / whole <= 0.55, (per_rank, whole)
    work = Workload(SMALL, 256, 2, "fp32")
    planned = {cp: stage_memory(work, Layout(micro_batch=2, cp=cp, cp_comm="ring"), 0).activations
               for cp in (1, 2)}
    assert planned[1] / whole == pytest.approx(1.0, abs=0.03)
    assert planned[2] / per_rank[0] == pytest.approx(1.0, abs=0.03)
    # the per-token terms halve; the ring's output copy (d per local token a layer) is extra
    ring_copy = SMALL.n_layers * 256 * SMALL.dim * 4
    assert planned[2] - ring_copy == planned[1] // 2


def test_model_states_shard_over_dp_x_cp_and_the_allgather_keeps_the_whole_kv():
    work = Workload(PRESETS["8b"], 32768, 16, "bf16")
    base = stage_memory(work, Layout(tp=2, dp=4, zero=2, sequence_parallel=True), 0)
    cp = stage_memory(work, Layout(tp=2, dp=4, cp=4, zero=2, sequence_parallel=True), 0)
    # weights replicated over cp: the same parameters, ZeRO's shards 4x smaller
    assert cp.params == base.params and cp.weights == base.weights
    assert (cp.master, cp.optimizer, cp.full_grads) == (base.master // 4, base.optimizer // 4,
                                                        base.full_grads // 4)
    # all-gather (auto under GQA): a rank's 8192 tokens save a quarter of the per-token
    # terms, plus per layer the whole sequence's K and V in place of its own (3 x 2 x 4
    # kv-heads / tp 2 x 128 bf16 per local token), and one layer's gathered K/V twice
    # (the gather and its reordered copy, or their gradients) while it runs
    tokens, kv = 8192, 4 * 128
    layer_extra = 3 * 2 * kv * 2
    assert cp.activations - base.activations // 4 == pytest.approx(32 * tokens * layer_extra, rel=1e-3)
    layout = Layout(tp=2, dp=4, cp=4, zero=2, sequence_parallel=True)
    assert cp_transient_bytes(work.model, tokens, layout, 2) == 2 * 4 * tokens * 2 * kv * 2


def test_kv_traffic_grows_with_cp_as_the_cost_formula_says():
    """Per layer and micro-batch, with nothing to hide behind (an infinitely fast GPU):
    the all-gather mode moves (cp - 1) / cp of the whole sequence's K/V forward
    (all-gather) and backward (reduce-scatter of dK/dV), the bytes of
    ``context_parallel.cost.kv_bytes_per_layer``; the ring's exposed time is its cp - 1 K/V
    messages each way plus cp - 1 fp32 dK/dV messages, the same function's ring bytes.
    With the attention to hide behind, the all-gather mode exposes what its collectives
    outlast the rank's own chunks' attention by, and the ring what its messages outlast
    their steps' blocks by (its last dK/dV message under a quarter of the own chunks'
    backward)."""
    from parallel3d.context_parallel.cost import kv_bytes_per_layer
    from parallel3d.planner.timing import cp_layer_seconds

    model = PRESETS["8b"]
    work = Workload(model, 65536, 16, "bf16")
    gpu = gpu_named("h100-80g")
    eff = replace(default_efficiency(), nvlink_latency_s=0.0, internode_latency_s=0.0)
    bw = gpu.nvlink_bytes_per_s * eff.link
    fast = replace(gpu, peak_flops=1e40)
    assert cp_layer_seconds(work, Layout(tp=2), gpu, 8, eff) == (0.0, 0.0)
    seconds = {}
    for cp in (2, 4):
        f, b = cp_layer_seconds(work, Layout(tp=2, cp=cp, cp_comm="allgather"), fast, 8, eff)
        sent = kv_bytes_per_layer("allgather", batch=1, seq_len=65536, n_kv_heads=8 // 2, head_dim=128, cp=cp)
        assert f == pytest.approx(b) and (f + b) * bw == pytest.approx(sent, rel=1e-12)
        seconds[cp] = f + b
    assert seconds[4] / seconds[2] == pytest.approx((3 / 4) / (1 / 2))
    # tp 4 x cp 4 spans two nodes: the cp group's traffic runs at the NIC's speed
    f, b = cp_layer_seconds(work, Layout(tp=4, cp=4, cp_comm="allgather"), fast, 8, eff)
    kv_elems = 2 * 65536 * 2 * 128
    gather_s = 3 / 4 * kv_elems * 2 / (gpu.internode_bytes_per_s * eff.link)
    assert f == pytest.approx(gather_s)
    # on an H100 the collectives run under the own chunks' attention: 2 of the rank's 2 cp
    # chunk blocks (head-tail), twice as long in the backward; at 32K tokens (8K a rank)
    # the all-gather outlasts it, the reduce-scatter does not
    work32 = Workload(model, 32768, 16, "bf16")
    own_f = 4 * 32768 * model.n_heads * model.head_dim * 8192 / 4 / (gpu.peak_flops * eff.compute) / 4
    assert 0 < own_f < gather_s / 2 < 2 * own_f
    assert cp_layer_seconds(work32, Layout(tp=4, cp=4, cp_comm="allgather"), gpu, 8, eff) == \
        pytest.approx((gather_s / 2 - own_f, 0.0))
    # the ring with no compute to overlap exposes all its bytes (tp 2 x cp 8 leaves the node)
    for cp in (2, 4, 8):
        f, b = cp_layer_seconds(work, Layout(tp=2, cp=cp, cp_comm="ring"), fast, 8, eff)
        sent = kv_bytes_per_layer("ring", batch=1, seq_len=65536, n_kv_heads=4, head_dim=128, cp=cp)
        link = bw if 2 * cp <= 8 else gpu.internode_bytes_per_s * eff.link
        assert (f + b) * link == pytest.approx(sent, rel=1e-12)
    # ... and on an H100 the block attention of 64K tokens hides every message, the last
    # dK/dV's (fp32, a quarter of the K/V) under the own chunks' last block; at 1K tokens
    # a step's blocks (1/4096 the work, 1/64 the bytes) no longer hide the messages
    assert cp_layer_seconds(work, Layout(tp=2, cp=4, cp_comm="ring"), gpu, 8, eff) == (0.0, 0.0)
    short = Workload(model, 1024, 16, "bf16")
    f, b = cp_layer_seconds(short, Layout(tp=2, cp=4, cp_comm="ring"), gpu, 8, eff)
    kv_msg = 2 * 1024 * 4 * 128 * 2 / 4 / bw  # a K/V shard, bf16
    step_f = 4 * 1024 * model.n_heads * model.head_dim * 256 / 2 / (gpu.peak_flops * eff.compute) / 4
    assert step_f < kv_msg and f == pytest.approx(3 * (kv_msg - step_f))
    assert b == pytest.approx(sum(max(0.0, x) for x in (
        kv_msg - 1.5 * step_f, 2 * kv_msg - 0.5 * step_f,  # step 0's K/V; the last dK/dV (fp32: 2x)
        kv_msg - 2 * step_f, kv_msg + 2 * kv_msg - 2 * step_f, 2 * kv_msg - 2 * step_f)))  # steps 1, 2, 3
    # the step carries it: m micro-batches x 32 layers x (F + B), recomputation adds F again
    layout = Layout(tp=4, cp=4, dp=4, micro_batch=1, cp_comm="allgather")
    t = step_time(work32, layout, gpu, 8, eff)
    f, b = cp_layer_seconds(work32, layout, gpu, 8, eff)
    assert f > 0 and t.cp_comm_s == pytest.approx(layout.n_micro(work32) * 32 * (f + b))
    t_full = step_time(work32, replace(layout, recompute="full"), gpu, 8, eff)
    assert t_full.cp_comm_s == pytest.approx(layout.n_micro(work32) * 32 * (2 * f + b))


def test_cp_is_searched_for_long_sequences_and_within_the_trainer_checks():
    from parallel3d.planner.search import valid_layouts

    short = Workload(PRESETS["8b"], 8192, 64)
    assert {lay.cp for lay in valid_layouts(short, 64, 8)} == {1}
    # 16392 = 8 x 2049 tokens: 2 cp chunks split it for cp 1, 2, 4; at cp 4 a rank's 4098
    # tokens split over tp 2 but not tp 4 (sequence parallelism)
    long = Workload(PRESETS["8b"], 16392, 64)
    layouts = list(valid_layouts(long, 64, 8, {"pp": 1, "recompute": "none", "zero": 1}, with_cp=True))
    assert {lay.cp for lay in layouts} == {1, 2, 4}
    assert {(lay.tp, lay.sequence_parallel) for lay in layouts if lay.cp == 4} == {
        (1, False), (2, False), (2, True), (4, False), (8, False)}
    assert all(lay.world_size == 64 for lay in layouts)


def test_plan_recommends_context_parallelism_at_128k_and_the_recipe_is_its_choice(tmp_path, capsys):
    """Llama 3.1 8B at 128K tokens on 64 H100s: no layout without cp fits without full
    recomputation, and the recommendation splits sequences over cp ranks; the shipped
    recipe recipes/llama3_8b_128k.toml is the layout the plan writes."""
    from pathlib import Path

    written = tmp_path / "planned.toml"
    assert main(["plan", "--model", "8b", "--gpus", "64", "--gpu", "h100", "--seq-len", "131072",
                 "--top", "3", "--write-recipe", str(written)]) == 0
    out = capsys.readouterr().out
    recommended = next(line for line in out.splitlines() if line.startswith("recommended:"))
    layout = recommended.split("recommended: ", 1)[1].split(" --", 1)[0]
    assert " cp" in layout and "context-parallel comm" in recommended, recommended
    assert "model.max_seq_len raised from 8192 to 131072" in out
    assert "no context parallelism (cp1): best is" in out
    planned = load_config(written)
    assert planned.parallel.cp > 1 and planned.model.max_seq_len == 131072
    shipped = load_config(Path(__file__).resolve().parents[1] / "recipes" / "llama3_8b_128k.toml")
    for section, keys in (("parallel", ("tp", "cp", "cp_comm", "pp", "dp", "schedule", "virtual_stages",
                                        "zero", "sequence_parallel")),
                          ("train", ("global_batch", "micro_batch", "seq_len", "dtype", "recompute")),
                          ("launch", ("nnodes", "nproc")), ("model", ("preset", "max_seq_len"))):
        for key in keys:
            assert getattr(getattr(shipped, section), key) == getattr(getattr(planned, section), key), \
                (section, key)
