"""A Hugging Face tokenizer folder, as ``prepare-data`` uses it.

The folder holds ``tokenizer.json`` (read with the ``tokenizers`` library; nothing from
the folder is executed) and names its EOS token in ``tokenizer_config.json`` or
``special_tokens_map.json``, unless the caller names it. A folder that ships only a
SentencePiece ``tokenizer.model`` (older Llama and Mistral releases) is converted to
``tokenizer.json`` by transformers (:func:`tokenizer_folder`; needs the sentencepiece
package), and the converted file is what the dataset keeps and records.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import tempfile
from dataclasses import dataclass
from pathlib import Path

from parallel3d.errors import UserError


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


@contextlib.contextmanager
def tokenizer_folder(path: str | Path):
    """Yields ``path``, or, for a folder holding ``tokenizer.model`` but no ``tokenizer.json``,
    a scratch folder into which transformers wrote its conversion (the fast tokenizer's
    ``tokenizer.json`` and ``tokenizer_config.json``, chat template included), removed on
    exit. Nothing is created when there is nothing to convert."""
    path = Path(path)
    if path.is_file() or (path / "tokenizer.json").is_file() or not (path / "tokenizer.model").is_file():
        yield path
        return
    with tempfile.TemporaryDirectory(prefix="p3d-tokenizer-") as scratch:
        yield _convert(path, Path(scratch))


def _convert(path: Path, scratch: Path) -> Path:
    """``scratch`` once transformers has written the conversion of ``path``'s
    ``tokenizer.model`` into it."""
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise UserError(f"tokenizer folder '{path}' has only tokenizer.model: converting it needs "
                        'transformers and sentencepiece (pip install -e ".[hf]" in the checkout)') from None
    try:
        tok = AutoTokenizer.from_pretrained(str(path))  # local files; no remote code
        tok.save_pretrained(str(scratch))
    except Exception as e:  # noqa: BLE001 - transformers and sentencepiece raise many types
        raise UserError(f"tokenizer folder '{path}' has only tokenizer.model and transformers cannot "
                        f"convert it: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from None
    if not (scratch / "tokenizer.json").is_file():
        raise UserError(f"transformers did not convert '{path / 'tokenizer.model'}' to a fast "
                        "tokenizer (tokenizer.json): install sentencepiece, or save the folder's "
                        "tokenizer with AutoTokenizer.save_pretrained")
    return scratch


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


def _vocab(json_path: Path) -> dict[str, int]:
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_file(str(json_path)).get_vocab(with_added_tokens=True)
    except Exception as e:  # noqa: BLE001 - the library raises a bare Exception
        raise UserError(f"tokenizer '{json_path}' cannot be read: {str(e).splitlines()[0]}") from None


def check_same_tokenizer(dataset, model_dir: str | Path) -> None:
    """Refuse a dataset whose token ids mean other tokens than the model's tokenizer's.

    ``dataset`` is a :class:`~parallel3d.data.format.PreparedDataset`; ``model_dir`` a
    Hugging Face model folder (fine-tuning). The index records the sha256 of the
    tokenizer.json the data was made with and keeps a copy of it: the same file passes at
    once, another file passes if it maps every token to the same id (a re-serialised copy).
    A model folder without tokenizer.json cannot be checked here (only the vocabulary
    size is, by the trainer). A model folder with only tokenizer.model is converted as
    prepare-data converts it, and the ids compared."""
    model_dir = Path(model_dir)
    with tokenizer_folder(model_dir) as folder:  # tokenizer.model only: its conversion
        if (folder / "tokenizer.json").is_file():
            _check_same_ids(dataset, model_dir, folder / "tokenizer.json")


def _check_same_ids(dataset, model_dir: Path, model_json: Path) -> None:
    recorded = dataset.index.get("tokenizer", {})
    if hashlib.sha256(model_json.read_bytes()).hexdigest() == recorded.get("sha256"):
        return
    fix = f"prepare the data again with --tokenizer {model_dir}"
    data_json = Path(dataset.dir) / recorded.get("dir", "tokenizer") / "tokenizer.json"
    if not data_json.is_file():
        raise UserError(f"data.path '{dataset.dir}' was tokenized with another tokenizer.json than "
                        f"model.hf_checkpoint's (sha256 differs, and the dataset keeps no copy to "
                        f"compare): {fix}")
    theirs, mine = _vocab(data_json), _vocab(model_json)
    differ = sum(1 for token, i in theirs.items() if mine.get(token) != i)
    if differ:
        raise UserError(f"data.path '{dataset.dir}' was tokenized with another tokenizer than "
                        f"model.hf_checkpoint '{model_dir}': {differ} of its {len(theirs)} tokens have "
                        f"another id or none in the model's tokenizer.json: {fix}")
