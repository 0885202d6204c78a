"""The on-disk format: box reads, the piece model (TP blocks with padding, ZeRO flat
ranges) read back at other layouts, and refusing damaged or foreign checkpoints."""

from __future__ import annotations

import json
import random

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from parallel3d.checkpoint.errors import CheckpointError
from parallel3d.checkpoint.format import Index, check_same_model, flat_boxes, model_identity
from parallel3d.checkpoint.reader import CheckpointReader
from parallel3d.checkpoint.safetensors_io import SafetensorsFile, write_file
from parallel3d.checkpoint.rank_files import RankPayload, build_index, write_rank_files
from parallel3d.checkpoint.state import Placement, Slot
from parallel3d.models.llama import config_from_preset


def test_flat_boxes_cover_ranges_in_order():
    rng = random.Random(0)
    for shape in [(7,), (3, 5), (2, 3, 4), (4, 1, 3, 2), (), (5, 7)]:
        n = torch.Size(shape).numel()
        ids = torch.arange(n).reshape(shape)
        for _ in range(100):
            lo = rng.randint(0, n)
            hi = rng.randint(lo, n)
            got = []
            boxes = flat_boxes(shape, lo, hi)
            assert len(boxes) <= max(1, 2 * len(shape) - 1)
            for start, box, pos in boxes:
                vals = ids[tuple(slice(a, a + b) for a, b in zip(start, box))].reshape(-1).tolist()
                assert vals == list(range(lo + pos, lo + pos + len(vals)))
                got += vals
            assert got == list(range(lo, hi))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64])
def test_box_reads_equal_slicing_and_files_are_standard(tmp_path, dtype):
    torch.manual_seed(0)
    tensors = {"a": (torch.randn(37, 53, 5) * 100).to(dtype), "b": torch.arange(71).to(dtype),
               "s": torch.tensor(3).to(dtype)}
    path = tmp_path / "x.safetensors"
    write_file(path, tensors)
    with safe_open(str(path), "pt") as f:  # the reference reader accepts our files
        assert all(torch.equal(f.get_tensor(k), v) for k, v in tensors.items())
    theirs = tmp_path / "y.safetensors"
    save_file(tensors, str(theirs))  # and we read theirs
    rng = random.Random(1)
    for p in (path, theirs):
        with SafetensorsFile(p) as f:
            assert torch.equal(f.read("s"), tensors["s"])
            for _ in range(60):
                lo = [rng.randrange(n) for n in (37, 53, 5)]
                shape = [rng.randint(1, n - o) for o, n in zip(lo, (37, 53, 5))]
                want = tensors["a"][tuple(slice(o, o + s) for o, s in zip(lo, shape))]
                assert torch.equal(f.read_box("a", lo, shape), want)
                # a flat range of "a" viewed as a (r, 53, 5) block, as a ZeRO piece is
                start = rng.randrange(0, 30) * 53 * 5
                r = rng.randint(1, 37 - start // 265)
                view = tensors["a"].reshape(-1)[start:start + r * 265].reshape(r, 53, 5)
                o = [rng.randrange(r), rng.randrange(53), rng.randrange(5)]
                s = [rng.randint(1, n - x) for x, n in zip(o, (r, 53, 5))]
                got = f.read_box("a", o, s, view_shape=(r, 53, 5), flat_start=start)
                assert torch.equal(got, view[tuple(slice(x, x + y) for x, y in zip(o, s))])


def _save_sharded(folder, full: torch.Tensor, tp: int, dp: int) -> None:
    """Write ``full`` (R, C) as a tp x dp layout: rows split over tp with the rows padded
    to a multiple of tp (as a vocabulary), each tp block's flat elements split over dp."""
    rows, cols = full.shape
    per = -(-rows // tp)
    padded = torch.zeros(per * tp, cols, dtype=full.dtype)
    padded[:rows] = full
    records = []
    for t in range(tp):
        block = padded[t * per:(t + 1) * per].reshape(-1)
        pl = Placement("w", tuple(full.shape), (t * per, 0), (per, cols), True)
        bounds = [block.numel() * d // dp for d in range(dp + 1)]
        for d in range(dp):
            lo, hi = bounds[d], bounds[d + 1]
            slot = Slot("optim/exp_avg/w", pl, block[lo:hi].clone(), (lo, hi))
            records.append(write_rank_files(folder, RankPayload(0, len(records), [slot], {})))
    index = build_index(7, records, {"model": {}, "layout": {"tp": tp, "dp": dp}})
    index.write(folder / "index.json")


def test_pieces_reshard_to_any_block_and_flat_range(tmp_path):
    torch.manual_seed(0)
    full = torch.randn(37, 53)  # odd rows: tp=2 pads to 38, the last row of rank 1 is padding
    _save_sharded(tmp_path, full, tp=2, dp=3)
    with CheckpointReader(tmp_path) as r:
        assert r.index.step == 7 and len(r.index.tensors["optim/exp_avg/w"].pieces) == 6
        assert torch.equal(r.read("optim/exp_avg/w"), full)
        assert torch.equal(r.read_region("optim/exp_avg/w", (5, 10), (25, 31)), full[5:30, 10:41])
        # tp=4 along the columns (a row-parallel layout) of a 3-way ZeRO: rank (1, 2)
        assert torch.equal(r.read_region("optim/exp_avg/w", (0, 14), (37, 13)), full[:, 14:27])
        # a tp=4 row block padded past the end (rows 30..39), and a flat range of it
        padded = torch.zeros(40, 53)
        padded[:37] = full
        want = padded[30:40].reshape(-1)[50:400]
        got = r.read_block_flat("optim/exp_avg/w", (30, 0), (10, 53), 50, 400)
        assert torch.equal(got, want)


def test_damaged_files_are_refused_naming_them(tmp_path):
    full = torch.randn(9, 4)
    _save_sharded(tmp_path, full, tp=1, dp=2)
    shard = tmp_path / "rank_00001.safetensors"
    data = bytearray(shard.read_bytes())
    data[-3] ^= 0x40  # one bit of the last value
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"rank_00001\.safetensors does not match the sha256"):
        CheckpointReader(tmp_path).read("optim/exp_avg/w")
    shard.write_bytes(bytes(data[:-8]))  # truncated
    with pytest.raises(CheckpointError, match=r"rank_00001\.safetensors has \d+ bytes but index"):
        CheckpointReader(tmp_path, verify=False).read("optim/exp_avg/w")
    with pytest.raises(CheckpointError, match=r"rank_00001\.safetensors is not a valid safetensors"):
        SafetensorsFile(shard)
    # an index naming a path outside the folder is refused before anything is opened
    index = json.loads((tmp_path / "index.json").read_text())
    index["files"]["../escape.safetensors"] = index["files"].pop("rank_00000.safetensors")
    (tmp_path / "index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=r"names the file '\.\./escape\.safetensors'"):
        Index.read(tmp_path)


def test_another_model_is_refused_naming_the_fields(tmp_path):
    ours = model_identity(config_from_preset("debug"))
    theirs = model_identity(config_from_preset("debug", n_layers=6, vocab_size=4096, init_std=0.5))
    with pytest.raises(CheckpointError, match=r"different model: n_layers 6 in the checkpoint vs 4 "
                                              r"here; vocab_size 4096 in the checkpoint vs 2048 here \("):
        check_same_model(theirs, ours, tmp_path)
