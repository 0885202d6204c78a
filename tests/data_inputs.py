"""Test inputs for the data pipeline: a small BPE tokenizer folder and mixed-format text
made from this machine's Python standard library (nothing is downloaded)."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

from parallel3d.data.stdlib import read_stdlib, train_bpe_tokenizer

EOS = "<|endoftext|>"


def make_tokenizer(out_dir: Path, vocab_size: int = 700) -> Path:
    """A byte-level BPE saved as a Hugging Face folder whose tokenizer_config.json names
    the EOS token. EOS gets id 2, not 0, so that a zero-filled gap cannot pass for it."""
    return train_bpe_tokenizer(read_stdlib(300_000), vocab_size, out_dir, eos=EOS,
                               other_special=("<|pad|>", "<|bos|>"))


def make_mixed_inputs(out_dir: Path, total_bytes: int, parquet: bool = False) -> list[str]:
    """Write ~``total_bytes`` of stdlib sources, a quarter of the documents each: as
    .txt files (one document each), a .jsonl, a gzipped .jsonl (with a blank line and an
    empty document, which are skipped), and a .parquet if asked, else another .jsonl.
    Returns the documents in the order prepare-data reads them (sorted file names, then
    line / row order)."""
    docs = [d for d in read_stdlib(total_bytes) if d]
    out_dir.mkdir(parents=True, exist_ok=True)
    quarter = len(docs) // 4
    txt, jsonl, gz, rest = (docs[:quarter], docs[quarter:2 * quarter], docs[2 * quarter:3 * quarter],
                            docs[3 * quarter:])
    for i, d in enumerate(txt):
        (out_dir / f"a{i:04d}.txt").write_text(d, encoding="utf-8")
    with open(out_dir / "b.jsonl", "w", encoding="utf-8") as f:
        for d in jsonl:
            f.write(json.dumps({"id": 1, "text": d}) + "\n")
    with gzip.open(out_dir / "c.jsonl.gz", "wt", encoding="utf-8") as f:
        f.write(json.dumps({"text": gz[0]}) + "\n\n" + json.dumps({"text": ""}) + "\n")
        for d in gz[1:]:
            f.write(json.dumps({"text": d}) + "\n")
    if parquet:
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.table({"text": rest, "n": list(range(len(rest)))}), out_dir / "d.parquet",
                       row_group_size=50)
    else:
        with open(out_dir / "d.jsonl", "w", encoding="utf-8") as f:
            for d in rest:
                f.write(json.dumps({"text": d}) + "\n")
    return txt + jsonl + gz + rest
