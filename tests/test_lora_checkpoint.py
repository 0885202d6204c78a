"""LoRA in and out of checkpoints and Hugging Face folders: a LoRA run on a Hugging Face
base saves its adapters (and their Adam state) in its checkpoints with the base by
reference (no frozen weight in them), resumes at another
layout with the uninterrupted run's losses (fp32, 1e-5), and at the end writes the
adapters as a PEFT folder (``checkpoint.export_peft``) and the merged model as a Hugging
Face folder (``checkpoint.export_hf``): peft loads the folder onto the base and gives the
run's logits (1e-5), and the merged export is peft's ``merge_and_unload()``."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from parallel3d.checkpoint.convert import convert
from parallel3d.checkpoint.reader import CheckpointReader, find_checkpoint
from parallel3d.config import config_from_dict
from parallel3d.errors import UserError
from parallel3d.topology import Topology
from parallel3d.train.trainer import Trainer

from helpers import relative_diff, tiny_job

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from test_checkpoint_hf import _hf_tensors, make_hf_model  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

STEPS, STOP = 8, 4
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
TOKENS = torch.randint(0, 512, (2, 24), generator=torch.Generator().manual_seed(5))


def _job(corpus_dir, run_dir: Path, hf_dir: Path, **parallel) -> dict:
    # grad_clip under every step's norm, as in test_lora: the clip sees a gradient's scale
    job = tiny_job(corpus_dir, str(run_dir), train={"steps": STEPS, "lr": 2e-2, "grad_clip": 0.05},
                   parallel=parallel, lora={"rank": 4, "alpha": 8.0, "targets": TARGETS},
                   checkpoint={"interval": 2, "keep": 0})
    job["model"] = {"hf_checkpoint": str(hf_dir)}  # the shape from config.json, the base weights from the folder
    return job


def _run(job: dict, stop_at: int | None = None) -> dict:
    """The run's losses, and after it its logits on TOKENS (gathered over tp, the
    vocabulary's padding dropped)."""
    cfg = config_from_dict(job)
    trainer = Trainer(cfg, Topology.of(cfg.parallel))
    losses = [r["loss"] for r in trainer.fit(stop_at=stop_at)]
    with torch.no_grad():
        logits = trainer.model(TOKENS)
    if trainer.topo.tp > 1:
        parts = [torch.empty_like(logits) for _ in range(trainer.topo.tp)]
        torch.distributed.all_gather(parts, logits, group=trainer.topo.tp_group)
        logits = torch.cat(parts, dim=-1)
    return {"losses": losses, "logits": logits[..., :trainer.model_cfg.vocab_size],
            "resumed": trainer.checkpointer.resumed_from is not None}


def test_lora_resumes_at_another_layout_and_exports(pools, corpus_dir, tmp_path):
    """dp 2 (ZeRO 2) stopped at step 4, resumed at tp 2 from its checkpoint: the losses
    are the uninterrupted one-process run's (1e-5, the layouts' parity bar; the adapters'
    Adam moments come from the checkpoint: a fresh optimizer moves the very next loss)."""
    hf_dir = make_hf_model("llama", tmp_path / "hf")
    straight = _run(_job(corpus_dir, tmp_path / "one", hf_dir))
    first = pools(2).run(_run, _job(corpus_dir, tmp_path / "dp2", hf_dir, dp=2, zero=2), STOP)[0]
    stopped = find_checkpoint(tmp_path / "dp2" / "checkpoints")
    with CheckpointReader(stopped) as reader:  # what trains and its moments; the base by reference
        names = reader.names()
        assert "model/layers.0.self_attn.q_proj.lora_A.weight" in names
        assert all(".lora_" in n for n in names if n.startswith("model/")), names
        assert reader.index.config["model"]["hf_checkpoint"] == str(hf_dir)
        assert "optim/exp_avg/layers.1.mlp.down_proj.lora_B.weight" in names
        assert not any(n.startswith("optim/") and ".lora_" not in n for n in names)
    job = _job(corpus_dir, tmp_path / "tp2", hf_dir, tp=2)
    job["checkpoint"].update(resume=str(stopped), export_peft="adapter", export_hf="merged")
    again = pools(2).run(_run, job)
    assert again[0]["resumed"] and len(again[0]["losses"]) == STEPS - STOP
    losses = first["losses"] + again[0]["losses"]
    assert relative_diff(losses, straight["losses"]) < 1e-5, (losses, straight["losses"])

    # the PEFT folder on the base, in peft: the trained run's logits (fp32, 1e-5)
    base = transformers.LlamaForCausalLM.from_pretrained(str(hf_dir), attn_implementation="sdpa")
    tuned = peft.PeftModel.from_pretrained(base, str(tmp_path / "tp2" / "adapter")).eval()
    with torch.no_grad():
        got = tuned(input_ids=TOKENS).logits
    torch.testing.assert_close(got, again[0]["logits"], rtol=1e-5, atol=1e-5)
    with tuned.disable_adapter(), torch.no_grad():  # the trained adapters matter
        assert (tuned(input_ids=TOKENS).logits - got).abs().max() > 1e-3
    # the merged export: peft's merge_and_unload() weights (1e-6: the same fp32 product
    # B @ A times alpha / r, added in fp32), every other weight the base's bit for bit
    merged = tuned.merge_and_unload().state_dict()
    exported = _hf_tensors(tmp_path / "tp2" / "merged")
    source = _hf_tensors(hf_dir)
    assert sorted(exported) == sorted(source)
    adapted = [k for k in exported if k.split(".")[-2] in TARGETS]
    assert len(adapted) == len(TARGETS) * 2
    for key, t in exported.items():
        if key in adapted:
            torch.testing.assert_close(t, merged[key], rtol=1e-6, atol=1e-6)
            assert (t - source[key]).abs().max() > 1e-4, key  # merged: not the base
        else:
            assert torch.equal(t, source[key]), key


def test_lora_checkpoint_exports_its_base_unmerged(pools, corpus_dir, tmp_path):
    """``convert --to hf`` of a LoRA run's checkpoint (the adapters, the base by reference)
    without ``merge_lora`` writes the base model, bit for bit the Hugging Face folder it
    started from; resuming it with another lora.rank, or converting it with its base
    gone, names what to change."""
    hf_dir = make_hf_model("llama", tmp_path / "hf")
    job = _job(corpus_dir, tmp_path / "run", hf_dir)
    job["train"]["steps"] = 2
    _run(job)
    saved = find_checkpoint(tmp_path / "run" / "checkpoints")
    convert(saved, tmp_path / "base", to="hf", progress=False)
    exported, source = _hf_tensors(tmp_path / "base"), _hf_tensors(hf_dir)
    assert sorted(exported) == sorted(source)
    assert all(torch.equal(exported[k], source[k]) for k in source)
    other = _job(corpus_dir, tmp_path / "other", hf_dir)
    other["lora"]["rank"] = 8
    other["checkpoint"]["resume"] = str(saved)
    with pytest.raises(UserError, match="resume with the lora.rank it was trained with"):
        Trainer(config_from_dict(other), Topology(1, 1, 1))
    hf_dir.rename(tmp_path / "moved")  # the checkpoint holds no frozen weight: it needs its base
    with pytest.raises(UserError, match="put the base back"):
        convert(saved, tmp_path / "again", to="hf", progress=False)


def test_lora_on_the_seeded_base_resumes_from_a_checkpoint_holding_the_base(corpus_dir, tmp_path):
    """Without model.hf_checkpoint the frozen base is the seeded init, which no folder
    holds: the checkpoint carries it, and a resumed run goes on with the straight run's
    losses (one process, the same layout: bit for bit)."""
    def job(name):
        j = tiny_job(corpus_dir, str(tmp_path / name), train={"steps": 4, "lr": 2e-2},
                     lora={"rank": 4, "alpha": 8.0, "targets": TARGETS}, checkpoint={"interval": 2, "keep": 0})
        return j

    straight = _run(job("straight"))["losses"]
    first = _run(job("resumed"), 2)["losses"]
    with CheckpointReader(find_checkpoint(tmp_path / "resumed" / "checkpoints")) as reader:
        assert reader.has("model/layers.0.mlp.up_proj.weight") and reader.has("model/embed_tokens.weight")
    again = _run(job("resumed"))
    assert again["resumed"] and first + again["losses"] == straight


@pytest.mark.parametrize("parallel", [{"tp": 2}, {"dp": 2, "zero": 3}], ids=["tp2", "dp2-zero3"])
def test_trainable_weights_export_as_peft_modules_to_save(pools, corpus_dir, tmp_path, parallel):
    """``lora.trainable`` (the final norm, every layer's input norm, the head) with
    ``checkpoint.export_peft`` at tp 2 and at dp 2 with ZeRO 3: the folder lists them as
    PEFT's modules_to_save (the final norm as ``model.norm``, so peft wraps that one norm
    and not the layers'), holds them whole (the head's two vocabulary shards joined, or its
    ZeRO 3 shards gathered), and peft loads it onto the base with the run's logits (fp32,
    1e-5); without the trained weights the logits move."""
    hf_dir = make_hf_model("llama", tmp_path / "hf")
    job = _job(corpus_dir, tmp_path / "tp2", hf_dir, **parallel)
    job["train"]["steps"] = 4
    job["lora"].update(targets=["q_proj", "v_proj"], trainable=["norm", "input_layernorm", "lm_head"])
    job["checkpoint"].update(export_peft="adapter")
    got = pools(2).run(_run, job)[0]
    base = transformers.LlamaForCausalLM.from_pretrained(str(hf_dir), attn_implementation="sdpa")
    n_layers = base.config.num_hidden_layers
    tuned = peft.PeftModel.from_pretrained(base, str(tmp_path / "tp2" / "adapter")).eval()
    assert tuned.peft_config["default"].modules_to_save == ["input_layernorm", "lm_head", "model.norm"]
    wrapped = sorted(n for n, m in tuned.named_modules() if type(m).__name__ == "ModulesToSaveWrapper")
    assert len(wrapped) == n_layers + 2 and not any("post_attention" in n for n in wrapped), wrapped
    with torch.no_grad():
        logits = tuned(input_ids=TOKENS).logits
    torch.testing.assert_close(logits, got["logits"], rtol=1e-5, atol=1e-5)
    saved = _hf_tensors(hf_dir)
    head = tuned.base_model.model.lm_head.modules_to_save["default"].weight
    assert head.shape == saved["lm_head.weight"].shape and (head - saved["lm_head.weight"]).abs().max() > 1e-4
    with tuned.disable_adapter(), torch.no_grad():  # the base's norms and head: other logits
        assert (tuned(input_ids=TOKENS).logits - logits).abs().max() > 1e-3
    # and back in: a run started from the folder (lora.adapter) holds its weights, in one process
    again = _job(corpus_dir, tmp_path / "again", hf_dir)
    again["lora"].update(targets=["q_proj", "v_proj"], trainable=["norm", "input_layernorm", "lm_head"],
                         adapter=str(tmp_path / "tp2" / "adapter"))
    trainer = Trainer(config_from_dict(again), Topology(1, 1, 1))
    with torch.no_grad():
        restarted = trainer.model(TOKENS)[..., :trainer.model_cfg.vocab_size]
    trainer.release()
    torch.testing.assert_close(restarted, logits, rtol=1e-5, atol=1e-5)
    again["lora"]["trainable"] = ["lm_head"]  # a folder whose modules_to_save are not lora.trainable's
    with pytest.raises(UserError, match=r"set lora.trainable=\['input_layernorm', 'lm_head', 'norm'\]"):
        Trainer(config_from_dict(again), Topology(1, 1, 1))


def test_export_peft_refuses_a_weight_that_is_both_target_and_trainable(corpus_dir, tmp_path):
    hf_dir = make_hf_model("llama", tmp_path / "hf")
    job = _job(corpus_dir, tmp_path / "run", hf_dir)
    job["lora"]["trainable"] = ["q_proj"]
    job["checkpoint"]["export_peft"] = "adapter"
    with pytest.raises(UserError, match="q_proj both in lora.targets and in lora.trainable"):
        Trainer(config_from_dict(job), Topology(1, 1, 1))


def test_export_peft_refuses_a_trained_tied_embedding(corpus_dir, tmp_path):
    job = tiny_job(corpus_dir, str(tmp_path / "run"), lora={"rank": 4, "alpha": 8.0, "targets": ["q_proj"],
                                                            "trainable": ["lm_head"]},
                   checkpoint={"export_peft": "adapter"})
    job["model"]["tie_embeddings"] = True
    with pytest.raises(UserError, match="trained tied embedding is not written"):
        Trainer(config_from_dict(job), Topology(1, 1, 1))
