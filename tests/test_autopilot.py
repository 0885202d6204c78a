"""The autopilot in running jobs (gloo, CPU): it moves a slow layout inside the running
processes and every loss stays that of one process from the same seed; a failure in the
middle of the move leaves a checkpoint at the old layout that resumes exactly; a job at
its best layout stays. The decision itself is tested on hand-worked numbers in
test_fitted.py; the 200-step measurement of the default job is benchmarks/bench_autopilot.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from parallel3d.config import config_from_dict
from parallel3d.testing import DistributedTestError
from parallel3d.topology import Topology
from parallel3d.train.trainer import Trainer

from helpers import relative_diff, tiny_job

STEPS = 14
pytestmark = pytest.mark.usefixtures("one_thread")


def _job(corpus_dir, run_dir, tp, dp, cp=1, **autopilot) -> dict:
    # decide at step 2 + 4 = 6, check the move at 12; move_cost_s: a 14-step run cannot
    # pay the estimated cost of a move (the first build's seconds), which is not what
    # these tests are about (test_fitted.py tests that rule)
    return tiny_job(corpus_dir, str(run_dir), train={"steps": STEPS, "autopilot": True},
                    parallel={"tp": tp, "pp": 1, "dp": dp, "cp": cp, "sequence_parallel": tp > 1, "zero": 1},
                    autopilot={"skip_steps": 2, "measure_steps": 4, "move_cost_s": 1e-3, **autopilot},
                    observability={"progress": "off"})


def _reference(job: dict) -> list[float]:
    one = json.loads(json.dumps(job))
    one["parallel"] = {"tp": 1, "pp": 1, "dp": 1}
    one["train"]["autopilot"] = False
    one["run"]["dir"] += "-reference"
    return [r["loss"] for r in Trainer(config_from_dict(one), Topology.single(), log=False).fit()]


def _autopilot(job: dict, fail_move: bool = False) -> list[float]:
    import parallel3d.train.regroup as regroup
    from parallel3d.train.pilot import fit_with_autopilot, timed_trainer

    if fail_move:
        def fail(*args, **kwargs):
            raise RuntimeError("injected failure while regrouping")
        regroup.new_topology = fail
    cfg, par = config_from_dict(job), job["parallel"]

    def make(c, topo):
        return Trainer(c, topo)
    trainer, build_s = timed_trainer(lambda: make(cfg, Topology.of(cfg.parallel)))
    return [r["loss"] for r in fit_with_autopilot(trainer, make, build_s)]


def _events(run_dir: Path) -> list[dict]:
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in lines if r.get("event") == "autopilot"]


def _steps(run_dir: Path) -> list[int]:
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["step"] for r in lines if "event" not in r]


def test_a_tp2_job_moves_inside_its_processes_and_keeps_every_loss(pools, corpus_dir, tmp_path):
    job = _job(corpus_dir, tmp_path / "run", tp=2, dp=2)
    losses = pools(4).run(_autopilot, job, timeout=600)[0]
    events = _events(tmp_path / "run")
    first = events[0]
    # tensor parallelism on gloo costs every layer 8 collectives: a tp 1 layout wins
    assert first["action"] == "move" and first["step"] == 6, first
    assert first["from"].startswith("tp2 pp1 dp2") and first["to"].startswith("tp1"), first
    assert first["ranked"][0]["layout"] == first["to"] and first["fitting"] >= 1
    assert events[1]["action"] == "move done" and events[2]["step"] == 12
    assert events[2]["action"] in ("confirmed", "move back")
    # every step once, in order; the layout of the checkpoint the move wrote is the old one
    assert _steps(tmp_path / "run") == list(range(1, STEPS + 1))
    index = json.loads((tmp_path / "run" / "checkpoints" / "step_00000006" / "index.json").read_text())
    assert (index["layout"]["tp"], index["layout"]["dp"]) == (2, 2)
    # fp32: other layouts add the same products in another order; 1e-5 is the parity bar
    assert relative_diff(losses, _reference(job)) < 1e-5


def test_a_context_parallel_job_moves_across_cp_and_keeps_every_loss(pools, corpus_dir, tmp_path):
    """cp 2 x dp 2: the fitted model counts the rank's half of each sequence and the K/V
    all-gathers of every layer (on gloo a collective step costs ~1 ms): a cp 1 layout wins,
    the move reshards across cp inside the processes, and every loss is one process's."""
    job = _job(corpus_dir, tmp_path / "run", tp=1, dp=2, cp=2)
    losses = pools(4).run(_autopilot, job, timeout=600)[0]
    events = _events(tmp_path / "run")
    first = events[0]
    assert first["action"] == "move" and first["step"] == 6, first
    assert first["from"].startswith("tp1 cp2 pp1 dp2") and " cp" not in first["to"], first
    assert events[1]["action"] == "move done" and events[2]["action"] in ("confirmed", "move back")
    index = json.loads((tmp_path / "run" / "checkpoints" / "step_00000006" / "index.json").read_text())
    assert (index["layout"]["cp"], index["layout"]["dp"]) == (2, 2)
    assert _steps(tmp_path / "run") == list(range(1, STEPS + 1))
    assert relative_diff(losses, _reference(job)) < 1e-5


def test_a_failure_during_the_move_leaves_the_run_resumable_at_the_old_layout(pools, corpus_dir, tmp_path):
    job = _job(corpus_dir, tmp_path / "run", tp=2, dp=2)
    with pytest.raises(DistributedTestError, match="injected failure while regrouping"):
        pools(4).run(_autopilot, job, True, timeout=600)
    root = tmp_path / "run" / "checkpoints"
    assert (root / "latest").read_text().strip() == "step_00000006"
    index = json.loads((root / "step_00000006" / "index.json").read_text())
    assert (index["layout"]["tp"], index["layout"]["pp"], index["layout"]["dp"]) == (2, 1, 2)
    # started again (the autopilot off): it resumes there at the old layout, and the run
    # has the losses of one that never moved
    job["train"]["autopilot"] = False
    resumed = pools(4).run(_resume, job, timeout=600)[0]
    assert resumed["resumed_at"] == 6 and resumed["layout"] == (2, 1, 2)
    steps = _steps(tmp_path / "run")
    assert steps == list(range(1, STEPS + 1))
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records if "event" not in r]
    assert relative_diff(losses, _reference(job)) < 1e-5


def _resume(job: dict) -> dict:
    par = job["parallel"]
    trainer = Trainer(config_from_dict(job), Topology(par["tp"], par["pp"], par["dp"]))
    at = trainer.step
    trainer.fit()
    return {"resumed_at": at, "layout": (trainer.topo.tp, trainer.topo.pp, trainer.topo.dp)}


def test_a_job_at_its_best_layout_does_not_move(pools, corpus_dir, tmp_path):
    job = _job(corpus_dir, tmp_path / "run", tp=1, dp=4)
    job["parallel"]["zero"] = 0
    losses = pools(4).run(_autopilot, job, timeout=600)[0]
    (event,) = _events(tmp_path / "run")
    assert event["action"] == "stay" and event["from"] == event["to"], event
    assert len(losses) == STEPS


def test_the_report_shows_the_move_and_the_decisions():
    from parallel3d.observe.report import build_figure, summary

    records = [{"step": s, "loss": 5.0 - s / 100, "tokens_per_s": 1000.0 if s <= 25 else 2000.0,
                "step_time_s": 2.0 if s <= 25 else 1.0} for s in range(1, 61)]
    events = [{"step": 25, "event": "autopilot", "action": "move", "from": "tp2 pp2 dp2", "to": "tp1 pp1 dp8",
               "measured_step_s": 2.0, "predicted_current_s": 2.0, "predicted_step_s": 0.9,
               "reason": "predicted 55% faster"},
              {"step": 25, "event": "autopilot", "action": "move done", "to": "tp1 pp1 dp8", "move_s": 1.0},
              {"step": 50, "event": "autopilot", "action": "confirmed", "reason": "measured 1000 ms against 900"}]
    fig = build_figure(records, None, "run", (), events)
    loss, throughput, breakdown = fig.axes[0], fig.axes[1], fig.axes[2]
    for ax in (loss, throughput, breakdown):  # a vertical line at the step of the move
        assert any(list(line.get_xdata()) == [25, 25] for line in ax.get_lines()), ax.get_title()
    assert any("tp1 pp1 dp8" in t.get_text() for t in loss.texts)
    assert "since step 25 (moved by the autopilot)" not in fig._suptitle.get_text()  # no job: no layout line
    text = summary(records, events)
    assert "autopilot, step 25: move tp2 pp2 dp2 (2000 ms measured) -> tp1 pp1 dp8 (900 ms predicted)" in text
    assert "autopilot, step 50: confirmed: measured 1000 ms against 900" in text


def _tensors(obj, depth: int = 4, seen=None) -> list:
    """Every tensor reachable from ``obj`` through attributes, dicts, lists and tuples."""
    import torch

    seen = set() if seen is None else seen
    if id(obj) in seen or depth < 0:
        return []
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        return [obj] + ([obj.grad] if obj.grad is not None else [])
    if isinstance(obj, dict):
        items = list(obj.keys()) + list(obj.values())
    elif isinstance(obj, (list, tuple, set)):
        items = list(obj)
    elif hasattr(obj, "__dict__") and not isinstance(obj, type):
        items = list(vars(obj).values())
    else:
        return []
    return [t for item in items for t in _tensors(item, depth - 1, seen)]


def test_the_move_frees_the_old_trainer_before_the_new_one_allocates(corpus_dir, tmp_path, monkeypatch):
    """The move's peak is one trainer's state: every parameter, gradient and optimizer
    buffer of the old trainer is dead when the new trainer's optimizer allocates, and the
    losses after the move are those of a run that never moved."""
    import weakref

    import parallel3d.train.regroup as regroup
    import parallel3d.train.trainer as trainer_module
    from parallel3d.planner.spec import Layout

    job = tiny_job(corpus_dir, str(tmp_path / "run"), train={"steps": 4}, observability={"progress": "off"})
    cfg = config_from_dict(job)
    straight = [r["loss"] for r in Trainer(config_from_dict({**job, "run": {"dir": str(tmp_path / "ref")}}),
                                           Topology.single(), log=False).fit()]
    trainer = Trainer(cfg, Topology.single(), log=False)
    losses = [r["loss"] for r in trainer.run_steps(2)]
    old = [weakref.ref(t) for t in _tensors(trainer.model) + _tensors(trainer.optimizer)]
    assert len(old) > 10 and any(t().grad is None and t().dim() == 1 for t in old)  # reached the buffers
    alive_at_build = []
    build = trainer_module.build_optimizer

    def checked(*args, **kwargs):
        alive_at_build.append(sum(r() is not None for r in old))
        return build(*args, **kwargs)
    monkeypatch.setattr(trainer_module, "build_optimizer", checked)
    monkeypatch.setattr(regroup, "new_topology", lambda layout, topo: Topology.single())
    new, _ = regroup.move(trainer, Layout.from_config(cfg), lambda c, topo: Trainer(c, topo, log=False))
    assert alive_at_build == [0]
    assert new.step == 2
    losses += [r["loss"] for r in new.run_steps(4)]
    new.close()
    assert losses == straight


def test_the_probe_holds_one_probe_model_at_a_time(monkeypatch):
    """Each probe model is built, run and freed (gradients included) before the next: at
    most one exists at any time, and none once a round is over."""
    import gc
    import weakref

    import torch

    from parallel3d.autopilot.probe import ComputeProbe
    from parallel3d.models.llama import model as llama_module

    built, alive_at_build = [], []
    init = llama_module.Llama.__init__

    def counted(self, *args, **kwargs):
        gc.collect()
        alive_at_build.append(sum(r() is not None for r in built))
        init(self, *args, **kwargs)
        built.append(weakref.ref(self))
    monkeypatch.setattr(llama_module.Llama, "__init__", counted)
    cfg = llama_module.LlamaConfig(vocab_size=256, n_layers=2, dim=64, n_heads=4, n_kv_heads=2, ffn_dim=128)
    probe = ComputeProbe(cfg, [1, 2], micro_batch=1, seq_len=16, device=torch.device("cpu"))
    for _ in range(2):
        probe.round()
    gc.collect()
    assert len(built) == 12 and alive_at_build == [0] * 12
    assert all(r() is None for r in built)
    assert set(probe.result()) == {1, 2}
