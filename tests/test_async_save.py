"""The async checkpoint copies the weights on its own thread: the training thread only lists
them and goes on; the optimizer's next update waits for the copy, so the checkpoint holds
the weights of its step (CPU, one process, the copy slowed down)."""

from __future__ import annotations

import time

import pytest
import torch

from parallel3d.checkpoint import save as save_module
from parallel3d.config import config_from_dict
from parallel3d.topology import Topology
from parallel3d.train.trainer import Trainer

from helpers import tiny_job

pytestmark = pytest.mark.usefixtures("one_thread")
SLOW_S = 1.0  # the background copy's added delay


def test_the_async_save_copies_off_the_training_thread_before_the_next_update(corpus_dir, tmp_path, monkeypatch):
    job = tiny_job(corpus_dir, str(tmp_path / "run"), train={"steps": 4},
                   checkpoint={"async_save": True, "resume": "never"}, observability={"progress": "off"})
    trainer = Trainer(config_from_dict(job), Topology.single(), log=False)
    trainer.run_steps(1)
    copied, threads = [], []
    real = save_module.snapshot

    def slow_snapshot(slots, copy):
        import threading

        threads.append(threading.current_thread().name)
        time.sleep(SLOW_S)  # a large state: the next step's forward runs meanwhile
        out = real(slots, copy)
        copied.append({s.name: s.tensor.clone() for s in out})
        return out
    monkeypatch.setattr(save_module, "snapshot", slow_snapshot)
    at_save = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    t0 = time.perf_counter()
    trainer.checkpointer.save(trainer)
    assert time.perf_counter() - t0 < SLOW_S / 2  # the training thread did not copy
    trainer.train_step()  # its update waited for the copy
    trainer.checkpointer.writer.wait()
    assert threads and all(name.startswith("p3d-checkpoint") for name in threads)
    saved = {name.removeprefix("model/"): t for name, t in copied[0].items() if name.startswith("model/")}
    assert saved and all(torch.equal(saved[n], at_save[n]) for n in saved)  # the saved step's weights
    after = dict(trainer.model.named_parameters())
    assert any(not torch.equal(after[n].detach(), at_save[n]) for n in saved)  # and the update happened
    trainer.close(finished=False)
