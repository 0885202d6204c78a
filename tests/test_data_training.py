"""Training on prepared data: the sampler resumes at exactly the next sample, prefetch
hides the data time (and records the wait), and the validation loss is what it says."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from parallel3d.config import config_from_dict
from parallel3d.data.format import open_dataset
from parallel3d.data.loader import PrefetchLoader
from parallel3d.data.sampler import GlobalBatchSampler, TokenWindows
from parallel3d.errors import UserError
from parallel3d.topology import Topology
from parallel3d.train.trainer import Trainer

from helpers import tiny_job_on


pytestmark = pytest.mark.usefixtures("one_thread")


def _global_steps(samplers, steps: int) -> list[list[int]]:
    """Advance every dp rank's sampler ``steps`` steps; the global batch of each step."""
    out = []
    for _ in range(steps):
        out.append([i for s in samplers for mb in s.next_step() for i in mb])
    return out


def test_sampler_resumes_from_a_json_state_at_the_next_sample():
    # 103 samples, 12 per step: epochs end inside steps 8, 17, 25.
    make = lambda dp, micro: [GlobalBatchSampler(103, 12, micro, dp, r, seed=5, fingerprint="abc")  # noqa: E731
                              for r in range(dp)]
    whole = _global_steps(make(1, 4), 30)
    first = make(3, 2)
    head = _global_steps(first, 9)
    state = json.loads(json.dumps(first[0].state_dict()))
    assert state["consumed_samples"] == 9 * 12 and state["epoch"] == 1
    resumed = make(2, 3)  # another dp layout: the position counts samples, not steps
    for s in resumed:
        s.load_state_dict(state)
    assert head + _global_steps(resumed, 21) == whole
    for bad in ({**state, "seed": 6}, {**state, "dataset": "other"}, {**state, "num_samples": 104}):
        with pytest.raises(UserError, match="cannot resume the sampler"):
            make(1, 4)[0].load_state_dict(bad)


def _train_recording(job: dict, state: dict | None = None, start_step: int = 0):
    """Train; return the (inputs, targets) token ids each step consumed and the sampler
    state at the end."""
    trainer = Trainer(config_from_dict(job), Topology(1, 1, 1), log=False)
    if state is not None:
        trainer.data.loader.load_state_dict(state)
        trainer.step = start_step
    seen = []
    run = trainer.schedule.run

    def recording(micro_batches, **kw):
        seen.append(torch.cat([torch.cat([x, y[:, -1:]], dim=1) for x, y in micro_batches]))
        return run(micro_batches, **kw)

    trainer.schedule.run = recording
    history = trainer.fit()
    return seen, trainer.data.loader.state_dict(), history


def test_training_resumes_at_exactly_the_next_sample(prepared_dir, tmp_path):
    """Run 2 steps, save the data position (through JSON), start a fresh trainer from it:
    the token ids it trains on continue exactly those of an uninterrupted 5-step run,
    although the first run's prefetch thread had read ahead."""
    job = lambda steps: tiny_job_on(prepared_dir, str(tmp_path), train={"steps": steps})  # noqa: E731
    whole, _, _ = _train_recording(job(5))
    head, state, _ = _train_recording(job(2))
    state = json.loads(json.dumps(state))
    assert state["consumed_samples"] == 2 * 8
    tail, _, _ = _train_recording(job(5), state, start_step=2)
    assert len(head) == 2 and len(tail) == 3
    for step, (a, b) in enumerate(zip(head + tail, whole)):
        assert torch.equal(a, b), f"step {step} trained on other tokens"
    # the windows come from the prepared shards, at the positions the sampler chose
    tokens = open_dataset(prepared_dir).split("train")
    first_idx = [i for mb in GlobalBatchSampler((len(tokens) - 1) // 32, 8, 2, 1, 0, seed=7).indices_at(0)
                 for i in mb]
    expect = np.stack([tokens[i * 32: i * 32 + 33] for i in first_idx]).astype(np.int64)
    assert torch.equal(whole[0], torch.from_numpy(expect))


class _SlowWindows(TokenWindows):
    """Reading a micro-batch takes ``delay`` seconds (a slow file system)."""

    def __init__(self, delay: float):
        super().__init__(np.arange(20_000) % 500, 16)
        self.delay = delay

    def batch(self, indices):
        time.sleep(self.delay)
        return super().batch(indices)


@pytest.mark.parametrize("depth", [0, 2])
def test_prefetch_hides_the_data_time_and_reports_the_wait(depth):
    read_s, compute_s = 0.03, 0.15  # per micro-batch (2 per step) and per step
    windows = _SlowWindows(read_s)
    sampler = GlobalBatchSampler(windows.num_samples, 8, 4, 1, 0, seed=1)
    loader = PrefetchLoader(windows, sampler, torch.device("cpu"), depth=depth)
    reference = GlobalBatchSampler(windows.num_samples, 8, 4, 1, 0, seed=1)
    waits = []
    for _ in range(6):
        batches, wait = loader.next()
        waits.append(wait)
        for (x, _), idx in zip(batches, reference.next_step()):  # the same data either way
            assert torch.equal(x, TokenWindows.batch(windows, idx)[0])
        time.sleep(compute_s)  # the step's compute, during which the thread reads ahead
    loader.close()
    if depth == 0:
        assert min(waits) >= 2 * read_s  # sleep() waits at least that long
    else:
        # From the second step the next batch was read during the previous step's
        # compute; 20 ms is slack for thread scheduling on a loaded 2-core machine.
        assert max(waits[1:]) < 0.02, waits


def test_validation_loss_is_the_mean_over_the_held_out_tokens(prepared_dir, tmp_path):
    job = tiny_job_on(prepared_dir, str(tmp_path), train={"steps": 4}, eval={"interval": 2, "batches": 2})
    trainer = Trainer(config_from_dict(job), Topology(1, 1, 1), log=False)
    history = trainer.fit()
    assert [("val_loss" in r) for r in history] == [False, True, False, True]
    assert all(r["data_wait_s"] >= 0 for r in history)
    # Independently: the first 2 global batches (16 sequences) of the validation split's
    # epoch-0 permutation, in one forward, one mean over all their tokens.
    val = open_dataset(prepared_dir).split("val")
    n = (len(val) - 1) // 32
    idx = np.random.default_rng([7, 0]).permutation(n)[:16]
    rows = torch.from_numpy(np.stack([val[i * 32: i * 32 + 33] for i in idx]).astype(np.int64))
    with torch.no_grad():
        logits = trainer.model(rows[:, :-1])
    expect = F.cross_entropy(logits.flatten(0, 1).float(), rows[:, 1:].flatten()).item()
    # fp32; the trainer averages 8 micro-batch means (2 batches of 4) of equal size instead
    # of taking one mean: the same number summed in another order.
    assert abs(history[-1]["val_loss"] - expect) < 1e-5 * expect
    assert history[1]["val_loss"] != history[3]["val_loss"]


def test_too_small_validation_split_is_a_clear_error(prepared_dir, tmp_path):
    job = tiny_job_on(prepared_dir, str(tmp_path), eval={"interval": 1, "batches": 10_000})
    with pytest.raises(UserError, match=r"the validation split holds \d+ sequences .* fewer than eval.batches 10000"):
        Trainer(config_from_dict(job), Topology(1, 1, 1), log=False)


def test_stdlib_corpus_is_a_prepared_dataset(corpus_dir):
    from pathlib import Path

    # the session's corpus (1 MB, the default 2% held out); tests that validate add variants
    # with another val_fraction beside it in the same cache
    (ds,) = [ds for ds in (open_dataset(p) for p in Path(corpus_dir).iterdir() if p.name.startswith("stdlib-"))
             if ds.index["source"]["max_bytes"] == 1_000_000 and ds.index["source"]["val_fraction"] == 0.02]
    d = ds.dir
    assert ds.num_tokens("train") > 100_000
    assert (d / "tokenizer" / "tokenizer.json").is_file()


BUILD_STDLIB = """
import sys
from parallel3d.config import DataConfig
from parallel3d.data.stdlib import prepare_stdlib
print(prepare_stdlib(DataConfig(max_bytes=150_000, vocab_size=300, cache_dir=sys.argv[1])).fingerprint)
"""


def test_two_processes_building_the_stdlib_corpus_at_once_agree(tmp_path):
    """No lock: each builds it in its own temporary directory and renames that into
    place; the loser keeps the winner's. Both read the same data, nothing is left over."""
    import subprocess
    import sys

    procs = [subprocess.Popen([sys.executable, "-c", BUILD_STDLIB, str(tmp_path)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [err for _, err in outs]
    fingerprints = [out.strip() for out, _ in outs]
    assert fingerprints[0] == fingerprints[1]
    (built,) = list(tmp_path.iterdir())
    assert built.name.startswith("stdlib-") and open_dataset(built).fingerprint == fingerprints[0]
