"""data.blend: three prepared datasets mixed 0.5 / 0.3 / 0.2 (issue 34, acceptance 1).

Token shares over 2,000 sequences within 1% of the weights; the smallest source's epochs
counted and logged; the same global batches at any dp split and the same losses at 1x1x1
and 2x2x2; a run stopped and resumed trains on the uninterrupted run's batches with its
losses; a changed blend on resume follows the written rule; validation per source.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from parallel3d.config import config_from_dict, load_config
from parallel3d.data.blend import CHANGED_BLEND_RULE, BlendSampler, BlendSchedule
from parallel3d.errors import UserError
from parallel3d.topology import Topology
from parallel3d.train.data import open_blend
from parallel3d.train.trainer import Trainer

from helpers import relative_diff, tiny_job_on

pytestmark = pytest.mark.usefixtures("one_thread")

WEIGHTS = {"web": 0.5, "code": 0.3, "math": 0.2}


@pytest.fixture(scope="module")
def sources(prepared_dir, tmp_path_factory) -> dict[str, str]:
    """Three datasets tokenized with prepared_dir's tokenizer from disjoint stdlib text:
    "math" is the smallest (about 170 windows of 32 tokens), so 2,000 sequences read it
    more than twice."""
    from parallel3d.data.prepare import prepare_data
    from parallel3d.data.stdlib import read_stdlib

    root = tmp_path_factory.mktemp("blend")
    # documents of ~800 characters, so that even the smallest source holds out some
    docs = [d[i: i + 800] for d in read_stdlib(700_000) if d for i in range(0, len(d), 800)]
    sizes = {"web": 300_000, "code": 200_000, "math": 13_000}
    out, i = {}, 0
    for name, size in sizes.items():
        chunk, n = [], 0
        while n < size and i < len(docs):
            chunk.append(docs[i])
            n += len(docs[i])
            i += 1
        src = root / f"{name}.jsonl"
        src.write_text("".join(json.dumps({"text": d}) + "\n" for d in chunk), encoding="utf-8")
        prepare_data([str(src)], Path(prepared_dir) / "tokenizer", root / name, workers=1,
                     val_fraction=0.1, shard_tokens=4096, progress=False)
        out[name] = str(root / name)
    return out


def _blend(sources: dict, weights: dict = WEIGHTS) -> list[dict]:
    return [{"name": n, "path": sources[n], "weight": w} for n, w in weights.items()]


def _job(sources, run_dir, weights=WEIGHTS, **sections) -> dict:
    job = tiny_job_on("", str(run_dir), **sections)
    job["data"] = {"blend": _blend(sources, weights), **sections.get("data", {})}
    return job


def test_token_shares_follow_the_weights_and_the_small_source_repeats(sources, tmp_path):
    cfg = config_from_dict(_job(sources, tmp_path, train={"global_batch": 40, "micro_batch": 4}))
    blend = open_blend(cfg, 768)
    logged: list[str] = []
    sampler = BlendSampler(blend.names, blend.weights, [w.num_samples for w in blend.train.sources],
                           [d.fingerprint for d in blend.datasets], 40, 4, 1, 0, seed=7, log=logged.append)
    tokens = dict.fromkeys(blend.names, 0)
    for _ in range(2000 // 40):
        before = sampler.consumed
        for idx in sampler.next_step():
            mb = blend.train.micro_batch(idx, 1.0)
            for k, n in zip(mb.sources.tolist(), (mb.targets != -100).sum(dim=1).tolist()):
                tokens[blend.names[k]] += n
        sampler.on_advance(before, sampler.consumed)
    total = sum(tokens.values())
    for name, w in WEIGHTS.items():
        assert abs(tokens[name] / total - w) < 0.01, tokens
    sizes = dict(zip(blend.names, (w.num_samples for w in blend.train.sources)))
    # math's 0.2 x 2,000 = 400 draws pass over its windows 2 or more times, web's 1,000 not once
    passes = {name: [1000, 600, 400][k] // sizes[name] for k, name in enumerate(blend.names)}
    assert passes["math"] >= 2 and passes["web"] == 0, sizes
    assert sampler.figures(2000) == {f"epochs/{n}": e for n, e in passes.items()}
    starts = [line for line in logged if "'math'" in line and "starts epoch" in line]
    assert len(starts) == passes["math"] and not any("'web'" in line for line in logged), logged
    state = sampler.state_dict()["blend"]["sources"]
    assert [s["epoch"] for s in state] == list(passes.values()) and state[2]["draws"] == 400
    # an epoch reads every window of the source once
    assert sorted(sampler._window(2, d) for d in range(sizes["math"])) == list(
        range(sampler.offsets[2], sampler.offsets[2] + sizes["math"]))


def test_the_schedule_jumps_to_any_position_as_it_walks():
    """counts_at(p) (O(K), for resuming and for each dp rank's slice) equals walking the
    interleave position by position; every prefix keeps each share within one window."""
    for weights in ([0.5, 0.3, 0.2], [1, 1, 1], [3, 1e-3, 2], [0.25, 0.25, 0.25, 0.25, 1e-6]):
        s = BlendSchedule(weights)
        walked = s.draws(0, 3000)
        counts = [0] * len(weights)
        for p in range(3000):
            if p % 7 == 0:
                assert s.counts_at(p) == counts
            for k, c in enumerate(counts):
                assert abs(c - p * s.weights[k]) <= 1.0
            k, d = walked[p]
            assert d == counts[k]
            counts[k] += 1
        assert s.draws(1234, 50) == walked[1234:1284]
    assert BlendSchedule([0.5, 0.3, 0.2]).counts_at(10**12) == [5 * 10**11, 3 * 10**11, 2 * 10**11]


def test_every_dp_split_reads_the_same_global_batches(sources, tmp_path):
    cfg = config_from_dict(_job(sources, tmp_path))
    blend = open_blend(cfg, 768)
    sizes = [w.num_samples for w in blend.train.sources]
    fps = [d.fingerprint for d in blend.datasets]

    def steps(dp, micro):
        samplers = [BlendSampler(blend.names, blend.weights, sizes, fps, 24, micro, dp, r, seed=3)
                    for r in range(dp)]
        return [[i for s in samplers for mb in s.next_step() for i in mb] for _ in range(30)]

    whole = steps(1, 4)
    assert steps(2, 3) == whole and steps(4, 2) == whole and steps(3, 1) == whole


def _record(job: dict):
    """Train; the token ids and sources of each step's batch, the final data state and the losses."""
    trainer = Trainer(config_from_dict(job), Topology(1, 1, 1), log=False)
    seen, run = [], trainer.schedule.run

    def recording(micro_batches, **kw):
        seen.append(torch.cat([torch.cat([mb.inputs, mb.sources[:, None]], dim=1) for mb in micro_batches]))
        return run(micro_batches, **kw)

    trainer.schedule.run = recording
    history = trainer.fit()
    return seen, trainer.data.loader.state_dict(), [h["loss"] for h in history]


def test_a_run_stopped_and_resumed_continues_the_blend_exactly(sources, tmp_path, capsys):
    """Stopped after step 3 (its checkpoint holds the blend's position), resumed by a new
    trainer: the same windows and the uninterrupted run's losses."""
    def job(run):
        return _job(sources, tmp_path / run, train={"steps": 6}, checkpoint={"interval": 3})
    whole, _, losses = _record(job("whole"))
    trainer = Trainer(config_from_dict(job("stopped")), Topology(1, 1, 1), log=False)
    head = [h["loss"] for h in trainer.fit(stop_at=3)]
    seen, _, tail = _record(job("stopped"))
    assert len(head) == 3 and len(tail) == 3
    assert all(torch.equal(a, b) for a, b in zip(seen, whole[3:]))
    assert relative_diff(head + tail, losses) < 1e-5
    assert CHANGED_BLEND_RULE not in capsys.readouterr().out


def test_a_changed_blend_on_resume_follows_the_rule_and_says_so(sources, tmp_path, capsys):
    cfg = config_from_dict(_job(sources, tmp_path))
    blend = open_blend(cfg, 768)
    sizes = [w.num_samples for w in blend.train.sources]
    fps = [d.fingerprint for d in blend.datasets]
    old = BlendSampler(blend.names, blend.weights, sizes, fps, 8, 2, 1, 0, seed=7)
    for _ in range(25):
        old.next_step()
    state = json.loads(json.dumps(old.state_dict()))
    drawn = dict(zip(blend.names, old.draws_at(old.consumed)))
    # "math" dropped, "code" weighted up, a "web" of other data would start afresh
    lines = []
    new = BlendSampler(["code", "web"], [0.6, 0.4], [sizes[1], sizes[0]], [fps[1], fps[0]], 8, 2, 1, 0, seed=7,
                       log=lines.append)
    new.load_state_dict(state)
    assert new.consumed == 200 and new.draws_at(200) == [drawn["code"], drawn["web"]]
    assert len(lines) == 1 and CHANGED_BLEND_RULE in lines[0]
    # code's stream continues where it was: its next windows are the old sampler's next ones
    old_code = [old._window(1, drawn["code"] + i) for i in range(5)]
    new_code = [new._window(0, drawn["code"] + i) - new.offsets[0] + old.offsets[1] for i in range(5)]
    assert old_code == new_code
    # the weights apply from the resume on
    after = new.draws_at(200 + 1000)
    assert abs(after[0] - drawn["code"] - 600) <= 1
    # saved again and loaded by the same blend: exact, no rule printed
    again = BlendSampler(["code", "web"], [0.6, 0.4], [sizes[1], sizes[0]], [fps[1], fps[0]], 8, 2, 1, 0, seed=7,
                         log=lines.append)
    again.load_state_dict(json.loads(json.dumps(new.state_dict())))
    assert len(lines) == 1 and again.step_indices(30) == new.step_indices(30)
    with pytest.raises(UserError, match="train.seed"):
        again.load_state_dict({**state, "seed": 8})


def test_validation_is_per_source(sources, tmp_path):
    job = _job(sources, tmp_path, train={"steps": 1}, eval={"interval": 1, "batches": 1})
    trainer = Trainer(config_from_dict(job), Topology(1, 1, 1), log=False)
    data = trainer.data
    assert data.source_names == ["web", "code", "math"]
    for k, name in enumerate(data.source_names):
        mbs = data.source_val_micro_batches(name, 0)
        windows = data.val_sources[name][0]
        first = [i for i in data.val_sources[name][1].indices_at(0)[0]]
        assert torch.equal(mbs[0].inputs[0], torch.from_numpy(windows.sample(first[0])[0][:-1]))
    mixed = {int(s) for mb in data.val_micro_batches(0) for s in mb.sources}
    assert mixed == {0, 1, 2}
    trainer.release(close_watch=True)


@pytest.mark.parametrize("bad, match", [
    ([{"name": "a", "path": "x", "weight": 0}], "weight of 'a' must be a positive"),
    ([{"name": "a b", "path": "x", "weight": 1}], "name 'a b' must be"),
    ([{"name": "a", "path": "x", "weight": 1}, {"name": "a", "path": "y", "weight": 1}], "used twice"),
    ([{"name": "a", "path": "/nonexistent/p3d", "weight": 1}], "data.blend 'a': dataset"),
])
def test_bad_blends_are_one_line_errors(tmp_path, bad, match):
    cfg = load_config(None, {"data": {"blend": bad}, "run": {"dir": str(tmp_path)}})
    with pytest.raises(UserError, match=match):
        open_blend(cfg, 768)


def test_sources_of_other_tokenizers_are_refused(sources, prepared_dir, tmp_path):
    from parallel3d.data.format import open_dataset

    other = tmp_path / "other"
    other.mkdir()
    for f in Path(sources["math"]).iterdir():
        if f.is_file():
            (other / f.name).write_bytes(f.read_bytes())
    index = json.loads((other / "index.json").read_text())
    index["tokenizer"]["sha256"] = "0" * 64
    (other / "index.json").write_text(json.dumps(index))
    open_dataset(other)
    cfg = config_from_dict(_job({**sources, "math": str(other)}, tmp_path))
    with pytest.raises(UserError, match="'math'.*another tokenizer"):
        open_blend(cfg, 768)


def _losses(job: dict) -> list[float]:
    cfg = config_from_dict(job)
    trainer = Trainer(cfg, Topology(cfg.parallel.tp, cfg.parallel.pp, cfg.parallel.dp))
    return [h["loss"] for h in trainer.fit()]


def test_2x2x2_trains_on_the_blend_as_1x1x1(pools, sources, tmp_path):
    job = _job(sources, tmp_path, train={"steps": 4, "global_batch": 16, "micro_batch": 2},
               model={"n_layers": 4})
    reference = _losses(job)
    ranks = pools(8).run(_losses, {**job, "parallel": {"tp": 2, "pp": 2, "dp": 2},
                                   "run": {"dir": str(tmp_path / "3d")}})
    for losses in ranks:
        assert relative_diff(losses, reference) < 1e-5  # fp32, sums in another order (test_train_3d)


def test_the_banner_line_names_the_blend():
    from parallel3d.data.stdlib import describe

    cfg = load_config(None, {"data": {"blend": [{"name": "web", "path": "/d/web", "weight": 3},
                                                {"name": "math", "path": "/d/math", "weight": 1}]}})
    assert describe(cfg.data) == "data.blend: web 75% (/d/web), math 25% (/d/math)"
