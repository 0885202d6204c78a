"""Data checks: a shard with ids outside the model's vocabulary stops the run before the
forward that would read them, naming the shard and offset, on every rank; a shard whose
bytes changed (ids still in range) is reported by the checksum verification, naming the
file, before training (small data) or at the same step on every rank (background)."""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch.distributed as dist

from parallel3d.data.format import all_shards
from parallel3d.data.checks import IdRangeCheck, ShardVerifier
from parallel3d.data.format import open_dataset
from parallel3d.data.sampler import GlobalBatchSampler, TokenWindows
from parallel3d.errors import UserError

from helpers import job_args, tiny_job_on

SEQ, GLOBAL, BAD_STEP = 32, 8, 3


def _copy(prepared_dir: str, dest: Path) -> Path:
    shutil.copytree(prepared_dir, dest)
    return dest


def _shard_of(index: dict, pos: int) -> tuple[str, int]:
    """(file, token offset) of train-stream position ``pos``, from the index's token counts."""
    start = 0
    for shard in index["splits"]["train"]["shards"]:
        if pos < start + shard["num_tokens"]:
            return shard["file"], pos - start
        start += shard["num_tokens"]
    raise AssertionError(pos)


def _write_token(data: Path, pos: int, value: int, fix_index: bool) -> tuple[Path, int]:
    """Put ``value`` at train-stream position ``pos``; with ``fix_index`` record the new
    sha256 (a shard written so, as by another tokenizer), else leave the index stale."""
    index = json.loads((data / "index.json").read_text())
    name, offset = _shard_of(index, pos)
    path = data / name
    tokens = np.fromfile(path, dtype="<u2")
    assert tokens[offset] != value
    tokens[offset] = value
    tokens.tofile(path)
    if fix_index:
        for shard in index["splits"]["train"]["shards"]:
            if shard["file"] == name:
                shard["sha256"] = hashlib.sha256(path.read_bytes()).hexdigest()
        (data / "index.json").write_text(json.dumps(index))
    return path, offset


def _train(data: Path, run: Path, nproc: int = 2, steps: int = 5) -> subprocess.CompletedProcess:
    job = tiny_job_on(str(data), str(run), parallel={"tp": 1, "pp": 1, "dp": nproc},
                      train={"steps": steps, "seq_len": SEQ, "global_batch": GLOBAL},
                      launch={"nproc": nproc}, observability={"progress": "off"})
    return subprocess.run([sys.executable, "-m", "parallel3d.cli", "train", *job_args(job)],
                          capture_output=True, text=True, timeout=600)


def test_an_id_outside_the_vocabulary_stops_every_rank_naming_shard_and_offset(prepared_dir, tmp_path):
    """The bad id sits in the first sample of dp rank 1's half of step 3's batch: rank 0,
    which never reads it, must stop at the same step with the same error (else it would
    wait in the gradient all-reduce for rank 1 and fail there, exit 4)."""
    data = _copy(prepared_dir, tmp_path / "data")
    ds = open_dataset(data)
    windows = TokenWindows(ds.split("train"), SEQ)
    sampler = GlobalBatchSampler(windows.num_samples, GLOBAL, 2, 1, 0, 7, ds.fingerprint)
    sample = sampler.global_indices_at((BAD_STEP - 1) * GLOBAL)[GLOBAL // 2]
    earlier = {i for s in range(BAD_STEP - 1) for i in sampler.global_indices_at(s * GLOBAL)}
    assert sample not in earlier and sample + 1 not in earlier  # no earlier window holds it
    path, offset = _write_token(data, sample * SEQ + 7, 65535, fix_index=True)

    proc = _train(data, tmp_path / "run")
    assert proc.returncode == 2, proc.stderr
    lines = [x for x in proc.stderr.splitlines() if x.strip()]
    assert len(lines) == 1, proc.stderr  # rank 0 says it; no rank reports a failed collective
    assert lines[0] == (f"parallel3d: error: data shard '{path}' holds id 65535 at token {offset} "
                        f"(byte {2 * offset}), outside the model's vocabulary of 768 (model.vocab_size): "
                        "the shard is corrupt or was tokenized for another model; restore it or "
                        "prepare the data again")
    assert "Traceback" not in proc.stderr and f"step     {BAD_STEP}" not in proc.stdout


def test_a_changed_shard_with_ids_in_range_is_named_before_training(prepared_dir, tmp_path):
    data = _copy(prepared_dir, tmp_path / "data")
    path, _ = _write_token(data, 12345, 5, fix_index=False)  # id 5 is in the vocabulary
    proc = _train(data, tmp_path / "run", nproc=2)
    assert proc.returncode == 2, proc.stderr
    lines = [x for x in proc.stderr.splitlines() if x.strip()]
    assert lines == [f"parallel3d: error: shard '{path}' does not match its sha256 in the dataset's "
                     "index.json: the file changed after prepare-data wrote it; restore it or prepare "
                     "the data again"], proc.stderr
    assert "step     1" not in proc.stdout  # small data: verified before the first step


def test_the_range_check_names_a_plain_stream_position():
    tokens = np.arange(100, dtype=np.uint16) % 50
    tokens[70] = 900
    windows = TokenWindows(tokens, 9)
    sampler = GlobalBatchSampler(windows.num_samples, 11, 1, 1, 0, 0)  # every window
    with pytest.raises(UserError, match=r"^the training split holds id 900 at token 70, outside the "
                                        r"model's vocabulary of 50 \(model.vocab_size\)"):
        IdRangeCheck(windows, sampler, 50)(0)
    IdRangeCheck(windows, sampler, 901)(0)  # in range: nothing


# -- the background verification, agreed at a step on every rank ---------------------------------

def _poll_until_settled(data: str, steps: int) -> dict:
    """Drive a ShardVerifier as the loader does, one poll per (simulated) step."""
    rank, world = dist.get_rank(), dist.get_world_size()
    verifier = ShardVerifier(open_dataset(data), rank, world, dist.new_group(backend="gloo"))
    mine = [verifier.shards[k][0] for k in range(rank, len(verifier.shards), world)]
    for step in range(1, steps + 1):
        try:
            verifier.poll()
        except UserError as e:
            return {"step": step, "error": str(e), "mine": mine}
        if verifier.settled:
            return {"step": step, "error": None, "mine": mine}
        time.sleep(0.05)  # a step's work
    verifier.close()
    return {"step": None, "error": None, "mine": mine}


def test_background_verification_stops_every_rank_at_the_same_step(pools, prepared_dir, tmp_path):
    data = _copy(prepared_dir, tmp_path / "data")
    clean = pools(2).run(_poll_until_settled, str(data), 200)
    assert clean[0]["step"] == clean[1]["step"] is not None and clean[0]["error"] is None
    index = json.loads((data / "index.json").read_text())
    # the verifier's list: token shards and format 2's side files, splits in name order
    names = [s["file"] for s, _ in all_shards(index)]
    token_files = [s["file"] for _, e in sorted(index["splits"].items()) for s in e["shards"]]
    changed = data / token_files[-1]
    k = names.index(token_files[-1])  # hashed by rank k % 2 only
    tokens = np.fromfile(changed, dtype="<u2")
    j = int(np.argmax(tokens[:-1] != tokens[1:]))  # two neighbours that differ: swap them
    tokens[j], tokens[j + 1] = tokens[j + 1], tokens[j]
    tokens.tofile(changed)
    results = pools(2).run(_poll_until_settled, str(data), 200)
    owner = k % 2
    assert changed.name in results[owner]["mine"] and changed.name not in results[1 - owner]["mine"]
    assert results[0]["step"] == results[1]["step"] is not None, results
    for res in results:
        assert res["error"] == (f"shard '{changed}' does not match its sha256 in the dataset's index.json: "
                                "the file changed after prepare-data wrote it; restore it or prepare the "
                                "data again")
