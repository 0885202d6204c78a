"""Checkpoints at full 3D layouts: tp x pp x dp with ZeRO-2 resumes bit for bit and
reshards to other layouts, pipeline stages and ZeRO stages; a Hugging Face model
round-trips through tp=2 x pp=2.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

# Plain imports of the project's own modules: a broken import fails these tests, it never
# skips them.
import parallel3d.pipeline  # noqa: F401
import parallel3d.zero  # noqa: F401
from parallel3d.checkpoint.convert import convert
from parallel3d.checkpoint.reader import CheckpointReader

from helpers import relative_diff, tiny_job
from test_checkpoint_hf import _hf_tensors, _save_at_layout, hf_job, make_hf_model, transformers

# A save every 2 steps, the run stopped at step 4 and resumed there. What is claimed holds
# at any length: a resume at the same layout is equal bit for bit or it is not, and a
# wrong reshard (a moment or a master weight in the wrong place) moves the very next
# losses; the 1e-5 bar of the resharded continuations is the layouts' own parity bar, not
# a drift grown over many steps. (20 steps stopped at 10 took 67 s of the suite.)
STEPS, STOP, INTERVAL = 8, 4, 2
# 8 ranks on a shared 2-core machine: a run can take minutes when the machine is loaded,
# past the pool's default 300 s hang guard.
SLOW = 900


def _job(corpus_dir, run_dir, tp, pp, dp, zero=0, virtual=1, **checkpoint):
    # 4 layers (1 per chunk at pp=2 x 2 virtual stages), odd vocabulary (padded at tp>1),
    # small ZeRO buckets so parameters straddle the dp shards.
    job = tiny_job(corpus_dir, str(run_dir), model={"vocab_size": 515, "n_layers": 4},
                   parallel={"tp": tp, "pp": pp, "dp": dp, "zero": zero, "bucket_mb": 0.05},
                   train={"steps": STEPS, "grad_clip": 0.5},
                   checkpoint={"interval": INTERVAL, "keep": 0, **checkpoint})
    if virtual > 1:
        job["parallel"].update({"schedule": "interleaved", "virtual_stages": virtual})
    return job


def _losses(job: dict, stop_at: int | None = None) -> list[float]:
    from parallel3d.config import config_from_dict
    from parallel3d.topology import Topology
    from parallel3d.train.trainer import Trainer

    p = job["parallel"]
    trainer = Trainer(config_from_dict(job), Topology(p["tp"], p["pp"], p["dp"]))
    return [r["loss"] for r in trainer.fit(stop_at=stop_at)]


def test_2x2x2_zero2_resumes_bit_exact_and_reshards(pools, corpus_dir, tmp_path):
    eight = pools(8)
    straight = eight.run(_losses, _job(corpus_dir, tmp_path / "straight", 2, 2, 2, zero=2), timeout=SLOW)[0]
    job = _job(corpus_dir, tmp_path / "resumed", 2, 2, 2, zero=2, async_save=True)
    first = eight.run(_losses, job, STOP, timeout=SLOW)[0]
    again = eight.run(_losses, job, timeout=SLOW)[0]
    assert first + again == straight  # same layout, async saves: bit for bit
    stopped = str(tmp_path / "resumed" / "checkpoints" / f"step_{STOP:08d}")
    with CheckpointReader(stopped) as reader:  # ZeRO-2 moments are flat ranges over dp
        assert any(p.flat for p in reader.entry("optim/exp_avg/layers.0.mlp.up_proj.weight").pieces)
    four = pools(4)
    for tp, pp, dp, zero, virtual in [(1, 1, 4, 2, 1), (4, 1, 1, 0, 1), (1, 2, 2, 1, 2)]:
        other = _job(corpus_dir, tmp_path / f"{tp}x{pp}x{dp}", tp, pp, dp, zero, virtual, resume=stopped)
        continued = four.run(_losses, other, timeout=SLOW)[0]
        # fp32: another layout sums the same products in another order (a few ulps per op,
        # as between the layouts' own loss curves); 1e-5 relative is the bar.
        assert len(continued) == STEPS - STOP
        assert relative_diff(continued, straight[STOP:]) < 1e-5, (tp, pp, dp, zero, virtual)


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_hf_round_trip_at_tp2_pp2(kind, pools, corpus_dir, tmp_path):
    hf_dir = make_hf_model(kind, tmp_path / "hf")
    job = hf_job(corpus_dir, tmp_path / "run", hf_dir, parallel={"tp": 2, "pp": 2})
    folder = Path(pools(4).run(_save_at_layout, job, 2, 2, 1, None)[0][0])
    out = tmp_path / "exported"
    convert(folder.parent, out, "hf", progress=False)
    before, after = _hf_tensors(hf_dir), _hf_tensors(out)
    assert sorted(before) == sorted(after)
    for name, t in before.items():
        assert after[name].dtype == t.dtype and torch.equal(after[name], t), name
    # transformers on the export computes what parallel3d's model computes from the
    # checkpoint the 4 ranks wrote (each stage and tp rank its own blocks)
    from parallel3d.models.llama import Llama

    with CheckpointReader(folder) as reader:
        assert len({p.file for e in reader.index.tensors.values() for p in e.pieces}) == 4
        ours = Llama(reader.model_config).eval()
        with torch.no_grad():
            for name, p in ours.named_parameters():
                p.copy_(reader.read("model/" + name))
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="sdpa").eval()
    tokens = torch.randint(0, 521, (2, 45), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (hf(tokens).logits - ours(tokens)).abs().max().item() < 1e-5  # fp32, same ops


def test_training_from_an_hf_folder_is_the_same_at_tp2_pp2_and_1x1x1(pools, corpus_dir, tmp_path):
    """The weights come from a Hugging Face folder, each rank reading only its slices: the
    4-rank tp 2 x pp 2 run's losses equal one process's (fp32; the same 1e-5 bar as every
    layout's parity from random initialisation)."""
    hf_dir = make_hf_model("llama", tmp_path / "hf")
    steps = {"steps": 4, "grad_clip": 0.5}
    one = hf_job(corpus_dir, tmp_path / "one", hf_dir, parallel={"tp": 1, "pp": 1, "dp": 1}, train=steps)
    four = hf_job(corpus_dir, tmp_path / "four", hf_dir, parallel={"tp": 2, "pp": 2, "dp": 1}, train=steps)
    ref = pools(1).run(_losses, one)[0]
    for losses in pools(4).run(_losses, four):
        assert relative_diff(losses, ref) < 1e-5, (losses, ref)
