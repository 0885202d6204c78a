"""The embedded corpus, its tokenizer, and the deterministic data-parallel sampler.

Default corpus: the ``.py`` sources of the running Python's standard library (real text
that every machine has), read in sorted path order up to ``data.max_bytes``, documents
separated by the EOS id. A byte-level BPE of ``data.vocab_size`` is trained on it with
Hugging Face ``tokenizers``; the token ids are cached in a memory-mapped ``.bin`` file
(uint16 when the vocabulary allows) keyed by everything that determines them.

Samples are the non-overlapping windows ``tokens[i*S : i*S + S + 1]`` (inputs and the
targets shifted by one). :class:`GlobalBatchSampler` walks a seeded permutation of them,
``global_batch`` samples per step, and gives each data-parallel rank its contiguous slice
cut into micro-batches, so any dp degree sees exactly the same global batch.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from parallel3d.config import DataConfig
from parallel3d.errors import UserError

EOS = "<|eos|>"


def _cache_root(cfg: DataConfig) -> Path:
    root = cfg.cache_dir or os.path.join(os.path.expanduser("~"), ".cache", "parallel3d")
    return Path(root)


def stdlib_files() -> list[Path]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    return sorted(p for p in stdlib.rglob("*.py") if "site-packages" not in p.parts)


def _read_corpus(max_bytes: int) -> list[str]:
    docs, total = [], 0
    for path in stdlib_files():
        text = path.read_text(encoding="utf-8", errors="replace")
        docs.append(text)
        total += len(text.encode("utf-8"))
        if total >= max_bytes:
            break
    return docs


def _atomic_write_bytes(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


@dataclass(frozen=True)
class Corpus:
    """A tokenized corpus on disk: ``tokens.bin`` (+ ``meta.json``, ``tokenizer.json``)."""

    dir: Path

    @property
    def meta(self) -> dict:
        return json.loads((self.dir / "meta.json").read_text())

    def tokens(self) -> np.ndarray:
        meta = self.meta
        return np.memmap(self.dir / "tokens.bin", dtype=np.dtype(meta["dtype"]), mode="r",
                         shape=(meta["num_tokens"],))


def stdlib_corpus_key(cfg: DataConfig) -> str:
    ident = {"python": sys.version, "stdlib": sysconfig.get_paths()["stdlib"],
             "max_bytes": cfg.max_bytes, "vocab_size": cfg.vocab_size, "format": 1}
    return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:16]


def prepare_corpus(cfg: DataConfig) -> Corpus:
    """Build (or find in the cache) the tokenized corpus; safe to call from many processes
    (files are written under temporary names and renamed; ``meta.json`` goes last)."""
    if cfg.source != "stdlib":
        raise UserError(f"data.source '{cfg.source}' is not supported: use 'stdlib'")
    if cfg.vocab_size < 257:
        raise UserError(f"data.vocab_size {cfg.vocab_size} is too small for a byte-level BPE "
                        "(needs at least 257: 256 bytes plus EOS)")
    out = _cache_root(cfg) / f"stdlib-{stdlib_corpus_key(cfg)}"
    if (out / "meta.json").is_file():
        return Corpus(out)
    out.mkdir(parents=True, exist_ok=True)
    from tokenizers import ByteLevelBPETokenizer

    docs = _read_corpus(cfg.max_bytes)
    tok = ByteLevelBPETokenizer()
    tok.train_from_iterator(docs, vocab_size=cfg.vocab_size, min_frequency=2,
                            special_tokens=[EOS], show_progress=False)
    eos_id = tok.token_to_id(EOS)
    ids: list[int] = []
    for enc in tok.encode_batch(docs):
        ids.extend(enc.ids)
        ids.append(eos_id)
    dtype = np.uint16 if tok.get_vocab_size() <= 65536 else np.uint32
    _atomic_write_bytes(out / "tokens.bin", np.asarray(ids, dtype=dtype).tobytes())
    _atomic_write_bytes(out / "tokenizer.json", tok._tokenizer.to_str().encode())
    meta = {"num_tokens": len(ids), "dtype": np.dtype(dtype).name, "eos_id": eos_id,
            "vocab_size": tok.get_vocab_size(), "num_docs": len(docs), "source": "stdlib"}
    _atomic_write_bytes(out / "meta.json", json.dumps(meta, indent=1).encode())
    return Corpus(out)


class TokenWindows:
    """Sample ``i`` is ``tokens[i*S : i*S + S + 1]``: inputs ``[:-1]``, targets ``[1:]``."""

    def __init__(self, tokens: np.ndarray, seq_len: int):
        self.tokens = tokens
        self.seq_len = seq_len
        self.num_samples = (len(tokens) - 1) // seq_len
        if self.num_samples < 1:
            raise UserError(f"corpus of {len(tokens)} tokens is shorter than train.seq_len {seq_len}")

    def batch(self, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets), each (len(indices), S) int64."""
        S = self.seq_len
        rows = np.stack([np.asarray(self.tokens[i * S: i * S + S + 1], dtype=np.int64) for i in indices])
        t = torch.from_numpy(rows)
        return t[:, :-1], t[:, 1:]


class GlobalBatchSampler:
    """Deterministic, shuffled, data-parallel-sharded sample indices.

    Global position ``p`` (samples consumed since the start) maps to sample
    ``perm_e[p mod N]`` with ``e = p // N`` and ``perm_e`` a permutation seeded by
    ``(seed, e)``. Step ``t`` covers positions ``[t*G, (t+1)*G)``; data-parallel rank ``r``
    takes the ``r``-th of ``dp`` contiguous slices and cuts it into micro-batches.
    """

    def __init__(self, num_samples: int, global_batch: int, micro_batch: int,
                 dp: int, dp_rank: int, seed: int):
        self.num_samples = num_samples
        self.global_batch = global_batch
        self.micro_batch = micro_batch
        self.dp, self.dp_rank, self.seed = dp, dp_rank, seed
        self._perms: dict[int, np.ndarray] = {}

    @property
    def micro_batches_per_step(self) -> int:
        return self.global_batch // (self.micro_batch * self.dp)

    def _sample_at(self, pos: int) -> int:
        epoch, offset = divmod(pos, self.num_samples)
        perm = self._perms.get(epoch)
        if perm is None:
            perm = np.random.default_rng([self.seed, epoch]).permutation(self.num_samples)
            self._perms = {epoch: perm}  # positions only move forward: keep one epoch
        return int(perm[offset])

    def step_indices(self, step: int) -> list[list[int]]:
        """This rank's sample indices for ``step``, as a list of micro-batches."""
        per_rank = self.global_batch // self.dp
        start = step * self.global_batch + self.dp_rank * per_rank
        idx = [self._sample_at(start + i) for i in range(per_rank)]
        m = self.micro_batch
        return [idx[i: i + m] for i in range(0, per_rank, m)]
