"""``parallel3d prepare-data``: raw text to token shards, in parallel worker processes.

Inputs are read as described in :mod:`parallel3d.data.sources`. ``--format text`` (the
default): every document is encoded without the tokenizer's own special tokens and
followed by the EOS id. ``--format chat``: every JSON line is a conversation, rendered with
the tokenizer's chat template and stored with its loss mask (:mod:`parallel3d.data.chat`).
Where each document starts is stored too (format version 2). Document
``i`` (in input order) goes to the validation split when ``floor((i+1) f) > floor(i f)``
for ``f = val_fraction``: whole documents, evenly spread, ``floor(n f)`` of them, the same
on every run. The main process reads the inputs in chunks, workers tokenize them, and
results are written in input order, so the shards are identical for any number of
workers.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import os
import shutil
import sys
import time
from fractions import Fraction
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np

from parallel3d.data.chat import CHAT_TEMPLATE_FILES, ChatRenderer, has_chat_template
from parallel3d.data.format import INDEX, SPLITS, ShardWriter, token_dtype, write_index
from parallel3d.data.progress import PrepareReport, Progress
from parallel3d.data.resume import StateSaver, clear_state, kept_files, load_state, options_key, restore_writers
from parallel3d.data.sources import CHUNK_BYTES, documents_of, expand_inputs, input_tasks
from parallel3d.data.tokenizer import TokenizerSpec, load_tokenizer, tokenizer_folder
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


def _die_with_parent() -> None:
    """In a pool worker: a Ctrl-C is the parent's to handle (it terminates the pool), and
    on Linux the worker gets SIGTERM as soon as its parent dies, so a killed prepare-data
    leaves no worker running on and none printing a broken pipe's traceback."""
    import ctypes
    import multiprocessing
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if not sys.platform.startswith("linux"):
        return
    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    parent = multiprocessing.parent_process()
    if parent is not None and os.getppid() != parent.pid:  # it died before the prctl
        os.kill(os.getpid(), signal.SIGTERM)


def _pool_worker_init(*args) -> None:
    _die_with_parent()
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one process per core, one thread each
    init_worker(*args)


def _pool_chat_init(*args) -> None:
    _die_with_parent()
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    from parallel3d.data.chat import init_chat_worker

    init_chat_worker(*args)


def _bounded_ordered(pool, tasks: Iterable[tuple], window: int, encode=encode_task) -> Iterator[tuple]:
    """``pool.imap`` in order, but never more than ``window`` tasks in flight (imap reads
    its whole input ahead, which would hold the whole corpus in memory)."""
    pending: collections.deque = collections.deque()
    for task in tasks:
        pending.append(pool.apply_async(encode, (task,)))
        if len(pending) >= window:
            yield pending.popleft().get()
    while pending:
        yield pending.popleft().get()


# ---------------------------------------------------------------------------------------
# The pipeline


def _val_mask(first_doc: int, n: int, frac: Fraction) -> np.ndarray:
    """Document ``i`` is held out when ``floor((i+1) f) > floor(i f)`` (exact integers)."""
    i = np.arange(first_doc, first_doc + n, dtype=np.int64)
    p, q = frac.numerator, frac.denominator
    return ((i + 1) * p) // q > (i * p) // q


def tokenize_to_shards(tasks: Iterable[tuple], spec: TokenizerSpec, out: Path, *,
                       val_fraction: float, shard_tokens: int, workers: int,
                       progress: Progress, chat: bool = False, resume: dict | None = None,
                       save_state: tuple[Path, dict] | None = None) -> tuple[dict, dict, dict, int]:
    """Run ``tasks`` through the workers and write both splits. Returns the index's
    ``splits`` entry, documents and tokens per split, and the UTF-8 bytes of text.
    ``chat``: the tasks are conversations (JSON lines) and a loss mask is written; the
    conversations dropped are counted in ``splits[...]["dropped"]`` of the train split.

    ``workers``: N > 1 processes of one thread each; 1: this process, one thread; 0: this
    process with the tokenizers library's own thread pool (all cores).

    ``resume``: a state saved by an interrupted run (:mod:`parallel3d.data.resume`): its
    tasks are skipped and the writers continue from it. ``save_state`` (out, key): save
    the state each time a shard is finished."""
    dtype = token_dtype(spec.vocab_size)
    frac = Fraction(val_fraction).limit_denominator(1_000_000)
    writers = {s: _SplitWriters(out, s, dtype, shard_tokens, chat) for s in SPLITS}
    counters = {"n_docs": 0, "text_bytes": 0, "dropped": {}, "tasks_done": 0}
    if resume is not None:
        restore_writers(writers, resume)
        counters = {k: resume[k] for k in counters}
        progress.done, progress.tokens = resume["disk_done"], resume["tokens_done"]
        progress.resumed = progress.done
        tasks = itertools.islice(tasks, resume["tasks_done"], None)
    saver = StateSaver(*save_state, writers) if save_state is not None else None
    if chat:
        from parallel3d.data.chat import encode_chat_task, init_chat_worker

        init, pool_init, encode, initargs = (init_chat_worker, _pool_chat_init, encode_chat_task,
                                             (str(spec.dir),))
    else:
        init, pool_init, encode = init_worker, _pool_worker_init, encode_task
        initargs = (str(spec.json_path), spec.eos_id, dtype.name)
    with contextlib.ExitStack() as stack:
        if workers > 1:
            import multiprocessing as mp

            # spawn: the tokenizers library's thread pool does not survive fork.
            pool = mp.get_context("spawn").Pool(workers, initializer=pool_init, initargs=initargs)
            stack.callback(pool.join)
            stack.callback(pool.terminate)
            results = _bounded_ordered(pool, tasks, window=2 * workers + 2, encode=encode)
        else:
            stack.enter_context(_tokenizer_threads(workers == 0))
            init(*initargs)
            results = map(encode, tasks)
        stack.callback(progress.close)
        dropped, text_bytes = _write_results(results, writers, frac, progress, counters, saver)
    splits = {s: w.close() for s, w in writers.items()}
    if chat:
        splits["train"]["dropped"] = dropped
    docs = {s: splits[s]["num_docs"] for s in SPLITS}
    tokens = {s: splits[s]["num_tokens"] for s in SPLITS}
    return splits, docs, tokens, text_bytes


class _SplitWriters:
    """One split's files: the tokens, where each document starts, and (chat) the mask."""

    def __init__(self, out: Path, split: str, dtype, shard_tokens: int, chat: bool):
        self.tokens = ShardWriter(out, split, dtype, shard_tokens)
        self.starts = ShardWriter(out, split, np.dtype("<i8"), shard_tokens, name=f"{split}-docs")
        self.mask = ShardWriter(out, split, np.uint8, shard_tokens, name=f"{split}-mask") if chat else None
        self.supervised = 0

    def named_parts(self) -> list[tuple[str, ShardWriter]]:
        parts = [("tokens", self.tokens), ("starts", self.starts)]
        return parts + ([("mask", self.mask)] if self.mask is not None else [])

    def parts(self) -> list[ShardWriter]:
        return [w for _, w in self.named_parts()]

    def add(self, ids: np.ndarray, lengths: np.ndarray, mask: np.ndarray | None) -> None:
        first = self.tokens.num_tokens_added
        self.starts.add(first + np.cumsum(lengths) - lengths, len(lengths))
        self.tokens.add(ids, len(lengths))
        if self.mask is not None:
            self.mask.add(mask, 0)
            self.supervised += int(mask.sum())

    def close(self) -> dict:
        entry = self.tokens.close()
        entry["doc_shards"] = self.starts.close()["shards"]
        if self.mask is not None:
            entry["mask_shards"] = self.mask.close()["shards"]
            entry["supervised_tokens"] = self.supervised
        return entry


def _write_results(results, writers: dict[str, _SplitWriters], frac: Fraction,
                   progress: Progress, counters: dict, saver=None) -> tuple[dict, int]:
    """Append each result, in order, to the split each of its documents belongs to,
    continuing ``counters`` (documents, bytes of text, drops, tasks: zero, or a resumed
    run's). Returns the conversations dropped by reason (chat) and the bytes of text."""
    n_docs, text_bytes, dropped = counters["n_docs"], counters["text_bytes"], dict(counters["dropped"])
    tasks_done = counters["tasks_done"]
    for ids, lengths, nbytes, disk_bytes, *chat in results:
        mask = chat[0] if chat else None
        for why, n in (chat[1] if chat else {}).items():
            dropped[why] = dropped.get(why, 0) + n
        is_val = _val_mask(n_docs, len(lengths), frac)
        token_is_val = np.repeat(is_val, lengths)
        for split, docs, toks in (("train", ~is_val, ~token_is_val), ("val", is_val, token_is_val)):
            writers[split].add(ids[toks], lengths[docs], None if mask is None else mask[toks])
        n_docs += len(lengths)
        text_bytes += nbytes
        tasks_done += 1
        progress.update(disk_bytes, len(ids))
        if saver is not None:
            saver(tasks_done, {"n_docs": n_docs, "text_bytes": text_bytes, "dropped": dropped,
                               "disk_done": progress.done, "tokens_done": progress.tokens})
    return dropped, text_bytes


def copy_tokenizer(spec: TokenizerSpec, out: Path) -> None:
    dst = out / "tokenizer"
    dst.mkdir(parents=True, exist_ok=True)
    if dst.resolve() == spec.dir.resolve():
        return
    shutil.copyfile(spec.json_path, dst / "tokenizer.json")
    for name in ("tokenizer_config.json", "special_tokens_map.json", *CHAT_TEMPLATE_FILES):
        if (spec.dir / name).is_file():
            shutil.copyfile(spec.dir / name, dst / name)


def _clear_old(out: Path, overwrite: bool, keep: set[str] = frozenset()) -> None:
    """Remove an old dataset's files (``--overwrite``) or an interrupted run's, except
    ``keep`` (what a resume continues from)."""
    if (out / INDEX).exists():
        if not overwrite:
            raise UserError(f"'{out}' already holds a prepared dataset ({INDEX}): choose another --out "
                            "or pass --overwrite")
        (out / INDEX).unlink()  # first, so nothing reads old shards as the new dataset
    prefixes = tuple(f"{p}{s}-" for s in SPLITS for p in ("", "."))
    for old in [*out.glob("*.bin"), *out.glob(".*.bin.partial")]:
        if old.name.startswith(prefixes) and old.name not in keep:
            old.unlink()


def check_options(val_fraction: float, shard_tokens: int, workers: int) -> None:
    if not 0.0 <= val_fraction < 1.0:
        raise UserError(f"--val-fraction must be in [0, 1), got {val_fraction}")
    if shard_tokens < 1:
        raise UserError(f"--shard-tokens must be positive, got {shard_tokens}")
    if workers < 1:
        raise UserError(f"--workers must be at least 1, got {workers}")


def _check_chat_inputs(files: list[Path], tokenizer_dir: Path, workers: int) -> None:
    """--format chat: JSON lines only, and a tokenizer with a chat template (checked here,
    before worker processes start, so that the error is one line rather than a pool of
    workers failing to start)."""
    from parallel3d.data.sources import _kind

    for f in files:
        if _kind(f) != "jsonl":
            raise UserError(f"--format chat reads JSON lines (.jsonl, .json, optionally .gz): '{f}' "
                            "is not; give conversation files, or use --format text")
    if not has_chat_template(tokenizer_dir):
        raise UserError(f"--format chat needs a chat template, and the tokenizer in '{tokenizer_dir}' "
                        f"has none ({tokenizer_dir / 'tokenizer_config.json'} has no chat_template): "
                        "use the model's own tokenizer folder, or --format text")
    if workers > 1:
        ChatRenderer(tokenizer_dir)  # transformers can load it


def prepare_data(inputs: list[str], tokenizer: str | Path, out: str | Path, *,
                 text_key: str = "text", eos_token: str | None = None, workers: int | None = None,
                 shard_tokens: int = DEFAULT_SHARD_TOKENS, val_fraction: float = 0.0,
                 overwrite: bool = False, progress: bool = True,
                 chunk_bytes: int = CHUNK_BYTES, format: str = "text") -> PrepareReport:
    """Tokenize ``inputs`` with the tokenizer in ``tokenizer`` into a dataset at ``out``
    (``format`` "text": documents; "chat": conversations with their loss mask). A tokenizer
    folder with only ``tokenizer.model`` is converted by transformers first."""
    workers = (os.cpu_count() or 1) if workers is None else workers
    check_options(val_fraction, shard_tokens, workers)
    if format not in ("text", "chat"):
        raise UserError(f"--format '{format}' is not supported: use text or chat")
    if not inputs:
        raise UserError("no inputs: give files, directories or glob patterns")
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise UserError(f"--out '{out}' is a file: give a directory for the dataset")
    # An output directory inside an input directory is not input (index.json is JSON).
    files = [f for f in expand_inputs(inputs) if out.resolve() not in f.resolve().parents]
    if not files:
        raise UserError(f"the inputs hold no files outside --out '{out}'")
    with tokenizer_folder(tokenizer) as folder:
        spec = load_tokenizer(folder, eos_token)
        if format == "chat":
            _check_chat_inputs(files, spec.dir, workers)
        try:
            out.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise UserError(f"--out '{out}' cannot be created: {e.strerror}") from None
        key = options_key(files, spec.sha256, eos_id=spec.eos_id, shard_tokens=shard_tokens,
                          val_fraction=val_fraction, text_key=text_key, format=format, chunk_bytes=chunk_bytes)
        state, why = (None, "") if (out / INDEX).exists() else load_state(out, key)
        if why and progress:
            print(f"prepare-data: not resuming the interrupted run in '{out}': {why}; starting over",
                  file=sys.stderr, flush=True)
        _clear_old(out, overwrite, kept_files(state))
        return _prepare(inputs, files, spec, out, text_key=text_key, workers=workers,
                        shard_tokens=shard_tokens, val_fraction=val_fraction, progress=progress,
                        chunk_bytes=chunk_bytes, chat=format == "chat", resume=state, key=key)


def _prepare(inputs, files, spec, out: Path, *, text_key, workers, shard_tokens, val_fraction,
             progress, chunk_bytes, chat, resume, key) -> PrepareReport:
    t0 = time.perf_counter()
    disk_total = sum(f.stat().st_size for f in files)
    shown = Progress(disk_total, progress)
    if resume is not None and progress:
        print(f"prepare-data: resuming the interrupted run in '{out}' after {resume['tasks_done']:,} units of "
              f"work ({resume['disk_done'] / 1e6:.1f} MB of input; its finished shards kept)",
              file=sys.stderr, flush=True)
    splits, docs, tokens, text_bytes = tokenize_to_shards(
        input_tasks(files, text_key, chunk_bytes), spec, out, val_fraction=val_fraction,
        shard_tokens=shard_tokens, workers=workers, progress=shown, chat=chat, resume=resume,
        save_state=(out, key))
    n_docs = sum(docs.values())
    dropped = splits["train"].get("dropped", {})
    plural = "s" * (len(files) != 1)
    if n_docs == 0 and chat:
        reasons = ", ".join(f"{n} {why}" for why, n in sorted(dropped.items())) or "none found"
        raise UserError(f"the inputs ({len(files)} file{plural}) hold no conversation to train on: "
                        f"every one was dropped ({reasons})")
    if n_docs == 0:
        raise UserError(f"the inputs ({len(files)} file{plural}) hold no documents: "
                        f"every one is empty or has an empty '{text_key}'")
    if val_fraction > 0 and docs["val"] == 0:
        raise UserError(f"--val-fraction {val_fraction} of {n_docs} documents holds out none: raise it "
                        f"to at least {1 / n_docs:.2g} or give more documents")
    copy_tokenizer(spec, out)
    write_index(out, dtype=token_dtype(spec.vocab_size), eos_id=spec.eos_id,
                vocab_size=spec.vocab_size, tokenizer_sha256=spec.sha256, splits=splits,
                source={"inputs": [str(i) for i in inputs], "num_files": len(files),
                        "format": "chat" if chat else "text", "text_key": text_key,
                        "val_fraction": val_fraction, "eos_token": spec.eos_token}, loss_mask=chat)
    clear_state(out)
    supervised = sum(splits[s].get("supervised_tokens", 0) for s in SPLITS)
    return PrepareReport(out, len(files), disk_total, text_bytes, time.perf_counter() - t0, workers,
                         docs, tokens, {s: len(splits[s]["shards"]) for s in SPLITS}, dropped, supervised,
                         resumed_bytes=shown.resumed)
