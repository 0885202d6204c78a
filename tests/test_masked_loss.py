"""Masked loss, normalised over the global batch: every loss path skips ignored targets, and
a step's loss is the mean over every supervised token of the global batch whatever the
split into micro-batches, pipeline stages and data-parallel ranks (issue 19, point 3)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from parallel3d.config import config_from_dict
from parallel3d.data.batch import IGNORE_INDEX
from parallel3d.models.llama.sharded_init import init_llama_
from parallel3d.models.llama import Llama
from parallel3d.models.llama.parallelize import cross_entropy_loss
from parallel3d.topology import Topology
from parallel3d.train.trainer import Trainer

from helpers import relative_diff, tiny_job

pytestmark = pytest.mark.usefixtures("one_thread")

STEPS = 3
SEQ = 128


def _targets_with_ignored(shape, vocab, seed):
    gen = torch.Generator().manual_seed(seed)
    targets = torch.randint(0, vocab, shape, generator=gen)
    targets[torch.rand(shape, generator=gen) < 0.5] = IGNORE_INDEX
    return targets


def test_cross_entropy_loss_skips_ignored_targets():
    logits = torch.randn(3, 11, 29, generator=torch.Generator().manual_seed(0))
    targets = _targets_with_ignored((3, 11), 29, 1)
    keep = targets != IGNORE_INDEX
    per_token = F.cross_entropy(logits[keep], targets[keep], reduction="none")  # the kept rows only
    assert torch.allclose(cross_entropy_loss(logits, targets), per_token.mean(), rtol=1e-6)
    assert torch.allclose(cross_entropy_loss(logits, targets, 7.5), per_token.sum() / 7.5, rtol=1e-6)


def _vocab_parallel_masked(vocab: int) -> dict:
    """tp = 2: the loss and dlogits of the vocab-parallel loss with ignored targets against
    the full-logit cross-entropy of the kept targets."""
    from parallel3d.models.llama.parallelize import VocabParallelLoss
    from parallel3d.tensor_parallel import padded_size

    topo = Topology(2, 1, 1)
    logits = torch.randn(2, 9, vocab, generator=torch.Generator().manual_seed(3)) * 3
    targets = _targets_with_ignored((2, 9), vocab, 4)
    full = logits.clone().requires_grad_()
    ref = cross_entropy_loss(full, targets, 5.0)
    ref.backward()
    padded = padded_size(vocab, 2)
    v = padded // 2
    wide = torch.cat([logits, torch.full((2, 9, padded - vocab), 50.0)], dim=-1)
    mine = wide[..., topo.tp_rank * v:(topo.tp_rank + 1) * v].clone().requires_grad_()
    loss = VocabParallelLoss(vocab, topo.tp_rank, 2, topo.tp_group)(mine, targets, 5.0)
    loss.backward()
    grad_ref = F.pad(full.grad, (0, padded - vocab))[..., topo.tp_rank * v:(topo.tp_rank + 1) * v]
    ignored = targets == IGNORE_INDEX
    mean = VocabParallelLoss(vocab, topo.tp_rank, 2, topo.tp_group)(mine.detach(), targets)
    return {"loss": abs(float(loss) - float(ref)) / float(ref),
            "mean": abs(float(mean) - float(cross_entropy_loss(logits, targets))) / float(ref),
            "dlogits": float((mine.grad - grad_ref).abs().max() / grad_ref.abs().max()),
            "ignored_rows_zero": bool(torch.all(mine.grad[ignored] == 0))}


def test_vocab_parallel_loss_skips_ignored_targets(pools):
    for r in pools(2).run(_vocab_parallel_masked, 31):
        # fp32: the same softmax split over two ranks (a max and two sums all-reduced)
        assert r["loss"] < 1e-6 and r["mean"] < 1e-6 and r["dlogits"] < 1e-5, r
        assert r["ignored_rows_zero"]


# -- one step's loss across layouts ------------------------------------------------------------

def _job(data: str, run_dir: str, **parallel) -> dict:
    job = tiny_job("", run_dir, model={"vocab_size": 640, "n_layers": 2},
                   train={"steps": STEPS, "global_batch": 8, "micro_batch": 1, "seq_len": SEQ,
                          "grad_clip": 0.0, "warmup_steps": 1}, parallel=parallel)
    job["data"] = {"path": data}
    return job


def _train(job: dict) -> dict:
    cfg = config_from_dict(job)
    trainer = Trainer(cfg, Topology(cfg.parallel.tp, cfg.parallel.pp, cfg.parallel.dp))
    first = trainer.data.sampler.global_indices_at(0) if trainer.topo.rank == 0 else None
    history = trainer.fit()
    return {"losses": [h["loss"] for h in history], "first_batch": first}


def _global_mean_by_hand(job: dict, indices: list[int]) -> tuple[float, float]:
    """The first step's loss computed here from the unsplit model and the windows: the
    mean over the global batch's supervised tokens, and (for contrast) the mean of the
    eight micro-batches' own means, which a per-micro-batch normalisation would give."""
    cfg = config_from_dict(job)
    trainer = Trainer(cfg, Topology.single(), log=False)
    # the trainer's initial weights: the counter-based init of the whole model, same seed
    model = init_llama_(Llama(trainer.model_cfg), cfg.train.seed)
    windows = trainer.data.windows
    sums, counts = [], []
    with torch.no_grad():
        for i in indices:
            ids, targets, positions = windows.sample(i)
            logits = model(torch.from_numpy(ids[None, :-1]), positions=torch.from_numpy(positions[None]))
            t = torch.from_numpy(targets)
            keep = t != IGNORE_INDEX
            sums.append(float(F.cross_entropy(logits[0][keep].double(), t[keep], reduction="sum")))
            counts.append(int(keep.sum()))
    trainer.data.loader.close()
    means = [s / c for s, c in zip(sums, counts) if c]  # a window may hold no answer at all
    return sum(sums) / sum(counts), sum(means) / len(means), counts


@pytest.mark.slow  # ~70 s on 2 loaded cores: four layouts, 15 processes
def test_step_loss_is_the_same_at_every_layout(pools, chat_data, tmp_path):
    ref = _train(_job(chat_data, str(tmp_path / "ref")))
    want, mean_of_means, counts = _global_mean_by_hand(_job(chat_data, str(tmp_path / "hand")),
                                                       ref["first_batch"])
    # The micro-batches' supervised counts differ widely, so normalising per micro-batch
    # would be wrong by far more than the tolerance below (a random model's per-token
    # losses are all near ln(640), which keeps the gap small, but 100x the 1e-6 bar).
    assert max(counts) > 2 * max(1, min(counts)), counts
    assert abs(mean_of_means - want) / want > 1e-4
    # fp32 training step against a float64 sum of the same fp32 logits
    assert abs(ref["losses"][0] - want) / want < 1e-6, (ref["losses"][0], want)
    for name, (tp, pp, dp, extra) in {"1x1x4": (1, 1, 4, {}), "1x2x1": (1, 2, 1, {}),
                                      "2x2x2": (2, 2, 2, {"sequence_parallel": True})}.items():
        job = _job(chat_data, str(tmp_path / name), tp=tp, pp=pp, dp=dp, **extra)
        got = pools(tp * pp * dp).run(_train, job)
        for r in got:
            # fp32, same data and weights: the sums run in another order (dp mean, tp
            # all-reduces), a few ulps; 1e-6 relative is the bar
            assert relative_diff(r["losses"], ref["losses"]) < 1e-6, (name, r["losses"], ref["losses"])
