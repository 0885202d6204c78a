"""Hugging Face in and out: a random HF model (built from a config here) initializes a
parallel3d run at tp=2 x dp=2, is saved there, and exports back bit for bit; transformers
loads the export and computes the logits of the tensor-parallel model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from parallel3d.checkpoint.convert import convert
from parallel3d.checkpoint.reader import CheckpointReader, find_checkpoint
from parallel3d.cli import main as cli_main
from parallel3d.config import config_from_dict
from parallel3d.errors import UserError
from parallel3d.topology import Topology
from parallel3d.train.trainer import Trainer

from helpers import tiny_job

transformers = pytest.importorskip("transformers")


pytestmark = pytest.mark.usefixtures("one_thread")

# GQA (4 heads over 2 kv-heads), an odd vocabulary (not divisible by any tp), Qwen2's
# q/k/v biases, llama3 rope scaling, tied and untied heads.
MODELS = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM,
              {"tie_word_embeddings": False,
               "rope_parameters": {"rope_type": "llama3", "rope_theta": 5000.0, "factor": 4.0,
                                   "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                   "original_max_position_embeddings": 32}}),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, {"tie_word_embeddings": True}),
}


def make_hf_model(kind: str, folder: Path, vocab: int = 521) -> Path:
    cfg_cls, model_cls, extra = MODELS[kind]
    cfg = cfg_cls(vocab_size=vocab, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, **extra)
    torch.manual_seed(3)
    model = model_cls(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias") or "norm" in name:  # not the trivial zeros / ones
                p.normal_(0.5, 0.1)
    # Small shards, so the folder has model.safetensors.index.json and several files.
    model.save_pretrained(folder, max_shard_size="100KB")
    return folder


def hf_job(corpus_dir: str, run_dir: Path, hf_dir: Path, **sections) -> dict:
    job = tiny_job(corpus_dir, str(run_dir), **sections)
    job["model"] = {"hf_checkpoint": str(hf_dir)}  # the shape comes from config.json
    return job


def _save_at_layout(job: dict, tp: int, pp: int, dp: int, tokens: torch.Tensor | None):
    """Initialize from model.hf_checkpoint at this layout, save a checkpoint (step 0), and
    return it with the parallel model's logits on ``tokens`` (gathered over tp)."""
    trainer = Trainer(config_from_dict(job), Topology(tp, pp, dp))
    trainer.checkpointer.save(trainer)
    trainer.checkpointer.writer.wait()
    folder = str(find_checkpoint(Path(job["run"]["dir"]) / "checkpoints"))
    if tokens is None:
        return folder, None
    with torch.no_grad():
        logits = trainer.model(tokens)  # (B, S, padded vocab / tp): this rank's columns
    if tp > 1:
        parts = [torch.empty_like(logits) for _ in range(tp)]
        torch.distributed.all_gather(parts, logits, group=trainer.topo.tp_group)
        logits = torch.cat(parts, dim=-1)
    return folder, logits[..., :trainer.model_cfg.vocab_size]


def _hf_tensors(folder: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in folder.glob("*.safetensors"):
        with safe_open(str(f), "pt") as st:
            out.update({k: st.get_tensor(k) for k in st.keys()})
    return out


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_hf_to_parallel_layout_to_hf_is_bit_identical(kind, pools, corpus_dir, tmp_path):
    hf_dir = make_hf_model(kind, tmp_path / "hf")
    assert (hf_dir / "model.safetensors.index.json").is_file()
    job = hf_job(corpus_dir, tmp_path / "run", hf_dir, parallel={"tp": 2, "dp": 2})
    tokens = torch.randint(0, 521, (2, 45), generator=torch.Generator().manual_seed(0))
    folder, logits = pools(4).run(_save_at_layout, job, 2, 1, 2, tokens)[0]
    folder = Path(folder)
    with CheckpointReader(folder) as reader:  # vocab 521 padded to 522, split over tp=2
        pieces = reader.index.tensors["model/embed_tokens.weight"].pieces
        assert sorted((p.offsets, p.block) for p in pieces) == [((0, 0), (261, 64)), ((261, 0), (260, 64))]
        assert len({p.file for e in reader.index.tensors.values() for p in e.pieces}) == 4
    out = tmp_path / "exported"
    convert(folder.parent, out, "hf", progress=False)
    before, after = _hf_tensors(hf_dir), _hf_tensors(out)
    assert sorted(before) == sorted(after)
    for name, t in before.items():
        assert after[name].dtype == t.dtype and torch.equal(after[name], t), name
    exported = json.loads((out / "config.json").read_text())
    assert exported["architectures"] == json.loads((hf_dir / "config.json").read_text())["architectures"]
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="sdpa").eval()
    with torch.no_grad():
        diff = (hf(tokens).logits - logits).abs().max().item()
    # fp32: the tp=2 model sums the same products in another order than transformers (the
    # row-parallel all-reduce): a few ulps per op, as in tests/test_tensor_parallel.py.
    assert diff < 1e-5, diff


def test_finetuning_starts_from_the_hf_weights_and_exports(corpus_dir, tmp_path):
    """The model initialized from the folder computes transformers' logits; a short
    fine-tuning run exports a folder transformers loads, with the source's config."""
    hf_dir = make_hf_model("llama", tmp_path / "hf")
    job = hf_job(corpus_dir, tmp_path / "run", hf_dir, train={"steps": 2},
                 checkpoint={"export_hf": "hf_out"})
    trainer = Trainer(config_from_dict(job), Topology.single())
    hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, attn_implementation="sdpa").eval()
    tokens = torch.randint(0, 521, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert (trainer.model(tokens) - hf(tokens).logits).abs().max().item() < 1e-5
    trainer.fit()  # interval 0, but export_hf needs (and forces) a final checkpoint
    out = tmp_path / "run" / "hf_out"
    tuned = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="sdpa").eval()
    assert tuned.config.rope_parameters["rope_type"] == "llama3"  # carried from the source
    with torch.no_grad():
        assert (trainer.model(tokens) - tuned(tokens).logits).abs().max().item() < 1e-5
        assert (tuned(tokens).logits - hf(tokens).logits).abs().max().item() > 1e-4  # it trained


def test_cli_round_trip_and_clear_errors(tmp_path, capsys):
    hf_dir = make_hf_model("qwen2", tmp_path / "hf", vocab=300)
    assert cli_main(["convert", str(hf_dir), str(tmp_path / "p3d"), "--to", "parallel3d"]) == 0
    assert cli_main(["convert", str(tmp_path / "p3d"), str(tmp_path / "back"), "--to", "hf",
                     "--dtype", "bfloat16"]) == 0
    before, after = _hf_tensors(hf_dir), _hf_tensors(tmp_path / "back")
    assert all(torch.equal(after[k], v.to(torch.bfloat16)) for k, v in before.items())
    err = capsys.readouterr().err
    assert "verified" in err and "100%" in err  # progress lines and the verification
    assert cli_main(["convert", str(tmp_path), str(tmp_path / "x"), "--to", "hf"]) == 2
    line = capsys.readouterr().err.strip()
    assert "\n" not in line and "is neither a Hugging Face folder" in line
    bad = hf_job("", tmp_path / "r", hf_dir)
    bad["model"]["dim"] = 128
    with pytest.raises(UserError, match=r"model.dim = 128 disagrees with model.hf_checkpoint"):
        Trainer(config_from_dict(bad), Topology.single())
