"""``parallel3d prepare-data``: formats, document order, the EOS separator, the held-out
split, determinism across worker counts, integrity checks and one-line errors."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from parallel3d.cli import main
from parallel3d.data.format import open_dataset, verify_checksums
from parallel3d.data.prepare import prepare_data
from parallel3d.errors import UserError

from data_inputs import EOS, make_mixed_inputs, make_tokenizer

VAL_EVERY = 50  # --val-fraction 0.02: documents 49, 99, 149, ... are held out


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    return make_tokenizer(tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    has_parquet = True
    try:
        import pyarrow  # noqa: F401
    except ImportError:
        has_parquet = False
    d = tmp_path_factory.mktemp("inputs")
    return d, make_mixed_inputs(d, 3_000_000, parquet=has_parquet)


@pytest.fixture(scope="module")
def prepared(tok_dir, inputs, tmp_path_factory):
    """The CLI run on ~3 MB of mixed inputs with 2 worker processes."""
    in_dir, docs = inputs
    out = tmp_path_factory.mktemp("prepared")
    proc = subprocess.run(
        [sys.executable, "-m", "parallel3d.cli", "prepare-data", str(in_dir), "--tokenizer", str(tok_dir),
         "--out", str(out), "--workers", "2", "--val-fraction", str(1 / VAL_EVERY),
         "--shard-tokens", "100000"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return out, docs, proc.stdout


def test_cli_prints_throughput_and_writes_every_document(prepared, tok_dir):
    out, docs, stdout = prepared
    m = re.search(r"prepared ([\d,]+) documents .* ([\d.]+) MB/s, ([\d,]+) tokens/s \(2 workers\)", stdout)
    assert m, stdout
    assert int(m[1].replace(",", "")) == len(docs)
    assert float(m[2]) > 0 and int(m[3].replace(",", "")) > 0

    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(Path(tok_dir) / "tokenizer.json"))
    eos = tok.token_to_id(EOS)
    expect = {"train": [], "val": []}
    for i, doc in enumerate(docs):  # encoded independently, one document at a time
        split = "val" if i % VAL_EVERY == VAL_EVERY - 1 else "train"
        expect[split] += tok.encode(doc, add_special_tokens=False).ids + [eos]
    ds = open_dataset(out)
    verify_checksums(ds)
    assert ds.eos_id == eos == 2 and ds.dtype == np.uint16
    assert ds.index["splits"]["val"]["num_docs"] == len(docs) // VAL_EVERY
    for split in ("train", "val"):
        stream = ds.split(split)
        assert stream[:].tolist() == expect[split], split
    assert len(ds.index["splits"]["train"]["shards"]) > 3  # windows will cross shard boundaries
    # the tokenizer travels with the data
    assert (out / "tokenizer" / "tokenizer.json").read_bytes() == (Path(tok_dir) / "tokenizer.json").read_bytes()


def test_output_is_the_same_for_any_worker_count_and_shard_size(prepared, tok_dir, inputs, tmp_path):
    out, _, _ = prepared
    in_dir, _ = inputs
    one = prepare_data([str(in_dir)], tok_dir, tmp_path / "one", workers=1, val_fraction=1 / VAL_EVERY,
                       shard_tokens=100000, progress=False)
    a, b = open_dataset(out), open_dataset(one.out)
    assert a.fingerprint == b.fingerprint  # every shard's sha256 equal
    big = prepare_data([str(in_dir / "b.jsonl"), str(in_dir / "a*.txt")], tok_dir, tmp_path / "big",
                       workers=1, shard_tokens=10**9, progress=False)
    (shard,) = open_dataset(big.out).index["splits"]["train"]["shards"]
    assert shard["num_tokens"] == big.tokens["train"] and big.docs["val"] == 0


def test_truncated_or_changed_shards_are_detected(prepared, tmp_path):
    import shutil

    out, _, _ = prepared
    copy = tmp_path / "copy"
    shutil.copytree(out, copy)
    shard = copy / "train-00001.bin"
    data = bytearray(shard.read_bytes())
    data[10] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(UserError, match="does not match its sha256"):
        verify_checksums(open_dataset(copy))
    shard.write_bytes(bytes(data[:-2]))
    with pytest.raises(UserError, match=r"train-00001.bin' is \d+ bytes, the index says \d+ bytes"):
        open_dataset(copy)


def _error_of(args, capsys) -> str:
    code = main(["prepare-data", *args])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1, err
    return err


def test_bad_inputs_give_one_line(tok_dir, inputs, tmp_path, capsys):
    in_dir, _ = inputs
    out = ["--out", str(tmp_path / "o")]
    assert "input 'nope.jsonl' not found" in _error_of(["nope.jsonl", "--tokenizer", str(tok_dir), *out], capsys)
    bad_tok = tmp_path / "badtok"
    bad_tok.mkdir()
    (bad_tok / "tokenizer.json").write_text("{not json")
    assert "cannot be read" in _error_of([str(in_dir), "--tokenizer", str(bad_tok), *out], capsys)
    assert "has no tokenizer.json" in _error_of([str(in_dir), "--tokenizer", str(tmp_path), *out], capsys)
    no_eos = tmp_path / "noeos"
    no_eos.mkdir()
    (no_eos / "tokenizer.json").write_bytes((Path(tok_dir) / "tokenizer.json").read_bytes())
    assert "pass --eos-token" in _error_of([str(in_dir), "--tokenizer", str(no_eos), *out], capsys)
    empty = tmp_path / "empty.jsonl"
    empty.write_text('{"text": ""}\n\n')
    assert "hold no documents" in _error_of([str(empty), "--tokenizer", str(tok_dir), *out], capsys)
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"text": "a"}\n{"text": "b"\n')
    assert "broken.jsonl:2: not a JSON line" in _error_of([str(broken), "--tokenizer", str(tok_dir), *out], capsys)
    assert "b.jsonl:1: no string under 'body' (found: id, text): pass --text-key" in _error_of(
        [str(in_dir / "b.jsonl"), "--tokenizer", str(tok_dir), "--text-key", "body", *out], capsys)
    assert "holds out none" in _error_of(
        [str(in_dir / "a0000.txt"), "--tokenizer", str(tok_dir), "--val-fraction", "0.1", *out], capsys)


def test_existing_output_needs_overwrite(prepared, tok_dir, inputs, capsys):
    out, _, _ = prepared
    in_dir, _ = inputs
    err = _error_of([str(in_dir / "a0000.txt"), "--tokenizer", str(tok_dir), "--out", str(out)], capsys)
    assert "already holds a prepared dataset" in err and "--overwrite" in err


def test_parquet_without_pyarrow_says_what_to_install(inputs, tok_dir, tmp_path):
    in_dir, _ = inputs
    if not (in_dir / "d.parquet").exists():
        pytest.skip("pyarrow not installed")
    code = ("import sys; sys.modules['pyarrow'] = sys.modules['pyarrow.parquet'] = None\n"
            "from parallel3d.cli import main; sys.exit(main(sys.argv[1:]))")
    proc = subprocess.run([sys.executable, "-c", code, "prepare-data", str(in_dir / "d.parquet"),
                           "--tokenizer", str(tok_dir), "--out", str(tmp_path / "o")],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and proc.stderr.strip().endswith('needs pyarrow: pip install pyarrow (or pip install -e ".[data]" in the checkout)'), proc.stderr


def test_tokenizer_config_may_hold_eos_as_a_dict(tok_dir, tmp_path):
    from parallel3d.data.prepare import load_tokenizer

    d = tmp_path / "tok"
    d.mkdir()
    (d / "tokenizer.json").write_bytes((Path(tok_dir) / "tokenizer.json").read_bytes())
    (d / "special_tokens_map.json").write_text(json.dumps({"eos_token": {"content": EOS, "lstrip": False}}))
    spec = load_tokenizer(d)
    assert spec.eos_token == EOS and spec.vocab_size == 700


def test_progress_prints_plain_lines_when_not_a_terminal(capsys):
    from parallel3d.data.prepare import Progress

    p = Progress(4_000_000, enabled=True, every_s=0.0)
    p.update(1_000_000, 250_000)
    p.close()
    err = capsys.readouterr().err
    assert err.startswith("prepare-data: 25% (1.0 of 4.0 MB)") and "tokens/s" in err
