"""The embedded default corpus: this machine's Python standard library, prepared.

The ``.py`` sources of the running Python's standard library (real text that every
machine has) are read in sorted path order up to ``data.max_bytes``, one file per
document. A byte-level BPE of ``data.vocab_size`` is trained on them with Hugging Face
``tokenizers`` and saved as a tokenizer folder, and the documents go through the same
pipeline as ``prepare-data`` (:func:`~parallel3d.data.prepare.tokenize_to_shards`), so
the result is an ordinary prepared dataset that training reads like any other.

The dataset is cached under ``data.cache_dir`` keyed by everything that determines it.
It is built in a temporary directory and renamed into place, so processes (or nodes on a
shared file system) that build it at once never see half of one.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import sysconfig
import time
import uuid
from pathlib import Path

from parallel3d.config import DataConfig
from parallel3d.data.format import INDEX, PreparedDataset, open_dataset, token_dtype, write_index
from parallel3d.errors import UserError

EOS = "<|eos|>"
FORMAT_KEY = 3  # bump when the corpus or its tokenization changes


def stdlib_files() -> list[Path]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    return sorted(p for p in stdlib.rglob("*.py") if "site-packages" not in p.parts)


def read_stdlib(max_bytes: int) -> list[str]:
    docs, total = [], 0
    for path in stdlib_files():
        text = path.read_text(encoding="utf-8", errors="replace")
        docs.append(text)
        total += len(text.encode("utf-8"))
        if total >= max_bytes:
            break
    return docs


def train_bpe_tokenizer(docs: list[str], vocab_size: int, out_dir: Path, eos: str = EOS,
                        other_special: tuple[str, ...] = ()) -> Path:
    """Train a byte-level BPE on ``docs`` and save it as a Hugging Face tokenizer folder
    (``tokenizer.json`` + ``tokenizer_config.json`` naming ``eos``). Special tokens take
    the first ids: ``other_special`` in order, then ``eos``."""
    from tokenizers import ByteLevelBPETokenizer

    tok = ByteLevelBPETokenizer()
    tok.train_from_iterator(docs, vocab_size=vocab_size, min_frequency=2,
                            special_tokens=[*other_special, eos], show_progress=False)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_dir / "tokenizer.json"))
    config = {"eos_token": eos, "tokenizer_class": "PreTrainedTokenizerFast"}
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=1))
    return out_dir


def stdlib_corpus_key(cfg: DataConfig) -> str:
    ident = {"python": sys.version, "stdlib": sysconfig.get_paths()["stdlib"],
             "max_bytes": cfg.max_bytes, "vocab_size": cfg.vocab_size,
             "val_fraction": cfg.val_fraction, "format": FORMAT_KEY}
    return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:16]


def cache_root(cfg: DataConfig) -> Path:
    return Path(cfg.cache_dir or os.path.join(os.path.expanduser("~"), ".cache", "parallel3d"))


def cache_path(cfg: DataConfig) -> Path:
    """Where the stdlib dataset of ``cfg`` is (or will be) cached."""
    return cache_root(cfg) / f"stdlib-{stdlib_corpus_key(cfg)}"


def describe(cfg: DataConfig) -> str:
    """One line on the stdlib corpus ``cfg`` names, and whether it is built yet (or, with
    ``data.blend``, on the blend's sources, which are read instead)."""
    if cfg.blend:
        total = sum(b.weight for b in cfg.blend)
        return "data.blend: " + ", ".join(f"{b.name} {b.weight / total:.0%} ({b.path})" for b in cfg.blend)
    path = cache_path(cfg)
    state = f"cached in {path}" if (path / INDEX).is_file() else f"to be built once into {path}"
    return (f"stdlib corpus: the first {cfg.max_bytes / 1e6:.1f} MB of this Python's standard library "
            f"({sysconfig.get_paths()['stdlib']}), byte-level BPE of {cfg.vocab_size} tokens, "
            f"{cfg.val_fraction:.0%} of the files held out; {state}")


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)  # progress, like prepare-data's: stdout stays the run's


def prepare_stdlib(cfg: DataConfig, out=_say) -> PreparedDataset:
    """Build (or find in the cache) the stdlib dataset for ``cfg``; ``out`` gets a line as
    the build starts and one when it is done (a build takes seconds, once)."""
    from parallel3d.data.prepare import (Progress, check_options, load_tokenizer,
                                         tokenize_to_shards)

    if cfg.source == "prepared":
        raise UserError("data.source 'prepared' needs data.path: set it to a dataset made by "
                        "`parallel3d prepare-data`")
    if cfg.vocab_size < 257:
        raise UserError(f"data.vocab_size {cfg.vocab_size} is too small for a byte-level BPE "
                        "(needs at least 257: 256 bytes plus EOS)")
    check_options(cfg.val_fraction, 1, 1)
    root = cache_root(cfg)
    dest = cache_path(cfg)
    if (dest / INDEX).is_file():
        return open_dataset(dest)
    tmp = root / f".stdlib-{stdlib_corpus_key(cfg)}.tmp-{uuid.uuid4().hex}"
    t0 = time.perf_counter()
    out(f"building the stdlib corpus: {cfg.max_bytes / 1e6:.1f} MB of Python sources, a byte-level BPE of "
        f"{cfg.vocab_size} tokens, then tokenizing (once; cached in {dest}) ...")
    try:
        docs = read_stdlib(cfg.max_bytes)
        spec = load_tokenizer(train_bpe_tokenizer(docs, cfg.vocab_size, tmp / "tokenizer"))
        chunks = (("texts", docs[i: i + 64], 0) for i in range(0, len(docs), 64))
        splits, _, tokens, _ = tokenize_to_shards(
            chunks, spec, tmp, val_fraction=cfg.val_fraction, shard_tokens=1 << 30, workers=0,
            progress=Progress(0, enabled=False))
        write_index(tmp, dtype=token_dtype(spec.vocab_size), eos_id=spec.eos_id,
                    vocab_size=spec.vocab_size, tokenizer_sha256=spec.sha256, splits=splits,
                    source={"stdlib": sysconfig.get_paths()["stdlib"], "max_bytes": cfg.max_bytes,
                            "val_fraction": cfg.val_fraction})
        try:
            os.rename(tmp, dest)
        except OSError:
            if not (dest / INDEX).is_file():  # not "another process finished first"
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    out(f"stdlib corpus built in {time.perf_counter() - t0:.1f} s: {tokens['train']:,} training and "
        f"{tokens['val']:,} held-out tokens from {len(docs):,} files")
    return open_dataset(dest)
