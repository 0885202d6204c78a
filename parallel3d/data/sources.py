"""What ``prepare-data`` reads: input files found, cut into units of work, and decoded.

Inputs are files, directories (searched recursively) or glob patterns, sorted so the
output does not depend on the order the shell lists them:

- ``.txt``: one file is one document (read whole, UTF-8, bad bytes replaced);
- ``.jsonl`` / ``.json``: JSON lines, one object per line, the document in ``text_key``;
- ``.parquet``: one row is one document, the column ``text_key`` (needs pyarrow);
- ``.txt.gz``, ``.jsonl.gz``, ``.json.gz``: the same, gzip-compressed.

A unit of work (a task) is ``(kind, payload, bytes_on_disk)``: a whole text file by
name, about ``CHUNK_BYTES`` of raw JSON lines, or a batch of Parquet rows already
decoded. The main process makes tasks in input order; a worker turns one into its
documents with :func:`documents_of`, so that JSON parsing runs in parallel too.
"""

from __future__ import annotations

import glob
import gzip
import json
from pathlib import Path
from typing import Iterator

from parallel3d.errors import UserError

TEXT_SUFFIXES = (".txt",)
JSONL_SUFFIXES = (".jsonl", ".json")
PARQUET_SUFFIXES = (".parquet",)
CHUNK_BYTES = 1 << 20  # raw JSON lines handed to a worker at a time


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
    try:
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
    except (OSError, EOFError) as e:  # unreadable, or a damaged / truncated .gz
        raise UserError(f"'{path}' cannot be read: {e}") from None
    if lines or last < path.stat().st_size:
        yield ("jsonl", (str(path), first, lines, text_key), path.stat().st_size - last)


def _parquet_tasks(path: Path, text_key: str) -> Iterator[tuple]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise UserError(f"reading '{path}' needs pyarrow: pip install pyarrow "
                        '(or pip install -e ".[data]" in the checkout)') from None
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
            yield from _parquet_tasks(path, text_key)


def documents_of(kind: str, payload) -> list[str]:
    """The documents of one task, in order (runs in a worker)."""
    if kind == "texts":
        return payload
    if kind == "text":
        try:
            with _open_binary(Path(payload)) as f:
                return [f.read().decode("utf-8", errors="replace")]
        except (OSError, EOFError) as e:
            raise UserError(f"'{payload}' cannot be read: {e}") from None
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
