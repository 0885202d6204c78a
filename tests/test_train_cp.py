"""Context parallelism in training: each sequence split over the cp ranks (head-tail
chunks), attention over the whole sequence, gradients averaged over dp x cp; the losses
of every layout equal one process's (fp32, 1e-5, the parity bar of every layout test)."""

from __future__ import annotations

import pytest

from parallel3d.config import config_from_dict
from parallel3d.topology import Topology
from parallel3d.train.trainer import Trainer

from helpers import relative_diff, tiny_job, torch_threads

STEPS = 10


def _job(corpus_dir, run_dir, **parallel) -> dict:
    # seq_len 32 cuts into 2 x cp = 8 chunks at cp 4; global 8 / micro 2 = 4 micro-batches
    # >= pp; validation at steps 5 and 10 (a tenth of the corpus held out), through the
    # pipeline's forward-only pass where pp > 1
    return tiny_job(corpus_dir, run_dir, train={"steps": STEPS, "global_batch": 8, "micro_batch": 2,
                                                "grad_clip": 0.5},
                    eval={"interval": 5, "batches": 1}, data={"val_fraction": 0.1}, parallel=parallel)


def _train(job: dict) -> dict:
    cfg = config_from_dict(job)
    trainer = Trainer(cfg, Topology.of(cfg.parallel))
    history = trainer.fit()
    return {"losses": [h["loss"] for h in history], "val": [h.get("val_loss") for h in history]}


@pytest.fixture(scope="module")
def reference(corpus_dir, tmp_path_factory):
    with torch_threads(1):
        return _train(_job(corpus_dir, str(tmp_path_factory.mktemp("ref"))))


@pytest.mark.parametrize("parallel", [
    {"cp": 2, "cp_comm": "allgather"},
    {"cp": 2, "cp_comm": "ring"},
    {"cp": 4, "cp_comm": "allgather"},
    {"cp": 4, "cp_comm": "ring"},
    {"cp": 2, "dp": 2, "zero": 2},
    {"tp": 2, "cp": 2, "pp": 2, "sequence_parallel": True, "schedule": "1f1b", "zero": 1},
    {"tp": 2, "cp": 2, "pp": 2, "sequence_parallel": True, "schedule": "zb-h1", "cp_comm": "ring"},
], ids=lambda p: "-".join(f"{k}{v}" for k, v in p.items()))
def test_context_parallel_trains_as_one_process(pools, corpus_dir, tmp_path, reference, parallel):
    parallel = {"tp": 1, "pp": 1, "dp": 1, **parallel}
    world = parallel["tp"] * parallel["pp"] * parallel["dp"] * parallel["cp"]
    ranks = pools(world).run(_train, _job(corpus_dir, str(tmp_path), **parallel))
    for got in ranks:
        assert relative_diff(got["losses"], reference["losses"]) < 1e-5, (got["losses"], reference["losses"])
        vals = [v for v in got["val"] if v is not None]
        ref_vals = [v for v in reference["val"] if v is not None]
        assert len(vals) == len(ref_vals) == 2 and relative_diff(vals, ref_vals) < 1e-5


def _chat_job(data: str, run_dir: str, **parallel) -> dict:
    job = tiny_job("", run_dir, model={"vocab_size": 640, "n_layers": 2},
                   train={"steps": STEPS, "global_batch": 8, "micro_batch": 1, "seq_len": 128,
                          "grad_clip": 0.0, "warmup_steps": 1}, parallel=parallel)
    job["data"] = {"path": data}
    return job


def test_packed_chat_documents_at_cp2_train_as_one_process(pools, chat_data, tmp_path):
    """Documents cross the chunk boundaries of the head-tail split: each rank's attention
    keeps to its tokens' documents (their starts derived from its positions) and the
    masked loss's divisor counts the replicas dp x cp."""
    ref = pools(1).run(_train, _chat_job(chat_data, str(tmp_path / "ref")))[0]
    for comm in ("allgather", "ring"):
        for got in pools(2).run(_train, _chat_job(chat_data, str(tmp_path / comm), cp=2, cp_comm=comm)):
            assert relative_diff(got["losses"], ref["losses"]) < 1e-5, (comm, got["losses"], ref["losses"])


def _losses_until(job: dict, stop_at: int | None = None) -> list[float]:
    cfg = config_from_dict(job)
    return [r["loss"] for r in Trainer(cfg, Topology.of(cfg.parallel)).fit(stop_at=stop_at)]


def test_a_cp_checkpoint_resumes_exactly_and_reshards_across_cp(pools, corpus_dir, tmp_path):
    """cp is replication of the weights: a checkpoint of dp 2 x cp 2 with ZeRO 1 (moments
    sharded over the 4 replicas) resumes there bit for bit and continues at cp 1 (dp 4)
    and at cp 4 with the straight run's losses (fp32 1e-5, the layouts' parity bar)."""
    def job(name, **par):
        j = _job(corpus_dir, str(tmp_path / name), zero=1, bucket_mb=0.05, **par)
        j["eval"]["interval"] = 0
        j["checkpoint"] = {"interval": 2, "keep": 0}
        return j

    four = pools(4)
    straight = four.run(_losses_until, job("straight", dp=2, cp=2))[0]
    first = four.run(_losses_until, job("resumed", dp=2, cp=2), 4)[0]
    again = four.run(_losses_until, job("resumed", dp=2, cp=2))[0]
    assert first + again == straight
    stopped = str(tmp_path / "resumed" / "checkpoints" / "step_00000004")
    for par in ({"dp": 4, "cp": 1}, {"dp": 1, "cp": 4}):
        other = job("at-" + "-".join(map(str, par.values())), **par)
        other["checkpoint"]["resume"] = stopped
        continued = four.run(_losses_until, other)[0]
        assert relative_diff(continued, straight[4:]) < 1e-5, (par, continued, straight[4:])
