"""The conversion pipeline: reads ahead within the memory budget, in order; what the default
verification catches (an altered source file, a written file of the wrong size) and that
nothing is published then; ``--verify full`` reads back."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch

from parallel3d.checkpoint.convert import convert
from parallel3d.checkpoint.errors import CheckpointError
from parallel3d.checkpoint.pipeline import Item, read_ahead
from parallel3d.checkpoint.safetensors_io import HashedFile, file_sha256


class _SlowSource:
    """Tensors of known sizes, each read slowly; records the bytes alive at once."""

    def __init__(self, sizes: list[int]):
        self.sizes = sizes
        self.alive = 0
        self.peak = 0
        self.lock = threading.Lock()

    def read(self, name: str) -> torch.Tensor:
        n = self.sizes[int(name)]
        with self.lock:  # counted from the start of the read: its memory is committed
            self.alive += n * 4
            self.peak = max(self.peak, self.alive)
        time.sleep(0.01)
        return torch.full((n,), float(name))

    def release(self, t: torch.Tensor) -> None:
        with self.lock:
            self.alive -= t.numel() * 4


@pytest.mark.parametrize("budget", [4_000, 40_000])
def test_read_ahead_keeps_order_and_the_budget(budget):
    sizes = [100, 900, 50, 2_000, 10, 400, 400, 400, 3_000, 5]  # elements (4 bytes)
    source = _SlowSource(sizes)
    items = [Item(str(i), str(i), (n,), torch.float32, torch.float32) for i, n in enumerate(sizes)]
    seen = []
    for item, tensor in read_ahead(source, items, budget=budget, threads=4):
        assert torch.equal(tensor, torch.full((item.shape[0],), float(item.name)))
        seen.append(item.name)
        source.release(tensor)
        del tensor
    assert seen == [str(i) for i in range(len(sizes))]
    # at most the budget, or one tensor larger than it alone
    assert source.peak <= max(budget, max(sizes) * 4), (source.peak, budget)
    if budget == 40_000:  # reads were admitted ahead of the consumer: more than one at once
        assert source.peak > max(sizes) * 4


def test_hashed_file_digest_is_the_file_sha256(tmp_path):
    f = HashedFile(tmp_path / "x")
    f.write(b"abc")
    f.write(memoryview(torch.arange(2**19, dtype=torch.float32).numpy()).cast("B"))  # parallel hash path
    size, digest = f.close()
    assert (size, digest) == file_sha256(tmp_path / "x")
    import zlib

    c = HashedFile(tmp_path / "y", "crc32")
    c.write(b"abc")
    c.write(memoryview(torch.arange(2**19, dtype=torch.float32).numpy()).cast("B"))
    data = (tmp_path / "x").read_bytes()
    assert c.close() == (len(data), f"{zlib.crc32(data):08x}")


@pytest.fixture()
def small_checkpoint(tmp_path):
    """A Hugging Face model folder converted to parallel3d (one file)."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).save_pretrained(tmp_path / "hf")
    convert(tmp_path / "hf", tmp_path / "p3d", "parallel3d", progress=False)
    return tmp_path / "p3d" / "step_00000000"


def test_verify_full_catches_an_altered_source_file_and_publishes_nothing(small_checkpoint, tmp_path):
    part = small_checkpoint / "part_00000.safetensors"
    data = bytearray(part.read_bytes())
    data[-8] ^= 0xFF  # a flipped bit in the last tensor: same size, other sha256
    part.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="does not match the sha256"):
        convert(small_checkpoint, tmp_path / "out", "hf", progress=False, verify="full")
    assert not (tmp_path / "out").exists()
    convert(small_checkpoint, tmp_path / "out", "hf", progress=False)  # the default checks sizes only


def test_a_written_file_of_the_wrong_size_is_caught(small_checkpoint, tmp_path, monkeypatch):
    from parallel3d.checkpoint import writers

    real = writers.check_output

    def truncate_then_check(out, to):
        path = Path(out.folder) / next(iter(out.files))
        path.write_bytes(path.read_bytes()[:-4])
        real(out, to)

    monkeypatch.setattr(writers, "check_output", truncate_then_check)
    with pytest.raises(CheckpointError, match="bytes, .* were written"):
        convert(small_checkpoint, tmp_path / "out", "dcp", progress=False)
    assert not (tmp_path / "out").exists()


def test_verify_full_reads_every_tensor_back(small_checkpoint, tmp_path, monkeypatch):
    from parallel3d.checkpoint import convert as convert_module

    calls = []
    real = convert_module._verify_full
    monkeypatch.setattr(convert_module, "_verify_full", lambda *a: (calls.append(a[2]), real(*a)))
    for to in ("hf", "dcp", "parallel3d"):
        convert(small_checkpoint, tmp_path / f"full_{to}", to, progress=False, verify="full")
    assert len(calls) == 3 and all(len(names) >= 9 for names in calls)
