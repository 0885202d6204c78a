"""Pipeline parallelism trains exactly as one process: gpipe, 1f1b, interleaved and the
zero-bubble zb-h1 and zb-v at pp=2 and pp=4, pp=2 x dp=2 with ZeRO, tied embeddings,
recomputation; the timeline's trace (B and W apart), the step's one closing collective.
The measured bubble, the trace's placement of steps and a stage's memory:
tests/test_train_pp_runtime.py."""

from __future__ import annotations

import json

import pytest
import torch

from parallel3d.config import config_from_dict
from parallel3d.pipeline.actions import undivided_backwards
from parallel3d.pipeline.partition import rank_chunks
from parallel3d.pipeline.schedules import plan
from parallel3d.topology import Topology
from parallel3d.train.trainer import Trainer

from helpers import BF16_U, WEIGHT_RTOL, relative_diff, tiny_job, torch_threads

STEPS = 10


def _job(corpus_dir, run_dir, n_layers=4, tie=False, recompute="none", **parallel) -> dict:
    # micro_batch 1 of global 8: m = 8 micro-batches at dp=1, more than pp, so 1F1B's
    # activation bound (pp) differs from GPipe's (m).
    # Validation every 5 steps runs the schedule's forward-only pass (a tenth of the 1 MB
    # corpus held out: its default 2% is less than one document of it).
    return tiny_job(corpus_dir, run_dir, model={"n_layers": n_layers, "tie_embeddings": tie},
                    train={"steps": STEPS, "global_batch": 8, "micro_batch": 1, "grad_clip": 0.5,
                           "recompute": recompute},
                    eval={"interval": 5, "batches": 2}, data={"val_fraction": 0.1},
                    parallel=parallel, run={"trace_steps": parallel.pop("trace_steps", 0)})


def _train(job: dict) -> dict:
    """Train on this rank; its history, its parameters by name, what its schedule saw."""
    cfg = config_from_dict(job)
    topo = Topology(cfg.parallel.tp, cfg.parallel.pp, cfg.parallel.dp)
    trainer = Trainer(cfg, topo)
    history = trainer.fit()
    weights = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    return {"history": history, "weights": weights, "pp_rank": topo.pp_rank,
            "peak_alive": trainer.schedule.peak_alive}


@pytest.fixture(scope="module")
def reference(corpus_dir, tmp_path_factory):
    """pp=1 runs of the same jobs, built once per model shape."""
    cache = {}

    def get(n_layers: int, tie: bool = False) -> dict:
        if (n_layers, tie) not in cache:
            run = tmp_path_factory.mktemp("ref")
            with torch_threads(1):
                cache[(n_layers, tie)] = _train(_job(corpus_dir, str(run), n_layers, tie))
        return cache[(n_layers, tie)]
    return get


def _assert_same_training(ranks: list[dict], ref: dict, tie: bool = False) -> None:
    losses = [r["loss"] for r in ref["history"]]
    norms = [r["grad_norm"] for r in ref["history"]]
    for r in ranks:  # every rank reports the step's loss and norm
        # fp32, same data and seed: the forward is the same sequence of ops, so losses agree
        # to the last bits; what differs is the order of sums (the gradient norm over
        # stages, the dp all-reduce, a tied embedding's two halves), a few ulps per step.
        assert relative_diff([h["loss"] for h in r["history"]], losses) < 1e-5
        # validation through the pipeline's forward-only pass: the same sums of the same
        # forward, so the same bound
        val = [h["val_loss"] for h in r["history"] if "val_loss" in h]
        assert len(val) == 2 and relative_diff(val, [h["val_loss"] for h in ref["history"]
                                                     if "val_loss" in h]) < 1e-5
        # The norm of the gradient of a 10-step-trained net carries those ulps further.
        assert relative_diff([h["grad_norm"] for h in r["history"]], norms) < 1e-4
    ref_w = ref["weights"]
    seen = set()
    for r in ranks:
        for name, w in r["weights"].items():
            # A tied head on the last stage is the first stage's embedding, by value.
            want = ref_w["embed_tokens.weight"] if tie and name == "lm_head.weight" else ref_w[name]
            # Per tensor, ||w - w_ref|| / ||w_ref||. Not element-wise: AdamW divides by
            # sqrt(v), so an element whose gradient is a near-cancelling sum (a rare
            # token's embedding: 7e-8 from terms 1e3 larger) turns an ulp of difference in
            # its gradient into 1e-4 of its update; one element in 32768 did.
            rel = ((w - want).norm() / want.norm()).item()
            assert rel < WEIGHT_RTOL, (name, rel)
            seen.add(name)
    assert seen == set(ref_w) | ({"lm_head.weight"} if tie else set())


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved"])
def test_pp2_equals_pp1(pools, corpus_dir, tmp_path, reference, schedule):
    v = 2 if schedule == "interleaved" else 1  # 4 layers in 4 chunks of one
    trace = 2 if schedule == "1f1b" else 0
    job = _job(corpus_dir, str(tmp_path), 4, schedule=schedule, pp=2, virtual_stages=v,
               trace_steps=trace)
    ranks = pools(2).run(_train, job)
    _assert_same_training(ranks, reference(4))
    first = ranks[0]
    if schedule == "1f1b":
        assert first["peak_alive"] == 2  # pp, with m = 8
        _check_trace(tmp_path / "trace.json", world=2, pp=2, m=8, steps=trace)
        _check_bubble_in_metrics(tmp_path / "metrics.jsonl")
    if schedule == "gpipe":
        assert first["peak_alive"] == 8  # m


def test_pp2_tied_embeddings_equal_pp1(pools, corpus_dir, tmp_path, reference):
    job = _job(corpus_dir, str(tmp_path), 4, tie=True, schedule="1f1b", pp=2)
    ranks = pools(2).run(_train, job)
    # Stage 0 holds embed_tokens, stage 1 lm_head: the same matrix, updated alike.
    assert set(ranks[0]["weights"]) & {"embed_tokens.weight", "lm_head.weight"} == {"embed_tokens.weight"}
    assert set(ranks[1]["weights"]) & {"embed_tokens.weight", "lm_head.weight"} == {"lm_head.weight"}
    _assert_same_training(ranks, reference(4, tie=True), tie=True)


def _train_bf16_tied(job: dict) -> dict:
    out = _train(job)
    return {"losses": [h["loss"] for h in out["history"]], "pp_rank": out["pp_rank"],
            "tied": {n: w for n, w in out["weights"].items() if n in ("embed_tokens.weight", "lm_head.weight")}}


@pytest.mark.parametrize("zero", [1, 2])
def test_pp2_tied_embeddings_in_bf16_with_zero_stay_identical(pools, corpus_dir, tmp_path, zero):
    """The GPU default (bf16 parameters, fp32 master weights and gradients in the ZeRO
    optimizer) with a tied embedding split over the first and last stage: both copies get
    the sum of both gradients, so after 20 steps they are bit-identical, and the losses
    follow one process's."""
    steps = 20
    jobs = {pp: _job(corpus_dir, str(tmp_path / f"pp{pp}"), 4, tie=True, schedule="1f1b", pp=pp, zero=zero)
            for pp in (1, 2)}
    for job in jobs.values():
        job["train"].update(steps=steps, dtype="bf16")
        job["eval"]["interval"] = 0
    ref = pools(1).run(_train_bf16_tied, jobs[1])[0]
    first, last = sorted(pools(2).run(_train_bf16_tied, jobs[2]), key=lambda r: r["pp_rank"])
    # bit for bit whatever the kernels: both copies are updated from the same summed
    # gradient by the same optimizer arithmetic (left unsummed, the bug this guards, they differ)
    assert torch.equal(first["tied"]["embed_tokens.weight"], last["tied"]["lm_head.weight"])
    # The losses against one process's: the same bf16 forward, but the tied gradient is
    # summed differently (at pp 1 autograd adds the embedding's and the head's bf16
    # gradients in bf16 before the fp32 buffer; at pp 2 each reaches fp32 alone) and the
    # stages' GEMMs may block their sums differently: the runs agree to one bf16 rounding
    # (helpers.BF16_U, derived and measured there).
    assert relative_diff(first["losses"], ref["losses"]) < BF16_U
    assert first["losses"] == last["losses"]


@pytest.mark.parametrize("schedule,n_layers,v", [("gpipe", 4, 1), ("1f1b", 4, 1), ("interleaved", 8, 2)])
def test_pp4_equals_pp1(pools, corpus_dir, tmp_path, reference, schedule, n_layers, v):
    job = _job(corpus_dir, str(tmp_path), n_layers, schedule=schedule, pp=4, virtual_stages=v)
    ranks = pools(4).run(_train, job)
    _assert_same_training(ranks, reference(n_layers))
    peaks = [r["peak_alive"] for r in ranks]
    if schedule == "1f1b":
        assert peaks == [4, 3, 2, 1]  # pp - pp_rank: at most pp on the first stage, m = 8
    elif schedule == "gpipe":
        assert peaks == [8, 8, 8, 8]


@pytest.mark.parametrize("schedule,tie", [("zb-h1", False), ("zb-h1", True), ("zb-v", False), ("zb-v", True)])
def test_zero_bubble_pp2_equals_pp1(pools, corpus_dir, tmp_path, reference, schedule, tie):
    """zb-h1 (1F1B's order, W's filling the cool-down) and zb-v (two chunks per rank in a
    V: embedding and head both on rank 0, which holds the tied matrix once and gets its
    two gradients per micro-batch) train as one process; the trace shows every B and W."""
    v = 2 if schedule == "zb-v" else 1
    trace = 2 if not tie else 0
    job = _job(corpus_dir, str(tmp_path), 4, tie=tie, schedule=schedule, pp=2, virtual_stages=v,
               trace_steps=trace)
    ranks = pools(2).run(_train, job)
    if schedule == "zb-v" and tie:
        # the V puts both uses of the tied matrix on rank 0: one parameter, as at pp 1
        assert "lm_head.weight" not in ranks[0]["weights"] and "embed_tokens.weight" in ranks[0]["weights"]
        assert not {"embed_tokens.weight", "lm_head.weight"} & set(ranks[1]["weights"])
        _assert_same_training(ranks, reference(4, tie=True))
    else:
        _assert_same_training(ranks, reference(4, tie=tie), tie=tie)
    # m = 8: zb-h1 keeps pp micro-batches on every rank until their W; zb-v 2 pp chunk-
    # micro-batches of half a stage (min(2 pp, m + r + 1))
    assert [r["peak_alive"] for r in sorted(ranks, key=lambda r: r["pp_rank"])] == ([2, 2] if v == 1 else [4, 4])
    if trace:
        _check_trace(tmp_path / "trace.json", world=2, pp=2, m=8, steps=trace, schedule=schedule)


@pytest.mark.parametrize("schedule,n_layers,v,tie", [("zb-h1", 4, 1, True), ("zb-v", 8, 2, True)])
def test_zero_bubble_pp4_equals_pp1(pools, corpus_dir, tmp_path, reference, schedule, n_layers, v, tie):
    job = _job(corpus_dir, str(tmp_path), n_layers, tie=tie, schedule=schedule, pp=4, virtual_stages=v)
    ranks = pools(4).run(_train, job)
    _assert_same_training(ranks, reference(n_layers, tie=tie), tie=tie and schedule != "zb-v")
    peaks = [r["peak_alive"] for r in sorted(ranks, key=lambda r: r["pp_rank"])]
    assert peaks == ([4, 4, 4, 4] if v == 1 else [8, 8, 8, 8])  # m = 8


@pytest.mark.parametrize("schedule,zero,recompute", [("zb-h1", 1, "full"), ("zb-v", 2, "selective")])
def test_zero_bubble_pp2_dp2_zero_recompute_equals_pp1(pools, corpus_dir, tmp_path, reference, schedule,
                                                       zero, recompute):
    """The data-parallel reduction waits for the W's: ZeRO's buckets are reduced once the
    step's last W filled them (a B that deferred its weight gradients must not count).
    Recomputation rebuilds each layer in its B; the W must still reach the parameters
    (it lost one micro-batch of eight when it used the rebuilt copies of the weights)."""
    v = 2 if schedule == "zb-v" else 1
    job = _job(corpus_dir, str(tmp_path), 4, recompute=recompute, schedule=schedule, pp=2, dp=2,
               zero=zero, virtual_stages=v)
    ranks = pools(4).run(_train, job)
    _assert_same_training(ranks, reference(4))


def test_pp2_dp2_equals_pp1(pools, corpus_dir, tmp_path, reference):
    job = _job(corpus_dir, str(tmp_path), 4, schedule="1f1b", pp=2, dp=2)
    ranks = pools(4).run(_train, job)
    _assert_same_training(ranks, reference(4))


# -- the trace and the bubble ---------------------------------------------------------------

def _check_trace(path, world: int, pp: int, m: int, steps: int, schedule: str = "1f1b") -> None:
    trace = json.loads(path.read_text())  # valid JSON, Chrome-trace object form
    assert set(trace) == {"traceEvents", "displayTimeUnit"}
    events = trace["traceEvents"]
    meta = [e for e in events if e["ph"] == "M"]
    spans = [e for e in events if e["ph"] == "X"]
    marks = [e for e in events if e["ph"] == "i"]  # gradient buckets' reductions issued
    assert len(meta) + len(spans) + len(marks) == len(events)
    for e in meta:
        assert e["name"] in ("process_name", "process_sort_index", "thread_name")
        assert isinstance(e["pid"], int) and isinstance(e["args"], dict)
    assert {e["pid"] for e in meta if e["name"] == "process_name"} == set(range(world))
    for e in spans:
        assert isinstance(e["name"], str) and isinstance(e["cat"], str)
        assert isinstance(e["ts"], (int, float)) and isinstance(e["dur"], (int, float))
        assert e["ts"] >= 0 and e["dur"] >= 0 and e["pid"] in range(world) and e["tid"] in (0, 1)
    # Every forward and backward of every chunk and micro-batch, once per recorded step;
    # with a split backward its B ("backward") and its W ("weight") apart, except on the
    # first chunk, whose backward runs undivided: one B span.
    split = schedule in ("zb-h1", "zb-v")
    v = 2 if schedule == "zb-v" else 1
    cats = {"F": "forward", "B": "backward", "W": "weight"}
    whole = {r: undivided_backwards(plan(schedule, pp, v, m, r)) if split else set() for r in range(pp)}
    work = sorted((e["pid"], e["args"]["step"], e["name"], e["cat"]) for e in spans if e["cat"] in cats.values())
    want = sorted((r, s, f"{op}{c}.{i}", cats[op]) for r in range(pp) for s in range(1, steps + 1)
                  for c in rank_chunks(r, pp, v, schedule)
                  for op in ("FBW" if split else "FB") for i in range(m)
                  if not (op == "W" and (c, i) in whole[r]))
    assert work == want
    assert all(e["args"].get("with_weight", False) == ((int(e["name"][1:].split(".")[0]),
                                                         int(e["name"].split(".")[1])) in whole[e["pid"]])
               for e in spans if e["cat"] == "backward")
    # The optimizer reduces a bucket as soon as the step's last backward pass filled it:
    # on every rank, the first bucket's reduction is issued before its last backward ends.
    for pid in range(world):
        for step in range(1, steps + 1):
            issued = [e["ts"] for e in marks if (e["pid"], e["args"]["step"]) == (pid, step)
                      and e["name"].startswith("reduce bucket")]
            last_b = max(e["ts"] + e["dur"] for e in spans if (e["pid"], e["args"]["step"]) == (pid, step)
                         and e["cat"] in ("backward", "weight"))
            assert issued and min(issued) < last_b, (pid, step)
    # Spans of one lane never overlap (a lane is one sequence of things on one rank).
    for pid in range(world):
        for tid in (0, 1):
            lane = sorted((e["ts"], e["ts"] + e["dur"], e["name"], e["args"]["step"]) for e in spans
                          if (e["pid"], e["tid"]) == (pid, tid))
            crossing = [(a, b) for a, b in zip(lane, lane[1:]) if a[1] > b[0] + 1e-3]
            assert not crossing, (pid, tid, crossing[:3])


def _check_bubble_in_metrics(path) -> None:
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(records) == STEPS
    assert all(0.0 < r["bubble_fraction"] < 1.0 for r in records)


def _count_step_collectives(job: dict) -> dict:
    """Steps 1 and 2 by hand, counting the collectives step 2 issues outside the pipeline's
    sends and receives; whether each record held its per-rank figures when."""
    import torch.distributed as dist

    cfg = config_from_dict(job)
    trainer = Trainer(cfg, Topology(cfg.parallel.tp, cfg.parallel.pp, cfg.parallel.dp), log=False)
    first = trainer.train_step()
    calls: list[tuple[str, str]] = []
    saved = {}
    for name in ("all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object",
                 "broadcast", "reduce_scatter_tensor", "all_to_all_single", "barrier"):
        if not hasattr(dist, name):
            continue
        saved[name] = getattr(dist, name)

        def counting(*args, _name=name, **kwargs):
            group = kwargs.get("group")
            calls.append((_name, "world" if group in (None, dist.group.WORLD) else str(dist.get_process_group_ranks(group))))
            return saved[_name](*args, **kwargs)

        setattr(dist, name, counting)
    try:
        first_done_before = "max_step_time_s" in first
        second = trainer.train_step()
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)
    state = {"first_done_before": first_done_before, "first_done": "max_step_time_s" in first,
             "second_done": "max_step_time_s" in second}
    trainer.finish_records()
    state["second_done_after_finish"] = "max_step_time_s" in second
    state["bubble"] = second["bubble_fraction"]
    trainer.data.loader.close()
    return {"calls": calls, **state}


def test_a_step_closes_with_one_world_all_reduce(pools, corpus_dir, tmp_path):
    """pp2 x dp2 (zero 0): besides the pipeline's point-to-point traffic a step issues the
    dp gradient all-reduce and one world all-reduce that carries the norm, the loss and the
    previous step's per-rank figures; nothing else (no loss sums, no metrics gather). On
    gloo a small all-reduce is one all-to-all (parallel3d.distributed.all_reduce)."""
    job = _job(corpus_dir, str(tmp_path), pp=2, dp=2, schedule="1f1b")
    job["eval"] = {"interval": 0}
    for rank, out in enumerate(pools(4).run(_count_step_collectives, job)):
        world = [c for c in out["calls"] if c[1] == "world"]
        assert len(world) == 1 and world[0][0] in ("all_reduce", "all_to_all_single"), (rank, out["calls"])
        others = [c for c in out["calls"] if c[1] != "world"]
        assert others and all(name == "all_reduce" for name, _ in others), (rank, others)  # dp gradients
        assert not out["first_done_before"] and out["first_done"], rank  # completed by step 2's sums
        assert not out["second_done"] and out["second_done_after_finish"], rank
        assert 0.0 < out["bubble"] < 1.0, (rank, out["bubble"])


def _train_losses(job: dict) -> list[float]:
    return [h["loss"] for h in _train(job)["history"]]


def test_zero_bubble_in_bf16_trains_as_1f1b_at_tp2_pp2(pools, corpus_dir, tmp_path):
    """The GPU default's path under a split backward: bf16 parameters, ZeRO-1's fp32
    gradient buffer, the tensor-parallel GEMMs adding their weight gradients into its
    fp32 main_grad views inside the W (the first chunk inside its undivided B), the
    norms' and embeddings' bf16 gradients added into it by the hooks. zb-v at tp 2 x pp 2
    runs the same bf16 operations on the same values as 1F1B at that layout, each weight
    gradient reaching the fp32 buffer in the same micro-batch order, but its weight
    gradients come from GEMMs of their own (in the W) where 1F1B's backward runs them
    beside the input gradients: a CPU's bf16 kernels may block those sums differently (they
    do with AMX), so the 10 steps' losses agree to one bf16 rounding (helpers.BF16_U). A W
    left out or run twice moves them by far more. Within a run every rank has the same
    losses, bit for bit (one loss, broadcast)."""
    runs = {}
    for schedule, v in (("1f1b", 1), ("zb-v", 2)):
        job = _job(corpus_dir, str(tmp_path / schedule), 4, schedule=schedule, pp=2, tp=2, zero=1,
                   virtual_stages=v)
        job["train"]["dtype"] = "bf16"
        runs[schedule] = pools(4).run(_train_losses, job)
    for ranks in runs.values():
        assert all(losses == ranks[0] for losses in ranks), runs
    assert relative_diff(runs["zb-v"][0], runs["1f1b"][0]) < BF16_U, runs
