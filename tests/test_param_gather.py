"""ZeRO 1/2's parameter all-gather overlapped with the next forward (issue 38, Megatron's
overlap-param-gather): the order of issues and waits on the step, the switch
``parallel.overlap_param_gather``, and the readers outside a forward that must wait first.

The losses with the overlap on (the default) at dp 2 and 4 against ZeRO 0 are
tests/test_zero.py's ``test_zero_stages_match_zero0``; at tp 2 x pp 2 x dp 2 against one
process, with 1F1B and zb-h1, tests/test_train_3d.py's ``1f1b-sp-zero2`` and
``zbh1-sp-zero2-selective``.
"""

from __future__ import annotations

import pytest
import torch

from parallel3d.config import config_from_dict
from parallel3d.topology import Topology
from parallel3d.train.trainer import Trainer

from helpers import tiny_job

pytestmark = pytest.mark.usefixtures("one_thread")

# 0.02 MiB of fp32 = 5242 elements: the tiny model splits into ~10 buckets
SMALL_BUCKET_MB = 0.02


def _job(corpus_dir, run_dir, steps=3, **parallel):
    return tiny_job(corpus_dir, run_dir, parallel={"dp": 2, "zero": 1, "bucket_mb": SMALL_BUCKET_MB, **parallel},
                    train={"steps": steps, "grad_clip": 0.5})


class _Recorded:
    """A real all-gather's work handle that notes when the forward waits for it."""

    def __init__(self, work, bucket: int, log: list):
        self.work, self.bucket, self.log = work, bucket, log

    def wait(self):
        self.log.append(("wait", self.bucket))
        return self.work.wait()


def _gather_order(job: dict) -> dict:
    """Step 1, then step 2 with step 1's all-gathers wrapped (in their issue order) and the
    top-level modules' forwards noted; the losses of three steps."""
    cfg = config_from_dict(job)
    trainer = Trainer(cfg, Topology(1, 1, cfg.parallel.dp))
    opt, model = trainer.optimizer, trainer.model
    losses = [trainer.train_step()["loss"]]
    log: list = []
    issued = list(opt._gathers)  # dict order: the order apply() issued them
    for b in issued:
        opt._gathers[b] = _Recorded(opt._gathers[b], b, log)
    names = ["embed_tokens"] + [f"layers.{i}" for i in range(len(model.layers))] + ["norm", "lm_head"]
    handles = [model.get_submodule(n).register_forward_pre_hook(
        lambda m, a, n=n: log.append(("forward", n)) if len(log) < 1000 else None) for n in names]
    losses.append(trainer.train_step()["loss"])
    for h in handles:
        h.remove()
    losses.append(trainer.train_step()["loss"])
    trainer.close()
    bucket_of = {}
    index = {id(p): i for i, p in enumerate(opt.params)}
    for n in names:
        bucket_of[n] = sorted({opt.layout.location[index[id(p)]][0] for p in model.get_submodule(n).parameters()})
    return {"issued": issued, "log": log, "n_buckets": len(opt.layout.buckets), "bucket_of": bucket_of,
            "losses": losses, "pending_after_close": len(opt._gathers)}


def test_forward_waits_per_bucket_in_the_order_it_needs_them(pools, corpus_dir, tmp_path):
    """Step 1's all-gathers are issued last bucket first (the first layers' parameters);
    step 2's forward waits for each bucket just before the first module reading it: the
    embedding waits for its own bucket only, layer 0's forward starts before the last
    bucket (the head's) is waited for, each bucket is waited for once. With
    ``overlap_param_gather = false`` nothing is left in flight after a step and the losses
    are the same bit for bit (the same all-gathers, waited for earlier)."""
    on = pools(2).run(_gather_order, _job(corpus_dir, str(tmp_path / "on")))
    off = pools(2).run(_gather_order, _job(corpus_dir, str(tmp_path / "off"), overlap_param_gather=False))
    for got, plain in zip(on, off):
        n, log = got["n_buckets"], got["log"]
        assert n >= 5 and got["issued"] == list(reversed(range(n)))
        waits = [b for kind, b in log if kind == "wait"]
        assert sorted(waits) == list(range(n))  # each bucket waited for once
        forwards = [name for kind, name in log if kind == "forward"]
        assert forwards[:2] == ["embed_tokens", "layers.0"]
        at = {}  # first occurrence (the step runs several micro-batches' forwards)
        for k, event in enumerate(log):
            at.setdefault(event, k)
        # before the embedding's forward: its own buckets' waits only
        assert {b for kind, b in log[:at[("forward", "embed_tokens")]] if kind == "wait"} \
            <= set(got["bucket_of"]["embed_tokens"])
        # layer 0 computes while the head's bucket (bucket 0) is still in flight
        assert at[("forward", "layers.0")] < at[("wait", 0)]
        # each bucket is waited for inside the window of the first top-level module reading
        # it (after the previous module's forward began, before the next one's): its own
        # turn, not all at the first layer
        order = forwards[:forwards.index("lm_head") + 1]  # the first micro-batch's
        for b in range(n):
            first = next(k for k, name in enumerate(order) if b in got["bucket_of"][name])
            lo = at[("forward", order[first - 1])] if first > 0 else -1
            hi = at[("forward", order[first + 1])] if first + 1 < len(order) else len(log)
            assert lo < at[("wait", b)] < hi, (b, order[first])
        assert got["pending_after_close"] == 0
        # overlap off: apply() waited for all of them, the forward found none in flight
        assert plain["issued"] == [] and ("forward", "layers.0") in plain["log"]
        assert [e for e in plain["log"] if e[0] == "wait"] == []
        assert got["losses"] == plain["losses"]


class _LateGather:
    """An all-gather still in flight: the bucket holds NaN until it is waited for."""

    def __init__(self, region: torch.Tensor, values: torch.Tensor):
        self.region, self.values = region, values

    def wait(self) -> None:
        self.region.copy_(self.values)


def _late_gathers(opt) -> None:
    opt.finish_param_gather()  # the real ones, then stand-ins that arrive when waited for
    values = opt.param_buffer.clone()
    opt.param_buffer.fill_(float("nan"))
    for b in opt.layout.buckets:
        region = slice(b.offset, b.offset + b.numel)
        opt._gathers[b.index] = _LateGather(opt.param_buffer[region], values[region])


def _save_and_evaluate_with_gathers_in_flight(job: dict) -> dict:
    from parallel3d.checkpoint.reader import CheckpointReader, find_checkpoint

    cfg = config_from_dict(job)
    trainer = Trainer(cfg, Topology(1, 1, cfg.parallel.dp))
    trainer.train_step()
    _late_gathers(trainer.optimizer)
    val = trainer.evaluate()
    want = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    _late_gathers(trainer.optimizer)
    trainer.checkpointer.save(trainer)
    trainer.checkpointer.writer.wait()
    with CheckpointReader(find_checkpoint(trainer.checkpointer.root)) as reader:
        saved = {n: reader.read("model/" + n) for n in want}
    trainer.release(close_watch=True)
    return {"val": val, "same": all(torch.equal(saved[n], want[n]) for n in want),
            "finite": all(torch.isfinite(t).all() for t in want.values())}


def test_checkpoint_and_evaluation_right_after_a_step_wait_for_the_gathers(pools, corpus_dir, tmp_path):
    """After a step every bucket's all-gather is still in flight (here: NaN until waited
    for); an evaluation and a checkpoint saved at once read the gathered values, not
    NaN: the evaluation's forward waits for each module's buckets, the checkpoint calls
    ``finish_param_gather`` first."""
    job = _job(corpus_dir, str(tmp_path), steps=1)
    job["eval"] = {"interval": 5, "batches": 1}  # (validation windows are built when it is on)
    job["data"]["val_fraction"] = 0.1
    job["checkpoint"] = {"interval": 1}
    for got in pools(2).run(_save_and_evaluate_with_gathers_in_flight, job):
        assert got["finite"] and got["same"]
        assert got["val"] == got["val"] and got["val"] < 10  # not NaN


def _steps_with_gathers_in_flight(job: dict) -> dict:
    """Each step after the first starts with every bucket's all-gather of every optimizer
    part still in flight (NaN until waited for), when the overlap is on. Also the
    modules that wait for gathers, counted: the experts' containers, and any of their
    descendants (whose forwards never run)."""
    from parallel3d.models.moe.experts import Experts
    from parallel3d.zero.params import bucket_readers

    cfg = config_from_dict(job)
    trainer = Trainer(cfg, Topology.of(cfg.parallel))
    parts = getattr(trainer.optimizer, "parts", (trainer.optimizer,))
    readers = [m for part in parts for m, _ in bucket_readers(trainer.model, part.params, part.layout)]
    inside = {id(d) for m in trainer.model.modules() if isinstance(m, Experts) for d in m.modules() if d is not m}
    losses = [trainer.train_step()["loss"]]
    for _ in range(2):
        for part in parts:
            if job["parallel"].get("overlap_param_gather", True):
                _late_gathers(part)
        losses.append(trainer.train_step()["loss"])
    trainer.close()
    return {"losses": losses, "containers": sum(isinstance(m, Experts) for m in readers),
            "inside": sum(id(m) in inside for m in readers)}


def test_a_module_computing_its_childrens_weights_waits_for_them(pools, corpus_dir, tmp_path):
    """A Mixture-of-Experts block's experts are computed by their container (one grouped
    GEMM over the held experts' weights), whose children's own forwards never run: the
    container waits for their buckets. Gathers still in flight at each step give the
    losses of the run without overlap, bit for bit (before the fix, the experts read NaN;
    on a real run, the previous step's weights whenever the gather was slower than the
    layers before them: a loss that depends on timing)."""
    def job(name, **par):
        j = _job(corpus_dir, str(tmp_path / name), **par)
        j["model"].update(preset="debug-moe", n_layers=2)
        return j
    late = pools(2).run(_steps_with_gathers_in_flight, job("late"))
    plain = pools(2).run(_steps_with_gathers_in_flight, job("plain", overlap_param_gather=False))
    for got, want in zip(late, plain):
        assert got["losses"] == want["losses"], (got, want)
        assert got["containers"] == 1 and got["inside"] == 0  # debug-moe at 2 layers: layer 1 is sparse


def _read_right_after_a_step(job: dict) -> dict:
    from parallel3d.zero.guard import guard

    cfg = config_from_dict(job)
    trainer = Trainer(cfg, Topology(1, 1, cfg.parallel.dp))
    opt = trainer.optimizer
    opt.read_waits = []
    trainer.train_step()
    trainer.train_step()
    steps_read = list(opt.read_waits)  # the trainer's own reads between steps: none
    guarded = [type(p).__name__ for p in opt.params]
    in_flight = len(opt._gathers)
    name, p = next(iter(trainer.model.named_parameters()))
    meta = (tuple(p.shape), p.numel())  # metadata waits for nothing
    waits_after_meta = len(opt.read_waits)
    first = p.detach().clone()  # a read of the elements: its bucket waited for first
    waited = list(opt.read_waits)
    # the same read with the values held back (NaN until waited for, as _late_gathers)
    _late_gathers(opt)
    for q in opt.params:
        guard(q, opt._read_in_flight)
    late = p.detach().clone()
    opt.finish_param_gather()
    trainer.close()
    return {"steps_read": steps_read, "guarded": guarded, "in_flight": in_flight, "meta": meta,
            "waits_after_meta": waits_after_meta, "waited": waited, "n": len(opt.params),
            "bucket": opt.layout.location[next(i for i, q in enumerate(opt.params) if q is p)][0],
            "shape": list(first.shape), "same": torch.equal(first, p.detach()),
            "late_finite": bool(torch.isfinite(late).all()), "late_same": torch.equal(late, p.detach()),
            "plain": type(p) is torch.nn.Parameter}


def test_a_read_outside_a_forward_waits_for_its_bucket(pools, corpus_dir, tmp_path):
    """Right after a step every bucket's all-gather is in flight and its parameters are
    guarded: reading one (here ``p.detach()``) first waits for its own bucket, so it sees
    the new weights, never a torn mix (with the values held back until the wait: no NaN);
    its shape reads without waiting. The trainer itself reads no parameter between steps
    (no wait recorded over two steps: the overlap is kept)."""
    for got in pools(2).run(_read_right_after_a_step, _job(corpus_dir, str(tmp_path))):
        assert got["steps_read"] == []
        assert got["in_flight"] >= 5 and all(name == "GuardedParameter" for name in got["guarded"])
        assert list(got["meta"][0]) == got["shape"] and got["waits_after_meta"] == 0
        assert got["waited"] == [(got["bucket"], "detach")]
        assert got["same"] and got["late_finite"] and got["late_same"] and got["plain"]
