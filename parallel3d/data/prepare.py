"""``parallel3d prepare-data``: raw text to token shards, in parallel worker processes.

Inputs are read as described in :mod:`parallel3d.data.sources`. Every document is
encoded without the tokenizer's own special tokens and followed by the EOS id. Document
``i`` (in input order) goes to the validation split when ``floor((i+1) f) > floor(i f)``
for ``f = val_fraction``: whole documents, evenly spread, ``floor(n f)`` of them, the same
on every run. The main process reads the inputs in chunks, workers tokenize them, and
results are written in input order, so the shards are identical for any number of
workers.
"""

from __future__ import annotations

import collections
import contextlib
import os
import shutil
import sys
import time
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np

from parallel3d.data.format import INDEX, SPLITS, ShardWriter, token_dtype, write_index
from parallel3d.data.sources import CHUNK_BYTES, documents_of, expand_inputs, input_tasks
from parallel3d.data.tokenizer import TokenizerSpec, load_tokenizer
from parallel3d.errors import UserError

__all__ = ["PrepareReport", "Progress", "TokenizerSpec", "load_tokenizer", "prepare_data",
           "tokenize_to_shards"]

DEFAULT_SHARD_TOKENS = 1 << 27  # 128 Mi tokens: 256 MiB as uint16


# ---------------------------------------------------------------------------------------
# Workers


class _Worker:
    tok = None
    eos_id = 0
    dtype = np.dtype(np.uint16)


def init_worker(tokenizer_json: str, eos_id: int, dtype: str) -> None:
    from tokenizers import Tokenizer

    _Worker.tok = Tokenizer.from_file(tokenizer_json)
    _Worker.eos_id, _Worker.dtype = eos_id, np.dtype(dtype)


def encode_task(task: tuple) -> tuple[np.ndarray, np.ndarray, int, int]:
    """Tokenize one unit: (ids with EOS after each document, tokens per document,
    UTF-8 bytes of text, bytes on disk). Empty documents are dropped."""
    kind, payload, disk_bytes = task
    docs = [d for d in documents_of(kind, payload) if d]
    tok, eos = _Worker.tok, _Worker.eos_id
    encode = getattr(tok, "encode_batch_fast", tok.encode_batch)
    encodings = encode(docs, add_special_tokens=False) if docs else []
    lengths = np.fromiter((len(e.ids) + 1 for e in encodings), dtype=np.int64, count=len(encodings))
    ids = np.empty(int(lengths.sum()), dtype=_Worker.dtype)
    pos = 0
    for enc, n in zip(encodings, lengths):
        ids[pos: pos + n - 1] = enc.ids
        ids[pos + n - 1] = eos
        pos += n
    text_bytes = sum(len(d.encode("utf-8")) for d in docs)
    return ids, lengths, text_bytes, disk_bytes


@contextlib.contextmanager
def _tokenizer_threads(enabled: bool):
    """The tokenizers library reads TOKENIZERS_PARALLELISM at each batch call: switch its
    own thread pool on or off for the duration, then restore the environment."""
    old = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "true" if enabled else "false"
    try:
        yield
    finally:
        if old is None:
            del os.environ["TOKENIZERS_PARALLELISM"]
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = old


def _pool_worker_init(*args) -> None:
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one process per core, one thread each
    init_worker(*args)


def _bounded_ordered(pool, tasks: Iterable[tuple], window: int) -> Iterator[tuple]:
    """``pool.imap`` in order, but never more than ``window`` tasks in flight (imap reads
    its whole input ahead, which would hold the whole corpus in memory)."""
    pending: collections.deque = collections.deque()
    for task in tasks:
        pending.append(pool.apply_async(encode_task, (task,)))
        if len(pending) >= window:
            yield pending.popleft().get()
    while pending:
        yield pending.popleft().get()


# ---------------------------------------------------------------------------------------
# Progress


class Progress:
    """A tqdm bar when stderr is a terminal and tqdm is installed, else a line every
    ``every_s`` seconds; ``enabled=False`` prints nothing."""

    def __init__(self, total_bytes: int, enabled: bool = True, every_s: float = 10.0):
        self.total, self.done, self.tokens = total_bytes, 0, 0
        self.enabled, self.every_s = enabled, every_s
        self.t0 = self._last = time.perf_counter()
        self.bar = None
        if enabled and sys.stderr.isatty():
            try:
                from tqdm import tqdm

                self.bar = tqdm(total=total_bytes, unit="B", unit_scale=True, desc="prepare-data",
                                file=sys.stderr)
            except ImportError:
                pass

    def update(self, disk_bytes: int, tokens: int) -> None:
        self.done += disk_bytes
        self.tokens += tokens
        if self.bar is not None:
            self.bar.update(disk_bytes)
            return
        now = time.perf_counter()
        if self.enabled and now - self._last >= self.every_s:
            self._last = now
            dt = now - self.t0
            print(f"prepare-data: {100 * self.done / max(1, self.total):.0f}% "
                  f"({self.done / 1e6:.1f} of {self.total / 1e6:.1f} MB), {self.done / 1e6 / dt:.2f} MB/s, "
                  f"{self.tokens / dt:,.0f} tokens/s", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


# ---------------------------------------------------------------------------------------
# The pipeline


@dataclass
class PrepareReport:
    out: Path
    num_files: int
    disk_bytes: int  # input bytes on disk (compressed size for .gz)
    text_bytes: int  # UTF-8 bytes of the documents
    seconds: float
    workers: int
    docs: dict[str, int] = field(default_factory=dict)  # per split
    tokens: dict[str, int] = field(default_factory=dict)
    shards: dict[str, int] = field(default_factory=dict)

    @property
    def mb_per_s(self) -> float:
        return self.disk_bytes / 1e6 / self.seconds

    @property
    def tokens_per_s(self) -> float:
        return sum(self.tokens.values()) / self.seconds

    def summary(self) -> str:
        docs, toks = sum(self.docs.values()), sum(self.tokens.values())
        shards = sum(self.shards.values())
        return (f"prepared {docs:,} documents ({self.docs['train']:,} train, {self.docs['val']:,} val), "
                f"{toks:,} tokens in {shards} shard{'s' * (shards != 1)} from {self.num_files} "
                f"file{'s' * (self.num_files != 1)}, {self.disk_bytes / 1e6:.1f} MB on disk "
                f"({self.text_bytes / 1e6:.1f} MB of text) in {self.seconds:.1f} s: "
                f"{self.mb_per_s:.2f} MB/s, {self.tokens_per_s:,.0f} tokens/s "
                f"({self.workers} worker{'s' * (self.workers != 1)}) -> {self.out}")


def _val_mask(first_doc: int, n: int, frac: Fraction) -> np.ndarray:
    """Document ``i`` is held out when ``floor((i+1) f) > floor(i f)`` (exact integers)."""
    i = np.arange(first_doc, first_doc + n, dtype=np.int64)
    p, q = frac.numerator, frac.denominator
    return ((i + 1) * p) // q > (i * p) // q


def tokenize_to_shards(tasks: Iterable[tuple], spec: TokenizerSpec, out: Path, *,
                       val_fraction: float, shard_tokens: int, workers: int,
                       progress: Progress) -> tuple[dict, dict, dict, int]:
    """Run ``tasks`` through the workers and write both splits. Returns the index's
    ``splits`` entry, documents and tokens per split, and the UTF-8 bytes of text.

    ``workers``: N > 1 processes of one thread each; 1: this process, one thread; 0: this
    process with the tokenizers library's own thread pool (all cores)."""
    dtype = token_dtype(spec.vocab_size)
    frac = Fraction(val_fraction).limit_denominator(1_000_000)
    writers = {s: ShardWriter(out, s, dtype, shard_tokens) for s in SPLITS}
    initargs = (str(spec.json_path), spec.eos_id, dtype.name)
    with contextlib.ExitStack() as stack:
        if workers > 1:
            import multiprocessing as mp

            # spawn: the tokenizers library's thread pool does not survive fork.
            pool = mp.get_context("spawn").Pool(workers, initializer=_pool_worker_init, initargs=initargs)
            stack.callback(pool.join)
            stack.callback(pool.terminate)
            results = _bounded_ordered(pool, tasks, window=2 * workers + 2)
        else:
            stack.enter_context(_tokenizer_threads(workers == 0))
            init_worker(*initargs)
            results = map(encode_task, tasks)
        stack.callback(progress.close)
        n_docs, text_bytes = _write_results(results, writers, frac, progress)
    splits = {s: w.close() for s, w in writers.items()}
    docs = {s: splits[s]["num_docs"] for s in SPLITS}
    tokens = {s: splits[s]["num_tokens"] for s in SPLITS}
    return splits, docs, tokens, text_bytes


def _write_results(results, writers: dict[str, ShardWriter], frac: Fraction,
                   progress: Progress) -> tuple[int, int]:
    """Append each result, in order, to the split each of its documents belongs to."""
    n_docs, text_bytes = 0, 0
    for ids, lengths, nbytes, disk_bytes in results:
        is_val = _val_mask(n_docs, len(lengths), frac)
        token_is_val = np.repeat(is_val, lengths)
        writers["train"].add(ids[~token_is_val], int((~is_val).sum()))
        writers["val"].add(ids[token_is_val], int(is_val.sum()))
        n_docs += len(lengths)
        text_bytes += nbytes
        progress.update(disk_bytes, len(ids))
    return n_docs, text_bytes


def copy_tokenizer(spec: TokenizerSpec, out: Path) -> None:
    dst = out / "tokenizer"
    dst.mkdir(parents=True, exist_ok=True)
    if dst.resolve() == spec.dir.resolve():
        return
    shutil.copyfile(spec.json_path, dst / "tokenizer.json")
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        if (spec.dir / name).is_file():
            shutil.copyfile(spec.dir / name, dst / name)


def _clear_old(out: Path, overwrite: bool) -> None:
    if (out / INDEX).exists():
        if not overwrite:
            raise UserError(f"'{out}' already holds a prepared dataset ({INDEX}): choose another --out "
                            "or pass --overwrite")
        (out / INDEX).unlink()  # first, so nothing reads old shards as the new dataset
    for old in out.glob("*.bin"):
        if old.name.startswith(tuple(f"{s}-" for s in SPLITS)):
            old.unlink()


def check_options(val_fraction: float, shard_tokens: int, workers: int) -> None:
    if not 0.0 <= val_fraction < 1.0:
        raise UserError(f"--val-fraction must be in [0, 1), got {val_fraction}")
    if shard_tokens < 1:
        raise UserError(f"--shard-tokens must be positive, got {shard_tokens}")
    if workers < 1:
        raise UserError(f"--workers must be at least 1, got {workers}")


def prepare_data(inputs: list[str], tokenizer: str | Path, out: str | Path, *,
                 text_key: str = "text", eos_token: str | None = None, workers: int | None = None,
                 shard_tokens: int = DEFAULT_SHARD_TOKENS, val_fraction: float = 0.0,
                 overwrite: bool = False, progress: bool = True,
                 chunk_bytes: int = CHUNK_BYTES) -> PrepareReport:
    """Tokenize ``inputs`` with the tokenizer in ``tokenizer`` into a dataset at ``out``."""
    workers = (os.cpu_count() or 1) if workers is None else workers
    check_options(val_fraction, shard_tokens, workers)
    if not inputs:
        raise UserError("no inputs: give files, directories or glob patterns")
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise UserError(f"--out '{out}' is a file: give a directory for the dataset")
    # An output directory inside an input directory is not input (index.json is JSON).
    files = [f for f in expand_inputs(inputs) if out.resolve() not in f.resolve().parents]
    if not files:
        raise UserError(f"the inputs hold no files outside --out '{out}'")
    spec = load_tokenizer(tokenizer, eos_token)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"--out '{out}' cannot be created: {e.strerror}") from None
    _clear_old(out, overwrite)
    t0 = time.perf_counter()
    disk_total = sum(f.stat().st_size for f in files)
    splits, docs, tokens, text_bytes = tokenize_to_shards(
        input_tasks(files, text_key, chunk_bytes), spec, out, val_fraction=val_fraction,
        shard_tokens=shard_tokens, workers=workers, progress=Progress(disk_total, progress))
    n_docs = sum(docs.values())
    if n_docs == 0:
        raise UserError(f"the inputs ({len(files)} file{'s' * (len(files) != 1)}) hold no documents: "
                        f"every one is empty or has an empty '{text_key}'")
    if val_fraction > 0 and docs["val"] == 0:
        raise UserError(f"--val-fraction {val_fraction} of {n_docs} documents holds out none: raise it "
                        f"to at least {1 / n_docs:.2g} or give more documents")
    copy_tokenizer(spec, out)
    write_index(out, dtype=token_dtype(spec.vocab_size), eos_id=spec.eos_id,
                vocab_size=spec.vocab_size, tokenizer_sha256=spec.sha256, splits=splits,
                source={"inputs": [str(i) for i in inputs], "num_files": len(files),
                        "text_key": text_key, "val_fraction": val_fraction,
                        "eos_token": spec.eos_token})
    return PrepareReport(out, len(files), disk_total, text_bytes, time.perf_counter() - t0, workers,
                         docs, tokens, {s: len(splits[s]["shards"]) for s in SPLITS})
