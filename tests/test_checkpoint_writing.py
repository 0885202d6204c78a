"""How convert writes: checksums combined and computed while writing, tensor-parallel tiles
written in place, DCP chunks built without ``torch.save``.

References are independent of the code under test: zlib's CRC of the concatenated bytes,
``torch.cat`` of the tiles, ``torch.save``'s own archive of the same tensor (its
``data.pkl`` bytes, its entry names), ``zipfile``'s CRC check of every entry, and
``torch.load(weights_only=True)`` / ``dcp.load`` reading what was written.
"""

from __future__ import annotations

import hashlib
import io
import math
import os
import zipfile
import zlib

import pytest
import torch

from parallel3d.checkpoint import zerocopy
from parallel3d.checkpoint.foreign import dcp_write
from parallel3d.checkpoint.convert import convert
from parallel3d.checkpoint.hashed_file import HashedFile, crc32_combine
from parallel3d.checkpoint.reader import CheckpointReader
from parallel3d.checkpoint.zerocopy import Tiles


def _bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()


def test_crc32_combine_equals_the_crc_of_the_concatenation():
    g = torch.Generator().manual_seed(0)
    for la, lb in [(0, 0), (0, 7), (5, 0), (1, 1), (37, 53), (4096, 1), (100_003, 65_537)]:
        a = _bytes(torch.randint(0, 256, (la,), dtype=torch.uint8, generator=g))
        b = _bytes(torch.randint(0, 256, (lb,), dtype=torch.uint8, generator=g))
        assert crc32_combine(zlib.crc32(a), zlib.crc32(b), len(b)) == zlib.crc32(a + b), (la, lb)


def _tiles(dim: int, widths: list[int], shape: tuple[int, ...], dtype=torch.float32, seed=0) -> Tiles:
    g = torch.Generator().manual_seed(seed)
    parts = []
    for w in widths:
        s = list(shape)
        s[dim] = w
        parts.append(torch.randn(s, generator=g).to(dtype))
    return Tiles(dim, parts, shape, dtype)


# dim 0 (rows), dim 1 of a 2-D weight (columns: interleaved per row), dim 1 of a 3-D one;
# (1000, 3001) fp32 is 12 MB, over the 1 MiB threshold and the 8 MiB pieces of the helper
TILES = [(0, [19, 18], (37, 53)), (1, [27, 26], (37, 53)), (1, [2, 3], (4, 5, 7)),
         (1, [1234, 1767], (1000, 3001)), (0, [3, 1, 4], (8, 1000))]


@pytest.mark.parametrize("algorithm", ["sha256", "crc32"])
def test_hashed_file_writes_tensors_and_tiles_as_their_bytes(tmp_path, algorithm):
    f = HashedFile(tmp_path / "x", algorithm)
    want = b"header"
    f.write(want)
    big = torch.randn(1500, 1001, generator=torch.Generator().manual_seed(1))
    assert f.write_tensor(big, crc=True) == zlib.crc32(_bytes(big))
    want += _bytes(big)
    for i, (dim, widths, shape) in enumerate(TILES):
        tiles = _tiles(dim, widths, shape, seed=i)
        whole = torch.cat(tiles.parts, dim)
        assert f.write_tiles(tiles, crc=True) == zlib.crc32(_bytes(whole)), (dim, shape)
        want += _bytes(whole)
    f.write_tiles(_tiles(1, [3, 4], (5, 7), torch.bfloat16))  # without its own CRC
    want += _bytes(torch.cat(_tiles(1, [3, 4], (5, 7), torch.bfloat16).parts, 1))
    size, digest = f.close()
    data = (tmp_path / "x").read_bytes()
    assert data == want
    ref = hashlib.sha256(want).hexdigest() if algorithm == "sha256" else f"{zlib.crc32(want):08x}"
    assert (size, digest) == (len(want), ref)


def test_writing_a_tensor_leaves_its_storage_resizable(tmp_path):
    """ZeRO 3 frees a gathered bucket by resizing its storage to 0 bytes; a bucket written
    while gathered (an export, a save) must still free afterwards, and the bytes written
    are the tensor's even when the caller drops it before the hashing thread reads them."""
    bucket = torch.arange(3000, dtype=torch.float32)
    view = bucket[1000:2000].view(10, 100)  # a parameter: a view into the bucket's storage
    f = HashedFile(tmp_path / "x", "sha256")
    f.write_tensor(view)
    f.write_tensor(torch.arange(5, dtype=torch.int64)[::2])  # a temporary contiguous copy
    f.write_tensor(torch.empty(0))
    size, digest = f.close()
    want = _bytes(view.clone()) + _bytes(torch.tensor([0, 2, 4]))  # (a copy: _bytes goes through numpy)
    assert (tmp_path / "x").read_bytes() == want and digest == hashlib.sha256(want).hexdigest()
    bucket.untyped_storage().resize_(0)  # raised "not resizable" when the write went through numpy
    assert bucket.untyped_storage().nbytes() == 0


def test_writes_that_return_before_hashing_keep_the_order_and_call_then_after(tmp_path):
    """With ``then``, write_tensor / write_tiles return once written and the helper hashes
    behind; the file's digest is still that of the bytes in order, and each ``then`` runs
    after its own bytes were hashed (the pipeline drops the source's pages there)."""
    from parallel3d.checkpoint import hashed_file

    f = HashedFile(tmp_path / "x", "crc32")
    hashed, calls, want = [], [], b""
    real = f._hash_runs
    f._hash_runs = lambda runs, crc, own: (real(runs, crc, own), hashed.append(sum(r.nbytes for r in runs)))
    g = torch.Generator().manual_seed(2)
    for i in range(6):  # 4 MB each: over the threshold, under the lag bound, so nothing waits
        t = torch.randn(1000, 1000, generator=g)
        f.write_tensor(t, then=lambda i=i, n=len(want) + t.numel() * 4: calls.append((i, sum(hashed) >= n)))
        want += _bytes(t)
        f.write(b"xyz")  # a small write in between waits for the helper: bytes stay in order
        want += b"xyz"
    size, digest = f.close()
    assert (tmp_path / "x").read_bytes() == want and (size, digest) == (len(want), f"{zlib.crc32(want):08x}")
    assert calls == [(i, True) for i in range(6)]
    assert hashed_file._MAX_LAG >= 4 << 20


def test_tiles_that_do_not_make_the_tensor_are_refused():
    with pytest.raises(ValueError, match="do not make"):
        Tiles(1, [torch.zeros(3, 2), torch.zeros(3, 2)], (3, 5), torch.float32)
    with pytest.raises(ValueError, match="do not make"):
        Tiles(0, [torch.zeros(3, 4).t()], (4, 3), torch.float32)  # not contiguous


CHUNKS = [torch.randn(37, 53), torch.arange(10, dtype=torch.bfloat16), torch.tensor(3.0),
          torch.randn(3, 4, 5).half(), torch.arange(6, dtype=torch.int64).reshape(2, 3)]


def _check_chunk(data: bytes, start: int, length: int, want: torch.Tensor) -> None:
    blob = data[start:start + length]
    z = zipfile.ZipFile(io.BytesIO(blob))
    assert z.testzip() is None  # every entry's CRC-32 (data descriptors, central directory)
    ref = io.BytesIO()
    torch.save(want, ref)
    theirs = zipfile.ZipFile(ref)
    assert z.namelist() == theirs.namelist()
    assert z.read("archive/data.pkl") == theirs.read("archive/data.pkl")
    info = z.getinfo("archive/data/0")  # its local header: name and extra field lengths at 26..30
    name_len, extra_len = (int.from_bytes(blob[info.header_offset + i:info.header_offset + i + 2], "little")
                           for i in (26, 28))
    data_at = start + info.header_offset + 30 + name_len + extra_len
    assert data_at % 64 == 0 and data[data_at:data_at + info.file_size] == _bytes(want)
    got = torch.load(io.BytesIO(blob), weights_only=True)
    assert got.dtype == want.dtype and torch.equal(got, want)


@pytest.mark.parametrize("zip64", [False, True])
def test_dcp_chunks_are_the_archives_torch_save_writes(tmp_path, monkeypatch, zip64):
    if zip64:  # every size and offset from 100 bytes on takes the zip64 records of a > 4 GB tensor
        monkeypatch.setattr(dcp_write, "ZIP64_LIMIT", 100)
    w = dcp_write.DCPFileWriter(tmp_path, "__0_0.distcp", "crc32")
    w.file.write(b"\0" * 13)  # an archive that does not start aligned
    wants = list(CHUNKS)
    for i, t in enumerate(CHUNKS):
        w.write(f"t{i}", t)
    tiles = _tiles(1, [27, 26], (37, 53))
    w.write_tiles("tiles", tiles)
    wants.append(torch.cat(tiles.parts, 1))
    size, digest = w.close()
    data = (tmp_path / "__0_0.distcp").read_bytes()
    assert (size, digest) == (len(data), f"{zlib.crc32(data):08x}")
    assert [r[0] for r in w.records] == [f"t{i}" for i in range(len(CHUNKS))] + ["tiles"]
    for (key, meta, start, length), want in zip(w.records, wants):
        assert meta.shape == want.shape and meta.dtype == want.dtype
        _check_chunk(data, start, length, want)


def test_a_dtype_without_a_storage_class_goes_through_torch_save(tmp_path):
    t = torch.randn(5, 7).to(torch.float8_e4m3fn)
    w = dcp_write.DCPFileWriter(tmp_path, "a.distcp", "crc32")
    w.write("f8", t)
    w.close()
    _, _, start, length = w.records[0]
    got = torch.load(io.BytesIO((tmp_path / "a.distcp").read_bytes()[start:start + length]), weights_only=True)
    assert torch.equal(got.view(torch.uint8), t.view(torch.uint8))


# -- a tensor-parallel checkpoint converted: tiles along rows and columns, with padding ------------

_COLUMN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "embed_tokens", "lm_head")
_ROW = ("o_proj", "down_proj")


def _tp_checkpoint(folder, tp: int = 2):
    """A tp=2 checkpoint of a small Llama whose vocabulary (37) and ffn (25) do not divide
    by tp: the last block of each split is padded, as the trainer saves it. Returns the
    logical tensors."""
    from parallel3d.checkpoint.format import model_identity
    from parallel3d.checkpoint.rank_files import RankPayload, build_index, write_rank_files
    from parallel3d.checkpoint.state import Placement, Slot, logical_shapes
    from parallel3d.models.llama import LlamaConfig

    folder.mkdir()
    cfg = LlamaConfig(vocab_size=37, dim=16, n_layers=1, n_heads=4, n_kv_heads=2, ffn_dim=25)
    g = torch.Generator().manual_seed(3)
    full = {n: torch.randn(s, generator=g) for n, s in logical_shapes(cfg).items()}
    records = []
    for rank in range(tp):
        slots = []
        for name, t in full.items():
            dim = 0 if any(f"{c}." in name for c in _COLUMN) else 1 if any(f"{r}." in name for r in _ROW) else None
            if dim is None and rank:
                continue
            offsets, block = [0] * t.dim(), list(t.shape)
            if dim is not None:
                block[dim] = math.ceil(t.shape[dim] / tp)
                offsets[dim] = rank * block[dim]
            padded = torch.zeros(block)
            sl = tuple(slice(o, o + b) for o, b in zip(offsets, block))
            have = t[sl]
            padded[tuple(slice(0, n) for n in have.shape)] = have
            slots.append(Slot("model/" + name, Placement(name, tuple(t.shape), tuple(offsets), tuple(block), True),
                              padded))
        records.append(write_rank_files(folder, RankPayload(0, rank, slots, {"rank": rank})))
    index = build_index(0, records, {"model": model_identity(cfg),
                                     "layout": {"tp": tp, "pp": 1, "dp": 1, "world_size": tp}})
    index.write(folder / "index.json")
    return full


def test_tp_pieces_come_as_tiles_and_convert_bit_identical(tmp_path):
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import load_file

    full = _tp_checkpoint(tmp_path / "p3d")
    with CheckpointReader(tmp_path / "p3d") as reader, zerocopy.zero_copy_reads():
        dims = {}
        for name, want in full.items():
            tiles = reader.read_tiles("model/" + name)
            if tiles is not None:
                dims[name] = tiles.dim
                assert torch.equal(tiles.assemble(), want), name
        assert dims["embed_tokens.weight"] == 0 and dims["layers.0.mlp.down_proj.weight"] == 1
        assert dims["layers.0.self_attn.o_proj.weight"] == 1 and "norm.weight" not in dims
    convert(tmp_path / "p3d", tmp_path / "hf", "hf", progress=False)
    got = load_file(tmp_path / "hf" / "model.safetensors")
    from parallel3d.models.llama.hf import name_to_hf

    assert sorted(got) == sorted(name_to_hf(n) for n in full)
    for name, want in full.items():
        assert torch.equal(got[name_to_hf(name)], want), name
    convert(tmp_path / "p3d", tmp_path / "dcp", "dcp", progress=False, max_shard_bytes=4096)
    assert len(list((tmp_path / "dcp").glob("*.distcp"))) > 2  # several files, closed in turn
    state = {name_to_hf(n): torch.zeros_like(t) for n, t in full.items()}
    dcp.load(state, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    for name, want in full.items():
        assert torch.equal(state[name_to_hf(name)], want), name
    assert os.path.getsize(tmp_path / "dcp" / ".metadata") > 0


def test_dcp_metadata_is_the_pickle_of_torchs_own_classes():
    """The stand-ins pickle to the same bytes as torch's Metadata built from the same
    records (as dcp.save's planner builds it for whole tensors); torch's pickle.load of
    ours gives an equal Metadata."""
    import pickle

    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, Metadata, MetadataIndex,
                                                       StorageMeta, TensorProperties, TensorStorageMetadata)

    from parallel3d.checkpoint.foreign.dcp_metadata import metadata_bytes

    records = [("model.embed_tokens.weight", "__0_0.distcp", torch.Size([37, 16]), torch.float32, 0, 1000),
               ("model.norm.weight", "__0_0.distcp", torch.Size([16]), torch.bfloat16, 1000, 500),
               ("lm_head.weight", "__0_1.distcp", torch.Size([37, 16]), torch.float32, 0, 1000),
               ("scalar", "__0_1.distcp", torch.Size([]), torch.float16, 1000, 400)]
    state, storage, planner = {}, {}, {}
    for key, file, shape, dtype, start, length in records:
        zeros = torch.Size([0] * len(shape))
        state[key] = TensorStorageMetadata(TensorProperties(dtype=dtype), torch.Size(shape),
                                           [ChunkStorageMetadata(zeros, torch.Size(shape))])
        storage[MetadataIndex(key, zeros)] = _StorageInfo(file, start, length)
        planner[key] = (key,)
    theirs = Metadata(state_dict_metadata=state, planner_data=planner, storage_data=storage,
                      storage_meta=StorageMeta(checkpoint_id="/ckpt/dcp", save_id="a-save-id"), version="1.0.0")
    ours = metadata_bytes(records, "/ckpt/dcp", "a-save-id")
    assert ours == pickle.dumps(theirs)
    assert pickle.loads(ours) == theirs  # noqa: S301 - our own bytes, test side
