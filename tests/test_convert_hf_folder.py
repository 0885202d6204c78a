"""``parallel3d convert SRC_HF --to hf DST`` writes a folder that works as its source does:
the tokenizer files and generation_config.json come along (issue 37 point 7), so
AutoTokenizer + AutoModelForCausalLM load it and ``generate`` follows the source's
generation config."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from parallel3d.checkpoint.foreign.hf import COMPANION_FILES
from parallel3d.cli import main

from data_inputs import make_tokenizer

transformers = pytest.importorskip("transformers")


def _tiny_hf_folder(folder: Path) -> Path:
    """A random Llama with its tokenizer (300 tokens) and a generation config that is not
    transformers' default: greedy, exactly 6 new tokens."""
    make_tokenizer(folder, 300)
    cfg = transformers.LlamaConfig(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(1)
    transformers.LlamaForCausalLM(cfg).save_pretrained(folder)
    transformers.GenerationConfig(max_new_tokens=6, min_new_tokens=6, do_sample=False, eos_token_id=2,
                                  pad_token_id=2).save_pretrained(folder)
    return folder


def _generate(folder: Path, text: str) -> tuple[list[int], object]:
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder)
    inputs = tok(text, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**inputs)
    return out[0].tolist(), model.generation_config


def test_convert_to_hf_keeps_the_tokenizer_and_the_generation_config(tmp_path, capsys):
    src = _tiny_hf_folder(tmp_path / "src")
    dst = tmp_path / "dst"
    assert main(["convert", str(src), str(dst), "--to", "hf"]) == 0
    err = capsys.readouterr().err
    assert "with the source's tokenizer.json" in err and "generation_config.json" in err
    assert "0.00 / 0.00 GiB" not in err and "MiB" in err  # a small model's progress in MiB
    for name in COMPANION_FILES:
        if (src / name).is_file():
            assert (dst / name).read_bytes() == (src / name).read_bytes(), name
    ids, gen = _generate(dst, "def f(x):\n    return x")
    assert (gen.max_new_tokens, gen.min_new_tokens, gen.do_sample) == (6, 6, False)
    want, _ = _generate(src, "def f(x):\n    return x")
    assert ids == want and len(ids) == len(want)


def test_a_conversion_failing_after_its_write_leaves_nothing_behind(tmp_path, monkeypatch):
    """A failure after the tensors are written (here: copying the tokenizer) removes the
    temporary folder and creates no destination; the source is untouched."""
    from parallel3d.checkpoint import convert as conv

    src = _tiny_hf_folder(tmp_path / "src")
    before = sorted(p.name for p in src.iterdir())

    def broken_copy(*args):
        raise OSError("disk full (simulated)")

    monkeypatch.setattr(conv, "copy_companion_files", broken_copy)
    with pytest.raises(OSError, match="disk full"):
        conv.convert(src, tmp_path / "dst", to="hf", progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]  # no dst, no .dst.tmp-convert*
    assert sorted(p.name for p in src.iterdir()) == before
