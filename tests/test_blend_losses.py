"""Per-source losses of a blend (issue 34 point 4), the parts below the trainer: each row's
source in the micro-batch, per-source loss sums from per-token losses, per-source token
counts from the sampler alone, and the step loss as their token-weighted mean."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from parallel3d.config import config_from_dict
from parallel3d.data.blend import BlendSampler
from parallel3d.data.source_loss import (SourceLossSums, source_figures, source_loss_sums, source_tokens,
                                         weighted_step_loss)
from parallel3d.train.data import open_blend

from test_blend import _job, sources  # noqa: F401 - the module's fixture

# fp64 sums of fp32 per-token losses against fp32 reductions of the same values: the
# reductions' own rounding, ~1e-7 relative for a few thousand terms
RTOL = 1e-5


def test_per_source_sums_and_counts_give_each_source_loss_and_the_step_loss(sources, tmp_path):  # noqa: F811
    cfg = config_from_dict(_job(sources, tmp_path, data={"packing": "documents"}))
    blend = open_blend(cfg, 768)
    sampler = BlendSampler(blend.names, blend.weights, [w.num_samples for w in blend.train.sources],
                           [d.fingerprint for d in blend.datasets], 16, 4, 1, 0, seed=7)
    position = 5 * 16
    micro = [blend.train.micro_batch(idx, None) for idx in sampler.indices_at(position)]
    counts = source_tokens(blend.train, sampler.global_indices_at(position))
    torch.manual_seed(0)
    acc = SourceLossSums(3, torch.device("cpu"))
    all_logits, all_targets, all_sources = [], [], []
    for mb in micro:
        logits = torch.randn(*mb.targets.shape, 768)
        token_loss = F.cross_entropy(logits.flatten(0, 1), mb.targets.flatten(), reduction="none").view(
            mb.targets.shape)  # 0 at IGNORE_INDEX, as the vocab-parallel loss
        acc.add(token_loss, mb.sources)
        all_logits.append(logits)
        all_targets.append(mb.targets)
        all_sources.append(mb.sources)
    sums = acc.take()
    assert torch.equal(acc.take(), torch.zeros(3, dtype=torch.float64))  # taken: zero again
    logits, targets, rows = torch.cat(all_logits), torch.cat(all_targets), torch.cat(all_sources)
    assert sorted(set(rows.tolist())) == [0, 1, 2]
    figures = source_figures(blend.names, sums.tolist(), counts)
    for k, name in enumerate(blend.names):
        mine = rows == k
        assert counts[k] == int((targets[mine] != -100).sum())  # counted without reading a token
        want = F.cross_entropy(logits[mine].flatten(0, 1), targets[mine].flatten())  # mean over its tokens
        assert figures[f"loss/{name}"] == pytest.approx(float(want), rel=RTOL)
    step = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
    assert weighted_step_loss(figures, blend.names) == pytest.approx(float(step), rel=RTOL)


def test_a_source_absent_from_a_batch_has_a_count_and_no_loss():
    token_loss = torch.ones(3, 4)
    sums = source_loss_sums(token_loss, torch.tensor([0, 0, 2]), 3)
    assert sums.tolist() == [8.0, 0.0, 4.0]
    figures = source_figures(["a", "b", "c"], sums.tolist(), [8, 0, 4])
    assert figures == {"loss/a": 1.0, "tokens/a": 8, "tokens/b": 0, "loss/c": 1.0, "tokens/c": 4}


def test_the_report_draws_and_names_each_sources_losses():
    pytest.importorskip("matplotlib")
    from parallel3d.observe.report import build_figure, summary

    records = []
    for step in range(1, 21):
        r = {"step": step, "loss": 3.0 - step * 0.05, "lr": 1e-3, "grad_norm": 1.0, "tokens_per_s": 1000.0,
             "step_time_s": 0.1, "loss/web": 3.1 - step * 0.05, "tokens/web": 100,
             "loss/math": 2.5 - step * 0.05, "tokens/math": 40}
        if step % 10 == 0:
            r.update({"val_loss": 2.9, "val_loss/web": 3.0, "val_loss/math": 2.4})
        records.append(r)
    fig = build_figure(records)
    labels = [line.get_label() for line in fig.axes[0].get_lines()]
    for name in ("web", "math"):
        assert f"{name} (training)" in labels and f"{name} (held out)" in labels
    text = summary(records)
    assert "source web: loss 2.1000 at step 20, val-loss 3.0000 at step 20" in text
    assert "source math: loss 1.5000 at step 20" in text


def _source_records(job: dict) -> list[dict]:
    from parallel3d.topology import Topology
    from parallel3d.train.trainer import Trainer

    cfg = config_from_dict(job)
    return Trainer(cfg, Topology.of(cfg.parallel)).fit()


def test_training_records_each_sources_loss_and_tokens_at_1x1x1_and_2x2x2(pools, sources, tmp_path):  # noqa: F811
    """Each step's record has loss/<name> and tokens/<name>; weighted by the tokens they give
    the step loss; the held-out loss of each source at every evaluation; the same figures
    at tp 2 x pp 2 x dp 2 (the last stage's tp rank 0 counts, dp ranks summed)."""
    from helpers import relative_diff

    job = _job(sources, tmp_path, train={"steps": 4, "global_batch": 8, "micro_batch": 2},
               eval={"interval": 2, "batches": 1})  # the smallest validation split holds 12 windows
    one = _source_records(job)
    names = sorted(k.split("/", 1)[1] for k in one[0] if k.startswith("tokens/"))
    assert len(names) == 3
    for r in one:
        assert sum(r[f"tokens/{n}"] for n in names) > 0
        assert weighted_step_loss(r, names) == pytest.approx(r["loss"], rel=RTOL)
    assert all(f"val_loss/{n}" in one[1] and f"val_loss/{n}" in one[3] for n in names)
    ranks = pools(8).run(_source_records, {**job, "parallel": {"tp": 2, "pp": 2, "dp": 2},
                                           "run": {"dir": str(tmp_path / "3d")}})
    keys = [k for k in one[-1] if k.startswith(("loss/", "tokens/", "val_loss/"))]
    for records in ranks:
        for got, want in zip(records, one):
            assert all(got[f"tokens/{n}"] == want[f"tokens/{n}"] for n in names)
            common = [k for k in keys if k in want]
            assert relative_diff([got[k] for k in common], [want[k] for k in common]) < 1e-5
