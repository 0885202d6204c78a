"""The on-disk format of a tokenized dataset: flat token shards plus ``index.json``.

A prepared dataset is a directory::

    index.json              written last: its presence means the dataset is complete
    train-00000.bin ...     the training split, flat little-endian uint16 or uint32 ids
    val-00000.bin ...       the held-out validation split (may be absent)
    tokenizer/              a copy of the tokenizer that made the ids

Each split is one token stream cut into shards of at most ``shard_tokens`` ids: the
documents, each followed by the EOS id, back to back. Shards are cut wherever the count
falls, even inside a document, so the shard size is a storage detail: readers see the
concatenation (:class:`TokenStream`), and a training window may span two shards.

Version 2 adds, per split, the start of every document in the stream (``train-docs-*.bin``,
little-endian int64, one entry per document: the packing of documents into windows needs
them) and, for chat data, a loss mask (``train-mask-*.bin``, one uint8 per token, 1 where
the token is a target to train on: the assistant turns; cut into shards at the same
places as the tokens). Version 1 datasets (no document starts, no mask) still open and
train as before; packing them by document asks to prepare them again.

``index.json`` records, per shard, its token count, byte size and sha256; opening a
dataset checks every size (a truncated copy fails at once), :func:`verify_checksums`
checks the hashes. :attr:`PreparedDataset.fingerprint` (derived from the hashes) names
the content, so a sampler can refuse to resume on different data.
"""

from __future__ import annotations

import hashlib
import json
import os
import uuid
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from parallel3d.errors import UserError

FORMAT = "parallel3d-tokens"
VERSION = 2
READABLE_VERSIONS = (1, 2)
INDEX = "index.json"
SPLITS = ("train", "val")
# Per split, the lists of shards besides the tokens (version 2), and their element type.
SIDE_SHARDS = {"doc_shards": np.dtype("<i8"), "mask_shards": np.dtype(np.uint8)}


def token_dtype(vocab_size: int) -> np.dtype:
    """The narrowest unsigned dtype that holds ids ``0 .. vocab_size - 1``."""
    return np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.uint32)


def atomic_write_bytes(path: Path, data) -> None:
    """Write under a temporary name unique across hosts, then rename: readers (and other
    processes writing the same file) see either nothing or the whole file."""
    tmp = path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


class ShardWriter:
    """Appends token arrays to one split and cuts them into shards of ``shard_tokens``.

    Tokens go straight to the current shard's file (``.NAME-00000.bin.partial``, renamed
    when the shard is full or at :meth:`close`), hashed as they are written: memory holds
    one added array, whatever the shard size. :meth:`state` / :meth:`restore` save and
    reload the writer at a point of the input (``prepare-data``'s resume): the finished
    shards and how many tokens of the partial one belong to it."""

    def __init__(self, out_dir: Path, split: str, dtype: np.dtype, shard_tokens: int,
                 name: str | None = None):
        self.out_dir, self.split, self.dtype = out_dir, split, np.dtype(dtype).newbyteorder("<")
        self.name = name or split  # files are NAME-00000.bin
        self.shard_tokens = shard_tokens
        self.shards: list[dict] = []
        self.num_docs = 0
        self.num_tokens_added = 0  # elements added so far, in finished shards or the partial one
        self._file = None
        self._hash = None
        self._count = 0  # elements in the partial shard

    def _partial_path(self) -> Path:
        return self.out_dir / f".{self.name}-{len(self.shards):05d}.bin.partial"

    def _open(self) -> None:
        self._file = open(self._partial_path(), "wb")
        self._hash, self._count = hashlib.sha256(), 0

    def add(self, tokens: np.ndarray, num_docs: int) -> None:
        arr = np.asarray(tokens).astype(self.dtype, copy=False)
        self.num_tokens_added += len(arr)
        self.num_docs += num_docs
        pos = 0
        while pos < len(arr):
            if self._file is None:
                self._open()
            n = min(len(arr) - pos, self.shard_tokens - self._count)
            data = arr[pos: pos + n].tobytes()
            self._file.write(data)
            self._hash.update(data)
            self._count += n
            pos += n
            if self._count == self.shard_tokens:
                self._finish()

    def _finish(self) -> None:
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        name = f"{self.name}-{len(self.shards):05d}.bin"
        os.replace(self._partial_path(), self.out_dir / name)
        self.shards.append({"file": name, "num_tokens": int(self._count),
                            "bytes": int(self._count * self.dtype.itemsize), "sha256": self._hash.hexdigest()})
        self._file, self._hash, self._count = None, None, 0

    def state(self) -> dict:
        """What :meth:`restore` needs (JSON); the partial shard's bytes are on disk."""
        if self._file is not None:
            self._file.flush()
            os.fsync(self._file.fileno())
        return {"shards": list(self.shards), "num_docs": self.num_docs,
                "num_tokens_added": self.num_tokens_added, "partial": self._count}

    def restore(self, state: dict) -> None:
        """Continue from :meth:`state`: the partial shard cut back to what it held then
        (tokens written after it are written again) and hashed again."""
        self.shards, self.num_docs = list(state["shards"]), state["num_docs"]
        self.num_tokens_added = state["num_tokens_added"]
        if state["partial"]:
            path = self._partial_path()
            done = self.out_dir / f"{self.name}-{len(self.shards):05d}.bin"
            if not path.exists() and done.exists():  # the shard was finished after the state
                os.replace(done, path)
            self._file = open(path, "r+b")
            self._file.truncate(state["partial"] * self.dtype.itemsize)
            self._hash, self._count = hashlib.sha256(), state["partial"]
            for block in iter(lambda: self._file.read(1 << 24), b""):
                self._hash.update(block)
            self._file.seek(0, os.SEEK_END)

    def close(self) -> dict:
        """Write the last partial shard; returns this split's entry of the index."""
        if self._file is not None:
            self._finish()
        return {"num_tokens": sum(s["num_tokens"] for s in self.shards),
                "num_docs": self.num_docs, "shards": self.shards}


def write_index(out_dir: Path, *, dtype: np.dtype, eos_id: int, vocab_size: int,
                tokenizer_sha256: str, splits: dict[str, dict], source: dict,
                loss_mask: bool = False) -> dict:
    index = {"format": FORMAT, "version": VERSION, "dtype": np.dtype(dtype).name,
             "eos_id": int(eos_id), "vocab_size": int(vocab_size),
             "tokenizer": {"dir": "tokenizer", "sha256": tokenizer_sha256},
             "loss_mask": bool(loss_mask), "splits": splits, "source": source}
    atomic_write_bytes(out_dir / INDEX, json.dumps(index, indent=1).encode())
    return index


class TokenStream:
    """The shards of one split read as one array of ``len(self)`` token ids.

    ``stream[a:b]`` returns ids ``a .. b-1`` as a NumPy array, reading across shard
    boundaries; shards are memory-mapped, so only the pages touched are read.
    """

    def __init__(self, shards: list[np.ndarray]):
        self.shards = [s for s in shards if len(s)]
        self.offsets = np.cumsum([0] + [len(s) for s in self.shards])  # shard k: [o_k, o_k+1)

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def __getitem__(self, key: slice) -> np.ndarray:
        if not isinstance(key, slice) or key.step not in (None, 1):
            raise TypeError("TokenStream supports contiguous slices only")
        start, stop, _ = key.indices(len(self))
        if stop <= start:
            return np.empty(0, dtype=self.shards[0].dtype if self.shards else np.uint16)
        first = int(np.searchsorted(self.offsets, start, side="right")) - 1
        parts, pos, k = [], start, first
        while pos < stop:
            lo = pos - self.offsets[k]
            hi = min(stop, self.offsets[k + 1]) - self.offsets[k]
            parts.append(self.shards[k][lo:hi])
            pos = int(self.offsets[k]) + hi
            k += 1
        return parts[0] if len(parts) == 1 else np.concatenate(parts)

    def locate(self, pos: int) -> tuple[str | None, int]:
        """(shard file, token offset in it) of stream position ``pos``; the file is None
        for shards that are plain arrays rather than memory-mapped files."""
        k = int(np.searchsorted(self.offsets, pos, side="right")) - 1
        return getattr(self.shards[k], "filename", None), pos - int(self.offsets[k])


@dataclass(frozen=True)
class PreparedDataset:
    """An opened dataset directory (see the module docstring)."""

    dir: Path
    index: dict

    @property
    def eos_id(self) -> int:
        return self.index["eos_id"]

    @property
    def vocab_size(self) -> int:
        return self.index["vocab_size"]

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(self.index["dtype"]).newbyteorder("<")  # shards are little-endian

    @property
    def fingerprint(self) -> str:
        """A short hash of the content (dtype, EOS, every shard's sha256, per split)."""
        ident = {"dtype": self.index["dtype"], "eos_id": self.eos_id,
                 "splits": {k: [s["sha256"] for s in v["shards"]]
                            for k, v in sorted(self.index["splits"].items())}}
        side = {k: [s["sha256"] for key in SIDE_SHARDS for s in v.get(key, [])]
                for k, v in sorted(self.index["splits"].items())}
        if any(side.values()):  # version 2: the documents and the mask name the content too
            ident["side"] = side
        return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:16]

    @property
    def has_documents(self) -> bool:
        """Whether every split records where its documents start (version 2)."""
        return all("doc_shards" in v for v in self.index["splits"].values())

    @property
    def has_loss_mask(self) -> bool:
        """Whether the dataset says which tokens to train on (chat data)."""
        return bool(self.index.get("loss_mask"))

    def _side(self, split: str, key: str) -> TokenStream:
        entry = self.index["splits"].get(split, {})
        maps = [np.memmap(self.dir / s["file"], dtype=SIDE_SHARDS[key], mode="r", shape=(s["num_tokens"],))
                for s in entry.get(key, []) if s["num_tokens"]]
        return TokenStream(maps)

    def document_starts(self, split: str) -> np.ndarray:
        """(documents,) int64: where each document of ``split`` starts in its token stream."""
        starts = self._side(split, "doc_shards")
        return np.asarray(starts[0:len(starts)], dtype=np.int64)

    def loss_mask(self, split: str) -> TokenStream:
        """One uint8 per token of ``split``: 1 where the token is trained on as a target."""
        return self._side(split, "mask_shards")

    def num_tokens(self, split: str) -> int:
        entry = self.index["splits"].get(split)
        return entry["num_tokens"] if entry else 0

    def split(self, name: str) -> TokenStream:
        """The token stream of ``name`` ("train" or "val"); empty if the split is absent."""
        entry = self.index["splits"].get(name, {"shards": []})
        maps = [np.memmap(self.dir / s["file"], dtype=self.dtype, mode="r", shape=(s["num_tokens"],))
                for s in entry["shards"] if s["num_tokens"]]
        return TokenStream(maps)


def open_dataset(path: str | Path) -> PreparedDataset:
    """Open a prepared dataset, checking its index and every shard's size."""
    d = Path(path)
    index_path = d / INDEX
    if not index_path.is_file():
        what = "does not exist" if not d.exists() else f"has no {INDEX}"
        raise UserError(f"dataset '{d}' {what}: make one with `parallel3d prepare-data INPUTS "
                        f"--tokenizer DIR --out {d}`")
    try:
        index = json.loads(index_path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise UserError(f"dataset index '{index_path}' cannot be read: {e}") from None
    if index.get("format") != FORMAT or index.get("version") not in READABLE_VERSIONS:
        raise UserError(f"'{index_path}' is not a {FORMAT} v{VERSION} index (format "
                        f"{index.get('format')!r}, version {index.get('version')!r}): prepare the data again")
    for shard, itemsize in all_shards(index):
        f = d / shard["file"]
        size = f.stat().st_size if f.is_file() else None
        want = shard["num_tokens"] * itemsize
        if size != want:
            got = "missing" if size is None else f"{size} bytes"
            raise UserError(f"shard '{f}' is {got}, the index says {want} bytes: the dataset "
                            "is truncated or was changed; prepare it again")
    return PreparedDataset(d, index)


def all_shards(index: dict):
    """(shard entry, bytes per element) of every file the index names: tokens, and the
    document starts and loss mask of version 2; splits in name order (the same list on
    every rank)."""
    itemsize = np.dtype(index["dtype"]).itemsize
    for _, entry in sorted(index["splits"].items()):
        for shard in entry["shards"]:
            yield shard, itemsize
        for key, dtype in SIDE_SHARDS.items():
            for shard in entry.get(key, []):
                yield shard, dtype.itemsize


def file_sha256(path: Path, stop=None) -> str | None:
    """sha256 of ``path``, read 16 MiB at a time (hashlib releases the GIL on each block);
    None if ``stop`` (a ``threading.Event``) is set before the end."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            if stop is not None and stop.is_set():
                return None
            h.update(block)
    return h.hexdigest()


def shard_mismatch_message(path: Path) -> str:
    return (f"shard '{path}' does not match its sha256 in the dataset's {INDEX}: the file "
            "changed after prepare-data wrote it; restore it or prepare the data again")


def verify_checksums(ds: PreparedDataset) -> None:
    """Re-hash every shard against the index (reads the whole dataset)."""
    for shard, _ in all_shards(ds.index):
        if file_sha256(ds.dir / shard["file"]) != shard["sha256"]:
            raise UserError(shard_mismatch_message(ds.dir / shard["file"]))
