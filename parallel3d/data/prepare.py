"""``parallel3d prepare-data``: raw text to token shards, in parallel worker processes.

Inputs (files, directories searched recursively, or glob patterns; sorted, so the output
does not depend on the order the shell lists them):

- ``.txt``: one file is one document (read whole, UTF-8, bad bytes replaced);
- ``.jsonl`` / ``.json``: JSON lines, one object per line, the document in ``text_key``;
- ``.parquet``: one row is one document, the column ``text_key`` (needs pyarrow);
- ``.txt.gz``, ``.jsonl.gz``, ``.json.gz``: the same, gzip-compressed.

Every document is encoded without the tokenizer's own special tokens and followed by the
EOS id. Document ``i`` (in input order) goes to the validation split when
``floor((i+1) f) > floor(i f)`` for ``f = val_fraction``: whole documents, evenly spread,
``floor(n f)`` of them, the same on every run. The main process reads the inputs in
chunks, workers tokenize them, and results are written in input order, so the shards are
identical for any number of workers.
"""

from __future__ import annotations

import collections
import contextlib
import glob
import gzip
import hashlib
import json
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
from parallel3d.errors import UserError

TEXT_SUFFIXES = (".txt",)
JSONL_SUFFIXES = (".jsonl", ".json")
PARQUET_SUFFIXES = (".parquet",)
DEFAULT_SHARD_TOKENS = 1 << 27  # 128 Mi tokens: 256 MiB as uint16
CHUNK_BYTES = 1 << 20  # text handed to a worker at a time


# ---------------------------------------------------------------------------------------
# Tokenizer


@dataclass(frozen=True)
class TokenizerSpec:
    """What workers need to rebuild the tokenizer, and what the index records of it."""

    dir: Path
    json_path: Path
    eos_token: str
    eos_id: int
    vocab_size: int  # one past the largest id
    sha256: str


def _special_token(value) -> str | None:
    if isinstance(value, dict):  # {"content": "</s>", "lstrip": false, ...}
        value = value.get("content")
    return value if isinstance(value, str) and value else None


def load_tokenizer(path: str | Path, eos_token: str | None = None) -> TokenizerSpec:
    """Read a Hugging Face tokenizer folder (``tokenizer.json``; the EOS token from
    ``tokenizer_config.json`` or ``special_tokens_map.json`` unless ``eos_token`` is given)."""
    from tokenizers import Tokenizer

    path = Path(path)
    d = path.parent if path.is_file() else path
    json_path = path if path.is_file() else path / "tokenizer.json"
    if not d.is_dir():
        raise UserError(f"tokenizer '{path}' not found: give a Hugging Face tokenizer folder")
    if not json_path.is_file():
        raise UserError(f"tokenizer folder '{d}' has no tokenizer.json (the fast-tokenizer file): "
                        "save one with transformers' AutoTokenizer.from_pretrained(DIR).save_pretrained(DIR)")
    try:
        tok = Tokenizer.from_file(str(json_path))
    except Exception as e:  # noqa: BLE001 - the library raises a bare Exception
        raise UserError(f"tokenizer '{json_path}' cannot be read: {str(e).splitlines()[0]}") from None
    if eos_token is None:
        for name in ("tokenizer_config.json", "special_tokens_map.json"):
            f = d / name
            if f.is_file():
                try:
                    eos_token = _special_token(json.loads(f.read_text()).get("eos_token"))
                except (json.JSONDecodeError, AttributeError):
                    raise UserError(f"'{f}' is not a JSON object") from None
                if eos_token:
                    break
    if not eos_token:
        raise UserError(f"no EOS token: neither tokenizer_config.json nor special_tokens_map.json in "
                        f"'{d}' names an eos_token; pass --eos-token TOKEN")
    eos_id = tok.token_to_id(eos_token)
    if eos_id is None:
        raise UserError(f"EOS token {eos_token!r} is not in the vocabulary of '{json_path}': "
                        "pass the right --eos-token")
    vocab_size = max(tok.get_vocab(with_added_tokens=True).values()) + 1
    sha = hashlib.sha256(json_path.read_bytes()).hexdigest()
    return TokenizerSpec(d, json_path, eos_token, eos_id, vocab_size, sha)


# ---------------------------------------------------------------------------------------
# Inputs


def _kind(path: Path) -> str | None:
    name = path.name.lower()
    if name.endswith(".gz"):
        name = name[:-3]
    for kind, suffixes in (("text", TEXT_SUFFIXES), ("jsonl", JSONL_SUFFIXES)):
        if name.endswith(suffixes):
            return kind
    if path.name.lower().endswith(PARQUET_SUFFIXES):
        return "parquet"
    return None


def expand_inputs(patterns: list[str]) -> list[Path]:
    """Files named directly, found under directories, or matched by globs; sorted."""
    files: set[Path] = set()
    for pattern in patterns:
        p = Path(pattern)
        if p.is_dir():
            found = [f for f in p.rglob("*") if f.is_file() and _kind(f)]
            if not found:
                raise UserError(f"input directory '{p}' holds no .txt, .jsonl, .json or .parquet files")
            files.update(found)
        elif p.is_file():
            if not _kind(p):
                raise UserError(f"input '{p}' is not .txt, .jsonl, .json or .parquet (optionally .gz, "
                                "except Parquet): rename it or convert it")
            files.add(p)
        elif glob.has_magic(pattern):
            found = [Path(f) for f in glob.glob(pattern, recursive=True) if _kind(Path(f))]
            if not found:
                raise UserError(f"input pattern '{pattern}' matches no .txt, .jsonl, .json or .parquet files")
            files.update(f for f in found if f.is_file())
        else:
            raise UserError(f"input '{pattern}' not found")
    return sorted(files)


def _open_binary(path: Path):
    return gzip.open(path, "rb") if path.name.lower().endswith(".gz") else open(path, "rb")


def _raw_position(f) -> int:
    """Bytes of the file on disk consumed so far (the compressed offset for gzip)."""
    return f.fileobj.tell() if isinstance(f, gzip.GzipFile) else f.tell()


def _jsonl_tasks(path: Path, text_key: str, chunk_bytes: int) -> Iterator[tuple]:
    with _open_binary(path) as f:
        lines, size, first, lineno, last = [], 0, 1, 0, 0
        for line in f:
            lineno += 1
            lines.append(line)
            size += len(line)
            if size >= chunk_bytes:
                pos = _raw_position(f)
                yield ("jsonl", (str(path), first, lines, text_key), pos - last)
                lines, size, first, last = [], 0, lineno + 1, pos
        if lines or last < path.stat().st_size:
            yield ("jsonl", (str(path), first, lines, text_key), path.stat().st_size - last)


def _parquet_tasks(path: Path, text_key: str, chunk_bytes: int) -> Iterator[tuple]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise UserError(f"reading '{path}' needs pyarrow: pip install parallel3d[data]") from None
    try:
        pf = pq.ParquetFile(path)
    except Exception as e:  # noqa: BLE001 - pyarrow raises several types for a bad file
        raise UserError(f"'{path}' cannot be read as Parquet: {str(e).splitlines()[0]}") from None
    names = pf.schema_arrow.names
    if text_key not in names:
        raise UserError(f"'{path}' has no column '{text_key}' (columns: {', '.join(names)}): pass --text-key")
    column_type = str(pf.schema_arrow.field(text_key).type)
    if column_type not in ("string", "large_string"):
        raise UserError(f"'{path}' column '{text_key}' holds {column_type}, not text: pass --text-key")
    rows, size = max(1, pf.metadata.num_rows), path.stat().st_size
    done = 0
    for batch in pf.iter_batches(batch_size=4096, columns=[text_key]):
        texts = [t for t in batch.column(0).to_pylist() if t is not None]
        advanced = size * (done + batch.num_rows) // rows - size * done // rows
        done += batch.num_rows
        yield ("texts", texts, advanced)


def input_tasks(files: list[Path], text_key: str, chunk_bytes: int = CHUNK_BYTES) -> Iterator[tuple]:
    """``(kind, payload, bytes_on_disk)`` units of work, in input order."""
    for path in files:
        kind = _kind(path)
        if kind == "text":
            yield ("text", str(path), path.stat().st_size)
        elif kind == "jsonl":
            yield from _jsonl_tasks(path, text_key, chunk_bytes)
        else:
            yield from _parquet_tasks(path, text_key, chunk_bytes)


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


def _docs_of(kind: str, payload) -> list[str]:
    if kind == "texts":
        return payload
    if kind == "text":
        with _open_binary(Path(payload)) as f:
            return [f.read().decode("utf-8", errors="replace")]
    path, first, lines, key = payload
    docs = []
    for n, line in enumerate(lines, first):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise UserError(f"{path}:{n}: not a JSON line ({e})") from None
        text = obj.get(key) if isinstance(obj, dict) else None
        if not isinstance(text, str):
            keys = ", ".join(obj) if isinstance(obj, dict) else type(obj).__name__
            raise UserError(f"{path}:{n}: no string under '{key}' (found: {keys}): pass --text-key")
        docs.append(text)
    return docs


def encode_task(task: tuple) -> tuple[np.ndarray, np.ndarray, int, int]:
    """Tokenize one unit: (ids with EOS after each document, tokens per document,
    UTF-8 bytes of text, bytes on disk). Empty documents are dropped."""
    kind, payload, disk_bytes = task
    docs = [d for d in _docs_of(kind, payload) if d]
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
    # An output directory inside an input directory is not input (index.json is JSON).
    files = [f for f in expand_inputs(inputs) if out.resolve() not in f.resolve().parents]
    if not files:
        raise UserError(f"the inputs hold no files outside --out '{out}'")
    spec = load_tokenizer(tokenizer, eos_token)
    out.mkdir(parents=True, exist_ok=True)
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
